"""Process hygiene: no orphans, however the node exits.

hivemind runs its DHT in a forked child process which starts its own ``p2pd`` daemon; if the main
process is SIGKILLed both stay alive (re-parented to init), holding ports and ``/tmp/hivemind-*.sock``
files. Measured with hivemind 1.1.12: importing hivemind also switches torch's sharing strategy to
``file_system``, which starts a ``torch_shm_manager`` in its *own session* (so a process-group kill
misses it) and leaves ``/dev/shm/torch_<pid>_*`` files after a SIGKILL.

The remedy, in the order a node calls it:

1. :func:`become_group_leader` - the node leads its own process group (one ``killpg`` reaches
   everything started in it); ``locoswarm.node.swarm.dht`` puts the DHT child and its p2pd in a group of their
   own, so a terminal's Ctrl+C (sent to the foreground group) does not kill p2pd before the node has
   left the swarm gracefully;
2. :func:`start_watchdog` - started right away: a lean process (a fresh
   interpreter that imports only the standard library, however heavy the node already is) that notices the
   node's death (``PR_SET_PDEATHSIG`` plus polling ``getppid``), then SIGTERMs, and after a grace
   period SIGKILLs, the node's process group and every descendant it last saw, and removes their IPC
   files;
3. :func:`install_signal_handlers` - SIGINT/SIGTERM ask for a graceful exit, a second one forces it;
4. on an orderly exit: shut the DHT down, then :func:`stop_watchdog`.

Linux only (``/proc``, ``prctl``); elsewhere the watchdog degrades to polling and the /proc helpers
return nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
_WATCHDOG_NAME = b"locoswarm-watch"
_WATCHDOG_ARG = "--locoswarm-watchdog"
_HIVEMIND_SOCKET_PREFIX = "/tmp/hivemind-"


# ---- /proc helpers ----

def proc_stat(pid: int) -> tuple[str, str, int, int, int] | None:
    """``(comm, state, ppid, pgid, starttime)`` of a process, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return None
    left, right = data.find("("), data.rfind(")")
    if left < 0 or right < 0:
        return None
    comm = data[left + 1:right]
    fields = data[right + 2:].split()
    try:
        return comm, fields[0], int(fields[1]), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    st = proc_stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def _all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (zombies included), by each process's parent pid in /proc/<pid>/stat.

    Not from ``/proc/<pid>/task/*/children``: the kernel documents that file as reliable only while the
    children are stopped, and the watchdog read it empty for a whole second while the node had a DHT child
    and a p2pd (a SIGKILL then left the p2pd's socket behind: the watchdog never saw the p2pd)."""
    return sorted(p for p, parent in _parents().items() if parent == pid)


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process (one pass over /proc)."""
    out: dict[int, int] = {}
    for other in _all_pids():
        st = proc_stat(other)
        if st is not None:
            out[other] = st[2]
    return out


def descendants(pid: int) -> list[int]:
    """All living descendants of ``pid`` (children first)."""
    parents = _parents()
    kids: dict[int, list[int]] = {}
    for child, parent in parents.items():
        kids.setdefault(parent, []).append(child)
    out: list[int] = []
    seen = {pid}
    queue = [pid]
    while queue:
        for child in sorted(kids.get(queue.pop(0), [])):
            if child not in seen:
                seen.add(child)
                if is_alive(child):
                    out.append(child)
                queue.append(child)
    return out


def group_members(pgid: int) -> list[int]:
    """Living processes of process group ``pgid``."""
    out = []
    for pid in _all_pids():
        st = proc_stat(pid)
        if st is not None and st[3] == pgid and st[1] not in ("Z", "X"):
            out.append(pid)
    return out


def tree_groups(pid: int) -> set[int]:
    """Process groups of ``pid`` (a group leader) and of its descendants (a DHT child leads its own)."""
    groups = {pid}
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(child))
    return groups


def kill_groups(groups: Iterable[int], proc: subprocess.Popen, timeout: float = 10.0) -> list[str]:
    """SIGKILL every process group in ``groups`` and every descendant of ``proc`` (torch's shared-memory
    manager runs in a session of its own), reap ``proc``, wait (bounded) until they are gone, and remove
    the IPC files they owned: what a harness that started ``proc`` in its own group does to leave nothing
    behind. The files are recorded first, because the SIGKILL takes the node's watchdog too (a test suite
    that killed its nodes this way left ~50 ``/dev/shm/torch_*`` files). Returns the files removed."""
    groups = set(groups)
    members = {p for g in groups for p in group_members(g)}
    tree = [proc.pid, *descendants(proc.pid)] if proc.poll() is None else []
    started = {p: st[4] for p in {*members, *tree} if (st := proc_stat(p)) is not None}
    files = ipc_files(list(started))
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    _signal_all({p: t for p, t in started.items() if _same_alive(p, t)}, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    deadline = time.monotonic() + timeout
    while (any(group_members(g) for g in groups) or any(_same_alive(p, t) for p, t in started.items())) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return cleanup_ipc_files(list(started), files, retry_s=2.0)


def p2pd_pids(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that are living ``p2pd`` daemons."""
    return [p for p in pids if (st := proc_stat(p)) is not None and st[0] == "p2pd" and st[1] not in ("Z", "X")]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def ipc_files(pids: Iterable[int]) -> set[str]:
    """IPC files that the given (living) processes own: a p2pd's control socket
    (``-listen=/unix/tmp/hivemind-p2pd-*.sock``), unix sockets they bound under ``/tmp/hivemind-``,
    and torch's ``/dev/shm/torch_<pid>_*`` segments. Record them while the processes live; remove
    them with :func:`cleanup_ipc_files` once they are gone."""
    pids = list(pids)
    files: set[str] = set()
    inodes: set[str] = set()
    tables: dict[str, list[tuple[str, str]]] = {}  # network namespace -> its bound unix sockets
    for pid in pids:
        for arg in _cmdline(pid):
            if arg.startswith("-listen=/unix/"):
                path = arg[len("-listen=/unix"):]
                if path.startswith(_HIVEMIND_SOCKET_PREFIX):
                    files.add(path)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
        # A process in another network namespace (a `bench swarm` node) lists its unix sockets only in its
        # own namespace's table, though their files lie in the shared /tmp: read the table through the pid.
        with contextlib.suppress(OSError):
            ns = os.readlink(f"/proc/{pid}/ns/net")
            if ns not in tables:
                tables[ns] = _unix_sockets(pid)
        files.update(glob.glob(f"/dev/shm/torch_{pid}_*"))
    if inodes:
        for table in tables.values() or [_unix_sockets()]:
            for inode, path in table:
                if inode in inodes and path.startswith(_HIVEMIND_SOCKET_PREFIX):
                    files.add(path)
    return files


def _unix_sockets(pid: int | None = None) -> list[tuple[str, str]]:
    """``(inode, path)`` of bound unix sockets in this process's network namespace (/proc/net/unix), or in
    ``pid``'s (/proc/<pid>/net/unix)."""
    out = []
    try:
        with open(f"/proc/{pid}/net/unix" if pid is not None else "/proc/net/unix") as fh:
            next(fh, None)
            for line in fh:
                parts = line.split()
                if len(parts) >= 8:
                    out.append((parts[6], parts[7]))
    except OSError:
        pass
    return out


def cleanup_ipc_files(pids: Iterable[int], files: Iterable[str] = (), retry_s: float = 0.0) -> list[str]:
    """Remove IPC files left by the given processes once none of them is alive: ``files`` recorded
    earlier with :func:`ipc_files` (sockets still bound by a living process are kept) and
    ``/dev/shm/torch_<pid>_*`` of each pid. Returns the removed paths.

    Measured: a DHT started and shut down normally leaves nothing; one whose process exits without
    ``shutdown()`` (or whose p2pd failed to bootstrap) leaves ``/tmp/hivemind-p2pd-*.sock``; a SIGKILL
    of the node also leaves ``/dev/shm/torch_<pid>_*``.

    A socket still listed as bound is kept (``retry_s`` = 0), or with ``retry_s`` waited for that long (a
    killed process's sockets can stay listed for a moment after it died) and then removed anyway: every
    process given is dead and no other process can bind a path while its file exists, so the listing is
    stale (loaded CI runs left a p2pd socket past a 2 s wait that did not remove it at the end)."""
    pids = list(pids)
    deadline = time.monotonic() + retry_s
    # Waited for too (within ``retry_s``): a SIGKILLed process can take a moment to die on a loaded machine,
    # and returning at once left its files for good.
    while any(is_alive(p) for p in pids):
        if time.monotonic() >= deadline:
            return []
        time.sleep(0.05)
    candidates = set(files)
    for pid in pids:
        candidates.update(glob.glob(f"/dev/shm/torch_{pid}_*"))
    removed: list[str] = []
    while True:
        expired = time.monotonic() >= deadline
        force = expired and retry_s > 0  # waited for the listing: every owner is dead, so it is stale
        in_use = {path for _, path in _unix_sockets()} if candidates and not force else set()
        kept = set()
        for path in sorted(candidates):
            if path in in_use and not path.startswith("/dev/shm/"):
                kept.add(path)
                continue
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        candidates = {p for p in kept if os.path.exists(p)}
        if not candidates or expired:
            return removed
        time.sleep(0.05)


def terminate_processes(pids: Iterable[int], grace_s: float = 1.0) -> list[int]:
    """SIGTERM the living ones of ``pids``, wait up to ``grace_s``, SIGKILL what is left.
    Returns the pids that had to be SIGKILLed. Start times are checked so a reused pid is spared."""
    start = {p: st[4] for p in pids if (st := proc_stat(p)) is not None and st[1] not in ("Z", "X")}
    _signal_all(start, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_same_alive(p, t) for p, t in start.items()):
        time.sleep(0.02)
    left = {p: t for p, t in start.items() if _same_alive(p, t)}
    _signal_all(left, signal.SIGKILL)
    return sorted(left)


def _same_alive(pid: int, starttime: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[4] == starttime and st[1] not in ("Z", "X")


def _signal_all(pids: dict[int, int], sig: int) -> None:
    for pid, starttime in pids.items():
        if _same_alive(pid, starttime):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


# ---- process group ----

def become_group_leader() -> bool:
    """Make this process the leader of its own process group (the DHT child and its p2pd inherit the
    group, so one ``killpg`` reaches them). Returns True if this process leads its group afterwards.

    A no-op when it already leads one (a shell with job control starts every command that way; a
    session leader, e.g. PID 1 in a container, always does). It stays put when it shares the
    terminal's *foreground* group: moving out would stop Ctrl+C from reaching it; the watchdog then
    relies on its snapshot of descendants instead of the group."""
    if os.getpgrp() == os.getpid():
        return True
    with contextlib.suppress(OSError):
        if os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp():
            return False
    with contextlib.suppress(PermissionError):  # EPERM: a session leader (already leads its group)
        os.setpgid(0, 0)
    return os.getpgrp() == os.getpid()


# ---- memory ----

def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc's ``malloc_trim(0)``); True if some were.

    A node tokenizes its corpus in many allocations below glibc's mmap threshold (which rises to the size of
    the largest block freed before, up to 32 MB); once the tokens are joined they are freed but stay in the
    heap, counted in the node's resident memory for its whole life. Harmless where it is not glibc (False)."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


# ---- the watchdog ----

def _prctl(option: int, arg: int | bytes) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (``PR_SET_PDEATHSIG``): a child
    that must not outlive the process that started it (a node's rank, its launcher). Linux only."""
    return _prctl(PR_SET_PDEATHSIG, sig)


def start_watchdog(poll_s: float = 0.5, grace_s: float = 1.0) -> int:
    """Start a watchdog that cleans up after this process if it dies (SIGKILL included).

    Call it early (right after :func:`become_group_leader`, before starting threads). When this process is
    gone, the watchdog SIGTERMs this process group (if this process leads it), every descendant it saw at its
    last poll (``poll_s``) and the process groups those descendants led (the DHT's), SIGKILLs whatever is
    left after ``grace_s``, removes their IPC files (:func:`cleanup_ipc_files`) and exits. It ignores
    SIGINT, SIGTERM and SIGHUP, so a Ctrl+C of the group lets the node shut down cleanly; it holds no
    inherited file descriptors except stdin/stdout/stderr. Returns the watchdog's pid; call
    :func:`stop_watchdog` after an orderly shutdown: the watchdog then leaves this process's session and
    group and only tidies up once this process has exited (torch's shared-memory files, which its
    ``torch_shm_manager`` does not always remove).

    The watchdog is a lean process: the forked child sets up its signals and ``PR_SET_PDEATHSIG`` (both
    survive ``execve``), closes the inherited descriptors and executes a fresh interpreter (``python -I -S``)
    on this file, which imports nothing but the standard library. A plain fork kept the caller's pages: a
    node forks it after importing torch, and such a watchdog held 100 MB PSS (70 MB of it its own) where
    the fresh interpreter holds about 10 MB. Should the ``execve`` fail, the child watches in place (the
    same behaviour, at the fork's memory).
    """
    parent = os.getpid()
    pgid = os.getpgrp()
    kill_group = pgid == parent
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), _WATCHDOG_ARG, str(parent),
            str(pgid if kill_group else -1), repr(float(poll_s)), repr(float(grace_s))]
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        _watchdog_setup()
        if sys.executable:
            with contextlib.suppress(OSError):
                os.execv(sys.executable, argv)
        _watchdog(parent, pgid if kill_group else None, poll_s, grace_s)
    except BaseException:  # never let the child return into the caller's code
        code = 1
    finally:
        os._exit(code)


def _watchdog_setup() -> None:
    """The watchdog's signals, name, parent-death signal and descriptors; the signal dispositions, the mask and
    ``PR_SET_PDEATHSIG`` survive the ``execve`` of :func:`start_watchdog`, so no signal of the node's group
    can reach the fresh interpreter before it has started."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # SIGUSR1: the parent died (PDEATHSIG); SIGUSR2: the parent shut down in order (stop_watchdog).
    # Both blocked and taken with sigtimedwait, so neither can be lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    _prctl(PR_SET_NAME, _WATCHDOG_NAME)
    _prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    with contextlib.suppress(OSError):
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)


def _watchdog(parent: int, pgid: int | None, poll_s: float, grace_s: float) -> None:
    _watchdog_setup()  # again after the execve: the name, and PDEATHSIG once more (harmless)
    me = os.getpid()
    seen: dict[int, int] = {}  # pid -> starttime of the parent's descendants at the last poll
    groups: set[int] = set()  # process groups led by those descendants (e.g. the DHT's, see dht.py)
    files: set[str] = set()
    orderly = False
    while os.getppid() == parent:
        snapshot, led = {}, set()
        for p in descendants(parent):
            st = proc_stat(p)
            if p != me and st is not None:
                snapshot[p] = st[4]
                if st[3] == p:
                    led.add(p)
        seen, groups = snapshot, led
        files = ipc_files([parent, *seen]) | {f for f in files if os.path.exists(f)}
        # wakes on SIGUSR1 (parent death), SIGUSR2 (orderly shutdown) or after poll_s
        got = signal.sigtimedwait({signal.SIGUSR1, signal.SIGUSR2}, poll_s)
        if got is not None and got.si_signo == signal.SIGUSR2 and not orderly:
            orderly = True
            # Out of the node's session and group: once the node has returned, nothing of it is left there
            # (for a supervisor waiting on the session, or a killpg); only this tidy-up lingers, in a session
            # of its own like torch's shm manager, and for as long as that manager does (about a second).
            with contextlib.suppress(OSError):
                os.setsid()
    # the parent is gone: the descendants seen last, its group and the groups they led
    if pgid is not None:
        groups.add(pgid)
    if orderly:
        # Everything was shut down in order; what may still live is torch's shm manager, which exits by
        # itself once its last client is gone. Give it that moment, then stop and tidy up as below.
        deadline = time.monotonic() + 3 * grace_s
        while time.monotonic() < deadline and any(_same_alive(p, t) for p, t in seen.items()):
            time.sleep(0.02)

    def collect(targets: dict[int, int]) -> dict[int, int]:
        for p in _all_pids():
            st = proc_stat(p)
            if p != me and st is not None and st[3] in groups and st[1] not in ("Z", "X"):
                targets.setdefault(p, st[4])
        return {p: t for p, t in targets.items() if _same_alive(p, t)}

    targets = collect(dict(seen))
    stopped = len(targets)
    # Their files once more while they still live: a p2pd started (or a socket bound) after the last
    # poll would otherwise outlive them (a CI run killed a node within poll_s of its DHT's start).
    files |= ipc_files(list(targets))
    if not targets:
        cleanup_ipc_files([parent], files, retry_s=2.0)
        return
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGTERM)  # we ignore SIGTERM ourselves
    _signal_all(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and collect(dict(targets)):
        time.sleep(0.02)
    targets = collect(targets)
    _signal_all(targets, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_same_alive(p, t) for p, t in targets.items()):
        time.sleep(0.02)
    cleanup_ipc_files([parent, *seen, *targets], files, retry_s=2.0)
    kept = sorted(f for f in files if os.path.exists(f))
    alive = sorted(p for p, t in targets.items() if _same_alive(p, t))
    with contextlib.suppress(OSError):
        os.write(2, f"locoswarm watchdog: node process {parent} is gone; stopped {stopped} leftover process(es)"
                    f"{f'; still alive: {alive}' if alive else ''}{f'; files kept: {kept}' if kept else ''}\n".encode())


def stop_watchdog(pid: int | None, timeout_s: float = 2.0) -> None:
    """Tell the watchdog that this process shut down in order, and wait (up to ``timeout_s``) until it has
    moved to a session of its own: nothing of the node stays in the node's session or group once the node
    has returned. The watchdog then waits until this process has exited, removes what torch leaves in
    ``/dev/shm`` (its ``torch_shm_manager`` removes a segment only when it exits itself, and a loaded CI
    run saw segments outlive it) and ends; it cannot become a zombie of ours, since it only ends after we
    do."""
    if not pid:
        return
    try:
        session = os.getsid(0)
        os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout_s
        while os.getsid(pid) == session and time.monotonic() < deadline:
            time.sleep(0.005)
    except (ProcessLookupError, PermissionError):
        return


# ---- signals ----

def install_signal_handlers(stop: threading.Event, log: Callable[[str], None] | None = None,
                            first_words: Callable[[], str] | None = None) -> None:
    """SIGINT and SIGTERM set ``stop`` the first time (a graceful exit; one line, ``first_words()`` where given,
    is written to stderr, or passed to ``log``); a second one raises KeyboardInterrupt in the main thread, a
    third exits at once (``os._exit``; the watchdog cleans up). Must run in the main thread; call it again after
    starting hivemind components, which may replace the SIGINT handler (its averager ignores SIGINT).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_signal_handlers() must be called from the main thread")
    count = [0]

    def say(text: str) -> None:
        if log is not None:
            with contextlib.suppress(Exception):
                log(text)
        else:
            with contextlib.suppress(OSError):
                os.write(2, (text + "\n").encode())

    owner = os.getpid()

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a forked child (hivemind's DHT, a data worker) inherited this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        count[0] += 1
        if count[0] == 1:
            stop.set()
            text = "leaving the swarm (Ctrl+C again to force)"
            if first_words is not None:
                with contextlib.suppress(Exception):
                    text = first_words()
            say(text)
        elif count[0] <= 2:
            count[0] = 2
            say("forced exit")
            raise KeyboardInterrupt
        else:
            os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


__all__ = [
    "become_group_leader",
    "children",
    "cleanup_ipc_files",
    "descendants",
    "die_with_parent",
    "group_members",
    "install_signal_handlers",
    "ipc_files",
    "is_alive",
    "p2pd_pids",
    "proc_stat",
    "release_free_heap",
    "start_watchdog",
    "stop_watchdog",
    "terminate_processes",
]


def _watchdog_main(argv: list[str]) -> int:
    """The watchdog's fresh interpreter (``python -I -S process.py --locoswarm-watchdog PARENT PGID POLL GRACE``,
    from :func:`start_watchdog`): it imports nothing outside the standard library."""
    if len(argv) != 5 or argv[0] != _WATCHDOG_ARG:
        sys.stderr.write("usage: process.py --locoswarm-watchdog PARENT PGID POLL_S GRACE_S (started by the node)\n")
        return 2
    parent, pgid = int(argv[1]), int(argv[2])
    code = 0
    try:
        _watchdog(parent, pgid if pgid > 0 else None, float(argv[3]), float(argv[4]))
    except BaseException:
        code = 1
    return code


if __name__ == "__main__":
    os._exit(_watchdog_main(sys.argv[1:]))
