"""Per-fragment outer state of one worker.

For fragment p the worker keeps phi_p (outer params as last agreed with peers, fp32), b_p (outer
Nesterov momentum), optionally e_p (error-feedback residual), the version (outer steps applied) and
bookkeeping of the last send. The live parameters theta_p are the model's own tensors; this class
reads and writes them as one flat fp32 vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class FragmentState:
    index: int
    params: list[torch.nn.Parameter]
    bounds: list[tuple[int, int]]          # flat [start, end) of each tensor
    phi: torch.Tensor
    momentum: torch.Tensor
    residual: torch.Tensor | None
    version: int = 0
    last_send: int | None = None           # swarm step of the last send
    tokens_since_send: float = 0.0
    last_quant_error: float = 0.0
    failed_rounds: int = 0                 # consecutive failed (or refused) rounds: the progress carried
    catch_ups_in_row: int = 0              # catch-ups since the last merged round (2+: a catch-up loop)

    @classmethod
    def create(cls, index: int, params: Sequence[torch.nn.Parameter], error_feedback: bool) -> FragmentState:
        bounds, start = [], 0
        for p in params:
            bounds.append((start, start + p.numel()))
            start += p.numel()
        with torch.no_grad():
            phi = torch.cat([p.detach().reshape(-1).float() for p in params]).clone()
        return cls(index=index, params=list(params), bounds=bounds, phi=phi,
                   momentum=torch.zeros_like(phi),
                   residual=torch.zeros_like(phi) if error_feedback else None)

    @property
    def numel(self) -> int:
        return self.phi.numel()

    @torch.no_grad()
    def theta(self) -> torch.Tensor:
        """A flat fp32 copy of the live parameters."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    @torch.no_grad()
    def set_theta(self, flat: torch.Tensor) -> None:
        for p, (a, b) in zip(self.params, self.bounds, strict=True):
            p.copy_(flat[a:b].view_as(p).to(p.dtype))
