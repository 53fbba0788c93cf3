"""Consensus of the outer params: keeping peers' phi from drifting apart under gossip.

With groups smaller than the swarm, each group applies its own average, so phi random-walks apart
between peers (ALGORITHMS section 6). Every ``every``-th sync of a fragment therefore also averages phi
itself, in fp32, within that round's group (uniform weights). When the group mean phi_bar of what was
sent arrives, phi and theta both move by ``phi_bar - phi_sent``: the outer point becomes the group's
consensus while the local progress (theta - phi) is kept. With an all-reduce group every phi is
already equal: members see equal digests and the round exchanges nothing. Groups change every round,
so repeated consensus rounds contract the spread across the whole swarm (the measured spread is in
the node's status).
"""

from __future__ import annotations

import hashlib

import torch

CONSENSUS_CODEC = "fp32"


def phi_digest(phi: torch.Tensor) -> bytes:
    """A short hash of phi's exact fp32 bytes: when a whole group's digests agree, the consensus round
    moves no bytes (the usual case under all-reduce groups)."""
    return hashlib.blake2b(phi.detach().to("cpu", torch.float32).contiguous().numpy().tobytes(),
                           digest_size=16).digest()


class PhiConsensus:
    def __init__(self, every: int, n_fragments: int) -> None:
        self.every = every
        self.n_fragments = n_fragments

    def due(self, step: int, h: int) -> bool:
        """Whether the sync started at swarm step ``step`` also averages phi: a function of the swarm
        clock only, so every member of a round agrees (restarts and failed rounds do not shift it)."""
        return self.every > 0 and (step // h) % self.every == self.every - 1

    def round_fragment(self, fragment: int) -> int:
        """The id under which the consensus round of ``fragment`` meets (apart from its delta round)."""
        return self.n_fragments + fragment

    @staticmethod
    def correction(phi_mean: torch.Tensor, phi_sent: torch.Tensor) -> torch.Tensor:
        return phi_mean.to(phi_sent.device) - phi_sent
