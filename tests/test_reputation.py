"""Per-peer reputation (node/swarm/reputation.py): offences, bans with a cool-down, bounded memory."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from locoswarm.node.swarm.reputation import Reputation

pytestmark = pytest.mark.timeout(60)

A, B = "QmAttacker" + "a" * 36, "QmHonest" + "b" * 38


class Clock:
    """A fake monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, **kw) -> Reputation:
    return Reputation(now=clock, log=logging.getLogger("test.reputation"), **kw)


def test_threshold_bans_and_snapshot_says_so(clock):
    rep = make(clock, threshold=3, cooldown_s=60, window_s=100)
    assert rep.refuse(A, "bad_weight", "token weight 1e30 above the bound") is False
    assert rep.refuse(A, "non_member", "part for fragment 0 round 12 from a non-member") is False
    assert not rep.is_banned(A) and rep.banned() == []
    assert rep.refuse(A, "bad_weight", "again") is True
    assert rep.is_banned(A) and rep.banned() == [A] and not rep.is_banned(B)
    clock.advance(15)
    snap = rep.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert snap["refused"] == 3 and snap["banned"] == 1
    peer = snap["peers"][A]
    assert peer["refused"] == 3 and peer["offences"] == 3 and peer["banned"] is True
    assert peer["by_kind"] == {"bad_weight": 2, "non_member": 1}
    assert peer["banned_for_s"] == pytest.approx(45.0)
    assert peer["last"] == "bad_weight: again"


def test_a_conclusive_offence_bans_at_once_and_a_refusal_that_is_no_offence_never_does(clock):
    rep = make(clock, threshold=3, cooldown_s=60, window_s=100)
    assert rep.refuse(A, "forged_sender", "not an offence here", offence=False, conclusive=True) is False
    assert rep.refuse(A, "forged_sender", "an ordinary offence") is False
    assert not rep.is_banned(A)
    assert rep.refuse(A, "forged_sender", "header names sender QmB on A's stream", conclusive=True) is True
    assert rep.is_banned(A) and not rep.is_banned(B)
    assert rep.refuse(A, "forged_sender", "again, while banned", conclusive=True) is False  # one ban, logged once
    clock.advance(61)
    assert not rep.is_banned(A)
    assert rep.refuse(A, "bad_contribution", "NaN after the cool-down", conclusive=True) is True  # banned anew
    clock.advance(100)
    assert rep.is_banned(A)


def test_offences_older_than_the_window_expire(clock):
    rep = make(clock, threshold=3, cooldown_s=60, window_s=100)
    rep.refuse(A, "bad_weight", "token weight 1e30")
    clock.advance(60)
    rep.refuse(A, "bad_weight", "token weight 1e30")
    clock.advance(41)  # the first offence is now 101 s old
    assert rep.snapshot()["peers"][A]["offences"] == 1
    assert rep.refuse(A, "bad_weight", "token weight 1e30") is False and not rep.is_banned(A)
    assert rep.refuse(A, "bad_weight", "token weight 1e30") is True  # three within the window
    assert rep.snapshot()["peers"][A]["refused"] == 4


def test_one_offence_of_a_kind_is_remembered_for_the_window_without_a_ban(clock):
    rep = make(clock, threshold=3, window_s=60)
    rep.refuse(A, "bad_state", "phi at 0 has 4 non-finite value(s)")
    rep.refuse(B, "rate", "too many requests", offence=False)
    assert rep.offended(A, "bad_state") and not rep.is_banned(A)
    assert not rep.offended(A, "bad_part") and not rep.offended(B, "rate") and not rep.offended("QmNobody", "x")
    clock.advance(61)
    assert not rep.offended(A, "bad_state")


def test_ban_ends_after_the_cool_down(clock):
    rep = make(clock, threshold=2, cooldown_s=60, window_s=30)
    rep.refuse(A, "bad_state", "NaN phi")
    assert rep.refuse(A, "bad_state", "NaN phi")
    clock.advance(59.9)
    assert rep.is_banned(A)
    clock.advance(0.2)
    assert not rep.is_banned(A) and rep.banned() == []
    peer = rep.snapshot()["peers"][A]
    assert peer["banned"] is False and peer["banned_for_s"] == 0.0 and peer["refused"] == 2


def test_repeat_offender_cool_down_doubles_up_to_the_cap(clock):
    rep = make(clock, threshold=2, cooldown_s=60, window_s=1000, max_cooldown_s=200)
    lengths = []
    for _ in range(4):
        rep.refuse(A, "impossible_clock", "clock jumped by 10000")
        assert rep.refuse(A, "impossible_clock", "clock jumped by 10000")
        lengths.append(rep.snapshot()["peers"][A]["banned_for_s"])
        clock.advance(lengths[-1] + 1)
        assert not rep.is_banned(A)
    assert lengths == [60, 120, 200, 200]
    clock.advance(201)  # clean for longer than the cap: a first offender again
    rep.refuse(A, "impossible_clock", "x")
    assert rep.refuse(A, "impossible_clock", "x")
    assert rep.snapshot()["peers"][A]["banned_for_s"] == 60


