"""``locoswarm plan``: an analytical compute-utilization planner (the model behind Table 4 of
Streaming DiLoCo).

Given a model size N, the time S of one inner step and a link (bandwidth, latency), it estimates
for each training method the share of wall time spent in inner steps, the bandwidth needed to reach a
target utilization, and recommends (H, F, tau, codec) for the link.

The model
---------
*Communication.* A sync averages a payload of P bits over a group of n workers (``--workers``,
default 2, the paper's 2-worker setting; pairwise gossip) with a reduce-scatter then an all-gather
in which every worker exchanges with all others at once (hivemind's butterfly all-reduce). Each
worker sends ``r·P`` bits, ``r = 2·(n−1)/n`` (1 for n = 2, up to 2 for large groups), and each of the
two phases pays the one-way latency L once::

    T_sync(P) = O + r·P / bandwidth + 2·L

``O`` (``--round-overhead``, default ``ROUND_OVERHEAD_S`` = 1 s) is what every sync of this node pays
on top of its bytes: matchmaking through the DHT (entries stored, then polled until every live peer
arrived or the window closed), group formation, waiting for the group's last member, and DHT messages
queued behind bulk data. Issue 10 measured roughly 1 s per round with 4 real nodes on 20 Mbit/s links;
``locoswarm bench swarm`` reports it per configuration (*matchmaking s*: from a round's start to its member
list). A round on standing members (``locoswarm.node.swarm.standing``) skips the DHT, but still waits in its
exchange for the group's last member to reach the slot: at 5 Mbit/s, blocking DiLoCo's rounds measured
0.28-0.89 s to their member list with standing members and 0.64 s without (``reports/swarm-standing``).
The Table 4 calibration below uses O = 0 (the
paper's datacenter all-reduce has no DHT matchmaking). O delays a sync but does not occupy the link.

*Catch-up.* A node that missed a round downloads phi and momentum of the fragment from a holder
(``CATCH_UP_STATE_BITS`` = 64 bits per parameter: both in fp32, the ``network.state_momentum`` default; 48 with
bf16), in the background and behind the holder's own rounds (``locoswarm.node.swarm.state_sync``). It does not
stall training, but it loads the link: on average ``c = m·(N/F)·64`` bits per sync, with ``m``
(``--catch-up-rate``, default ``CATCH_UP_RATE`` = 0.01) catch-ups per round a node takes part in. ``m`` is
measured by ``locoswarm bench swarm`` (``catch_ups`` and rounds per node): 5 catch-ups in 529 node-rounds over the
tiny-preset sessions of reports/swarm-final/*-e329a4a* (0.0095), every configuration but hivemind's. The Table 4
calibration below uses m = 0. What the term cannot capture is a cascade: at 5 Mbit/s, before a lone node stopped
taking solo steps while a peer joins, the version lineages of the first node and its joiners were reconciled by
4.5 MB downloads again and again, and the recommended stack measured 0.796 where this model predicts 1.000
(reports/swarm-final/5mbit). The bench counts such loops (``catch_up_loops``); there has been none since.

The bandwidth is the per-worker link rate (bit/s, full duplex); links are assumed symmetric and
uncontended, so a group is as fast as one link. A round's transfers get only a share ``e``
(``--link-efficiency``, default ``LINK_EFFICIENCY`` = 0.65) of the nominal rate (the reduce-scatter's and
all-gather's concurrent streams, TCP through a token bucket, libp2p framing). It is measured on the rounds
of blocking DiLoCo (fp32, the whole model, 1.12M parameters: each member sends 53.5 Mbit) with four real
nodes on tc-shaped links, where ``locoswarm bench swarm`` reports a round's wall time from its start to its
result (reports/swarm-final): 4.52 s at 20 Mbit/s (0.17 s of it to the member list) and 16.40 s and 17.09 s
at 5 Mbit/s (0.65 s and 2.10 s), i.e. e = 0.62, 0.68 and 0.71 of the link's rate for the bytes. With e = 0.65
and O = 1 s the model gives rounds of 5.1 s and 17.5 s. (An earlier fit, e = 0.5, matched utilizations that
were predicted with a step time 15-30% longer than the nodes' own, and so underpredicted with the right
one: 0.29 where 0.48 was measured.) The Table 4 calibration below uses e = 1 (a datacenter link).
Required and peak bandwidths are reported as nominal link rates (divided by e).

*Payload.* ``P = params_in_sync · b_eff`` with ``b_eff`` bits per parameter including codec scale
overhead (one fp32 scale per block of 64): fp32 32, bf16 16, int8 8 + 32/64 = 8.5, fp4 (E3M0)
4 + 32/64 = 4.5.

*Schedule.* A method is a period of H inner steps (compute ``C = H·S``) with K = F sync events of
N/F parameters each (fragment p at its own offset, one every H/F steps). A sync started at step
t_s may run for a free window ``W = (tau + o)·S`` without stalling training: tau inner steps of
overlap (Streaming DiLoCo's τ) plus the optional ``--backward-overlap`` o, the fraction of a step's
backward pass that the reduction can hide behind (the paper's simulator overlaps all reductions with
the backward pass; default 0 = not overlapped). Past W, training waits. The link carries one sync at
a time, so if syncs come faster than it can carry them, the link sets the pace. (A node with a late window
waits at most max(W, 1 s) past it and then leaves the round in flight, ``locoswarm.node.core.late_window``;
the model leaves that bound out: it binds only for rounds more than twice their window, a straggling member
rather than a link the planner would pick.) Per period::

    stall = K · max(0, T_sync − W)
    wall  = max(C + stall, K · (T_sync − O + c / bandwidth))    (steady state)
    utilization = C / wall

Quantization, dequantization and the outer step / merge are assumed free (cost 0); real runs pay a
little for them (ALGORITHMS.md §8). Steps have a constant duration; no stragglers, churn or failed
groups.

*Required bandwidth* (closed form). ``utilization ≥ u`` holds iff ``T_sync ≤ T_max`` with
``T_max = W + C·(1/u − 1)/K`` and the link keeps pace, ``K·(T_sync − O) + K·c/bandwidth ≤ C/u``, so
``bandwidth ≥ max(r·P / (T_max − 2·L − O), (r·P + c) / (C/(u·K) − 2·L))`` (infinite if the latency and overhead
alone leave no room).

*Recommendation.* Settings are evaluated as the node runs them: with the alpha rule, whose round may
run on past tau until its late window ends (``max_delay = -1``, which a pick sets: h / F steps), so the
free window is ``W = max(tau, H/F)·S`` (``node_overlap``); the table's rows keep the papers' fixed tau.
A grid setting qualifies when its predicted utilization reaches the target, is not
below blocking DiLoCo's (H = 50, fp32) by more than ``DILOCO_MARGIN``, and its average link load stays
within ``LINK_LOAD_MAX`` of the bandwidth: a link kept busy by bulk transfers delays matchmaking and
heartbeats in ways this model does not capture (measured: H=10 fp32 using half of a 20 Mbit/s link
reached 0.64 of the unshaped utilization where 0.91 was predicted), and its sync events are at least
``MIN_SYNC_INTERVAL_S`` apart (H·S/F, the default matchmaking window of a round): syncs every 2.6 s
(H=10, F=1 at 0.26 s steps, predicted 0.92) measured 0.36 of unshaped with 20 of 36 rounds failed,
since a node's rounds then overlap one another's matchmaking. The rounds of one fragment are at
least ``MIN_ROUND_SPACING_S`` apart (H·S, two default matchmaking windows): the pick H=20 F=1 (one
round of the whole model every 5.4 s at 0.27 s steps) measured 0.58-0.91 of unshaped at 20 Mbit/s in
five runs (predicted 0.96-1.00) and 0.27 and 0.47 at 5 Mbit/s (predicted 0.85-0.86), with up to half
its rounds failed on group mismatch, while the default H=50 F=2 (each fragment every 13.6 s) measured
0.82-0.96 and 0.65-0.90 on the same links (early reports/swarm-* runs, now in git history). A
fragment's round takes up to one matchmaking window to form plus its transfer, and a catch-up of a
whole-model fragment; rounds of the same fragment closer than that run into each other. Codecs are
preferred widest first (less quantization), except where the link is the bottleneck (blocking DiLoCo
does not reach the target on it): there fp4 comes first.

*Methods* (rows of the table):
- dp: every step all-reduces all N gradients (``--baseline-codec``, fp32 default), blocking:
  ``util = S / (S + T_sync)`` when o = 0.
- diloco: every H steps a blocking sync of all N parameters (baseline codec).
- streaming: F fragments, one sync of N/F parameters every H/F steps, blocking (tau = 0).
- streaming-overlap: the same with tau steps of overlap, in the baseline codec and in fp4.
- eager: eager updates / one-round delay: F = 1, tau = H, the whole sync overlaps a whole round.
- locoswarm: CoCoDC as run by this node (fragments, fp4, overlap tau). Delay compensation changes
  what is done with a late result, not the bytes, so its row equals streaming-overlap fp4.
- diloco-x: DiLoCoX, F = 1, tau = H (one-step delay), ``codec = "lowrank"`` at the default initial rank
  and at the largest rank (codec ``lr<rank>``): its bits per parameter follow from the matrices' shapes
  (``locoswarm.node.core.lowrank``: each m x n matrix sends r·(m + n) factor values, the other tensors go raw), so the
  rows use the shapes of ``--preset`` or of the preset nearest in size to ``--params``.
- sparseloco: SparseLoCo (arXiv 2508.15706), F = 1, tau = 0, the ``[outer] sparse_*`` defaults (chunk 4096,
  top-64, 2 bits): a member's part costs ``sparse_bits`` (0.289 bits per parameter), a reducer's average carries
  the union of the ``n`` members' supports at 16-bit index + int8 value each (``sparseloco_bits``: the
  disjoint-support bound); the ring's two halves are the mean of the two (codec label ``sparse``).

Calibration against Streaming DiLoCo's Table 4 (1B model, 95% utilization: 222 Gbit/s data-parallel,
23.3 DiLoCo, 2.0 Streaming DiLoCo with overlap and FP4). The paper's exact simulator settings were
not available here. With S = 0.1 s, n = 2, bf16 baselines, reductions overlapped with the backward
pass (o = 2/3, backward ≈ 2/3 of a step), H = 100, F = 8 (24 layers / 3), tau = 1 this model gives
222 Gbit/s for dp (matches), 27.0 for diloco (+16%) and 2.42 for locoswarm/fp4 (+21%, or 2.15 with
no scale overhead): the same orders of magnitude and ratios (8.2× and 11×) close to the paper's
(9.5× and 11.7×). ``tests/test_plan.py`` checks this within a tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from locoswarm.node.config import ModelSection, OuterSection
from locoswarm.node.core.codec_table import CODECS, SPARSE_INDEX_BITS, sparse_bits
from locoswarm.node.core.codec_table import codec_bits as table_bits
from locoswarm.node.core.late_window import AUTO, late_window
from locoswarm.node.errors import UserError
from locoswarm.node.sizing import (
    DEFAULT_MFU,
    DEFAULT_TOKENS_PER_STEP,
    GPUS,
    estimate,
    gpu_class,
    preset_params,
    sizes_table,
)

# --------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------

BLOCK_SIZE = 64  # elements per fp32 codec scale (locoswarm.node.core.codecs default)
PHASES = 2  # reduce-scatter + all-gather, one latency each
ROUND_OVERHEAD_S = 1.0  # O: fixed seconds per sync (matchmaking, group formation; see the docstring)
CATCH_UP_RATE = 0.01  # m: catch-up downloads per round a node takes part in (measured; see the docstring)
CATCH_UP_STATE_BITS = 64  # bits per parameter of a catch-up: phi and momentum in fp32 (state_momentum default)
LINK_EFFICIENCY = 0.65  # e: share of a link's rate a round's transfers get (measured; see the docstring)
# the same for hivemind's averager (its own transport; fitted on its rows of `bench swarm`, hivemind_utilization)
HIVEMIND_LINK_EFFICIENCY = 0.5
LINK_LOAD_MAX = 0.5  # a recommended setting's average link load, as a share of the bandwidth
DILOCO_MARGIN = 0.02  # a recommended setting predicts at least blocking DiLoCo's utilization minus this
MIN_SYNC_INTERVAL_S = 5.0  # a recommended setting's sync events are at least this far apart (H·S/F seconds)
MIN_ROUND_SPACING_S = 10.0  # and rounds of one fragment at least this far apart (H·S seconds): two matchmaking windows

GRID_H: tuple[int, ...] = (10, 20, 25, 50, 100, 200, 250, 500, 1000)
GRID_F: tuple[int, ...] = (1, 2, 4, 8, 16)
GRID_TAU: tuple[int, ...] = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)

# Defaults mirror the node's [outer] defaults (node/config.py): h = 50, fragments = 2, tau = 2.
DEFAULT_H = 50
DEFAULT_FRAGMENTS = 2
DEFAULT_TAU = 2
DEFAULT_WORKERS = 2
DEFAULT_TARGET = 0.95

# --------------------------------------------------------------------------------------------------
# Parsing of flag values
# --------------------------------------------------------------------------------------------------

_NUMBER = r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
_COUNT_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<suffix>[kKmMbBgGtT]?)\s*$")
_COUNT_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}

_SECONDS_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[a-zA-Zµ]*)\s*$")
_SECONDS_UNIT = {"": 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
                 "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9,
                 "min": 60.0, "h": 3600.0}

_RATE_RE = re.compile(
    rf"^\s*{_NUMBER}\s*(?P<prefix>(?:[kKmMgGtT]i?)?)\s*"
    r"(?P<unit>bits/s|bit/s|bps|b/s|bits|bit|b|bytes/s|byte/s|Bps|B/s|bytes|byte|B)?\s*$")
_RATE_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_BYTE_UNITS = {"bytes/s", "byte/s", "Bps", "B/s", "bytes", "byte", "B"}

_COUNT_FORMS = "a positive count such as 125e6, 150M, 25m (million), 1B or 1.3b"
_SECONDS_FORMS = "seconds such as 0.5, 2s, 500ms or 250us"
_RATE_FORMS = ("a positive rate such as 1Gbit/s, 100Mbps, '2.5 Gbit/s', 10MB/s (bytes per second) "
               "or 1e9 (bit/s)")


def _bad(flag: str, value: str, forms: str) -> UserError:
    return UserError(f"{flag}: cannot use {value!r}; expected {forms}")


def parse_count(value: str, flag: str = "--params") -> float:
    """Parse a parameter count: ``125e6``, ``1B``, ``150M``, ``25m`` (million), ``1.3b``, ``7k``.

    Suffixes are decimal and case-insensitive (k = 1e3, m = 1e6, b/g = 1e9, t = 1e12).
    Raises ``UserError`` naming ``flag`` for anything else, zero or a non-finite value.
    """
    match = _COUNT_RE.match(str(value))
    if not match:
        raise _bad(flag, value, _COUNT_FORMS)
    count = float(match["num"]) * _COUNT_SUFFIX[match["suffix"].lower()]
    if not math.isfinite(count) or count <= 0:
        raise _bad(flag, value, _COUNT_FORMS)
    return count


def parse_seconds(value: str, flag: str = "--step-time", *, allow_zero: bool = False) -> float:
    """Parse a duration in seconds: ``0.5``, ``2s``, ``500ms``, ``250us``, ``1min``.

    A bare number is seconds. Zero is refused unless ``allow_zero`` (e.g. for a latency).
    Raises ``UserError`` naming ``flag`` otherwise.
    """
    forms = _SECONDS_FORMS + (" (0 allowed)" if allow_zero else ", greater than 0")
    match = _SECONDS_RE.match(str(value))
    if not match or match["unit"] not in _SECONDS_UNIT:
        raise _bad(flag, value, forms)
    seconds = float(match["num"]) * _SECONDS_UNIT[match["unit"]]
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise _bad(flag, value, forms)
    return seconds


def parse_rate(value: str, flag: str = "--bandwidth") -> float:
    """Parse a link rate and return it in **bit/s**.

    Accepts ``1Gbit/s``, ``100Mbps``, ``2.5 Gbit/s``, ``10Gb/s``, ``10MB/s`` / ``10MBps`` (bytes: an
    upper-case ``B`` or the word byte), binary prefixes (``1Gibit/s``) and a bare number in bit/s
    (``1e9``). Decimal prefixes k, M, G, T (either case). Raises ``UserError`` naming ``flag``.
    """
    match = _RATE_RE.match(str(value))
    if not match:
        raise _bad(flag, value, _RATE_FORMS)
    unit = match["unit"] or ""
    rate = float(match["num"]) * _RATE_PREFIX[match["prefix"].lower()]
    if unit in _BYTE_UNITS:
        rate *= 8.0
    if not math.isfinite(rate) or rate <= 0:
        raise _bad(flag, value, _RATE_FORMS)
    return rate


def parse_fraction(value: str, flag: str = "--target", *, allow_zero: bool = False) -> float:
    """Parse a fraction: ``0.95`` or ``95%`` (a bare number in (1, 100] is read as a percent)."""
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        number = float(text[:-1] if percent else text)
    except ValueError:
        number = math.nan
    if percent or 1 < number <= 100:
        number /= 100
    low_ok = number >= 0 if allow_zero else number > 0
    if not (math.isfinite(number) and low_ok and number <= 1):
        lo = "0" if allow_zero else "just above 0"
        raise UserError(f"{flag}: cannot use {value!r}; expected a fraction from {lo} to 1, e.g. 0.95 or 95%")
    return number


def _parse_int(value: str, flag: str, low: int, high: int | None = None) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        bound = f"from {low} to {high}" if high is not None else f"{low} or more"
        raise UserError(f"{flag}: cannot use {value!r}; expected a whole number {bound}")
    return number


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------

def codec_bits(codec: str, block_size: int = BLOCK_SIZE) -> float:
    """Wire bits per parameter of a codec, scale overhead included (fp4 at block 64: 4.5; ``core/codec_table.py``)."""
    if codec not in CODECS:
        raise UserError(f"codec: cannot use {codec!r}; expected one of {', '.join(CODECS)}")
    return table_bits(codec, block_size)


def ring_factor(workers: int) -> float:
    """Share of the payload each worker sends in reduce-scatter + all-gather: ``2·(n−1)/n``."""
    return 2.0 * (workers - 1) / workers


@dataclass(frozen=True)
class _Period:
    compute: float  # C, seconds of inner steps per period
    syncs: int  # K, sync events per period
    wire_bits: float  # r·P, bits each worker sends per sync
    window: float  # W, seconds a sync may run without stalling
    overhead: float  # O, fixed seconds per sync that do not use the link
    catch_up_bits: float = 0.0  # bits of catch-up downloads the link carries per sync, on average

    @property
    def avg_bandwidth(self) -> float:
        """Bit/s the syncs and their catch-ups send on average over the compute time."""
        return self.syncs * (self.wire_bits + self.catch_up_bits) / self.compute


def _period(params: float, step_time: float, *, h: int, fragments: int, tau: float, codec: str,
            workers: int, backward_overlap: float, block_size: int, round_overhead: float,
            catch_up_rate: float = 0.0, bits: float | None = None) -> _Period:
    payload = params / fragments * (codec_bits(codec, block_size) if bits is None else bits)
    catch_up = catch_up_rate * params / fragments * CATCH_UP_STATE_BITS if workers > 1 else 0.0
    return _Period(compute=h * step_time, syncs=fragments, wire_bits=ring_factor(workers) * payload,
                   window=(tau + backward_overlap) * step_time, overhead=round_overhead, catch_up_bits=catch_up)


def sync_time(wire_bits: float, bandwidth: float, latency: float = 0.0, round_overhead: float = 0.0) -> float:
    """Seconds of one sync: ``round_overhead + wire_bits / bandwidth + 2·latency``."""
    return round_overhead + wire_bits / bandwidth + PHASES * latency


def utilization(params: float, step_time: float, bandwidth: float, *, h: int = 1, fragments: int = 1,
                tau: float = 0, codec: str = "fp32", latency: float = 0.0, workers: int = DEFAULT_WORKERS,
                backward_overlap: float = 0.0, block_size: int = BLOCK_SIZE, round_overhead: float = 0.0,
                catch_up_rate: float = 0.0, bits: float | None = None) -> float:
    """Compute utilization in [0, 1] of a schedule (see the module docstring for the model).

    ``h`` inner steps per period, ``fragments`` syncs of ``params / fragments`` parameters per period,
    each overlapping ``tau`` inner steps; ``bandwidth`` in bit/s, ``latency``, ``step_time`` and
    ``round_overhead`` (O, fixed per sync) in seconds. ``h=1, fragments=1, tau=0`` is data-parallel.
    ``catch_up_rate`` (m): catch-up downloads per round, which load the link but do not stall training.
    ``bits``: wire bits per parameter where they depend on the model's shapes (``lowrank_bits``).
    """
    p = _period(params, step_time, h=h, fragments=fragments, tau=tau, codec=codec, workers=workers,
                backward_overlap=backward_overlap, block_size=block_size, round_overhead=round_overhead,
                catch_up_rate=catch_up_rate, bits=bits)
    if p.wire_bits == 0:  # a single worker: nothing to send
        return 1.0
    t_sync = sync_time(p.wire_bits, bandwidth, latency, p.overhead)
    link_busy = t_sync - p.overhead + p.catch_up_bits / bandwidth  # seconds of link per sync
    wall = max(p.compute + p.syncs * max(0.0, t_sync - p.window), p.syncs * link_busy)
    return p.compute / wall


def required_bandwidth(params: float, step_time: float, *, target: float = DEFAULT_TARGET, h: int = 1,
                       fragments: int = 1, tau: float = 0, codec: str = "fp32", latency: float = 0.0,
                       workers: int = DEFAULT_WORKERS, backward_overlap: float = 0.0,
                       block_size: int = BLOCK_SIZE, round_overhead: float = 0.0, catch_up_rate: float = 0.0,
                       bits: float | None = None) -> float:
    """Smallest bandwidth (bit/s) at which the schedule reaches ``target`` utilization.

    Closed form of the model: the larger of what a sync's stall budget needs, ``r·P / (W + C·(1/u − 1)/K − 2·L
    − O)``, and what the link's pace needs, ``(r·P + c) / (C/(u·K) − 2·L)`` with ``c`` the catch-up bits per
    sync; ``math.inf`` when latency and overhead alone prevent it.
    """
    p = _period(params, step_time, h=h, fragments=fragments, tau=tau, codec=codec, workers=workers,
                backward_overlap=backward_overlap, block_size=block_size, round_overhead=round_overhead,
                catch_up_rate=catch_up_rate, bits=bits)
    if p.wire_bits == 0:
        return 0.0
    stall_room = p.window + p.compute * (1.0 / target - 1.0) / p.syncs - PHASES * latency - p.overhead
    pace_room = p.compute / (target * p.syncs) - PHASES * latency
    if stall_room <= 0 or pace_room <= 0:
        return math.inf
    return max(p.wire_bits / stall_room, (p.wire_bits + p.catch_up_bits) / pace_room)


# --------------------------------------------------------------------------------------------------
# Methods and the recommendation
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One method's schedule and its figures on the given link."""

    method: str
    h: int
    fragments: int
    tau: int
    codec: str
    bytes_per_sync: float  # bytes each worker sends per sync
    avg_bandwidth: float  # bit/s sustained over compute time (all periods' bytes / H·S)
    peak_bandwidth: float  # bit/s for one sync to finish in its window + stall budget at the target
    utilization: float  # at the given bandwidth, in [0, 1]
    required_bandwidth: float  # bit/s to reach the target (math.inf if unreachable)


