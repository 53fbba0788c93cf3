"""One configuration of the swarm benchmark: start N real peers in their namespaces, measure, stop.

A peer is a real ``locoswarm run`` process (or, for the ``hivemind`` configuration, the program of
:mod:`locoswarm.node.bench.swarm.peers`) started with ``ip netns exec`` in node ``i``'s namespace, in a session
of its own so that it and everything it starts (the DHT child, p2pd, the watchdog) are stopped by
process group, never by name. Peers are observed only through ``status.json`` in their state dirs.

Measurement: once every peer trains and sees the other N-1 (plus ``warmup`` seconds for joins and
first rounds), a *before* status is taken, the peers run ``seconds`` more while every status is
polled (each event seen is kept once), then an *after* status. All figures are differences between
the two, divided by the difference of the peer's own ``uptime_s``: the node's compute seconds are
``compute_utilization * uptime_s`` in the same status, so the window's utilization is exact for the
window whatever the start-up cost. ``node_metrics`` does that arithmetic (pure, unit-tested).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from locoswarm.node.bench.swarm.netns import Topology
from locoswarm.node.swarm.process import (
    PR_SET_PDEATHSIG,
    _prctl,
    cleanup_ipc_files,
    descendants,
    ipc_files,
    kill_groups,
    proc_stat,
    tree_groups,
)

REPO = Path(__file__).resolve().parents[3]
NODE_PORT = 31337
PROXY_PORT = 31338


#: Signals that stop the bench (cli._Interrupt): held back while a child is spawned and recorded.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the bench dies, even by SIGKILL (its own session
    puts it out of reach of a signal to the bench's group; the setting survives ``ip netns exec``).
    The stop signals the spawner blocked are unblocked again (a blocked mask survives exec)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class BenchProc:
    """A process in a session of its own (optionally inside a namespace); stopped by process group."""

    def __init__(self, name: str, argv: list[str], log_path: Path, into: list[BenchProc],
                 env: dict[str, str] | None = None) -> None:
        """Start the process and append it to ``into`` with the stop signals held back, so that a Ctrl+C
        or SIGTERM (a KeyboardInterrupt) can never fall between the two and leave an untracked child."""
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
            self.pid = self.proc.pid
            into.append(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a held signal is handled here, once recorded

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 6) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def groups(self) -> set[int]:
        """Process groups of this process and its descendants (the DHT child leads its own)."""
        return tree_groups(self.pid)

    def kill(self) -> None:
        """SIGKILL every process group of this process tree, wait until they are gone, remove the IPC
        files (hivemind sockets, torch shared memory) the killed processes leave behind."""
        kill_groups(self.groups(), self.proc)

    def close(self) -> None:
        self.kill()
        with contextlib.suppress(OSError):
            self._log.close()


def stop_all(procs: list[BenchProc], grace_s: float = 12.0) -> list[str]:
    """SIGTERM every process (a node leaves gracefully: DHT shut down, no files left), wait up to
    ``grace_s`` for all of them together, then kill whatever is left by process group. The IPC files
    of the process trees (recorded before) that outlive them are removed; returns those that could
    not be (normally none)."""
    pids = [q for p in procs if p.alive() for q in (p.pid, *descendants(p.pid))]
    started = {pid: st[4] for pid in pids if (st := proc_stat(pid)) is not None}
    files = ipc_files(pids)
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        p.close()

    def ours_alive() -> list[int]:  # same pid and start time: never a reused pid
        return [pid for pid, t in started.items() if (st := proc_stat(pid)) is not None and st[4] == t
                and st[1] not in ("Z", "X")]

    # helpers in sessions of their own (torch's shared-memory manager) exit once their clients are gone
    deadline = time.monotonic() + 5.0
    while ours_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in ours_alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while ours_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    cleanup_ipc_files(pids, files)
    return sorted(f for f in files if os.path.exists(f))


def read_status(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


_PEER_RE = re.compile(r"\b(?:Qm[1-9A-HJ-NP-Za-km-z]{6,}|12D3Koo[1-9A-HJ-NP-Za-km-z]{6,}|[0-9a-f]{12,})\b(?:…|\.\.\.)?")
_NUM_RE = re.compile(r"\b\d+(?:\.\d+)?\b")
_LIST_RE = re.compile(r"\[[^\]]*\]")  # a list of peers (a round's group, whom it awaited) or the round's timing


def failure_reason(event: dict) -> str:
    """The reason of a ``failed`` event, with peer ids, numbers and bracketed lists replaced so that equal reasons
    count together (``peer <peer> sent <n> of <n> reduced chunks``)."""
    text = str(event.get("error") or "")
    if not text:
        detail = str(event.get("detail", ""))
        text = detail.split(": ", 1)[1] if ": " in detail else detail
    text = _LIST_RE.sub("[…]", _PEER_RE.sub("<peer>", text))
    return _NUM_RE.sub("<n>", text).strip()[:160] or "unknown"


def _mean_of(events: list[dict], key: str) -> float | None:
    vals = [float(e[key]) for e in events if isinstance(e.get(key), int | float) and math.isfinite(e[key])]
    return sum(vals) / len(vals) if vals else None


def _compute_seconds(st: dict) -> float:
    return float(st.get("compute_utilization") or 0.0) * float(st.get("uptime_s") or 0.0)


def reachability(st: dict) -> tuple[str, int]:
    """A status's reachability: its ``reachability.state`` (public, relayed, outbound-only or unknown; "unknown"
    where the node reports none) and its ``reachability.relayed_bytes`` (0 where it reports none)."""
    r = st.get("reachability")
    if not isinstance(r, dict):
        return "unknown", 0
    state = r.get("state")
    try:
        relayed = max(0, int(r.get("relayed_bytes") or 0))
    except (TypeError, ValueError):
        relayed = 0
    return (state if isinstance(state, str) and state else "unknown"), relayed


def _count(value: object) -> int:
    """A non-negative count from a status field (0 where it is missing or not a number)."""
    try:
        return max(0, int(value or 0))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0


def node_metrics(before: dict, after: dict, events: list[dict]) -> dict:
    """Figures of one peer over the window between two of its statuses; ``events`` are the events it
    reported in the window (each once).

    Rounds by kind: ``rounds_ok`` (merged) and ``rounds_failed`` from the node's counters, ``standing_rounds``
    (rounds that took the last merged round's members), ``matchmade_rounds`` (the others that ended in the
    window: merged + failed - standing, or the status's own ``matchmade_rounds`` where it has one) and
    ``dropped`` (``dropped`` events: stale progress thrown away). ``reachability`` is the state in the
    *after* status, ``relayed_bytes`` the growth of its counter over the window."""
    wall = float(after.get("uptime_s", 0.0)) - float(before.get("uptime_s", 0.0))
    compute = _compute_seconds(after) - _compute_seconds(before)
    steps = int(after.get("inner_step", 0)) - int(before.get("inner_step", 0))

    def delta(key: str) -> int:
        return int(after.get(key, 0) or 0) - int(before.get(key, 0) or 0)

    def bytes_delta(key: str) -> int:
        return int((after.get("bytes") or {}).get(key, 0)) - int((before.get("bytes") or {}).get(key, 0))

    reasons = Counter(failure_reason(e) for e in events if e.get("kind") == "failed")
    merged = [e for e in events if e.get("kind") == "merged"]
    kinds = Counter(str(e.get("kind")) for e in events)
    curve = after.get("eval_curve") or []
    ok = wall > 0
    state, relayed_after = reachability(after)
    _, relayed_before = reachability(before)
    standing = delta("standing_rounds")
    if "matchmade_rounds" in after:
        matchmade = delta("matchmade_rounds")
    else:
        matchmade = max(0, delta("syncs_ok") + delta("syncs_failed") - standing)
    return {
        "peer_id": after.get("peer_id"),
        "window_s": wall,
        "utilization": compute / wall if ok else None,
        "steps": steps,
        "steps_per_s": steps / wall if ok else None,
        "step_time_s": compute / steps if steps > 0 else None,
        "rounds_ok": delta("syncs_ok"),
        "rounds_failed": delta("syncs_failed"),
        "failure_reasons": dict(reasons.most_common()),
        "catch_ups": delta("catch_ups"),
        "standing_rounds": standing,
        "matchmade_rounds": matchmade,
        "dropped": kinds.get("dropped", 0),
        "catch_up_loops": kinds.get("catch_up_loop", 0),
        "reachability": state,
        "relayed_bytes": max(0, relayed_after - relayed_before),
        "relayed_bytes_total": relayed_after,
        # peers it failed to dial lately, at the window's end (rounds keep it out of their groups: ``dial_failures``)
        "undialable": _count((after.get("reachability") or {}).get("undialable")),
        "sent_bytes_per_s": bytes_delta("sent") / wall if ok else None,
        "received_bytes_per_s": bytes_delta("received") / wall if ok else None,
        "event_counts": dict(kinds.most_common()),
        # A merged round's wall time: until its member list was decided (the fixed cost) and until done.
        "matchmaking_s": _mean_of(merged, "matchmaking_s"),
        "round_s": _mean_of(merged, "round_s"),
        # the curve's first point is the evaluation at start: a node too slow to reach eval_every has no other
        "eval_loss": float(curve[-1][1]) if len(curve) > 1 else None,
        "initial_eval_loss": float(curve[0][1]) if curve else None,
        "loss": after.get("loss"),
        # the node process's resident memory at the window's end (its DHT child and p2pd not counted)
        "rss_mb": _rss_mb(after),
        "peak_rss_mb": _rss_mb(after, "peak_rss"),
    }


def _rss_mb(st: dict, key: str = "rss") -> float | None:
    """A status's ``memory.rss`` (or ``peak_rss``) in MB (10^6 bytes, as ``bench memory``); None where missing."""
    value = (st.get("memory") or {}).get(key)
    return round(float(value) / 1e6, 1) if isinstance(value, int | float) and value > 0 else None


def first_merge(events: list[dict], since: float, before: float | None = None) -> float | None:
    """Seconds from ``since`` (a node's start, wall clock) to the first ``merged`` event among ``events`` (a merged
    round with peers: a lone node's outer steps make no such event); ``before``: the earliest already known."""
    times = [float(e["time"]) for e in events if e.get("kind") == "merged" and isinstance(e.get("time"), int | float)]
    if before is not None:
        times.append(since + before)
    return round(min(times) - since, 2) if times else None


@dataclass
class PeerLaunch:
    """How to start the peers of one configuration."""

    module: list[str]                # python -m ...
    config_path: Path                # the swarm's peers.toml
    extra_args: list[str] = field(default_factory=list)


@dataclass
class RunSettings:
    """What every configuration of a session shares."""

    nodes: int
    seconds: float
    warmup: float
    ready_timeout: float
    work_dir: Path
    data: list[str]
    eval_every: int
    latency_ms: float = 0.0
    node_args: list[list[str]] = field(default_factory=list)  # node i's own flags (--synthetic-step, --throttle)


class ConfigRun:
    """Run one configuration on ``topology`` (already shaped or unshaped by the caller)."""

    def __init__(self, name: str, launch: PeerLaunch, topology: Topology, settings: RunSettings, *,
                 proxied: bool, on_progress: Callable[[str, float], None] | None = None) -> None:
        self.name = name
        self.launch = launch
        self.topo = topology
        self.s = settings
        self.proxied = proxied and settings.latency_ms > 0
        self.on_progress = on_progress or (lambda what, done: None)
        self.root = settings.work_dir / name
        self.root.mkdir(parents=True, exist_ok=True)
        self.nodes: list[BenchProc] = []
        self.proxies: list[BenchProc] = []
        self.events: list[dict[tuple, dict]] = []
        self.started_at: dict[int, float] = {}     # node i's start (wall clock, as its events' times)
        self.first_merge: dict[int, float] = {}    # seconds from node i's start to its first merged round

    # ---- processes --------------------------------------------------------------------------------
    def state_dir(self, i: int) -> Path:
        return self.root / f"node{i}"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   HIVEMIND_LOGLEVEL="WARNING", GOLOG_LOG_LEVEL="error")
        return env

    def start_proxies(self) -> None:
        """Start the latency proxy of every node that listens behind one (none when the run is not proxied)."""
        for i in range(self.s.nodes):
            if self._proxied(i):
                self._start_proxy(i)

    def _start_proxy(self, i: int) -> None:
        argv = [*self.topo.exec_prefix(i), sys.executable, "-m", "locoswarm.node.bench.swarm.proxy",
                "--listen", f"{self.topo.address(i)}:{PROXY_PORT}", "--target", f"127.0.0.1:{NODE_PORT}",
                "--delay-ms", f"{self.s.latency_ms:g}"]
        BenchProc(f"proxy{i}", argv, self.root / f"proxy{i}.log", self.proxies, self._env())

    def _proxied(self, i: int) -> bool:
        """Whether node ``i`` listens behind a latency proxy: a NATed node has none, since nobody can dial it
        (its outbound connections cross the proxies of the public nodes they dial)."""
        return self.proxied and not self.topo.natted(i)

    def start_peer(self, i: int, bootstrap: str | None) -> None:
        """Start node ``i`` (in its namespace), dialing ``bootstrap`` first (None: the first node, which dials
        nobody)."""
        # a NATed node listens on its private address and announces nothing else: no address that pretends
        # to be reachable (what it reports of its reachability is the node's own finding)
        host = "127.0.0.1" if self._proxied(i) else self.topo.address(i)
        args = ["--config", str(self.launch.config_path), "--state-dir", str(self.state_dir(i)),
                "--threads", "1", "--host", host, "--port", str(NODE_PORT), "--seed", str(i),
                "--checkpoint-every", "0", "--eval-every", str(self.s.eval_every), "--control-port", "0",
                "--device", "cpu", *self.launch.extra_args,
                *(self.s.node_args[i] if i < len(self.s.node_args) else [])]
        if self._proxied(i):
            args += ["--announce", f"/ip4/{self.topo.address(i)}/tcp/{PROXY_PORT}"]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        if self.s.data:
            args += ["--data", *self.s.data]
        argv = [*self.topo.exec_prefix(i), sys.executable, "-m", *self.launch.module, *args]
        self.started_at[i] = time.time()
        BenchProc(f"{self.name}/node{i}", argv, self.root / f"node{i}.log", self.nodes, self._env())

    def statuses(self) -> list[dict]:
        """Every node's status now; each read also notes a node's first merged round (a status keeps only its
        last events, so it is looked for at every poll from the start)."""
        sts = [read_status(self.state_dir(i)) for i in range(len(self.nodes))]
        for i, st in enumerate(sts):
            if i in self.started_at:
                t = first_merge(st.get("events") or [], self.started_at[i], self.first_merge.get(i))
                if t is not None:
                    self.first_merge[i] = t
        return sts

    def _check_alive(self) -> None:
        for p in self.nodes + self.proxies:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}): {p.tail()}")

    def _wait(self, predicate: Callable[[list[dict]], bool], timeout: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            sts = self.statuses()
            if predicate(sts):
                return sts
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {timeout:.0f} s; last log lines: "
                                   + " || ".join(p.tail(3) for p in self.nodes))
            time.sleep(0.25)

    def _wait_bootstrap(self, timeout: float) -> str:
        """node0's multiaddr in the bench subnet, from its log line "listening on ..." (printed as soon
        as its DHT is up, well before its first status), so the other peers start while it builds."""
        subnet = re.escape(self.topo.address(0).rsplit(".", 1)[0] + ".")
        pattern = re.compile(rf"listening on .*?(/ip4/{subnet}\d+/tcp/\d+/p2p/\w+)")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                m = pattern.search(self.nodes[0].log_path.read_text(errors="replace"))
                if m:
                    return m.group(1)
            self._check_alive()
            time.sleep(0.2)
        raise RuntimeError(f"node0 announced no address in the bench subnet after {timeout:.0f} s: "
                           f"{self.nodes[0].tail(3)}")

    # ---- the run ----------------------------------------------------------------------------------
    def run(self) -> dict:
        """Start, measure and stop; returns ``{"nodes": [...], ...}`` or ``{"error": ...}``."""
        n = self.s.nodes
        result: dict = {"proxied": self.proxied}
        try:
            self.start_proxies()
            self.on_progress("starting", 0.0)
            self.start_peer(0, None)
            boot = self._wait_bootstrap(self.s.ready_timeout)
            result["bootstrap"] = boot
            for i in range(1, n):
                self.start_peer(i, boot)
            self._wait(lambda sts: all(st.get("state") == "training" and len(st.get("peers") or {}) >= n - 1
                                       for st in sts), self.s.ready_timeout, f"{n} training peers that see each other")
            self._poll_for(self.s.warmup, "warm-up")
            before = self.statuses()
            window_start = time.time()
            seen: list[dict[tuple, dict]] = [{} for _ in range(n)]
            self._poll_for(self.s.seconds, "measuring", seen)
            after = self.statuses()
            self._check_alive()
            # events of the window (a status lags its events by at most one heartbeat: 1 s of slack)
            window = [[e for e in seen[i].values() if float(e.get("time", 0.0)) >= window_start - 1.0]
                      for i in range(n)]
            result["nodes"] = [{**node_metrics(before[i], after[i], window[i]), "behind_nat": self.topo.natted(i),
                                "first_merge_s": self.first_merge.get(i)} for i in range(n)]
        except Exception as exc:  # a configuration that could not run is reported; the others still run
            result["error"] = f"{type(exc).__name__}: {exc}"[:600]
        finally:
            self.on_progress("stopping", self.s.seconds)
            result["files_left"] = stop_all(self.nodes + self.proxies)
        return result

    def _poll_for(self, seconds: float, what: str, seen: list[dict[tuple, dict]] | None = None) -> None:
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            self._check_alive()
            if seen is not None:
                for i, st in enumerate(self.statuses()):
                    for e in st.get("events") or []:
                        seen[i].setdefault((e.get("time"), e.get("kind"), e.get("detail")), e)
                self.on_progress(what, elapsed)
            time.sleep(min(1.0, max(0.0, seconds - elapsed)))
        if seen is not None:
            self.on_progress(what, seconds)
