"""``python -m locoswarm.node.bench.hostile``: a hostile peer, for the adversarial tests and ``bench robustness``.

Nothing here is imported by the node: the production modules carry no attack code. A hostile *node*
is the ordinary ``locoswarm run`` with its attack installed in its own process before it starts (``--attack KIND``,
or env ``LOCOSWARM_ATTACK``): the hooks of the node's public wire seam (``locoswarm.node.swarm.tamper``), and for
some kinds a wrapper of the transport's public ``start_average`` or of the reputation's public face. Every other
argument is ``locoswarm run``'s. Kinds:

- ``weight``:  its contributions claim a token weight of 1e30;
- ``values``:  its contribution chunks hold values of 1e30 (finite, encoded with the swarm's codec);
- ``nan``:     its contribution chunks decode to NaN (NaN block scales; raw NaN for fp32/bf16);
- ``reducer``: as a reducer it returns reduced chunks of 1e30 (to everyone, itself included);
- ``state``:   its heartbeats claim version +1000 of every fragment and its state server serves NaN phi
  and momentum at that version;
- ``clock``:   its heartbeat clock claims +10000 more every ``--attack-period`` seconds;
- ``forge``:   its contribution headers name another member as the sender.

In-bound node attacks: each stays inside every bound a reducer can check by size (finite values, norms
within the reject factor, weights within the bounds heartbeats allow), so only direction, effect, replay
memory and the version rules can tell:

- ``flip``:        its contributions are its own progress negated and scaled by 5 (inside the reject factor of 8),
  claiming 4x its token weight;
- ``ipm``:         inner-product manipulation (Xie, Koyejo, Gupta 2019): it sends the negative of the last group
  average it received for the fragment (its own progress negated before it has one);
- ``drift``:       its own progress plus 2x its rms times a fixed sign pattern per fragment, every round (a small,
  consistent drift in one direction: ALIE-like, Baruch et al. 2019);
- ``sleeper``:     honest for ``--attack-period`` seconds, then ``flip``;
- ``replay``:      sends, as its contribution, the reduced chunks its group agreed on two rounds before (honest
  members' averages, byte for byte);
- ``badreduce``:   as a reducer, returns its part of the average negated and scaled by 3;
- ``reducedrift``: as a reducer, adds 2x its part's rms times a fixed sign pattern to its part, every round;
- ``reducenudge``: the same at 0.8x its part's rms (a smaller pattern, for the spread check's sensitivity);
- ``stateliar``:   heartbeats claim version +2 of every fragment (inside the swarm clock's bound), with the
  digest of what its state server serves at that version: its phi negated (finite, ordinary norm);
- ``statenoise``:  the same, serving noise of its phi's norm instead (no reversal: a cosine of about 0 with an
  honest phi, so only its effect gives it away);
- ``versionliar``: the same with version +1000 (far beyond the swarm clock's bound).
- ``replayliar``:  heartbeats claim version +2, and a node that asks to replay the steps up to it
  (``locoswarm.node.core.step_log``) is served two steps from the liar's real state, each its last group
  average negated, with the digests those steps really reach: every digest a replaying node checks matches.

A hostile *client* never publishes a heartbeat nor enters matchmaking; it joins the DHT with its own
libp2p identity (``--state-dir``) and:

- ``inject``:   reads the public match keys of recent rounds and streams plausible contributions to
  the members it finds: under its own id in the first round it finds, forged in the second (another
  member's id), then forged or its own at random;
- ``flood``:    opens many concurrent streams to each live peer's averaging handler, each sending a
  frame that announces ``--frame-mib`` MiB (half of them after a valid header) as fast as the peer
  takes it;
- ``download``: requests full state downloads of every fragment from every live peer, in a loop.

A client runs ``--seconds`` and writes what it achieved as JSON (``--report FILE``, and one
``hostile-report: {...}`` line on stdout): contributions accepted/refused, streams refused, bytes, ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from locoswarm.node.config import fingerprint, load_config
from locoswarm.node.swarm import tamper
from locoswarm.node.swarm.dht import start_dht
from locoswarm.node.swarm.membership import Membership, swarm_key
from locoswarm.node.swarm.reputation import Reputation
from locoswarm.node.swarm.runtime import NetworkRuntime
from locoswarm.node.swarm.tamper import Tamper
from locoswarm.node.swarm.wire import PeerRefused, WireError, open_stream
from locoswarm.protocol import swarm_pb2

# The modules that import torch or hivemind are imported where they are used ("# lazy:"): torch takes seconds to
# import (measured), which --help and the argument errors do without, and hivemind reads HIVEMIND_LOGLEVEL once, at
# its import, which run_client sets first (none of the modules above imports either).
if TYPE_CHECKING:
    import torch

log = logging.getLogger("locoswarm.hostile")

ABSURD = 1e30            # the weight/values/reduced values of the attacks
VERSION_LIE = 1000       # ``state``: versions claimed above the real ones
CLOCK_JUMP = 10_000      # ``clock``: clock claimed above the real one, once more per period
ATTACK_ENV = "LOCOSWARM_ATTACK"
CARRIED_OUT = "attack carried out"  # logged once a patch changed what the node sends (NodeAttack.carried_out)
CARRIED_OUT_AT = re.compile(re.escape(CARRIED_OUT) + r": '[^']*' at (\d+(?:\.\d+)?)")  # ... and when (epoch s)
MIB = 1 << 20


class HostileError(Exception):
    """A bad argument: one line for the user."""


# ---- payload forgery ------------------------------------------------------------------------------


def absurd_chunk(codec, numel: int) -> bytes:
    """``numel`` values of 1e30, encoded with ``codec`` (finite: they pass the codec's own checks)."""
    # lazy: torch (seconds to import, measured)
    import torch

    return codec.encode(torch.full((numel,), ABSURD))


def nan_chunk(codec, numel: int) -> bytes:
    """Bytes of the exact codec size that decode to NaN: NaN block scales for the block codecs (fp4,
    int8), raw NaN for fp32 and bf16. A codec's encoder refuses NaN, so these are written by hand."""
    # lazy: torch (seconds to import, measured)
    import torch

    if codec.name == "fp32":
        return b"\x00\x00\xc0\x7f" * numel
    if codec.name == "bf16":
        return b"\xc0\x7f" * numel
    data = bytearray(codec.encode(torch.full((numel,), 0.01)))
    n_blocks = -(-numel // codec.block_size)
    data[:4 * n_blocks] = b"\x00\x00\xc0\x7f" * n_blocks
    return bytes(data)


# ---- node attacks: the wire seam's hooks in one node process -----------------------------------------


class NodeAttack(Tamper, ABC):
    """One attack of a hostile node: the wire seam's hooks it overrides (``Tamper``), installed before the node
    runs, and patches of public methods where an attack needs more (:meth:`apply`)."""

    name: str
    help: str
    keeps_peers = False  # its own node never bans anyone (it wants to stay in the honest nodes' groups)

    def __init__(self, period: float) -> None:
        self.period = period
        self._carried_out = False

    def carried_out(self) -> None:
        """Log once that a patch really changed what this node sends or serves. A patch that no longer fits
        the code it wraps fails inside the node's tasks, not at start, and the node goes on as an honest
        one: the adversarial tests look for this line to know the attack ran at all."""
        if not self._carried_out:
            self._carried_out = True
            log.warning("hostile node: %s: %r at %.3f", CARRIED_OUT, self.name, time.time())

    def install(self) -> None:
        """The attack's hooks and patches, and for an attacker that keeps its peers, a reputation that bans
        nobody: the node's own defences would otherwise judge the honest contributions against its own hostile
        one, ban every honest node, exclude them in its match entries and so leave their groups (isolated,
        harmless, and never judged again)."""
        if self.keeps_peers:
            Reputation.is_banned = lambda self, peer: False
            Reputation.banned = lambda self: []
            Reputation.offended = lambda self, peer, kind: False
        tamper.install(self)
        self.apply()

    def apply(self) -> None:
        """Patches beyond the seam's hooks (in this process only); none by default."""


class _ContributionAttack(NodeAttack):
    """Rewrites the request this node streams to each reducer (``Tamper.contribution``)."""

    def contribution(self, reducer, req, part, bounds, codec):
        forged = self.rewrite(codec, req, part, bounds)
        self.carried_out()
        return forged

    @abstractmethod
    def rewrite(self, codec, req, part: range, bounds):
        """The request as sent to the reducer of ``part`` (``codec``: the one its chunks are encoded with)."""


class WeightAttack(_ContributionAttack):
    name = "weight"
    help = "contributions claim a token weight of 1e30"

    def rewrite(self, codec, req, part, bounds):
        return dataclasses.replace(req, weight=ABSURD)


class ValuesAttack(_ContributionAttack):
    name = "values"
    help = "contribution chunks hold values of 1e30 (encoded with the codec)"

    def rewrite(self, codec, req, part, bounds):
        chunks = list(req.chunks)
        for c in part:
            chunks[c] = absurd_chunk(codec, bounds[c][1] - bounds[c][0])
        return dataclasses.replace(req, chunks=chunks)


class NanAttack(_ContributionAttack):
    name = "nan"
    help = "contribution chunks decode to NaN (NaN fp4 scales)"

    def rewrite(self, codec, req, part, bounds):
        chunks = list(req.chunks)
        for c in part:
            chunks[c] = nan_chunk(codec, bounds[c][1] - bounds[c][0])
        return dataclasses.replace(req, chunks=chunks)


class ReducerAttack(NodeAttack):
    name = "reducer"
    help = "as a reducer, returns reduced chunks of 1e30"

    def reduced(self, fragment, round_, chunks, codec, sizes, *, consensus):
        self.carried_out()
        return {c: absurd_chunk(codec, sizes[c]) for c in chunks}


class StateAttack(NodeAttack):
    name = "state"
    help = "heartbeats claim version +1000 of every fragment; the state server serves NaN phi"

    def published(self, snapshot, outer):
        # lazy: torch, and core.transport imports it (seconds, measured)
        import torch

        from locoswarm.node.core.transport import FragmentSnapshot

        nan = torch.full_like(snapshot.phi, math.nan)
        self.carried_out()
        return FragmentSnapshot(snapshot.fragment, snapshot.version + VERSION_LIE, nan, nan.clone())

    def heartbeat(self, heartbeat, outer):
        for fs in heartbeat.fragments:  # the norm a peer sees looks healthy; only the served state is NaN
            fs.phi_norm = float(outer.snapshot(fs.fragment).phi.norm())
        return heartbeat


class ClockAttack(NodeAttack):
    name = "clock"
    help = "the heartbeat clock claims +10000 more every --attack-period seconds"

    def __init__(self, period: float) -> None:
        super().__init__(period)
        self.started = time.monotonic()

    def heartbeat(self, heartbeat, outer):
        heartbeat.clock += CLOCK_JUMP * (1 + int((time.monotonic() - self.started) // self.period))
        self.carried_out()
        return heartbeat


class ForgeAttack(NodeAttack):
    name = "forge"
    help = "contribution headers name another member as the sender"

    def __init__(self, period: float) -> None:
        super().__init__(period)
        self.transport = None

    def attached(self, transport) -> None:
        self.transport = transport

    def sender(self, reducer, own):
        live = self.transport.view.live_peers() if self.transport is not None else []
        others = sorted(p for p in live if p not in (reducer, own))
        forged = others[0] if others else reducer
        if forged != reducer:
            self.carried_out()
        return forged


# ---- in-bound node attacks --------------------------------------------------------------------------


class _RequestAttack(NodeAttack):
    """Rewrites every contribution this node starts (``SwarmTransport.start_average``, the transport's public
    entry) as the attack's values of its own progress; consensus rounds (phi itself) stay honest."""

    claimed_weight = 1.0  # times the node's own token weight
    keeps_peers = True

    def __init__(self, period: float) -> None:
        super().__init__(period)
        self.started = time.monotonic()

    def apply(self) -> None:
        # lazy: swarm.averaging imports torch and hivemind (seconds, measured)
        from locoswarm.node.swarm.averaging import SwarmTransport

        original = SwarmTransport.start_average
        attack = self

        @functools.wraps(original)
        def start_average(transport, request):
            if request.digest or not attack.active():
                return attack.watch(transport, request, original(transport, request))
            forged = attack.rewrite(transport, request)
            if forged is not request:
                attack.carried_out()
            return attack.watch(transport, request, original(transport, forged))

        SwarmTransport.start_average = start_average

    def active(self) -> bool:
        return True

    def watch(self, transport, request, handle):
        """The handle of a round this node started (an attack that learns from results wraps it)."""
        return handle

    def rewrite(self, transport, req):
        # lazy: torch, and core.codecs and .payload import it (seconds, measured)
        import torch

        from locoswarm.node.core.codecs import get_codec
        from locoswarm.node.core.payload import decode_chunks, encode_chunks

        codec = get_codec(req.codec or transport.codec.name, transport.codec.block_size)
        own = decode_chunks(codec, req.chunks, req.numel)
        values = self.values(req, own)
        if values is None:
            return req
        return dataclasses.replace(req, chunks=encode_chunks(codec, values.to(torch.float32)),
                                   weight=req.weight * self.claimed_weight)

    @abstractmethod
    def values(self, req, own):
        """The contribution to send instead of ``own`` (None: send ``req`` unchanged)."""


class FlipAttack(_RequestAttack):
    name = "flip"
    help = "its own progress negated and scaled by 5 (inside the reject factor), claiming 4x its weight"
    claimed_weight = 4.0

    def values(self, req, own):
        return -5.0 * own


class SleeperAttack(FlipAttack):
    name = "sleeper"
    help = "honest for --attack-period seconds, then flip"

    def active(self) -> bool:
        if getattr(self, "_first", None) is None:
            self._first = time.monotonic()  # its first round: it trains from here (joining takes a while)
        turned = time.monotonic() - self._first >= self.period
        if turned and not getattr(self, "_announced", False):
            self._announced = True
            log.warning("sleeper: turning hostile now")
        return turned


class IpmAttack(_RequestAttack):
    name = "ipm"
    help = "inner-product manipulation: the negative of the last group average it received"

    def __init__(self, period: float) -> None:
        super().__init__(period)
        self.last: dict[int, object] = {}

    def watch(self, transport, request, handle):
        attack = self

        class Watched:
            def __getattr__(self, name):
                return getattr(handle, name)

            def result(self, timeout=None):
                res = handle.result(timeout)
                if res.ok and res.average is not None and not request.digest:
                    attack.last[request.fragment] = res.average.clone()
                return res

        return Watched()

    def values(self, req, own):
        last = self.last.get(req.fragment)
        if last is None or last.numel() != own.numel():
            return -own
        return -last * (float(own.norm()) / max(float(last.norm()), 1e-12))


class DriftAttack(_RequestAttack):
    name = "drift"
    help = "its own progress plus 2x its rms times a fixed sign pattern, every round"

    def values(self, req, own):
        # lazy: torch (seconds to import, measured)
        import torch

        gen = torch.Generator().manual_seed(1000 + req.fragment)
        pattern = torch.randint(0, 2, (own.numel(),), generator=gen).float() * 2 - 1
        rms = float(own.norm()) / max(1, own.numel()) ** 0.5
        return own + 2.0 * rms * pattern


class ReplayAttack(NodeAttack):
    name = "replay"
    help = "sends the reduced chunks its group agreed on two rounds before as its contribution"
    keeps_peers = True

    def __init__(self, period: float) -> None:
        super().__init__(period)
        self.seen: dict[int, list[dict[int, bytes]]] = {}  # fragment -> reduced chunks of its last rounds, oldest first
        self.current: dict[tuple[int, int], dict[int, bytes]] = {}

    def keep(self, fragment: int, round_: int, chunks: dict[int, bytes]) -> None:
        rounds = self.current.setdefault((fragment, round_), {})
        rounds.update(chunks)
        history = self.seen.setdefault(fragment, [])
        if not history or history[-1] is not rounds:
            history.append(rounds)
            del history[:-4]

    def returned(self, reducer, req, chunks):
        if not req.digest:
            self.keep(req.fragment, req.round, dict(chunks))

    def reduced(self, fragment, round_, chunks, codec, sizes, *, consensus):
        if not consensus:
            self.keep(fragment, round_, dict(chunks))
        return chunks

    def apply(self) -> None:
        # lazy: swarm.averaging imports torch and hivemind (seconds, measured)
        from locoswarm.node.swarm.averaging import SwarmTransport

        original_start = SwarmTransport.start_average
        attack = self

        @functools.wraps(original_start)
        def start_average(transport, req):
            history = attack.seen.get(req.fragment, [])
            old = history[-3] if len(history) >= 3 else None
            if req.digest or old is None:
                return original_start(transport, req)
            chunks = [old.get(c, data) if len(old.get(c, b"")) == len(data) else data
                      for c, data in enumerate(req.chunks)]
            if chunks != list(req.chunks):
                attack.carried_out()
            return original_start(transport, dataclasses.replace(req, chunks=chunks))

        SwarmTransport.start_average = start_average


class _PartAttack(NodeAttack):
    """As a reducer, it reduces honestly, then changes each chunk of its part of the average (:meth:`turn`) before
    it streams the part back; rounds that average phi itself are left alone."""

    keeps_peers = True

    def reduced(self, fragment, round_, chunks, codec, sizes, *, consensus):
        if consensus:
            return chunks
        self.carried_out()
        return {c: codec.encode(self.turn(fragment, c, codec.decode(data, sizes[c]))) for c, data in chunks.items()}

    @staticmethod
    @abstractmethod
    def turn(fragment: int, chunk: int, values: torch.Tensor) -> torch.Tensor:
        """What it sends instead of the reduced ``values`` of ``chunk`` of ``fragment``."""


class BadReduceAttack(_PartAttack):
    name = "badreduce"
    help = "as a reducer, returns its part of the average negated and scaled by 3"

    @staticmethod
    def turn(fragment: int, chunk: int, values: torch.Tensor) -> torch.Tensor:
        return -3.0 * values


class ReduceDriftAttack(_PartAttack):
    name = "reducedrift"
    help = "as a reducer, adds 2x its part's rms times a fixed sign pattern to its part of the average, every round"
    scale = 2.0

    @classmethod
    def turn(cls, fragment: int, chunk: int, values: torch.Tensor) -> torch.Tensor:
        # lazy: torch (seconds to import, measured)
        import torch

        # the same pattern for this chunk of this fragment in every round: its effect adds up
        gen = torch.Generator().manual_seed(2000 + 1000 * fragment + chunk)
        pattern = torch.randint(0, 2, values.shape, generator=gen).to(values.dtype) * 2 - 1
        rms = float(values.norm()) / max(1, values.numel()) ** 0.5
        return values + cls.scale * rms * pattern


class ReduceNudgeAttack(ReduceDriftAttack):
    name = "reducenudge"
    help = ("reducedrift at 0.8x its part's rms: a smaller pattern, for the spread check's sensitivity (3.3-3.8x a "
            "member's own part's spread in groups of 4, about 1x in groups of 6)")
    scale = 0.8


class StateLiarAttack(NodeAttack):
    name = "stateliar"
    help = "heartbeats claim version +2 (inside the clock's bound) and its state server serves its phi negated"
    lie = 2
    keeps_peers = True

    def published(self, snapshot, outer):
        # lazy: core.transport imports torch (seconds, measured)
        from locoswarm.node.core.transport import FragmentSnapshot

        self.carried_out()
        return FragmentSnapshot(snapshot.fragment, snapshot.version + self.lie,
                                self.poison(snapshot.phi, snapshot.version), snapshot.momentum.clone())

    @staticmethod
    def poison(phi: torch.Tensor, version: int) -> torch.Tensor:
        return -phi


class StateNoiseAttack(StateLiarAttack):
    name = "statenoise"
    help = "as stateliar, but it serves noise of its phi's norm (no reversal: cosine about 0 with honest phis)"

    @staticmethod
    def poison(phi: torch.Tensor, version: int) -> torch.Tensor:
        # lazy: torch (seconds to import, measured)
        import torch

        noise = torch.randn(phi.shape, generator=torch.Generator().manual_seed(version), dtype=phi.dtype)
        return (noise * (phi.norm() / noise.norm().clamp_min(1e-12))).to(phi.device)


class VersionLiarAttack(StateLiarAttack):
    name = "versionliar"
    help = "heartbeats claim version +1000 and its state server serves its phi negated"
    lie = VERSION_LIE


class ReplayLiarAttack(StateLiarAttack):
    name = "replayliar"
    help = ("heartbeats claim version +2 and its state server serves the two steps that lead there from its real "
            "state: its last group average negated, twice, with the digests they really reach (a replay that "
            "checks out step by step and ends where the liar claims)")

    def __init__(self, period: float) -> None:
        super().__init__(period)
        self.block_size = 0  # of the swarm's block codecs: read from the transport once it is built

    def attached(self, transport) -> None:
        self.block_size = transport.codec.block_size

    def published(self, snapshot, outer):
        # lazy: core.codecs, .payload, .state and .transport import torch (seconds, measured)
        from locoswarm.node.core.codecs import get_codec
        from locoswarm.node.core.payload import decode_chunks, encode_chunks
        from locoswarm.node.core.state import state_digest
        from locoswarm.node.core.transport import EncodedAverage, FragmentSnapshot, OuterStep

        if not snapshot.steps:  # nothing logged to forge from yet (a catch-up or a consensus broke the chain)
            return snapshot
        last = snapshot.steps[-1].average
        codec = get_codec(last.codec, self.block_size)
        turned = encode_chunks(codec, -decode_chunks(codec, list(last.chunks), last.numel))
        forged = EncodedAverage(last.codec, last.numel, tuple(turned))
        delta = decode_chunks(codec, list(forged.chunks), forged.numel)  # what a replaying node decodes
        phi, momentum = snapshot.phi.clone(), snapshot.momentum.clone()
        steps = []
        for k in range(1, self.lie + 1):
            before = state_digest(phi, momentum)
            outer.optimizer.step(phi, momentum, delta)
            steps.append(OuterStep(snapshot.version + k, forged, before, state_digest(phi, momentum)))
        self.carried_out()
        return FragmentSnapshot(snapshot.fragment, snapshot.version + self.lie, phi, momentum, steps=tuple(steps))


NODE_ATTACKS: dict[str, type[NodeAttack]] = {a.name: a for a in (
    WeightAttack, ValuesAttack, NanAttack, ReducerAttack, StateAttack, ClockAttack, ForgeAttack, FlipAttack, IpmAttack,
    DriftAttack, SleeperAttack, ReplayAttack, BadReduceAttack, ReduceDriftAttack, ReduceNudgeAttack, StateLiarAttack,
    StateNoiseAttack, VersionLiarAttack, ReplayLiarAttack)}


# ---- client attacks: a peer that never joins matchmaking --------------------------------------------


@dataclasses.dataclass
class ClientOptions:
    config: str | None
    bootstrap: list[str]
    state_dir: Path
    seconds: float
    report: Path | None
    streams: int
    frame_mib: int
    seed: int


class HostileClient(ABC):
    """A DHT peer with its own libp2p identity that reads the swarm's public records and attacks its
    peers' handlers directly. ``run`` returns the JSON-able report."""

    name: str
    help: str

    def __init__(self, opts: ClientOptions) -> None:
        self.opts = opts
        self.cfg = load_config(opts.config, [])
        self.fingerprint = fingerprint(self.cfg)
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        self.samples: dict[str, list[str]] = {}

    def note(self, kind: str, text: str = "") -> None:
        """Count an outcome; keep the first few texts of each kind for the report."""
        self.counts[kind] += 1
        if text:
            kept = self.samples.setdefault(kind, [])
            if len(kept) < 5 and text not in kept:
                kept.append(text[:200])

    def run(self) -> dict:
        self.dht = start_dht(self.opts.bootstrap, identity_path=self.opts.state_dir / "identity.key", attempts=5,
                             log=lambda line: log.warning(line), stop=self.stop)
        try:
            self.runtime = NetworkRuntime(self.dht)
            self.peer_id = self.runtime.peer_id
            self.membership = Membership(self.dht, self.cfg, self.peer_id)  # read-only: never publishes
            self.swarm_key = swarm_key(self.cfg.swarm.name, self.fingerprint, "")
            deadline = time.monotonic() + self.opts.seconds
            log.info("hostile client %s (%s) for %.0f s", self.peer_id, self.name, self.opts.seconds)
            self.runtime.call(self.attack(deadline), timeout=self.opts.seconds + 120)
        finally:
            with contextlib.suppress(Exception):
                self.runtime.stop()
            self.dht.shutdown()
        return {"attack": self.name, "peer_id": self.peer_id, "seconds": self.opts.seconds,
                "counts": dict(self.counts), "samples": self.samples}

    def active(self, deadline: float) -> bool:
        """Still attacking: before ``deadline`` (monotonic) and not told to stop (SIGTERM)."""
        return time.monotonic() < deadline and not self.stop.is_set()

    def live_peers(self) -> dict:
        return self.membership.peers()

    async def peers_async(self) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self.live_peers)

    @abstractmethod
    async def attack(self, deadline: float) -> None:
        """Attack until ``deadline`` (monotonic), on the network loop."""


class InjectClient(HostileClient):
    name = "inject"
    help = "streams contributions to recent rounds' members under a forged (or its own) sender id"

    def __init__(self, opts: ClientOptions) -> None:
        super().__init__(opts)
        # lazy: core.codecs, .schedule, data, model and partition import torch (seconds, measured)
        from locoswarm.node.core.codecs import get_codec
        from locoswarm.node.core.schedule import make_schedule
        from locoswarm.node.data import load_tokenizer
        from locoswarm.node.model import build_model
        from locoswarm.node.partition import partition

        tokenizer = load_tokenizer(self.cfg.model.tokenizer)
        model = build_model(self.cfg.model, tokenizer.vocab_size, seed=self.cfg.data.seed)
        self.numel = [sum(dict(model.named_parameters())[n].numel() for n in f.names)
                      for f in partition(model, self.cfg.outer.fragments)]
        self.codec = get_codec(self.cfg.outer.codec, self.cfg.outer.block_size)
        self.schedule = make_schedule("fixed", self.cfg.outer.h, self.cfg.outer.fragments)
        self.rng = random.Random(opts.seed)
        self.done: set[tuple[int, int]] = set()
        self.own_round: tuple[int, int] | None = None  # the round attacked under its own id
        self.own_answered = asyncio.Event()               # ... and answered
        self.forged_rounds = 0

    async def attack(self, deadline: float) -> None:
        if self.cfg.outer.schedule != "fixed":
            raise HostileError("inject follows the fixed schedule's rounds; use a swarm with outer.schedule = fixed")
        tasks: set[asyncio.Task] = set()
        while self.active(deadline):
            peers = await self.peers_async()
            clocks = sorted(hb.clock for hb in peers.values())
            if clocks:
                clock = clocks[len(clocks) // 2]
                for t in range(max(1, clock - 2 * self.cfg.outer.h), clock + 1):
                    for p in self.schedule.due(t):
                        if (p, t) not in self.done:
                            task = asyncio.create_task(self.inject_round(p, t))
                            tasks.add(task)
                            task.add_done_callback(tasks.discard)
            await asyncio.sleep(0.3)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def entries(self, fragment: int, round_: int) -> dict:
        # lazy: swarm.records imports torch and hivemind (seconds, measured; HIVEMIND_LOGLEVEL: see the head)
        from locoswarm.node.swarm.records import subkey_peer

        found = await self.dht.get(f"{self.swarm_key}/match/{fragment}/{round_}", latest=True, return_future=True)
        out = {}
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                with contextlib.suppress(Exception):
                    entry = swarm_pb2.MatchEntry.FromString(item.value)
                    if entry.peer_id == subkey_peer(subkey):
                        out[entry.peer_id] = entry
        return out

    async def inject_round(self, fragment: int, round_: int) -> None:
        # lazy: transport.groups imports torch (seconds, measured)
        from locoswarm.node.transport.groups import form_groups, kept_apart

        entries = await self.entries(fragment, round_)
        if len(entries) < 2:
            return  # not formed yet (or a lone member): try again on the next pass
        self.done.add((fragment, round_))
        self.note("rounds_found")
        # The first round under its own id, every later one once that round has been answered: a forged sender
        # is a conclusive offence (banned at once), so a forged stream that overtook the own-id ones left the
        # non-member path untried, and own-id streams to several rounds at once earned a ban for it before any
        # forged one was sent (two CI runs, 2026-12-03). Then forged, then either at random.
        if self.own_round is None:
            self.own_round = (fragment, round_)
            forged = False
        else:
            await self.own_answered.wait()
            forged = self.forged_rounds == 0 or self.rng.random() < 0.5
            self.forged_rounds += forged
        members = sorted(entries)
        excluded = {p: list(entries[p].excluded) for p in members}
        doubted = {p: list(entries[p].doubted) for p in members}
        apart = kept_apart(excluded, doubted) if self.cfg.robust.drift_ceiling < 1 else excluded
        groups = form_groups(members, fragment, round_, self.cfg.network.group_size, apart)
        jobs = []
        for group in groups:
            if len(group) < 2:
                continue
            for j, reducer in enumerate(group):
                sender = next(m for m in group if m != reducer) if forged else self.peer_id
                jobs.append(self.send_part(fragment, round_, group, j, sender, entries[reducer]))
        await asyncio.gather(*jobs, return_exceptions=True)
        if not forged:
            self.own_answered.set()

    async def send_part(self, fragment: int, round_: int, group: list[str], j: int, sender: str, entry) -> None:
        # lazy: torch, and core.payload, swarm.exchange and transport.reduce import it (seconds, measured);
        # swarm.exchange imports hivemind too (HIVEMIND_LOGLEVEL: see the head)
        import torch

        from locoswarm.node.core.payload import chunk_bounds
        from locoswarm.node.swarm.exchange import AVERAGE_HANDLER, MAX_HEADER_BYTES, group_hash
        from locoswarm.node.transport.reduce import reducer_parts

        bounds = chunk_bounds(self.numel[fragment], self.codec.block_size)
        part = reducer_parts(len(bounds), group, round_=round_)[j]
        header = swarm_pb2.AverageRequest(header=swarm_pb2.AverageHeader(
            fingerprint=self.fingerprint, fragment=fragment, round=round_, group_hash=group_hash(group),
            sender=sender, weight=max(1.0, entry.weight), version=entry.version, n_chunks=len(part)))

        async def requests():
            yield header
            for c in part:  # plausible values: small noise, as a real pseudo-gradient
                n = bounds[c][1] - bounds[c][0]
                data = self.codec.encode(0.01 * torch.randn(n))
                yield swarm_pb2.AverageRequest(chunk=swarm_pb2.Chunk(index=c, data=data))

        how = "forged" if sender != self.peer_id else "own_id"
        try:
            async with open_stream(self.runtime.p2p, group[j], AVERAGE_HANDLER, requests(), swarm_pb2.AverageReply,
                                   max_reply_bytes=max(MAX_HEADER_BYTES, 1 << 20), idle_timeout=20.0) as replies:
                first = await anext(replies, None)
                if first is not None and first.HasField("header") and first.header.ok:
                    self.note("accepted", f"{how}: reducer {group[j][:12]} answered ok")
                    self.note(f"accepted_{how}")
                else:
                    self.note("refused", f"{how}: no ok header")
        except PeerRefused as exc:
            self.note("refused", f"{how}: {exc}")
            self.note(f"refused_{how}")
        except WireError as exc:
            self.note("errors", f"{how}: {exc}")


class FloodClient(HostileClient):
    name = "flood"
    help = "many concurrent streams, each announcing a huge chunk frame (--frame-mib, --streams per peer)"

    async def attack(self, deadline: float) -> None:
        peers = {}
        while not peers and self.active(deadline):
            peers = await self.peers_async()
            await asyncio.sleep(0.3)
        workers = [asyncio.create_task(self.stream_loop(peer, k, deadline))
                   for peer in sorted(peers) for k in range(self.opts.streams)]
        await asyncio.gather(*workers, return_exceptions=True)

    async def stream_loop(self, peer: str, k: int, deadline: float) -> None:
        while self.active(deadline):
            try:
                await asyncio.wait_for(self.one_stream(peer, with_header=k % 2 == 1), deadline - time.monotonic())
            except TimeoutError:
                return
            except Exception as exc:
                self.note("errors", f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.05)

    async def one_stream(self, peer: str, with_header: bool) -> None:
        # lazy: hivemind, and swarm.exchange imports it and torch (seconds, measured; HIVEMIND_LOGLEVEL: see the head)
        from hivemind.p2p import PeerID

        from locoswarm.node.swarm.exchange import AVERAGE_HANDLER

        _, reader, writer = await self.runtime.p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                               AVERAGE_HANDLER)
        self.note("streams_opened")
        try:
            if with_header:  # a well-formed header first (its own id: authentication passes), then the flood
                header = swarm_pb2.AverageRequest(header=swarm_pb2.AverageHeader(
                    fingerprint=self.fingerprint, fragment=0, round=10**9, sender=self.peer_id, weight=1.0,
                    n_chunks=1)).SerializeToString()
                writer.write(b"\x00" + len(header).to_bytes(8, "big") + header)
            writer.write(b"\x00" + (self.opts.frame_mib * MIB).to_bytes(8, "big"))
            block = bytes(MIB)
            for _ in range(self.opts.frame_mib):
                writer.write(block)
                await asyncio.wait_for(writer.drain(), 10.0)
                self.note("mib_written")
            self.note("frames_completed")
        except (ConnectionError, OSError, TimeoutError) as exc:
            self.note("streams_cut", type(exc).__name__)
        finally:
            with contextlib.suppress(Exception):
                answer = await asyncio.wait_for(reader.read(4096), 2.0)
                if answer[:1] == b"\x01":
                    self.note("refusals_read", answer[9:].decode(errors="replace"))
            writer.close()


class DownloadClient(HostileClient):
    name = "download"
    help = "requests full state downloads of every fragment from every live peer, in a loop"

    async def attack(self, deadline: float) -> None:
        # lazy: hivemind, and swarm.state_sync imports torch (seconds, measured; HIVEMIND_LOGLEVEL: see the head)
        from hivemind.p2p import PeerID

        from locoswarm.node.swarm.state_sync import STATE_HANDLER

        while self.active(deadline):
            peers = await self.peers_async()
            for peer in sorted(peers):
                for fragment in range(self.cfg.outer.fragments):
                    request = swarm_pb2.StateRequest(fingerprint=self.fingerprint, fragment=fragment)
                    self.note("requests")
                    try:
                        stream = await self.runtime.p2p.iterate_protobuf_handler(
                            PeerID.from_base58(peer), STATE_HANDLER, request, swarm_pb2.StateChunk)
                        got = 0
                        async for msg in stream:
                            if msg.error:
                                self.note("refused", msg.error)
                                break
                            got += len(msg.phi) + len(msg.momentum)
                            if msg.offset + len(msg.phi) // 4 >= msg.numel:
                                self.note("completed")
                        self.counts["bytes"] += got
                    except Exception as exc:
                        self.note("errors", f"{type(exc).__name__}: {str(exc)[:120]}")
            await asyncio.sleep(0.2)


CLIENT_ATTACKS: dict[str, type[HostileClient]] = {c.name: c for c in (InjectClient, FloodClient, DownloadClient)}
ALL_ATTACKS = (*NODE_ATTACKS, *CLIENT_ATTACKS)


# ---- command line ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    kinds = "\n".join(f"  {a.name:<9} {a.help}" for a in (*NODE_ATTACKS.values(), *CLIENT_ATTACKS.values()))
    p = argparse.ArgumentParser(
        prog="python -m locoswarm.node.bench.hostile", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="a hostile peer (a patched node, or a client that never joins) for robustness tests",
        epilog=f"attacks:\n{kinds}\n\nA node attack passes every other argument to 'locoswarm run' "
               "(e.g. --state-dir DIR --config peers.toml --bootstrap MULTIADDR).")
    p.add_argument("--attack", default=os.environ.get(ATTACK_ENV), metavar="KIND",
                   help=f"the attack (env {ATTACK_ENV}): one of {', '.join(ALL_ATTACKS)}")
    p.add_argument("--attack-period", type=float, default=5.0,
                   help="clock: seconds between two further jumps of the claimed clock; sleeper: seconds it behaves "
                        "before it turns (default 5)")
    client = p.add_argument_group("client attacks (inject, flood, download)")
    client.add_argument("--config", default=None, help="the swarm's peers.toml")
    client.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                        help="a peer of the swarm (repeatable; required)")
    client.add_argument("--state-dir", default=None,
                        help="where its identity key lives (default: a temporary directory, removed)")
    client.add_argument("--seconds", type=float, default=30.0, help="how long to attack (default 30)")
    client.add_argument("--report", default=None, help="write the JSON report to this file")
    client.add_argument("--streams", type=int, default=24, help="flood: concurrent streams per peer (default 24)")
    client.add_argument("--frame-mib", type=int, default=600,
                        help="flood: MiB each frame announces and tries to send (default 600)")
    client.add_argument("--threads", type=int, default=None, help="torch CPU threads (a node attack: 'run --threads')")
    client.add_argument("--seed", type=int, default=None, help="inject: random seed (a node attack: 'run --seed')")
    return p


def _fail(message: str) -> int:
    print(f"hostile: error: {message} (see 'python -m locoswarm.node.bench.hostile --help')", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv)
    if not args.attack:
        return _fail(f"no attack given: pass --attack KIND (or set {ATTACK_ENV}); one of {', '.join(ALL_ATTACKS)}")
    if args.attack not in ALL_ATTACKS:
        return _fail(f"--attack {args.attack!r} is not an attack; choose one of {', '.join(ALL_ATTACKS)}")
    if not (math.isfinite(args.attack_period) and args.attack_period > 0):
        return _fail(f"--attack-period {args.attack_period} must be a positive number of seconds")
    if args.attack in NODE_ATTACKS:
        return run_hostile_node(args, rest)
    if rest:
        return _fail(f"unknown argument(s) for a client attack: {' '.join(rest)}")
    try:
        return run_client(args)
    except HostileError as exc:
        return _fail(str(exc))


def run_hostile_node(args: argparse.Namespace, rest: list[str]) -> int:
    """Patch this process for the attack, then run the ordinary node with the other arguments."""
    # lazy: locoswarm.node.cli imports torch (seconds, measured)
    from locoswarm.node.cli import main as cli_main

    # The client flags parsed above belong to 'locoswarm run' as well: hand them back.
    for flag, value in (("--config", args.config), ("--state-dir", args.state_dir), ("--seed", args.seed),
                        ("--threads", args.threads)):
        if value is not None:
            rest += [flag, str(value)]
    for addr in args.bootstrap:
        rest += ["--bootstrap", addr]
    NODE_ATTACKS[args.attack](args.attack_period).install()
    logging.getLogger("locoswarm.hostile").warning("hostile node: attack %r armed", args.attack)
    return cli_main(["run", *rest])


def run_client(args: argparse.Namespace) -> int:
    if not args.bootstrap:
        raise HostileError(f"--attack {args.attack} needs --bootstrap MULTIADDR (a peer of the swarm)")
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= 24 * 3600):
        raise HostileError(f"--seconds {args.seconds} must be in (0, 86400]")
    if args.streams < 1 or args.frame_mib < 1:
        raise HostileError("--streams and --frame-mib must be >= 1")
    if args.config and not Path(args.config).is_file():
        raise HostileError(f"--config {args.config}: no such file")
    if args.threads:
        # lazy: torch (seconds to import, measured)
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-5s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
    with contextlib.ExitStack() as stack:
        state_dir = Path(args.state_dir) if args.state_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        opts = ClientOptions(config=args.config, bootstrap=list(args.bootstrap), state_dir=state_dir,
                             seconds=args.seconds, report=Path(args.report) if args.report else None,
                             streams=args.streams, frame_mib=args.frame_mib, seed=args.seed or 0)
        client = CLIENT_ATTACKS[args.attack](opts)
        signal.signal(signal.SIGTERM, lambda *_: client.stop.set())
        report = client.run()
    text = json.dumps(report)
    if opts.report is not None:
        opts.report.write_text(text)
    print(f"hostile-report: {text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
