"""Hostile peers against honest ones: real ``locoswarm run`` nodes and p2pd on loopback.

Two honest nodes run for the whole module; each test adds one hostile peer (``locoswarm.node.bench.hostile``:
a node with one attack patched in, or a client that never joins matchmaking), lets it attack for a
while, kills it, and checks that the honest nodes never crashed, kept training and averaging with
each other, kept a finite phi and an eval loss near what they had before the attack, counted the
attacker's offences (and banned a repeat offender), never banned each other, and kept their memory
bounded. Every process is killed by its process group; files live under pytest's tmp paths.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarm_util import REPO, NodeProc, bootstrap_addr, run_bench, write_config, write_corpus

from locoswarm.node.bench.hostile import CARRIED_OUT

pytestmark = pytest.mark.timeout(240)

NODE_ATTACK_S = 30.0     # seconds of attack once the hostile node trains (at most: see Watch.run)
NODE_ATTACK_MIN_S = 15.0
CLIENT_ATTACK_S = 20.0
RSS_GROWTH_MB = 300.0    # an honest node's memory may not grow by more than this during an attack
# Eval loss during an attack (4 held-out batches, so single values scatter by +-20% on a clean swarm): its
# mean at most this times the mean of the last evaluations before it, and no value above half the
# untrained loss (a poisoned round goes to nan or far above the untrained loss).
EVAL_SLACK = 1.2


def rss_mb(node: NodeProc) -> float:
    """Resident memory of the node and everything it started (DHT child, p2pd), in MB."""
    total = 0
    for pid in [node.proc.pid, *node.descendants()]:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


class HonestPair:
    """Two honest nodes that train and average together for the whole module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = write_config(root / "peers.toml")
        self.data = write_corpus(root / "data")
        self.args = ["--config", str(self.config), "--data", str(self.data), "--eval-every", "25"]
        self.nodes: list[NodeProc] = []
        self.boot = ""

    def start(self) -> None:
        a = NodeProc("a", self.root / "a", self.args, self.root / "a.log")
        self.nodes.append(a)
        self.boot = bootstrap_addr(a.wait_status(lambda s: s.get("addrs"), 90, "its addresses"))
        self.nodes.append(NodeProc("b", self.root / "b", [*self.args, "--bootstrap", self.boot], self.root / "b.log"))
        for node in self.nodes:
            node.wait_status(lambda s: s.get("syncs_ok", 0) >= 2, 120, "two merged rounds")
        # Attacks start on a trained pair: right after b joined a barely trained a (a slow first start, e.g.
        # a fresh clone compiling its modules), b's first evaluations were still above half the untrained
        # loss, which the attack tests read as damage.
        untrained = max(n.status()["eval_curve"][0][1] for n in self.nodes)  # a's start: the untrained model
        for node in self.nodes:
            node.wait_status(lambda s: len(s.get("eval_curve") or []) >= 2
                             and s["eval_curve"][-1][1] < 0.4 * untrained, 180, "a trained model")
        # ... and settled: right after b joined, a burst of rounds (a's clock jumping to b's) once set a's
        # model back to the untrained loss for some seconds, inside the first attack's window (a fresh-clone
        # run and a module run, 2026-11-27). Attacks start once each node has merged 10 rounds with the other
        # and its last 5 evaluations are trained.
        for node in self.nodes:
            node.wait_status(lambda s: len([e for e in s.get("events", []) if e["kind"] == "merged"
                                            and e.get("group_size", 0) >= 2]) >= 10
                             and len(s["eval_curve"]) >= 5
                             and all(v < 0.4 * untrained for _, v in s["eval_curve"][-5:]), 180, "a settled pair")

    def ids(self) -> set[str]:
        return {n.status()["peer_id"] for n in self.nodes}

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    pair = HonestPair(tmp_path_factory.mktemp("adversarial"))
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()
    for node in pair.nodes:
        assert not node.group_alive(), f"{node.name} left processes behind"


