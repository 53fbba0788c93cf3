"""Periodic, crash-safe checkpoints of a node, and ``locoswarm export`` of the trained model.

A checkpoint is a pair of files in the node's state dir:

- ``checkpoint.safetensors``: every tensor of the node, copied to CPU and made contiguous first:
  ``model/<param name>`` (the live params theta), ``inner/<i>/<key>`` (AdamW state ``exp_avg``,
  ``exp_avg_sq``, ``step`` of the i-th parameter in ``model.parameters()`` order; a parameter without
  state yet has no entries), ``outer/<p>/phi``, ``outer/<p>/momentum``, ``outer/<p>/residual`` (only
  with error feedback) and ``outer/shared_r`` (adaptive schedule, once known). Its safetensors
  metadata carries the format, the swarm fingerprint and a random content id.
- ``checkpoint.json``: the format, fingerprint, content id, the SHA-256 of the tensor file, per-fragment
  version / last_send / tokens_since_send, the inner ``steps_done``, a few outer counters and, under
  ``"meta"``, whatever the caller passed (swarm clock, data position, tokens, peer id, wall time).

The JSON is the commit record: a checkpoint exists once its JSON is in place and names the content id
(and hash) of the tensor file beside it. Saving never touches the files a reader may need:

1. write both files under temporary names, fsync them;
2. if the current pair is intact, hard-link it (copy where links are unsupported) to temporary names
   and ``os.replace`` those onto ``checkpoint.prev.*``, tensors first;
3. ``os.replace`` the new tensor file onto ``checkpoint.safetensors``, then the new JSON onto
   ``checkpoint.json`` (the directory is fsynced after every replace).

At every instant either the current pair or the previous pair is intact and holds the last completed
save (or the new one), so a crash at any point loses nothing that was saved. An intact current pair
is rotated only after its hash checks, so a damaged current pair never overwrites a good previous one.

The outer loop's part is what ``OuterLoop.state_dict()`` returns (its tensors under ``outer/``, its
records under ``"fragments"`` and ``"outer"``) and goes back through ``OuterLoop.load_state_dict()``:
in-flight syncs are not saved (a restarted node re-sends; see ``OuterLoop.state_dict``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from locoswarm.node.config import SwarmConfig, to_dict
from locoswarm.node.config import fingerprint as swarm_fingerprint
from locoswarm.node.errors import UserError
from locoswarm.node.fsutil import atomic_write_text
from locoswarm.node.inner import InnerOptimizer
from locoswarm.node.model import build_model
from locoswarm.node.partition import fragment_params, partition

if TYPE_CHECKING:
    from locoswarm.node.core.outer_loop import OuterLoop

log = logging.getLogger(__name__)

#: Bumped when the layout of the checkpoint files changes incompatibly.
FORMAT = 1
CURRENT = "checkpoint"
PREVIOUS = "checkpoint.prev"
_ST_FORMAT = f"locoswarm-checkpoint/{FORMAT}"
_TMP_PREFIX = ".checkpoint"
_TMP_SUFFIX = ".tmp"


def _paths(state_dir: Path, stem: str) -> tuple[Path, Path]:
    return state_dir / f"{stem}.safetensors", state_dir / f"{stem}.json"


# ---- low-level file helpers ------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sync_and_hash(path: Path) -> str:
    """fsync ``path`` and return its SHA-256 (read back while it is still in the page cache)."""
    with open(path, "r+b") as f:
        os.fsync(f.fileno())
        f.seek(0)
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _link_or_copy(src: Path, dst: Path) -> None:
    """A second name for ``src`` (free with a hard link; files are never modified in place, so a link is
    as good as a copy)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb") as f:
            os.fsync(f.fileno())


def _remove_stale_temps(state_dir: Path) -> None:
    """Temporary files of a save that crashed: never part of a checkpoint, safe to delete."""
    for path in state_dir.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"):
        path.unlink(missing_ok=True)


# ---- reading a pair --------------------------------------------------------------------------------

