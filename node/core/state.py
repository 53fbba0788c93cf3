"""Per-fragment outer state of one worker.

For fragment p the worker keeps phi_p (outer params as last agreed with peers, fp32), b_p (outer
Nesterov momentum), optionally e_p (error-feedback residual), the version (outer steps applied) and
bookkeeping of the last send. The live parameters theta_p are the model's own tensors; this class
reads and writes them as one flat fp32 vector, and nothing else does. A node whose outer model is a copy
of what its ranks train (``locoswarm.node.ranks``) passes a :class:`ThetaAccess` that hears of each read
and write, so that it moves a fragment between the ranks only when the outer loop touches it.
"""

from __future__ import annotations

import contextlib
import hashlib
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

DIGEST_BYTES = 16


def state_digest(phi: torch.Tensor, momentum: torch.Tensor) -> bytes:
    """The digest heartbeats announce of a fragment's outer state: phi's fp32 bytes and the momentum rounded to
    bf16 (a download may carry it in bf16, and must still be checkable)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(phi.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    h.update(momentum.detach().to("cpu", torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.digest()


def tensor_crc(t: torch.Tensor, crc: int = 0) -> int:
    """crc32 of a tensor's fp32 bytes (chained from ``crc``): a phi's identity in heartbeats, statuses and a
    round's lineage, and the ranks' check that they hold one model."""
    return zlib.crc32(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes(), crc)


class ThetaAccess(Protocol):
    """Told of every read and write of a fragment's theta (``FragmentState.theta``/``set_theta``)."""

    def before_read(self, fragment: int) -> None:
        """The live parameters of ``fragment`` are about to be read: bring them up to date."""

    def after_write(self, fragment: int) -> None:
        """The live parameters of ``fragment`` were overwritten (every element of them)."""


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
    refused_rounds: int = 0                # of those, rounds this node failed by refusing what peers sent
    catch_ups_in_row: int = 0              # catch-ups since the last merged round (2+: a catch-up loop)
    folded: bool = False                   # progress folded into phi since the last merge, catch-up or drop
    in_step: bool = False                  # in step with its group since a merged round (``IN_STEP_SLACK``)
    access: ThetaAccess | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, index: int, params: Sequence[torch.nn.Parameter], error_feedback: bool,
               device: torch.device | None = None, access: ThetaAccess | None = None) -> FragmentState:
        """The fragment's outer state, initialised from the live parameters. ``device``: where the outer
        state lives (default: the parameters' device). On a CUDA model a CPU ``device`` holds it in
        pinned host memory, so the GPU keeps only the model and its optimizer: theta is copied over
        parameter by parameter, never as one more fragment-sized tensor on the GPU. ``access``: told of
        each read and write of theta (see :class:`ThetaAccess`)."""
        bounds, start = [], 0
        for p in params:
            bounds.append((start, start + p.numel()))
            start += p.numel()
        device = torch.device(device) if device is not None else params[0].device
        pin = device.type == "cpu" and params[0].device.type == "cuda"

        def zeros() -> torch.Tensor:
            return torch.zeros(start, dtype=torch.float32, device=device, pin_memory=pin)

        state = cls(index=index, params=list(params), bounds=bounds, phi=zeros(), momentum=zeros(),
                    residual=zeros() if error_feedback else None, access=access)
        state.phi.copy_(state.theta())
        return state

    @property
    def numel(self) -> int:
        return self.phi.numel()

    @property
    def device(self) -> torch.device:
        """Where the outer state lives (maybe not where the model trains: see ``create``)."""
        return self.phi.device

    @torch.no_grad()
    def theta(self) -> torch.Tensor:
        """A flat fp32 copy of the live parameters, on the outer state's device."""
        if self.access is not None:
            self.access.before_read(self.index)
        out = torch.empty(self.numel, dtype=torch.float32, device=self.phi.device)
        for p, (a, b) in zip(self.params, self.bounds, strict=True):
            out[a:b].copy_(p.detach().reshape(-1))
        return out

    @contextlib.contextmanager
    def swapped(self, flat: torch.Tensor) -> Iterator[None]:
        """Hold ``flat`` in the live parameters for the duration of the block, then put back exactly what
        they held (a forward pass on a candidate: ``locoswarm.node.core.judge``). Nobody is told: the
        parameters end as they were, and what they held is not brought up to date first."""
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            try:
                for p, (a, b) in zip(self.params, self.bounds, strict=True):
                    p.copy_(flat[a:b].view_as(p))
                yield
            finally:
                for p, old in zip(self.params, saved, strict=True):
                    p.copy_(old)

    @torch.no_grad()
    def set_theta(self, flat: torch.Tensor) -> None:
        for p, (a, b) in zip(self.params, self.bounds, strict=True):
            p.copy_(flat[a:b].view_as(p))
        if self.access is not None:
            self.access.after_write(self.index)


def outer_state_device(offload: str, train_device: torch.device) -> torch.device:
    """Where the outer state lives for ``[outer] offload``: ``cpu``; ``off`` (the training device); ``auto``
    (cpu when training on CUDA: phi, momentum and the residual are 3 fp32 copies of the model, more than
    the bf16/fp32 weights themselves, and they are touched once per sync, not once per step)."""
    if offload == "cpu" or (offload == "auto" and torch.device(train_device).type == "cuda"):
        return torch.device("cpu")
    if offload in ("off", "auto"):
        return torch.device(train_device)
    raise ValueError(f"outer.offload = {offload!r}; choose auto, off or cpu")
