"""Helpers for multi-process swarm tests: real ``locoswarm run`` processes on loopback.

Each node runs in its own session (process group), so a test can kill it and everything it started
(the DHT child, p2pd) by process group, never by name. ``status.json`` in a node's state dir is how
the tests observe it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORDS = ["the", "swarm", "trains", "a", "model", "while", "peers", "come", "and", "go", "averaging",
         "fragments", "by", "gossip", "over", "libp2p", "streams", "with", "quantized", "payloads"]


def write_corpus(directory: Path, docs: int = 8, lines: int = 200) -> Path:
    rng = random.Random(0)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) + "." for _ in range(lines))
        (directory / f"doc{i}.txt").write_text(text)
    return directory


def write_config(path: Path, **sections: dict) -> Path:
    """A tiny, fast swarm: small model, short rounds, short timeouts."""
    base = {
        "swarm": {"name": "test-swarm"},
        "model": {"preset": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128, "max_seq_len": 64},
        "inner": {"batch_size": 4, "seq_len": 32, "warmup": 5, "lr": 3e-3},
        "outer": {"method": "compensate", "h": 8, "fragments": 2, "tau": 2, "codec": "fp4"},
        "network": {"group_size": 8, "matchmaking_timeout": 3.0, "round_timeout": 10.0,
                    "heartbeat_interval": 0.5},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


class NodeProc:
    """A ``locoswarm run`` process (or, with ``command``, another ``python -m ...`` entry point that takes
    a node's arguments, e.g. ``["locoswarm.node.bench.hostile", "--attack", "nan"]``)."""

    def __init__(self, name: str, state_dir: Path, args: list[str], log_path: Path,
                 command: list[str] | None = None, prefix: list[str] | None = None) -> None:
        self.name = name
        self.state_dir = state_dir
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        entry = command or ["locoswarm.node.cli", "run"]
        # ``prefix``: e.g. ``ip netns exec NS`` (it execs the command, so the process group stays the node's)
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", *entry, "--state-dir", str(state_dir),
                                      "--threads", "1", *args], cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.proc.pid
        # IPC files of this node's processes recorded before a SIGKILL of its group (which takes its
        # watchdog too); stop() removes them once every process is dead
        self._killed_pids: list[int] = []
        self._killed_files: set[str] = set()

    def status(self) -> dict:
        try:
            return json.loads((self.state_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_status(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st and predicate(st):
                return st
            if self.proc.poll() is not None and not (st and predicate(st)):
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before {what}:\n{self.tail()}")
            time.sleep(0.25)
        raise AssertionError(f"{self.name}: timed out after {timeout:.0f} s waiting for {what}:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        with contextlib.suppress(FileNotFoundError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def group_alive(self) -> list[int]:
        """PIDs still in this node's process group."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    if int(fields[2]) == self.pgid and fields[0] != "Z":
                        pids.append(int(entry.name))
        return pids

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if sig == signal.SIGKILL and self.proc.poll() is None:
            from locoswarm.node.swarm.process import ipc_files

            pids = [self.proc.pid, *self.descendants()]
            self._killed_pids += pids
            self._killed_files |= ipc_files(pids)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM the node (graceful leave) and wait for it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def descendants(self) -> list[int]:
        """PIDs descending from the node process (the DHT child leads a group of its own)."""
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        found, frontier = [], [self.proc.pid]
        while frontier:
            kids = [p for p, pp in parents.items() if pp in frontier]
            found += kids
            frontier = kids
        return found

    def stop(self) -> None:
        """Make sure nothing of this node is left: its processes (by process group) and their IPC files.
        The SIGKILL of the group takes the node's watchdog too, so the files its processes own (torch's
        ``/dev/shm/torch_<pid>_*``, a p2pd socket) are recorded first and removed here once all are dead
        (a full suite left ~50 such files in /dev/shm)."""
        from locoswarm.node.swarm.process import cleanup_ipc_files, ipc_files

        pids: list[int] = []
        files: set[str] = set()
        if self.proc.poll() is None:
            pids = [self.proc.pid, *self.descendants()]
            files = ipc_files(pids)
            for pid in pids[1:]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
            self.kill(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        deadline = time.monotonic() + 10
        while self.group_alive() and time.monotonic() < deadline:
            self.kill(signal.SIGKILL)
            time.sleep(0.2)
        pids, files = pids + self._killed_pids, files | self._killed_files
        if pids:
            cleanup_ipc_files(pids, files, retry_s=2.0)
        self.log.close()


def bootstrap_addr(status: dict) -> str:
    addrs = [a for a in status.get("addrs", []) if "/127.0.0.1/" in a]
    assert addrs, f"no loopback address in {status.get('addrs')}"
    return addrs[0]


def run_bench(args: list[str], tmp_path: Path, timeout: float) -> str:
    """``locoswarm bench ARGS`` with its scratch swarms under ``tmp_path``; its output. A bench that outlasts
    ``timeout`` gets a SIGTERM (it stops the nodes it started) and fails the test."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen([sys.executable, "-m", "locoswarm.node.cli", "bench", *args], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = bench.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        bench.send_signal(signal.SIGTERM)
        output, _ = bench.communicate(timeout=25)
        raise AssertionError(f"bench {args[0]} did not finish:\n{output[-3000:]}") from None
    assert bench.returncode == 0, output[-3000:]
    return output
