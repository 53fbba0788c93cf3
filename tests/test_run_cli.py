"""``locoswarm run`` as a new user meets it: bad input is refused in one line before anything starts
(no DHT, no join command), the state dir is checked and locked, a restart keeps its libp2p port, and
a crashed save's temporary files are cleaned up."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from swarm_util import REPO, write_config, write_corpus

from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import StateDirLock, prepare_state_dir

pytestmark = pytest.mark.timeout(240)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "locoswarm.node.cli", "run", "--threads", "1", "--control-port", "0", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def refused_before_start(res: subprocess.CompletedProcess, *needles: str) -> str:
    """The run failed with one ``locoswarm: error:`` line naming ``needles``, before any network started."""
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("locoswarm: error: ")]
    assert len(errors) == 1, out
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert "listening on" not in out and "--bootstrap" not in out, f"the network started first:\n{out}"
    return errors[0]


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    return write_config(tmp_path / "peers.toml"), write_corpus(tmp_path / "data", docs=3, lines=60)


def test_a_state_dir_that_is_a_file_is_refused(setup, tmp_path: Path) -> None:
    config, data = setup
    (tmp_path / "afile").write_text("x")
    line = refused_before_start(run("--config", str(config), "--data", str(data), "--state-dir",
                                    str(tmp_path / "afile"), "--max-steps", "1"), "afile", "is a file")
    assert "give a directory" in line


def test_a_state_dir_in_use_by_another_node_is_refused(setup, tmp_path: Path) -> None:
    config, data = setup
    state = tmp_path / "state"
    state.mkdir()
    lock = StateDirLock(state)  # this test process plays the running node
    try:
        refused_before_start(run("--config", str(config), "--data", str(data), "--state-dir", str(state),
                                 "--max-steps", "1"), "in use by another running node", f"pid {os.getpid()}")
    finally:
        lock.release()


@pytest.mark.parametrize("case", ["fragments", "data", "device", "empty-config", "binary-data"])
def test_bad_settings_are_refused_before_the_network_starts(setup, tmp_path: Path, case: str) -> None:
    config, data = setup
    args = ["--config", str(config), "--data", str(data), "--state-dir", str(tmp_path / "s"), "--max-steps", "1"]
    if case == "fragments":
        needles = ("outer.fragments = 8", "decoder blocks")
        args += ["--set", "outer.fragments=8", "--set", "outer.h=16"]  # the test model has 2 blocks
    elif case == "data":
        needles = ("nowhere",)
        args += ["--data", str(tmp_path / "nowhere")]
    elif case == "device":
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA: --device cuda is valid here")
        needles = ("cuda", "not available")
        args += ["--device", "cuda"]
    elif case == "empty-config":
        (tmp_path / "empty.toml").write_text("# nothing here\n")
        needles = ("empty.toml", "is empty")
        args += ["--config", str(tmp_path / "empty.toml")]
    else:
        blob = tmp_path / "blob"
        blob.mkdir()
        (blob / "weights.txt").write_bytes(bytes(range(256)) * 64)  # a .txt name does not make it text
        needles = ("binary file", "weights.txt")
        args += ["--data", str(blob)]
    refused_before_start(run(*args), *needles)
    assert not (tmp_path / "s" / "identity.key").exists()


def test_a_restart_keeps_its_port_and_removes_a_crashed_saves_temp_files(setup, tmp_path: Path) -> None:
    config, data = setup
    state = tmp_path / "state"
    args = ["--config", str(config), "--data", str(data), "--state-dir", str(state), "--max-steps", "3",
            "--eval-every", "0"]
    first = run(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    port = re.search(r"listening on /ip4/127\.0\.0\.1/tcp/(\d+)/", first.stderr + first.stdout)
    assert port, first.stderr
    # a kill -9 in the middle of a checkpoint and of a status write leaves these behind
    stale = [state / ".checkpoint.0123.safetensors.tmp", state / ".status.json.abcd.tmp"]
    for path in stale:
        path.write_bytes(b"\0" * 4096)
    second = run(*args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"listening on /ip4/127.0.0.1/tcp/{port.group(1)}/" in second.stderr + second.stdout
    assert not any(p.exists() for p in stale)
    assert "add_port.cc" not in second.stderr


def test_a_taken_control_port_is_one_friendly_line_without_grpcs_own(setup, tmp_path: Path) -> None:
    config, data = setup
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        res = run("--config", str(config), "--data", str(data), "--state-dir", str(tmp_path / "s"),
                  "--max-steps", "1", "--control-port", str(taken))
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out
    assert str(taken) in out and "add_port.cc" not in out, out


def test_prepare_state_dir_says_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="cannot be created"):
        prepare_state_dir(tmp_path / "file" / "sub")  # a parent that is a file
    ro = tmp_path / "ro"
    ro.mkdir()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(UserError, match=r"is not writable \(Read-only file system\)"):
        prepare_state_dir(ro)
    monkeypatch.undo()
    lock = prepare_state_dir(ro)
    try:
        assert (ro / ".lock").read_text().strip() == str(os.getpid())
    finally:
        lock.release()
    prepare_state_dir(ro).release()  # released: usable again


def _subparsers(parser) -> dict:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_help_text_is_plain_and_every_option_explained() -> None:
    from locoswarm.node.cli import build_parser
    from locoswarm.node.helptext import describe

    assert describe("``locoswarm run``: the :class:`~locoswarm.node.daemon.Node`'s ``loop``\nmore") == \
        "locoswarm run: the locoswarm.node.daemon.Node's loop"
    todo = [("locoswarm", build_parser())]
    seen = 0
    while todo:
        name, parser = todo.pop()
        text = parser.format_help()
        assert "``" not in text and ":class:" not in text and ":func:" not in text, f"{name}:\n{text}"
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help text"
        todo += [(f"{name} {sub}", p) for sub, p in _subparsers(parser).items()]
        seen += 1
    assert seen > 10


@pytest.mark.quick_process
def test_building_the_command_line_imports_no_torch() -> None:
    """``locoswarm --help``, ``locoswarm status`` and argument errors start without torch (1.6 s of CPU, measured) or
    the other heavy packages: a command imports its torch modules when it runs. In a fresh interpreter, which no
    other test's imports reach."""
    code = ("import sys\n"
            "from locoswarm.node.cli import build_parser\n"
            "build_parser()\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'hivemind', 'transformers'}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"building the command line imports {res.stdout.strip()}"


DOMAIN = ["locoswarm.node.config", "locoswarm.node.partition", "locoswarm.node.checkpoint", "locoswarm.node.daemon",
          "locoswarm.node.data", "locoswarm.node.model", "locoswarm.node.plan",
          "locoswarm.node.core.outer_loop", "locoswarm.node.swarm.averaging"]


@pytest.mark.parametrize("module", DOMAIN)
def test_domain_modules_do_not_import_the_command_line(module: str) -> None:
    code = (f"import sys, {module}, inspect\n"
            "bad = [m for m in sys.modules if m in ('locoswarm.node.cli', 'locoswarm.node.commands') or "
            "m.startswith('locoswarm.node.commands.')]\n"
            f"src = inspect.getsource({module})\n"
            "bad += [w for w in ('locoswarm.node.cli', 'locoswarm.node.commands') if w in src]\n"
            "print(bad)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"{module} reaches the CLI layer: {res.stdout}"
