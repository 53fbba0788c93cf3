"""The node (``Node``) that ``locoswarm run`` starts. The command's description and flags have one home, its
command line (``node/commands/run.py``; this module never imports it); this docstring says what the node does.

Config -> model/data -> inner loop -> outer core -> transport, for one volunteer:

1. start (or join) the swarm's DHT with retries; refuse a swarm whose fingerprint differs;
2. build the model and data; resume from the state dir's checkpoint, if any; when peers already hold
   outer state, download phi and momentum from them (spread over several peers) before training;
3. train: an inner AdamW step, then the outer core (``OuterLoop.advance``) on the swarm clock
   (swarm-wide progress from heartbeats, ``locoswarm.node.swarm.clock``: every node steers toward the median of
   the validated clocks, so all meet in the same rounds, each contribution weighted by its tokens);
   averaging runs on the network thread
   while training goes on; results merge between inner steps;
4. publish a heartbeat every ``network.heartbeat_interval`` (and ``status.json`` in the state dir);
   checkpoint atomically every ``--checkpoint-every`` steps;
5. on SIGTERM/Ctrl+C: wait (bounded) for in-flight rounds and merge them, publish a "leaving"
   heartbeat, checkpoint, stop the DHT and p2pd. A watchdog kills leftovers if the node is SIGKILLed.

With ``--nproc N`` (or torchrun) the node runs N ranks (``locoswarm.node.ranks``): rank 0 does all of the above,
the other ranks only inner steps; DDP averages their gradients, and rank 0 broadcasts theta after the
outer loop wrote it. A rank that dies makes rank 0 leave the swarm as above and exit non-zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import resource
import signal
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from locoswarm.node.checkpoint import load_checkpoint, save_checkpoint
from locoswarm.node.config import SwarmConfig, fingerprint
from locoswarm.node.core.compress import wire_codec
from locoswarm.node.core.judge import LossJudge
from locoswarm.node.core.outer_loop import OuterLoop, carry_steps
from locoswarm.node.core.schedule import ScheduleState
from locoswarm.node.core.state import outer_state_device, tensor_crc
from locoswarm.node.data import (
    TrainBatches,
    check_data_paths,
    eval_batches,
    evaluate,
    judge_batches,
    load_corpus,
    load_tokenizer,
)
from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import atomic_write_text, prepare_state_dir
from locoswarm.node.inner import InnerOptimizer
from locoswarm.node.model import build_meta_model, build_model, resolve_device
from locoswarm.node.partition import partition
from locoswarm.node.ranks import Command, RankFailure, RankGroup, ThetaSync, launched
from locoswarm.node.status import (
    ByteStatus,
    ConsensusStatus,
    EvalPoint,
    FragmentStatus,
    MemoryStatus,
    NodePeerStatus,
    NodeStatus,
    PeerReputation,
    ReputationStatus,
    Spread,
    StatusEvent,
)
from locoswarm.node.swarm import process, tamper
from locoswarm.node.swarm.clock import SwarmClock
from locoswarm.node.swarm.dht import check_port_free, join_command, maddr_port, start_dht, tcp_port_free, visible_maddrs
from locoswarm.node.swarm.membership import Membership, fragment_spread, heartbeat_age, pace_set, swarm_key
from locoswarm.node.swarm.reachability import (
    FIRST_CHECK_S,
    OUTBOUND_ONLY,
    PUBLIC,
    RECHECK_S,
    Reachability,
    ReachServer,
    keep_checking,
    peer_ids_of,
)
from locoswarm.node.swarm.reachability import check as check_reachability
from locoswarm.node.swarm.reputation import Reputation
from locoswarm.node.swarm.runtime import NetworkRuntime
from locoswarm.node.swarm.state_sync import StateClient, StateServer
from locoswarm.node.swarm.versions import Claim, absurd_version, believe, state_digest, version_bound
from locoswarm.node.swarm.view import SwarmView
from locoswarm.node.synthetic import SyntheticCompute, swarm_seed
from locoswarm.protocol import swarm_pb2

# For annotations only. The averaging transport, records, admission and the control server are imported where first
# used, for their start-up cost: every command's parser imports this module (``locoswarm --help`` takes about 3 s,
# torch's import), and they load hivemind, libp2p records, cryptography or grpc on top (``swarm.averaging`` alone
# about 1.2 s more, measured on the 2-core development machine); a node loads them in its first seconds anyway.
if TYPE_CHECKING:
    from hivemind import DHT

    from locoswarm.node.control.server import ControlServer
    from locoswarm.node.data import Corpus
    from locoswarm.node.fsutil import StateDirLock
    from locoswarm.node.partition import Fragment
    from locoswarm.node.swarm.admission import Admission
    from locoswarm.node.swarm.averaging import SwarmTransport
    from locoswarm.node.swarm.counters import ByteCounters
    from locoswarm.node.swarm.versions import Belief

log = logging.getLogger("locoswarm.node")

PORT_FILE = "listen_port"  # in the state dir: the libp2p port to listen on again after a restart
# Failed rounds a peer's token claim may carry, at least (its own max_carry is not ours to know).
MIN_CARRY_ALLOWANCE = 8
# A round that took this long (seconds) logs its timing: a slow one holds its fragment's next sync (late_window).
SLOW_ROUND_S = 1.0


@dataclass
class NodeOptions:
    """Node-local settings: flags and environment, never in peers.toml."""

    state_dir: Path
    data: list[str] = field(default_factory=list)
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    announce: list[str] | None = None  # multiaddrs peers should dial instead of the listen address
    reachability: str = "auto"     # auto (a dial-back check), public or outbound-only (swarm/reachability.py)
    bootstrap: list[str] | None = None
    bootstrap_attempts: int | None = None
    max_steps: int | None = None
    checkpoint_every: int = 200
    eval_every: int = 100
    eval_batches: int = 4
    throttle: float = 1.0          # >1 makes this node that many times slower (tests, demos)
    synthetic_step: float = 0.0    # >0: synthetic compute, seconds per inner step (benchmarks only; node/synthetic.py)
    threads: int | None = None
    config_path: str | None = None
    seed: int | None = None        # data sampling seed of this node (default: from its peer id)
    control_host: str = "127.0.0.1"
    control_port: int = 0          # gRPC control API (0 = off); see locoswarm.node.control
    control_port_default: bool = False  # not chosen by the user: if taken (another node), use any free port
    allow_remote_control: bool = False
    metrics_port: int = 0          # Prometheus text endpoint (0 = off)


class RoundPeriodWarning:
    """Warns once when a fragment's rounds come faster than one round's matchmaking window: h inner steps at the
    swarm's pace against ``SwarmTransport.window``. Rounds of one fragment then overlap, a failed round holds its
    node for the whole window while the others go on, and such a node drops progress and catches up in loops
    (several multi-process runs at h = 8 on the tiny preset: 0.15-0.5 s between rounds, a 3 s window)."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, h: int, step: float, window: float) -> bool:
        """Warn, unless warned before, if ``h`` inner steps of ``step`` seconds each (a step time not yet known is
        not finite or not positive) take less than ``window`` seconds; whether it warned now."""
        if self.warned or not (step > 0 and math.isfinite(step)) or h * step >= window:
            return False
        self.warned = True
        log.warning("[outer] h = %d: each fragment's round comes every %.2f s at the swarm's %.3f s per inner step, "
                    "shorter than a round's %.1f s matchmaking window; rounds will overlap, and a node held up by a "
                    "failed one falls behind. Set [outer] h >= %d, or a shorter [network] matchmaking_timeout",
                    h, h * step, step, window, math.ceil(2 * window / step))
        return True


