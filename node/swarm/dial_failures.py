"""Dial failures: the peers this node could not open a stream to lately, so that rounds route around them.

The dial-back check (``locoswarm.node.swarm.reachability``) tells a node whether peers in general can dial it.
It cannot see a connection that fails between two particular peers: a firewall between them, a network that
drops one route, or a node that says it is public and cannot be dialled (its checker lied, a port forward
broke). Every stream of such a pair fails, and with it each round in which one of them must send the other a
part. So each member lists, in its match entry (``MatchEntry.undialable``), the peers it failed to dial within
``DIAL_FAILURE_TTL_S``, and every member applies the same two rules to the entries of a round
(``locoswarm.node.transport.groups.route_around``):

- a member that most of the round's other members cannot dial is taken as outbound only for that round: it
  reduces no part, nobody opens a stream to it, and it still sends its own part to the reducers;
- any other pair named is kept apart, as a ban keeps a pair apart: never one group.

A liar naming honest peers only separates itself from them; to make an honest member outbound only it needs a
strict majority of the round's other members (then it already holds most groups' reducers). A listed peer is
dialled again after the TTL (a router may have been fixed); a failing pair then costs one failed round per TTL.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

DIAL_FAILURE_TTL_S = 300.0   # how long a failed dial keeps a pair apart
MAX_LISTED = 32              # peers one match entry may list (as its ban list: far below a DHT record's size)


class DialFailures:
    """The peers this node's stream opens failed to within ``ttl_s``, newest last; a successful open clears one."""

    def __init__(self, ttl_s: float = DIAL_FAILURE_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._failed: OrderedDict[str, float] = OrderedDict()

    def failed(self, peer: str) -> bool:
        """An open to ``peer`` failed; True when it was not listed (the node's match entries change)."""
        self._expire()
        new = peer not in self._failed
        self._failed[peer] = self._clock()
        self._failed.move_to_end(peer)
        while len(self._failed) > MAX_LISTED:
            self._failed.popitem(last=False)
        return new

    def reached(self, peer: str) -> None:
        """An open to ``peer`` succeeded: it is dialable again."""
        self._failed.pop(peer, None)

    def peers(self) -> list[str]:
        """The peers listed now, sorted (what this node's match entry names)."""
        self._expire()
        return sorted(self._failed)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._failed and next(iter(self._failed.values())) < cutoff:
            self._failed.popitem(last=False)


__all__ = ["DIAL_FAILURE_TTL_S", "MAX_LISTED", "DialFailures"]
