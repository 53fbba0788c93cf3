"""Outer-state download between peers: how a joining node (or one that fell behind) gets phi and b.

The server answers a ``StateRequest`` for one fragment with a stream of ``StateChunk``s (phi in fp32,
momentum in the precision the request asks for, 16 Ki elements per message) from an immutable snapshot,
so a download never sees a half-applied outer step.

Precision: phi is always exact (fp32), since a node rounds from it and must hold its version's phi. The
momentum may travel in bf16 (``MOMENTUM_BF16``, config ``network.state_momentum``): 6 bytes per parameter
instead of 8, a quarter less to download before a joiner or a node behind rounds again. The price: the
downloader's momentum differs from its source's by bf16 rounding (relative 2^-9), and so, slightly, do
the phis it computes from then on; the swarm's phis then agree to that rounding, no longer bit for bit
(one consensus round or the next catch-up makes them equal again). fp32 is the default.

Flow control: the server sends at most ``CREDIT_CHUNKS`` chunks ahead of the client. Each further
``StateRequest`` the client writes on the same stream (one per chunk received) lets it send one more.
Without that, a download filled every buffer between the two processes (socket buffers, libp2p's
per-stream window) with megabytes, and the DHT's messages and the rounds' parts, which share the
peers' one libp2p connection, queued behind them: at 5 Mbit/s a holder serving three joiners could
not publish its heartbeat for tens of seconds ("no answer from the DHT in 5 s"), was taken for gone
and the rounds fell apart. Now at most ``CREDIT_CHUNKS`` x 128 KiB of one download wait ahead of
them (0.8 s at 5 Mbit/s), and at most ``SERVER_CREDIT_CHUNKS`` of all the downloads a server serves at
once (``SharedCredit``): per download alone, three joiners pulling two fragments each still queued 3 MB
(5 s at 5 Mbit/s) and a bench run logged the DHT timeouts again. The price is throughput on links whose
bandwidth-delay product exceeds that window (about 40 Mbit/s at 100 ms round trip per download). After
its last chunk the server reads the client's trailing acknowledgements up to its END before closing: a
stream closed with unread data is reset, which cut the last chunk short.

Rounds first: while this node has a round's exchange in flight (``yield_to()``), the server holds its next
chunk back, at most ``YIELD_MAX_S`` per chunk. A holder serving a joiner or a node behind otherwise filled its
uplink with the download, its own round waited behind it, and training stalled at the round's late window: a
5 Mbit/s bench run saw a holder send 6.9 MB of state in 16 s while making 16 inner steps instead of ~50 (with
F = 1, a catch-up is the whole model). A download still gets the link between rounds. The client does not hold
back its acknowledgements during its own rounds: a round exchanges for most of its 4-7 s at 5 Mbit/s while using
a seventh of the link, and in two bench runs that did, a 4.5 MB catch-up took 15-47 s instead of 4-22 s, landed
a version already stale and was followed by another (0.75 and 0.80 of unshaped, against 0.67-1.00 without).

The client is resumable: when a peer fails mid-stream it continues from the last element received with
another peer holding the same version. A joiner spreads its fragments over several peers, and any download
with more than one holder to ask spreads over them: its first pass asks each holder with ``spread`` set, which
a holder that is sending another peer a download refuses (``busy``), and only if every holder did is the
download asked again of those, without it. Two nodes behind NAT that caught up at once from the same one of
their two public holders otherwise took the whole of its 5 Mbit/s link for 30 s.

Both ends use the bounded framing of ``locoswarm.node.swarm.wire``: a request is at most ``MAX_REQUEST_BYTES``, a
chunk at most ``MAX_CHUNK_BYTES``, each message must arrive within ``IDLE_TIMEOUT``, and the server caps
concurrent downloads per peer and in total.

The state is served only to a peer that is not banned, has a live heartbeat in this swarm's DHT (checked
on the authenticated libp2p id of the stream, never on a field of the request) and stays within a per-peer
rate (``StateRateLimiter``). The heartbeat is the one in this node's peer table, or, for a peer not in it
yet (a joiner whose heartbeat this node has not read: at 5 Mbit/s a holder serving a download could not
refresh its table for 30 s), one found by reading the swarm's peers key in the DHT at the request
(``confirm_live``; at most ``LOOKUPS`` at once, a peer's answer kept ``LIVE_CACHE_S``). A heartbeat the
requester presents in its request is no proof: anyone can make one, and a stranger downloaded the full state
96 times that way. A heartbeat in the DHT is signed under the peer's owner subkey and seen by every member.

A node that peers cannot dial (outbound only, behind a home router) serves no state, only replays. Downloaders skip
it by its heartbeat, but one that has not read that heartbeat yet can still reach it over a connection the node
opened, and a 4.5 MB fragment takes its 5 Mbit/s uplink for 7 s, which its own rounds, and every member of them,
would wait for. It refuses ``outbound-only``, and the client asks it again a minute later at the earliest.

Serving is bounded by a bandwidth budget over all downloads (``ServeBudget``, ``[robust] state_serve_mbit``),
and members that train (a heartbeat with state) are served before peers that do not (joiners, and anyone
who merely publishes a heartbeat); rounds come first anyway (above).
A refusal is one line, ``"<code>: <why>"`` in ``StateChunk.error``, and is reported to
``on_refused``; only the refusals a peer earned (a flood of requests far past the rate, a
malformed request) count as offences.

The client trusts nothing it downloads: each chunk must be the next one (no gap, no overlap), of the
fragment and version asked for, finite, and the whole must be exactly the size this node expects for the
fragment. A source that breaks a rule is reported to ``on_bad``, everything it sent is dropped, and the
download starts over with the next holder. Refusals that pass with time (not live yet, too many streams)
are retried with a backoff until the client's timeout; a holder that refused for another reason (banned,
rate-limited, no newer state) is not asked again for a while (``HolderBackoff``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from locoswarm.node.core.codecs import CODECS, MAX_BYTES_PER_ELEMENT
from locoswarm.node.core.state import DIGEST_BYTES
from locoswarm.node.core.step_log import REPLAY_DEPTH
from locoswarm.node.core.transport import EncodedAverage, FragmentSnapshot, OuterStep
from locoswarm.node.swarm import wire
from locoswarm.node.swarm.reputation import EveryNth
from locoswarm.protocol import swarm_pb2

if TYPE_CHECKING:  # pragma: no cover (types only: the averaging protocol is not needed to move state)
    from locoswarm.node.swarm.counters import ByteCounters
    from locoswarm.node.swarm.runtime import NetworkRuntime

log = logging.getLogger("locoswarm.state")

STATE_HANDLER = "locoswarm.state.v1"
CHUNK_ELEMS = 1 << 14
CREDIT_CHUNKS = 4  # chunks a server sends ahead of the client's acknowledgements (module docstring)
SERVER_CREDIT_CHUNKS = 6  # chunks a server has in flight over all its downloads (module docstring)
MIN_DOWNLOAD_RATE = 250_000  # bytes/s a download is given time for, on top of the client's timeout
DRAIN_S = 5.0  # how long a server reads a client's trailing acknowledgements after its last chunk
YIELD_MAX_S = 2.0  # longest a chunk is held back for this node's own round exchange (module docstring)
YIELD_POLL_S = 0.05
MAX_REQUEST_BYTES = 2048  # a StateRequest is a fingerprint, three integers and a small heartbeat
LOOKUPS = 4               # DHT reads of unknown requesters' heartbeats at once (more wait their turn, briefly)
LOOKUP_TIMEOUT_S = 5.0
LIVE_CACHE_S = 10.0       # a requester found (or not) in the DHT is not looked up again for this long
MAX_LIVE_CACHE = 4096
MAX_CHUNK_BYTES = 2 * 4 * CHUNK_ELEMS + 4096  # phi and momentum in fp32 (the widest), plus the small fields
IDLE_TIMEOUT = 20.0  # seconds for any one message (a chunk is at most 128 KiB)
MAX_STREAMS_PER_PEER = 8
MAX_STREAMS = 64
REQUESTS_PER_MINUTE = 60
PARALLEL_DOWNLOADS = 4  # a joiner's concurrent fragment downloads (a server refuses a peer's streams past its cap)
RETRY_FIRST_S = 0.5  # first wait before asking again after a passing refusal; doubles each time
RETRY_MAX_S = 4.0
# A holder that refused this node is not asked again for a while (per refusal code; the wait doubles while
# it keeps refusing): a node behind in a fast swarm would otherwise ask at every send, several times a
# second, and earn the rate limit's refusals (and, asking on, a flood offence) from every holder.
BACKOFF_FIRST_S = {"banned": 30.0, "rate-limited": 5.0, "outbound-only": 60.0}
BACKOFF_DEFAULT_S = 2.0
BACKOFF_MAX_S = 120.0
MAX_RATE_PEERS = 4096  # rate buckets kept, least recently used dropped (only peers with a live heartbeat get one)

# The first word of a refusal (``StateChunk.error``), which the client reads to decide what to do next.
BANNED = "banned"
NOT_LIVE = "not-live"
RATE_LIMITED = "rate-limited"
FINGERPRINT = "fingerprint"
NO_STATE = "no-state"
OLD_VERSION = "old-version"
BAD_OFFSET = "bad-offset"
BAD_REQUEST = "bad-request"
BUSY = "busy"  # serving another download now, to a request that says it has other holders (``spread``)
NO_REPLAY = "no-replay"  # a replay's steps are not all kept here (``locoswarm.node.core.step_log``)
OUTBOUND = "outbound-only"  # this node serves no state: peers cannot dial it (module docstring)
_PASSING = {NOT_LIVE}  # refusals worth asking the same peer again about, after a wait
_STREAM_CAP = "too many streams"  # wire.StreamGate's refusal: passes when a stream closes


class RefusalCallback(Protocol):
    """``Reputation.refuse``'s shape: count a refusal of ``peer`` (``offence``: towards a ban)."""

    def __call__(self, peer: str, kind: str, detail: str, *, offence: bool = True) -> object: ...


