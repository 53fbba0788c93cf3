"""Outer-state download between peers: how a joining node (or one that fell behind) gets phi and b.

The server answers a ``StateRequest`` for one fragment with a stream of ``StateChunk``s (fp32 phi and
momentum, 64 Ki elements per message) from an immutable snapshot, so a download never sees a
half-applied outer step. The client is resumable: when a peer fails mid-stream it continues from the
last element received with another peer holding the same version. A joiner spreads its fragments
over several peers.

Both ends use the bounded framing of ``node.swarm.wire``: a request is at most ``MAX_REQUEST_BYTES``, a
chunk at most ``MAX_CHUNK_BYTES``, each message must arrive within ``IDLE_TIMEOUT``, and the server caps
concurrent downloads per peer and in total (a client keeps its own downloads under the per-peer cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import numpy as np
import torch

from node.swarm import wire
from node.swarm.averaging import ByteCounters
from node.swarm.runtime import NetworkRuntime
from node.transport.base import FragmentSnapshot
from protocol import swarm_pb2

log = logging.getLogger("locoswarm.state")

STATE_HANDLER = "locoswarm.state.v1"
CHUNK_ELEMS = 1 << 16
MAX_REQUEST_BYTES = 1024  # a StateRequest is a fingerprint and three integers
MAX_CHUNK_BYTES = 2 * 4 * CHUNK_ELEMS + 4096  # phi and momentum in fp32, plus the small fields
IDLE_TIMEOUT = 20.0  # seconds for any one message (a chunk is at most 512 KiB)
MAX_STREAMS_PER_PEER = 8
MAX_STREAMS = 64
PARALLEL_DOWNLOADS = 4  # a joiner's concurrent fragment downloads: under MAX_STREAMS_PER_PEER


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def _from_bytes(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())


class StateServer:
    """Serves snapshots of this node's outer state (``snapshot(fragment)`` must be thread-safe)."""

    def __init__(self, runtime: NetworkRuntime, fingerprint: str,
                 snapshot: Callable[[int], FragmentSnapshot | None], counters: ByteCounters) -> None:
        self.fingerprint = fingerprint
        self.snapshot = snapshot
        self.counters = counters
        self.served = 0
        self._runtime = runtime
        self._server = runtime.call(wire.serve(
            runtime.p2p, STATE_HANDLER, self._handle, swarm_pb2.StateRequest, max_request_bytes=MAX_REQUEST_BYTES,
            idle_timeout=IDLE_TIMEOUT, max_streams_per_peer=MAX_STREAMS_PER_PEER, max_streams=MAX_STREAMS),
            timeout=30)

    def close(self) -> None:
        """Stop serving (downloads already running finish)."""
        with contextlib.suppress(Exception):
            self._runtime.call(self._server.stop(), timeout=5)

    async def _handle(self, remote: str,
                      requests: AsyncIterator[swarm_pb2.StateRequest]) -> AsyncIterator[swarm_pb2.StateChunk]:
        request = await anext(requests, None)  # a framing violation raises wire.WireError: refused
        if request is None:
            return
        if request.fingerprint != self.fingerprint:
            yield swarm_pb2.StateChunk(error=f"fingerprint mismatch: {request.fingerprint} vs {self.fingerprint}")
            return
        snap = self.snapshot(request.fragment)
        if snap is None:
            yield swarm_pb2.StateChunk(error=f"no state for fragment {request.fragment}")
            return
        if snap.version < request.min_version:
            yield swarm_pb2.StateChunk(error=f"have version {snap.version} < {request.min_version}")
            return
        numel = snap.phi.numel()
        for a in range(int(request.offset), numel, CHUNK_ELEMS):
            b = min(a + CHUNK_ELEMS, numel)
            msg = swarm_pb2.StateChunk(fragment=request.fragment, version=snap.version, numel=numel, offset=a,
                                       phi=_to_bytes(snap.phi[a:b]), momentum=_to_bytes(snap.momentum[a:b]))
            self.counters.sent(remote, request.fragment, -1, msg.ByteSize())
            yield msg
            await asyncio.sleep(0)
        if numel == 0:
            yield swarm_pb2.StateChunk(fragment=request.fragment, version=snap.version, numel=0, offset=0)
        self.served += 1


