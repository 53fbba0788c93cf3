"""One node over several GPUs (or CPU ranks): PyTorch's own data parallelism inside a swarm node.

A node started with ``--nproc N`` (or under ``torchrun --nproc-per-node N``) runs N ranks of one
process group (NCCL on GPUs, gloo on CPU). Inner steps are plain DDP (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training"): every rank computes gradients on its
own batch, the backward pass all-reduces (averages) them, and the replicated AdamW steps keep every
rank's parameters bit-identical. The swarm sees one peer: rank 0 alone holds the DHT, the outer loop,
the control server, checkpoints and heartbeats; the node's batch is N times a rank's batch.

The one thing DDP does not replicate is the outer loop: a merge, a catch-up or a join writes theta on
rank 0 only. Between two inner steps the other ranks therefore wait for rank 0's commands
(:class:`Command`, one small broadcast each) and carry them out together with it:

- ``PUSH p``: rank 0's parameters of fragment ``p`` to every rank (the outer loop wrote them);
- ``GATHER p``: the ranks' latest parameters of fragment ``p`` into rank 0's outer copy (FSDP, below:
  the outer loop is about to read them);
- ``RESET_INNER``: every rank forgets its AdamW moments (rank 0's outer loop saw theta diverge);
- ``GATHER_INNER``: the sharded AdamW state into rank 0's copy, for a checkpoint (FSDP);
- ``STEP``: every rank makes one inner step; ``STOP``: every rank stops.

:class:`ThetaSync` is rank 0's side of it: the outer loop reports each read and write of a fragment's
theta (``locoswarm.node.core.state.ThetaAccess``), and a fragment moves between the ranks only when it
was written (pushed before the next step) or is read while rank 0's copy lags the ranks (gathered
then). A step's cost is one command broadcast; the outer loop's syncs move only their own fragment.

At the start rank 0 broadcasts the data seed and step counter (``broadcast_start``), the parameters and
its inner optimizer state (resumed from its checkpoint or fresh): the ranks start from rank 0's state.

How the ranks hold the model is an engine chosen once (``--parallel``, :data:`ENGINES`):

- :class:`DDPEngine` (default): every rank holds the whole model and AdamW state; the outer loop on
  rank 0 works on the very tensors DDP trains.
- :class:`FSDPEngine`: PyTorch FSDP2 (``fully_shard``; Zhao et al. 2023, "PyTorch FSDP: Experiences on
  Scaling Fully Sharded Data Parallel"): each rank holds 1/N of the parameters, gradients and AdamW
  moments, for a model whose training state does not fit one device. Rank 0 also keeps one full copy
  of theta on the CPU for the outer loop, evaluations and checkpoints. After every inner step the ranks
  gather the new parameters into it, one tensor at a time (peak extra device memory: the largest
  tensor) for the fragments the outer loop reads (``GATHER``), and before an evaluation or a
  checkpoint for all of them; a merge scatters its fragment back (``PUSH``). For a checkpoint the
  moments are gathered the same way (``GATHER_INNER``).
Until then the other ranks wait on the rendezvous store, not in a collective: rank 0 may take as long
as it needs to join the swarm (bootstrap retries, a state download), yet its death is noticed at once.

A rank that dies breaks the next collective (gloo reports a reset connection at once; a finite
``timeout`` bounds the rest): the survivors raise :class:`RankFailure`, rank 0 leaves the swarm in the
usual way and exits non-zero. :class:`RankLauncher` (``--nproc``) also watches its ranks and SIGTERMs
rank 0 (a graceful leave) when another rank dies.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from locoswarm.node.inner import InnerOptimizer

from locoswarm.node.core.state import tensor_crc
from locoswarm.node.errors import UserError
from locoswarm.node.model import resolve_device
from locoswarm.node.swarm.process import die_with_parent

LAUNCHED_ENV = "LOCOSWARM_LAUNCHED"  # set by RankLauncher: the ranks leave signal handling to the launcher
# Keys of the rendezvous store, per torchrun restart (its agent's store outlives a restart of the ranks):
_START_KEY = "locoswarm/{restart}/start"    # set by rank 0 when it has joined the swarm
_CLOSED_KEY = "locoswarm/{restart}/closed"  # counts the ranks > 0 that left the process group (see close)


class RankFailure(RuntimeError):
    """A collective of the node's ranks failed: a rank died or hung."""


