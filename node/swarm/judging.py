"""The judge of what members send a round: every contribution and every reduced part weighed by what it would do.

A reducer screens each member's contribution (``locoswarm.node.core.robust``) and tells this judge how it agreed
with the group (``PartJudge.contribution``). A member judges each reduced part it receives against its own
contribution to it (``part_geometry``): its direction (``reduced_direction``), how far it spreads beyond the part this
member reduced itself from the same contributions (``spreads``), and how much its residual persists round after round
against the other reducers' (``persistence``). The outer loop's effect check blames the reducer of a harmful part or
the member of a harmful contribution (``harmful_part``, ``harmful_member``). Every judgement is evidence in the node's
``Reputation`` (a window per kind, a ban at its bound) and, against a reducer, a pause as a catch-up source
(``SourcePauses``): a phi is no better evidence of the swarm's than the part its holder just reduced. The thresholds
below are the measured bounds of honest behaviour; ``docs/security.md`` gives the threat model they answer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import Codec
from locoswarm.node.core.persistence import DeviationMemory, sample_index
from locoswarm.node.core.transport import AverageRequest, MemberShare, PartOrigin
from locoswarm.node.swarm.offences import SPREAD_BAN, STALE_DIRECTION, OffenceBook
from locoswarm.node.swarm.reputation import Allowance, EveryNth

if TYPE_CHECKING:  # pragma: no cover
    from locoswarm.node.swarm.reputation import Reputation

MAX_TRACKED = 256            # peers held in any per-peer pause or probe table (first come; a flood cannot grow one)

# A reduced part whose agreement with this member's own contribution (``part_geometry``) is below this is
# not applied (the round fails), and reducers whose last REDUCED_WINDOW parts average below it are banned.
# Honest parts of one lineage were never below -0.04 (``part_geometry``; of another, see UNLINED_TURNED); a
# hostile reducer's negated part scattered from -0.31 to -0.58 where refused at -0.3, and those above it were
# applied (a CI run of the hostile-node tests).
REDUCED_AGREEMENT = -0.1
REDUCED_WINDOW = 3
# A harmful average made from more than one phi (``reject_part``): every this many such refusals of its reducer
# make one offence.
UNLINED_HARM = 8
# Reduced parts from a reducer that names another phi ban it when its last REDUCED_WINDOW average below this: honest
# reducers of another lineage sent parts down to -0.34 while a state liar disrupted the swarm (robustness bench,
# 180 s), a reducer that negates its part -0.7 to -0.96 (hostile-node tests), -0.27 to -0.90 (the bench, 180 s).
UNLINED_TURNED = -0.5
# A reducer's part and this member's own part of one round reduce the same members' contributions, so an honest
# reducer's part spreads away from this member's contribution about as much as the part this member reduced itself
# (``spread_ratio``). Measured in robustness-bench runs of real nodes: honest parts of a clean 4-node run (6,432)
# median 1.01, 99% below 1.51, at most 2.73 (in the first seconds of training); of 4 + 2 runs (groups of up to 6,
# 9,247 honest parts) at most 3.74, the geometric mean of 2, 3 and 4 in a row at most 2.80, 2.16 and 2.00. A
# reducer that adds a fixed pattern of 2x its part's rms (the bench's ``reducedrift``) measured 3.2-8.2x, while its
# parts' agreement stayed positive. 0.8x of it (``reducenudge``) is not caught here: 3.3-3.8x in in-process draws
# of groups of 4, but in real 3 + 1 runs at most 1.73x after the first seconds, unbanned at +8.0% and +19.9% at
# equal progress; a median 1.03 in groups of 6 (its persistence bans it: PERSISTENCE_BAN). Reducers whose
# last SPREAD_WINDOW parts spread more than SPREAD_BAN times as much on the whole (the log ratio's sum,
# accumulated: two parts at 6.25x, three at 3.97x, four at 2.5x; ``Reputation.judge``) are banned; a part beyond
# SPREAD_REFUSE is not applied (the round fails). An own part that spreads less than SPREAD_FLOOR (its members
# nearly agreed with ours; 1% of own parts spread less than 0.32) counts as SPREAD_FLOOR. SPREAD_BAN is defined in
# ``offences``, which this module imports: the offence book follows the round's majority on it too.
SPREAD_WINDOW = 4
SPREAD_REFUSE = 4.0
# A reducer whose header names another phi mixes its own contribution, made from that phi, into its part, so the
# part spreads further from ours than an honest reducer of our phi would: an honest low-rank joiner's parts
# averaged 2.53x over four in a row in a fresh-clone suite run and it was banned at SPREAD_BAN. Its parts are
# judged apart, against the refusal bound: each part beyond SPREAD_REFUSE still fails the round, four parts above
# it on the whole ban, and a reducer that alternates its claim only fills the window of our phi at half the pace.
# What this leaves a reducer that always names another phi, below 4x, the persistence check bounds.
SPREAD_BAN_OTHER_PHI = SPREAD_REFUSE
SPREAD_FLOOR = 0.15
# A reducer's residual (its part's component orthogonal to this member's contribution, ``PartGeometry.residuals``)
# persists from one of its parts to the next as much as the members' data differ, about equally for every honest
# reducer since parts turn each round (``transport.reduce.reducer_parts``); a fixed pattern added to the part persists
# more (``PartJudge.persistence``). Each chunk's memory is of the reducer's own earlier parts, which turned parts make
# a group size's rounds apart: honest residuals decorrelate over that time, a fixed pattern does not. Measured in
# robustness-bench runs of real nodes at 60a0880 (tiny preset; 3 + 0, 3 + 1, 3 + 1 split data, 4 + 2): honest
# reducers' levels at most 0.19 above the median of the reducers' levels over four in a row (4 + 2 with two drifters:
# a drifter's pattern passes through an honest reducer that does not mute it yet; 0.07-0.15 elsewhere);
# ``reducenudge`` (a pattern of 0.8x its part's rms) 0.37-0.50 above it from its first parts, and a drifter's own
# parts (its pattern at full pull) 0.40. A reducer whose last PERSISTENCE_WINDOW levels exceed the median by more than
# PERSISTENCE_BAN on the whole (accumulated: two at 0.44, three at 0.29) is banned; at 0.18 the 4 + 2 drift run banned
# an honest reducer at 0.192, and at 0.25 the unit test's members whose data differ by a fixed bias every round (a
# reducers' median of 0.52-0.66, ``reducenudge`` 0.18-0.25 above it) went unbanned: the margin is thin on both
# sides, and 0.22 is not yet run in the bench. Before parts turned, a member reduced the same chunk range round
# after round, and chunk ranges differ in how their residuals persist (a clean 3-node run: 0.35 against 0.43 by
# position, the same from every observer): the range's nature became the reducer's, and an honest joiner was banned
# 18 s after it joined (0.58 against a median of 0.38).
PERSISTENCE_WINDOW = 4
PERSISTENCE_BAN = 0.22
# A contribution of fewer tokens than this share of the reducer's own is not judged for the agreement ban: a
# member that just joined, caught up or dropped its carry has a step or two of progress, whose direction is
# mostly noise (it has little pull anyway).
JUDGED_WEIGHT = 0.25
# A contribution made from another phi is judged with this much added to its agreement. Measured (robustness
# bench, tiny preset, clean/flip/sleeper/stateliar windows): honest contributions of another lineage had a
# lowest mean over 4 of -0.05 (of one lineage: +0.12), a flipper's from another phi a median of -0.25.
OTHER_LINEAGE_MARGIN = 0.1

# A reducer whose part this node refused, as pointing against its own progress or for its effect on the held-out
# loss, serves it no catch-up for this long (``CatchUp.may_serve``): a phi is no better evidence of the swarm's than
# the part its holder just reduced. Why: in a 2 + 2 drift run an honest node refused a drifter's reduced parts
# (agreement -0.15 to -0.28) and caught up from that same drifter two seconds later, three times in 10 s, each
# phi 4-16% worse than its own, its held-out loss 2.63 to 3.82 before the bans (robustness bench, a31b1f9). As
# short as ``WORSE_SOURCE_S``, and only where the part is evidence (not a pair's: there honest members' parts
# point against each other), so an honest reducer misjudged once is a source again within seconds.
TURNED_SOURCE_S = 20.0
# A member whose phi is older than every other member's of its round (it joined from a snapshot the swarm left while
# it downloaded, or its rounds failed) makes progress from a point the others have left, and with the alpha merge its
# contribution also carries half of the outer step it last took there: honest contributions one to four versions
# behind their group's agreed at -0.42 to +0.06, against +0.2 to +0.48 for the same nodes' at the group's version
# (bench swarm, 5 Mbit/s, two of four nodes behind NAT: a public node banned a NATed joiner for its direction 30 to 90
# s after its join, in two of three runs of the code before these rules). So such a contribution is no evidence of its
# sender's intent, STALE_GRACE times per STALE_GRACE_S per sender: an honest node catches up within a round or two,
# and a sender that stays the odd stale one (a flipper whose own rounds fail) is judged again after that. Where this
# node is the stale one it does not judge the group's parts against its own progress
# (``PartJudge.reduced_direction``): refusing them, and pausing their reducers as catch-up sources,
# discarded a stale NATed node's every catch-up (three in 60 s) from the only holders it could reach; it stayed four
# versions behind until it folded. With both rules the same bench merged 49 of 50 rounds and banned nobody (the code
# before: 29 of 48 with a ban; 48 of 53 with a node stuck four versions behind).
STALE_GRACE = 2
STALE_GRACE_S = 60.0


class SourcePauses:
    """Peers this node asks for no catch-up until a moment (``time.monotonic``): a longer pause already set stands,
    and at most ``limit`` peers are held, the oldest entry going first (a flood of peers cannot grow the table)."""

    def __init__(self, limit: int = MAX_TRACKED) -> None:
        self.limit = limit
        self._until: dict[str, float] = {}

    def pause(self, peer: str, seconds: float) -> None:
        """``peer`` serves no catch-up for ``seconds`` from now."""
        self._until[peer] = max(time.monotonic() + seconds, self._until.get(peer, -math.inf))
        while len(self._until) > self.limit:
            self._until.pop(next(iter(self._until)))

    def paused(self, peer: str) -> bool:
        """Whether ``peer`` is paused now."""
        return time.monotonic() < self._until.get(peer, -math.inf)


class RoundView(Protocol):
    """What the judge asks of the round a part belongs to (``exchange.Reduction``)."""

    def judges_reduced_part(self, reducer: str) -> bool:
        """Whether ``reducer``'s part is evidence in this round (not in a pair without an accuser)."""
        ...


