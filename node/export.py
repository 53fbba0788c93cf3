"""``locoswarm export``: write a node's checkpointed model as a transformers directory.

Kept apart from ``node.checkpoint`` so that building the command line (every ``locoswarm`` call,
``locoswarm status`` included) does not import torch: the checkpoint code is imported when the
command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _cmd_export(args: argparse.Namespace) -> int:
    from node.checkpoint import export_model
    from node.cli import load_config_from_args
    from node.data import load_tokenizer

    cfg = load_config_from_args(args)
    vocab_size = load_tokenizer(cfg.model.tokenizer).vocab_size
    use = "live" if args.live else "outer"
    out = export_model(Path(args.state_dir), Path(args.out), cfg, vocab_size, use=use)
    print(f"exported the {'live' if args.live else 'outer (consensus)'} model to {out}")
    return 0


def register_export(sub: Any) -> None:
    """Add the ``export`` subcommand: write the checkpointed model as a transformers directory."""
    from node.cli import add_config_args

    parser = sub.add_parser(
        "export", help="export a node's checkpointed model as a transformers directory",
        description="Load the checkpoint in --state-dir and save its model with save_pretrained "
                    "(safetensors) into --out, plus locoswarm.json naming the swarm fingerprint and versions.")
    add_config_args(parser)
    parser.add_argument("--state-dir", required=True, help="state dir of the node (holds checkpoint.json)")
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.add_argument("--live", action="store_true",
                        help="export this node's live params theta instead of the consensus outer params phi")
    parser.set_defaults(func=_cmd_export)
