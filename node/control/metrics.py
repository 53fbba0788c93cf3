"""Prometheus metrics of a running node: ``locoswarm run --metrics-port 9615`` -> ``GET /metrics``.

The figures are those of the control API (one :class:`locoswarm.node.control.server.StatusSource`), in the text
exposition format 0.0.4 with conventional names: a ``locoswarm_`` prefix, base units in the name
(``_seconds``, ``_bytes``, ``_ratio``), ``_total`` on counters. A tiny ``http.server`` thread serves them,
so no client library is needed; it listens on the control host (loopback unless the user allowed remote
control), and is off by default.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from locoswarm.node.control import format_hostport
from locoswarm.node.errors import UserError
from locoswarm.node.status import NodeStatus

log = logging.getLogger("locoswarm.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float | int) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[dict[str, object], float | int | None]]) -> None:
        """One metric family; samples whose value is None are left out (the family's HELP/TYPE stay)."""
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if value is None:
                continue
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{label_text}}} {_number(value)}" if label_text else f"{name} {_number(value)}")

    def one(self, name: str, kind: str, help_text: str, value: float | int | None) -> None:
        self.metric(name, kind, help_text, [({}, value)])


def render_metrics(st: NodeStatus) -> str:
    """The node's status (:meth:`StatusSource.snapshot`) in the Prometheus text format."""
    w = _Writer()
    w.metric("locoswarm_info", "gauge", "Constant 1, labelled with this node's identity and state.",
             [({"peer_id": st.peer_id, "swarm": st.swarm, "fingerprint": st.fingerprint, "state": st.state}, 1)])
    w.one("locoswarm_uptime_seconds", "gauge", "Seconds since the node started.", st.uptime_s)
    w.one("locoswarm_inner_steps_total", "counter", "Inner optimizer steps taken by this node.", st.inner_step)
    w.one("locoswarm_swarm_clock_steps", "gauge", "Swarm clock: steps of swarm-wide progress.", st.clock)
    w.one("locoswarm_tokens_total", "counter", "Tokens this node has trained on.", st.tokens)
    w.one("locoswarm_tokens_per_second", "gauge", "Training throughput of this node (tokens per second).",
          st.tokens_per_s)
    w.one("locoswarm_loss", "gauge", "Training loss of the last inner step.", st.loss)
    w.one("locoswarm_eval_loss", "gauge", "Held-out loss of the last evaluation.",
          st.eval_curve[-1].loss if st.eval_curve else None)
    w.one("locoswarm_compute_utilization_ratio", "gauge", "Share of wall time spent in inner steps (0..1).",
          st.compute_utilization)
    w.one("locoswarm_synthetic_step_seconds", "gauge", "Synthetic compute (benchmarks only): seconds per inner "
          "step; 0 for a node that trains.", st.synthetic_step_s)
    m = st.memory
    w.one("locoswarm_memory_rss_bytes", "gauge", "Resident memory of the node's process (rank 0's with --nproc).",
          m.rss)
    w.one("locoswarm_memory_peak_rss_bytes", "gauge", "The most resident memory of the node's process since it "
          "started.", m.peak_rss)
    if m.device_allocated is not None:
        w.metric("locoswarm_device_memory_bytes", "gauge", "Memory PyTorch holds on the training device: now, "
                 "its peak since the start, and the device's capacity.",
                 [({"device": m.device, "kind": kind}, value) for kind, value in
                  (("allocated", m.device_allocated), ("peak", m.device_peak), ("total", m.device_total))])
    r = st.reachability
    w.metric("locoswarm_reachability", "gauge", "1 for this node's reachability: public (peers can dial it), "
             "relayed, outbound-only (behind NAT: it reduces no part and serves no state) or unknown.",
             [({"state": state}, int(r.state == state)) for state in ("public", "relayed", "outbound-only", "unknown")])
    w.one("locoswarm_inbound_streams_total", "counter", "Averaging and state streams peers opened to this node.",
          r.inbound_streams)
    w.one("locoswarm_undialable_peers", "gauge", "Peers this node failed to dial lately: rounds keep it out of "
          "their groups.", r.undialable)
    peers = sorted(st.peers.items())
    w.one("locoswarm_peers", "gauge", "Live peers of the swarm seen in the DHT (this node excluded).", len(peers))
    w.metric("locoswarm_syncs_total", "counter", "Fragment averaging rounds by result.",
             [({"result": "ok"}, st.syncs_ok), ({"result": "failed"}, st.syncs_failed)])
    w.one("locoswarm_catch_ups_total", "counter", "Fragments downloaded from peers to catch up.", st.catch_ups)
    w.one("locoswarm_replays_total", "counter", "Catch-ups that replayed the outer steps missed instead of "
          "downloading the state.", st.replays)
    w.one("locoswarm_catch_up_loops_total", "counter", "Catch-ups of a fragment with no merged round since its "
          "previous catch-up (a node that keeps arriving after its group).", st.catch_up_loops)
    w.one("locoswarm_stalls_cut_total", "counter", "Rounds still running after their stall budget at the end of "
          "the late window, left in flight while training went on (a slow member of the group).", st.stalls_cut)
    w.one("locoswarm_standing_rounds_total", "counter", "Rounds that took the members of the fragment's last merged "
          "round, the swarm being unchanged, without matchmaking through the DHT.", st.standing_rounds)
    w.one("locoswarm_solo_steps_total", "counter", "Outer steps taken with no live peer (a swarm of one).",
          st.solo_steps)
    w.metric("locoswarm_consensus_rounds_total", "counter", "Consensus rounds (fp32 phi averaging) by result.",
             [({"result": "ok"}, st.consensus.rounds), ({"result": "failed"}, st.consensus.failed)])
    b = st.bytes
    for direction, by_peer in (("sent", b.sent_by_peer), ("received", b.received_by_peer)):
        w.metric(f"locoswarm_bytes_{direction}_total", "counter",
                 f"Bytes {direction} in averaging and state transfers, by peer.",
                 [({"peer": p}, n) for p, n in sorted(by_peer.items())])
    for direction, by_fragment in (("sent", b.sent_by_fragment), ("received", b.received_by_fragment)):
        w.metric(f"locoswarm_fragment_bytes_{direction}_total", "counter", f"Bytes {direction}, by fragment.",
                 [({"fragment": f}, n) for f, n in sorted(by_fragment.items())])
    frags = st.fragments
    w.metric("locoswarm_fragment_version", "gauge", "Outer steps applied to the fragment's phi.",
             [({"fragment": f.fragment}, f.version) for f in frags])
    w.metric("locoswarm_fragment_staleness_steps", "gauge", "Swarm steps since the fragment's last merged round.",
             [({"fragment": f.fragment}, None if f.last_merge_clock is None else max(0, st.clock - f.last_merge_clock))
              for f in frags])
    w.metric("locoswarm_fragment_group_size", "gauge", "Members of the fragment's last merged round.",
             [({"fragment": f.fragment}, f.group_size or None) for f in frags])
    w.metric("locoswarm_fragment_quantization_error_ratio", "gauge",
             "Relative error of the fragment's last quantized pseudo-gradient.",
             [({"fragment": f.fragment}, f.quant_error) for f in frags])
    w.metric("locoswarm_fragment_distinct_hashes", "gauge",
             "Distinct phi hashes among the peers at the fragment's shared version (1 = consensus).",
             [({"fragment": f.fragment}, f.spread.distinct_hashes if f.spread and f.spread.version is not None
               else None) for f in frags])
    w.metric("locoswarm_fragment_version_lag", "gauge", "Highest minus lowest fragment version across peers.",
             [({"fragment": f.fragment}, f.spread.max_lag if f.spread else None) for f in frags])
    rep = st.reputation
    rep_peers = sorted(rep.peers.items())
    w.metric("locoswarm_refused_total", "counter", "Things this node refused of a peer (member or not), by kind.",
             [({"peer": p, "kind": k}, n) for p, r in rep_peers for k, n in sorted(r.by_kind.items())])
    w.metric("locoswarm_peer_banned", "gauge", "1 while this node bans the peer (a cool-down after repeated offences).",
             [({"peer": p}, 1 if r.banned else 0) for p, r in rep_peers])
    w.one("locoswarm_banned_peers", "gauge", "Peers this node bans now.", rep.banned)
    w.metric("locoswarm_peer_inner_steps", "gauge", "A peer's inner steps, from its last heartbeat.",
             [({"peer": p}, info.inner_step) for p, info in peers])
    w.metric("locoswarm_peer_tokens_per_second", "gauge", "A peer's throughput, from its last heartbeat.",
             [({"peer": p}, info.tokens_per_s) for p, info in peers])
    w.metric("locoswarm_peer_last_seen_seconds", "gauge", "Seconds since a peer's last heartbeat.",
             [({"peer": p}, max(0.0, st.now - info.time)) for p, info in peers])
    return "\n".join(w.lines) + "\n"


