"""What a swarm benchmark runs: flag parsing and the per-configuration swarm descriptors.

Everything here is pure (no processes, no namespaces), so it is unit-tested directly. A bad flag
value raises :class:`locoswarm.node.errors.UserError` naming the value and what is allowed.

Configurations (``--configs``):

- ``unshaped``: the recommended stack on unshaped links (no tc, no loss, no latency proxy): the
  ceiling each node's utilization is divided by. Always run first when listed.
- ``recommended``: the stack of the base ``peers.toml`` (built-in defaults: alpha, H=50, F=2, tau=2,
  fp4 with error feedback).
- ``diloco``: blocking DiLoCo: one fragment, no overlap (tau=0), fp32 payloads, method replace.
- ``planner``: what :func:`locoswarm.node.plan.recommend` picks for the measured step time, parameter count and
  link (method replace when it picks tau=0, else the base method). Run after a configuration that
  measured the step time.
- ``hivemind``: the hook for hivemind's own ``hivemind.Optimizer`` on the same model, data and links
  (see :mod:`locoswarm.node.bench.swarm.peers`); a configuration whose peer program is not available is
  reported as "could not run" with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from locoswarm.node.config import SwarmConfig, validate
from locoswarm.node.errors import UserError
from locoswarm.node.plan import parse_rate

CONFIGS: tuple[str, ...] = ("unshaped", "recommended", "diloco", "planner", "hivemind")
DEFAULT_CONFIGS = "unshaped,recommended,diloco,planner"
PRESETS: tuple[str, ...] = ("tiny", "small")
MIN_RATE = 100e3  # bit/s: below this a round of even the tiny model takes minutes
MAX_RATE = 100e9
MAX_LATENCY_MS = 2000.0
MAX_NODES = 32                   # the topology's limit (netns.MAX_NODES): one /24 of node addresses, one private
#                                  /24 per NATed node
MAX_SPEED = 100.0                # a node's step-time multiplier (--speeds), as --throttle allows
MAX_STEP_TIME_S = 60.0           # --step-time
# Resident memory of one node, per preset, in MB: the node process's peak RSS measured by `locoswarm bench memory`
# on the CPU (reports/memory-cpu: 671-680 MB tiny, 2219-2400 MB small) plus about 150 MB for its DHT child and
# p2pd (not measured there). An estimate: what --nodes is checked against, never a measurement of this run.
NODE_MEMORY_MB: dict[str, float] = {"tiny": 830.0, "small": 2550.0}
MEMORY_HEADROOM = 0.9            # of the memory available at the start: the rest for the bench, proxies and the OS


@dataclass(frozen=True)
class LinkSpec:
    """The shaped link of every node: rates in bit/s (None = uncapped), one-way latency, loss."""

    upload_bps: float | None
    download_bps: float | None
    latency_ms: float = 0.0
    loss: float = 0.0

    @property
    def rate_bps(self) -> float:
        """The rate a sync is limited by (the slower direction); inf when uncapped."""
        rates = [r for r in (self.upload_bps, self.download_bps) if r is not None]
        return min(rates) if rates else math.inf

    def describe(self) -> str:
        def rate(r: float | None) -> str:
            return "uncapped" if r is None else f"{r / 1e6:g} Mbit/s"

        parts = [f"up {rate(self.upload_bps)}", f"down {rate(self.download_bps)}"]
        if self.latency_ms:
            parts.append(f"{self.latency_ms:g} ms one-way latency")
        if self.loss:
            parts.append(f"{self.loss:.2%} loss")
        return ", ".join(parts)


def parse_link_rate(value: str | None, flag: str) -> float | None:
    """A tc-style rate (``20mbit``, ``5Mbit/s``, ``1gbit``, ``2MB/s``) in bit/s; ``none``/``0``/empty:
    uncapped (None). Lower-case ``mbit`` is megabit as in tc (not millibit)."""
    if value is None:
        return None
    text = str(value).strip()
    if text.lower() in ("", "none", "0", "off", "unlimited"):
        return None
    rate = parse_rate(text, flag)
    if not MIN_RATE <= rate <= MAX_RATE:
        raise UserError(f"{flag}: cannot use {value!r}; expected a rate from 100kbit to 100gbit, e.g. 20mbit, "
                        f"or 'none' for no cap")
    return rate


def parse_loss(value: str | float, flag: str = "--loss") -> float:
    """A packet loss probability: ``0.01``, ``1%``; allowed 0 to 0.5."""
    text = str(value).strip()
    try:
        loss = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        loss = math.nan
    if not (math.isfinite(loss) and 0.0 <= loss <= 0.5):
        raise UserError(f"{flag}: cannot use {value!r}; expected a loss probability from 0 to 0.5, e.g. 0.01 or 1%")
    return loss


def parse_latency(value: str | float, flag: str = "--latency-ms") -> float:
    """A one-way latency in milliseconds, 0 to 2000."""
    try:
        ms = float(str(value).strip())
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and 0.0 <= ms <= MAX_LATENCY_MS):
        raise UserError(f"{flag}: cannot use {value!r}; expected milliseconds from 0 to {MAX_LATENCY_MS:g}, e.g. 50")
    return ms


def parse_configs(text: str) -> list[str]:
    """``--configs`` as a list in run order: ``unshaped`` first, ``planner`` after every configuration
    it can take a measured step time from (``hivemind`` runs last), duplicates dropped."""
    names: list[str] = []
    for part in str(text).split(","):
        name = part.strip()
        if not name:
            continue
        if name not in CONFIGS:
            raise UserError(f"--configs: unknown configuration {name!r}; choose from {','.join(CONFIGS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise UserError(f"--configs: cannot use {text!r}; give one or more of {','.join(CONFIGS)}")
    order = {"unshaped": 0, "recommended": 1, "diloco": 1, "planner": 2, "hivemind": 3}
    return sorted(names, key=lambda n: order[n])


def parse_nat(value: str | int, nodes: int, flag: str = "--nat") -> int:
    """How many nodes sit behind NAT (``--nat K``): an integer from 0 to ``nodes - 1``, since node 0, the
    bootstrap the others join through, stays public (K = nodes - 1: one public node)."""
    text = str(value).strip()
    try:
        k = int(text)
    except ValueError:
        k = -1
    if not 0 <= k < nodes:
        raise UserError(f"{flag}: cannot use {value!r}; expected a count of nodes behind NAT from 0 to {nodes - 1} "
                        f"(fewer than the {nodes} nodes: node 0, the bootstrap, stays public)")
    return k


def parse_cuts(value: str, nodes: int, flag: str = "--cut") -> tuple[tuple[int, int], ...]:
    """The pairs of nodes that cannot connect (``--cut 2-3,0-1``): each two different node numbers from 0 to
    ``nodes - 1``; '' for none."""
    text = str(value).strip()
    if not text:
        return ()
    pairs: list[tuple[int, int]] = []
    for item in text.split(","):
        a, sep, b = item.strip().partition("-")
        try:
            i, j = int(a), int(b)
        except ValueError:
            i = j = -1
        if not sep or not (0 <= i < nodes and 0 <= j < nodes) or i == j:
            raise UserError(f"{flag}: cannot use {item.strip()!r}; expected pairs of two different node numbers "
                            f"from 0 to {nodes - 1} joined by '-', comma-separated (e.g. --cut 2-3)")
        pair = (min(i, j), max(i, j))
        if pair not in pairs:
            pairs.append(pair)
    return tuple(pairs)


def parse_speeds(value: str, nodes: int, flag: str = "--speeds") -> list[float]:
    """Per-node step-time multipliers (``--speeds 1,1,2,5``): exactly ``nodes`` numbers from 1 to 100, node 0's
    first ('' : every node 1). One per node rather than a list repeated: a run's speeds are then read off the
    command line without counting."""
    text = str(value).strip()
    if not text:
        return [1.0] * nodes
    parts = [p.strip() for p in text.split(",")]
    try:
        speeds = [float(p) for p in parts]
    except ValueError:
        speeds = []
    if len(speeds) != nodes or not all(math.isfinite(s) and 1.0 <= s <= MAX_SPEED for s in speeds):
        raise UserError(f"{flag}: cannot use {value!r}; expected {nodes} comma-separated step-time multipliers (one "
                        f"per node, --nodes {nodes}) from 1 to {MAX_SPEED:g}, e.g. "
                        f"{','.join(['1'] * (nodes - 1) + ['3'])}")
    return speeds


def node_compute_args(step_time: float, speeds: list[float]) -> list[list[str]]:
    """Each node's compute flags: with synthetic compute (``step_time`` > 0) ``--synthetic-step`` of its own
    multiple of the step time, so the whole of a slow node's step counts as compute (its utilization stays that of
    a node that computes all the time); without it ``--throttle`` (a node sleeps ``speed - 1`` times its real step
    after each, which its utilization does not count: compare a slow node with its own unshaped run)."""
    if step_time > 0:
        return [["--synthetic-step", f"{step_time * s:g}"] for s in speeds]
    return [["--throttle", f"{s:g}"] if s != 1.0 else [] for s in speeds]


def check_memory(nodes: int, preset: str, available_mb: float | None) -> dict:
    """Whether ``nodes`` nodes of ``preset`` fit the memory available (MB; None: unknown, not checked): the
    estimate as the report states it, or a one-line refusal naming the estimate and the most nodes that fit."""
    per_node = NODE_MEMORY_MB.get(preset, NODE_MEMORY_MB["small"])
    need = nodes * per_node
    usable = None if available_mb is None else available_mb * MEMORY_HEADROOM
    fit = None if usable is None else max(0, int(usable // per_node))
    estimate = {"per_node_mb": per_node, "needed_mb": need, "available_mb": available_mb, "max_nodes": fit,
                "basis": "peak RSS per node of `bench memory` (reports/memory-cpu) + about 150 MB for its DHT child "
                         "and p2pd; nodes x that against 90% of MemAvailable at the start"}
    if usable is not None and need > usable:
        raise UserError(f"--nodes {nodes}: {nodes} {preset} nodes need about {need / 1e3:.1f} GB ({per_node:.0f} MB "
                        f"each, an estimate), more than the {usable / 1e3:.1f} GB this machine can give them (90% of "
                        f"{available_mb / 1e3:.1f} GB available); use --nodes {fit} or fewer, or more memory")
    return estimate


def available_memory_mb(meminfo: str = "/proc/meminfo") -> float | None:
    """``MemAvailable`` in MB (10^6 bytes, as ``NODE_MEMORY_MB``; None where the kernel does not say)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e6  # the kernel's kB are KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_range(flag: str, value: float, low: float, high: float, what: str) -> None:
    """One line naming ``flag`` when ``value`` is outside ``[low, high]``."""
    if not (isinstance(value, int | float) and math.isfinite(value) and low <= value <= high):
        raise UserError(f"{flag}: cannot use {value!r}; expected {what} from {low:g} to {high:g}")