BadSourceCallback = RefusalCallback  # (peer, kind, detail, offence=...): a source that served bad state

# A state that does not match the digest its version was announced with is refused every time, but counted as an
# offence only every this many times per holder: an honest holder serves one now and then. A node that follows
# its group's version (``OuterLoop._follow_group``) takes, with another phi, a version it had announced a moment
# before, and the requester read the older heartbeat (seen: an honest holder in the adversarial tests, during a
# round a hostile member had split).
DIGEST_MISMATCHES = 3


MOMENTUM_PRECISIONS = {"fp32": swarm_pb2.MOMENTUM_FP32, "bf16": swarm_pb2.MOMENTUM_BF16}
_BYTES_PER_ELEM = {swarm_pb2.MOMENTUM_FP32: 4, swarm_pb2.MOMENTUM_BF16: 2}


def _to_bytes(t: torch.Tensor, precision: int = swarm_pb2.MOMENTUM_FP32) -> bytes:
    """Little-endian fp32, or bf16 (rounded to nearest even) when ``precision`` is ``MOMENTUM_BF16``."""
    t = t.detach().to("cpu", torch.float32).contiguous()
    if precision == swarm_pb2.MOMENTUM_BF16:
        return t.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype("<f4").tobytes()


def _from_bytes(data: bytes, precision: int = swarm_pb2.MOMENTUM_FP32) -> torch.Tensor:
    """fp32 values of little-endian fp32 or bf16 bytes (the length must be a multiple of the width)."""
    if precision == swarm_pb2.MOMENTUM_BF16:
        raw = np.frombuffer(data, dtype="<i2").astype(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).to(torch.float32)
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))


def _one_line(text: str, limit: int = 200) -> str:
    """Printable, single-line, bounded text (a peer's words go into logs)."""
    clean = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return clean if len(clean) <= limit else clean[:limit - 3] + "..."


def _refusal(code: str, detail: str) -> str:
    return f"{code}: {detail}"


def _refusal_code(text: str) -> str:
    return text.split(":", 1)[0].strip()


class StateRateLimiter:
    """Per-peer token buckets: ``per_minute`` requests a minute, in bursts of at most ``per_minute``.

    A refusal is no offence by itself (an honest node far behind asks often, and a peer cannot know the
    other's bucket); a peer refused more than ``per_minute`` times a minute keeps asking regardless of the
    answers, and each refusal past that is a flood offence (:meth:`flooding`).

    Used on the network loop only. At most ``max_peers`` buckets are kept (the least recently used is
    forgotten first); the server asks only about live peers, so the swarm's size bounds them anyway.
    """

    def __init__(self, per_minute: int, *, now: Callable[[], float] = time.monotonic,
                 max_peers: int = MAX_RATE_PEERS) -> None:
        if per_minute < 1 or max_peers < 1:
            raise ValueError("per_minute and max_peers must be positive")
        self.per_minute = int(per_minute)
        self._capacity = float(per_minute)
        self._per_second = per_minute / 60.0
        self._now = now
        self._max_peers = max_peers
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, at)
        self._refusals: OrderedDict[str, tuple[float, float]] = OrderedDict()  # refusals allowed, the same way

    def take(self, peer: str) -> bool:
        """Spend one of ``peer``'s tokens; False (nothing spent) when it has none left."""
        return self._spend(self._buckets, peer)

    def flooding(self, peer: str) -> bool:
        """Count one refusal of ``peer``: True when it was refused more than ``per_minute`` times a minute."""
        return not self._spend(self._refusals, peer)

    def _spend(self, buckets: OrderedDict[str, tuple[float, float]], peer: str) -> bool:
        now = self._now()
        tokens, at = buckets.pop(peer, (self._capacity, now))
        tokens = min(self._capacity, tokens + max(0.0, now - at) * self._per_second)
        allowed = tokens >= 1.0
        buckets[peer] = (tokens - 1.0 if allowed else tokens, now)
        while len(buckets) > self._max_peers:
            buckets.popitem(last=False)
        return allowed


class SharedCredit:
    """Chunks in flight over all of a server's downloads: a chunk takes one before it is sent and gives
    it back when its client acknowledges it (or its stream ends). Waiters are served in arrival order,
    so concurrent downloads share the credit. ``high_water`` is the most ever taken at once."""

    def __init__(self, chunks: int) -> None:
        if chunks < 1:
            raise ValueError(f"a server needs a credit of at least one chunk, got {chunks}")
        self.chunks = chunks
        self._free = asyncio.Semaphore(chunks)
        self.taken = 0
        self.high_water = 0

    async def take(self) -> None:
        await self._free.acquire()
        self.taken += 1
        self.high_water = max(self.high_water, self.taken)

    def give(self, count: int = 1) -> None:
        for _ in range(count):
            self.taken -= 1
            self._free.release()


