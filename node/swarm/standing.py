"""Standing members: a round without a DHT round trip while the swarm has not changed (issue 10).

Matchmaking through the DHT (``locoswarm.node.swarm.averaging``) costs every round a store and reads until
the last member's entry shows; on a link full of bulk data the DHT's messages queue behind it ("no answer
from the DHT in 5 s" at 5 Mbit/s). Yet in a swarm that has not changed, a round's member list is the last
one's. So after a round of fragment ``p`` merged with member list ``M``, this node's next round of ``p``
skips the DHT and exchanges at once, in the groups the seeded rule (``form_groups``) cuts from ``M`` for
that round, when nothing in this node's view of the swarm says ``M`` changed: no live peer outside ``M``,
no ban of its own changed, and every live member keeping the swarm's pace (matchmaking would leave a
straggler out after the grace; a standing list would wait for it). A member of ``M`` missing from the live
view does not decline the list: on a starved link a heartbeat read fails for seconds ("no answer from the DHT
in 5 s" at 5 Mbit/s), and a node that matchmade on that shrunken view formed another group than its
partners, which failed the round for all (``reports/swarm-standing``); a member that really left fails one
round (its streams cannot open), after which the fragment matchmakes again. The node still stores its match
entry, in the background, so that a member that matchmakes finds it. A list that holds a peer this node bans
does not stand (it was formed while bans differed, and its groups would keep that split).

Where views differ (a peer joined, or fell behind in one view and not in another), members form different
groups, the exchange refuses the mismatch and the round fails: the next one goes through the DHT again,
since a list stands only for the round right after the one that merged with it (``take`` removes it, a
merged round ``record``s it again). Rounds that need the entries' contents do not stand: consensus rounds
(digests), the adaptive schedule (the slot leader's pick) and low-rank payloads (basis tags).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Standing:
    """The member list of a fragment's last merged round, and what this node knew when it formed it."""

    round: int
    members: tuple[str, ...]
    excluded: Mapping[str, list[str]]  # each member's ban list from its match entry (the groups avoid them)
    banned: frozenset[str]             # whom this node banned then
    # each member's doubted list from its match entry (the round's idle reducers), and this node's own then
    doubted: Mapping[str, list[str]] = field(default_factory=dict)
    own_doubted: frozenset[str] = frozenset()
    outbound: frozenset[str] = frozenset()  # members that said they are outbound only (they reduce no part)
    # each member's undialable list from its match entry (``dial_failures``), and this node's own then
    undialable: Mapping[str, list[str]] = field(default_factory=dict)
    own_undialable: frozenset[str] = frozenset()


class StandingMembers:
    """Per fragment, the member list a merged round leaves standing for the next (see module docstring)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._by_fragment: dict[int, Standing] = {}
        self.used = 0       # rounds that took a standing list
        self.declined = 0   # rounds that had one but found the swarm changed

    def record(self, fragment: int, round_: int, members: Iterable[str], excluded: Mapping[str, list[str]],
               banned: Iterable[str], doubted: Mapping[str, list[str]] | None = None,
               own_doubted: Iterable[str] = (), outbound: Iterable[str] = (),
               undialable: Mapping[str, list[str]] | None = None, own: str | None = None) -> None:
        """Round ``round_`` of ``fragment`` merged with ``members``: they stand for its next round."""
        if self.enabled:
            undialable = dict(undialable or {})
            self._by_fragment[fragment] = Standing(round_, tuple(sorted(members)), dict(excluded),
                                                   frozenset(banned), dict(doubted or {}), frozenset(own_doubted),
                                                   frozenset(outbound), undialable,
                                                   frozenset(undialable.get(own, ())) if own else frozenset())

    def forget(self, fragment: int) -> None:
        self._by_fragment.pop(fragment, None)

    def take(self, fragment: int, round_: int, view: set[str], banned: Iterable[str],
             doubted: Iterable[str] = (), own: str | None = None, own_outbound: bool = False,
             own_undialable: Iterable[str] = ()) -> Standing | None:
        """The standing list for round ``round_`` of ``fragment``, if this node's ``view`` (itself and the live
        peers it would wait for) holds no peer outside its members and its own bans and doubts are unchanged
        (a changed doubt must reach the others' idle reducers through a match entry); else None.
        A change of this node's (``own``, where given) reachability, ``own_outbound``, also matchmakes: the others learn
        it from its match entry, and so does a change of the peers it failed to dial lately (``own_undialable``: the
        others' groups must keep it apart from a new one). Either way the list is used up."""
        standing = self._by_fragment.pop(fragment, None)
        if standing is None:
            return None
        banned = frozenset(banned)
        # A list holding a peer this node bans was formed while bans differed between members (its groups kept
        # the peer apart from some of them): a standing round would repeat that split for good, while members
        # that matchmake drop the peer once everyone bans it (``matchmaking.shunned_dropped``), so it matchmakes.
        if (round_ <= standing.round or not view <= set(standing.members) or banned != standing.banned
                or banned & set(standing.members) or frozenset(doubted) != standing.own_doubted
                or (own is not None and own_outbound != (own in standing.outbound))
                or frozenset(own_undialable) != standing.own_undialable):
            self.declined += 1
            return None
        self.used += 1
        return standing
