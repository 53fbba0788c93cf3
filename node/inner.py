"""The inner loop: AdamW with linear warmup and gradient clipping, one step at a time.

This is DiLoCo's inner optimizer; its state is kept across outer rounds (never reset at a sync).
Weight decay applies to matrices only (not to norms and biases), as in nanoGPT.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from locoswarm.node.config import InnerSection


class InnerOptimizer:
    """One worker's inner optimizer.

    Args:
        model: the live model (theta).
        cfg: the ``[inner]`` settings.
        total_steps: when given, the lr decays with a cosine to 10% of its peak at ``total_steps``;
            otherwise it stays constant after warmup (an open-ended swarm run).
    """

    def __init__(self, model: torch.nn.Module, cfg: InnerSection, total_steps: int | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.total_steps = total_steps
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)
        self.steps_done = 0

    def reset_state(self) -> None:
        """Forget the moment estimates (after theta diverged and restarted from phi: moments built on
        non-finite gradients would carry the divergence into every later step)."""
        self.optimizer.state.clear()

    def state_dict(self) -> dict:
        """The AdamW state (copies, on the CPU) and the step counter: what another rank needs to take
        this optimizer's place (``locoswarm.node.ranks``)."""
        opt = self.optimizer.state_dict()
        state = {i: {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in opt["state"].items()}
        return {"optimizer": {**opt, "state": state}, "steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` from :meth:`state_dict` (moments move to the parameters' device)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = int(state["steps_done"])

    def params(self) -> list[torch.Tensor]:
        """The optimized parameters in the optimizer's order (decayed first): index ``i`` below."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def param_state(self, i: int) -> dict:
        """The AdamW state of parameter ``i`` (empty before its first step or after a reset)."""
        return dict(self.optimizer.state.get(self.params()[i], {}))

    def load_param_state(self, i: int, state: dict) -> None:
        """Set parameter ``i``'s AdamW state (empty: none, as before its first step)."""
        param = self.params()[i]
        if state:
            self.optimizer.state[param] = dict(state)
        else:
            self.optimizer.state.pop(param, None)

    def lr_at(self, step: int) -> float:
        if self.cfg.warmup and step < self.cfg.warmup:
            return self.cfg.lr * (step + 1) / self.cfg.warmup
        if not self.total_steps:
            return self.cfg.lr
        progress = min(1.0, (step - self.cfg.warmup) / max(1, self.total_steps - self.cfg.warmup))
        return self.cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def step(self, batches: list[torch.Tensor]) -> float:
        """One inner step on the mean loss of ``batches`` (several = gradient accumulation)."""
        device = next(self.model.parameters()).device
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext())
        total = 0.0
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            with autocast:
                loss = self.model(input_ids=batch, labels=batch).loss / len(batches)
            loss.backward()
            total += float(loss.detach())
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.steps_done)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return total
