"""``locoswarm bench ...``: benchmark commands. Each writes a report: JSON + markdown + PNG."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from locoswarm.node.fsutil import atomic_write_bytes


def register(sub: argparse._SubParsersAction) -> None:
    # lazy: circle (the benchmark modules import this package's helpers at their heads)
    from locoswarm.node.bench import codecs, convergence, memory, robustness
    from locoswarm.node.bench import swarm as swarm_bench

    p = sub.add_parser("bench", help="benchmarks that write a report (JSON + markdown + PNG)")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK",
                                 parser_class=type(p))
    codecs.register(bench_sub)
    convergence.register(bench_sub)
    memory.register(bench_sub)
    robustness.register(bench_sub)
    swarm_bench.register(bench_sub)


def write_png(fig, path: Path) -> None:
    """Lay out ``fig`` (a matplotlib figure), write it to ``path`` as a PNG atomically and close it: the
    last step of every benchmark's plot."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


@contextlib.contextmanager
def local_swarm_runs(what: str, total: int, console) -> Iterator[tuple[Path, object, object]]:
    """What a benchmark of local node processes runs its items (scenarios, configurations) in: a scratch
    directory (removed afterwards), a rich progress display with a task counting ``total`` items of
    ``what``, and a SIGTERM handler that turns the signal into ``KeyboardInterrupt``, so that the ``finally``
    of every item still stops the nodes it started. Yields ``(scratch, progress, task)``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    signal.signal(signal.SIGTERM, _interrupt)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}"),
               TimeElapsedColumn()]
    with tempfile.TemporaryDirectory(prefix=f"locoswarm-{what}-") as tmp, children_scratch(), \
            Progress(*columns, console=console) as progress:
        yield Path(tmp), progress, progress.add_task(what, total=total)


@contextlib.contextmanager
def children_scratch() -> Iterator[None]:
    """The processes a benchmark starts inherit a ``TMPDIR`` of the benchmark's own, removed at the end, so the files
    they leave when killed (multiprocessing's ``pymp-*`` listener directories, torch's ``torch-shm-dir-*``) do not
    pile up in /tmp. Its path stays short (``/tmp/lsw-XXXXXXXX`` where the temporary directory's own is long, as a
    test's is): a unix socket's path must stay under 108 bytes, and multiprocessing binds one in it."""
    base = tempfile.gettempdir()
    scratch = tempfile.mkdtemp(prefix="lsw-", dir=base if len(base) <= SHORT_TMP else "/tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = scratch
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(scratch, ignore_errors=True)


# The longest temporary directory a benchmark's processes get (see ``children_scratch``): a multiprocessing
# listener adds about 40 bytes, a hivemind socket name 36, and a unix socket's path holds 107.
SHORT_TMP = 48


def keep_logs(root: Path, dest: Path) -> None:
    """An item's node logs, kept next to the report (the item's scratch folder is temporary)."""
    dest.mkdir(parents=True, exist_ok=True)
    for log_file in root.glob("*.log"):
        shutil.copyfile(log_file, dest / log_file.name)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
