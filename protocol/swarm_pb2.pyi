from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MomentumPrecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MOMENTUM_FP32: _ClassVar[MomentumPrecision]
    MOMENTUM_BF16: _ClassVar[MomentumPrecision]
MOMENTUM_FP32: MomentumPrecision
MOMENTUM_BF16: MomentumPrecision

class FragmentStatus(_message.Message):
    __slots__ = ("fragment", "version", "phi_hash", "phi_norm", "last_send", "digest")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHI_HASH_FIELD_NUMBER: _ClassVar[int]
    PHI_NORM_FIELD_NUMBER: _ClassVar[int]
    LAST_SEND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    phi_hash: int
    phi_norm: float
    last_send: int
    digest: bytes
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., phi_hash: _Optional[int] = ..., phi_norm: _Optional[float] = ..., last_send: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("peer_id", "addrs", "fingerprint", "clock", "inner_step", "tokens", "tokens_per_s", "loss", "fragments", "time", "leaving", "has_state", "control_port", "shared_r", "certificate", "reachability")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PORT_FIELD_NUMBER: _ClassVar[int]
    SHARED_R_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    addrs: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    clock: int
    inner_step: int
    tokens: int
    tokens_per_s: float
    loss: float
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    time: float
    leaving: bool
    has_state: bool
    control_port: int
    shared_r: _containers.RepeatedScalarFieldContainer[float]
    certificate: bytes
    reachability: str
    def __init__(self, peer_id: _Optional[str] = ..., addrs: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ..., clock: _Optional[int] = ..., inner_step: _Optional[int] = ..., tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., loss: _Optional[float] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., time: _Optional[float] = ..., leaving: _Optional[bool] = ..., has_state: _Optional[bool] = ..., control_port: _Optional[int] = ..., shared_r: _Optional[_Iterable[float]] = ..., certificate: _Optional[bytes] = ..., reachability: _Optional[str] = ...) -> None: ...

class MatchEntry(_message.Message):
    __slots__ = ("peer_id", "arrival", "weight", "version", "digest", "fragment", "scheduled", "last_send", "shared_r", "excluded", "basis", "expected", "window", "certificate", "doubted", "outbound_only", "undialable")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEND_FIELD_NUMBER: _ClassVar[int]
    SHARED_R_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    DOUBTED_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    UNDIALABLE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    arrival: float
    weight: float
    version: int
    digest: bytes
    fragment: int
    scheduled: bool
    last_send: _containers.RepeatedScalarFieldContainer[int]
    shared_r: _containers.RepeatedScalarFieldContainer[float]
    excluded: _containers.RepeatedScalarFieldContainer[str]
    basis: bytes
    expected: _containers.RepeatedScalarFieldContainer[int]
    window: float
    certificate: bytes
    doubted: _containers.RepeatedScalarFieldContainer[str]
    outbound_only: bool
    undialable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, peer_id: _Optional[str] = ..., arrival: _Optional[float] = ..., weight: _Optional[float] = ..., version: _Optional[int] = ..., digest: _Optional[bytes] = ..., fragment: _Optional[int] = ..., scheduled: _Optional[bool] = ..., last_send: _Optional[_Iterable[int]] = ..., shared_r: _Optional[_Iterable[float]] = ..., excluded: _Optional[_Iterable[str]] = ..., basis: _Optional[bytes] = ..., expected: _Optional[_Iterable[int]] = ..., window: _Optional[float] = ..., certificate: _Optional[bytes] = ..., doubted: _Optional[_Iterable[str]] = ..., outbound_only: _Optional[bool] = ..., undialable: _Optional[_Iterable[str]] = ...) -> None: ...

class AverageHeader(_message.Message):
    __slots__ = ("fingerprint", "fragment", "round", "group_hash", "sender", "weight", "version", "extras", "n_chunks", "codec", "basis", "lineage")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUP_HASH_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    N_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    fragment: int
    round: int
    group_hash: bytes
    sender: str
    weight: float
    version: int
    extras: _containers.RepeatedScalarFieldContainer[float]
    n_chunks: int
    codec: str
    basis: bytes
    lineage: int
    def __init__(self, fingerprint: _Optional[str] = ..., fragment: _Optional[int] = ..., round: _Optional[int] = ..., group_hash: _Optional[bytes] = ..., sender: _Optional[str] = ..., weight: _Optional[float] = ..., version: _Optional[int] = ..., extras: _Optional[_Iterable[float]] = ..., n_chunks: _Optional[int] = ..., codec: _Optional[str] = ..., basis: _Optional[bytes] = ..., lineage: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class AverageRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: AverageHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[AverageHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class ReduceHeader(_message.Message):
    __slots__ = ("ok", "error", "total_weight", "extras", "n_chunks", "lineage", "version", "missing")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    N_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    total_weight: float
    extras: _containers.RepeatedScalarFieldContainer[float]
    n_chunks: int
    lineage: int
    version: int
    missing: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., total_weight: _Optional[float] = ..., extras: _Optional[_Iterable[float]] = ..., n_chunks: _Optional[int] = ..., lineage: _Optional[int] = ..., version: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...

class AverageReply(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ReduceHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[ReduceHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("fingerprint", "fragment", "offset", "min_version", "heartbeat", "momentum_precision", "spread", "replay")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_PRECISION_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    fragment: int
    offset: int
    min_version: int
    heartbeat: Heartbeat
    momentum_precision: MomentumPrecision
    spread: bool
    replay: bool
    def __init__(self, fingerprint: _Optional[str] = ..., fragment: _Optional[int] = ..., offset: _Optional[int] = ..., min_version: _Optional[int] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., momentum_precision: _Optional[_Union[MomentumPrecision, str]] = ..., spread: _Optional[bool] = ..., replay: _Optional[bool] = ...) -> None: ...

class ReplayStep(_message.Message):
    __slots__ = ("version", "codec", "numel", "index", "count", "data", "before", "after")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    version: int
    codec: str
    numel: int
    index: int
    count: int
    data: bytes
    before: bytes
    after: bytes
    def __init__(self, version: _Optional[int] = ..., codec: _Optional[str] = ..., numel: _Optional[int] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., data: _Optional[bytes] = ..., before: _Optional[bytes] = ..., after: _Optional[bytes] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("error", "fragment", "version", "numel", "offset", "phi", "momentum", "clock", "inner_step", "momentum_precision", "step")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PHI_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_PRECISION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    error: str
    fragment: int
    version: int
    numel: int
    offset: int
    phi: bytes
    momentum: bytes
    clock: int
    inner_step: int
    momentum_precision: MomentumPrecision
    step: ReplayStep
    def __init__(self, error: _Optional[str] = ..., fragment: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., offset: _Optional[int] = ..., phi: _Optional[bytes] = ..., momentum: _Optional[bytes] = ..., clock: _Optional[int] = ..., inner_step: _Optional[int] = ..., momentum_precision: _Optional[_Union[MomentumPrecision, str]] = ..., step: _Optional[_Union[ReplayStep, _Mapping]] = ...) -> None: ...

class ReachRequest(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class ReachReply(_message.Message):
    __slots__ = ("reachable", "observed", "error")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    observed: str
    error: str
    def __init__(self, reachable: _Optional[bool] = ..., observed: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
