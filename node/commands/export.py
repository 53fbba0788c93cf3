"""``locoswarm export`` and ``locoswarm generate``: a node's checkpointed model as a transformers
directory (with the swarm's tokenizer), or sampled from on the command line.

Building the command line (every ``locoswarm`` call, ``locoswarm status`` included) does not import
torch: the checkpoint code is imported when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from locoswarm.node.commands import add_config_args, load_config_from_args
from locoswarm.node.errors import UserError
from locoswarm.node.generate import generate_text


def _cmd_export(args: argparse.Namespace) -> int:
    # lazy: locoswarm.node.checkpoint and .data import torch (~1 s, measured); this module does not
    from locoswarm.node.checkpoint import export_model
    from locoswarm.node.data import load_tokenizer

    cfg = load_config_from_args(args)
    use = "live" if args.live else "outer"
    out = export_model(Path(args.state_dir), Path(args.out), cfg, load_tokenizer(cfg.model.tokenizer), use=use)
    print(f"exported the {'live' if args.live else 'outer (consensus)'} model to {out}")
    return 0


def _checkpoint_args(parser: argparse.ArgumentParser, verb: str) -> None:
    """The swarm's config, the node's state dir and which of its params: shared by export and generate."""
    add_config_args(parser)
    parser.add_argument("--state-dir", required=True, help="state dir of the node (holds checkpoint.json)")
    parser.add_argument("--live", action="store_true",
                        help=f"{verb} this node's live params theta instead of the consensus outer params phi")


def register_export(sub: Any) -> None:
    """Add the ``export`` subcommand: write the checkpointed model as a transformers directory."""

    parser = sub.add_parser(
        "export", help="export a node's checkpointed model as a transformers directory",
        description="Load the checkpoint in --state-dir and save its model with save_pretrained "
                    "(safetensors) into --out, plus locoswarm.json naming the swarm fingerprint and versions.")
    _checkpoint_args(parser, "export")
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.set_defaults(func=_cmd_export)


def _cmd_generate(args: argparse.Namespace) -> int:
    # lazy: locoswarm.node.checkpoint and .data import torch (~1 s, measured); this module does not
    from locoswarm.node.checkpoint import load_trained_model
    from locoswarm.node.data import load_tokenizer

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} is not allowed; give at least 1")
    if not 0 <= args.temperature <= 10:
        raise UserError(f"--temperature {args.temperature} is not allowed; use 0 (greedy) to 10")
    if args.top_k < 0:
        raise UserError(f"--top-k {args.top_k} is not allowed; use 0 (no cut) or more")
    cfg = load_config_from_args(args)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    model, _ = load_trained_model(Path(args.state_dir), cfg, tokenizer.vocab_size,
                                  use="live" if args.live else "outer")
    text = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                         max_seq_len=cfg.model.max_seq_len)
    print(args.prompt + text)
    return 0


def register_generate(sub: Any) -> None:
    """Add the ``generate`` subcommand: sample text from a node's checkpointed model."""

    parser = sub.add_parser(
        "generate", help="sample text from a node's checkpointed model",
        description="Load the checkpoint in --state-dir (the swarm's consensus phi, or --live) and print the "
                    "prompt followed by the model's continuation.")
    _checkpoint_args(parser, "use")
    parser.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=200,
                        help="stop after this many tokens (bytes with the byte tokenizer; default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=50,
                        help="sample among the k likeliest tokens; 0 = all (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.set_defaults(func=_cmd_generate)