class _Unusable(Exception):
    """One checkpoint pair cannot be used; ``path`` is the file to blame."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass
class _Pair:
    stem: str
    tensors: Path
    json_path: Path
    doc: dict
    shapes: dict[str, tuple[int, ...]]


def _read_doc(json_path: Path) -> dict:
    try:
        doc = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Unusable(json_path, f"unreadable ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("format"), int) \
            or not isinstance(doc.get("content_id"), str) or not isinstance(doc.get("fingerprint"), str):
        raise _Unusable(json_path, "not a locoswarm checkpoint record (format/content_id/fingerprint missing)")
    return doc


def _read_header(path: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # safetensors raises its own error types for every kind of damage
        raise _Unusable(path, f"corrupt ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return meta, shapes


def _open_pair(state_dir: Path, stem: str, fingerprint: str | None, *, verify_hash: bool = True) -> _Pair | None:
    """The pair ``stem`` if its JSON exists; raises ``_Unusable`` if it is damaged or inconsistent and
    ``UserError`` if it belongs to another swarm (``fingerprint`` None: no check) or a newer format."""
    tensors, json_path = _paths(state_dir, stem)
    if not json_path.exists():
        return None
    doc = _read_doc(json_path)
    if doc["format"] > FORMAT:
        raise UserError(f"{json_path} was written by a newer locoswarm (checkpoint format {doc['format']}, "
                        f"this one reads {FORMAT}); upgrade locoswarm or use another --state-dir")
    if fingerprint is not None and doc["fingerprint"] != fingerprint:
        raise UserError(f"state dir {state_dir} holds a checkpoint of swarm fingerprint {doc['fingerprint']} "
                        f"but this node runs {fingerprint}; use another --state-dir or the matching peers.toml")
    if not tensors.exists():
        raise _Unusable(tensors, f"missing (expected beside {json_path.name})")
    meta, shapes = _read_header(tensors)
    if meta.get("content_id") != doc["content_id"]:
        # A crash between the two replaces of a save: the tensors are newer than the record.
        raise _Unusable(tensors, f"belongs to another save than {json_path.name} (an interrupted save)")
    if verify_hash and _file_sha256(tensors) != doc.get("tensors_sha256"):
        raise _Unusable(tensors, "corrupt (its SHA-256 differs from the one recorded at save time)")
    return _Pair(stem, tensors, json_path, doc, shapes)


def _pair_intact(state_dir: Path, stem: str) -> bool:
    try:
        return _open_pair(state_dir, stem, None) is not None
    except (_Unusable, UserError):
        return False


def _select(state_dir: Path, fingerprint: str | None, check: Callable[[_Pair], None]) -> _Pair | None:
    """The newest usable pair (current, else previous) that passes ``check``; None if no record exists.

    Raises ``UserError`` naming the damaged files when records exist but none is usable."""
    problems: list[_Unusable] = []
    for stem in (CURRENT, PREVIOUS):
        try:
            pair = _open_pair(state_dir, stem, fingerprint)
            if pair is None:
                continue
            check(pair)
        except _Unusable as exc:
            problems.append(exc)
            continue
        for problem in problems:
            log.warning("checkpoint %s is unusable (%s); using %s instead", problem.path, problem.reason,
                        pair.json_path.name)
        return pair
    if not problems:
        return None
    details = "; ".join(str(p) for p in problems)
    first = problems[0].path
    raise UserError(f"state dir {state_dir} holds no usable checkpoint: {details}; move the damaged file(s) "
                    f"away (e.g. mv {first} {first}.bad) to start this node fresh")


def _expect(pair: _Pair, name: str, shape: tuple[int, ...]) -> None:
    got = pair.shapes.get(name)
    if got is None:
        raise _Unusable(pair.tensors, f"has no tensor {name!r}; it does not fit this node's model")
    if got != tuple(shape):
        raise _Unusable(pair.tensors, f"tensor {name!r} has shape {list(got)} but this node needs "
                                      f"{list(shape)}; it does not fit this node's model")


# ---- save ------------------------------------------------------------------------------------------

def _cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor (a copy for device tensors; CPU tensors are written as they are, the save
    being synchronous)."""
    return t.detach().to("cpu").contiguous()


