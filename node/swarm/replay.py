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
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

DIGEST_BYTES = 12
MAX_ENTRIES = 1 << 15


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


class ReplayMemory:
    """Digests of payload chunks seen, each with the (fragment, round) it was seen in.

    Not thread-safe: used on the network loop only."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def remember(self, fragment: int, round_: int, chunks: Iterable[bytes]) -> None:
        """Chunks seen in round ``round_`` of ``fragment`` (zero chunks must be left out by the caller)."""
        for data in chunks:
            key = digest(data)
            self._seen.pop(key, None)
            self._seen[key] = (fragment, round_)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def replayed(self, fragment: int, round_: int, chunks: Iterable[bytes]) -> list[tuple[int, int]]:
        """The (fragment, round) of each of ``chunks`` seen in another round than this one."""
        found = []
        for data in chunks:
            seen = self._seen.get(digest(data))
            if seen is not None and seen != (fragment, round_):
                found.append(seen)
        return found


__all__ = ["ReplayMemory", "digest"]
