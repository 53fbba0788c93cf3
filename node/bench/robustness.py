"""``locoswarm bench robustness``: honest nodes against hostile peers, one scenario per attack.

Each scenario is a short multi-process swarm on loopback (real ``locoswarm run`` processes, real
DHTs and p2pd): ``--honest`` honest nodes train until they have averaged together, then an attack
scenario adds ``N`` hostile peers of one kind (``python -m locoswarm.node.bench.hostile``: a node with the attack
patched in, or a client that never joins), ``clean`` adds ``N`` bystanders instead, for each ``N``
of ``--counts``: nodes that train as hard as a hostile node but in a swarm of their own, so the honest
nodes share the machine's cores as they do under attack but average only with each other, as they do
when every attacker's contribution is refused; ``control`` adds ``N`` honest members that read what an
attacker reads (all the data), the attack's setup without the attack: against ``clean`` it measures what an extra
member costs or gains the honest nodes by itself (with ``--split-data``, one that trains on all of it), and its
refusals and bans are false positives. For ``--seconds`` the honest nodes are sampled: eval
loss, rounds merged and failed, memory. The report compares the honest nodes' eval loss per scenario
with the clean one of the same ``N`` and lists what they refused of the attackers and whether they
banned them. Writes ``results.json``, ``report.md`` and
``robustness.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from locoswarm.node.bench import keep_logs, local_swarm_runs, write_png
from locoswarm.node.bench.hostile import CARRIED_OUT_AT
from locoswarm.node.commands import add_data_args, data_paths
from locoswarm.node.config import DataSection, load_config
from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import atomic_write_text
from locoswarm.node.helptext import describe
from locoswarm.node.swarm.process import descendants, kill_groups, tree_groups

OUT_OF_BOUND = ("weight", "values", "nan", "reducer", "state", "clock", "forge", "inject", "flood", "download")
IN_BOUND = ("flip", "ipm", "drift", "sleeper", "replay", "badreduce", "reducedrift", "reducenudge", "stateliar",
            "statenoise", "versionliar", "replayliar")
CONTROL = "control"  # extra members that are honest (module docstring)
CLIENT_KINDS = ("inject", "flood", "download")
SPLIT_SKIPPED = frozenset({"site-packages", "dist-packages", "__pycache__"})  # never a share (``split_data``)
SLEEPER_SHARE = 1 / 3  # a sleeper behaves for this share of the attack window, then turns


@dataclass(frozen=True)
class ScenarioKind:
    """What a scenario kind's added peers are, looked up once by name (``scenario_kind``) where the bench starts,
    samples and reports them. By default a hostile node (``locoswarm.node.bench.hostile``) with its attack patched
    in from the window's start."""

    name: str
    baseline: bool = False  # "clean": bystanders in a swarm of their own, the baseline the others are compared with
    honest: bool = False    # "control": honest members, so any refusal or ban of one is a false positive
    client: bool = False    # a client of the swarm that never joins it: it takes part in no rounds
    turns: bool = False     # behaves for ``SLEEPER_SHARE`` of the window, then attacks (``--attack-period``)

    @property
    def patched(self) -> bool:
        """Whether the added peers are nodes with an attack patched in, whose logs say whether it ran."""
        return not (self.baseline or self.honest or self.client)


SCENARIO_KINDS: dict[str, ScenarioKind] = {k.name: k for k in [
    ScenarioKind("clean", baseline=True),
    ScenarioKind(CONTROL, honest=True),
    *(ScenarioKind(name, client=name in CLIENT_KINDS) for name in OUT_OF_BOUND),
    *(ScenarioKind(name, turns=name == "sleeper") for name in IN_BOUND)]}
KINDS = tuple(SCENARIO_KINDS)  # ``--kinds``, in this order


def scenario_kind(name: str) -> ScenarioKind:
    """The kind named ``name``; a name this bench no longer knows (an older report's) is a hostile node's attack."""
    return SCENARIO_KINDS.get(name) or ScenarioKind(name)


REPO = Path(__file__).resolve().parents[2]

