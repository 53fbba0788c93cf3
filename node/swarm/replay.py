"""Replays: a payload seen in an earlier round is refused when it comes back as a contribution.

A hostile member can resend, as its own contribution, bytes it received in an earlier round: a reduced
part every member of that round's group was sent (the all-gather), or a member's contribution it reduced
itself. The header binds a contribution to its fragment, round, group and authenticated sender, but not
its payload, and a stale average is progress made at an older phi, counted again. So every member
remembers the digests of the chunks it has seen (its own contributions, the contributions it reduced, the
reduced parts it made or received) with the round it saw them in, and a reducer refuses a contribution
whose chunks were seen in another round.

What is never a replay: a chunk that decodes to zeros (a member with no progress sends the same bytes every
time), and the same bytes from two members in one round (a slice of parameters that only weight decay
moves, such as the embedding rows of bytes a corpus never holds, changes by the same amount on every member
that made the same steps). The memory is bounded (``max_entries``, least recently seen forgotten first), so
a replay from far enough back passes: it is then a stale contribution, which the direction judgement and
the clipping bound like any other (``locoswarm.node.core.robust``).

A replay of averages is conclusive: an honest member's contribution is its own progress, which never equals, byte
for byte, a group's average of an earlier round in ``CONCLUSIVE_CHUNKS`` chunks (a slice that only weight decay
moves is the same on every member, so its bytes are this round's own, and the reducer's own contribution of this
round already holds them). Any other replay counts as one offence of the threshold: a replayer that resent its
group's average from two rounds before was banned by every honest node only 13-14 rounds after its first attack
(robustness bench, 4 honest + 2 replayers, three offences each).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

DIGEST_BYTES = 12
MAX_ENTRIES = 1 << 15
CONCLUSIVE_CHUNKS = 2  # chunks of earlier averages in one contribution that make its replay conclusive


class Seen(NamedTuple):
    """Where a chunk was seen: the round of a fragment, and whether as the group's average."""

    fragment: int
    round: int
    averaged: bool = False


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


class ReplayMemory:
    """Digests of payload chunks seen, each with the (fragment, round) it was seen in and whether it was an average.

    Not thread-safe: used on the network loop only."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, Seen] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def remember(self, fragment: int, round_: int, chunks: Iterable[bytes], *, averaged: bool = False) -> None:
        """Chunks seen in round ``round_`` of ``fragment`` (zero chunks must be left out by the caller); ``averaged``:
        chunks of the group's average (reduced parts), not of a member's contribution."""
        for data in chunks:
            key = digest(data)
            self._seen.pop(key, None)
            self._seen[key] = Seen(fragment, round_, averaged)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def replayed(self, fragment: int, round_: int, chunks: Iterable[bytes]) -> list[Seen]:
        """Where each of ``chunks`` that was seen in another round than this one was seen."""
        found = []
        for data in chunks:
            seen = self._seen.get(digest(data))
            if seen is not None and (seen.fragment, seen.round) != (fragment, round_):
                found.append(seen)
        return found


def conclusive(seen: Iterable[Seen]) -> bool:
    """Whether a contribution's replayed chunks (``ReplayMemory.replayed``) cannot be an honest member's (module
    docstring): at least ``CONCLUSIVE_CHUNKS`` of them were an earlier round's average."""
    return sum(1 for s in seen if s.averaged) >= CONCLUSIVE_CHUNKS


__all__ = ["CONCLUSIVE_CHUNKS", "ReplayMemory", "Seen", "conclusive", "digest"]
