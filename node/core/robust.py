"""Robust aggregation: how a reducer combines its group members' contributions to one part.

A volunteer swarm is open, so any member may send garbage, by accident or on purpose. A reducer
therefore *screens* every contribution before it enters a reduction, then *combines* the accepted
ones with the swarm's aggregator. Both steps are pure torch and shared by every transport (the swarm
reducer and the in-process hub of the simulator), so the benchmark measures what the network runs.

Screening (every aggregator), with ``ref`` a robust reference taken over the group: the median (the
lower one for an even count) of the members' values, or, in a pair, the reducer's own value (a pair
cannot outvote a liar, but the reducer trusts itself):

- values: all finite, else refused;
- token weight: finite and > 0, else refused; above ``WEIGHT_ABSURD`` times the sender's own bound
  (what its heartbeat throughput allows over a whole carry; the cap below when it has none), refused;
  else clamped to the cap = ``weight_factor * ref weight`` and the sender's own bound;
- norm of the whole part (of its deviation from ``center``, for rounds that average phi itself):
  above ``reject_factor * ref norm`` times its (clamped) weight over the reference weight when that
  ratio is above 1 (progress grows at most linearly with the steps it represents), refused.

A refused contribution is dropped from the round; the round completes with the others.

Combining (per chunk, so memory is bounded by members x one chunk), chosen once from
``[robust] aggregator``:

- ``mean``: the token-weighted mean. No protection beyond screening: a member may still move the
  result anywhere within ``reject_factor`` times a normal norm.
- ``clipped_mean`` (default): each contribution's chunk is scaled down to a norm of at most
  ``clip_factor * ref`` (the chunk's median norm) times a weight allowance, the square root of the
  contribution's clamped weight over the reference weight when that is above 1, then the token-weighted
  mean. Progress over n steps grows between sqrt(n) (noise) and n (a steady drift) times one step's,
  so the root lets a faster node's honest progress through mostly whole (without it, a node three times
  faster than its pair was scaled down to its partner's norm), while a liar that claims the largest
  weight the clamp allows buys at most ``sqrt(weight_factor)`` times the clip. One member's pull is
  bounded by that; honest contributions are unchanged (their norms are within a small factor of the
  median), so it costs nothing without attackers.
- ``trimmed_mean``: per coordinate, the ``b`` largest and ``b`` smallest values are dropped
  (``b = round(trim_fraction * n)``, at least 1 for n >= 3, leaving at least one value), then the
  token-weighted mean of the rest. Robust to ``b`` attackers per coordinate, at the price of
  discarding honest values (noisier averages in small groups).
- ``median``: the token-weighted coordinate-wise median. The most robust (to any minority), and the
  noisiest: it ignores all but one value per coordinate.

In groups of two (pairwise gossip) trimming and medians cannot tell the liar (they reduce to the
mean); screening and clipping against the reducer's own contribution still bound the damage.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from locoswarm.node.config import AGGREGATORS, RobustSection

#: A weight above this many times its cap is not a rounding matter but a lie (or a bug): refused.
WEIGHT_ABSURD = 100.0
#: A norm above this many times the reference is absurd, not merely large: honest pseudo-gradients
#: differ by their members' step counts and learning rates (a ratio of a few thousand at most, across a
#: warmup), so such a refusal is an offence even in a pair, where the reference is the reducer's own.
NORM_ABSURD = 1e6


@dataclass
class ContributionStats:
    """What a reducer knows of one member's contribution to its part before combining it."""

    sender: str
    weight: float
    chunk_norms: torch.Tensor              # float64 per chunk of the part: norm of (values - center)
    finite: bool = True
    max_weight: float = math.inf           # the sender's own cap (e.g. from its heartbeat throughput)

    @property
    def norm(self) -> float:
        return float(torch.linalg.vector_norm(self.chunk_norms)) if self.chunk_norms.numel() else 0.0


@dataclass
class Refusal:
    sender: str
    kind: str       # "bad_contribution" | "bad_weight"
    detail: str
    relative: bool = False   # judged against the group's reference (not absolute: non-finite, absurd weight/norm)
    conclusive: bool = False  # this project's code never sends it (non-finite values, an absurd norm): a ban at once


@dataclass
class Screening:
    """The outcome of screening a group's contributions to one part."""

    accepted: list[int]                    # indices into the screened list, in order
    weights: list[float]                   # the weight each accepted contribution enters with
    chunk_refs: torch.Tensor               # float64 per chunk: the reference norm clipping uses
    allowances: list[float] = field(default_factory=list)  # per accepted: max(1, weight / reference weight)
    # (screening's norm limit scales with it; clipping with its square root)
    refusals: list[Refusal] = field(default_factory=list)
    clamped: list[str] = field(default_factory=list)   # senders whose weight was clamped

    @property
    def total_weight(self) -> float:
        return float(sum(self.weights))