def _collect(model: torch.nn.Module, inner: InnerOptimizer, outer: OuterLoop) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a checkpoint and the outer loop's state (see the module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        tensors[f"model/{name}"] = _cpu(p)
    for i, p in enumerate(model.parameters()):
        for key, value in inner.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"inner/{i}/{key}"] = _cpu(value)
            elif isinstance(value, int | float):
                tensors[f"inner/{i}/{key}"] = torch.tensor(float(value), dtype=torch.float32)
    state = outer.state_dict()
    for key, value in state["tensors"].items():
        tensors[f"outer/{key}"] = _cpu(value)
    return tensors, state


def save_checkpoint(state_dir: Path, *, model: torch.nn.Module, inner: InnerOptimizer, outer: OuterLoop,
                    meta: dict) -> Path:
    """Write a checkpoint of the node to ``state_dir`` atomically (see the module docstring).

    Args:
        model: the live model (theta).
        inner: its inner optimizer.
        outer: its ``OuterLoop``.
        meta: JSON-serializable caller data; must hold ``"fingerprint"`` (the swarm fingerprint); the
            rest (swarm clock, local step, tokens, peer id, wall time) is stored as given under ``"meta"``.

    Returns the path of the tensor file. The previous checkpoint is kept as ``checkpoint.prev.*``.
    """
    fingerprint = meta.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError("save_checkpoint: meta must hold the swarm fingerprint under 'fingerprint'")
    from safetensors.torch import save_file

    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(state_dir)
    content_id = uuid.uuid4().hex
    tensors, state = _collect(model, inner, outer)
    doc: dict[str, Any] = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "content_id": content_id,
        "tensors_sha256": "",
        "inner_steps_done": int(inner.steps_done),
        "fragments": state["fragments"],
        "outer": {"expected_share": state["expected_share"], "stats": state["stats"]},
        "meta": dict(meta),
    }
    new_st, new_json = _paths(state_dir, CURRENT)
    prev_st, prev_json = _paths(state_dir, PREVIOUS)

    def tmp(kind: str) -> Path:
        return state_dir / f"{_TMP_PREFIX}.{content_id}.{kind}{_TMP_SUFFIX}"

    temps = [tmp("safetensors"), tmp("json"), tmp("prev.safetensors"), tmp("prev.json")]
    try:
        save_file(tensors, str(temps[0]), metadata={"format": _ST_FORMAT, "fingerprint": fingerprint,
                                                    "content_id": content_id})
        doc["tensors_sha256"] = _sync_and_hash(temps[0])
        _write_synced(temps[1], (json.dumps(doc, indent=1) + "\n").encode("utf-8"))
        if _pair_intact(state_dir, CURRENT):
            _link_or_copy(new_st, temps[2])
            _link_or_copy(new_json, temps[3])
            os.replace(temps[2], prev_st)
            _fsync_dir(state_dir)
            os.replace(temps[3], prev_json)
            _fsync_dir(state_dir)
        os.replace(temps[0], new_st)
        _fsync_dir(state_dir)
        os.replace(temps[1], new_json)
        _fsync_dir(state_dir)
    finally:
        for path in temps:
            path.unlink(missing_ok=True)
    return new_st


# ---- load ------------------------------------------------------------------------------------------

def _optimizer_index(inner: InnerOptimizer) -> dict[int, int]:
    """id(param) -> its index in the optimizer's state_dict (params of all groups in order)."""
    out: dict[int, int] = {}
    for group in inner.optimizer.param_groups:
        for p in group["params"]:
            out.setdefault(id(p), len(out))
    return out


