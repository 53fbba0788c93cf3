"""Which versions a node believes (locoswarm.node.swarm.versions) and which payloads are replays
(locoswarm.node.swarm.replay): pure functions and small classes, no network."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from locoswarm.node.core.codecs import get_codec
from locoswarm.node.swarm.catchup import CatchUp
from locoswarm.node.swarm.replay import ReplayMemory, Seen, conclusive
from locoswarm.node.swarm.versions import (
    CAUGHT_S,
    LIE_MARGIN_S,
    LIES_BAN,
    LIES_IN_ONE,
    VERSION_SLACK,
    Belief,
    Claim,
    RoundClaims,
    absurd_version,
    believe,
    plausible_version,
    state_digest,
    version_bound,
)
from locoswarm.node.swarm.view import StateSource
from tests.stand_ins import catch_up


def _states(fetch: Callable, fetch_steps: Callable | None = None) -> SimpleNamespace:
    """A stand-in for the transport's ``StateSource``: ``fetch``, and ``fetch_steps`` (None: no replay served)."""
    return SimpleNamespace(fetch=fetch, fetch_steps=fetch_steps or (lambda *args: None))


def _transport(belief: Belief, states: StateSource | None = None, **kwargs) -> CatchUp:
    """A node's ``CatchUp`` (``tests.stand_ins.catch_up``) with ``belief`` as the heartbeats' and ``states`` as its
    state source: a fresh ``RoundClaims``, no reputation or suspicions."""
    return catch_up(states=states, view=SimpleNamespace(outbound_peers=set, latest_versions=lambda fragment: belief,
                                                        kin=lambda source, fragment: True), **kwargs)


def test_the_clock_bounds_the_versions_any_fragment_can_hold() -> None:
    # fixed schedule, H = 8: one slot per 8 steps, plus the slot at clock 0, plus the slack
    assert version_bound(0, 8) == 1 + VERSION_SLACK
    assert version_bound(80, 8) == 11 + VERSION_SLACK
    assert version_bound(80, 8, sends_per_h=2) == 21 + VERSION_SLACK  # adaptive: a fragment in every slot
    assert version_bound(-5, 8) == 1 + VERSION_SLACK
    bound = version_bound(800, 8)
    assert not absurd_version(bound + 1, bound) and not absurd_version(2 * bound, bound)
    assert absurd_version(bound + 1000, bound)  # the +1000 liar


def test_two_liars_above_the_clock_are_not_believed_and_the_majority_digest_picks_the_holders() -> None:
    honest = {f"h{i}": Claim(40, b"good") for i in range(3)}
    liars = {"x": Claim(1040, b"bad"), "y": Claim(1040, b"bad")}
    belief = believe({**honest, **liars}, bound=version_bound(320, 8))
    assert (belief.version, belief.digest, belief.holders) == (40, b"good", ["h0", "h1", "h2"])
    # without the bound, two corroborating liars would have been believed (the old rule)
    assert believe({**honest, **liars}).version == 1040
    # liars at the honest majority's version announce another digest: they are not asked
    belief = believe({**honest, "x": Claim(40, b"bad"), "y": Claim(40, b"bad")}, bound=1000)
    assert belief.digest == b"good" and set(belief.holders) == {"h0", "h1", "h2"}


def test_belief_needs_a_second_claimant_unless_there_is_only_one() -> None:
    assert believe({}).version == -1 and believe({}).holders == []
    assert believe({"a": Claim(7, b"d")}).version == 7   # a pair: its partner's claim stands
    belief = believe({"a": Claim(9, b"d"), "b": Claim(5, b"e"), "c": Claim(5, b"e")})
    assert belief.version == 5 and belief.holders == ["b", "c"]
    # a tie of digests is broken the same way on every node
    assert believe({"a": Claim(5, b"1"), "b": Claim(5, b"2")}).digest == b"2"


def test_plausible_version_of_a_groups_claims_drops_those_above_the_bound() -> None:
    claims = {"me": 10, "h": 10, "x": 1010, "y": 1010}
    assert plausible_version(claims, own="me") == 1010
    assert plausible_version(claims, own="me", bound=20) == 10


