"""The ``locoswarm`` command line.

Each subsystem registers its own subcommand (``register(subparsers)``) and owns its flags; this
module only dispatches and turns user mistakes into one clear line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from locoswarm.node import plan
from locoswarm.node.bench import register as register_bench
from locoswarm.node.commands import admit, config, data, partition, run
from locoswarm.node.commands.export import register_export, register_generate
from locoswarm.node.commands.simulate import register as register_sim
from locoswarm.node.control.cli import register as register_status
from locoswarm.node.errors import Stopped, UserError
from locoswarm.node.helptext import describe


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (and a hint) instead of a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="locoswarm", description=describe(__doc__))
    parser.add_argument("--version", action="version", version="locoswarm 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for register in (run.register, config.register, partition.register, data.register, register_sim, register_bench,
                     plan.register, register_export, register_generate, register_status, admit.register):
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a launcher re-runs (``run --nproc``)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"locoswarm: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Stopped as exc:
        print(f"locoswarm: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("locoswarm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
