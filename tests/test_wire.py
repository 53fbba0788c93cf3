"""Bounded framing on real libp2p streams: two hivemind P2P daemons on loopback inside this process.

A server P2P registers handlers with ``locoswarm.node.swarm.wire.serve``; a client P2P talks to it with
``open_stream`` or, to play a hostile peer, writes raw frames on a binary stream. Every test is
bounded in time; both p2pd processes are stopped by the fixture, and every asyncio error the loop
reports ("Future exception was never retrieved", unhandled callback errors) fails the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any

import hivemind  # noqa: F401 (imported up front so the first test's timings exclude the import)
import pytest
from hivemind.p2p import P2P, PeerID

from locoswarm.node.swarm import wire
from locoswarm.node.swarm.wire import DialError, PeerRefused, RequestStream, WireError, open_stream, serve
from locoswarm.protocol import swarm_pb2

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
_names = itertools.count()


def rss_bytes() -> int:
    """Resident memory of this process (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class LoopThread:
    """An asyncio loop in a thread (like the node's network runtime) that records every loop error."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[str] = []
        self.loop.set_exception_handler(self._record)
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-wire-loop", daemon=True)
        self._thread.start()

    def _record(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class Net:
    def __init__(self, loop: LoopThread, server: P2P, client: P2P) -> None:
        self.loop = loop
        self.server = server
        self.client = client
        self.server_id = str(server.peer_id)
        self.client_id = str(client.peer_id)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return self.loop.run(coro, timeout)

    async def raw_stream(self, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A binary stream from the client to the server's handler ``name``: a hostile peer writes raw bytes."""
        _, reader, writer = await self.client.call_binary_stream_handler(PeerID.from_base58(self.server_id), name)
        return reader, writer


async def start_p2ps(n: int) -> list[P2P]:
    """``n`` P2P daemons on loopback, each bootstrapped from the first."""
    quiet = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], auto_nat=False, nat_port_map=False, use_relay=False)
    first = await P2P.create(**quiet)
    rest = [await P2P.create(initial_peers=await first.get_visible_maddrs(), **quiet) for _ in range(n - 1)]
    return [first, *rest]


def _p2pd_children() -> set[int]:
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{name}/stat") as fh:
            stat = fh.read()
        comm, fields = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
        if comm == "p2pd" and int(fields[1]) == os.getpid():
            out.add(int(name))
    return out


@contextlib.contextmanager
def p2p_nodes(n: int) -> Iterator[tuple[LoopThread, list[P2P]]]:
    """A loop thread and ``n`` P2P daemons; on exit the daemons are shut down (and must be gone by PID)
    and any error the loop reported fails the caller."""
    before = _p2pd_children()
    loop = LoopThread()
    p2ps = loop.run(start_p2ps(n), timeout=60)
    ours = _p2pd_children() - before
    try:
        yield loop, p2ps
    finally:
        for p2p in reversed(p2ps):
            with contextlib.suppress(Exception):
                loop.run(p2p.shutdown(), timeout=10)
        gc.collect()  # an un-retrieved future's error is reported when it is collected
        loop.run(asyncio.sleep(0.1), timeout=5)
        errors = list(loop.errors)
        loop.stop()
        deadline = time.monotonic() + 10
        while ours & _p2pd_children() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in ours & _p2pd_children():  # still there: ours, killed by PID
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert not errors, f"the event loop reported errors: {errors}"
    assert not ours & _p2pd_children(), "a p2pd started by this module was still running"


@pytest.fixture(scope="module")
def net():
    with p2p_nodes(2) as (loop, (server, client)):
        yield Net(loop, server, client)


def _name() -> str:
    return f"locoswarm.test.wire.{next(_names)}"


