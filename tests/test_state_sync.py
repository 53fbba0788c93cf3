"""State download between real libp2p peers (three p2pd daemons on loopback inside this process).

Two holders (``good``, ``other``) and a downloader (``client``). The servers are the node's own
``StateServer`` with test switches for liveness and bans; a hostile holder is a raw handler registered
under the state protocol's name with ``wire.serve``. Every test is bounded in time; the daemons are
stopped (and checked gone by PID) by the fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P
from test_wire import LoopThread, p2p_nodes

from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.payload import encode_chunks
from locoswarm.node.core.transport import EncodedAverage, FragmentSnapshot, OuterStep
from locoswarm.node.swarm import state_sync, wire
from locoswarm.node.swarm.state_sync import (
    CHUNK_ELEMS,
    MAX_CHUNK_BYTES,
    STATE_HANDLER,
    HolderBackoff,
    StateClient,
    StateRateLimiter,
    StateServer,
)
from locoswarm.protocol import swarm_pb2

pytestmark = pytest.mark.timeout(120)

NUMEL = 2 * CHUNK_ELEMS + 123  # three chunks, the last one partial
FP = "fp-test"


class ByteCounters:
    """The two members of counters.ByteCounters the state protocol uses."""

    def __init__(self) -> None:
        self.sent_bytes = self.received_bytes = 0

    def sent(self, peer: str, fragment: int, round_: int, n: int) -> None:
        self.sent_bytes += n

    def received(self, peer: str, fragment: int, round_: int, n: int) -> None:
        self.received_bytes += n


class Runtime:
    """The two members of NetworkRuntime that StateServer/StateClient use, on the test's loop."""

    def __init__(self, loop: LoopThread, p2p: P2P) -> None:
        self.p2p = p2p
        self._loop = loop

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return self._loop.run(coro, timeout or 60)


@dataclass
class Swarm:
    loop: LoopThread
    good: P2P
    other: P2P
    client: P2P

    def id(self, p2p: P2P) -> str:
        return str(p2p.peer_id)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return self.loop.run(coro, timeout)


@pytest.fixture(scope="module")
def swarm():
    with p2p_nodes(3) as (loop, (good, other, client)):
        yield Swarm(loop, good, other, client)


def _snaps(seed: int = 0) -> dict[int, FragmentSnapshot]:
    g = torch.Generator().manual_seed(seed)
    snaps = {f: FragmentSnapshot(f, 5 + f, torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g))
             for f in range(3)}
    snaps[3] = FragmentSnapshot(3, 1, torch.zeros(0), torch.zeros(0))
    return snaps


def _numel(fragment: int) -> int | None:
    return {0: NUMEL, 1: NUMEL, 2: NUMEL, 3: 0}.get(fragment)


@dataclass
class Book:
    """What a server refused and what a client found bad, as the daemon's Reputation would be told."""

    refused: list[tuple[str, str, bool]] = field(default_factory=list)  # (peer, kind, offence)
    bad: list[tuple[str, str, str]] = field(default_factory=list)  # (peer, kind, detail)
    bad_offences: list[str] = field(default_factory=list)  # the peers of those that counted as offences

    def refuse(self, peer: str, kind: str, detail: str, *, offence: bool = True) -> bool:
        self.refused.append((peer, kind, offence))
        return False

    def on_bad(self, peer: str, kind: str, detail: str, *, offence: bool = True) -> None:
        self.bad.append((peer, kind, detail))
        if offence:
            self.bad_offences.append(peer)


def _server(swarm: Swarm, p2p: P2P, book: Book, *, live: Callable[[str], bool] = lambda p: True,
            banned: Callable[[str], bool] = lambda p: False, snaps: dict | None = None, **kw) -> StateServer:
    return StateServer(Runtime(swarm.loop, p2p), FP, (snaps or _snaps()).get, ByteCounters(), is_live=live,
                       is_banned=banned, on_refused=book.refuse, **kw)


def _client(swarm: Swarm, book: Book, timeout: float = 20.0, fingerprint: str = FP,
            backoff: HolderBackoff | None = None, momentum: str = "fp32") -> StateClient:
    return StateClient(Runtime(swarm.loop, swarm.client), fingerprint, ByteCounters(), timeout=timeout,
                       expected_numel=_numel, on_bad=book.on_bad, backoff=backoff, momentum=momentum)


def _same(a: FragmentSnapshot, b: FragmentSnapshot) -> bool:
    return a.version == b.version and torch.equal(a.phi, b.phi) and torch.equal(a.momentum, b.momentum)


# ---- honest downloads --------------------------------------------------------------------------------


def test_round_trip_sets_the_source_and_refuses_what_cannot_be_served(swarm):
    book = Book()
    snaps = _snaps()
    server = _server(swarm, swarm.good, book, snaps=snaps)
    client = _client(swarm, book)
    good = swarm.id(swarm.good)
    try:
        got = client.fetch(1, [good], min_version=6)
        assert got is not None and _same(got, snaps[1]) and got.source == good
        many = client.fetch_many({f: ([good], 0, b"") for f in (0, 1, 2, 3)})
        assert sorted(many) == [0, 1, 2, 3] and many[3].phi.numel() == 0
        assert all(_same(many[f], snaps[f]) for f in range(4))
        assert client.fetch(1, [good], min_version=7) is None  # "old-version: have version 6 < 7"
        assert client.fetch(9, [good]) is None  # a fragment this node does not have: not even asked
        assert _client(swarm, book, fingerprint="other").fetch(0, [good]) is None
        assert book.refused == [(swarm.id(swarm.client), "state_fingerprint", False)]
        assert book.bad == []  # honest refusals are nobody's offence
        assert server.served == 5
    finally:
        server.close()


def test_a_download_carries_the_servers_clock_as_it_sent_the_state(swarm):
    """A joiner whose DHT reads of the holder's heartbeat went stale during the download still learns the
    holder's clock: every chunk carries the server's (clock, inner step); the snapshot keeps the last one's."""
    book = Book()
    now = {"clock": 214, "step": 530}
    server = _server(swarm, swarm.good, book, clock=lambda: (now["clock"], now["step"]))
    plain = _server(swarm, swarm.other, book)  # a server that tells no clock
    client = _client(swarm, book)
    try:
        t0 = time.time()
        got = client.fetch(0, [swarm.id(swarm.good)])
        assert got is not None and (got.clock, got.inner_step) == (214, 530) and t0 <= got.seen <= time.time()
        now.update(clock=300, step=610)
        assert client.fetch(1, [swarm.id(swarm.good)]).clock == 300
        untold = client.fetch(0, [swarm.id(swarm.other)])
        assert untold is not None and untold.clock is None and untold.seen == 0.0
    finally:
        server.close()
        plain.close()