def load_checkpoint(state_dir: Path, *, model: torch.nn.Module, inner: InnerOptimizer, outer: OuterLoop,
                    fingerprint: str) -> dict | None:
    """Restore the node from the newest usable checkpoint in ``state_dir``, in place.

    Tensors go to the device of the objects they restore. In-flight syncs of ``outer`` are dropped (the
    checkpoint has none; see the module docstring). Falls back to ``checkpoint.prev.*`` when the current
    pair is damaged or from an interrupted save.

    Returns the JSON record (the caller's data under ``"meta"``, per-fragment counters under
    ``"fragments"``, plus ``"loaded_from"``: the record's file name), or None without a checkpoint.
    Raises ``UserError`` on a fingerprint mismatch or when no pair is usable.
    """
    state_dir = Path(state_dir)
    if not state_dir.is_dir():
        return None
    named = list(model.named_parameters())
    params = list(model.parameters())
    opt_index = _optimizer_index(inner)

    def check(pair: _Pair) -> None:
        for name, p in named:
            _expect(pair, f"model/{name}", tuple(p.shape))
        for key in pair.shapes:
            if key.startswith("inner/"):
                _, i, kind = [*key.split("/", 2), "", ""][:3]
                if not i.isdigit() or not kind or int(i) >= len(params) or id(params[int(i)]) not in opt_index:
                    raise _Unusable(pair.tensors, f"has optimizer state {key!r} for a parameter this node's "
                                                  "optimizer does not have")
                if kind in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    _expect(pair, key, tuple(params[int(i)].shape))
        required, optional = outer.state_shapes()
        records = pair.doc.get("fragments")
        n_fragments = sum(1 for key in required if key.endswith("/phi"))
        if not isinstance(records, list) or len(records) != n_fragments:
            raise _Unusable(pair.json_path, f"records {len(records or [])} fragments but this node has "
                                            f"{n_fragments}")
        for key, shape in required.items():
            _expect(pair, f"outer/{key}", shape)
        for key, shape in optional.items():
            if f"outer/{key}" in pair.shapes and key != "shared_r":
                _expect(pair, f"outer/{key}", shape)
        _check_finite(pair)

    pair = _select(state_dir, fingerprint, check)
    if pair is None:
        return None
    _restore(pair, model, inner, outer, opt_index)
    return {**pair.doc, "loaded_from": pair.json_path.name}


def _check_finite(pair: _Pair) -> None:
    """Nothing non-finite is ever loaded: a checkpoint saved from a poisoned state (or damaged on disk
    in a way its checksums missed) is unusable, and the previous pair is used instead."""
    from safetensors import safe_open

    with safe_open(str(pair.tensors), framework="pt", device="cpu") as f:
        for key in pair.shapes:
            t = f.get_tensor(key)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise _Unusable(pair.tensors, f"tensor {key!r} has {bad} non-finite value(s)")


@torch.no_grad()
def _restore(pair: _Pair, model: torch.nn.Module, inner: InnerOptimizer, outer: OuterLoop,
             opt_index: dict[int, int]) -> None:
    from safetensors import safe_open

    params = list(model.parameters())
    with safe_open(str(pair.tensors), framework="pt", device="cpu") as f:
        for name, p in model.named_parameters():
            p.copy_(f.get_tensor(f"model/{name}"))
        # Rebuild the optimizer state through load_state_dict, which puts every value on the device
        # and dtype torch expects (``step`` stays a CPU scalar unless capturable/fused). The current
        # param_groups are kept: lr comes from steps_done, and local settings may have changed.
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key in pair.shapes:
            if key.startswith("inner/"):
                _, i, kind = key.split("/", 2)
                state.setdefault(opt_index[id(params[int(i)])], {})[kind] = f.get_tensor(key)
        sd = inner.optimizer.state_dict()
        sd["state"] = state
        inner.optimizer.load_state_dict(sd)
        inner.steps_done = int(pair.doc["inner_steps_done"])

        outer_tensors = {key[len("outer/"):]: f.get_tensor(key) for key in pair.shapes if key.startswith("outer/")}
    extra = pair.doc.get("outer") or {}
    outer.load_state_dict({"tensors": outer_tensors, "fragments": pair.doc["fragments"], **extra})


