"""The control API, ``locoswarm status`` and the metrics endpoint.

Unit tests use a stand-in node; the rest share ONE real ``locoswarm run`` (throttled, one thread,
module-scoped) and talk to it through real gRPC, HTTP, a real terminal (tmux) and a DHT client that
publishes a second peer's heartbeat. The daemon is asked to leave through the API at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console
from swarm_util import REPO, NodeProc, bootstrap_addr, write_config, write_corpus

from locoswarm.node.control import NodeUnreachable, check_control_options, control_port_from_args, parse_hostport
from locoswarm.node.control.metrics import render_metrics
from locoswarm.node.control.server import StatusSource, start_control_server
from locoswarm.node.control.tui import render, short_id, sparkline
from locoswarm.node.errors import UserError
from locoswarm.node.status import (
    ByteStatus,
    ConsensusStatus,
    EvalPoint,
    FragmentStatus,
    MemoryStatus,
    NodePeerStatus,
    NodeStatus,
    ReputationStatus,
    Spread,
    StatusEvent,
    SwarmView,
)
from locoswarm.node.swarm.counters import ByteCounters
from locoswarm.node.swarm.reputation import Reputation
from locoswarm.protocol import swarm_pb2

pytestmark = pytest.mark.timeout(120)

SELF = "QmSelf" + "B" * 40
PEER = "QmPeer" + "A" * 40
OUTSIDER = "QmOutsider" + "C" * 36   # never published a heartbeat: a non-member attacker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
    full.update(OMP_NUM_THREADS="1", COLUMNS="120", **(env or {}))
    return subprocess.run([sys.executable, "-m", "locoswarm.node.cli", *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=timeout)


# ---- a stand-in node ----------------------------------------------------------------------------------

def fake_counters() -> ByteCounters:
    """The real byte counters, filled as after one round with one peer over two fragments."""
    counters = ByteCounters()
    for fragment in (0, 1):
        counters.sent(PEER, fragment, 10, 60_000)
        counters.received(PEER, fragment, 10, 59_000)
    return counters


class FakeNode:
    """What the control server reads of a Node, with two fragments and one peer."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.loss = 3.2
        self.local_step, self.clock = 120, 124
        self.counters = fake_counters()
        now = time.time()
        hb = swarm_pb2.Heartbeat(peer_id=PEER, clock=124, inner_step=118, tokens_per_s=900.0, loss=3.1, time=now - 1,
                                 has_state=True, control_port=7616,
                                 fragments=[swarm_pb2.FragmentStatus(fragment=0, version=7, phi_hash=5, phi_norm=10),
                                            swarm_pb2.FragmentStatus(fragment=1, version=6, phi_hash=6, phi_norm=10)])
        self.peer_table = {PEER: hb}
        # the real Reputation on a frozen clock: the outsider is banned (cool-down 600 s), PEER was rate-limited
        self.reputation = Reputation(now=lambda: 5000.0, log=logging.getLogger("test.reputation"))
        for kind in ("forged_sender", "non_member", "forged_sender"):
            self.reputation.refuse(OUTSIDER, kind, f"{kind} part for fragment 0 round 112")
        self.reputation.refuse(OUTSIDER, "banned", "part refused: banned", offence=False)
        for _ in range(2):
            self.reputation.refuse(PEER, "rate_limited", "state download again within 5 s", offence=False)
        self.merged = StatusEvent(time=now - 5, kind="merged", detail="fragment 0 round v7", clock=120, fragment=0,
                                  round=112, bytes_sent=30_000, bytes_received=29_000, group_size=2, version=7,
                                  own_weight=1.0, total_weight=2.0)
        self.events = [
            StatusEvent(time=now - 30, kind="joined", detail="downloaded 2/2 fragments from 1 peer(s)", clock=10),
            self.merged,
            StatusEvent(time=now - 3, kind="failed", detail="fragment 1 round v6: round timed out after 10 s",
                        clock=122, fragment=1, round=116, version=6)]

    def status_snapshot(self) -> NodeStatus:  # what Node.status_snapshot() builds, from the same figures
        c, merged = self.counters, self.merged
        reputation = ReputationStatus.from_json(self.reputation.snapshot())
        peers = {}
        for pid, hb in self.peer_table.items():
            judged = reputation.peers[pid]
            peers[pid] = dataclasses.replace(NodePeerStatus.from_heartbeat(hb), bytes_sent=c.sent_by_peer[pid],
                                             bytes_received=c.received_by_peer[pid], refused=judged.refused,
                                             banned=judged.banned)
        return NodeStatus(
            peer_id=SELF, fingerprint="1a2b3c4d5e6f7a8b", swarm="test-swarm", addrs=["/ip4/127.0.0.1"], pid=123,
            uptime_s=75.3, clock=self.clock, inner_step=self.local_step, tokens=15360, state="training",
            loss=self.loss, tokens_per_s=1024.5, compute_utilization=0.83,
            eval_curve=[EvalPoint(0, 5.5), EvalPoint(100, 3.4)],
            fragments=[FragmentStatus(fragment=0, version=7, numel=54000, last_send=112, quant_error=0.034,
                                      phi_hash=12345, phi_norm=10.0, bytes_sent=c.sent_by_fragment[0],
                                      bytes_received=c.received_by_fragment[0], group_size=merged.group_size,
                                      last_merge_time=merged.time, last_merge_clock=merged.clock,
                                      spread=Spread(version=7, holders=2, distinct_hashes=1, max_version=7)),
                       FragmentStatus(fragment=1, version=6, numel=53000, bytes_sent=c.sent_by_fragment[1],
                                      bytes_received=c.received_by_fragment[1],
                                      spread=Spread(max_version=6, max_lag=1))],
            peers=peers, syncs_ok=5, syncs_failed=1, solo_steps=3,
            consensus=ConsensusStatus(rounds=4, failed=3, last_error="no peer in group"),
            memory=MemoryStatus(rss=1_500_000_000, peak_rss=2_000_000_000, device="cuda:0",
                                device_allocated=3_200_000_000, device_peak=5_100_000_000,
                                device_total=80_000_000_000),
            bytes=ByteStatus(sent=c.total_sent, received=c.total_received, sent_by_peer=dict(c.sent_by_peer),
                             received_by_peer=dict(c.received_by_peer), sent_by_fragment=dict(c.sent_by_fragment),
                             received_by_fragment=dict(c.received_by_fragment)),
            reputation=reputation, events=list(self.events), now=time.time())


