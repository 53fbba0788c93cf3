"""Catching up: which version of a fragment to reach, from whom, and whether a peer may serve this node state at all.

A node behind its swarm (it joined, a round failed, it was offline) asks ``CatchUp.newest`` which version to reach
and who holds it: the heartbeats' corroborated belief (``locoswarm.node.swarm.versions``), or the version the group
of its last merged round reached where that is newer (heartbeats lag behind fast rounds), or a probe of a lone newer
claim. ``fetch`` replays the steps from the node's own version where a holder keeps them and they lead to the digest
the swarm's holders announce, else downloads the state (``locoswarm.node.swarm.state_sync`` through a
``StateSource``); ``start`` does it in a background thread. A peer serves no catch-up while this node bans it,
refused a state of its, suspects it by its own judgements, muted it for its standing drift, or cannot dial it
(``may_serve``): a phi is no better evidence of the swarm's than the rounds its holder took part in.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from locoswarm.node.core.persistence import DeviationMemory
from locoswarm.node.core.step_log import REPLAY_DEPTH
from locoswarm.node.core.transport import FetchHandle, FragmentSnapshot
from locoswarm.node.swarm.dial_failures import DialFailures
from locoswarm.node.swarm.judging import MAX_TRACKED, SourcePauses
from locoswarm.node.swarm.offences import OffenceBook
from locoswarm.node.swarm.versions import Belief, RoundClaims, state_digest
from locoswarm.node.swarm.view import StateSource, SwarmView

if TYPE_CHECKING:  # pragma: no cover
    from locoswarm.node.swarm.reputation import Reputation

log = logging.getLogger("locoswarm.averaging")

NO_REPLAY_S = 60.0  # after a replay the core could not take, a fragment's catch-ups download the state this long
# The judged kinds whose scores, leaning against a peer (``Reputation.suspects``), keep it from serving this node a
# catch-up (``CatchUp.may_serve``) before any ban: the directions of its contributions and of its reduced
# parts. Why: two drifting colluders with two honest nodes merged rounds between themselves, so their versions ran
# ahead; an honest node caught up from one of them six times in 10 s, each phi measured 0.4-6% worse than its own
# (inside the snapshot slack), and its eval rose 13.5% above the clean run's before the reducer's turned parts
# banned it (robustness bench, 2 + 2 drift, 74dfbf2). A suspect's phi is no better evidence of the swarm's than its
# parts were: the node stays on its own lineage (or takes another holder's) until the suspicion clears or bans.
SUSPECT_SOURCE = ("direction", "reduction", "reduction_other_phi")
# ... for as long as that suspicion is renewed: once the newest of those scores is older than SUSPECT_SOURCE_S the
# peer may serve catch-ups again. A node on a lineage of its own meets the suspect in no round, so nothing would
# ever clear the suspicion, and with every holder suspected it never rejoins (a CI run of the low-rank joiner test
# held one honest node 140 versions behind the other two for the test's last 120 s; its log did not show why, and
# this is one of the two rules that could hold it there for good, with ``outer_loop.FOLDED_SLACK``). An attacker in
# this node's rounds is judged at every one of them (seconds apart), so its suspicion stays fresh.
SUSPECT_SOURCE_S = 60.0
REFUSED_SOURCE_S = 120.0     # a peer whose state this node refused as malformed is not asked again for this long
WORSE_SOURCE_S = 20.0        # ... and one whose state merely measured worse than ours (``may_serve``)
PROBE_INTERVAL_S = 60.0      # a lone newer claim is probed at most this often per claimant (``newest``)


def holder_order(own: str, fragment: int, holders: Sequence[str]) -> list[str]:
    """The order in which ``own`` asks ``holders`` for a fragment: a hash of the pair (rendezvous hashing), so
    that nodes catching up at once start with different holders instead of all with the first one listed."""
    def rank(holder: str) -> bytes:
        return hashlib.blake2b(f"{own}/{fragment}/{holder}".encode(), digest_size=8).digest()

    return sorted(holders, key=rank)


class _BackgroundFetch(FetchHandle):
    """A download in the fetch thread. Its snapshot is handed over only where its source is still one this node
    takes state from (``still_source``: ``CatchUp.may_serve``) when the download lands: a 2 + 2 drift
    run had an honest node adopt a drifter's phi, 36% worse than its own, one second after banning that drifter
    (the download had started before the ban), and the other honest node then caught up from it (robustness
    bench, 22683e6)."""

    def __init__(self, future: concurrent.futures.Future, still_source: Callable[[str], bool]) -> None:
        super().__init__(None)
        self._future = future
        self._still_source = still_source

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> FragmentSnapshot | None:
        if self._future.cancelled():
            return None
        if self._future.exception() is not None:
            log.info("state download failed: %r", self._future.exception())
            return None
        snapshot = self._future.result()
        if snapshot is not None and snapshot.source and not self._still_source(snapshot.source):
            log.info("state download of fragment %d from %s discarded: this node stopped taking state from its "
                     "source while it downloaded (a ban, or a part of its refused)", snapshot.fragment,
                     snapshot.source[:12])
            return None
        return snapshot


class CatchUp:
    """A node's catch-ups (module docstring).

    Args:
        peer_id: this node's.
        view: the swarm as this node sees it (``SwarmView``: its version belief, outbound peers, kin).
        states: where a catch-up downloads a fragment's state or replays its steps (``StateSource``).
        reputation: bans, offences and suspicions (None: nobody is banned or suspected).
        book: where a refused state's offence is counted (``reject_snapshot``).
        round_claims: what members' round headers named of their versions (backs or refutes a holder's claim).
        pauses: the catch-up sources paused for a while (shared with the judge of reduced parts).
        dial_failures: peers this node could not dial lately.
        deviations: whom this node mutes for their standing drift.
        now: the clock of probes and replay pauses (seconds; tests pass their own).
    """

    def __init__(self, peer_id: str, *, view: SwarmView, states: StateSource, reputation: Reputation | None,
                 book: OffenceBook, round_claims: RoundClaims, pauses: SourcePauses, dial_failures: DialFailures,
                 deviations: DeviationMemory, now: Callable[[], float] = time.monotonic) -> None:
        self.peer_id = peer_id
        self.now = now
        self.view = view
        self.states = states
        self.reputation = reputation
        self.book = book
        self.round_claims = round_claims
        self.pauses = pauses
        self.dial_failures = dial_failures
        self.deviations = deviations
        # fragment -> (version the group reached in its last successful round, its members): heartbeats
        # lag behind fast rounds, so this is how a member that missed a round learns it is behind.
        self.recent: dict[int, tuple[int, list[str]]] = {}
        self._probed: dict[tuple[int, str], float] = {}  # (fragment, peer) -> when this node last asked it
        self._no_replay: dict[int, float] = {}  # fragment -> until when its catch-ups download the state instead
        self._fetcher: concurrent.futures.ThreadPoolExecutor | None = None

    def merged(self, fragment: int, version: int, group: list[str]) -> None:
        """A round of ``fragment`` merged at ``version`` with ``group``: a newer version than the heartbeats say
        is held by its members."""
        if version >= self.recent.get(fragment, (-1, []))[0]:
            self.recent[fragment] = (version, group)

    def close(self) -> None:
        """Stop the fetch thread (a download under way is cancelled)."""
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)

    def may_serve(self, peer: str) -> bool:
        """Whether ``peer`` may serve this node a catch-up: not banned, not an offender by its state
        (``Reputation.offended``: a liar that was a group member serves NaN under an honest version), not suspected
        by this node's own recent judgements of its contributions and reduced parts (``SUSPECT_SOURCE``), and no state
        of its refused lately, else a node would download it again at every send: for ``REFUSED_SOURCE_S`` after a
        malformed one, for ``WORSE_SOURCE_S`` after one the effect check found worse than ours. The latter is
        short because an honest swarm's phi moves every round: a node that refused the others' phi while a bad
        average had set them back (seen: 3.34 against its own 1.08, with a low-rank joiner) stays on a phi of
        its own until it asks again. A reducer whose part this node refused pauses for ``TURNED_SOURCE_S``. With a
        drift ceiling, a peer this node muted round after round for its standing drift serves none
        (``DeviationMemory.drifting``). Nor does a peer nobody, or this node, can dial (outbound only, or listed by
        ``dial_failures``): a download from it would only wait for the dial to fail."""
        if self.pauses.paused(peer):
            return False
        if peer in self.view.outbound_peers():  # nobody can dial it: a download from it would only time out
            return False
        if peer in self.dial_failures.peers():  # this node could not dial it lately (``dial_failures``)
            return False
        if self.deviations.drifting(peer):  # with a drift ceiling: its phi carries the drift it spread
            return False
        return self.reputation is None or not (self.reputation.is_banned(peer)
                                               or self.reputation.offended(peer, "bad_state")
                                               or self.reputation.suspects(peer, SUSPECT_SOURCE,
                                                                          within_s=SUSPECT_SOURCE_S))

    def newest(self, fragment: int) -> Belief:
        """The version of ``fragment`` to catch up to and whom to ask: the heartbeats' belief
        (``locoswarm.node.swarm.versions``), or the version the group of its last merged round reached when
        that is newer (heartbeats lag behind fast rounds; no digest is announced for it yet), or a probe of a
        newer claim nobody corroborates (at most one per claimant every ``PROBE_INTERVAL_S``)."""
        belief = self.view.latest_versions(fragment)
        now = self.now()
        for peer, claim in sorted(belief.unconfirmed.items()):
            if self.may_serve(peer) and now - self._probed.get((fragment, peer), -math.inf) >= PROBE_INTERVAL_S:
                return Belief(claim.version, claim.digest, [peer])
        recent_version, members = self.recent.get(fragment, (-1, []))
        others = [m for m in members if m != self.peer_id and self.may_serve(m)]
        holders = [h for h in belief.holders if self.may_serve(h)]
        # a holder whose own rounds name an older version serves a state of its making (``versions``, rule 5):
        # none whose round said so lately (two colluding liars corroborate each other's claims, and in a 4 + 2
        # robustness bench run they were the only holders: honest nodes took 3 to 7 catch-ups from them each, up
        # to 14% worse than their own phi, before the liars' claims were caught); the backed ones where any are
        holders = [h for h in holders if not self.round_claims.refutes(fragment, h, belief.version)]
        # ... and of the others, those whose rounds named the version (or the one before) first, then those never
        # met in a round: two colluders that just joined corroborate each other before any round of theirs is seen
        holders = ([h for h in holders if self.round_claims.proves(fragment, h, belief.version)]
                   or [h for h in holders if self.round_claims.backs(fragment, h, belief.version)] or holders)
        if recent_version > belief.version and others:
            return Belief(recent_version, b"", others)
        if recent_version == belief.version and not belief.digest:
            holders = holders + [m for m in others if m not in holders]
        return Belief(belief.version, belief.digest, holders)

    def latest_version(self, fragment: int) -> int:
        return self.newest(fragment).version

    def fetch(self, fragment: int, have: int | None = None) -> FragmentSnapshot | None:
        """A catch-up of ``fragment``: a replay of the steps from ``have`` where that is possible (at most
        ``REPLAY_DEPTH`` versions behind, a holder that keeps them: ``_replay``), else the state."""
        belief = self.newest(fragment)
        if not belief.holders:
            return None
        for peer in belief.holders:  # a probe's claimant is not probed again for a while, whatever it serves
            self._probed[(fragment, peer)] = self.now()
        while len(self._probed) > MAX_TRACKED:
            self._probed.pop(next(iter(self._probed)))
        order = holder_order(self.peer_id, fragment, belief.holders)
        snapshot, contradicted = self._replay(fragment, order, have, belief)
        if snapshot is None:
            # A holder whose own steps do not reach the digest the swarm's holders announce for the version holds
            # another state there, whatever its heartbeat says, and a download serves its newest state, which no
            # digest can check: ask the others only. (A replay liar, robustness bench, served its forged state this
            # way right after its steps failed the check: 6-7% worse than the node's own phi, taken.)
            order = [h for h in order if h != contradicted]
            if not order:
                log.info("catching up: fragment %d to v%d: no other holder; not now", fragment, belief.version)
                return None
            log.info("catching up: fragment %d to v%d from %s", fragment, belief.version,
                     ", ".join(h[:12] for h in order))
            snapshot = self.states.fetch(fragment, order, belief.version, belief.digest)
        if snapshot is not None and snapshot.source:
            snapshot.doubted = self.deviations.muted_lately(snapshot.source)
            snapshot.kin = self.view.kin(snapshot.source, fragment)
        return snapshot

    def _replay(self, fragment: int, holders: list[str], have: int | None,
                belief: Belief) -> tuple[FragmentSnapshot | None, str | None]:
        """The steps from ``have`` to the believed version (``locoswarm.node.core.step_log``), checked as the core
        replays them against the digests the holder sent with them and, where the swarm's holders announce one,
        the digest of the believed version; None where a replay is not possible or not worth asking. With it, the
        holder whose steps contradicted the announced digest, if one did."""
        if (have is None or not 0 < belief.version - have <= REPLAY_DEPTH
                or self.now() < self._no_replay.get(fragment, -math.inf)):
            return None, None
        snapshot = self.states.fetch_steps(fragment, holders, have, belief.version)
        if snapshot is None:
            return None, None
        claimed = {have: snapshot.steps[0].before, **{s.version: s.after for s in snapshot.steps}}
        if belief.digest and claimed.get(belief.version) != belief.digest:
            log.info("replay of fragment %d from %s: its steps do not lead to the state the swarm's holders announce "
                     "for v%d; not asking it for the state", fragment, snapshot.source[:12],
                     belief.version)
            return None, snapshot.source

        def verify(version: int, phi: torch.Tensor, momentum: torch.Tensor) -> bool:
            return state_digest(phi, momentum) == claimed.get(version)

        log.info("catching up: fragment %d from v%d to v%d by replaying %d step(s) from %s", fragment, have,
                 snapshot.version, len(snapshot.steps), snapshot.source[:12])
        return replace(snapshot, verify=verify), None

    def reject_replay(self, snapshot: FragmentSnapshot, reason: str) -> None:
        """A replay the core could not take: the next catch-ups of its fragment download the state for a while
        (a digest that does not match is nobody's proven fault: another device's arithmetic, a step of its own)."""
        log.info("replay of fragment %d from %s not taken: %s; downloading the state instead for %.0f s",
                 snapshot.fragment, snapshot.source[:12], reason, NO_REPLAY_S)
        self._no_replay[snapshot.fragment] = self.now() + NO_REPLAY_S

    def start(self, fragment: int, have: int | None = None) -> FetchHandle:
        """Download in a background thread (one at a time: they share the link): a catch-up of a few MB
        over a slow link took seconds, and blocking training for it made the node late to its next round
        too, so it caught up again, and again (issue 10: catch-up loops at 5 Mbit/s)."""
        if self._fetcher is None:
            self._fetcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="locoswarm-fetch")
        return _BackgroundFetch(self._fetcher.submit(self.fetch, fragment, have), self.may_serve)

    def reject_snapshot(self, snapshot: FragmentSnapshot, reason: str, *, offence: bool = True,
                        conclusive: bool = False) -> None:
        if snapshot.source:
            # a state is other evidence than rounds: good rounds do not take its offence back (``reputation``)
            self.book.refuse(snapshot.source, "bad_state" if offence else "worse_state", reason, offence=offence,
                          conclusive=conclusive, forgivable=False)
            self.pauses.pause(snapshot.source, REFUSED_SOURCE_S if offence else WORSE_SOURCE_S)
