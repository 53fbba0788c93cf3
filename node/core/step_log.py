"""The outer steps a fragment took from its groups' averages, kept to be replayed by a node that missed them.

A node that falls a version or two behind its swarm (a failed round, a late arrival, a join whose download took
longer than a round) used to download the fragment's whole outer state: phi and momentum in fp32, 8 bytes per
parameter, where the round it missed moved a fp4 average of about half a byte per parameter. On 5 Mbit/s links
(a bench run of two public nodes and two behind NAT) the catch-ups of the `tiny` preset's 4.5 MB fragments took
4-22 s each, often landed a version already stale, and were followed by another: more bytes than all the rounds'
(in such a run rounds merged 0.3-0.6 MB per node each). The holder
instead serves the averages of the steps the node missed; the node applies them to its own phi and momentum with
the same outer optimizer, which is deterministic on the same device type, and checks the outcome against the
digest the swarm's holders announce for that version (``locoswarm.node.swarm.versions``) before it takes it, like
a download. Where anything differs (another device, a consensus shift, a step of its own), the digest does not
match and the node downloads the state as before.

A holder serves only an unbroken chain: each logged step starts from the phi and momentum the previous one left,
and the last ends at the state the holder has now (anything else that moved phi, a catch-up, a fold, a consensus
round, breaks it). Each step carries the digest of the state before and after it (``state_digest``, the one
heartbeats announce), and the node that replays checks both: that it starts from the holder's state (else it is
on another phi, and downloads), and that each of its steps ends where the holder's did. Where the swarm's holders
announce a digest for the version the replay reaches, the outcome must match that too.
"""

from __future__ import annotations

from collections import deque

import torch

from locoswarm.node.core.state import state_digest
from locoswarm.node.core.transport import EncodedAverage, OuterStep

REPLAY_DEPTH = 4  # steps a fragment keeps (and a node may be behind to replay instead of downloading)
# Bytes of encoded averages a node keeps over all its fragments' logs; a fragment keeps its last step whatever it
# costs. The `tiny` preset's steps are 0.3 MB in fp4; a 1B-parameter model's, in 4 fragments, 125 MB each.
STEP_LOG_BYTES = 256 << 20


def fingerprint(phi: torch.Tensor, momentum: torch.Tensor) -> bytes:
    """The digest of an outer state (``locoswarm.node.core.state.state_digest``)."""
    return state_digest(phi, momentum)


class StepLog:
    """The last ``depth`` outer steps of one fragment (module docstring)."""

    def __init__(self, depth: int = REPLAY_DEPTH, max_bytes: int = STEP_LOG_BYTES) -> None:
        if depth < 1:
            raise ValueError(f"a step log keeps at least one step, got depth {depth}")
        self._steps: deque[OuterStep] = deque(maxlen=depth)
        self.max_bytes = max_bytes

    def record(self, before: bytes, after: bytes, version: int, average: EncodedAverage) -> None:
        """The step on ``average`` took the state from digest ``before`` to ``after``, at ``version``; the oldest
        steps go beyond ``max_bytes`` (the last one stays)."""
        self._steps.append(OuterStep(version, average, before, after))
        while len(self._steps) > 1 and sum(s.average.nbytes for s in self._steps) > self.max_bytes:
            self._steps.popleft()

    def chain(self, now: bytes, version: int) -> tuple[OuterStep, ...]:
        """The longest run of logged steps that ends at the state of digest ``now`` at ``version`` with no gap:
        each step starts where the previous one ended, one version later. Empty when the last step is not what
        made the state as it is."""
        run: list[OuterStep] = []
        for step in reversed(self._steps):
            expected = (now, version) if not run else (run[-1].before, run[-1].version - 1)
            if (step.after, step.version) != expected:
                break
            run.append(step)
        return tuple(reversed(run))

    def clear(self) -> None:
        self._steps.clear()
