"""A user-space TCP proxy that adds a fixed one-way delay: latency for a kernel without netem.

It listens on ``--listen HOST:PORT`` and forwards every connection to ``--target HOST:PORT``. Bytes
read from either side are queued with their arrival time and written to the other side once
``--delay-ms`` has passed, so every byte (in both directions) arrives ``delay`` later than it would,
while throughput is unchanged (reading goes on while earlier bytes wait: a pipe, not stop-and-wait).
A node announces the proxy's address, so every connection into it crosses the proxy: a round trip
between two nodes pays ``2 * delay``. The swarm benchmark runs one proxy per node, in the node's
network namespace, in front of a node that listens on loopback only.

Each direction holds at most ``--max-buffer`` bytes in flight; beyond that reading pauses (TCP
backpressure reaches the sender), so memory stays bounded whatever the link.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import sys
import time
from collections.abc import Callable

from locoswarm.node.helptext import describe

CHUNK = 64 * 1024


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 10.77.0.11:31338)")
    return host, int(port)


class DelayPipe:
    """One direction of a proxied connection: read from ``reader``, write to ``writer`` ``delay`` later."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                 max_buffer: int, abort: Callable[[], None]) -> None:
        self.reader, self.writer = reader, writer
        self.abort = abort  # closes both sockets of the connection (a write failed: the pair is done)
        self.delay = delay
        self.max_buffer = max_buffer
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.buffered = 0
        self.bytes = 0
        self._data = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._eof = False

    async def run(self) -> None:
        """Pump until either side closes; then half-close the writer after the queue drained."""
        await asyncio.gather(self._read(), self._write())

    async def _read(self) -> None:
        try:
            while True:
                await self._room.wait()
                data = await self.reader.read(CHUNK)
                if not data:
                    break
                self.queue.append((time.monotonic() + self.delay, data))
                self.buffered += len(data)
                if self.buffered >= self.max_buffer:
                    self._room.clear()
                self._data.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self._eof = True
            self._data.set()

    async def _write(self) -> None:
        try:
            while True:
                if not self.queue:
                    if self._eof:
                        break
                    self._data.clear()
                    await self._data.wait()
                    continue
                due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self.queue.popleft()
                self.buffered -= len(data)
                if self.buffered < self.max_buffer:
                    self._room.set()
                self.writer.write(data)
                self.bytes += len(data)
                await self.writer.drain()
            with contextlib.suppress(OSError, RuntimeError):
                if self.writer.can_write_eof():
                    self.writer.write_eof()
        except (ConnectionError, OSError):
            self._room.set()
            self.abort()


class DelayProxy:
    """The listening side: one pair of :class:`DelayPipe` per accepted connection."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float,
                 max_buffer: int = 8 * 1024 * 1024) -> None:
        self.listen, self.target = listen, target
        self.delay = delay_s
        self.max_buffer = max_buffer
        self.server: asyncio.base_events.Server | None = None
        self.connections = 0
        self.bytes = 0

    async def start(self) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        self.server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1])
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        def abort() -> None:
            for w in (client_w, upstream_w):
                with contextlib.suppress(Exception):
                    w.transport.abort()

        pipes = (DelayPipe(client_r, upstream_w, self.delay, self.max_buffer, abort),
                 DelayPipe(upstream_r, client_w, self.delay, self.max_buffer, abort))
        try:
            await asyncio.gather(*(p.run() for p in pipes))
        except asyncio.CancelledError:
            # The proxy is shutting down (asyncio.run cancels the connections' tasks). Ending this top-level task
            # normally keeps asyncio's streams callback from logging a traceback for every open connection.
            abort()
        finally:
            self.bytes += sum(p.bytes for p in pipes)
            for w in (client_w, upstream_w):
                with contextlib.suppress(Exception):
                    w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()


async def _serve(args: argparse.Namespace) -> None:
    proxy = DelayProxy(args.listen, args.target, args.delay_ms / 1000.0, args.max_buffer)
    port = await proxy.start()
    print(f"proxy listening on {args.listen[0]}:{port} -> {args.target[0]}:{args.target[1]} "
          f"delay {args.delay_ms:g} ms", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m locoswarm.node.bench.swarm.proxy", description=describe(__doc__))
    parser.add_argument("--listen", type=_hostport, required=True, help="HOST:PORT to accept connections on")
    parser.add_argument("--target", type=_hostport, required=True, help="HOST:PORT to forward them to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every byte")
    parser.add_argument("--max-buffer", type=int, default=8 * 1024 * 1024, help="bytes in flight per direction")
    args = parser.parse_args(argv)
    if not 0 <= args.delay_ms <= 10_000:
        parser.error(f"--delay-ms {args.delay_ms:g} is not allowed; use 0..10000")
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