def _row(method: str, params: float, step_time: float, bandwidth: float, *, h: int, fragments: int,
         tau: int, codec: str, target: float, latency: float, workers: int, backward_overlap: float,
         block_size: int, round_overhead: float, catch_up_rate: float, bits: float | None = None) -> Row:
    kw = dict(h=h, fragments=fragments, tau=tau, codec=codec, latency=latency, workers=workers,
              backward_overlap=backward_overlap, block_size=block_size, round_overhead=round_overhead,
              catch_up_rate=catch_up_rate, bits=bits)
    p = _period(params, step_time, h=h, fragments=fragments, tau=tau, codec=codec, workers=workers,
                backward_overlap=backward_overlap, block_size=block_size, round_overhead=round_overhead,
                catch_up_rate=catch_up_rate, bits=bits)
    budget = p.window + p.compute * (1.0 / target - 1.0) / p.syncs - PHASES * latency - p.overhead
    return Row(method=method, h=h, fragments=fragments, tau=tau, codec=codec,
               bytes_per_sync=p.wire_bits / 8.0,
               avg_bandwidth=p.avg_bandwidth,
               peak_bandwidth=p.wire_bits / budget if budget > 0 else math.inf,
               utilization=utilization(params, step_time, bandwidth, **kw),
               required_bandwidth=required_bandwidth(params, step_time, target=target, **kw))


