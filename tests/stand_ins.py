"""Real swarm parts built on in-memory stand-ins for the network, for the unit tests of their rules."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import Codec
from locoswarm.node.core.persistence import DeviationMemory
from locoswarm.node.swarm.catchup import CatchUp
from locoswarm.node.swarm.dial_failures import DialFailures
from locoswarm.node.swarm.exchange import ByteCounters, Exchange
from locoswarm.node.swarm.judging import PartJudge, SourcePauses
from locoswarm.node.swarm.lone import LonePolicy
from locoswarm.node.swarm.matchmaking import Matchmaker
from locoswarm.node.swarm.offences import OffenceBook
from locoswarm.node.swarm.reputation import Reputation
from locoswarm.node.swarm.standing import StandingMembers
from locoswarm.node.swarm.versions import RoundClaims, plausible_version
from locoswarm.node.swarm.view import StateSource, SwarmView


def catch_up(*, peer_id: str = "QmMe", reputation: Reputation | None = None, view: Any = None,
             states: Any = None, round_claims: RoundClaims | None = None, pauses: SourcePauses | None = None,
             dial_failures: DialFailures | None = None, deviations: DeviationMemory | None = None,
             recent: dict[int, tuple[int, list[str]]] | None = None,
             now: Callable[[], float] = time.monotonic) -> CatchUp:
    """A node's ``CatchUp`` as ``SwarmTransport`` builds it: ``view`` (default: no outbound peers) and ``states``
    (default: serves nothing) stand in for the node and the network; ``recent``: the rounds it merged."""
    claims = round_claims if round_claims is not None else RoundClaims()
    catch = CatchUp(peer_id, view=view if view is not None else SimpleNamespace(outbound_peers=set),
                    states=states if states is not None else StateSource(), reputation=reputation,
                    book=OffenceBook(peer_id, reputation, claims), round_claims=claims,
                    pauses=pauses if pauses is not None else SourcePauses(),
                    dial_failures=dial_failures if dial_failures is not None else DialFailures(),
                    deviations=deviations if deviations is not None else DeviationMemory(), now=now)
    for fragment, (version, group) in (recent or {}).items():
        catch.merged(fragment, version, group)
    return catch


def exchange(codec: Codec, *, peer_id: str = "QmMe", fingerprint: str = "swarm", round_timeout: float = 10.0,
             view: Any = None, book: OffenceBook | None = None, reputation: Reputation | None = None,
             robust: RobustSection | None = None) -> Exchange:
    """A node's ``Exchange`` as ``SwarmTransport`` builds it, with its real judge, matchmaker and memories, but no
    network: ``p2p`` is None, so only rounds in which this node opens no stream (every other member outbound only)
    and the streams it serves (``Exchange.serve_part``, fed by the test) run. ``view``: default a ``SwarmView``
    (no bounds); ``book``: where refusals are counted (default: one on ``reputation``)."""
    view = view if view is not None else SwarmView()
    robust = robust if robust is not None else RobustSection()
    claims = RoundClaims()
    book = book if book is not None else OffenceBook(peer_id, reputation, claims)
    deviations = DeviationMemory(ceiling=robust.drift_ceiling)
    dial_failures = DialFailures()
    matchmaker = Matchmaker(None, peer_id, swarm_key="test", subkey="test", matchmaking_timeout=1.0, view=view,
                            lone=LonePolicy(view), deviations=deviations, dial_failures=dial_failures, book=book,
                            standing=StandingMembers(True))
    return Exchange(None, peer_id, fingerprint=fingerprint, codec=codec, round_timeout=round_timeout,
                    stream_timeout=2 * round_timeout, robust=robust, view=view, matching=matchmaker,
                    judge=PartJudge(peer_id, reputation, book, robust, SourcePauses()), book=book,
                    deviations=deviations, round_claims=claims, dial_failures=dial_failures,
                    counters=ByteCounters(), plausible=lambda c: plausible_version(c, own=peer_id))
