"""The compressor seam of the outer loop: how a fragment's pseudo-gradient becomes the vector peers average.

The transports average flat vectors coded by a block codec (``locoswarm.node.core.codecs``), chunk by chunk, with a
robust weighted mean. A :class:`Compressor` turns a fragment's Delta (plus its error-feedback residual) into
such a vector and turns the group's mean of those vectors back into a dense average of Delta:

- :class:`BlockCompressor`: the vector is Delta itself, coded by ``[outer] codec`` (fp32, bf16, int8, fp4).
- :class:`locoswarm.node.core.lowrank.LowRankCompressor` (``codec = "lowrank"``): the vector holds low-rank
  coefficients of the fragment's matrices on a basis the group shares, so that the group's mean of the
  coefficients is the compression of the mean (DiLoCoX's adaptive low-rank compression).
- :class:`SparseLoCoCompressor` (``codec = "sparseloco"``): the vector is the chunk-wise top-k, 2-bit coded, of
  a decayed error-feedback accumulator (SparseLoCo, ``locoswarm.node.core.sparse``).

The outer loop chooses one once from the config (``outer_loop.make_compressor``) and asks it; it never tests the
codec's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from locoswarm.node.config import OuterSection
from locoswarm.node.core.codecs import Codec, get_codec
from locoswarm.node.core.payload import encode_with_feedback
from locoswarm.node.core.sparse import SparseCodec


@dataclass
class Encoded:
    """One member's contribution of one fragment, ready for the transport."""

    chunks: list[bytes]          # the wire vector coded by the compressor's block codec (locoswarm.node.core.payload)
    numel: int                   # elements of the wire vector
    own: torch.Tensor            # this member's contribution as the group counts it, dense (the fragment's numel)
    extras: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # side values summed over the group
    basis: bytes = b""           # the tag of the basis the vector was projected on (b"": none)
    ticket: object | None = None  # what :meth:`Compressor.finish` needs to read the group's result


class Compressor(ABC):
    """Encodes a fragment's pseudo-gradient into the vector the group averages, and reads the average back.

    Args:
        codec: the block codec of the wire vector (what the transport's reducers decode and re-encode).
    """

    # Whether the dense average ``finish`` returns is the wire average itself, so that a node that missed a round
    # can replay its step from the wire's bytes (``locoswarm.node.core.step_log``).
    replayable = False

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def n_extras(self, fragment: int) -> int:
        """Length of :attr:`Encoded.extras` for ``fragment``."""
        return 0

    @abstractmethod
    def encode(self, fragment: int, delta: torch.Tensor, residual: torch.Tensor | None, round_: int) -> Encoded:
        """Encode ``delta`` (+ ``residual``, updated in place to what this send drops)."""

    def reencode(self, ticket: object, tag: bytes) -> Encoded | None:
        """The same contribution on the basis ``tag`` names (a group whose members' bases differ); None when
        this compressor has no basis or cannot use that one."""
        return None

    @abstractmethod
    def finish(self, ticket: object, average: torch.Tensor, extras: torch.Tensor, basis: bytes,
               residual: torch.Tensor | None) -> torch.Tensor:
        """The dense group average of Delta from the group's mean wire vector ``average`` (and the summed
        ``extras``, the ``basis`` tag the group used); moves the compressor's shared state on. Raises
        ``ValueError`` when the result cannot be read (a basis or size this member did not send)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors a checkpoint keeps (keys start with the fragment index and '/')."""
        return {}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of :meth:`state_dict`'s tensors (all optional in a checkpoint)."""
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:  # noqa: B027 - stateless by default
        """Restore what :meth:`state_dict` returned (missing keys: start afresh)."""

    def status(self, fragment: int) -> dict:
        """Figures for status displays (e.g. the current ranks)."""
        return {}


class BlockCompressor(Compressor):
    """The block codecs: the wire vector is Delta itself (error feedback carries the quantization error)."""

    replayable = True

    def encode(self, fragment: int, delta: torch.Tensor, residual: torch.Tensor | None, round_: int) -> Encoded:
        chunks, own = encode_with_feedback(self.codec, delta, residual)
        return Encoded(chunks, delta.numel(), own)

    def finish(self, ticket: object, average: torch.Tensor, extras: torch.Tensor, basis: bytes,
               residual: torch.Tensor | None) -> torch.Tensor:
        return average


class SparseLoCoCompressor(BlockCompressor):
    """SparseLoCo (Sarfi, Therien, Lidin, Belilovsky 2025, arXiv 2508.15706): the error-feedback residual is the
    accumulator ``e``; a sync decays it, ``e <- beta * e + Delta``, sends the :class:`SparseCodec` coding of
    ``e`` (its chunk-wise top-k, 2-bit) and keeps ``e - sent``. The decay is what stands in for the outer
    momentum (run it with ``[outer] momentum = 0``). Not replayable: the step-log replay rebuilds a codec by
    name and block size, which cannot say the top-k."""

    replayable = False

    def __init__(self, codec: SparseCodec, beta: float) -> None:
        super().__init__(codec)
        self.beta = beta

    def encode(self, fragment: int, delta: torch.Tensor, residual: torch.Tensor | None, round_: int) -> Encoded:
        if residual is None:  # config validation requires error_feedback: without it there is no accumulator
            raise ValueError("sparseloco needs the error-feedback accumulator ([outer] error_feedback = true)")
        residual.mul_(self.beta)
        chunks, own = encode_with_feedback(self.codec, delta, residual)
        return Encoded(chunks, delta.numel(), own)


def wire_codec(outer: OuterSection) -> Codec:
    """The block codec of the vectors a swarm's reducers average under these settings."""
    if outer.codec == "sparseloco":
        return SparseCodec(outer.sparse_chunk, outer.sparse_topk, outer.sparse_value_bits)
    inner = outer.lowrank_codec if outer.codec == "lowrank" else outer.codec
    return get_codec(inner, outer.block_size)