def method_rows(params: float, step_time: float, bandwidth: float, *, h: int = DEFAULT_H,
                fragments: int = DEFAULT_FRAGMENTS, tau: int = DEFAULT_TAU, target: float = DEFAULT_TARGET,
                latency: float = 0.0, workers: int = DEFAULT_WORKERS, backward_overlap: float = 0.0,
                baseline_codec: str = "fp32", block_size: int = BLOCK_SIZE, round_overhead: float = 0.0,
                catch_up_rate: float = 0.0, lowrank: Sequence[tuple[str, float]] = ()) -> list[Row]:
    """The table: one ``Row`` per method (dp, diloco, streaming, streaming-overlap ×2, eager, locoswarm), a
    diloco-x row (F = 1, tau = H) per ``lowrank`` entry: (codec label, wire bits per parameter), and sparseloco."""
    specs: list[tuple[str, int, int, int, str, float | None]] = [
        ("dp", 1, 1, 0, baseline_codec, None),
        ("diloco", h, 1, 0, baseline_codec, None),
        ("streaming", h, fragments, 0, baseline_codec, None),
        ("streaming-overlap", h, fragments, tau, baseline_codec, None),
        ("streaming-overlap", h, fragments, tau, "fp4", None),
        ("eager", h, 1, h, baseline_codec, None),
        ("locoswarm", h, fragments, tau, "fp4", None),
    ] + [("diloco-x", h, 1, h, label, bits) for label, bits in lowrank] + [
        ("sparseloco", h, 1, 0, "sparse", sparseloco_bits(workers)),
    ]
    return [_row(name, params, step_time, bandwidth, h=rh, fragments=rf, tau=rt, codec=rc, target=target,
                 latency=latency, workers=workers, backward_overlap=backward_overlap, block_size=block_size,
                 round_overhead=round_overhead, catch_up_rate=catch_up_rate, bits=bits)
            for name, rh, rf, rt, rc, bits in specs]