def test_the_state_digest_covers_phi_exactly_and_momentum_as_bf16() -> None:
    phi, momentum = torch.randn(1000), torch.randn(1000)
    d = state_digest(phi, momentum)
    assert len(d) == 16 and d == state_digest(phi.clone(), momentum.to(torch.bfloat16).float())
    assert d != state_digest(-phi, momentum)
    assert d != state_digest(phi, momentum * 2)


def test_a_chunk_seen_in_another_round_is_a_replay_the_same_round_is_not() -> None:
    codec = get_codec("fp4", 64)
    memory = ReplayMemory(max_entries=4)
    a, b = codec.encode(torch.randn(256)), codec.encode(torch.randn(256))
    memory.remember(0, 10, [a])
    assert memory.replayed(0, 10, [a]) == []           # two members' identical bytes in one round
    assert memory.replayed(0, 12, [a, b]) == [Seen(0, 10)]  # round 10's payload back in round 12
    assert memory.replayed(1, 10, [a]) == [Seen(0, 10)]     # or in another fragment
    # a contribution is no average: its replay is one offence; two chunks of an earlier average are conclusive
    assert not conclusive(memory.replayed(0, 12, [a, b]))
    c, d = codec.encode(torch.randn(256)), codec.encode(torch.randn(256))
    memory.remember(0, 11, [c, d], averaged=True)
    assert memory.replayed(0, 13, [c, d]) == [Seen(0, 11, True), Seen(0, 11, True)]
    assert conclusive(memory.replayed(0, 13, [c, d])) and not conclusive(memory.replayed(0, 13, [c, a]))
    # the reducer's own contribution of this round holds those bytes too: this round's, not a replay
    memory.remember(0, 13, [c])
    assert memory.replayed(0, 13, [c, d]) == [Seen(0, 11, True)]
    for k in range(5):                                      # bounded: the oldest is forgotten
        memory.remember(0, 20 + k, [codec.encode(torch.randn(256))])
    assert len(memory) == 4 and memory.replayed(0, 30, [a]) == []


def test_a_lone_newer_claim_is_unconfirmed_not_believed() -> None:
    """One peer a version or two ahead (an honest node a round ahead, or a liar within the bound): not believed,
    listed for a probe; a claim above the bound is neither."""
    claims = {"h0": Claim(40, b"g"), "h1": Claim(40, b"g"), "ahead": Claim(42, b"x"), "far": Claim(900, b"y")}
    belief = believe(claims, bound=50)
    assert belief.version == 40 and belief.holders == ["h0", "h1"]
    assert belief.unconfirmed == {"ahead": Claim(42, b"x")}


def test_the_transport_probes_a_lone_claimant_once_a_while() -> None:
    from locoswarm.node.swarm.catchup import PROBE_INTERVAL_S

    fetched, clock = [], [100.0]
    stub = _transport(Belief(40, b"g", ["h0"], {"ahead": Claim(42, b"x")}),
                      states=_states(lambda *args: fetched.append(args)), now=lambda: clock[0])
    assert stub.newest(0).version == 42
    stub.fetch(0)
    assert fetched == [(0, ["ahead"], 42, b"x")]
    assert stub.newest(0).version == 40  # probed: not again for a while
    clock[0] += PROBE_INTERVAL_S - 0.1
    assert stub.newest(0).version == 40
    clock[0] += 0.1
    assert stub.newest(0).version == 42


def test_a_holder_whose_steps_contradict_the_announced_digest_serves_no_state_of_that_catch_up() -> None:
    """A replay whose steps do not reach the digest the swarm's holders announce for the believed version is not
    taken, and its holder is not asked for the state either: a download serves its newest state, which no digest
    checks. The other holders are; with none left there is no catch-up. A replay that matches is taken as it is."""

    from locoswarm.node.core.transport import FragmentSnapshot, OuterStep

    def steps_from(source: str, after: bytes) -> FragmentSnapshot:
        empty = torch.zeros(0)
        return FragmentSnapshot(0, 40, empty, empty, source=source, base=38,
                                steps=(OuterStep(39, None, b"a", b"b"), OuterStep(40, None, b"b", after)))

    for holders, served, want in ((["h1", "liar"], "liar", [(0, ["h1"], 40, b"good")]),
                                  (["liar"], "liar", []),
                                  (["h1", "liar"], "h1", [])):
        fetched: list[tuple] = []
        stub = _transport(Belief(40, b"good", holders),
                          states=_states(lambda *args, fetched=fetched: fetched.append(args),
                                         lambda fragment, order, have, version, served=served: steps_from(
                                             served, b"good" if served == "h1" else b"forged")))
        got = stub.fetch(0, have=38)
        assert fetched == want, (holders, served)
        if served == "h1":
            assert got is not None and got.is_replay and got.source == "h1"
        elif not want:
            assert got is None


