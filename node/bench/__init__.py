"""``locoswarm bench ...``: benchmark commands. Each writes a report: JSON + markdown + PNG."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
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

    from locoswarm.node.fsutil import atomic_write_bytes

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