class _Probe:
    """A raw download stream that acknowledges only when told (``ack``) and counts the chunks it got."""

    def __init__(self, swarm: Swarm, server: P2P, fragment: int, version: int, origin: P2P | None = None) -> None:
        self.request = swarm_pb2.StateRequest(fingerprint=FP, fragment=fragment, min_version=version)
        self.acks: asyncio.Queue = asyncio.Queue()
        self.seen: list[int] = []
        self._swarm, self._server = swarm, server
        self._origin = origin or swarm.client  # the peer the stream is opened from

    def ack(self) -> None:
        self.acks.put_nowait(self.request)

    async def run(self, done: asyncio.Event) -> None:
        async def requests():
            yield self.request
            while (ack := await self.acks.get()) is not None:
                yield ack

        async with wire.open_stream(self._origin, self._swarm.id(self._server), STATE_HANDLER, requests(),
                                    swarm_pb2.StateChunk, max_reply_bytes=MAX_CHUNK_BYTES, idle_timeout=10) as stream:
            reader = asyncio.create_task(self._read(stream))
            await done.wait()
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader

    async def _read(self, stream) -> None:
        async for msg in stream:
            self.seen.append(msg.offset)


def _big_snaps(fragments: int, chunks: int = 10) -> dict[int, FragmentSnapshot]:
    numel = chunks * CHUNK_ELEMS
    g = torch.Generator().manual_seed(5)
    return {f: FragmentSnapshot(f, 5, torch.randn(numel, generator=g), torch.randn(numel, generator=g))
            for f in range(fragments)}


def test_the_server_sends_at_most_its_credit_ahead_of_the_clients_acknowledgements(swarm):
    """A download may not fill the buffers the DHT and the rounds share (module docstring of state_sync):
    without acknowledgements the server sends CREDIT_CHUNKS chunks and waits; each one lets one more go."""
    server = _server(swarm, swarm.good, Book(), snaps=_big_snaps(1))

    async def probe() -> list[int]:
        one, done = _Probe(swarm, swarm.good, 0, 5), asyncio.Event()
        task = asyncio.create_task(one.run(done))
        await asyncio.sleep(1.5)  # nothing beyond the credit comes without an acknowledgement
        counts = [len(one.seen)]
        one.ack()
        await asyncio.sleep(1.0)
        counts.append(len(one.seen))
        done.set()
        await task
        return counts

    try:
        assert swarm.run(probe()) == [state_sync.CREDIT_CHUNKS, state_sync.CREDIT_CHUNKS + 1]
    finally:
        server.close()


def test_concurrent_downloads_share_the_servers_credit(swarm):
    """Three downloads at once (a holder serving joiners) have at most the server's credit in flight in
    all, not each their own: the DHT's messages share the holder's uplink. A stream that ends gives its
    share back, and real downloads under a credit smaller than one stream's still complete exactly."""
    snaps = _big_snaps(3)
    server = _server(swarm, swarm.good, Book(), snaps=snaps, server_credit=6)

    async def scenario() -> tuple[list[int], list[int], int, int]:
        probes = [_Probe(swarm, swarm.good, f, 5) for f in range(3)]
        dones = [asyncio.Event() for _ in probes]
        tasks = [asyncio.create_task(p.run(d)) for p, d in zip(probes, dones, strict=True)]
        await asyncio.sleep(2.0)
        before = [len(p.seen) for p in probes]
        # The download holding the largest share ends (its client leaves): its share goes to the others.
        # (Which stream the server admitted first is up to the scheduler, so the test picks it afterwards.)
        k = max(range(len(probes)), key=lambda i: before[i])
        dones[k].set()
        await tasks[k]
        await asyncio.sleep(1.5)
        after = [len(p.seen) for p in probes]
        for d in dones:
            d.set()
        await asyncio.gather(*tasks)
        return before, after, k, server.credit.high_water

    try:
        before, after, k, high = swarm.run(scenario())
        assert sum(before) == 6 and max(before) <= state_sync.CREDIT_CHUNKS, before
        # the ended one's share went to the other two: the whole credit again, each within its own cap
        rest = [i for i in range(3) if i != k]
        assert sum(after[i] for i in rest) == 6 > sum(before[i] for i in rest), (before, after, k)
        assert max(after) <= state_sync.CREDIT_CHUNKS, (before, after)
        assert high == 6
        deadline = time.monotonic() + 5
        while server.credit.taken and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.credit.taken == 0  # every ended stream gave its credit back
    finally:
        server.close()
    snaps = _snaps()  # three chunks each, of the sizes the client expects
    small = _server(swarm, swarm.good, Book(), snaps=snaps, server_credit=2)
    try:
        got = _client(swarm, Book()).fetch_many({f: ([swarm.id(swarm.good)], 0, b"") for f in (0, 1, 2)})
        assert sorted(got) == [0, 1, 2] and all(_same(got[f], snaps[f]) for f in range(3))
        assert small.credit.high_water == 2
    finally:
        small.close()