def test_holders_whose_rounds_named_the_version_serve_first() -> None:
    """Catch-ups ask the holders whose rounds named the believed version (or the one before) where there are any,
    before holders never met in a round (two colluders that just joined corroborate each other's claims); where
    none has named it, the others may serve."""

    from locoswarm.node.core.transport import FragmentSnapshot

    def transport(holders: list[str]) -> tuple[CatchUp, list[tuple]]:
        asked: list[tuple] = []

        def fetch(fragment: int, order: list[str], version: int, digest: bytes) -> FragmentSnapshot:
            asked.append((fragment, order, version, digest))
            return FragmentSnapshot(0, 41, torch.zeros(2), torch.zeros(2), source=order[0])

        return _transport(Belief(40, b"good", holders), states=_states(fetch)), asked

    stub, asked = transport(["seen", "stranger"])
    stub.round_claims.record(0, "seen", 39, now=time.monotonic())
    snap = stub.fetch(0)
    assert asked == [(0, ["seen"], 40, b"good")] and snap.source == "seen" and not snap.doubted
    stub, asked = transport(["seen", "stranger"])
    stub.fetch(0)  # nobody named it: both may serve
    assert asked and sorted(asked[0][1]) == ["seen", "stranger"]


def test_a_claim_its_claimants_rounds_contradict_is_not_believed_for_a_while() -> None:
    """``RoundClaims`` (rule 5): a member whose round, after its heartbeat claimed version 12, names version 10 was
    caught claiming a state it does not hold; its claims above its rounds' version + 1 are then doubted for
    ``CAUGHT_S``, even after its next round names 11. An honest member's heartbeat lags its rounds: a round naming
    the claimed version, one below it (a heartbeat published between a round's send and its stream), a newer one,
    or any round seen before the claim contradicts nothing. Members and fragments are apart."""
    rc = RoundClaims()
    rc.record(0, "liar", 10, now=5.0)          # a round before the claim was seen: no evidence either way
    assert not rc.doubted(0, "liar", 12, now=6.0)
    rc.record(0, "liar", 10, now=7.0)          # after it: two below the claim
    assert rc.doubted(0, "liar", 12, now=7.0)
    assert rc.caught(now=7.0) == [(0, "liar")]
    assert rc.doubted(0, "liar", 13, now=7.5)  # a newer claim, nothing named since: doubted while caught
    rc.record(0, "liar", 11, now=8.0)          # its version moved on; it still claims 13
    assert rc.doubted(0, "liar", 13, now=8.0)
    assert not rc.doubted(0, "liar", 12, now=8.5)   # 11 + 1: its rounds back that much
    # a claim first seen after its last round: no evidence against it, but doubted while the member stays caught
    assert rc.doubted(0, "liar", 13, now=9.0)
    assert not rc.doubted(0, "liar", 13, now=8.0 + CAUGHT_S + 1)
    assert not rc.doubted(1, "liar", 12, now=7.0)  # another fragment: nothing named there
    for named in (12, 11, 14):
        honest = RoundClaims()
        assert not honest.doubted(0, "honest", 12, now=6.0)
        honest.record(0, "honest", named, now=7.0)
        assert not honest.doubted(0, "honest", 12, now=7.0), named
        assert honest.caught(now=7.0) == []
    # whose rounds back holding a version: the version before it or newer named, or nothing named yet
    assert [rc.backs(0, "liar", v) for v in (11, 12, 13)] == [True, True, False]
    assert rc.backs(1, "liar", 99)
    small = RoundClaims(max_pairs=2)
    for i in range(3):
        small.doubted(i, "p", 9, now=0.5)
        small.record(i, "p", 1, now=1.0)
    assert not small.doubted(0, "p", 9, now=2.0)  # forgotten: the oldest pair went first
    assert small.doubted(2, "p", 9, now=2.0)


