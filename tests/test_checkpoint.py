"""Checkpoints: exact round trip, resume determinism, crash safety, damage fallback, export and CLI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from locoswarm.node.checkpoint import export_model, load_checkpoint, save_checkpoint
from locoswarm.node.commands.export import register_export
from locoswarm.node.config import InnerSection, ModelSection, OuterSection, SwarmConfig, fingerprint
from locoswarm.node.core.codecs import get_codec
from locoswarm.node.core.outer_loop import OuterLoop
from locoswarm.node.data import ByteTokenizer
from locoswarm.node.errors import UserError
from locoswarm.node.inner import InnerOptimizer
from locoswarm.node.model import build_model
from locoswarm.node.partition import partition
from locoswarm.node.transport.inprocess import InProcessHub

VOCAB = 257
FP = fingerprint(SwarmConfig())  # the nodes below use the default sections, so this is their swarm
REPO = Path(__file__).resolve().parents[1]



class Node:
    """model + inner AdamW + outer loop, wired as in node/sim/simulator.py."""

    def __init__(self) -> None:
        self.model = build_model(ModelSection(), VOCAB)
        self.inner = InnerOptimizer(self.model, InnerSection())
        hub = InProcessHub(get_codec("fp4"), 2)
        self.outer = OuterLoop(self.model, partition(self.model, 2), OuterSection(), hub.transport(0),
                               expected_group_size=2)

    def train(self, steps: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            self.inner.step([torch.randint(0, VOCAB, (2, 16), generator=gen)])

    def save(self, state_dir: Path, **meta) -> Path:
        return save_checkpoint(state_dir, model=self.model, inner=self.inner, outer=self.outer,
                               meta={"fingerprint": FP, **meta})

    def load(self, state_dir: Path, fp: str = FP) -> dict | None:
        return load_checkpoint(state_dir, model=self.model, inner=self.inner, outer=self.outer, fingerprint=fp)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def _trained(seed: int = 0) -> Node:
    """A node whose every piece of state is non-trivial (and one parameter without AdamW state)."""
    node = Node()
    node.train(3, seed)
    node.inner.optimizer.state.pop(next(node.model.parameters()))  # as if it never had a gradient
    gen = torch.Generator().manual_seed(seed + 1)
    for st in node.outer.states:
        st.phi.add_(0.01 * torch.randn(st.phi.shape, generator=gen))
        st.momentum.copy_(torch.randn(st.phi.shape, generator=gen))
        st.residual.copy_(1e-3 * torch.randn(st.phi.shape, generator=gen))
        st.version = 5 + st.index
        st.last_send = None if st.index == 0 else 17
        st.tokens_since_send = 1234.5 + st.index
    node.outer.stats.syncs_ok, node.outer.stats.bytes_sent = 4, 9999
    return node


def _assert_same(a: Node, b: Node) -> None:
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    for i, (pa, pb) in enumerate(zip(a.model.parameters(), b.model.parameters(), strict=True)):
        sa, sb = a.inner.optimizer.state.get(pa, {}), b.inner.optimizer.state.get(pb, {})
        assert sa.keys() == sb.keys(), i
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (i, key)
    assert a.inner.steps_done == b.inner.steps_done
    for sa, sb in zip(a.outer.states, b.outer.states, strict=True):
        assert torch.equal(sa.phi, sb.phi) and torch.equal(sa.momentum, sb.momentum)
        assert torch.equal(sa.residual, sb.residual)
        assert (sa.version, sa.last_send, sa.tokens_since_send) == (sb.version, sb.last_send, sb.tokens_since_send)
    assert (a.outer.stats.syncs_ok, a.outer.stats.bytes_sent) == (b.outer.stats.syncs_ok, b.outer.stats.bytes_sent)


# ---- round trip ------------------------------------------------------------------------------------

def test_round_trip_restores_everything_and_resumes_identically(tmp_path: Path) -> None:
    a = _trained()
    assert a.inner.optimizer.state.get(next(a.model.parameters())) is None
    path = a.save(tmp_path, step=42, tokens=3.5e6, peer_id="QmPeer", swarm_clock=40)
    assert path == tmp_path / "checkpoint.safetensors"
    b = Node()
    doc = b.load(tmp_path)
    assert doc is not None and doc["meta"]["step"] == 42 and doc["meta"]["peer_id"] == "QmPeer"
    assert doc["fingerprint"] == FP and doc["loaded_from"] == "checkpoint.json"
    assert [f["version"] for f in doc["fragments"]] == [5, 6]
    _assert_same(a, b)
    # One more step from both: identical params and optimizer state (the resume is exact).
    a.train(1, seed=9)
    b.train(1, seed=9)
    _assert_same(a, b)


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    assert Node().load(tmp_path) is None
    assert Node().load(tmp_path / "missing") is None


def test_in_flight_sync_is_saved_as_failed(tmp_path: Path) -> None:
    """pending is not saved: the fragment keeps its tokens and its residual from before the send."""
    a = Node()
    a.train(1, seed=0)
    a.outer.add_tokens(100.0)
    residual_before = a.outer.states[0].residual.clone()
    events = a.outer.send(25)  # fragment 0's offset with h = 50, F = 2
    assert [e.kind for e in events] == ["sent"] and 0 in a.outer.pending
    assert not torch.equal(a.outer.states[0].residual, residual_before)  # fp4 left an error to carry
    a.save(tmp_path)
    b = Node()
    b.load(tmp_path)
    assert not b.outer.pending
    assert b.outer.states[0].tokens_since_send == 100.0 and b.outer.states[0].last_send == 25
    assert torch.equal(b.outer.states[0].residual, residual_before)
    assert torch.equal(b.outer.states[1].residual, a.outer.states[1].residual)


# ---- crash safety ----------------------------------------------------------------------------------

class _Crash(BaseException):
    """Not an Exception: nothing in the code under test may swallow it."""


def _crash_after(monkeypatch: pytest.MonkeyPatch, n_ok: int | None) -> None:
    """Make os.replace crash on call n_ok + 1 (None: never)."""
    real = os.replace
    calls = {"n": 0}

    def replace(src, dst, **kw):
        if n_ok is not None and calls["n"] >= n_ok:
            raise _Crash(f"simulated crash before replace {src} -> {dst}")
        calls["n"] += 1
        return real(src, dst, **kw)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("first", [0, 1, 2, 3, None])
@pytest.mark.parametrize("second", [0, 1, 2, 3, None])
def test_a_crash_at_any_replace_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              first: int | None, second: int | None) -> None:
    """Two saves crash at any replace (a save makes 2 or 4): the last completed save always loads."""
    node = _trained()
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    completed = None
    for tag, crash in enumerate([None, None, first, second]):
        node.train(1, seed=tag)
        snapshots[tag] = node.params()
        _crash_after(monkeypatch, crash)
        try:
            node.save(tmp_path, tag=tag)
            completed = tag
        except _Crash:
            pass
        monkeypatch.undo()
    fresh = Node()
    doc = fresh.load(tmp_path)
    assert doc is not None and doc["meta"]["tag"] == completed
    got = fresh.params()
    assert all(torch.equal(got[n], snapshots[completed][n]) for n in got)


def test_crash_in_the_first_save_leaves_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = _trained()
    for n_ok in (0, 1):
        _crash_after(monkeypatch, n_ok)
        with pytest.raises(_Crash):
            node.save(tmp_path)
        monkeypatch.undo()
        assert Node().load(tmp_path) is None  # a tensor file without its JSON record is not a checkpoint


def test_stale_temporaries_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".checkpoint.deadbeef.safetensors.tmp"
    stale.write_bytes(b"half a file")
    _trained().save(tmp_path)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json", "checkpoint.safetensors"]


# ---- fingerprint and damage ------------------------------------------------------------------------

def test_fingerprint_mismatch_is_one_line(tmp_path: Path) -> None:
    _trained().save(tmp_path)
    with pytest.raises(UserError) as info:
        Node().load(tmp_path, fp="0123456789abcdef")
    assert str(info.value) == (f"state dir {tmp_path} holds a checkpoint of swarm fingerprint {FP} but this node "
                               "runs 0123456789abcdef; use another --state-dir or the matching peers.toml")


def _flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage_json"])
def test_damaged_current_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    node = _trained()
    node.save(tmp_path, tag="old")
    old = node.params()
    node.train(1, seed=5)
    node.save(tmp_path, tag="new")
    if damage == "flip":
        _flip_middle(tmp_path / "checkpoint.safetensors")
    elif damage == "truncate":
        with open(tmp_path / "checkpoint.safetensors", "r+b") as f:
            f.truncate(100)
    else:
        (tmp_path / "checkpoint.json").write_text("{not json")
    fresh = Node()
    doc = fresh.load(tmp_path)
    assert doc is not None and doc["meta"]["tag"] == "old" and doc["loaded_from"] == "checkpoint.prev.json"
    assert all(torch.equal(p, old[n]) for n, p in fresh.params().items())
    # The next save must not rotate the damaged pair over the good previous one.
    node.save(tmp_path, tag="newer")
    prev = json.loads((tmp_path / "checkpoint.prev.json").read_text())
    assert prev["meta"]["tag"] == "old"


def test_a_non_finite_checkpoint_is_never_loaded(tmp_path: Path) -> None:
    """A state saved after it was poisoned (nan in phi) is unusable: the previous pair loads instead,
    and with no clean pair the node refuses to start with a one-line error naming the tensor."""
    node = _trained()
    node.save(tmp_path, tag="clean")
    clean = node.params()
    node.outer.states[0].phi[0] = float("nan")
    node.save(tmp_path, tag="poisoned")
    fresh = Node()
    doc = fresh.load(tmp_path)
    assert doc is not None and doc["meta"]["tag"] == "clean" and doc["loaded_from"] == "checkpoint.prev.json"
    assert all(torch.equal(p, clean[n]) for n, p in fresh.params().items())
    assert all(bool(torch.isfinite(st.phi).all()) for st in fresh.outer.states)
    node.save(tmp_path, tag="poisoned again")  # now both pairs hold the nan
    with pytest.raises(UserError) as info:
        Node().load(tmp_path)
    assert "\n" not in str(info.value) and "non-finite" in str(info.value) and "outer/0/phi" in str(info.value)


def test_everything_damaged_names_the_file(tmp_path: Path) -> None:
    node = _trained()
    node.save(tmp_path)
    node.save(tmp_path)
    for stem in ("checkpoint", "checkpoint.prev"):
        _flip_middle(tmp_path / f"{stem}.safetensors")
    with pytest.raises(UserError) as info:
        Node().load(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "checkpoint.safetensors") in message and "checkpoint.prev.safetensors" in message
    assert "mv " in message and "corrupt" in message


# ---- export ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("use", ["outer", "live"])
def test_export_loads_with_transformers(tmp_path: Path, use: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    node = _trained()
    node.save(tmp_path / "state", step=7)
    out = export_model(tmp_path / "state", tmp_path / "out", SwarmConfig(), ByteTokenizer(), use=use)
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)  # the swarm's byte tokenizer
    text = "a swarm of ünïcödé ✓\n"
    assert tokenizer.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
    assert tokenizer.decode(ByteTokenizer().encode(text)) == text
    assert tokenizer.eos_token_id == loaded.config.eos_token_id == ByteTokenizer.eos_id
    named = dict(loaded.named_parameters())
    if use == "outer":
        for frag, st in zip(partition(node.model, 2), node.outer.states, strict=True):
            flat = torch.cat([named[n].detach().reshape(-1) for n in frag.names])
            assert torch.equal(flat, st.phi)
    else:
        assert all(torch.equal(named[n].detach(), p) for n, p in node.params().items())
    record = json.loads((out / "locoswarm.json").read_text())
    assert record["fingerprint"] == FP and record["weights"] == use
    assert record["versions"] == {"0": 5, "1": 6} and record["meta"]["step"] == 7


def test_export_errors_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        export_model(tmp_path / "nope", tmp_path / "out", SwarmConfig(), ByteTokenizer())
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no checkpoint"):
        export_model(tmp_path / "empty", tmp_path / "out", SwarmConfig(), ByteTokenizer())


# ---- CLI -------------------------------------------------------------------------------------------

def _parser_with_export() -> argparse.ArgumentParser:
    """locoswarm.node.cli's parser class with our subcommand (locoswarm.node.cli may not register ``export`` yet)."""
    from locoswarm.node.cli import _Parser

    parser = _Parser(prog="locoswarm")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    register_export(sub)
    return parser