def test_a_holder_busy_with_another_download_passes_a_catch_up_on_to_another_holder(swarm):
    """Downloads spread over the holders (module docstring): a holder that sends another peer a download refuses
    ``busy`` to a request that has other holders to ask, which then serves it; a lone holder serves it anyway,
    and so does a busy one when every holder is busy. Nothing of it is an offence or a backoff."""
    snaps = _snaps()
    good_book, other_book = Book(), Book()
    good = _server(swarm, swarm.good, good_book, snaps=snaps)
    other = _server(swarm, swarm.other, other_book, snaps=snaps)
    backoff = HolderBackoff()
    client = _client(swarm, Book(), backoff=backoff)
    holders = [swarm.id(swarm.good), swarm.id(swarm.other)]

    async def busy_while(probes: list[tuple[P2P, P2P]], fetch: Callable[[], Any]) -> Any:
        dones = [asyncio.Event() for _ in probes]
        runs = [_Probe(swarm, server, 1, 0, origin=origin) for server, origin in probes]
        tasks = [asyncio.create_task(r.run(d)) for r, d in zip(runs, dones, strict=True)]
        while not all(r.seen for r in runs):  # each server has started sending its download
            await asyncio.sleep(0.05)
        try:
            return await asyncio.to_thread(fetch)
        finally:
            for d in dones:
                d.set()
            await asyncio.gather(*tasks)

    try:
        snap = swarm.run(busy_while([(swarm.good, swarm.other)], lambda: client.fetch(0, holders)))
        assert _same(snap, snaps[0]) and snap.source == swarm.id(swarm.other), snap.source
        alone = swarm.run(busy_while([(swarm.good, swarm.other)], lambda: client.fetch(0, holders[:1])))
        assert _same(alone, snaps[0]) and alone.source == swarm.id(swarm.good)
        both = swarm.run(busy_while([(swarm.good, swarm.other), (swarm.other, swarm.good)],
                                    lambda: client.fetch(0, holders)))
        assert _same(both, snaps[0]) and both.source == swarm.id(swarm.good)
        assert backoff.waiting(swarm.id(swarm.good)) == 0 and not good_book.refused and not other_book.refused
    finally:
        good.close()
        other.close()


def test_stream_cap_refusals_are_retried_not_counted(swarm):
    """A joiner downloading more fragments at once than the server's per-peer cap still gets them all."""
    book = Book()
    snaps = _snaps()
    server = _server(swarm, swarm.good, book, snaps=snaps, max_streams_per_peer=1)
    try:
        many = _client(swarm, book).fetch_many({f: ([swarm.id(swarm.good)], 0, b"") for f in (0, 1, 2)})
        assert sorted(many) == [0, 1, 2] and all(_same(many[f], snaps[f]) for f in range(3))
        print(f"\n[state] stream-cap refusals while fetching 3 fragments: {len(book.refused)}")
        assert book.refused and {(kind, offence) for _, kind, offence in book.refused} == {("state_streams", False)}
        assert book.bad == []
    finally:
        server.close()


def test_a_download_must_match_the_digest_its_version_was_announced_with(swarm):
    """Heartbeats announce each fragment's digest (``versions.state_digest``): a holder that serves another
    state under the announced version is a bad source (the download moves on; every DIGEST_MISMATCHES-th time
    an offence, since an honest holder that just followed its group's version serves one now and then), and a
    newer version than the one announced is taken (it has no announced digest yet: the effect check judges it)."""
    from locoswarm.node.swarm.state_sync import DIGEST_MISMATCHES
    from locoswarm.node.swarm.versions import state_digest

    book = Book()
    snaps = _snaps()
    server = _server(swarm, swarm.good, book, snaps=snaps)
    good = swarm.id(swarm.good)
    try:
        right = state_digest(snaps[0].phi, snaps[0].momentum)
        got = _client(swarm, book).fetch(0, [good], snaps[0].version, digest=right)
        assert got is not None and _same(got, snaps[0]) and book.bad == []
        client = _client(swarm, book, timeout=3.0)
        for _ in range(DIGEST_MISMATCHES):
            assert client.fetch(0, [good], snaps[0].version, digest=b"x" * 16) is None
        assert [(p, kind) for p, kind, _ in book.bad] == [(good, "digest_mismatch")] * DIGEST_MISMATCHES
        assert "digest" in book.bad[0][2] and book.bad_offences == [good]  # refused each time, one offence
        book.bad.clear()
        assert _client(swarm, book).fetch(0, [good], snaps[0].version - 1, digest=b"x" * 16) is not None
        assert book.bad == []
    finally:
        server.close()


# ---- who is served -------------------------------------------------------------------------------------


def test_a_peer_without_a_live_heartbeat_is_refused_until_it_has_one(swarm):
    book = Book()
    live: set[str] = set()
    server = _server(swarm, swarm.good, book, live=lambda p: p in live)
    client_id = swarm.id(swarm.client)
    try:
        t0 = time.monotonic()
        assert _client(swarm, book, timeout=2.0).fetch(0, [swarm.id(swarm.good)]) is None
        elapsed = time.monotonic() - t0
        assert 1.5 < elapsed < 6, elapsed  # retried (a joiner's heartbeat may not be seen yet), then gave up
        assert book.refused and set(book.refused) == {(client_id, "state_not_live", False)}
        assert book.bad == [] and server.served == 0

        # Its heartbeat arrives while the client waits: the retried request is served.
        book.refused.clear()
        timer = threading.Timer(1.0, live.add, args=(client_id,))
        timer.start()
        try:
            got = _client(swarm, book, timeout=20.0).fetch(0, [swarm.id(swarm.good)])
        finally:
            timer.cancel()
        assert got is not None and got.source == swarm.id(swarm.good)
        assert book.refused and set(book.refused) == {(client_id, "state_not_live", False)}
    finally:
        server.close()


def _first_reply(swarm: Swarm, server: P2P, request: swarm_pb2.StateRequest) -> str:
    """Send one raw request; the first reply's refusal, or "data" when a chunk came."""

    async def ask() -> str:
        async with wire.open_stream(swarm.client, swarm.id(server), STATE_HANDLER, request, swarm_pb2.StateChunk,
                                    max_reply_bytes=MAX_CHUNK_BYTES, idle_timeout=10) as replies:
            async for msg in replies:
                return msg.error or "data"
        return "nothing"

    return swarm.run(ask(), timeout=30)


def test_a_stranger_is_refused_whatever_heartbeat_it_presents_and_a_joiner_is_served_from_the_dht(swarm,
                                                                                                  monkeypatch):
    """A heartbeat in the request is the requester's own word: anyone can make one (a stranger downloaded the
    whole state 96 times that way). A requester that is not in the server's table is looked up in the swarm's
    DHT (``confirm_live``): served when its heartbeat is there (a joiner the server has not read yet), refused
    "not-live" otherwise, however fresh and well-formed the heartbeat it presents; the lookup's answer is
    cached, and a refusal is no offence (a joiner may be early)."""
    book = Book()
    in_dht: set[str] = set()
    lookups: list[str] = []

    async def confirm_live(peer: str) -> bool:
        lookups.append(peer)
        return peer in in_dht

    server = _server(swarm, swarm.good, book, live=lambda p: False, confirm_live=confirm_live)
    me = swarm.id(swarm.client)
    try:
        presented = swarm_pb2.StateRequest(fingerprint=FP, fragment=1, heartbeat=swarm_pb2.Heartbeat(
            peer_id=me, fingerprint=FP, time=time.time()))
        assert _first_reply(swarm, swarm.good, presented).startswith("not-live")
        assert _first_reply(swarm, swarm.good, swarm_pb2.StateRequest(fingerprint=FP, fragment=1)).startswith(
            "not-live")
        assert lookups == [me]  # the second request was answered from the cache
        assert {(p, kind, offence) for p, kind, offence in book.refused} == {(me, "state_not_live", False)}
        assert server.served == 0
        # its heartbeat reaches the DHT: once the cached answer has expired, it is served
        in_dht.add(me)
        monkeypatch.setattr(state_sync, "LIVE_CACHE_S", 0.0)  # every cached answer has expired
        assert _first_reply(swarm, swarm.good, swarm_pb2.StateRequest(fingerprint=FP, fragment=1)) == "data"
    finally:
        server.close()


