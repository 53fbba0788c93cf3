"""Discovery: starting the node's hivemind DHT and joining a swarm through bootstrap peers.

hivemind 1.1.12 treats an unreachable bootstrap peer as fatal at start (p2pd exits with "failed to
connect to bootstrap peers"), so :func:`start_dht` retries with exponential backoff, falls back to
one bootstrap peer at a time, and makes sure a failed attempt leaves no DHT process or p2pd behind.
A fixed port is checked first: p2pd binds with SO_REUSEPORT and would silently share a taken port.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import ipaddress
import os
import re
import shlex
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from locoswarm.node.errors import Stopped, UserError
from locoswarm.node.swarm import process as _proc

if TYPE_CHECKING:  # pragma: no cover
    import hivemind

ENV_BOOTSTRAP = "LOCOSWARM_BOOTSTRAP"
_EXAMPLE = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."
_PROBE_TIMEOUT = 2.0
_SOCKETS = "/tmp/hivemind-*.sock"


# ---- bootstrap addresses ----

def validate_bootstrap(addrs: Iterable[str]) -> list[str]:
    """Check that each address is a multiaddr with a valid ``/p2p/<peer id>``; returns them stripped
    and de-duplicated (order kept). Raises :class:`UserError` naming the first bad one."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    out: list[str] = []
    for raw in addrs:
        addr = str(raw).strip()
        if not addr:
            continue
        try:
            ma = Multiaddr(addr)
        except Exception as exc:
            raise UserError(f"bootstrap address {addr!r} is not a valid multiaddr ({_short(exc)}); write it "
                            f"like {_EXAMPLE} (the address a running peer prints)") from None
        if "p2p" not in ma:
            raise UserError(f"bootstrap address {addr!r} has no /p2p/<peer id> part; append the peer id, like "
                            f"{_EXAMPLE} (the address a running peer prints)")
        try:
            PeerID.from_base58(ma["p2p"])
        except Exception:
            raise UserError(f"bootstrap address {addr!r} has an invalid peer id; copy the whole address a "
                            f"running peer prints, like {_EXAMPLE}") from None
        if addr not in out:
            out.append(addr)
    return out


def bootstrap_from_env_and_args(cfg_bootstrap: Sequence[str], cli: Sequence[str] | None) -> list[str]:
    """The bootstrap peers to use: ``--bootstrap`` flags (repeatable; each may hold several addresses
    separated by commas or spaces) override ``$LOCOSWARM_BOOTSTRAP`` (comma/space separated), which
    overrides ``[swarm] bootstrap`` of peers.toml. De-duplicated, order kept; not validated here."""
    def split(items: Iterable[str]) -> list[str]:
        out: list[str] = []
        for item in items:
            for part in re.split(r"[\s,]+", str(item)):
                if part and part not in out:
                    out.append(part)
        return out

    if cli:
        chosen = split(cli)
        if chosen:
            return chosen
    env = os.environ.get(ENV_BOOTSTRAP, "")
    if env.strip():
        return split([env])
    return split(cfg_bootstrap or [])


# ---- ports ----

def _host_maddr(host: str, port: int) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise UserError(f"listen host {host!r} is not an IP address; use e.g. 127.0.0.1 (this machine only) "
                        f"or 0.0.0.0 (all interfaces)") from None
    return f"/ip{ip.version}/{host}/tcp/{port}"


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`UserError` naming the port if ``host:port`` (TCP) cannot be bound right now."""
    if not 0 < port < 65536:
        raise UserError(f"port {port} is out of range; use 1-65535, or 0 for any free port")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT, not listeners
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use (another locoswarm node or program?); "
                            f"stop it, pick another port, or use port 0 for any free port") from None
        if exc.errno == errno.EACCES:
            raise UserError(f"port {port} on {host} needs privileges; use a port >= 1024") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"cannot listen on {host}: not an address of this machine; use 127.0.0.1, "
                            f"0.0.0.0 or one of this machine's addresses") from None
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    finally:
        sock.close()


# ---- starting the DHT ----

def _short(exc: BaseException) -> str:
    text = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", " ".join(str(exc).split()))  # p2pd's timestamps
    return text[:200] if text else type(exc).__name__


def _probe(addr: str, timeout: float = _PROBE_TIMEOUT) -> str:
    """Why a bootstrap peer did not answer, as a few words (a TCP probe of its address)."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        ma = Multiaddr(addr)
        host = next((ma[p] for p in ("ip4", "ip6", "dns4", "dns6", "dns") if p in ma), None)
        port = int(ma["tcp"]) if "tcp" in ma else None
    except Exception:
        return "unreachable"
    if host is None or port is None:
        return "unreachable (not a TCP address)"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no TCP answer in {timeout:g} s"
    except socket.gaierror:
        return f"cannot resolve {host}"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    return "port open, but no locoswarm peer with that peer id answered"


