"""Peer programs of the swarm benchmark other than ``locoswarm run``: the ``hivemind`` configuration.

The hook
--------
A configuration's peer is started by :class:`locoswarm.node.bench.swarm.runner.ConfigRun` exactly like a
``locoswarm run`` node: ``python -m locoswarm.node.bench.swarm.peers hivemind`` followed by the node's flags
(``--config --state-dir --threads --host --port --seed --checkpoint-every --eval-every --control-port
--device`` and optionally ``--announce``, ``--bootstrap``, ``--data``), inside node i's namespace. It
must (1) log a line ``... listening on /ip4/<bench subnet address>/tcp/<port>/p2p/<peer id>`` as soon
as it can be bootstrapped from, and (2) rewrite ``STATE_DIR/status.json`` every second or so with the
fields the runner reads: ``state`` ("training" once it trains), ``peers`` (one entry per other peer
it sees), ``uptime_s``, ``compute_utilization`` (compute seconds / uptime), ``inner_step``,
``syncs_ok``, ``syncs_failed``, ``catch_ups``, ``bytes`` (``sent``/``received``), ``eval_curve``
(``[[step, loss], ...]``), ``loss`` and ``events``. Another optimizer is one more subcommand here.

``hivemind``
------------
hivemind's own ``hivemind.Optimizer`` (the tool a user of this field would otherwise pick) trains the
same model (:func:`locoswarm.node.model.build_model`, same preset and seed) on the same data and batches with
the same AdamW settings, in its local-updates mode (``use_local_updates=True``: every peer steps on
its own gradients; parameters and optimizer state are averaged once the swarm has processed
``target_batch_size`` samples, here ``outer.h`` steps of every peer: DiLoCo's period without its outer
optimizer), fp32 payloads (hivemind's 8-bit codecs break under NumPy >= 2.4). Compute seconds are
forward + backward + the local AdamW step; a ``step()`` that waited (an averaging round, or a local step
waiting for the background round) counts only the median ``step()`` time as compute, the rest is a stall.
Bytes are the namespace's ``eth0`` counters (hivemind counts none itself). hivemind exposes no round counters either, so
:class:`HivemindRounds` reads its own log records: ``syncs_ok`` counts state averaging rounds with at least
one other peer ("Averaged parameters with N peers", N >= 2), ``syncs_failed`` the failed ones and those
that found nobody, ``catch_ups`` the state downloads ("Peer is out of sync"), each a status event; a row
whose utilization is high because its rounds failed shows it there. ``epoch`` is hivemind's local epoch.

The peers start their first step together (a rendezvous under a DHT key, up to ``RENDEZVOUS_S``), as a
hivemind run's peers start at epoch 0: a peer that trained alone while the others were still starting put
the swarm's epoch ahead of theirs, and hivemind makes a peer more than one epoch behind download the whole
state (parameters and AdamW statistics, retried until it lands: at 5 Mbit/s most of a window) before it
steps again.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path

from locoswarm.node.config import load_config
from locoswarm.node.fsutil import atomic_write_text

log = logging.getLogger("locoswarm.bench.hivemind")


EVAL_MAX_S = 30.0
RENDEZVOUS_S = 120.0   # the longest the peers wait for each other before their first step


class HivemindRounds(logging.Handler):
    """Counts hivemind's averaging rounds and state downloads from its log records (module doc)."""

    def __init__(self, max_events: int = 200) -> None:
        super().__init__(logging.INFO)
        self.ok = self.failed = self.catch_ups = 0
        self.events: list[dict] = []
        self.max_events = max_events
        self._lock_counts = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        kind = None
        if msg.startswith("Averaged parameters with "):
            peers = msg.removeprefix("Averaged parameters with ").split(" ", 1)[0]
            if peers.isdigit() and int(peers) >= 2:
                kind = "merged"
            else:
                kind, msg = "failed", f"no peer in group ({msg})"
        elif msg.startswith("Averaging failed"):
            kind = "failed"
        elif msg.startswith("Peer is out of sync"):
            kind, msg = "caught_up", "out of sync: downloading the state from peers"
        if kind is None:
            return
        with self._lock_counts:
            if kind == "merged":
                self.ok += 1
            elif kind == "failed":
                self.failed += 1
            else:
                self.catch_ups += 1
            self.events.append({"time": record.created, "kind": kind, "detail": f"hivemind: {msg}"[:300]})
            del self.events[:-self.max_events]

    def attach(self) -> None:
        """Listen on the ``hivemind`` logger, where its loggers stop (they do not propagate to the root), at INFO
        at least: the outcome of a round is an INFO record."""
        top = logging.getLogger("hivemind")
        if top.getEffectiveLevel() > logging.INFO:
            top.setLevel(logging.INFO)
        top.addHandler(self)

    def detach(self) -> None:
        logging.getLogger("hivemind").removeHandler(self)

    def counts(self) -> dict:
        with self._lock_counts:
            return {"syncs_ok": self.ok, "syncs_failed": self.failed, "catch_ups": self.catch_ups,
                    "events": list(self.events)}


