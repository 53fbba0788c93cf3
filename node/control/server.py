"""The ``Control`` gRPC service of a running node (``protocol/control.proto``).

``locoswarm run`` serves it on 127.0.0.1:7615 by default. It answers from ``Node.status_snapshot()`` (a
:class:`locoswarm.node.status.NodeStatus`) plus what a :class:`StatusSource` samples once a second from cheap node
attributes: the loss history (for the TUI's sparkline), byte rates, and peer joins and leaves (the daemon
keeps only its own events). The full status is built on demand only and cached briefly: building it hashes
every fragment's phi, which is not free for a large model, and several watchers must not multiply that cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from locoswarm.node.control import (
    DEFAULT_CONTROL_HOST,
    DEFAULT_CONTROL_PORT,
    check_control_options,
    format_hostport,
    is_loopback,
    remote_warning,
)
from locoswarm.node.control.metrics import start_metrics_server
from locoswarm.node.errors import UserError
from locoswarm.node.status import LossSample, NodeStatus, StatusEvent
from locoswarm.node.swarm.dht import tcp_port_free
from locoswarm.protocol import control_pb2, control_pb2_grpc

if TYPE_CHECKING:  # pragma: no cover
    from locoswarm.node.control.metrics import MetricsServer
    from locoswarm.node.daemon import Node

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
    """The node's status as the control API and metrics serve it: ``Node.status_snapshot()`` with what only
    a watcher over time can know (see the module docstring).

    ``node`` needs ``status_snapshot()``; ``loss``, ``local_step``, ``clock``, ``counters`` and ``peer_table``
    are read when present, so a node still starting (or a stand-in in tests) works too.
    """

    def __init__(self, node: Any, *, interval: float = SAMPLE_INTERVAL_S, cache_s: float = 0.5) -> None:
        self.node = node
        self.interval = interval
        self.cache_s = cache_s
        self._loss: deque[LossSample] = deque(maxlen=HISTORY)
        self._bytes: deque[tuple[float, int, int]] = deque()
        self._peers: set[str] | None = None
        self._peer_events: deque[StatusEvent] = deque(maxlen=PEER_EVENTS)
        self._cache: tuple[float, NodeStatus] | None = None
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
        loss = getattr(node, "loss", None)
        step = int(getattr(node, "local_step", 0) or 0)
        with self._lock:
            if loss is not None and (not self._loss or self._loss[-1].inner_step != step):
                self._loss.append(LossSample(time=now, inner_step=step, loss=float(loss)))
            counters = getattr(node, "counters", None)
            if counters is not None:
                self._bytes.append((now, int(counters.total_sent), int(counters.total_received)))
                while len(self._bytes) > 2 and now - self._bytes[1][0] >= RATE_WINDOW_S:
                    self._bytes.popleft()
            peers = set(_copy(getattr(node, "peer_table", {}) or {}))
            clock = int(getattr(node, "clock", 0) or 0)
            if self._peers is not None:
                for pid in sorted(peers - self._peers):
                    self._peer_events.append(StatusEvent(time=now, kind="peer_joined", peer_id=pid, clock=clock,
                                                         detail=f"peer {pid} joined the swarm"))
                for pid in sorted(self._peers - peers):
                    self._peer_events.append(StatusEvent(
                        time=now, kind="peer_left", peer_id=pid, clock=clock,
                        detail=f"peer {pid} left (leaving heartbeat, or none for a while)"))
            self._peers = peers

    def _rates(self) -> tuple[float, float]:
        if len(self._bytes) < 2:
            return 0.0, 0.0
        (t0, s0, r0), (t1, s1, r1) = self._bytes[0], self._bytes[-1]
        dt = max(t1 - t0, 1e-6)
        return max(0, s1 - s0) / dt, max(0, r1 - r0) / dt

    def _node_status(self) -> NodeStatus:
        """``Node.status_snapshot()``, retried: it copies dicts other threads may be growing at that moment."""
        for attempt in range(3):
            try:
                return self.node.status_snapshot()
            except RuntimeError:  # "dictionary changed size during iteration"
                if attempt == 2:
                    raise
                time.sleep(0.01)
        raise AssertionError("unreachable")

    def snapshot(self) -> NodeStatus:
        """The node's status with the samples (cached for ``cache_s``)."""
        now = time.time()
        with self._lock:
            if self._cache is not None and now - self._cache[0] < self.cache_s:
                return self._cache[1]
        st = self._node_status()
        with self._lock:
            st = self._enrich(st)
            self._cache = (now, st)
        return st

    def _enrich(self, st: NodeStatus) -> NodeStatus:
        sent_per_s, received_per_s = self._rates()
        # the node's last EVENTS and ours, apart: a flood of failed rounds must not push joins out
        events = sorted([*st.events[-EVENTS:], *self._peer_events], key=lambda e: e.time)
        return dataclasses.replace(st, loss_history=list(self._loss), events=events,
                                   bytes=dataclasses.replace(st.bytes, sent_per_s=sent_per_s,
                                                             received_per_s=received_per_s))


def _copy(d: Any) -> dict:
    """``dict(d)`` of a dict another thread may be growing (its size changing mid-copy raises)."""
    for _ in range(5):
        try:
            return dict(d)
        except RuntimeError:
            time.sleep(0.001)
    return {}


# ---- the service ---------------------------------------------------------------------------------------

class ControlService(control_pb2_grpc.ControlServicer):
    """The RPC handlers; every answer comes from one :class:`StatusSource`."""

    def __init__(self, node: Any, source: StatusSource, closing: threading.Event) -> None:
        self.node = node
        self.source = source
        self.closing = closing

    def GetStatus(self, request: control_pb2.StatusRequest, context: grpc.ServicerContext) -> control_pb2.Status:
        return self.source.snapshot().to_proto()

    def WatchStatus(self, request: control_pb2.WatchRequest,
                    context: grpc.ServicerContext) -> Iterator[control_pb2.Status]:
        interval = min(max(request.interval_s or SAMPLE_INTERVAL_S, MIN_WATCH_S), MAX_WATCH_S)
        while context.is_active() and not self.closing.is_set():
            yield self.source.snapshot().to_proto()
            if self.closing.wait(interval):
                break

    def ListPeers(self, request: control_pb2.ListPeersRequest, context: grpc.ServicerContext) -> control_pb2.PeerList:
        st = self.source.snapshot()
        return control_pb2.PeerList(peers=[peer.to_proto(pid) for pid, peer in st.peers.items()], now=st.now)

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
    "start_control_server",
]
