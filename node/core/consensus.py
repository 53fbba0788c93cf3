"""Consensus of the outer state: keeping peers' phi from drifting apart under gossip.

With groups smaller than the swarm, each group applies its own average, so phi random-walks apart
between peers (ALGORITHMS section 6). Every ``every``-th sync of a fragment therefore also averages the
fragment's outer state itself, phi and its momentum, in fp32, within that round's group (uniform
weights). When the group mean of what was sent arrives, phi and momentum take it, plus whatever moved
them locally since the send (nothing, in the usual case, so the result is the group's mean exactly,
bit for bit, on every member), and theta moves with phi: the outer point becomes the group's consensus
while the local progress (theta - phi) is kept.

Momentum is part of it because the outer step is phi -= lr * f(momentum, average): members that agree on
phi but not on momentum (say, two that each stepped alone before they met) are moved apart again by
every later round, so a phi-only consensus never made them equal. With an all-reduce group the outer
states are already equal: members see equal digests and the round exchanges nothing. Groups change
every round, so repeated consensus rounds contract the spread across the whole swarm (the measured
spread is in the node's status).
"""

from __future__ import annotations

import hashlib

import torch

CONSENSUS_CODEC = "fp32"


def state_digest(state: torch.Tensor) -> bytes:
    """A short hash of an outer state's exact fp32 bytes: when a whole group's digests agree, the
    consensus round moves no bytes (the usual case under all-reduce groups)."""
    return hashlib.blake2b(state.detach().to("cpu", torch.float32).contiguous().numpy().tobytes(),
                           digest_size=16).digest()


def join_state(phi: torch.Tensor, momentum: torch.Tensor) -> torch.Tensor:
    """The vector a consensus round averages: phi, then its momentum (fp32, on phi's device)."""
    return torch.cat([phi.detach().float(), momentum.detach().to(phi.device, torch.float32)])


def split_state(state: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phi, momentum)`` of a vector made by :func:`join_state`."""
    return state[:numel], state[numel:]


class StateConsensus:
    def __init__(self, every: int, n_fragments: int) -> None:
        self.every = every
        self.n_fragments = n_fragments

    def due(self, step: int, h: int) -> bool:
        """Whether the sync started at swarm step ``step`` also averages the outer state: a function of the swarm
        clock only, so every member of a round agrees (restarts and failed rounds do not shift it)."""
        return self.every > 0 and (step // h) % self.every == self.every - 1

    def round_fragment(self, fragment: int) -> int:
        """The id under which the consensus round of ``fragment`` meets (apart from its delta round)."""
        return self.n_fragments + fragment

    @staticmethod
    def settle(mean: torch.Tensor, sent: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
        """The value after the round: the group's ``mean`` of what was sent, plus what moved ``now`` away
        from ``sent`` locally since. In that order of operations the usual case (nothing moved) gives the
        mean itself, bit for bit, on every member; ``now + (mean - sent)`` rounds differently per member."""
        return mean.to(now.device) + (now - sent)
