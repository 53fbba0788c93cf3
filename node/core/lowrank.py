"""DiLoCoX's adaptive low-rank compression of pseudo-gradients (Qi et al. 2025), on PowerSGD's warm-started
power iteration (Vogels et al. 2019) with one exchange per round.

For every matrix ``M`` (m x n with m >= n: a matrix with fewer rows is taken transposed, see
:class:`MatrixSlot`; Delta plus the error-feedback residual) of a fragment the group shares a basis ``Q``
(n x r, orthonormal columns). A member sends, coded by a block codec (int8 by default):

- ``P = M Q`` (m x r): the coefficients of ``M`` on the basis; the group's mean ``P̄`` decodes to the dense
  update ``P̄ Q^T``, which is exactly the projection of the group's mean of ``M`` (the compression is linear
  in ``M`` for a fixed basis, so the reducers' chunked robust mean needs no change);
- ``Y = M^T M Q / |M|`` (n x r): one power-iteration step on the member's ``M``; ``Ȳ`` (the group's mean)
  gives the next basis ``Q' = orth(Ȳ)`` on every member that received the same result: a warm-started
  subspace iteration over rounds. ``Y`` is divided by ``|M|`` so its magnitude grows like ``P``'s, not
  like ``|M|^2`` (screening and clipping compare members' norms);
- every other tensor (1-D, or a matrix too small for rank ``lowrank_max_rank`` to save elements) as it is.

Each segment starts on a codec block, so no scale block mixes ``P``, ``Y`` and raw values. Error feedback
keeps ``(M + e) - P̂ Q^T`` (``P̂``: the member's own coefficients as the codec delivers them): what the basis
and the quantization drop is sent later.

Everything a member needs to take the next basis and rank comes from the round's shared result (the mean
wire vector and the summed extras), and is computed from it in float64 on the CPU with numpy, so the whole
group moves on together (numpy's LAPACK runs these small matrices on one thread: the result cannot depend
on a node's thread count, and torch's threaded QR ran 250x slower on a loaded 2-core machine). The ranks
and a hash of the basis travel with every request (``AverageRequest.basis``), and a group whose members'
tags differ falls back to the seeded basis of that round at the leader's ranks
(:meth:`LowRankCompressor.reencode`), after which its members share the next basis. That costs one round's
warm start where membership changes (a joiner, a node that missed a round); under pairwise gossip, where
groups change every round, most rounds take the seeded basis: a random projection, still unbiased over time
through error feedback, but without the power iteration's warm start.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from locoswarm.node.core.codecs import Codec
from locoswarm.node.core.compress import Compressor, Encoded
from locoswarm.node.core.payload import decode_chunks, encode_chunks, payload_size

#: The rank doubles when the group's basis captured less than this share of its members' energy.
GROW_BELOW = 0.5
#: The rank halves when the top half of the basis alone would have captured at least this share of it.
SHRINK_ABOVE = 0.9
#: Share of the old basis mixed into the power-iteration proposal: keeps the next basis full rank (a
#: matrix whose update is zero keeps its basis) without moving a proposal that has data.
RIDGE = 1e-3
_DIGEST_BYTES = 8
_SEED_SALT = "locoswarm-lowrank-v1"
_TINY = 1e-30


# --------------------------------------------------------------------------------------------------
# Bases: seeded, orthonormalized, advanced by the power iteration
# --------------------------------------------------------------------------------------------------


def _seed(*key: object) -> int:
    text = ":".join(map(str, (_SEED_SALT, *key)))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") & (2**63 - 1)


def orthonormal(a: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``a``'s (float64 QR), signs fixed so that ``R``'s diagonal is >= 0: QR of a
    full-rank matrix is unique up to those signs, so equal inputs give equal bases on every member."""
    q, r = np.linalg.qr(a.detach().to("cpu", torch.float64).numpy())
    return torch.from_numpy(q * np.where(np.diagonal(r) < 0, -1.0, 1.0))


def seeded_basis(n: int, rank: int, *key: object) -> torch.Tensor:
    """An orthonormal n x rank fp32 basis from a Gaussian seeded by ``key``: the same on every peer."""
    gen = torch.Generator().manual_seed(_seed(n, rank, *key))
    return orthonormal(torch.randn(n, rank, generator=gen, dtype=torch.float64)).to(torch.float32)