class StateClient:
    def __init__(self, runtime: NetworkRuntime, fingerprint: str, counters: ByteCounters,
                 timeout: float = 60.0) -> None:
        self.runtime = runtime
        self.fingerprint = fingerprint
        self.counters = counters
        self.timeout = timeout

    def fetch(self, fragment: int, peers: list[str], min_version: int = 0) -> FragmentSnapshot | None:
        """Blocking download of one fragment (for the training thread)."""
        try:
            return self.runtime.call(self.fetch_async(fragment, peers, min_version), timeout=self.timeout)
        except Exception as exc:
            log.warning("state download of fragment %d failed: %s", fragment, exc)
            return None

    def fetch_many(self, fragments: list[int], peers: list[str], min_version: int = 0) -> dict[int, FragmentSnapshot]:
        """Download several fragments at once, spread over ``peers`` (a joining node)."""

        async def run() -> dict[int, FragmentSnapshot]:
            slots = asyncio.Semaphore(PARALLEL_DOWNLOADS)  # servers refuse a peer's streams past their cap

            async def one(frag: int, order: list[str]) -> FragmentSnapshot:
                async with slots:
                    return await self.fetch_async(frag, order, min_version)

            jobs = []
            for i, frag in enumerate(fragments):
                rotated = peers[i % len(peers):] + peers[:i % len(peers)]  # a different first peer each
                jobs.append(one(frag, rotated))
            got = await asyncio.gather(*jobs, return_exceptions=True)
            return {f: g for f, g in zip(fragments, got, strict=True) if isinstance(g, FragmentSnapshot)}

        if not peers:
            return {}
        return self.runtime.call(run(), timeout=self.timeout * max(1, len(fragments)))

    async def fetch_async(self, fragment: int, peers: list[str], min_version: int = 0) -> FragmentSnapshot:
        download = _Download(fragment, min_version)
        errors = []
        for peer in peers:
            try:
                async with wire.open_stream(self.runtime.p2p, peer, STATE_HANDLER, download.request(self.fingerprint),
                                            swarm_pb2.StateChunk, max_reply_bytes=MAX_CHUNK_BYTES,
                                            idle_timeout=IDLE_TIMEOUT) as stream:
                    async for msg in stream:
                        self.counters.received(peer, fragment, -1, msg.ByteSize())
                        download.add(msg)
                if download.complete():
                    return download.snapshot()
                errors.append(f"{peer[:12]}: stream ended at {download.progress()}")
            except Exception as exc:
                errors.append(f"{peer[:12]}: {exc}")
        raise RuntimeError(f"fragment {fragment}: no peer could serve it ({'; '.join(errors)})")


class _Download:
    """One fragment's download, resumable across peers: checks each chunk against the stream so far."""

    def __init__(self, fragment: int, min_version: int) -> None:
        self.fragment = fragment
        self._min_version = min_version
        self._phi: list[torch.Tensor] = []
        self._mom: list[torch.Tensor] = []
        self._offset = 0
        self._version: int | None = None
        self._numel: int | None = None

    def request(self, fingerprint: str) -> swarm_pb2.StateRequest:
        """The request resuming at the next element (of the version started, if any)."""
        version = self._version if self._version is not None else self._min_version
        return swarm_pb2.StateRequest(fingerprint=fingerprint, fragment=self.fragment, offset=self._offset,
                                      min_version=version)

    def add(self, msg: swarm_pb2.StateChunk) -> None:
        """Append a chunk, or raise RuntimeError (the caller moves on to another peer)."""
        if msg.error:
            raise RuntimeError(f"refused: {msg.error[:200]}")
        if self._version is None:
            self._version, self._numel = msg.version, msg.numel
        elif msg.version != self._version:
            # The peer moved on since the first part: keep the newest, start over.
            self._phi.clear(), self._mom.clear()
            self._version, self._numel, self._offset = msg.version, msg.numel, 0
            if msg.offset != 0:
                raise RuntimeError("version changed mid-download")
        if msg.numel != self._numel:
            raise RuntimeError(f"fragment size changed from {self._numel} to {msg.numel} within a version")
        if msg.offset != self._offset:
            raise RuntimeError(f"expected offset {self._offset}, got {msg.offset}")
        count = self._chunk_elems(msg)
        self._phi.append(_from_bytes(msg.phi))
        self._mom.append(_from_bytes(msg.momentum))
        self._offset += count

    def _chunk_elems(self, msg: swarm_pb2.StateChunk) -> int:
        """Elements in a well-formed chunk: phi and momentum of equal fp32 length, inside the fragment."""
        if len(msg.phi) != len(msg.momentum) or len(msg.phi) % 4:
            raise RuntimeError(f"malformed chunk: {len(msg.phi)} bytes of phi, {len(msg.momentum)} of momentum")
        count = len(msg.phi) // 4
        if count > CHUNK_ELEMS or self._offset + count > (self._numel or 0) or (count == 0 and self._numel):
            raise RuntimeError(f"chunk of {count} elements at {self._offset} does not fit {self._numel} elements")
        return count

    def complete(self) -> bool:
        return self._numel is not None and self._offset >= self._numel

    def progress(self) -> str:
        return f"{self._offset}/{self._numel}"

    def snapshot(self) -> FragmentSnapshot:
        return FragmentSnapshot(self.fragment, int(self._version or 0),
                                torch.cat(self._phi) if self._phi else torch.zeros(0),
                                torch.cat(self._mom) if self._mom else torch.zeros(0))