class _StreamWindow:
    """One download's chunks in flight: each holds one of the stream's own ``CREDIT_CHUNKS`` and one of the
    server's shared credit until the client acknowledges it (each later request on the stream is one),
    read as they come by a task of its own: a stream that waited for its acknowledgements only at its own
    cap kept its shared credit, and three streams holding two each with a credit of six stood still."""

    def __init__(self, credit: SharedCredit, acks: AsyncIterator[swarm_pb2.StateRequest]) -> None:
        self._credit = credit
        self._own = asyncio.Semaphore(CREDIT_CHUNKS)
        self._unacked = 0
        self._reader = asyncio.ensure_future(self._read(acks))

    async def _read(self, acks: AsyncIterator[swarm_pb2.StateRequest]) -> None:
        async for _ in acks:
            if self._unacked > 0:  # an acknowledgement ahead of its chunk buys nothing
                self._unacked -= 1
                self._own.release()
                self._credit.give()

    async def take(self) -> bool:
        """Wait for room for one more chunk: False when the client ended the stream first; a malformed
        acknowledgement raises here, as it would have where it was read."""
        for acquire in (self._own.acquire, self._credit.take):
            getter = asyncio.ensure_future(acquire())
            done, _ = await asyncio.wait({getter, self._reader}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                if self._reader.exception() is not None:
                    raise self._reader.exception()
                if acquire == self._credit.take:
                    self._own.release()
                return False
        self._unacked += 1
        return True

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for the client's END."""
        with contextlib.suppress(TimeoutError, wire.WireError):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)

    def close(self) -> None:
        self._reader.cancel()
        self._credit.give(self._unacked)
        self._unacked = 0


class ServeBudget:
    """The bytes per second a server spends on state downloads, over all of them: a token bucket of one second's
    worth, where a member that trains is served before anyone else waits (module docstring). Used on the
    network loop only. ``waited_s``: the seconds chunks waited for it."""

    def __init__(self, bytes_per_s: float, *, now: Callable[[], float] = time.monotonic) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"a serve budget needs a positive rate, got {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self.capacity = self.rate  # one second's worth
        self._tokens = self.capacity
        self._at = now()
        self._now = now
        self._members_waiting = 0
        self.waited_s = 0.0

    def _refill(self) -> None:
        now = self._now()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now

    async def take(self, n: int, member: bool) -> None:
        """Spend ``n`` bytes, waiting for them; a non-member waits while a member does."""
        need = min(float(n), self.capacity)  # a chunk larger than the bucket waits for a full one
        started = self._now()
        if member:
            self._members_waiting += 1
        try:
            while True:
                self._refill()
                if (member or self._members_waiting == 0) and self._tokens >= need:
                    self._tokens -= n
                    return
                await asyncio.sleep(min(0.5, max(0.005, (need - self._tokens) / self.rate)))
        finally:
            if member:
                self._members_waiting -= 1
            self.waited_s += self._now() - started