def _reason(addr: str, exc: BaseException | None) -> str:
    text = str(exc or "")
    if "none of the initial_peers responded" in text:
        return "its DHT did not answer a ping"
    return _probe(addr)


def _is_identity_error(exc: BaseException) -> bool:
    return "already taken by another peer" in str(exc)


def _identity_peer_id(path: Path) -> str:
    try:
        from hivemind.p2p import PeerID

        return PeerID.from_identity(path.read_bytes()).to_base58()
    except Exception:
        return "?"


def _kill_dht(dht: hivemind.DHT, p2pds: dict[int, int], before: set[int], files: set[str]) -> None:
    """Make sure a DHT whose start failed left no process: the DHT child and every p2pd it started."""
    with contextlib.suppress(Exception):
        if dht.is_alive():
            dht.shutdown()
    with contextlib.suppress(Exception):
        dht.join(2.0)
    with contextlib.suppress(Exception):
        if dht.is_alive():
            dht.kill()
            dht.join(2.0)
    # p2pds that outlived their DHT process: the ones we saw, and new ones in the DHT's process group
    for pid in _proc.p2pd_pids(_proc._all_pids()):
        st = _proc.proc_stat(pid)
        if pid not in before and pid not in p2pds and st is not None and dht.pid and st[3] == dht.pid:
            p2pds[pid] = st[4]
    live = [p for p, t in p2pds.items() if _proc._same_alive(p, t)]
    files = files | _proc.ipc_files(live)
    _proc.terminate_processes(live, grace_s=1.0)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(_proc.is_alive(p) for p in live):
        time.sleep(0.02)
    _proc.cleanup_ipc_files(live, files)


_DHT_CLASS: type | None = None

# Identity files this process holds locked (open fds). Every forked child closes its copies: only this
# process's fd keeps the lock, so a DHT shut down here frees its identity even while other children of
# the node (another DHT's process, a data worker) live on.
_IDENTITY_LOCKS: set[int] = set()


def _drop_identity_locks_in_child() -> None:
    for fd in _IDENTITY_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _IDENTITY_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_identity_locks_in_child)


def _identity_in_use(identity_path: Path) -> UserError:
    return UserError(f"the identity {identity_path} (peer id {_identity_peer_id(identity_path)}) is "
                     f"already used by another running node; stop that node or give this one its "
                     f"own state directory")


def _lock_identity(identity_path: Path) -> int | None:
    """Lock the identity file for this process (flock, freed by the kernel when the process dies):
    two nodes on one machine with one state directory are refused at once, without hivemind's probe,
    which asks the swarm whether the peer id answers and can miss a peer that just (re)joined. Returns
    the fd to :func:`_unlock_identity` later; None where the file or its file system has no lock."""
    try:
        fd = os.open(identity_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _identity_in_use(identity_path) from None
    except OSError:  # no locks here (some network file systems): hivemind's probe is all there is
        os.close(fd)
        return None
    _IDENTITY_LOCKS.add(fd)
    return fd


def _unlock_identity(fd: int | None) -> None:
    if fd is not None and fd in _IDENTITY_LOCKS:
        _IDENTITY_LOCKS.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


def _kill_own_group(signum: int, frame: object) -> None:
    """The DHT child's end when the node died: SIGKILL the rest of its group (p2pd), remove the files they
    owned (p2pd's socket: a SIGKILLed p2pd leaves it, and a p2pd started after the watchdog's last poll is
    one the watchdog never saw), then SIGKILL the group, this process included."""
    me, group = os.getpid(), os.getpgid(0)
    with contextlib.suppress(Exception):
        others = [p for p in _proc.group_members(group) if p != me]
        files = _proc.ipc_files(others)
        for pid in others:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        # Our own children (p2pd): reap them, then their files go at once. /proc/net/unix may list a dead
        # p2pd's socket for a while, and waiting that out here lost the race with the watchdog's SIGKILL.
        deadline = time.monotonic() + 1.0
        while any(_proc.is_alive(p) for p in others) and time.monotonic() < deadline:
            for pid in others:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.01)
        if not any(_proc.is_alive(p) for p in others):
            for path in files:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    os.killpg(group, signal.SIGKILL)


