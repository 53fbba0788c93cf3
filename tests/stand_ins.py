"""Real swarm parts built on in-memory stand-ins for the network, for the unit tests of their rules."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from locoswarm.node.core.persistence import DeviationMemory
from locoswarm.node.swarm.catchup import CatchUp
from locoswarm.node.swarm.dial_failures import DialFailures
from locoswarm.node.swarm.judging import SPREAD_BAN, SourcePauses
from locoswarm.node.swarm.offences import OffenceBook
from locoswarm.node.swarm.reputation import Reputation
from locoswarm.node.swarm.versions import RoundClaims
from locoswarm.node.swarm.view import StateSource


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
                    book=OffenceBook(peer_id, reputation, claims, spread_ban=SPREAD_BAN), round_claims=claims,
                    pauses=pauses if pauses is not None else SourcePauses(),
                    dial_failures=dial_failures if dial_failures is not None else DialFailures(),
                    deviations=deviations if deviations is not None else DeviationMemory(), now=now)
    for fragment, (version, group) in (recent or {}).items():
        catch.merged(fragment, version, group)
    return catch