def next_basis(y_mean: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``orth(Ȳ)`` (float64, n x r): the power-iteration step from the group's proposal, its columns ordered
    by their norm in ``Ȳ`` (the most energetic direction first, so a shrink keeps the leading columns)."""
    y = y_mean.to(torch.float64)
    norm = float(torch.linalg.matrix_norm(y))
    weight = RIDGE * norm / math.sqrt(y.shape[1]) if norm > 0 else 1.0
    mix = y + weight * basis.to(torch.float64)
    order = torch.argsort(torch.linalg.vector_norm(mix, dim=0), descending=True, stable=True)
    return orthonormal(mix[:, order])


def resized(basis: torch.Tensor, rank: int, *key: object) -> torch.Tensor:
    """``basis`` (n x r) at ``rank`` columns: its leading ones, or all of them and seeded new ones
    (orthonormalized after them, so the existing columns stay as they are)."""
    have = basis.shape[1]
    if rank <= have:
        return basis[:, :rank]
    extra = seeded_basis(basis.shape[0], rank - have, *key, "grow", rank).to(torch.float64)
    return orthonormal(torch.cat([basis.to(torch.float64), extra], dim=1))


# --------------------------------------------------------------------------------------------------
# Layout of a fragment's wire vector
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatrixSlot:
    """A matrix of the fragment: flat ``[start, start + rows * cols)``, compressed as its ``long x short``
    view ``M`` (transposed when it has fewer rows than columns): the basis lies on the short side, the model's
    width in a transformer's MLP and embedding matrices, where pseudo-gradients' subspaces moved far less
    from one round to the next than on the long side (measured on the tiny model, 30-step rounds: the previous
    round's top 32 directions held 0.83 of a down projection's energy on its short side, 0.50 on its long one;
    0.9 and 0.25 for the up and gate projections). Square matrices keep their columns (the input side)."""

    start: int
    rows: int
    cols: int

    @property
    def end(self) -> int:
        return self.start + self.rows * self.cols

    @property
    def transposed(self) -> bool:
        return self.rows < self.cols

    @property
    def long(self) -> int:
        return max(self.rows, self.cols)

    @property
    def short(self) -> int:
        return min(self.rows, self.cols)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This matrix of a flat fragment as its ``long x short`` view (no copy)."""
        m = flat[self.start:self.end].view(self.rows, self.cols)
        return m.T if self.transposed else m

    def put(self, out: torch.Tensor | np.ndarray, dense: torch.Tensor | np.ndarray) -> None:
        """Write a ``long x short`` matrix into its place in the flat fragment ``out``."""
        out[self.start:self.end] = (dense.T if self.transposed else dense).reshape(-1)


@dataclass(frozen=True)
class Segments:
    """Where each matrix's ``P`` and ``Y`` and the raw tensors start in the wire vector, at given ranks."""

    p: tuple[int, ...]
    y: tuple[int, ...]
    raw: int
    numel: int


class LowRankLayout:
    """Which tensors of a fragment go low-rank, and where each factor sits in the wire vector.

    A 2-D tensor (m x n) goes low-rank when its factors at ``max_rank`` have fewer elements than it:
    ``max_rank * (m + n) < m * n``; every other tensor goes raw. The wire vector is all ``P`` (long x r
    each, see :class:`MatrixSlot`), then all ``Y`` (short x r each), then the raw tensors, each factor
    starting on a codec block.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], max_rank: int, block_size: int) -> None:
        matrices, raw, start = [], [], 0
        for shape in shapes:
            size = math.prod(shape)
            if len(shape) == 2 and max_rank * (shape[0] + shape[1]) < size:
                matrices.append(MatrixSlot(start, shape[0], shape[1]))
            else:
                raw.append((start, start + size))
            start += size
        self.numel = start
        self.matrices: tuple[MatrixSlot, ...] = tuple(matrices)
        self.raw: tuple[tuple[int, int], ...] = tuple(raw)
        self.raw_numel = sum(b - a for a, b in raw)
        self.block_size = block_size

    def _aligned(self, n: int) -> int:
        return -(-n // self.block_size) * self.block_size

    def segments(self, ranks: Sequence[int]) -> Segments:
        if len(ranks) != len(self.matrices):
            raise ValueError(f"{len(ranks)} ranks for {len(self.matrices)} matrices")
        offset, p, y = 0, [], []
        for slot, r in zip(self.matrices, ranks, strict=True):
            p.append(offset)
            offset += self._aligned(slot.long * r)
        for slot, r in zip(self.matrices, ranks, strict=True):
            y.append(offset)
            offset += self._aligned(slot.short * r)
        return Segments(tuple(p), tuple(y), offset, offset + self.raw_numel)

    def wire_numel(self, ranks: Sequence[int]) -> int:
        return self.segments(ranks).numel

    def wire_bytes(self, ranks: Sequence[int], codec: Codec) -> int:
        """Exact payload bytes of one contribution at ``ranks`` (the chunks ``encode`` produces)."""
        return payload_size(codec, self.wire_numel(ranks))


def lowrank_bits_per_element(shapes: Sequence[tuple[int, ...]], rank: int, max_rank: int, codec: Codec) -> float:
    """Wire bits per parameter of tensors of ``shapes`` sent as one fragment at ``rank`` (for the planner)."""
    layout = LowRankLayout(shapes, max_rank, codec.block_size)
    return 8.0 * layout.wire_bytes([min(rank, max_rank)] * len(layout.matrices), codec) / max(1, layout.numel)


def _place_raw(layout: LowRankLayout, seg: Segments, wire: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the raw tensors' values from the wire vector to their places in the dense fragment."""
    offset = seg.raw
    for a, b in layout.raw:
        out[a:b] = wire[offset:offset + b - a]
        offset += b - a


# --------------------------------------------------------------------------------------------------
# The rank rule
# --------------------------------------------------------------------------------------------------


class AdaptiveRank:
    """DiLoCoX's rank adaptation (Qi et al. 2025: the rank follows the pseudo-gradients' effective rank),
    per matrix, from what every member of a group holds after a round, so the whole group takes the same
    next rank:

    - captured share ``c = sum_i |P_i|^2 / sum_i |M_i|^2``, summed over the group's accepted members (the
      round's extras): how much of the members' energy the basis holds;
    - top-half share ``s = sum_{k < r/2} sigma_k^2 / sum_k sigma_k^2``, ``sigma`` the singular values of
      the group's mean coefficients ``P̄`` (the spectrum of the group's update on the basis).

    Rule: ``c < GROW_BELOW`` (0.5): the basis misses most of the energy, double the rank (up to
    ``max_rank``); else ``c * s >= SHRINK_ABOVE`` (0.9): the top half of the basis alone would have held 90%
    of the members' energy, halve the rank (down to ``min_rank``); else keep it. Halving needs ``c`` as well
    as ``s`` (``s`` alone halved a basis that held half the energy, which then grew back, round after round:
    seen on the tiny model's pseudo-gradients), and the gap between the thresholds keeps a halved rank from
    growing back at once (its ``c`` is about the ``c * s >= 0.9`` it was halved at). On a matrix of rank k
    with comparable singular values the rank settles in [k, 2k) (for k < 10: halving needs 90% in half);
    on a full-rank one it grows to ``max_rank``.
    """

    def __init__(self, min_rank: int, max_rank: int) -> None:
        if not 1 <= min_rank <= max_rank:
            raise ValueError(f"ranks must satisfy 1 <= min_rank <= max_rank, got {min_rank} and {max_rank}")
        self.min_rank = min_rank
        self.max_rank = max_rank

    @staticmethod
    def captured_share(captured: float, energy: float) -> float:
        """``c`` (1.0 when there was no energy at all: nothing to grow for)."""
        return captured / energy if energy > 0 else 1.0

    @staticmethod
    def top_half_share(p_mean: torch.Tensor) -> float:
        """``s`` of the m x r coefficients ``P̄`` (0.0 for r < 2 or a zero ``P̄``: nothing to shrink)."""
        r = p_mean.shape[1]
        if r < 2:
            return 0.0
        energy = np.linalg.svd(p_mean.detach().to("cpu", torch.float64).numpy(), compute_uv=False) ** 2
        total = float(energy.sum())
        return float(energy[: r // 2].sum()) / total if total > 0 else 0.0

    def next_rank(self, rank: int, captured_share: float, top_half_share: float) -> int:
        if captured_share < GROW_BELOW:
            return min(2 * rank, self.max_rank)
        if captured_share * top_half_share >= SHRINK_ABOVE:
            return max(rank // 2, self.min_rank)
        return rank


# --------------------------------------------------------------------------------------------------
# The compressor
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Basis:
    """One fragment's bases (fp32 CPU, n x r each) at their ranks, and their tag."""

    ranks: tuple[int, ...]
    bases: tuple[torch.Tensor, ...]
    tag: bytes

    @classmethod
    def of(cls, ranks: Sequence[int], bases: Sequence[torch.Tensor]) -> _Basis:
        """The tag: the ranks (little-endian u16) then a hash of them and of the bases' fp32 bytes."""
        bases = tuple(b.to(torch.float32).contiguous() for b in bases)
        head = struct.pack(f"<{len(ranks)}H", *ranks)
        h = hashlib.blake2b(head, digest_size=_DIGEST_BYTES)
        for b in bases:
            h.update(b.numpy().tobytes())
        return cls(tuple(ranks), bases, head + h.digest())


@dataclass
class _Ticket:
    """What a send leaves for reading its round's result: the basis it used, what it projected, and a
    fallback encoding when the group re-encoded on a seeded basis."""

    fragment: int
    round: int
    target: torch.Tensor
    basis: _Basis
    fallback: _Basis | None = None
    fallback_own: torch.Tensor | None = None


class LowRankCompressor(Compressor):
    """Per fragment, the group's shared bases and ranks, and the low-rank wire vector on them (see the
    module docstring; the rank rule is :class:`AdaptiveRank`).

    Args:
        fragments: (index, shapes of its tensors in flat order) per fragment.
        codec: the block codec of the wire vector.
        rank: the rank every matrix starts at; ``min_rank`` / ``max_rank`` bound the adaptation.
    """

    def __init__(self, fragments: Sequence[tuple[int, Sequence[tuple[int, ...]]]], codec: Codec, *,
                 rank: int, min_rank: int, max_rank: int) -> None:
        super().__init__(codec)
        if not min_rank <= rank <= max_rank:
            raise ValueError(f"rank {rank} is not within [{min_rank}, {max_rank}]")
        self.rule = AdaptiveRank(min_rank, max_rank)
        self.layouts = {index: LowRankLayout(shapes, max_rank, codec.block_size) for index, shapes in fragments}
        self._initial_rank = rank
        self._state = {index: self._seeded(index, [rank] * len(layout.matrices), "init")
                       for index, layout in self.layouts.items()}

    # ---- the seam ---------------------------------------------------------------------------------
    def n_extras(self, fragment: int) -> int:
        return 2 * len(self.layouts[fragment].matrices)

    def ranks(self, fragment: int) -> tuple[int, ...]:
        return self._state[fragment].ranks

    def tag(self, fragment: int) -> bytes:
        return self._state[fragment].tag

    def bases(self, fragment: int) -> tuple[torch.Tensor, ...]:
        """The current bases (n x r fp32 each, one per low-rank matrix); do not modify them."""
        return self._state[fragment].bases

    def encode(self, fragment: int, delta: torch.Tensor, residual: torch.Tensor | None, round_: int) -> Encoded:
        target = delta.reshape(-1).to(torch.float32).clone()
        if residual is not None:
            target += residual.reshape(-1)
        basis = self._state[fragment]
        enc = self._project(fragment, target, basis)
        if residual is not None:
            residual.copy_((target - enc.own).view(residual.shape))
        enc.ticket = _Ticket(fragment, round_, target, basis)
        return enc

    def reencode(self, ticket: object, tag: bytes) -> Encoded | None:
        if not isinstance(ticket, _Ticket):
            return None
        ranks = self._parse_ranks(ticket.fragment, tag)
        if ranks is None:
            return None
        fallback = self._seeded(ticket.fragment, ranks, ticket.round)
        enc = self._project(ticket.fragment, ticket.target, fallback)
        ticket.fallback, ticket.fallback_own = fallback, enc.own
        enc.ticket = ticket
        return enc

    def finish(self, ticket: object, average: torch.Tensor, extras: torch.Tensor, basis: bytes,
               residual: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(ticket, _Ticket):
            raise ValueError("no low-rank send to read this result with")
        if basis == ticket.basis.tag:
            used = ticket.basis
        elif ticket.fallback is not None and basis == ticket.fallback.tag:
            used = ticket.fallback
        else:
            raise ValueError("the group's result is on a basis this node did not send on")
        layout = self.layouts[ticket.fragment]
        seg = layout.segments(used.ranks)
        if average.numel() != seg.numel or extras.numel() != 2 * len(layout.matrices):
            raise ValueError(f"low-rank result of {average.numel()} values and {extras.numel()} extras; "
                             f"{seg.numel} and {2 * len(layout.matrices)} expected")
        wire = average.detach().reshape(-1).to("cpu", torch.float64)
        if not bool(torch.isfinite(wire).all()):
            raise ValueError("low-rank result is not finite")
        if used is ticket.fallback and residual is not None and ticket.fallback_own is not None:
            residual.copy_((ticket.target - ticket.fallback_own).view(residual.shape))
        dense = self._expand_exact(layout, seg, used, wire)
        self._state[ticket.fragment] = self._advance(ticket.fragment, layout, seg, used, wire, extras)
        return dense

    def status(self, fragment: int) -> dict:
        return {"ranks": list(self._state[fragment].ranks)}

    # ---- encoding and decoding -------------------------------------------------------------------
    def _project(self, fragment: int, target: torch.Tensor, basis: _Basis) -> Encoded:
        """``target``'s wire vector on ``basis``, its chunks, the extras and the dense value they decode to."""
        layout = self.layouts[fragment]
        seg = layout.segments(basis.ranks)
        wire = torch.zeros(seg.numel, dtype=torch.float32, device=target.device)
        extras = torch.zeros(2 * len(layout.matrices), dtype=torch.float32)
        k = len(layout.matrices)
        for j, (slot, q) in enumerate(zip(layout.matrices, basis.bases, strict=True)):
            m = slot.view(target)
            q = q.to(target.device)
            p = m @ q
            energy = float(torch.linalg.matrix_norm(m)) ** 2
            extras[j], extras[k + j] = energy, float(torch.linalg.matrix_norm(p)) ** 2
            y = (m.T @ p) / max(math.sqrt(energy), _TINY)
            wire[seg.p[j]:seg.p[j] + p.numel()] = p.reshape(-1)
            wire[seg.y[j]:seg.y[j] + y.numel()] = y.reshape(-1)
        if layout.raw:
            wire[seg.raw:] = torch.cat([target[a:b] for a, b in layout.raw])
        chunks = encode_chunks(self.codec, wire)
        own = self._expand(layout, seg, basis, decode_chunks(self.codec, chunks, seg.numel).to(target.device))
        return Encoded(chunks, seg.numel, own, extras, basis.tag)

    @staticmethod
    def _expand(layout: LowRankLayout, seg: Segments, basis: _Basis, wire: torch.Tensor) -> torch.Tensor:
        """The dense fragment a member's own wire vector stands for (fp32, on its device): ``P Q^T`` per
        matrix, the raw tensors as they are."""
        out = torch.zeros(layout.numel, dtype=wire.dtype, device=wire.device)
        for j, (slot, q) in enumerate(zip(layout.matrices, basis.bases, strict=True)):
            p = wire[seg.p[j]:seg.p[j] + slot.long * basis.ranks[j]].view(slot.long, basis.ranks[j])
            slot.put(out, p @ q.to(wire.device).T)
        _place_raw(layout, seg, wire, out)
        return out

    @staticmethod
    def _expand_exact(layout: LowRankLayout, seg: Segments, basis: _Basis, wire: torch.Tensor) -> torch.Tensor:
        """Like :meth:`_expand` for the group's result (a float64 CPU wire vector): the products in float64
        with numpy, then rounded to fp32, so every member holds the same bits."""
        values = wire.numpy()
        out = np.zeros(layout.numel, dtype=np.float64)
        for j, (slot, q) in enumerate(zip(layout.matrices, basis.bases, strict=True)):
            p = values[seg.p[j]:seg.p[j] + slot.long * basis.ranks[j]].reshape(slot.long, basis.ranks[j])
            slot.put(out, p @ q.numpy().astype(np.float64).T)
        dense = torch.from_numpy(out.astype(np.float32))
        _place_raw(layout, seg, wire.to(torch.float32), dense)
        return dense

    def _advance(self, fragment: int, layout: LowRankLayout, seg: Segments, used: _Basis, wire: torch.Tensor,
                 extras: torch.Tensor) -> _Basis:
        """The next bases and ranks, from the round's shared result only."""
        k = len(layout.matrices)
        sums = extras.to(torch.float64)
        ranks, bases = [], []
        for j, slot in enumerate(layout.matrices):
            r = used.ranks[j]
            p_mean = wire[seg.p[j]:seg.p[j] + slot.long * r].view(slot.long, r)
            y_mean = wire[seg.y[j]:seg.y[j] + slot.short * r].view(slot.short, r)
            rank = self.rule.next_rank(r, self.rule.captured_share(float(sums[k + j]), float(sums[j])),
                                       self.rule.top_half_share(p_mean))
            ranks.append(rank)
            bases.append(resized(next_basis(y_mean, used.bases[j]), rank, fragment, j).to(torch.float32))
        return _Basis.of(ranks, bases)

    # ---- bases from seeds and tags --------------------------------------------------------------
    def _seeded(self, fragment: int, ranks: Sequence[int], round_: object) -> _Basis:
        layout = self.layouts[fragment]
        return _Basis.of(ranks, [seeded_basis(slot.short, r, fragment, j, round_)
                                 for j, (slot, r) in enumerate(zip(layout.matrices, ranks, strict=True))])

    def _parse_ranks(self, fragment: int, tag: bytes) -> list[int] | None:
        """The ranks a tag names, if they are valid for this fragment (a peer's tag is not trusted)."""
        k = len(self.layouts[fragment].matrices)
        if len(tag) != 2 * k + _DIGEST_BYTES:
            return None
        ranks = list(struct.unpack(f"<{k}H", tag[: 2 * k]))
        if not all(self.rule.min_rank <= r <= self.rule.max_rank for r in ranks):
            return None
        return ranks

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for index, layout in self.layouts.items():
            if layout.matrices:
                out[f"{index}/lowrank_ranks"] = (len(layout.matrices),)
            for j, slot in enumerate(layout.matrices):
                out[f"{index}/lowrank_basis/{j}"] = (slot.short, self.rule.max_rank)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per fragment its ranks (int32) and each basis zero-padded to ``max_rank`` columns (fixed shapes)."""
        out: dict[str, torch.Tensor] = {}
        for index, state in self._state.items():
            if not state.ranks:
                continue
            out[f"{index}/lowrank_ranks"] = torch.tensor(state.ranks, dtype=torch.int32)
            for j, q in enumerate(state.bases):
                padded = torch.zeros(q.shape[0], self.rule.max_rank, dtype=torch.float32)
                padded[:, : q.shape[1]] = q
                out[f"{index}/lowrank_basis/{j}"] = padded
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the bases and ranks of every fragment whose tensors are there and valid; the others start
        from the seeded basis at the initial rank (a node that switched to this codec)."""
        for index, layout in self.layouts.items():
            k = len(layout.matrices)
            self._state[index] = self._seeded(index, [self._initial_rank] * k, "init")
            ranks = tensors.get(f"{index}/lowrank_ranks")
            if ranks is None or ranks.numel() != k:
                continue
            ranks_list = [int(r) for r in ranks.reshape(-1).tolist()]
            padded = [tensors.get(f"{index}/lowrank_basis/{j}") for j in range(k)]
            if not all(self.rule.min_rank <= r <= self.rule.max_rank for r in ranks_list) or any(
                    p is None or tuple(p.shape) != (slot.short, self.rule.max_rank)
                    for p, slot in zip(padded, layout.matrices, strict=True)):
                continue
            self._state[index] = _Basis.of(ranks_list, [p[:, :r].to(torch.float32).clone()
                                                        for p, r in zip(padded, ranks_list, strict=True)])
