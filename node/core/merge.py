"""Merge rules: how a fragment's sync result enters the live parameters theta.

All functions are pure and work on flat fp32 tensors of one fragment, *after* the outer step moved
``phi`` (except ``eager_outer_gradient``, which builds the outer step's input). ``snapshot`` is theta
at send time, so ``snapshot - theta`` is the local progress made while the sync was in flight.

- ``replace``     theta <- phi. DiLoCo / Streaming DiLoCo without overlap (tau = 0).
- ``alpha``       theta <- alpha * theta + (1 - alpha) * phi. Streaming DiLoCo's overlap mix
                  (Douillard et al., 2025; alpha = 0.5 in the paper).
- ``rebase``      theta <- phi - (snapshot - theta). DiLoCoX's one-step-delay overlap (Qi et al.,
                  2025): keep the local progress made since the send on top of the new outer point.
- ``compensate``  theta <- phi - g_hat, g = snapshot - theta, D = phi - snapshot,
                  g_hat_i = g_i + lambda_i * g_i * g_i * D_i with lambda_i = lambda0 * |g_i| /
                  (|g_i * g_i * D_i| + eps) per tensor i. CoCoDC's first-order Taylor delay
                  compensation (DC-ASGD with diag(g * g) as the Hessian), correction norm lambda0*|g|.
- ``eager``       the outer step takes g = late_avg - share_prev * own_prev + share_now * own_now,
                  then theta <- phi. Eager updates (Kale et al., 2025): the node's own contribution
                  is applied at once, everyone else's one round late (share_prev: its share in the
                  group that averaged round t-1; see ``eager_outer_gradient``).
- ``delay``       the outer step takes g = late_avg (the group average of the previous round), then
                  theta <- phi: the *naive* one-outer-step delay, the baseline of the Eager paper (its
                  own progress reaches phi only through the group's average, one round late). Unlike
                  ``rebase``, the local progress made while the sync ran is not kept in theta.

Each method is one class (:class:`MergeRule`), chosen once from ``[outer] method`` by
:func:`make_merge_rule`; the outer loop asks it, never the method's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

EPS = 1e-12


def merge_replace(theta: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    return phi.clone()


def merge_alpha(theta: torch.Tensor, phi: torch.Tensor, alpha: float) -> torch.Tensor:
    return theta * alpha + phi * (1.0 - alpha)


def merge_rebase(theta: torch.Tensor, phi: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    return phi - (snapshot - theta)


def compensated_progress(g: torch.Tensor, shift: torch.Tensor, lambda0: float,
                         bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """g_hat = g + lambda * g*g*D per tensor, with lambda scaled so ||correction_i|| = lambda0*||g_i||."""
    out = g.clone()
    if lambda0 == 0:
        return out
    for a, b in bounds:
        gi, di = g[a:b], shift[a:b]
        corr = gi * gi * di
        corr_norm = torch.linalg.vector_norm(corr)
        lam = lambda0 * torch.linalg.vector_norm(gi) / (corr_norm + EPS)
        out[a:b] += lam * corr
    return out


def merge_compensate(theta: torch.Tensor, phi: torch.Tensor, snapshot: torch.Tensor, lambda0: float,
                     bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    g = snapshot - theta
    return phi - compensated_progress(g, phi - snapshot, lambda0, bounds)


def eager_outer_gradient(late_average: torch.Tensor | None, own_prev: torch.Tensor | None,
                         share_in_group: float, share_applied: float, own_now: torch.Tensor,
                         share_now: float) -> torch.Tensor:
    """The eager outer gradient of round t, three parts:

    - everyone else's progress of round t-1: ``avg(t-1) - share_in_group * own(t-1)``, where
      ``share_in_group`` is this node's token share in the group that actually averaged round t-1
      (0 if its contribution was not in it, 1 for a group of one);
    - this node's own part of round t-1 brought to that share: ``(share_in_group - share_applied) *
      own(t-1)``, since round t-1 applied it at the share expected then (``share_applied``); so over the
      rounds every member applies exactly the group averages (a node left out takes its part back);
    - its fresh progress at once: ``share_now * own(t)``.

    ``late_average`` is None in the first round (nothing has arrived yet). Shares are token shares (1/n
    for equal weights).
    """
    g = own_now * share_now
    if late_average is not None:
        # The late part first: others' progress of round t-1, which is exactly 0 for a worker alone (its
        # average is its own contribution), so that eager with one worker is blocking DiLoCo bit for bit.
        late = late_average.to(g.device)
        if own_prev is not None:
            late = late - own_prev * share_in_group
            if share_in_group != share_applied:
                late = late + own_prev * (share_in_group - share_applied)
        g = g + late
    return g


# ---- one class per method ---------------------------------------------------------------------------

Bounds = Sequence[tuple[int, int]]


class MergeRule(ABC):
    """How a fragment's sync result enters theta (see the module docstring).

    ``late`` rules (eager, delay) overlap a whole round (tau = h): a round's result is consumed at the
    fragment's next send, where it forms the outer gradient with the fresh local progress
    (:meth:`LateRule.outer_gradient`); the others merge at collect time (:meth:`merge`).
    """

    name: ClassVar[str]
    late: ClassVar[bool] = False
    # The rule's own ``[outer]`` settings a fair benchmark tunes besides the outer lr
    # (locoswarm.node.bench.convergence).
    tunable: ClassVar[tuple[str, ...]] = ()
    # Whether a result may be merged later than tau while training goes on: the rule keeps the local
    # progress made since the send (mixed or carried), so a late result costs staleness, not steps.
    # ``replace`` drops that progress (theta <- phi), so it waits at tau as blocking DiLoCo does.
    merges_late: ClassVar[bool] = True

    @abstractmethod
    def merge(self, theta: torch.Tensor, phi: torch.Tensor, snapshot: torch.Tensor, bounds: Bounds) -> torch.Tensor:
        """theta after the outer step moved phi; ``snapshot`` is theta when the sync was sent."""

    def carry(self, theta: torch.Tensor, phi_new: torch.Tensor, phi_old: torch.Tensor,
              bounds: Bounds) -> torch.Tensor:
        """theta after a catch-up replaced phi_old by a downloaded phi_new: the local progress rides on it."""
        return merge_rebase(theta, phi_new, phi_old)


class Replace(MergeRule):
    """DiLoCo / Streaming DiLoCo without overlap (Douillard et al. 2023, 2025): theta <- phi."""

    name = "replace"
    merges_late = False

    def merge(self, theta, phi, snapshot, bounds):
        return merge_replace(theta, phi)


class Alpha(MergeRule):
    """Streaming DiLoCo's overlap mix (Douillard et al. 2025): theta <- alpha * theta + (1 - alpha) * phi."""

    name = "alpha"
    tunable = ("alpha",)

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def merge(self, theta, phi, snapshot, bounds):
        return merge_alpha(theta, phi, self.alpha)


