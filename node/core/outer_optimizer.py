"""The outer optimizer of DiLoCo: SGD with Nesterov momentum on the averaged pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023).
With the PyTorch convention (``torch.optim.SGD(nesterov=True, dampening=0)``)::

    b <- mu * b + delta
    phi <- phi - lr * (delta + mu * b)

where ``delta = phi - theta`` averaged over the group is the pseudo-gradient.
"""

from __future__ import annotations

import torch


class NesterovOuterOptimizer:
    """Applies the outer step to flat fp32 tensors in place (one call per fragment sync)."""

    def __init__(self, lr: float, momentum: float) -> None:
        if lr <= 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0 <= momentum <= 1:
            raise ValueError(f"outer momentum must be in [0, 1], got {momentum}")
        self.lr = lr
        self.momentum = momentum

    @torch.no_grad()
    def step(self, phi: torch.Tensor, momentum_buf: torch.Tensor, delta: torch.Tensor) -> None:
        delta = delta.to(device=phi.device, dtype=phi.dtype)
        momentum_buf.mul_(self.momentum).add_(delta)
        phi.sub_(delta.add(momentum_buf, alpha=self.momentum), alpha=self.lr)