def _share_by_descriptor() -> None:
    """Undo hivemind's switch of torch's sharing strategy to ``file_system`` (its ``mpfuture`` does it at import,
    unless ``HIVEMIND_MEMORY_SHARING_STRATEGY`` names another): back to ``file_descriptor``, Linux's default.

    The only tensors a node shares between processes are hivemind's future states (16-byte buffers that every
    DHT call passes to the DHT child). Under ``file_system`` their first share started a ``torch_shm_manager``
    (80 MB PSS, 58 MB of it its own, measured on a lone tiny node) in a session of its own, and a SIGKILL left
    ``/dev/shm/torch_<pid>_*`` files; with descriptors the segment is unlinked at once and passed over a unix
    socket, with no manager. A strategy named in that variable is kept."""
    if os.environ.get("HIVEMIND_MEMORY_SHARING_STRATEGY"):
        return
    import torch.multiprocessing

    if "file_descriptor" in torch.multiprocessing.get_all_sharing_strategies():
        torch.multiprocessing.set_sharing_strategy("file_descriptor")


def _dht_class() -> type:
    """``hivemind.DHT`` whose child process leads its own process group (p2pd, started by it, joins
    that group): a terminal's Ctrl+C, sent to the node's foreground group, then reaches only the node,
    which can still publish its leaving heartbeat and shut the DHT down in order (p2pd exits on
    SIGINT). The child also drops the parent's Python signal handlers it inherited through fork. The
    watchdog of :mod:`locoswarm.node.swarm.process` kills groups led by the node's descendants."""
    global _DHT_CLASS
    if _DHT_CLASS is None:
        import hivemind

        _share_by_descriptor()

        class GroupedDHT(hivemind.DHT):
            def __init__(self, *args, **kwargs) -> None:
                self._node_pid = os.getpid()  # the parent, recorded before the fork
                self._identity_lock: int | None = None
                super().__init__(*args, **kwargs)

            def hold_identity_lock(self, fd: int | None) -> None:
                """Keep the identity file locked (see :func:`_lock_identity`) until this DHT shuts down."""
                self._identity_lock = fd

            def shutdown(self) -> None:
                try:
                    super().shutdown()
                finally:
                    if os.getpid() == self._node_pid:
                        _unlock_identity(self._identity_lock)
                        self._identity_lock = None

            def run(self) -> None:
                with contextlib.suppress(OSError):
                    os.setpgid(0, 0)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                # Die with the node, p2pd included, even if the node and its watchdog were SIGKILLed
                # together (e.g. `kill -9 -PGID`): the kernel sends SIGTERM when the node dies, and the
                # handler takes this whole group (this process and its p2pd) down.
                signal.signal(signal.SIGTERM, _kill_own_group)
                _proc._prctl(_proc.PR_SET_PDEATHSIG, signal.SIGTERM)
                # The node died before the request took effect. (Compare with the recorded pid, not
                # with 1: in a container without an init the node itself is PID 1.)
                if os.getppid() != self._node_pid:
                    _kill_own_group(signal.SIGTERM, None)
                super().run()

        _DHT_CLASS = GroupedDHT
    return _DHT_CLASS