def sparseloco_bits(workers: int, chunk: int | None = None, topk: int | None = None) -> float:
    """Wire bits per parameter of ``codec = "sparseloco"`` averaged over a round's two halves: members send their
    parts (``sparse_bits``), reducers send averages that keep the union of the ``workers`` supports (at most
    ``workers * k`` entries a chunk, each a 16-bit index and an int8 value, plus a float32 scale and a uint32
    count per chunk). Defaults: the ``[outer]`` settings' defaults."""
    outer = OuterSection()
    chunk = outer.sparse_chunk if chunk is None else chunk
    topk = outer.sparse_topk if topk is None else topk
    union = min(chunk, max(1, workers) * min(topk, chunk))
    reduced = (union * (SPARSE_INDEX_BITS + 8) + 64) / chunk
    return (sparse_bits(chunk, topk, outer.sparse_value_bits) + reduced) / 2


def lowrank_bits(params: float, preset: str | None = None, arch: str = "llama") -> list[tuple[str, float]]:
    """Wire bits per parameter of ``codec = "lowrank"`` (the default ``[outer]`` ranks and factor codec) at
    its initial and at its largest rank, labelled ``lr<rank>``. They depend on the matrices' shapes: those of
    ``preset``, or of the preset nearest in size to ``params`` (the ratio follows the widths, not the count)."""
    # lazy: locoswarm.node.core.codecs, .core.lowrank and .model import torch (~1 s, measured); this module does not
    from locoswarm.node.core.codecs import get_codec
    from locoswarm.node.core.lowrank import lowrank_bits_per_element
    from locoswarm.node.model import PRESETS, build_meta_model

    if preset is None:
        preset = min(PRESETS, key=lambda p: abs(math.log(preset_params(p, arch) / max(params, 1.0))))
    shapes = [tuple(p.shape) for p in build_meta_model(ModelSection(arch=arch, preset=preset), 257).parameters()]
    outer = OuterSection()
    codec = get_codec(outer.lowrank_codec, BLOCK_SIZE)
    return [(f"lr{rank}", lowrank_bits_per_element(shapes, rank, outer.lowrank_max_rank, codec))
            for rank in sorted({outer.lowrank_rank, outer.lowrank_max_rank})]