@pytest.fixture
def fake():
    node = FakeNode()
    source = StatusSource(node, cache_s=0.0)  # no cache: each snapshot shows the changes a test just made
    for i in range(6):
        node.loss = 3.2 - 0.1 * i
        node.local_step += 1
        node.counters.sent_by_peer[PEER] += 1000
        source.sample(now=1000.0 + i)
    return node, source


def text_of(status: NodeStatus | SwarmView, width: int) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(render(status, width))
    return console.export_text()


# ---- unit tests ---------------------------------------------------------------------------------------

def test_status_source_samples_history_rates_and_peer_churn(fake):
    node, source = fake
    st = source.snapshot()
    assert [s.inner_step for s in st.loss_history] == list(range(121, 127))
    assert [s.loss for s in st.loss_history] == pytest.approx([3.2 - 0.1 * i for i in range(6)])
    assert st.bytes.sent_per_s == pytest.approx(1000.0)  # 1000 B per 1 s sample
    hb = node.peer_table.pop(PEER)
    source.sample(now=time.time() + 100)
    node.peer_table[PEER] = hb
    source.sample(now=time.time() + 101)
    events = source.snapshot().events
    assert [(e.kind, e.peer_id) for e in events[-2:]] == [("peer_left", PEER), ("peer_joined", PEER)]
    assert [e.kind for e in events[:3]] == ["joined", "merged", "failed"]  # the node's own, in time order