class Rebase(MergeRule):
    """DiLoCoX's one-step-delay overlap (Qi et al. 2025): theta <- phi - (snapshot - theta)."""

    name = "rebase"

    def merge(self, theta, phi, snapshot, bounds):
        return merge_rebase(theta, phi, snapshot)


class Compensate(MergeRule):
    """CoCoDC's first-order delay compensation (2025): theta <- phi - (g + lambda * g * g * D) per tensor,
    also when a catch-up moves phi under the local progress."""

    name = "compensate"
    tunable = ("lambda0",)
    # Its correction (norm lambda0 * |g|, along g * g * D) grows with the progress made since the send and
    # enters the next pseudo-gradient. Merged later than tau, that fed back round after round: in the
    # 4-node pairwise-gossip swarm one pair's phi grew from 131 to 240 in norm over 20 merges while the
    # other pair's stayed at 135 (2 runs of 3; alpha and rebase: spreads of 0.7-5.2%). So it waits at tau.
    merges_late = False

    def __init__(self, lambda0: float) -> None:
        self.lambda0 = lambda0

    def merge(self, theta, phi, snapshot, bounds):
        return merge_compensate(theta, phi, snapshot, self.lambda0, bounds)

    def carry(self, theta, phi_new, phi_old, bounds):
        return merge_compensate(theta, phi_new, phi_old, self.lambda0, bounds)


class LateRule(MergeRule):
    """A rule whose round overlaps a whole round: the outer step happens at the next send, on
    g = late_avg - share_prev * own_prev + share_now * own_now (theta <- phi afterwards)."""

    late = True
    merges_late = False  # its result is consumed at the next send (tau = h): no window beyond that

    def merge(self, theta, phi, snapshot, bounds):
        return phi.clone()

    @abstractmethod
    def own_share(self, expected_share: float) -> float:
        """The share of its fresh progress a worker applies at once (its expected token share, or 0)."""

    @staticmethod
    def outer_gradient(late_average: torch.Tensor | None, own_prev: torch.Tensor | None, share_in_group: float,
                       share_applied: float, own_now: torch.Tensor, share_now: float) -> torch.Tensor:
        return eager_outer_gradient(late_average, own_prev, share_in_group, share_applied, own_now, share_now)


class Eager(LateRule):
    """Eager updates (Kale et al. 2025): the worker's own fresh progress is applied at once at its token
    share, everyone else's one round late."""

    name = "eager"

    def own_share(self, expected_share: float) -> float:
        return expected_share


class NaiveDelay(LateRule):
    """The naive one-outer-step delay (the Eager paper's baseline): the outer step of round k applies the
    group average of round k-1, nothing of the fresh progress, and theta restarts from phi."""

    name = "delay"

    def own_share(self, expected_share: float) -> float:
        return 0.0


def make_merge_rule(method: str, *, alpha: float = 0.5, lambda0: float = 0.2) -> MergeRule:
    """The rule of ``[outer] method``."""
    rules = {"replace": Replace, "rebase": Rebase, "eager": Eager, "delay": NaiveDelay}
    if method in rules:
        return rules[method]()
    if method == "alpha":
        return Alpha(alpha)
    if method == "compensate":
        return Compensate(lambda0)
    raise ValueError(f"unknown merge method {method!r}")
