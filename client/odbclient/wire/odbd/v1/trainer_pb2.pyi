from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerHello(_message.Message):
    __slots__ = ("protocol_version", "job_id", "rank", "resume", "resume_epoch", "resume_step", "prefetch", "world_size", "launcher_rank", "world_source", "resume_update")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RESUME_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RESUME_UPDATE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    job_id: str
    rank: int
    resume: bool
    resume_epoch: int
    resume_step: int
    prefetch: int
    world_size: int
    launcher_rank: int
    world_source: str
    resume_update: int
    def __init__(self, protocol_version: _Optional[int] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., resume: _Optional[bool] = ..., resume_epoch: _Optional[int] = ..., resume_step: _Optional[int] = ..., prefetch: _Optional[int] = ..., world_size: _Optional[int] = ..., launcher_rank: _Optional[int] = ..., world_source: _Optional[str] = ..., resume_update: _Optional[int] = ...) -> None: ...

class Delivered(_message.Message):
    __slots__ = ("epoch", "step", "wait_s", "compute_s", "steps", "measured")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    wait_s: float
    compute_s: float
    steps: int
    measured: _containers.RepeatedCompositeFieldContainer[StepTime]
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., wait_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., steps: _Optional[int] = ..., measured: _Optional[_Iterable[_Union[StepTime, _Mapping]]] = ...) -> None: ...

class StepTime(_message.Message):
    __slots__ = ("epoch", "step", "compute_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    compute_s: float
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., compute_s: _Optional[float] = ...) -> None: ...

class EndJob(_message.Message):
    __slots__ = ("epoch", "step")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class TrainerMessage(_message.Message):
    __slots__ = ("hello", "delivered", "end_job")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    END_JOB_FIELD_NUMBER: _ClassVar[int]
    hello: TrainerHello
    delivered: Delivered
    end_job: EndJob
    def __init__(self, hello: _Optional[_Union[TrainerHello, _Mapping]] = ..., delivered: _Optional[_Union[Delivered, _Mapping]] = ..., end_job: _Optional[_Union[EndJob, _Mapping]] = ...) -> None: ...

class PadValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: float
    def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class TrainerWelcome(_message.Message):
    __slots__ = ("job_id", "segments", "layout_version", "world_size", "length_key", "pads", "loss_scaling", "collate", "concat_keys", "labels_key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_KEY_FIELD_NUMBER: _ClassVar[int]
    PADS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALING_FIELD_NUMBER: _ClassVar[int]
    COLLATE_FIELD_NUMBER: _ClassVar[int]
    CONCAT_KEYS_FIELD_NUMBER: _ClassVar[int]
    LABELS_KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    segments: _containers.RepeatedScalarFieldContainer[str]
    layout_version: int
    world_size: int
    length_key: str
    pads: _containers.RepeatedCompositeFieldContainer[PadValue]
    loss_scaling: str
    collate: str
    concat_keys: _containers.RepeatedScalarFieldContainer[str]
    labels_key: str
    def __init__(self, job_id: _Optional[str] = ..., segments: _Optional[_Iterable[str]] = ..., layout_version: _Optional[int] = ..., world_size: _Optional[int] = ..., length_key: _Optional[str] = ..., pads: _Optional[_Iterable[_Union[PadValue, _Mapping]]] = ..., loss_scaling: _Optional[str] = ..., collate: _Optional[str] = ..., concat_keys: _Optional[_Iterable[str]] = ..., labels_key: _Optional[str] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("epoch", "step", "is_idle", "loss_scale", "num_samples", "num_tokens", "global_num_samples", "global_num_tokens", "sample_ids", "segments", "offsets", "nbytes", "filler_schema", "progress", "update")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    IS_IDLE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FILLER_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    is_idle: bool
    loss_scale: float
    num_samples: int
    num_tokens: int
    global_num_samples: int
    global_num_tokens: int
    sample_ids: bytes
    segments: bytes
    offsets: bytes
    nbytes: bytes
    filler_schema: str
    progress: Progress
    update: Update
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., is_idle: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., num_samples: _Optional[int] = ..., num_tokens: _Optional[int] = ..., global_num_samples: _Optional[int] = ..., global_num_tokens: _Optional[int] = ..., sample_ids: _Optional[bytes] = ..., segments: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., nbytes: _Optional[bytes] = ..., filler_schema: _Optional[str] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., update: _Optional[_Union[Update, _Mapping]] = ...) -> None: ...

class Update(_message.Message):
    __slots__ = ("index", "end", "num_steps", "step_in_update", "num_tokens", "num_samples", "short", "per_rank", "skip", "skipped_after")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_IN_UPDATE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SHORT_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_AFTER_FIELD_NUMBER: _ClassVar[int]
    index: int
    end: bool
    num_steps: int
    step_in_update: int
    num_tokens: int
    num_samples: int
    short: bool
    per_rank: bool
    skip: bool
    skipped_after: int
    def __init__(self, index: _Optional[int] = ..., end: _Optional[bool] = ..., num_steps: _Optional[int] = ..., step_in_update: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_samples: _Optional[int] = ..., short: _Optional[bool] = ..., per_rank: _Optional[bool] = ..., skip: _Optional[bool] = ..., skipped_after: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("epoch_steps_estimate", "epoch_steps_exact", "epoch_sample_fraction", "epoch_token_fraction", "epoch_tokens", "job_fraction", "job_steps_estimate")
    EPOCH_STEPS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_STEPS_EXACT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_SAMPLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_TOKEN_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    JOB_FRACTION_FIELD_NUMBER: _ClassVar[int]
    JOB_STEPS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    epoch_steps_estimate: int
    epoch_steps_exact: bool
    epoch_sample_fraction: float
    epoch_token_fraction: float
    epoch_tokens: int
    job_fraction: float
    job_steps_estimate: int
    def __init__(self, epoch_steps_estimate: _Optional[int] = ..., epoch_steps_exact: _Optional[bool] = ..., epoch_sample_fraction: _Optional[float] = ..., epoch_token_fraction: _Optional[float] = ..., epoch_tokens: _Optional[int] = ..., job_fraction: _Optional[float] = ..., job_steps_estimate: _Optional[int] = ...) -> None: ...

class EpochEnd(_message.Message):
    __slots__ = ("epoch", "num_steps", "global_num_samples", "rejected_by_reason", "num_identities")
    class RejectedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_steps: int
    global_num_samples: int
    rejected_by_reason: _containers.ScalarMap[str, int]
    num_identities: int
    def __init__(self, epoch: _Optional[int] = ..., num_steps: _Optional[int] = ..., global_num_samples: _Optional[int] = ..., rejected_by_reason: _Optional[_Mapping[str, int]] = ..., num_identities: _Optional[int] = ...) -> None: ...

class JobEnd(_message.Message):
    __slots__ = ("reason", "failed")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    reason: str
    failed: bool
    def __init__(self, reason: _Optional[str] = ..., failed: _Optional[bool] = ...) -> None: ...

class StepBatches(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepBatch]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepBatch, _Mapping]]] = ...) -> None: ...

class TrainerEvent(_message.Message):
    __slots__ = ("welcome", "step", "epoch_end", "job_end", "steps", "refusal")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_END_FIELD_NUMBER: _ClassVar[int]
    JOB_END_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    welcome: TrainerWelcome
    step: StepBatch
    epoch_end: EpochEnd
    job_end: JobEnd
    steps: StepBatches
    refusal: Refusal
    def __init__(self, welcome: _Optional[_Union[TrainerWelcome, _Mapping]] = ..., step: _Optional[_Union[StepBatch, _Mapping]] = ..., epoch_end: _Optional[_Union[EpochEnd, _Mapping]] = ..., job_end: _Optional[_Union[JobEnd, _Mapping]] = ..., steps: _Optional[_Union[StepBatches, _Mapping]] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