class PartRefused(RuntimeError):
    """This node refused a reduced part a peer sent it (malformed, or pointing against its own progress): the
    round fails as ``AverageResult.refused`` (the outer loop keeps the progress such rounds carried)."""


@dataclass(frozen=True)
class PartGeometry:
    """A reduced part seen from this member's own contribution ``c`` to it: ``agreement``, the cosine of the part
    with ``c``; ``spread``, the norm of the part's component orthogonal to ``c`` over the norm of ``c``;
    ``residuals``, per chunk the evenly spaced sample (``sample_index``) of that orthogonal component, what a
    reducer adds beyond our own direction (``PartJudge.persistence``)."""

    agreement: float
    spread: float
    residuals: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)


def part_geometry(codec: Codec, req: AverageRequest, chunks: dict[int, bytes],
                  bounds: list[tuple[int, int]]) -> PartGeometry | None:
    """The geometry of a reduced part against this member's own contribution to it (None: either is zero there).
    The honest mean of a part includes ours: on the tiny presets its cosine with each member's own was at least
    -0.04 (4 and 6 members), where a negated part gives about -0.5. Chunk by chunk, keeping only samples for the
    residuals, so that a large fragment is never held decoded."""
    dot = own_sq = red_sq = 0.0
    samples: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for c in sorted(chunks):
        n = bounds[c][1] - bounds[c][0]
        red = codec.decode(chunks[c], n).to(torch.float64)
        own = codec.decode(req.chunks[c], n).to(torch.float64)
        dot += float(red @ own)
        own_sq += float(own @ own)
        red_sq += float(red @ red)
        at = sample_index(n)
        samples[c] = (red[at], own[at])
    if own_sq <= 0 or red_sq <= 0:
        return None
    a = dot / own_sq
    return PartGeometry(agreement=dot / math.sqrt(own_sq * red_sq),
                        spread=math.sqrt(max(0.0, red_sq - dot * dot / own_sq) / own_sq),
                        residuals={c: (red - a * own).to(torch.float32) for c, (red, own) in samples.items()})


