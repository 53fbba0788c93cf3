"""One node over several ranks (``locoswarm.node.ranks``, ``locoswarm run --nproc N``), on CPU with gloo.

The protocol on its own: two ranks train the tiny model with DDP and stay bit-identical, and a write of
theta on rank 0 (what an outer merge does) reaches the other rank. Then the issue's acceptance with real
nodes: two ``--nproc 2`` nodes average every fragment and agree on phi; SIGKILL of one node's rank 1
makes that node leave cleanly (non-zero exit, nothing left behind) while the other keeps training, and
the node resumes from its state dir.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from swarm_util import REPO, NodeProc, write_config, write_corpus
from test_run_cli import refused_before_start, run
from test_swarm_integration import Swarm, agree, fragments_merged, merged, swarm, wait_until  # noqa: F401

from locoswarm.node.ranks import Command, RankFailure, RankGroup, ThetaSync, free_port
from locoswarm.node.swarm.process import children, descendants, is_alive, p2pd_pids

GLOO = dist.is_available() and dist.is_gloo_available()
needs_gloo = pytest.mark.skipif(not GLOO, reason="torch.distributed with gloo is not available in this torch build")
NPROC = ("--nproc", "2", "--device", "cpu")


# ---- the protocol, two gloo ranks in spawned processes ------------------------------------------------
def _rank_main(rank: int, port: int, config: str, data: str, out: str, parallel: str = "ddp") -> None:
    """One rank, driven as the node drives it (rank 0 through ``ThetaSync``, the others following its
    commands): 3 steps; rank 0 writes fragment 0 (+1, as a merge would) and 2 more steps push it first;
    then the optimizer state's round trip (what a checkpoint gathers and a resume scatters). Saves rank
    0's full theta after each phase (refreshed from the ranks), what moved, every rank's digest at the stop
    and the first batch it trained on."""
    from locoswarm.node.config import load_config
    from locoswarm.node.data import TrainBatches, load_corpus, load_tokenizer
    from locoswarm.node.inner import InnerOptimizer
    from locoswarm.node.model import build_model
    from locoswarm.node.partition import partition

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = load_config(Path(config))
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    corpus = load_corpus([data], cfg.data, tokenizer)
    group = RankGroup(rank, 2, rank, timeout_s=60, parallel=parallel)
    group.start(torch.device("cpu"))
    engine = group.engine
    # Different initial weights per rank: the start push (as the node does it) must make them equal.
    model = build_model(cfg.model, tokenizer.vocab_size, seed=cfg.data.seed + rank)
    outer, train = engine.place(model, torch.device("cpu"))
    fragments = partition(outer, cfg.outer.fragments)
    sync = ThetaSync(group, outer, train, [f.names for f in fragments])
    group.broadcast_start(7, 0, layout=sync.layout())
    sync.push_all()
    inner = InnerOptimizer(train, cfg.inner)
    batches = TrainBatches(corpus.train, rank, 2, cfg.inner.batch_size, cfg.inner.seq_len, seed=7)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in train.parameters()]
    snapshots: dict[str, object] = {"batch": batches.get(0), "numel": sum(p.numel() for p in train.parameters()),
                                    "local_numel": sum(t.numel() for t in local),
                                    "fragment0": set(fragments[0].names),
                                    "names": [n for n, _ in outer.named_parameters()]}

    def theta() -> list[torch.Tensor]:
        sync.refresh()
        return [p.detach().clone() for p in outer.parameters()]

    step = 0
    for phase, steps in (("trained", 3), ("after_merge", 2)):
        if phase == "after_merge" and group.is_leader:
            with torch.no_grad():
                for name, p in outer.named_parameters():
                    if name in snapshots["fragment0"]:
                        p.add_(1.0)
            sync.after_write(0)  # what FragmentState.set_theta tells it
            snapshots["merged"] = theta()
        for _ in range(steps):
            if group.is_leader:
                sync.step()
            else:
                assert sync.follow() is Command.STEP
            inner.step([batches.get(step)])
            step += 1
        if group.is_leader:
            snapshots[phase] = theta()
            snapshots[f"{phase}_moved"] = (sync.pushed, sync.gathered)

    def moments(opt: InnerOptimizer) -> list[dict]:
        return [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.param_state(i).items()}
                for i in range(len(opt.params()))]

    def gathered(source: InnerOptimizer) -> InnerOptimizer:
        target = InnerOptimizer(outer, cfg.inner) if engine.shards_optimizer and group.is_leader else source
        if group.is_leader:
            sync.gather_inner(source, target)
        elif engine.shards_optimizer:
            assert sync.follow() is Command.GATHER_INNER
            engine.pull_inner(source, target)
        return target

    saved = gathered(inner)
    if group.is_leader:
        sync.stop()
    else:
        assert sync.follow() is Command.STOP
    snapshots["digest"] = engine.digest(outer, train)  # after the stop, as the node logs it
    # The start of a resume (not through commands): the fixed sequence of push_inner on every rank.
    fresh = InnerOptimizer(train, cfg.inner)
    engine.push_inner(saved, fresh)
    again = InnerOptimizer(outer, cfg.inner) if engine.shards_optimizer and group.is_leader else fresh
    engine.pull_inner(fresh, again)
    if group.is_leader:
        snapshots["moments"], snapshots["moments_again"] = moments(saved), moments(again)
        snapshots["steps_done"] = (saved.steps_done, again.steps_done)
    # As a resumed node starts: the other ranks' optimizers are empty, and each is its own source argument.
    if not group.is_leader:
        inner.reset_state()
    engine.push_inner(saved if group.is_leader else inner, inner)
    snapshots["own_moments"] = moments(inner) if not engine.shards_optimizer else None
    resumed = InnerOptimizer(outer, cfg.inner) if engine.shards_optimizer and group.is_leader else inner
    engine.pull_inner(inner, resumed)  # collective: every rank
    snapshots["moments_resumed"] = moments(resumed) if group.is_leader else None
    torch.save(snapshots, out)
    group.close()


def _run_ranks(tmp_path: Path, parallel: str) -> tuple[dict, dict]:
    config = write_config(tmp_path / "peers.toml")
    data = write_corpus(tmp_path / "data", docs=3, lines=60)
    port = free_port()
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"{parallel}-rank{r}.pt" for r in range(2)]
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(config), str(data), str(outs[r]), parallel))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    r0, r1 = (torch.load(o, weights_only=False) for o in outs)
    assert not torch.equal(r0["batch"], r1["batch"]), "each rank must read its own shard"
    assert r0["digest"] == r1["digest"], "the ranks stopped with different parameters"
    # The write happened on rank 0 only, to fragment 0 only: +1 there, nothing elsewhere.
    in_fragment = [name in r0["fragment0"] for name in r0["names"]]
    assert any(in_fragment) and not all(in_fragment)
    for trained, after, written in zip(r0["trained"], r0["merged"], in_fragment, strict=True):
        assert torch.allclose(after, trained + 1.0) if written else torch.equal(after, trained)
    assert not torch.equal(r0["merged"][0], r0["after_merge"][0]), "training after the merge changed nothing"
    # What moved: at the merge, fragment 0 alone was pushed; FSDP gathered the whole model once per read of
    # it (the phase ends), never after every step; DDP never gathers (rank 0 trains the outer model itself).
    fragment0 = sum(t.numel() for t, w in zip(r0["trained"], in_fragment, strict=True) if w)
    assert r0["trained_moved"] == (0, r0["numel"] if parallel == "fsdp" else 0)
    assert r0["after_merge_moved"] == (fragment0, (2 if parallel == "fsdp" else 0) * r0["numel"])
    # The optimizer state survives a gather, a scatter into a fresh optimizer and a gather again.
    assert r0["steps_done"] == (5, 5)
    assert any(m for m in r0["moments"]), "no AdamW state after 5 steps"
    for again in ("moments_again", "moments_resumed"):
        for a, b in zip(r0["moments"], r0[again], strict=True):
            assert a.keys() == b.keys(), again
            for key in a:
                assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (again, key)
    if r1["own_moments"] is not None:  # replicated: rank 1 holds rank 0's whole state
        for a, b in zip(r0["moments"], r1["own_moments"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
    return r0, r1


@needs_gloo
@pytest.mark.timeout(180)
def test_two_gloo_ranks_stay_identical_and_a_rank0_write_reaches_both(tmp_path: Path) -> None:
    _run_ranks(tmp_path, "ddp")


@needs_gloo
@pytest.mark.timeout(300)
def test_fsdp_ranks_train_as_ddp_does_and_round_trip_their_state(tmp_path: Path) -> None:
    """FSDP (each rank holds half of every parameter and of its AdamW moments) makes the same steps as DDP
    from the same start and data: the sharded AdamW update is elementwise, only the order of the
    gradient sums differs (reduce-scatter vs all-reduce)."""
    ddp, _ = _run_ranks(tmp_path, "ddp")
    fsdp, fsdp1 = _run_ranks(tmp_path, "fsdp")
    assert ddp["local_numel"] == ddp["numel"]
    for rank in (fsdp, fsdp1):  # each rank holds about half of the parameters
        assert rank["numel"] == ddp["numel"] and rank["local_numel"] <= 0.55 * rank["numel"], rank["local_numel"]
    for phase in ("trained", "after_merge"):
        for a, b in zip(ddp[phase], fsdp[phase], strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), f"fsdp and ddp differ after {phase}"
    for a, b in zip(ddp["moments"], fsdp["moments"], strict=True):
        for key in a:
            assert torch.allclose(torch.as_tensor(a[key]), torch.as_tensor(b[key]), atol=1e-6, rtol=1e-3), key


class _FakeGroup:
    """A rank 0 whose commands are recorded, not broadcast, and whose engine records what it moves."""

    def __init__(self) -> None:
        self.sent: list[tuple[Command, int]] = []
        self.moved: list[tuple[str, tuple[str, ...] | None]] = []
        self.fail = False
        self.tries = 0
        group = self

        class Engine:
            copies_params = shards_optimizer = True

            def pull_params(self, train, outer, names=None) -> None:
                group.moved.append(("gather", None if names is None else tuple(names)))

            def push_params(self, outer, train, names=None) -> None:
                group.moved.append(("push", None if names is None else tuple(names)))

        self.engine = Engine()

    def command(self, command: Command = Command.STEP, arg: int = 0) -> tuple[Command, int]:
        self.tries += 1
        if self.fail:
            raise RankFailure("rank 0: waiting for rank 0's command failed (a rank died or hung)")
        self.sent.append((command, arg))
        return command, arg


def _raises(call) -> list[BaseException]:
    try:
        call()
    except BaseException as exc:  # handed to the test's thread
        return [exc]
    return []


@pytest.mark.timeout(30)
def test_rank0_moves_a_fragment_only_when_the_outer_loop_touches_it_and_a_failure_waits_for_the_step() -> None:
    """ThetaSync on rank 0: nothing moves until a step; then a read gathers that fragment once, a write
    marks it for the push before the next step, and a refresh gathers the rest. A failed gather inside
    the outer loop's read is not raised there (the outer loop would stop between two writes), but at the
    next step."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    fragments = [("0.weight", "0.bias"), ("1.weight", "1.bias")]
    group = _FakeGroup()
    sync = ThetaSync(group, model, model, fragments)
    sync.before_read(0)
    sync.after_write(1)
    assert group.sent == [] and group.moved == []  # before any step rank 0's copy is the newest
    sync.step()
    assert group.sent == [(Command.PUSH, 1), (Command.STEP, 0)] and group.moved == [("push", fragments[1])]
    group.sent.clear(), group.moved.clear()
    sync.before_read(1)
    sync.before_read(1)  # gathered once until the next step
    assert group.sent == [(Command.GATHER, 1)] and group.moved == [("gather", fragments[1])]
    sync.after_write(0)  # a whole fragment written: nothing to gather, a push to make
    sync.refresh()
    assert group.sent == [(Command.GATHER, 1)], "a written fragment was gathered over rank 0's write"
    sync.step()
    assert group.sent[1:] == [(Command.PUSH, 0), (Command.STEP, 0)]
    assert (sync.pushed, sync.gathered, sync.steps) == (3 * 3 + 3 + 3 * 2 + 2, 3 * 2 + 2, 2)
    other = threading.Thread(target=lambda: errors.extend(_raises(sync.step)))
    errors: list[BaseException] = []
    other.start(), other.join(10)
    assert len(errors) == 1 and "off the training thread" in str(errors[0])
    group.fail = True
    sync.before_read(0)  # not raised inside the outer loop
    assert isinstance(sync.failure, RankFailure)
    tries = group.tries
    sync.before_read(1)  # the ranks failed: nothing is tried again (a hung rank would hold each try)
    assert group.tries == tries
    with pytest.raises(RankFailure):
        sync.step()
    with pytest.raises(ValueError, match="every parameter"):
        ThetaSync(_FakeGroup(), model, model, fragments[:1])


