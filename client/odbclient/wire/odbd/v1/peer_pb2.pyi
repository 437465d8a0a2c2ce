from odbclient.wire.odbd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AbortKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ABORT_KIND_UNSPECIFIED: _ClassVar[AbortKind]
    ABORT_KIND_ROUND_TIMEOUT: _ClassVar[AbortKind]
    ABORT_KIND_PEER_LOST: _ClassVar[AbortKind]
    ABORT_KIND_JOIN_TIMEOUT: _ClassVar[AbortKind]
    ABORT_KIND_REFUSED: _ClassVar[AbortKind]
    ABORT_KIND_JOB_FAILED: _ClassVar[AbortKind]
ABORT_KIND_UNSPECIFIED: AbortKind
ABORT_KIND_ROUND_TIMEOUT: AbortKind
ABORT_KIND_PEER_LOST: AbortKind
ABORT_KIND_JOIN_TIMEOUT: AbortKind
ABORT_KIND_REFUSED: AbortKind
ABORT_KIND_JOB_FAILED: AbortKind

class Hello(_message.Message):
    __slots__ = ("protocol_version", "job_id", "node_rank", "fingerprint", "listen_address", "nonce")
    class FingerprintEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LISTEN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    job_id: str
    node_rank: int
    fingerprint: _containers.ScalarMap[str, str]
    listen_address: str
    nonce: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., job_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., fingerprint: _Optional[_Mapping[str, str]] = ..., listen_address: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class Challenge(_message.Message):
    __slots__ = ("nonce", "hub_proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    HUB_PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    hub_proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., hub_proof: _Optional[bytes] = ...) -> None: ...

class Proof(_message.Message):
    __slots__ = ("spoke_proof",)
    SPOKE_PROOF_FIELD_NUMBER: _ClassVar[int]
    spoke_proof: bytes
    def __init__(self, spoke_proof: _Optional[bytes] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("protocol_version", "num_nodes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    num_nodes: int
    def __init__(self, protocol_version: _Optional[int] = ..., num_nodes: _Optional[int] = ...) -> None: ...

class Contribution(_message.Message):
    __slots__ = ("round", "node_rank", "payload", "subtree_payloads")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SUBTREE_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    round: int
    node_rank: int
    payload: bytes
    subtree_payloads: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, round: _Optional[int] = ..., node_rank: _Optional[int] = ..., payload: _Optional[bytes] = ..., subtree_payloads: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RoundResult(_message.Message):
    __slots__ = ("round", "payloads", "last_node_rank", "recipient_payload_omitted")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    LAST_NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_PAYLOAD_OMITTED_FIELD_NUMBER: _ClassVar[int]
    round: int
    payloads: _containers.RepeatedScalarFieldContainer[bytes]
    last_node_rank: int
    recipient_payload_omitted: bool
    def __init__(self, round: _Optional[int] = ..., payloads: _Optional[_Iterable[bytes]] = ..., last_node_rank: _Optional[int] = ..., recipient_payload_omitted: _Optional[bool] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("kind", "round", "reason", "missing")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    kind: AbortKind
    round: int
    reason: str
    missing: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeRef]
    def __init__(self, kind: _Optional[_Union[AbortKind, str]] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ..., missing: _Optional[_Iterable[_Union[_common_pb2.NodeRef, _Mapping]]] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Waiting(_message.Message):
    __slots__ = ("round", "reason", "node_rank")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    round: int
    reason: str
    node_rank: int
    def __init__(self, round: _Optional[int] = ..., reason: _Optional[str] = ..., node_rank: _Optional[int] = ...) -> None: ...

class PeerMessage(_message.Message):
    __slots__ = ("hello", "contribution", "leave", "waiting", "proof", "abort")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    contribution: Contribution
    leave: Leave
    waiting: Waiting
    proof: Proof
    abort: Abort
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., contribution: _Optional[_Union[Contribution, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ..., waiting: _Optional[_Union[Waiting, _Mapping]] = ..., proof: _Optional[_Union[Proof, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ...) -> None: ...

class HubMessage(_message.Message):
    __slots__ = ("welcome", "result", "abort", "challenge")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    result: RoundResult
    abort: Abort
    challenge: Challenge
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., result: _Optional[_Union[RoundResult, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., challenge: _Optional[_Union[Challenge, _Mapping]] = ...) -> None: ...
