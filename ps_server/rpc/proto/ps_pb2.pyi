# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PushMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_MODE_UNSPECIFIED: _ClassVar[PushMode]
    PUSH_MODE_APPLY: _ClassVar[PushMode]
    PUSH_MODE_SYNC: _ClassVar[PushMode]
    PUSH_MODE_DELTA: _ClassVar[PushMode]
PUSH_MODE_UNSPECIFIED: PushMode
PUSH_MODE_APPLY: PushMode
PUSH_MODE_SYNC: PushMode
PUSH_MODE_DELTA: PushMode

class CreateTableRequest(_message.Message):
    __slots__ = ("config_json",)
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    def __init__(self, config_json: _Optional[str] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("config_json",)
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    config_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, config_json: _Optional[_Iterable[str]] = ...) -> None: ...

class PullSparseRequest(_message.Message):
    __slots__ = ("table", "keys", "shm_segment", "shm_num_keys", "with_state")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SHM_NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    WITH_STATE_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    shm_segment: str
    shm_num_keys: int
    with_state: bool
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., shm_segment: _Optional[str] = ..., shm_num_keys: _Optional[int] = ..., with_state: _Optional[bool] = ...) -> None: ...

class PullSparseResponse(_message.Message):
    __slots__ = ("values", "dim", "state", "state_dim")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_DIM_FIELD_NUMBER: _ClassVar[int]
    values: bytes
    dim: int
    state: bytes
    state_dim: int
    def __init__(self, values: _Optional[bytes] = ..., dim: _Optional[int] = ..., state: _Optional[bytes] = ..., state_dim: _Optional[int] = ...) -> None: ...

class PushSparseRequest(_message.Message):
    __slots__ = ("table", "keys", "grads", "mode", "sync_count", "more_parts", "shm_segment", "shm_num_keys", "shows", "state_deltas", "with_state")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SYNC_COUNT_FIELD_NUMBER: _ClassVar[int]
    MORE_PARTS_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SHM_NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    SHOWS_FIELD_NUMBER: _ClassVar[int]
    STATE_DELTAS_FIELD_NUMBER: _ClassVar[int]
    WITH_STATE_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: bytes
    grads: bytes
    mode: PushMode
    sync_count: int
    more_parts: bool
    shm_segment: str
    shm_num_keys: int
    shows: bytes
    state_deltas: bytes
    with_state: bool
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[bytes] = ..., grads: _Optional[bytes] = ..., mode: _Optional[_Union[PushMode, str]] = ..., sync_count: _Optional[int] = ..., more_parts: _Optional[bool] = ..., shm_segment: _Optional[str] = ..., shm_num_keys: _Optional[int] = ..., shows: _Optional[bytes] = ..., state_deltas: _Optional[bytes] = ..., with_state: _Optional[bool] = ...) -> None: ...

class PushSparseResponse(_message.Message):
    __slots__ = ("num_keys", "applied", "created", "filtered", "skipped_nonfinite", "evicted", "sync_arrived")
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SYNC_ARRIVED_FIELD_NUMBER: _ClassVar[int]
    num_keys: int
    applied: int
    created: int
    filtered: int
    skipped_nonfinite: int
    evicted: int
    sync_arrived: int
    def __init__(self, num_keys: _Optional[int] = ..., applied: _Optional[int] = ..., created: _Optional[int] = ..., filtered: _Optional[int] = ..., skipped_nonfinite: _Optional[int] = ..., evicted: _Optional[int] = ..., sync_arrived: _Optional[int] = ...) -> None: ...

class DenseUpload(_message.Message):
    __slots__ = ("upload_id", "offset", "total", "more_parts")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    MORE_PARTS_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    offset: int
    total: int
    more_parts: bool
    def __init__(self, upload_id: _Optional[str] = ..., offset: _Optional[int] = ..., total: _Optional[int] = ..., more_parts: _Optional[bool] = ...) -> None: ...

class InitDenseRequest(_message.Message):
    __slots__ = ("table", "name", "values", "upload")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    table: str
    name: str
    values: bytes
    upload: DenseUpload
    def __init__(self, table: _Optional[str] = ..., name: _Optional[str] = ..., values: _Optional[bytes] = ..., upload: _Optional[_Union[DenseUpload, _Mapping]] = ...) -> None: ...

class InitDenseResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class PullDenseRequest(_message.Message):
    __slots__ = ("table", "name", "offset", "count")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    table: str
    name: str
    offset: int
    count: int
    def __init__(self, table: _Optional[str] = ..., name: _Optional[str] = ..., offset: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class PullDenseResponse(_message.Message):
    __slots__ = ("values", "total")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    values: bytes
    total: int
    def __init__(self, values: _Optional[bytes] = ..., total: _Optional[int] = ...) -> None: ...

class PushDenseRequest(_message.Message):
    __slots__ = ("table", "name", "grad", "mode", "sync_count", "upload", "return_values")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SYNC_COUNT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    RETURN_VALUES_FIELD_NUMBER: _ClassVar[int]
    table: str
    name: str
    grad: bytes
    mode: PushMode
    sync_count: int
    upload: DenseUpload
    return_values: bool
    def __init__(self, table: _Optional[str] = ..., name: _Optional[str] = ..., grad: _Optional[bytes] = ..., mode: _Optional[_Union[PushMode, str]] = ..., sync_count: _Optional[int] = ..., upload: _Optional[_Union[DenseUpload, _Mapping]] = ..., return_values: _Optional[bool] = ...) -> None: ...

class PushDenseResponse(_message.Message):
    __slots__ = ("applied", "sync_arrived", "values", "has_values")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    SYNC_ARRIVED_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    HAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    sync_arrived: int
    values: bytes
    has_values: bool
    def __init__(self, applied: _Optional[bool] = ..., sync_arrived: _Optional[int] = ..., values: _Optional[bytes] = ..., has_values: _Optional[bool] = ...) -> None: ...

class PushStepRequest(_message.Message):
    __slots__ = ("sparse", "dense")
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    sparse: _containers.RepeatedCompositeFieldContainer[PushSparseRequest]
    dense: PushDenseRequest
    def __init__(self, sparse: _Optional[_Iterable[_Union[PushSparseRequest, _Mapping]]] = ..., dense: _Optional[_Union[PushDenseRequest, _Mapping]] = ...) -> None: ...

class PushStepResponse(_message.Message):
    __slots__ = ("sparse", "dense")
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    sparse: _containers.RepeatedCompositeFieldContainer[PushSparseResponse]
    dense: PushDenseResponse
    def __init__(self, sparse: _Optional[_Iterable[_Union[PushSparseResponse, _Mapping]]] = ..., dense: _Optional[_Union[PushDenseResponse, _Mapping]] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("dir", "mode")
    DIR_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    dir: str
    mode: str
    def __init__(self, dir: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("manifest_json",)
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    def __init__(self, manifest_json: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("dir",)
    DIR_FIELD_NUMBER: _ClassVar[int]
    dir: str
    def __init__(self, dir: _Optional[str] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("rows", "created_tables")
    class RowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CREATED_TABLES_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.ScalarMap[str, int]
    created_tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rows: _Optional[_Mapping[str, int]] = ..., created_tables: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckpointBeginRequest(_message.Message):
    __slots__ = ("root", "name", "kind", "mode", "min_show")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MIN_SHOW_FIELD_NUMBER: _ClassVar[int]
    root: str
    name: str
    kind: str
    mode: str
    min_show: int
    def __init__(self, root: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[str] = ..., mode: _Optional[str] = ..., min_show: _Optional[int] = ...) -> None: ...

class CheckpointBeginResponse(_message.Message):
    __slots__ = ("snapshot_s", "snapshot_bytes", "previous_export")
    SNAPSHOT_S_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_EXPORT_FIELD_NUMBER: _ClassVar[int]
    snapshot_s: float
    snapshot_bytes: int
    previous_export: str
    def __init__(self, snapshot_s: _Optional[float] = ..., snapshot_bytes: _Optional[int] = ..., previous_export: _Optional[str] = ...) -> None: ...

class CheckpointWaitRequest(_message.Message):
    __slots__ = ("root", "name", "timeout_s")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    root: str
    name: str
    timeout_s: float
    def __init__(self, root: _Optional[str] = ..., name: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CheckpointWaitResponse(_message.Message):
    __slots__ = ("manifest_json", "write_s")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    WRITE_S_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    write_s: float
    def __init__(self, manifest_json: _Optional[str] = ..., write_s: _Optional[float] = ...) -> None: ...

class CheckpointCommitRequest(_message.Message):
    __slots__ = ("root", "name", "step", "num_servers", "trainer_states_json", "extra_json", "keep")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STATES_JSON_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    root: str
    name: str
    step: int
    num_servers: int
    trainer_states_json: str
    extra_json: str
    keep: int
    def __init__(self, root: _Optional[str] = ..., name: _Optional[str] = ..., step: _Optional[int] = ..., num_servers: _Optional[int] = ..., trainer_states_json: _Optional[str] = ..., extra_json: _Optional[str] = ..., keep: _Optional[int] = ...) -> None: ...

class CheckpointCommitResponse(_message.Message):
    __slots__ = ("record_json", "deleted")
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    record_json: str
    deleted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, record_json: _Optional[str] = ..., deleted: _Optional[_Iterable[str]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("root", "full")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    root: str
    full: bool
    def __init__(self, root: _Optional[str] = ..., full: _Optional[bool] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints_json",)
    CHECKPOINTS_JSON_FIELD_NUMBER: _ClassVar[int]
    checkpoints_json: str
    def __init__(self, checkpoints_json: _Optional[str] = ...) -> None: ...

class ShrinkRequest(_message.Message):
    __slots__ = ("table", "unseen_days")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    UNSEEN_DAYS_FIELD_NUMBER: _ClassVar[int]
    table: str
    unseen_days: int
    def __init__(self, table: _Optional[str] = ..., unseen_days: _Optional[int] = ...) -> None: ...

class ShrinkResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class EndDayRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndDayResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("name", "count", "timeout_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    timeout_s: float
    def __init__(self, name: _Optional[str] = ..., count: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class ShmAttachRequest(_message.Message):
    __slots__ = ("segment", "token")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    segment: str
    token: bytes
    def __init__(self, segment: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class ShmAttachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShmDetachRequest(_message.Message):
    __slots__ = ("segment",)
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    segment: str
    def __init__(self, segment: _Optional[str] = ...) -> None: ...

class ShmDetachResponse(_message.Message):
    __slots__ = ("detached",)
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    detached: bool
    def __init__(self, detached: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("stats_json",)
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    stats_json: str
    def __init__(self, stats_json: _Optional[str] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