class MetricsServer:
    """A daemon thread serving ``GET /metrics`` (and ``/``) from ``snapshot()``."""

    def __init__(self, httpd: ThreadingHTTPServer) -> None:
        self.httpd = httpd
        self.port = int(httpd.server_address[1])
        self.thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="metrics", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(2.0)


def start_metrics_server(snapshot: Callable[[], NodeStatus], host: str, port: int) -> MetricsServer:
    """Serve ``render_metrics(snapshot())`` on ``http://host:port/metrics``; :class:`UserError` naming the
    port if it is taken."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/", "/metrics"):
                self.send_error(404, "try /metrics")
                return
            try:
                body = render_metrics(snapshot()).encode()
            except Exception as exc:  # report, never kill the thread
                log.warning("metrics: %s", exc)
                self.send_error(500, "status unavailable")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
            log.debug("metrics: " + format, *args)

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    try:
        httpd = Server((host.strip("[]"), port), Handler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"--metrics-port: port {port} on {host} is already in use (another node or program?); "
                            f"pick another port") from None
        raise UserError(f"--metrics-port: cannot listen on {format_hostport(host, port)} "
                        f"({exc.strerror or exc})") from None
    return MetricsServer(httpd)


__all__ = ["CONTENT_TYPE", "MetricsServer", "render_metrics", "start_metrics_server"]