class StateServer:
    """Serves snapshots of this node's outer state (``snapshot(fragment)`` must be thread-safe) to the
    live, unbanned peers of this swarm, each within ``requests_per_minute`` (see the module docstring).

    ``is_live(peer)``, ``is_member(peer)`` and ``is_banned(peer)`` run on the network loop: they must be quick
    (a table look-up, no network call); ``confirm_live(peer)`` is awaited there for a peer ``is_live`` does not
    know (a DHT read; None: unknown peers are refused). ``on_refused(peer, kind, detail, offence=...)`` is told
    of every refusal. ``serve_bytes_per_s``: the budget of all downloads (None: unbounded). While
    ``outbound_only()`` holds (peers cannot dial this node: ``locoswarm.node.swarm.reachability``), it serves
    replays but no state (module docstring).
    """

    def __init__(self, runtime: NetworkRuntime, fingerprint: str,
                 snapshot: Callable[[int], FragmentSnapshot | None], counters: ByteCounters, *,
                 is_live: Callable[[str], bool], is_banned: Callable[[str], bool],
                 on_refused: RefusalCallback | None = None, max_streams_per_peer: int = MAX_STREAMS_PER_PEER,
                 requests_per_minute: int = REQUESTS_PER_MINUTE, now: Callable[[], float] = time.monotonic,
                 clock: Callable[[], tuple[int, int]] | None = None,
                 server_credit: int = SERVER_CREDIT_CHUNKS, yield_to: Callable[[], bool] | None = None,
                 confirm_live: Callable[[str], Awaitable[bool]] | None = None,
                 is_member: Callable[[str], bool] | None = None, serve_bytes_per_s: float | None = None,
                 outbound_only: Callable[[], bool] | None = None) -> None:
        self.fingerprint = fingerprint
        self._outbound_only = outbound_only or (lambda: False)
        self._confirm_live = confirm_live
        self._is_member = is_member or (lambda peer: False)
        self.budget = ServeBudget(serve_bytes_per_s) if serve_bytes_per_s else None
        self._lookups: asyncio.Semaphore | None = None  # made on the network loop, at the first lookup
        self._live_cache: OrderedDict[str, tuple[bool, float]] = OrderedDict()  # peer -> (live, monotonic time)
        self._yield_to = yield_to
        self.held_back_s = 0.0  # seconds chunks were held back for this node's rounds (module docstring)
        self.credit = SharedCredit(server_credit)
        self._clock = clock
        self.snapshot = snapshot
        self.counters = counters
        self.served = 0
        self._is_live = is_live
        self._is_banned = is_banned
        self._on_refused = on_refused
        self._limiter = StateRateLimiter(requests_per_minute, now=now)
        self._runtime = runtime
        self._serving: dict[str, int] = {}  # peer -> downloads being sent to it now (past admission)
        self._server = runtime.call(wire.serve(
            runtime.p2p, STATE_HANDLER, self._handle, swarm_pb2.StateRequest, max_request_bytes=MAX_REQUEST_BYTES,
            idle_timeout=IDLE_TIMEOUT, max_streams_per_peer=max_streams_per_peer, max_streams=MAX_STREAMS,
            on_refused=self._stream_refused), timeout=30)

    def close(self) -> None:
        """Stop serving (downloads already running finish)."""
        with contextlib.suppress(Exception):
            self._runtime.call(self._server.stop(), timeout=5)

    def streams_served(self) -> int:
        """State streams peers opened to this node since its start."""
        return self._server.served

    def open_streams(self, peer: str | None = None) -> int:
        """Downloads being served now, to ``peer`` or to anyone."""
        return self._server.open_streams(peer)

    def downloading_peers(self) -> list[str]:
        """The peers this node serves a download now."""
        return self._server.streaming_peers()

    async def _handle(self, remote: str,
                      requests: AsyncIterator[swarm_pb2.StateRequest]) -> AsyncIterator[swarm_pb2.StateChunk]:
        try:
            request = await anext(requests, None)
        except wire.FramingViolation as exc:  # oversize or malformed: the peer's fault (the wire answers it)
            self._report(remote, "state_request", str(exc), offence=True)
            raise
        if request is None:
            return
        refusal = self._admit(remote, request, await self._live(remote))
        if refusal is None:
            snap = self.snapshot(request.fragment)
            if request.replay:
                refusal = self._unreplayable(request, snap)
            else:
                refusal = self._outbound(request) or self._unservable(request, snap) or self._busy(remote, request)
        if refusal is not None:
            yield swarm_pb2.StateChunk(fragment=request.fragment, error=refusal)
            return  # the wire writes END and holds the stream until the client has closed it
        assert snap is not None
        # Closed here, not left to the garbage collector: its end gives back the shared credit it holds.
        self._serving[remote] = self._serving.get(remote, 0) + 1
        started, sent = time.monotonic(), 0
        serve = self._steps if request.replay else self._chunks
        try:
            async with contextlib.aclosing(serve(remote, request, snap, requests)) as chunks:
                async for chunk in chunks:
                    sent += chunk.ByteSize()
                    yield chunk
        finally:
            if (left := self._serving.pop(remote) - 1) > 0:
                self._serving[remote] = left
            what = (f"the steps from v{request.min_version}" if request.replay
                    else f"the state from element {request.offset}")
            log.info("served: fragment %d v%d to %s, %s: %d B in %.1f s", request.fragment, snap.version,
                     remote[:12], what, sent, time.monotonic() - started)
        self.served += 1

    def _outbound(self, request: swarm_pb2.StateRequest) -> str | None:
        """``OUTBOUND`` while peers cannot dial this node: it sits behind a home router whose uplink its own rounds
        need (module docstring)."""
        if self._outbound_only():
            return _refusal(OUTBOUND, f"this node is outbound only and serves no state of fragment {request.fragment}")
        return None

    def _busy(self, remote: str, request: swarm_pb2.StateRequest) -> str | None:
        """``BUSY`` for a request that could go to another holder (``spread``) while this node sends a download
        to another peer: two nodes behind NAT that caught up from the same one of two public holders at 5 Mbit/s
        took 9 MB off its link at once, and its rounds and DHT calls stalled for 30 s (a bench run)."""
        if request.spread and any(peer != remote for peer in self._serving):
            return _refusal(BUSY, "serving another download now; ask another holder first")
        return None

    async def _live(self, remote: str) -> bool:
        """Whether ``remote`` has a live heartbeat in this swarm: in this node's table, or in the DHT now
        (module docstring); answers are cached for ``LIVE_CACHE_S``, and lookups beyond ``LOOKUPS`` at once
        are answered no (a stranger's flood of requests must not turn into DHT traffic)."""
        if self._is_live(remote):
            return True
        if self._confirm_live is None or self._is_banned(remote):
            return False
        cached = self._live_cache.get(remote)
        if cached is not None and time.monotonic() - cached[1] < LIVE_CACHE_S:
            return cached[0]
        if self._lookups is None:
            self._lookups = asyncio.Semaphore(LOOKUPS)
        if self._lookups.locked():
            return False
        async with self._lookups:
            try:
                live = bool(await asyncio.wait_for(self._confirm_live(remote), LOOKUP_TIMEOUT_S))
            except Exception as exc:  # a DHT failure is no proof either way: refused for now (passing)
                log.debug("state: looking up %s failed: %r", remote[:16], exc)
                live = False
        self._live_cache.pop(remote, None)
        self._live_cache[remote] = (live, time.monotonic())
        while len(self._live_cache) > MAX_LIVE_CACHE:
            self._live_cache.popitem(last=False)
        return live

    def _admit(self, remote: str, request: swarm_pb2.StateRequest, live: bool) -> str | None:
        """None when ``remote`` may download now, else the refusal (reported)."""
        if self._is_banned(remote):
            return self._refuse(remote, BANNED, "state requests from this peer are refused for a while",
                                kind="state_banned", offence=False)
        if not live:
            # a stranger (counted: no offence, but seen), or a joiner whose heartbeat is not in the DHT yet
            return self._refuse(remote, NOT_LIVE, "no live heartbeat from this peer in this swarm's DHT",
                                kind="state_not_live", offence=False)
        if not self._limiter.take(remote):
            return self._refuse(remote, RATE_LIMITED, f"more than {self._limiter.per_minute} state requests "
                                                      "a minute", kind="state_rate",
                                offence=self._limiter.flooding(remote))
        if request.fingerprint != self.fingerprint:
            return self._refuse(remote, FINGERPRINT, f"{request.fingerprint[:40]!r} is not {self.fingerprint}",
                                kind="state_fingerprint", offence=False)
        if request.momentum_precision not in _BYTES_PER_ELEM:  # no version of this node sends one
            return self._refuse(remote, BAD_REQUEST, f"momentum precision {request.momentum_precision} is not one "
                                                     f"of {sorted(_BYTES_PER_ELEM)}", kind="state_request",
                                offence=True)
        return None

    @staticmethod
    def _unservable(request: swarm_pb2.StateRequest, snap: FragmentSnapshot | None) -> str | None:
        """Why this node cannot serve the request (nobody's fault: not reported), or None."""
        if snap is None:
            return _refusal(NO_STATE, f"no state for fragment {request.fragment}")
        if snap.version < request.min_version:
            return _refusal(OLD_VERSION, f"have version {snap.version} < {request.min_version}")
        if snap.version == request.min_version and request.offset > snap.phi.numel():
            return _refusal(BAD_OFFSET, f"offset {request.offset} is past the {snap.phi.numel()} elements")
        return None

    @staticmethod
    def _unreplayable(request: swarm_pb2.StateRequest, snap: FragmentSnapshot | None) -> str | None:
        """Why this node cannot serve the outer steps from ``request.min_version`` to its own version (its step
        log does not reach back that far: ``locoswarm.node.core.step_log``), or None."""
        if snap is None:
            return _refusal(NO_STATE, f"no state for fragment {request.fragment}")
        if snap.version <= request.min_version:
            return _refusal(OLD_VERSION, f"have version {snap.version}, not above {request.min_version}")
        if not snap.steps or snap.steps[0].version > request.min_version + 1:
            return _refusal(NO_REPLAY, f"the steps kept here do not reach back to version {request.min_version}")
        return None

    async def _steps(self, remote: str, request: swarm_pb2.StateRequest, snap: FragmentSnapshot,
                     acks: AsyncIterator[swarm_pb2.StateRequest]) -> AsyncIterator[swarm_pb2.StateChunk]:
        """A replay: the averages of the steps after ``request.min_version``, one message per encoded chunk, in
        order, under the same flow control, budget and rounds-first rule as a state download."""
        window = _StreamWindow(self.credit, acks)
        try:
            for step in snap.steps:
                if step.version <= request.min_version:
                    continue
                count = len(step.average.chunks)
                for index, data in enumerate(step.average.chunks):
                    if not await window.take():
                        return  # the client is done with this stream
                    await self._yield_to_rounds()
                    msg = swarm_pb2.StateChunk(
                        fragment=request.fragment, version=snap.version, numel=snap.phi.numel(),
                        momentum_precision=request.momentum_precision,
                        step=swarm_pb2.ReplayStep(version=step.version, codec=step.average.codec,
                                                  numel=step.average.numel, index=index, count=count, data=data,
                                                  before=step.before if index == 0 else b"",
                                                  after=step.after if index == 0 else b""))
                    yield await self._ready(remote, msg)
                    await asyncio.sleep(0)
            await window.drain(DRAIN_S)
        finally:
            window.close()

    async def _chunks(self, remote: str, request: swarm_pb2.StateRequest, snap: FragmentSnapshot,
                      acks: AsyncIterator[swarm_pb2.StateRequest]) -> AsyncIterator[swarm_pb2.StateChunk]:
        numel = snap.phi.numel()
        # A resumed download continues only within the version it started; a newer one starts over.
        start = int(request.offset) if snap.version == request.min_version else 0
        window = _StreamWindow(self.credit, acks)
        try:
            for a in range(start, numel, CHUNK_ELEMS):
                if not await window.take():
                    return  # the client is done with this stream
                await self._yield_to_rounds()
                b = min(a + CHUNK_ELEMS, numel)
                precision = request.momentum_precision
                msg = swarm_pb2.StateChunk(fragment=request.fragment, version=snap.version, numel=numel, offset=a,
                                           phi=_to_bytes(snap.phi[a:b]),
                                           momentum=_to_bytes(snap.momentum[a:b], precision),
                                           momentum_precision=precision)
                yield await self._ready(remote, msg)
                await asyncio.sleep(0)
            if numel == 0:
                yield self._stamp(swarm_pb2.StateChunk(fragment=request.fragment, version=snap.version, numel=0,
                                                       offset=0, momentum_precision=request.momentum_precision))
            # Read the client's last acknowledgements up to its END before the stream closes: a socket closed
            # with unread data is reset, and the reset discarded the end of the last chunk on its way out.
            await window.drain(DRAIN_S)
        finally:
            window.close()  # what the stream still holds of the shared credit is nobody's now

    async def _ready(self, remote: str, msg: swarm_pb2.StateChunk) -> swarm_pb2.StateChunk:
        """``msg`` stamped with this node's clock, within the serve budget and counted: ready to send."""
        self._stamp(msg)
        if self.budget is not None:
            await self.budget.take(msg.ByteSize(), self._is_member(remote))
        self.counters.sent(remote, msg.fragment, -1, msg.ByteSize())
        return msg

    async def _yield_to_rounds(self) -> None:
        """Hold the next chunk back while this node's own round exchange is in flight (at most
        ``YIELD_MAX_S``): the round is what training waits for, the download is not."""
        if self._yield_to is None:
            return
        start = time.monotonic()
        while time.monotonic() - start < YIELD_MAX_S:
            try:
                busy = self._yield_to()
            except Exception:  # a broken callback must not stop the download
                busy = False
            if not busy:
                break
            await asyncio.sleep(YIELD_POLL_S)
        self.held_back_s += time.monotonic() - start

    def _stamp(self, msg: swarm_pb2.StateChunk) -> swarm_pb2.StateChunk:
        """Put this node's swarm clock and inner steps on a chunk: a joiner whose view of our heartbeats is
        stale (its DHT reads time out while the download fills the links) still joins at our clock."""
        if self._clock is not None:
            msg.clock, msg.inner_step = (max(0, int(v)) for v in self._clock())
        return msg

    def _refuse(self, remote: str, code: str, detail: str, *, kind: str, offence: bool) -> str:
        log.debug("state: refused %s (%s): %s", remote[:16], code, detail)
        self._report(remote, kind, detail, offence=offence)
        return _refusal(code, detail)

    def _stream_refused(self, remote: str, reason: str) -> None:
        # Over the stream cap: a joiner with many fragments can get there honestly (the cap is configurable).
        self._report(remote, "state_streams", reason, offence=False)

    def _report(self, remote: str, kind: str, detail: str, *, offence: bool) -> None:
        if self._on_refused is None:
            return
        try:
            self._on_refused(remote, kind, detail, offence=offence)
        except Exception as exc:  # bookkeeping must never break serving
            log.debug("state: on_refused failed: %r", exc)


