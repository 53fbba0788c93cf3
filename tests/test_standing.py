"""Standing members (node/swarm/standing.py): when a merged round's member list stands for the next."""

from __future__ import annotations

import contextlib

import pytest
import torch

from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.payload import encode_chunks
from locoswarm.node.core.transport import AverageRequest
from locoswarm.node.swarm.averaging import SwarmTransport
from locoswarm.node.swarm.dht import start_dht, visible_maddrs
from locoswarm.node.swarm.reachability import Reachability
from locoswarm.node.swarm.runtime import NetworkRuntime
from locoswarm.node.swarm.standing import StandingMembers
from locoswarm.node.swarm.view import SwarmView

SWARM = {"QmA", "QmB", "QmC"}


class _Peers(SwarmView):
    """A node's view of a swarm of ``peers`` that all train (everything else: a lone node's answers)."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = list(peers)

    def live_peers(self) -> list[str]:
        return list(self.peers)


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


def test_a_changed_doubt_goes_back_to_matchmaking() -> None:
    """Whom this node doubts reaches the others' idle reducers only through a match entry."""
    standing = StandingMembers()
    standing.record(0, 100, sorted(SWARM), {}, banned=[], doubted={"QmA": ["QmC"]}, own_doubted=["QmC"])
    assert standing.take(0, 150, set(SWARM), banned=[], doubted=[]) is None
    standing.record(0, 100, sorted(SWARM), {}, banned=[], doubted={"QmA": ["QmC"]}, own_doubted=["QmC"])
    taken = standing.take(0, 150, set(SWARM), banned=[], doubted=["QmC"])
    assert taken is not None and taken.doubted == {"QmA": ["QmC"]}


def test_fragments_stand_apart_and_forget_drops_a_list() -> None:
    standing = _recorded()
    assert standing.take(1, 150, set(SWARM), []) is None and standing.declined == 0
    standing.forget(0)
    assert standing.take(0, 150, set(SWARM), []) is None


def test_disabled_never_stands() -> None:
    standing = _recorded(enabled=False)
    assert standing.take(0, 150, set(SWARM), []) is None


# ---- a standing round between two real transports (hivemind DHTs and p2pd on loopback) -----------------

def _stop(transports: list, runtimes: list, dhts: list) -> None:
    for t in transports:
        t.close()
    for r in runtimes:
        r.stop()
    for d in dhts:
        with contextlib.suppress(Exception):
            d.shutdown()


def _start_swarm(tmp_path, n: int, dhts: list, runtimes: list) -> list[str]:
    """``n`` DHTs on loopback, each bootstrapped from the first, with their network threads; their peer ids. Appends
    to ``dhts`` and ``runtimes`` as each starts, so that ``_stop`` in the caller's ``finally`` stops whatever did."""
    dhts.append(start_dht([], identity_path=tmp_path / "0.key"))
    for i in range(1, n):
        dhts.append(start_dht(visible_maddrs(dhts[0]), identity_path=tmp_path / f"{i}.key"))
    runtimes.extend(NetworkRuntime(d) for d in dhts)
    return [r.peer_id for r in runtimes]


