"""The node's status as one typed structure: :class:`NodeStatus` and the records it nests.

``Node.status_snapshot()`` builds a :class:`NodeStatus` once per request; everything else reads that
structure: ``STATE_DIR/status.json`` is its :meth:`NodeStatus.to_json`, the control API sends its
:meth:`NodeStatus.to_proto` (``protocol/control.proto``'s ``Status``), ``locoswarm status`` turns the message
back with :meth:`NodeStatus.from_proto` and draws it (``locoswarm.node.control.tui``), and the metrics endpoint
renders it (``locoswarm.node.control.metrics``). The swarm view of ``locoswarm status --swarm`` (no local node, the
peers' heartbeats only) is a :class:`SwarmView`.

Why frozen dataclasses and not the generated ``control.Status`` message used directly:

- ``status.json`` keeps the JSON shape its readers (tests, benchmarks, docker/bootstrap_from.py) depend on:
  ``eval_curve`` as ``[clock, loss]`` pairs, ``consensus`` and ``reputation`` as nested objects, fragment-keyed
  ``spread``, plain numbers. protobuf's JSON mapping would change those shapes (64-bit integers as strings,
  ``consensus_*`` flattened, peers as a list) and every reader with them.
- "not known" is ``None`` in a dataclass; a proto3 scalar has no None except where the field is ``optional``,
  and reading a message means ``HasField`` checks in every consumer.
- The fields are plain Python types that a type checker and a reader see in one place; the wire format
  stays the proto, whose field numbers older clients and nodes keep understanding.

JSON and proto conversions are written once, here. Fields with the same name as a scalar, repeated-scalar or
map field of the message are copied by name (:func:`_copy_plain` / :func:`_plain_from`); nested messages and
the few fields shaped differently on the wire (peers keyed by id, the flattened consensus and reputation
totals) are converted by hand in each record's ``to_proto`` / ``from_proto``. ``tests/test_status.py`` fills
every field of every record and checks that JSON and proto round trips give the same structure back and that
no proto field stays unset, so a field added on one side only fails there.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from locoswarm.protocol import control_pb2, swarm_pb2

# ---- the conversions every record shares ----------------------------------------------------------------


class Record:
    """Base of the status records: JSON by field name, typed back from JSON by the fields' annotations; the
    proto ``PROTO`` by field name (:func:`_copy_plain`), where a record adds what is shaped otherwise."""

    PROTO: ClassVar[Any] = None  # its control.proto message (None: its fields live in the parent's message)

    def to_proto(self) -> Any:
        msg = self.PROTO()
        _copy_plain(self, msg)
        return msg

    @classmethod
    def from_proto(cls, msg: Any) -> Self:
        return cls(**_plain_from(cls, msg))

    def to_json(self) -> Any:
        """A JSON-able value: ``{field: value}``, records nested, mapping keys as strings."""
        return {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """The record from :meth:`to_json`'s value. A missing key takes the field's default (a status written
        by an older node); an unknown key is ignored (one written by a newer node)."""
        hints = _hints(cls)
        return cls(**{f.name: _from_json(hints[f.name], data[f.name])
                      for f in dataclasses.fields(cls) if f.name in data})


def _json_value(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_json(tp: Any, value: Any) -> Any:
    """``value`` (parsed JSON) as the annotated type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):  # only ``X | None`` occurs in the records
        return None if value is None else _from_json(next(a for a in args if a is not type(None)), value)
    if origin is list:
        return [_from_json(args[0], v) for v in value]
    if origin is dict:
        return {_from_json(args[0], k): _from_json(args[1], v) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_json(value)
    return tp(value)  # int, float, str, bool: JSON keys come as strings, 0.0 may come as 0


@functools.cache
def _plain_fields(record_cls: type, descriptor: Any, prefix: str = "") -> tuple[tuple[str, Any], ...]:
    """``(record field, proto field descriptor)`` of the fields copied by name: the record's fields whose
    ``prefix + name`` is a scalar, repeated-scalar or map-of-scalars field of the message (nested and
    repeated messages are converted by hand)."""
    out = []
    for f in dataclasses.fields(record_cls):
        fd = descriptor.fields_by_name.get(prefix + f.name)
        if fd is not None and (fd.message_type is None or _is_scalar_map(fd)):
            out.append((f.name, fd))
    return tuple(out)


def _is_scalar_map(fd: Any) -> bool:
    entry = fd.message_type
    return bool(entry.GetOptions().map_entry) and entry.fields_by_name["value"].message_type is None


def _copy_plain(record: Record, msg: Any, prefix: str = "") -> None:
    """Set ``msg``'s plain fields from ``record`` (see :func:`_plain_fields`); None leaves an ``optional``
    field absent."""
    for name, fd in _plain_fields(type(record), msg.DESCRIPTOR, prefix):
        value = getattr(record, name)
        if value is None:
            continue
        if fd.message_type is not None:  # a map
            getattr(msg, fd.name).update(value)
        elif fd.is_repeated:
            getattr(msg, fd.name).extend(value)
        else:
            setattr(msg, fd.name, value)


def _plain_from(record_cls: type, msg: Any, prefix: str = "") -> dict[str, Any]:
    """The keyword arguments of ``record_cls`` that :func:`_copy_plain` wrote into ``msg``."""
    out: dict[str, Any] = {}
    for name, fd in _plain_fields(record_cls, msg.DESCRIPTOR, prefix):
        value = getattr(msg, fd.name)
        if fd.message_type is not None:
            out[name] = dict(value)
        elif fd.is_repeated:
            out[name] = list(value)
        elif fd.has_presence and not msg.HasField(fd.name):
            out[name] = None
        else:
            out[name] = value
    return out


# ---- the records ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalPoint(Record):
    """A held-out evaluation: the swarm clock it was taken at and its loss. JSON: ``[clock, loss]``."""

    clock: int = 0
    loss: float = 0.0

    PROTO: ClassVar[Any] = control_pb2.EvalPoint

    def to_json(self) -> list:
        return [self.clock, self.loss]

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return cls(int(data[0]), float(data[1]))


@dataclass(frozen=True)
class LossSample(Record):
    """The training loss at one inner step, as the control server sampled it (for the TUI's sparkline)."""

    time: float = 0.0
    inner_step: int = 0
    loss: float = 0.0

    PROTO: ClassVar[Any] = control_pb2.LossSample


@dataclass(frozen=True)
class Spread(Record):
    """The consensus measure of one fragment across this node and the peers' heartbeats
    (``locoswarm.node.swarm.membership.fragment_spread``): ``version`` is the highest version held by >= 2 peers (None:
    none is), ``holders`` how many hold it, ``distinct_hashes`` their distinct phi hashes (1 = consensus),
    ``norm_spread`` (max - min) / mean of their phi norms, ``max_lag`` the highest minus the lowest version."""

    version: int | None = None
    holders: int = 0
    distinct_hashes: int = 0
    norm_spread: float = 0.0
    max_version: int = 0
    max_lag: int = 0

    PROTO: ClassVar[Any] = control_pb2.Spread


@dataclass(frozen=True)
class FragmentStatus(Record):
    """One fragment of this node: its outer state (version, size, last send, quantization error, phi's hash
    and norm), its traffic, its last merged round and its spread across peers. None: not known (yet)."""

    fragment: int = 0
    version: int = 0
    numel: int = 0
    last_send: int | None = None
    quant_error: float | None = None
    phi_hash: int | None = None
    phi_norm: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    group_size: int = 0                      # members of the last merged round (0: none yet)
    last_merge_time: float | None = None
    last_merge_clock: int | None = None
    spread: Spread | None = None
    ranks: list[int] = field(default_factory=list)  # codec lowrank: each matrix's rank (empty: a block codec)

    PROTO: ClassVar[Any] = control_pb2.Fragment

    def to_proto(self) -> control_pb2.Fragment:
        msg = super().to_proto()
        if self.spread is not None:
            msg.spread.CopyFrom(self.spread.to_proto())
        return msg

    @classmethod
    def from_proto(cls, msg: control_pb2.Fragment) -> Self:
        spread = Spread.from_proto(msg.spread) if msg.HasField("spread") else None
        return cls(**_plain_from(cls, msg), spread=spread)


@dataclass(frozen=True)
class PeerStatus(Record):
    """A live peer as its last heartbeat shows it (all the swarm view, without a local node, knows)."""

    clock: int = 0
    inner_step: int = 0
    tokens_per_s: float = 0.0
    time: float = 0.0                        # DHT time of its last heartbeat
    loss: float | None = None
    tokens: int = 0
    control_port: int = 0
    has_state: bool = False
    fragments: dict[int, int] = field(default_factory=dict)   # fragment -> version it holds
    reachability: str = ""                   # public, relayed, outbound-only, unknown ("": an older node)

    PROTO: ClassVar[Any] = control_pb2.Peer

    @classmethod
    def from_heartbeat(cls, hb: swarm_pb2.Heartbeat) -> Self:
        """What the heartbeat says (a :class:`NodePeerStatus`'s own fields are left at zero)."""
        return cls(clock=int(hb.clock), inner_step=int(hb.inner_step), tokens_per_s=float(hb.tokens_per_s),
                   time=float(hb.time), loss=float(hb.loss), tokens=int(hb.tokens),
                   control_port=int(hb.control_port), has_state=bool(hb.has_state),
                   fragments={int(fs.fragment): int(fs.version) for fs in hb.fragments},
                   reachability=str(hb.reachability))

    def to_proto(self, peer_id: str = "") -> control_pb2.Peer:
        msg = super().to_proto()
        msg.peer_id = peer_id
        for fragment, version in sorted(self.fragments.items()):
            msg.fragments.add(fragment=fragment, version=version)
        return msg

    @classmethod
    def from_proto(cls, msg: control_pb2.Peer) -> Self:
        return cls(**_plain_from(cls, msg), fragments={f.fragment: f.version for f in msg.fragments})


@dataclass(frozen=True)
class NodePeerStatus(PeerStatus):
    """A live peer in a node's status: its heartbeat, and the bytes this node exchanged with it and what it
    refused of it (which the swarm view cannot know)."""

    bytes_sent: int = 0                      # by this node to that peer
    bytes_received: int = 0
    refused: int = 0                         # refusals of what it sent (its PeerReputation.refused)
    banned: bool = False


class FlatRecord(Record):
    """A record whose fields live in the parent's ``Status`` message under ``PREFIX`` (no message of its own)."""

    PREFIX: ClassVar[str] = ""

    def into_proto(self, msg: control_pb2.Status) -> None:
        _copy_plain(self, msg, self.PREFIX)

    @classmethod
    def from_proto(cls, msg: control_pb2.Status) -> Self:
        return cls(**_plain_from(cls, msg, cls.PREFIX))


@dataclass(frozen=True)
class ConsensusStatus(FlatRecord):
    """Consensus rounds (fp32 averaging of phi and momentum): done, failed, the last one's shift and error.
    On the wire: the ``consensus_*`` fields of ``Status``."""

    rounds: int = 0
    last_shift: float | None = None          # |phi_bar - phi| / |phi| of the last consensus round
    failed: int = 0
    last_error: str = ""

    PREFIX: ClassVar[str] = "consensus_"


@dataclass(frozen=True)
class MemoryStatus(FlatRecord):
    """Memory of the node's process (rank 0's, with several ranks) and of its training device, in bytes: what
    a user sizes a preset by. On the wire: the ``memory_*`` fields of ``Status``."""

    rss: int = 0                              # resident now
    peak_rss: int = 0                         # the most resident since the process started
    device: str = ""                          # the training device ("cpu", "cuda:0")
    device_allocated: int | None = None       # held by PyTorch on an accelerator now (None on the CPU)
    device_peak: int | None = None            # the most PyTorch held there since the start
    device_total: int | None = None           # the accelerator's capacity

    PREFIX: ClassVar[str] = "memory_"


@dataclass(frozen=True)
class ReachabilityStatus(FlatRecord):
    """Whether peers can dial this node (``locoswarm.node.swarm.reachability``): ``state`` is public, relayed,
    outbound-only or unknown; ``source`` says how it is known (declared, checked, or assumed). On the wire: the
    ``reachability_*`` fields of ``Status``."""

    state: str = "unknown"
    mode: str = "auto"                        # what --reachability asked for: auto (checked), public, outbound-only
    source: str = ""
    relay: str | None = None                  # the relay's peer id where it is reachable through one
    checked_at: float | None = None           # wall-clock time of the last dial-back check
    reachable: int = 0                        # ... how many checkers reached it
    unreachable: int = 0                      # ... how many could not
    no_answer: int = 0                        # ... how many gave no answer
    checks_served: int = 0                    # dial-back checks this node ran for peers
    relayed_bytes: int = 0                    # bytes this node relayed for others
    inbound_streams: int = 0                  # averaging and state streams peers opened to this node
    undialable: int = 0                       # peers this node failed to dial lately (node/swarm/dial_failures.py)

    PREFIX: ClassVar[str] = "reachability_"


@dataclass(frozen=True)
class ByteStatus(Record):
    """Bytes on the wire: totals, recent rates (sampled by the control server; 0 in ``status.json``), per
    peer and per fragment."""

    sent: int = 0
    received: int = 0
    sent_per_s: float = 0.0
    received_per_s: float = 0.0
    sent_by_peer: dict[str, int] = field(default_factory=dict)
    received_by_peer: dict[str, int] = field(default_factory=dict)
    sent_by_fragment: dict[int, int] = field(default_factory=dict)
    received_by_fragment: dict[int, int] = field(default_factory=dict)

    PROTO: ClassVar[Any] = control_pb2.Bytes


@dataclass(frozen=True)
class PeerReputation(Record):
    """What this node refused of one peer and whether it bans it (``locoswarm.node.swarm.reputation``)."""

    refused: int = 0                         # refusals of anything it sent
    offences: int = 0                        # refusals that count toward a ban, within the offence window
    by_kind: dict[str, int] = field(default_factory=dict)
    banned: bool = False
    banned_for_s: float = 0.0                # cool-down left (0: not banned)
    last: str = ""                           # the last refusal, "kind: detail"
    first_banned: float | None = None        # wall time of this node's first ban of it (None: never)
    scores: dict[str, float] = field(default_factory=dict)  # judged kind -> mean of its last scores
    forgiven: int = 0                        # offences good behaviour took back

    PROTO: ClassVar[Any] = control_pb2.PeerReputation

    def to_proto(self, peer_id: str = "") -> control_pb2.PeerReputation:
        msg = super().to_proto()
        msg.peer_id = peer_id
        return msg


@dataclass(frozen=True)
class ReputationStatus(Record):
    """``Reputation.snapshot()`` typed (its dict is this record's JSON): per peer, and the totals."""

    peers: dict[str, PeerReputation] = field(default_factory=dict)
    refused: int = 0                         # refusals of all peers (forgotten peers included)
    banned: int = 0                          # peers banned now

    def into_proto(self, msg: control_pb2.Status) -> None:
        msg.refused_total, msg.banned_peers = self.refused, self.banned
        msg.reputation.extend(r.to_proto(pid) for pid, r in self.peers.items())

    @classmethod
    def from_proto(cls, msg: control_pb2.Status) -> Self:
        return cls(peers={r.peer_id: PeerReputation.from_proto(r) for r in msg.reputation},
                   refused=msg.refused_total, banned=msg.banned_peers)


@dataclass(frozen=True)
class StatusEvent(Record):
    """One event of the node (joined, resumed, merged, failed, caught_up, ...) or of the control server
    (peer_joined, peer_left: ``peer_id`` set). The fields a kind does not have stay None / 0."""

    time: float = 0.0
    kind: str = ""
    detail: str = ""
    clock: int = 0
    fragment: int | None = None
    round: int | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    group_size: int = 0
    version: int | None = None
    own_weight: float | None = None          # tokens this node contributed to the round
    total_weight: float | None = None        # tokens of the whole group
    peer_id: str = ""
    matchmaking_s: float | None = None       # merged / failed rounds: seconds until the member list was decided
    round_s: float | None = None             # ... and until the result was complete

    PROTO: ClassVar[Any] = control_pb2.Event


@dataclass(frozen=True)
class NodeStatus(Record):
    """Everything ``locoswarm status``, ``status.json`` and the metrics show of one node.

    ``loss_history`` and the byte rates are what only a watcher over time knows: the control server samples
    them (``locoswarm.node.control.server.StatusSource``); they are empty in ``status.json``.
    """

    peer_id: str = ""
    fingerprint: str = ""
    swarm: str = ""
    addrs: list[str] = field(default_factory=list)
    pid: int = 0
    uptime_s: float = 0.0
    clock: int = 0
    inner_step: int = 0
    tokens: int = 0
    state: str = ""                          # starting, training, leaving, stopped
    loss: float | None = None
    tokens_per_s: float = 0.0
    compute_utilization: float = 0.0         # share of wall time spent in inner steps
    synthetic_step_s: float = 0.0            # > 0: synthetic compute (benchmarks only), seconds per inner step
    eval_curve: list[EvalPoint] = field(default_factory=list)
    loss_history: list[LossSample] = field(default_factory=list)
    fragments: list[FragmentStatus] = field(default_factory=list)
    peers: dict[str, NodePeerStatus] = field(default_factory=dict)
    syncs_ok: int = 0
    syncs_failed: int = 0
    catch_ups: int = 0
    catch_up_loops: int = 0
    replays: int = 0                         # catch-ups that replayed the steps missed (node/core/step_log.py)
    stalls_cut: int = 0                      # rounds left in flight after their stall budget (late window)
    standing_rounds: int = 0                 # rounds that took the last merged round's members (no matchmaking)
    solo_steps: int = 0                      # outer steps taken with no live peer (a swarm of one)
    effect_checks: int = 0                   # results and snapshots the effect check compared (core.judge)
    effect_refused: int = 0                  # ... of which it refused
    contested_checks: int = 0                # passed averages whose own part's screening was outvoted, judged
    strangers: int = 0                       # a closed swarm: peers without a certificate it refused
    consensus: ConsensusStatus = field(default_factory=ConsensusStatus)
    memory: MemoryStatus = field(default_factory=MemoryStatus)
    reachability: ReachabilityStatus = field(default_factory=ReachabilityStatus)
    bytes: ByteStatus = field(default_factory=ByteStatus)
    refusals: list[str] = field(default_factory=list)
    reputation: ReputationStatus = field(default_factory=ReputationStatus)
    events: list[StatusEvent] = field(default_factory=list)
    now: float = 0.0                         # the node's wall-clock time of this snapshot
    control_port: int = 0
    metrics_port: int = 0

    PROTO: ClassVar[Any] = control_pb2.Status

    def spread_by_fragment(self) -> dict[int, Spread]:
        """The fragments' spreads by fragment (those known)."""
        return {f.fragment: f.spread for f in self.fragments if f.spread is not None}

    def to_json(self) -> dict[str, Any]:
        """Also ``"spread"``: the fragments' spreads by fragment, as ``status.json`` has always had it."""
        return {**super().to_json(), "spread": _json_value(self.spread_by_fragment())}

    def to_proto(self) -> control_pb2.Status:
        msg = super().to_proto()
        msg.eval_curve.extend(p.to_proto() for p in self.eval_curve)
        msg.loss_history.extend(s.to_proto() for s in self.loss_history)
        msg.fragments.extend(f.to_proto() for f in self.fragments)
        msg.peers.extend(p.to_proto(pid) for pid, p in self.peers.items())
        self.consensus.into_proto(msg)
        self.memory.into_proto(msg)
        self.reachability.into_proto(msg)
        msg.bytes.CopyFrom(self.bytes.to_proto())
        self.reputation.into_proto(msg)
        msg.events.extend(e.to_proto() for e in self.events)
        return msg

    @classmethod
    def from_proto(cls, msg: control_pb2.Status) -> Self:
        return cls(**_plain_from(cls, msg),
                   eval_curve=[EvalPoint.from_proto(p) for p in msg.eval_curve],
                   loss_history=[LossSample.from_proto(s) for s in msg.loss_history],
                   fragments=[FragmentStatus.from_proto(f) for f in msg.fragments],
                   peers={p.peer_id: NodePeerStatus.from_proto(p) for p in msg.peers},
                   consensus=ConsensusStatus.from_proto(msg), memory=MemoryStatus.from_proto(msg),
                   reachability=ReachabilityStatus.from_proto(msg), bytes=ByteStatus.from_proto(msg.bytes),
                   reputation=ReputationStatus.from_proto(msg),
                   events=[StatusEvent.from_proto(e) for e in msg.events])


@dataclass(frozen=True)
class SwarmView(Record):
    """``locoswarm status --swarm``: a swarm seen from its DHT through ``via``, without a local node: the
    peers' heartbeats and the spread of every fragment across them. JSON: also ``"mode": "swarm"``."""

    swarm: str = ""
    fingerprint: str = ""
    via: str = ""
    now: float = 0.0
    peers: dict[str, PeerStatus] = field(default_factory=dict)
    spread: dict[int, Spread] = field(default_factory=dict)
    note: str = ""                           # shown under the peers (e.g. why there are none)

    def to_json(self) -> dict[str, Any]:
        return {"mode": "swarm", **super().to_json()}


__all__ = [
    "ByteStatus",
    "ConsensusStatus",
    "EvalPoint",
    "FragmentStatus",
    "LossSample",
    "NodePeerStatus",
    "NodeStatus",
    "PeerReputation",
    "PeerStatus",
    "ReachabilityStatus",
    "Record",
    "ReputationStatus",
    "Spread",
    "StatusEvent",
    "SwarmView",
]