@dataclass(frozen=True)
class PlannerPick:
    """The planner's recommendation as the settings it changes."""

    h: int
    fragments: int
    tau: int
    codec: str
    predicted: float


def config_for(name: str, base: SwarmConfig, pick: PlannerPick | None = None) -> SwarmConfig:
    """The swarm descriptor of configuration ``name``: ``base`` with that configuration's changes and a
    swarm name of its own (so configurations never meet in a DHT), validated."""
    cfg = copy.deepcopy(base)
    cfg.swarm = dataclasses.replace(cfg.swarm, name=f"{base.swarm.name}-{name}"[:64], bootstrap=[])
    o = cfg.outer
    # lazy: locoswarm.node.core.merge imports torch (~1 s, measured); this module does not
    from locoswarm.node.core.merge import make_merge_rule

    if name == "diloco":
        cfg.outer = dataclasses.replace(o, fragments=1, tau=0, codec="fp32", method="replace")
    elif name == "planner":
        if pick is None:
            raise ValueError("the planner configuration needs the planner's pick")
        # The planner's predictions assume a rule that may merge a slow round late (its late window):
        # keep the base's rule if it is one, else alpha. (tau = 0 is no reason for replace: with the
        # late window, a round is merged as soon as it lands.)
        method = o.method if make_merge_rule(o.method).merges_late else "alpha"
        cfg.outer = dataclasses.replace(o, h=pick.h, fragments=pick.fragments, tau=pick.tau, codec=pick.codec,
                                        method=method, max_delay=-1)  # the late window its prediction assumes
    validate(cfg, f"bench swarm configuration {name!r}")
    return cfg


def outer_settings(cfg: SwarmConfig) -> dict:
    """The settings that distinguish configurations, for the report."""
    o = cfg.outer
    return {"method": o.method, "h": o.h, "fragments": o.fragments, "tau": o.tau, "codec": o.codec,
            "error_feedback": o.error_feedback, "group_size": cfg.network.group_size}