async def _echo(remote: str, requests: RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
    """Answers each StateRequest with a chunk naming it (and the authenticated remote in ``error``)."""
    async for req in requests:
        yield swarm_pb2.StateChunk(fragment=req.fragment, offset=req.offset, error=remote)


async def _requests(n: int) -> AsyncIterator[swarm_pb2.StateRequest]:
    for i in range(n):
        yield swarm_pb2.StateRequest(fingerprint="fp", fragment=i, offset=10 * i)


async def _collect(stream: wire.ReplyStream) -> list:
    async with stream:
        return [msg async for msg in stream]


def _serve(net: Net, handler, **limits) -> wire.WireServer:
    kw = dict(max_request_bytes=4096, idle_timeout=5.0, max_streams_per_peer=4, max_streams=16)
    kw.update(limits)
    return net.run(serve(net.server, _name(), handler, swarm_pb2.StateRequest, **kw))


def _wait_until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


# ---- a normal stream ------------------------------------------------------------------------------


def test_round_trip_of_a_stream_and_of_one_message(net):
    server = _serve(net, _echo)
    try:
        replies = net.run(_collect(open_stream(net.client, net.server_id, server.name, _requests(3),
                                               swarm_pb2.StateChunk, max_reply_bytes=4096, idle_timeout=5)))
        assert [(r.fragment, r.offset) for r in replies] == [(0, 0), (1, 10), (2, 20)]
        assert {r.error for r in replies} == {net.client_id}  # the handler saw the authenticated peer id
        one = net.run(_collect(open_stream(net.client, net.server_id, server.name,
                                           swarm_pb2.StateRequest(fragment=7, offset=3), swarm_pb2.StateChunk,
                                           max_reply_bytes=4096, idle_timeout=5)))
        assert [(r.fragment, r.offset) for r in one] == [(7, 3)]
        assert _wait_until(lambda: server.open_streams() == 0, 5)
    finally:
        net.run(server.stop())


def test_the_server_closes_last_and_holds_a_silent_peers_stream_a_bounded_time(net):
    """After its END the server keeps the stream until the client closes it (a stream p2pd resets on the
    server's close can lose the last frames), and no longer than LINGER_TIMEOUT when the client never does."""
    server = _serve(net, _echo)

    async def read_to_end(reader: asyncio.StreamReader) -> list:
        return [m async for m in wire.RequestStream(reader, swarm_pb2.StateChunk, 4096, 5.0)]

    async def one_stream(close_after: float) -> tuple[list, float, float]:
        reader, writer = await net.raw_stream(server.name)
        await wire.write_message(writer, swarm_pb2.StateRequest(fragment=5))
        await wire.write_end(writer)
        replies = await read_to_end(reader)  # up to and including the server's END
        t_end = time.monotonic()
        await asyncio.sleep(close_after)
        held = server.open_streams(net.client_id)  # still served while this client keeps its end open
        writer.close()
        while server.open_streams(net.client_id) and time.monotonic() - t_end < 10:
            await asyncio.sleep(0.01)
        return replies, held, time.monotonic() - t_end

    try:
        replies, held, gone = net.run(one_stream(close_after=0.5), timeout=30)
        assert [r.fragment for r in replies] == [5]
        assert held == 1, "the server closed first"
        assert gone < 0.5 + 1.0  # released once the client closed, not at the linger bound
        replies, held, gone = net.run(one_stream(close_after=wire.LINGER_TIMEOUT + 1.0), timeout=30)
        assert [r.fragment for r in replies] == [5] and held == 0  # a client that never closes: let go
    finally:
        net.run(server.stop())


def test_frames_are_hivemind_frames(net):
    """The framing is hivemind's: its own writer's frames parse, and its reader parses ours."""

    async def check() -> None:
        reader = asyncio.StreamReader()
        msg = swarm_pb2.StateChunk(fragment=3, phi=b"x" * 100)
        transport = _BufferTransport()
        protocol = asyncio.StreamReaderProtocol(reader)
        writer = asyncio.StreamWriter(transport, protocol, reader, asyncio.get_running_loop())
        await P2P.send_protobuf(msg, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
        await wire.write_message(writer, msg)
        await wire.write_error(writer, "go away")
        reader.feed_data(bytes(transport.data))
        reader.feed_eof()
        assert await wire.read_message(reader, swarm_pb2.StateChunk, max_bytes=1000, timeout=1) == msg
        assert await wire.read_message(reader, swarm_pb2.StateChunk, max_bytes=1000, timeout=1) is None
        theirs, err = await P2P.receive_protobuf(swarm_pb2.StateChunk, reader)
        assert theirs == msg and err is None
        theirs, err = await P2P.receive_protobuf(swarm_pb2.StateChunk, reader)
        assert theirs is None and err.message == "go away"

    net.run(check())


class _BufferTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


# ---- a hostile client ------------------------------------------------------------------------------


async def _counting(seen: list[str], remote: str, requests: RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
    """Echoes requests; records the WireError it refuses (the handler decides what to count)."""
    try:
        async for req in requests:
            yield swarm_pb2.StateChunk(fragment=req.fragment)
    except WireError as exc:
        seen.append(str(exc))
        raise


async def _push_frame(net: Net, name: str, announced: int, max_bytes: int) -> tuple[int, int, str]:
    """A hostile client: announces a frame of ``announced`` bytes and pushes up to ``max_bytes`` of it (20 s
    at most). Returns the bytes pushed before the server stopped it, the peak RSS meanwhile, the refusal."""
    reader, writer = await net.raw_stream(name)
    writer.write(wire.MESSAGE_MARKER + announced.to_bytes(wire.HEADER_LEN, "big"))
    block = bytes(MiB)
    sent, peak = 0, rss_bytes()
    deadline = time.monotonic() + 20
    with contextlib.suppress(ConnectionError, OSError):  # TimeoutError included: the server stopped reading
        while sent < max_bytes and time.monotonic() < deadline:
            writer.write(block)
            await asyncio.wait_for(writer.drain(), 2)
            sent += len(block)
            peak = max(peak, rss_bytes())
    try:
        await wire.read_message(reader, swarm_pb2.StateChunk, max_bytes=4096, timeout=5)
        refusal = "no refusal"
    except WireError as exc:  # the refusal, or a broken pipe if the close overtook it
        refusal = str(exc)
    writer.close()
    return sent, peak, refusal


def _serves_the_next_client(net: Net, server: wire.WireServer) -> None:
    replies = net.run(_collect(open_stream(net.client, net.server_id, server.name, _requests(2),
                                           swarm_pb2.StateChunk, max_reply_bytes=4096, idle_timeout=5)))
    assert [r.fragment for r in replies] == [0, 1]


def test_announced_600_mib_message_is_refused_without_allocating_it(net):
    seen: list[str] = []
    server = _serve(net, functools.partial(_counting, seen), max_request_bytes=64 * 1024)
    announced = 600 * MiB
    try:
        start = rss_bytes()
        sent, peak, refusal = net.run(_push_frame(net, server.name, announced, announced), timeout=60)
        print(f"\n[wire] flood: announced {announced >> 20} MiB, client pushed {sent >> 20} MiB before the "
              f"server stopped it; RSS {start >> 20} -> peak {peak >> 20} MiB; refusal: {refusal!r}")
        assert seen == [f"message of {announced} bytes exceeds the limit of 65536"]
        assert refusal != "no refusal"
        assert peak - start < 64 * MiB, "the server buffered the announced message"
        assert _wait_until(lambda: server.open_streams() == 0, 5)
        _serves_the_next_client(net, server)  # the server is healthy for the next client
    finally:
        net.run(server.stop())


def test_a_peer_the_gatekeeper_refuses_gets_one_frame_and_nothing_of_it_is_read(net):
    """A banned peer's stream: the error frame, then the stream is closed; the handler never runs and the
    server reads none of what the peer pushes (a banned flooder's megabytes cost the server nothing)."""
    seen: list[str] = []
    asked: list[str] = []
    refuse = {"on": True}

    def gatekeeper(remote: str) -> str | None:
        asked.append(remote)
        return "refused: this node bans your peer id for now" if refuse["on"] else None

    server = _serve(net, functools.partial(_counting, seen), max_request_bytes=64 * 1024, gatekeeper=gatekeeper)
    try:
        sent, _, refusal = net.run(_push_frame(net, server.name, 600 * MiB, 64 * MiB), timeout=60)
        print(f"\n[wire] banned peer pushed {sent >> 20} MiB before its stream was gone; refusal: {refusal!r}")
        assert asked == [net.client_id]
        assert seen == [] and refusal != "no refusal"
        assert sent < 64 * MiB, "the server kept reading a refused peer's stream"
        assert _wait_until(lambda: server.open_streams() == 0, 5)
        refuse["on"] = False  # no longer refused: served as usual
        _serves_the_next_client(net, server)
    finally:
        net.run(server.stop())


def test_a_refused_peers_streams_are_held_before_their_refusal_up_to_a_cap(net, monkeypatch):
    """Closed at once, a banned flooder opens its next stream at once; held (unread) for TARPIT_S, each of
    its streams costs it that long. Past TARPIT_MAX held streams the next ones close at once."""
    monkeypatch.setattr(wire, "TARPIT_S", 0.8)
    monkeypatch.setattr(wire, "TARPIT_MAX", 2)
    server = _serve(net, _echo, gatekeeper=lambda remote: "refused: this node bans your peer id for now")

    async def one() -> tuple[float, str]:
        reader, writer = await net.raw_stream(server.name)
        t0 = time.monotonic()
        head = await asyncio.wait_for(reader.readexactly(1 + wire.HEADER_LEN), 10)  # marker, length: whole
        text = await asyncio.wait_for(reader.readexactly(int.from_bytes(head[1:], "big")), 10)
        writer.close()
        return time.monotonic() - t0, text.decode(errors="replace")

    async def three() -> list[tuple[float, str]]:
        return await asyncio.gather(one(), one(), one())

    try:
        times = sorted(net.run(three(), timeout=30))
        print(f"\n[wire] refusals of a banned peer after {[round(t, 2) for t, _ in times]} s")
        assert all("bans your peer id" in text for _, text in times)
        assert times[0][0] < 0.5  # the third stream, past the cap: at once
        assert all(t >= 0.7 for t, _ in times[1:])  # held
    finally:
        net.run(server.stop())


def test_trickling_client_is_dropped_after_idle_timeout(net):
    server = _serve(net, _echo, idle_timeout=1.0)

    async def trickle() -> tuple[float, str]:
        reader, writer = await net.raw_stream(server.name)
        body = swarm_pb2.StateRequest(fingerprint="x" * 200).SerializeToString()
        frame = wire.MESSAGE_MARKER + len(body).to_bytes(wire.HEADER_LEN, "big") + body
        t0 = time.monotonic()
        reading = asyncio.create_task(wire.read_message(reader, swarm_pb2.StateChunk, max_bytes=4096, timeout=10))
        try:
            for byte in frame:  # one byte every 0.1 s: the frame would take > 20 s
                if reading.done():
                    break
                writer.write(bytes([byte]))
                with contextlib.suppress(ConnectionError, OSError):
                    await writer.drain()
                await asyncio.sleep(0.1)
            try:
                await reading
                return time.monotonic() - t0, "no refusal"
            except WireError as exc:
                return time.monotonic() - t0, str(exc)
        finally:
            writer.close()

    try:
        elapsed, refusal = net.run(trickle(), timeout=30)
        print(f"\n[wire] trickling client dropped after {elapsed:.2f} s: {refusal!r}")
        assert "no complete message within 1 s" in refusal
        assert 0.9 <= elapsed < 3.0
        assert _wait_until(lambda: server.open_streams() == 0, 5)
    finally:
        net.run(server.stop())


@pytest.mark.parametrize("garbage, reason", [
    (b"\x07" + bytes(8), "unknown frame marker 0x07"),
    (wire.MESSAGE_MARKER + (3).to_bytes(8, "big") + b"\xff\xff\xff", "malformed StateRequest"),
    (wire.ERROR_MARKER + (1 << 40).to_bytes(8, "big"), "error frame of"),
])
def test_garbage_frames_are_refused_with_a_reason(net, garbage, reason):
    seen: list[str] = []
    server = _serve(net, functools.partial(_counting, seen))

    async def send() -> str:
        reader, writer = await net.raw_stream(server.name)
        writer.write(garbage)
        await writer.drain()
        try:
            await wire.read_message(reader, swarm_pb2.StateChunk, max_bytes=4096, timeout=5)
            return "no refusal"
        except PeerRefused as exc:
            return str(exc)
        finally:
            writer.close()

    try:
        assert reason in net.run(send())
        assert len(seen) == 1 and reason in seen[0]
    finally:
        net.run(server.stop())


def test_per_peer_stream_cap_refuses_the_excess_and_admits_after_one_closes(net):
    refused: list[tuple[str, str]] = []
    server = _serve(net, _echo, max_streams_per_peer=2, on_refused=lambda peer, why: refused.append((peer, why)))

    async def held(release: asyncio.Event) -> AsyncIterator[swarm_pb2.StateRequest]:
        yield swarm_pb2.StateRequest(fragment=1)
        await release.wait()

    async def scenario() -> None:
        release = asyncio.Event()
        opened = [open_stream(net.client, net.server_id, server.name, held(release), swarm_pb2.StateChunk,
                              max_reply_bytes=4096, idle_timeout=10) for _ in range(2)]
        try:
            await check(release, opened)
        finally:
            for stream in opened:
                await stream.aclose()

    async def check(release: asyncio.Event, opened: list[wire.ReplyStream]) -> None:
        for stream in opened:
            assert (await anext(stream)).fragment == 1  # both admitted and served
        assert server.open_streams(net.client_id) == 2
        third = open_stream(net.client, net.server_id, server.name, swarm_pb2.StateRequest(fragment=3),
                            swarm_pb2.StateChunk, max_reply_bytes=4096, idle_timeout=10)
        with pytest.raises(PeerRefused, match="too many streams: this peer already has 2 open"):
            await anext(third)
        assert refused == [(net.client_id, "too many streams: this peer already has 2 open")]
        await opened[0].aclose()  # the server sees the end of stream and releases the slot
        deadline = time.monotonic() + 5
        while server.open_streams(net.client_id) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert server.open_streams(net.client_id) == 1
        again = await _collect(open_stream(net.client, net.server_id, server.name,
                                           swarm_pb2.StateRequest(fragment=4), swarm_pb2.StateChunk,
                                           max_reply_bytes=4096, idle_timeout=10))
        assert [r.fragment for r in again] == [4]
        release.set()
        assert [r.fragment async for r in opened[1]] == []  # the held stream ends cleanly
        assert len(refused) == 1

    try:
        net.run(scenario())
        assert _wait_until(lambda: server.open_streams() == 0, 5)
    finally:
        net.run(server.stop())


def test_total_stream_cap_refuses_any_peer(net):
    refused: list[str] = []
    server = _serve(net, _echo, max_streams_per_peer=5, max_streams=1, on_refused=lambda p, why: refused.append(why))

    async def scenario() -> None:
        release = asyncio.Event()

        async def held() -> AsyncIterator[swarm_pb2.StateRequest]:
            yield swarm_pb2.StateRequest(fragment=1)
            await release.wait()

        async with open_stream(net.client, net.server_id, server.name, held(), swarm_pb2.StateChunk,
                               max_reply_bytes=4096, idle_timeout=10) as first:
            assert (await anext(first)).fragment == 1
            with pytest.raises(PeerRefused, match="the server has 1 open"):
                await _collect(open_stream(net.client, net.server_id, server.name, swarm_pb2.StateRequest(),
                                           swarm_pb2.StateChunk, max_reply_bytes=4096, idle_timeout=10))
            release.set()

    try:
        net.run(scenario())
        assert refused == ["too many streams: the server has 1 open"]
    finally:
        net.run(server.stop())


# ---- a hostile server ------------------------------------------------------------------------------


def test_client_refuses_an_oversized_reply_and_a_silent_server(net):
    release = asyncio.Event()

    async def big(remote: str, requests: RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        async for req in requests:
            yield swarm_pb2.StateChunk(fragment=req.fragment, phi=bytes(req.offset))

    async def silent(remote: str, requests: RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        await anext(requests)
        await release.wait()  # never answers while the client waits
        yield swarm_pb2.StateChunk()

    big_server, silent_server = _serve(net, big), _serve(net, silent)

    async def scenario() -> None:
        ok = await _collect(open_stream(net.client, net.server_id, big_server.name,
                                        swarm_pb2.StateRequest(fragment=1, offset=1000), swarm_pb2.StateChunk,
                                        max_reply_bytes=MiB, idle_timeout=5))
        assert len(ok[0].phi) == 1000
        before = rss_bytes()
        with pytest.raises(WireError, match=r"message of \d+ bytes exceeds the limit of 1048576"):
            await _collect(open_stream(net.client, net.server_id, big_server.name,
                                       swarm_pb2.StateRequest(fragment=1, offset=8 * MiB), swarm_pb2.StateChunk,
                                       max_reply_bytes=MiB, idle_timeout=5))
        assert rss_bytes() - before < 64 * MiB
        t0 = time.monotonic()
        with pytest.raises(WireError, match="no complete message within 1 s"):
            await _collect(open_stream(net.client, net.server_id, silent_server.name, swarm_pb2.StateRequest(),
                                       swarm_pb2.StateChunk, max_reply_bytes=MiB, idle_timeout=1.0))
        assert 0.9 <= time.monotonic() - t0 < 3.0
        release.set()

    try:
        net.run(scenario())
    finally:
        net.run(big_server.stop())
        net.run(silent_server.stop())


def test_client_reports_a_dropped_stream_and_a_missing_handler(net):
    async def dies(remote: str, requests: RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        await anext(requests)
        yield swarm_pb2.StateChunk(fragment=1)
        raise RuntimeError("internal detail that must not leak")

    server = _serve(net, dies)

    async def scenario() -> None:
        stream = open_stream(net.client, net.server_id, server.name, swarm_pb2.StateRequest(),
                             swarm_pb2.StateChunk, max_reply_bytes=4096, idle_timeout=5)
        assert (await anext(stream)).fragment == 1
        with pytest.raises(PeerRefused, match=r"^handler failed: RuntimeError$"):
            await anext(stream)
        with pytest.raises(StopAsyncIteration):  # closed after the failure
            await anext(stream)
        with pytest.raises(DialError, match="could not open a stream"):  # told apart from what a peer sent
            await _collect(open_stream(net.client, net.server_id, "locoswarm.test.wire.nobody",
                                       swarm_pb2.StateRequest(), swarm_pb2.StateChunk, max_reply_bytes=4096,
                                       idle_timeout=5))

    try:
        net.run(scenario())
    finally:
        net.run(server.stop())


def test_aclose_from_another_task_while_a_read_waits(net):
    """Closing a stream that another task is reading ends that read with a WireError, nothing else."""
    release = asyncio.Event()

    async def slow(remote: str, requests: RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        await anext(requests)
        await release.wait()
        yield swarm_pb2.StateChunk()

    server = _serve(net, slow)

    async def scenario() -> None:
        stream = open_stream(net.client, net.server_id, server.name, _requests(1), swarm_pb2.StateChunk,
                             max_reply_bytes=4096, idle_timeout=10)
        reading = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.3)
        await stream.aclose()
        with pytest.raises(WireError):
            await asyncio.wait_for(reading, 5)
        release.set()

    try:
        net.run(scenario())
        assert _wait_until(lambda: server.open_streams() == 0, 5)
    finally:
        net.run(server.stop())


def test_many_concurrent_streams(net):
    server = _serve(net, _echo, max_streams_per_peer=64, max_streams=64)

    async def scenario() -> list[list[int]]:
        streams = [open_stream(net.client, net.server_id, server.name, _requests(5), swarm_pb2.StateChunk,
                               max_reply_bytes=4096, idle_timeout=10) for _ in range(20)]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        return [[r.fragment for r in replies] for replies in results]

    try:
        assert net.run(scenario()) == [list(range(5))] * 20
        assert _wait_until(lambda: server.open_streams() == 0, 5)
    finally:
        net.run(server.stop())


class _Writer:
    """A stream writer that accepts everything (the peer never reads it back)."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


class _HandlerRegistry:
    """The part of hivemind's P2P a server registers with: the binary stream handlers, by name."""

    def __init__(self) -> None:
        self.handlers: dict[str, Callable[..., Awaitable[None]]] = {}

    async def add_binary_stream_handler(self, name: str, handler: Callable[..., Awaitable[None]]) -> None:
        self.handlers[name] = handler


def test_a_stream_task_cancelled_at_shutdown_ends_normally() -> None:
    """A node that leaves cancels its stream tasks; hivemind's done-callback reads task.exception(), which
    raised CancelledError and logged a traceback at every shutdown of the swarm bench. The handler now ends
    normally when cancelled (here: while it holds a refused peer's stream in the tarpit)."""

    async def main() -> asyncio.Task:
        async def handler(remote, requests):
            yield swarm_pb2.StateChunk()

        p2p = _HandlerRegistry()
        server = wire.WireServer(p2p, "t", handler, swarm_pb2.StateRequest, max_request_bytes=64, idle_timeout=1.0,
                                 max_streams_per_peer=1, max_streams=1, gatekeeper=lambda remote: "banned here")
        await server.start()  # registers the stream handler hivemind calls for each incoming stream
        info = type("Info", (), {"peer_id": "QmPeer"})()
        task = asyncio.create_task(p2p.handlers["t"](info, asyncio.StreamReader(), _Writer()))
        await asyncio.sleep(0.1)  # inside the tarpit's hold
        task.cancel()
        await asyncio.wait([task], timeout=5)
        return task

    task = asyncio.run(main())
    assert task.done() and not task.cancelled() and task.exception() is None


def test_the_stream_gate_names_the_peers_it_serves_now() -> None:
    """A lone node asks the state server's gate who is downloading: those peers are joining (no solo steps)."""
    gate = wire.StreamGate(max_per_peer=2, max_total=3)
    assert gate.admit("QmA") is None and gate.admit("QmA") is None and gate.admit("QmB") is None
    assert sorted(gate.peers()) == ["QmA", "QmB"] and gate.open_streams() == 3
    assert gate.admit("QmC") is not None, "over the server's cap: refused, not counted"
    gate.release("QmA")
    assert sorted(gate.peers()) == ["QmA", "QmB"]
    gate.release("QmA")
    gate.release("QmB")
    assert gate.peers() == [] and gate.open_streams() == 0