@pytest.mark.timeout(60)
def test_inner_state_dict_lets_another_optimizer_take_over(tmp_path: Path) -> None:
    """What rank 0 hands the other ranks at the start (its resumed AdamW state and step counter): an optimizer
    loaded from it makes the same next step as the original."""
    from locoswarm.node.config import load_config
    from locoswarm.node.inner import InnerOptimizer

    cfg = load_config(write_config(tmp_path / "peers.toml"))
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [InnerOptimizer(m, cfg.inner) for m in models]
    x = torch.randn(8, 4)

    def step(i: int) -> None:
        models[i](x).pow(2).mean().backward()
        opts[i].optimizer.step()
        opts[i].optimizer.zero_grad()
        opts[i].steps_done += 1

    for _ in range(3):
        step(0)
    models[1].load_state_dict(models[0].state_dict())
    opts[1].load_state_dict(opts[0].state_dict())
    assert opts[1].steps_done == 3
    step(0)
    step(1)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
def test_launcher_kills_a_rank0_that_does_not_leave_after_another_rank_died(tmp_path: Path) -> None:
    """Rank 1 fails; rank 0 ignores the launcher's SIGTERM (as if stuck in an NCCL collective with the dead
    rank): after ``leave_s`` the launcher SIGKILLs it and exits with rank 1's code."""
    pidfile = tmp_path / "rank0.pid"
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open(sys.argv[1], "w").write(str(os.getpid()))
            time.sleep(120)
            sys.exit(0)
        time.sleep(1.0)
        sys.exit(3)
    """))
    code = ("import sys; from locoswarm.node.ranks import RankLauncher; "
            f"sys.exit(RankLauncher([{str(script)!r}, {str(pidfile)!r}], 2, leave_s=1.0, "
            "command=[sys.executable]).run())")
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=50,
                         start_new_session=True)
    assert res.returncode == 3, res.stderr
    assert "rank 1 exited with 3" in res.stderr
    assert time.monotonic() - started < 30
    assert not is_alive(int(pidfile.read_text()))


# ---- validation ------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_bad_nproc_is_refused_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path / "peers.toml")
    data = write_corpus(tmp_path / "data", docs=3, lines=60)
    common = ("--config", str(config), "--data", str(data), "--state-dir", str(tmp_path / "s"), "--max-steps", "1")
    refused_before_start(run(*common, "--nproc", "0"), "--nproc 0", ">= 1")
    too_many = max(2, (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1)
    refused_before_start(run(*common, "--nproc", str(too_many), "--device", "cuda"), f"--nproc {too_many}", "GPUs")
    refused_before_start(run(*common, "--nproc", "2", "--device", "cuda:1"), "cuda:1", "auto, cuda or cpu")
    refused_before_start(run(*common, "--nproc", "2", "--parallel", "zero3"), "--parallel 'zero3'", "ddp, fsdp")
    refused_before_start(run(*common, "--parallel", "fsdp"), "--parallel fsdp", "--nproc N")
    with monkeypatch.context() as env:  # a rank of torchrun's (WORLD_SIZE 2) told --nproc 3
        env.setenv("WORLD_SIZE", "2")
        env.setenv("RANK", "1")
        refused_before_start(run(*common, "--nproc", "3"), "--nproc 3", "one of 2 ranks")
    assert not (tmp_path / "s").exists()


# ---- the acceptance: two --nproc 2 nodes ------------------------------------------------------
def _rank_pid(node: NodeProc, rank: int) -> int:
    """The pid of ``node``'s rank ``rank``: a child of its launcher with RANK in its environment (the forks of
    a rank, its watchdog and DHT process, inherit that environment but are not the launcher's children)."""
    for pid in children(node.proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"{node.name}: no rank {rank} among the launcher's children {children(node.proc.pid)}")


