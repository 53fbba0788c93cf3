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
                  is applied at once, everyone else's one round late.
"""

from __future__ import annotations

from collections.abc import Sequence

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
                         share_prev: float, own_now: torch.Tensor, share_now: float) -> torch.Tensor:
    """The eager outer gradient g = avg(t-1) - share_prev * own(t-1) + share_now * own(t).

    ``late_average`` is None in the first round (nothing has arrived yet); ``share_*`` is the
    node's token share of the group (1/n for equal weights).
    """
    g = own_now * share_now
    if late_average is not None:
        # The late part first: others' progress of round k-1, which is exactly 0 for a worker alone (its
        # average is its own contribution), so that eager with one worker is blocking DiLoCo bit for bit.
        late = late_average.to(g.device)
        if own_prev is not None:
            late = late - own_prev * share_prev
        g = g + late
    return g
