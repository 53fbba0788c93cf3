"""One node over several GPUs (or CPU ranks): PyTorch's own data parallelism inside a swarm node.

A node started with ``--nproc N`` (or under ``torchrun --nproc-per-node N``) runs N ranks of one
process group (NCCL on GPUs, gloo on CPU). Inner steps are plain DDP (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training"): every rank computes gradients on its
own batch, the backward pass all-reduces (averages) them, and the replicated AdamW steps keep every
rank's parameters bit-identical. The swarm sees one peer: rank 0 alone holds the DHT, the outer loop,
the control server, checkpoints and heartbeats; the node's batch is N times a rank's batch.

The one thing DDP does not replicate is the outer loop: a merge, a catch-up or a join writes theta on
rank 0 only. The protocol that keeps the ranks equal, all collective, between two inner steps:

1. rank 0 broadcasts a small flag tensor ``[changed, stop, reset_inner]``;
2. if ``changed``, rank 0 broadcasts every parameter (theta was written by the outer loop);
3. if ``reset_inner``, every rank forgets its AdamW moments (rank 0's outer loop saw theta diverge);
4. if ``stop``, every rank stops together.

At the start rank 0 broadcasts the data seed and step counter (``broadcast_start``), the parameters and
its inner optimizer state (resumed from its checkpoint or fresh): the ranks start from rank 0's state.
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
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import TCPStore

from locoswarm.node.errors import UserError

LAUNCHED_ENV = "LOCOSWARM_LAUNCHED"  # set by RankLauncher: the ranks leave signal handling to the launcher
DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer (a hung rank) fails
_START_KEY = "locoswarm/start"  # set in the rendezvous store by rank 0 when it has joined the swarm


class RankFailure(RuntimeError):
    """A collective of the node's ranks failed: a rank died or hung."""


@dataclass(frozen=True)
class Flags:
    """What rank 0 tells the other ranks between two inner steps."""

    changed: bool = False      # the outer loop wrote theta: the parameters follow
    stop: bool = False         # every rank stops after this exchange
    reset_inner: bool = False  # forget the AdamW moments (theta diverged on rank 0)


class RankGroup:
    """The process group of one node's ranks (DDP inside a swarm node; see the module docstring).

    Args:
        rank, world_size, local_rank: as torchrun sets them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
        timeout_s: how long a collective may wait for a rank before it fails.
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise UserError(f"rank {rank} of world size {world_size}: need a world size >= 2 and 0 <= rank < it")
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.timeout_s = timeout_s
        self.device = torch.device("cpu")
        self._started = False
        self._store: TCPStore | None = None

    @classmethod
    def from_env(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGroup | None:
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
        return None if world <= 1 else cls(rank, world, local, timeout_s)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that joins the swarm."""
        return self.rank == 0

    def resolve_device(self, spec: str) -> torch.device:
        """This rank's device: ``auto`` and ``cuda`` mean ``cuda:LOCAL_RANK`` when CUDA exists (one GPU
        per rank), ``cpu`` the CPU."""
        from locoswarm.node.model import resolve_device

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
            self._store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                        int(os.environ.get("MASTER_PORT", "29500")), self.world_size,
                                        self.is_leader, timeout=timeout)
            dist.init_process_group(backend, store=self._store, rank=self.rank, world_size=self.world_size,
                                    timeout=timeout)
        self._started = True

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` for the inner steps: DDP averages the gradients over the ranks in backward. The outer
        loop keeps the bare model (the parameters are the same tensors)."""
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def sync(self, flags: Flags) -> Flags:
        """Rank 0's ``flags`` on every rank (the other ranks' argument is ignored)."""
        import torch.distributed as dist

        t = torch.tensor([flags.changed, flags.stop, flags.reset_inner], dtype=torch.uint8, device=self._comm())
        with self._collective("exchanging flags"):
            dist.broadcast(t, src=0)
        changed, stop, reset = (bool(v) for v in t.tolist())
        return Flags(changed=changed, stop=stop, reset_inner=reset)

    def broadcast_params(self, model: torch.nn.Module) -> None:
        """Rank 0's parameters into every rank's ``model``, flattened per dtype (one broadcast each)."""
        import torch.distributed as dist

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in model.parameters():
            by_dtype.setdefault(p.dtype, []).append(p.data)
        for params in by_dtype.values():
            flat = torch.cat([p.reshape(-1) for p in params]).to(self._comm())
            with self._collective("broadcasting the parameters"):
                dist.broadcast(flat, src=0)
            if not self.is_leader:
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def broadcast_start(self, seed: int, step: int, poll_s: float = 0.2) -> tuple[int, int]:
        """Rank 0's data seed and inner step counter on every rank. The other ranks first wait (without a
        time limit: rank 0 may retry its bootstrap for long) until rank 0 gets here."""
        import torch.distributed as dist

        with self._collective("waiting for rank 0 to join the swarm"):
            if self.is_leader:
                self._store.set(_START_KEY, "1")
            else:
                while not self._store.check([_START_KEY]):
                    time.sleep(poll_s)
        t = torch.tensor([seed, step], dtype=torch.int64, device=self._comm())
        with self._collective("sharing the start"):
            dist.broadcast(t, src=0)
        seed, step = (int(v) for v in t.tolist())
        return seed, step

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's ``obj`` (picklable, tensors on the CPU) on every rank."""
        import torch.distributed as dist

        box = [obj if self.is_leader else None]
        with self._collective("sharing the inner optimizer state"):
            dist.broadcast_object_list(box, src=0, device=self._comm())
        return box[0]

    def close(self, failed: bool = False) -> None:
        """Leave the process group (skipped after a failure: a broken group may block its teardown)."""
        import torch.distributed as dist

        if self._started and not failed and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._started = False

    def _comm(self) -> torch.device:
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


def params_digest(model: torch.nn.Module) -> int:
    """CRC32 of every parameter's bytes: what each rank logs when it stops, to show they trained one model."""
    import zlib

    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes(), crc)
    return crc


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
    to rank 0 as SIGTERM (a graceful leave, whose stop flag ends the other ranks, which ignore signals), a
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
    from locoswarm.node.swarm.process import die_with_parent

    die_with_parent(signal.SIGTERM)


def launched() -> bool:
    """Whether this process is a rank started by :class:`RankLauncher` (which owns the signals)."""
    return os.environ.get(LAUNCHED_ENV) == "1"