def tiny_swarm() -> dict[str, dict]:
    """A tiny, fast swarm (as in the multi-process tests): rounds every few hundred milliseconds."""
    # lazy: locoswarm.node.core.outer_loop imports torch (~1 s, measured); this module does not
    from locoswarm.node.core.outer_loop import HEALTHY_SLACK

    return {
        "swarm": {"name": "robustness-bench"},
        "model": {"preset": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": 64},
        "inner": {"batch_size": 4, "seq_len": 32, "warmup": 5, "lr": 3e-3},
        "outer": {"method": "compensate", "h": 8, "fragments": 2, "tau": 2, "codec": "fp4"},
        "network": {"group_size": 8, "matchmaking_timeout": 3.0, "round_timeout": 10.0, "heartbeat_interval": 0.5},
        "robust": {"health_slack": HEALTHY_SLACK},  # off by default (node/core/outer_loop.py); measured with it on
    }


def split_data(paths: Sequence[str], parts: int, extensions: Sequence[str] | None = None) -> list[list[str]]:
    """``parts`` disjoint shares of the data for non-identically distributed honest nodes (``--split-data``): the
    entries directly inside each directory of ``paths`` (the standard library's when none: its sub-packages and
    modules), dealt out by the bytes of their data files, largest first, each to the share smallest so far. Each
    share is a corpus of its own topics (asyncio to one node, email to another), the data a volunteer brings."""
    # lazy: locoswarm.node.data imports torch (~1 s, measured); this module does not
    from locoswarm.node.data import discover_files, stdlib_dir

    extensions = DataSection().extensions if extensions is None else extensions
    roots = [Path(p) for p in paths] or [stdlib_dir()]
    entries: list[Path] = []
    for root in roots:
        if root.is_dir():
            entries += [e for e in sorted(root.iterdir()) if e.name not in SPLIT_SKIPPED and not e.name.startswith(".")]
        else:
            entries.append(root)
    sized = []
    for entry in entries:
        try:
            size = sum(f.stat().st_size for f in discover_files([str(entry)], extensions))
        except UserError:  # no data file in it
            continue
        if size:
            sized.append((size, str(entry)))
    shares: list[list[str]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for size, entry in sorted(sized, reverse=True):
        i = totals.index(min(totals))
        shares[i].append(entry)
        totals[i] += size
    if any(not share for share in shares):
        raise UserError(f"--split-data: the data has {len(sized)} entries with data files, too few for {parts} "
                        "honest nodes; give a directory with more files or sub-directories")
    return [sorted(share) for share in shares]


def write_tiny_config(path: Path) -> Path:
    lines = []
    for name, values in tiny_swarm().items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class LocalProc:
    """One ``python -m ...`` process of a scenario in its own session (killed by process group, never
    by name); ``status.json`` in its state dir is how it is observed."""

    def __init__(self, name: str, module: list[str], args: list[str], state_dir: Path, log_path: Path,
                 niceness: int = 0) -> None:
        self.name = name
        self.state_dir = state_dir
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        nice = ["nice", "-n", str(niceness)] if niceness else []  # nice execs: the pid is the python process's
        self.proc = subprocess.Popen([*nice, sys.executable, "-m", *module, *args], cwd=REPO, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def status(self) -> dict:
        try:
            return json.loads((self.state_dir / "status.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st and predicate(st):
                return st
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before {what}: {self.tail()}")
            time.sleep(0.25)
        raise RuntimeError(f"{self.name}: no {what} after {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 8) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def rss_mb(self) -> float:
        """Resident memory of the process and its descendants (DHT child, p2pd), in MB."""
        total = 0
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(OSError, ValueError, IndexError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        return total / 1024

    def stop(self) -> None:
        """Kill the process, its group and the groups of its descendants; wait until they are gone."""
        kill_groups(tree_groups(self.proc.pid), self.proc)
        self._log.close()


@dataclass
class Scenario:
    kind: str        # "clean", "control" or an attack of locoswarm.node.bench.hostile
    hostile: int     # peers added: hostile ones, bystanders (another swarm) for "clean", honest members for "control"

    @property
    def name(self) -> str:
        return self.kind if self.hostile <= 1 else f"{self.kind} x{self.hostile}"

    @property
    def traits(self) -> ScenarioKind:
        """What its added peers are (``scenario_kind``)."""
        return scenario_kind(self.kind)


@dataclass
class Sample:
    t: float                  # seconds since the attack started
    evals: list[float]        # latest eval loss of each honest node
    rounds_ok: int            # merged rounds, summed over the honest nodes
    rounds_failed: int
    rss_mb: float             # largest honest node
    clocks: list[int] = field(default_factory=list)          # each honest node's swarm clock
    banned: list[list[str]] = field(default_factory=list)    # each honest node's banned peers
    attacker_rounds: int = 0  # rounds the hostile nodes took part in so far (merged, failed or refused)
    # per hostile node (peer id), seconds since the window opened to the start of its attack: its first round in the
    # window that sent to an honest member (``attack_round``), not before its attack was first carried out
    attacker_first: dict[str, float] = field(default_factory=dict)


@dataclass
class Outcome:
    scenario: Scenario
    samples: list[Sample] = field(default_factory=list)
    honest: list[dict] = field(default_factory=list)
    attackers: list[str] = field(default_factory=list)
    carried_out: int | None = None  # hostile nodes whose log says their attack ran (None: clean or a client)
    error: str = ""

    def summary(self) -> dict:
        finals = [h["final_eval"] for h in self.honest if h.get("final_eval") is not None]
        during = [v for s in self.samples for v in s.evals if v is not None]
        refused = sum(h["attacker_refused"] for h in self.honest)
        return {
            "kind": self.scenario.kind, "hostile": self.scenario.hostile, "error": self.error,
            "attackers": self.attackers, "attack_carried_out": self.carried_out, "honest": self.honest,
            "honest_alive": sum(1 for h in self.honest if h["alive"]),
            "final_eval": sum(finals) / len(finals) if finals else None,
            "max_eval_during": max(during) if during else None,
            "rounds_ok": sum(h["rounds_ok"] for h in self.honest),
            "rounds_failed": sum(h["rounds_failed"] for h in self.honest),
            "attacker_refused": refused,
            "banned_by": sum(1 for h in self.honest if h["attacker_banned"]),
            "banned_by_all": sum(1 for h in self.honest if h.get("all_attackers_banned")),
            "max_rounds_to_ban": _max_to_ban(self.honest, "rounds"),
            "max_seconds_to_ban": _max_to_ban(self.honest, "seconds"),
            "honest_refusals": honest_refusals(self.honest),
            "rss_growth_mb": max((h["rss_growth_mb"] for h in self.honest), default=0.0),
            "samples": [vars(s) for s in self.samples],
        }


def _max_to_ban(honest: list[dict], what: str) -> float | None:
    """The longest any honest node took to ban any attacker (None when one was never banned, or none ran)."""
    values = [b.get(what) if b else None for h in honest for b in (h.get("bans") or {}).values()]
    if not values or any(v is None for v in values):
        return None
    return max(values)


# Refusals that judge nothing a peer sent, only when it came: a stream for a round the reducer skipped or formed
# otherwise, a state request before the holder's table shows the requester, a stream over a cap, a banned peer's.
PROTOCOL_KINDS = frozenset({"not_in_round", "non_member", "streams", "wire", "fingerprint", "banned", "state_banned",
                            "state_not_live", "state_rate", "state_streams", "stranger"})


def honest_refusals(honest: list[dict]) -> dict[str, int]:
    """Refusals the honest nodes counted of each other during the window, by kind, with ``judged`` (refusals of
    something an honest node sent: a contribution, a part, a state, a claim) and ``protocol`` (``PROTOCOL_KINDS``:
    when, not what) totals and ``offences`` (those that count toward a ban, over the whole run); ``before_judged``
    and ``before_protocol``: those counted before the window opened, while the honest swarm formed."""
    out: dict[str, int] = {"judged": 0, "protocol": 0, "offences": 0, "before_judged": 0, "before_protocol": 0}
    for h in honest:
        rep, earlier = h.get("reputation") or {}, h.get("refused_before") or {}
        for other in h.get("honest_ids") or []:
            r, before = rep.get(other) or {}, earlier.get(other) or {}
            for kind, n in (r.get("by_kind") or {}).items():
                old = min(int(n), int(before.get(kind, 0)))
                group = "protocol" if kind in PROTOCOL_KINDS else "judged"
                if int(n) > old:
                    out[kind] = out.get(kind, 0) + int(n) - old
                    out[group] += int(n) - old
                out[f"before_{group}"] += old
            out["offences"] += int(r.get("offences") or 0)
    return out


class ScenarioRun:
    """One scenario: start the swarm, attack, sample, collect, stop everything."""

    def __init__(self, scenario: Scenario, root: Path, config: Path, data: list[str], honest: int,
                 seconds: float, progress=None, nice_others: int = 0, shares: list[list[str]] | None = None) -> None:
        self.scenario = scenario
        self.shares = shares  # each honest node's own data (``split_data``); None: all train on ``data``
        self.nice_others = nice_others
        self.root = root
        self.config = config
        self.data = data
        self.n_honest = honest
        self.seconds = seconds
        self.progress = progress
        self.procs: list[LocalProc] = []
        self.honest: list[LocalProc] = []
        self.extra: list[LocalProc] = []

    def node_args(self, honest: int | None = None) -> list[str]:
        """A node's arguments; ``honest``: the honest node's index, for its share of split data."""
        # 16 held-out batches per evaluation: with 4, single values scattered by +-20% on a clean swarm
        args = ["--config", str(self.config), "--eval-every", "25", "--eval-batches", "16", "--threads", "1"]
        data = self.shares[honest] if self.shares is not None and honest is not None else self.data
        return args + (["--data", *data] if data else [])

    def spawn(self, name: str, module: list[str], args: list[str], niceness: int = 0) -> LocalProc:
        proc = LocalProc(name, module, [*args, "--state-dir", str(self.root / name)], self.root / name,
                         self.root / f"{name}.log", niceness)
        self.procs.append(proc)
        return proc

    def run(self) -> Outcome:
        outcome = Outcome(self.scenario)
        try:
            boot = self.start_honest()
            before = [p.status() for p in self.honest]
            rss0 = [p.rss_mb() for p in self.honest]
            self.start_extra(boot)
            started = time.time()
            outcome.samples = self.sample(started)
            outcome.attackers = self.attacker_ids()
            outcome.carried_out = self.carried_out()
            honest_ids = [st0.get("peer_id", "") for st0 in before]
            slots = self.slots_per_step()
            outcome.honest = []
            for i, (p, st0, r0) in enumerate(zip(self.honest, before, rss0, strict=True)):
                node = self.collect(p, st0, r0, started, outcome.attackers, outcome.samples)
                banned_at = {a: node["reputation"].get(a, {}).get("first_banned") for a in outcome.attackers}
                outcome.honest.append(node | judged(
                    i, honest_ids, outcome.attackers, outcome.samples, self.turn_after(), slots,
                    in_rounds=not self.scenario.traits.client,
                    banned_at={a: t - started for a, t in banned_at.items() if t is not None}))
        except Exception as exc:  # a scenario that could not run is reported, the others still run
            outcome.error = f"{type(exc).__name__}: {exc}"[:400]
        finally:
            for proc in self.procs:
                proc.stop()
        return outcome

    def slots_per_step(self) -> float:
        """Rounds a node takes part in per step of the swarm clock: F fragments, each every H steps."""
        try:
            outer = load_config(self.config).outer
        except Exception:
            return 0.0
        return outer.fragments / max(1, outer.h) if outer.schedule == "fixed" else (
            (outer.sends_per_h or outer.fragments) / max(1, outer.h))

    def start_honest(self) -> str:
        first = self.spawn("honest0", ["locoswarm.node.cli", "run"], self.node_args(0))
        self.honest.append(first)
        addrs = first.wait_for(lambda s: s.get("addrs"), 120, "addresses")["addrs"]
        boot = next((a for a in addrs if "/127.0.0.1/" in a), addrs[0])
        for i in range(1, self.n_honest):
            self.honest.append(self.spawn(f"honest{i}", ["locoswarm.node.cli", "run"],
                                          [*self.node_args(i), "--bootstrap", boot]))
        if self.n_honest > 1:
            for proc in self.honest:
                proc.wait_for(lambda s: s.get("syncs_ok", 0) >= 2, 180, "two merged rounds")
        return boot

    def start_extra(self, boot: str) -> None:
        kind, n, traits = self.scenario.kind, self.scenario.hostile, self.scenario.traits
        if traits.baseline:
            # Bystanders: as much CPU as a hostile node, none of its (refused) contributions; an honest
            # extra member would make the baseline a larger swarm that learns faster than the one attacked.
            for i in range(n):
                self.extra.append(self.spawn(f"bystander{i}", ["locoswarm.node.cli", "run"],
                                             [*self.node_args(), "--set", f"swarm.name=robustness-bystander-{i}"],
                                             self.nice_others))
        elif traits.honest:
            for i in range(n):
                self.extra.append(self.spawn(f"control{i}", ["locoswarm.node.cli", "run"],
                                             [*self.node_args(), "--bootstrap", boot], self.nice_others))
        elif traits.client:
            for i in range(n):
                args = ["--config", str(self.config), "--bootstrap", boot, "--seconds", str(self.seconds + 5),
                        "--report", str(self.root / f"hostile{i}.json")]
                self.extra.append(self.spawn(f"hostile{i}", ["locoswarm.node.bench.hostile", "--attack", kind], args,
                                             self.nice_others))
        else:
            period = ["--attack-period", f"{self.turn_after():.1f}"] if traits.turns else []
            for i in range(n):
                self.extra.append(self.spawn(f"hostile{i}", ["locoswarm.node.bench.hostile", "--attack", kind, *period],
                                             [*self.node_args(), "--bootstrap", boot], self.nice_others))
        if not traits.client:
            for proc in self.extra:
                proc.wait_for(lambda s: s.get("state") == "training", 120, "training")

    def turn_after(self) -> float:
        """Seconds after the attack window opens at which the attack itself begins (a sleeper's turn)."""
        return SLEEPER_SHARE * self.seconds if self.scenario.traits.turns else 0.0

    def sample(self, started: float) -> list[Sample]:
        task = self.progress.add_task(f"  {self.scenario.name}", total=self.seconds) if self.progress else None
        samples = []
        t0 = time.monotonic()
        first: dict[str, float] = {}
        while (elapsed := time.monotonic() - t0) < self.seconds:
            statuses = [p.status() for p in self.honest]
            hostile = [(p, p.status()) for p in self.extra] if not self.scenario.traits.baseline else []
            for proc, st in hostile:
                if st.get("peer_id") and st["peer_id"] not in first:
                    start = attack_start(st.get("events", []), carried_out_at(proc.log_path), started)
                    if start is not None:
                        first[st["peer_id"]] = start
            samples.append(Sample(
                t=time.time() - started,
                evals=[(st.get("eval_curve") or [[0, None]])[-1][1] for st in statuses],
                rounds_ok=sum(st.get("syncs_ok", 0) for st in statuses),
                rounds_failed=sum(st.get("syncs_failed", 0) for st in statuses),
                rss_mb=max(p.rss_mb() for p in self.honest),
                clocks=[int(st.get("clock", 0)) for st in statuses],
                attacker_rounds=sum(st.get("syncs_ok", 0) + st.get("syncs_failed", 0) for _, st in hostile),
                attacker_first=dict(first),
                banned=[sorted(p for p, r in ((st.get("reputation") or {}).get("peers") or {}).items()
                               if r.get("banned")) for st in statuses]))
            if task is not None:
                self.progress.update(task, completed=min(elapsed, self.seconds))
            time.sleep(min(2.0, max(0.0, self.seconds - elapsed)))
        if task is not None:
            self.progress.remove_task(task)
        return samples

    def attacker_ids(self) -> list[str]:
        ids = []
        for i, proc in enumerate(self.extra):
            if self.scenario.traits.baseline:
                continue
            if self.scenario.traits.client:
                with contextlib.suppress(Exception):  # the client may still be writing its report
                    proc.proc.wait(30)
                with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                    ids.append(json.loads((self.root / f"hostile{i}.json").read_text())["peer_id"])
            elif proc.status().get("peer_id"):
                ids.append(proc.status()["peer_id"])
        return ids

    def carried_out(self) -> int | None:
        """Hostile nodes whose attack really ran: a patch that no longer fits the node fails inside its tasks
        and leaves an honest node, whose scenario would read as a perfect defence."""
        if not self.scenario.traits.patched:
            return None
        return sum(1 for p in self.extra if carried_out_at(p.log_path) is not None)

    @staticmethod
    def collect(proc: LocalProc, before: dict, rss0: float, started: float, attackers: list[str],
                samples: list[Sample]) -> dict:
        st = proc.status()
        curve = st.get("eval_curve") or []
        peers = (st.get("reputation") or {}).get("peers", {})
        merged = [e for e in st.get("events", []) if e.get("kind") == "merged" and e.get("time", 0) >= started]
        rss_max = max([rss0, *(s.rss_mb for s in samples)])
        return {
            "peer_id": st.get("peer_id"), "alive": proc.alive(),
            "initial_eval": curve[0][1] if curve else None,
            "eval_before": (before.get("eval_curve") or [[0, None]])[-1][1],
            "final_eval": curve[-1][1] if curve else None,
            "final_clock": curve[-1][0] if curve else None,
            "eval_curve": curve,
            "phi_finite": all(f.get("phi_norm") is not None and math.isfinite(f["phi_norm"])
                              for f in st.get("fragments", [])),
            "inner_steps": st.get("inner_step", 0) - before.get("inner_step", 0),
            "rounds_ok": st.get("syncs_ok", 0) - before.get("syncs_ok", 0),
            "rounds_failed": st.get("syncs_failed", 0) - before.get("syncs_failed", 0),
            "merged_with_peers": sum(1 for e in merged if e.get("group_size", 0) >= 2),
            "attacker_refused": sum(peers.get(a, {}).get("refused", 0) for a in attackers),
            "attacker_banned": any(peers.get(a, {}).get("banned") for a in attackers),
            "all_attackers_banned": bool(attackers) and all(peers.get(a, {}).get("banned") for a in attackers),
            "refused_by_kind": {a[:12]: peers.get(a, {}).get("by_kind", {}) for a in attackers},
            "effect_checks": st.get("effect_checks", 0), "effect_refused": st.get("effect_refused", 0),
            "contested_checks": st.get("contested_checks", 0),
            # ``last``: the node's last refusal of the peer, "kind: detail" (why honest nodes refuse each other)
            "reputation": {p: {k: r.get(k) for k in ("refused", "offences", "by_kind", "banned", "first_banned",
                                                     "last")}
                           for p, r in peers.items()},
            # the refusals counted before the window opened (the honest swarm forming): ``honest_refusals`` counts
            # the window's alone
            "refused_before": {p: r.get("by_kind", {}) for p, r in
                               ((before.get("reputation") or {}).get("peers") or {}).items()},
            "rss_mb_before": rss0, "rss_growth_mb": rss_max - rss0,
        }


# A hostile node's failed round that sent nothing to an honest member (``UNSENT_FAILURES``): it had no group,
# arrived after the window, was dropped by every other member, or its contribution was refused before it was read
# (not in the reducer's round or group). Its attack begins with its first round that did send: a joining node
# fails such rounds for a while (up to 25 s in a 4 + 2 run on a loaded 2-core machine), and a ban cannot come
# before any honest node has seen what it sends.

def attack_round(event: dict) -> bool:
    """Whether a hostile node's status event is a round whose contributions reached an honest member."""
    # lazy: locoswarm.node.core.transport imports torch (~1 s, measured); this module does not
    from locoswarm.node.core.transport import UNSENT_FAILURES

    kind = event.get("kind")
    if kind == "merged":
        return True
    return kind == "failed" and not any(text in str(event.get("detail", "")) for text in UNSENT_FAILURES)


def carried_out_at(log_path: Path) -> float | None:
    """When a hostile node's log says its attack was first carried out (epoch seconds; None: not yet)."""
    with contextlib.suppress(OSError):
        found = CARRIED_OUT_AT.search(log_path.read_text(errors="replace"))
        return float(found.group(1)) if found else None
    return None


def attack_start(events: list[dict], carried_out: float | None, started: float) -> float | None:
    """Seconds since the window opened (``started``, epoch) at which a hostile node's attack began: its first round in
    the window that reached an honest member (``attack_round``), and not before its attack was first carried out
    (``carried_out``, epoch): a state liar's lies begin with its first forged heartbeat, seconds after its first
    round (robustness bench, 4 + 2 replayliar: 7 s). None until both happened."""
    rounds = [e["time"] - started for e in events if attack_round(e) and e.get("time", 0) >= started]
    if not rounds or carried_out is None:
        return None
    return max(min(rounds), carried_out - started)


def judged(i: int, honest_ids: list[str], attackers: list[str], samples: list[Sample], turn_after: float,
           slots_per_step: float, in_rounds: bool = True, banned_at: dict[str, float] | None = None) -> dict:
    """What honest node ``i`` did about its peers during the window: per attacker the seconds and rounds from the
    start of its attack to its first ban by this node (None: not banned), and the ids of the other honest nodes
    (whose refusals by this node the summary counts). The attack starts ``turn_after`` s into the window, and a
    node attack not before that hostile node's own start (``Sample.attacker_first``: its first round that sent to an
    honest member, since it acts through rounds and a joining node takes a while to get into one, and not before
    its attack was carried out; a client's attack starts with the window). A ban's time is the node's own record
    (``banned_at``: seconds since the window opened), else the first sample that shows it; its rounds are the
    node's swarm clock advance from the start to the ban (linear between samples) times ``slots_per_step``."""
    banned_at = banned_at or {}
    clocks = [[s.t, s.clocks[i]] for s in samples if i < len(s.clocks)]
    bans: dict[str, dict | None] = {}
    for a in attackers:
        firsts = [s.attacker_first[a] for s in samples if a in s.attacker_first]
        start = (max(turn_after, min(firsts)) if firsts else None) if in_rounds else turn_after
        t = banned_at.get(a)
        if t is None:
            t = next((s.t for s in samples if i < len(s.banned) and a in s.banned[i]), None)
        if t is None:
            bans[a[:12]] = None
            continue
        t0 = turn_after if start is None else start
        rounds = None
        if start is not None and clocks:
            advance = _clock_at(clocks, max(t, start)) - _clock_at(clocks, start)
            rounds = max(0.0, advance * slots_per_step)
        bans[a[:12]] = {"seconds": max(0.0, t - t0), "rounds": rounds}
    return {"bans": bans, "honest_ids": [h for j, h in enumerate(honest_ids) if j != i]}


def _clock_at(clocks: list[list[float]], t: float) -> float:
    """A node's swarm clock at ``t`` from its samples ([[t, clock], ...]), linear between them, the nearest end
    outside them."""
    if t <= clocks[0][0]:
        return float(clocks[0][1])
    if t >= clocks[-1][0]:
        return float(clocks[-1][1])
    value = interpolate(clocks, t)
    return float(clocks[-1][1]) if value is None else value


# ---- command line ---------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("robustness", help="honest nodes against hostile peers of each kind (multi-process)",
                       description=describe(__doc__))
    add_data_args(p)
    p.add_argument("--out", required=True,
                   help="report directory (results.json, report.md, robustness.png; the nodes' logs under logs/)")
    p.add_argument("--config", default=None,
                   help="the swarm's peers.toml (default: a tiny fast swarm written for the benchmark)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated scenarios (default all): {','.join(KINDS)}")
    p.add_argument("--seconds", type=float, default=40.0, help="seconds of attack per scenario (default 40)")
    p.add_argument("--counts", default="1", help="hostile peers per attack scenario, comma-separated (default 1; "
                                                 "e.g. 1,2)")
    p.add_argument("--honest", type=int, default=2, help="honest nodes per scenario (default 2)")
    p.add_argument("--render", action="store_true",
                   help="run nothing: write report.md and robustness.png again from --out's results.json (after a "
                        "change of the report's columns)")
    p.add_argument("--split-data", action="store_true",
                   help="give each honest node a disjoint share of the data (not identically distributed: the "
                        "entries of each data directory dealt out by size); attackers, bystanders and control "
                        "members read all of it")
    p.add_argument("--nice-others", type=int, default=0, metavar="N",
                   help="run the added peers (attackers and bystanders alike) at nice N, so that on a small machine "
                        "the honest nodes keep the cores as they would with the attackers on machines of their own "
                        "(default 0: all equal)")
    p.set_defaults(func=run_robustness)


def _scenarios(kinds_text: str, counts_text: str) -> list[Scenario]:
    kinds = [k.strip() for k in kinds_text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UserError(f"--kinds {kinds_text!r}: unknown scenario {bad[0] if bad else '(none)'}; "
                        f"choose from {','.join(KINDS)}")
    try:
        counts = sorted({int(c) for c in counts_text.split(",") if c.strip()})
    except ValueError:
        raise UserError(f"--counts {counts_text!r}: give whole numbers, e.g. 1,2") from None
    if not counts or counts[0] < 1 or counts[-1] > 4:
        raise UserError(f"--counts {counts_text!r}: each count must be in 1..4")
    out = []
    for kind in kinds:
        out += [Scenario(kind, n) for n in counts]
    return out


def run_robustness(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.render:
        return render_again(Path(args.out))
    scenarios = _scenarios(args.kinds, args.counts)
    if not (math.isfinite(args.seconds) and 1 <= args.seconds <= 3600):
        raise UserError(f"--seconds {args.seconds} is not allowed; use 1..3600")
    if not 1 <= args.honest <= 8:
        raise UserError(f"--honest {args.honest} is not allowed; use 1..8")
    if not 0 <= args.nice_others <= 19:
        raise UserError(f"--nice-others {args.nice_others} is not allowed; use 0..19")
    if args.config and not Path(args.config).is_file():
        raise UserError(f"--config {args.config}: no such file")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    data = [str(Path(d).resolve()) for d in data_paths(args)]
    shares = split_data(data, args.honest) if args.split_data else None
    setup = {"honest": args.honest, "seconds": args.seconds, "nice_others": args.nice_others,
             "config": args.config or tiny_swarm(),
             "data": data or "the node's default corpus", "scenarios": [s.name for s in scenarios]}
    if shares is not None:
        setup["split_data"] = shares
    results: dict[str, dict] = {}
    started = time.perf_counter()
    with local_swarm_runs("robustness", len(scenarios), console) as (tmp, progress, overall):
        for i, scenario in enumerate(scenarios):
            root = tmp / f"s{i}"
            root.mkdir()
            config = Path(args.config).resolve() if args.config else write_tiny_config(root / "peers.toml")
            outcome = ScenarioRun(scenario, root, config, data, args.honest, args.seconds, progress,
                                  nice_others=args.nice_others, shares=shares).run()
            results[scenario.name] = outcome.summary()
            keep_logs(root, out / "logs" / scenario.name)
            progress.console.print(_one_line(scenario.name, results[scenario.name]))
            progress.update(overall, advance=1)
            write_report(out, setup, results, time.perf_counter() - started)
    report = write_report(out, setup, results, time.perf_counter() - started)
    Console().print(report["table_md"])
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'robustness.png'}")
    return 0


def render_again(out: Path) -> int:
    """``--render``: the report of an earlier run, from its results.json."""
    from rich.console import Console

    try:
        doc = json.loads((out / "results.json").read_text())
        setup, results, wall = doc["setup"], doc["scenarios"], float(doc["wall_seconds"])
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"--render: {out / 'results.json'} is not a results file of this benchmark ({exc})") from None
    report = write_report(out, setup, results, wall)
    Console().print(report["table_md"])
    return 0


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _one_line(name: str, r: dict) -> str:
    if r["error"]:
        return f"{name:<12} could not run: {r['error']}"
    return (f"{name:<12} final eval {_fmt(r['final_eval'])}  rounds ok {r['rounds_ok']} failed {r['rounds_failed']}  "
            f"attacker refused {r['attacker_refused']} banned by {r['banned_by']}/{len(r['honest'])}  "
            f"RSS +{r['rss_growth_mb']:.0f} MB")


def clean_baseline(results: dict[str, dict], r: dict) -> float | None:
    """The final eval of the clean scenario with as many added peers as ``r`` (None if it did not run)."""
    clean = _clean_of(results, r)
    return None if clean is None else clean["final_eval"]


def _clean_of(results: dict[str, dict], r: dict) -> dict | None:
    for other in results.values():
        if scenario_kind(other["kind"]).baseline and other["hostile"] == r["hostile"] and not other["error"]:
            return other
    return None


def interpolate(curve: list[list[float]], x: float) -> float | None:
    """The eval loss of ``curve`` ([[clock, loss], ...], clocks ascending) at clock ``x``, linear between its
    points; None outside the curve's range (no extrapolation)."""
    points = [(float(c), float(v)) for c, v in curve if v is not None and math.isfinite(v)]
    for (c0, v0), (c1, v1) in itertools.pairwise(points):
        if c0 <= x <= c1:
            return v0 if c1 == c0 else v0 + (v1 - v0) * (x - c0) / (c1 - c0)
    return points[0][1] if len(points) == 1 and points[0][0] == x else None


EQUAL_SPAN = 100  # swarm clock steps over which the equal-progress comparison averages the evaluations


def window_mean(curve: list[list[float]], lo: float, hi: float) -> float | None:
    """The mean eval loss of ``curve``'s points with a clock in ``[lo, hi]`` (the curve's value at ``hi``, linear
    between its points, when none falls inside); None outside the curve's range."""
    inside = [float(v) for c, v in curve if v is not None and math.isfinite(v) and lo <= c <= hi]
    return sum(inside) / len(inside) if inside else interpolate(curve, hi)


def equal_progress(results: dict[str, dict], r: dict) -> tuple[float, float] | None:
    """``r``'s honest nodes' eval loss and the clean run's, each averaged over the ``EQUAL_SPAN`` swarm-clock steps
    before the clock both reached (the smaller of the two final clocks, per pair of nodes): the attack's cost to
    the model, without the cost of the CPU the attackers took from the honest nodes on a shared machine (fewer
    steps in the same seconds), and without extrapolating either curve. None when a curve is missing."""
    clean = _clean_of(results, r)
    if clean is None:
        return None
    attacked, baseline = [], []
    for h in r["honest"]:
        for c in clean["honest"]:
            if h.get("final_clock") is None or c.get("final_clock") is None:
                return None
            hi = min(h["final_clock"], c["final_clock"])
            a = window_mean(h.get("eval_curve") or [], hi - EQUAL_SPAN, hi)
            b = window_mean(c.get("eval_curve") or [], hi - EQUAL_SPAN, hi)
            if a is None or b is None:
                return None
            attacked.append(a)
            baseline.append(b)
    if not attacked:
        return None
    return sum(attacked) / len(attacked), sum(baseline) / len(baseline)


def worst_vs_clean(results: dict[str, dict], r: dict) -> float | None:
    """The worst the honest nodes' eval loss got against the clean run's during the window, at equal progress:
    the largest relative excess of an honest node's mean eval loss over ``EQUAL_SPAN`` clock steps (at each of
    its evaluations in the window) over the clean nodes' mean at the same clocks. None where it cannot be
    measured (no clean run, or no clock both reached)."""
    clean = _clean_of(results, r)
    if clean is None or not r.get("samples"):
        return None
    worst = None
    for i, h in enumerate(r["honest"]):
        clocks = r["samples"][0].get("clocks") or []
        start = clocks[i] if i < len(clocks) else None
        curve = h.get("eval_curve") or []
        for c, _ in curve:
            if start is None or c < start + EQUAL_SPAN:
                continue
            a = window_mean(curve, c - EQUAL_SPAN, c)
            b = [window_mean(k.get("eval_curve") or [], c - EQUAL_SPAN, c) for k in clean["honest"]]
            if a is None or any(v is None for v in b) or not b:
                continue
            base = sum(b) / len(b)
            if base > 0:
                worst = max(worst if worst is not None else -math.inf, (a - base) / base)
    return worst


def clean_at_equal_progress(results: dict[str, dict], r: dict) -> float | None:
    """The clean side of :func:`equal_progress` (None when it cannot be measured)."""
    pair = equal_progress(results, r)
    return None if pair is None else pair[1]


def markdown_table(results: dict[str, dict]) -> str:
    rows = ["| scenario | honest alive | final eval (honest mean) | vs clean | vs clean at equal progress | "
            "worst vs clean during | honest steps (mean) | max eval during | rounds ok | rounds failed | "
            "attacker refused | banned by | to ban: s / rounds (max) | "
            "honest refused by honest: judged / offences / protocol | RSS growth (MB) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if r["error"]:
            rows.append(f"| {name} | could not run: {r['error'][:80]} | | | | | | | | | | | | | |")
            continue
        traits = scenario_kind(r["kind"])
        attack = not traits.baseline
        clean = clean_baseline(results, r)
        rel = (f"{100 * (r['final_eval'] - clean) / clean:+.1f}%" if clean and r["final_eval"] is not None
               and attack else "-")
        pair = equal_progress(results, r) if attack else None
        rel_equal = f"{100 * (pair[0] - pair[1]) / pair[1]:+.1f}%" if pair and pair[1] else "-"
        worst = worst_vs_clean(results, r) if attack else None
        rel_worst = "-" if worst is None else f"{100 * worst:+.1f}%"
        refused = str(r["attacker_refused"]) if attack else "-"
        banned = f"{r.get('banned_by_all', r['banned_by'])}/{len(r['honest'])}" if attack else "-"
        if traits.honest:  # honest extra members: any ban of one is a false positive
            banned = f"{r['banned_by']}/{len(r['honest'])} (false positives)"
        ran = r.get("attack_carried_out")
        if attack and ran is not None and ran < r["hostile"]:
            refused += f" (attack ran in {ran}/{r['hostile']} hostile nodes)"
        to_ban = "-"
        if attack and r.get("max_seconds_to_ban") is not None:
            rounds = r.get("max_rounds_to_ban")
            to_ban = f"{r['max_seconds_to_ban']:.0f} / " + ("-" if rounds is None else f"{rounds:.0f}")
        elif attack and not traits.honest:
            to_ban = "not all"
        hh = r.get("honest_refusals") or {}
        honest_hh = f"{hh.get('judged', 0)} / {hh.get('offences', 0)} / {hh.get('protocol', 0)}"
        if hh.get("before_judged") or hh.get("before_protocol"):
            honest_hh += f" (before: {hh.get('before_judged', 0)} / {hh.get('before_protocol', 0)})"
        steps = [h.get("inner_steps", 0) for h in r["honest"]]
        rows.append(f"| {name} | {r['honest_alive']}/{len(r['honest'])} | {_fmt(r['final_eval'])} | {rel} | "
                    f"{rel_equal} | {rel_worst} | "
                    f"{sum(steps) / max(1, len(steps)):.0f} | {_fmt(r['max_eval_during'])} | {r['rounds_ok']} | "
                    f"{r['rounds_failed']} | {refused} | {banned} | {to_ban} | {honest_hh} | "
                    f"{r['rss_growth_mb']:.0f} |")
    return "\n".join(rows)


def render_markdown(setup: dict, results: dict[str, dict], table: str, wall: float) -> str:
    lines = [
        "# Robustness benchmark", "",
        f"{setup['honest']} honest nodes per scenario (real processes on loopback); an attack scenario adds N "
        "hostile peers of one kind (`python -m locoswarm.node.bench.hostile`; `xN` in its name, 1 if none), `clean` "
        "adds N bystanders instead (nodes training as hard, each in a swarm of its own: the same share of the "
        "machine's cores, no contribution), `control` adds N honest members reading all the data as attackers do "
        "(their refusals and bans are false positives); vs clean compares with the clean run of the same N. "
        f"{setup['seconds']:.0f} s of attack per scenario, once the hostile node trains; "
        + (f"the added peers (attackers and bystanders alike) ran at nice {setup['nice_others']}; "
           if setup.get("nice_others") else "") +
        f"wall time {wall / 60:.1f} min.",
        "", "Final eval: the honest nodes' last held-out eval loss at the end of the attack; rounds: merged and failed "
        "rounds of the honest nodes during it; honest steps: inner steps each honest node made during it (on a shared "
        "machine, other load shows here first: fewer steps, a higher loss); vs clean at equal progress: the honest "
        f"nodes' eval loss against the clean run's, each the mean of the evaluations over the {EQUAL_SPAN} swarm-clock "
        "steps before the clock both runs reached (the attack's cost to the model without the CPU the attackers "
        "took); worst vs clean during: the largest excess of that mean at any evaluation of an honest node during "
        "the window over the clean run's at the same clock; attacker refused: refusals of the attackers' peer ids "
        "counted by the honest nodes; banned by: honest "
        "nodes that ban every attacker at the end; to ban: the longest any honest node took to ban an attacker after "
        "that attacker's attack began (its first round in the window that sent to an honest member, not before its "
        "log says its attack was carried out; a sleeper turns a third into it) to the ban the node recorded, in "
        "seconds and in the rounds the node took part in "
        "meanwhile (its swarm clock's "
        "advance x F / H; 'not all': some attacker was never banned by some honest node); honest refused by "
        "honest: refusals the honest nodes counted of each other during the window, of something one "
        "sent (a contribution, a reduced part, a state, a claim), the offences among all their refusals (which count "
        "toward a ban), and protocol refusals, which judge only when a stream came (a round the reducer had skipped "
        "or formed otherwise; a state request before the holder's table showed the requester); 'before': the judged "
        "and protocol refusals counted while the honest nodes formed their swarm, before the window. Who banned "
        "whom, and when: "
        "`results.json` (each honest node's `bans`).",
        "", table, "",
        "![eval loss](robustness.png)", ""]
    return "\n".join(lines)


def write_report(out: Path, setup: dict, results: dict[str, dict], wall: float) -> dict:
    doc = {"setup": setup, "scenarios": results, "wall_seconds": wall}
    atomic_write_text(out / "results.json", json.dumps(doc, indent=1))
    table = markdown_table(results)
    atomic_write_text(out / "report.md", render_markdown(setup, results, table, wall))
    plot(out / "robustness.png", results)
    return {"table_md": table, **doc}


def plot(path: Path, results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for name, r in results.items():
        points = [(s["t"], sum(v for v in s["evals"] if v is not None) / len([v for v in s["evals"] if v is not None]))
                  for s in r["samples"] if any(v is not None for v in s["evals"])]
        points = [(t, v) for t, v in points if math.isfinite(v)]
        baseline = scenario_kind(r["kind"]).baseline
        if points:
            ax.plot([t for t, _ in points], [v for _, v in points], label=name,
                    lw=2.5 if baseline else 1.2, color="black" if baseline else None,
                    ls="--" if baseline and r["hostile"] > 1 else "-")
    ax.set_xlabel("seconds since the attack started")
    ax.set_ylabel("honest nodes' eval loss (mean)")
    ax.set_title("eval loss of the honest nodes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    names = [n for n, r in results.items() if not scenario_kind(r["kind"]).baseline]
    ys = range(len(names))
    bx.barh([y - 0.2 for y in ys], [results[n]["attacker_refused"] for n in names], height=0.4, label="refused")
    bx.barh([y + 0.2 for y in ys], [results[n]["banned_by"] for n in names], height=0.4, label="banned by (nodes)")
    bx.set_yticks(list(ys), names)
    bx.set_xscale("symlog")
    bx.invert_yaxis()
    bx.set_title("what the honest nodes did about the attackers")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3, axis="x")
    write_png(fig, path)
