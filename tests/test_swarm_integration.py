"""Multi-process swarm tests: real ``locoswarm run`` nodes, real hivemind DHTs and p2pd on loopback.

Nodes are observed through their ``status.json``; every node runs in its own process group and is
killed by it at the end. Each test is bounded in time.
"""

from __future__ import annotations

import math
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from swarm_util import NodeProc, bootstrap_addr, write_config, write_corpus

from locoswarm.node.config import load_config
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.payload import payload_size

pytestmark = pytest.mark.timeout(300)


class Swarm:
    def __init__(self, root: Path, **config) -> None:
        self.root = root
        self.config = write_config(root / "peers.toml", **config)
        self.data = write_corpus(root / "data")
        self.nodes: list[NodeProc] = []
        self.boot: str | None = None

    def start(self, name: str, *extra: str, bootstrap: bool = True, config: Path | None = None) -> NodeProc:
        args = ["--config", str(config or self.config), "--data", str(self.data), "--eval-every", "25", *extra]
        if bootstrap and self.boot:
            args += ["--bootstrap", self.boot]
        node = NodeProc(name, self.root / name, args, self.root / f"{name}.log")
        self.nodes.append(node)
        if self.boot is None and bootstrap:
            self.boot = bootstrap_addr(node.wait_status(lambda s: s.get("addrs"), 90, "its addresses"))
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _running(s: Swarm) -> Iterator[Swarm]:
    yield s
    s.stop()
    for node in s.nodes:
        assert not node.group_alive(), f"{node.name} left processes behind"


@pytest.fixture
def swarm(tmp_path):
    yield from _running(Swarm(tmp_path))


@pytest.fixture
def paced_swarm(tmp_path):
    """As ``swarm``, at h = 48: a round of each fragment every 48 steps, not 8. At h = 8 a node resumed after SIGKILL
    sent a round several times a second, each failing with "no peer in group", and caught up 83 times in a row
    without a merged round until the test timed out (a fresh-clone CI run)."""
    yield from _running(Swarm(tmp_path, outer={"h": 48}))


def merged(status: dict) -> list[dict]:
    return [e for e in status.get("events", []) if e["kind"] == "merged"]


def fragments_merged(status: dict) -> set[int]:
    return {e["fragment"] for e in merged(status)}


def phi_views(nodes: list[NodeProc]) -> list[dict[int, tuple[int, int]]]:
    """Per node: {fragment: (version, phi hash)}."""
    return [{f["fragment"]: (f["version"], f["phi_hash"]) for f in n.status().get("fragments", [])} for n in nodes]


def agree(nodes: list[NodeProc]) -> bool:
    """All nodes hold the same phi (hash) at the same version for every fragment."""
    views = phi_views(nodes)
    return all(v == views[0] for v in views[1:]) and all(ver > 0 for ver, _ in views[0].values())


