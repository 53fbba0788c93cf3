"""The effect check: what a round's result would do to this node's model, measured before it is applied.

Screening bounds what one contribution can do (``locoswarm.node.core.robust``), but what a node finally
applies is an average of parts reduced by its group's members, and a hostile reducer decides what every
member receives for its part. So before the outer step of a round, the node compares two candidates of the
fragment on a held-out batch of its own choosing: the outer step on the group's average, and the outer
step on its own contribution alone (what one worker's DiLoCo would do). The group's average brings other
members' progress on other data and should not do worse; when its loss exceeds the own step's by more than
``[robust] effect_tolerance`` (relative), the result is refused like a failed round (the node keeps its
local progress), and each part whose own effect is that bad is blamed on its reducer.

This is the Gauntlet validator's measure (Templar, arXiv 2505.21684: a peer's update judged by the loss
before and after applying it) without a validator: every node judges what it is about to apply, at the
cost of two forward passes of ``[robust] judge_sequences`` sequences per merged round (the average's and
phi's; the own step's only where the average is harmful against phi: it can only lower the bar), about 1% of
the inner steps between two rounds of the tiny preset, and a forward pass per part only when it refuses.

The held-out batches rotate over a pool drawn from the node's evaluation split at other offsets than the
batches it reports its eval loss on; the candidates are written into the live parameters of the fragment
for the forward pass and the parameters restored afterwards.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch

from locoswarm.node.core.state import FragmentState


class EffectJudge(ABC):
    """Held-out losses of candidate values of one fragment (see the module docstring)."""

    @abstractmethod
    def joint_losses(self, states: Sequence[FragmentState],
                     candidates: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        """The held-out loss of the model with the fragments of ``states`` set together to each candidate (one
        flat fp32 tensor per state, in the fragment's layout), every other parameter as it is now; all on the
        same batch."""

    def losses(self, state: FragmentState, candidates: Sequence[torch.Tensor]) -> list[float]:
        """The held-out loss of the model with ``state``'s fragment set to each candidate."""
        return self.joint_losses([state], [[c] for c in candidates])

    def lazy_losses(self, state: FragmentState, candidates: Sequence[torch.Tensor]) -> Iterator[float]:
        """:meth:`losses` one candidate at a time, each measured only when the caller asks for it (all on one
        batch): a caller that can decide from the first few saves the forward passes of the rest. Close it (or
        exhaust it) when done."""
        yield from self.losses(state, candidates)

    def pooled_losses(self, states: Sequence[FragmentState],
                      candidates: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        """:meth:`joint_losses` on every held-out batch this judge has, each candidate's mean: for a rare,
        weighty decision (a catch-up replaces the whole fragment), where one small batch is too noisy."""
        return self.joint_losses(states, candidates)

    @property
    def last_batch(self) -> int:
        """Which held-out batch the last :meth:`losses` or :meth:`lazy_losses` measured on (a key: the caller keeps
        per-batch marks, ``OuterLoop._healthiest``); 0 for a judge of one batch."""
        return 0

    def health_slack(self) -> float:
        """How many tolerances above the lowest loss of a phi the node held a round may take it
        (``OuterLoop._healthiest``); 0: not judged."""
        return 0.0

    def tolerance(self, reference: float) -> float:
        """How much a candidate's loss may exceed ``reference`` before it is judged harmful."""
        return 0.0

    def knowing_nothing(self) -> float:
        """The loss of a model that knows nothing (uniform over the vocabulary): honest training, even set back by
        a bad round, was measured below it; infinite where the judge cannot tell."""
        return math.inf

    def harmful(self, loss: float, reference: float, slack: float = 1.0) -> bool:
        """Whether ``loss`` is worse than ``reference`` by more than ``slack`` times the tolerance (or not finite)."""
        return not math.isfinite(loss) or loss > reference + slack * self.tolerance(reference)


class LossJudge(EffectJudge):
    """The language-model loss on a rotating pool of held-out batches (``batches``: token id tensors of
    shape (sequences, seq_len)); ``relative_tolerance``: the share of the reference loss a candidate may
    exceed it by."""

    def __init__(self, model: torch.nn.Module, batches: Sequence[torch.Tensor], device: torch.device | str, *,
                 relative_tolerance: float, health_slack: float = 0.0) -> None:
        if not batches:
            raise ValueError("the effect check needs at least one held-out batch")
        self.model = model
        self.batches = list(batches)
        self.device = torch.device(device)
        self.relative_tolerance = float(relative_tolerance)
        self._health_slack = float(health_slack)
        self.calls = 0
        self.forwards = 0
        self._last_batch = 0

    @property
    def last_batch(self) -> int:
        return self._last_batch

    def health_slack(self) -> float:
        return self._health_slack

    def tolerance(self, reference: float) -> float:
        return self.relative_tolerance * abs(reference)

    def knowing_nothing(self) -> float:
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return math.log(vocab) if isinstance(vocab, int) and vocab > 1 else math.inf

    def joint_losses(self, states: Sequence[FragmentState],
                     candidates: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        return list(self._measure(states, candidates))

    def lazy_losses(self, state: FragmentState, candidates: Sequence[torch.Tensor]) -> Iterator[float]:
        return self._measure([state], [[c] for c in candidates])

    def pooled_losses(self, states: Sequence[FragmentState],
                      candidates: Sequence[Sequence[torch.Tensor]]) -> list[float]:
        batches = [b.to(self.device) for b in self.batches]
        return [sum(self._loss(b, states, c) for b in batches) / len(batches) for c in candidates]

    def _measure(self, states: Sequence[FragmentState],
                 candidates: Sequence[Sequence[torch.Tensor]]) -> Iterator[float]:
        """Each candidate's loss on the next batch of the pool, measured as it is asked for."""
        self._last_batch = self.calls % len(self.batches)
        batch = self.batches[self._last_batch].to(self.device)
        self.calls += 1
        for candidate in candidates:
            yield self._loss(batch, states, candidate)

    @torch.no_grad()
    def _loss(self, batch: torch.Tensor, states: Sequence[FragmentState], candidate: Sequence[torch.Tensor]) -> float:
        was_training = self.model.training
        self.model.eval()
        try:
            with contextlib.ExitStack() as swaps:
                for state, flat in zip(states, candidate, strict=True):
                    swaps.enter_context(state.swapped(flat))
                loss = float(self.model(input_ids=batch, labels=batch).loss)
            self.forwards += 1
            return loss
        finally:
            self.model.train(was_training)


__all__ = ["EffectJudge", "LossJudge"]
