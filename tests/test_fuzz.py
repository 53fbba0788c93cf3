"""Fuzzed decoders: everything the node parses from a peer, fed random, mutated and truncated bytes.

Each decoder must return a value or refuse with its one documented exception, never anything else and
never hang: ``read_message`` (the stream framing) a message or ``WireError``; each codec's ``decode`` a
tensor or ``ValueError``; ``decode_chunks`` a tensor or ``ValueError``; protobuf ``FromString`` a
message or ``DecodeError``.

A value that parses is not a value to trust: a message can hold absurd numbers (a weight of 1e30, a
clock far in the future), and a payload of the right length decodes to whatever floats its bytes
spell, NaN and inf included. Validating those is the receivers' job (robust aggregation, heartbeat and
state checks); these tests only show that hostile bytes cannot crash or hang the parsers.

hypothesis runs derandomized (the same examples on every run, like a seeded generator), with a
bounded number of examples and a deadline per example, and no example database (no files written).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import string
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from locoswarm.node.core.codecs import CODECS, get_codec
from locoswarm.node.core.payload import chunk_bounds, decode_chunks, encode_chunks
from locoswarm.node.swarm import wire
from locoswarm.node.swarm.wire import WireError, read_message
from locoswarm.protocol import swarm_pb2

pytestmark = pytest.mark.timeout(120)

MESSAGE_TYPES: tuple[type[Message], ...] = (
    swarm_pb2.Heartbeat, swarm_pb2.MatchEntry, swarm_pb2.AverageRequest, swarm_pb2.AverageReply,
    swarm_pb2.StateRequest, swarm_pb2.StateChunk,
)
TYPE_IDS = [t.__name__ for t in MESSAGE_TYPES]
BLOCK_SIZES = (1, 7, 64)


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=timedelta(seconds=2), derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=False)


# ---- random but well-formed messages (the starting point of the mutations) -------------------------

_TEXT = string.printable + "éλ中🙂"


def _value(rnd: random.Random, field: FieldDescriptor, depth: int):
    cpp = field.cpp_type
    if cpp == FieldDescriptor.CPPTYPE_INT32:
        return rnd.randint(-(2**31), 2**31 - 1)
    if cpp == FieldDescriptor.CPPTYPE_UINT32:
        return rnd.choice([0, 1, 2**32 - 1, rnd.randint(0, 2**32 - 1)])
    if cpp == FieldDescriptor.CPPTYPE_INT64:
        return rnd.choice([-1, 0, 2**63 - 1, -(2**63), rnd.randint(-(2**63), 2**63 - 1)])
    if cpp == FieldDescriptor.CPPTYPE_UINT64:
        return rnd.choice([0, 2**64 - 1, rnd.randint(0, 2**64 - 1)])
    if cpp in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        return rnd.choice([0.0, -1.5, 1e30, float("inf"), float("nan"), rnd.uniform(-1e6, 1e6)])
    if cpp == FieldDescriptor.CPPTYPE_BOOL:
        return rnd.random() < 0.5
    if cpp == FieldDescriptor.CPPTYPE_ENUM:  # proto3 enums are open: unknown numbers parse too
        return rnd.choice([v.number for v in field.enum_type.values] + [rnd.randint(-(2**31), 2**31 - 1)])
    if field.type == FieldDescriptor.TYPE_BYTES:
        return rnd.randbytes(rnd.choice([0, 1, 4, 33, 300]))
    if cpp == FieldDescriptor.CPPTYPE_STRING:
        return "".join(rnd.choice(_TEXT) for _ in range(rnd.choice([0, 1, 16, 80])))
    raise AssertionError(f"unhandled field type of {field.full_name}")


def random_message(rnd: random.Random, msg_type: type[Message], depth: int = 0) -> Message:
    msg = msg_type()
    _fill(rnd, msg, msg_type.DESCRIPTOR, depth)
    return msg


def _fill(rnd: random.Random, msg: Message, descriptor: Descriptor, depth: int) -> None:
    for field in descriptor.fields:
        if rnd.random() < 0.4:
            continue
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if depth >= 2:
                continue
            targets = ([getattr(msg, field.name).add() for _ in range(rnd.randint(0, 3))] if field.is_repeated
                       else [getattr(msg, field.name)])
            for target in targets:
                _fill(rnd, target, field.message_type, depth + 1)
                if not field.is_repeated:
                    target.SetInParent()
        elif field.is_repeated:
            getattr(msg, field.name).extend(_value(rnd, field, depth) for _ in range(rnd.randint(0, 4)))
        else:
            setattr(msg, field.name, _value(rnd, field, depth))


def _frame(marker: bytes, body: bytes) -> bytes:
    return marker + len(body).to_bytes(wire.HEADER_LEN, wire.BYTEORDER) + body


def _error_frame(text: str) -> bytes:
    from hivemind.proto.p2pd_pb2 import RPCError

    return _frame(wire.ERROR_MARKER, RPCError(message=text).SerializeToString() if text else b"")


MUTATIONS = ("none", "truncate", "flip", "length", "marker", "garbage", "random_body", "error", "random")


@st.composite
def streams(draw, msg_type: type[Message]) -> bytes:
    """Frames of ``msg_type``, then one mutation (or pure random bytes)."""
    return mutated_stream(draw(st.randoms(use_true_random=False)), msg_type, draw(st.sampled_from(MUTATIONS)))


def mutated_stream(rnd: random.Random, msg_type: type[Message], kind: str) -> bytes:
    """Frames of random ``msg_type`` messages (maybe an END), then the mutation ``kind`` of MUTATIONS."""
    if kind == "random":
        return rnd.randbytes(rnd.choice([0, 1, 8, 9, 10, 64, 1000]))
    data = b"".join(_frame(wire.MESSAGE_MARKER, random_message(rnd, msg_type).SerializeToString())
                    for _ in range(rnd.randint(0, 3)))
    if rnd.random() < 0.7:
        data += _error_frame("")  # END
    if kind == "truncate" and data:
        data = data[:rnd.randrange(len(data))]
    elif kind == "flip" and data:
        i = rnd.randrange(len(data))
        data = data[:i] + bytes([data[i] ^ (1 << rnd.randrange(8))]) + data[i + 1:]
    elif kind == "length" and data:  # rewrite the first frame's announced length
        length = rnd.choice([0, 1, 2**16, 2**31, 2**63, 2**64 - 1, rnd.randrange(2**64)])
        data = data[:1] + length.to_bytes(wire.HEADER_LEN, wire.BYTEORDER) + data[1 + wire.HEADER_LEN:]
    elif kind == "marker" and data:
        data = bytes([rnd.randrange(256)]) + data[1:]
    elif kind == "garbage":
        data += rnd.randbytes(rnd.randint(1, 100))
    elif kind == "random_body":  # a well-framed body of random bytes: the parser sees raw garbage
        data = _frame(wire.MESSAGE_MARKER, rnd.randbytes(rnd.randint(0, 200))) + data
    elif kind == "error":
        text = rnd.choice(["", "refused", "x" * 5000, "\x00\n\x1b[31mred"])
        data = data + _error_frame(text) if rnd.random() < 0.5 else _error_frame(text)
    return data


# ---- (1) the stream framing ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


async def _read_all(data: bytes, splits: list[int], msg_type: type[Message], max_bytes: int) -> list:
    """Feed ``data`` in pieces (the reader waits between them), read frames until END or a refusal."""
    reader = asyncio.StreamReader()

    async def feed() -> None:
        last = 0
        for cut in sorted({min(s, len(data)) for s in splits}):
            reader.feed_data(data[last:cut])
            last = cut
            await asyncio.sleep(0)
        reader.feed_data(data[last:])
        reader.feed_eof()

    feeding = asyncio.ensure_future(feed())
    outcomes: list = []
    try:
        for _ in range(len(data) // (1 + wire.HEADER_LEN) + 2):  # each frame takes >= 9 bytes
            try:
                msg = await read_message(reader, msg_type, max_bytes=max_bytes, timeout=2.0)
            except WireError as exc:
                outcomes.append(exc)
                break
            outcomes.append(msg)
            if msg is None:
                break
            assert type(msg) is msg_type
        else:
            raise AssertionError("read_message neither ended nor refused")
    finally:
        await feeding
    return outcomes


@pytest.mark.parametrize("msg_type", MESSAGE_TYPES, ids=TYPE_IDS)
def test_read_message_returns_a_message_or_refuses(loop, msg_type):
    stats = {"messages": 0, "ends": 0, "refusals": 0}

    @fuzz_settings(250)
    @given(data=streams(msg_type), splits=st.lists(st.integers(0, 400), max_size=4),
           max_bytes=st.sampled_from([0, 16, 4096, 1 << 20]))
    def check(data: bytes, splits: list[int], max_bytes: int) -> None:
        outcomes = loop.run_until_complete(_read_all(data, splits, msg_type, max_bytes))
        for outcome in outcomes:
            if isinstance(outcome, WireError):
                stats["refusals"] += 1
                text = str(outcome)
                assert text and "\n" not in text and len(text) <= 300, text
            elif outcome is None:
                stats["ends"] += 1
            else:
                stats["messages"] += 1

    check()
    print(f"\n[fuzz] read_message({msg_type.__name__}): {stats}")
    assert stats["messages"] and stats["ends"] and stats["refusals"]  # every outcome was exercised


def test_read_message_refuses_each_violation_by_name(loop):
    """The refusals the fuzzer hits, one by one, with their reasons."""
    body = swarm_pb2.StateRequest(fingerprint="f" * 40).SerializeToString()
    # (bytes, max_bytes, the reason, the class: a framing violation is the peer's fault, a cut stream may not be)
    cases = [
        (b"", 64, "closed without an end marker", WireError),
        (b"\x02" + bytes(8), 64, "unknown frame marker 0x02", wire.FramingViolation),
        (_frame(wire.MESSAGE_MARKER, body)[:5], 64, "truncated frame: stream closed in the length", WireError),
        (_frame(wire.MESSAGE_MARKER, body)[:-1], 64, "truncated frame: stream closed in the body", WireError),
        (_frame(wire.MESSAGE_MARKER, body), 16, f"message of {len(body)} bytes exceeds the limit of 16",
         wire.FramingViolation),
        (_frame(wire.MESSAGE_MARKER, b"\x0a\xff"), 64, "malformed StateRequest (2 bytes)", wire.FramingViolation),
        (_frame(wire.ERROR_MARKER, b"\xff" * 5000), 64, "error frame of 5000 bytes exceeds the limit of 4096",
         wire.FramingViolation),
        (_error_frame("nope\nsecond line"), 64, "nope second line", wire.PeerRefused),
    ]
    for data, max_bytes, reason, cls in cases:
        outcomes = loop.run_until_complete(_read_all(data, [], swarm_pb2.StateRequest, max_bytes))
        assert type(outcomes[-1]) is cls and reason in str(outcomes[-1]), (data[:20], outcomes)
    assert loop.run_until_complete(_read_all(_error_frame(""), [], swarm_pb2.StateRequest, 16)) == [None]


# ---- (2) codec payloads -----------------------------------------------------------------------------


@st.composite
def payloads(draw) -> tuple[str, int, int, bytes]:
    """(codec, block_size, numel, data): random bytes of random or exact length, truncated valid payloads."""
    rnd = draw(st.randoms(use_true_random=False))
    name, block = draw(st.sampled_from(CODECS)), draw(st.sampled_from(BLOCK_SIZES))
    codec = get_codec(name, block)
    numel = rnd.choice([0, 1, 2, 3, block, block + 1, rnd.randint(0, 3000)])
    kind = draw(st.sampled_from(["exact", "random", "truncated", "extended", "valid"]))
    if kind == "random":
        return name, block, numel, rnd.randbytes(rnd.randint(0, 2 * codec.encoded_size(numel) + 8))
    if kind == "exact":
        return name, block, numel, rnd.randbytes(codec.encoded_size(numel))
    valid = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(rnd.randrange(2**31))))
    if kind == "truncated" and valid:
        valid = valid[:rnd.randrange(len(valid))]
    elif kind == "extended":
        valid += rnd.randbytes(rnd.randint(1, 9))
    return name, block, numel, valid


@fuzz_settings(1500)
@given(case=payloads())
def test_codec_decode_returns_a_tensor_or_value_error(case):
    name, block, numel, data = case
    codec = get_codec(name, block)
    try:
        out = codec.decode(data, numel)
    except ValueError as exc:
        assert len(data) != codec.encoded_size(numel), f"refused a payload of the right length: {exc}"
        return
    assert len(data) == codec.encoded_size(numel)
    assert out.dtype == torch.float32 and out.shape == (numel,) and out.device.type == "cpu"
    acc = torch.zeros(numel)
    codec.decode_accumulate(data, numel, acc, weight=0.5)  # the receiver's path agrees with decode
    assert torch.equal(acc, (0.5 * out) + torch.zeros(numel)) or not torch.isfinite(out).all()


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [-1, 2**62, 1.5, True, None, "3"])
def test_codec_decode_refuses_impossible_numel(name, numel):
    with pytest.raises(ValueError):
        get_codec(name, 64).decode(b"\x00" * 16, numel)


@pytest.mark.parametrize("name", CODECS)
def test_codec_decode_accepts_every_bytes_like(name):
    codec = get_codec(name, 64)
    data = codec.encode(torch.linspace(-1, 1, 100))
    ref = codec.decode(data, 100)
    for view in (bytearray(data), memoryview(data)):
        assert torch.equal(codec.decode(view, 100), ref)


# ---- (3) chunked payloads ---------------------------------------------------------------------------


@st.composite
def chunk_lists(draw) -> tuple[str, int, int, list[bytes]]:
    rnd = draw(st.randoms(use_true_random=False))
    name, block = draw(st.sampled_from(CODECS)), draw(st.sampled_from((7, 64)))
    codec = get_codec(name, block)
    numel = rnd.choice([0, 1, 16384, 16385, rnd.randint(0, 40000)])
    chunks = encode_chunks(codec, torch.randn(numel, generator=torch.Generator().manual_seed(rnd.randrange(2**31))))
    kind = draw(st.sampled_from(["valid", "drop", "extra", "empty", "truncate", "extend", "swap_numel"]))
    if kind == "drop":
        chunks.pop(rnd.randrange(len(chunks)))
    elif kind == "extra":
        chunks.insert(rnd.randrange(len(chunks) + 1), rnd.randbytes(rnd.randint(0, 100)))
    elif kind == "empty":
        chunks = []
    elif kind in ("truncate", "extend"):
        i = rnd.randrange(len(chunks))
        chunks[i] = chunks[i][:-1] if kind == "truncate" and chunks[i] else chunks[i] + b"\x00"
    elif kind == "swap_numel":
        numel = rnd.choice([-1, numel + 1, max(0, numel - 1), 2**50])
    return name, block, numel, chunks


@fuzz_settings(400)
@given(case=chunk_lists())
def test_decode_chunks_returns_a_tensor_or_value_error(case):
    name, block, numel, chunks = case
    codec = get_codec(name, block)
    try:
        out = decode_chunks(codec, chunks, numel)
    except ValueError:
        return
    bounds = chunk_bounds(numel, block)
    assert len(chunks) == len(bounds)
    assert all(len(c) == codec.encoded_size(b - a) for c, (a, b) in zip(chunks, bounds, strict=True))
    assert out.dtype == torch.float32 and out.shape == (numel,)


@pytest.mark.parametrize("numel", [-1, -(2**40), 2**50, 2**62])
def test_decode_chunks_refuses_absurd_sizes_at_once(numel):
    """A huge claimed size is refused by arithmetic, before a list of bounds or a tensor is built."""
    with pytest.raises(ValueError):
        decode_chunks(get_codec("fp4", 64), [b"\x00" * 36] * 3, numel)


# ---- (4) protobuf parsing ---------------------------------------------------------------------------


@st.composite
def protobuf_bytes(draw, msg_type: type[Message]) -> bytes:
    rnd = draw(st.randoms(use_true_random=False))
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "spliced"]))
    if kind == "random":
        return rnd.randbytes(rnd.choice([1, 2, 5, 20, 300]))
    data = random_message(rnd, msg_type).SerializeToString() + random_message(rnd, msg_type).SerializeToString()
    if not data:
        return rnd.randbytes(3)
    i = rnd.randrange(len(data))
    if kind == "truncated":
        return data[:i]
    if kind == "flipped":
        return data[:i] + bytes([data[i] ^ (1 << rnd.randrange(8))]) + data[i + 1:]
    return data[:i] + rnd.randbytes(rnd.randint(1, 20)) + data[i:]


@pytest.mark.parametrize("msg_type", MESSAGE_TYPES, ids=TYPE_IDS)
def test_protobuf_from_string_returns_a_message_or_decode_error(msg_type):
    outcomes = {"parsed": 0, "refused": 0}

    @fuzz_settings(300)
    @given(data=protobuf_bytes(msg_type))
    def check(data: bytes) -> None:
        try:
            msg = msg_type.FromString(data)
        except DecodeError:
            outcomes["refused"] += 1
            return
        assert type(msg) is msg_type
        msg.SerializeToString()  # a parsed message (unknown fields and all) can be used
        outcomes["parsed"] += 1

    check()
    print(f"\n[fuzz] {msg_type.__name__}.FromString: {outcomes}")
    assert outcomes["parsed"] and outcomes["refused"]


@pytest.mark.parametrize("msg_type", MESSAGE_TYPES, ids=TYPE_IDS)
def test_protobuf_deep_nesting_is_a_decode_error(msg_type):
    """Thousands of nested unknown groups hit the parser's depth limit, not Python's recursion limit."""
    groups = b"\x0b" * 20000 + b"\x0c" * 20000  # field 1, start-group / end-group
    with pytest.raises(DecodeError):
        msg_type.FromString(groups)


# ---- (5) live handlers on real libp2p streams ----------------------------------------------------------
#
# The node's state server (and a bounded echo handler) on one p2pd, hostile bytes from another: every
# stream ends with a refusal, an answer or a close, and the server still serves a valid download after.
# The state client is fed hostile replies the same way: it fails the download (None), nothing else.

LIVE_EXAMPLES = 120
LIVE_BATCH = 8  # streams in flight at once (under the servers' per-peer caps)
REFUSAL_KINDS = {"state_request", "state_fingerprint", "state_streams"}


@pytest.fixture(scope="module")
def live():
    from test_wire import p2p_nodes

    with p2p_nodes(2) as (loop, (server, client)):
        yield loop, server, client


def _live_cases(seed: int, n: int) -> list[bytes]:
    """Mutated streams of the state request (mostly) and of every other message type."""
    rnd = random.Random(seed)
    cases = []
    for _ in range(n):
        msg_type = swarm_pb2.StateRequest if rnd.random() < 0.6 else rnd.choice(MESSAGE_TYPES)
        cases.append(mutated_stream(rnd, msg_type, rnd.choice(MUTATIONS)))
    return cases


async def _send_raw(client, server_id: str, name: str, data: bytes, wait: float = 1.5) -> str:
    """Write ``data`` on a fresh stream and read what comes back: "end", "replies", the refusal, or
    "waiting" when the server still waits for the rest of a frame after ``wait`` seconds (a half-close
    ends a p2pd stream, so the client closes instead and the server sees a truncated frame)."""
    from hivemind.p2p import PeerID

    _, reader, writer = await client.call_binary_stream_handler(PeerID.from_base58(server_id), name)
    try:
        writer.write(data)
        with contextlib.suppress(Exception):
            await writer.drain()
        replies = 0
        while True:
            try:
                msg = await read_message(reader, swarm_pb2.StateChunk, max_bytes=1 << 20, timeout=wait)
            except wire.PeerRefused as exc:
                return f"refused: {exc}"
            except WireError as exc:
                return "waiting" if "no complete message" in str(exc) else f"dropped: {exc}"
            if msg is None:
                return "replies" if replies else "end"
            replies += 1
    finally:
        writer.close()


def test_live_state_server_survives_fuzzed_streams(live):
    from test_state_sync import FP, Book, ByteCounters, Runtime, _numel, _same, _snaps

    from locoswarm.node.swarm.state_sync import STATE_HANDLER, StateClient, StateServer

    loop, server_p2p, client_p2p = live
    book, snaps = Book(), _snaps(seed=7)
    server = StateServer(Runtime(loop, server_p2p), FP, snaps.get, ByteCounters(), is_live=lambda p: True,
                         is_banned=lambda p: False, on_refused=book.refuse, max_streams_per_peer=2 * LIVE_BATCH)
    server_id = str(server_p2p.peer_id)
    outcomes: collections.Counter[str] = collections.Counter()

    async def batch(cases: list[bytes]) -> list[str]:
        return await asyncio.gather(*(_send_raw(client_p2p, server_id, STATE_HANDLER, c) for c in cases))

    try:
        cases = _live_cases(seed=11, n=LIVE_EXAMPLES)
        t0 = time.monotonic()
        for i in range(0, len(cases), LIVE_BATCH):
            for outcome in loop.run(batch(cases[i:i + LIVE_BATCH]), timeout=60):
                outcomes[outcome.split(":", 1)[0]] += 1
        print(f"\n[fuzz] {LIVE_EXAMPLES} hostile streams at the state server in {time.monotonic() - t0:.1f} s: "
              f"{dict(outcomes)}; reported {collections.Counter(k for _, k, _ in book.refused)}")
        assert outcomes["refused"] and outcomes["end"] + outcomes["replies"]
        assert {kind for _, kind, _ in book.refused} <= REFUSAL_KINDS
        deadline = time.monotonic() + 10
        while server.open_streams() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.open_streams() == 0
        client = StateClient(Runtime(loop, client_p2p), FP, ByteCounters(), timeout=20, expected_numel=_numel)
        got = client.fetch(1, [server_id], min_version=6)
        assert got is not None and _same(got, snaps[1])  # still serving
    finally:
        server.close()


def test_live_state_client_survives_fuzzed_replies(live):
    """A hostile holder writes mutated StateChunk streams: each download fails cleanly (None), counted
    against the holder when it broke the rules, and the client downloads from an honest holder after."""
    from test_state_sync import FP, Book, ByteCounters, Runtime, _numel, _same, _snaps

    from locoswarm.node.swarm import state_sync
    from locoswarm.node.swarm.state_sync import STATE_HANDLER, HolderBackoff, StateClient, StateServer

    loop, server_p2p, client_p2p = live
    server_id = str(server_p2p.peer_id)
    cases = _live_cases(seed=12, n=LIVE_EXAMPLES // 2)
    replies = iter(cases)

    async def hostile(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(next(replies, b""))
            await writer.drain()
        except Exception:  # the client may have left already
            pass
        finally:
            writer.close()

    book = Book()
    clock = [0.0]  # the client's backoff clock: a holder that refused is asked again once its wait is over
    client = StateClient(Runtime(loop, client_p2p), FP, ByteCounters(), timeout=3, expected_numel=_numel,
                         on_bad=book.on_bad, backoff=HolderBackoff(now=lambda: clock[0]))
    loop.run(server_p2p.add_binary_stream_handler(STATE_HANDLER, hostile))
    try:
        t0 = time.monotonic()
        results = []
        for _ in cases:  # every case reaches the client: a refusal's wait is over before the next one
            clock[0] += state_sync.BACKOFF_MAX_S
            results.append(client.fetch(0, [server_id]))
        print(f"\n[fuzz] {len(cases)} hostile reply streams at the state client in {time.monotonic() - t0:.1f} s: "
              f"all refused; {len(book.bad)} counted against the holder "
              f"{dict(collections.Counter(k for _, k, _ in book.bad))}")
        assert results == [None] * len(cases)
        assert book.bad and {peer for peer, _, _ in book.bad} == {server_id}
        assert {kind for _, kind, _ in book.bad} <= {"bad_state", "bad_stream"}
    finally:
        loop.run(server_p2p.remove_binary_stream_handler(STATE_HANDLER))
    snaps = _snaps(seed=8)
    honest = StateServer(Runtime(loop, server_p2p), FP, snaps.get, ByteCounters(), is_live=lambda p: True,
                         is_banned=lambda p: False)
    clock[0] += state_sync.BACKOFF_MAX_S
    try:
        got = client.fetch(2, [server_id])
        assert got is not None and _same(got, snaps[2])
    finally:
        honest.close()


def test_live_wire_server_survives_fuzzed_streams(live):
    """The bounded framing under every message type: a stateless echo handler keeps answering."""
    loop, server_p2p, client_p2p = live
    server_id = str(server_p2p.peer_id)
    seen: list[str] = []

    async def echo(remote: str, requests: wire.RequestStream) -> AsyncIterator[swarm_pb2.StateChunk]:
        async for req in requests:
            yield swarm_pb2.StateChunk(fragment=req.fragment)

    server = loop.run(wire.serve(server_p2p, "locoswarm.test.fuzz.echo", echo, swarm_pb2.StateRequest,
                                 max_request_bytes=4096, idle_timeout=5, max_streams_per_peer=2 * LIVE_BATCH,
                                 max_streams=64, on_refused=lambda peer, why: seen.append(why)))
    outcomes: collections.Counter[str] = collections.Counter()

    async def batch(cases: list[bytes]) -> list[str]:
        return await asyncio.gather(*(_send_raw(client_p2p, server_id, server.name, c) for c in cases))

    try:
        cases = _live_cases(seed=13, n=LIVE_EXAMPLES)
        for i in range(0, len(cases), LIVE_BATCH):
            for outcome in loop.run(batch(cases[i:i + LIVE_BATCH]), timeout=60):
                outcomes[outcome.split(":", 1)[0]] += 1
        print(f"\n[fuzz] {LIVE_EXAMPLES} hostile streams at a wire server: {dict(outcomes)}")
        assert outcomes["refused"] and outcomes["replies"]
        assert not seen  # no stream-cap refusals: every stream was read and answered or refused
        ok = loop.run(_send_raw(client_p2p, server_id, server.name,
                                _frame(wire.MESSAGE_MARKER, swarm_pb2.StateRequest(fragment=5).SerializeToString())
                                + _error_frame("")))
        assert ok == "replies"
    finally:
        loop.run(server.stop())