def _assert_down(node: NodeProc, p2pd: list[int]) -> None:
    """``node`` exits non-zero within a minute and leaves nothing: its process group and its p2pd (which runs
    in the DHT process's own group) are gone."""
    rc = node.proc.wait(60)
    assert rc != 0, node.tail()
    deadline = time.monotonic() + 15
    while (node.group_alive() or p2pd_pids(p2pd)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not node.group_alive() and not p2pd_pids(p2pd), "the node left processes behind"


@needs_gloo
@pytest.mark.timeout(180)
def test_sigkill_of_rank0_stops_the_node_and_leaves_nothing(swarm: Swarm) -> None:  # noqa: F811 (the fixture)
    node = swarm.start("n0", *NPROC)
    node.wait_status(lambda s: s.get("inner_step", 0) >= 10, 120, "training")
    p2pd = p2pd_pids(descendants(node.proc.pid))
    assert p2pd
    os.kill(_rank_pid(node, 0), signal.SIGKILL)  # rank 1 fails its next collective; rank 0's watchdog cleans up
    _assert_down(node, p2pd)
    assert "rank 1: " in node.tail(), node.tail()


@needs_gloo
@pytest.mark.timeout(420)
def test_two_nproc2_nodes_agree_and_survive_a_rank_kill(swarm: Swarm) -> None:  # noqa: F811 (the fixture)
    """The fixture (``test_swarm_integration``) stops every node and checks that none left processes."""
    extra = (*NPROC, "--checkpoint-every", "10")
    nodes = [swarm.start("n0", *extra), swarm.start("n1", *extra)]
    for node in nodes:  # every fragment averaged (with the other node: group 2) on both
        node.wait_status(lambda s: fragments_merged(s) == {0, 1} and len(merged(s)) >= 4, 240,
                         "every fragment averaged twice")
    wait_until(lambda: agree(nodes), 60, "phi to agree across the two nodes", nodes)
    survivor, victim = nodes
    assert victim.state_dir.joinpath("checkpoint.json").exists()
    p2pd = p2pd_pids(descendants(victim.proc.pid))
    assert p2pd, "rank 0 of the victim runs the node's only p2pd"
    os.kill(_rank_pid(victim, 1), signal.SIGKILL)
    _assert_down(victim, p2pd)
    st = victim.status()
    assert st["state"] == "stopped", st["state"]  # its leave path ran: drained, checkpointed, announced
    assert any(e["kind"] == "rank_failed" for e in st["events"]), [e["kind"] for e in st["events"]]
    # The other node keeps training.
    before = survivor.status()["inner_step"]
    survivor.wait_status(lambda s: s["inner_step"] >= before + 20, 90, "20 more steps without the victim")
    # Restarted on its state dir, the node resumes with two ranks and merges rounds again.
    restarted = swarm.start("n1", *extra)
    restarted.wait_status(lambda s: any(e["kind"] == "resumed" for e in s.get("events", [])), 120, "resume")
    restarted.wait_status(lambda s: [e for e in merged(s) if e["group_size"] == 2], 150,
                          "a round merged with the other node after resuming")
    for node in (survivor, restarted):  # graceful leave of a whole node: both ranks stop with one model
        assert node.terminate(90) == 0, node.tail()
        stops = re.findall(r"rank (\d) stops at step (\d+) with parameters crc32 ([0-9a-f]{8})",
                           node.log_path.read_text(errors="replace"))
        assert len(stops) == 2 and {r for r, _, _ in stops} == {"0", "1"}, stops  # the killed run logged none
        assert len({(step, crc) for _, step, crc in stops}) == 1, f"{node.name}: ranks differ at the stop: {stops}"


@needs_gloo
@pytest.mark.timeout(420)
def test_an_fsdp_node_averages_with_a_plain_node_and_resumes(swarm: Swarm) -> None:  # noqa: F811 (the fixture)
    """A two-rank FSDP node (each rank holds half the model and half its AdamW state) beside a one-process
    node: every fragment averaged in groups of two, phi agreed, a graceful leave with one model on both
    ranks and a checkpoint gathered from them, then a resume with two ranks that merges again."""
    fsdp = (*NPROC, "--parallel", "fsdp", "--checkpoint-every", "10")
    plain = swarm.start("n1", "--device", "cpu")  # first: the swarm's bootstrap peer, alive throughout
    nodes = [swarm.start("n0", *fsdp), plain]
    for node in nodes:
        node.wait_status(lambda s: fragments_merged(s) == {0, 1} and len(merged(s)) >= 4, 240,
                         "every fragment averaged twice")
    wait_until(lambda: agree(nodes), 60, "phi to agree across the two nodes", nodes)
    # Enough steps for the gather count below to mean something (a joiner can merge its first rounds within
    # a dozen steps: seen 11).
    nodes[0].wait_status(lambda s: s["inner_step"] >= 20, 120, "20 inner steps on the FSDP node")

    def stops(node: NodeProc) -> list[tuple[str, str, str]]:
        return re.findall(r"rank (\d) stops at step (\d+) with parameters crc32 ([0-9a-f]{8})",
                          node.log_path.read_text(errors="replace"))

    assert nodes[0].terminate(90) == 0, nodes[0].tail()
    first = stops(nodes[0])
    assert len(first) == 2 and len({(step, crc) for _, step, crc in first}) == 1, f"ranks differ: {first}"
    # Rank 0 gathered a fragment only when the outer loop read it (a sync, an evaluation, a checkpoint
    # every 10 steps), not the whole model after every step.
    moved = re.search(r"pushed (\d+) and gathered (\d+) parameters in (\d+) steps \(model (\d+)\)",
                      nodes[0].log_path.read_text(errors="replace"))
    assert moved, nodes[0].tail()
    pushed, gathered, steps, numel = map(int, moved.groups())
    assert steps >= 20 and 0 < gathered < 0.7 * steps * numel and 0 < pushed < steps * numel, moved.group(0)
    assert nodes[0].state_dir.joinpath("checkpoint.json").exists()
    restarted = swarm.start("n0", *fsdp)
    restarted.wait_status(lambda s: any(e["kind"] == "resumed" for e in s.get("events", [])), 120, "resume")
    restarted.wait_status(lambda s: [e for e in merged(s) if e["group_size"] == 2], 150,
                          "a round merged with the other node after resuming")
    assert restarted.terminate(90) == 0, restarted.tail()
    again = stops(restarted)[len(first):]
    assert len(again) == 2 and len({(step, crc) for _, step, crc in again}) == 1, f"ranks differ: {again}"
    assert int(again[0][1]) > int(first[0][1]), "the resumed node did not continue from its checkpoint"


@needs_gloo
@pytest.mark.timeout(300)
def test_a_node_under_torchrun_averages_with_a_plain_node_and_stops_on_sigterm(swarm: Swarm) -> None:  # noqa: F811
    """``torchrun --nproc-per-node 2 -m locoswarm.node.cli run``: torchrun's own launcher instead of ``--nproc``.
    The node merges rounds with a one-process node; a SIGTERM to torchrun reaches the ranks, rank 0 leaves
    the swarm cleanly, both ranks stop with one model, and no process of the node is left."""
    plain = swarm.start("n1", "--device", "cpu")
    args = ["--config", str(swarm.config), "--data", str(swarm.data), "--eval-every", "25", "--device", "cpu",
            "--bootstrap", swarm.boot]
    node = NodeProc("t0", swarm.root / "t0", args, swarm.root / "t0.log",
                    command=["torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "locoswarm.node.cli", "run"])
    swarm.nodes.append(node)  # the fixture stops it and checks its process group
    for n in (node, plain):
        n.wait_status(lambda s: [e for e in merged(s) if e["group_size"] == 2], 180, "a round merged with the other")
    family = [node.proc.pid, *node.descendants()]
    ranks = [p for p in children(node.proc.pid) if "locoswarm.node.cli" in _cmdline(p)]
    assert len(ranks) == 2, f"not two ranks under torchrun: {[_cmdline(p) for p in children(node.proc.pid)]}"
    assert node.terminate(90) == 1, node.tail()  # torchrun's own code after a SIGTERM to its workers
    stops = re.findall(r"rank (\d) stops at step (\d+) with parameters crc32 ([0-9a-f]{8})",
                       node.log_path.read_text(errors="replace"))
    assert {r for r, _, _ in stops} == {"0", "1"} and len({(s, c) for _, s, c in stops}) == 1, node.tail()
    assert node.status()["state"] == "stopped", node.tail()
    deadline = time.monotonic() + 15  # torchrun may exit while a rank still tears its process group down
    while [p for p in family if is_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [(p, _cmdline(p)) for p in family if is_alive(p)], "processes of the torchrun node are left"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:
        return ""


@needs_gloo
@pytest.mark.timeout(240)
def test_a_node_over_two_torchrun_agents_trains_as_one(swarm: Swarm) -> None:  # noqa: F811
    """A node over several machines: two torchrun agents (``--nnodes 2``, as two machines would run them, here
    on loopback) rendezvous through c10d and run one rank each. Rank 0 joins the swarm alone and
    takes its solo outer steps; the other agent's rank only follows. Both stop at ``--max-steps`` with one
    model, both agents exit 0, and nothing of either is left."""
    port = free_port()
    agents = []
    for node_rank in (0, 1):
        command = ["torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "locoswarm-test",
                   "-m", "locoswarm.node.cli", "run"]
        args = ["--config", str(swarm.config), "--data", str(swarm.data), "--device", "cpu", "--max-steps", "40",
                "--eval-every", "20"]
        agents.append(NodeProc(f"agent{node_rank}", swarm.root / f"agent{node_rank}", args,
                               swarm.root / f"agent{node_rank}.log", command=command))
    swarm.nodes.extend(agents)  # the fixture stops them and checks their process groups
    assert [a.proc.wait(180) for a in agents] == [0, 0], "\n".join(a.tail() for a in agents)
    logs = "\n".join(a.log_path.read_text(errors="replace") for a in agents)
    stops = re.findall(r"rank (\d) stops at step (\d+) with parameters crc32 ([0-9a-f]{8})", logs)
    assert sorted(r for r, _, _ in stops) == ["0", "1"] and len({(s, c) for _, s, c in stops}) == 1, stops
    assert stops[0][1] == "40"
    # Rank 0 is on the agent the rendezvous made node 0 (c10d: not always the first started); only its state
    # dir holds the node's state.
    statuses = [a.status() for a in agents if a.state_dir.joinpath("status.json").exists()]
    assert len(statuses) == 1, "not exactly one rank wrote the node's state"
    st = statuses[0]
    assert st["state"] == "stopped" and st["solo_steps"] > 0 and st["inner_step"] == 40, st.get("state")