def test_proto_round_trip_keeps_the_status(fake):
    _, source = fake
    st = source.snapshot()
    back = NodeStatus.from_proto(st.to_proto())
    assert back == st
    assert back.fragments[1].last_send is None and back.fragments[1].quant_error is None
    assert back.spread_by_fragment()[0].distinct_hashes == 1 and back.spread_by_fragment()[1].version is None
    assert back.bytes.sent_by_fragment == {0: 60_000, 1: 60_000}
    assert back.peers[PEER].fragments == {0: 7, 1: 6} and back.peers[PEER].control_port == 7616
    assert back.consensus == ConsensusStatus(rounds=4, last_shift=None, failed=3, last_error="no peer in group")
    assert back.reputation.refused == 6 and back.reputation.banned == 1
    outsider = back.reputation.peers[OUTSIDER]
    assert outsider.banned and outsider.banned_for_s == 600.0 and outsider.offences == 3
    assert outsider.by_kind == {"banned": 1, "forged_sender": 2, "non_member": 1}
    assert back.peers[PEER].refused == 2 and back.peers[PEER].banned is False
    assert OUTSIDER not in back.peers  # no heartbeat: only in the reputation
    assert back.events[1].own_weight == 1.0 and back.events[0].fragment is None


@pytest.mark.parametrize("width", [100, 120, 140])
def test_tui_frame_at_fixed_widths(fake, width):
    _, source = fake
    st = NodeStatus.from_proto(source.snapshot().to_proto())
    text = text_of(st, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    for needle in ("test-swarm", SELF, "training", "1.0k tok/s", "83%", "fragments", "last sync", "staleness",
                   "quant err", "3.4%", "2 at v7 agree", "3 outer steps with no peer", "swarm (1 peer in the DHT)",
                   "(this node)", "recent events",
                   "joined", "timed out", "60.0 kB", "eval 3.400", "1.5 GB (peak 2.0 GB)",
                   "cuda:0", "3.2 GB (peak 5.1 GB) of 80.0 GB"):
        assert needle in text, (needle, text)
    assert short_id(PEER, 16 if width < 110 else 24 if width < 130 else 52) in text
    assert "4 steps" in text  # staleness: clock 124 - merged at 120
    spark = re.search(r"loss +\S+ ([▁▂▃▄▅▆▇█]+)", text)
    assert spark and len(spark.group(1)) == 6, text


@pytest.mark.parametrize("width", [100, 140])
def test_tui_shows_refused_and_banned_peers(fake, width):
    node, source = fake
    for kind in ("bad_weight", "bad_weight", "impossible_clock"):  # PEER, a member with a heartbeat, banned too
        node.reputation.refuse(PEER, kind, "token weight 1e30 > bound 4.1e5")
    text = text_of(NodeStatus.from_proto(source.snapshot().to_proto()), width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "peers  9 refused   2 banned" in text  # the network panel's totals
    id_width = 16 if width < 110 else 52
    row = next(line for line in text.splitlines() if line.startswith(" " + short_id(PEER, id_width) + " banned"))
    assert re.search(r" 5 +\d+s ago *$", row), row  # its refused count, then last seen
    assert "refused / banned peers (9 refused, 2 banned)" in text
    outsider = next(line for line in text.splitlines() if short_id(OUTSIDER, id_width) in line)
    assert re.search(r"none +4 +3 +banned 10m00s +forged_sender 2, banned 1", outsider), outsider
    assert "bad_weight 2, rate_limited 2" in text


def test_tui_without_refusals_or_reputation(fake):
    _, source = fake
    st = NodeStatus.from_proto(source.snapshot().to_proto())
    peers = {pid: dataclasses.replace(p, refused=0, banned=False) for pid, p in st.peers.items()}
    text = text_of(dataclasses.replace(st, reputation=ReputationStatus(), peers=peers), 120)
    assert "peers  0 refused   0 banned" in text and "refused / banned peers" not in text
    row = next(line for line in text.splitlines() if line.startswith(" " + short_id(PEER, 24)))
    assert re.search(r"v7 v6 +— +0 +\d+s ago *$", row), row  # no reachability in its heartbeat: "—"


def test_tui_swarm_mode_and_helpers():
    from locoswarm.node.config import load_config
    from locoswarm.node.control.cli import swarm_view

    cfg = load_config(None, [])
    hb = swarm_pb2.Heartbeat(peer_id=PEER, clock=50, inner_step=48, tokens_per_s=1500, loss=2.0, time=99.0,
                             fragments=[swarm_pb2.FragmentStatus(fragment=0, version=3, phi_hash=1, phi_norm=1.0)],
                             reachability="outbound-only")
    text = text_of(swarm_view({PEER: hb}, cfg, f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", now=100.0), 120)
    assert "swarm (1 peer in the DHT)" in text and "1.5k" in text and "1s ago" in text and "v3" in text
    assert "(this node)" not in text and "alone (max v3)" in text
    # its reachability as its heartbeat says; refusals are a node's own judgement: none in the swarm view
    assert re.search(r"v3 +outbound-only +— +1s ago", text), text
    empty = text_of(swarm_view({}, cfg, "/ip4/127.0.0.1/tcp/1", now=100.0), 120)
    assert "is --config the swarm's peers.toml?" in empty
    assert sparkline([3.0, 2.0, 1.0], 10) == "█▅▁" and sparkline([], 5) == ""


def test_metrics_text_format(fake):
    _, source = fake
    text = render_metrics(source.snapshot())
    families = re.findall(r"^# TYPE (\S+) (counter|gauge)$", text, re.M)
    names = dict(families)
    for name, kind in [("locoswarm_tokens_total", "counter"), ("locoswarm_inner_steps_total", "counter"),
                       ("locoswarm_loss", "gauge"), ("locoswarm_tokens_per_second", "gauge"),
                       ("locoswarm_bytes_sent_total", "counter"), ("locoswarm_fragment_version", "gauge"),
                       ("locoswarm_syncs_total", "counter"), ("locoswarm_peers", "gauge"),
                       ("locoswarm_uptime_seconds", "gauge")]:
        assert names.get(name) == kind, name
        assert f"# HELP {name} " in text
    assert all(kind == "counter" for name, kind in families if name.endswith("_total"))
    sample = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)+\})? (-?[0-9.e+-]+|NaN|[+-]Inf)$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
    assert f'locoswarm_bytes_sent_total{{peer="{PEER}"}} 126000' in text
    assert 'locoswarm_fragment_version{fragment="0"} 7' in text
    assert 'locoswarm_syncs_total{result="failed"} 1' in text
    assert 'locoswarm_consensus_rounds_total{result="ok"} 4' in text
    assert 'locoswarm_consensus_rounds_total{result="failed"} 3' in text
    assert "locoswarm_peers 1" in text
    assert 'locoswarm_fragment_staleness_steps{fragment="0"} 4' in text
    assert f'locoswarm_refused_total{{peer="{OUTSIDER}",kind="forged_sender"}} 2' in text
    assert f'locoswarm_refused_total{{peer="{PEER}",kind="rate_limited"}} 2' in text
    assert f'locoswarm_peer_banned{{peer="{OUTSIDER}"}} 1' in text
    assert f'locoswarm_peer_banned{{peer="{PEER}"}} 0' in text
    assert "locoswarm_banned_peers 1" in text
    assert "locoswarm_memory_rss_bytes 1500000000" in text and "locoswarm_memory_peak_rss_bytes 2000000000" in text
    assert 'locoswarm_device_memory_bytes{device="cuda:0",kind="peak"} 5100000000' in text
    assert "locoswarm_device_memory_bytes" not in render_metrics(NodeStatus())  # none on the CPU
    assert names.get("locoswarm_refused_total") == "counter" and names.get("locoswarm_peer_banned") == "gauge"
    tricky = render_metrics(NodeStatus(peer_id='a"b\\c\nd'))
    assert 'peer_id="a\\"b\\\\c\\nd"' in tricky


def test_control_flags_are_checked(monkeypatch):
    assert parse_hostport("127.0.0.1:7000") == ("127.0.0.1", 7000)
    assert parse_hostport(":7001") == ("127.0.0.1", 7001)
    assert parse_hostport("[::1]:7002") == ("::1", 7002)
    assert parse_hostport("localhost") == ("localhost", 7615)
    with pytest.raises(UserError, match="not a TCP port"):
        parse_hostport("127.0.0.1:http")
    with pytest.raises(UserError, match="--allow-remote-control"):
        check_control_options("0.0.0.0", {"--control-port": 7615}, allow_remote=False)
    assert "reachable from other machines" in check_control_options("0.0.0.0", {"--control-port": free_port()},
                                                                    allow_remote=True)
    assert check_control_options("127.0.0.1", {"--control-port": 0, "--metrics-port": 0}, False) is None
    with pytest.raises(UserError, match="not an IP address"):
        check_control_options("example.org", {"--control-port": 7615}, allow_remote=True)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"--control-port: port {port} on 127.0.0.1 is already in use"):
            check_control_options("127.0.0.1", {"--control-port": port}, allow_remote=False)
        check_control_options("127.0.0.1", {"--control-port": port}, False, may_be_taken={"--control-port"})
    monkeypatch.delenv("LOCOSWARM_CONTROL_PORT", raising=False)
    assert control_port_from_args(None) == (7615, True) and control_port_from_args(0) == (0, False)
    monkeypatch.setenv("LOCOSWARM_CONTROL_PORT", "7700")
    assert control_port_from_args(None) == (7700, False)
    monkeypatch.setenv("LOCOSWARM_CONTROL_PORT", "x")
    with pytest.raises(UserError, match="LOCOSWARM_CONTROL_PORT"):
        control_port_from_args(None)


