"""Standing members (node/swarm/standing.py): when a merged round's member list stands for the next."""

from __future__ import annotations

from locoswarm.node.swarm.standing import StandingMembers

SWARM = {"QmA", "QmB", "QmC"}


def _recorded(enabled: bool = True) -> StandingMembers:
    standing = StandingMembers(enabled)
    standing.record(0, 100, sorted(SWARM), {"QmA": [], "QmB": [], "QmC": []}, banned=[])
    return standing


def test_an_unchanged_swarm_takes_the_last_members_once() -> None:
    standing = _recorded()
    taken = standing.take(0, 150, set(SWARM), banned=[])
    assert taken is not None and taken.members == ("QmA", "QmB", "QmC") and taken.round == 100
    assert standing.take(0, 200, set(SWARM), banned=[]) is None, "a list stands for one round only"
    assert (standing.used, standing.declined) == (1, 0)


def test_a_member_missing_from_the_view_keeps_the_list_standing() -> None:
    """A heartbeat read late on a starved link must not send one member to matchmaking alone: it would form
    another group than its partners'. A member that really left fails one round, then the list is gone."""
    standing = _recorded()
    taken = standing.take(0, 150, SWARM - {"QmC"}, banned=[])
    assert taken is not None and taken.members == ("QmA", "QmB", "QmC")


def test_a_newcomer_a_ban_or_an_old_round_goes_back_to_matchmaking() -> None:
    for view, banned, round_ in [(SWARM | {"QmJoiner"}, [], 150),   # a peer joined
                                 (set(SWARM), ["QmC"], 150),         # this node banned a member since
                                 (set(SWARM), [], 100)]:             # not a later round
        standing = _recorded()
        assert standing.take(0, round_, view, banned) is None, (view, banned, round_)
        assert standing.declined == 1
        assert standing.take(0, round_ + 50, set(SWARM), []) is None, "a declined list is used up"


def test_fragments_stand_apart_and_forget_drops_a_list() -> None:
    standing = _recorded()
    assert standing.take(1, 150, set(SWARM), []) is None and standing.declined == 0
    standing.forget(0)
    assert standing.take(0, 150, set(SWARM), []) is None


def test_disabled_never_stands() -> None:
    standing = _recorded(enabled=False)
    assert standing.take(0, 150, set(SWARM), []) is None