class Watch:
    """The honest nodes' view before and during one attack."""

    def __init__(self, pair: HonestPair) -> None:
        self.pair = pair
        self.before = {n.name: n.status() for n in pair.nodes}
        self.rss0 = {n.name: rss_mb(n) for n in pair.nodes}
        self.rss_max = dict(self.rss0)
        self.started = time.time()

    def sample(self) -> None:
        """Alive, phi finite; memory tracked."""
        for node in self.pair.nodes:
            assert node.proc.poll() is None, f"honest node {node.name} died:\n{node.tail()}"
            st = node.status()
            norms = [f["phi_norm"] for f in st.get("fragments", [])]
            assert all(v is not None and math.isfinite(v) for v in norms), f"{node.name}: phi norms {norms}"
            self.rss_max[node.name] = max(self.rss_max[node.name], rss_mb(node))

    def run(self, seconds: float, attacker: str | None = None) -> None:
        """Watch for ``seconds``, or, given the ``attacker``, until it is banned and each honest node has what
        ``check_honest`` judges (no less than ``NODE_ATTACK_MIN_S``): a banned attacker does no more harm."""
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            self.sample()
            if attacker is not None and elapsed >= NODE_ATTACK_MIN_S and self.judged(attacker):
                break
            time.sleep(1.0)
        self.sample()

    def judged(self, attacker: str) -> bool:
        """Some honest node bans ``attacker``, and each has trained 60 steps, merged 3 rounds and evaluated once
        since the watch began."""
        banned = False
        for node in self.pair.nodes:
            st, st0 = node.status(), self.before[node.name]
            merged = [e for e in st["events"] if e["kind"] == "merged" and e["time"] >= self.started
                      and e.get("group_size", 0) >= 2]
            if (st["inner_step"] < st0["inner_step"] + 60 or len(merged) < 3
                    or len(st["eval_curve"]) <= len(st0["eval_curve"])):
                return False
            banned |= bool(st["reputation"]["peers"].get(attacker, {}).get("banned"))
        return banned

    def check_honest(self, attacker: str | None, *, banned: bool) -> dict[str, dict]:
        """The honest nodes after the attack; returns their status by name."""
        ids = self.pair.ids()
        untrained = max(n.status()["eval_curve"][0][1] for n in self.pair.nodes)  # the first node's start
        after = {}
        for node in self.pair.nodes:
            st, st0 = node.status(), self.before[node.name]
            after[node.name] = st
            name = node.name
            assert st["inner_step"] > st0["inner_step"] + 50, f"{name} stopped training"
            merged = [e for e in st["events"] if e["kind"] == "merged" and e["time"] >= self.started
                      and e.get("group_size", 0) >= 2]
            assert len(merged) >= 3, f"{name}: only {len(merged)} merged rounds with a peer during the attack"
            assert all(e["group_size"] <= 3 for e in merged), f"{name}: a group larger than the swarm"
            # Evaluations during the attack: finite, far below the untrained model's, and on average near
            # the node's own level before the attack.
            curve0, curve = st0["eval_curve"], st["eval_curve"]
            recent = [v for _, v in curve0[-4:]]
            level = sum(recent) / len(recent)
            during = [v for _, v in curve[len(curve0):]]
            assert during, f"{name}: no evaluation during the attack"
            assert all(math.isfinite(v) and v < untrained / 2 for v in during), f"{name}: eval {during} ({untrained=})"
            mean = sum(during) / len(during)
            assert mean <= EVAL_SLACK * level, f"{name}: eval mean {mean:.3f} during vs {level:.3f} before: {during}"
            rep = st["reputation"]["peers"]
            for other in ids - {st["peer_id"]}:  # honest peers are never punished
                assert not rep.get(other, {}).get("offences"), f"{name} counts offences of an honest peer: {rep[other]}"
            grow = self.rss_max[name] - self.rss0[name]
            assert grow < RSS_GROWTH_MB, f"{name}: RSS grew by {grow:.0f} MB ({self.rss0[name]:.0f} MB before)"
        if attacker is not None:
            seen = [s["reputation"]["peers"].get(attacker) for s in after.values()]
            assert any(p and p["refused"] > 0 for p in seen), f"attacker {attacker[:12]} never refused: {seen}"
            if banned:
                assert any(p and p["banned"] for p in seen), f"attacker {attacker[:12]} not banned: {seen}"
        return after


# Out of bounds, then inside them (a direction flip, a reducer that negates its part, a replay of earlier
# rounds' averages, state liars within the swarm clock's bound, serving a reversal or noise): each is refused
# or judged, and banned.
NODE_ATTACKS = ["weight", "values", "nan", "reducer", "state", "clock", "forge", "flip", "badreduce", "replay",
                "stateliar", "statenoise"]