def test_server_binding_rules(fake, caplog):
    node, _ = fake
    with pytest.raises(UserError, match="--allow-remote-control"):
        start_control_server(node, "0.0.0.0", 0, allow_remote=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_control_server(node, "127.0.0.1", port, allow_remote=False)
        with pytest.raises(UserError, match=f"--metrics-port: port {port}"):
            start_control_server(node, "127.0.0.1", None, allow_remote=False, metrics_port=port)
        with caplog.at_level(logging.WARNING, logger="locoswarm.control"):
            moved = start_control_server(node, "127.0.0.1", port, allow_remote=False, any_port_if_taken=True)
        try:
            assert moved.port not in (0, port) and f"port {port} on 127.0.0.1 is taken" in caplog.text
        finally:
            moved.stop()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="locoswarm.control"):
        remote = start_control_server(node, "0.0.0.0", 0, allow_remote=True)
    remote.stop()
    assert "reachable from other machines" in caplog.text


def test_status_without_a_node_says_so_and_exits_1():
    port = free_port()
    res = cli("status", "--once", env={"LOCOSWARM_CONTROL": f"127.0.0.1:{port}"})
    assert res.returncode == 1, res
    assert res.stderr == (f"locoswarm: error: no node answers on 127.0.0.1:{port} (is 'locoswarm run' running? "
                          f"start one or pass --control HOST:PORT)\n")
    assert res.stdout == ""
    res = cli("status", "--json", "--control", "127.0.0.1:notaport")
    assert res.returncode == 2 and "not a TCP port" in res.stderr and "Traceback" not in res.stderr
    with pytest.raises(NodeUnreachable):
        from locoswarm.node.control.cli import ControlClient

        client = ControlClient("127.0.0.1", port)
        try:
            client.status()
        finally:
            client.close()


