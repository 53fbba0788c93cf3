"""Shared test set-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _import_this_checkout() -> None:
    """Make ``locoswarm.node`` / ``locoswarm.protocol`` this checkout's node/ and protocol/, in this process and
    in the processes tests start (``python -m locoswarm.node.cli``), when the installed ``locoswarm`` is another
    checkout (several worktrees sharing one environment) or none: a ``locoswarm`` package whose path is the
    checkout's root, on PYTHONPATH. A fresh clone installed editable (CI) already maps here: nothing is done."""
    import atexit
    import importlib.util
    import os
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        spec = importlib.util.find_spec("locoswarm.node")
    except ModuleNotFoundError:  # no locoswarm installed at all
        spec = None
    if spec is not None and spec.origin and Path(spec.origin).resolve() == root / "node" / "__init__.py":
        return
    for name in [m for m in sys.modules if m == "locoswarm" or m.startswith("locoswarm.")]:
        del sys.modules[name]
    shim = Path(tempfile.mkdtemp(prefix="locoswarm-checkout-"))
    atexit.register(shutil.rmtree, shim, True)
    (shim / "locoswarm").mkdir()
    (shim / "locoswarm" / "__init__.py").write_text(f"__path__ = [{str(root)!r}]\n")
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)


_import_this_checkout()


def _sigterm_unwinds() -> None:
    """A SIGTERM to pytest (``timeout``, a CI runner cancelling) unwinds like Ctrl+C, so the running test's
    ``finally`` and fixtures stop the node processes it started. Without this, pytest died at once and the nodes,
    each in a session of its own, trained on with their DHT children and p2pd daemons (two nodes found running 13
    minutes after a ``timeout 580 pytest`` of the hostile-node tests)."""
    import signal

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills as usual
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)


_sigterm_unwinds()


@pytest.fixture(autouse=True, scope="session")
def _scratch_for_children():
    """The processes tests start (nodes, their DHT children, p2pd, torchrun) write their scratch files under a
    directory of this run's own, removed at the session's end: a process a test kills with SIGKILL cannot clean up
    after itself, and each left a ``pymp-*`` listener directory, a ``torch-shm-dir-*`` and a ``torchelastic_*`` in
    /tmp (about 60 an hour of the suite). The benchmarks' own mechanism (short paths included); pytest keeps the
    temporary directory it had (``tmp_path`` lives there, as before)."""
    from locoswarm.node.bench import children_scratch

    with children_scratch():
        yield


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The tensors in unit tests are small; on a busy 2-core box intra-op threads only add
    synchronisation cost (and two processes with two threads each thrash)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- test tiers --------------------------------------------------------------------------------------------------
# ``pytest -m "not swarm and not slow"`` is the fast tier: pure logic and in-process transports, without the few long
# ones marked ``slow`` by hand. A test is in the ``swarm`` tier when it starts processes or network daemons: it uses
# a fixture that does, or its body (or a helper it calls, of its module or of the suite's helper modules) names one
# of the calls below. Marked at collection, so that a new test lands in the right tier without anyone remembering
# to mark it. A test marked ``quick_process`` by hand starts one short python process that only imports (no node,
# no daemon, no socket) and stays in the fast tier.
_PROCESS_FIXTURES = frozenset({"honest", "daemon", "fake_peer", "live", "swarm", "pair", "net"})
_PROCESS_CALLS = ("NodeProc", "subprocess", "Popen", "start_dht", "P2P.create", "start_p2ps", "p2p_nodes", "netns",
                  "docker", "sys.executable", "cli(", 'get_context("spawn")', "mp.Process(")


def _starts_processes(source: str) -> bool:
    return any(call in source for call in _PROCESS_CALLS)


def _process_helpers(module) -> frozenset[str]:
    """The functions and classes of the module, its own or imported from a helper module of the suite
    (``swarm_util.run_bench``), whose source names a process-starting call."""
    import inspect

    here = Path(__file__).resolve().parent
    names = set()
    for name, obj in vars(module).items():
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        try:
            source_file = inspect.getsourcefile(inspect.unwrap(obj))  # a @contextmanager helper's own file
        except TypeError:
            continue
        if source_file and Path(source_file).resolve().parent == here:
            try:
                if _starts_processes(inspect.getsource(obj)):
                    names.add(name)
            except (OSError, TypeError):
                continue
    return frozenset(names)


def pytest_collection_modifyitems(config, items):
    import inspect

    helpers: dict[str, frozenset[str]] = {}
    for item in items:
        function, module = getattr(item, "function", None), getattr(item, "module", None)
        if function is None or module is None or item.get_closest_marker("quick_process"):
            continue
        if module.__name__ not in helpers:
            helpers[module.__name__] = _process_helpers(module)
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            source = ""
        called = any(f"{name}(" in source for name in helpers[module.__name__] if name != function.__name__)
        if set(item.fixturenames) & _PROCESS_FIXTURES or _starts_processes(source) or called:
            item.add_marker(pytest.mark.swarm)