def test_a_new_ban_needs_fresh_offences(clock):
    """Offences that earned a ban (or came during it) do not earn the next one."""
    rep = make(clock, threshold=2, cooldown_s=10, window_s=1000)
    rep.refuse(A, "oversize", "stream of 600 MiB")
    assert rep.refuse(A, "oversize", "stream of 600 MiB")
    assert rep.refuse(A, "oversize", "again, while banned") is False  # counted, no second ban
    assert rep.snapshot()["peers"][A]["offences"] == 3
    clock.advance(11)
    assert rep.refuse(A, "oversize", "after the ban") is False and not rep.is_banned(A)
    assert rep.refuse(A, "oversize", "after the ban") is True


def test_non_offence_refusals_never_ban(clock):
    rep = make(clock, threshold=2, cooldown_s=60, window_s=100)
    for _ in range(50):
        assert rep.refuse(A, "rate_limited", "state download too soon", offence=False) is False
    assert not rep.is_banned(A)
    peer = rep.snapshot()["peers"][A]
    assert peer["refused"] == 50 and peer["offences"] == 0 and peer["by_kind"] == {"rate_limited": 50}


def test_the_ban_is_logged_once_as_one_line(clock, caplog):
    rep = make(clock, threshold=2, cooldown_s=60, window_s=100)
    with caplog.at_level(logging.DEBUG, logger="test.reputation"):
        rep.refuse(A, "bad_weight", "token weight 1e30")
        rep.refuse(A, "non_member", "not in group\nsecond line")
        for _ in range(10):
            rep.refuse(A, "banned", "part refused: peer is banned", offence=False)
            rep.refuse(A, "bad_weight", "still at it")
    records = [r for r in caplog.records if r.name == "test.reputation"]
    assert len(records) == 1, [r.getMessage() for r in records]
    line = records[0].getMessage()
    assert "\n" not in line and A in line and "60 s" in line
    assert "bad_weight=1" in line and "non_member=1" in line
    assert rep.snapshot()["peers"][A]["refused"] == 22


def test_memory_is_bounded(clock):
    rep = make(clock, threshold=2, cooldown_s=60, window_s=100, max_peers=4)
    rep.refuse(A, "bad_contribution", "norm 1e30")
    rep.refuse(A, "bad_contribution", "norm 1e30")  # banned: kept while others come and go
    for i in range(100):
        rep.refuse(f"Qm{i:04d}", "protocol", "x" * 10_000, offence=False)
    snap = rep.snapshot()
    assert len(snap["peers"]) == 4 and A in snap["peers"] and "Qm0099" in snap["peers"]
    assert "Qm0000" not in snap["peers"] and rep.is_banned(A)
    assert snap["refused"] == 102  # the total keeps the forgotten peers' refusals
    assert all(len(p["last"]) <= 200 and "\n" not in p["last"] for p in snap["peers"].values())
    long_id = "Q" * 100_000
    rep.refuse(long_id, "k" * 1000, "d")
    assert rep.refuse(long_id, "k", "d") and rep.is_banned(long_id)  # tracked under its bounded key
    peers = rep.snapshot()["peers"]
    assert max(map(len, peers)) <= 128 and all(len(k) <= 32 for p in peers.values() for k in p["by_kind"])


def test_least_recently_seen_peer_is_forgotten_first(clock):
    rep = make(clock, max_peers=3)
    for peer in ("Qm1", "Qm2", "Qm3"):
        rep.refuse(peer, "protocol", "x", offence=False)
    rep.refuse("Qm1", "protocol", "x", offence=False)  # Qm2 is now the least recently seen
    rep.refuse("Qm4", "protocol", "x", offence=False)
    assert sorted(rep.snapshot()["peers"]) == ["Qm1", "Qm3", "Qm4"]


def test_many_kinds_fold_into_other(clock):
    rep = make(clock)
    for i in range(100):
        rep.refuse(A, f"kind{i}", "x", offence=False)
    by_kind = rep.snapshot()["peers"][A]["by_kind"]
    assert len(by_kind) <= 33 and sum(by_kind.values()) == 100 and by_kind["other"] == 100 - 32


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Reputation(threshold=0)
    with pytest.raises(ValueError):
        Reputation(cooldown_s=0)


def test_threads_share_one_reputation():
    """The network and training threads call it at once: counts add up, one ban per peer, no exception."""
    rep = Reputation(threshold=50, cooldown_s=600, window_s=600, max_peers=64)
    bans: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(n: int) -> None:
        try:
            barrier.wait(5)
            for i in range(2000):
                peer = f"Qm{i % 40}"
                if rep.refuse(peer, "bad_contribution", f"thread {n} part {i}"):
                    bans.append(peer)
                rep.is_banned(peer)
                if i % 100 == 0:
                    rep.snapshot()
                    rep.banned()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    snap = rep.snapshot()
    assert snap["refused"] == 8000 and sum(p["refused"] for p in snap["peers"].values()) == 8000
    assert sorted(bans) == sorted(f"Qm{i}" for i in range(40)) and snap["banned"] == 40