class Command(enum.IntEnum):
    """What rank 0 tells the other ranks between two inner steps (see the module docstring)."""

    STEP = 0
    STOP = 1
    PUSH = 2          # argument: the fragment (ALL: every parameter)
    GATHER = 3        # argument: the fragment (ALL: every parameter)
    RESET_INNER = 4
    GATHER_INNER = 5


ALL = -1  # a PUSH or GATHER of every parameter


class RankGroup:
    """The process group of one node's ranks (DDP inside a swarm node; see the module docstring).

    Args:
        rank, world_size, local_rank: as torchrun sets them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
        timeout_s: how long a collective may wait for a rank before it fails (``locoswarm run --rank-timeout``).
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, timeout_s: float,
                 parallel: str = "ddp") -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise UserError(f"rank {rank} of world size {world_size}: need a world size >= 2 and 0 <= rank < it")
        if parallel not in ENGINES:
            raise UserError(f"--parallel {parallel!r} is not allowed; use one of {', '.join(ENGINES)}")
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.timeout_s = timeout_s
        self.engine: ParallelEngine = ENGINES[parallel](self)
        self.device = torch.device("cpu")
        self._started = False
        self._store: TCPStore | None = None
        self._start_key = self._closed_key = ""  # set by start()

    @classmethod
    def from_env(cls, timeout_s: float, parallel: str = "ddp") -> RankGroup | None:
        """The group torchrun (or :class:`RankLauncher`) describes in the environment; None for a
        single-process node (no ``WORLD_SIZE``, or 1)."""
        env = os.environ
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError as exc:
            raise UserError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers ({exc}); "
                            "start the node with --nproc N or torchrun") from None
        return None if world <= 1 else cls(rank, world, local, timeout_s, parallel)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that joins the swarm."""
        return self.rank == 0

    def resolve_device(self, spec: str) -> torch.device:
        """This rank's device: ``auto`` and ``cuda`` mean ``cuda:LOCAL_RANK`` when CUDA exists (one GPU
        per rank), ``cpu`` the CPU."""
        value = (spec or "").strip().lower()
        if value in ("auto", "cuda") and torch.cuda.is_available():
            value = f"cuda:{self.local_rank}"
        return resolve_device(value)

    def start(self, device: torch.device) -> None:
        """Join the process group (rendezvous at ``MASTER_ADDR:MASTER_PORT``): NCCL on GPUs, gloo on CPU."""
        import torch.distributed as dist

        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        with self._collective("joining the process group"):
            # Our own handle on the rendezvous store: the other ranks wait on it for rank 0's start.
            # Under torchrun its agent serves the store at MASTER_ADDR:MASTER_PORT and every rank is a client
            # (what torch's own rendezvous does); under --nproc rank 0 serves it.
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            self._store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                        int(os.environ.get("MASTER_PORT", "29500")), self.world_size,
                                        self.is_leader and not agent, timeout=timeout)
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._start_key, self._closed_key = _START_KEY.format(restart=restart), _CLOSED_KEY.format(restart=restart)
            dist.init_process_group(backend, store=self._store, rank=self.rank, world_size=self.world_size,
                                    timeout=timeout)
        self._started = True

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` for the inner steps: DDP averages the gradients over the ranks in backward. The outer
        loop keeps the bare model (the parameters are the same tensors)."""
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def command(self, command: Command = Command.STEP, arg: int = 0) -> tuple[Command, int]:
        """Rank 0's ``(command, arg)`` on every rank (the other ranks' arguments are ignored)."""
        import torch.distributed as dist

        t = torch.tensor([int(command), arg], dtype=torch.int64, device=self.comm_device())
        with self._collective("waiting for rank 0's command"):
            dist.broadcast(t, src=0)
        value, arg = (int(v) for v in t.tolist())
        return Command(value), arg

    def broadcast_params(self, params: Iterable[torch.Tensor]) -> None:
        """Rank 0's ``params`` into every rank's, flattened per dtype (one broadcast each)."""
        import torch.distributed as dist

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p.data)
        for params in by_dtype.values():
            flat = torch.cat([p.reshape(-1) for p in params]).to(self.comm_device())
            with self._collective("broadcasting the parameters"):
                dist.broadcast(flat, src=0)
            if not self.is_leader:
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def broadcast_start(self, seed: int, step: int, poll_s: float = 0.2, layout: int = 0) -> tuple[int, int]:
        """Rank 0's data seed and inner step counter on every rank. The other ranks first wait (without a
        time limit: rank 0 may retry its bootstrap for long) until rank 0 gets here. ``layout``: a
        digest of how this rank names its fragments' parameters (:meth:`ThetaSync.layout`); a rank whose
        digest differs from rank 0's fails here, not with a wrong fragment moved later."""
        import torch.distributed as dist

        with self._collective("waiting for rank 0 to join the swarm"):
            if self.is_leader:
                self._store.set(self._start_key, "1")
            else:
                while not self._store.check([self._start_key]):
                    time.sleep(poll_s)
        t = torch.tensor([seed, step, layout], dtype=torch.int64, device=self.comm_device())
        with self._collective("sharing the start"):
            dist.broadcast(t, src=0)
        seed, step, leader_layout = (int(v) for v in t.tolist())
        if leader_layout != layout:
            raise RankFailure(f"rank {self.rank}: its fragments name other parameters than rank 0's "
                              f"(layout {layout:08x} vs {leader_layout:08x}): every rank must run one config")
        return seed, step

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's ``obj`` (picklable, tensors on the CPU) on every rank."""
        import torch.distributed as dist

        box = [obj if self.is_leader else None]
        with self._collective("sharing the inner optimizer state"):
            dist.broadcast_object_list(box, src=0, device=self.comm_device())
        return box[0]

    def close(self, failed: bool = False, wait_s: float = 30.0) -> None:
        """Leave the process group (skipped after a failure: a broken group may block its teardown).

        Rank 0 goes last: it serves the rendezvous store (under --nproc), and a rank whose teardown still talked to it
        when rank 0's process ended aborted ("terminate called without an active exception", SIGABRT;
        1 run in 4 of the two-rank protocol test, and once in CI). The others say on the store that they
        are done, and rank 0 waits for that (at most ``wait_s``) before its own teardown."""
        import torch.distributed as dist

        if self._started and not failed and dist.is_initialized():
            with contextlib.suppress(Exception):
                if not self.is_leader:
                    dist.destroy_process_group()
                    if self._store is not None:
                        self._store.add(self._closed_key, 1)
                else:
                    deadline = time.monotonic() + wait_s
                    while self._store is not None and time.monotonic() < deadline \
                            and self._store.add(self._closed_key, 0) < self.world_size - 1:
                        time.sleep(0.02)
                    dist.destroy_process_group()
        self._started = False

    def comm_device(self) -> torch.device:
        """Where collective tensors live: NCCL needs them on the GPU."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except RankFailure:
            raise
        except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError is a RuntimeError)
            raise RankFailure(f"rank {self.rank}: {what} failed (a rank died or hung): "
                              f"{str(exc).splitlines()[0][:300]}") from exc

    def guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A block whose collective errors (e.g. DDP's backward all-reduce) become :class:`RankFailure`."""
        return self._collective(what)


def params_digest(tensors: Iterable[torch.Tensor]) -> int:
    """CRC32 of the tensors' bytes (as fp32), in order: what each rank logs when it stops, to show they
    trained one model."""
    crc = 0
    for t in tensors:
        crc = tensor_crc(t, crc)
    return crc


class ParallelEngine:
    """How a node's ranks hold the model: the transfers between rank 0's outer model and the ranks'
    training module. Every method is collective (every rank calls it at the same point) unless it says
    otherwise. ``outer`` is the model the outer loop, evaluations and checkpoints use on rank 0 (on other
    ranks whatever :meth:`place` returned); ``train`` the module the inner steps run."""

    name = ""
    shards_optimizer = False  # the ranks hold 1/N of the AdamW state each (checkpoints gather it)
    copies_params = False     # rank 0's outer model is a copy of the trained parameters (gathered to read)

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def place(self, model: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
        """``(outer, train)`` for a freshly built ``model`` (on the CPU); not collective."""
        raise NotImplementedError

    def push_params(self, outer: torch.nn.Module, train: torch.nn.Module, names: Sequence[str] | None = None) -> None:
        """Rank 0's ``outer`` parameters (those ``names``, default all) into every rank's ``train`` (after a
        merge, at the start)."""
        raise NotImplementedError

    def pull_params(self, train: torch.nn.Module, outer: torch.nn.Module, names: Sequence[str] | None = None) -> None:
        """The trained parameters (those ``names``, default all) into rank 0's ``outer``, where it is a copy
        (``copies_params``; before the outer loop reads them)."""

    def push_inner(self, source: InnerOptimizer, inner: InnerOptimizer) -> None:
        """Rank 0's ``source`` optimizer state (and step count) into every rank's ``inner``."""
        raise NotImplementedError

    def pull_inner(self, inner: InnerOptimizer, target: InnerOptimizer) -> None:
        """The ranks' optimizer state into rank 0's ``target`` (before a checkpoint)."""

    def digest(self, outer: torch.nn.Module, train: torch.nn.Module) -> int:
        """CRC32 of the whole parameters, equal on every rank when they agree (see :func:`params_digest`)."""
        raise NotImplementedError


class DDPEngine(ParallelEngine):
    """Every rank holds the whole model; DDP averages the gradients in backward, so the replicated AdamW
    steps keep the ranks bit-identical. The outer model *is* the trained model: nothing to pull."""

    name = "ddp"

    def place(self, model: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
        model = model.to(device)
        return model, self.group.wrap(model)

    def push_params(self, outer: torch.nn.Module, train: torch.nn.Module, names: Sequence[str] | None = None) -> None:
        self.group.broadcast_params(_named(outer, names))

    def push_inner(self, source: InnerOptimizer, inner: InnerOptimizer) -> None:
        state = self.group.broadcast_object(source.state_dict() if self.group.is_leader else None)
        if not self.group.is_leader or inner is not source:  # (rank 0's own optimizer has it already)
            inner.load_state_dict(state)

    def digest(self, outer: torch.nn.Module, train: torch.nn.Module) -> int:
        return params_digest(outer.parameters())


class FSDPEngine(ParallelEngine):
    """FSDP2 ``fully_shard`` over the node's ranks (see the module docstring): every ``nn.ModuleList``
    entry (a transformer block) is one shard group, the rest of the model (embeddings, head, final norm)
    another. Rank 0 keeps the full outer copy of theta on the CPU."""

    name = "fsdp"
    shards_optimizer = True
    copies_params = True

    def place(self, model: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
        import copy

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (self.group.world_size,))
        # Rank 0 shards a copy and keeps the original (on the CPU) as its outer model; the other ranks
        # need no full copy at all.
        train = copy.deepcopy(model) if self.group.is_leader else model
        for module in list(train.modules()):
            if isinstance(module, torch.nn.ModuleList):
                for block in module:
                    fully_shard(block, mesh=mesh)
        fully_shard(train, mesh=mesh)
        train.to(device)
        return (model if self.group.is_leader else train), train

    def push_params(self, outer: torch.nn.Module, train: torch.nn.Module, names: Sequence[str] | None = None) -> None:
        with torch.no_grad():
            for full, param in zip(_named(outer, names), _named(train, names), strict=True):
                param.to_local().copy_(self._scatter(full if self.group.is_leader else None, param))

    def pull_params(self, train: torch.nn.Module, outer: torch.nn.Module, names: Sequence[str] | None = None) -> None:
        with torch.no_grad(), self.group.guard("gathering the parameters"):
            for param, full in zip(_named(train, names), _named(outer, names), strict=True):
                gathered = param.full_tensor()
                if self.group.is_leader:
                    full.copy_(gathered)

    def push_inner(self, source: InnerOptimizer, inner: InnerOptimizer) -> None:
        # What rank 0 holds, per parameter: its state's keys, and which of them are parameter-shaped
        # (sharded like the parameter) rather than scalars such as AdamW's ``step``.
        params = inner.params()
        layout = None
        if self.group.is_leader:
            layout = [{k: torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape)
                       for k, v in source.param_state(i).items()} for i, p in enumerate(params)]
            layout = (layout, source.steps_done)
        layout, steps_done = self.group.broadcast_object(layout)
        full = source.param_state if self.group.is_leader else None
        for i, (param, keys) in enumerate(zip(params, layout, strict=True)):
            state: dict[str, object] = {}
            own = full(i) if full is not None else {}
            for key, sharded in keys.items():
                if sharded:
                    local = self._scatter(own.get(key), param)
                    state[key] = _like_param(local, param)
                else:
                    state[key] = self.group.broadcast_object(own.get(key))
            inner.load_param_state(i, state)
        inner.steps_done = int(steps_done)

    def pull_inner(self, inner: InnerOptimizer, target: InnerOptimizer) -> None:
        from torch.distributed.tensor import DTensor

        with torch.no_grad(), self.group.guard("gathering the optimizer state"):
            for i, _ in enumerate(inner.params()):
                state = {}
                for key, value in inner.param_state(i).items():
                    value = value.full_tensor() if isinstance(value, DTensor) else value
                    state[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
                if self.group.is_leader:
                    target.load_param_state(i, state)
        if self.group.is_leader:
            target.steps_done = inner.steps_done

    def digest(self, outer: torch.nn.Module, train: torch.nn.Module) -> int:
        with torch.no_grad(), self.group.guard("gathering the parameters"):
            return params_digest(param.full_tensor() for param in train.parameters())

    def _scatter(self, full: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
        """This rank's shard of rank 0's ``full`` tensor shaped like the sharded ``param``: one broadcast,
        then each rank keeps its slice (the same slicing FSDP uses)."""
        import torch.distributed as dist
        from torch.distributed.tensor import distribute_tensor

        comm = self.group.comm_device()
        if self.group.is_leader:
            assert full is not None
            buf = full.detach().to(comm, param.dtype).contiguous()
        else:
            buf = torch.empty(tuple(param.shape), dtype=param.dtype, device=comm)
        with self.group.guard("scattering the parameters"):
            dist.broadcast(buf, src=0)
        local = distribute_tensor(buf, param.device_mesh, param.placements, src_data_rank=None).to_local()
        return local.to(param.to_local().device)


def _named(module: torch.nn.Module, names: Sequence[str] | None) -> list[torch.nn.Parameter]:
    """``module``'s parameters called ``names`` (in that order), or all of them."""
    if names is None:
        return list(module.parameters())
    named = dict(module.named_parameters())
    return [named[n] for n in names]


def _like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A DTensor holding ``local`` with ``param``'s mesh and placements (how FSDP keeps AdamW moments)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.clone(), param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)


ENGINES: dict[str, type[ParallelEngine]] = {e.name: e for e in (DDPEngine, FSDPEngine)}


def check_nproc(nproc: int, device: str) -> None:
    """``--nproc`` against the machine, before anything starts (one-line :class:`UserError`)."""
    if nproc < 1:
        raise UserError(f"--nproc {nproc} is not allowed; it must be >= 1 (the ranks of this node)")
    if nproc == 1:
        return
    value = (device or "").strip().lower()
    if value not in ("auto", "cuda", "cpu"):
        raise UserError(f"--device {device!r} with --nproc {nproc} is not allowed; use auto, cuda or cpu "
                        "(each rank takes cuda:LOCAL_RANK on GPUs)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value == "cuda" and gpus < nproc:
        raise UserError(f"--nproc {nproc} with --device cuda needs {nproc} GPUs, this machine has {gpus}; "
                        f"use --nproc {max(1, gpus)} or --device cpu")
    if value == "auto" and 0 < gpus < nproc:
        raise UserError(f"--nproc {nproc} needs {nproc} GPUs (one per rank), this machine has {gpus}; "
                        f"use --nproc {gpus} or --device cpu")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host`` (the rendezvous port of the ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RankLauncher:
    """``locoswarm run --nproc N``: start the node's N ranks as child processes and watch them.

    Each rank runs the same command with torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). The launcher owns the signals: SIGINT/SIGTERM go
    to rank 0 as SIGTERM (a graceful leave, whose STOP command ends the other ranks, which ignore signals), a
    third one SIGKILLs every rank. When a rank exits with an error, rank 0 gets a SIGTERM (it leaves the
    swarm cleanly and exits non-zero: the dead rank also breaks its next collective), and is SIGKILLed if
    it is still there after ``leave_s`` (NCCL may hang on a dead peer until its timeout instead of failing;
    rank 0's watchdog then removes its DHT and p2pd, and its last periodic checkpoint stays); when rank 0
    exits, ranks still running after ``grace_s`` are SIGKILLed. Each rank dies with the launcher
    (``PR_SET_PDEATHSIG``). Returns 0 when every rank exited 0, else the first failure's code (1 for a
    signal). ``command``: what runs ``argv`` (default this interpreter's ``-m locoswarm.node.cli``)."""

    def __init__(self, argv: Sequence[str], nproc: int, grace_s: float = 15.0, leave_s: float = 120.0,
                 poll_s: float = 0.1, command: Sequence[str] | None = None) -> None:
        self.command = list(command) if command else [sys.executable, "-m", "locoswarm.node.cli"]
        self.argv = list(argv)
        self.nproc = nproc
        self.grace_s = grace_s
        self.leave_s = leave_s
        self.poll_s = poll_s
        self.procs: list[subprocess.Popen] = []
        self._signals = 0

    def run(self) -> int:
        port = free_port()
        for rank in range(self.nproc):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.nproc),
                       LOCAL_WORLD_SIZE=str(self.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env[LAUNCHED_ENV] = "1"
            self.procs.append(subprocess.Popen([*self.command, *self.argv], env=env,
                                               preexec_fn=_die_with_parent))
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self._watch()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals += 1
        if self._signals <= 2:
            _send(self.procs[0], signal.SIGTERM)
        else:
            for proc in self.procs:
                _send(proc, signal.SIGKILL)

    def _watch(self) -> int:
        code = 0
        failed_at: float | None = None
        leader_done: float | None = None
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic()
            for rank, proc in enumerate(self.procs):
                rc = proc.poll()
                if rc is None or rc == 0 or code:
                    continue
                code, failed_at = (rc if rc > 0 else 1), now
                sys.stderr.write(f"locoswarm: rank {rank} exited with {rc}; stopping the node's other ranks\n")
                _send(self.procs[0], signal.SIGTERM)  # rank 0 leaves the swarm cleanly
            if failed_at is not None and now - failed_at > self.leave_s:
                _send(self.procs[0], signal.SIGKILL)  # stuck in a collective with the dead rank
            if leader_done is None and self.procs[0].poll() is not None:
                leader_done = now
            if leader_done is not None and now - leader_done > self.grace_s:
                for proc in self.procs[1:]:
                    _send(proc, signal.SIGKILL)
            time.sleep(self.poll_s)
        for rank, proc in enumerate(self.procs):
            if proc.returncode and not code:
                code = proc.returncode if proc.returncode > 0 else 1
                sys.stderr.write(f"locoswarm: rank {rank} exited with {proc.returncode}\n")
        return code


def _send(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _die_with_parent() -> None:
    """In a launched rank (before exec): SIGTERM when the launcher dies, so no rank outlives it."""
    die_with_parent(signal.SIGTERM)


def launched() -> bool:
    """Whether this process is a rank started by :class:`RankLauncher` (which owns the signals)."""
    return os.environ.get(LAUNCHED_ENV) == "1"


class ThetaSync:
    """Theta kept one across a node's ranks, lazily and a fragment at a time (the commands of the module
    docstring).

    Rank 0 drives it. It is the outer loop's :class:`~locoswarm.node.core.state.ThetaAccess`: a fragment
    the outer loop writes is pushed to the ranks before the next inner step (:meth:`step`), and one it
    reads while rank 0's copy lags the ranks' steps (FSDP) is gathered first. :meth:`refresh` brings the
    whole copy up to date (an evaluation, a checkpoint), :meth:`gather_inner` the optimizer state, and
    :meth:`stop` ends the ranks. The other ranks call :meth:`follow` between their steps: it carries out
    the transfers and returns rank 0's next other command.

    A failed transfer inside the outer loop's read is not raised there (the outer loop would be left
    between two writes): rank 0 goes on with its last copy of that fragment, and the failure is raised
    at the next :meth:`step` or :meth:`stop`. After any failure of the ranks (:meth:`broken`) no transfer
    is tried again: a hung rank would hold each one for the whole rank timeout while rank 0 leaves.
    Every call comes from the thread that trains (the commands of two threads would interleave).

    Args:
        group: the node's ranks.
        outer, train: the engine's two models (:meth:`ParallelEngine.place`).
        fragments: each fragment's parameter names, by index (``locoswarm.node.partition``); together
            every parameter of the model.
    """

    def __init__(self, group: RankGroup, outer: torch.nn.Module, train: torch.nn.Module,
                 fragments: Sequence[Sequence[str]]) -> None:
        self.group = group
        self.engine = group.engine
        self.outer, self.train = outer, train
        self.fragments = [tuple(names) for names in fragments]
        covered = sorted(n for names in self.fragments for n in names)
        if covered != sorted(n for n, _ in outer.named_parameters()):
            raise ValueError("the fragments must hold every parameter of the model exactly once")
        self._numel = [sum(p.numel() for p in _named(outer, names)) for names in self.fragments]
        self._stale: set[int] = set()    # fragments whose copy on rank 0 lacks the ranks' latest steps
        self._written: set[int] = set()  # fragments rank 0's outer loop wrote since the last step
        self._reset = False
        self._stopped = False
        self._thread = threading.get_ident()
        self.failure: RankFailure | None = None
        # What moved, in parameters: the node logs it as it stops, tests read it.
        self.pushed = self.gathered = 0
        self.steps = 0

    def layout(self) -> int:
        """A digest of the fragments' parameter names: equal on every rank of one config."""
        return zlib.crc32("\n".join("\t".join(names) for names in self.fragments).encode())

    # ---- rank 0: the outer loop's ThetaAccess -------------------------------------------------------
    def before_read(self, fragment: int) -> None:
        if fragment not in self._stale or self.failure is not None:
            return
        if self._stopped:
            raise RuntimeError(f"fragment {fragment} read after the ranks stopped, without its last steps")
        try:
            self._command(Command.GATHER, fragment)
            self.engine.pull_params(self.train, self.outer, self.fragments[fragment])
        except RankFailure as exc:
            self.broken(exc)
            return
        self._stale.discard(fragment)
        self.gathered += self._numel[fragment]

    def after_write(self, fragment: int) -> None:
        self._stale.discard(fragment)  # rank 0's copy is now the newest
        self._written.add(fragment)

    # ---- rank 0: between two inner steps ------------------------------------------------------------
    def broken(self, failure: RankFailure) -> None:
        """The ranks failed (here or in an inner step): no transfer is tried again."""
        if self.failure is None:
            self.failure = failure

    def reset_inner(self) -> None:
        """The ranks forget their AdamW moments before the next step (rank 0 has reset its own)."""
        self._reset = True

    def refresh(self) -> None:
        """Rank 0's copy of every fragment up to date (before an evaluation or a checkpoint)."""
        for fragment in sorted(self._stale):
            self.before_read(fragment)
        self._raise_failure()

    def step(self) -> None:
        """The outer loop's writes to every rank, then one inner step on every rank."""
        self._push_written()
        self._command(Command.STEP)
        self.steps += 1
        if self.engine.copies_params:
            self._stale = set(range(len(self.fragments)))

    def stop(self) -> None:
        """The outer loop's writes to every rank, rank 0's copy up to date (the leave reads and saves it),
        then every rank stops. Transfers after this are the fixed sequence of the stop (digest, moments)."""
        self._push_written()
        self.refresh()
        self._command(Command.STOP)
        self._stopped = True

    def gather_inner(self, inner: InnerOptimizer, target: InnerOptimizer) -> None:
        """The ranks' optimizer state into rank 0's ``target`` (for a checkpoint)."""
        if not self.engine.shards_optimizer:
            return  # every rank holds the whole state: rank 0's is the node's
        self._raise_failure()
        if not self._stopped:
            self._command(Command.GATHER_INNER)
        with self._breaking():
            self.engine.pull_inner(inner, target)

    def push_all(self) -> None:
        """Rank 0's whole outer model to every rank (collective: at the start, after a resume or a join)."""
        self.engine.push_params(self.outer, self.train)
        self._stale.clear()
        self._written.clear()

    def _push_written(self) -> None:
        self._raise_failure()
        if self._reset:
            self._command(Command.RESET_INNER)
            self._reset = False
        for fragment in sorted(self._written):
            self._command(Command.PUSH, fragment)
            with self._breaking():
                self.engine.push_params(self.outer, self.train, self.fragments[fragment])
            self.pushed += self._numel[fragment]
        self._written.clear()

    def _command(self, command: Command, arg: int = 0) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError(f"{command.name} sent off the training thread: the ranks' commands must come "
                               "from one thread")
        with self._breaking():
            self.group.command(command, arg)

    @contextlib.contextmanager
    def _breaking(self) -> Iterator[None]:
        """A transfer whose failure marks the ranks :meth:`broken` (and is raised)."""
        try:
            yield
        except RankFailure as exc:
            self.broken(exc)
            raise

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ---- the other ranks ------------------------------------------------------------------------------
    def follow(self) -> Command:
        """Carry out rank 0's transfers until its next STEP, STOP, RESET_INNER or GATHER_INNER; return it."""
        while True:
            command, arg = self.group.command()
            if command not in (Command.PUSH, Command.GATHER):
                return command
            names = None if arg == ALL else self.fragments[arg]
            if command is Command.PUSH:
                self.engine.push_params(self.outer, self.train, names)
            else:
                self.engine.pull_params(self.train, self.outer, names)
