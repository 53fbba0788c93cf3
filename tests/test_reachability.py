"""Reachability (``locoswarm.node.swarm.reachability``): the dial-back check, what a node makes of it, and how
rounds place members that nobody can dial (``form_groups``, ``unreachable_idle``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import pytest

from locoswarm.node.swarm.averaging import unreachable_idle
from locoswarm.node.swarm.reachability import (
    OUTBOUND_ONLY,
    PUBLIC,
    UNKNOWN,
    Reachability,
    Verdict,
    check,
    dial,
    peer_ids_of,
    tcp_target,
)
from locoswarm.node.swarm.runtime import NetworkRuntime
from locoswarm.node.transport.groups import form_groups
from locoswarm.node.transport.reduce import reducer_parts

PEERS = [f"Qm{i:02d}" for i in range(12)]


# ---- grouping -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, outbound, group_size", [(4, 2, 4), (4, 3, 4), (8, 6, 4), (12, 9, 2), (5, 1, 2),
                                                      (7, 4, 3)])
def test_every_group_holds_a_member_peers_can_dial(n: int, outbound: int, group_size: int) -> None:
    members = PEERS[:n]
    unreachable = set(members[n - outbound:])
    for round_ in range(40):
        groups = form_groups(members, 0, round_, group_size, outbound=unreachable)
        assert sorted(p for g in groups for p in g) == sorted(members)
        for g in groups:
            assert set(g) - unreachable, (round_, groups)
        dialable = n - outbound
        # as many groups as group_size asks for, unless there are fewer dialable members than that
        assert len(groups) == min(-(-n // group_size), dialable)


def test_a_round_of_outbound_only_members_alone_forms_no_group() -> None:
    members = PEERS[:4]
    assert form_groups(members, 0, 3, 4, outbound=set(members)) == [[p] for p in members]


def test_without_outbound_members_the_groups_are_unchanged() -> None:
    for round_ in range(20):
        assert form_groups(PEERS[:8], 1, round_, 3) == form_groups(PEERS[:8], 1, round_, 3, outbound=())


def test_bans_and_reachability_together() -> None:
    members = PEERS[:6]
    unreachable = {"Qm03", "Qm04", "Qm05"}
    excluded = {"Qm00": ["Qm03"], "Qm01": ["Qm04"]}
    for round_ in range(30):
        groups = form_groups(members, 0, round_, 2, excluded, unreachable)
        for g in groups:
            assert len(g) == 1 or set(g) - unreachable, groups  # never two outbound-only members alone together
            assert not ({"Qm00", "Qm03"} <= set(g) or {"Qm01", "Qm04"} <= set(g)), groups


def test_outbound_only_members_reduce_no_part_unless_the_group_has_nobody_else() -> None:
    group = ["A", "B", "C", "D"]
    idle = unreachable_idle(group, frozenset(), {"C", "D"})
    assert idle == {"C", "D"}
    assert [len(r) for r in reducer_parts(10, group, idle)] == [5, 5, 0, 0]
    # a dialable member muted for its drift still reduces where it is the only dialable one
    assert unreachable_idle(["A", "C"], frozenset({"A"}), {"C"}) == {"C"}
    assert unreachable_idle(group, frozenset({"A"}), {"C", "D"}) == {"A", "C", "D"}
    # a group of outbound-only members alone: nothing changes (no stream could reach any of them anyway)
    assert unreachable_idle(["C", "D"], frozenset(), {"C", "D"}) == frozenset()


# ---- what a node believes -------------------------------------------------------------------------------------


def test_auto_takes_the_majority_of_the_answers_and_keeps_it_through_silence() -> None:
    r = Reachability("auto")
    assert r.state == UNKNOWN and not r.outbound_only and r.dht_client_mode(True) and not r.dht_client_mode(False)
    r.take(Verdict(reachable=0, unreachable=2, no_answer=1))
    assert r.state == OUTBOUND_ONLY and r.outbound_only and r.source == "checked"
    r.take(Verdict(no_answer=3))  # nobody answered: the last answered check stands
    assert r.state == OUTBOUND_ONLY and r.verdict.unreachable == 2
    r.take(Verdict(reachable=1, unreachable=1))  # a tie: public (rounds fail fast where it is wrong)
    assert r.state == PUBLIC
    r.assume(OUTBOUND_ONLY, "a guess")  # a checked state is not replaced by an assumption
    assert r.state == PUBLIC


def test_a_declared_mode_is_kept_whatever_the_check_says() -> None:
    r = Reachability("outbound-only")
    assert r.outbound_only and r.dht_client_mode(False) and r.source == "declared"
    r.take(Verdict(reachable=3))
    assert r.outbound_only
    p = Reachability("public")
    assert not p.dht_client_mode(True)
    p.take(Verdict(unreachable=3))
    assert p.state == PUBLIC and p.status().unreachable == 3
    with pytest.raises(ValueError, match="reachability mode"):
        Reachability("natted")


def test_a_node_behind_nat_is_told_once_how_to_become_public() -> None:
    r = Reachability("auto")
    assert r.advice(31337) is None  # nothing to say while not outbound only
    r.take(Verdict(unreachable=2))
    line = r.advice(31337)
    assert line is not None and "\n" not in line and "forward TCP port 31337" in line and "--announce" in line
    assert r.advice(31337) is None


def test_address_parsing() -> None:
    assert tcp_target("/ip4/10.77.0.21/tcp/40123") == ("10.77.0.21", 40123)
    assert tcp_target("/ip6/::1/tcp/5/p2p/QmX") == ("::1", 5)
    for bad in ("/ip4/1.2.3.4/udp/5/quic", "/dns4/example.org/tcp/5", "/ip4/1.2.3.4/tcp/0",
                "/ip4/10.0.0.1/tcp/4001/p2p/QmR/p2p-circuit", "/ip4/999.1.1.1/tcp/5", "garbage"):
        assert tcp_target(bad) is None, bad
    assert peer_ids_of(["/ip4/1.2.3.4/tcp/5/p2p/QmA", "/ip4/1.2.3.5/tcp/5/p2p/QmA", "/ip4/1.2.3.4/tcp/5"]) == ["QmA"]


def test_dial_tells_a_listener_from_a_closed_port() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]  # bound, not listening: refused
    try:
        assert asyncio.run(dial("127.0.0.1", port, timeout=2.0))
        assert not asyncio.run(dial("127.0.0.1", closed_port, timeout=2.0))
    finally:
        listener.close()
        closed.close()


# ---- the check between two real p2pd daemons ------------------------------------------------------------------


@contextlib.contextmanager
def _checker_and_asker() -> Iterator[tuple[NetworkRuntime, NetworkRuntime, Reachability]]:
    """A public DHT node serving dial-back checks, and a client-mode one connected to it (real p2pd daemons)."""
    from hivemind import DHT

    from locoswarm.node.swarm.reachability import ReachServer

    checker_dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    asker_dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                    initial_peers=[str(a) for a in checker_dht.get_visible_maddrs()])
    runtimes: list[NetworkRuntime] = []
    try:
        checker, asker = NetworkRuntime(checker_dht), NetworkRuntime(asker_dht)
        runtimes += [checker, asker]
        served = Reachability("auto")
        ReachServer(checker, served)
        yield checker, asker, served
    finally:
        for rt in runtimes:
            rt.stop()
        asker_dht.shutdown()
        checker_dht.shutdown()


@pytest.mark.timeout(120)
def test_a_peer_dials_back_the_port_it_was_told_at_the_address_the_connection_comes_from() -> None:
    with _checker_and_asker() as (checker, asker, served):
        listen_port = int(str(asker.dht.get_visible_maddrs()[0]).split("/tcp/")[1].split("/")[0])
        verdict = asker.call(check(asker, [checker.peer_id, asker.peer_id], listen_port), timeout=60)
        assert (verdict.reachable, verdict.unreachable, verdict.no_answer) == (1, 0, 0), verdict
        assert verdict.observed == [f"127.0.0.1:{listen_port}"]
        # the same requester again at once: refused (one check per CHECK_EVERY_S), not dialled
        again = asker.call(check(asker, [checker.peer_id], listen_port), timeout=60)
        assert again.no_answer == 1 and served.checks_served == 1


@pytest.mark.timeout(120)
def test_a_port_nobody_listens_on_is_reported_unreachable() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    try:
        with _checker_and_asker() as (checker, asker, _):
            verdict = asker.call(check(asker, [checker.peer_id], closed.getsockname()[1]), timeout=60)
            assert (verdict.reachable, verdict.unreachable) == (0, 1), verdict
            assert verdict.state == OUTBOUND_ONLY
    finally:
        closed.close()


def test_an_outbound_only_peer_serves_no_catch_up() -> None:
    from types import SimpleNamespace

    from tests.stand_ins import catch_up

    stub = catch_up(view=SimpleNamespace(outbound_peers=lambda: {"QmNatted"}))
    assert not stub.may_serve("QmNatted")
    assert stub.may_serve("QmPublic")