def test_serving_is_bounded_by_the_budget_and_members_go_first():
    """``ServeBudget``: the bytes per second of all downloads; a member that trains takes the bucket before a
    non-member that waits with it."""
    async def run() -> tuple[float, list[str]]:
        budget = state_sync.ServeBudget(1_000_000)
        order: list[str] = []
        t0 = time.monotonic()

        async def take(who: str, member: bool) -> None:
            for _ in range(3):
                await budget.take(500_000, member)
                order.append(who)

        await asyncio.gather(take("joiner", False), take("member", True))
        return time.monotonic() - t0, order

    elapsed, order = asyncio.run(run())
    # 3 MB at 1 MB/s with a bucket of one second's worth: about 2 s
    assert 1.6 < elapsed < 4.0, elapsed
    assert order.index("joiner") >= 2 or order[:2] == ["member", "member"] or order[0] == "joiner"
    assert order[-1] == "joiner"


def test_a_banned_peer_is_refused_and_the_client_skips_banned_holders(swarm):
    book = Book()
    server = _server(swarm, swarm.good, book, banned=lambda p: p == swarm.id(swarm.client))
    try:
        assert _client(swarm, book, timeout=3.0).fetch(0, [swarm.id(swarm.good)]) is None
        assert book.refused == [(swarm.id(swarm.client), "state_banned", False)]  # refused once, not retried
        client = StateClient(Runtime(swarm.loop, swarm.client), FP, ByteCounters(), timeout=3.0,
                             expected_numel=_numel, is_banned=lambda p: True)
        with pytest.raises(RuntimeError, match="banned here"):
            swarm.run(client.fetch_async(0, [swarm.id(swarm.good)]))
        assert len(book.refused) == 1  # the banned holder was never asked
    finally:
        server.close()


def test_rate_limit_refuses_without_blame_and_the_client_waits_before_asking_again(swarm):
    book = Book()
    clock = [1000.0]
    server = _server(swarm, swarm.good, book, requests_per_minute=3, now=lambda: clock[0])
    client = _client(swarm, book, timeout=5.0, backoff=HolderBackoff(now=lambda: clock[0]))
    good, client_id = swarm.id(swarm.good), swarm.id(swarm.client)
    try:
        for _ in range(3):
            assert client.fetch(0, [good]) is not None
        assert book.refused == []
        t0 = time.monotonic()
        assert client.fetch(0, [good]) is None  # the 4th within the minute
        assert time.monotonic() - t0 < 3  # not retried at once
        # refused, but no offence: an honest node far behind asks often and cannot see the server's bucket
        assert book.refused == [(client_id, "state_rate", False)]
        assert client.fetch(0, [good]) is None  # the holder refused lately: not even asked
        assert book.refused == [(client_id, "state_rate", False)]
        clock[0] += state_sync.BACKOFF_FIRST_S[state_sync.RATE_LIMITED] + 15.0  # a token back, the wait over
        assert client.fetch(0, [good]) is not None
        assert book.bad == []
    finally:
        server.close()


def test_a_peer_that_keeps_asking_past_the_refusals_floods_and_that_is_an_offence(swarm):
    book = Book()
    clock = [1000.0]
    server = _server(swarm, swarm.good, book, requests_per_minute=3, now=lambda: clock[0])
    good, client_id = swarm.id(swarm.good), swarm.id(swarm.client)
    try:
        for _ in range(9):  # a client that ignores the refusals (a fresh backoff each time)
            _client(swarm, book, timeout=5.0).fetch(0, [good])
        # 3 served, 3 refused without blame, then each refusal past 3 a minute is a flood offence
        assert book.refused == [(client_id, "state_rate", False)] * 3 + [(client_id, "state_rate", True)] * 3
    finally:
        server.close()


def test_holder_backoff_waits_per_refusal_and_doubles_while_refused():
    clock = [0.0]
    backoff = HolderBackoff(now=lambda: clock[0])
    assert backoff.waiting("a") == 0
    assert backoff.refused("a", state_sync.BANNED) == state_sync.BACKOFF_FIRST_S[state_sync.BANNED]
    assert backoff.refused("b", state_sync.OLD_VERSION) == state_sync.BACKOFF_DEFAULT_S
    assert backoff.waiting("a") == state_sync.BACKOFF_FIRST_S[state_sync.BANNED]
    clock[0] += 100.0
    assert backoff.waiting("a") == 0 and backoff.waiting("b") == 0
    waits = [backoff.refused("b", state_sync.OLD_VERSION) for _ in range(10)]
    assert waits[:3] == [2 * state_sync.BACKOFF_DEFAULT_S, 4 * state_sync.BACKOFF_DEFAULT_S,
                         8 * state_sync.BACKOFF_DEFAULT_S]
    assert waits[-1] == state_sync.BACKOFF_MAX_S
    backoff.served("b")
    assert backoff.waiting("b") == 0 and backoff.refused("b", state_sync.OLD_VERSION) == state_sync.BACKOFF_DEFAULT_S


def test_rate_limiter_buckets():
    clock = [0.0]
    limiter = StateRateLimiter(60, now=lambda: clock[0], max_peers=2)
    assert all(limiter.take("a") for _ in range(60)) and not limiter.take("a")
    clock[0] += 1.0
    assert limiter.take("a") and not limiter.take("a")  # one a second
    assert limiter.take("b") and limiter.take("c")  # "a" is forgotten (bounded memory): a full bucket again
    assert sum(limiter.take("a") for _ in range(100)) == 60
    with pytest.raises(ValueError):
        StateRateLimiter(0)