def spread_ratio(part: PartGeometry, own: PartGeometry) -> float:
    """How much more a reducer's part spreads away from this member's contribution than this member's own part,
    which it reduced itself from the same members' contributions (``PartJudge.spreads``)."""
    return part.spread / max(own.spread, SPREAD_FLOOR)


class PartResult(NamedTuple):
    """One reduced part of a round as this member received it (its own included)."""

    reducer: str
    chunks: dict[int, bytes]
    total_weight: float
    extras: list[float]
    geometry: PartGeometry | None  # against this member's own contribution (``part_geometry``)
    missing: int = 0               # group members the reducer went without (``ReduceHeader.missing``)
    same_lineage: bool = True      # the reducer's header names this member's phi (``SPREAD_BAN_OTHER_PHI``)
    # this member's own part only: the other members whose contributions to it had no pull (agreement at or below
    # ``agreement_floor``): the round had a sender that may have turned another reducer's part (``PartJudge.spreads``)
    disputed: frozenset[str] = frozenset()
    # why the part is not applied, where it points against this member's contribution (``PartJudge.reduced_direction``):
    # the round fails once every part's spread and persistence were judged (``Exchange.run``)
    refused: str = ""

    def turned_by_another(self, reducer: str) -> bool:
        """Whether (this member's own part says) a member other than ``reducer`` had no pull in this round, and
        may have turned ``reducer``'s part: its spread and persistence are then no evidence against it."""
        return bool(self.disputed - {reducer})