@pytest.mark.parametrize("attack", NODE_ATTACKS)
def test_hostile_node(honest: HonestPair, attack: str, tmp_path: Path) -> None:
    watch = Watch(honest)
    hostile = NodeProc(f"hostile-{attack}", tmp_path / "h", [*honest.args, "--bootstrap", honest.boot],
                       tmp_path / "h.log", command=["locoswarm.node.bench.hostile", "--attack", attack])
    try:
        st = hostile.wait_status(lambda s: s.get("state") == "training", 90, "the hostile node to train")
        attacker = st["peer_id"]
        watch.run(NODE_ATTACK_S, attacker if attack != "state" else None)
        assert hostile.proc.poll() is None, f"the hostile node itself died:\n{hostile.tail()}"
    finally:
        hostile.stop()
    # A patch that no longer fits the code it wraps fails inside the hostile node's tasks: it then runs as an
    # honest node, and the checks below would pass (or fail) for nothing.
    assert CARRIED_OUT in hostile.log_path.read_text(errors="replace"), f"the attack never ran:\n{hostile.tail()}"
    if attack != "state":  # refused (or judged), and repeated until the attacker is banned
        after = watch.check_honest(attacker, banned=True)
        for name, st in after.items():  # a liar's clock never drags the honest clocks along
            assert st["clock"] - watch.before[name]["clock"] < 5000, f"{name}: clock jumped to {st['clock']}"
        return
    # The state attack's version is corroborated by nobody, so an honest node believes it only while its
    # table holds no other claimant (a heartbeat missed under load). Each time it does, the NaN snapshot
    # is refused, and the refusal is held against the peer that served it.
    after = watch.check_honest(None, banned=False)
    lie = re.compile(r"catch-up to v(\d+)")
    lured = [st["peer_id"] for st in after.values() if any(
        e["kind"] == "refused" and e["time"] >= watch.started and (m := lie.search(e["detail"]))
        and int(m.group(1)) >= 1000 for e in st["events"])]
    print(f"state attack: {len(lured)} honest node(s) tried the liar's snapshot")
    for st in after.values():
        if st["peer_id"] in lured:
            assert st["reputation"]["peers"].get(attacker, {}).get("refused"), \
                f"a NaN snapshot was refused but its source {attacker[:12]} was not counted"


def run_client(pair: HonestPair, attack: str, tmp_path: Path, *extra: str) -> dict:
    report = tmp_path / "report.json"
    proc = NodeProc(f"hostile-{attack}", tmp_path / "h",
                    ["--config", str(pair.config), "--bootstrap", pair.boot, "--seconds", str(CLIENT_ATTACK_S),
                     "--report", str(report), *extra], tmp_path / "h.log", command=["locoswarm.node.bench.hostile",
                                                                                     "--attack", attack])
    watch = Watch(pair)
    try:
        deadline = time.monotonic() + CLIENT_ATTACK_S + 60
        while proc.proc.poll() is None and time.monotonic() < deadline:
            watch.sample()
            time.sleep(1.0)
        assert proc.proc.poll() == 0, f"the hostile client failed:\n{proc.tail()}"
    finally:
        proc.stop()
    doc = json.loads(report.read_text())
    doc["after"] = watch.check_honest(None, banned=False)
    doc["watch"] = watch
    return doc


def test_non_member_injection_is_never_accepted(honest: HonestPair, tmp_path: Path) -> None:
    doc = run_client(honest, "inject", tmp_path)
    counts = doc["counts"]
    assert counts.get("rounds_found", 0) >= 3, f"the injector found no round to attack: {doc}"
    assert counts.get("accepted", 0) == 0, f"a non-member contribution was accepted: {doc}"
    assert counts.get("refused_forged", 0) >= 1 and counts.get("refused_own_id", 0) >= 1, doc
    injector = doc["peer_id"]
    kinds = {k for st in doc["after"].values() for k in st["reputation"]["peers"].get(injector, {}).get("by_kind", {})}
    assert {"forged_sender", "non_member"} <= kinds, f"refusals of the injector: {kinds}"
    assert any(st["reputation"]["peers"].get(injector, {}).get("banned") for st in doc["after"].values())


def test_flood_of_huge_frames_keeps_memory_bounded(honest: HonestPair, tmp_path: Path) -> None:
    doc = run_client(honest, "flood", tmp_path, "--streams", "24", "--frame-mib", "600")
    counts = doc["counts"]
    assert counts.get("streams_opened", 0) >= 24, doc
    # Every stream was cut long before its frame was through (memory: checked by run_client's watch).
    assert counts.get("frames_completed", 0) == 0, f"a peer swallowed a 600 MiB frame: {doc}"
    assert counts.get("streams_cut", 0) >= 1, doc
    per_stream = counts.get("mib_written", 0) / counts["streams_opened"]
    watch = doc["watch"]
    print(f"flood: {counts['streams_opened']} streams, {per_stream:.2f} MiB written per stream; RSS MB before "
          f"{watch.rss0}, max {watch.rss_max}")
    assert per_stream < 16, f"peers read {per_stream:.1f} MiB per stream of a frame announcing 600 MiB"