def test_a_malformed_request_is_an_offence_and_the_server_keeps_serving(swarm):
    book = Book()
    server = _server(swarm, swarm.good, book)

    async def garbage() -> str:
        from hivemind.p2p import PeerID

        _, reader, writer = await swarm.client.call_binary_stream_handler(
            PeerID.from_base58(swarm.id(swarm.good)), STATE_HANDLER)
        writer.write(wire.MESSAGE_MARKER + (1 << 20).to_bytes(8, "big"))  # a 1 MiB "request"
        await writer.drain()
        try:
            await wire.read_message(reader, swarm_pb2.StateChunk, max_bytes=4096, timeout=5)
            return "no refusal"
        except wire.WireError as exc:
            return str(exc)
        finally:
            writer.close()

    try:
        assert f"exceeds the limit of {state_sync.MAX_REQUEST_BYTES}" in swarm.run(garbage())
        assert book.refused == [(swarm.id(swarm.client), "state_request", True)]
        assert _client(swarm, book).fetch(2, [swarm.id(swarm.good)]) is not None
    finally:
        server.close()


# ---- hostile holders --------------------------------------------------------------------------------------

_hostile_names = itertools.count()


async def _drain(requests: wire.RequestStream) -> None:
    """Read the client's acknowledgements to its END, as the real server does before it closes (a stream
    closed with unread data is reset, and the reset can cut the last chunk short on its way out)."""
    with contextlib.suppress(TimeoutError, wire.WireError):
        async with asyncio.timeout(5):
            async for _ in requests:
                pass


def _chunk(req: swarm_pb2.StateRequest, offset: int, count: int, *, version: int = 9, numel: int = NUMEL,
           value: float = 0.5, mom_count: int | None = None) -> swarm_pb2.StateChunk:
    phi = torch.full((count,), value).numpy().tobytes()
    mom = torch.zeros(count if mom_count is None else mom_count).numpy().tobytes()
    return swarm_pb2.StateChunk(fragment=req.fragment, version=version, numel=numel, offset=offset, phi=phi,
                                momentum=mom)


def _complete(req: swarm_pb2.StateRequest, **bad) -> list[swarm_pb2.StateChunk]:
    """A whole fragment's chunks with the middle one altered by ``bad`` (``_chunk``'s keywords)."""
    last = NUMEL - 2 * CHUNK_ELEMS
    return [_chunk(req, 0, CHUNK_ELEMS), _chunk(req, CHUNK_ELEMS, CHUNK_ELEMS, **bad),
            _chunk(req, 2 * CHUNK_ELEMS, last)]


def _hostile_chunks(mode: str, req: swarm_pb2.StateRequest) -> list[swarm_pb2.StateChunk]:
    first = _chunk(req, 0, CHUNK_ELEMS)  # a plausible first chunk: dropped with the rest
    return {
        "nan": _complete(req, value=float("nan")),
        "inf": _complete(req, value=float("-inf")),
        "inf_momentum": [swarm_pb2.StateChunk(fragment=req.fragment, version=9, numel=NUMEL, offset=0,
                                              phi=bytes(400), momentum=torch.full((100,), float("inf"))
                                              .numpy().tobytes())],
        "wrong_numel": [_chunk(req, 0, 10, numel=10)],
        "huge_numel": [_chunk(req, 0, CHUNK_ELEMS, numel=1 << 40)],
        "numel_changes": _complete(req, numel=NUMEL + 1),
        "chunk_past_end": [_chunk(req, 0, CHUNK_ELEMS), _chunk(req, CHUNK_ELEMS, CHUNK_ELEMS),
                           _chunk(req, 2 * CHUNK_ELEMS, 200)],
        "chunk_too_big": [_chunk(req, 0, CHUNK_ELEMS + 1)],
        "unequal_lengths": [_chunk(req, 0, 100, mom_count=99)],
        "gap": [first, _chunk(req, CHUNK_ELEMS + 1, 10)],
        "overlap": [first, _chunk(req, CHUNK_ELEMS - 5, 10)],
        "version_switch": _complete(req, version=10),
        "old_version": [_chunk(req, 0, 10, version=1)],
        "other_fragment": [swarm_pb2.StateChunk(fragment=req.fragment + 1, version=9, numel=NUMEL, offset=0,
                                                phi=bytes(4), momentum=bytes(4))],
        "oversize": [swarm_pb2.StateChunk(fragment=req.fragment, version=9, numel=NUMEL, offset=0,
                                          phi=bytes(MAX_CHUNK_BYTES), momentum=bytes(MAX_CHUNK_BYTES))],
        "ends_early": [first],
        "other_precision": [swarm_pb2.StateChunk(fragment=req.fragment, version=9, numel=NUMEL, offset=0,
                                                 phi=bytes(400), momentum=bytes(200),
                                                 momentum_precision=swarm_pb2.MOMENTUM_BF16)],
        "unknown_precision": [swarm_pb2.StateChunk(fragment=req.fragment, version=9, numel=NUMEL, offset=0,
                                                   phi=bytes(400), momentum=bytes(400), momentum_precision=7)],
    }[mode]


# mode -> (the kind the client reports, a part of its detail)
HOSTILE = {
    "nan": ("bad_state", f"phi at {CHUNK_ELEMS} has {CHUNK_ELEMS} non-finite value(s)"),
    "inf": ("bad_state", f"phi at {CHUNK_ELEMS} has {CHUNK_ELEMS} non-finite value(s)"),
    "inf_momentum": ("bad_state", "momentum at 0 has 100 non-finite value(s)"),
    "wrong_numel": ("bad_state", f"fragment 0 has {NUMEL} elements here, not 10"),
    "huge_numel": ("bad_state", f"fragment 0 has {NUMEL} elements here, not {1 << 40}"),
    "numel_changes": ("bad_state", f"has {NUMEL} elements here, not {NUMEL + 1}"),
    "chunk_past_end": ("bad_state", f"chunk of 200 elements at {2 * CHUNK_ELEMS} does not fit {NUMEL} elements"),
    "chunk_too_big": ("bad_state", f"chunk of {CHUNK_ELEMS + 1} elements at 0 does not fit"),
    "unequal_lengths": ("bad_state", "malformed chunk: 400 bytes of phi, 396 of momentum"),
    "gap": ("bad_state", f"sent offset {CHUNK_ELEMS + 1}, expected {CHUNK_ELEMS} (gap or overlap)"),
    "overlap": ("bad_state", f"sent offset {CHUNK_ELEMS - 5}, expected {CHUNK_ELEMS} (gap or overlap)"),
    "version_switch": ("bad_state", "switched from version 9 to 10 mid-fragment"),
    "old_version": ("bad_state", "sent version 1, below the 5 asked for"),
    "other_fragment": ("bad_state", "sent fragment 1 for fragment 0"),
    "oversize": ("bad_stream", "exceeds the limit of"),
    "ends_early": ("bad_state", f"the stream ended at {CHUNK_ELEMS}/{NUMEL}"),
    "other_precision": ("bad_state", "momentum in precision 1, 0 was asked for"),
    "unknown_precision": ("bad_state", "momentum in precision 7, 0 was asked for"),
}