def test_claims_the_rounds_never_backed_are_lies_and_three_ban() -> None:
    """``RoundClaims.lies`` (rule 5): a member that claims two versions more than its rounds name tells a new lie
    with each claim its rounds then contradict, and ``LIES_BAN`` of them in one fragment within ``CAUGHT_S`` ban it
    (``RoundClaims.liar``). An honest member that follows its group down had named the claimed version in a round
    shortly before: caught (its claim is doubted) but no lie. Lies age out after ``CAUGHT_S``; members and
    fragments are apart."""
    liar = RoundClaims()
    t = 0.0
    for real in range(10, 10 + LIES_BAN):
        liar.record(0, "liar", real, now=t)
        # the claim is seen, nothing named since: no evidence, but doubted once the liar was caught
        assert liar.doubted(0, "liar", real + 2, now=t + 1) is (real > 10)
        liar.record(0, "liar", real, now=t + 2)                   # its next round names what it holds
        assert liar.doubted(0, "liar", real + 2, now=t + 3)
        assert liar.lies(0, "liar", now=t + 3) == real - 9
        t += 10.0
    assert liar.lies(0, "liar", now=t) == LIES_BAN and liar.liar("liar", now=t) == {0: LIES_BAN}
    assert liar.lies(1, "liar", now=t) == 0 and liar.lies(0, "other", now=t) == 0 and not liar.liar("other", now=t)
    assert liar.lies(0, "liar", now=t + CAUGHT_S) < LIES_BAN  # the first lies aged out
    assert not liar.liar("liar", now=t + CAUGHT_S)
    assert liar.doubted(0, "liar", 12, now=t + 4) is False    # a claim its rounds back (11 + 1) is no new lie
    assert liar.lies(0, "liar", now=t + 4) == LIES_BAN

    honest = RoundClaims()
    for drop in range(LIES_BAN + 1):  # it held each claim: named it, was seen claiming it, then took its group's
        v = 20 + 5 * drop
        honest.record(0, "honest", v, now=100.0 * drop)
        assert not honest.doubted(0, "honest", v, now=100.0 * drop + 1)
        honest.record(0, "honest", v - 3, now=100.0 * drop + 2)
        assert honest.doubted(0, "honest", v, now=100.0 * drop + 3)  # caught: its claim is doubted for a while
    assert honest.lies(0, "honest", now=100.0 * LIES_BAN + 3) == 0 and not honest.liar("honest")
    late = RoundClaims()  # a heartbeat read late: the round that named the claim came within LIE_MARGIN_S before
    late.record(0, "honest", 30, now=0.0)
    assert not late.doubted(0, "honest", 30, now=LIE_MARGIN_S - 1)
    late.record(0, "honest", 27, now=LIE_MARGIN_S)
    assert late.doubted(0, "honest", 30, now=LIE_MARGIN_S) and late.lies(0, "honest", now=LIE_MARGIN_S) == 0


def test_a_lie_is_judged_at_the_round_that_contradicted_it_not_when_the_node_asks() -> None:
    """A liar two versions ahead steps on: the round after its claim was seen names two below it, and its next
    round one below. A node that asks only after both (it reads claims at its own sends) still finds the lie: the
    claim is judged by the rounds up to the one that contradicted it. An honest member whose round named the claimed
    version before the contradicting one told none."""
    liar = RoundClaims()
    liar.record(0, "liar", 8, now=0.0)
    assert not liar.doubted(0, "liar", 12, now=1.0)   # seen
    liar.record(0, "liar", 10, now=2.0)               # contradicts it
    liar.record(0, "liar", 11, now=3.0)               # its next outer step: one below the claim
    assert not liar.doubted(0, "liar", 12, now=4.0)   # its rounds back 12 now (11 + 1): believed again ...
    assert liar.lies(0, "liar", now=4.0) == 1 and liar.caught(now=4.0) == [(0, "liar")]  # ... but it lied
    honest = RoundClaims()
    honest.doubted(0, "honest", 12, now=1.0)
    honest.record(0, "honest", 12, now=2.0)           # it held the version it claimed
    honest.record(0, "honest", 9, now=3.0)            # then took its group's, three below
    assert honest.doubted(0, "honest", 12, now=4.0) and honest.lies(0, "honest", now=4.0) == 0