# ---- export ----------------------------------------------------------------------------------------

def load_trained_model(state_dir: Path, cfg: SwarmConfig, vocab_size: int, *,
                       use: str = "outer") -> tuple[torch.nn.Module, _Pair]:
    """The checkpoint's model on CPU: ``use="outer"`` loads phi, the consensus the swarm agreed on (the
    same on every peer at equal versions); ``use="live"`` this node's own live params theta. Returns the
    model and the checkpoint pair it came from. Raises ``UserError`` without a usable checkpoint."""
    if use not in ("outer", "live"):
        raise UserError(f"use = {use!r}; choose 'outer' (consensus phi) or 'live' (this node's theta)")
    state_dir = Path(state_dir)
    if not state_dir.is_dir():
        raise UserError(f"state dir {state_dir} does not exist; pass the --state-dir of a node that has "
                        "saved a checkpoint")
    fp = swarm_fingerprint(cfg)
    model = build_model(cfg.model, vocab_size)
    fragments = partition(model, cfg.outer.fragments)

    def check(pair: _Pair) -> None:
        if use == "live":
            for name, p in model.named_parameters():
                _expect(pair, f"model/{name}", tuple(p.shape))
        else:
            for frag in fragments:
                _expect(pair, f"outer/{frag.index}/phi", (frag.numel,))

    pair = _select(state_dir, fp, check)
    if pair is None:
        raise UserError(f"state dir {state_dir} holds no checkpoint (no {CURRENT}.json); run the node until "
                        "it has saved one, or pass the right --state-dir")
    from safetensors import safe_open

    with torch.no_grad(), safe_open(str(pair.tensors), framework="pt", device="cpu") as f:
        if use == "live":
            for name, p in model.named_parameters():
                p.copy_(f.get_tensor(f"model/{name}"))
        else:
            for frag in fragments:
                phi = f.get_tensor(f"outer/{frag.index}/phi")
                start = 0
                for p in fragment_params(model, frag):
                    p.copy_(phi[start:start + p.numel()].view_as(p))
                    start += p.numel()
    return model.eval(), pair


def export_model(state_dir: Path, out_dir: Path, cfg: SwarmConfig, tokenizer, *, use: str = "outer") -> Path:
    """Write the checkpoint's model (see :func:`load_trained_model` for ``use``) as a ``transformers``
    directory loadable with ``from_pretrained``, with ``tokenizer`` (the swarm's: ``locoswarm.node.data``) saved
    beside it so ``AutoTokenizer.from_pretrained`` loads it too, and the end-of-document token as the
    model's eos. Also writes ``out_dir/locoswarm.json`` (fingerprint, fragment versions, the checkpoint's
    meta) so the export can be traced to its swarm. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file; give a directory to write the model into")
    model, pair = load_trained_model(state_dir, cfg, tokenizer.vocab_size, use=use)
    fp = swarm_fingerprint(cfg)
    for config in (model.config, model.generation_config):
        config.eos_token_id = config.pad_token_id = tokenizer.eos_id
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard progress bar is noise on the CLI
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out_dir), safe_serialization=True)
        tokenizer.save(out_dir)
        record = {"fingerprint": fp, "weights": use, "content_id": pair.doc["content_id"],
                  "checkpoint": str(pair.json_path), "inner_steps_done": pair.doc.get("inner_steps_done"),
                  "versions": {str(r["index"]): r["version"] for r in pair.doc.get("fragments", [])},
                  "meta": pair.doc.get("meta", {}), "config": to_dict(cfg)}
        atomic_write_text(out_dir / "locoswarm.json", json.dumps(record, indent=1) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write the exported model to {out_dir}: {exc.strerror or exc}; "
                        "choose a writable --out directory") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return out_dir