@pytest.mark.timeout(180)
def test_a_standing_round_learns_its_members_versions_from_their_headers(tmp_path) -> None:
    """A round that skips the DHT has no match entries to read versions from. It once took its own version
    for every member's, so a member one version behind (same phi) stayed behind for good: its group's
    version was its own, so it never caught up, and the survivors of a CI run never agreed on phi."""
    dhts, runtimes, transports = [], [], []
    try:
        ids = _start_swarm(tmp_path, 2, dhts, runtimes)
        codec = get_codec("fp32", 64)
        for i, runtime in enumerate(runtimes):
            other = ids[1 - i]
            transports.append(SwarmTransport(
                runtime, swarm_key="locoswarm/standing-test/fp/", fingerprint="fp", codec=codec, group_size=2,
                matchmaking_timeout=5.0, round_timeout=20.0, view=_Peers([other])))

        def round_(number: int, versions: list[int]) -> list:
            # each round's payloads differ (the same bytes in a later round would be a replay)
            handles = [t.start_average(AverageRequest(
                fragment=0, round=number, chunks=encode_chunks(codec, torch.full((100,), float(i + 1) + number / 100)),
                numel=100, weight=1.0, version=v)) for i, (t, v) in enumerate(zip(transports, versions, strict=True))]
            return [h.result(60) for h in handles]

        first = round_(10, [5, 5])
        assert all(r.ok and r.max_version == 5 for r in first), [(r.ok, r.error, r.max_version) for r in first]
        assert all(t.standing_rounds() == 0 for t in transports)
        second = round_(20, [5, 6])  # the first member is a version behind
        assert all(r.ok for r in second), [r.error for r in second]
        assert [t.standing_rounds() for t in transports] == [1, 1], "the second round took the standing members"
        assert [r.max_version for r in second] == [6, 6], "both members know the group's newest version"
        assert torch.allclose(second[0].average, torch.full((100,), 1.7))
        assert transports[0].latest_version(0) == 7, "the member behind learns the group's next version"
    finally:
        _stop(transports, runtimes, dhts)


@pytest.mark.timeout(180)
def test_a_round_a_reducer_completed_without_a_member_leaves_no_list_standing(tmp_path) -> None:
    """Three members merge; in the next round one of them does not come (an outbound-only one, which reduces no
    part: without it the others can still complete the round): the other two stand on the list of three,
    reduce without it (the partial reduction) and merge, and every member learns from its reducers' headers that
    a member was missing. That list does not stand: the round after matchmakes. Standing on it kept the lists
    different for good (a 2 + 2 NAT test: one member failed 40 rounds in a row alone while the others waited for
    its part in every round)."""
    dhts, runtimes, transports = [], [], []
    try:
        ids = _start_swarm(tmp_path, 3, dhts, runtimes)
        codec = get_codec("fp32", 64)
        for i, runtime in enumerate(runtimes):
            others = [p for p in ids if p != ids[i]]
            transports.append(SwarmTransport(
                runtime, swarm_key="locoswarm/standing-test-missing/fp/", fingerprint="fp", codec=codec,
                group_size=3, matchmaking_timeout=3.0, round_timeout=5.0, view=_Peers(others),
                reachability=Reachability("outbound-only" if i == 2 else "public")))

        def round_(number: int, who: list[int]) -> list:
            handles = [transports[i].start_average(AverageRequest(
                fragment=0, round=number, numel=100, weight=1.0, version=number,
                chunks=encode_chunks(codec, torch.full((100,), float(i + 1) + number / 100)))) for i in who]
            return [h.result(60) for h in handles]

        first = round_(10, [0, 1, 2])
        assert all(r.ok and r.group_size == 3 and r.missing == 0 for r in first), [(r.ok, r.error) for r in first]
        second = round_(20, [0, 1])  # the outbound-only member does not come
        assert all(r.ok for r in second), [r.error for r in second]
        assert [t.standing_rounds() for t in transports[:2]] == [1, 1], "the second round stood on the list of three"
        assert all(r.missing >= 1 for r in second), [r.missing for r in second]
        third = round_(30, [0, 1, 2])
        assert all(r.ok and r.group_size == 3 for r in third), [(r.ok, r.error, r.group_size) for r in third]
        # the two that merged the incomplete round matchmade (the third stood on the first round's list, as before)
        assert [t.standing_rounds() for t in transports[:2]] == [1, 1], "the round after an incomplete one matchmade"
    finally:
        _stop(transports, runtimes, dhts)


def test_a_list_holding_a_peer_this_node_bans_does_not_stand() -> None:
    """Formed while bans differed (the peer kept apart from some members by the groups), such a list would
    repeat that split every round while members that matchmake drop the peer: it matchmakes instead."""
    from locoswarm.node.swarm.standing import StandingMembers

    standing = StandingMembers()
    standing.record(0, 8, ["A", "B", "C", "X"], {"A": ["X"]}, banned=["X"])
    assert standing.take(0, 16, {"B", "C"}, banned=["X"]) is None
    standing.record(0, 8, ["A", "B", "C"], {}, banned=["X"])
    assert standing.take(0, 16, {"B", "C"}, banned=["X"]) is not None


