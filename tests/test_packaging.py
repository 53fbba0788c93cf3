"""The distribution's import names cannot collide (issue 12): node/ and protocol/ are installed as
locoswarm.node and locoswarm.protocol, never as top-level node/protocol; pyproject lists every package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)


def test_every_package_folder_is_listed_under_its_locoswarm_name() -> None:
    """A folder with an __init__.py under node/ or protocol/ missing from the list would be left out of a
    non-editable install (the docker image) while editable installs still find it."""
    setup = _pyproject()["tool"]["setuptools"]
    assert setup["package-dir"] == {"locoswarm.node": "node", "locoswarm.protocol": "protocol"}
    on_disk = sorted("locoswarm." + ".".join(p.parent.relative_to(REPO).parts)
                     for top in ("node", "protocol") for p in (REPO / top).rglob("__init__.py")
                     if "__pycache__" not in p.parts)
    assert sorted(setup["packages"]) == on_disk
    assert _pyproject()["project"]["scripts"]["locoswarm"] == "locoswarm.node.cli:main"


@pytest.mark.timeout(240)
def test_wheel_installs_locoswarm_node_and_no_top_level_node(tmp_path: Path) -> None:
    """The wheel a non-editable ``pip install .`` builds (the docker image's) holds locoswarm/node/... and
    locoswarm/protocol/... (with the .proto files), and nothing at top level but locoswarm and its metadata.
    Built from a copy of the sources, so that setuptools' build/ and egg-info stay out of the checkout."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("node", "protocol"):
        shutil.copytree(REPO / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--no-index", "-q", "-w", str(tmp_path / "wheel"), str(src)],
                         capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("locoswarm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"locoswarm"}
    expected = {f"locoswarm/{p.relative_to(REPO).as_posix()}" for top in ("node", "protocol")
                for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts}
    assert expected <= set(names), sorted(expected - set(names))[:5]
    assert {f"locoswarm/protocol/{p.name}" for p in (REPO / "protocol").glob("*.proto")} <= set(names)
    assert "locoswarm = locoswarm.node.cli:main" in entry


def test_no_module_is_imported_under_the_old_top_level_names() -> None:
    """Importing every module of the package, from the repository root (where the folders node/ and
    protocol/ would also be importable as top-level packages), loads nothing named node.* or protocol.*:
    no module is loaded twice under two names."""
    code = ("import pkgutil, sys, importlib\n"
            "import locoswarm.node, locoswarm.protocol\n"
            "for pkg in (locoswarm.node, locoswarm.protocol):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('node', 'protocol')))\n"
            "print(sum(m.startswith('locoswarm.node.') for m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stderr[-2000:]
    old, count = res.stdout.split("\n")[:2]
    assert old == "[]"
    assert int(count) > 20