def test_state_download_by_a_non_member_is_refused(honest: HonestPair, tmp_path: Path) -> None:
    doc = run_client(honest, "download", tmp_path)
    counts = doc["counts"]
    assert counts.get("requests", 0) >= 4, doc
    assert counts.get("completed", 0) == 0, f"a non-member downloaded the outer state: {doc}"
    assert counts.get("refused", 0) >= 1, doc


def test_hostile_cli_refuses_bad_arguments() -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "locoswarm.node.bench.hostile", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")})

    for args, needle in ((("--attack", "bogus"), "is not an attack"), ((), "no attack given"),
                         (("--attack", "flood"), "needs --bootstrap"),
                         (("--attack", "clock", "--attack-period", "0"), "positive number")):
        res = run(*args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, res.stderr)
    res = run("--help")
    assert res.returncode == 0 and "inject" in res.stdout and "locoswarm run" in res.stdout


def test_split_data_deals_each_directorys_entries_out_to_disjoint_balanced_shares(tmp_path: Path) -> None:
    """``bench robustness --split-data``: every entry with data files lands in exactly one share, the largest first
    to the smallest share so far; skipped and empty entries in none; too few entries is a one-line error."""
    from locoswarm.node.bench.robustness import split_data
    from locoswarm.node.errors import UserError

    root = tmp_path / "corpus"
    for name, size in (("big", 9000), ("mid", 5000), ("small", 3000), ("tiny", 1000)):
        (root / name).mkdir(parents=True)
        (root / name / "a.txt").write_text("x" * size)
    (root / "module.py").write_text("y" * 2000)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "c.txt").write_text("z" * 50_000)
    (root / "empty").mkdir()
    (root / "empty" / "image.bin").write_bytes(b"\0" * 100)
    shares = split_data([str(root)], 2)
    names = [sorted(Path(e).name for e in share) for share in shares]
    assert sorted(n for share in names for n in share) == ["big", "mid", "module.py", "small", "tiny"]
    assert names == [["big", "tiny"], ["mid", "module.py", "small"]]  # 10000 and 10000 bytes
    with pytest.raises(UserError, match="too few for 6 honest nodes"):
        split_data([str(root)], 6)


def test_robustness_report_compares_with_the_clean_run_at_equal_progress() -> None:
    """Both runs' eval loss averaged over the EQUAL_SPAN clock steps before the clock both reached (linear between
    evals where no point falls inside): no extrapolation of either curve, whichever went further."""
    from locoswarm.node.bench.robustness import EQUAL_SPAN, equal_progress, interpolate, markdown_table, window_mean

    curve = [[0, 5.0], [100, 3.0], [200, 2.5]]
    assert interpolate(curve, 50) == 4.0 and interpolate(curve, 200) == 2.5
    assert interpolate(curve, 201) is None and interpolate([], 0) is None
    assert window_mean(curve, 100, 200) == 2.75 and window_mean(curve, 120, 150) == pytest.approx(2.75)

    def scenario(kind: str, hostile: int, curves: list[list[list[float]]]) -> dict:
        honest = [{"final_clock": c[-1][0], "eval_curve": c, "inner_steps": c[-1][0], "final_eval": c[-1][1]}
                  for c in curves]
        final = sum(c[-1][1] for c in curves) / len(curves)
        return {"kind": kind, "hostile": hostile, "error": "", "honest": honest, "honest_alive": len(curves),
                "final_eval": final, "max_eval_during": 5.0, "rounds_ok": 9, "rounds_failed": 0,
                "attacker_refused": 3, "banned_by": 2, "rss_growth_mb": 1.0}

    clean = [[0, 5.0], [100, 3.0], [200, 2.5], [300, 2.0]]
    results = {"clean x2": scenario("clean", 2, [clean, clean]),
               "slow x2": scenario("flood", 2, [[[0, 5.0], [100, 3.3], [200, 3.0]]] * 2),
               "far x2": scenario("weight", 2, [[[0, 5.0], [200, 2.5], [300, 2.2], [400, 1.9]]] * 2),
               "weight": scenario("weight", 1, [clean])}
    # slower: compared where it ended (clock 200), over the last EQUAL_SPAN steps of both curves
    assert EQUAL_SPAN == 100
    assert equal_progress(results, results["slow x2"]) == pytest.approx((3.15, 2.75))
    # further than the clean run: compared where the clean run ended (clock 300), not extrapolated
    assert equal_progress(results, results["far x2"]) == pytest.approx((2.35, 2.25))
    assert equal_progress(results, results["weight"]) is None  # no clean run of one bystander
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in markdown_table(results).splitlines()[2:]}
    assert rows["slow x2"][3:5] == ["+50.0%", "+14.5%"]  # 3.0 against 2.0 at the end; 3.15 against 2.75
    assert rows["weight"][3:5] == ["-", "-"] and rows["clean x2"][4] == "-"
    # a hostile node whose patches never ran is an honest node: its row says so next to the refusals
    results["far x2"]["attack_carried_out"], results["slow x2"]["attack_carried_out"] = 1, 2
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in markdown_table(results).splitlines()[2:]}
    assert rows["far x2"][10] == "3 (attack ran in 1/2 hostile nodes)" and rows["slow x2"][10] == "3"
    # honest extra members (``control``): compared with clean like an attack; a ban of one is a false positive,
    # and none is no missing ban
    results["control x2"] = scenario("control", 2, [clean, clean]) | {"max_seconds_to_ban": None}
    row = {line.split(" | ")[0][2:]: line.split(" | ") for line in markdown_table(results).splitlines()[2:]}[
        "control x2"]
    assert row[4] == "+0.0%" and row[11] == "2/2 (false positives)" and row[12] == "-"


