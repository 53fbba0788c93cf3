"""Robust aggregation: how a reducer judges and combines its group members' contributions to one part.

A volunteer swarm is open, so any member may send garbage, by accident or on purpose, and a hostile one
sends what stays inside every bound it can see. A reducer therefore *screens* every contribution before it
enters a reduction, *judges* its direction, then *combines* the accepted ones around a robust centre. All
of it is pure torch, shared by every transport (the swarm reducer and the in-process hub of the
simulator), so the benchmark measures what the network runs. The threat model is ``docs/security.md``.

Screening (every aggregator), with ``ref`` a robust reference over the group: the median (the lower one
for an even count) of the members' values, or, in a pair, the reducer's own value (a pair cannot outvote a
liar, but the reducer trusts itself):

- values: all finite, else refused (conclusive: this project's code never sends them);
- token weight: finite and > 0, else refused; above ``WEIGHT_ABSURD`` times the sender's own bound, refused;
  else clamped to ``weight_factor * ref weight`` (default 1: a claim above the group's median buys no pull,
  however many tokens it names) and the sender's own bound;
- norm of the whole part (of its deviation from ``center``, for rounds that average phi itself): above
  ``NORM_ABSURD * ref norm``, refused (conclusive); above ``reject_factor * ref norm`` (times its claimed tokens
  over the reference's, where that is above 1: progress grows at most linearly with steps), it has no pull.

A refused contribution is dropped from the round and its sender told so (its round fails); the round
completes with the others. A contribution without pull is not refused: its sender gets the group's average
like everyone. An honest member can be far larger than its group now and then (it carried failed rounds'
progress while the others had just caught up): a robustness-bench run saw one refused for its norm twelve
times, banned by an honest peer, and kept out of that peer's rounds.

Direction (rounds of pseudo-gradients, :func:`agreement_scores`): a contribution's *agreement* is the larger
of its cosine with the coordinate-wise median of the *other* contributions and its cosine with the reducer's
own (the one contribution a reducer trusts; with no trusted member, the first alone). Its pull factor rises
linearly from 0 at ``agreement_floor`` to 1 at ``agreement_full``. A direction flip, an inner-product
manipulation (a negative multiple of the honest mean) or a replay of another round's progress disagrees and
has no pull, whatever its norm. Why not refuse it outright: an honest part can disagree now and then. On
the tiny presets (4 and 6 workers, parts of a quarter to a sixth of a fragment, 600 steps) the agreement of
honest contributions had a 1st percentile of +0.004 and a minimum of -0.26, while their mean over 4 rounds
never went below +0.016. So one round only weighs a contribution; the swarm layer bans on the mean
(``[robust] agreement_ban``), and an honest member is never refused for its direction. Taking the larger of
the two cosines keeps a reducer that has no honest majority in its group (two colluders with identical
vectors are the median of the others) from mistaking an honest member for the outlier. For the same reason a
contribution that points against the reducer's own and with the others' median is no evidence either way for
the ban (``Agreement.evidence``): the reducer is outvoted and cannot tell who is odd, and two colluders agreeing
with each other must not earn credit for it.

Centre and clipping (``clipped_mean``, :func:`clip_scales`): the centre is the coordinate-wise median of the
contributions with pull (of a consensus round: the reducer's own phi), and each contribution's deviation
from it is scaled down to at most ``clip_factor`` times the median deviation (centred clipping,
Karimireddy, He and Jaggi 2021, with the radius taken from the group's own spread, not from the norms).
Honest contributions lie within a small factor of the median deviation and pass whole (the mean of
unclipped deviations around any centre is the plain mean); a member that agrees in direction but drifts
moves the average by at most its share of weight times that radius.

Combining (per chunk, so memory is bounded by members x one chunk), chosen once from ``[robust]
aggregator``, over the deviations from the centre weighted by clamped weight x pull factor:

- ``mean``: the weighted mean, no clipping.
- ``clipped_mean`` (default): the weighted mean of the clipped deviations.
- ``trimmed_mean``: per coordinate, the ``b`` largest and ``b`` smallest values are dropped
  (``b = round(trim_fraction * n)``, at least 1 for n >= 3, leaving at least one value), then the weighted
  mean of the rest.
- ``median``: the weighted coordinate-wise median.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from locoswarm.node.config import AGGREGATORS, RobustSection
from locoswarm.node.core.persistence import DeviationRound

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
    conclusive: bool = False  # this project's code never sends it (non-finite values, an absurd norm): a ban at once


@dataclass
class Screening:
    """The outcome of screening a group's contributions to one part, then judging their directions."""

    accepted: list[int]                    # indices into the screened list, in order
    weights: list[float]                   # the (clamped) weight each accepted contribution claims
    allowances: list[float] = field(default_factory=list)  # per accepted: max(1, weight / reference weight)
    refusals: list[Refusal] = field(default_factory=list)
    clamped: list[str] = field(default_factory=list)   # senders whose weight was clamped
    # per accepted: why it has no pull for its norm (None: it may have pull); the direction judgement (None:
    # not judged: the reducer's own, a consensus round, no progress) and the pull factor in [0, 1] it gives;
    # the clip scale of its deviation from the centre
    muted: list[str | None] = field(default_factory=list)
    scores: list[Agreement | None] = field(default_factory=list)
    factors: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    persistence: list[float] = field(default_factory=list)  # per accepted, where measured (core.persistence)

    def __post_init__(self) -> None:
        n = len(self.accepted)
        self.muted = self.muted or [None] * n
        self.scores = self.scores or [None] * n
        self.factors = self.factors or [0.0 if m else 1.0 for m in self.muted]
        self.scales = self.scales or [1.0] * n

    @property
    def pulls(self) -> list[float]:
        """The weight each accepted contribution enters the average with: clamped weight x pull factor."""
        return [w * f for w, f in zip(self.weights, self.factors, strict=True)]

    @property
    def total_weight(self) -> float:
        return float(sum(self.pulls))


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
           part_floor: float = 0.0) -> Screening:
    """Screen a group's contributions to one part (see the module docstring): absolute checks, weights,
    norms. Directions and clipping are judged afterwards, over the values (:func:`agreement_scores`,
    :func:`clip_scales`).

    ``trusted`` is the index of the reducer's own contribution, if it has one: it is never refused and
    it is the reference in a pair. ``part_floor`` is the smallest reference norm (rounds that average phi
    itself: deviations below ``consensus_tolerance * |phi|`` are normal drift, never refused however small
    the group's median deviation is).
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

    # Token weights: clamp to a cap derived from the group; refuse what no clamping can excuse. The reducer's
    # own claim is a floor of the reference: members that just joined (a step or two each) must not cap a
    # whole round's honest claim at theirs, and colluders' high claims cannot raise it past the median.
    ref_weight = _reference([stats[i].weight for i in live], t_live)
    if t_live is not None:
        ref_weight = max(ref_weight, stats[trusted].weight)
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
    # reference's may be larger in proportion: progress grows at most linearly with steps. The claim counts
    # here (within the sender's own bound), not its clamped weight: a member that carried failed rounds'
    # progress claims their tokens, and its norm is theirs.
    norms = [stats[i].norm for i in live]
    ref_norm = max(_reference(norms, t_live), part_floor)
    ref_w = _reference([weights[i] for i in live], t_live)
    accepted, muted = [], []
    allowance = {i: max(1.0, min(stats[i].weight, stats[i].max_weight) / ref_w if ref_w > 0 else 1.0)
                 for i in live}
    for i, norm in zip(live, norms, strict=True):
        limit = settings.reject_factor * allowance[i]
        if i != trusted and ref_norm > 0 and norm > NORM_ABSURD * ref_norm:
            refusals.append(Refusal(stats[i].sender, "bad_contribution",
                                    f"norm {norm:.3g} is {norm / ref_norm:.3g}x the group's reference "
                                    f"{ref_norm:.3g}", conclusive=True))
            continue
        accepted.append(i)
        if i != trusted and ref_norm > 0 and norm > limit * ref_norm:
            muted.append(f"norm {norm:.3g} is {norm / ref_norm:.1f}x the group's reference {ref_norm:.3g} (limit "
                         f"{limit:.3g}x for its tokens)")
        elif i != trusted and ref_norm == 0 and norm > 0 and len(live) > 2:
            # Every other member changed nothing here: a lone large change is not believable.
            muted.append(f"norm {norm:.3g} where the group's reference is 0")
        else:
            muted.append(None)
    return Screening(accepted=accepted, weights=[weights[i] for i in accepted],
                     allowances=[allowance[i] for i in accepted], refusals=refusals,
                     clamped=[s for s in clamped if any(stats[i].sender == s for i in accepted)], muted=muted)


def chunk_norm(values: torch.Tensor, center: torch.Tensor | None = None) -> float:
    """Norm of ``values - center`` in float64 (huge finite fp32 values must not overflow to inf)."""
    x = values.to(torch.float64)
    if center is not None:
        x = x - center.to(torch.float64)
    return float(torch.linalg.vector_norm(x))


def median_rows(rows: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of ``rows`` (k, m): the middle value, the mean of the two middle ones for an
    even k (so that a pair's centre is its mean, and two colluders cannot make one of their values the centre
    of a group of four)."""
    k = rows.shape[0]
    if k == 1:
        return rows[0].clone()
    ordered = torch.sort(rows, dim=0).values
    if k % 2:
        return ordered[k // 2]
    return 0.5 * (ordered[k // 2 - 1] + ordered[k // 2])


ChunkRows = Callable[[int], torch.Tensor]  # chunk k of a part -> (members, elements) fp32 values


@dataclass(frozen=True)
class Agreement:
    """A contribution's direction as one reducer sees it: its cosine with the coordinate-wise median of the other
    contributions (``with_others``) and with the reducer's own (``with_own``; None without one)."""

    with_others: float | None
    with_own: float | None
    others: int  # how many other contributions it was judged against (the reducer's own among them)

    @property
    def score(self) -> float:
        """The larger of the two cosines: what its pull follows (module docstring)."""
        return max(c for c in (self.with_others, self.with_own) if c is not None)

    @property
    def outvoted(self) -> bool:
        """Whether it points against the reducer's own contribution and with the others' median."""
        return self.with_own is not None and self.with_others is not None and self.with_own < 0 <= self.with_others

    @property
    def evidence(self) -> float | None:
        """The score as evidence of the sender's intent, for the agreement ban; None where this reducer is
        outvoted: the contribution points against the reducer's own and with the others' median. There the
        reducer cannot tell whether it is the odd one out or the others collude, and counting the agreement
        as good cleared two colluding flippers: an honest node grouped with both of them saw each agree with
        the other, those scores diluted its window of judgements from honest-majority groups, and it banned one
        flipper after 87 rounds and never the other (robustness bench, 4 honest + 2 flippers).

        None in a pair too (``others`` < 2): the reducer's own contribution is the only other one, so a
        disagreement says that the two differ, not which of them is odd. Honest pairs do disagree: with the
        alpha merge a member's next contribution carries alpha times its last progress minus the group's
        average, in a pair half the difference of the two, and with rounds every step or two two honest nodes
        pointed against each other at -0.5 to -0.9 and banned each other (a two-node CI run, which then failed
        every round for the ban's 600 s). A hostile partner gains nothing: without agreement it has no pull,
        and the effect check still judges what it did."""
        if self.others < 2:
            return None
        if self.outvoted:
            return None
        return self.score

    def evidence_where(self, *, accused: bool) -> float | None:
        """``evidence``, except where another member of the round already excludes the sender (``accused``):
        then the reducer is not alone in its disagreement, and the sender's agreement with the reducer's own
        contribution counts, in a pair and where the reducer is outvoted. Once one honest node of three banned a
        flipper, the others were grouped with it in pairs, judged nothing, and banned it only 20 s later when it
        served a harmful state (robustness bench, 3 + 1, 65-69 rounds against 4). Once one honest node of four
        banned two colluders, the placement kept them from it and grouped them with another honest node, which
        they outvoted: it judged nothing, and banned them 25-30 rounds after the first (4 + 2, ipm)."""
        if not accused:
            return self.evidence
        if self.others < 2:
            return self.score
        if self.outvoted:
            return self.with_own
        return self.score


def agreement_scores(chunk_rows: ChunkRows, n_chunks: int, *, trusted: int | None) -> list[Agreement | None]:
    """Per row: its agreement with the group (:class:`Agreement`: the cosines with the coordinate-wise median of
    the other rows and with the ``trusted`` row); None for the trusted row itself and for a row that changes
    nothing (no direction to judge). Summed chunk by chunk (one chunk of every row in memory at a time)."""
    dot_loo = dot_own = sq = loo_sq = None
    own_sq = 0.0
    for k in range(n_chunks):
        x = chunk_rows(k).to(torch.float64)
        n = x.shape[0]
        if dot_loo is None:
            dot_loo, loo_sq, dot_own, sq = (torch.zeros(n, dtype=torch.float64) for _ in range(4))
        sq += (x * x).sum(1)
        for i in range(n):
            others = torch.cat([x[:i], x[i + 1:]])
            if others.shape[0]:
                centre = median_rows(others)
                dot_loo[i] += x[i] @ centre
                loo_sq[i] += centre @ centre
        if trusted is not None:
            dot_own += x @ x[trusted]
            own_sq += float(x[trusted] @ x[trusted])
    if dot_loo is None:
        return []
    out: list[Agreement | None] = []
    for i in range(len(dot_loo)):
        if i == trusted or float(sq[i]) <= 0.0:
            out.append(None)
            continue
        with_others = with_own = None
        if float(loo_sq[i]) > 0:
            with_others = float(dot_loo[i]) / math.sqrt(float(sq[i]) * float(loo_sq[i]))
        if trusted is not None and own_sq > 0:
            with_own = float(dot_own[i]) / math.sqrt(float(sq[i]) * own_sq)
        out.append(None if with_others is None and with_own is None
                   else Agreement(with_others, with_own, others=len(dot_loo) - 1))
    return out


def pull_factor(score: float | None, settings: RobustSection) -> float:
    """The pull of a contribution of agreement ``score``: 0 at or below ``agreement_floor``, 1 from
    ``agreement_full`` on, linear in between; 1 when it was not judged."""
    if score is None:
        return 1.0
    lo, hi = settings.agreement_floor, settings.agreement_full
    if score >= hi:  # first: a floor of -1 with full pull from -1 judges nothing
        return 1.0
    if score <= lo:
        return 0.0
    return (score - lo) / (hi - lo)


def clip_scales(chunk_rows: ChunkRows, n_chunks: int, centre: Callable[[int, torch.Tensor], torch.Tensor],
                live: Sequence[bool], clip_factor: float, *, floor: float = 0.0,
                persistence: DeviationRound | None = None, trusted: int | None = None) -> list[float]:
    """Per row, the factor its deviation from the centre is scaled by: ``min(1, radius / deviation)``, the
    radius ``clip_factor`` times the median deviation of the ``live`` rows (those with pull), at least
    ``floor``. ``centre(k, rows)`` is chunk ``k``'s centre for its rows. With ``persistence`` (the reducer's
    memory of its senders' deviations, ``locoswarm.node.core.persistence``) each row's radius is scaled by
    :func:`persistence_shrink` of the cosines of the rows' deviations with their remembered ones (the ``trusted``
    row, the reducer's own, keeps the radius); the memory then learns this round's deviations."""
    dev_sq = None
    for k in range(n_chunks):
        x = chunk_rows(k)
        c = centre(k, x).to(torch.float64)
        dev = x.to(torch.float64) - c
        if persistence is not None:
            persistence.observe(k, dev)
        d = (dev ** 2).sum(1)
        dev_sq = d if dev_sq is None else dev_sq + d
    if dev_sq is None:
        return []
    shrink = [1.0] * len(dev_sq)
    if persistence is not None:
        shrink = persistence_shrink(persistence.persistence(), trusted)
        persistence.commit()
    devs = [math.sqrt(float(v)) for v in dev_sq]
    ref = [d for d, ok in zip(devs, live, strict=True) if ok]
    if not ref:
        return [1.0] * len(devs)
    ordered = sorted(ref)
    median = ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else 0.5 * (
        ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2])
    radius = clip_factor * max(median, floor)
    return [1.0 if d <= radius * f or d == 0 else radius * f / d for d, f in zip(devs, shrink, strict=True)]


def persistence_shrink(persistence: Sequence[float], trusted: int | None) -> list[float]:
    """Per row, the factor its clip radius is scaled by for the persistence of its deviation
    (``locoswarm.node.core.persistence``), relative to the group's: ``1 - (p - ref) / (1 - ref)`` above the
    group's median persistence ``ref``, 1 at or below it and for the ``trusted`` row. Honest members deviate
    persistently too (each trains on its own documents: on the tiny preset their persistence averaged 0.32-0.37 in
    one robustness-bench run, 0.49-0.50 beside a drifter), so only what persists more than the group's own costs
    radius; a minority cannot move the median."""
    ordered = sorted(persistence)
    if not ordered:
        return []
    n = len(ordered)
    ref = ordered[(n - 1) // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
    ref = max(ref, 0.0)
    # at or below the median (in a pair both members' deviations are opposite, so equally persistent): no shrink
    return [1.0 if i == trusted or p <= ref + 1e-6 else max(0.0, 1.0 - (p - ref) / (1.0 - ref))
            for i, p in enumerate(persistence)]


class Aggregator(ABC):
    """Combines the screened, judged (and, where it ``clips``, clipped) deviations of one chunk from its
    centre (see the module docstring)."""

    name: str
    clips: bool = False  # whether deviations are clipped to the group's radius before combining

    def combine(self, values: torch.Tensor, weights: torch.Tensor, center: torch.Tensor,
                scales: torch.Tensor | None = None) -> torch.Tensor:
        """``values``: (k, m) fp32, one row per accepted contribution; ``weights``: (k,) >= 0, not all 0;
        ``center``: (m,) the chunk's centre; ``scales``: (k,) clip scales of the rows' deviations (ignored
        unless the aggregator clips). Returns (m,) fp32: the centre plus the combined deviations."""
        keep = weights > 0
        if values.shape[0] == 0 or not bool(keep.any()):
            raise ValueError("no contribution to combine")
        if not (self.clips and scales is not None and bool((scales[keep] < 1).any())):
            # nothing clipped: the centre cancels out, and the plain combination is exact (bit for bit what it
            # was before centres existed; the centred form rounds differently in fp32)
            return self._combine(values[keep].float(), weights[keep].float())
        c = center.to(values.dtype)
        dev = (values[keep].float() - c) * scales[keep].to(torch.float32).unsqueeze(1)
        return c + self._combine(dev, weights[keep].float())

    @abstractmethod
    def _combine(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


class Mean(Aggregator):
    """The weighted mean (screening and direction only)."""

    name = "mean"

    def _combine(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (weights / weights.sum()) @ values


class ClippedMean(Mean):
    """The weighted mean of deviations from the centre clipped to the group's radius (module docstring)."""

    name = "clipped_mean"
    clips = True


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

    def _combine(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        b = self.trim_count(values.shape[0])
        if b == 0:
            return (weights / weights.sum()) @ values
        ordered, w = _sorted_with_weights(values, weights)
        ordered, w = ordered[b:values.shape[0] - b], w[b:values.shape[0] - b]
        return (ordered * w).sum(0) / w.sum(0)


class Median(Aggregator):
    """Coordinate-wise weighted median (the lower one where the weights split exactly in half)."""

    name = "median"

    def _combine(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
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
        return ClippedMean()
    if settings.aggregator == "trimmed_mean":
        return TrimmedMean(settings.trim_fraction)
    if settings.aggregator == "median":
        return Median()
    raise ValueError(f"unknown aggregator {settings.aggregator!r}; choose one of {', '.join(AGGREGATORS)}")
