from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "attached", "queued_steps", "delivered_steps", "wait_s", "compute_s", "delivered_samples", "delivered_loss_tokens", "delivered_real_tokens", "delivered_padded_tokens", "trained_epoch", "trained_epoch_steps", "epochs_trained")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_STEPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRAINED_EPOCH_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    attached: bool
    queued_steps: int
    delivered_steps: int
    wait_s: float
    compute_s: float
    delivered_samples: int
    delivered_loss_tokens: int
    delivered_real_tokens: int
    delivered_padded_tokens: int
    trained_epoch: int
    trained_epoch_steps: int
    epochs_trained: int
    def __init__(self, rank: _Optional[int] = ..., attached: _Optional[bool] = ..., queued_steps: _Optional[int] = ..., delivered_steps: _Optional[int] = ..., wait_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., delivered_samples: _Optional[int] = ..., delivered_loss_tokens: _Optional[int] = ..., delivered_real_tokens: _Optional[int] = ..., delivered_padded_tokens: _Optional[int] = ..., trained_epoch: _Optional[int] = ..., trained_epoch_steps: _Optional[int] = ..., epochs_trained: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("job_id", "node_rank", "num_nodes", "epoch", "round", "dataset_size", "epoch_emitted_samples", "buffered_samples", "leased_samples", "producers", "shm_used_bytes", "shm_capacity_bytes", "ranks", "rejected_by_reason", "uptime_s", "phase", "last_error", "producers_lane_full", "waiting_for", "cost_model", "ending", "planned_epoch", "planned_epoch_steps", "planned_epoch_steps_exact", "planned_epoch_steps_so_far", "planned_steps", "trained_epoch", "trained_epoch_steps", "trained_epoch_samples", "trained_epoch_planned_steps", "epochs_trained", "trained_samples_per_s", "trained_tokens_per_s", "rate_window_s", "migrate", "migrated_out_samples", "migrated_out_bytes", "migrated_in_samples", "migrated_in_bytes", "migration_rounds_none", "migration_rounds_balanced", "migration_rounds_dealt")
    class RejectedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DATASET_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_EMITTED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LEASED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PRODUCERS_FIELD_NUMBER: _ClassVar[int]
    SHM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    PRODUCERS_LANE_FULL_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    COST_MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDING_FIELD_NUMBER: _ClassVar[int]
    PLANNED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLANNED_EPOCH_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_EPOCH_STEPS_EXACT_FIELD_NUMBER: _ClassVar[int]
    PLANNED_EPOCH_STEPS_SO_FAR_FIELD_NUMBER: _ClassVar[int]
    PLANNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRAINED_EPOCH_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_EPOCH_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_EPOCH_PLANNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RATE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_OUT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_IN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ROUNDS_NONE_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ROUNDS_BALANCED_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ROUNDS_DEALT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_rank: int
    num_nodes: int
    epoch: int
    round: int
    dataset_size: int
    epoch_emitted_samples: int
    buffered_samples: int
    leased_samples: int
    producers: int
    shm_used_bytes: int
    shm_capacity_bytes: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    rejected_by_reason: _containers.ScalarMap[str, int]
    uptime_s: float
    phase: str
    last_error: str
    producers_lane_full: int
    waiting_for: str
    cost_model: CostModelStatus
    ending: str
    planned_epoch: int
    planned_epoch_steps: int
    planned_epoch_steps_exact: bool
    planned_epoch_steps_so_far: int
    planned_steps: int
    trained_epoch: int
    trained_epoch_steps: int
    trained_epoch_samples: int
    trained_epoch_planned_steps: int
    epochs_trained: int
    trained_samples_per_s: float
    trained_tokens_per_s: float
    rate_window_s: float
    migrate: bool
    migrated_out_samples: int
    migrated_out_bytes: int
    migrated_in_samples: int
    migrated_in_bytes: int
    migration_rounds_none: int
    migration_rounds_balanced: int
    migration_rounds_dealt: int
    def __init__(self, job_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., num_nodes: _Optional[int] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., dataset_size: _Optional[int] = ..., epoch_emitted_samples: _Optional[int] = ..., buffered_samples: _Optional[int] = ..., leased_samples: _Optional[int] = ..., producers: _Optional[int] = ..., shm_used_bytes: _Optional[int] = ..., shm_capacity_bytes: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., rejected_by_reason: _Optional[_Mapping[str, int]] = ..., uptime_s: _Optional[float] = ..., phase: _Optional[str] = ..., last_error: _Optional[str] = ..., producers_lane_full: _Optional[int] = ..., waiting_for: _Optional[str] = ..., cost_model: _Optional[_Union[CostModelStatus, _Mapping]] = ..., ending: _Optional[str] = ..., planned_epoch: _Optional[int] = ..., planned_epoch_steps: _Optional[int] = ..., planned_epoch_steps_exact: _Optional[bool] = ..., planned_epoch_steps_so_far: _Optional[int] = ..., planned_steps: _Optional[int] = ..., trained_epoch: _Optional[int] = ..., trained_epoch_steps: _Optional[int] = ..., trained_epoch_samples: _Optional[int] = ..., trained_epoch_planned_steps: _Optional[int] = ..., epochs_trained: _Optional[int] = ..., trained_samples_per_s: _Optional[float] = ..., trained_tokens_per_s: _Optional[float] = ..., rate_window_s: _Optional[float] = ..., migrate: _Optional[bool] = ..., migrated_out_samples: _Optional[int] = ..., migrated_out_bytes: _Optional[int] = ..., migrated_in_samples: _Optional[int] = ..., migrated_in_bytes: _Optional[int] = ..., migration_rounds_none: _Optional[int] = ..., migration_rounds_balanced: _Optional[int] = ..., migration_rounds_dealt: _Optional[int] = ...) -> None: ...

class CostModelStatus(_message.Message):
    __slots__ = ("mode", "state", "learned", "a", "b", "c", "a_seconds", "b_seconds", "c_seconds", "fit_error", "fixed_error", "observations")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEARNED_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    C_FIELD_NUMBER: _ClassVar[int]
    A_SECONDS_FIELD_NUMBER: _ClassVar[int]
    B_SECONDS_FIELD_NUMBER: _ClassVar[int]
    C_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIT_ERROR_FIELD_NUMBER: _ClassVar[int]
    FIXED_ERROR_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    state: str
    learned: bool
    a: float
    b: float
    c: float
    a_seconds: float
    b_seconds: float
    c_seconds: float
    fit_error: float
    fixed_error: float
    observations: int
    def __init__(self, mode: _Optional[str] = ..., state: _Optional[str] = ..., learned: _Optional[bool] = ..., a: _Optional[float] = ..., b: _Optional[float] = ..., c: _Optional[float] = ..., a_seconds: _Optional[float] = ..., b_seconds: _Optional[float] = ..., c_seconds: _Optional[float] = ..., fit_error: _Optional[float] = ..., fixed_error: _Optional[float] = ..., observations: _Optional[int] = ...) -> None: ...