class HolderBackoff:
    """Holders that refused this node, each not asked again until its wait ends. The first wait depends
    on the refusal (a ban lasts, a rate limit refills quickly), doubles while the holder keeps refusing
    (up to ``BACKOFF_MAX_S``) and is forgotten when the holder serves."""

    def __init__(self, now: Callable[[], float] = time.monotonic, max_peers: int = MAX_RATE_PEERS) -> None:
        self._now = now
        self._max_peers = max_peers
        self._peers: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (until, last wait)

    def waiting(self, peer: str) -> float:
        """Seconds before ``peer`` may be asked again (0: now)."""
        until, _ = self._peers.get(peer, (0.0, 0.0))
        return max(0.0, until - self._now())

    def refused(self, peer: str, code: str) -> float:
        """``peer`` refused with ``code``: its new wait (seconds)."""
        _, last = self._peers.pop(peer, (0.0, 0.0))
        wait = min(BACKOFF_MAX_S, 2 * last if last else BACKOFF_FIRST_S.get(code, BACKOFF_DEFAULT_S))
        self._peers[peer] = (self._now() + wait, wait)
        while len(self._peers) > self._max_peers:
            self._peers.popitem(last=False)
        return wait

    def served(self, peer: str) -> None:
        self._peers.pop(peer, None)


