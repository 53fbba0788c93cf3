"""The offence book: every refusal of a peer this node counts, and the bans it follows from the other members.

Each refusal is logged (``refusals``: the last few, for the status) and counted by the node's ``Reputation``, which
bans at its threshold. A round's match entries name whom each member excludes; ``follow_majority_bans`` bans a
member most of the others exclude where this node's own evidence leans against it too, and never on the others'
word alone unless more than ``FOLLOWED_SHARE`` of at least ``FOLLOWED_VOTERS`` voters exclude it: no minority of
colluders reaches that against an honest member.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import TYPE_CHECKING

from locoswarm.node.transport.groups import majority_shunned

if TYPE_CHECKING:
    from locoswarm.node.swarm.reputation import Reputation
    from locoswarm.node.swarm.versions import RoundClaims

# The judged kinds whose scores are this node's own evidence when it follows the round's majority in a ban
# (``OffenceBook.follow_majority_bans``): the directions of the peer's own contributions only. A reduced part's
# agreement is not the reducer's doing alone: colluders that outvote an honest reducer in its group turn its part,
# and with their exclusions as the majority they could otherwise get it banned by the other honest members.
STALE_DIRECTION = "direction_stale"  # the kind of a stale contribution's direction score (``STALE_GRACE``)
FOLLOWED_EVIDENCE = ("direction", STALE_DIRECTION)
# ... and the spread of the peer's reduced parts (``judging.PartJudge.spreads``), where its last parts judged here
# spread more than the spread ban (``SPREAD_BAN``, below) times as far as this node's own on the whole (the geometric
# mean, at least ``MIN_EVIDENCE`` parts): unlike a part's agreement, the spread is not judged in a round where another
# member's contribution to this node's own part had no pull, and what a member sends a reducer moves its part by at most
# its share of the weight times the clip radius. Honest parts of 4 + 2 runs, under attack, reached 2.80x as the
# geometric mean of two in a row, 2.00x of four (the spread bounds' comment in ``judging``). Why: in 3 + 1, once two
# honest nodes banned a reducer that adds a fixed pattern (``reducedrift``), placement put the third with it in pairs;
# the two excluders are too few voters to follow without evidence, and the third banned it 4 s later, 14 rounds after
# its first attack, with its first two parts at 4.00x and 3.4x in hand (robustness bench, 318e346).
FOLLOWED_SPREAD = ("reduction_spread", "reduction_spread_other_phi")
# A reducer whose last ``judging.SPREAD_WINDOW`` parts spread more than this many times as far as this node's own
# part on the whole is banned (``judging.PartJudge.spreads``; the measurements that set it are the comment on the
# spread bounds in ``judging``), and beyond it this node's own judgements of a reducer are evidence for following the
# round's majority in a ban (``FOLLOWED_SPREAD``). It is defined here, not in ``judging``, because ``judging``
# imports this module.
SPREAD_BAN = 2.5
# A member that more than this share of at least FOLLOWED_VOTERS of the round's other voters exclude is banned here
# without evidence of this node's own. Judge and judged are not voters, so c colluders framing an honest member
# before h - 2 other honest voters reach the share only if c > 2 (h - 2) while c < h: never with at least 3
# voters. It is what bans colluders on a node that never met them: once the other honest members exclude them,
# placement keeps them out of its groups (``form_groups``), so it gathers no evidence of its own (robustness
# bench, 4 honest + 2 ipm: one honest node never banned either). With h honest members it follows c colluders
# only where h >= 2c (4 + 2: 3 of 4 voters); beyond that its own evidence is needed.
FOLLOWED_SHARE = Fraction(2, 3)
FOLLOWED_VOTERS = 3
# The offences that are this node's own evidence for following the round's (strict) majority in a ban once they
# number one short of its own ban threshold: what the peer itself sent in its contributions and headers, never a
# reduced part (colluders turn an honest reducer's part) nor a clock or group view (honest members disagree on
# those now and then). Why: in 3 + 1, an attacker claiming 10x its weight (or sending 10x values) is refused by
# every honest reducer; two nodes banned it at their third offence, and then placement kept it out of the third
# node's groups, which stayed at two offences and had too few voters (2) for ``FOLLOWED_VOTERS`` (robustness
# bench, out-of-bound kinds, 90 s: weight and values banned by 2 of 3). Two colluders framing an honest member
# before two honest nodes are a majority too, so one offence (an honest joiner's large first delta) is not enough.
FOLLOWED_OFFENCES = ("bad_contribution", "bad_weight", "bad_part", "bad_header", "duplicate", "replay",
                     "forged_sender", "harmful_contribution")


def majority_excluded(members: list[str], excluded: Mapping[str, Iterable[str]], own: str,
                      banned: Iterable[str], *, share: Fraction = Fraction(1, 2), min_voters: int = 2) -> list[str]:
    """The members (other than ``own``) that a strict majority of the round's other voters exclude: the members
    neither ``own`` nor the judged one nor banned here, at least two of them.

    A member that every other member bans is dropped from the round (``shunned_dropped``), but a colluder never
    bans its partner, so two colluders are never dropped that way. Once the other honest members ban both, the
    one honest member left to group with them is outvoted in every group it shares with them: the pair is the
    median of the others, its own judgements of them are no evidence, and in a robustness-bench run (4 honest
    + 2 flippers) that node banned one flipper after 95 rounds and never the other. The majority is evidence
    only together with the node's own (``OffenceBook.follow_majority_bans``): two colluders among two honest
    members are a majority against each honest one. With ``share`` 2/3 and ``min_voters`` 3 it is the bound no
    minority reaches against an honest member (``FOLLOWED_SHARE``)."""
    shunned = majority_shunned(members, excluded, ignore=[*banned, own], min_voters=min_voters, share=share)
    return [p for p in members if p in shunned]


class OffenceBook:
    """This node's refusals of peers and the bans it follows (module docstring). ``reputation``: where offences
    are counted and bans looked up (None: nothing is counted, nobody banned); ``round_claims``: what members'
    round headers named of their versions (a lie found there is evidence for following a ban). The spread beyond
    which this node's own judgements of a reducer's parts are evidence is ``SPREAD_BAN``."""

    def __init__(self, peer_id: str, reputation: Reputation | None, round_claims: RoundClaims) -> None:
        self.peer_id = peer_id
        self.reputation = reputation
        self.round_claims = round_claims
        self.refusals: deque[str] = deque(maxlen=50)

    def refuse(self, peer: str, kind: str, detail: str, *, offence: bool = True, conclusive: bool = False,
                 forgivable: bool = True) -> None:
        """Count a refusal of ``peer`` (an offence unless it may be an honest peer's bad luck; ``conclusive``:
        something this project's code never sends, a ban at once; ``forgivable``: ``Reputation.refuse``)."""
        self.refusals.append(f"{peer[:12]}: {kind}: {detail}")
        if self.reputation is not None:
            self.reputation.refuse(peer, kind, detail, offence=offence, conclusive=conclusive, forgivable=forgivable)

    def banned(self, peer: str) -> bool:
        """Whether this node bans ``peer`` now."""
        return self.reputation is not None and self.reputation.is_banned(peer)

    def shunned(self, drifting: Iterable[str]) -> list[str]:
        """Whom this node keeps out of its rounds and names as excluded in its match entries, sorted: the peers it
        bans, and ``drifting``, the senders that during an alarm only the alarm's bound mutes round after round
        (``DeviationMemory.shunned``; no offence counted). A round treats them all as banned here, so the others'
        exclusions of a shunned peer make this node no ban of it (``follow_majority_bans``) until the alarm
        lapses."""
        banned = self.reputation.banned() if self.reputation is not None else []
        return sorted(set(banned) | set(drifting))

    def follow_majority_bans(self, members: list[str], excluded: Mapping[str, Iterable[str]],
                              banned: Iterable[str]) -> None:
        """Ban a member that most of the round's other members exclude (``majority_excluded``) where this node's
        own judgements of it lean against it too (``Reputation.suspects``: its contributions' directions, or its
        reduced parts' spread beyond ``SPREAD_BAN``, ``FOLLOWED_SPREAD``) or it counted all but the last of the
        offences that would ban it here (``FOLLOWED_OFFENCES``) or one of its claims was a lie here
        (``RoundClaims.lied``); their exclusions alone never ban, unless more
        than ``FOLLOWED_SHARE`` of at least ``FOLLOWED_VOTERS`` voters exclude it. The ban takes effect from the
        next round: this round's groups are already agreed."""
        if self.reputation is None:
            return
        overwhelming = set(majority_excluded(members, excluded, self.peer_id, banned, share=FOLLOWED_SHARE,
                                             min_voters=FOLLOWED_VOTERS))
        for peer in majority_excluded(members, excluded, self.peer_id, banned):
            if self.reputation.suspects(peer, FOLLOWED_EVIDENCE):
                self.refuse(peer, "majority_ban", "excluded by most of the round's other members, and this "
                                                "node's own judgements of it lean against it", conclusive=True)
            elif self.reputation.suspects(peer, FOLLOWED_SPREAD, below=-math.log(SPREAD_BAN)):
                self.refuse(peer, "majority_ban", "excluded by most of the round's other members, and its reduced "
                                                f"parts spread more than {SPREAD_BAN:g}x as far as this node's "
                                                "own here", conclusive=True)
            elif peer in overwhelming:
                self.refuse(peer, "majority_ban", f"excluded by more than {FOLLOWED_SHARE} of at least "
                                                f"{FOLLOWED_VOTERS} of the round's other members",
                            conclusive=True)
            elif (own := self.reputation.offences(peer, FOLLOWED_OFFENCES)) >= max(1, self.reputation.threshold - 1):
                self.refuse(peer, "majority_ban", f"excluded by most of the round's other members, after {own} "
                                                "offences of its own contributions here", conclusive=True)
            elif self.round_claims.lied(peer):
                # a state liar the others banned leaves this node's groups, and with them the rounds that would
                # prove its next lies here (robustness bench, 3 + 1 replayliar: banned by 2 of 3)
                self.refuse(peer, "majority_ban", "excluded by most of the round's other members, after a "
                                                "version claim of its that its own rounds never backed here",
                            conclusive=True)