CODEC, N = get_codec("fp32", 16), 8192  # 8 chunks: parts for three reducers


def _three_doubt_the_fourth(tmp_path, swarm_key: str, rounds: int, dhts: list, runtimes: list, transports: list,
                            robust=None) -> list[str]:
    """Four real transports in one DHT, room for all in one group; the first three have judged the fourth's standing
    drift ``rounds`` times (fed to their memories as the reductions would). Fills the lists (the caller stops them)
    and returns the peer ids, the fourth the drifter's."""
    ids = _start_swarm(tmp_path, 4, dhts, runtimes)
    for i, runtime in enumerate(runtimes):
        others = [p for p in ids if p != ids[i]]
        transports.append(SwarmTransport(
            runtime, swarm_key=swarm_key, fingerprint="fp", codec=CODEC, group_size=4, matchmaking_timeout=5.0,
            round_timeout=20.0, view=_Peers(others), robust=robust))
        if i < 3:
            honest = [p for p in ids[:3] if p != ids[i]]
            for _ in range(rounds):
                transports[i].deviations.standing_drift([*honest, "QmOther", ids[3]], [0.3, 0.3, 0.3, 0.95])
    return ids


def _average_round(transports: list, number: int) -> list:
    """One round of fragment 0 on every transport, member ``i`` contributing ``i + 1 + number / 100`` everywhere."""
    handles = [t.start_average(AverageRequest(
        fragment=0, round=number, chunks=encode_chunks(CODEC, torch.full((N,), float(i + 1) + number / 100)),
        numel=N, weight=1.0, version=1)) for i, t in enumerate(transports)]
    return [h.result(60) for h in handles]


@pytest.mark.timeout(240)
def test_a_member_the_others_doubt_reduces_no_part_and_every_round_still_merges(tmp_path) -> None:
    """Four real transports, one group: three doubt the fourth for its standing drift (fed to their memories as
    the reductions would). It reduces no part, every member still merges the same average, matchmade and then
    standing, and the doubted member's contribution has no pull in it."""
    from locoswarm.node.core.persistence import DRIFT_ROUNDS

    dhts, runtimes, transports = [], [], []
    try:
        ids = _three_doubt_the_fourth(tmp_path, "locoswarm/idle-test/fp/", DRIFT_ROUNDS, dhts, runtimes, transports)
        drifter = ids[3]
        assert [t.deviations.doubted() for t in transports[:3]] == [[drifter]] * 3

        for number in (10, 20):
            results = _average_round(transports, number)
            assert all(r.ok for r in results), [r.error for r in results]
            reducers = [{o.reducer for o in r.parts} for r in results]
            assert all(rs == set(ids[:3]) for rs in reducers), (number, reducers)
            assert all(torch.equal(r.average, results[0].average) for r in results)
        # the first round gave the reducers the differences to measure persistence with; from the second on the
        # doubted member is muted in every part (none is its own): the average is the honest three's mean
        assert torch.allclose(results[0].average, torch.full((N,), 2.2)), results[0].average[:4]
        assert [t.standing_rounds() for t in transports] == [1, 1, 1, 1], "the second round took the standing members"
    finally:
        _stop(transports, runtimes, dhts)