def _reference(values: Sequence[float], trusted: int | None) -> float:
    """The lower median of ``values``; in a pair, the trusted member's value (with none trusted, the
    larger one: two members cannot tell who is lying, so a pair without a trusted side is not judged)."""
    if not values:
        return 0.0
    if len(values) == 2:
        return float(values[trusted]) if trusted is not None else float(max(values))
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


def screen(stats: Sequence[ContributionStats], settings: RobustSection, *, trusted: int | None = None,
           part_floor: float = 0.0, chunk_floors: torch.Tensor | None = None) -> Screening:
    """Screen a group's contributions to one part (see the module docstring).

    ``trusted`` is the index of the reducer's own contribution, if it has one: it is never refused and
    it is the reference in a pair. ``part_floor`` and ``chunk_floors`` are the smallest reference norms
    (rounds that average phi itself: deviations below ``consensus_tolerance * |phi|`` are normal drift,
    never clipped or refused however small the group's median deviation is).
    """
    refusals: list[Refusal] = []
    live = []
    for i, s in enumerate(stats):
        if i != trusted and not s.finite:
            # A node resets non-finite theta to phi instead of sending it: nothing honest sends NaN.
            refusals.append(Refusal(s.sender, "bad_contribution", "non-finite values (nan/inf)", conclusive=True))
        elif i != trusted and not (math.isfinite(s.weight) and s.weight > 0):
            refusals.append(Refusal(s.sender, "bad_weight", f"token weight {s.weight!r} is not a positive number"))
        else:
            live.append(i)
    t_live = live.index(trusted) if trusted in live else None

    # Token weights: clamp to a cap derived from the group; refuse what no clamping can excuse.
    ref_weight = _reference([stats[i].weight for i in live], t_live)
    weights: dict[int, float] = {}
    clamped: list[str] = []
    for i in live:
        s = stats[i]
        cap = min(settings.weight_factor * ref_weight, s.max_weight) if ref_weight > 0 else s.max_weight
        # Refused (an offence) only past the sender's own bound when there is one: the group's reference
        # can be an honest member's claim of a step or two (it just joined or caught up), and a normal
        # claim of a whole round is then far above it. Clamping to ``cap`` protects the average anyway.
        bound = s.max_weight if math.isfinite(s.max_weight) else cap
        if i != trusted and math.isfinite(bound) and s.weight > WEIGHT_ABSURD * bound:
            refusals.append(Refusal(s.sender, "bad_weight", f"token weight {s.weight:.3g} is more than "
                                                            f"{WEIGHT_ABSURD:g}x its bound {bound:.3g}"))
            continue
        weights[i] = min(s.weight, cap) if math.isfinite(cap) else s.weight
        if weights[i] < s.weight:
            clamped.append(s.sender)
    live = [i for i in live if i in weights]
    t_live = live.index(trusted) if trusted in live else None

    # Norms of the whole part against the group's reference. A contribution of more tokens than the
    # reference's (its clamped weight) may be larger in proportion: progress grows at most linearly with
    # steps. Without that, a member that just caught up (a step or two of its own) refused its partner's
    # whole round as "23x the reference", and a node faster than its pair never got a round through.
    norms = [stats[i].norm for i in live]
    ref_norm = max(_reference(norms, t_live), part_floor)
    ref_w = _reference([weights[i] for i in live], t_live)
    accepted = []
    allowance = {i: max(1.0, weights[i] / ref_w if ref_w > 0 else 1.0) for i in live}
    for i, norm in zip(live, norms, strict=True):
        limit = settings.reject_factor * allowance[i]
        if i != trusted and ref_norm > 0 and norm > limit * ref_norm:
            refusals.append(Refusal(stats[i].sender, "bad_contribution",
                                    f"norm {norm:.3g} is {norm / ref_norm:.1f}x the group's reference "
                                    f"{ref_norm:.3g} (limit {limit:.3g}x for its token weight)",
                                    relative=norm <= NORM_ABSURD * ref_norm,
                                    conclusive=norm > NORM_ABSURD * ref_norm))
        elif i != trusted and ref_norm == 0 and norm > 0 and len(live) > 2:
            # Every other member changed nothing here: a lone large change is not believable.
            refusals.append(Refusal(stats[i].sender, "bad_contribution",
                                    f"norm {norm:.3g} where the group's reference is 0", relative=True))
        else:
            accepted.append(i)
    t_acc = accepted.index(trusted) if trusted in accepted else None

    n_chunks = stats[accepted[0]].chunk_norms.numel() if accepted else 0
    refs = torch.zeros(n_chunks, dtype=torch.float64)
    for c in range(n_chunks):
        refs[c] = _reference([float(stats[i].chunk_norms[c]) for i in accepted], t_acc)
    if chunk_floors is not None and n_chunks:
        refs = torch.maximum(refs, chunk_floors.to(torch.float64))
    return Screening(accepted=accepted, weights=[weights[i] for i in accepted], chunk_refs=refs,
                     allowances=[allowance[i] for i in accepted], refusals=refusals,
                     clamped=[s for s in clamped if any(stats[i].sender == s for i in accepted)])


