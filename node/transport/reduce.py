"""The group reduction every transport performs: reduce-scatter then all-gather of codec chunks.

Members are ordered (by peer id); the payload's chunks are split into ``n`` contiguous parts and
member ``j`` reduces part ``j``: it screens every member's chunks of that part, judges their directions,
combines the accepted ones in fp32 around the group's centre with the swarm's robust aggregator
(``locoswarm.node.core.robust``), and re-encodes the reduced chunks with the same codec (``Codec.encode_reduced``:
a sparse codec keeps the union of the members' supports, so its reduced chunks are larger than a part's). The reduced
chunks are then all-gathered. Every member decodes the *same* reduced bytes, so the group's result is
bit-identical on all members. Per member and sync this moves about ``2 (n-1)/n`` payloads each way, the
exchange pattern of a ring/butterfly all-reduce.

A part is reduced in passes over the (already size-checked) codec bytes, one chunk at a time, so memory
stays at members x one chunk: norms for screening, directions (pull factors), deviations from the centre
(clip scales), then the combination of the accepted ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import Codec
from locoswarm.node.core.payload import chunk_bounds
from locoswarm.node.core.persistence import DeviationMemory
from locoswarm.node.core.robust import (
    Aggregator,
    ContributionStats,
    Screening,
    agreement_scores,
    chunk_norm,
    clip_scales,
    median_rows,
    pull_factor,
    screen,
)


def part_ranges(n_chunks: int, n_members: int) -> list[range]:
    """Contiguous ranges of chunk indices, one per member (some may be empty)."""
    base, extra = divmod(n_chunks, n_members)
    out, start = [], 0
    for j in range(n_members):
        size = base + (1 if j < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def reducer_parts(n_chunks: int, members: Sequence[str], idle: Collection[str] = (), round_: int = 0) -> list[range]:
    """Per member (in ``members``' order) the range of chunk indices it reduces in round ``round_``:
    :func:`part_ranges` over the members not ``idle``, turned by one range per round; an idle member's range is
    empty. Where every member is idle, none is.

    Why the turn: chunks differ in how much their residuals persist (a clean run of three real nodes, each
    chunk range always reduced by the same member: 0.35 against 0.43 by position, the same from every observer),
    and a reducer is judged against the others for its parts' spread and persistence (``swarm.judging``). Where
    each member reduced the same range round after round, the range's nature became the reducer's. Turned, every
    reducer of a steady group covers every range in turn."""
    reducing = [m for m in members if m not in idle] or list(members)
    ranges = part_ranges(n_chunks, len(reducing))
    turn = round_ % len(ranges)
    turned = iter(ranges[turn:] + ranges[:turn])
    return [next(turned) if m in reducing else range(0) for m in members]


# Why a member that most of the round mutes for its standing drift has no pull (``screen_part``'s ``round_mutes``).
ROUND_MUTES = "most of the round mutes it for its standing drift"

@dataclass
class PartContribution:
    """One member's chunks of one part, as the reducer holds them (exact codec bytes, sizes checked)."""

    sender: str
    weight: float
    chunks: Mapping[int, bytes]
    max_weight: float = math.inf


def screen_part(codec: Codec, contributions: Sequence[PartContribution], sizes: Mapping[int, int],
                settings: RobustSection, *, trusted: int | None = None,
                centers: Mapping[int, torch.Tensor] | None = None,
                memory: DeviationMemory | None = None, fragment: int = 0,
                round_mutes: Collection[str] = ()) -> Screening:
    """Screen a part's contributions, judge their directions and clip scales (``locoswarm.node.core.robust``).

    With ``centers`` (rounds that average phi itself) deviations are measured from them and directions are
    not judged (phi's deviations between honest members are drift with no direction to agree on); norms
    below ``consensus_tolerance`` times the center's own norm are normal drift (the floor of the screening and
    of the clipping radius). With ``memory`` (the reducer's, of rounds of pseudo-gradients of ``fragment``) a
    sender whose deviation from the centre persists round after round gets a smaller radius
    (``locoswarm.node.core.persistence``). ``round_mutes``: senders that most of the round mutes for their standing
    drift (``locoswarm.node.swarm.averaging.idle_reducers``): no pull here either (``ROUND_MUTES`` says why),
    though this reducer's own memory would give them some (they are still judged, so a probe round still gathers
    evidence of them)."""
    part = sorted(sizes)
    stats = []
    for con in contributions:
        norms = torch.zeros(len(part), dtype=torch.float64)
        finite = True
        for k, c in enumerate(part):
            values = codec.decode(con.chunks[c], sizes[c])
            if not bool(torch.isfinite(values).all()):
                finite = False
                break
            norms[k] = chunk_norm(values, None if centers is None else centers[c])
        stats.append(ContributionStats(con.sender, con.weight, norms, finite=finite, max_weight=con.max_weight))
    part_floor = 0.0
    if centers is not None and part:
        part_floor = settings.consensus_tolerance * math.sqrt(sum(chunk_norm(centers[c]) ** 2 for c in part))
    screening = screen(stats, settings, trusted=trusted, part_floor=part_floor)
    accepted = screening.accepted
    if not accepted or not part:
        return screening
    t_acc = accepted.index(trusted) if trusted in accepted else None

    def rows(k: int) -> torch.Tensor:
        c = part[k]
        return torch.stack([codec.decode(contributions[i].chunks[c], sizes[c]) for i in accepted])

    if centers is None and len(accepted) >= 2:
        screening.scores = agreement_scores(rows, len(part), trusted=t_acc)
        factors = [0.0 if muted else pull_factor(None if sc is None else sc.score, settings)
                   for sc, muted in zip(screening.scores, screening.muted, strict=True)]
        if any(factors):
            screening.factors = factors
        else:  # nobody agrees with anybody (no trusted member): judge nobody's direction
            screening.factors = [0.0 if muted else 1.0 for muted in screening.muted]
        if not any(screening.factors):
            screening.factors = [1.0] * len(accepted)
    if memory is not None and centers is None and settings.persistence_clip and t_acc is not None:
        _mute_standing_drift(memory, fragment, [contributions[i].sender for i in accepted], part, rows, t_acc,
                             screening)
    if round_mutes and centers is None:
        for k, i in enumerate(accepted):
            if contributions[i].sender in round_mutes and k != t_acc and not screening.muted[k]:
                screening.factors[k] = 0.0
                screening.muted[k] = ROUND_MUTES
    live = [f > 0 for f in screening.factors]
    persistence = None
    if memory is not None and centers is None and settings.persistence_clip and len(accepted) >= 2:
        persistence = memory.round(fragment, [contributions[i].sender for i in accepted], part)
    screening.scales = clip_scales(rows, len(part), _centre(part, centers, live), live, settings.clip_factor,
                                   floor=part_floor, persistence=persistence, trusted=t_acc)
    if persistence is not None:
        screening.persistence = persistence.persistence()
    return screening


def _mute_standing_drift(memory: DeviationMemory, fragment: int, senders: list[str], part: Sequence[int],
                         rows: Callable[[int], torch.Tensor], trusted: int, screening: Screening) -> None:
    """No pull for a sender whose difference from our own contribution persists far more than other senders'
    (``DeviationMemory.standing_drift``): the measure of drift that colluders in the group cannot move."""
    own = memory.own_round(fragment, senders, part)
    for k in range(len(part)):
        x = rows(k)
        own.observe(k, x - x[trusted])
    persistence = [None if i == trusted or not known else p
                   for i, (p, known) in enumerate(zip(own.persistence(), own.known(), strict=True))]
    own.commit()
    for i, why in enumerate(memory.standing_drift(senders, persistence)):
        if why is not None:
            screening.factors[i] = 0.0
            screening.muted[i] = why


def _centre(part: Sequence[int], centers: Mapping[int, torch.Tensor] | None,
            live: Sequence[bool]) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Chunk k's centre: the given one (consensus rounds), else the coordinate-wise median of the live rows."""
    if centers is not None:
        return lambda k, rows: centers[part[k]]
    mask = torch.tensor(list(live), dtype=torch.bool)
    return lambda k, rows: median_rows(rows[mask])


def combine_part(codec: Codec, contributions: Sequence[PartContribution], screening: Screening,
                 sizes: Mapping[int, int], aggregator: Aggregator, *,
                 centers: Mapping[int, torch.Tensor] | None = None) -> dict[int, bytes]:
    """Last pass: each chunk of the part combined from the accepted contributions, re-encoded."""
    if not screening.accepted or screening.total_weight <= 0:
        raise ValueError("no contribution to this part was accepted")
    part = sorted(sizes)
    weights = torch.tensor(screening.pulls, dtype=torch.float32)
    scales = torch.tensor(screening.scales, dtype=torch.float64)
    centre = _centre(part, centers, [f > 0 for f in screening.factors])
    reduced = {}
    for k, c in enumerate(part):
        rows = torch.stack([codec.decode(contributions[i].chunks[c], sizes[c]) for i in screening.accepted])
        # encode_reduced: a sparse codec's average (the union of the parts' supports) must not be top-k'ed again
        reduced[c] = codec.encode_reduced(aggregator.combine(rows, weights, centre(k, rows), scales))
    return reduced


def reduce_group(codec: Codec, payloads: Sequence[Sequence[bytes]], weights: Sequence[float], numel: int,
                 settings: RobustSection, aggregator: Aggregator, *, senders: Sequence[str] | None = None,
                 memory: DeviationMemory | None = None, fragment: int = 0, round_: int = 0,
                 ) -> tuple[list[bytes], list[int], list[int], list[float]]:
    """Reduce a whole group's payloads in one place (the in-process transport; tests). ``senders`` name the
    members (default: their indices) for ``memory``, the reducers' memory of persistent deviations; each member
    reduces its part of round ``round_`` (:func:`reducer_parts`).

    Returns the reduced chunks (what every member decodes), per member the bytes it sent and received
    under the reduce-scatter + all-gather pattern, and per member the weight it entered the reduction
    with (0 where some reducer refused it or gave it no pull; what screening clamped otherwise).
    """
    n = len(payloads)
    bounds = chunk_bounds(numel, codec.block_size)
    parts = reducer_parts(len(bounds), [str(i) for i in range(n)], round_=round_)
    reduced: list[bytes] = [b""] * len(bounds)
    sent = [0] * n
    received = [0] * n
    entered = list(map(float, weights))
    for j, part in enumerate(parts):
        if not part:
            continue
        sizes = {c: bounds[c][1] - bounds[c][0] for c in part}
        names = [str(i) for i in range(n)] if senders is None else list(senders)
        cons = [PartContribution(names[i], float(weights[i]), {c: payloads[i][c] for c in part}) for i in range(n)]
        screening = screen_part(codec, cons, sizes, settings, memory=memory, fragment=fragment)
        for c, data in combine_part(codec, cons, screening, sizes, aggregator).items():
            reduced[c] = data
        pulls = screening.pulls
        for i in range(n):
            if i not in screening.accepted:
                entered[i] = 0.0
            else:
                entered[i] = min(entered[i], pulls[screening.accepted.index(i)])
        for c in part:
            for i in range(n):
                if i != j:
                    sent[i] += len(payloads[i][c])        # reduce-scatter: i -> reducer j
                    received[j] += len(payloads[i][c])
                    sent[j] += len(reduced[c])            # all-gather: reducer j -> i
                    received[i] += len(reduced[c])
    return reduced, sent, received, entered
