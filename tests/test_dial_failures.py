"""Routing around pairs that cannot connect (node/swarm/dial_failures.py, ``route_around`` in
node/transport/groups.py): what a node remembers of its failed dials, and the groups every member then forms."""

from __future__ import annotations

import pytest

from locoswarm.node.bench.swarm import netns, spec
from locoswarm.node.core.transport import AverageRequest
from locoswarm.node.errors import UserError
from locoswarm.node.swarm.dial_failures import MAX_LISTED, DialFailures
from locoswarm.node.swarm.matchmaking import match_entry
from locoswarm.node.swarm.standing import StandingMembers
from locoswarm.node.transport.groups import form_groups, route_around
from locoswarm.protocol import swarm_pb2

FOUR = ["QmA", "QmB", "QmC", "QmD"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_dial_is_listed_until_the_ttl_or_a_successful_open() -> None:
    clock = _Clock()
    memory = DialFailures(ttl_s=60.0, clock=clock)
    assert memory.failed("QmB") is True and memory.failed("QmB") is False  # new once, then known
    assert memory.failed("QmA") is True
    assert memory.peers() == ["QmA", "QmB"]
    memory.reached("QmA")
    assert memory.peers() == ["QmB"]
    clock.now += 59.0
    assert memory.peers() == ["QmB"]
    memory.failed("QmC")
    clock.now += 2.0  # QmB's last failure is 61 s old, QmC's 2 s
    assert memory.peers() == ["QmC"]
    clock.now += 60.0
    assert memory.peers() == []


def test_a_repeated_failure_restarts_the_ttl_and_the_list_is_bounded_by_the_newest() -> None:
    clock = _Clock()
    memory = DialFailures(ttl_s=60.0, clock=clock)
    memory.failed("QmOld")
    clock.now += 50.0
    memory.failed("QmOld")
    clock.now += 50.0
    assert memory.peers() == ["QmOld"]
    for i in range(MAX_LISTED + 5):
        memory.failed(f"Qm{i:03d}")
    listed = memory.peers()
    assert len(listed) == MAX_LISTED and "QmOld" not in listed and f"Qm{MAX_LISTED + 4:03d}" in listed
    with pytest.raises(ValueError, match="ttl_s"):
        DialFailures(ttl_s=0)


def test_a_pair_that_cannot_connect_never_shares_a_group_and_nobody_is_left_alone() -> None:
    outbound, apart = route_around(FOUR, frozenset(), {"QmC": ["QmD"], "QmD": ["QmC"]}, {})
    assert outbound == frozenset() and apart == {"QmC": ["QmD"], "QmD": ["QmC"]}
    for round_ in range(0, 2000, 50):
        groups = form_groups(FOUR, 0, round_, 4, apart, outbound)
        assert not any({"QmC", "QmD"} <= set(g) for g in groups), groups
        assert sorted(p for g in groups for p in g) == FOUR and all(len(g) == 2 for g in groups), groups
    # without the lists the four would be one group: the pair's dials would fail its round every time
    assert form_groups(FOUR, 0, 50, 4, {}, frozenset()) == [FOUR]


def test_a_member_most_others_cannot_dial_is_taken_as_outbound_only_and_still_averages() -> None:
    undialable = {"QmA": ["QmD"], "QmB": ["QmD"], "QmC": []}
    outbound, apart = route_around(FOUR, frozenset(), undialable, {"QmA": ["QmX"]})
    assert outbound == {"QmD"}
    assert apart == {"QmA": ["QmX"]}, "nobody dials it: no pair to keep apart"
    for round_ in range(0, 1000, 50):
        groups = form_groups(FOUR, 1, round_, 4, apart, outbound)
        mine = next(g for g in groups if "QmD" in g)
        assert len(mine) > 1 and set(mine) - {"QmD"}, groups  # with a member that reduces its part


def test_a_liar_naming_honest_members_only_separates_itself() -> None:
    five = [*FOUR, "QmL"]
    undialable = {"QmL": ["QmA", "QmB", "QmC", "QmD"]}
    outbound, apart = route_around(five, frozenset(), undialable, {})
    assert outbound == frozenset(), "one voter of four is no majority: no honest member loses its reducer share"
    for round_ in range(0, 1000, 50):
        groups = form_groups(five, 0, round_, 4, apart, outbound)
        assert ["QmL"] in groups and sorted(p for g in groups if g != ["QmL"] for p in g) == FOUR, groups


def test_an_outbound_only_member_that_cannot_dial_a_public_one_is_kept_from_it() -> None:
    outbound, apart = route_around(FOUR, frozenset({"QmD"}), {"QmD": ["QmA"]}, {})
    assert outbound == {"QmD"} and apart["QmD"] == ["QmA"]
    for round_ in range(0, 1000, 50):
        groups = form_groups(FOUR, 0, round_, 2, apart, outbound)
        assert not any({"QmA", "QmD"} <= set(g) for g in groups), groups


def test_names_outside_the_round_and_oneself_are_ignored() -> None:
    outbound, apart = route_around(["QmA", "QmB"], frozenset(), {"QmA": ["QmA", "QmGone"], "QmB": []}, {})
    assert outbound == frozenset() and apart == {}


def test_the_match_entry_carries_the_list_bounded() -> None:
    req = AverageRequest(fragment=0, round=50, weight=1.0, version=3, chunks=[], numel=0, codec="fp32")
    entry = match_entry("QmA", req, 10.0, undialable=[f"Qm{i:03d}" for i in range(100)])
    back = swarm_pb2.MatchEntry.FromString(entry.SerializeToString())
    assert len(back.undialable) == 32 and back.undialable[0] == "Qm000"


def test_a_standing_list_declines_once_the_node_failed_to_dial_someone_new() -> None:
    standing = StandingMembers()

    def record() -> None:
        standing.record(0, 100, FOUR, {p: [] for p in FOUR}, banned=[], undialable={"QmA": ["QmD"]}, own="QmA")

    record()
    assert standing.take(0, 150, set(FOUR), banned=[], own="QmA", own_undialable=["QmD"]) is not None
    record()
    assert standing.take(0, 150, set(FOUR), banned=[], own="QmA", own_undialable=["QmC", "QmD"]) is None
    record()
    assert standing.take(0, 150, set(FOUR), banned=[], own="QmA", own_undialable=[]) is None


@pytest.mark.parametrize(("value", "want"), [("", ()), ("2-3", ((2, 3),)), ("3-2, 0-1,2-3", ((2, 3), (0, 1)))])
def test_cut_pairs_parse(value: str, want: tuple) -> None:
    assert spec.parse_cuts(value, 4) == want


@pytest.mark.parametrize("value", ["2", "2-2", "1-4", "a-b", "2-3,", "-1-2"])
def test_a_bad_cut_names_flag_value_and_form(value: str) -> None:
    with pytest.raises(UserError) as err:
        spec.parse_cuts(value, 4)
    text = str(err.value)
    assert text.startswith("--cut: cannot use") and "from 0 to 3" in text and "\n" not in text


def test_cut_rules_drop_both_directions_in_the_raw_table() -> None:
    rules = netns.cut_rules("10.77.0.3")
    assert all(r[:2] == ["-t", "raw"] and r[-2:] == ["-j", "DROP"] for r in rules)
    assert {(r[3], r[4]) for r in rules} == {("PREROUTING", "-s"), ("PREROUTING", "-d"), ("OUTPUT", "-d")}