def test_robustness_report_counts_the_rounds_to_a_ban_from_the_attackers_first_round() -> None:
    """Time to a ban: from the hostile node's first round in the window (or the sleeper's turn, whichever is later)
    to the honest node's own record of the ban; rounds: its swarm clock's advance between the two, linear between
    samples, times the rounds per clock step. Without the node's record, the first sample that shows the ban. Each
    attacker's ban is timed from its own start."""
    from locoswarm.node.bench.robustness import Sample, judged

    def sample(t: float, clock: int, first: float | None, banned: bool) -> Sample:
        return Sample(t=t, evals=[2.0], rounds_ok=0, rounds_failed=0, rss_mb=1.0, clocks=[clock],
                      banned=[["QmA"] if banned else []], attacker_first={} if first is None else {"QmA": first})

    samples = [sample(0.0, 100, None, False), sample(2.0, 120, 1.5, False), sample(4.0, 140, 1.5, False),
               sample(6.0, 160, 1.5, True)]
    out = judged(0, ["QmH"], ["QmA"], samples, 0.0, 0.25, banned_at={"QmA": 4.5})
    assert out["bans"]["QmA"] == {"seconds": pytest.approx(3.0), "rounds": pytest.approx((145 - 115) * 0.25)}
    late = judged(0, ["QmH"], ["QmA"], samples, 3.0, 0.25)  # a sleeper's turn at 3 s; the ban seen at 6 s
    assert late["bans"]["QmA"] == {"seconds": pytest.approx(3.0), "rounds": pytest.approx((160 - 130) * 0.25)}
    never = judged(0, ["QmH"], ["QmA"], samples[:3], 0.0, 0.25)
    assert never["bans"]["QmA"] is None
    for s in samples[2:]:  # a second attacker that began 2 s after the first and was banned with it
        s.attacker_first["QmB"] = 3.5
        s.banned[0].append("QmB")
    both = judged(0, ["QmH"], ["QmA", "QmB"], samples, 0.0, 0.25, banned_at={"QmA": 4.5, "QmB": 4.5})
    assert both["bans"]["QmA"]["seconds"] == pytest.approx(3.0)
    assert both["bans"]["QmB"] == {"seconds": pytest.approx(1.0), "rounds": pytest.approx((145 - 135) * 0.25)}


def test_honest_refusals_of_honest_nodes_are_counted_in_the_window_apart_from_those_before_it() -> None:
    """``honest_refusals``: what the honest nodes refused of each other during the attack window, by kind, judged
    and protocol apart; those counted while the honest swarm formed (the statuses read when the window opened) are
    reported apart, and refusals of attackers never count."""
    from locoswarm.node.bench.robustness import honest_refusals

    honest = [
        {"honest_ids": ["QmB"], "refused_before": {"QmB": {"clock": 3, "non_member": 1}},
         "reputation": {"QmB": {"by_kind": {"clock": 3, "non_member": 2, "reduction": 1}, "offences": 0},
                        "QmA": {"by_kind": {"contribution": 9}, "offences": 9}}},
        {"honest_ids": ["QmC"], "refused_before": {},
         "reputation": {"QmC": {"by_kind": {"effect": 2}, "offences": 1}}},
    ]
    out = honest_refusals(honest)
    assert out == {"judged": 3, "protocol": 1, "offences": 1, "before_judged": 3, "before_protocol": 1,
                   "non_member": 1, "reduction": 1, "effect": 2}