# ---- one real daemon ------------------------------------------------------------------------------------

class Daemon:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = write_config(root / "peers.toml")
        data = write_corpus(root / "data", docs=4, lines=100)
        self.control, self.metrics = free_port(), free_port()
        self.proc = NodeProc("node", root / "state", ["--config", str(self.config), "--data", str(data),
                                                       "--eval-every", "25", "--throttle", "3",
                                                       "--control-port", str(self.control),
                                                       "--metrics-port", str(self.metrics)], root / "node.log")
        st = self.proc.wait_status(lambda s: s.get("state") == "training" and s.get("inner_step", 0) > 0, 90,
                                   "training")  # status.json, read as plain JSON like the benchmarks read it
        self.peer_id, self.addr = st["peer_id"], bootstrap_addr(st)

    def client(self):
        from locoswarm.node.control.cli import ControlClient

        return ControlClient("127.0.0.1", self.control)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("control"))
    try:
        yield d
    finally:
        if d.proc.proc.poll() is None:  # a test failed before the leave test: SIGTERM, so it cleans up
            with contextlib.suppress(Exception):
                d.proc.terminate(30)
        d.proc.stop()
        assert not d.proc.group_alive(), "the daemon left processes behind"


def test_real_daemon_status_over_grpc(daemon):
    client = daemon.client()
    try:
        st = client.status()
        assert st.peer_id == daemon.peer_id and st.swarm == "test-swarm" and st.state == "training"
        assert st.control_port == daemon.control and st.metrics_port == daemon.metrics
        assert st.inner_step > 0 and st.tokens > 0 and st.loss is not None and math.isfinite(st.loss)
        assert [f.fragment for f in st.fragments] == [0, 1] and all(f.numel > 0 for f in st.fragments)
        assert all(f.phi_norm is not None and f.phi_norm > 0 for f in st.fragments)
        assert 0 < st.compute_utilization < 1 and st.uptime_s > 0
        # Its own process, measured: the model and torch alone take tens of MB; no accelerator here.
        assert 30e6 < st.memory.rss <= st.memory.peak_rss < 20e9 and st.memory.device == "cpu"
        assert st.memory.device_allocated is None and st.memory.device_peak is None
        assert st.eval_curve and st.peers == {}
        assert st.reputation == ReputationStatus()
        on_disk = json.loads((daemon.proc.state_dir / "status.json").read_text())
        assert on_disk["peer_id"] == st.peer_id and NodeStatus.from_json(on_disk).fingerprint == st.fingerprint
        frames = []
        for frame in client.watch(interval=0.3):  # at least 4 frames, and >1 s so the sampler has run
            frames.append(frame)
            if (len(frames) >= 4 and frame.loss_history) or len(frames) == 12:
                break
        assert [f.now for f in frames] == sorted(f.now for f in frames)
        assert frames[-1].inner_step > frames[0].inner_step
        assert frames[-1].loss_history, "the sampler records the loss once a second"
    finally:
        client.close()


