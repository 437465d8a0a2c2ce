from odbclient.wire.odbd.v1 import trainer_pb2 as _trainer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProducerHello(_message.Message):
    __slots__ = ("protocol_version", "job_id", "name", "pid", "dataset_size")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DATASET_SIZE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    job_id: str
    name: str
    pid: int
    dataset_size: int
    def __init__(self, protocol_version: _Optional[int] = ..., job_id: _Optional[str] = ..., name: _Optional[str] = ..., pid: _Optional[int] = ..., dataset_size: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class CommitBatch(_message.Message):
    __slots__ = ("view_keys", "offsets", "nbytes", "lengths", "loss_tokens", "schema_hashes", "patches")
    VIEW_KEYS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_HASHES_FIELD_NUMBER: _ClassVar[int]
    PATCHES_FIELD_NUMBER: _ClassVar[int]
    view_keys: bytes
    offsets: bytes
    nbytes: bytes
    lengths: bytes
    loss_tokens: bytes
    schema_hashes: bytes
    patches: bytes
    def __init__(self, view_keys: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., nbytes: _Optional[bytes] = ..., lengths: _Optional[bytes] = ..., loss_tokens: _Optional[bytes] = ..., schema_hashes: _Optional[bytes] = ..., patches: _Optional[bytes] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("view_key", "reason", "detail")
    VIEW_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    view_key: int
    reason: str
    detail: str
    def __init__(self, view_key: _Optional[int] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class RejectBatch(_message.Message):
    __slots__ = ("rejections",)
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    rejections: _containers.RepeatedCompositeFieldContainer[Rejection]
    def __init__(self, rejections: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ...) -> None: ...

class LaneFull(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class ProducerMessage(_message.Message):
    __slots__ = ("hello", "lease", "commit", "reject", "lane_full")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    LANE_FULL_FIELD_NUMBER: _ClassVar[int]
    hello: ProducerHello
    lease: LeaseRequest
    commit: CommitBatch
    reject: RejectBatch
    lane_full: LaneFull
    def __init__(self, hello: _Optional[_Union[ProducerHello, _Mapping]] = ..., lease: _Optional[_Union[LeaseRequest, _Mapping]] = ..., commit: _Optional[_Union[CommitBatch, _Mapping]] = ..., reject: _Optional[_Union[RejectBatch, _Mapping]] = ..., lane_full: _Optional[_Union[LaneFull, _Mapping]] = ...) -> None: ...

class Lane(_message.Message):
    __slots__ = ("segment", "offset", "size")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    segment: int
    offset: int
    size: int
    def __init__(self, segment: _Optional[int] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class IngestWelcome(_message.Message):
    __slots__ = ("job_id", "segments", "layout_version", "length_key", "labels_key", "lane", "lease_timeout_s", "dataset_size", "patch_key", "patch_count_key", "concat_keys", "packed", "check_finite")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LENGTH_KEY_FIELD_NUMBER: _ClassVar[int]
    LABELS_KEY_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DATASET_SIZE_FIELD_NUMBER: _ClassVar[int]
    PATCH_KEY_FIELD_NUMBER: _ClassVar[int]
    PATCH_COUNT_KEY_FIELD_NUMBER: _ClassVar[int]
    CONCAT_KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    CHECK_FINITE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    segments: _containers.RepeatedScalarFieldContainer[str]
    layout_version: int
    length_key: str
    labels_key: str
    lane: Lane
    lease_timeout_s: float
    dataset_size: int
    patch_key: str
    patch_count_key: str
    concat_keys: _containers.RepeatedScalarFieldContainer[str]
    packed: bool
    check_finite: bool
    def __init__(self, job_id: _Optional[str] = ..., segments: _Optional[_Iterable[str]] = ..., layout_version: _Optional[int] = ..., length_key: _Optional[str] = ..., labels_key: _Optional[str] = ..., lane: _Optional[_Union[Lane, _Mapping]] = ..., lease_timeout_s: _Optional[float] = ..., dataset_size: _Optional[int] = ..., patch_key: _Optional[str] = ..., patch_count_key: _Optional[str] = ..., concat_keys: _Optional[_Iterable[str]] = ..., packed: _Optional[bool] = ..., check_finite: _Optional[bool] = ...) -> None: ...

class LeaseGrant(_message.Message):
    __slots__ = ("view_keys", "identities")
    VIEW_KEYS_FIELD_NUMBER: _ClassVar[int]
    IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    view_keys: bytes
    identities: bytes
    def __init__(self, view_keys: _Optional[bytes] = ..., identities: _Optional[bytes] = ...) -> None: ...

class FreeBatch(_message.Message):
    __slots__ = ("offsets",)
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    offsets: bytes
    def __init__(self, offsets: _Optional[bytes] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class IngestMessage(_message.Message):
    __slots__ = ("welcome", "lease", "free", "shutdown", "refusal")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    welcome: IngestWelcome
    lease: LeaseGrant
    free: FreeBatch
    shutdown: Shutdown
    refusal: _trainer_pb2.Refusal
    def __init__(self, welcome: _Optional[_Union[IngestWelcome, _Mapping]] = ..., lease: _Optional[_Union[LeaseGrant, _Mapping]] = ..., free: _Optional[_Union[FreeBatch, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., refusal: _Optional[_Union[_trainer_pb2.Refusal, _Mapping]] = ...) -> None: ...