@pytest.mark.parametrize("mode", sorted(HOSTILE))
def test_a_hostile_holder_is_refused_and_the_next_holder_serves(swarm, mode, caplog):
    caplog.set_level(logging.INFO, logger="locoswarm.state")
    book = Book()
    snaps = _snaps(seed=3)
    honest = _server(swarm, swarm.good, book, snaps=snaps)

    async def hostile(remote: str, requests: wire.RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        req = await anext(requests)
        for chunk in _hostile_chunks(mode, req):
            yield chunk
        await _drain(requests)

    bad = swarm.run(wire.serve(swarm.other, STATE_HANDLER, hostile, swarm_pb2.StateRequest,
                               max_request_bytes=1024, idle_timeout=5, max_streams_per_peer=4, max_streams=8))
    bad_id, good_id = swarm.id(swarm.other), swarm.id(swarm.good)
    try:
        for attempt in range(3):
            caplog.clear()
            got = _client(swarm, book).fetch(0, [bad_id, good_id], min_version=5)
            assert got is not None and got.source == good_id
            assert _same(got, snaps[0])  # nothing of the hostile holder's chunks survived
            if book.bad:
                break
            # Not counted: only a network failure of the stream to the hostile holder may explain that
            # (seen once in a loaded CI run); anything else is a defect. Ask again.
            failed = [r.getMessage() for r in caplog.records if f"from {bad_id[:16]} failed" in r.getMessage()]
            assert failed, f"the hostile holder was neither refused nor failed: {caplog.text[-2000:]}"
            print(f"\n[state] {mode}: attempt {attempt}: {failed}")
        kind, detail = HOSTILE[mode]
        assert [(peer, k) for peer, k, _ in book.bad] == [(bad_id, kind)]
        assert detail in book.bad[0][2], book.bad[0][2]
        print(f"\n[state] {mode}: refused {bad_id[:12]}: {book.bad[0][2]}")
        # With no honest holder left, the download fails cleanly (no exception, nothing half-applied).
        assert _client(swarm, book, timeout=5).fetch(0, [bad_id]) is None
    finally:
        swarm.run(bad.stop())
        honest.close()


def test_a_bf16_momentum_download_is_a_quarter_smaller_with_phi_exact(swarm):
    """``momentum="bf16"``: phi arrives bit for bit, the momentum rounded to bf16 (nearest even), and the
    download carries 6 bytes per element instead of 8."""
    book = Book()
    snaps = _snaps(seed=5)
    server = _server(swarm, swarm.good, book, snaps=snaps)
    good = swarm.id(swarm.good)
    try:
        exact, half = _client(swarm, book), _client(swarm, book, momentum="bf16")
        full = exact.fetch(0, [good])
        got = half.fetch(0, [good])
        assert full is not None and _same(full, snaps[0])
        assert got is not None and got.version == snaps[0].version and torch.equal(got.phi, snaps[0].phi)
        assert got.momentum.dtype == torch.float32
        assert torch.equal(got.momentum, snaps[0].momentum.to(torch.bfloat16).to(torch.float32))
        assert not torch.equal(got.momentum, snaps[0].momentum)  # rounded: random fp32 values are not bf16
        rel = float((got.momentum - snaps[0].momentum).abs().max() / snaps[0].momentum.abs().max())
        assert 0 < rel <= 2 ** -8
        sent, recv = exact.counters.received_bytes, half.counters.received_bytes
        payload = 8 * NUMEL  # fp32 phi + momentum
        assert payload <= sent < payload * 1.02, sent
        assert 0.75 * payload <= recv < 0.75 * payload * 1.02, recv
        print(f"\n[state] {NUMEL} elements: {sent} bytes with fp32 momentum, {recv} with bf16 ({recv / sent:.3f})")
        assert book.bad == [] and book.refused == []
    finally:
        server.close()


def test_the_server_holds_chunks_back_while_its_own_round_exchanges_but_not_forever(swarm, monkeypatch):
    """``yield_to``: while this node's round is exchanging, the next chunk waits (its uplink goes to the round);
    at most ``YIELD_MAX_S`` per chunk, so a round that never ends cannot starve a download."""
    monkeypatch.setattr(state_sync, "YIELD_MAX_S", 0.3)
    book = Book()
    snaps = _snaps(seed=6)
    busy_until = [time.monotonic() + 1.0]
    server = _server(swarm, swarm.good, book, snaps=snaps, yield_to=lambda: time.monotonic() < busy_until[0])
    good = swarm.id(swarm.good)
    try:
        t0 = time.monotonic()
        got = _client(swarm, book).fetch(0, [good])
        took = time.monotonic() - t0
        assert got is not None and _same(got, snaps[0])
        assert took >= 0.85 and 0.85 <= server.held_back_s <= 2.0, (took, server.held_back_s)  # 3 chunks x 0.3 s
        busy_until[0] = time.monotonic() + 3600.0  # a round that never ends
        held = server.held_back_s
        got = _client(swarm, book).fetch(1, [good])
        assert got is not None and _same(got, snaps[1])
        assert 0.85 <= server.held_back_s - held <= 2.0  # 3 chunks, 0.3 s each at most (and a loaded machine)
        busy_until[0] = 0.0
        held = server.held_back_s
        assert _client(swarm, book).fetch(2, [good]) is not None and server.held_back_s - held < 0.1
    finally:
        server.close()


def test_a_bf16_client_refuses_a_holder_that_sends_fp32_momentum(swarm):
    book = Book()

    async def wide(remote: str, requests: wire.RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        req = await anext(requests)
        assert req.momentum_precision == swarm_pb2.MOMENTUM_BF16
        chunk = _chunk(req, 0, CHUNK_ELEMS)  # fp32 momentum (4 bytes a value) labelled bf16
        chunk.momentum_precision = swarm_pb2.MOMENTUM_BF16
        yield chunk
        await _drain(requests)

    bad = swarm.run(wire.serve(swarm.other, STATE_HANDLER, wide, swarm_pb2.StateRequest,
                               max_request_bytes=1024, idle_timeout=5, max_streams_per_peer=4, max_streams=8))
    try:
        assert _client(swarm, book, timeout=5, momentum="bf16").fetch(0, [swarm.id(swarm.other)]) is None
        assert [(k, d) for _, k, d in book.bad] == [
            ("bad_state", f"malformed chunk: {4 * CHUNK_ELEMS} bytes of phi, {4 * CHUNK_ELEMS} of momentum")]
        with pytest.raises(ValueError, match="momentum precision 'fp16' is not one of"):
            _client(swarm, book, momentum="fp16")
    finally:
        swarm.run(bad.stop())


def test_a_request_for_an_unknown_momentum_precision_is_an_offence(swarm):
    book = Book()
    server = _server(swarm, swarm.good, book)

    async def ask() -> swarm_pb2.StateChunk:
        req = swarm_pb2.StateRequest(fingerprint=FP, fragment=0, momentum_precision=5)

        async def once() -> AsyncIterator[swarm_pb2.StateRequest]:
            yield req

        async with wire.open_stream(swarm.client, swarm.id(swarm.good), STATE_HANDLER, once(),
                                    swarm_pb2.StateChunk, max_reply_bytes=MAX_CHUNK_BYTES, idle_timeout=5) as stream:
            return await anext(aiter(stream))

    try:
        reply = swarm.run(ask())
        assert reply.error.startswith("bad-request: momentum precision 5 is not one of [0, 1]"), reply.error
        assert book.refused == [(swarm.id(swarm.client), "state_request", True)]
        assert server.served == 0
    finally:
        server.close()


def test_a_stream_closed_under_the_client_is_asked_again_not_given_up(swarm):
    # A refusal written just before the holder closed can reach the client as a closed or broken stream; the
    # only holder must be asked again (a joiner that gave up kept that fragment at its initial state).
    book = Book()
    calls = []

    async def flaky(remote: str, requests: wire.RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        req = await anext(requests)
        calls.append(req.offset)
        if len(calls) == 1:
            raise ConnectionResetError("closed under the client")
        for chunk in _complete(req):
            yield chunk
        await _drain(requests)

    server = swarm.run(wire.serve(swarm.other, STATE_HANDLER, flaky, swarm_pb2.StateRequest,
                                  max_request_bytes=1024, idle_timeout=5, max_streams_per_peer=4, max_streams=8))
    try:
        got = _client(swarm, book, timeout=10.0).fetch(0, [swarm.id(swarm.other)], min_version=5)
        assert got is not None and got.source == swarm.id(swarm.other) and len(calls) == 2
        assert book.bad == []  # a closed stream is nobody's offence
    finally:
        swarm.run(server.stop())


def test_a_holder_that_moves_to_a_newer_version_mid_download_is_followed(swarm):
    """Resuming at another holder that has a newer version starts over there (not a fault)."""
    book = Book()
    new = _snaps(seed=4)
    for s in new.values():
        s.version += 1
    honest = _server(swarm, swarm.good, book, snaps=new)

    async def drops(remote: str, requests: wire.RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        req = await anext(requests)
        yield _chunk(req, 0, CHUNK_ELEMS, version=5)
        raise ConnectionError("gone")  # the stream fails: a network fault, not a bad source

    flaky = swarm.run(wire.serve(swarm.other, STATE_HANDLER, drops, swarm_pb2.StateRequest,
                                 max_request_bytes=1024, idle_timeout=5, max_streams_per_peer=4, max_streams=8))
    try:
        got = _client(swarm, book).fetch(0, [swarm.id(swarm.other), swarm.id(swarm.good)], min_version=5)
        assert got is not None and got.version == 6 and _same(got, new[0])
        assert book.bad == []
    finally:
        swarm.run(flaky.stop())
        honest.close()


def test_constants_bound_a_chunk():
    assert MAX_CHUNK_BYTES >= 2 * 4 * CHUNK_ELEMS + 64  # a full chunk and its small fields fit
    assert MAX_CHUNK_BYTES < 2 * 4 * CHUNK_ELEMS + 8192
    assert state_sync.PARALLEL_DOWNLOADS <= state_sync.MAX_STREAMS_PER_PEER


def test_a_download_is_given_time_for_its_size(swarm):
    """A fixed 30 s failed every join of a 9 MB state pulled by three joiners from one holder at 5 Mbit/s."""
    client = _client(swarm, Book(), timeout=30.0)
    assert client.budget(0) == 30.0
    nine_mb = 9_000_000 // 8  # phi and momentum in fp32: 8 bytes per element
    assert client.budget(nine_mb) == pytest.approx(30.0 + 9_000_000 / state_sync.MIN_DOWNLOAD_RATE)
    assert client.budget(nine_mb) > 3 * 9_000_000 * 8 / 5e6  # three such downloads at 5 Mbit/s fit


# ---- replays: the steps a node missed instead of the state (locoswarm.node.core.step_log) -------------------


def _stepped(seed: int = 8, steps: int = 3, codec: str = "fp4") -> tuple[dict[int, FragmentSnapshot],
                                                                         list[EncodedAverage]]:
    """A holder's snapshots whose fragment 0 logged ``steps`` steps, at versions 6 - steps .. 5 (averages of several
    chunks each, so that each step is several messages)."""
    g = torch.Generator().manual_seed(seed)
    enc = get_codec(codec, 64)
    averages = [EncodedAverage(codec, NUMEL, tuple(encode_chunks(enc, torch.randn(NUMEL, generator=g))))
                for _ in range(steps)]
    snaps = _snaps(seed)
    snaps[0] = replace(snaps[0], steps=tuple(OuterStep(6 - steps + i, a, bytes([i] * 16), bytes([i + 1] * 16))
                                             for i, a in enumerate(averages)))
    return snaps, averages


def test_a_holder_serves_the_steps_a_node_missed_and_refuses_what_its_log_does_not_reach(swarm):
    """A replay over real p2pd: from version 3 the client receives the two steps after it (v4, v5), byte for byte,
    as a snapshot to replay on its own state (``base`` 3), for far fewer bytes than the state. From version 1 the
    log (v3..v5) does not reach back: refused without blame, nothing returned (the node then downloads the state),
    and the holder is still asked for the state at once (no backoff)."""
    book = Book()
    snaps, averages = _stepped()
    server = _server(swarm, swarm.good, book, snaps=snaps)
    good = swarm.id(swarm.good)
    try:
        client = _client(swarm, book)
        got = client.fetch_steps(0, [good], have=3, target=5)
        assert got is not None and got.source == good and got.base == 3 and got.version == 5
        assert got.steps == snaps[0].steps[1:] and got.phi.numel() == 0 and got.is_replay
        assert len(averages[1].chunks) > 2
        assert client.counters.received_bytes < 0.2 * 8 * NUMEL  # two fp4 steps, against phi + momentum in fp32
        assert client.fetch_steps(0, [good], have=1, target=5) is None
        assert client.fetch_steps(0, [good], have=5, target=5) is None  # nothing newer to replay
        assert _same(client.fetch(0, [good], min_version=5), snaps[0])
        assert book.bad == [] and all(not offence for _, _, offence in book.refused)
    finally:
        server.close()


def test_a_replay_of_fp32_steps_is_taken_though_it_outweighs_the_state(swarm):
    """Steps in the widest codec (fp32, 4 bytes per element): four of them are twice the bytes of the state, and the
    client still takes them from an honest holder (a bound of the state's size refused two, and blamed the holder:
    a loopback gossip test's nodes then stopped taking state from each other)."""
    book = Book()
    snaps, averages = _stepped(steps=4, codec="fp32")
    server = _server(swarm, swarm.good, book, snaps=snaps)
    good = swarm.id(swarm.good)
    try:
        got = _client(swarm, book).fetch_steps(0, [good], have=1, target=5)
        assert got is not None and got.base == 1 and got.version == 5
        assert [s.average for s in got.steps] == averages and sum(a.nbytes for a in averages) == 16 * NUMEL
        assert book.bad == []
    finally:
        server.close()


def replace_step(step: swarm_pb2.ReplayStep) -> swarm_pb2.ReplayStep:
    """``step`` without its digests."""
    bare = swarm_pb2.ReplayStep()
    bare.CopyFrom(step)
    bare.ClearField("before")
    bare.ClearField("after")
    return bare


REPLAY_HOSTILE = {
    "gap": ("sent step v5 chunk 0; expected v4 chunk 0", lambda s: [m for m in s if m.step.version != 4]),
    "reordered": ("sent step v4 chunk 2 inside step v4 at chunk 1", lambda s: [s[0], s[2], s[1], *s[3:]]),
    "state_instead": ("sent a state for a replay of fragment 0", None),
    # one step in more bytes than fp32 takes (the widest codec): a replay never holds more than REPLAY_DEPTH of those
    "oversized": (f"sent {4 * NUMEL + 4098} bytes of step v4, more than any codec takes for {NUMEL} elements",
                  lambda s: [swarm_pb2.StateChunk(fragment=0, version=5, numel=NUMEL, step=swarm_pb2.ReplayStep(
                      version=4, codec="fp32", numel=NUMEL, index=i, count=2, data=bytes(2 * NUMEL + 2049),
                      before=bytes(16) if i == 0 else b"", after=bytes(16) if i == 0 else b"")) for i in range(2)]),
    "no_digests": ("step v4: digests of 0 and 0 bytes, not 16",
                   lambda s: [swarm_pb2.StateChunk(fragment=m.fragment, version=m.version, numel=m.numel,
                                                   step=replace_step(m.step)) for m in s]),
}


@pytest.mark.parametrize("mode", sorted(REPLAY_HOSTILE))
def test_a_holder_that_serves_a_malformed_replay_is_refused_and_the_next_one_serves(swarm, mode):
    book = Book()
    snaps, averages = _stepped()
    honest = _server(swarm, swarm.good, book, snaps=snaps)
    detail, mangle = REPLAY_HOSTILE[mode]

    async def hostile(remote: str, requests: wire.RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        req = await anext(requests)
        msgs = [swarm_pb2.StateChunk(fragment=0, version=5, numel=NUMEL, step=swarm_pb2.ReplayStep(
            version=4 + k, codec="fp4", numel=NUMEL, index=i, count=len(a.chunks), data=data,
            before=bytes(16) if i == 0 else b"", after=bytes(16) if i == 0 else b""))
            for k, a in enumerate(averages[1:]) for i, data in enumerate(a.chunks)]
        msgs = mangle(msgs) if mangle else [_chunk(req, 0, CHUNK_ELEMS)]
        for msg in msgs:
            yield msg
        await _drain(requests)

    bad = swarm.run(wire.serve(swarm.other, STATE_HANDLER, hostile, swarm_pb2.StateRequest,
                               max_request_bytes=1024, idle_timeout=5, max_streams_per_peer=4, max_streams=8))
    try:
        got = _client(swarm, book).fetch_steps(0, [swarm.id(swarm.other), swarm.id(swarm.good)], have=3, target=5)
        assert got is not None and got.source == swarm.id(swarm.good)
        assert [s.average for s in got.steps] == averages[1:]
        assert [(k, d) for _, k, d in book.bad] == [("bad_state", detail)]
    finally:
        honest.close()
        swarm.run(bad.stop())


def test_an_outbound_only_holder_serves_replays_but_no_state(swarm):
    """Behind a home router (``outbound_only``) a node serves no state: a peer that reaches it over a connection
    the node opened is refused (``outbound-only``, no blame) and asks it again a minute later at the earliest;
    replays, a few hundred kB, it still serves."""
    book = Book()
    snaps, _ = _stepped()
    server = _server(swarm, swarm.good, book, snaps=snaps, outbound_only=lambda: True)
    good = swarm.id(swarm.good)
    try:
        backoff = HolderBackoff()
        client = _client(swarm, book, backoff=backoff)
        assert client.fetch(0, [good], min_version=5) is None
        assert 55 <= backoff.waiting(good) <= 60
        assert book.bad == [] and all(not offence for _, _, offence in book.refused)
        got = _client(swarm, book).fetch_steps(0, [good], have=4, target=5)
        assert got is not None and got.steps == snaps[0].steps[2:]
    finally:
        server.close()
