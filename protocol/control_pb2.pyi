from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class EvalPoint(_message.Message):
    __slots__ = ("clock", "loss")
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    clock: int
    loss: float
    def __init__(self, clock: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class LossSample(_message.Message):
    __slots__ = ("time", "inner_step", "loss")
    TIME_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    time: float
    inner_step: int
    loss: float
    def __init__(self, time: _Optional[float] = ..., inner_step: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class Spread(_message.Message):
    __slots__ = ("version", "holders", "distinct_hashes", "norm_spread", "max_version", "max_lag")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    DISTINCT_HASHES_FIELD_NUMBER: _ClassVar[int]
    NORM_SPREAD_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    version: int
    holders: int
    distinct_hashes: int
    norm_spread: float
    max_version: int
    max_lag: int
    def __init__(self, version: _Optional[int] = ..., holders: _Optional[int] = ..., distinct_hashes: _Optional[int] = ..., norm_spread: _Optional[float] = ..., max_version: _Optional[int] = ..., max_lag: _Optional[int] = ...) -> None: ...

class Fragment(_message.Message):
    __slots__ = ("fragment", "version", "numel", "last_send", "quant_error", "phi_hash", "bytes_sent", "bytes_received", "group_size", "last_merge_time", "last_merge_clock", "spread", "phi_norm", "ranks")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    LAST_SEND_FIELD_NUMBER: _ClassVar[int]
    QUANT_ERROR_FIELD_NUMBER: _ClassVar[int]
    PHI_HASH_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_MERGE_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_MERGE_CLOCK_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    PHI_NORM_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    numel: int
    last_send: int
    quant_error: float
    phi_hash: int
    bytes_sent: int
    bytes_received: int
    group_size: int
    last_merge_time: float
    last_merge_clock: int
    spread: Spread
    phi_norm: float
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., last_send: _Optional[int] = ..., quant_error: _Optional[float] = ..., phi_hash: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., group_size: _Optional[int] = ..., last_merge_time: _Optional[float] = ..., last_merge_clock: _Optional[int] = ..., spread: _Optional[_Union[Spread, _Mapping]] = ..., phi_norm: _Optional[float] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerFragment(_message.Message):
    __slots__ = ("fragment", "version")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("peer_id", "clock", "inner_step", "tokens_per_s", "time", "loss", "tokens", "control_port", "has_state", "fragments", "bytes_sent", "bytes_received", "refused", "banned", "reachability")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PORT_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    clock: int
    inner_step: int
    tokens_per_s: float
    time: float
    loss: float
    tokens: int
    control_port: int
    has_state: bool
    fragments: _containers.RepeatedCompositeFieldContainer[PeerFragment]
    bytes_sent: int
    bytes_received: int
    refused: int
    banned: bool
    reachability: str
    def __init__(self, peer_id: _Optional[str] = ..., clock: _Optional[int] = ..., inner_step: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., time: _Optional[float] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., control_port: _Optional[int] = ..., has_state: _Optional[bool] = ..., fragments: _Optional[_Iterable[_Union[PeerFragment, _Mapping]]] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., refused: _Optional[int] = ..., banned: _Optional[bool] = ..., reachability: _Optional[str] = ...) -> None: ...

class PeerList(_message.Message):
    __slots__ = ("peers", "now")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    now: float
    def __init__(self, peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., now: _Optional[float] = ...) -> None: ...

class Bytes(_message.Message):
    __slots__ = ("sent", "received", "sent_per_s", "received_per_s", "sent_by_peer", "received_by_peer", "sent_by_fragment", "received_by_fragment")
    class SentByPeerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ReceivedByPeerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SentByFragmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class ReceivedByFragmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SENT_PER_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_PER_S_FIELD_NUMBER: _ClassVar[int]
    SENT_BY_PEER_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BY_PEER_FIELD_NUMBER: _ClassVar[int]
    SENT_BY_FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BY_FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    sent: int
    received: int
    sent_per_s: float
    received_per_s: float
    sent_by_peer: _containers.ScalarMap[str, int]
    received_by_peer: _containers.ScalarMap[str, int]
    sent_by_fragment: _containers.ScalarMap[int, int]
    received_by_fragment: _containers.ScalarMap[int, int]
    def __init__(self, sent: _Optional[int] = ..., received: _Optional[int] = ..., sent_per_s: _Optional[float] = ..., received_per_s: _Optional[float] = ..., sent_by_peer: _Optional[_Mapping[str, int]] = ..., received_by_peer: _Optional[_Mapping[str, int]] = ..., sent_by_fragment: _Optional[_Mapping[int, int]] = ..., received_by_fragment: _Optional[_Mapping[int, int]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("time", "kind", "detail", "clock", "fragment", "round", "bytes_sent", "bytes_received", "group_size", "version", "peer_id", "own_weight", "total_weight", "matchmaking_s", "round_s")
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    OWN_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MATCHMAKING_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_S_FIELD_NUMBER: _ClassVar[int]
    time: float
    kind: str
    detail: str
    clock: int
    fragment: int
    round: int
    bytes_sent: int
    bytes_received: int
    group_size: int
    version: int
    peer_id: str
    own_weight: float
    total_weight: float
    matchmaking_s: float
    round_s: float
    def __init__(self, time: _Optional[float] = ..., kind: _Optional[str] = ..., detail: _Optional[str] = ..., clock: _Optional[int] = ..., fragment: _Optional[int] = ..., round: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., group_size: _Optional[int] = ..., version: _Optional[int] = ..., peer_id: _Optional[str] = ..., own_weight: _Optional[float] = ..., total_weight: _Optional[float] = ..., matchmaking_s: _Optional[float] = ..., round_s: _Optional[float] = ...) -> None: ...

class PeerReputation(_message.Message):
    __slots__ = ("peer_id", "refused", "offences", "banned", "banned_for_s", "last", "by_kind", "first_banned", "scores", "forgiven")
    class ByKindEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    OFFENCES_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    BANNED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    BY_KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_BANNED_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    FORGIVEN_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    refused: int
    offences: int
    banned: bool
    banned_for_s: float
    last: str
    by_kind: _containers.ScalarMap[str, int]
    first_banned: float
    scores: _containers.ScalarMap[str, float]
    forgiven: int
    def __init__(self, peer_id: _Optional[str] = ..., refused: _Optional[int] = ..., offences: _Optional[int] = ..., banned: _Optional[bool] = ..., banned_for_s: _Optional[float] = ..., last: _Optional[str] = ..., by_kind: _Optional[_Mapping[str, int]] = ..., first_banned: _Optional[float] = ..., scores: _Optional[_Mapping[str, float]] = ..., forgiven: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("peer_id", "fingerprint", "swarm", "addrs", "pid", "uptime_s", "clock", "inner_step", "tokens", "state", "loss", "tokens_per_s", "compute_utilization", "eval_curve", "loss_history", "fragments", "peers", "syncs_ok", "syncs_failed", "catch_ups", "consensus_rounds", "consensus_last_shift", "bytes", "refusals", "events", "now", "control_port", "metrics_port", "solo_steps", "reputation", "refused_total", "banned_peers", "consensus_failed", "consensus_last_error", "catch_up_loops", "stalls_cut", "standing_rounds", "memory_rss", "memory_peak_rss", "memory_device", "memory_device_allocated", "memory_device_peak", "memory_device_total", "effect_checks", "effect_refused", "strangers", "reachability_state", "reachability_mode", "reachability_source", "reachability_relay", "reachability_checked_at", "reachability_reachable", "reachability_unreachable", "reachability_no_answer", "reachability_checks_served", "reachability_relayed_bytes", "reachability_inbound_streams", "reachability_undialable", "replays", "contested_checks", "synthetic_step_s")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SWARM_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    EVAL_CURVE_FIELD_NUMBER: _ClassVar[int]
    LOSS_HISTORY_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SYNCS_OK_FIELD_NUMBER: _ClassVar[int]
    SYNCS_FAILED_FIELD_NUMBER: _ClassVar[int]
    CATCH_UPS_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_LAST_SHIFT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    SOLO_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPUTATION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BANNED_PEERS_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_FAILED_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_LOOPS_FIELD_NUMBER: _ClassVar[int]
    STALLS_CUT_FIELD_NUMBER: _ClassVar[int]
    STANDING_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RSS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_RSS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_DEVICE_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_DEVICE_PEAK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_DEVICE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EFFECT_CHECKS_FIELD_NUMBER: _ClassVar[int]
    EFFECT_REFUSED_FIELD_NUMBER: _ClassVar[int]
    STRANGERS_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_STATE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_MODE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_RELAY_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_CHECKED_AT_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_REACHABLE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_NO_ANSWER_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_CHECKS_SERVED_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_INBOUND_STREAMS_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_UNDIALABLE_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    CONTESTED_CHECKS_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_STEP_S_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    fingerprint: str
    swarm: str
    addrs: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    uptime_s: float
    clock: int
    inner_step: int
    tokens: int
    state: str
    loss: float
    tokens_per_s: float
    compute_utilization: float
    eval_curve: _containers.RepeatedCompositeFieldContainer[EvalPoint]
    loss_history: _containers.RepeatedCompositeFieldContainer[LossSample]
    fragments: _containers.RepeatedCompositeFieldContainer[Fragment]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    syncs_ok: int
    syncs_failed: int
    catch_ups: int
    consensus_rounds: int
    consensus_last_shift: float
    bytes: Bytes
    refusals: _containers.RepeatedScalarFieldContainer[str]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    now: float
    control_port: int
    metrics_port: int
    solo_steps: int
    reputation: _containers.RepeatedCompositeFieldContainer[PeerReputation]
    refused_total: int
    banned_peers: int
    consensus_failed: int
    consensus_last_error: str
    catch_up_loops: int
    stalls_cut: int
    standing_rounds: int
    memory_rss: int
    memory_peak_rss: int
    memory_device: str
    memory_device_allocated: int
    memory_device_peak: int
    memory_device_total: int
    effect_checks: int
    effect_refused: int
    strangers: int
    reachability_state: str
    reachability_mode: str
    reachability_source: str
    reachability_relay: str
    reachability_checked_at: float
    reachability_reachable: int
    reachability_unreachable: int
    reachability_no_answer: int
    reachability_checks_served: int
    reachability_relayed_bytes: int
    reachability_inbound_streams: int
    reachability_undialable: int
    replays: int
    contested_checks: int
    synthetic_step_s: float
    def __init__(self, peer_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., swarm: _Optional[str] = ..., addrs: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., clock: _Optional[int] = ..., inner_step: _Optional[int] = ..., tokens: _Optional[int] = ..., state: _Optional[str] = ..., loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., compute_utilization: _Optional[float] = ..., eval_curve: _Optional[_Iterable[_Union[EvalPoint, _Mapping]]] = ..., loss_history: _Optional[_Iterable[_Union[LossSample, _Mapping]]] = ..., fragments: _Optional[_Iterable[_Union[Fragment, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., syncs_ok: _Optional[int] = ..., syncs_failed: _Optional[int] = ..., catch_ups: _Optional[int] = ..., consensus_rounds: _Optional[int] = ..., consensus_last_shift: _Optional[float] = ..., bytes: _Optional[_Union[Bytes, _Mapping]] = ..., refusals: _Optional[_Iterable[str]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., now: _Optional[float] = ..., control_port: _Optional[int] = ..., metrics_port: _Optional[int] = ..., solo_steps: _Optional[int] = ..., reputation: _Optional[_Iterable[_Union[PeerReputation, _Mapping]]] = ..., refused_total: _Optional[int] = ..., banned_peers: _Optional[int] = ..., consensus_failed: _Optional[int] = ..., consensus_last_error: _Optional[str] = ..., catch_up_loops: _Optional[int] = ..., stalls_cut: _Optional[int] = ..., standing_rounds: _Optional[int] = ..., memory_rss: _Optional[int] = ..., memory_peak_rss: _Optional[int] = ..., memory_device: _Optional[str] = ..., memory_device_allocated: _Optional[int] = ..., memory_device_peak: _Optional[int] = ..., memory_device_total: _Optional[int] = ..., effect_checks: _Optional[int] = ..., effect_refused: _Optional[int] = ..., strangers: _Optional[int] = ..., reachability_state: _Optional[str] = ..., reachability_mode: _Optional[str] = ..., reachability_source: _Optional[str] = ..., reachability_relay: _Optional[str] = ..., reachability_checked_at: _Optional[float] = ..., reachability_reachable: _Optional[int] = ..., reachability_unreachable: _Optional[int] = ..., reachability_no_answer: _Optional[int] = ..., reachability_checks_served: _Optional[int] = ..., reachability_relayed_bytes: _Optional[int] = ..., reachability_inbound_streams: _Optional[int] = ..., reachability_undialable: _Optional[int] = ..., replays: _Optional[int] = ..., contested_checks: _Optional[int] = ..., synthetic_step_s: _Optional[float] = ...) -> None: ...