class Node(SwarmView):
    """One swarm node, and its transport's view of the swarm (``SwarmView``: ``live_peers``, ``pace_peers``,
    ``latest_versions``, ...). ``ranks``: the node's process group when it runs over several GPUs or CPU ranks
    (``locoswarm.node.ranks``); None for a single process, which never touches ``torch.distributed``."""

    def __init__(self, cfg: SwarmConfig, opts: NodeOptions, ranks: RankGroup | None = None) -> None:
        self.cfg = cfg
        self.opts = opts
        self.ranks = ranks
        self.world = ranks.world_size if ranks else 1  # ranks training this node: its batch is world x a rank's
        self.theta_sync: ThetaSync | None = None  # with ranks: theta between rank 0 and the others (_prepare)
        self._inner_gathered_at = 0   # FSDP: the step of the moments in saved_inner (see _gather_inner)
        self.rank_failed = False
        self.fingerprint = fingerprint(cfg)
        self.stop = threading.Event()
        self._beat = threading.Event()  # wakes the heartbeat thread early (see _beat_soon)
        self.peer_table: dict = {}
        self.published: dict = {}
        self._digests: dict[int, bytes] = {}  # fragment -> digest of its published state (heartbeats)
        self.admission: Admission | None = None  # a closed swarm's rule (``_admit_self``); None: an open swarm
        self.certificate = b""
        self.state_server: StateServer | None = None  # built with the network (``_start_network``)

        self.reachability = Reachability(opts.reachability)  # checked when the network starts
        self.state = "starting"              # starting, training, leaving, stopped
        self.loss: float | None = None       # of the last inner step
        self.tokens_per_s = 0.0              # over the last few seconds, as heartbeats announce it
        self.events: list[StatusEvent] = []
        self._last_merge: dict[int, StatusEvent] = {}  # per fragment: its last merged round with peers
        self.eval_curve: list[tuple[int, float]] = []
        self.clock = 0
        self.local_step = 0
        self.tokens = 0
        self.started = time.time()
        self.compute_seconds = 0.0
        self.computed_steps = 0              # inner steps timed in compute_seconds (local_step may be resumed)
        self._rounds_from: float | None = None  # monotonic time from which we enter rounds
        self._realigned_at = -1    # slot of the last adaptive-schedule hint handled
        self._alone = False
        self._round_period = RoundPeriodWarning()  # once: rounds come faster than the matchmaking window
        # What the phases of ``run`` build, in order; None (or empty) until that phase ran. Whatever reads them
        # before (``status_snapshot``, ``_shutdown_network`` after a failed start) checks for None.
        # ``_prepare``: the state dir's lock (rank 0's), the training device
        self._state_lock: StateDirLock | None = None
        self.device: torch.device | None = None
        # ``_start_network``: the DHT and p2pd, this node's identity and addresses, membership, reachability
        self.dht: DHT | None = None
        self.runtime: NetworkRuntime | None = None
        self.peer_id = ""
        self.maddrs: list[str] = []
        self.swarm_key = ""
        self.membership: Membership | None = None
        self.reach_server: ReachServer | None = None
        # ``_load``: the data, the model and its fragments, the inner optimizer
        self.corpus: Corpus | None = None
        self.evals: list[torch.Tensor] = []
        self.model: torch.nn.Module | None = None
        self.train_model: torch.nn.Module | None = None
        self.fragments: list[Fragment] = []
        self.inner: InnerOptimizer | None = None
        self.saved_inner: InnerOptimizer | None = None
        # what an inner step runs: the inner optimizer's step, or synthetic compute (``_build``: it needs the seed)
        self._step: Callable[[list[torch.Tensor]], float | None] | None = None
        self.synthetic: SyntheticCompute | None = None
        # ``_build``: this node's data shard, the transport, the outer loop and the state client
        self.data_seed = 0
        self.batches: TrainBatches | None = None
        self.counters: ByteCounters | None = None
        self.reputation: Reputation | None = None
        self.swarm_clock: SwarmClock | None = None
        self.state_client: StateClient | None = None
        self.transport: SwarmTransport | None = None
        self.outer: OuterLoop | None = None
        # ``_start_control``, ``_start_heartbeats``, ``_join_or_resume``
        self.control: ControlServer | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self.initial_eval: float | None = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the node; 0 after a clean leave, 1 when one of its ranks failed (it left the swarm cleanly)."""
        if self.ranks is not None and not self.ranks.is_leader:
            return self._follow()

        if not launched():  # a launched rank stays in its launcher's process group (one killpg reaches all)
            process.become_group_leader()
        watchdog = process.start_watchdog()
        self._install_signal_handlers()
        try:
            self._prepare()  # everything a user can get wrong locally is checked before anything starts
            self._start_network()  # then the swarm's own verdict (a wrong swarm), before the data loads
            self._install_signal_handlers()  # hivemind may have replaced them
            self._load()
            self._build()
            self._start_control()
            meta = self._resume()  # before any heartbeat: peers never see a clock from before the checkpoint
            self._start_heartbeats()
            self._join_or_resume(meta)
            self._train_with_ranks()
            self._leave()
            return 1 if self.rank_failed else 0
        finally:
            self._shutdown_network()
            process.stop_watchdog(watchdog)
            if self.ranks is not None:
                self.ranks.close(failed=self.rank_failed)
            if self._state_lock is not None:
                self._state_lock.release()

    def _install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM: a graceful leave. A rank started by ``--nproc`` ignores SIGINT: a terminal's
        Ctrl+C reaches the whole group, and the launcher passes it on to rank 0 once (as SIGTERM)."""


        process.install_signal_handlers(self.stop, first_words=lambda: "leaving the swarm (Ctrl+C again to force)"
                                        if self.state == "training" else "stopping (Ctrl+C again to force)")
        if launched():
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _follow(self) -> int:
        """A rank > 0: no network, no state dir; rank 0's start, then inner steps until rank 0 says stop.
        It ignores SIGINT and SIGTERM (torchrun and a terminal signal every rank): it stops when rank 0 says
        so, or when rank 0 is gone (its next collective fails)."""


        assert self.ranks is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        cfg = self.cfg
        try:
            self._prepare()
            self._load()
            assert self.theta_sync is not None
            engine = self.ranks.engine
            seed, step = self.ranks.broadcast_start(0, 0, layout=self.theta_sync.layout())
            batches = TrainBatches(self.corpus.train, self.ranks.rank, self.world, cfg.inner.batch_size,
                                   cfg.inner.seq_len, seed)
            self.theta_sync.push_all()
            engine.push_inner(self.inner, self.inner)
            while (command := self.theta_sync.follow()) is not Command.STOP:
                if command is Command.STEP:
                    self._inner_step(batches.get(step))
                    step += 1
                elif command is Command.RESET_INNER:
                    self.inner.reset_state()
                elif command is Command.GATHER_INNER:
                    engine.pull_inner(self.inner, self.inner)  # rank 0's checkpoint
            self._log_digest(step)
            engine.pull_inner(self.inner, self.inner)  # rank 0's leave checkpoint
        except RankFailure as exc:
            log.error("%s: stopping", exc)
            self.rank_failed = True
            return 1
        finally:
            self.ranks.close(failed=self.rank_failed)
        log.info("rank %d stopped with rank 0 at step %d", self.ranks.rank, step)
        return 0

    def _start_network(self) -> None:

        o = self.opts
        bootstrap = o.bootstrap or []
        extra = {"announce_maddrs": list(o.announce)} if o.announce else {}
        client_mode = self.reachability.dht_client_mode(bool(bootstrap))

        def start(port: int, client_mode: bool) -> None:
            self.dht = start_dht(bootstrap, host=o.host, port=port, identity_path=o.state_dir / "identity.key",
                                 attempts=o.bootstrap_attempts, log=lambda line: log.warning(line), stop=self.stop,
                                 client_mode=client_mode, **extra)
            self.runtime = NetworkRuntime(self.dht)

        start(self._listen_port(), client_mode)
        self.peer_id = self.runtime.peer_id
        if o.reachability == "auto" and bootstrap:
            # Joined as a DHT client (safe either way); a node the check shows public restarts as a DHT server,
            # so that the DHT has servers beyond the swarm's first nodes.
            port = self._announced_port()
            self.reachability.take(self.runtime.call(check_reachability(self.runtime, peer_ids_of(bootstrap),
                                                                        port), timeout=60))
            log.info("reachability: %s (%d of %d peers that checked could dial port %d%s)",
                     self.reachability.state, self.reachability.verdict.reachable,
                     self.reachability.verdict.answered, port,
                     f", {self.reachability.verdict.no_answer} gave no answer" if self.reachability.verdict.no_answer
                     else "")
            if self.reachability.state != OUTBOUND_ONLY:
                self._restart_dht(start, maddr_port(visible_maddrs(self.dht)[0]) or 0)
        elif not bootstrap:
            self.reachability.assume(PUBLIC, "assumed: the swarm's first node, which peers join by dialling it")
        self.reach_server = ReachServer(self.runtime, self.reachability)
        self._tell_reachability()
        if o.reachability != OUTBOUND_ONLY:  # a router may change, and a first node is checked once peers come
            first = RECHECK_S if self.reachability.checked_at else FIRST_CHECK_S
            self.runtime.submit(keep_checking(self.runtime, self.reachability, self._dialable_peers,
                                              self._announced_port(), on_change=self._tell_reachability,
                                              first_after=first))
        self.membership = Membership(self.dht, self.cfg, self.peer_id, admission=self.admission,
                                     certificate=self.certificate)
        self.membership.check_fingerprint()
        self.membership.announce_fingerprint()
        self.swarm_key = swarm_key(self.cfg.swarm.name, self.fingerprint, "")
        self.maddrs = visible_maddrs(self.dht)
        self._remember_port()
        log.info("peer %s listening on %s", self.peer_id, " ".join(self.maddrs))
        if not bootstrap:
            log.info("started a new swarm %r (fingerprint %s); to join it from another machine run:\n  %s",
                     self.cfg.swarm.name, self.fingerprint, join_command(self.maddrs, o.config_path))

    def _tell_reachability(self) -> None:
        """Log (and record as an event) what this node's reachability means for it, once per state."""
        line = self.reachability.advice(self._announced_port())
        if line:
            self.record_event("reachability", line)  # logged as "reachability: ..."

    def _dialable_peers(self) -> list[str]:
        """Live peers whose heartbeats say peers can dial them (the checkers a dial-back asks; an outbound-only
        checker's answer would be as good, but those are most volunteers, and public ones know their own)."""

        return [p for p, hb in self.peer_table.items() if hb.reachability != OUTBOUND_ONLY and not hb.leaving]

    def outbound_peers(self) -> set[str]:
        """Live peers whose heartbeats say nobody can dial them: they serve no state and reduce no part."""

        return {p for p, hb in self.peer_table.items() if hb.reachability == OUTBOUND_ONLY}

    def _inbound_streams(self) -> int:
        """Streams peers opened to this node (averaging and state; an outbound-only node's stay 0)."""
        served = self.transport.streams_served()
        return served + (self.state_server.streams_served() if self.state_server is not None else 0)

    def _announced_port(self) -> int:
        """The TCP port peers should dial: the first ``--announce`` address's, else the one p2pd listens on."""

        for addr in [*(self.opts.announce or []), *visible_maddrs(self.dht)]:
            port = maddr_port(addr)
            if port:
                return port
        return 0

    def _restart_dht(self, start: Callable[[int, bool], None], port: int) -> None:
        """Stop the client-mode DHT and start it again as a DHT server on the same port and identity."""

        self.runtime.stop()
        self.dht.shutdown()
        deadline = time.monotonic() + 10.0
        while port and not tcp_port_free(self.opts.host, port) and time.monotonic() < deadline:
            time.sleep(0.1)  # p2pd lets go of the port when it has exited
        start(port if port and tcp_port_free(self.opts.host, port) else 0, False)
        if self.runtime.peer_id != self.peer_id:
            raise RuntimeError("the DHT came back with another peer id")

    def _listen_port(self) -> int:
        """``--port``, or (0: any) the port this state dir listened on last time when it is free: a restarted
        node keeps its address, so the join command it printed before still works."""

        o = self.opts
        if o.port:
            return o.port
        with contextlib.suppress(OSError, ValueError):
            port = int((o.state_dir / PORT_FILE).read_text().strip())
            if 0 < port < 65536:
                if tcp_port_free(o.host, port):
                    return port
                log.warning("port %d, where this node listened before, is taken now: listening on another one "
                            "(peers that bootstrap from the old address must use the new one below)", port)
        return 0

    def _remember_port(self) -> None:

        ports = {maddr_port(a) for a in self.maddrs} - {None}
        if len(ports) == 1:
            with contextlib.suppress(OSError):
                atomic_write_text(self.opts.state_dir / PORT_FILE, f"{ports.pop()}\n")

    def _prepare(self) -> None:
        """The checks of the local half, before any network and in seconds: the state dir, a closed swarm's
        certificate, a taken port, the device, the fragments the model splits into (on a ``meta`` copy: names
        without memory), the data's files and their first text. A bad flag or setting fails here, before a DHT
        starts or a join command prints; the data itself loads after the swarm accepted this node (``_load``)."""

        o, cfg = self.opts, self.cfg
        if self.ranks is None or self.ranks.is_leader:  # the state dir is rank 0's alone
            self._state_lock = prepare_state_dir(o.state_dir)
            self._admit_self()
            if o.port:  # a taken --port is told now, not after the data has loaded (tens of seconds)

                check_port_free(o.host, o.port)
        if o.threads:
            torch.set_num_threads(o.threads)
        self.device = self.ranks.resolve_device(o.device) if self.ranks else resolve_device(o.device)
        if self.ranks is not None:
            self.ranks.start(self.device)
        partition(build_meta_model(cfg.model, load_tokenizer(cfg.model.tokenizer).vocab_size), cfg.outer.fragments)
        check_data_paths(o.data, cfg.data)

    def _load(self) -> None:
        """The local half of the node: the data, the model and its fragments, the inner optimizer (tens of
        seconds for a large corpus: a wrong swarm is told before it, by ``_start_network``)."""

        o, cfg = self.opts, self.cfg
        tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.corpus = load_corpus(o.data, cfg.data, tokenizer)
        process.release_free_heap()  # what tokenizing the corpus allocated and freed
        log.info("data: %s", self.corpus.description)
        for warning in self.corpus.warnings:
            log.warning("data: %s", warning)
        model = build_model(cfg.model, tokenizer.vocab_size, seed=cfg.data.seed)
        # self.model is what the outer loop, evaluations and checkpoints see; self.train_model what the inner
        # steps run: the same module in one process; with ranks, the engine's (DDP: the bare model and its
        # DDP wrapper, one set of tensors; FSDP: rank 0's full CPU copy and the sharded module).
        if self.ranks is None:
            self.model = self.train_model = model.to(self.device)
        else:
            self.model, self.train_model = self.ranks.engine.place(model, self.device)
        self.fragments = partition(self.model, cfg.outer.fragments)
        if self.ranks is not None:
            self.theta_sync = ThetaSync(self.ranks, self.model, self.train_model, [f.names for f in self.fragments])
        self.inner = InnerOptimizer(self.train_model, cfg.inner)
        self._step = self.inner.step
        # What checkpoints save and load: the inner optimizer itself, unless its state is sharded over the
        # ranks (FSDP): then one over rank 0's full model, filled by the engine before each save.
        sharded = self.ranks is not None and self.ranks.engine.shards_optimizer
        self.saved_inner = InnerOptimizer(self.model, cfg.inner) if sharded and self.ranks.is_leader else self.inner
        self.evals = eval_batches(self.corpus.eval, cfg.inner.batch_size, cfg.inner.seq_len, o.eval_batches)

    def _admit_self(self) -> None:
        """A closed swarm (``[swarm] owner_key``): this node's certificate must admit its own peer id, checked
        before anything starts (``locoswarm.node.swarm.admission``)."""
        from locoswarm.node.swarm.admission import Admission
        from locoswarm.node.swarm.records import identity_key, peer_id_of

        s = self.cfg.swarm
        if not s.owner_key:
            return
        self.admission = Admission(s.owner_key, s.name)
        try:
            self.certificate = Path(s.certificate).read_bytes()
        except OSError as exc:
            raise UserError(f"[swarm] certificate {s.certificate}: {exc.strerror or exc}") from None
        me = peer_id_of(identity_key(self.opts.state_dir / "identity.key").get_public_key())
        why = self.admission.why_not(me, self.certificate)
        if why is not None:
            raise UserError(f"[swarm] certificate {s.certificate} is {why} for this node (peer {me}) in swarm "
                            f"{s.name!r}; ask the swarm's owner for one: locoswarm admit sign --peer-id {me} ...")

    def _build(self) -> None:
        """The networked half: this node's data shard (seeded by its peer id), the transport, the outer
        loop, the state server."""
        from locoswarm.node.swarm.averaging import SwarmTransport
        from locoswarm.node.swarm.counters import ByteCounters

        o, cfg = self.opts, self.cfg
        self.data_seed = o.seed if o.seed is not None else zlib.crc32(self.peer_id.encode())
        self.batches = TrainBatches(self.corpus.train, 0, self.world, cfg.inner.batch_size, cfg.inner.seq_len,
                                    self.data_seed)
        if o.synthetic_step > 0:  # benchmarks only: chosen here, once (the seeds are known now)
            self.synthetic = SyntheticCompute(self.inner, o.synthetic_step, common_seed=swarm_seed(self.fingerprint),
                                              node_seed=self.data_seed, clock=lambda: self.clock, stop=self.stop)
            self._step = self.synthetic.step
            log.warning("%s", self.synthetic.describe())
        codec = wire_codec(cfg.outer)  # what the reducers average (codec lowrank: its factors' block codec)
        self.counters = ByteCounters()
        rb = cfg.robust  # refusals and bans per peer
        self.reputation = Reputation(rb.ban_threshold, rb.ban_seconds, rb.ban_window,
                                     log=logging.getLogger("locoswarm.reputation"))
        # An impossible clock claim is ignored and counted as an offence; banned peers' clocks do not count.
        self.swarm_clock = SwarmClock(self.peer_id, cfg.network.heartbeat_interval, on_offence=self.reputation.refuse,
                                      is_banned=self.reputation.is_banned)
        numels = {f.index: f.numel for f in self.fragments}  # a download of another size is refused
        self.state_client = StateClient(self.runtime, self.fingerprint, self.counters,
                                        timeout=max(30.0, cfg.network.round_timeout), expected_numel=numels.get,
                                        on_bad=self.reputation.refuse, is_banned=self.reputation.is_banned,
                                        momentum=cfg.network.state_momentum)
        self.transport = SwarmTransport(
            self.runtime, swarm_key=self.swarm_key, fingerprint=self.fingerprint, codec=codec,
            group_size=cfg.network.group_size, matchmaking_timeout=cfg.network.matchmaking_timeout,
            round_timeout=cfg.network.round_timeout, view=self, states=self.state_client,
            robust=cfg.robust, reputation=self.reputation, standing_members=cfg.network.standing_members,
            admission=self.admission, certificate=self.certificate, reachability=self.reachability,
            counters=self.counters)
        judge = None
        if rb.effect_check:  # what a round's average would do to the model, on held-out data (core.judge)
            judge = LossJudge(self.model, judge_batches(self.corpus.eval, rb.judge_sequences, cfg.inner.seq_len),
                              self._outer_device(), relative_tolerance=rb.effect_tolerance,
                              health_slack=rb.health_slack)
        self.outer = OuterLoop(self.model, self.fragments, cfg.outer, self.transport, judge=judge,
                               expected_group_size=cfg.network.group_size,
                               wait_timeout=cfg.network.longest_round_s(),
                               state_device=outer_state_device(cfg.outer.offload, self._outer_device()),
                               theta_access=self.theta_sync)
        self.state_server = StateServer(
            self.runtime, self.fingerprint, self.published.get, self.counters,
            is_live=lambda peer: peer in self.peer_table, is_banned=self.reputation.is_banned,
            on_refused=self.reputation.refuse, max_streams_per_peer=cfg.robust.max_streams_per_peer,
            requests_per_minute=cfg.robust.state_requests_per_minute,
            clock=lambda: (self.clock, self.local_step), yield_to=self.transport.exchanging,
            confirm_live=self.membership.heard, is_member=self._trains,
            serve_bytes_per_s=cfg.robust.state_serve_mbit * 1e6 / 8, outbound_only=self.transport.outbound_only)

    def _start_control(self) -> None:
        """The control API (``locoswarm status``) and metrics, once there is a status to serve."""
        o = self.opts
        if o.control_port or o.metrics_port:
            from locoswarm.node.control.server import start_control_server

            self.control = start_control_server(self, o.control_host, o.control_port or None,
                                                o.allow_remote_control, metrics_port=o.metrics_port,
                                                any_port_if_taken=o.control_port_default)
            o.control_port = self.control.port  # what heartbeats announce

    def _resume(self) -> dict | None:
        """Load the state dir's checkpoint, if any; its meta (None without one)."""

        doc = load_checkpoint(self.opts.state_dir, model=self.model, inner=self.saved_inner, outer=self.outer,
                              fingerprint=self.fingerprint)
        meta = doc["meta"] if doc else None
        if meta:
            self.local_step = int(meta.get("local_step", 0))
            self.clock = int(meta.get("clock", 0))
            self.tokens = int(meta.get("tokens", 0))
            self.record_event("resumed", f"from checkpoint at step {self.local_step}, clock {self.clock}")
        return meta

    def _start_heartbeats(self) -> None:
        """Publish the first heartbeat now (a joiner is visible before it asks peers for state), then
        one every interval. We count as a member of rounds ("has_state") only once training starts."""
        self._beat_once()
        self._heartbeat_thread = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def _join_or_resume(self, meta: dict | None) -> None:
        self.peer_table = self._wait_for_peers()
        self.swarm_clock.observe_table(self.peer_table)
        plans = {f.index: self.latest_versions(f.index) for f in self.fragments}
        holders = sorted({p for belief in plans.values() for p in belief.holders})
        if holders:
            before = self.counters.total_received
            fetched = self.state_client.fetch_many({p: (b.holders, max(0, b.version), b.digest)
                                                    for p, b in plans.items()})
            got = self.counters.total_received - before  # the download's bytes (and a heartbeat's, if any)
            # Judged together: a resumed node far behind measured an honest swarm's fragment beside its own stale
            # ones at several times its own loss, one fragment at a time (``OuterLoop._land_staged``).
            refused = self.outer.adopt(list(fetched.values()), keep_progress=bool(meta))  # resumed: keeps progress
            for p, refusal in refused.items():
                snap = fetched.pop(p)
                if snap.source:
                    self.reputation.refuse(snap.source, "bad_state", refusal.reason, offence=refusal.offence,
                                           conclusive=refusal.conclusive, forgivable=False)
                self.record_event("refused",
                                  f"fragment {p} state from {snap.source[:12] or 'a peer'}: {refusal.reason}",
                                  fragment=p, version=snap.version)
            # The servers' clocks as they sent the state: fresher than their heartbeats, which a joiner's DHT
            # reads could not refresh while the download filled the links (a 5 Mbit/s bench run saw joiners
            # take clock 0, their holder's heartbeat gone stale, while the holder was at 214).
            for snap in fetched.values():
                if snap.clock is not None and snap.source:
                    self.swarm_clock.observe(snap.source, snap.clock, snap.inner_step, snap.seen)
            self.clock = self.swarm_clock.join(self.clock)
            self._adopt_schedule_state()
            self.record_event("joined", f"downloaded {len(fetched)}/{len(self.fragments)} fragments from "
                                        f"{len(holders)} peer(s) ({got / 1e6:.3f} MB, momentum in "
                                        f"{self.cfg.network.state_momentum}); swarm clock {self.clock}")
        else:
            self.clock = self.swarm_clock.join(self.clock)  # no peer trains: our own clock
        for p in range(self.outer.n_fragments):
            self._publish(p)
        self.initial_eval = self._evaluate()
        self.eval_curve = [(self.clock, self.initial_eval)]
        log.info("eval loss at start: %.4f", self.initial_eval)

    def _wait_for_peers(self) -> dict:
        """A joining node waits (briefly) until the peers' heartbeats are visible in the DHT."""
        peers = self.membership.peers()
        if self.opts.bootstrap:
            deadline = time.monotonic() + max(5.0, 4 * self.cfg.network.heartbeat_interval)
            while not peers and time.monotonic() < deadline and not self.stop.is_set():
                time.sleep(0.2)
                peers = self.membership.peers()
            if not peers:
                log.warning("no peer heartbeat seen yet: starting from the initial model; "
                            "outer state will be fetched from peers when they appear")
        return peers

    # ---- training ---------------------------------------------------------------------------------
    def _train_with_ranks(self) -> None:
        """Train; a failed rank (``RankFailure``) ends training here, and the caller leaves the swarm."""
        try:
            self._share_start()
            self._train()
        except RankFailure as exc:
            self.rank_failed = True
            if self.theta_sync is not None:
                self.theta_sync.broken(exc)  # the leave's drain moves nothing between the ranks any more
            log.error("%s", exc)
            self.record_event("rank_failed", "a rank of this node failed: leaving the swarm")

    def _share_start(self) -> None:
        """Rank 0's data seed, step, theta and inner optimizer state to the other ranks (after resume/join)."""
        if self.ranks is None:
            return
        assert self.theta_sync is not None
        self.ranks.broadcast_start(self.data_seed, self.local_step, layout=self.theta_sync.layout())
        self.theta_sync.push_all()
        self.ranks.engine.push_inner(self.saved_inner, self.inner)

    def _continue(self) -> bool:
        """Whether to make another inner step. With ranks, collective: rank 0's decision reaches every rank,
        after the fragments the outer loop wrote since the last call (``locoswarm.node.ranks``)."""
        o = self.opts
        stop = self.stop.is_set() or (o.max_steps is not None and self.local_step >= o.max_steps)
        if self.theta_sync is not None:
            if not stop:
                self.theta_sync.step()
            else:  # before the leave's drain, which may write theta on rank 0 alone
                self.theta_sync.stop()
                sync = self.theta_sync
                log.info("theta between the ranks: pushed %d and gathered %d parameters in %d steps (model %d)",
                         sync.pushed, sync.gathered, sync.steps, sum(p.numel() for p in self.model.parameters()))
                self._log_digest(self.local_step)
                self._gather_inner()  # for the leave checkpoint
        return not stop

    def _log_digest(self, step: int) -> None:
        """The parameters' digest as this rank stops: equal on every rank (tests and users compare the logs)."""
        assert self.ranks is not None
        log.info("rank %d stops at step %d with parameters crc32 %08x", self.ranks.rank, step,
                 self.ranks.engine.digest(self.model, self.train_model))

    def _inner_step(self, batch: torch.Tensor) -> float | None:
        """One inner step; its loss (None under synthetic compute, which has none)."""
        if self.ranks is None:
            return self._step([batch])
        with self.ranks.guard("an inner step"):  # the gradients' all-reduce: a dead rank fails it
            return self._step([batch])

    def _gather_inner(self) -> None:
        """The ranks' optimizer state and theta into rank 0's copies before a checkpoint (FSDP; else
        nothing)."""
        if self.theta_sync is not None:
            self.theta_sync.refresh()
            self.theta_sync.gather_inner(self.inner, self.saved_inner)
            self._inner_gathered_at = self.local_step

    def _outer_device(self) -> torch.device:
        """Where the outer model lives (FSDP: rank 0's full copy stays on the CPU)."""
        return next(self.model.parameters()).device

    def _train(self) -> None:

        o = self.opts
        self.state = "training"
        self._beat_soon()  # peers count us as a member of rounds from our next heartbeat: make it now
        last_log = time.monotonic()
        window_tokens, window_start = 0, time.monotonic()
        while self._continue():
            t0 = time.monotonic()
            batch = self.batches.get(self.local_step)
            loss = self._inner_step(batch)
            node_tokens = batch.numel() * self.world  # every rank trained a batch of this size
            self.local_step += 1
            self.tokens += node_tokens
            window_tokens += node_tokens
            step_time = time.monotonic() - t0
            self.compute_seconds += step_time
            self.computed_steps += 1
            if o.throttle > 1:
                time.sleep(step_time * (o.throttle - 1))
            prev = self.clock
            self.clock = self.swarm_clock.tick(self.local_step)
            if self.clock > prev:
                for ev in self.outer.advance(prev, self.clock, node_tokens):
                    self._on_sync(ev)
            else:  # ahead of the swarm's median: our clock waits for it, and nothing new is due
                self.outer.add_tokens(node_tokens)
            self._realign_schedule()
            self.loss = loss
            # no periodic evaluation of a synthetic model: its loss means nothing and costs the CPU the mode saves
            if o.eval_every and self.synthetic is None and self.local_step % o.eval_every == 0:
                self.eval_curve.append((self.clock, self._evaluate()))
            if o.checkpoint_every and self.local_step % o.checkpoint_every == 0:
                self._gather_inner()
                save_checkpoint(o.state_dir, model=self.model, inner=self.saved_inner, outer=self.outer,
                                meta=self._checkpoint_meta())
            now = time.monotonic()
            if now - window_start >= 5.0:
                self.tokens_per_s = window_tokens / (now - window_start)
                window_tokens, window_start = 0, now
            if now - last_log >= 10.0:
                last_log = now
                self._check_round_period()
                log.info("step=%d clock=%d loss=%s tok/s=%.0f peers=%d sent=%s", self.local_step, self.clock,
                         "synthetic" if loss is None else f"{loss:.3f}", self.tokens_per_s, len(self.peer_table),
                         self.counters.total_sent)

    def _check_round_period(self) -> None:
        """Once this node has taken two rounds' inner steps among peers, hold its round period at the swarm's pace
        against ``SwarmTransport.window`` (``RoundPeriodWarning``: a warning at most once)."""
        if self._round_period.warned or self.local_step < 2 * self.cfg.outer.h or not self.peer_table:
            return
        self._round_period.check(self.cfg.outer.h, self.step_time(), self.transport.window())

    def _on_sync(self, ev) -> None:
        if ev.kind in ("merged", "caught_up"):
            self._publish(ev.fragment)
        if ev.kind == "sent":
            return
        if ev.kind == "diverged":
            self.inner.reset_state()
            if self.theta_sync is not None:
                self.theta_sync.reset_inner()
        detail = f"fragment {ev.fragment} round v{ev.version}"
        # a slow round, merged or failed, holds its fragment's next sync (late_window): say how slow
        timing = (f" [matched in {ev.matchmaking_s:.1f} s, {ev.kind} after {ev.round_s:.1f} s]"
                  if ev.kind in ("merged", "failed") and ev.round_s >= SLOW_ROUND_S else "")
        if ev.kind == "merged" and ev.group_size == 1:
            # Alone in the swarm: an outer step on our own progress (see ``LonePolicy.solo``), counted by
            # the core (``OuterStats.solo_steps``) and announced once per stretch alone, so that it does not
            # flood the log and events.
            if not self._alone:
                self._alone = True
                self.record_event("alone", f"no live peer: outer steps on this node's own progress (from {detail}) "
                                           "until peers join", fragment=ev.fragment, version=ev.version)
            return
        if ev.kind == "merged":
            self._alone = False
            detail += f" group {ev.group_size} sent {ev.bytes_sent} B received {ev.bytes_received} B{timing}"
        elif (ev.kind in ("refused", "diverged", "dropped", "folded", "bounded", "catch_up_loop")
              or (ev.kind == "caught_up" and ev.error)):
            detail += f": {ev.error}"
        elif ev.kind == "failed":
            detail += f": {ev.error}{timing}"
            if ev.error.startswith("joining:"):  # expected for a second or so after joining; not news
                log.debug("%s", detail)
                return
            if not self.peer_table:  # alone in the swarm: every round fails; not news
                log.debug("%s", detail)
                return
        self.record_event(ev.kind, detail, fragment=ev.fragment, round=ev.round, bytes_sent=ev.bytes_sent,
                          bytes_received=ev.bytes_received, group_size=ev.group_size, version=ev.version,
                          own_weight=ev.own_weight, total_weight=ev.total_weight,
                          matchmaking_s=ev.matchmaking_s or None, round_s=ev.round_s or None)

    def _evaluate(self) -> float:

        if self.theta_sync is not None:
            self.theta_sync.refresh()
        return evaluate(self.model, self.evals, self._outer_device())

    def _publish(self, fragment: int) -> None:
        """An immutable snapshot for the state server (read from the network thread), and its digest for the
        heartbeats (``locoswarm.node.swarm.versions.state_digest``)."""

        snap = tamper.installed().published(self.outer.snapshot(fragment), self.outer)
        self._digests[fragment] = state_digest(snap.phi, snap.momentum)
        self.published[fragment] = snap

    def _adopt_schedule_state(self) -> None:
        """When joining, start the adaptive schedule from a peer's state (last sends, the summed R),
        as its heartbeat tells it: usually right, and a slot's matchmaking corrects it otherwise
        (see ``_realign_schedule``)."""
        if not self.outer.schedule.adaptive:
            return
        donors = [hb for hb in self.peer_table.values() if hb.has_state and hb.fragments]
        if not donors:
            return
        donor = min(donors, key=lambda hb: hb.peer_id)  # the leader rule of the slots' matchmaking
        last_send = list(self.outer.schedule_state().last_send)
        for fs in donor.fragments:
            if 0 <= fs.fragment < len(last_send):
                last_send[fs.fragment] = None if fs.last_send < 0 else int(fs.last_send)
        shared_r = tuple(float(x) for x in donor.shared_r) if len(donor.shared_r) == len(last_send) else None
        self.outer.set_schedule_state(ScheduleState(tuple(last_send), shared_r))

    def _realign_schedule(self) -> None:
        """Adopt the slot leader's adaptive-schedule state when a slot showed that our picks differ
        (``SwarmTransport.schedule_hint``); a hint older than our own latest send is left for a newer one."""
        hint = self.transport.schedule_hint
        if hint is None or hint.round <= self._realigned_at:
            return
        self._realigned_at = hint.round
        if any(t is not None and t > hint.round for t in self.outer.schedule_state().last_send):
            return
        self.outer.adopt_schedule(hint.state, hint.fragment, hint.round)
        self.record_event("realigned", f"adaptive schedule: took the state of slot leader {hint.leader[:12]} "
                                       f"at slot {hint.round}")

    # ---- the swarm as the transport sees it (SwarmView) -------------------------------------------------
    def live_peers(self) -> list[str]:
        """Peers whose heartbeats say they train: every round's candidates."""
        return [p for p, hb in self.peer_table.items() if hb.has_state]

    def pace_peers(self) -> list[str]:
        """Live peers that keep the swarm's pace (``membership.pace_set``: the same set on every member),
        the ones a round waits for."""

        rates = {p: float(hb.tokens_per_s) for p, hb in self.peer_table.items() if hb.has_state}
        rates[self.peer_id] = self.tokens_per_s  # as our heartbeat announces it
        return sorted(pace_set(rates) - {self.peer_id})

    def straggler_grace(self) -> float:
        """How long a round may wait for peers outside the pace set without stalling training: the
        overlap tau, in steps at the swarm's inner-step rate (the median of the announced rates, about
        the same on every member, so members cut stragglers at about the same moment); this node's own
        step time while no rate is known."""
        return max(0.05, 0.8 * self.cfg.outer.tau * self.step_time())

    def step_time(self) -> float:
        """Seconds per inner step of the swarm (its clock's rate), this node's own while none is known."""
        rate = self.swarm_clock.rate()
        if rate and rate > 0 and math.isfinite(rate):
            return 1.0 / rate
        return self.compute_step_time()

    def compute_step_time(self) -> float:
        """Seconds this node computes per inner step (throttled as it trains), without its waits for rounds."""
        return self.compute_seconds / self.computed_steps * self.opts.throttle if self.computed_steps else 0.0

    def _trains(self, peer: str) -> bool:
        """Whether ``peer`` is a member that trains (its heartbeat has state): served state first."""
        hb = self.peer_table.get(peer)
        return hb is not None and hb.has_state

    def joining_peers(self) -> list[str]:
        """Peers joining now by their heartbeats: no state yet. A lone node takes no solo step meanwhile, so the
        state they download stays the newest (``LonePolicy.joiner_waited_for``)."""
        return [p for p, hb in self.peer_table.items() if not hb.has_state]

    def serving_peers(self) -> list[str]:
        """Peers this node serves a state download now (they show before the downloader's heartbeat reaches
        this node's table); no solo step while one lasts (``LonePolicy.joiner_waited_for``)."""
        return self.state_server.downloading_peers() if self.state_server is not None else []

    def version_bound(self) -> int:
        """The most outer versions a fragment can hold at the swarm's clock (``locoswarm.node.swarm.versions``)."""

        o = self.cfg.outer
        sends = 1 if o.schedule == "fixed" else (o.sends_per_h or o.fragments)
        return version_bound(max(self.clock, self.swarm_clock.estimate()), o.h, sends)

    def latest_versions(self, fragment: int) -> Belief:
        """The version of ``fragment`` to believe among the peers' heartbeats, and the holders to take it from
        (``locoswarm.node.swarm.versions``): at most what the swarm clock allows (a claim far above it is an
        offence), corroborated by a second claimant, from the holders that announce the digest most of them
        do. A banned peer's claims do not count, nor those of a peer that served this node a state it refused
        lately (``Reputation.offended``: colluding liars corroborate each other's claims), nor a claim its own
        rounds contradict (``RoundClaims``: a claim of a state it does not hold); its claimant is banned after
        ``LIES_BAN`` such claims that its rounds never backed (``RoundClaims.liar``)."""

        bound = self.version_bound()
        round_claims = self.transport.round_claims
        claims: dict[str, Claim] = {}
        now = time.monotonic()
        # a claim dates from its heartbeat's publication (RoundClaims.doubted), at most two intervals back: a peer
        # table read that late (a DHT failure keeps the last one) is no evidence of when it was published
        reach = 2.0 * self.cfg.network.heartbeat_interval
        for pid, hb in self.peer_table.items():
            if not hb.has_state or self.reputation.is_banned(pid):
                continue
            # Not believed, but still held against its rounds below: a state liar that served one bad state was
            # otherwise never caught lying, and was not banned (CI, the ``statenoise`` node attack).
            offended = self.reputation.offended(pid, "bad_state")
            for fs in hb.fragments:
                if fs.fragment != fragment:
                    continue
                if absurd_version(int(fs.version), bound):
                    self.reputation.refuse(pid, "version_lie", f"heartbeat claims version {fs.version} of fragment "
                                                               f"{fragment}; the swarm clock allows {bound}")
                    continue
                published = now - min(heartbeat_age(hb), reach)
                if round_claims.doubted(fragment, pid, int(fs.version), now, published):
                    if lies := round_claims.liar(pid, now):
                        told = ", ".join(f"{n} of fragment {f}" for f, n in lies.items())
                        self.reputation.refuse(pid, "version_claim", f"{sum(lies.values())} heartbeat claims ({told}) "
                                               "that its own rounds never backed", conclusive=True)
                    continue
                if not offended:
                    claims[pid] = Claim(int(fs.version), bytes(fs.digest))
        # Nobody can dial an outbound-only holder: the version to take is the newest that peers one can download
        # from hold (a version only outbound-only peers hold reaches the others through their rounds instead).
        outbound = self.outbound_peers()
        return believe({p: c for p, c in claims.items() if p not in outbound}, bound=bound)

    def kin(self, peer: str, fragment: int) -> bool:
        """Whether ``peer``'s heartbeat announces this node's published state of every fragment but ``fragment``:
        the same digest at the same version, or a version one apart (``FragmentSnapshot.kin``)."""
        hb = self.peer_table.get(peer)
        if hb is None:
            return False
        theirs = {int(fs.fragment): (int(fs.version), bytes(fs.digest)) for fs in hb.fragments}
        for p, snap in list(self.published.items()):  # read from the fetch thread; published may be replaced
            if p == fragment:
                continue
            version, digest = theirs.get(p, (-1, b""))
            if abs(version - snap.version) > 1 or (version == snap.version and digest != self._digests.get(p)):
                return False
        return True

    def max_weight(self, peer: str, own_weight: float) -> float:
        """The most tokens ``peer`` can claim in a round where this node claims ``own_weight``: what it
        trains in the same time at its announced throughput (at most 64x ours), times the screening's
        slack. A peer without a heartbeat gets the slack alone.

        "The same time" is at least a whole carry: a claim covers the tokens since the peer's last
        merged round, which after failed rounds is up to ``max_carry + 1`` send intervals of ``h`` steps.
        Our own weight alone is no measure of that: right after this node joined, caught up or dropped
        its carry it claims a step or two, and an honest peer's normal claim was then refused as absurd
        (an offence: a fresh-clone CI run saw an honest joiner banned that way)."""
        slack = self.cfg.robust.weight_factor
        steps = carry_steps(self.cfg.outer.h, max(self.cfg.outer.max_carry, MIN_CARRY_ALLOWANCE))
        whole_carry = float(self.cfg.inner.batch_size * self.cfg.inner.seq_len * self.world * steps)
        base = max(own_weight, whole_carry)
        hb = self.peer_table.get(peer)
        own_rate = self.tokens_per_s
        if hb is None or own_rate <= 0 or not math.isfinite(hb.tokens_per_s):
            return slack * base
        return slack * base * min(64.0, max(1.0, hb.tokens_per_s / own_rate))

    # ---- heartbeats and status --------------------------------------------------------------------
    def _heartbeat(self, leaving: bool = False) -> swarm_pb2.Heartbeat:
        from hivemind.utils import get_dht_time

        schedule = self.outer.schedule_state()
        heartbeat = swarm_pb2.Heartbeat(
            peer_id=self.peer_id, addrs=self.maddrs[:4], fingerprint=self.fingerprint, clock=self.clock,
            inner_step=self.local_step, tokens=self.tokens, tokens_per_s=self.tokens_per_s,
            loss=float(self.loss or 0.0), fragments=self._fragment_statuses(), time=get_dht_time(), leaving=leaving,
            has_state=self.state == "training", control_port=self.opts.control_port,
            shared_r=list(schedule.shared_r or ()), reachability=self.reachability.state)
        return tamper.installed().heartbeat(heartbeat, self.outer)

    def _fragment_statuses(self) -> list[swarm_pb2.FragmentStatus]:
        """Per published fragment: version, phi's hash and norm, last send (the heartbeat's part; hashing
        every phi is not free for a large model, so a status builds it once)."""
        last_send = self.outer.schedule_state().last_send
        return [swarm_pb2.FragmentStatus(fragment=p, version=snap.version, phi_hash=tensor_crc(snap.phi),
                                         phi_norm=float(snap.phi.norm()),
                                         last_send=-1 if last_send[p] is None else last_send[p],
                                         digest=self._digests.get(p, b""))
                for p, snap in sorted(self.published.items())]

    def _heartbeats(self) -> None:
        interval = self.cfg.network.heartbeat_interval
        while not self.stop.is_set():
            next_beat = time.monotonic() + interval
            # At most one early beat per 0.2 s: a burst of requests must not turn into DHT traffic.
            self.stop.wait(min(0.2, interval))
            self._beat.wait(max(0.0, next_beat - time.monotonic()))
            self._beat.clear()
            if not self.stop.is_set():
                self._beat_once()

    def _beat_once(self) -> None:
        """Publish our heartbeat, refresh the peer table (and the swarm clock's view of it), write status."""
        interval = self.cfg.network.heartbeat_interval
        try:
            hb = self._heartbeat()
            self.membership.publish(hb)
            if hb.has_state and self._rounds_from is None:
                # Peers refresh their tables every interval: after 1.5 of them, all count us in.
                self._rounds_from = time.monotonic() + 1.5 * interval
            self.peer_table = self.membership.peers()
            self.swarm_clock.observe_table(self.peer_table)
            self.write_status()
        except Exception as exc:
            log.warning("heartbeat failed: %s", exc)

    def in_rounds(self) -> bool:
        """Whether rounds may count on every peer knowing us (``SwarmView.in_rounds``);
        with no peer at all there is nobody to disagree, and a lone node's rounds are its own."""
        if not self.peer_table:
            return True
        return self._rounds_from is not None and time.monotonic() >= self._rounds_from

    def _beat_soon(self) -> None:
        """Publish a heartbeat and refresh the peer table now instead of at the next interval."""
        self._beat.set()

    def record_event(self, kind: str, detail: str, **fields) -> None:
        """Record an event (``fields``: those of :class:`StatusEvent`) and log it."""
        entry = StatusEvent(time=time.time(), kind=kind, detail=detail, clock=self.clock, **fields)
        self.events.append(entry)
        del self.events[:-200]
        if kind == "merged" and entry.fragment is not None:
            self._last_merge[entry.fragment] = entry
        log.info("%s: %s", kind, detail)

    def status_snapshot(self) -> NodeStatus:
        """The node's status now: what ``status.json`` holds and the control API serves (``locoswarm.node.status``)."""
        now = time.time()
        if self.outer is None:  # not built yet
            return NodeStatus(peer_id=self.peer_id, addrs=list(self.maddrs), state=self.state, now=now)

        own = self._fragment_statuses()
        spread: dict[int, dict] = {}
        with contextlib.suppress(Exception):
            spread = fragment_spread(self.peer_table, own)
        uptime = now - self.started
        stats, counters = self.outer.stats, self.counters
        reputation = ReputationStatus.from_json(self.reputation.snapshot())
        return NodeStatus(
            peer_id=self.peer_id, fingerprint=self.fingerprint, swarm=self.cfg.swarm.name, addrs=list(self.maddrs),
            pid=os.getpid(), uptime_s=uptime, clock=self.clock, inner_step=self.local_step, tokens=self.tokens,
            state=self.state, loss=self.loss, tokens_per_s=self.tokens_per_s,
            compute_utilization=self.compute_seconds / uptime if uptime else 0.0,
            eval_curve=[EvalPoint(clock, loss) for clock, loss in self.eval_curve],
            fragments=self._fragments_status({fs.fragment: fs for fs in own}, spread),
            peers=self._peers_status(reputation),
            syncs_ok=stats.syncs_ok - stats.solo_steps, syncs_failed=stats.syncs_failed, catch_ups=stats.catch_ups,
            catch_up_loops=stats.catch_up_loops, replays=stats.replays, stalls_cut=stats.stalls_cut,
            solo_steps=stats.solo_steps,
            effect_checks=stats.effect_checks, effect_refused=stats.effect_refused,
            contested_checks=stats.contested_checks,
            strangers=self.admission.strangers if self.admission is not None else 0,
            standing_rounds=self.transport.standing_rounds(),
            consensus=ConsensusStatus(rounds=stats.consensus_rounds, last_shift=stats.last_consensus_shift,
                                      failed=stats.consensus_failed, last_error=stats.last_consensus_error),
            memory=self._memory(),
            reachability=dataclasses.replace(self.reachability.status(), inbound_streams=self._inbound_streams(),
                                             undialable=self.transport.undialable()),
            bytes=ByteStatus(sent=counters.total_sent, received=counters.total_received,
                             sent_by_peer=dict(counters.sent_by_peer),
                             received_by_peer=dict(counters.received_by_peer),
                             sent_by_fragment=dict(counters.sent_by_fragment),
                             received_by_fragment=dict(counters.received_by_fragment)),
            refusals=list(self.transport.refusals)[-20:],
            reputation=reputation,
            events=self.events[-50:], now=now, control_port=self.opts.control_port,
            metrics_port=self.opts.metrics_port, synthetic_step_s=self.opts.synthetic_step)

    def _memory(self) -> MemoryStatus:
        """This process's memory now (``/proc/self/statm``), its peak (``getrusage``), and PyTorch's allocator
        on a CUDA training device: what a user sizes a preset and ``[outer] offload`` by."""

        rss = 0
        with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        device = self.device
        out = MemoryStatus(rss=rss, peak_rss=max(peak, rss), device="" if device is None else str(device))
        if device is not None and device.type == "cuda":
            out = dataclasses.replace(out, device_allocated=int(torch.cuda.memory_allocated(device)),
                                      device_peak=int(torch.cuda.max_memory_allocated(device)),
                                      device_total=int(torch.cuda.get_device_properties(device).total_memory))
        return out

    def _fragments_status(self, own: dict[int, swarm_pb2.FragmentStatus],
                          spread: dict[int, dict]) -> list[FragmentStatus]:
        """Per fragment: the outer loop's figures, phi's hash and norm as published (``own``: the heartbeat's
        ``FragmentStatus`` by fragment), bytes, the last merged round, the spread across peers."""
        out = []
        for f in self.outer.fragment_status():
            p, fs, merge = f["fragment"], own.get(f["fragment"]), self._last_merge.get(f["fragment"])
            out.append(FragmentStatus(
                fragment=p, version=f["version"], numel=f["numel"], last_send=f["last_send"],
                quant_error=f["quant_error"], phi_hash=None if fs is None else int(fs.phi_hash),
                phi_norm=None if fs is None else float(fs.phi_norm),
                bytes_sent=self.counters.sent_by_fragment.get(p, 0),
                bytes_received=self.counters.received_by_fragment.get(p, 0),
                group_size=0 if merge is None else merge.group_size,
                last_merge_time=None if merge is None else merge.time,
                last_merge_clock=None if merge is None else merge.clock,
                spread=Spread.from_json(spread[p]) if p in spread else None, ranks=list(f.get("ranks", ()))))
        return out

    def _peers_status(self, reputation: ReputationStatus) -> dict[str, NodePeerStatus]:
        """The live peers from their heartbeats, with this node's bytes to and from each and its judgement."""
        out = {}
        for pid, hb in self.peer_table.items():
            judged = reputation.peers.get(pid, PeerReputation())
            out[pid] = dataclasses.replace(
                NodePeerStatus.from_heartbeat(hb), bytes_sent=self.counters.sent_by_peer.get(pid, 0),
                bytes_received=self.counters.received_by_peer.get(pid, 0), refused=judged.refused,
                banned=judged.banned)
        return out

    def write_status(self) -> None:
        """Write :meth:`status_snapshot` to ``status.json`` in the state directory now (atomically)."""
        atomic_write_text(self.opts.state_dir / "status.json", json.dumps(self.status_snapshot().to_json(), indent=1))

    def _checkpoint_meta(self) -> dict:
        return {"fingerprint": self.fingerprint, "local_step": self.local_step, "clock": self.clock,
                "tokens": self.tokens, "peer_id": self.peer_id, "time": time.time()}

    # ---- leaving ----------------------------------------------------------------------------------
    def _leave(self) -> None:

        self.state = "leaving"
        log.info("leaving: finishing %d in-flight round(s)", self.outer.in_flight())
        for ev in self.outer.drain(self.clock):
            self._on_sync(ev)
        if self.rank_failed and self.saved_inner is not self.inner:
            log.warning("a rank failed: the leave checkpoint holds the AdamW moments of step %d (the last "
                        "gathered), theta as rank 0 last gathered each fragment, and the outer state of step %d",
                        self._inner_gathered_at, self.local_step)
        save_checkpoint(self.opts.state_dir, model=self.model, inner=self.saved_inner, outer=self.outer,
                        meta=self._checkpoint_meta())
        self.stop.set()
        self._beat.set()
        try:
            self.membership.publish(self._heartbeat(leaving=True))
        except Exception as exc:
            log.warning("could not announce leaving: %s", exc)
        self.state = "stopped"
        self.write_status()
        log.info("left the swarm cleanly at step %d (checkpoint saved)", self.local_step)

    def _shutdown_network(self) -> None:
        self.stop.set()
        self._beat.set()
        for closing in (self.control, self.transport):
            if closing is not None:
                closing.close()
        if self.runtime is not None:
            self.runtime.stop()
        if self.dht is not None:
            self.dht.shutdown()
