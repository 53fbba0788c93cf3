"""``locoswarm run``: the node daemon.

This module is its command line (flags and environment -> ``NodeOptions``) and the one home of its description
(the first line above is ``run --help``'s). The daemon itself (``locoswarm.node.daemon``, whose docstring says what
the node does, step by step) and the node's ranks (``locoswarm.node.ranks``) are imported when the command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
from pathlib import Path

from locoswarm.node.commands import add_config_args, add_data_args, data_paths, load_config_from_args
from locoswarm.node.control import check_control_options, control_port_from_args
from locoswarm.node.errors import UserError
from locoswarm.node.helptext import describe
from locoswarm.node.swarm.dht import bootstrap_from_env_and_args
from locoswarm.node.swarm.reachability import MODES as REACHABILITY_MODES

# --synthetic-step's range (0 = off): checked here, before the daemon and torch are imported (node/synthetic.py)
SYNTHETIC_MIN_S, SYNTHETIC_MAX_S = 0.01, 600.0
DEFAULT_RANK_TIMEOUT_S = 300.0  # --rank-timeout: a collective of the node's ranks that waits longer (a hung rank) fails


def register(sub: argparse._SubParsersAction) -> None:
    env = os.environ.get
    p = sub.add_parser("run", help="run a node: join (or start) a swarm and train",
                       description=describe(__doc__))
    add_config_args(p)
    add_data_args(p)
    p.add_argument("--state-dir", default=env("LOCOSWARM_STATE_DIR", "locoswarm-state"),
                   help="identity, checkpoints and status.json (env LOCOSWARM_STATE_DIR; default ./locoswarm-state)")
    p.add_argument("--host", default=env("LOCOSWARM_HOST", "127.0.0.1"),
                   help="address to listen on (env LOCOSWARM_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(env("LOCOSWARM_PORT", "0")),
                   help="TCP port for libp2p (env LOCOSWARM_PORT; default 0 = any free port)")
    p.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                   help="address peers should dial instead of the listen address, e.g. /ip4/203.0.113.5/tcp/31337 "
                        "behind a port forward or a proxy (repeatable; default: the listen address)")
    p.add_argument("--reachability", default=env("LOCOSWARM_REACHABILITY", "auto"), choices=REACHABILITY_MODES,
                   help="whether peers can dial this node: auto (default; peers check by dialling it back), public "
                        "(a port forward or a server), outbound-only (behind NAT: it reduces no part and serves no "
                        "state, but trains and averages fully) (env LOCOSWARM_REACHABILITY)")
    p.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR",
                   help="a peer to join through (repeatable; env LOCOSWARM_BOOTSTRAP; default [swarm] bootstrap)")
    p.add_argument("--bootstrap-attempts", type=int, default=None,
                   help="give up after this many bootstrap attempts (default: keep trying)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many inner steps")
    p.add_argument("--checkpoint-every", type=int, default=200, help="inner steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=100, help="inner steps between held-out evaluations (0=off)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches of each evaluation (default 4)")
    p.add_argument("--throttle", type=float, default=1.0, help="run this many times slower (tests, demos)")
    p.add_argument("--synthetic-step", type=float, default=0.0, metavar="SECONDS",
                   help="benchmarks only: synthetic compute, no forward/backward pass; each inner step sleeps "
                        "SECONDS (times --throttle) after a cheap deterministic update of the real parameters, and "
                        "the node takes no periodic evaluation (default 0 = off: real training)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=None, help="data sampling seed (default: from the peer id)")
    p.add_argument("--control-port", type=int, default=None,
                   help="port of the local control API read by 'locoswarm status' (env LOCOSWARM_CONTROL_PORT; "
                        "default 7615, or any free port if another node has it; 0 = off)")
    p.add_argument("--control-host", default="127.0.0.1",
                   help="address the control API (and metrics) listen on (default 127.0.0.1; another address "
                        "needs --allow-remote-control)")
    p.add_argument("--allow-remote-control", action="store_true",
                   help="allow a non-loopback --control-host: anyone who reaches it can stop this node")
    p.add_argument("--metrics-port", type=int, default=int(env("LOCOSWARM_METRICS_PORT", "0")),
                   help="serve Prometheus metrics on http://CONTROL_HOST:PORT/metrics (env LOCOSWARM_METRICS_PORT; "
                        "default 0 = off)")
    p.add_argument("--nproc", type=int, default=int(env("LOCOSWARM_NPROC", "1")),
                   help="train this node over N ranks (one per GPU, or CPU processes with --device cpu): DDP inside "
                        "the node, rank 0 joins the swarm (env LOCOSWARM_NPROC; default 1). Under torchrun the "
                        "ranks come from its environment instead")
    p.add_argument("--parallel", default=env("LOCOSWARM_PARALLEL", "ddp"),
                   help="how the node's ranks hold the model (env LOCOSWARM_PARALLEL): ddp (default; every rank "
                        "holds it all) or fsdp (each rank holds 1/N of the parameters, gradients and AdamW state, "
                        "for a model that does not fit one device; rank 0 keeps a full copy of theta on the CPU)")
    p.add_argument("--rank-timeout", type=float, default=DEFAULT_RANK_TIMEOUT_S,
                   help=f"seconds a collective of the node's ranks may wait for a rank before the node leaves "
                        f"(default {DEFAULT_RANK_TIMEOUT_S:.0f}; at least the network's matchmaking and round timeouts "
                        "plus 60: rank 0's longest pause between steps; a dead rank is noticed at once)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    p.set_defaults(func=run_node)


def run_node(args: argparse.Namespace) -> int:
    rank = os.environ.get("RANK") if os.environ.get("WORLD_SIZE", "1") != "1" else None  # a node's rank
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"%(asctime)s %(levelname)-5s {f'[rank {rank}] ' if rank else ''}%(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
    cfg = load_config_from_args(args)
    if cfg.outer.codec == "sparseloco":
        # The simulator, the planner and the codec benchmark carry it; the swarm's exchange still checks every
        # gathered average against the codec's fixed encoded size, and sparse averages vary in length.
        raise UserError("[outer] codec = 'sparseloco' is not allowed in a swarm yet (simulator, plan and benchmarks "
                        "only); use fp4, int8, bf16, fp32 or lowrank")
    for flag, value, low in (("--max-steps", args.max_steps, 1), ("--checkpoint-every", args.checkpoint_every, 0),
                             ("--eval-every", args.eval_every, 0), ("--threads", args.threads, 1),
                             ("--eval-batches", args.eval_batches, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} {value} is not allowed; it must be >= {low}")
    if not 1.0 <= args.throttle <= 100.0:
        raise UserError(f"--throttle {args.throttle} is not allowed; use a slowdown factor in [1, 100]")
    check_synthetic_step(args.synthetic_step, args.nproc)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a TCP port; use 0..65535 (0 = any free port)")
    # lazy: locoswarm.node.daemon and .ranks import torch (~1 s, measured); this module does not, and the checks
    # above fail at once without it
    from locoswarm.node import daemon
    from locoswarm.node.ranks import ENGINES, RankGroup, RankLauncher, check_nproc

    check_nproc(args.nproc, args.device)
    if args.parallel not in ENGINES:
        raise UserError(f"--parallel {args.parallel!r} is not allowed; use one of {', '.join(ENGINES)}")
    if not args.rank_timeout > 0:
        raise UserError(f"--rank-timeout {args.rank_timeout} is not allowed; give seconds > 0")
    # Rank 0 may wait out a round between two steps: the others must not give up on it meanwhile.
    ranks = RankGroup.from_env(max(args.rank_timeout, cfg.network.longest_round_s()), parallel=args.parallel)
    if ranks is None and args.nproc == 1 and args.parallel != "ddp":
        raise UserError(f"--parallel {args.parallel} needs several ranks; add --nproc N (N >= 2) or run under "
                        "torchrun")
    if ranks is not None and args.nproc not in (1, ranks.world_size):
        raise UserError(f"--nproc {args.nproc} but this process is one of {ranks.world_size} ranks (WORLD_SIZE, set "
                        "by torchrun or the launcher); drop --nproc under torchrun or make them agree")
    if ranks is None and args.nproc > 1:  # the launcher: the ranks run this same command
        return RankLauncher(args.argv, args.nproc).run()

    control_port, control_port_default = control_port_from_args(args.control_port)
    check_control_options(args.control_host, {"--control-port": control_port, "--metrics-port": args.metrics_port},
                          args.allow_remote_control, may_be_taken={"--control-port"} if control_port_default else ())
    if args.reachability not in REACHABILITY_MODES:  # from the environment: argparse checks only the flag
        raise UserError(f"LOCOSWARM_REACHABILITY={args.reachability!r} is not a reachability; use auto, public or "
                        "outbound-only (or unset it for auto)")
    opts = daemon.NodeOptions(
        state_dir=Path(args.state_dir), data=data_paths(args), device=args.device, host=args.host, port=args.port,
        announce=_announce_addrs(args.announce), reachability=args.reachability,
        bootstrap=bootstrap_from_env_and_args(cfg.swarm.bootstrap, args.bootstrap),
        bootstrap_attempts=args.bootstrap_attempts, max_steps=args.max_steps,
        checkpoint_every=args.checkpoint_every, eval_every=args.eval_every, eval_batches=args.eval_batches,
        throttle=args.throttle, synthetic_step=args.synthetic_step,
        threads=args.threads, config_path=args.config, seed=args.seed, control_host=args.control_host,
        control_port=control_port, control_port_default=control_port_default,
        allow_remote_control=args.allow_remote_control, metrics_port=args.metrics_port)
    code = daemon.Node(cfg, opts, ranks).run()
    if ranks is not None:
        _exit_rank(code)
    return code


def check_synthetic_step(seconds: float, nproc: int = 1) -> None:
    """``--synthetic-step``: 0 (off) or seconds per inner step in the synthetic range, on one process (a node's
    ranks would each need the same synthetic update: not built, benchmarks need no --nproc)."""
    if seconds == 0:
        return
    if not (math.isfinite(seconds) and SYNTHETIC_MIN_S <= seconds <= SYNTHETIC_MAX_S):
        raise UserError(f"--synthetic-step {seconds:g} is not allowed; use 0 (off, the default) or seconds per inner "
                        f"step from {SYNTHETIC_MIN_S:g} to {SYNTHETIC_MAX_S:g}")
    if nproc != 1 or os.environ.get("WORLD_SIZE", "1") != "1":
        raise UserError("--synthetic-step runs a node as one process; drop --nproc (and torchrun) or drop "
                        "--synthetic-step")


def _exit_rank(code: int) -> None:
    """End a rank's process now that its node has left (checkpoint saved, network down, group closed).

    A rank's interpreter teardown may destroy distributed objects whose C++ threads still run: one CI run
    saw a rank that had stopped cleanly abort afterwards ("terminate called without an active exception",
    SIGABRT), and the launcher rightly reported the node as failed. Nothing is left to run after the
    node's own cleanup, so the rank flushes its output and exits without that teardown."""
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _announce_addrs(addrs: list[str] | None) -> list[str] | None:
    """``--announce`` values checked: each a TCP multiaddr without a peer id (one line naming a bad one)."""
    if not addrs:
        return None
    from hivemind.utils.multiaddr import Multiaddr

    out = []
    for addr in addrs:
        try:
            ma = Multiaddr(addr)
            ok = "tcp" in ma and "p2p" not in ma
        except Exception:
            ok = False
        if not ok:
            raise UserError(f"--announce {addr!r} is not allowed; give a TCP multiaddr without a peer id, "
                            "e.g. /ip4/203.0.113.5/tcp/31337")
        out.append(addr)
    return out
