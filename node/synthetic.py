"""Synthetic compute, for benchmarks only (``locoswarm run --synthetic-step SECONDS``; never the default).

An inner step does no forward or backward pass: it applies a cheap, deterministic update to every trainable
parameter and then sleeps out the rest of ``SECONDS``, so a machine can hold many more nodes than it has cores
while the model, its fragments, the pseudo-gradients, the codecs, the error feedback, the robust screening, the
memory, the rounds and the bytes on the wire stay those of the real model size. What is not real: the loss (there
is none; a node reports no training loss and takes no periodic evaluation) and the direction of the update.

The update of parameter tensor ``p`` at inner step ``t`` is ``p -= lr(t) * u`` with ``lr(t)`` the inner optimizer's
lr (its warmup included) and ``u`` of unit RMS per tensor, the size of an AdamW step at that lr::

    u = sqrt(1/2) * (cos(a t_s) C1 + sin(a t_s) C2) + sqrt(1/2) * (w1(t) B1 + w2(t) B2),  w1^2 + w2^2 = 1

- ``C1``, ``C2``: a direction common to every node of the swarm, drawn once from the swarm's seed (its
  fingerprint), so that the nodes' pseudo-gradients agree as honest ones do and their average is meaningful. It
  turns slowly (a full turn every ``TURN_STEPS`` steps) so that the parameters do not drift without bound along
  one direction over a long run, yet stays nearly constant over one outer round's H steps. It turns with the swarm
  clock ``t_s``, not the node's own step count: a node that joined late or steps slowly then points the same way
  as the others (by its own count, a joiner 1,000 steps behind would point against them).
- ``B1``, ``B2``, ``w(t)``: this node's own part, drawn once from the node's seed (its data seed: ``--seed``, else
  from its peer id); the weights ``w(t)`` from the seed and the step.

The four bases of a tensor are drawn once and made orthonormal (Gram-Schmidt, scaled to unit RMS), so ``u`` has
unit RMS exactly: an inner step costs four fused in-place adds over the model and no random draws (measured on
the ``small`` preset in the commit that added this module). The bases cost four float32 copies of the trainable
parameters; a synthetic node holds no gradients and no AdamW moments, which a training node does (three copies).

Tokens count as if a batch was trained, so token weights and claims are those of a real node.
"""

from __future__ import annotations

import math
import random
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from locoswarm.node.inner import InnerOptimizer

TURN_STEPS = 2000      # inner steps per full turn of the common direction
COMMON_SHARE = 0.5     # share of the update's variance along the common direction (the rest is the node's own)
BASES = 4              # C1, C2, B1, B2 per tensor


def swarm_seed(fingerprint: str) -> int:
    """The common direction's seed: the same on every node of a swarm (its fingerprint)."""
    return zlib.crc32(f"synthetic-common:{fingerprint}".encode())


def _orthonormal_bases(shape: torch.Size, common: torch.Generator, own: torch.Generator) -> list[torch.Tensor]:
    """Two common and two own random tensors of ``shape``, orthogonal to each other and of unit RMS (a tensor of
    fewer than four elements cannot hold four orthogonal ones: it gets them independent, each of unit RMS)."""
    drawn = [torch.randn(shape, generator=common), torch.randn(shape, generator=common),
             torch.randn(shape, generator=own), torch.randn(shape, generator=own)]
    n = drawn[0].numel()
    out: list[torch.Tensor] = []
    for v in drawn:
        if n >= BASES:
            for b in out:
                v -= (v * b).sum() / (b * b).sum() * b
        rms = v.pow(2).mean().sqrt()
        out.append(v / rms if rms > 0 else torch.ones_like(v))
    return out


class SyntheticCompute:
    """The inner step of a node under ``--synthetic-step``: the update of the module docstring, then a sleep to
    ``seconds`` of wall time from the step's start. Chosen once when the node builds (``Node._load``); its
    :meth:`step` takes the place of ``InnerOptimizer.step`` and returns no loss.

    Args:
        inner: the node's inner optimizer (``locoswarm.node.inner.InnerOptimizer``): its parameters, in its order,
            its lr schedule (``lr_at``) and its step counter (``steps_done``, which checkpoints keep), advanced here.
        seconds: wall time of one inner step.
        common_seed: the swarm's seed (:func:`swarm_seed`); node_seed: this node's.
        clock: the swarm clock now (the common direction turns with it); None: this node's step count.
        stop: an event that cuts a sleep short (a node that leaves does not wait out its step).
        sleep: how to wait (tests pass a fake clock).
    """

    def __init__(self, inner: InnerOptimizer, seconds: float, *, common_seed: int, node_seed: int,
                 clock: Callable[[], int] | None = None, stop: threading.Event | None = None,
                 sleep: Callable[[float], object] | None = None) -> None:
        self.inner = inner
        self.clock = clock
        self.params = [p for p in inner.params() if p.requires_grad]
        self.seconds = float(seconds)
        self.node_seed = int(node_seed)
        self.stop = stop
        self._sleep = sleep or (stop.wait if stop is not None else time.sleep)
        common = torch.Generator().manual_seed(int(common_seed))
        own = torch.Generator().manual_seed(self.node_seed)
        per_param = []
        with torch.no_grad():
            for p in self.params:
                per_param.append([b.to(p.device, p.dtype) for b in _orthonormal_bases(p.shape, common, own)])
        # per basis, one list over the parameters: one fused add per basis and step
        self.bases = [[bases[k] for bases in per_param] for k in range(BASES)]

    def coefficients(self, step: int, clock: int | None = None) -> tuple[float, float, float, float]:
        """The weights of C1, C2, B1, B2 at this node's ``step`` and the swarm's ``clock`` (default: ``step``);
        their squares sum to 1: the update has unit RMS."""
        angle = 2 * math.pi * (step if clock is None else clock) / TURN_STEPS
        c = math.sqrt(COMMON_SHARE)
        rng = random.Random(self.node_seed * 1_000_003 + step)  # the node's own weights at this step
        w1, w2 = rng.gauss(0.0, 1.0), rng.gauss(0.0, 1.0)
        norm = math.hypot(w1, w2) or 1.0
        o = math.sqrt(1 - COMMON_SHARE)
        return c * math.cos(angle), c * math.sin(angle), o * w1 / norm, o * w2 / norm

    def update(self, step: int) -> float:
        """Apply step ``step``'s update in place (at the swarm clock now); returns the lr it used."""
        lr = self.inner.lr_at(step)
        clock = self.clock() if self.clock is not None else None
        with torch.no_grad():
            for coef, basis in zip(self.coefficients(step, clock), self.bases, strict=True):
                if coef:
                    torch._foreach_add_(self.params, basis, alpha=-lr * coef)
        return lr

    def step(self, batches: Sequence[torch.Tensor] = ()) -> None:
        """One inner step in place of ``InnerOptimizer.step`` (``batches`` are not looked at: their tokens count
        all the same): the update at the inner optimizer's step, then sleep until ``seconds`` have passed since
        the step began."""
        t0 = time.monotonic()
        self.update(self.inner.steps_done)
        self.inner.steps_done += 1
        left = self.seconds - (time.monotonic() - t0)
        if left > 0:
            self._sleep(left)

    def describe(self) -> str:
        """The line a node logs at start, and what its status says."""
        return (f"synthetic compute: {self.seconds:.2f} s/step (benchmarks only: no forward/backward pass, no "
                f"training loss, no periodic evaluation; a deterministic update of the real "
                f"{sum(p.numel() for p in self.params):,} parameters)")