def test_real_daemon_metrics_endpoint(daemon):
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    steps = int(re.search(r"^locoswarm_inner_steps_total (\d+)$", text, re.M).group(1))
    assert steps > 0 and f'peer_id="{daemon.peer_id}"' in text
    assert 'locoswarm_fragment_version{fragment="1"}' in text
    assert re.search(r"^locoswarm_banned_peers 0$", text, re.M)


def test_real_daemon_a_second_run_on_its_port_is_refused(daemon, tmp_path):
    res = cli("run", "--config", str(daemon.config), "--state-dir", str(tmp_path / "other"),
              "--control-port", str(daemon.control))
    assert res.returncode == 2, res
    assert f"--control-port: port {daemon.control} on 127.0.0.1 is already in use" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "other").exists()
    res = cli("run", "--config", str(daemon.config), "--state-dir", str(tmp_path / "other"),
              "--control-host", "0.0.0.0")
    assert res.returncode == 2 and "--allow-remote-control" in res.stderr


FAKE_PEER = """
import glob, os, signal, sys, threading
from pathlib import Path
from hivemind.utils import get_dht_time
from locoswarm.node.config import load_config
from locoswarm.node.swarm.dht import start_dht
from locoswarm.node.swarm.membership import Membership
from locoswarm.protocol import swarm_pb2

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
# its own libp2p identity: heartbeats are signed with it (start_dht installs the record validators)
dht = start_dht([sys.argv[2]], identity_path=Path(sys.argv[3]) / "identity.key", attempts=3, client_mode=True,
                log=lambda line: print(line, file=sys.stderr))
try:
    membership = Membership(dht, load_config(sys.argv[1], []), str(dht.peer_id))
    print(dht.peer_id, flush=True)
    while not stop.is_set():
        membership.publish(swarm_pb2.Heartbeat(
            peer_id=str(dht.peer_id), clock=0, inner_step=77, tokens=1000, tokens_per_s=4321.0, loss=2.5,
            time=get_dht_time(), has_state=False,
            fragments=[swarm_pb2.FragmentStatus(fragment=0, version=0, phi_hash=1, phi_norm=1.0)]))
        stop.wait(0.5)
finally:
    dht.shutdown()
    for path in glob.glob(f"/dev/shm/torch_{os.getpid()}_*"):  # hivemind's shared future state, ours alone
        os.unlink(path)
"""