@pytest.mark.timeout(240)
def test_with_a_drift_ceiling_a_member_the_others_keep_apart_is_in_none_of_their_groups(tmp_path) -> None:
    """Four real transports, room for all in one group, ``[robust] drift_ceiling`` set: three have muted the fourth
    round after round for its standing drift (fed to their memories as the reductions would). Placement keeps it
    out of their group (``groups.kept_apart``): its rounds fail for want of a peer, the three merge their own
    mean, matchmade and then standing."""
    import dataclasses

    from locoswarm.node.config import RobustSection
    from locoswarm.node.core.persistence import DRIFT_ROUNDS, SUSTAINED_MUTES
    from locoswarm.node.core.transport import NO_PEER_IN_GROUP

    robust = dataclasses.replace(RobustSection(), drift_ceiling=0.75)
    dhts, runtimes, transports = [], [], []
    try:
        ids = _three_doubt_the_fourth(tmp_path, "locoswarm/apart-test/fp/", DRIFT_ROUNDS + SUSTAINED_MUTES, dhts,
                                      runtimes, transports, robust=robust)
        assert [t.deviations.apart() for t in transports[:3]] == [[ids[3]]] * 3

        for number in (10, 20):
            results = _average_round(transports, number)
            assert all(r.ok for r in results[:3]), [r.error for r in results]
            assert not results[3].ok and NO_PEER_IN_GROUP in (results[3].error or ""), results[3].error
            assert all({o.reducer for o in r.parts} == set(ids[:3]) for r in results[:3])
            assert torch.allclose(results[0].average, torch.full((N,), 2.0 + number / 100)), results[0].average[:4]
        assert [t.standing_rounds() for t in transports[:3]] == [1, 1, 1], "the second round took the standing members"
    finally:
        _stop(transports, runtimes, dhts)


def test_apart_by_trust_names_a_round_where_an_exclusion_involves_the_node() -> None:
    """A node alone in its group because it bans (or shuns) another member, or another member bans it, failed its
    round over a trust decision; one left over by placement alone (three members in pairs) did not."""
    from locoswarm.node.swarm.averaging import apart_by_trust

    members = ["QmA", "QmB", "QmC"]
    assert apart_by_trust("QmA", members, {"QmA": ["QmB"]})
    assert apart_by_trust("QmA", members, {"QmC": ["QmA"]})
    assert not apart_by_trust("QmA", members, {"QmB": ["QmC"]})  # an exclusion between the others
    assert not apart_by_trust("QmA", members, {})
    assert not apart_by_trust("QmA", ["QmA"], {"QmA": ["QmGone"]})  # no other member: not a round kept apart
    assert apart_by_trust("QmA", ["QmA"], {}, kept_out={"QmLive"})  # a live peer it keeps out is no member


@pytest.mark.timeout(180)
def test_two_members_kept_apart_by_a_ban_fail_their_round_as_a_refusal(tmp_path) -> None:
    """A member that bans the other (a ban, or an alarm's shunning) is alone in its group, and so is the banned
    one: both rounds fail as refusals (``AverageResult.refused``), so that each node's outer loop folds the progress
    they carried into its phi instead of dropping it every ``max_carry`` rounds (a 2 + 2 drift run: honest nodes
    alone for a minute trained for nothing). Without the ban the same two members average."""
    from locoswarm.node.swarm.reputation import Reputation

    dhts, runtimes, transports = [], [], []
    try:
        ids = _start_swarm(tmp_path, 2, dhts, runtimes)
        codec = get_codec("fp32", 64)
        reputations = [Reputation(), Reputation()]
        for i, runtime in enumerate(runtimes):
            transports.append(SwarmTransport(
                runtime, swarm_key="locoswarm/apart-test/fp/", fingerprint="fp", codec=codec, group_size=2,
                matchmaking_timeout=5.0, round_timeout=20.0, view=_Peers([ids[1 - i]]), reputation=reputations[i],
                standing_members=False))

        def round_(number: int) -> list:
            handles = [t.start_average(AverageRequest(
                fragment=0, round=number, chunks=encode_chunks(codec, torch.full((100,), float(i + 1) + number / 100)),
                numel=100, weight=1.0, version=1)) for i, t in enumerate(transports)]
            return [h.result(60) for h in handles]

        together = round_(10)
        assert all(r.ok for r in together), [r.error for r in together]
        reputations[0].refuse(ids[1], "direction", "mean -0.4 over its last 2", conclusive=True)
        apart = round_(20)
        assert not any(r.ok for r in apart) and all(r.refused for r in apart), [(r.error, r.refused) for r in apart]
    finally:
        _stop(transports, runtimes, dhts)