class _Refused(RuntimeError):
    """A holder's honest refusal (``code`` is its first word): it is not asked again for a while."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"refused: {text}")
        self.code = code


class BadSource(Exception):
    """The peer served state that breaks the rules (counted against it; its data is dropped)."""


class DigestMismatch(BadSource):
    """A complete state of the version asked for that is not the one its holders announced (DIGEST_MISMATCHES)."""


def _describe(exc: BaseException) -> str:
    """An exception as one line that is never empty (a timeout's text is: the log said "failed: ")."""
    text = str(exc).strip()
    return text if text else f"{type(exc).__name__} (no detail; a timeout gives none)"


class _AllWaiting(RuntimeError):
    """Every holder asked for refused this node lately (``HolderBackoff``): nobody is asked now."""


class _Passing(Exception):
    """The peer refused for now (not live yet, too many streams): ask it again after a wait."""


class _Busy(Exception):
    """The peer serves another download now, and this request offered to ask another holder first."""


class _Download:
    """One fragment's download, resumable across peers: each chunk is checked against the stream so far."""

    def __init__(self, fragment: int, min_version: int, numel: int,
                 precision: int = swarm_pb2.MOMENTUM_FP32, digest: bytes = b"") -> None:
        self.fragment = fragment
        self._min_version = min_version
        self._digest = digest  # what the state of ``min_version`` must hash to (``versions.state_digest``)
        self._numel = numel
        self._precision = precision  # of the momentum, asked for and required of every chunk
        self._phi: torch.Tensor | None = None
        self._mom: torch.Tensor | None = None
        self._offset = 0
        self._version: int | None = None
        self._claim: tuple[int, int, float] | None = None  # the last chunk's (clock, inner step, wall time seen)

    def request(self, fingerprint: str, spread: bool = False) -> swarm_pb2.StateRequest:
        """The request resuming at the next element (of the version started, if any). The server knows us
        from our heartbeat in the DHT (a heartbeat in the request proves nothing: see ``StateServer``).
        ``spread``: other holders could serve it (a busy server refuses it, module docstring)."""
        version = self._version if self._version is not None else self._min_version
        return swarm_pb2.StateRequest(fingerprint=fingerprint, fragment=self.fragment, offset=self._offset,
                                      min_version=version, momentum_precision=self._precision, spread=spread)

    def reset(self) -> None:
        """Forget what was received (it came from a source found bad)."""
        self._phi = self._mom = None
        self._offset, self._version, self._claim = 0, None, None

    def add(self, msg: swarm_pb2.StateChunk) -> None:
        """Take a chunk, or raise: ``BadSource``, ``_Passing``, or RuntimeError for an honest refusal."""
        _raise_refusal(msg)
        if msg.HasField("step"):
            raise BadSource("sent a replay's step for a state download")
        if msg.fragment != self.fragment:
            raise BadSource(f"sent fragment {msg.fragment} for fragment {self.fragment}")
        if msg.version < self._min_version:
            raise BadSource(f"sent version {msg.version}, below the {self._min_version} asked for")
        if msg.numel != self._numel:
            raise BadSource(f"fragment {self.fragment} has {self._numel} elements here, not {msg.numel}")
        if self._version is not None and msg.version != self._version:
            if msg.offset != 0:
                raise BadSource(f"switched from version {self._version} to {msg.version} mid-fragment")
            self.reset()  # the peer holds a newer version than the one begun elsewhere: start over
        if msg.offset != self._offset:
            raise BadSource(f"sent offset {msg.offset}, expected {self._offset} (gap or overlap)")
        phi, mom = self._chunk(msg)
        if self._phi is None or self._mom is None:
            self._version = int(msg.version)
            self._phi, self._mom = torch.empty(self._numel), torch.empty(self._numel)
        self._phi[self._offset:self._offset + phi.numel()] = phi
        self._mom[self._offset:self._offset + mom.numel()] = mom
        self._offset += phi.numel()
        # the claim is the sender's like its heartbeat's: the swarm clock judges it (bounds, liars)
        self._claim = (int(msg.clock), int(msg.inner_step), time.time()) if msg.clock or msg.inner_step else None

    def _chunk(self, msg: swarm_pb2.StateChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """A well-formed chunk's phi and momentum: the precision asked for, as many momentum values as phi
        values, inside the fragment, finite."""
        if msg.momentum_precision != self._precision:
            raise BadSource(f"momentum in precision {msg.momentum_precision}, {self._precision} was asked for")
        width = _BYTES_PER_ELEM[self._precision]
        count = len(msg.phi) // 4
        if len(msg.phi) % 4 or len(msg.momentum) != count * width:
            raise BadSource(f"malformed chunk: {len(msg.phi)} bytes of phi, {len(msg.momentum)} of momentum")
        if count > CHUNK_ELEMS or self._offset + count > self._numel or (count == 0 and self._numel):
            raise BadSource(f"chunk of {count} elements at {self._offset} does not fit {self._numel} elements")
        phi, mom = _from_bytes(msg.phi), _from_bytes(msg.momentum, self._precision)
        for name, values in (("phi", phi), ("momentum", mom)):
            if not bool(torch.isfinite(values).all()):
                bad = int((~torch.isfinite(values)).sum())
                raise BadSource(f"{name} at {self._offset} has {bad} non-finite value(s)")
        return phi, mom

    def complete(self) -> bool:
        return self._version is not None and self._offset == self._numel

    def check_digest(self) -> None:
        """A complete download of the version asked for must be the state its holders announced: raise
        ``BadSource`` otherwise (a newer version than asked for has no announced digest to match)."""
        if not self._digest or self._version != self._min_version or self._phi is None or self._mom is None:
            return
        from locoswarm.node.swarm.versions import state_digest

        if state_digest(self._phi, self._mom) != self._digest:
            raise DigestMismatch(f"version {self._version} of fragment {self.fragment} does not match the digest "
                                 "its holders announce")

    def progress(self) -> str:
        return f"{self._offset}/{self._numel}"

    def snapshot(self, source: str) -> FragmentSnapshot:
        assert self._version is not None
        clock, inner_step, seen = self._claim if self._claim is not None else (None, 0, 0.0)
        return FragmentSnapshot(self.fragment, self._version,
                                self._phi if self._phi is not None else torch.zeros(0),
                                self._mom if self._mom is not None else torch.zeros(0), source=source,
                                clock=clock, inner_step=inner_step, seen=seen)


def _raise_refusal(msg: swarm_pb2.StateChunk) -> None:
    """Raise what a refusal (``StateChunk.error``) means to a client: ``_Passing``, ``_Busy`` or ``_Refused``."""
    if not msg.error:
        return
    text = _one_line(msg.error)
    if _refusal_code(text) in _PASSING:
        raise _Passing(text)
    if _refusal_code(text) == BUSY:
        raise _Busy(text)
    raise _Refused(_refusal_code(text), text)


class _Replay:
    """A replay under way: the steps of ``fragment`` after version ``have``, each one's chunks in order, checked as
    they come (module docstring of ``locoswarm.node.core.step_log``). Each step holds at most what the widest codec
    takes (``MAX_BYTES_PER_ELEMENT``), so a replay at most ``REPLAY_DEPTH`` times that: twice the state."""

    def __init__(self, fragment: int, have: int, target: int, numel: int) -> None:
        self.fragment, self.have, self.target, self.numel = fragment, have, target, numel
        self.steps: list[OuterStep] = []
        self._open: swarm_pb2.ReplayStep | None = None  # the step being received: its first chunk's fields
        self._chunks: list[bytes] = []
        self._version = have
        self._bytes = 0
        self._claim: tuple[int, int, float] | None = None

    def add(self, msg: swarm_pb2.StateChunk) -> None:
        _raise_refusal(msg)
        if msg.fragment != self.fragment or not msg.HasField("step"):
            raise BadSource(f"sent {'fragment ' + str(msg.fragment) if msg.fragment != self.fragment else 'a state'} "
                            f"for a replay of fragment {self.fragment}")
        step = msg.step
        if self._open is None:
            if step.version != self._version + 1 or step.index != 0:
                raise BadSource(f"sent step v{step.version} chunk {step.index}; expected v{self._version + 1} chunk 0")
            if len(self.steps) >= REPLAY_DEPTH:
                raise BadSource(f"sent more than {REPLAY_DEPTH} steps")
            if step.codec not in CODECS or step.numel != self.numel or not 0 < step.count <= self.numel + 1:
                raise BadSource(f"step v{step.version}: codec {step.codec[:20]!r}, {step.numel} elements in "
                                f"{step.count} chunks, for a fragment of {self.numel}")
            if len(step.before) != DIGEST_BYTES or len(step.after) != DIGEST_BYTES:
                raise BadSource(f"step v{step.version}: digests of {len(step.before)} and {len(step.after)} bytes, "
                                f"not {DIGEST_BYTES}")
            self._open = step
        elif (step.version, step.index, step.count, step.codec, step.numel) != (
                self._open.version, len(self._chunks), self._open.count, self._open.codec, self._open.numel):
            raise BadSource(f"sent step v{step.version} chunk {step.index} inside step v{self._open.version} "
                            f"at chunk {len(self._chunks)}")
        self._bytes += len(step.data)
        if self._bytes > MAX_BYTES_PER_ELEMENT * self.numel + 4096:
            raise BadSource(f"sent {self._bytes} bytes of step v{step.version}, more than any codec takes for "
                            f"{self.numel} elements")
        self._chunks.append(step.data)
        if len(self._chunks) == self._open.count:
            self.steps.append(OuterStep(int(self._open.version),
                                        EncodedAverage(self._open.codec, int(self._open.numel), tuple(self._chunks)),
                                        bytes(self._open.before), bytes(self._open.after)))
            self._version, self._open, self._chunks, self._bytes = int(self._open.version), None, [], 0
        self._claim = (int(msg.clock), int(msg.inner_step), time.time()) if msg.clock or msg.inner_step else None

    def complete(self) -> bool:
        return self._open is None and self._version >= self.target

    def at(self, version: int) -> bool:
        """Whether the steps received end at ``version`` (the server's, which each message names)."""
        return self._open is None and self._version >= version

    def snapshot(self, source: str) -> FragmentSnapshot:
        clock, inner_step, seen = self._claim if self._claim is not None else (None, 0, 0.0)
        return FragmentSnapshot(self.fragment, self._version, torch.zeros(0), torch.zeros(0), source=source,
                                clock=clock, inner_step=inner_step, seen=seen, base=self.have,
                                steps=tuple(self.steps))


class StateClient:
    """Downloads fragments' outer state from peers, validating everything (see the module docstring).

    ``expected_numel(fragment)`` is the fragment's size on this node (a download of another size is
    refused); ``on_bad(peer, kind, detail, offence=...)`` is told of each source that served bad state or broke the
    framing; holders for which ``is_banned(peer)`` holds are skipped. ``momentum`` is the precision the
    momentum is asked in (``MOMENTUM_PRECISIONS``: "fp32" exact, "bf16" a quarter fewer bytes; module
    docstring).
    """

    def __init__(self, runtime: NetworkRuntime, fingerprint: str, counters: ByteCounters,
                 timeout: float = 60.0, *, expected_numel: Callable[[int], int | None],
                 on_bad: BadSourceCallback | None = None, is_banned: Callable[[str], bool] | None = None,
                 backoff: HolderBackoff | None = None, momentum: str = "fp32") -> None:
        if momentum not in MOMENTUM_PRECISIONS:
            raise ValueError(f"momentum precision {momentum!r} is not one of {sorted(MOMENTUM_PRECISIONS)}")
        self._precision = MOMENTUM_PRECISIONS[momentum]
        self.runtime = runtime
        self.fingerprint = fingerprint
        self.counters = counters
        self.timeout = timeout
        self._expected_numel = expected_numel
        self._on_bad = on_bad
        self._is_banned = is_banned
        self._backoff = backoff or HolderBackoff()
        self._mismatches = EveryNth(DIGEST_MISMATCHES)

    def budget(self, numel: int | None) -> float:
        """Seconds a download of ``numel`` elements may take: the timeout, plus its bytes at
        ``MIN_DOWNLOAD_RATE``. A fixed 30 s failed every join of a 9 MB state that three joiners pulled from
        one holder at 5 Mbit/s (43 s): they started from scratch at clock 0 instead."""
        return self.timeout + max(0, numel or 0) * 8 / MIN_DOWNLOAD_RATE

    def fetch(self, fragment: int, peers: list[str], min_version: int = 0,
              digest: bytes = b"") -> FragmentSnapshot | None:
        """Blocking download of one fragment (for the training thread); ``digest``: what ``min_version`` must
        hash to (``locoswarm.node.swarm.versions``)."""
        try:
            return self.runtime.call(self.fetch_async(fragment, peers, min_version, digest=digest),
                                     timeout=self.budget(self._expected_numel(fragment)) + 5)
        except _AllWaiting as exc:  # every holder refused us lately: nothing was asked, nothing to report
            log.debug("state download of fragment %d: %s", fragment, exc)
            return None
        except Exception as exc:
            log.warning("state download of fragment %d failed: %s", fragment, _describe(exc))
            return None

    def fetch_many(self, plans: Mapping[int, tuple[list[str], int, bytes]]) -> dict[int, FragmentSnapshot]:
        """Download several fragments at once (a joining node): ``plans`` maps a fragment to the peers to ask,
        the least version and its digest (``locoswarm.node.swarm.versions.Belief``); spread over the peers."""
        fragments = sorted(f for f, (peers, _, _) in plans.items() if peers)

        async def run() -> dict[int, FragmentSnapshot]:
            slots = asyncio.Semaphore(PARALLEL_DOWNLOADS)

            async def one(frag: int, order: list[str]) -> FragmentSnapshot:
                async with slots:
                    return await self.fetch_async(frag, order, plans[frag][1], digest=plans[frag][2])

            jobs = []
            for i, frag in enumerate(fragments):
                peers = plans[frag][0]
                rotated = peers[i % len(peers):] + peers[:i % len(peers)]  # a different first peer each
                jobs.append(one(frag, rotated))
            got = await asyncio.gather(*jobs, return_exceptions=True)
            for frag, g in zip(fragments, got, strict=True):
                if not isinstance(g, FragmentSnapshot):
                    log.warning("state download of fragment %d failed: %s", frag, _describe(g))
            return {f: g for f, g in zip(fragments, got, strict=True) if isinstance(g, FragmentSnapshot)}

        if not fragments:
            return {}
        waves = -(-max(1, len(fragments)) // PARALLEL_DOWNLOADS)
        slowest = max((self.budget(self._expected_numel(f)) for f in fragments), default=self.timeout)
        return self.runtime.call(run(), timeout=(slowest + 5) * waves)

    def fetch_steps(self, fragment: int, peers: list[str], have: int, target: int) -> FragmentSnapshot | None:
        """Blocking: a replay of ``fragment`` from version ``have`` to ``target`` or beyond
        (``FragmentSnapshot.is_replay``) from the first of ``peers`` that keeps the steps, or None (then a node
        downloads the state)."""
        numel = self._expected_numel(fragment)
        if numel is None or not peers:
            return None
        try:
            return self.runtime.call(self._steps_async(fragment, peers, have, target, numel),
                                     timeout=self.timeout + 5)
        except Exception as exc:
            log.info("replay of fragment %d failed: %s", fragment, _describe(exc))
            return None

    async def _steps_async(self, fragment: int, peers: list[str], have: int, target: int,
                           numel: int) -> FragmentSnapshot | None:
        deadline = time.monotonic() + self.timeout
        for peer in peers:
            if (self._is_banned is not None and self._is_banned(peer)) or self._backoff.waiting(peer) > 0:
                continue
            replay = _Replay(fragment, have, target, numel)
            acks: asyncio.Queue[swarm_pb2.StateRequest | None] = asyncio.Queue()
            request = swarm_pb2.StateRequest(fingerprint=self.fingerprint, fragment=fragment, min_version=have,
                                             momentum_precision=self._precision, replay=True)

            async def requests(first: swarm_pb2.StateRequest = request,
                               queue: asyncio.Queue = acks) -> AsyncIterator[swarm_pb2.StateRequest]:
                yield first
                while (ack := await queue.get()) is not None:
                    yield ack

            try:
                async with asyncio.timeout_at(_loop_deadline(deadline)):
                    async with wire.open_stream(self.runtime.p2p, peer, STATE_HANDLER, requests(),
                                                swarm_pb2.StateChunk, max_reply_bytes=MAX_CHUNK_BYTES,
                                                idle_timeout=IDLE_TIMEOUT) as stream:
                        async for msg in stream:
                            self.counters.received(peer, fragment, -1, msg.ByteSize())
                            replay.add(msg)
                            # one acknowledgement per message (the server's credit), END after the last step
                            acks.put_nowait(None if replay.at(int(msg.version)) else request)
            except (BadSource, wire.FramingViolation) as exc:
                log.warning("replay of fragment %d: refused peer %s: %s", fragment, peer[:16], exc)
                if self._on_bad is not None:
                    self._on_bad(peer, "bad_state", str(exc), offence=True)
                continue
            except (_Refused, _Passing, _Busy) as exc:
                log.debug("replay of fragment %d from %s: %s", fragment, peer[:16], exc)
                continue
            except TimeoutError:
                return None
            except Exception as exc:  # a dropped stream: the next holder, or the state instead
                log.info("replay of fragment %d from %s failed: %s", fragment, peer[:16], _describe(exc))
                continue
            if replay.complete():
                return replay.snapshot(peer)
        return None

    async def fetch_async(self, fragment: int, peers: list[str], min_version: int = 0, *,
                          expected_numel: int | None = None, digest: bytes = b"") -> FragmentSnapshot:
        """Download ``fragment`` at ``min_version`` or newer from the first of ``peers`` that serves it
        whole and valid; the returned snapshot's ``source`` is the peer that served its last part.
        Raises RuntimeError when none did within ``timeout``."""
        numel = expected_numel if expected_numel is not None else self._expected_numel(fragment)
        if numel is None or numel < 0:
            raise RuntimeError(f"fragment {fragment}: its size on this node is unknown")
        download = _Download(fragment, min_version, int(numel), self._precision, digest)
        deadline = time.monotonic() + self.budget(numel)
        errors: list[str] = []
        order, wait = list(peers), RETRY_FIRST_S
        if order and all(self._backoff.waiting(p) > 0 for p in order):
            raise _AllWaiting(f"fragment {fragment}: every holder refused this node lately; not asked again yet")
        # The first pass offers each holder to pass us on while it serves someone else (``spread``); the holders
        # that did are asked again at once, without the offer, if nobody else served it.
        spread = len(order) > 1
        while True:
            again: list[str] = []
            busy: list[str] = []
            for peer in order:
                if self._is_banned is not None and self._is_banned(peer):
                    errors.append(f"{peer[:12]}: banned here")
                    continue
                if (left := self._backoff.waiting(peer)) > 0:
                    errors.append(f"{peer[:12]}: refused lately, not asked for {left:.0f} s")
                    continue
                outcome = await self._try_peer(download, peer, deadline, spread=spread)
                if isinstance(outcome, FragmentSnapshot):
                    return outcome
                if outcome.startswith("busy: "):
                    busy.append(peer)
                    continue
                if outcome.startswith("again: "):
                    again.append(peer)
                errors.append(f"{peer[:12]}: {outcome}")
            if busy:
                order, spread = busy + again, False
                continue
            left = deadline - time.monotonic()
            if not again or left <= 0:
                break
            await asyncio.sleep(min(wait, left))
            order, wait = again, min(2 * wait, RETRY_MAX_S)
        raise RuntimeError(f"fragment {fragment}: no peer could serve it ({'; '.join(errors[-8:])})")

    async def _try_peer(self, download: _Download, peer: str, deadline: float, *,
                        spread: bool = False) -> FragmentSnapshot | str:
        """The snapshot, or why not (prefixed ``again: `` when the peer is worth asking again, ``busy: `` when it
        serves someone else and ``spread`` offered to ask another holder first)."""
        acks: asyncio.Queue[swarm_pb2.StateRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[swarm_pb2.StateRequest]:
            # the request, then one acknowledgement per chunk received (the server's flow control)
            yield download.request(self.fingerprint, spread)
            while (ack := await acks.get()) is not None:
                yield ack

        try:
            async with asyncio.timeout_at(_loop_deadline(deadline)):
                async with wire.open_stream(self.runtime.p2p, peer, STATE_HANDLER, requests(), swarm_pb2.StateChunk,
                                            max_reply_bytes=MAX_CHUNK_BYTES, idle_timeout=IDLE_TIMEOUT) as stream:
                    async for msg in stream:
                        self.counters.received(peer, download.fragment, -1, msg.ByteSize())
                        download.add(msg)
                        # one more chunk, or END once complete (the server then ends the stream)
                        acks.put_nowait(None if download.complete() else download.request(self.fingerprint))
            if download.complete():
                download.check_digest()
                self._backoff.served(peer)
                return download.snapshot(peer)
            raise BadSource(f"the stream ended at {download.progress()}")
        except DigestMismatch as exc:
            return self._bad(download, peer, "digest_mismatch", str(exc), offence=self._mismatches.offence(peer))
        except BadSource as exc:
            return self._bad(download, peer, "bad_state", str(exc))
        except wire.FramingViolation as exc:  # an oversize or malformed message
            return self._bad(download, peer, "bad_stream", str(exc))
        except _Passing as exc:
            return f"again: {exc}"
        except _Busy as exc:
            return f"busy: {exc}"
        except _Refused as exc:
            wait = self._backoff.refused(peer, exc.code)
            log.info("state download of fragment %d from %s: %s (not asked again for %.0f s)", download.fragment,
                     peer[:16], exc, wait)
            return str(exc)
        except wire.PeerRefused as exc:
            if str(exc).startswith(_STREAM_CAP):
                return f"again: {exc}"
            self._backoff.refused(peer, "refused")
            return f"refused: {exc}"
        except wire.WireError as exc:
            # A stream closed under us: what a refusal written just before the server closed often looks like
            # here (seen: a joiner's second download refused while the holder had not seen its heartbeat yet
            # arrived as a broken pipe, was not asked again, and the fragment stayed at its initial state). The
            # holder is asked again after a wait, within the download's deadline.
            why = _one_line(str(exc)) or type(exc).__name__
            log.info("state download of fragment %d from %s failed: %s", download.fragment, peer[:16], why)
            return f"again: {why}" if why.startswith(("stream broken", "stream closed")) else why
        except TimeoutError:
            return "no time left"
        except Exception as exc:  # a dropped or silent stream, an honest refusal: try the next holder
            why = _one_line(str(exc)) or type(exc).__name__
            log.info("state download of fragment %d from %s failed: %s", download.fragment, peer[:16], why)
            return why

    def _bad(self, download: _Download, peer: str, kind: str, detail: str, *, offence: bool = True) -> str:
        download.reset()  # nothing of a bad source is kept, however plausible the earlier chunks looked
        log.warning("state download of fragment %d: refused peer %s: %s", download.fragment, peer[:16], detail)
        if self._on_bad is not None:
            try:
                self._on_bad(peer, kind, detail, offence=offence)
            except Exception as exc:
                log.debug("state: on_bad failed: %r", exc)
        return f"{kind}: {detail}"


def _loop_deadline(monotonic_deadline: float) -> float:
    """``time.monotonic()`` deadline -> the running loop's clock (the same clock, but say so explicitly)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())
