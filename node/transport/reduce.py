"""The group reduction every transport performs: reduce-scatter then all-gather of codec chunks.

Members are ordered (by peer id); the payload's chunks are split into ``n`` contiguous parts and
member ``j`` reduces part ``j``: it screens every member's chunks of that part, combines the accepted
ones in fp32 with the swarm's robust aggregator (``locoswarm.node.core.robust``), and re-encodes the reduced
chunks with the same codec. The reduced chunks are then all-gathered. Every member decodes the *same*
reduced bytes, so the group's result is bit-identical on all members. Per member and sync this moves
about ``2 (n-1)/n`` payloads each way, the exchange pattern of a ring/butterfly all-reduce.

A part is reduced in two passes over the (already size-checked) codec bytes, one chunk at a time, so
memory stays at members x one chunk: the first pass measures each contribution's chunk norms for
screening, the second combines the accepted ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import Codec
from locoswarm.node.core.payload import chunk_bounds
from locoswarm.node.core.robust import Aggregator, ContributionStats, Screening, chunk_norm, screen


def part_ranges(n_chunks: int, n_members: int) -> list[range]:
    """Contiguous ranges of chunk indices, one per member (some may be empty)."""
    base, extra = divmod(n_chunks, n_members)
    out, start = [], 0
    for j in range(n_members):
        size = base + (1 if j < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass
class PartContribution:
    """One member's chunks of one part, as the reducer holds them (exact codec bytes, sizes checked)."""

    sender: str
    weight: float
    chunks: Mapping[int, bytes]
    max_weight: float = math.inf


def screen_part(codec: Codec, contributions: Sequence[PartContribution], sizes: Mapping[int, int],
                settings: RobustSection, *, trusted: int | None = None,
                centers: Mapping[int, torch.Tensor] | None = None) -> Screening:
    """First pass: per-chunk norms (of deviations from ``centers``), finiteness, then screening.

    With ``centers`` (rounds that average phi itself) the norms below ``consensus_tolerance`` times the
    center's own norm are normal drift (the floors of the screening)."""
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
    floors, part_floor = None, 0.0
    if centers is not None and part:
        floors = torch.tensor([settings.consensus_tolerance * chunk_norm(centers[c]) for c in part],
                              dtype=torch.float64)
        part_floor = float(torch.linalg.vector_norm(floors))
    return screen(stats, settings, trusted=trusted, part_floor=part_floor, chunk_floors=floors)


def combine_part(codec: Codec, contributions: Sequence[PartContribution], screening: Screening,
                 sizes: Mapping[int, int], aggregator: Aggregator, *,
                 centers: Mapping[int, torch.Tensor] | None = None) -> dict[int, bytes]:
    """Second pass: each chunk of the part combined from the accepted contributions, re-encoded."""
    if not screening.accepted:
        raise ValueError("no contribution to this part was accepted")
    weights = torch.tensor(screening.weights, dtype=torch.float32)
    allowances = torch.tensor(screening.allowances, dtype=torch.float64) if screening.allowances else None
    reduced = {}
    for k, c in enumerate(sorted(sizes)):
        rows = torch.stack([codec.decode(contributions[i].chunks[c], sizes[c]) for i in screening.accepted])
        center = None if centers is None else centers[c]
        reduced[c] = codec.encode(aggregator.combine(rows, weights, float(screening.chunk_refs[k]), center,
                                                     allowances))
    return reduced


def reduce_group(codec: Codec, payloads: Sequence[Sequence[bytes]], weights: Sequence[float], numel: int,
                 settings: RobustSection, aggregator: Aggregator,
                 ) -> tuple[list[bytes], list[int], list[int], list[float]]:
    """Reduce a whole group's payloads in one place (the in-process transport; tests).

    Returns the reduced chunks (what every member decodes), per member the bytes it sent and received
    under the reduce-scatter + all-gather pattern, and per member the weight it entered the reduction
    with (0 where some reducer refused it; what screening clamped otherwise).
    """
    n = len(payloads)
    bounds = chunk_bounds(numel, codec.block_size)
    parts = part_ranges(len(bounds), n)
    reduced: list[bytes] = [b""] * len(bounds)
    sent = [0] * n
    received = [0] * n
    entered = list(map(float, weights))
    for j, part in enumerate(parts):
        if not part:
            continue
        sizes = {c: bounds[c][1] - bounds[c][0] for c in part}
        cons = [PartContribution(str(i), float(weights[i]), {c: payloads[i][c] for c in part}) for i in range(n)]
        screening = screen_part(codec, cons, sizes, settings)
        for c, data in combine_part(codec, cons, screening, sizes, aggregator).items():
            reduced[c] = data
        for i in range(n):
            if i not in screening.accepted:
                entered[i] = 0.0
            else:
                entered[i] = min(entered[i], screening.weights[screening.accepted.index(i)])
        for c in part:
            for i in range(n):
                if i != j:
                    sent[i] += len(payloads[i][c])        # reduce-scatter: i -> reducer j
                    received[j] += len(payloads[i][c])
                    sent[j] += len(reduced[c])            # all-gather: reducer j -> i
                    received[i] += len(reduced[c])
    return reduced, sent, received, entered