def _cli_registers_export() -> bool:
    from locoswarm.node.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return "export" in action.choices
    return False


def test_cli_export_through_register_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    import locoswarm.node.cli

    monkeypatch.delenv("LOCOSWARM_CONFIG", raising=False)
    monkeypatch.setattr(locoswarm.node.cli, "build_parser", _parser_with_export)
    _trained().save(tmp_path / "state")
    out = tmp_path / "out"
    assert locoswarm.node.cli.main(["export", "--state-dir", str(tmp_path / "state"), "--out", str(out)]) == 0
    assert (out / "model.safetensors").exists() and (out / "locoswarm.json").exists()
    capsys.readouterr()
    for argv in (["export", "--state-dir", str(tmp_path / "nope"), "--out", str(out)],
                 ["export", "--state-dir", str(tmp_path / "state"), "--out", str(out), "--set", "outer.h=20"]):
        assert locoswarm.node.cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("locoswarm: error: ") and "Traceback" not in err


@pytest.mark.skipif(not _cli_registers_export(), reason="locoswarm.node.cli does not register 'export' yet")
def test_cli_export_subprocess(tmp_path: Path) -> None:
    _trained().save(tmp_path / "state")
    env = {k: v for k, v in os.environ.items() if k != "LOCOSWARM_CONFIG"}

    def run(state: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "locoswarm.node.cli", "export", "--state-dir", str(state),
                               "--out", str(tmp_path / "out"), "--live"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    ok = run(tmp_path / "state")
    assert ok.returncode == 0, ok.stderr
    bad = run(tmp_path / "nope")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


# ---- generate --------------------------------------------------------------------------------------

def test_generate_greedy_matches_transformers_generate_on_the_export(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from locoswarm.node.checkpoint import load_trained_model
    from locoswarm.node.generate import generate_text

    _trained().save(tmp_path / "state")
    export_model(tmp_path / "state", tmp_path / "out", SwarmConfig(), ByteTokenizer())
    model, _ = load_trained_model(tmp_path / "state", SwarmConfig(), VOCAB)
    ours = generate_text(model, ByteTokenizer(), "The swarm ", max_new_tokens=12, temperature=0.0, top_k=0,
                         seed=0, max_seq_len=SwarmConfig().model.max_seq_len)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    ids = tok("The swarm ", return_tensors="pt", add_special_tokens=False).input_ids
    out = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.eos_token_id)
    assert ours == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    sampled = [generate_text(model, ByteTokenizer(), "x", max_new_tokens=20, temperature=1.0, top_k=10, seed=s,
                             max_seq_len=64) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]  # seeded


def test_cli_generate_prints_the_prompt_and_its_continuation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    import locoswarm.node.cli

    monkeypatch.delenv("LOCOSWARM_CONFIG", raising=False)
    _trained().save(tmp_path / "state")
    argv = ["generate", "--state-dir", str(tmp_path / "state"), "--prompt", "Hello", "--max-new-tokens", "8"]
    assert locoswarm.node.cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("Hello")
    for bad in (["--max-new-tokens", "0"], ["--temperature", "-1"], ["--state-dir", str(tmp_path / "nope")]):
        assert locoswarm.node.cli.main([*argv, *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("locoswarm: error: ") and "Traceback" not in err
