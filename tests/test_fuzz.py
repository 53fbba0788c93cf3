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
import random
import string
from datetime import timedelta

import pytest
import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.core.codecs import CODECS, get_codec
from node.core.payload import chunk_bounds, decode_chunks, encode_chunks
from node.swarm import wire
from node.swarm.wire import WireError, read_message
from protocol import swarm_pb2

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
    rnd = draw(st.randoms(use_true_random=False))
    kind = draw(st.sampled_from(MUTATIONS))
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
    cases = [
        (b"", "closed without an end marker"),
        (b"\x02" + bytes(8), "unknown frame marker 0x02"),
        (_frame(wire.MESSAGE_MARKER, body)[:5], "truncated frame: stream closed in the length"),
        (_frame(wire.MESSAGE_MARKER, body)[:-1], "truncated frame: stream closed in the body"),
        (_frame(wire.MESSAGE_MARKER, body), f"message of {len(body)} bytes exceeds the limit of 16"),
        (_frame(wire.MESSAGE_MARKER, b"\x0a\xff"), "malformed StateRequest (2 bytes)"),
        (_frame(wire.ERROR_MARKER, b"\xff" * 5000), "error frame of 5000 bytes exceeds the limit of 4096"),
        (_error_frame("nope\nsecond line"), "nope second line"),
    ]
    for data, reason in cases:
        outcomes = loop.run_until_complete(_read_all(data, [], swarm_pb2.StateRequest, 16))
        assert isinstance(outcomes[-1], WireError) and reason in str(outcomes[-1]), (data[:20], outcomes)
    assert isinstance(outcomes[-1], wire.PeerRefused)
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
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)