@pytest.fixture
def fake_peer(daemon, tmp_path):
    """A second swarm member as the DHT sees it: a DHT client (its own process, so its hivemind state
    leaves with it) publishing a heartbeat every 0.5 s; it never holds state, so rounds ignore it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
    proc = subprocess.Popen([sys.executable, "-c", FAKE_PEER, str(daemon.config), daemon.addr,
                             str(tmp_path / "fake-peer")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        peer_id = proc.stdout.readline().strip()
        assert peer_id, "the fake peer did not start"
        yield peer_id
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(5)
        proc.stdout.close()


def test_real_daemon_peers_tui_and_swarm_view(daemon, fake_peer, tmp_path):
    client = daemon.client()
    try:
        deadline = time.monotonic() + 30
        while fake_peer not in client.peers() and time.monotonic() < deadline:
            time.sleep(0.3)
        peers = client.peers()
        assert fake_peer in peers and peers[fake_peer].inner_step == 77
        assert peers[fake_peer].tokens_per_s == pytest.approx(4321.0)
        time.sleep(1.2)  # one sampler tick: the join becomes an event
        st = client.status()
        assert any(e.kind == "peer_joined" and e.peer_id == fake_peer for e in st.events)
    finally:
        client.close()

    # --once and --json of the real CLI
    once = cli("status", "--once", "--control", f"127.0.0.1:{daemon.control}")
    assert once.returncode == 0, once.stderr
    for needle in (daemon.peer_id, "(this node)", "peer joined", "swarm (1 peer in the DHT)", "4.3k"):
        assert needle in once.stdout, (needle, once.stdout)
    assert max(map(len, once.stdout.splitlines())) <= 120
    assert "Ctrl+C" not in once.stdout and "refreshed every second" not in once.stdout  # one frame, not a live view
    as_json = cli("status", "--json", env={"LOCOSWARM_CONTROL": f"127.0.0.1:{daemon.control}"})
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["peer_id"] == daemon.peer_id

    # the live TUI in a real terminal (tmux, 120x40)
    if shutil.which("tmux"):
        sock, done = tmp_path / "tmux.sock", tmp_path / "exit"
        tmux = ["tmux", "-S", str(sock)]
        cmd = (f"{sys.executable} -m locoswarm.node.cli status --control 127.0.0.1:{daemon.control}; "
               f"echo $? > {done}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCOSWARM_", "TMUX"))}
        subprocess.run([*tmux, "new-session", "-d", "-x", "120", "-y", "40", "-c", str(REPO), cmd], env=env,
                       check=True, timeout=10)
        try:
            screen, deadline = "", time.monotonic() + 30
            while "recent events" not in screen and time.monotonic() < deadline:
                time.sleep(0.5)
                screen = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True,
                                        timeout=10).stdout
            assert "recent events" in screen, screen
            for needle in (daemon.peer_id, "training", "fragments", "staleness", "(this node)", "4.3k", "up "):
                assert needle in screen, (needle, screen)
            assert max(map(len, screen.splitlines())) <= 120
            first = re.search(r"step +([\d,]+) inner", screen).group(1)
            time.sleep(2.5)
            again = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True, timeout=10).stdout
            assert re.search(r"step +([\d,]+) inner", again).group(1) != first, "the screen refreshes"
            subprocess.run([*tmux, "send-keys", "C-c"], check=True, timeout=10)
            deadline = time.monotonic() + 15
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert done.exists() and done.read_text().strip() == "0"
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)

    # no local node: the swarm from the DHT
    swarm = cli("status", "--swarm", daemon.addr, "--config", str(daemon.config), "--once")
    assert swarm.returncode == 0, swarm.stderr
    assert "swarm (2 peers in the DHT)" in swarm.stdout, swarm.stdout
    assert short_id(daemon.peer_id, 24) in swarm.stdout and "fragments across peers" in swarm.stdout
    assert "(this node)" not in swarm.stdout and swarm.stderr == ""


def test_real_daemon_leaves_when_asked_then_status_says_no_node(daemon):
    client = daemon.client()
    try:
        accepted, message = client.leave("test")
        assert accepted and "leaving" in message
        with contextlib.suppress(NodeUnreachable):  # unless it is already gone
            assert client.leave("again")[0] is False
    finally:
        client.close()
    assert daemon.proc.proc.wait(60) == 0, daemon.proc.tail()
    assert "left the swarm cleanly" in daemon.proc.tail()
    res = cli("status", "--once", "--control", f"127.0.0.1:{daemon.control}")
    assert res.returncode == 1 and res.stderr.startswith(f"locoswarm: error: no node answers on 127.0.0.1:"
                                                         f"{daemon.control} ")
    with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics}/", timeout=2):
        raise AssertionError("metrics still served after the node left")


def test_repeated_failures_and_drops_are_one_row_each_and_a_join_stays_in_sight() -> None:
    """Beside a silent peer every round fails and every fourth failure drops the carried progress: those repeat
    with the same reason and are summed up in one row per reason, so the join before them stays among the rows."""
    from locoswarm.node.control.tui import _event_rows

    events = [StatusEvent(time=1.0, kind="peer_joined", detail="QmPeer joined", clock=1)]
    for i in range(20):
        events.append(StatusEvent(time=2.0 + i, kind="failed", detail=f"fragment {i % 2} round v0: no peer in group",
                                  clock=2 + i, fragment=i % 2, round=i, version=0))
        if i % 4 == 3:
            events.append(StatusEvent(time=2.5 + i, kind="dropped", fragment=i // 4 % 2, clock=2 + i, version=0,
                                      detail=f"fragment {i // 4 % 2} round v0: 4 rounds in a row failed: the local "
                                             f"progress they carried is dropped (theta <- phi)"))
    rows = _event_rows(events, limit=8)
    assert [(kind, count) for _, kind, count, _ in rows] == [("peer_joined", 1), ("failed", 20), ("dropped", 5)]
    assert rows[1][3] == "no peer in group (fragments 0, 1)"
    assert rows[2][3].startswith("4 rounds in a row failed") and rows[2][3].endswith("(fragments 0, 1)")
