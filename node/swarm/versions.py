"""Which outer version of a fragment to believe, and whom to take it from.

A node catches up when peers hold a newer version of a fragment than it does, and a joiner downloads the
newest. A hostile peer can claim any version, and two colluders can corroborate each other. What a claim
must pass before a node acts on it:

1. **The swarm clock.** A fragment's version counts the outer steps applied to it, at most one per send slot
   of the fragment, and the slots are fixed by the swarm clock (``locoswarm.node.core.schedule``): at clock
   ``t`` no honest node holds more than :func:`version_bound` of them. The clock itself is the median of the
   live peers' validated clocks (``locoswarm.node.swarm.clock``), which a minority of liars cannot move. A
   claim above the bound is not believed; one far above it (:func:`absurd_version`) is an offence, since an
   honest node restarted from an old checkpoint may be somewhat ahead of a younger swarm's clock but never
   by a multiple of it.
2. **Corroboration.** The newest version that at least two claimants hold or exceed (one suffices when it
   is the only other peer: a pair cannot outvote a liar, and the effect check stands behind it).
3. **The majority's digest.** Heartbeats announce each fragment's phi and momentum digest
   (:func:`state_digest`). Of the holders of the chosen version, only those announcing the digest most of
   them announce are asked, and a download must match it: liars that hold the same version as the honest
   majority cannot serve another state under it.
4. **The effect check** (``locoswarm.node.core.judge``): a downloaded phi may not do worse on the node's
   own held-out batch than the phi it holds. What passes 1-3 but lies (colluders within the bound) is
   refused there, and its sources are blamed.

A claim newer than the belief that nobody corroborates (``Belief.unconfirmed``) is not believed, but it is
not ignored either: the transport *probes* it now and then (one download from its claimant, judged by the
effect check like any other). A node that is a round ahead of the others gets followed; a lone liar within
the bound serves what it claims, and the effect check convicts it. Verify, don't trust, and never act on a
claim alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from locoswarm.node.core.state import state_digest  # the digest heartbeats announce

VERSION_SLACK = 2       # versions above the clock's count of send slots still believed (clocks differ by a step)
VERSION_ABSURD = 256    # a claim this far above twice the bound is a lie, not a restart: an offence


def version_bound(clock: int, h: int, sends_per_h: int = 1) -> int:
    """The most outer versions any fragment can hold at swarm clock ``clock``: one per send slot, at most
    ``sends_per_h`` slots of one fragment per ``h`` steps (1 on the fixed schedule; the adaptive one may pick
    a fragment in every slot), plus ``VERSION_SLACK``."""
    return max(0, int(clock)) * max(1, int(sends_per_h)) // max(1, int(h)) + 1 + VERSION_SLACK


def absurd_version(version: int, bound: int) -> bool:
    """Whether a claim of ``version`` is far beyond ``bound`` (module docstring, 1)."""
    return version > 2 * bound + VERSION_ABSURD


@dataclass(frozen=True)
class Claim:
    version: int
    digest: bytes = b""


@dataclass
class Belief:
    """The version to believe and the holders to take it from (``holders`` announce ``digest``); the claims
    newer than it that nobody corroborates, within the bound (peer -> claim: probed, module docstring)."""

    version: int = -1
    digest: bytes = b""
    holders: list[str] = field(default_factory=list)
    unconfirmed: dict[str, Claim] = field(default_factory=dict)


def believe(claims: Mapping[str, Claim], *, bound: int | None = None) -> Belief:
    """The newest corroborated version among ``claims`` (peer -> claim) at or below ``bound``, and the holders of
    it that announce the digest most of its holders announce (module docstring, 1-3)."""
    kept = {p: c for p, c in claims.items() if bound is None or c.version <= bound}
    if not kept:
        return Belief()
    versions = sorted((c.version for c in kept.values()), reverse=True)
    version = versions[0] if len(kept) < 2 else versions[1]
    holders = [p for p, c in kept.items() if c.version == version]
    counts = Counter(kept[p].digest for p in holders)
    # the most holders; ties broken by the digest's bytes, so every node picks the same one
    digest = max(counts, key=lambda d: (counts[d], d))
    return Belief(version, digest, sorted(p for p in holders if kept[p].digest == digest),
                  {p: c for p, c in kept.items() if c.version > version})


def plausible_version(claims: Mapping[str, int], own: str | None = None, *, bound: int | None = None) -> int:
    """The newest version that is corroborated: claimed (or exceeded) by at least two peers, one of
    which may be this node (``own``), at or below ``bound``. With a single other claimant its claim stands:
    a pair cannot outvote a liar, and the snapshot guards bound what a liar can do. -1 without claims."""
    kept = {p: v for p, v in claims.items() if bound is None or v <= bound}
    if not kept:
        return -1
    values = sorted(kept.values(), reverse=True)
    if sum(1 for p in kept if p != own) < 2:
        return values[0]
    return values[1]


__all__ = ["Belief", "Claim", "absurd_version", "believe", "plausible_version", "state_digest", "version_bound"]
