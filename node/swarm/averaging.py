"""Fragment averaging over libp2p streams: the swarm's implementation of ``Transport``.

A round of fragment ``p`` started at swarm step ``r``:

1. **Matchmaking** through the DHT: each member stores a ``MatchEntry`` under the round's key and
   polls it until every live peer has arrived or the window (``network.matchmaking_timeout`` after
   the first arrival) closes. Members are sorted, shuffled by a seed derived from (p, r) and cut into
   balanced groups of at most ``network.group_size``: random groups that change from round to round
   (2 = pairwise gossip; as large as the swarm = all-reduce). Under the adaptive schedule all members
   of a send slot meet under one key whatever fragment they picked; a member whose pick or schedule
   state differs from the slot leader's (smallest peer id) is told the leader's state to adopt.
   A node with no live peer at all is a swarm of one: its round "averages" its own contribution.
2. **Exchange**: reduce-scatter then all-gather of the exact codec chunks (``node.transport.reduce``):
   member ``i`` streams its chunks of part ``j`` to member ``j``, which waits for every member's part,
   takes the token-weighted fp32 mean, re-encodes it and streams it back to each member.
3. **Atomicity**: a member applies a result only when it holds every reduced part. A reducer missing
   a contribution (a peer died, disagreed on the group or timed out) answers an error instead of a
   partial mean, so nobody applies a partial average; the caller keeps its local progress.

Every header carries the swarm fingerprint and the group hash; a mismatch is refused by name.
Bytes sent and received are counted here, per peer and per fragment.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from node.core.codecs import Codec
from node.core.payload import chunk_bounds, decode_chunks
from node.core.schedule import ScheduleState
from node.swarm.runtime import NetworkRuntime
from node.transport.base import AverageHandle, AverageRequest, AverageResult, FragmentSnapshot, Transport
from node.transport.reduce import part_ranges, reduce_chunk
from protocol import swarm_pb2

log = logging.getLogger("locoswarm.averaging")

AVERAGE_HANDLER = "locoswarm.average.v1"


@dataclass
class ByteCounters:
    """Bytes on the wire (serialized protocol messages), per peer and per fragment."""

    sent_by_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received_by_peer: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_by_fragment: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    received_by_fragment: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    by_round: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def sent(self, peer: str, fragment: int, round_: int, n: int) -> None:
        self.sent_by_peer[peer] += n
        self.sent_by_fragment[fragment] += n
        self.by_round[(fragment, round_)][0] += n

    def received(self, peer: str, fragment: int, round_: int, n: int) -> None:
        self.received_by_peer[peer] += n
        self.received_by_fragment[fragment] += n
        self.by_round[(fragment, round_)][1] += n

    @property
    def total_sent(self) -> int:
        return sum(self.sent_by_peer.values())

    @property
    def total_received(self) -> int:
        return sum(self.received_by_peer.values())


@dataclass(frozen=True)
class ScheduleHint:
    """The adaptive schedule's state to adopt: ``leader`` picked ``fragment`` from ``state`` at ``round``."""

    round: int
    fragment: int
    state: ScheduleState
    leader: str


def match_entry(peer_id: str, req: AverageRequest, arrival: float) -> swarm_pb2.MatchEntry:
    """This member's record in a round's matchmaking key."""
    entry = swarm_pb2.MatchEntry(peer_id=peer_id, arrival=arrival, weight=req.weight, version=req.version,
                                 digest=req.digest, fragment=req.fragment)
    if req.schedule is not None:
        entry.scheduled = True
        entry.last_send.extend(-1 if t is None else t for t in req.schedule.last_send)
        entry.shared_r.extend(req.schedule.shared_r or ())
    return entry


def group_hash(members: list[str]) -> bytes:
    return hashlib.blake2b(",".join(sorted(members)).encode(), digest_size=16).digest()