class PartJudge:
    """Judges contributions and reduced parts (module docstring).

    Args:
        peer_id: this node's (its own part is never blamed: it screened that one itself).
        reputation: where judgements are evidence and bans are looked up (None: nothing is judged).
        book: where refusals and offences are counted (``OffenceBook``).
        robust: the ``[robust]`` settings (the contributions' agreement window and bounds).
        pauses: the catch-up sources this node pauses (shared with the state source's rule).
        now: the clock of the stale senders' grace (``STALE_GRACE``; tests pass their own).
    """

    def __init__(self, peer_id: str, reputation: Reputation | None, book: OffenceBook, robust: RobustSection,
                 pauses: SourcePauses, *, now: Callable[[], float] = time.monotonic) -> None:
        self.peer_id = peer_id
        self.reputation = reputation
        self.book = book
        self.robust = robust
        self.pauses = pauses
        self._stale_grace = Allowance(STALE_GRACE, STALE_GRACE_S, now=now)  # stale contributions not judged
        self._unlined_harm = EveryNth(UNLINED_HARM)  # harmful averages from other phis, per reducer
        # what this node saw of each reducer's parts, against its own contributions (``persistence``)
        self.part_drift = DeviationMemory()

    def contribution(self, peer: str, score: float, weight_ratio: float, *, same_lineage: bool,
                         stale: bool = False) -> None:
        """One judged agreement of ``peer``'s contribution (``locoswarm.node.core.robust``): evidence for the
        agreement ban (``Reputation.judge``). A light contribution (a member that just joined or caught up) is
        not judged. A contribution made from another phi (its header's lineage differs from ours: a member
        behind, just caught up, or split off by a refused round) is judged too, its score raised by
        ``OTHER_LINEAGE_MARGIN``: its progress started elsewhere and agrees less, but the lineage is the sender's
        own claim, and a flipper whose own rounds failed sent nearly all its contributions from another phi
        (306 of 317 judged in a bench run) and went unjudged while they did not count. Both kinds of evidence
        share one window, so a member that alternates its claim cannot split it. A contribution from a ``stale``
        sender (its version below every other member's of the round) is no evidence for the ban, ``STALE_GRACE``
        times per ``STALE_GRACE_S`` (``_stale_grace``); it is kept as ``STALE_DIRECTION``, evidence of this
        node's own only where the round's majority already excludes the sender (``FOLLOWED_EVIDENCE``)."""
        if self.reputation is None or weight_ratio < JUDGED_WEIGHT:
            return
        r = self.robust
        judged = score if same_lineage else score + OTHER_LINEAGE_MARGIN
        if stale and self._stale_grace.take(peer):
            # Kept apart from the ban's window, but this node's own view when the round's majority bans the peer
            # (FOLLOWED_EVIDENCE): a flipper whose first contributions were stale, and which the other honest
            # members banned at once, is otherwise never met again here and never banned (robustness bench, 3 + 1).
            self.reputation.judge(peer, STALE_DIRECTION, judged, window=r.agreement_window, ban_below=-math.inf,
                                  good_from=math.inf)
            return
        self.reputation.judge(peer, "direction", judged, window=r.agreement_window, ban_below=r.agreement_ban,
                              good_from=r.agreement_full, accumulate=True,
                              detail=f"agreement of its contributions with the group's, +{OTHER_LINEAGE_MARGIN:g} "
                                     "from another phi")

    def reduced_direction(self, peer: str, agreement: float, *, same_lineage: bool,
                                 evidence: bool = True, stale: bool = False) -> None:
        """A reduced part's agreement with this member's own contribution to it (``part_geometry``): evidence
        against its reducer, and a part below ``REDUCED_AGREEMENT`` is not applied (raises, the round fails).
        Within one lineage its last REDUCED_WINDOW parts ban it when they average below REDUCED_AGREEMENT. The
        lineage is the reducer's own claim, and a reducer that turned every part and named another phi failed
        every honest round it sat in (a hostile-node test: no merged round for 30 s), so parts from another phi
        are judged apart, against UNLINED_TURNED: honest reducers of another lineage never averaged that low.

        Not ``evidence`` in a pair: the part is the reducer's own contribution and ours, and where the two
        disagree (it gave ours no pull, ``Agreement.evidence``) it points against ours whoever is odd. Honest
        pairs do disagree: with the alpha merge (theta <- alpha theta + (1 - alpha) phi) a member's next
        contribution carries alpha times its own last progress minus the group's average, which in a pair is
        half the difference of the two, so when rounds come every step or two two honest members' contributions
        point against each other (cosines of -0.5 to -0.9 in a two-node test, which then banned each other).
        Such a part is still refused: the round fails and nothing is applied. It is evidence in a pair where
        another member of the round excludes the reducer (``Reduction.accused``).

        Where this node is ``stale`` (its version below every other member's of the round), a part of another phi
        is not judged against its own contribution at all: that contribution is the odd one, made from a phi the
        group has left, and the reducer is whom it catches up from (``STALE_GRACE``). The part is applied if it
        passes everything else (sizes, spreads, the effect check of the average), so that the round merges and a
        download under way lands at the group's state (``OuterLoop._land`` replays the averages merged meanwhile):
        refusing such parts kept a NATed node at 5 Mbit/s in a catch-up loop, two to four versions behind, for
        its whole run."""
        if stale and not same_lineage:
            return
        if evidence:
            self.reduction(peer, agreement, same_lineage=same_lineage)
        if agreement >= REDUCED_AGREEMENT:
            return
        reason = f"a reduced part that points against this node's own progress (agreement {agreement:+.2f})"
        if not same_lineage:
            self.book.refuse(peer, "reduction", f"{reason}, from another phi", offence=False)
        if evidence:
            self.pauses.pause(peer, TURNED_SOURCE_S)
        raise PartRefused(f"peer {peer[:12]} sent {reason}")

    def reduction(self, peer: str, agreement: float, *, same_lineage: bool = True) -> None:
        """One reduced part's agreement with this member's own contribution: evidence of a reducer that turns
        its part (``Reputation.judge``)."""
        if self.reputation is None:
            return
        kind, bound = ("reduction", REDUCED_AGREEMENT) if same_lineage else ("reduction_other_phi", UNLINED_TURNED)
        self.reputation.judge(peer, kind, agreement, window=REDUCED_WINDOW, ban_below=bound, good_from=0.0,
                              detail="agreement of its reduced parts with this node's own progress")

    def parts(self, req: AverageRequest, results: Sequence[PartResult], view: RoundView | None) -> None:
        """Every reducer's part of a round (``results``: this member's own first) judged against the others: its
        spread (``spreads``) and persistence (``persistence``); raises ``PartRefused`` for a part
        that either refuses, or that pointed against this member's contribution (``PartResult.refused``). A part
        refused for its direction is judged for its spread and persistence all the same: refused round after round,
        a reducer whose parts pointed against ours from another phi (above ``UNLINED_TURNED``) was otherwise never
        banned, nor its pattern seen (3 + 1 ``reducedrift``: refused 151 times, banned by nobody, +31% at equal
        progress; robustness bench, 658608e)."""
        self.spreads(results[0], results[1:], view)
        self.persistence(req, results, view)
        for part in results[1:]:
            if part.refused:
                raise PartRefused(part.refused)

    def spreads(self, own: PartResult, parts: Iterable[PartResult], view: RoundView | None) -> None:
        """Each reducer's part against the part this member reduced itself (``spread_ratio``, SPREAD_WINDOW): evidence
        against a reducer that adds its own pattern to the average, which no check of one part's size or
        direction alone sees (twice its rms in a fixed sign pattern kept the part's agreement near +0.3). Raises
        ``PartRefused`` for a part beyond SPREAD_REFUSE or from a reducer this judgement just banned. Not evidence
        where ``reduced_direction``'s is not (a pair), and none without a reference: our own part must mix
        others' contributions in. A member cannot frame an honest reducer far: what it sends that reducer moves
        the part by at most its share of the group's weight times the clip radius.

        Nor is it evidence in a round where another member's contribution to our own part had no pull
        (``PartResult.disputed``): that member may have turned this reducer's part, which the reducer's screening
        of other chunks let pass (the part is still refused beyond SPREAD_REFUSE). Why: a flipper that joined with
        40 steps' progress got an honest reducer banned by both other honest nodes of a 3 + 1 run within 4 s of
        its first round, each judging the reducer's parts 2.6x as spread as its own over four of them, while the
        flipper's contributions to their own parts had no pull (robustness bench, 7182100)."""
        if own.geometry is None or self.reputation is None:
            return
        for part in parts:
            if part.geometry is None or (view is not None and not view.judges_reduced_part(part.reducer)):
                continue
            ratio = spread_ratio(part.geometry, own.geometry)
            banned = False
            if not own.turned_by_another(part.reducer):
                kind, bound = (("reduction_spread", SPREAD_BAN) if part.same_lineage
                               else ("reduction_spread_other_phi", SPREAD_BAN_OTHER_PHI))
                banned = self.reputation.judge(
                    part.reducer, kind, -math.log(max(ratio, 1e-6)), window=SPREAD_WINDOW,
                    ban_below=-math.log(bound), good_from=-math.log(SPREAD_BAN) / 2, accumulate=True,
                    detail=f"log of how much more its reduced parts spread than this node's own, {ratio:.2f}x last")
            if banned or ratio > SPREAD_REFUSE:
                self.pauses.pause(part.reducer, TURNED_SOURCE_S)
                why = "its parts' spread banned it" if banned else f"at most {SPREAD_REFUSE:g}x"
                if own.turned_by_another(part.reducer):
                    why += "; a member this round gave no pull may have turned it: no evidence against the reducer"
                raise PartRefused(f"peer {part.reducer[:12]} sent a reduced part that spreads {ratio:.2f}x as far "
                                  f"from this node's contribution as its own part ({why})")

    def persistence(self, req: AverageRequest, parts: Sequence[PartResult], view: RoundView | None) -> None:
        """Each reducer's residual (``PartGeometry.residuals``) against its own past ones, chunk by chunk
        (``DeviationMemory``): a reducer that adds a fixed pattern to its part, however small, has a residual that
        persists more than the others' do, whose persistence is the members' data and is about the same for every
        honest reducer, this node's own part included. A reducer whose standing persistence exceeds the median of
        every reducer judged here (ours among them) by more than PERSISTENCE_BAN over its last PERSISTENCE_WINDOW
        parts (accumulated) is banned. Not evidence where ``spreads``' is not; nothing is refused for one
        part alone: a single part inside the spread bounds is ordinary in size and direction.

        Not for low-rank payloads (``req.basis``): their chunks are coefficients on a basis the group moves on every
        round (and replaces by a seeded one where members' bases differ), so chunk k of two rounds is not the same
        coordinate; honest reducers' levels stood 0.18-0.19 above the median over four parts in low-rank runs of
        three real nodes (a test's two partners banned an honest one in 2 of 3 runs)."""
        if req.digest or req.basis or parts[0].geometry is None or self.reputation is None:
            return
        reducers, persistence = [], []
        for part in parts:
            if part.geometry is None or (part.reducer != self.peer_id and view is not None
                                         and not view.judges_reduced_part(part.reducer)):
                continue
            residuals = part.geometry.residuals
            obs = self.part_drift.round(req.fragment, [part.reducer], list(residuals))
            for k, e in enumerate(residuals.values()):
                obs.observe(k, e.unsqueeze(0))
            reducers.append(part.reducer)
            persistence.append(obs.persistence()[0] if obs.known()[0] else None)
            obs.commit()
        self.part_drift.fold(reducers, persistence)
        ref = self.part_drift.reference()
        if ref is None:
            return
        for reducer in reducers:
            level = self.part_drift.level(reducer)
            if reducer == self.peer_id or level is None or parts[0].turned_by_another(reducer):
                continue  # a disputed round is observed, but no evidence against a reducer (as in ``spreads``)
            banned = self.reputation.judge(
                reducer, "reduction_persistence", ref - level, window=PERSISTENCE_WINDOW,
                ban_below=-PERSISTENCE_BAN, good_from=-PERSISTENCE_BAN / 2, accumulate=True,
                detail=f"how much more its reduced parts' residuals persist than the reducers' median {ref:.2f}, "
                       f"{level:.2f} last")
            if banned:
                self.pauses.pause(reducer, TURNED_SOURCE_S)

    def harmful_part(self, part: PartOrigin, reason: str) -> None:
        """The outer loop refused ``result`` for ``part``'s effect on its held-out loss: an offence of its
        reducer (this node's own part is never blamed: it screened that one itself)."""
        if not part.reducer or part.reducer == self.peer_id:
            return
        # Averaged from more than one phi: an honest joiner and its group refuse each other's averages for a
        # round or two (seen: a pair of honest nodes banned each other 1 s after a join, and never averaged
        # again). There every UNLINED_HARM-th such refusal is an offence, so a member cannot escape the effect
        # check for good by claiming another lineage.
        offence = part.one_lineage or self._unlined_harm.offence(part.reducer)
        self.book.refuse(part.reducer, "bad_effect", reason, offence=offence)
        self.pauses.pause(part.reducer, TURNED_SOURCE_S)

    def harmful_member(self, share: MemberShare, reason: str) -> None:
        """The outer loop refused ``result``, and ``share``, a member's own contribution to this node's part, is
        harmful alone: an offence of that member, within one lineage; from another phi every UNLINED_HARM-th
        (a joiner's first delta from a phi the group has left may be honest)."""
        if not share.member or share.member == self.peer_id:
            return
        offence = share.same_lineage or self._unlined_harm.offence(share.member)
        self.book.refuse(share.member, "harmful_contribution", reason, offence=offence)
        self.pauses.pause(share.member, TURNED_SOURCE_S)