@dataclass(frozen=True)
class Recommendation:
    """The preferred grid setting (see ``recommend``)."""

    reached: bool  # whether it reaches the target at the given bandwidth
    h: int
    fragments: int
    tau: int
    codec: str
    utilization: float  # at the given bandwidth
    required_bandwidth: float  # bit/s at which this setting reaches the target
    target: float


def _grid(h_values: tuple[int, ...], f_values: tuple[int, ...], tau_values: tuple[int, ...],
          codecs: tuple[str, ...], *, most_fragments: bool = False):
    """Settings in order of preference: smallest H, ``codecs`` in order, smallest tau, smallest F (largest
    first with ``most_fragments``)."""
    for h in sorted(h_values):
        for codec in codecs:
            for tau in sorted(tau_values):
                for f in sorted(f_values, reverse=most_fragments):
                    if f <= h and h % f == 0 and tau <= h // f:
                        yield h, f, tau, codec


def link_load(params: float, step_time: float, bandwidth: float, *, h: int, fragments: int, codec: str,
              workers: int = DEFAULT_WORKERS, block_size: int = BLOCK_SIZE, catch_up_rate: float = 0.0) -> float:
    """Average share of the link a schedule's syncs and their catch-ups keep busy over its compute time."""
    p = _period(params, step_time, h=h, fragments=fragments, tau=0, codec=codec, workers=workers,
                backward_overlap=0.0, block_size=block_size, round_overhead=0.0, catch_up_rate=catch_up_rate)
    return p.avg_bandwidth / bandwidth


def node_overlap(h: int, fragments: int, tau: int) -> int:
    """Inner steps a round of a pick (H, F, tau) may run before training waits: its late window with
    ``max_delay = -1`` (``locoswarm.node.core.late_window``: h / fragments, at least tau), which a pick sets."""
    return late_window(h=h, fragments=fragments, tau=tau, max_delay=AUTO)


def is_spaced(h: int, fragments: int, step_time: float, min_sync_interval: float = MIN_SYNC_INTERVAL_S,
              min_round_spacing: float = MIN_ROUND_SPACING_S) -> bool:
    """Whether a schedule's sync events (every H·S/F s) and each fragment's rounds (every H·S s) are far
    enough apart for the swarm's matchmaking (module docstring)."""
    tol = 1 - 1e-12
    return (h * step_time / fragments >= min_sync_interval * tol
            and h * step_time >= min_round_spacing * tol)


def diloco_utilization(params: float, step_time: float, bandwidth: float, *, latency: float = 0.0,
                       workers: int = DEFAULT_WORKERS, backward_overlap: float = 0.0,
                       block_size: int = BLOCK_SIZE, round_overhead: float = 0.0,
                       catch_up_rate: float = 0.0) -> float:
    """Blocking DiLoCo's predicted utilization (H = DEFAULT_H, one fp32 sync): the floor of a pick."""
    return utilization(params, step_time, bandwidth, h=DEFAULT_H, fragments=1, tau=0, codec="fp32",
                       latency=latency, workers=workers, backward_overlap=backward_overlap,
                       block_size=block_size, round_overhead=round_overhead, catch_up_rate=catch_up_rate)


def hivemind_utilization(params: float, step_time: float, bandwidth: float, *, h: int, latency: float = 0.0,
                         workers: int = DEFAULT_WORKERS, block_size: int = BLOCK_SIZE) -> float:
    """``hivemind.Optimizer`` in local-updates mode with its default delayed state averaging, as ``locoswarm
    bench swarm`` runs it (``node/bench/swarm/peers.py``): the model of what its logs show.

    An epoch ends when the swarm has made ``target_batch_size`` samples (H steps of every peer) or when the
    progress tracker's ETA, extrapolated from the peers' stepping rate, has passed: H·S after the epoch began.
    At the transition every peer starts one fp32 all-reduce of all its parameters in the background
    (A = ``sync_time`` of them, no fixed cost: it matchmakes before the epoch ends), and with local updates
    that averaging is a delta rule: every local step waits for it ("Waiting for delayed updates to finish").
    The ETA runs on meanwhile, so an epoch lasts max(H·S, A + S) and a peer computes in it only outside the
    wait::

        u = (T - A) / T,   T = max(H·S, A + S)

    A 5 Mbit/s run (4 peers, tiny preset) logged transitions every 19-20 s and waits of 18.3 s on each; its
    peers made 0.32 steps/s (0.105 of their unshaped utilization; 0.014 by this model: the few steps between
    a transition and the first wait are left out).

    ``bandwidth`` is what its all-reduce gets: the link rate times ``HIVEMIND_LINK_EFFICIENCY`` (0.5), hivemind's
    averager being another transport than the node's rounds (``LINK_EFFICIENCY``). With it the model gave 0.558
    and 0.008 where its rows measured 0.557 and 0.012 of unshaped at 20 and 5 Mbit/s (reports/swarm-final)."""
    p = _period(params, step_time, h=h, fragments=1, tau=0, codec="fp32", workers=workers, backward_overlap=0.0,
                block_size=block_size, round_overhead=0.0)
    if p.wire_bits == 0:
        return 1.0
    wait = sync_time(p.wire_bits, bandwidth, latency)
    epoch = max(p.compute, wait + step_time)
    return (epoch - wait) / epoch