def wait_until(predicate, timeout: float, what: str, nodes: list[NodeProc]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    tails = "\n".join(f"--- {n.name}\n{n.tail(15)}\n--- {n.name}: its last catch-ups, refusals and bans\n"
                      + "\n".join(_decisions(n)) for n in nodes)
    try:
        views = "\n".join(f"{n.name}: {v}" for n, v in zip(nodes, phi_views(nodes), strict=True))
        counts = ("syncs_ok", "syncs_failed", "solo_steps", "catch_ups", "stalls_cut", "standing_rounds")
        statuses = [n.status() for n in nodes]
        views += "\n" + "\n".join(f"{n.name}: " + " ".join(f"{k}={st.get(k)}" for k in counts)
                                  for n, st in zip(nodes, statuses, strict=True))
        views += "\n" + "\n".join(f"{n.name} of {peer[:12]}: {rep}" for n, st in zip(nodes, statuses, strict=True)
                                  for peer, rep in st.get("reputation", {}).get("peers", {}).items())
    except Exception as exc:  # a node that died cannot answer; its tail says why
        views = f"(status unavailable: {exc})"
    raise AssertionError(f"timed out waiting for {what}\nfragment (version, phi hash) per node:\n{views}\n{tails}")


def _decisions(node: NodeProc, n: int = 12) -> list[str]:
    """The last ``n`` lines of a node's log that say why it holds the phi it holds (a failure's diagnosis: a node
    stuck on a lineage of its own either refused the others' phi, had no source to take it from, or was banned)."""
    try:
        lines = node.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    words = ("caught_up:", "refused:", "banned", "folded:", "state download")
    return [line[:300] for line in lines if any(w in line for w in words)][-n:]


def test_three_nodes_average_agree_and_learn_then_a_fourth_joins(tmp_path):
    # Rounds that last a few heartbeats, as in any real swarm (H = 48 steps slowed 4x: ~1.7 s).
    # With the tiny model's 10 ms steps a whole round would pass before a heartbeat announces a joiner,
    # and "within two rounds" would measure heartbeat latency, not the protocol.
    swarm = Swarm(tmp_path, outer={"h": 48, "tau": 4})
    try:
        _three_then_four(swarm)
    finally:
        swarm.stop()
    assert not any(n.group_alive() for n in swarm.nodes), "processes left behind"


def _three_then_four(swarm: Swarm) -> None:
    slow = ("--throttle", "4")
    n0 = swarm.start("n0", *slow)
    n1, n2 = swarm.start("n1", *slow), swarm.start("n2", *slow)
    trio = [n0, n1, n2]
    cfg = load_config(swarm.config)
    for node in trio:  # every fragment gets averaged on every node
        node.wait_status(lambda s: fragments_merged(s) == {0, 1} and len(merged(s)) >= 4, 150,
                         "every fragment averaged twice")
    wait_until(lambda: agree(trio), 60, "outer params to agree across peers", trio)
    # In a swarm that does not change, rounds after the first merged one take its members without
    # matchmaking through the DHT (node/swarm/standing.py), and every merged round says where its time went.
    wait_until(lambda: all(n.status().get("standing_rounds", 0) >= 1 for n in trio), 60,
               "a round on standing members on every node", trio)
    for node in trio:
        timed = merged(node.status())
        assert all(0 <= e["matchmaking_s"] <= e["round_s"] for e in timed), timed

    # Bytes of one round, summed over its members, match the codec payload and the exchange pattern:
    # reduce-scatter + all-gather moves 2 (n-1) payloads in all, plus small protocol headers.
    rounds: dict[tuple[int, int], list[dict]] = {}
    for node in trio:
        for e in merged(node.status()):
            rounds.setdefault((e["fragment"], e["round"]), []).append(e)
    numel = {f["fragment"]: f["numel"] for f in n0.status()["fragments"]}
    full = [(k, evs) for k, evs in rounds.items() if len(evs) == evs[0]["group_size"] == 3]
    assert full, f"no round seen complete on all three nodes: {list(rounds)}"
    codec = get_codec(cfg.outer.codec, cfg.outer.block_size)
    for (fragment, _), evs in full:
        payload = payload_size(codec, numel[fragment])
        total_sent = sum(e["bytes_sent"] for e in evs)
        assert total_sent == sum(e["bytes_received"] for e in evs)
        assert 2 * 2 * payload <= total_sent <= 2 * 2 * payload * 1.02 + 3000, (payload, total_sent)

    st = n0.status()
    first, last = st["eval_curve"][0][1], min(v for _, v in st["eval_curve"])
    assert last < 0.5 * first, st["eval_curve"]
    assert all(math.isfinite(n.status()["loss"]) for n in trio)

    # A fourth node joins mid-training: downloads the outer state and contributes within two rounds.
    n3 = swarm.start("n3", *slow)
    st3 = n3.wait_status(lambda s: any(e["kind"] == "joined" for e in s.get("events", [])), 90, "joined")
    joined = next(e for e in st3["events"] if e["kind"] == "joined")
    assert "downloaded 2/2 fragments" in joined["detail"]
    h = cfg.outer.h
    st3 = n3.wait_status(lambda s: merged(s), 90, "its first merged round")
    # Its first merged round started within three rounds of joining, timed by the round's own clock (its
    # start), not the merge's: a round slower than tau is merged up to the late window (h / F steps) after it
    # started. Two rounds were allowed until two loaded fresh-clone runs measured 160 (merge clock) and 115
    # (round clock) steps; a joiner's first round can fail while the members still count it as a newcomer.
    assert merged(st3)[0]["round"] - joined["clock"] <= 3 * h + cfg.outer.tau, (joined, merged(st3)[0])
    for node in [*trio, n3]:  # graceful leave
        assert node.terminate(60) == 0, node.tail()


def test_a_joiner_with_bf16_momentum_downloads_a_quarter_less_and_stays_with_the_swarm(tmp_path):
    """``network.state_momentum = "bf16"`` on the joiner alone (a per-node setting): its download carries 6 bytes
    per parameter instead of 8, it rounds with the others, and its phi stays within bf16 rounding of theirs."""
    # H = 320: a fragment's version then holds for seconds, longer than the 2 s between two status.json writes
    # of a node (its heartbeat interval), so the three nodes' snapshots meet at equal versions. With H = 16 a CI
    # run's nodes moved 3-4 versions a second and the check never saw all three at one version in 90 s.
    outer = {"h": 320, "tau": 2, "consensus_every": 0}
    swarm = Swarm(tmp_path, outer=outer)
    half = write_config(tmp_path / "bf16.toml", outer=outer, network={"state_momentum": "bf16"})
    try:
        pair = [swarm.start("n0"), swarm.start("n1")]
        for node in pair:
            node.wait_status(lambda s: fragments_merged(s) == {0, 1}, 120, "both fragments averaged")
        n2 = swarm.start("n2", config=half)
        st = n2.wait_status(lambda s: any(e["kind"] == "joined" for e in s.get("events", [])), 90, "joined")
        joined = next(e for e in st["events"] if e["kind"] == "joined")
        assert "downloaded 2/2 fragments" in joined["detail"] and "momentum in bf16" in joined["detail"], joined
        numel = sum(f["numel"] for f in st["fragments"])
        mb = float(joined["detail"].split(" MB")[0].rsplit("(", 1)[1])
        # phi 4 + momentum 2 bytes per parameter, plus the chunks' headers (the detail rounds to 1 kB)
        assert 6 * numel - 500 <= mb * 1e6 <= 6 * numel * 1.05, (mb, numel)
        n2.wait_status(lambda s: len(merged(s)) >= 4, 120, "the joiner's rounds")
        nodes = [*pair, n2]

        def close() -> bool:  # one status read per node: same versions, phi norms within 1e-4 of each other
            views = [{f["fragment"]: (f["version"], f["phi_norm"]) for f in n.status()["fragments"]} for n in nodes]
            return all(all(v[p][0] == views[0][p][0] and abs(v[p][1] - views[0][p][1]) <= 1e-4 * views[0][p][1]
                           for p in views[0]) for v in views[1:])
        wait_until(close, 90, "phi norms within bf16 rounding on all three nodes", nodes)
        assert all(node.terminate(60) == 0 for node in nodes)
    finally:
        swarm.stop()


def test_sigkill_mid_round_stalls_nobody_and_the_node_resumes(paced_swarm):
    swarm = paced_swarm
    nodes = [swarm.start("n0"), swarm.start("n1"), swarm.start("n2", "--checkpoint-every", "10")]
    for node in nodes:
        node.wait_status(lambda s: len(merged(s)) >= 2, 150, "two merged rounds")
    nodes[2].wait_status(lambda s: (nodes[2].state_dir / "checkpoint.json").exists(), 60, "a checkpoint")
    victim, survivors = nodes[2], nodes[:2]
    victim_pid = victim.proc.pid
    before = {n.name: n.status()["syncs_ok"] for n in survivors}
    victim.proc.send_signal(signal.SIGKILL)  # the node process only: its watchdog must clean up the rest
    victim.proc.wait(10)
    deadline = time.monotonic() + 15
    while victim.group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not victim.group_alive(), f"processes of the killed node left: {victim.group_alive()}"
    # The others finish their next rounds within the timeout and apply no partial average.
    cfg = load_config(swarm.config)
    limit = cfg.network.matchmaking_timeout + cfg.network.round_timeout + 30
    for n in survivors:
        n.wait_status(lambda s, n=n: s["syncs_ok"] >= before[n.name] + 3, limit, "three more rounds")
        assert all(math.isfinite(v) for _, v in n.status()["eval_curve"])
        assert math.isfinite(n.status()["loss"])
    wait_until(lambda: agree(survivors), 60, "survivors to agree on phi", survivors)
    # Restarted on its state dir, the node resumes from its checkpoint and rejoins.
    restarted = swarm.start("n2")
    assert restarted.proc.pid != victim_pid
    restarted.wait_status(lambda s: any(e["kind"] == "resumed" for e in s.get("events", [])), 90, "resume")
    st = restarted.wait_status(lambda s: merged(s), 90, "a merged round after resuming")
    assert st["syncs_ok"] >= 1


def test_slow_node_contributes_by_tokens_and_is_not_waited_for(tmp_path):
    # Rounds long enough that compute, not round latency, sets the pace (as in a real swarm).
    swarm = Swarm(tmp_path, outer={"h": 24, "tau": 6}, network={"matchmaking_timeout": 2.0})
    try:
        _slow_node_case(swarm)
    finally:
        swarm.stop()
        assert not any(n.group_alive() for n in swarm.nodes)


def _slow_node_case(swarm: Swarm) -> None:
    fast = [swarm.start("n0", "--throttle", "2"), swarm.start("n1", "--throttle", "2")]
    fast[1].wait_status(lambda s: len(merged(s)) >= 2, 150, "the fast nodes' rounds")
    slow = swarm.start("slow", "--throttle", "6")
    slow.wait_status(lambda s: len(merged(s)) >= 3, 180, "the slow node's merged rounds")
    start_steps = [n.status()["inner_step"] for n in [*fast, slow]]
    time.sleep(10)
    end = [n.status() for n in [*fast, slow]]
    made = [e["inner_step"] - s for e, s in zip(end, start_steps, strict=True)]
    # Not waited for: over the same 10 s the fast nodes make far more steps than the 3x slower one (waited for,
    # they would make about as many). Not 3x: a throttled node sleeps, so on 2 loaded cores its share of the CPU
    # grows (1.79x seen in a full integration run).
    assert min(made[:2]) > 1.5 * made[2], made
    # Contributes, weighted by its tokens: each contribution's weight is the tokens it represents (whole
    # batches of 4 x 32), and a round's total weight is at most the sum of its members' weights (screening
    # caps a weight at the group's lower median and lowers the pull of a member whose direction disagrees,
    # so it may be less) and at least the smallest of them.
    tokens_per_step = 4 * 32
    rounds: dict[tuple[int, int], list[dict]] = {}
    for st in end:
        for e in merged(st):
            rounds.setdefault((e["fragment"], e["round"]), []).append(e)
    complete = [evs for evs in rounds.values() if len(evs) == evs[0]["group_size"] == 3]
    assert complete, "no round seen on all three nodes"
    for evs in complete:
        weights = [e["own_weight"] for e in evs]
        assert min(weights) <= evs[0]["total_weight"] <= sum(weights) * (1 + 1e-6), (weights, evs[0]["total_weight"])
        assert all(e["own_weight"] > 0 and e["own_weight"] % tokens_per_step == 0 for e in evs)
    assert merged(end[2]), "the slow node never contributed"


def test_different_fingerprint_is_refused_by_name(swarm, tmp_path):
    swarm.start("n0")
    other = write_config(tmp_path / "other.toml", outer={"codec": "int8"})
    node = swarm.start("intruder", config=other)
    assert node.proc.wait(90) == 2
    text = node.log_path.read_text()
    assert "outer.codec: fp4 vs int8" in text and "fingerprint" in text, text[-2000:]
    assert "Traceback" not in text
    assert "data:" not in text, text[-2000:]  # told before its data loaded (tens of seconds for a large corpus)


def test_a_missing_data_path_is_told_before_any_network(swarm, tmp_path):
    node = swarm.start("nodata", "--data", str(tmp_path / "missing"), bootstrap=False)
    assert node.proc.wait(60) == 2
    text = node.log_path.read_text()
    assert f"data path {str(tmp_path / 'missing')!r} does not exist" in text, text[-2000:]
    assert "listening on" not in text and "Traceback" not in text, text[-2000:]  # no DHT started


def test_unreachable_bootstrap_retries_with_a_clear_message(swarm):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    node = swarm.start("lost", "--bootstrap", fake, "--bootstrap-attempts", "2", bootstrap=False)
    assert node.proc.wait(90) == 2
    text = node.log_path.read_text()
    assert text.count("bootstrap: no answer") >= 2 and "retrying" in text, text[-2000:]
    assert "Traceback" not in text


def test_ctrl_c_before_the_join_stops_quietly_with_130(swarm):
    """A user who gives up while the bootstrap peer does not answer is not told of an error or of leaving a swarm
    it never joined."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    node = swarm.start("quitter", "--bootstrap", fake, "--bootstrap-attempts", "50", bootstrap=False)
    deadline = time.monotonic() + 60
    while "bootstrap: no answer" not in node.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    node.proc.send_signal(signal.SIGINT)
    assert node.proc.wait(30) == 130
    text = node.log_path.read_text()
    assert "stopping (Ctrl+C again to force)" in text and "stopped before joining the swarm" in text, text[-2000:]
    assert "leaving the swarm" not in text and "locoswarm: error" not in text and "Traceback" not in text, text[-2000:]


def test_a_taken_port_is_told_before_the_data_loads(swarm):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = swarm.start("clash", "--port", str(port), bootstrap=False)
        assert node.proc.wait(60) == 2
    text = node.log_path.read_text()
    assert f"locoswarm: error: port {port} on 127.0.0.1 is already in use" in text, text[-2000:]
    assert "data:" not in text and "Traceback" not in text, text[-2000:]  # nothing loaded, no DHT started


def test_group_sigkill_leaves_no_process(swarm):
    """`kill -9 -PGID` takes the node and its watchdog at once: the DHT child and p2pd still go."""
    node = swarm.start("n0")
    # Alone, it is a swarm of one: outer steps on its own progress (not one ever-growing delta).
    st = node.wait_status(lambda s: s.get("solo_steps", 0) >= 4, 90, "outer steps alone")
    assert all(f["version"] >= 1 for f in st["fragments"]) and st["syncs_ok"] == 0, st["fragments"]
    assert [e["kind"] for e in st["events"]].count("alone") == 1, st["events"]
    descendants = node.descendants()
    assert len(descendants) >= 2  # watchdog, DHT child (+ its p2pd)
    node.kill(signal.SIGKILL)
    deadline = time.monotonic() + 15
    alive = descendants
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in descendants if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"left behind: {alive}"


@pytest.mark.parametrize("outer", [
    {"method": "replace", "tau": 0, "codec": "fp32"},
    {"method": "alpha", "tau": 2, "codec": "int8"},
    {"method": "rebase", "tau": 8},
    {"method": "eager", "tau": 8, "fragments": 1},
    {"method": "delay", "tau": 8, "fragments": 1},
    {"method": "compensate", "tau": 2, "schedule": "adaptive", "codec": "bf16"},
    {"method": "rebase", "tau": 8, "fragments": 1, "codec": "lowrank", "lowrank_rank": 16, "lowrank_max_rank": 16},
], ids=lambda o: "diloco-x" if o.get("codec") == "lowrank" else o["method"])
def test_every_method_of_the_core_runs_in_the_daemon(tmp_path, outer):
    swarm = Swarm(tmp_path, outer=outer)
    try:
        nodes = [swarm.start("n0"), swarm.start("n1")]
        for node in nodes:
            st = node.wait_status(lambda s: len(merged(s)) >= 4, 150, f"{outer['method']} rounds")
            assert math.isfinite(st["loss"])
        assert all(node.terminate(60) == 0 for node in nodes)
    finally:
        swarm.stop()


@pytest.mark.timeout(420)  # its waits add up to 390 s at most (150 + 2 * 120)
def test_a_lowrank_node_that_joins_late_rounds_with_the_others_on_the_seeded_basis(tmp_path):
    """codec lowrank: the two first nodes' bases have moved on when a third joins with the initial one; their
    groups re-encode on the round's seeded basis, after which all three share one basis and, with the consensus
    rounds every honest swarm runs (a node that refused a catch-up while a bad average had set the others back
    holds another phi at the same version until one), one phi."""
    swarm = Swarm(tmp_path, outer={"method": "rebase", "h": 96, "tau": 4, "codec": "lowrank", "lowrank_rank": 16,
                                   "lowrank_max_rank": 16, "consensus_every": 4})
    try:
        nodes = [swarm.start("n0"), swarm.start("n1")]
        for node in nodes:
            node.wait_status(lambda s: len(merged(s)) >= 4, 150, "lowrank rounds of the first two nodes")
        nodes.append(swarm.start("n2"))
        nodes[2].wait_status(lambda s: len(merged(s)) >= 4, 120, "the joiner's lowrank rounds")

        def same_state() -> bool:  # one status read per node: equal versions, phi hashes and ranks
            views = [{f["fragment"]: (f["version"], f["phi_hash"], f["ranks"]) for f in n.status()["fragments"]}
                     for n in nodes]
            return all(v == views[0] for v in views[1:]) and all(v[0] > 0 for v in views[0].values())
        wait_until(same_state, 120, "one phi and one set of ranks on all three nodes", nodes)
        assert "low-rank bases differ; re-encoded" in nodes[2].log_path.read_text(errors="replace")
        assert all(node.terminate(60) == 0 for node in nodes)
    finally:
        swarm.stop()


@pytest.mark.timeout(420)  # its waits add up to 390 s at most (180 + 60 + 90 + 60)
def test_pairwise_gossip_keeps_outer_params_close(tmp_path):
    """group_size 2 in a 4-node swarm: groups differ per round; consensus rounds keep phi together."""
    swarm = Swarm(tmp_path, outer={"consensus_every": 2, "codec": "fp32"}, network={"group_size": 2})
    try:
        nodes = [swarm.start(f"n{i}") for i in range(4)]
        for node in nodes:
            node.wait_status(lambda s: s.get("consensus", {}).get("rounds", 0) >= 3 and len(merged(s)) >= 6,
                             180, "gossip and consensus rounds")
        assert all(e["group_size"] == 2 for n in nodes for e in merged(n.status()))

        # The spread of phi across peers, as a node measures it from heartbeats (norms of phi at the newest
        # version >= 2 peers hold), falls within 5%.
        def spreads() -> list[float]:
            spread = nodes[0].status().get("spread") or {}
            return [v["norm_spread"] for v in spread.values() if v.get("version") is not None]

        wait_until(lambda: len(spreads()) == 2 and max(spreads()) < 0.05, 60, "phi spread within 5%", nodes)
        # Then it settles there: within 5% on both fragments for 5 s in a row (10 samples). Drifting apart would
        # never settle. On the way it may leave 5% for a while: in the first minute a node that trained far
        # ahead of the swarm clock while the others were busy with joins (one made 658 inner steps in 10 s,
        # H = 8, while its rounds failed) brings that progress to its pair's rounds and moves that pair's
        # phi; consensus rounds with the other pair pull it back. Seen on a 2-core machine: 0.12 -> 0.087
        # within 10 s, and once 0.52 for 4.5 s (its partner then refused that consensus round's result as
        # too far from its own state and, after three, banned the honest reducer: an open defect of
        # gossip with nodes of very unequal pace, noted in issue 10).
        timeline: list[tuple[float, list[float]]] = []
        start = time.monotonic()
        settled = 0
        while settled < 10 and time.monotonic() - start < 90:
            time.sleep(0.5)
            now = [round(v, 4) for v in spreads()]
            timeline.append((round(time.monotonic() - start, 1), now))
            settled = settled + 1 if len(now) == 2 and max(now) < 0.05 else 0
        assert settled >= 10, f"spread over time {timeline[-60:]}"
        worst = max((max(v) for _, v in timeline if v), default=0.0)
        print(f"\n[timing] phi spread settled within 5% after {timeline[-1][0]:.1f} s (worst sample {worst:.3f})")
        # A consensus round's shift is half the distance between that round's two phis: right after a
        # node caught up or met a peer of another pair it can be a few percent; rounds bring it down.
        wait_until(lambda: all(n.status()["consensus"]["last_shift"] < 0.05 for n in nodes), 60,
                   "consensus shifts below 5% on every node", nodes)
    finally:
        swarm.stop()