def _try_start(peers: list[str], host_maddr: str, identity_path: Path, stop: threading.Event | None,
               start_timeout: float, kwargs: dict) -> tuple[hivemind.DHT | None, BaseException | None]:
    before = set(_proc.p2pd_pids(_proc._all_pids()))
    old_files = set(glob.glob(_SOCKETS))
    dht = _dht_class()(initial_peers=peers or None, start=False, host_maddrs=[host_maddr],
                       identity_path=str(identity_path), **kwargs)
    seen: dict[int, int] = {}
    files: set[str] = set()
    deadline = time.monotonic() + start_timeout
    try:
        dht.run_in_background(await_ready=False)
        while True:
            if dht.pid:
                for pid in _proc.p2pd_pids(_proc.children(dht.pid)):
                    st = _proc.proc_stat(pid)
                    if st is not None and pid not in seen:
                        seen[pid] = st[4]
                        files |= _proc.ipc_files([pid])
            try:
                dht.wait_until_ready(timeout=0.05)
                return dht, None
            except TimeoutError:
                pass
            if stop is not None and stop.is_set():
                raise Stopped("stopped before joining the swarm: nothing to leave")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the DHT did not start in {start_timeout:g} s")
            if not dht.is_alive():
                try:
                    dht.wait_until_ready(timeout=1.0)
                    return dht, None
                except TimeoutError:
                    raise RuntimeError(f"the DHT process exited (code {dht.exitcode})") from None
    except BaseException as exc:
        # sockets that appeared during this attempt and that no living process binds are ours
        _kill_dht(dht, seen, before, files | (set(glob.glob(_SOCKETS)) - old_files))
        if isinstance(exc, UserError | KeyboardInterrupt | SystemExit):
            raise
        return None, exc


def _with_record_validators(identity_path: Path, kwargs: dict) -> dict:
    """``kwargs`` for ``hivemind.DHT`` with the signed-record validators of :mod:`locoswarm.node.swarm.records`
    (unless the caller passes its own ``record_validators``). They sign with the libp2p identity, so the
    identity file is created here when missing, as hivemind would create it; hivemind skips its
    "identity already taken" probe (an extra p2pd) for a key it just generated, and so do we."""
    # lazy: swarm.records imports hivemind (~0.35 s at every CLI start, measured)
    from locoswarm.node.swarm.records import record_validators

    if "record_validators" in kwargs:
        return kwargs
    fresh = not identity_path.exists()
    try:
        validators = record_validators(identity_path)
    except OSError as exc:
        raise UserError(f"cannot create the identity file {identity_path} ({exc.strerror or exc}); "
                        f"choose a writable state directory") from None
    out = {**kwargs, "record_validators": validators}
    if fresh:
        out.setdefault("check_if_identity_free", False)
    return out


def start_dht(initial_peers: Sequence[str], *, host: str = "127.0.0.1", port: int = 0, identity_path: Path,
              attempts: int | None = None, backoff: tuple[float, float] = (1.0, 30.0),
              log: Callable[[str], None] = print, stop: threading.Event | None = None,
              start_timeout: float = 60.0, **dht_kwargs) -> hivemind.DHT:
    """Start this node's DHT (listening on ``host:port``; port 0 = any free port) and join the swarm
    through ``initial_peers`` (none: start a new swarm).

    ``identity_path`` is the node's private key file (created on first run, its directory too), so the
    peer id survives restarts. A failed bootstrap attempt logs one line naming each peer and why it did
    not answer, then the node retries after an exponential backoff (``backoff = (initial, max)``
    seconds) until ``attempts`` attempts have failed (None: forever, until ``stop`` is set). An attempt
    passes all peers at once, then (with several) each one alone. Raises :class:`UserError` when it
    gives up, on a bad address, a taken port, an identity used by another running node, or when
    ``stop`` is set. Extra keyword arguments go to ``hivemind.DHT``; unless they name ``record_validators``,
    the DHT gets :func:`locoswarm.node.swarm.records.record_validators` (records under owner subkeys must be signed
    by their owner; sizes bounded), signing with this identity.
    """
    peers = validate_bootstrap(initial_peers)
    identity_path = Path(identity_path)
    try:
        identity_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the state directory {identity_path.parent} "
                        f"({exc.strerror or exc}); choose a writable directory") from None
    dht_kwargs = _with_record_validators(identity_path, dht_kwargs)
    host_maddr = _host_maddr(host, port)
    lo, hi = float(backoff[0]), float(backoff[1])
    if attempts is not None and attempts < 1:
        raise ValueError("attempts must be >= 1 or None")
    candidates = [peers] + ([[p] for p in peers] if len(peers) > 1 else [])
    lock = _lock_identity(identity_path)
    try:
        attempt, delay = 0, lo
        while True:
            attempt += 1
            errors: dict[str, BaseException | None] = {}
            last: BaseException | None = None
            for group in candidates:
                if port:
                    check_port_free(host, port)
                dht, exc = _try_start(group, host_maddr, identity_path, stop, start_timeout, dht_kwargs)
                if dht is not None:
                    if attempt > 1 or group is not candidates[0]:
                        log(f"bootstrap: joined the swarm via {', '.join(group)} (attempt {attempt})")
                    dht.hold_identity_lock(lock)
                    return dht
                last = exc
                if _is_identity_error(exc):
                    raise _identity_in_use(identity_path) from None
                if not peers:
                    raise UserError(f"cannot start the DHT on {host_maddr}: {_short(exc)}") from None
                for addr in group:
                    errors.setdefault(addr, exc)
            why = ", ".join(f"{addr} ({_reason(addr, err)})" for addr, err in errors.items())
            if attempts is not None and attempt >= attempts:
                log(f"bootstrap: no answer from {why}; giving up (attempt {attempt} of {attempts})")
                raise UserError(
                    f"could not join the swarm: no bootstrap peer answered after {attempt} attempt(s) "
                    f"({_short(last) if last else 'no details'}); check that a peer runs at "
                    f"{', '.join(peers)} and that the address (with its /p2p/ peer id) is the one it prints, "
                    f"or leave --bootstrap out to start a new swarm")
            log(f"bootstrap: no answer from {why}; retrying in {delay:.1f} s (attempt {attempt})")
            if stop is not None:
                if stop.wait(delay):
                    raise Stopped("stopped before joining the swarm: nothing to leave")
            else:
                time.sleep(delay)
            delay = min(delay * 2, hi)
    except BaseException:
        _unlock_identity(lock)
        raise