def _no_staler_default_tau(tau: int, *, h: int, fragments: int, round_steps: float) -> int:
    """``DEFAULT_TAU`` in place of a smaller tau that is no fresher: a round lasting ``round_steps`` inner steps
    is merged when it lands whatever tau below that is (the late window), so tau = 0 and tau = 2 merge a
    5 Mbit/s round of about 8 steps at the same step. The default is the tau the bench has measured most: the pick
    H=50 F=2 tau=0 fp4 measured 0.005, 0.002 and 0.013 below the default stack (tau = 2) in three 5 and
    20 Mbit/s sessions of five (reports/swarm-final), within the noise of 60 s windows, but never above it by
    more than 0.002. Utilization does not change: both overlap the late window of h / F steps."""
    if tau < DEFAULT_TAU <= min(h // fragments, round_steps):
        return DEFAULT_TAU
    return tau


def recommend(params: float, step_time: float, bandwidth: float, *, target: float = DEFAULT_TARGET,
              latency: float = 0.0, workers: int = DEFAULT_WORKERS, backward_overlap: float = 0.0,
              block_size: int = BLOCK_SIZE, round_overhead: float = 0.0, catch_up_rate: float = 0.0,
              h_values: tuple[int, ...] = GRID_H,
              f_values: tuple[int, ...] = GRID_F, tau_values: tuple[int, ...] = GRID_TAU,
              codecs: tuple[str, ...] = CODECS, min_sync_interval: float = MIN_SYNC_INTERVAL_S,
              min_round_spacing: float = MIN_ROUND_SPACING_S) -> Recommendation:
    """Search the (H, F, tau, codec) grid for the first setting that qualifies on the link.

    A setting qualifies when it reaches ``target``, predicts at least blocking DiLoCo's utilization
    minus ``DILOCO_MARGIN``, keeps the link's average load within ``LINK_LOAD_MAX`` and spaces its sync
    events at least ``min_sync_interval`` seconds apart and the rounds of each fragment at least
    ``min_round_spacing`` apart (``is_spaced``, module docstring). Preference order: the
    smallest H (more frequent syncs converge better), then the widest codec (less quantization; the
    narrowest instead where the link is the bottleneck, i.e. blocking DiLoCo does not reach the target),
    then the smallest tau (less staleness; but the default tau where a round lasts longer than it, which is then
    no staler: ``_no_staler_default_tau``), then the smallest F, except where the link is the bottleneck: there
    the largest F that qualifies. A round of the whole model (F = 1) loads the link in bursts twice as large, and
    a node that missed one catches up the whole model from a holder whose own rounds then wait behind it:
    at 5 Mbit/s the planner's pick H=50 F=1 measured 0.861, 0.864 and 0.890 of unshaped in three runs against
    0.949, 0.997 and 0.980 for F = 2 (reports/swarm-matchmaking). F must divide H and tau is at most H/F.
    If nothing qualifies, returns a spaced setting with the highest utilization (an unspaced one only if
    none is spaced; ties broken by the same preference) with ``reached=False``.
    """
    kw = dict(latency=latency, workers=workers, backward_overlap=backward_overlap, block_size=block_size,
              round_overhead=round_overhead, catch_up_rate=catch_up_rate)
    diloco = diloco_utilization(params, step_time, bandwidth, **kw)
    threshold = max(target, diloco - DILOCO_MARGIN)
    # The link is the bottleneck when blocking DiLoCo cannot reach the target on it: then the narrowest
    # codec comes first (fp4 costs little quality, and a lightly loaded link keeps the fixed cost small).
    bottleneck = diloco < target
    order = tuple(sorted(codecs, key=codec_bits)) if bottleneck else codecs
    # Without a qualifying setting: the best-spaced, then highest-utilization one (reached=False).
    best: tuple[bool, float, float, tuple[int, int, int, str]] | None = None
    for h, f, tau, codec in _grid(h_values, f_values, tau_values, order, most_fragments=bottleneck):
        # the node overlaps a slow round up to its late window (it merges with alpha, which allows it)
        util = utilization(params, step_time, bandwidth, h=h, fragments=f, tau=node_overlap(h, f, tau),
                           codec=codec, **kw)
        load = link_load(params, step_time, bandwidth, h=h, fragments=f, codec=codec, workers=workers,
                         block_size=block_size, catch_up_rate=catch_up_rate)
        spaced = is_spaced(h, f, step_time, min_sync_interval, min_round_spacing)
        qualifies = util >= threshold * (1 - 1e-12) and load <= LINK_LOAD_MAX and spaced
        if qualifies or best is None or (spaced, util) > best[:2]:
            best = (spaced, util, load, (h, f, tau, codec))
        if qualifies:
            break
    if best is None:
        raise UserError("plan: the search grid is empty; no (H, F, tau) combination is valid")
    spaced, util, load, (h, f, tau, codec) = best
    p = _period(params, step_time, h=h, fragments=f, tau=0, codec=codec, workers=workers, backward_overlap=0.0,
                block_size=block_size, round_overhead=round_overhead)
    if DEFAULT_TAU in tau_values:
        tau = _no_staler_default_tau(tau, h=h, fragments=f,
                                     round_steps=sync_time(p.wire_bits, bandwidth, latency, p.overhead) / step_time)
    need = required_bandwidth(params, step_time, target=target, h=h, fragments=f, tau=node_overlap(h, f, tau),
                              codec=codec, **kw)
    return Recommendation(reached=util >= target * (1 - 1e-12) and load <= LINK_LOAD_MAX and spaced, h=h, fragments=f,
                          tau=tau, codec=codec, utilization=util, required_bandwidth=need, target=target)


# --------------------------------------------------------------------------------------------------
# Formatting and the CLI
# --------------------------------------------------------------------------------------------------

def format_rate(bits_per_s: float) -> str:
    """``2.42e9`` -> ``'2.42 Gbit/s'`` (3 significant digits); ``inf`` -> ``'unreachable'``."""
    if math.isinf(bits_per_s):
        return "unreachable"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {prefix}bit/s"
    return f"{bits_per_s:.3g} bit/s"


def format_bytes(n_bytes: float) -> str:
    """``6.25e7`` -> ``'62.5 MB'`` (decimal units, 3 significant digits)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {prefix}B"
    return f"{n_bytes:.3g} B"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _sizing_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"arch": getattr(args, "arch", "llama") or "llama",
            "tokens_per_step": int(parse_count(str(getattr(args, "tokens_per_step", None)
                                                   or DEFAULT_TOKENS_PER_STEP), "--tokens-per-step")),
            "seq_len": _parse_int(str(getattr(args, "seq_len", None) or 1024), "--seq-len", 8, 131072),
            "mfu": parse_fraction(str(getattr(args, "mfu", None) or DEFAULT_MFU), "--mfu")}


def _model_inputs(args: argparse.Namespace) -> tuple[float, float, dict[str, Any] | None]:
    """(params, step time, sizing) from --params/--step-time, or from --preset and --gpu (estimated)."""
    # lazy: locoswarm.node.model imports torch (~1 s, measured); this module does not
    from locoswarm.node.model import PRESETS

    preset, gpu = getattr(args, "preset", None), getattr(args, "gpu", None)
    if preset is not None and preset not in PRESETS:
        raise UserError(f"--preset {preset!r} is not a preset; choose one of {', '.join(PRESETS)}")
    if gpu is not None and preset is None and args.params is None:
        raise UserError("--gpu needs --preset (the model whose step time it estimates); add e.g. --preset 125m")
    sizing = None
    if preset is not None and gpu is not None:
        est = estimate(preset, gpu, **_sizing_kwargs(args))
        sizing = {**asdict(est), "total_gib": est.total_gib, "fits": est.fits()}
    if args.params is not None:
        params = parse_count(args.params, "--params")
    elif preset is not None:
        params = float(preset_params(preset, getattr(args, "arch", "llama") or "llama"))
    else:
        raise UserError("the model size is missing; give --params N (e.g. --params 125M) or --preset P")
    if args.step_time is not None:
        step_time = parse_seconds(args.step_time, "--step-time")
    elif sizing is not None:
        step_time = sizing["step_time_s"]
    else:
        raise UserError("the step time is missing; give --step-time S (e.g. --step-time 0.5) or --preset P --gpu G")
    return params, step_time, sizing


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Parse the ``plan`` flags and compute the rows and the recommendation (JSON-ready dict)."""
    params, step_time, sizing = _model_inputs(args)
    if args.bandwidth is None:
        raise UserError("--bandwidth is missing; give the per-worker link rate, e.g. --bandwidth 100Mbit/s")
    bandwidth = parse_rate(args.bandwidth, "--bandwidth")
    latency = parse_seconds(args.latency, "--latency", allow_zero=True)
    workers = _parse_int(args.workers, "--workers", 2, 100_000)
    h = _parse_int(args.h, "--h", 1, 1_000_000)
    fragments = _parse_int(args.fragments, "--fragments", 1, h)
    tau = _parse_int(args.tau, "--tau", 0, h)
    target = parse_fraction(args.target, "--target")
    overlap = parse_fraction(args.backward_overlap, "--backward-overlap", allow_zero=True)
    overhead = parse_seconds(args.round_overhead, "--round-overhead", allow_zero=True)
    catch_ups = parse_fraction(args.catch_up_rate, "--catch-up-rate", allow_zero=True)
    efficiency = parse_fraction(args.link_efficiency, "--link-efficiency")
    common = dict(target=target, latency=latency, workers=workers, backward_overlap=overlap,
                  round_overhead=overhead, catch_up_rate=catch_ups)
    # modelled on the rate a round's transfers get; capacities reported back as nominal link rates
    usable = bandwidth * efficiency
    rows = [replace(r, required_bandwidth=r.required_bandwidth / efficiency,
                    peak_bandwidth=r.peak_bandwidth / efficiency)
            for r in method_rows(params, step_time, usable, h=h, fragments=fragments, tau=tau,
                                 baseline_codec=args.baseline_codec,
                                 lowrank=lowrank_bits(params, getattr(args, "preset", None),
                                                      getattr(args, "arch", "llama") or "llama"), **common)]
    rec = recommend(params, step_time, usable, **common)
    rec = replace(rec, required_bandwidth=rec.required_bandwidth / efficiency)
    return {
        "inputs": {"params": params, "step_time_s": step_time, "bandwidth_bit_s": bandwidth,
                   "latency_s": latency, "workers": workers, "h": h, "fragments": fragments, "tau": tau,
                   "target": target, "backward_overlap": overlap, "baseline_codec": args.baseline_codec,
                   "round_overhead_s": overhead, "catch_up_rate": catch_ups, "link_efficiency": efficiency},
        "model": {"ring_factor": ring_factor(workers), "phases_per_sync": PHASES,
                  "codec_bits": {c: codec_bits(c) for c in CODECS}, "quantize_merge_cost_s": 0.0,
                  "round_overhead_s": overhead, "catch_up_rate": catch_ups,
                  "catch_up_state_bits": CATCH_UP_STATE_BITS, "link_efficiency": efficiency,
                  "link_load_max": LINK_LOAD_MAX,
                  "diloco_margin": DILOCO_MARGIN},
        "methods": [{**asdict(r), "required_bandwidth": _finite(r.required_bandwidth),
                     "peak_bandwidth": _finite(r.peak_bandwidth)} for r in rows],
        "recommendation": {**asdict(rec), "required_bandwidth": _finite(rec.required_bandwidth)},
        "sizing": sizing,
    }


_DISPLAY = {"streaming-overlap": "stream-overlap"}  # keeps the table within 80 columns


def _short_count(n: float) -> str:
    """``1.3e9`` -> ``'1.3B'``, ``125e6`` -> ``'125M'``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"


def _short_rate(bits_per_s: float | None) -> str:
    """Compact rate for the table: ``2.42e9`` -> ``'2.42G'``; None / inf -> ``'never'``."""
    if bits_per_s is None or math.isinf(bits_per_s):
        return "never"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g}{prefix}"
    return f"{bits_per_s:.3g}"


def _print_plan(plan: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    inp = plan["inputs"]
    target = inp["target"]
    console = Console(highlight=False)
    console.print(f"{_short_count(inp['params'])} params, {inp['step_time_s']:g} s per inner step, link "
                  f"{format_rate(inp['bandwidth_bit_s'])} per worker, latency {inp['latency_s']:g} s, "
                  f"n = {inp['workers']} workers per sync")
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    for name, justify in (("method", "left"), ("H", "right"), ("F", "right"), ("tau", "right"),
                          ("codec", "left"), ("B/sync", "right"), ("avg", "right"),
                          ("peak", "right"), ("util", "right"), ("need", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for r in plan["methods"]:
        table.add_row(_DISPLAY.get(r["method"], r["method"]), str(r["h"]), str(r["fragments"]), str(r["tau"]),
                      r["codec"],
                      format_bytes(r["bytes_per_sync"]).replace(" ", ""), _short_rate(r["avg_bandwidth"]),
                      _short_rate(r["peak_bandwidth"]), f"{r['utilization']:.1%}",
                      _short_rate(r["required_bandwidth"]))
    console.print(table)
    ring = plan["model"]["ring_factor"]
    console.print(f"B/sync: bytes a worker sends per sync (ring factor {ring:.2f}); rates in bit/s: avg = "
                  "bytes over compute time, peak = one sync within its overlap window and stall budget, "
                  f"need = minimum bandwidth for {target:.0%} utilization. Round overhead "
                  f"{inp['round_overhead_s']:g} s per sync (matchmaking, group formation), "
                  f"{inp['catch_up_rate']:g} catch-up downloads per sync, transfers at "
                  f"{inp['link_efficiency']:.0%} of the link rate, quantize/merge "
                  f"cost 0, backward overlap {inp['backward_overlap']:g} step. A recommendation keeps the "
                  f"link's average load within {LINK_LOAD_MAX:.0%}, predicts at least blocking DiLoCo's "
                  f"utilization, spaces its syncs at least {MIN_SYNC_INTERVAL_S:g} s apart and each "
                  f"fragment's rounds at least {MIN_ROUND_SPACING_S:g} s apart.")
    rec = plan["recommendation"]
    setting = f"H={rec['h']} F={rec['fragments']} tau={rec['tau']} codec={rec['codec']}"
    need = rec["required_bandwidth"]
    at = f"reaches {target:.0%} from {format_rate(math.inf if need is None else need)}"
    if rec["reached"]:
        console.print(f"recommendation: {setting}: {rec['utilization']:.1%} utilization ({at})")
    else:
        console.print(f"recommendation: no setting of the grid reaches {target:.0%} on this link; best "
                      f"found {setting}: {rec['utilization']:.1%} utilization ({at})")


def build_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """Every preset on every GPU class (``--sizes``; ``--preset``/``--gpu`` narrow it)."""
    # lazy: locoswarm.node.model imports torch (~1 s, measured); this module does not
    from locoswarm.node.model import PRESETS

    presets = [args.preset] if getattr(args, "preset", None) else list(PRESETS)
    if presets[0] not in PRESETS:
        raise UserError(f"--preset {presets[0]!r} is not a preset; choose one of {', '.join(PRESETS)}")
    gpus = [gpu_class(args.gpu).name] if getattr(args, "gpu", None) else list(GPUS)
    kw = _sizing_kwargs(args)
    rows = []
    for r in sizes_table(presets, gpus, **kw):
        on = estimate(r.preset, r.gpu, outer_on_device=True, **kw)
        rows.append({**asdict(r), "total_gib": r.total_gib, "fits": r.fits(), "outer_on_device_gib": on.outer_gib,
                     "total_gib_offload_off": on.total_gib, "fits_offload_off": on.fits()})
    return {"inputs": kw, "rows": rows}


def _print_sizes(sizes: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    kw = sizes["inputs"]
    console = Console(highlight=False)
    console.print(f"estimates ({kw['arch']}, {kw['tokens_per_step']:,} tokens per step in sequences of "
                  f"{kw['seq_len']}, MFU {kw['mfu']:g}; not measured, see node/sizing.py)")
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    for name in ("preset", "params", "gpu", "step s", "GiB", "fits", "off: GiB", "fits"):
        table.add_column(name, justify="left" if name in ("preset", "gpu") else "right", no_wrap=True)
    for r in sizes["rows"]:
        table.add_row(r["preset"], _short_count(r["params"]), f"{r['gpu']} ({GPUS[r['gpu']].memory_gib:g}G)",
                      f"{r['step_time_s']:.3g}", f"{r['total_gib']:.1f}", "yes" if r["fits"] else "no",
                      f"{r['total_gib_offload_off']:.1f}", "yes" if r["fits_offload_off"] else "no")
    console.print("GiB: the training device's memory (weights, grads, AdamW, activations; the outer state is in "
                  "host memory by default); off: with [outer] offload = \"off\" (phi, momentum, residual on the GPU)",
                  markup=False)
    console.print(table)


def _handler(args: argparse.Namespace) -> int:
    build, show = (build_sizes, _print_sizes) if args.sizes else (build_plan, _print_plan)
    result = build(args)
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False))
    else:
        show(result)
    return 0


def register(sub: Any) -> None:
    """Add the ``plan`` subcommand to the CLI's subparsers."""
    parser = sub.add_parser(
        "plan", help="estimate compute utilization and the bandwidth needed per method",
        description="Analytical compute-utilization planner (Streaming DiLoCo Table 4 model): per "
                    "method, bytes per sync, bandwidth needed and utilization on a link, and a "
                    "recommended (H, F, tau, codec). Model and assumptions: see node/plan.py.")
    parser.add_argument("--params", metavar="N",
                        help="parameter count: 125e6, 150M, 25m, 1B, 1.3b (or --preset)")
    parser.add_argument("--step-time", metavar="S",
                        help="seconds per inner step: 0.5, 500ms (or --preset with --gpu: estimated)")
    parser.add_argument("--bandwidth", metavar="RATE",
                        help="per-worker link rate: 1Gbit/s, 100Mbps, 10MB/s (bytes), 1e9 (bit/s)")
    parser.add_argument("--preset", metavar="P", help="a model preset (tiny, small, 125m, 350m, 1b): its "
                        "parameter count, and with --gpu its estimated step time and memory")
    parser.add_argument("--gpu", metavar="G", help="a GPU class (t4, l4, rtx4090, a100-40g, a100-80g, h100, h200) "
                        "whose datasheet throughput estimates the step time")
    parser.add_argument("--arch", default="llama", choices=("llama", "gpt2"), help="architecture of --preset")
    parser.add_argument("--tokens-per-step", metavar="T", help="tokens per inner step for the estimates "
                        "(default 32768)")
    parser.add_argument("--seq-len", metavar="L", help="sequence length for the estimates (default 1024)")
    parser.add_argument("--mfu", metavar="U", help="model flops utilization assumed (default 0.35)")
    parser.add_argument("--sizes", action="store_true",
                        help="print the expected step time and memory of every preset on every GPU class "
                             "(--preset/--gpu narrow it) and exit")
    parser.add_argument("--latency", default="0", metavar="L", help="one-way latency: 50ms, 0.05 (default 0)")
    parser.add_argument("--workers", default=str(DEFAULT_WORKERS), metavar="M",
                        help=f"workers averaged per sync, n (default {DEFAULT_WORKERS})")
    parser.add_argument("--h", default=str(DEFAULT_H), metavar="H",
                        help=f"inner steps between two syncs of a fragment (default {DEFAULT_H})")
    parser.add_argument("--fragments", default=str(DEFAULT_FRAGMENTS), metavar="F",
                        help=f"fragments F (default {DEFAULT_FRAGMENTS})")
    parser.add_argument("--tau", default=str(DEFAULT_TAU), metavar="T",
                        help=f"inner steps a sync overlaps with training (default {DEFAULT_TAU})")
    parser.add_argument("--target", default=str(DEFAULT_TARGET), metavar="U",
                        help="target utilization: 0.95 or 95%% (default 0.95)")
    parser.add_argument("--backward-overlap", default="0", metavar="O",
                        help="fraction of a step every reduction hides behind (backward pass), e.g. "
                             "0.67 (default 0)")
    parser.add_argument("--round-overhead", default=str(ROUND_OVERHEAD_S), metavar="O",
                        help="fixed seconds every sync pays besides its bytes: matchmaking, group formation, "
                             f"the last member (default {ROUND_OVERHEAD_S:g}, as measured on 20 Mbit/s links; "
                             "0 for the paper's datacenter model)")
    parser.add_argument("--catch-up-rate", default=str(CATCH_UP_RATE), metavar="M",
                        help="catch-up downloads (phi and momentum of a fragment, in the background) per round a "
                             f"node takes part in (default {CATCH_UP_RATE:g}, as measured; 0 for the paper's model)")
    parser.add_argument("--link-efficiency", default=str(LINK_EFFICIENCY), metavar="E",
                        help="share of the link rate a round's transfers get (default "
                             f"{LINK_EFFICIENCY:g}, as measured on tc-shaped links; 1 for the paper's datacenter "
                             "model)")
    parser.add_argument("--baseline-codec", default="fp32", choices=("fp32", "bf16"),
                        help="codec of dp, diloco, streaming and eager rows (default fp32)")
    parser.add_argument("--json", action="store_true", help="print rows and recommendation as JSON")
    parser.set_defaults(func=_handler)