def chunk_norm(values: torch.Tensor, center: torch.Tensor | None = None) -> float:
    """Norm of ``values - center`` in float64 (huge finite fp32 values must not overflow to inf)."""
    x = values.to(torch.float64)
    if center is not None:
        x = x - center.to(torch.float64)
    return float(torch.linalg.vector_norm(x))


class Aggregator(ABC):
    """Combines the screened contributions to one chunk (see the module docstring)."""

    name: str

    def combine(self, values: torch.Tensor, weights: torch.Tensor, ref_norm: float,
                center: torch.Tensor | None = None, allowances: torch.Tensor | None = None) -> torch.Tensor:
        """``values``: (k, m) fp32, one row per accepted contribution; ``weights``: (k,) > 0;
        ``ref_norm``: the chunk's reference norm (of deviations from ``center``); ``allowances``: (k,) the
        rows' weight allowances (:attr:`Screening.allowances`; all 1 when None). Returns (m,) fp32."""
        if values.shape[0] == 0:
            raise ValueError("no contribution to combine")
        if center is None:
            return self._combine(values.float(), weights.float(), ref_norm, allowances)
        c = center.to(values.dtype)
        return c + self._combine((values - c).float(), weights.float(), ref_norm, allowances)

    @abstractmethod
    def _combine(self, values: torch.Tensor, weights: torch.Tensor, ref_norm: float,
                 allowances: torch.Tensor | None) -> torch.Tensor: ...


class Mean(Aggregator):
    """The token-weighted mean (screening only)."""

    name = "mean"

    def _combine(self, values: torch.Tensor, weights: torch.Tensor, ref_norm: float,
                 allowances: torch.Tensor | None) -> torch.Tensor:
        return (weights / weights.sum()) @ values


class ClippedMean(Aggregator):
    """Norm-clipped weighted mean: rows above ``clip_factor * ref_norm`` times the root of their weight
    allowance are scaled down to it (module docstring)."""

    name = "clipped_mean"

    def __init__(self, clip_factor: float) -> None:
        self.clip_factor = clip_factor

    def _combine(self, values: torch.Tensor, weights: torch.Tensor, ref_norm: float,
                 allowances: torch.Tensor | None) -> torch.Tensor:
        norms = torch.linalg.vector_norm(values.double(), dim=1)
        limit = torch.full_like(norms, self.clip_factor * ref_norm)
        if allowances is not None:
            limit = limit * allowances.to(torch.float64).sqrt()
        scale = torch.where(norms > limit, limit / norms.clamp_min(1e-300), torch.ones_like(norms))
        return (weights / weights.sum()) @ (values * scale.float().unsqueeze(1))


def _sorted_with_weights(values: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per coordinate: the values sorted, and the weight of the member each sorted value came from."""
    ordered, index = torch.sort(values, dim=0)
    return ordered, weights[index]


class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed weighted mean: drop the ``b`` smallest and largest values."""

    name = "trimmed_mean"

    def __init__(self, trim_fraction: float) -> None:
        self.trim_fraction = trim_fraction

    def trim_count(self, n: int) -> int:
        if n < 3:
            return 0
        return min((n - 1) // 2, max(1, round(self.trim_fraction * n)))

    def _combine(self, values: torch.Tensor, weights: torch.Tensor, ref_norm: float,
                 allowances: torch.Tensor | None) -> torch.Tensor:
        b = self.trim_count(values.shape[0])
        if b == 0:
            return (weights / weights.sum()) @ values
        ordered, w = _sorted_with_weights(values, weights)
        ordered, w = ordered[b:values.shape[0] - b], w[b:values.shape[0] - b]
        return (ordered * w).sum(0) / w.sum(0)


class Median(Aggregator):
    """Coordinate-wise weighted median (the lower one where the weights split exactly in half)."""

    name = "median"

    def _combine(self, values: torch.Tensor, weights: torch.Tensor, ref_norm: float,
                 allowances: torch.Tensor | None) -> torch.Tensor:
        if values.shape[0] <= 2:
            return (weights / weights.sum()) @ values
        ordered, w = _sorted_with_weights(values, weights)
        cum = torch.cumsum(w, dim=0)
        first = (cum >= 0.5 * weights.sum()).to(torch.int64).argmax(dim=0, keepdim=True)
        return ordered.gather(0, first).squeeze(0)


def make_aggregator(settings: RobustSection) -> Aggregator:
    """The aggregator ``settings.aggregator`` names (chosen once, when a transport is built)."""
    if settings.aggregator == "mean":
        return Mean()
    if settings.aggregator == "clipped_mean":
        return ClippedMean(settings.clip_factor)
    if settings.aggregator == "trimmed_mean":
        return TrimmedMean(settings.trim_fraction)
    if settings.aggregator == "median":
        return Median()
    raise ValueError(f"unknown aggregator {settings.aggregator!r}; choose one of {', '.join(AGGREGATORS)}")
