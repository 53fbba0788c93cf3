"""Outer-state download between peers: how a joining node (or one that fell behind) gets phi and b.

The server answers a ``StateRequest`` for one fragment with a stream of ``StateChunk``s (fp32 phi and
momentum, 64 Ki elements per message) from an immutable snapshot, so a download never sees a
half-applied outer step. The client is resumable: when a peer fails mid-stream it continues from the
last element received with another peer holding the same version. A joiner spreads its fragments
over several peers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import numpy as np
import torch

from node.swarm.averaging import ByteCounters
from node.swarm.runtime import NetworkRuntime
from node.transport.base import FragmentSnapshot
from protocol import swarm_pb2

log = logging.getLogger("locoswarm.state")

STATE_HANDLER = "locoswarm.state.v1"
CHUNK_ELEMS = 1 << 16


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
        runtime.call(runtime.p2p.add_protobuf_handler(
            STATE_HANDLER, self._handle, swarm_pb2.StateRequest, stream_output=True), timeout=30)

    async def _handle(self, request: swarm_pb2.StateRequest, context) -> AsyncIterator[swarm_pb2.StateChunk]:
        remote = str(context.remote_id)
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
            jobs = []
            for i, frag in enumerate(fragments):
                rotated = peers[i % len(peers):] + peers[:i % len(peers)]  # a different first peer each
                jobs.append(self.fetch_async(frag, rotated, min_version))
            got = await asyncio.gather(*jobs, return_exceptions=True)
            return {f: g for f, g in zip(fragments, got, strict=True) if isinstance(g, FragmentSnapshot)}

        if not peers:
            return {}
        return self.runtime.call(run(), timeout=self.timeout * max(1, len(fragments)))

    async def fetch_async(self, fragment: int, peers: list[str], min_version: int = 0) -> FragmentSnapshot:
        from hivemind.p2p import PeerID

        phi: list[torch.Tensor] = []
        mom: list[torch.Tensor] = []
        offset, version, numel = 0, None, None
        errors = []
        for peer in peers:
            try:
                request = swarm_pb2.StateRequest(fingerprint=self.fingerprint, fragment=fragment, offset=offset,
                                                 min_version=version if version is not None else min_version)
                stream = await self.runtime.p2p.iterate_protobuf_handler(
                    PeerID.from_base58(peer), STATE_HANDLER, request, swarm_pb2.StateChunk)
                async for msg in stream:
                    self.counters.received(peer, fragment, -1, msg.ByteSize())
                    if msg.error:
                        raise RuntimeError(msg.error)
                    if version is None:
                        version, numel = msg.version, msg.numel
                    elif msg.version != version:
                        # The peer moved on since the first part: keep the newest, start over.
                        phi.clear(), mom.clear()
                        version, numel, offset = msg.version, msg.numel, 0
                        if msg.offset != 0:
                            raise RuntimeError("version changed mid-download")
                    if msg.offset != offset:
                        raise RuntimeError(f"expected offset {offset}, got {msg.offset}")
                    phi.append(_from_bytes(msg.phi))
                    mom.append(_from_bytes(msg.momentum))
                    offset += phi[-1].numel()
                if numel is not None and offset >= numel:
                    return FragmentSnapshot(fragment, int(version),
                                            torch.cat(phi) if phi else torch.zeros(0),
                                            torch.cat(mom) if mom else torch.zeros(0))
                errors.append(f"{peer[:12]}: stream ended at {offset}/{numel}")
            except Exception as exc:
                errors.append(f"{peer[:12]}: {exc}")
        raise RuntimeError(f"fragment {fragment}: no peer could serve it ({'; '.join(errors)})")
