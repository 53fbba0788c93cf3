"""Bounded message framing for the node's libp2p streams.

The frame format is hivemind's (``P2P.send_protobuf``): a 1-byte marker (``0x00`` a message, ``0x01``
an error), an 8-byte big-endian length, then the serialized protobuf. An error frame carries
hivemind's ``RPCError``; an *empty* one is hivemind's ``END_OF_STREAM``, the sender's clean end.

hivemind's own reader trusts the announced length: it reads that many bytes into memory before
anything can check them, so one peer can make a node allocate gigabytes. Here every read is bounded
before the body is touched: an announced length above ``max_bytes`` is refused, and a frame (the wait
for it included) must complete within ``timeout`` so a trickling peer cannot hold a stream open. Both
ends of a stream (``serve`` and ``open_stream``) read one message at a time, on demand: no prefetch
queue, so a stream never holds more than one message in memory.

Unlike hivemind's server, ``serve`` ends every stream it completes with an END frame, so a client can
tell a finished stream from a dropped connection (a bare end of stream is reported as an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from google.protobuf.message import Message

if TYPE_CHECKING:  # pragma: no cover
    from hivemind.p2p import P2P

log = logging.getLogger("locoswarm.wire")

__all__ = [
    "DialError",
    "FramingViolation",
    "PeerRefused",
    "ReplyStream",
    "WireError",
    "WireServer",
    "open_stream",
    "read_message",
    "serve",
    "write_end",
    "write_error",
    "write_message",
]

HEADER_LEN = 8
BYTEORDER = "big"
MESSAGE_MARKER = b"\x00"
ERROR_MARKER = b"\x01"
# An error frame holds one short line of text; a bigger one is itself a violation.
MAX_ERROR_FRAME = 4096
MAX_ERROR_TEXT = 200
# Writing a refusal to a peer we are dropping must never block us for long.
REFUSAL_WRITE_TIMEOUT = 5.0
# After a refusal or the END of a stream, what the peer still sends is read and dropped until it closes
# (bounded): the server closes last, because a stream that p2pd resets on our close (unread data, or its
# pipe still reading) can lose the last frames on their way out.
LINGER_TIMEOUT = 2.0
# A stream of a peer the gatekeeper refuses (banned) is held this long, unread, before its refusal is
# written and it is closed: closed at once, a flooder opens the next one at once (measured: ~680 streams/s
# from two flooders, which halved two honest nodes' rounds on a 2-core machine); held, each of its
# streams costs it TARPIT_S. At most TARPIT_MAX streams are held at once; past that they close at once.
TARPIT_S = 3.0
TARPIT_MAX = 32
LINGER_MAX_BYTES = 1 << 20

M = TypeVar("M", bound=Message)
Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)

# The stream I/O errors a peer can cause (a closed or reset connection).
_CONNECTION_ERRORS = (ConnectionError, OSError, asyncio.IncompleteReadError, EOFError)


class WireError(Exception):
    """A stream violated the framing rules or its bounds; ``str()`` is a one-line, peer-facing reason."""


class FramingViolation(WireError):
    """The peer broke the framing rules (unknown marker, oversize or malformed frame): a fault or an
    attack, unlike a timeout or a dropped connection, which the network alone can cause."""


class DialError(WireError):
    """No stream to the peer could be opened: no connection (the network between the two), no such handler on
    its side, or none within the timeout; nothing the peer sent is at fault."""


class PeerRefused(WireError):
    """The peer sent an error frame: it refused or failed; ``str()`` is its (truncated) text."""


def _one_line(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """Printable, single-line, bounded text (it may come from a peer and goes into logs)."""
    clean = "".join(c if c.isprintable() else " " for c in text).strip()
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def _rpc_error_type() -> type[Message]:
    # hivemind is imported lazily (1-2 s); the RPCError type is what its peers put in error frames.
    from hivemind.proto.p2pd_pb2 import RPCError

    return RPCError


# ---- reading --------------------------------------------------------------------------------------


async def read_message(reader: asyncio.StreamReader, msg_type: type[M], *, max_bytes: int,
                       timeout: float | None) -> M | None:
    """Read one frame: the parsed message, or None at the peer's END frame.

    Raises :class:`FramingViolation` (a :class:`WireError`) on an unknown marker, an announced length
    above ``max_bytes`` (refused before reading the body) or a message that does not parse; a plain
    :class:`WireError` on a truncated frame or a bare end of stream, or no complete frame within
    ``timeout`` seconds (the wait for it included; None: no limit). An error frame raises
    :class:`PeerRefused` with the peer's text.
    """
    try:
        async with asyncio.timeout(timeout):
            return await _read_frame(reader, msg_type, max_bytes)
    except TimeoutError:
        raise WireError(f"no complete message within {timeout:g} s") from None


async def _read_frame(reader: asyncio.StreamReader, msg_type: type[M], max_bytes: int) -> M | None:
    marker = await _read_exactly(reader, 1, "marker")
    if marker not in (MESSAGE_MARKER, ERROR_MARKER):
        raise FramingViolation(f"unknown frame marker 0x{marker[0]:02x}")
    length = int.from_bytes(await _read_exactly(reader, HEADER_LEN, "length"), BYTEORDER)
    if marker == ERROR_MARKER:
        return await _read_error_frame(reader, length)
    if length > max_bytes:
        raise FramingViolation(f"message of {length} bytes exceeds the limit of {max_bytes}")
    body = await _read_exactly(reader, length, "body")
    return _parse(msg_type, body)


async def _read_exactly(reader: asyncio.StreamReader, n: int, part: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        if part == "marker" and not exc.partial:
            raise WireError("stream closed without an end marker") from None
        raise WireError(f"truncated frame: stream closed in the {part} ({len(exc.partial)} of {n} bytes)") from None
    except _CONNECTION_ERRORS as exc:
        raise WireError(f"stream broken: {type(exc).__name__}") from None


async def _read_error_frame(reader: asyncio.StreamReader, length: int) -> None:
    if length > MAX_ERROR_FRAME:
        raise FramingViolation(f"error frame of {length} bytes exceeds the limit of {MAX_ERROR_FRAME}")
    error = _parse(_rpc_error_type(), await _read_exactly(reader, length, "body"))
    text = error.message  # type: ignore[attr-defined]
    if isinstance(text, bytes):  # RPCError is proto2: a string field with invalid UTF-8 parses as bytes
        text = text.decode("utf-8", "replace")
    if not text:
        return None  # hivemind's END_OF_STREAM: the sender's clean end
    raise PeerRefused(_one_line(text) or "peer error")


def _parse(msg_type: type[M], body: bytes) -> M:
    try:
        return msg_type.FromString(body)
    except Exception as exc:  # DecodeError, or anything else the parser may raise on hostile bytes
        reason = _one_line(str(exc), 80)
        raise FramingViolation(f"malformed {msg_type.__name__} ({len(body)} bytes): {reason}") from None


# ---- writing --------------------------------------------------------------------------------------


async def _write_frame(writer: asyncio.StreamWriter, marker: bytes, data: bytes) -> None:
    writer.write(marker + len(data).to_bytes(HEADER_LEN, BYTEORDER))
    writer.write(data)
    await writer.drain()


async def write_message(writer: asyncio.StreamWriter, msg: Message) -> None:
    """Write one message frame and wait until the transport has taken it (flow control)."""
    await _write_frame(writer, MESSAGE_MARKER, msg.SerializeToString())


async def write_end(writer: asyncio.StreamWriter) -> None:
    """Write the END frame (hivemind's ``END_OF_STREAM``): no more messages follow."""
    await _write_frame(writer, ERROR_MARKER, b"")


async def write_error(writer: asyncio.StreamWriter, text: str) -> None:
    """Write an error frame: a refusal the peer reads as :class:`PeerRefused` (one line, bounded)."""
    error = _rpc_error_type()(message=_one_line(text) or "error")
    await _write_frame(writer, ERROR_MARKER, error.SerializeToString())


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a stream, never raising and never waiting long (the peer may be gone)."""
    with contextlib.suppress(Exception):
        writer.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REFUSAL_WRITE_TIMEOUT):
            await writer.wait_closed()


async def _try_write_error(writer: asyncio.StreamWriter, text: str) -> None:
    """Best effort: tell the peer why, unless its side is already gone or blocked."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(REFUSAL_WRITE_TIMEOUT):
            await write_error(writer, text)


async def _linger(reader: asyncio.StreamReader) -> None:
    """Drop what the peer still sends until it closes, at most ``LINGER_MAX_BYTES`` / ``LINGER_TIMEOUT``."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(LINGER_TIMEOUT):
            left = LINGER_MAX_BYTES
            while left > 0:
                data = await reader.read(min(left, 1 << 16))
                if not data:
                    return
                left -= len(data)


# ---- the server side ------------------------------------------------------------------------------


class RequestStream(Generic[Req]):
    """The incoming messages of one stream, read one at a time on demand, each bounded.

    Iterating ends at the peer's END frame; a violation raises :class:`WireError` (and every later
    read raises it again), so the handler decides what to refuse or count.
    """

    def __init__(self, reader: asyncio.StreamReader, msg_type: type[Req], max_bytes: int,
                 timeout: float | None) -> None:
        self._reader = reader
        self._msg_type = msg_type
        self._max_bytes = max_bytes
        self._timeout = timeout
        self._ended = False
        self._failure: WireError | None = None

    def __aiter__(self) -> RequestStream[Req]:
        return self

    async def __anext__(self) -> Req:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))
        if self._ended:
            raise StopAsyncIteration
        try:
            msg = await read_message(self._reader, self._msg_type, max_bytes=self._max_bytes,
                                     timeout=self._timeout)
        except WireError as exc:
            self._failure = exc
            raise
        if msg is None:
            self._ended = True
            raise StopAsyncIteration
        return msg


Handler = Callable[[str, RequestStream[Any]], AsyncIterator[Message]]
RefusedCallback = Callable[[str, str], None]
Gatekeeper = Callable[[str], str | None]


class StreamGate:
    """Counts the open streams of one handler, per peer and in total, and admits within the caps."""

    def __init__(self, max_per_peer: int, max_total: int) -> None:
        self._max_per_peer = max_per_peer
        self._max_total = max_total
        self._open: dict[str, int] = {}

    def admit(self, peer: str) -> str | None:
        """Count a new stream of ``peer`` and return None, or return why it is refused."""
        if self._open.get(peer, 0) >= self._max_per_peer:
            return f"too many streams: this peer already has {self._max_per_peer} open"
        if self.open_streams() >= self._max_total:
            return f"too many streams: the server has {self._max_total} open"
        self._open[peer] = self._open.get(peer, 0) + 1
        return None

    def release(self, peer: str) -> None:
        left = self._open.get(peer, 0) - 1
        if left > 0:
            self._open[peer] = left
        else:
            self._open.pop(peer, None)

    def open_streams(self, peer: str | None = None) -> int:
        return sum(self._open.values()) if peer is None else self._open.get(peer, 0)

    def peers(self) -> list[str]:
        """The peers with a stream open now."""
        return list(self._open)


class WireServer:
    """One registered stream handler with bounded requests and capped concurrent streams.

    For each incoming stream it calls ``handler(remote, requests)`` (``remote``: the authenticated
    libp2p peer id) and writes each reply it yields, then an END frame, and holds the stream until the
    peer closes it (at most ``LINGER_TIMEOUT``). A :class:`WireError` that
    escapes the handler is sent to the peer as an error frame; any other failure is logged at debug
    and answered with a generic error. The stream is closed in every case and no exception reaches
    hivemind's tasks.

    ``gatekeeper(remote)``, when given, is asked first: a reason it returns (e.g. the peer is banned) is
    written as the error frame and the stream is closed, without reading anything the peer sends (a banned
    flooder's megabytes per stream would otherwise still be read and dropped), after holding it for
    ``TARPIT_S`` (at most ``TARPIT_MAX`` at once) so that a flooder cannot cycle streams as fast as it likes.
    """

    def __init__(self, p2p: P2P, name: str, handler: Handler, request_type: type[Message], *,
                 max_request_bytes: int, idle_timeout: float | None, max_streams_per_peer: int,
                 max_streams: int, on_refused: RefusedCallback | None = None,
                 gatekeeper: Gatekeeper | None = None) -> None:
        self._p2p = p2p
        self.name = name
        self._handler = handler
        self._request_type = request_type
        self._max_request_bytes = max_request_bytes
        self._idle_timeout = idle_timeout
        self._gate = StreamGate(max_streams_per_peer, max_streams)
        self._on_refused = on_refused
        self._gatekeeper = gatekeeper
        # Refused streams linger briefly (see LINGER_TIMEOUT); past this many at once they close at once.
        self._max_lingering = max_streams
        self._lingering = 0
        self._tarpitted = 0
        self.served = 0  # streams admitted since the start (an outbound-only node's stay 0: nobody can dial it)

    async def start(self) -> None:
        await self._p2p.add_binary_stream_handler(self.name, self._on_stream)

    async def stop(self) -> None:
        """Unregister the handler (streams already open run to their end)."""
        await self._p2p.remove_binary_stream_handler(self.name)

    def open_streams(self, peer: str | None = None) -> int:
        """Streams being served now, of ``peer`` or of everyone."""
        return self._gate.open_streams(peer)

    def streaming_peers(self) -> list[str]:
        """The peers this handler serves a stream now."""
        return self._gate.peers()

    async def _on_stream(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = "?"
        try:
            remote = str(stream_info.peer_id)
            if self._gatekeeper is not None and (refusal := self._gatekeeper(remote)) is not None:
                await self._tarpit()
                await _try_write_error(writer, refusal)
                return
            refusal = self._gate.admit(remote)
            if refusal is not None:
                await self._refuse(remote, refusal, reader, writer)
                return
            self.served += 1
            try:
                await self._serve(remote, reader, writer)
            finally:
                self._gate.release(remote)
        except Exception as exc:  # last line of defence: nothing escapes into hivemind's server task
            log.debug("%s: stream from %s failed: %r", self.name, remote[:16], exc)
        except asyncio.CancelledError:
            # The node is leaving and its loop cancels the stream tasks. hivemind's done-callback calls
            # task.exception(), which raises on a cancelled task and logs "Exception in callback" with a
            # traceback at every shutdown; nothing awaits this task, so ending it normally loses nothing.
            log.debug("%s: stream from %s cancelled", self.name, remote[:16])
        finally:
            await _close_writer(writer)

    async def _tarpit(self) -> None:
        """Hold a refused peer's stream (nothing read: flow control stalls its writes) for ``TARPIT_S``."""
        if self._tarpitted >= TARPIT_MAX:
            return
        self._tarpitted += 1
        try:
            await asyncio.sleep(TARPIT_S)
        finally:
            self._tarpitted -= 1

    async def _refuse(self, remote: str, reason: str, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        log.debug("%s: refused a stream from %s: %s", self.name, remote[:16], reason)
        if self._on_refused is not None:
            try:
                self._on_refused(remote, reason)
            except Exception as exc:
                log.debug("%s: on_refused failed: %r", self.name, exc)
        await self._send_refusal(reason, reader, writer)

    async def _send_refusal(self, text: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Write an error frame, then linger so that it arrives."""
        await _try_write_error(writer, text)
        await self._close_last(reader)

    async def _close_last(self, reader: asyncio.StreamReader) -> None:
        """Linger until the peer closes (bounded, and only while few streams do), so that this side closes last.

        p2pd can reset a stream whose handler socket closes while its pipe still reads from the peer, and the
        reset can overtake our last frames. That is the best explanation found (not reproduced) for a loaded CI
        run whose client saw the stream end with nothing in it, where a refusal was due after the request and its
        END had been read. The client closes as soon as it has read our END or error frame, so the wait is that
        long.
        """
        if self._lingering >= self._max_lingering:
            return
        self._lingering += 1
        try:
            await _linger(reader)
        finally:
            self._lingering -= 1

    async def _serve(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests = RequestStream(reader, self._request_type, self._max_request_bytes, self._idle_timeout)
        replies: AsyncIterator[Message] | None = None
        try:
            replies = self._handler(remote, requests)
            async for reply in replies:
                await self._write_bounded(writer, reply)
            async with asyncio.timeout(self._idle_timeout):
                await write_end(writer)
            await self._close_last(reader)
        except WireError as exc:
            log.debug("%s: stream from %s refused: %s", self.name, remote[:16], exc)
            await self._send_refusal(str(exc), reader, writer)
        except (TimeoutError, *_CONNECTION_ERRORS) as exc:  # the peer stopped reading, or left
            log.debug("%s: stream to %s dropped: %r", self.name, remote[:16], exc)
        except Exception as exc:
            log.debug("%s: handler failed on a stream from %s", self.name, remote[:16], exc_info=True)
            await self._send_refusal(f"handler failed: {type(exc).__name__}", reader, writer)
        finally:
            if replies is not None:
                await _aclose(replies)

    async def _write_bounded(self, writer: asyncio.StreamWriter, reply: Message) -> None:
        # A peer that stops reading fills the buffers and would block drain() forever.
        async with asyncio.timeout(self._idle_timeout):
            await write_message(writer, reply)


async def _aclose(iterator: object) -> None:
    """Close an async generator we iterated (from the task that iterated it, so never 'running')."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


async def serve(p2p: P2P, name: str, handler: Handler, request_type: type[Message], *, max_request_bytes: int,
                idle_timeout: float | None, max_streams_per_peer: int, max_streams: int,
                on_refused: RefusedCallback | None = None, gatekeeper: Gatekeeper | None = None) -> WireServer:
    """Register ``handler`` under ``name`` on ``p2p`` with bounded framing; returns the started server.

    ``handler(remote, requests)`` returns an async iterator of replies; ``requests`` yields parsed
    messages of at most ``max_request_bytes`` each, each within ``idle_timeout`` seconds. A peer with
    ``max_streams_per_peer`` streams open on this handler, or any peer while ``max_streams`` are open,
    gets an error frame and ``on_refused(remote, reason)`` is called; a peer ``gatekeeper`` refuses gets
    its error frame and nothing else (see :class:`WireServer`).
    """
    server = WireServer(p2p, name, handler, request_type, max_request_bytes=max_request_bytes,
                        idle_timeout=idle_timeout, max_streams_per_peer=max_streams_per_peer,
                        max_streams=max_streams, on_refused=on_refused, gatekeeper=gatekeeper)
    await server.start()
    return server


# ---- the client side ------------------------------------------------------------------------------


class ReplyStream(Generic[Rep]):
    """The client end of one stream: an async iterator of bounded replies.

    The stream opens on the first ``__anext__``; requests are written (a single message at once, an
    async iterator by a writer task) and then an END frame. The stream is closed when the replies end,
    on any failure (raised as :class:`WireError`), on ``aclose()`` or when leaving ``async with``.
    ``aclose()`` is safe from any task at any time, even while another task waits for a reply.
    """

    def __init__(self, p2p: P2P, peer_id: str, name: str, requests: Message | AsyncIterable[Message],
                 reply_type: type[Rep], *, max_reply_bytes: int, idle_timeout: float | None) -> None:
        self._p2p = p2p
        self._peer_id = peer_id
        self._name = name
        self._requests = requests
        self._reply_type = reply_type
        self._max_reply_bytes = max_reply_bytes
        self._idle_timeout = idle_timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._writing: asyncio.Task[None] | None = None
        self._closed = False
        self.opened = False  # the stream was opened (a caller cancelled before that learns the peer was not reached)

    def __aiter__(self) -> ReplyStream[Rep]:
        return self

    async def __aenter__(self) -> ReplyStream[Rep]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def __anext__(self) -> Rep:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._reader is None:
                await self._open()
            assert self._reader is not None
            reply = await read_message(self._reader, self._reply_type, max_bytes=self._max_reply_bytes,
                                       timeout=self._idle_timeout)
        except WireError:
            await self.aclose()
            raise
        except Exception as exc:
            await self.aclose()
            raise WireError(f"stream failed: {type(exc).__name__}: {_one_line(str(exc), 120)}") from None
        except BaseException:  # cancelled: close, then let the cancellation through
            await self.aclose()
            raise
        if reply is None:
            await self.aclose()
            raise StopAsyncIteration
        return reply

    async def aclose(self) -> None:
        """Stop writing, close the stream; idempotent and never raises."""
        self._closed = True
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.cancel()
            with contextlib.suppress(BaseException):
                await writing
        writer, self._writer = self._writer, None
        if writer is not None:
            await _close_writer(writer)

    async def _open(self) -> None:
        from hivemind.p2p import PeerID

        try:
            peer = PeerID.from_base58(self._peer_id)
        except Exception:
            raise WireError(f"invalid peer id {_one_line(str(self._peer_id), 60)!r}") from None
        try:
            async with asyncio.timeout(self._idle_timeout):
                _, self._reader, self._writer = await self._p2p.call_binary_stream_handler(peer, self._name)
        except TimeoutError:
            raise DialError(f"could not open a stream within {self._idle_timeout:g} s") from None
        except Exception as exc:
            raise DialError(f"could not open a stream: {_one_line(str(exc), 120)}") from None
        self.opened = True
        # Requests go out from their own task even when there is one, so that a server refusing at
        # once (and closing) is read as its refusal rather than as a failed write.
        requests = _as_single(self._requests) if isinstance(self._requests, Message) else self._requests
        self._writing = asyncio.create_task(self._write_all(requests))
        self._writing.add_done_callback(_retrieve)

    async def _write_all(self, requests: AsyncIterable[Message]) -> None:
        """Write every request then END, each write bounded (a server that stops reading cannot hang us)."""
        writer = self._writer
        assert writer is not None
        try:
            async for request in requests:
                async with asyncio.timeout(self._idle_timeout):
                    await write_message(writer, request)
            async with asyncio.timeout(self._idle_timeout):
                await write_end(writer)
        finally:
            await _aclose(requests)


async def _as_single(msg: Message) -> AsyncIterator[Message]:
    yield msg


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a task's failure as seen: a writer failing because the server closed is expected."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.debug("request writer ended: %r", exc)


def open_stream(p2p: P2P, peer_id: str, name: str, requests: Message | AsyncIterable[Message],
                reply_type: type[Rep], *, max_reply_bytes: int, idle_timeout: float | None) -> ReplyStream[Rep]:
    """Open (lazily, on the first read) a stream to ``peer_id``'s handler ``name``; iterate the replies.

    Each reply is at most ``max_reply_bytes`` and must arrive within ``idle_timeout`` seconds (also the
    bound for opening and for each write); a violation raises :class:`WireError`, an error frame from
    the server :class:`PeerRefused`. Use ``async with open_stream(...) as replies`` or iterate to the
    end so the stream is always closed.
    """
    return ReplyStream(p2p, peer_id, name, requests, reply_type, max_reply_bytes=max_reply_bytes,
                       idle_timeout=idle_timeout)
