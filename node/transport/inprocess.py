"""An in-process transport: workers of one process meet at a hub that forms groups and reduces.

Used by the simulator and unit tests. It performs the same reduction as the swarm transport
(``locoswarm.node.transport.reduce``) on the same codec bytes and counts bytes with the same exchange pattern,
so simulated bandwidth figures are the ones the network would carry. Workers run in lock-step in one
thread: each calls ``start_average`` during a step's send phase, then the driver calls ``flush()``,
which completes every round started so far.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from locoswarm.node.config import RobustSection
from locoswarm.node.core.codecs import Codec, get_codec
from locoswarm.node.core.payload import chunk_bounds, decode_chunks
from locoswarm.node.core.persistence import DeviationMemory
from locoswarm.node.core.robust import make_aggregator
from locoswarm.node.core.transport import (
    BASIS_MISMATCH,
    NO_PEER_IN_GROUP,
    NOT_AT_CONSENSUS_VERSION,
    AverageHandle,
    AverageRequest,
    AverageResult,
    EncodedAverage,
    FragmentSnapshot,
    MemberShare,
    PartOrigin,
    Transport,
)
from locoswarm.node.transport.groups import consensus_members, form_groups, group_basis
from locoswarm.node.transport.reduce import reduce_group, reducer_parts

# Per message besides codec chunks: weight (f64) + version (i64), then the fp32 extras vector and the
# basis tag of low-rank payloads.
HEADER_BYTES = 16


class _Handle(AverageHandle):
    def __init__(self) -> None:
        self._result: AverageResult | None = None

    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout: float | None = None) -> AverageResult:
        if self._result is None:
            raise RuntimeError("in-process round not completed: the driver must call hub.flush() first")
        return self._result


@dataclass
class _Pending:
    worker: int
    request: AverageRequest
    handle: _Handle


class InProcessHub:
    """Rendezvous of the in-process workers.

    Args:
        codec: the swarm's payload codec.
        group_size: at most this many members per group; members of a round are split into random
            balanced groups by the swarm's rule (``locoswarm.node.transport.groups``; ``group_size >= workers`` is an
            all-reduce).
        seed: seeds dropped syncs.
        drop_prob: probability that a worker's sync is dropped (fails for that worker only).
        robust: how reducers screen and combine contributions (``[robust]``; default: its defaults).
    """

    def __init__(self, codec: Codec, group_size: int, seed: int = 0, drop_prob: float = 0.0,
                 robust: RobustSection | None = None) -> None:
        self.codec = codec
        self.group_size = group_size
        self.robust = robust or RobustSection()
        self.aggregator = make_aggregator(self.robust)
        self.deviations = DeviationMemory()  # the reducers' memory of persistent deviations (core.persistence)
        self.drop_prob = drop_prob
        self._rng = random.Random(seed)
        self._pending: dict[tuple[int, int], list[_Pending]] = defaultdict(list)
        self._sources: dict[int, Callable[[int], FragmentSnapshot]] = {}
        self._versions: dict[int, Callable[[int], int]] = {}
        self.n_workers = 0

    def transport(self, worker: int) -> InProcessTransport:
        self.n_workers = max(self.n_workers, worker + 1)
        return InProcessTransport(self, worker)

    def register_state(self, worker: int, version: Callable[[int], int],
                       snapshot: Callable[[int], FragmentSnapshot]) -> None:
        """Let behind workers fetch this worker's outer state (catch-up)."""
        self._versions[worker] = version
        self._sources[worker] = snapshot

    def submit(self, worker: int, request: AverageRequest) -> _Handle:
        handle = _Handle()
        self._pending[(request.fragment, request.round)].append(_Pending(worker, request, handle))
        return handle

    def flush(self) -> None:
        """Complete every round started so far."""
        pending, self._pending = self._pending, defaultdict(list)
        for key in sorted(pending):
            self._complete_round(sorted(pending[key], key=lambda p: p.worker))

    def _complete_round(self, members: list[_Pending]) -> None:
        alive = []
        for m in members:
            if self.drop_prob > 0 and self._rng.random() < self.drop_prob:
                m.handle._result = AverageResult.failed("dropped", own_weight=m.request.weight)
            else:
                alive.append(m)
        if not alive:
            return
        # The swarm's rule (locoswarm.node.transport.groups): the same split for the same members and round.
        by_id = {f"w{m.worker:06d}": m for m in alive}
        key = alive[0].request
        ids = list(by_id)
        if key.digest:  # a consensus round averages the members at its common version only
            ids = consensus_members(ids, {p: m.request.version for p, m in by_id.items()})
            for p in set(by_id) - set(ids):
                by_id[p].handle._result = AverageResult.failed(NOT_AT_CONSENSUS_VERSION,
                                                               own_weight=by_id[p].request.weight)
        for group in form_groups(ids, key.fragment, key.round, self.group_size):
            self._reduce([by_id[p] for p in group])

    def _reduce(self, group: list[_Pending]) -> None:
        group = self._agree_on_basis(group)
        if len(group) < 2 and self.n_workers > 1:
            for m in group:
                m.handle._result = AverageResult.failed(NO_PEER_IN_GROUP, own_weight=m.request.weight)
            return
        if group[0].request.digest and all(m.request.digest == group[0].request.digest for m in group):
            for m in group:  # identical contributions: their mean is each of them, nothing to move
                m.handle._result = AverageResult(ok=True, average=None, group_size=len(group), total_weight=float(
                    sum(x.request.weight for x in group)), own_weight=m.request.weight)
            return
        numel = group[0].request.numel
        weights = [m.request.weight if m.request.weight > 0 else 1.0 for m in group]
        req = group[0].request
        codec = get_codec(req.codec, self.codec.block_size) if req.codec else self.codec
        reduced, sent, received, entered = reduce_group(
            codec, [m.request.chunks for m in group], weights, numel, self.robust, self.aggregator,
            senders=[f"w{m.worker:06d}" for m in group], fragment=req.fragment, round_=req.round,
            memory=None if req.digest else self.deviations)  # phi's deviations (consensus) persist by nature
        average = decode_chunks(codec, reduced, numel)
        weights = [w if w > 0 else 0.0 for w in entered]
        total = float(sum(weights)) or 1.0
        # The side vector (CoCoDC's R) is summed over the accepted members, as CoCoDC all-reduces it.
        extras = sum(m.request.extras.float() for w, m in zip(weights, group, strict=True) if w > 0)
        n = len(group)
        header = HEADER_BYTES + 4 * group[0].request.extras.numel() + len(group[0].request.basis)
        bounds = chunk_bounds(numel, codec.block_size)
        ids = [f"w{m.worker:06d}" for m in group]
        spans = [(j, bounds[r.start][0], bounds[r.stop - 1][1])
                 for j, r in enumerate(reducer_parts(len(bounds), ids, round_=req.round)) if len(r)]
        # each member's own part carries the others' contributions to it, as the swarm's reducers do (not in a pair)
        decoded = (None if req.digest or req.basis or n < 3 else
                   [decode_chunks(codec, list(m.request.chunks), numel) if w > 0 else None
                    for m, w in zip(group, entered, strict=True)])
        for i, m in enumerate(group):
            origins = [PartOrigin(ids[j], a, b, shares=() if decoded is None or j != i else tuple(
                MemberShare(ids[k], decoded[k][a:b].clone()) for k in range(n) if k != i and decoded[k] is not None))
                for j, a, b in spans]
            m.handle._result = AverageResult(
                ok=True, average=average.clone(), extras=torch.as_tensor(extras).clone(),
                group_size=n, total_weight=total, own_weight=weights[i],
                bytes_sent=sent[i] + (n - 1) * header, bytes_received=received[i] + (n - 1) * header,
                max_version=max(m.request.version for m in group), basis=m.request.basis, parts=origins,
                encoded=EncodedAverage(codec.name, numel, tuple(reduced)))

    @staticmethod
    def _agree_on_basis(group: list[_Pending]) -> list[_Pending]:
        """Low-rank payloads are coefficients on a basis, so a group's members must share it. Where their
        tags differ (a member missed a round, or last met other peers), every member re-encodes on the seeded
        basis of this round at the leader's (smallest id) ranks (``group_basis``); one that cannot leaves the
        round."""
        leader = group_basis([m.request.basis for m in group])
        if leader is None:
            return group
        kept = []
        for m in group:
            again = m.request.reencode(leader) if m.request.reencode is not None else None
            if again is None:
                m.handle._result = AverageResult.failed(f"{BASIS_MISMATCH}: cannot re-encode on the group's basis",
                                                        own_weight=m.request.weight)
            else:
                m.request = again
                kept.append(m)
        return kept

    def latest_version(self, fragment: int, exclude: int) -> int:
        versions = [v(fragment) for w, v in self._versions.items() if w != exclude]
        return max(versions, default=-1)

    def fetch(self, fragment: int, exclude: int) -> FragmentSnapshot | None:
        best = max((w for w in self._versions if w != exclude),
                   key=lambda w: self._versions[w](fragment), default=None)
        return None if best is None else self._sources[best](fragment)


class InProcessTransport(Transport):
    def __init__(self, hub: InProcessHub, worker: int) -> None:
        self.hub = hub
        self.worker = worker

    def start_average(self, request: AverageRequest) -> AverageHandle:
        return self.hub.submit(self.worker, request)

    def latest_version(self, fragment: int) -> int:
        return self.hub.latest_version(fragment, exclude=self.worker)

    def fetch_fragment(self, fragment: int) -> FragmentSnapshot | None:
        return self.hub.fetch(fragment, exclude=self.worker)