def test_a_hostile_nodes_attack_starts_with_its_first_round_to_an_honest_member_once_carried_out(
        tmp_path: Path) -> None:
    """``attack_start``: a hostile node's attack begins with its first round in the window that reached an honest
    member, but not before its log says the attack was carried out (a state liar forges its first heartbeat
    seconds after its first round); nothing before both. ``carried_out_at`` reads that moment from its log."""
    from locoswarm.node.bench.hostile import NODE_ATTACKS
    from locoswarm.node.bench.robustness import attack_start, carried_out_at

    log = tmp_path / "hostile0.log"
    assert carried_out_at(log) is None  # no log yet
    log.write_text("12:00:00 INFO  locoswarm.node: joined\n")
    assert carried_out_at(log) is None
    attack = NODE_ATTACKS["replayliar"](0.0)
    handler = logging.FileHandler(log)
    logging.getLogger("locoswarm.hostile").addHandler(handler)
    try:
        before = time.time()
        attack.carried_out()
        attack.carried_out()  # logged once
    finally:
        logging.getLogger("locoswarm.hostile").removeHandler(handler)
        handler.close()
    at = carried_out_at(log)
    assert at is not None and before - 1e-3 <= at <= time.time() + 1e-3 and log.read_text().count(CARRIED_OUT) == 1
    started = 1000.0
    merged = [{"kind": "merged", "time": 1002.0}, {"kind": "merged", "time": 999.0}]
    assert attack_start(merged, None, started) is None        # not carried out yet
    assert attack_start([], 1001.0, started) is None          # no round reached an honest member yet
    assert attack_start(merged, 1001.0, started) == pytest.approx(2.0)  # its first round in the window
    assert attack_start(merged, 1009.0, started) == pytest.approx(9.0)  # its first lie, after its rounds began


def test_a_hostile_round_that_sent_nothing_does_not_start_its_attack() -> None:
    """A joining hostile node's rounds that failed before anything reached an honest member (no group, after the
    window, refused as no member of the reducer's round) do not start the clock to its ban; one that merged or
    was refused for what it sent does."""
    from locoswarm.node.bench.robustness import attack_round
    from locoswarm.node.core.transport import EXCLUDED_BY_ALL

    def failed(error: str) -> dict:
        return {"kind": "failed", "detail": f"fragment 0 round v136: {error}"}

    assert not attack_round(failed("no peer in group"))
    assert not attack_round(failed("arrived after the matchmaking window closed"))
    assert not attack_round(failed(EXCLUDED_BY_ALL))
    assert not attack_round(failed("RuntimeError: peer QmX refused: this peer is not in the round (it arrived "
                                   "after the window or had no group)"))
    assert attack_round(failed("RuntimeError: peer QmX refused: round failed at reducer: direction"))
    assert attack_round({"kind": "merged", "detail": "fragment 0 round v1 group 4"})
    assert not attack_round({"kind": "caught_up", "detail": "fragment 0 round v141"})


@pytest.mark.timeout(300)
def test_bench_robustness_writes_json_markdown_and_png(tmp_path: Path) -> None:
    out = tmp_path / "report"
    data = write_corpus(tmp_path / "data")
    run_bench(["robustness", "--out", str(out), "--kinds", "nan", "--seconds", "5", "--data", str(data)], tmp_path, 270)
    doc = json.loads((out / "results.json").read_text())
    r = doc["scenarios"]["nan"]
    assert not r["error"], r["error"]
    assert r["honest_alive"] == 2 and all(h["phi_finite"] for h in r["honest"]), r
    assert r["samples"] and r["final_eval"] is not None and math.isfinite(r["final_eval"])
    assert len(r["attackers"]) == 1
    table = (out / "report.md").read_text()
    assert "| nan | 2/2 |" in table and "robustness.png" in table
    assert (out / "robustness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, str(tmp_path))]
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not list(tmp_path.glob("locoswarm-robustness-*")), "the benchmark left its scratch swarm behind"


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_text(errors="replace")
    except OSError:
        return False