def test_a_claim_dates_from_its_heartbeats_publication_not_from_when_it_was_read() -> None:
    """A liar publishes a claim two versions ahead of its state; its next round names its real version, and the
    round after that one more. A node that reads the heartbeat only after both rounds (tables are read every 2 s)
    finds the lie where the claim dates from the heartbeat's publication, and not where it dates from the read:
    then nothing after it contradicts it. A heartbeat dated after the read counts from the read. An honest member
    whose rounds back its claim told no lie, however early its claim is dated."""
    def read(published: float | None) -> RoundClaims:
        claims = RoundClaims()
        claims.record(0, "liar", 9, now=0.0)
        claims.record(0, "liar", 10, now=1.5)   # after its heartbeat of 12 at 1.0: two below the claim
        claims.record(0, "liar", 11, now=2.5)   # its next outer step: one below
        claims.doubted(0, "liar", 12, now=3.0, published=published)
        return claims

    assert read(published=1.0).lies(0, "liar", now=3.0) == 1
    assert read(published=None).lies(0, "liar", now=3.0) == 0
    assert read(published=9.0).lies(0, "liar", now=3.0) == 0  # dated ahead: seen at the read
    honest = RoundClaims()
    honest.record(0, "honest", 11, now=0.5)
    honest.record(0, "honest", 12, now=1.5)  # it holds what its heartbeat at 1.0 claims
    honest.doubted(0, "honest", 12, now=3.0, published=1.0)
    assert honest.lies(0, "honest", now=3.0) == 0 and not honest.doubted(0, "honest", 12, now=3.5)


def test_a_heartbeats_age_is_never_negative() -> None:
    from locoswarm.node.swarm.membership import _dht_time, heartbeat_age
    from locoswarm.protocol import swarm_pb2

    assert heartbeat_age(swarm_pb2.Heartbeat(time=_dht_time() + 60)) == 0.0
    assert 29 < heartbeat_age(swarm_pb2.Heartbeat(time=_dht_time() - 30)) < 31


def lie_once(claims: RoundClaims, fragment: int, member: str, real: int, t: float) -> None:
    """``member`` claims ``real`` + 2 of ``fragment`` at ``t``, and its next round names ``real``: one lie."""
    claims.doubted(fragment, member, real + 2, now=t)
    claims.record(fragment, member, real, now=t + 1)
    assert claims.doubted(fragment, member, real + 2, now=t + 2)


def test_lies_over_several_fragments_ban_where_one_fragment_holds_two_of_them() -> None:
    """``RoundClaims.liar`` (rule 5): a liar that claims two versions ahead in every fragment lies in each of them
    with each outer step, so its lies are counted over all fragments: ``LIES_BAN`` in all ban it once
    ``LIES_IN_ONE`` of them are in one fragment. An honest member that drops to its group's version unseen in every
    fragment at once (one lie in each, however many fragments) is not banned for it, nor for that twice in one
    fragment alone."""
    assert LIES_IN_ONE < LIES_BAN
    liar = RoundClaims()
    lie_once(liar, 0, "liar", 10, 0.0)
    lie_once(liar, 1, "liar", 20, 1.0)
    assert not liar.liar("liar", now=3.0)  # one lie in each of two fragments
    lie_once(liar, 0, "liar", 11, 4.0)
    assert liar.liar("liar", now=6.0) == {0: 2, 1: 1}
    assert not liar.liar("liar", now=4.0 + CAUGHT_S + 1)  # they age out as in one fragment
    honest = RoundClaims()
    for f in range(8):  # one unseen drop in each of 8 fragments: LIES_BAN lies in all, none two in one fragment
        lie_once(honest, f, "honest", 30, float(f))
    assert sum(honest.lies(f, "honest", now=10.0) for f in range(8)) == 8 and not honest.liar("honest", now=10.0)
    twice = RoundClaims()
    lie_once(twice, 0, "honest", 30, 0.0)
    lie_once(twice, 0, "honest", 40, 50.0)
    assert twice.lies(0, "honest", now=60.0) == LIES_IN_ONE and not twice.liar("honest", now=60.0)