# ---- addresses to share ----

def _is_loopback(addr: str) -> bool:
    parts = addr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(parts[2]).is_loopback
    return len(parts) > 2 and parts[1] in ("dns", "dns4", "dns6") and parts[2] == "localhost"


def _is_link_local(addr: str) -> bool:
    parts = addr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(parts[2]).is_link_local
    return False


def tcp_port_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind ``host:port`` now."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                return True
        except OSError:
            continue
    return False


def maddr_port(maddr: str) -> int | None:
    """The TCP port of a multiaddr like ``/ip4/1.2.3.4/tcp/31337/p2p/Qm...`` (None without one)."""
    parts = str(maddr).split("/")
    if "tcp" in parts and "p2p-circuit" not in parts:
        with contextlib.suppress(ValueError, IndexError):
            return int(parts[parts.index("tcp") + 1])
    return None


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """This node's own multiaddrs (each with ``/p2p/<peer id>``), loopback first."""
    addrs: list[str] = []
    for ma in dht.get_visible_maddrs():
        text = str(ma)
        if text not in addrs:
            addrs.append(text)
    return sorted(addrs, key=lambda a: (not _is_loopback(a), "/p2p-circuit" in a, "/ip6/" in a))


def join_command(maddrs: Sequence[str], config_path: str | None) -> str:
    """The command another machine runs to join this node's swarm, e.g.
    ``locoswarm run --config peers.toml --bootstrap /ip4/192.168.1.5/tcp/31337/p2p/12D3KooW...``.
    Uses a non-loopback address when there is one; otherwise the loopback one, with a note."""
    usable = [a for a in maddrs if "/p2p/" in a and "/p2p-circuit" not in a]
    if not usable:
        raise ValueError("no multiaddr with a /p2p/ peer id to share")
    remote = [a for a in usable if not _is_loopback(a) and not _is_link_local(a)]
    remote.sort(key=lambda a: "/ip6/" in a)
    addr = remote[0] if remote else usable[0]
    cmd = "locoswarm run"
    if config_path:
        cmd += f" --config {shlex.quote(str(config_path))}"
    cmd += f" --bootstrap {addr}"
    if not remote:
        cmd += ("  # loopback address: works only on this machine; listen on a LAN or public address "
                "to let other machines join")
    return cmd


__all__ = [
    "ENV_BOOTSTRAP",
    "bootstrap_from_env_and_args",
    "check_port_free",
    "join_command",
    "start_dht",
    "validate_bootstrap",
    "visible_maddrs",
]