def test_a_mean_agreement_below_the_bound_over_a_full_window_bans_at_once() -> None:
    """Statistical evidence: one bad score weighs nothing, four with a mean below the bound are a conclusive
    offence; the evidence is spent on that ban (a later one needs a full window anew)."""
    rep = Reputation(threshold=3)
    kw = {"window": 4, "ban_below": -0.1, "good_from": 0.1}
    assert not any(rep.judge("honest", "direction", s, **kw) for s in (0.3, -0.26, 0.1, 0.02, 0.4, -0.05))
    assert not rep.is_banned("honest")
    banned = [rep.judge("flip", "direction", s, **kw) for s in (-0.3, -0.2, -0.35, -0.25)]
    assert banned == [False, False, False, True] and rep.is_banned("flip")
    snap = rep.snapshot()["peers"]
    assert snap["flip"]["first_banned"] is not None and snap["honest"]["first_banned"] is None
    assert snap["honest"]["scores"]["direction"] > 0


def test_good_judgements_forgive_old_offences_but_buy_no_slack() -> None:
    """Every FORGIVE_AFTER good judgements in a row take back one old non-conclusive offence; a sleeper with a
    long good record is banned as fast as a stranger once its offences come (forgiveness never pre-pays)."""
    from locoswarm.node.swarm.reputation import FORGIVE_AFTER

    rep = Reputation(threshold=3)
    rep.refuse("unlucky", "bad_reduction", "once")
    rep.refuse("unlucky", "bad_reduction", "twice")
    for _ in range(FORGIVE_AFTER):
        rep.good("unlucky")
    assert rep.snapshot()["peers"]["unlucky"]["offences"] == 1
    assert not rep.refuse("unlucky", "bad_reduction", "again")  # 2 of 3: not banned
    sleeper = Reputation(threshold=3)
    sleeper.refuse("s", "other", "to create its record")
    for _ in range(10 * FORGIVE_AFTER):
        sleeper.good("s")
    assert [sleeper.refuse("s", "bad_effect", "turned") for _ in range(3)] == [False, False, True]


def test_good_rounds_do_not_take_back_an_offence_of_other_evidence() -> None:
    """An offence refused with ``forgivable=False`` (a state the effect check blamed) stays through any number of
    good judgements (of rounds), counts toward the ban, and still leaves with the window."""
    from locoswarm.node.swarm.reputation import FORGIVE_AFTER

    clock = [0.0]
    rep = Reputation(threshold=3, window_s=100.0, now=lambda: clock[0])
    rep.refuse("liar", "bad_state", "served noise", forgivable=False)
    rep.refuse("liar", "bad_reduction", "a late part")
    for _ in range(4 * FORGIVE_AFTER):
        rep.good("liar")
    assert rep.snapshot()["peers"]["liar"]["offences"] == 1 and rep.offended("liar", "bad_state")
    assert not rep.refuse("liar", "bad_state", "served noise again", forgivable=False)
    assert rep.refuse("liar", "bad_state", "and again", forgivable=False) and rep.is_banned("liar")
    once = Reputation(threshold=3, window_s=100.0, now=lambda: clock[0])
    once.refuse("peer", "bad_state", "served noise", forgivable=False)
    clock[0] = 101.0
    assert not once.offended("peer", "bad_state")  # the window still forgets it


def test_accumulated_evidence_bans_a_far_outlier_sooner_and_an_honest_dip_never() -> None:
    """With ``accumulate`` the sum of the last 2..window scores is held against window x bound: two scores far
    below the bound ban, a near one needs the full window, and one bad score alone (or an honest dip between
    good ones) never does."""
    rep = Reputation(threshold=3)
    kw = {"window": 4, "ban_below": -0.1, "good_from": 0.1, "accumulate": True}
    assert [rep.judge("far", "direction", s, **kw) for s in (-0.25, -0.3)] == [False, True]
    assert "over its last 2" in rep.snapshot()["peers"]["far"]["last"]
    assert [rep.judge("near", "direction", s, **kw) for s in (-0.12, -0.11, -0.1, -0.12)] == [False, False, False, True]
    assert not rep.judge("once", "direction", -0.9, **kw)  # a single score weighs nothing
    assert not any(rep.judge("honest", "direction", s, **kw) for s in (0.3, -0.26, 0.1, -0.12, 0.2, 0.02, 0.4, -0.05))
    assert not rep.is_banned("honest") and not rep.is_banned("once")
    plain = Reputation(threshold=3)  # without accumulation the same far scores need a full window
    assert [plain.judge("far", "direction", s, window=4, ban_below=-0.1, good_from=0.1)
            for s in (-0.25, -0.3, -0.25, -0.3)] == [False, False, False, True]