def rendezvous(dht, key: str, nodes: int, timeout: float = RENDEZVOUS_S) -> int:
    """Announce this peer under ``key`` and wait until ``nodes`` peers have (or ``timeout`` passed); how many did."""
    from hivemind.utils import get_dht_time

    deadline = time.monotonic() + timeout
    while True:
        dht.store(key, True, expiration_time=get_dht_time() + 600, subkey=str(dht.peer_id))
        found = dht.get(key, latest=True)
        seen = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if seen >= nodes or time.monotonic() >= deadline:
            return seen
        time.sleep(0.5)


def _eth0_bytes() -> tuple[int, int]:
    """(sent, received) bytes of this network namespace's ``eth0`` (0, 0 when there is none)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                f = rest.split()
                return int(f[8]), int(f[0])
    except OSError:
        pass
    return 0, 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m locoswarm.node.bench.swarm.peers hivemind")
    p.add_argument("--config", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--announce", action="append", default=None)
    p.add_argument("--bootstrap", action="append", default=None)
    p.add_argument("--data", nargs="*", default=None)
    p.add_argument("--nodes", type=int, default=4, help="peers of the swarm (sets target_batch_size)")
    return p


def run_hivemind(argv: list[str]) -> int:
    """Train with ``hivemind.Optimizer`` until SIGTERM, writing ``status.json`` (see the module doc)."""
    args, _ = _parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-5s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    import hivemind
    import torch

    # lazy, as hivemind and torch above: locoswarm.node.data and .model import torch (~1 s, measured)
    from locoswarm.node.data import TrainBatches, eval_batches, evaluate, load_corpus, load_tokenizer
    from locoswarm.node.model import build_model

    started = time.time()
    rounds = HivemindRounds()
    rounds.attach()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    dht = None
    for attempt in range(30):  # hivemind treats an unreachable bootstrap peer as fatal: retry
        try:
            dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
                               announce_maddrs=args.announce or None, initial_peers=args.bootstrap or None)
            break
        except Exception as exc:
            log.warning("DHT start failed (attempt %d): %s", attempt + 1, exc)
            time.sleep(min(5.0, 0.5 * (attempt + 1)))
    if dht is None:
        log.error("could not start the DHT")
        return 1
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    log.info("peer %s listening on %s", dht.peer_id, " ".join(addrs))

    tok = load_tokenizer(cfg.model.tokenizer)
    corpus = load_corpus(args.data or [], cfg.data, tok)
    model = build_model(cfg.model, tok.vocab_size, seed=cfg.data.seed)
    i = cfg.inner
    batches = TrainBatches(corpus.train, 0, 1, i.batch_size, i.seq_len, args.seed)
    evals = eval_batches(corpus.eval, i.batch_size, i.seq_len, 4)
    opt = hivemind.Optimizer(
        dht=dht, run_id=cfg.swarm.name, params=model.parameters(),
        optimizer=partial(torch.optim.AdamW, lr=i.lr, betas=(i.beta1, i.beta2), weight_decay=i.weight_decay),
        batch_size_per_step=i.batch_size, target_batch_size=i.batch_size * cfg.outer.h * max(1, args.nodes),
        use_local_updates=True, matchmaking_time=cfg.network.matchmaking_timeout,
        averaging_timeout=cfg.network.round_timeout, allreduce_timeout=cfg.network.round_timeout,
        next_chunk_timeout=cfg.network.round_timeout, verbose=True)  # its epochs and state loads in the log
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # hivemind's averager set SIGINT to ignored
        signal.signal(sig, lambda *_: stop.set())
    eval_curve = [[0, evaluate(model, evals, "cpu")]]
    waited = time.monotonic()
    seen = rendezvous(dht, f"{cfg.swarm.name}_bench_start", max(1, args.nodes))
    log.info("rendezvous: %d of %d peers after %.1f s", seen, max(1, args.nodes), time.monotonic() - waited)
    sent0, recv0 = _eth0_bytes()
    status: dict = {"peer_id": str(dht.peer_id), "addrs": addrs, "state": "training"}
    compute, step, epochs, loss = 0.0, 0, 0, float("nan")
    local_times: list[float] = []
    last_write, last_eval = 0.0, time.monotonic()
    while not stop.is_set():
        batch = batches.get(step)
        t0 = time.monotonic()
        out = model(input_ids=batch, labels=batch).loss
        out.backward()
        if i.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), i.grad_clip)
        t1 = time.monotonic()
        epoch = opt.local_epoch
        opt.step()
        opt.zero_grad()
        t2 = time.monotonic()
        # A step() that waited (an averaging round at a transition, or, with local updates, any step while the
        # background round runs: "Waiting for delayed updates to finish...") counts as compute only the median
        # step() time of the last 50: the rest is a stall. Counting the waits of ordinary steps as compute made a
        # 20 Mbit/s row 0.994 of unshaped at 1.58 steps/s against the locoswarm nodes' 2.39.
        local_times.append(t2 - t1)
        del local_times[:-50]
        compute += (t1 - t0) + min(t2 - t1, statistics.median(local_times))
        if opt.local_epoch != epoch:
            epochs += 1
        step += 1
        loss = float(out.detach())
        # every eval_every steps, and at least every EVAL_MAX_S seconds: a peer stalled by its averaging
        # may make fewer steps in a whole window than eval_every, and its row would show the untrained loss
        if args.eval_every and (step % args.eval_every == 0 or time.monotonic() - last_eval >= EVAL_MAX_S):
            eval_curve.append([step, evaluate(model, evals, "cpu")])
            last_eval = time.monotonic()
        now = time.time()
        if now - last_write >= 1.0:
            last_write = now
            sent, recv = _eth0_bytes()
            uptime = now - started
            n_peers = max(0, int(getattr(opt.tracker.global_progress, "num_peers", 1)) - 1)
            status.update(uptime_s=uptime, compute_utilization=compute / uptime, inner_step=step,
                          loss=loss, eval_curve=eval_curve, epochs=epochs, **rounds.counts(),
                          bytes={"sent": sent - sent0, "received": recv - recv0},
                          peers={f"peer{k}": {} for k in range(n_peers)}, epoch=opt.local_epoch)
            atomic_write_text(state_dir / "status.json", json.dumps(status))
    status["state"] = "stopped"
    atomic_write_text(state_dir / "status.json", json.dumps(status))
    opt.shutdown()
    dht.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "hivemind":
        print("usage: python -m locoswarm.node.bench.swarm.peers hivemind [node flags]", file=sys.stderr)
        return 2
    return run_hivemind(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
