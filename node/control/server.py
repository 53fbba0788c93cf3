"""The ``Control`` gRPC service of a running node (``protocol/control.proto``).

``locoswarm run`` serves it on 127.0.0.1:7615 by default. It answers from ``Node._status()`` plus what a
:class:`StatusSource` samples once a second from cheap node attributes: the loss history (for the
TUI's sparkline), byte rates, and peer joins and leaves (the daemon keeps only its own events). The full
status is built on demand only and cached briefly: building it hashes every fragment's phi, which is
not free for a large model, and several watchers must not multiply that cost.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from node.control import (
    DEFAULT_CONTROL_HOST,
    DEFAULT_CONTROL_PORT,
    check_control_options,
    format_hostport,
    is_loopback,
    remote_warning,
)
from node.errors import UserError
from protocol import control_pb2, control_pb2_grpc

if TYPE_CHECKING:  # pragma: no cover
    from node.control.metrics import MetricsServer
    from node.daemon import Node

log = logging.getLogger("locoswarm.control")

SAMPLE_INTERVAL_S = 1.0
HISTORY = 240               # loss samples kept (4 minutes at one per second)
RATE_WINDOW_S = 5.0         # byte rates are averaged over this window
EVENTS = 50                 # the node's events in a status
PEER_EVENTS = 20            # plus this many peer joins and leaves
MIN_WATCH_S, MAX_WATCH_S = 0.2, 60.0
MAX_RPCS = 16               # concurrent RPCs (watch streams included)


# ---- sampling the node ------------------------------------------------------------------------------

class StatusSource:
    """The node's status as the control API and metrics serve it: ``Node._status()`` enriched with
    samples only a watcher over time can know (see the module docstring).

    ``node`` needs ``_status()``; ``status``, ``local_step``, ``counters``, ``peer_table`` and ``events``
    are read when present, so a node still starting (or a stand-in in tests) works too.
    """

    def __init__(self, node: Any, *, interval: float = SAMPLE_INTERVAL_S, cache_s: float = 0.5) -> None:
        self.node = node
        self.interval = interval
        self.cache_s = cache_s
        self.control_port = 0
        self.metrics_port = 0
        self._loss: deque[dict] = deque(maxlen=HISTORY)
        self._bytes: deque[tuple[float, int, int]] = deque()
        self._peers: set[str] | None = None
        self._peer_events: deque[dict] = deque(maxlen=PEER_EVENTS)
        self._merges: dict[int, dict] = {}
        self._cache: tuple[float, dict] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StatusSource:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="control-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as exc:  # a sampling hiccup must never take the node down
                log.debug("control sampler: %s", exc)

    def sample(self, now: float | None = None) -> None:
        """Record one sample: the loss, the byte totals, the peer set (joins and leaves)."""
        node = self.node
        now = time.time() if now is None else now
        status = getattr(node, "status", {}) or {}
        loss = status.get("loss")
        step = int(getattr(node, "local_step", 0) or 0)
        with self._lock:
            if loss is not None and (not self._loss or self._loss[-1]["inner_step"] != step):
                self._loss.append({"time": now, "inner_step": step, "loss": float(loss)})
            counters = getattr(node, "counters", None)
            if counters is not None:
                self._bytes.append((now, int(counters.total_sent), int(counters.total_received)))
                while len(self._bytes) > 2 and now - self._bytes[1][0] >= RATE_WINDOW_S:
                    self._bytes.popleft()
            peers = set(_copy(getattr(node, "peer_table", {}) or {}))
            clock = int(getattr(node, "clock", 0) or 0)
            if self._peers is not None:
                for pid in sorted(peers - self._peers):
                    self._peer_events.append({"time": now, "kind": "peer_joined", "peer_id": pid, "clock": clock,
                                              "detail": f"peer {pid} joined the swarm"})
                for pid in sorted(self._peers - peers):
                    self._peer_events.append({"time": now, "kind": "peer_left", "peer_id": pid, "clock": clock,
                                              "detail": f"peer {pid} left (leaving heartbeat, or none for a while)"})
            self._peers = peers
            for ev in list(getattr(node, "events", []) or []):
                if ev.get("kind") == "merged" and ev.get("fragment") is not None:
                    last = self._merges.get(int(ev["fragment"]))
                    if last is None or ev.get("time", 0) >= last.get("time", 0):
                        self._merges[int(ev["fragment"])] = ev

    def _rates(self) -> tuple[float, float]:
        if len(self._bytes) < 2:
            return 0.0, 0.0
        (t0, s0, r0), (t1, s1, r1) = self._bytes[0], self._bytes[-1]
        dt = max(t1 - t0, 1e-6)
        return max(0, s1 - s0) / dt, max(0, r1 - r0) / dt

    def _node_status(self) -> dict:
        """``Node._status()``, retried: it copies dicts other threads may be growing at that moment."""
        for attempt in range(3):
            try:
                return dict(self.node._status())
            except RuntimeError:  # "dictionary changed size during iteration"
                if attempt == 2:
                    raise
                time.sleep(0.01)
        raise AssertionError("unreachable")

    def snapshot(self) -> dict:
        """The enriched status dict (cached for ``cache_s``; callers must not modify it)."""
        now = time.time()
        with self._lock:
            if self._cache is not None and now - self._cache[0] < self.cache_s:
                return self._cache[1]
        st = self._node_status()
        with self._lock:
            st = self._enrich(st, now)
            self._cache = (now, st)
        return st

    def _enrich(self, st: dict, now: float) -> dict:
        node = self.node
        st["now"] = now
        st["control_port"] = self.control_port
        st["metrics_port"] = self.metrics_port
        st["loss_history"] = list(self._loss)
        counters = getattr(node, "counters", None)
        b = st.setdefault("bytes", {"sent": 0, "received": 0})
        b["sent_per_s"], b["received_per_s"] = self._rates()
        if counters is not None:
            b["received_by_fragment"] = {str(k): v for k, v in _copy(counters.received_by_fragment).items()}
        spread = st.get("spread", {}) or {}
        for f in st.get("fragments", []) or []:
            key = str(f["fragment"])
            f["bytes_sent"] = int(b.get("sent_by_fragment", {}).get(key, 0))
            f["bytes_received"] = int(b.get("received_by_fragment", {}).get(key, 0))
            merge = self._merges.get(int(f["fragment"]))
            f["group_size"] = int(merge.get("group_size") or 0) if merge else 0
            f["last_merge_time"] = merge.get("time") if merge else None
            f["last_merge_clock"] = merge.get("clock") if merge else None
            f["spread"] = spread.get(key)
        table = _copy(getattr(node, "peer_table", {}) or {})
        peers = st.get("peers", {}) or {}
        reputation = (st.get("reputation") or {}).get("peers") or {}
        for pid, info in peers.items():
            hb = table.get(pid)
            info["bytes_sent"] = int(b.get("sent_by_peer", {}).get(pid, 0))
            info["bytes_received"] = int(b.get("received_by_peer", {}).get(pid, 0))
            rep = reputation.get(pid) or {}
            info["refused"], info["banned"] = int(rep.get("refused", 0)), bool(rep.get("banned", False))
            if hb is not None:
                info.update(heartbeat_extras(hb))
        # the node's last EVENTS and ours, apart: a flood of failed rounds must not push joins out
        events = [*(st.get("events") or [])[-EVENTS:], *self._peer_events]
        st["events"] = sorted(events, key=lambda e: e.get("time", 0))
        return st


def _copy(d: Any) -> dict:
    """``dict(d)`` of a dict another thread may be growing (its size changing mid-copy raises)."""
    for _ in range(5):
        try:
            return dict(d)
        except RuntimeError:
            time.sleep(0.001)
    return {}


def heartbeat_extras(hb: Any) -> dict:
    """What a peer's heartbeat tells beyond the daemon's peer summary."""
    return {"loss": float(hb.loss), "tokens": int(hb.tokens), "control_port": int(hb.control_port),
            "has_state": bool(hb.has_state),
            "fragments": {str(fs.fragment): int(fs.version) for fs in hb.fragments}}


def peers_from_heartbeats(heartbeats: dict) -> dict:
    """``{peer id: peer dict}`` (the shape of a status's ``peers``) from ``Membership.peers()``."""
    return {pid: {"clock": int(hb.clock), "inner_step": int(hb.inner_step), "tokens_per_s": float(hb.tokens_per_s),
                  "time": float(hb.time), **heartbeat_extras(hb)} for pid, hb in heartbeats.items()}


# ---- dict <-> proto ----------------------------------------------------------------------------------

def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def _set(msg: Any, **fields: Any) -> None:
    """Assign the fields that are not None (proto3 ``optional`` fields stay absent for None)."""
    for name, value in fields.items():
        if value is not None:
            setattr(msg, name, value)


def _peer_to_proto(pid: str, info: dict) -> control_pb2.Peer:
    p = control_pb2.Peer(peer_id=pid, clock=int(info.get("clock", 0)), inner_step=int(info.get("inner_step", 0)),
                         tokens_per_s=float(info.get("tokens_per_s", 0.0)), time=float(info.get("time", 0.0)),
                         tokens=int(info.get("tokens", 0)), control_port=int(info.get("control_port", 0)),
                         has_state=bool(info.get("has_state", False)),
                         bytes_sent=int(info.get("bytes_sent", 0)), bytes_received=int(info.get("bytes_received", 0)),
                         refused=int(info.get("refused", 0)), banned=bool(info.get("banned", False)))
    _set(p, loss=None if info.get("loss") is None else float(info["loss"]))
    for frag, version in sorted((info.get("fragments") or {}).items(), key=lambda kv: int(kv[0])):
        p.fragments.add(fragment=int(frag), version=int(version))
    return p


def _reputation_to_proto(msg: control_pb2.Status, rep: dict) -> None:
    """``Reputation.snapshot()`` into ``msg``: totals and one ``PeerReputation`` per peer."""
    msg.refused_total = int(rep.get("refused", 0))
    msg.banned_peers = int(rep.get("banned", 0))
    for pid, r in (rep.get("peers") or {}).items():
        pr = msg.reputation.add(peer_id=str(pid), refused=int(r.get("refused", 0)), offences=int(r.get("offences", 0)),
                                banned=bool(r.get("banned", False)), banned_for_s=float(r.get("banned_for_s", 0.0)),
                                last=str(r.get("last", "")))
        pr.by_kind.update({str(k): int(n) for k, n in (r.get("by_kind") or {}).items()})


def _reputation_from_proto(msg: control_pb2.Status) -> dict:
    """The ``reputation`` of a status dict (the shape of ``Reputation.snapshot()``)."""
    peers = {r.peer_id: {"refused": r.refused, "offences": r.offences, "by_kind": dict(sorted(r.by_kind.items())),
                         "banned": r.banned, "banned_for_s": r.banned_for_s, "last": r.last} for r in msg.reputation}
    return {"peers": peers, "refused": msg.refused_total, "banned": msg.banned_peers}


def status_to_proto(st: dict) -> control_pb2.Status:
    """The enriched status dict (:meth:`StatusSource.snapshot`) as a ``control.Status`` message."""
    msg = control_pb2.Status(
        peer_id=str(st.get("peer_id", "")), fingerprint=str(st.get("fingerprint", "")),
        swarm=str(st.get("swarm", "")), addrs=[str(a) for a in st.get("addrs", []) or []],
        pid=int(st.get("pid", 0)), uptime_s=float(st.get("uptime_s", 0.0)), clock=int(st.get("clock", 0)),
        inner_step=int(st.get("inner_step", 0)), tokens=int(st.get("tokens", 0)), state=str(st.get("state") or ""),
        tokens_per_s=float(st.get("tokens_per_s") or 0.0),
        compute_utilization=float(st.get("compute_utilization") or 0.0),
        syncs_ok=int(st.get("syncs_ok", 0)), syncs_failed=int(st.get("syncs_failed", 0)),
        catch_ups=int(st.get("catch_ups", 0)), catch_up_loops=int(st.get("catch_up_loops", 0)),
        solo_steps=int(st.get("solo_steps", 0)), refusals=[str(r) for r in st.get("refusals", []) or []],
        now=float(st.get("now", time.time())), control_port=int(st.get("control_port", 0)),
        metrics_port=int(st.get("metrics_port", 0)))
    _set(msg, loss=None if st.get("loss") is None else float(st["loss"]))
    consensus = st.get("consensus") or {}
    msg.consensus_rounds = int(consensus.get("rounds") or 0)
    msg.consensus_failed = int(consensus.get("failed") or 0)
    msg.consensus_last_error = str(consensus.get("last_error") or "")
    _set(msg, consensus_last_shift=None if consensus.get("last_shift") is None else float(consensus["last_shift"]))
    for clock, loss in st.get("eval_curve", []) or []:
        msg.eval_curve.add(clock=int(clock), loss=float(loss))
    for s in st.get("loss_history", []) or []:
        msg.loss_history.add(time=float(s["time"]), inner_step=int(s["inner_step"]), loss=float(s["loss"]))
    for f in st.get("fragments", []) or []:
        pf = msg.fragments.add(fragment=int(f["fragment"]), version=int(f.get("version", 0)),
                               numel=int(f.get("numel", 0)), bytes_sent=int(f.get("bytes_sent", 0)),
                               bytes_received=int(f.get("bytes_received", 0)), group_size=int(f.get("group_size", 0)))
        _set(pf, last_send=f.get("last_send"), quant_error=f.get("quant_error"), phi_hash=f.get("phi_hash"),
             last_merge_time=f.get("last_merge_time"), last_merge_clock=f.get("last_merge_clock"))
        sp = f.get("spread") or (st.get("spread") or {}).get(str(f["fragment"]))
        if sp:
            pf.spread.holders = int(sp.get("holders", 0))
            pf.spread.distinct_hashes = int(sp.get("distinct_hashes", 0))
            pf.spread.norm_spread = float(sp.get("norm_spread", 0.0))
            pf.spread.max_version = int(sp.get("max_version", 0))
            pf.spread.max_lag = int(sp.get("max_lag", 0))
            _set(pf.spread, version=sp.get("version"))
    for pid, info in (st.get("peers") or {}).items():
        msg.peers.append(_peer_to_proto(pid, info))
    b = st.get("bytes") or {}
    msg.bytes.sent = int(b.get("sent", 0))
    msg.bytes.received = int(b.get("received", 0))
    msg.bytes.sent_per_s = float(b.get("sent_per_s", 0.0))
    msg.bytes.received_per_s = float(b.get("received_per_s", 0.0))
    for name in ("sent_by_peer", "received_by_peer"):
        getattr(msg.bytes, name).update({str(k): int(v) for k, v in (b.get(name) or {}).items()})
    for name in ("sent_by_fragment", "received_by_fragment"):
        getattr(msg.bytes, name).update({int(k): int(v) for k, v in (b.get(name) or {}).items()})
    for e in st.get("events", []) or []:
        pe = msg.events.add(time=float(e.get("time", 0.0)), kind=str(e.get("kind", "")),
                            detail=str(e.get("detail", "")), clock=max(0, int(e.get("clock") or 0)),
                            bytes_sent=int(e.get("bytes_sent") or 0), bytes_received=int(e.get("bytes_received") or 0),
                            group_size=int(e.get("group_size") or 0), peer_id=str(e.get("peer_id") or ""))
        _set(pe, fragment=e.get("fragment"), round=e.get("round"), version=e.get("version"))
    _reputation_to_proto(msg, st.get("reputation") or {})
    return msg


def status_from_proto(msg: control_pb2.Status) -> dict:
    """A ``control.Status`` back to the status dict (the shape ``Node._status()`` returns, enriched):
    what the TUI renders and ``locoswarm status --json`` prints."""
    spread = {}
    fragments = []
    for f in msg.fragments:
        sp = None
        if f.HasField("spread"):
            sp = {"version": _opt(f.spread, "version"), "holders": f.spread.holders,
                  "distinct_hashes": f.spread.distinct_hashes, "norm_spread": f.spread.norm_spread,
                  "max_version": f.spread.max_version, "max_lag": f.spread.max_lag}
            spread[str(f.fragment)] = sp
        fragments.append({"fragment": f.fragment, "version": f.version, "numel": f.numel,
                          "last_send": _opt(f, "last_send"), "quant_error": _opt(f, "quant_error"),
                          "phi_hash": _opt(f, "phi_hash"), "bytes_sent": f.bytes_sent,
                          "bytes_received": f.bytes_received, "group_size": f.group_size,
                          "last_merge_time": _opt(f, "last_merge_time"),
                          "last_merge_clock": _opt(f, "last_merge_clock"), "spread": sp})
    return {
        "peer_id": msg.peer_id, "fingerprint": msg.fingerprint, "swarm": msg.swarm, "addrs": list(msg.addrs),
        "pid": msg.pid, "uptime_s": msg.uptime_s, "clock": msg.clock, "inner_step": msg.inner_step,
        "tokens": msg.tokens, "state": msg.state, "loss": _opt(msg, "loss"), "tokens_per_s": msg.tokens_per_s,
        "compute_utilization": msg.compute_utilization,
        "eval_curve": [[p.clock, p.loss] for p in msg.eval_curve],
        "loss_history": [{"time": s.time, "inner_step": s.inner_step, "loss": s.loss} for s in msg.loss_history],
        "fragments": fragments,
        "peers": {p.peer_id: peer_from_proto(p) for p in msg.peers},
        "spread": spread,
        "syncs_ok": msg.syncs_ok, "syncs_failed": msg.syncs_failed, "catch_ups": msg.catch_ups,
        "catch_up_loops": msg.catch_up_loops, "solo_steps": msg.solo_steps,
        "consensus": {"rounds": msg.consensus_rounds, "last_shift": _opt(msg, "consensus_last_shift"),
                      "failed": msg.consensus_failed, "last_error": msg.consensus_last_error},
        "bytes": {"sent": msg.bytes.sent, "received": msg.bytes.received, "sent_per_s": msg.bytes.sent_per_s,
                  "received_per_s": msg.bytes.received_per_s, "sent_by_peer": dict(msg.bytes.sent_by_peer),
                  "received_by_peer": dict(msg.bytes.received_by_peer),
                  "sent_by_fragment": {str(k): v for k, v in sorted(msg.bytes.sent_by_fragment.items())},
                  "received_by_fragment": {str(k): v for k, v in sorted(msg.bytes.received_by_fragment.items())}},
        "refusals": list(msg.refusals),
        "reputation": _reputation_from_proto(msg),
        "events": [{"time": e.time, "kind": e.kind, "detail": e.detail, "clock": e.clock,
                    "fragment": _opt(e, "fragment"), "round": _opt(e, "round"), "bytes_sent": e.bytes_sent,
                    "bytes_received": e.bytes_received, "group_size": e.group_size, "version": _opt(e, "version"),
                    "peer_id": e.peer_id} for e in msg.events],
        "now": msg.now, "control_port": msg.control_port, "metrics_port": msg.metrics_port,
    }


def peer_from_proto(p: control_pb2.Peer) -> dict:
    return {"clock": p.clock, "inner_step": p.inner_step, "tokens_per_s": p.tokens_per_s, "time": p.time,
            "loss": _opt(p, "loss"), "tokens": p.tokens, "control_port": p.control_port, "has_state": p.has_state,
            "fragments": {str(f.fragment): f.version for f in p.fragments},
            "bytes_sent": p.bytes_sent, "bytes_received": p.bytes_received, "refused": p.refused, "banned": p.banned}


# ---- the service ---------------------------------------------------------------------------------------

class ControlService(control_pb2_grpc.ControlServicer):
    """The RPC handlers; every answer comes from one :class:`StatusSource`."""

    def __init__(self, node: Any, source: StatusSource, closing: threading.Event) -> None:
        self.node = node
        self.source = source
        self.closing = closing

    def GetStatus(self, request: control_pb2.StatusRequest, context: grpc.ServicerContext) -> control_pb2.Status:
        return status_to_proto(self.source.snapshot())

    def WatchStatus(self, request: control_pb2.WatchRequest,
                    context: grpc.ServicerContext) -> Iterator[control_pb2.Status]:
        interval = min(max(request.interval_s or SAMPLE_INTERVAL_S, MIN_WATCH_S), MAX_WATCH_S)
        while context.is_active() and not self.closing.is_set():
            yield status_to_proto(self.source.snapshot())
            if self.closing.wait(interval):
                break

    def ListPeers(self, request: control_pb2.ListPeersRequest, context: grpc.ServicerContext) -> control_pb2.PeerList:
        st = self.source.snapshot()
        return control_pb2.PeerList(peers=[_peer_to_proto(pid, info) for pid, info in (st.get("peers") or {}).items()],
                                    now=float(st.get("now", time.time())))

    def Leave(self, request: control_pb2.LeaveRequest, context: grpc.ServicerContext) -> control_pb2.LeaveReply:
        if self.node.stop.is_set():
            return control_pb2.LeaveReply(accepted=False, message="the node is already leaving")
        peer = context.peer() if context is not None else "?"
        log.warning("leave requested through the control API by %s%s", peer,
                    f" ({request.reason})" if request.reason else "")
        self.node.stop.set()
        return control_pb2.LeaveReply(accepted=True, message="leaving: finishing in-flight rounds, then checkpointing")


class ControlServer:
    """What :func:`start_control_server` started: the gRPC server and/or the metrics endpoint."""

    def __init__(self, source: StatusSource, grpc_server: grpc.Server | None, port: int,
                 metrics: MetricsServer | None, closing: threading.Event) -> None:
        self.source = source
        self.grpc_server = grpc_server
        self.port = port
        self.metrics = metrics
        self._closing = closing

    @property
    def metrics_port(self) -> int:
        return self.metrics.port if self.metrics is not None else 0

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (watch streams end at once); idempotent."""
        self._closing.set()
        if self.grpc_server is not None:
            with contextlib.suppress(Exception):
                self.grpc_server.stop(grace).wait(grace + 1.0)
            self.grpc_server = None
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        self.source.stop()

    close = stop  # the daemon closes its network objects by this name


def _bind_error(host: str, port: int, flag: str) -> UserError:
    """Why ``host:port`` cannot be bound, as a UserError naming it (the port check says it best)."""
    try:
        check_control_options(host, {flag: port}, allow_remote=True)
    except UserError as exc:
        return exc
    return UserError(f"{flag}: cannot listen on {format_hostport(host, port)}; pick another port")


def _add_port(server: grpc.Server, host: str, port: int) -> int:
    """The port bound, or 0 (grpc raises on some versions, returns 0 on others). A taken port is found
    first: grpc's core prints its own raw ``add_port.cc ... Address already in use`` line to stderr for one,
    which users read as a crash."""
    from node.swarm.dht import tcp_port_free

    if port and not tcp_port_free(host, port):
        return 0
    try:
        return int(server.add_insecure_port(format_hostport(host, port)))
    except RuntimeError:
        return 0


def start_control_server(node: Node | Any, host: str, port: int | None, allow_remote: bool, *,
                         metrics_port: int = 0, any_port_if_taken: bool = False) -> ControlServer:
    """Serve the control API of ``node`` on ``host:port`` (``port`` 0: any free port; None: no gRPC) and,
    with ``metrics_port`` (0: off), Prometheus metrics on ``host:metrics_port``. ``any_port_if_taken``:
    a taken ``port`` (the default one, held by another node on this machine) moves to any free port,
    with a warning naming it.

    A non-loopback ``host`` needs ``allow_remote`` (the API can make the node leave) and logs a warning.
    Raises :class:`UserError` naming a port that is already in use.
    """
    from node.control.metrics import start_metrics_server

    if not is_loopback(host):
        if not allow_remote:
            raise UserError(f"--control-host {host} is reachable from other machines, and the control API can "
                            f"stop this node; pass --allow-remote-control to do it anyway, or use 127.0.0.1")
        log.warning("%s", remote_warning(host))
    source = StatusSource(node)
    closing = threading.Event()
    server, bound = None, 0
    if port is not None:
        # SO_REUSEPORT is on by default in grpc: a second node would silently share the port.
        # One worker per RPC in flight (a watcher holds one); more callers get RESOURCE_EXHAUSTED, not a hang.
        server = grpc.server(ThreadPoolExecutor(max_workers=MAX_RPCS, thread_name_prefix="control"),
                             options=[("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=MAX_RPCS)
        control_pb2_grpc.add_ControlServicer_to_server(ControlService(node, source, closing), server)
        bound = _add_port(server, host, port)
        if not bound and any_port_if_taken and port:
            bound = _add_port(server, host, 0)
            if bound:
                log.warning("control API: port %d on %s is taken (another node?); serving on port %d instead: "
                            "locoswarm status --control %s", port, host, bound, format_hostport(host, bound))
        if not bound:
            server.stop(None)
            raise _bind_error(host, port, "--control-port")
    metrics = None
    if metrics_port:
        try:
            metrics = start_metrics_server(source.snapshot, host, metrics_port)
        except UserError:
            if server is not None:
                server.stop(None)
            raise
    if server is not None:
        server.start()
    source.control_port, source.metrics_port = bound, metrics.port if metrics else 0
    source.start()
    if server is not None:
        where = format_hostport(host, bound)
        hint = "" if bound == DEFAULT_CONTROL_PORT and host == DEFAULT_CONTROL_HOST else f" --control {where}"
        log.info("control API on %s; watch this node with: locoswarm status%s", where, hint)
    if metrics is not None:
        log.info("Prometheus metrics on http://%s/metrics", format_hostport(host, metrics.port))
    return ControlServer(source, server, bound, metrics, closing)


__all__ = [
    "ControlServer",
    "ControlService",
    "StatusSource",
    "peers_from_heartbeats",
    "start_control_server",
    "status_from_proto",
    "status_to_proto",
]