@pytest.mark.parametrize("served_bad_state", [False, True])
def test_the_node_bans_a_claimant_whose_rounds_never_back_its_claims(served_bad_state: bool) -> None:
    """The daemon's belief (``Node.latest_versions``) skips a doubted claim, and refuses its claimant as a
    ``version_claim`` offence that bans once ``LIES_BAN`` of its claims were lies; an honest holder whose rounds
    name what it claims keeps being believed. A claimant that served this node a bad state is not believed, and its
    claims are still held against its rounds: it is banned for its lies all the same."""
    import time

    from locoswarm.node.daemon import Node
    from locoswarm.node.swarm.membership import _dht_time
    from locoswarm.node.swarm.reputation import Reputation

    def heartbeat(version: int) -> SimpleNamespace:
        return SimpleNamespace(has_state=True, reachability="public", time=_dht_time(),
                               fragments=[SimpleNamespace(fragment=0, version=version, digest=b"d")])

    claims = RoundClaims()
    node = SimpleNamespace(peer_table={}, reputation=Reputation(), transport=SimpleNamespace(round_claims=claims),
                           version_bound=lambda: 10_000,
                           cfg=SimpleNamespace(network=SimpleNamespace(heartbeat_interval=2.0)))
    node.outbound_peers = lambda: Node.outbound_peers(node)
    if served_bad_state:
        node.reputation.refuse("QmLiar", "bad_state", "effect: 4x worse", forgivable=False)
    for real in range(10, 10 + LIES_BAN):
        node.peer_table = {"QmLiar": heartbeat(real + 2), "QmHonest": heartbeat(real), "QmOther": heartbeat(real)}
        Node.latest_versions(node, 0)  # the claims are seen
        time.sleep(0.002)
        claims.record(0, "QmLiar", real)
        claims.record(0, "QmHonest", real)
        belief = Node.latest_versions(node, 0)
        assert belief.version == real and "QmLiar" not in belief.holders
    assert node.reputation.is_banned("QmLiar") and not node.reputation.is_banned("QmHonest")
    kinds = {"version_claim": 1, "bad_state": 1} if served_bad_state else {"version_claim": 1}
    assert node.reputation.snapshot()["peers"]["QmLiar"]["by_kind"] == kinds


def test_a_holder_is_kin_where_it_announces_this_nodes_other_fragments() -> None:
    """``Node.kin`` (``FragmentSnapshot.kin``): a holder's heartbeat announces this node's published version and
    digest of every fragment but the one downloaded, or a version one apart; the same version with another digest
    (another lineage), two versions apart, or no heartbeat is not."""

    from locoswarm.node.daemon import Node

    def heartbeat(*fragments: tuple[int, int, bytes]) -> SimpleNamespace:
        return SimpleNamespace(fragments=[SimpleNamespace(fragment=f, version=v, digest=d) for f, v, d in fragments])

    node = SimpleNamespace(published={0: SimpleNamespace(version=10), 1: SimpleNamespace(version=20)},
                           _digests={0: b"a", 1: b"b"}, peer_table={})
    cases = {"same": ((0, 11, b"x"), (1, 20, b"b")), "ahead": ((0, 11, b"x"), (1, 21, b"y")),
             "lineage": ((0, 11, b"x"), (1, 20, b"z")), "far": ((0, 11, b"x"), (1, 22, b"y")),
             "missing": ((0, 11, b"x"),)}
    node.peer_table = {peer: heartbeat(*fs) for peer, fs in cases.items()}
    assert {peer: Node.kin(node, peer, 0) for peer in [*cases, "stranger"]} == {
        "same": True, "ahead": True, "lineage": False, "far": False, "missing": False, "stranger": False}
    assert Node.kin(node, "lineage", 1)  # downloading fragment 1: its fragment 0 is one version apart from ours