def form_groups(members: list[str], fragment: int, round_: int, group_size: int) -> list[list[str]]:
    """Balanced random groups, the same on every member that saw the same member list."""
    seed = int.from_bytes(hashlib.blake2b(f"{fragment}:{round_}".encode(), digest_size=8).digest(), "big")
    order = sorted(members)
    random.Random(seed).shuffle(order)
    n_groups = max(1, -(-len(order) // group_size))
    return [sorted(order[g::n_groups]) for g in range(n_groups)]


class _Reduction:
    """This member's part of one group round: contributions in, one reduced part out."""

    def __init__(self, key: tuple[int, int, bytes]) -> None:
        self.key = key
        self.created = time.monotonic()
        self.contributions: dict[str, tuple[float, list[float], dict[int, bytes]]] = {}
        self.configured = asyncio.Event()
        self.n_members = 0
        self.part: range = range(0)
        self.sizes: dict[int, int] = {}       # chunk index -> numel
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.codec: Codec | None = None
        self.members: set[str] = set()
        self.replies = 0
        self._replied = asyncio.Condition()

    async def replied(self) -> None:
        """A reply stream of this part has finished."""
        async with self._replied:
            self.replies += 1
            self._replied.notify_all()

    async def all_replied(self, count: int) -> None:
        async with self._replied:
            await self._replied.wait_for(lambda: self.replies >= count)

    def configure(self, codec: Codec, members: list[str], part: range, sizes: dict[int, int]) -> None:
        self.codec, self.n_members, self.part, self.sizes = codec, len(members), part, sizes
        self.members = set(members)
        self.configured.set()

    def add(self, sender: str, weight: float, extras: list[float], chunks: dict[int, bytes]) -> None:
        if self.done.done():
            return
        if sender in self.contributions:
            self.fail(f"duplicate contribution from {sender[:12]}")
            return
        self.contributions[sender] = (weight, extras, chunks)
        if self.configured.is_set() and len(self.contributions) == self.n_members:
            self._reduce()

    def maybe_reduce(self) -> None:
        if not self.done.done() and len(self.contributions) == self.n_members:
            self._reduce()

    def _reduce(self) -> None:
        try:
            senders = sorted(self.contributions)
            weights = [max(self.contributions[s][0], 0.0) for s in senders]
            if sum(weights) <= 0:
                weights = [1.0] * len(senders)
            total = float(sum(weights))
            reduced = {}
            for c in self.part:
                datas = [self.contributions[s][2].get(c) for s in senders]
                if any(d is None for d in datas):
                    raise ValueError(f"chunk {c} missing from a contribution")
                reduced[c] = reduce_chunk(self.codec, datas, weights, self.sizes[c])
            n_extras = len(self.contributions[senders[0]][1])
            extras = [sum(w * self.contributions[s][1][i] for s, w in zip(senders, weights, strict=True)) / total
                      for i in range(n_extras)]
            self.done.set_result((reduced, total, extras))
        except Exception as exc:
            self.fail(f"reduction failed: {exc}")

    def fail(self, error: str) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(error))


class _Handle(AverageHandle):
    def __init__(self, future, timeout: float) -> None:
        self._future = future
        self._timeout = timeout

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> AverageResult:
        try:
            return self._future.result(timeout if timeout is not None else self._timeout)
        except Exception as exc:
            self._future.cancel()
            return AverageResult.failed(f"{type(exc).__name__}: {exc}")

    def cancel(self) -> None:
        self._future.cancel()


class SwarmTransport(Transport):
    """Averaging with peers found in the DHT (see module docstring).

    Args:
        runtime: the node's network thread (DHT + P2P replica).
        swarm_key: prefix of this swarm's DHT keys (contains the fingerprint).
        fingerprint: refused when a peer's header carries another one.
        codec: the swarm's payload codec.
        group_size, matchmaking_timeout, round_timeout: from ``[network]``.
        live_peers: returns the ids of live peers (from heartbeats): matchmaking closes as soon as they
            are all in.
        pace_peers: the live peers that keep pace with this node: once they are in, stragglers get only
            ``grace()`` seconds (the wait the overlap hides) before the round starts without them.
        latest_versions: returns {fragment: (version, [peer ids holding it])} from heartbeats.
        fetch: downloads a fragment's outer state from given peers (``node.swarm.state_sync``).
        ready: whether this node may enter rounds: a joining node waits until every peer has had the
            time to see its heartbeat, since members that disagree on whether it is live would form
            different groups and fail the round for everyone.
    """

    def __init__(self, runtime: NetworkRuntime, *, swarm_key: str, fingerprint: str, codec: Codec,
                 group_size: int, matchmaking_timeout: float, round_timeout: float,
                 live_peers: Callable[[], list[str]],
                 latest_versions: Callable[[int], tuple[int, list[str]]],
                 fetch: Callable[[int, list[str], int], FragmentSnapshot | None],
                 pace_peers: Callable[[], list[str]] | None = None,
                 grace: Callable[[], float] | None = None,
                 ready: Callable[[], bool] | None = None) -> None:
        self.runtime = runtime
        self.dht = runtime.dht
        self.peer_id = runtime.peer_id
        self.swarm_key = swarm_key
        self.fingerprint = fingerprint
        self.codec = codec
        self.group_size = group_size
        self.matchmaking_timeout = matchmaking_timeout
        self.round_timeout = round_timeout
        self.live_peers = live_peers
        self.pace_peers = pace_peers or live_peers
        self.grace = grace or (lambda: matchmaking_timeout)
        self.ready = ready or (lambda: True)
        # The newest slot where this node's adaptive-schedule state differed from the slot leader's.
        self.schedule_hint: ScheduleHint | None = None
        self._latest_versions = latest_versions
        self._fetch = fetch
        self.counters = ByteCounters()
        self.refusals: list[str] = []
        self._sessions: dict[tuple[int, int, bytes], _Reduction] = {}
        # fragment -> (version the group reached in its last successful round, its members): heartbeats
        # lag behind fast rounds, so this is how a member that missed a round learns it is behind.
        self.recent: dict[int, tuple[int, list[str]]] = {}
        self._skipped: dict[tuple[int, int], float] = {}
        self._digests: dict[tuple[int, int], dict[str, bytes]] = {}
        runtime.call(runtime.p2p.add_protobuf_handler(
            AVERAGE_HANDLER, self._handle_average, swarm_pb2.AverageRequest, stream_input=True,
            stream_output=True), timeout=30)

    # ---- Transport ------------------------------------------------------------------------------
    def start_average(self, request: AverageRequest) -> AverageHandle:
        budget = self.matchmaking_timeout + self.round_timeout + 5.0
        future = self.runtime.submit(asyncio.wait_for(self._average(request), budget))
        return _Handle(future, budget)

    def _newest(self, fragment: int) -> tuple[int, list[str]]:
        version, holders = self._latest_versions(fragment)
        recent_version, members = self.recent.get(fragment, (-1, []))
        others = [m for m in members if m != self.peer_id]
        if recent_version > version and others:
            return recent_version, others
        if recent_version == version:
            holders = holders + [m for m in others if m not in holders]
        return version, holders

    def latest_version(self, fragment: int) -> int:
        return self._newest(fragment)[0]

    def fetch_fragment(self, fragment: int) -> FragmentSnapshot | None:
        version, holders = self._newest(fragment)
        if not holders:
            return None
        return self._fetch(fragment, holders, version)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.runtime.call(self.runtime.p2p.remove_protobuf_handler(
                AVERAGE_HANDLER, stream_input=True, stream_output=True), timeout=5)

    # ---- one round ------------------------------------------------------------------------------
    async def _average(self, req: AverageRequest) -> AverageResult:
        if not self.ready():
            return AverageResult.failed("joining: peers have not all seen this node's heartbeat yet",
                                        own_weight=req.weight)
        matched = await self._matchmake(req)
        if matched is None:
            self._not_in_round(req.fragment, req.round)
            return AverageResult.failed("arrived after the matchmaking window closed", own_weight=req.weight)
        members, versions = matched
        group = next(g for g in form_groups(members, req.fragment, req.round, self.group_size)
                     if self.peer_id in g)
        if len(group) < 2:
            self._not_in_round(req.fragment, req.round)
            if len(members) == 1 and not req.digest and not self.live_peers():
                return self._solo(req)
            return AverageResult.failed("no peer in group", own_weight=req.weight)
        max_version = max(versions.get(p, req.version) for p in group)
        digests = self._digests.pop((req.fragment, req.round), {})
        if req.digest and all(digests.get(p) == req.digest for p in group):
            self._not_in_round(req.fragment, req.round)  # nobody will send us a part of it
            return AverageResult(ok=True, average=None, group_size=len(group), own_weight=req.weight,
                                 total_weight=req.weight * len(group), max_version=max_version)
        result = await self._exchange(req, group)
        result.max_version = max_version
        if result.ok:
            known = self.recent.get(req.fragment, (-1, []))[0]
            if max_version + 1 >= known:
                self.recent[req.fragment] = (max_version + 1, group)
        return result

    def _solo(self, req: AverageRequest) -> AverageResult:
        """A node with no live peer is a swarm of one: its "group average" is its own (quantized)
        contribution, so it takes ordinary outer steps (DiLoCo with one worker) instead of carrying an
        ever larger delta into the first round with peers, whose outer step would then be huge."""
        average = decode_chunks(self._codec(req.codec), req.chunks, req.numel)
        return AverageResult(ok=True, average=average, extras=req.extras.clone(), group_size=1,
                             total_weight=req.weight, own_weight=req.weight, max_version=req.version)

    def _match_key(self, fragment: int, round_: int, slot_wide: bool = False) -> str:
        if slot_wide:  # adaptive schedule: every member of the slot meets here, whichever fragment it picked
            return f"{self.swarm_key}/match/slot/{round_}"
        return f"{self.swarm_key}/match/{fragment}/{round_}"

    def _check_schedule(self, req: AverageRequest, me: swarm_pb2.MatchEntry,
                        entries: dict[str, swarm_pb2.MatchEntry]) -> None:
        """Members of a slot must pick the same fragment from the same schedule state. When they do not,
        the state of the member with the smallest peer id wins (one rule, so all converge on one state):
        it is left in ``schedule_hint`` for the node to adopt between inner steps."""
        leader = entries[min(entries)]
        if not leader.scheduled or leader.peer_id == self.peer_id:
            return
        if (leader.fragment, list(leader.last_send), list(leader.shared_r)) == \
                (me.fragment, list(me.last_send), list(me.shared_r)):
            return
        state = ScheduleState(tuple(None if t < 0 else int(t) for t in leader.last_send),
                              tuple(leader.shared_r) if len(leader.shared_r) else None)
        self.schedule_hint = ScheduleHint(req.round, int(leader.fragment), state, leader.peer_id)

    async def _read_entries(self, key: str) -> dict[str, swarm_pb2.MatchEntry]:
        found = await self.dht.get(key, latest=True, return_future=True)
        entries: dict[str, swarm_pb2.MatchEntry] = {}
        if found is None or not isinstance(found.value, dict):
            return entries
        for subkey, item in found.value.items():
            try:
                entry = swarm_pb2.MatchEntry.FromString(item.value)
            except Exception:
                continue
            if entry.peer_id == subkey:
                entries[subkey] = entry
        return entries

    async def _matchmake(self, req: AverageRequest) -> tuple[list[str], dict[str, int]] | None:
        from hivemind.utils import get_dht_time

        key = self._match_key(req.fragment, req.round, slot_wide=req.schedule is not None)
        me = match_entry(self.peer_id, req, get_dht_time())
        await self.dht.store(key, me.SerializeToString(), expiration_time=get_dht_time() + 300,
                             subkey=self.peer_id, return_future=True)
        expected = set(self.live_peers()) | {self.peer_id}
        core = set(self.pace_peers()) | {self.peer_id}
        grace = min(self.grace(), self.matchmaking_timeout)
        while True:
            entries = await self._read_entries(key)
            entries.setdefault(self.peer_id, me)
            first = min(e.arrival for e in entries.values())
            window_end = first + self.matchmaking_timeout
            now = get_dht_time()
            if set(entries) >= expected or now >= window_end:
                break
            if set(entries) >= core and now >= first + grace:
                window_end = now  # stragglers are not waited for beyond the grace
                break
            await asyncio.sleep(0.02 if set(entries) >= core else 0.05)
        if not set(entries) >= expected:
            await asyncio.sleep(0.3)  # let stores that raced the deadline land, then read once more
            entries.update(await self._read_entries(key))
        if req.schedule is not None:
            self._check_schedule(req, me, entries)
            entries = {p: e for p, e in entries.items() if e.fragment == req.fragment}
        members = sorted(p for p, e in entries.items() if e.arrival <= window_end)
        if self.peer_id not in members:
            return None
        self._digests[(req.fragment, req.round)] = {p: bytes(entries[p].digest) for p in members}
        return members, {p: int(entries[p].version) for p in members}

    async def _exchange(self, req: AverageRequest, group: list[str]) -> AverageResult:
        ghash = group_hash(group)
        n = len(group)
        me = group.index(self.peer_id)
        bounds = chunk_bounds(req.numel, self._codec(req.codec).block_size)
        parts = part_ranges(len(bounds), n)
        sizes = {c: bounds[c][1] - bounds[c][0] for c in parts[me]}
        session = self._session((req.fragment, req.round, ghash))
        codec = self._codec(req.codec)
        session.configure(codec, group, parts[me], sizes)
        self._refuse_other_views(session)
        extras = [float(x) for x in req.extras.tolist()]
        session.add(self.peer_id, req.weight, extras, {c: req.chunks[c] for c in parts[me]})
        session.maybe_reduce()

        async def own_part():
            return me, await session.done

        tasks = [own_part()] + [self._send_part(group[j], j, req, ghash, parts[j], extras)
                                for j in range(n) if j != me]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), self.round_timeout)
        except Exception as exc:
            session.fail(str(exc) or type(exc).__name__)
            sent, received = self.counters.by_round.pop((req.fragment, req.round), (0, 0))
            res = AverageResult.failed(f"{type(exc).__name__}: {exc}", own_weight=req.weight)
            res.bytes_sent, res.bytes_received = sent, received
            return res
        finally:
            asyncio.get_running_loop().call_later(self.round_timeout, self._sessions.pop, session.key, None)
        reduced: dict[int, bytes] = {}
        total_weight, avg_extras = 0.0, extras
        for _, (chunks, total, ex) in results:
            reduced.update(chunks)
            total_weight, avg_extras = total, ex
        if len(reduced) != len(bounds):
            return AverageResult.failed("incomplete group result", own_weight=req.weight)
        average = decode_chunks(codec, [reduced[c] for c in range(len(bounds))], req.numel)
        # Our reduced part may still be streaming to the others: wait (briefly) so the round's byte
        # count is complete; the result itself is already final.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(session.all_replied(n - 1), timeout=5.0)
        sent, received = self.counters.by_round.pop((req.fragment, req.round), (0, 0))
        return AverageResult(
            ok=True, average=average, extras=torch.tensor(avg_extras, dtype=torch.float32), group_size=n,
            total_weight=total_weight, own_weight=req.weight, bytes_sent=sent, bytes_received=received)

    async def _send_part(self, peer: str, index: int, req: AverageRequest, ghash: bytes, part: range,
                         extras: list[float]):
        from hivemind.p2p import PeerID

        header = swarm_pb2.AverageRequest(header=swarm_pb2.AverageHeader(
            fingerprint=self.fingerprint, fragment=req.fragment, round=req.round, group_hash=ghash,
            sender=self.peer_id, weight=req.weight, version=req.version, extras=extras,
            n_chunks=len(part), codec=req.codec))

        async def requests() -> AsyncIterator[swarm_pb2.AverageRequest]:
            self.counters.sent(peer, req.fragment, req.round, header.ByteSize())
            yield header
            for c in part:
                msg = swarm_pb2.AverageRequest(chunk=swarm_pb2.Chunk(index=c, data=req.chunks[c]))
                self.counters.sent(peer, req.fragment, req.round, msg.ByteSize())
                yield msg

        stream = await self.runtime.p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer), AVERAGE_HANDLER, requests(), swarm_pb2.AverageReply)
        first = await anext(stream, None)
        if first is None:
            raise RuntimeError(f"peer {peer[:12]} closed the stream without an answer")
        self.counters.received(peer, req.fragment, req.round, first.ByteSize())
        if not first.HasField("header") or not first.header.ok:
            raise RuntimeError(f"peer {peer[:12]} refused: {first.header.error or 'bad reply'}")
        chunks: dict[int, bytes] = {}
        async for msg in stream:
            self.counters.received(peer, req.fragment, req.round, msg.ByteSize())
            chunks[msg.chunk.index] = msg.chunk.data
        if set(chunks) != set(part):
            raise RuntimeError(f"peer {peer[:12]} sent {len(chunks)} of {len(part)} reduced chunks")
        return index, (chunks, first.header.total_weight, list(first.header.extras))

    def _codec(self, name: str) -> Codec:
        from node.core.codecs import get_codec

        return get_codec(name, self.codec.block_size) if name and name != self.codec.name else self.codec

    # ---- group disagreement: fail fast, never wait for a contribution that cannot come ----------
    def _not_in_round(self, fragment: int, round_: int) -> None:
        """Remember that this node takes no part in a round, so contributions to it fail at once."""
        self._skipped[(fragment, round_)] = time.monotonic()
        for key in [k for k, t in self._skipped.items() if t < time.monotonic() - 300]:
            del self._skipped[key]
        for (f, r, _), sess in list(self._sessions.items()):
            if f == fragment and r == round_:
                sess.fail("this peer is not in the round")

    def _local_view(self, fragment: int, round_: int) -> _Reduction | None:
        for (f, r, _), sess in self._sessions.items():
            if f == fragment and r == round_ and sess.configured.is_set():
                return sess
        return None

    def _refuse_other_views(self, mine: _Reduction) -> None:
        """Members that formed another group for this round will not contribute to ours: fail both."""
        fragment, round_, ghash = mine.key
        for (f, r, h), sess in list(self._sessions.items()):
            if f == fragment and r == round_ and h != ghash:
                sess.fail("group mismatch: members disagree on who is in this round")
                if mine.members & set(sess.contributions):
                    mine.fail("group mismatch: a member of our group formed another group")

    # ---- serving our part -----------------------------------------------------------------------
    def _session(self, key: tuple[int, int, bytes]) -> _Reduction:
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Reduction(key)
            self._prune()
        return session

    def _prune(self) -> None:
        horizon = time.monotonic() - 2 * (self.round_timeout + self.matchmaking_timeout)
        for key in [k for k, s in self._sessions.items() if s.created < horizon]:
            self._sessions.pop(key).fail("expired")

    async def _handle_average(self, requests: AsyncIterator[swarm_pb2.AverageRequest],
                              context) -> AsyncIterator[swarm_pb2.AverageReply]:
        try:
            async for reply in self._serve_part(requests, str(context.remote_id)):
                yield reply
        except Exception as exc:
            log.debug("average handler failed: %r", exc)
            yield swarm_pb2.AverageReply(header=swarm_pb2.ReduceHeader(ok=False, error=f"reducer error: {exc!r}"))

    async def _serve_part(self, requests: AsyncIterator[swarm_pb2.AverageRequest],
                          remote: str) -> AsyncIterator[swarm_pb2.AverageReply]:
        first = await anext(requests)
        h = first.header
        self.counters.received(remote, h.fragment, h.round, first.ByteSize())

        def error(text: str) -> swarm_pb2.AverageReply:
            reply = swarm_pb2.AverageReply(header=swarm_pb2.ReduceHeader(ok=False, error=text))
            self.counters.sent(remote, h.fragment, h.round, reply.ByteSize())
            return reply

        if not first.HasField("header"):
            yield error("expected a header first")
            return
        if h.fingerprint != self.fingerprint:
            text = f"swarm fingerprint mismatch: peer has {h.fingerprint}, this node {self.fingerprint}"
            self.refusals.append(f"{remote[:12]}: {text}")
            yield error(text)
            return
        chunks: dict[int, bytes] = {}
        async for msg in requests:
            self.counters.received(remote, h.fragment, h.round, msg.ByteSize())
            chunks[msg.chunk.index] = msg.chunk.data
        if len(chunks) != h.n_chunks:
            yield error(f"expected {h.n_chunks} chunks, got {len(chunks)}")
            return
        if (h.fragment, h.round) in self._skipped:
            yield error("this peer is not in the round (it arrived after the window or had no group)")
            return
        local = self._local_view(h.fragment, h.round)
        if local is not None and local.key[2] != bytes(h.group_hash):
            if h.sender in local.members:
                local.fail(f"group mismatch with {h.sender[:12]}")
            yield error("group mismatch: this reducer formed another group for the round")
            return
        session = self._session((h.fragment, h.round, bytes(h.group_hash)))
        session.add(h.sender, h.weight, list(h.extras), chunks)
        try:
            # This node must enter the round within the matchmaking window, or it is not a member.
            await asyncio.wait_for(session.configured.wait(), self.matchmaking_timeout + 2.0)
            if set(chunks) != set(session.part):
                session.fail(f"{h.sender[:12]} sent chunks of another part")
            reduced, total, extras = await asyncio.wait_for(asyncio.shield(session.done), self.round_timeout)
        except Exception as exc:
            session.fail(str(exc) or type(exc).__name__)
            yield error(f"round failed at reducer: {exc or type(exc).__name__}")
            return
        header = swarm_pb2.AverageReply(header=swarm_pb2.ReduceHeader(
            ok=True, total_weight=total, extras=extras, n_chunks=len(reduced)))
        self.counters.sent(remote, h.fragment, h.round, header.ByteSize())
        yield header
        for c in sorted(reduced):
            msg = swarm_pb2.AverageReply(chunk=swarm_pb2.Chunk(index=c, data=reduced[c]))
            self.counters.sent(remote, h.fragment, h.round, msg.ByteSize())
            yield msg
        await session.replied()
