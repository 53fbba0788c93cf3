"""Synthetic compute (``locoswarm run --synthetic-step``, node/synthetic.py): a deterministic update of the real
parameters of unit RMS per tensor at the inner lr, shared in part by every node of a swarm, then a sleep that
burns no CPU; and the flag's one-line refusals."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time

import pytest
import torch
from swarm_util import REPO

from locoswarm.node.commands.run import check_synthetic_step
from locoswarm.node.config import load_config
from locoswarm.node.errors import UserError
from locoswarm.node.inner import InnerOptimizer
from locoswarm.node.synthetic import COMMON_SHARE, SyntheticCompute, swarm_seed

pytestmark = pytest.mark.timeout(120)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 64))


def _synthetic(node_seed: int, *, seconds: float = 0.0, warmup: int = 0, common_seed: int = 7,
               stop: threading.Event | None = None, clock=None) -> SyntheticCompute:
    cfg = dataclasses.replace(load_config(None).inner, warmup=warmup)
    return SyntheticCompute(InnerOptimizer(_model(), cfg), seconds, common_seed=common_seed, node_seed=node_seed,
                            stop=stop, clock=clock)


def _params(s: SyntheticCompute) -> list[torch.Tensor]:
    return [p.detach().clone() for p in s.params]


def _updates(s: SyntheticCompute) -> list[torch.Tensor]:
    """The change of every parameter over one step."""
    before = _params(s)
    s.step()
    return [p.detach() - b for p, b in zip(s.params, before, strict=True)]


def test_the_same_seeds_and_step_give_the_same_update_and_other_nodes_differ() -> None:
    a, b, other = _synthetic(1), _synthetic(1), _synthetic(2)
    for _ in range(3):
        ua, ub, uo = _updates(a), _updates(b), _updates(other)
        assert all(torch.equal(x, y) for x, y in zip(ua, ub, strict=True))
        assert not any(torch.equal(x, y) for x, y in zip(ua, uo, strict=True))
    assert a.inner.steps_done == 3  # the inner optimizer's counter advances: lr schedule and checkpoints see steps
    assert swarm_seed("abc") == swarm_seed("abc") != swarm_seed("abd")


def test_each_tensors_update_has_unit_rms_at_the_inner_lr() -> None:
    s = _synthetic(3)
    lr = s.inner.lr_at(0)
    for u in _updates(s):
        assert (u.pow(2).mean().sqrt() / lr).item() == pytest.approx(1.0, rel=2e-3)


def test_the_update_follows_the_inner_lr_warmup() -> None:
    s = _synthetic(3, warmup=10)
    lr0 = s.inner.lr_at(0)
    assert lr0 == pytest.approx(s.inner.cfg.lr / 10)
    u = _updates(s)[0]
    assert (u.pow(2).mean().sqrt()).item() == pytest.approx(lr0, rel=2e-3)


def test_two_nodes_agree_on_the_common_share_of_their_updates() -> None:
    """Honest pseudo-gradients agree in part: two nodes' updates have cosine COMMON_SHARE (the common direction's
    share of the variance); a node of another swarm (another common seed) does not agree at all."""
    a, b, stranger = _synthetic(1), _synthetic(2), _synthetic(2, common_seed=8)
    ua, ub, us = _updates(a)[0].flatten(), _updates(b)[0].flatten(), _updates(stranger)[0].flatten()
    cos = torch.nn.functional.cosine_similarity
    assert cos(ua, ub, dim=0).item() == pytest.approx(COMMON_SHARE, abs=0.03)  # 32k elements: +-0.01 by chance
    assert abs(cos(ua, us, dim=0).item()) < 0.03


def test_the_common_direction_turns_with_the_swarm_clock_not_the_nodes_own_steps() -> None:
    """A joiner (or a slow node) far behind in its own step count still agrees with the others: the common
    direction follows the swarm clock; by its own count it would point elsewhere."""
    a, late = _synthetic(1, clock=lambda: 1000), _synthetic(2, clock=lambda: 1000)
    a.inner.steps_done = 1000  # 1,000 steps in; the joiner is at its first step
    ua, ul = _updates(a)[0].flatten(), _updates(late)[0].flatten()
    cos = torch.nn.functional.cosine_similarity
    assert cos(ua, ul, dim=0).item() == pytest.approx(COMMON_SHARE, abs=0.03)
    own_count = _synthetic(2)  # no clock: its own step 0, half a turn (TURN_STEPS = 2000) from the swarm's 1000
    assert cos(ua, _updates(own_count)[0].flatten(), dim=0).item() == pytest.approx(-COMMON_SHARE, abs=0.03)


def test_a_step_sleeps_its_wall_time_and_burns_no_cpu() -> None:
    s = _synthetic(1, seconds=0.05)
    s.step()  # first-touch costs out of the way
    steps = 6
    wall0, cpu0 = time.monotonic(), time.process_time()
    for _ in range(steps):
        s.step()
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    assert wall >= steps * 0.05 * 0.98
    assert cpu < 0.25 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s of wall"


def test_a_leaving_node_does_not_wait_out_its_step() -> None:
    stop = threading.Event()
    stop.set()
    s = _synthetic(1, seconds=30.0, stop=stop)
    t0 = time.monotonic()
    s.step()
    assert time.monotonic() - t0 < 5.0 and s.inner.steps_done == 1


@pytest.mark.parametrize("seconds", [0.0, 0.01, 1.5, 600.0])
def test_synthetic_step_range_accepted(seconds: float) -> None:
    check_synthetic_step(seconds)


@pytest.mark.parametrize("seconds", [0.001, -1.0, 601.0, float("nan"), float("inf")])
def test_a_synthetic_step_out_of_range_is_one_line_naming_value_and_range(seconds: float) -> None:
    with pytest.raises(UserError) as err:
        check_synthetic_step(seconds)
    text = str(err.value)
    assert text.startswith(f"--synthetic-step {seconds:g} is not allowed") and "0.01 to 600" in text
    assert "0 (off" in text and "\n" not in text


def test_synthetic_compute_with_several_ranks_is_refused() -> None:
    with pytest.raises(UserError, match="drop --nproc"):
        check_synthetic_step(1.0, nproc=2)


@pytest.mark.quick_process
def test_run_refuses_a_bad_synthetic_step_in_one_line_before_anything_starts(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "locoswarm.node.cli", "run", "--state-dir", str(tmp_path / "s"),
                           "--synthetic-step", "0.001"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--synthetic-step 0.001" in proc.stderr
    assert "Traceback" not in proc.stderr and "listening on" not in proc.stdout + proc.stderr


def test_a_synthetic_node_says_so_in_its_log_and_status_and_trains_no_loss(tmp_path) -> None:
    """A real ``locoswarm run --synthetic-step``: the start log line, ``synthetic_step_s`` in status.json, no
    training loss, no periodic evaluation, steps of at least the synthetic step's wall time, tokens counted."""
    import json
    import os

    from swarm_util import write_config, write_corpus

    config, data = write_config(tmp_path / "peers.toml"), write_corpus(tmp_path / "data", docs=3, lines=60)
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "locoswarm.node.cli", "run", "--threads", "1", "--control-port", "0",
                           "--config", str(config), "--data", str(data), "--state-dir", str(state),
                           "--max-steps", "12", "--eval-every", "4", "--checkpoint-every", "0",
                           "--synthetic-step", "0.2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "synthetic compute: 0.20 s/step" in out
    assert time.monotonic() - t0 >= 12 * 0.2
    st = json.loads((state / "status.json").read_text())
    assert st["synthetic_step_s"] == 0.2 and st["inner_step"] == 12 and st["loss"] is None
    assert len(st["eval_curve"]) == 1  # the evaluation at start only
    assert st["tokens"] == 12 * 4 * 32  # batch_size x seq_len per step, as if trained
