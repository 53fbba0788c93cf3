"""The swarm descriptor (``peers.toml``): schema, strict validation and the swarm fingerprint.

Every peer of a swarm reads the same ``peers.toml``. Its sections are ``[swarm]``, ``[model]``,
``[data]``, ``[inner]``, ``[outer]`` and ``[network]``. Node-local settings (ports, data path, state
dir, device) are not here: they come from CLI flags and environment variables.

Each field carries metadata:
- ``shared``: peers must agree on it; it is part of the swarm fingerprint.
- ``choices`` / ``min`` / ``max`` / ``min_exclusive``: what is allowed.
- ``help``: one line for error messages and docs.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import difflib
import hashlib
import json
import math
import os
import re
import textwrap
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from locoswarm.node.core.codec_table import CODECS
from locoswarm.node.errors import ConfigError


def setting(default: Any, *, shared: bool, help: str, choices: tuple | None = None,
            min: float | None = None, max: float | None = None, min_exclusive: bool = False,
            item_type: type | None = None) -> Any:
    """A dataclass field with validation metadata (see module docstring)."""
    meta = {"shared": shared, "help": help, "choices": choices, "min": min, "max": max,
            "min_exclusive": min_exclusive, "item_type": item_type}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SwarmSection:
    name: str = setting("locoswarm-dev", shared=True,
                        help="swarm name; part of every DHT key so swarms never mix")
    bootstrap: list[str] = setting([], shared=False, item_type=str,  # noqa: RUF009 (default_factory)
                                   help="bootstrap multiaddrs, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...")
    owner_key: str = setting("", shared=True,
                             help="a closed swarm: the owner's public key (locoswarm admit keygen); only nodes with "
                                  "a certificate it signed are members (empty: an open swarm)")
    certificate: str = setting("", shared=False,
                               help="a closed swarm: this node's certificate file (locoswarm admit sign)")


#: The model size presets (their shapes: ``locoswarm.node.model.PRESETS``, which has exactly these keys).
PRESET_NAMES = ("tiny", "small", "125m", "350m", "1b")


@dataclass
class ModelSection:
    arch: str = setting("llama", shared=True, choices=("llama", "gpt2"), help="model architecture")
    preset: str = setting("tiny", shared=True, choices=PRESET_NAMES,
                          help="size preset: tiny (~1M params), small (~25M), 125m, 350m, 1b")
    # 0 means "take the preset's value"; a positive value overrides it.
    n_layers: int = setting(0, shared=True, min=0, max=256, help="decoder blocks (0 = preset)")
    d_model: int = setting(0, shared=True, min=0, max=16384, help="hidden size (0 = preset)")
    n_heads: int = setting(0, shared=True, min=0, max=256, help="attention heads (0 = preset)")
    d_ff: int = setting(0, shared=True, min=0, max=65536, help="MLP hidden size (0 = preset)")
    max_seq_len: int = setting(1024, shared=True, min=16, max=131072, help="position capacity")
    tokenizer: str = setting("bytes", shared=True,
                             help="'bytes' (byte-level, default) or a local tokenizer directory")


@dataclass
class DataSection:
    extensions: list[str] = setting([".txt", ".md", ".py", ".jsonl"], shared=False,  # noqa: RUF009
                                    item_type=str,
                                    help="file extensions read from data directories")
    text_field: str = setting("text", shared=False, help="field holding the text in .jsonl files")
    eval_fraction: float = setting(0.02, shared=True, min=0.0, max=0.5, min_exclusive=True,
                                   help="share of documents held out for evaluation")
    seed: int = setting(0, shared=True, min=0, help="seed of the data split and sampling")
    max_bytes: int = setting(64_000_000, shared=False, min=1, help="read at most this many bytes")


@dataclass
class InnerSection:
    lr: float = setting(1e-3, shared=False, min=0.0, max=1.0, min_exclusive=True, help="AdamW lr")
    warmup: int = setting(50, shared=False, min=0, help="linear warmup steps")
    batch_size: int = setting(8, shared=False, min=1, max=4096, help="sequences per inner step")
    seq_len: int = setting(128, shared=True, min=8, max=131072, help="tokens per sequence")
    grad_clip: float = setting(1.0, shared=False, min=0.0, help="max grad norm (0 = off)")
    weight_decay: float = setting(0.1, shared=False, min=0.0, max=1.0, help="AdamW weight decay")
    beta1: float = setting(0.9, shared=False, min=0.0, max=1.0, help="AdamW beta1")
    beta2: float = setting(0.95, shared=False, min=0.0, max=1.0, help="AdamW beta2")


@dataclass
class OuterSection:
    method: str = setting("alpha", shared=True,
                          choices=("replace", "alpha", "rebase", "compensate", "eager", "delay"),
                          help="how a sync result is merged into the live params: replace (DiLoCo), "
                               "alpha (Streaming DiLoCo), rebase (DiLoCoX one-step delay), "
                               "compensate (CoCoDC), eager (eager updates, needs tau = h), "
                               "delay (naive one-outer-step delay, needs tau = h)")
    h: int = setting(50, shared=True, min=1, max=100000, help="inner steps between two syncs of a fragment")
    fragments: int = setting(2, shared=True, min=1, max=256, help="number of fragments F")
    tau: int = setting(2, shared=True, min=0, help="inner steps a sync overlaps with training (<= h)")
    max_delay: int = setting(-1, shared=False, min=-1, max=100000,
                             help="inner steps after a send by which its round must have finished: past tau, "
                                  "training goes on and a slow round is merged late, by the method's rule "
                                  "(alpha, rebase; replace and compensate always wait at tau). -1 = auto (h / "
                                  "fragments: the next sync event), 0 = always wait at tau")
    alpha: float = setting(0.5, shared=False, min=0.0, max=1.0, help="mix weight of the 'alpha' method")
    lambda0: float = setting(0.2, shared=False, min=0.0, max=10.0,
                             help="delay-compensation strength of the 'compensate' method")
    lr: float = setting(0.7, shared=True, min=0.0, max=10.0, min_exclusive=True, help="outer lr eta")
    momentum: float = setting(0.9, shared=True, min=0.0, max=1.0, help="outer Nesterov momentum mu")
    codec: str = setting("fp4", shared=True, choices=(*CODECS, "lowrank", "sparseloco"),
                         help="payload codec of pseudo-gradients: a block codec, lowrank (DiLoCoX's adaptive "
                              "low-rank compression of matrices, coded with lowrank_codec), or sparseloco "
                              "(SparseLoCo: chunk-wise top-k of a decayed error-feedback accumulator, 2-bit)")
    block_size: int = setting(64, shared=True, min=8, max=65536, help="elements per codec scale block")
    error_feedback: bool = setting(True, shared=False, help="carry quantization error to the next sync")
    # Starts at the max: the first round's basis is a seeded random one, which holds only about rank / n of a
    # matrix's energy, so a low start loses most of the first round (measured on the tiny model: rank 8 of
    # 128 kept 6% of round 1, 32 kept 23%); the rule then lowers the rank where the spectrum allows.
    lowrank_rank: int = setting(32, shared=True, min=1, max=4096,
                                help="codec lowrank: the rank every matrix starts at (then adapted within "
                                     "[lowrank_min_rank, lowrank_max_rank] from the pseudo-gradients' spectrum)")
    lowrank_min_rank: int = setting(1, shared=True, min=1, max=4096, help="codec lowrank: the smallest rank")
    lowrank_max_rank: int = setting(32, shared=True, min=1, max=4096,
                                    help="codec lowrank: the largest rank; a matrix is sent low-rank only when its "
                                         "factors at this rank have fewer elements than the matrix")
    lowrank_codec: str = setting("int8", shared=True, choices=CODECS,
                                 help="codec lowrank: the block codec of the low-rank factors and the other tensors")
    # SparseLoCo's defaults are the paper's (arXiv 2508.15706): chunks of 4096, top-64 (1.56% density), 2 bits.
    sparse_chunk: int = setting(4096, shared=True, min=1, max=65536,
                                help="codec sparseloco: elements per top-k chunk (indices are 16-bit within it)")
    sparse_topk: int = setting(64, shared=True, min=1, max=65536,
                               help="codec sparseloco: entries sent per chunk (density = sparse_topk / sparse_chunk)")
    sparse_beta: float = setting(0.95, shared=True, min=0.0, max=1.0,
                                 help="codec sparseloco: decay of the error-feedback accumulator, "
                                      "e <- beta * e + Delta")
    sparse_value_bits: int = setting(2, shared=True, choices=(2, 32),
                                     help="codec sparseloco: bits per sent value (2, or 32 for full precision)")
    schedule: str = setting("fixed", shared=True, choices=("fixed", "adaptive"),
                            help="fixed (evenly spaced offsets) or adaptive (CoCoDC)")
    consensus_every: int = setting(10, shared=True, min=0, max=100000,
                                   help="every N-th sync of a fragment also averages its outer state (phi and "
                                        "momentum, fp32) so peers' outer params cannot drift apart under gossip "
                                        "(0 = never)")
    sends_per_h: int = setting(0, shared=True, min=0,
                               help="adaptive schedule: fragment sends per h steps (0 = fragments)")
    offload: str = setting("auto", shared=False, choices=("auto", "off", "cpu"),
                           help="where phi, momentum and the residual live: cpu (pinned host memory; "
                                "frees 3 fp32 model copies on a GPU), off (the training device), auto (cpu "
                                "when training on CUDA)")
    max_carry: int = setting(4, shared=False, min=0, max=100000,
                             help="consecutive failed rounds of a fragment after which the local progress it "
                                  "carries is dropped (theta <- phi): stale progress grows until peers refuse "
                                  "it as too large; folded into phi by an outer step on it alone instead where "
                                  "this node refused what peers sent in half of those rounds or more; one sync "
                                  "carries at most (max_carry + 1) * h inner steps of progress, scaled down to that "
                                  "beyond (0 = carry it forever, unbounded)")


#: The widest matchmaking window a round may agree on, seconds (``swarm.matchmaking.agreed_window``): members wait
#: for each other at most this long, whatever a member's window claims.
MAX_WINDOW_S = 60.0


def longest_round_s(matchmaking_timeout: float, round_timeout: float) -> float:
    """The longest one round may take from its start to its result: the widest matchmaking window it may agree on,
    the exchange's timeout and 5 s of slack. The outer loop's wait for a result, the averaging streams' timeout and
    the other ranks' patience with rank 0 all derive from it (``NetworkSection.longest_round_s``)."""
    return max(matchmaking_timeout, MAX_WINDOW_S) + round_timeout + 5.0


@dataclass
class NetworkSection:
    group_size: int = setting(4, shared=True, min=2, max=1024,
                              help="peers per averaging group (2 = pairwise gossip)")
    matchmaking_timeout: float = setting(5.0, shared=False, min=0.1, max=600.0,
                                         help="seconds to wait for a group to form (or 4 swarm inner steps"
                                              " where longer, at most 60 s)")
    round_timeout: float = setting(30.0, shared=False, min=0.5, max=3600.0,
                                   help="seconds a group exchange may take before it is abandoned")
    heartbeat_interval: float = setting(2.0, shared=False, min=0.1, max=600.0,
                                        help="seconds between membership heartbeats")
    state_momentum: str = setting("fp32", shared=False, choices=("fp32", "bf16"),
                                  help="precision of the momentum in this node's state downloads (join, "
                                       "catch-up); phi is always exact. bf16: a quarter fewer bytes, phi then "
                                       "agrees with the swarm's to bf16 rounding, not bit for bit")
    standing_members: bool = setting(True, shared=False,
                                     help="a merged round's member list stands for the fragment's next round "
                                          "while this node's view of the swarm is unchanged: that round skips "
                                          "the DHT matchmaking (false: every round matchmakes)")

    def longest_round_s(self) -> float:
        """:func:`longest_round_s` of these settings."""
        return longest_round_s(self.matchmaking_timeout, self.round_timeout)


#: Robust aggregators (``locoswarm.node.core.robust``), declared here once: the schema is their single home.
AGGREGATORS: tuple[str, ...] = ("clipped_mean", "trimmed_mean", "median", "mean")


@dataclass
class RobustSection:
    """How reducers screen and combine contributions, and how this node polices peers."""

    aggregator: str = setting("clipped_mean", shared=True, choices=AGGREGATORS,
                              help="how a reducer combines screened contributions: clipped_mean (mean of deviations "
                                   "from the group's centre, each clipped), trimmed_mean, median (coordinate-wise) "
                                   "or mean (no clipping)")
    clip_factor: float = setting(2.0, shared=True, min=1.0, max=1e6,
                                 help="clipped_mean: a contribution's deviation from the group's centre (the "
                                      "coordinate-wise median) is clipped to this many times the median deviation")
    reject_factor: float = setting(8.0, shared=True, min=1.0, max=1e6,
                                   help="a contribution whose norm exceeds this many times the group's median is "
                                        "refused (dropped from the round, counted as an offence)")
    weight_factor: float = setting(1.0, shared=True, min=1.0, max=1e6,
                                   help="a token weight enters with at most this many times the group's median "
                                        "weight: a larger claim buys no more pull")
    agreement_floor: float = setting(-0.1, shared=True, min=-1.0, max=1.0,
                                     help="a contribution whose direction agrees with the group's (cosine with the "
                                          "others' median or the reducer's own) at or below this has no pull")
    agreement_full: float = setting(0.1, shared=True, min=-1.0, max=1.0,
                                    help="... and full pull from this agreement on (linear in between)")
    persistence_clip: bool = setting(True, shared=True,
                                     help="clipped_mean: a member whose deviation from the group's centre points the "
                                          "same way round after round (a drift) gets a clip radius smaller by the "
                                          "cosine of its deviation with its remembered ones")
    drift_ceiling: float = setting(1.0, shared=True, min=0.0, max=1.0,
                                   help="a sender whose standing drift (persistence of its difference from the "
                                        "reducer's own) is above this has no pull whatever the senders' median, and "
                                        "one muted round after round shares no group with the reducer and serves it "
                                        "no state; 1 is off (experimental, see docs/security.md)")
    trim_fraction: float = setting(0.25, shared=True, min=0.0, max=0.5,
                                   help="trimmed_mean: share of members dropped from each side per coordinate")
    consensus_tolerance: float = setting(0.1, shared=True, min=0.0, max=1.0,
                                         help="rounds averaging phi itself: deviations below this share of |phi| "
                                              "are normal drift, never clipped or refused (a pair refuses a phi "
                                              "reject_factor times further: 80% of |phi| by default)")
    agreement_ban: float = setting(-0.1, shared=False, min=-1.0, max=1.0,
                                   help="a peer whose mean agreement over its last agreement_window judged "
                                        "contributions is below this is banned (a direction flip, not bad luck)")
    agreement_window: int = setting(4, shared=False, min=1, max=1000,
                                    help="judged contributions the agreement ban averages over")
    effect_check: bool = setting(True, shared=False,
                                 help="before applying a round's average, compare its effect on a held-out batch "
                                      "with this node's own contribution's; refuse it when it is worse")
    effect_tolerance: float = setting(1.0, shared=False, min=0.0, max=10.0,
                                      help="a round's average may raise the held-out loss by this share over the "
                                           "worse of this node's phi and its own contribution's step before "
                                           "it is refused")
    health_slack: float = setting(0.0, shared=False, min=0.0, max=10.0,
                                  help="above 0: a round's average that does worse than this node's phi is also "
                                       "refused where its held-out loss is more than this share of "
                                       "effect_tolerance above the lowest loss of any phi this node held on that "
                                       "batch (bounds the sum of rounds each within the tolerance; the robustness "
                                       "bench runs 0.1); past half of it, the round also alarms the transport: for "
                                       "60 s a peer whose difference from this node's own progress persists above "
                                       "0.75 has no pull here, and one muted round after round is kept out of this "
                                       "node's rounds; 0 turns both off")
    judge_sequences: int = setting(4, shared=False, min=1, max=4096,
                                   help="held-out sequences of the effect check's batch (one forward pass each "
                                        "for the average, the own contribution and phi)")
    ban_threshold: int = setting(3, shared=False, min=1, max=1_000_000,
                                 help="offences within ban_window before this node bans a peer")
    ban_window: float = setting(600.0, shared=False, min=1.0, max=1e7,
                                help="seconds an offence counts towards a ban")
    ban_seconds: float = setting(600.0, shared=False, min=1.0, max=1e7,
                                 help="first cool-down of a banned peer (doubles for a repeat offender)")
    max_streams_per_peer: int = setting(8, shared=False, min=1, max=10_000,
                                        help="concurrent incoming streams one peer may hold open")
    state_requests_per_minute: int = setting(60, shared=False, min=1, max=1_000_000,
                                             help="state downloads (fragment requests) served to one peer per minute")
    state_serve_mbit: float = setting(100.0, shared=False, min=0.01, max=1e6,
                                      help="megabits per second this node serves state downloads at, over all of "
                                           "them (members that train first, then joiners)")


@dataclass
class SwarmConfig:
    swarm: SwarmSection = field(default_factory=SwarmSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    inner: InnerSection = field(default_factory=InnerSection)
    outer: OuterSection = field(default_factory=OuterSection)
    network: NetworkSection = field(default_factory=NetworkSection)
    robust: RobustSection = field(default_factory=RobustSection)


SECTIONS: dict[str, type] = {
    "swarm": SwarmSection, "model": ModelSection, "data": DataSection,
    "inner": InnerSection, "outer": OuterSection, "network": NetworkSection, "robust": RobustSection,
}

# ---- loading, validation and fingerprint below (owned by the config module) ----

#: Bumped whenever the meaning of the fingerprinted settings changes (not when a value changes).
# 2: payload chunking by size (core.payload), centred clipping, direction screening; 3: reducers' parts turn each round
FINGERPRINT_FORMAT = 3

_INIT_HINT = "create one with 'locoswarm config --init > peers.toml'"
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_NAME_MAX = 64
_INT64_MAX = 2**63 - 1
_TYPE_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "list[str]": "a list of strings"}
# Examples for type errors where the default is not a helpful one.
_EXAMPLES = {"swarm.bootstrap": '["/ip4/1.2.3.4/tcp/31337/p2p/QmPeerId"]',
             "model.tokenizer": '"bytes"'}
# Cross-field rules, shown in --init next to the key they constrain.
_NOTES = {
    "swarm.name": f"1-{_NAME_MAX} characters of A-Z a-z 0-9 . _ -",
    "swarm.bootstrap": "each entry a multiaddr starting with '/' and containing '/p2p/'",
    "model.d_model": "must be divisible by n_heads when both are set",
    "model.tokenizer": '"bytes" or an existing directory',
    "inner.seq_len": "at most model.max_seq_len",
    "outer.method": "replace needs tau = 0; eager and delay need tau = h",
    "outer.tau": "at most h; 0 for method = replace; equal to h for method = eager or delay",
    "outer.fragments": "at most h when schedule = fixed (offsets must be distinct)",
    "outer.sends_per_h": "at most h",
    "outer.lowrank_rank": "between lowrank_min_rank and lowrank_max_rank",
    "robust.reject_factor": "at least clip_factor",
}


# ---- schema helpers ----

def iter_settings() -> Iterator[tuple[str, str, dataclasses.Field]]:
    """All settings as ``(section, key, field)``, in schema order."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f.name, f


def _fields(section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def _kind(f: dataclasses.Field) -> str:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    kind = kind.replace(" ", "")
    if kind not in _TYPE_WORDS:
        raise TypeError(f"unsupported setting type {f.type!r} for {f.name}")
    return kind


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


# ---- rendering ----

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v: Any) -> str:
    """``v`` as a TOML value (also used to show values in error messages)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest round-trip form; inf/nan spell the same in TOML
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, _dt.date | _dt.time):
        return v.isoformat()
    return repr(v)


def _toml_key(k: Any) -> str:
    k = str(k)
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_str(k)


def _type_word(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    for types, word in ((str, "string"), (int, "integer"), (float, "float"), (list, "array"),
                        (dict, "table"), (_dt.date | _dt.time, "date/time")):
        if isinstance(v, types):
            return word
    return type(v).__name__


def _one_line(msg: str) -> str:
    return " ".join(part.strip() for part in str(msg).splitlines() if part.strip())


def _fail(msg: str) -> ConfigError:
    return ConfigError(_one_line(msg))


class _Where:
    """Names a setting the way its source spells it: ``[outer] h`` in a file, ``outer.h`` for --set."""

    def __init__(self, source: str):
        self.source = source
        self.dotted = source == "--set"

    def key(self, section: str, key: str) -> str:
        return f"{section}.{key}" if self.dotted else f"[{section}] {key}"

    def assign(self, section: str, key: str, value: Any) -> str:
        return f"{self.key(section, key)} = {_toml_value(value)}"


def _did_you_mean(word: str, options: Sequence[str], fmt: Callable[[str], str] = str) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f"did you mean {fmt(close[0])}? " if close else ""


# ---- per-field validation ----

def _check_value(section: str, key: str, value: Any, where: _Where) -> Any:
    """Type- and range-check one value; returns it normalized (floats as float, lists copied)."""
    f = _fields(section)[key]
    kind = _kind(f)
    meta = f.metadata
    src, shown = where.source, where.assign(section, key, value)
    example = _EXAMPLES.get(f"{section}.{key}")
    if example is None:
        default = _default(f)
        example = _toml_value(default if default != [] else ["..."])

    example = f"{section}.{key}={example}" if where.dotted else f"{key} = {example}"

    def type_error() -> ConfigError:
        return _fail(f"{src}: {shown} has the wrong type ({_type_word(value)}); expected "
                     f"{_TYPE_WORDS[kind]}, e.g. {example}")

    if kind == "bool":
        if not isinstance(value, bool):
            raise type_error()
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise type_error()
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise type_error()
        if isinstance(value, float) and not math.isfinite(value):
            raise _fail(f"{src}: {shown} is not a finite number; give a plain number, e.g. {example}")
        value = float(value) + 0.0  # int -> float, -0.0 -> 0.0
    elif kind == "str":
        if not isinstance(value, str):
            raise type_error()
    elif kind == "list[str]":
        if not isinstance(value, list | tuple) or not all(isinstance(x, str) for x in value):
            raise type_error()
        value = list(value)

    choices = meta.get("choices")
    if choices is not None and value not in choices:
        options = ", ".join(_toml_value(c) for c in choices)
        hint = _did_you_mean(value, choices, _toml_value) if isinstance(value, str) else ""
        raise _fail(f"{src}: {shown} is not allowed; {hint}choose one of {options}")

    if kind in ("int", "float"):
        lo, hi, excl = meta.get("min"), meta.get("max"), meta.get("min_exclusive")
        if kind == "int" and hi is None:
            hi = _INT64_MAX
        below = lo is not None and (value <= lo if excl else value < lo)
        above = hi is not None and value > hi
        if below or above:
            raise _fail(f"{src}: {shown} is out of range; allowed: {_range(key, f, hi)}")
    return value


def _range(key: str, f: dataclasses.Field, hi: float | None = None) -> str:
    """``1 <= h <= 100000``, ``lr > 0.0``, ``seed >= 0``: the allowed range of a number setting."""
    meta = f.metadata
    cast = int if _kind(f) == "int" else float
    lo, excl = meta.get("min"), meta.get("min_exclusive")
    hi = meta.get("max") if hi is None else hi
    if lo is not None and hi is not None:
        return f"{_toml_value(cast(lo))} {'<' if excl else '<='} {key} <= {_toml_value(cast(hi))}"
    if lo is not None:
        return f"{key} {'>' if excl else '>='} {_toml_value(cast(lo))}"
    if hi is not None:
        return f"{key} <= {_toml_value(cast(hi))}"
    return f"any {key}"


# ---- building a config from parsed TOML ----

def _locate_key(key: str) -> list[str]:
    return [section for section, name, _ in iter_settings() if name == key]


def _unknown_section(name: str, value: Any, where: _Where) -> ConfigError:
    src = where.source
    known = ", ".join(f"[{s}]" for s in SECTIONS)
    homes = _locate_key(name)
    if homes and not isinstance(value, dict):
        return _fail(f"{src}: {name} = {_toml_value(value)} is outside any section; move it under "
                     f"[{homes[0]}] (known sections: {known})")
    hint = _did_you_mean(name, list(SECTIONS), lambda s: f"[{s}]")
    return _fail(f"{src}: unknown section [{name}]; {hint}known sections: {known}")


def _unknown_key(section: str, key: str, value: Any, where: _Where) -> ConfigError:
    known = list(_fields(section))
    hint = _did_you_mean(key, known, lambda k: f'"{k}"')
    homes = [s for s in _locate_key(key) if s != section]
    if homes:
        hint = f"{key} belongs in [{homes[0]}]; "
    return _fail(f"{where.source}: {where.assign(section, key, value)} is not a known setting; "
                 f"{hint}known keys of [{section}]: {', '.join(known)}")


def _build(data: Any, source: str) -> SwarmConfig:
    """Sections from a parsed TOML document, each value checked; no cross-field rules."""
    where = _Where(source)
    if not isinstance(data, dict):
        raise _fail(f"{source}: expected a TOML document with sections, got {_type_word(data)}")
    sections: dict[str, Any] = {}
    for name, table in data.items():
        if name not in SECTIONS:
            raise _unknown_section(str(name), table, where)
        if not isinstance(table, dict):
            raise _fail(f"{source}: {name} = {_toml_value(table)} is not a section; write it as a table "
                        f"[{name}] with key = value lines under it")
        fields = _fields(name)
        values = {}
        for key, value in table.items():
            if key not in fields:
                raise _unknown_key(name, str(key), value, where)
            values[key] = _check_value(name, key, value, where)
        sections[name] = SECTIONS[name](**values)
    return SwarmConfig(**sections)


def config_from_dict(data: dict, source: str = "peers.toml") -> SwarmConfig:
    """A validated :class:`SwarmConfig` from a parsed descriptor; missing keys take defaults."""
    cfg = _build(data, source)
    validate(cfg, source)
    return cfg


# ---- cross-field validation ----

def _check_all(cfg: SwarmConfig, source_of: Callable[[Sequence[str]], str]) -> None:
    """Every per-field and cross-field rule; ``source_of(keys)`` names the source to blame."""

    def where(*keys: str) -> _Where:
        return _Where(source_of(keys))

    for section, key, _ in iter_settings():
        _check_value(section, key, getattr(getattr(cfg, section), key), where(f"{section}.{key}"))

    s, m, i, o = cfg.swarm, cfg.model, cfg.inner, cfg.outer

    w = where("swarm.name")
    if not s.name:
        raise _fail(f"{w.source}: {w.assign('swarm', 'name', s.name)} is empty; give the swarm a name, "
                    f'e.g. name = "my-swarm"')
    if len(s.name) > _NAME_MAX:
        raise _fail(f"{w.source}: {w.assign('swarm', 'name', s.name)} is {len(s.name)} characters long; "
                    f"use at most {_NAME_MAX}")
    if not _NAME_RE.fullmatch(s.name):
        bad = "".join(sorted({c for c in s.name if not _NAME_RE.fullmatch(c)}))
        raise _fail(f"{w.source}: {w.assign('swarm', 'name', s.name)} contains {_toml_value(bad)}; use only "
                    f"letters, digits, '.', '_' and '-'")

    w = where("swarm.owner_key")
    if s.owner_key:
        # lazy: swarm.admission loads cryptography (~15 ms at every CLI start, measured)
        from locoswarm.node.swarm.admission import AdmissionError, load_public_key

        try:
            load_public_key(s.owner_key)
        except AdmissionError as exc:
            raise _fail(f"{w.source}: {w.key('swarm', 'owner_key')}: {exc}") from None
        if not s.certificate:
            raise _fail(f"{w.source}: a closed swarm ({w.key('swarm', 'owner_key')} is set) needs this node's "
                        f"certificate: set [swarm] certificate = \"FILE\" (locoswarm admit sign makes one)")
        if not os.path.isfile(s.certificate):
            raise _fail(f"{where('swarm.certificate').source}: {w.assign('swarm', 'certificate', s.certificate)} "
                        f"is not a file; use the path of the certificate 'locoswarm admit sign' wrote")

    w = where("swarm.bootstrap")
    for addr in s.bootstrap:
        if not (addr.startswith("/") and "/p2p/" in addr):
            raise _fail(f"{w.source}: {w.key('swarm', 'bootstrap')} entry {_toml_value(addr)} is not a "
                        f"multiaddr with a peer id; write it like /ip4/1.2.3.4/tcp/31337/p2p/QmPeerId "
                        f"(the address a running peer prints)")

    w = where("model.tokenizer")
    if m.tokenizer != "bytes" and not os.path.isdir(m.tokenizer):
        raise _fail(f"{w.source}: {w.assign('model', 'tokenizer', m.tokenizer)} is neither \"bytes\" nor an "
                    f"existing directory; use \"bytes\" or the path of a local tokenizer directory")

    w = where("model.d_model", "model.n_heads")
    if m.d_model > 0 and m.n_heads > 0 and m.d_model % m.n_heads:
        raise _fail(f"{w.source}: {w.assign('model', 'd_model', m.d_model)} is not divisible by "
                    f"{w.assign('model', 'n_heads', m.n_heads)}; pick n_heads that divides d_model "
                    f"(or 0 to use the preset's)")

    w = where("inner.seq_len", "model.max_seq_len")
    if i.seq_len > m.max_seq_len:
        raise _fail(f"{w.source}: {w.assign('inner', 'seq_len', i.seq_len)} is longer than "
                    f"{w.assign('model', 'max_seq_len', m.max_seq_len)}; set seq_len <= max_seq_len "
                    f"or raise max_seq_len")

    r = cfg.robust
    w = where("robust.agreement_floor", "robust.agreement_full")
    if r.agreement_full < r.agreement_floor:
        raise _fail(f"{w.source}: {w.assign('robust', 'agreement_full', r.agreement_full)} is below "
                    f"{w.assign('robust', 'agreement_floor', r.agreement_floor)}; full pull must start at or above "
                    f"the floor of no pull")

    w = where("outer.tau", "outer.h")
    if o.tau > o.h:
        raise _fail(f"{w.source}: {w.assign('outer', 'tau', o.tau)} is larger than "
                    f"{w.assign('outer', 'h', o.h)}; a sync overlaps at most h inner steps, set tau <= {o.h}")

    w = where("outer.method", "outer.tau", "outer.h")
    if o.method in ("eager", "delay") and o.tau != o.h:
        raise _fail(f"{w.source}: {w.assign('outer', 'method', o.method)} needs tau = h (got tau = {o.tau}, "
                    f"h = {o.h}); set tau = {o.h} or choose another method")
    if o.method == "replace" and o.tau != 0:
        raise _fail(f"{w.source}: {w.assign('outer', 'method', o.method)} needs tau = 0 (got tau = {o.tau}); "
                    f'set tau = 0, or to overlap syncs with training use method = "alpha", '
                    f'"compensate" or "rebase"')

    w = where("outer.fragments", "outer.h", "outer.schedule")
    if o.schedule == "fixed" and o.fragments > o.h:
        raise _fail(f"{w.source}: {w.assign('outer', 'fragments', o.fragments)} is larger than "
                    f"{w.assign('outer', 'h', o.h)} with schedule = \"fixed\"; the fragments' sync offsets "
                    f"within h steps must be distinct, so set fragments <= {o.h} or raise h")

    r = cfg.robust
    w = where("robust.reject_factor", "robust.clip_factor")
    if r.reject_factor < r.clip_factor:
        raise _fail(f"{w.source}: {w.assign('robust', 'reject_factor', r.reject_factor)} is smaller than "
                    f"{w.assign('robust', 'clip_factor', r.clip_factor)}; a contribution is refused only beyond "
                    f"what clipping would scale down, so set reject_factor >= {r.clip_factor:g}")

    w = where("outer.sends_per_h", "outer.h")
    if o.sends_per_h > o.h:
        raise _fail(f"{w.source}: {w.assign('outer', 'sends_per_h', o.sends_per_h)} is larger than "
                    f"{w.assign('outer', 'h', o.h)}; set sends_per_h <= {o.h} (0 = one send per fragment)")

    w = where("outer.lowrank_rank", "outer.lowrank_min_rank", "outer.lowrank_max_rank")
    if not o.lowrank_min_rank <= o.lowrank_rank <= o.lowrank_max_rank:
        raise _fail(f"{w.source}: {w.assign('outer', 'lowrank_rank', o.lowrank_rank)} is not between "
                    f"{w.assign('outer', 'lowrank_min_rank', o.lowrank_min_rank)} and "
                    f"{w.assign('outer', 'lowrank_max_rank', o.lowrank_max_rank)}; set lowrank_min_rank <= "
                    f"lowrank_rank <= lowrank_max_rank")

    w = where("outer.sparse_topk", "outer.sparse_chunk")
    if o.sparse_topk > o.sparse_chunk:
        raise _fail(f"{w.source}: {w.assign('outer', 'sparse_topk', o.sparse_topk)} is larger than "
                    f"{w.assign('outer', 'sparse_chunk', o.sparse_chunk)}; a chunk cannot send more entries "
                    f"than it holds, so set sparse_topk <= {o.sparse_chunk}")
    w = where("outer.codec", "outer.error_feedback")
    if o.codec == "sparseloco" and not o.error_feedback:
        raise _fail(f"{w.source}: {w.assign('outer', 'codec', o.codec)} needs "
                    f"{w.assign('outer', 'error_feedback', o.error_feedback)} to be true; the error-feedback "
                    f"residual is SparseLoCo's accumulator, so set error_feedback = true")


def validate(cfg: SwarmConfig, source: str = "peers.toml") -> None:
    """Check every field and the cross-field rules; raises :class:`ConfigError` (one line)."""
    _check_all(cfg, lambda keys: source)


# ---- loading ----

def _read_file(path: str | os.PathLike) -> tuple[dict, str]:
    source = os.fspath(path)
    if not os.path.exists(source):
        raise _fail(f"{source}: file does not exist; check the path, or {_INIT_HINT}")
    if os.path.isdir(source):
        raise _fail(f"{source}: is a directory, not a peers.toml file; pass the file, or {_INIT_HINT}")
    try:
        with open(source, "rb") as fh:
            data = tomllib.load(fh)
        if not data:  # an empty descriptor is a mistake (a wrong file, a failed copy), not a choice of defaults
            raise _fail(f"{source}: is empty (no settings); write at least [swarm] name = \"...\", or run without "
                        f"--config for the built-in defaults, or {_INIT_HINT}")
        return data, source
    except tomllib.TOMLDecodeError as exc:
        raise _fail(f"{source}: invalid TOML: {exc}; fix the syntax (see https://toml.io)") from None
    except UnicodeDecodeError:
        raise _fail(f"{source}: is not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise _fail(f"{source}: cannot be read ({exc.strerror or exc}); check the path and permissions") \
            from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` -> ``(section, key, value)``; the value is TOML, or a bare string."""
    where = _Where("--set")
    name, eq, raw = str(text).partition("=")
    name = name.strip()
    parts = name.split(".")
    if not eq or len(parts) != 2 or not all(parts):
        raise _fail(f"--set: {_toml_value(str(text))} is not SECTION.KEY=VALUE; write it like "
                    f"--set outer.h=20 or --set outer.codec=int8")
    section, key = parts
    if section not in SECTIONS:
        raise _unknown_section(section, None, where)
    if key not in _fields(section):
        raise _unknown_key(section, key, raw.strip(), where)
    raw = raw.strip()
    try:
        doc = tomllib.loads(f"v = {raw}")
        value = doc["v"] if list(doc) == ["v"] else raw
    except tomllib.TOMLDecodeError:
        value = raw
    if _kind(_fields(section)[key]) == "str" and not isinstance(value, str):
        value = raw  # --set swarm.name=2024 means the string "2024"
    return section, key, value


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> SwarmConfig:
    """Read and validate a descriptor (``None``: built-in defaults), then apply ``--set`` overrides."""
    data, source = ({}, "defaults") if path is None or os.fspath(path) == "" else _read_file(path)
    cfg = _build(data, source)
    overridden: set[str] = set()
    for text in overrides:
        section, key, value = parse_override(text)
        setattr(getattr(cfg, section), key, _check_value(section, key, value, _Where("--set")))
        overridden.add(f"{section}.{key}")
    _check_all(cfg, lambda keys: "--set" if overridden.intersection(keys) else source)
    return cfg


def named_settings(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> set[str]:
    """The ``section.key`` names a descriptor and ``--set`` overrides set explicitly (what a caller with defaults
    of its own, such as a benchmark profile, must leave as the user set them). Call after :func:`load_config`."""
    data = {} if path is None or os.fspath(path) == "" else _read_file(path)[0]
    named = {f"{section}.{key}" for section, values in data.items() if isinstance(values, dict) for key in values}
    for text in overrides:
        section, key, _ = parse_override(text)
        named.add(f"{section}.{key}")
    return named


# ---- output and fingerprint ----

def to_dict(cfg: SwarmConfig) -> dict:
    """``{section: {key: value}}`` of every setting (lists copied)."""
    out: dict[str, dict[str, Any]] = {}
    for section, key, _ in iter_settings():
        value = getattr(getattr(cfg, section), key)
        out.setdefault(section, {})[key] = list(value) if isinstance(value, list) else value
    return out


def to_toml(cfg: SwarmConfig) -> str:
    """The config as a TOML document; ``config_from_dict(tomllib.loads(to_toml(c))) == c``."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


def shared_settings(cfg: SwarmConfig) -> dict:
    """Only the settings peers must agree on (``shared=True``), as ``{section: {key: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    for section, key, f in iter_settings():
        if not f.metadata.get("shared"):
            continue
        value = getattr(getattr(cfg, section), key)
        if _kind(f) == "float" and not isinstance(value, bool):
            value = float(value) + 0.0  # 1 and 1.0 (and -0.0) are the same setting
        out.setdefault(section, {})[key] = list(value) if isinstance(value, list) else value
    return out


def fingerprint(cfg: SwarmConfig) -> str:
    """16 hex chars identifying the shared settings; peers with different fingerprints never mix."""
    doc = {"format": FINGERPRINT_FORMAT, "shared": shared_settings(cfg)}
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _plain(v: Any) -> str:
    return v if isinstance(v, str) else _toml_value(v)


def describe_difference(a: dict, b: dict) -> str:
    """One line naming each shared setting that differs, e.g. ``outer.codec: fp4 vs int8``."""
    missing = object()
    order = [(s, k) for s, k, _ in iter_settings()]
    extra = sorted({(s, k) for d in (a, b) for s, t in d.items() if isinstance(t, dict) for k in t}
                   - set(order))
    diffs = []
    for section, key in order + extra:
        va = (a.get(section) or {}).get(key, missing)
        vb = (b.get(section) or {}).get(key, missing)
        if va is missing and vb is missing:
            continue
        if va is missing or vb is missing or type(va) is not type(vb) or va != vb:
            sa = "(unset)" if va is missing else _plain(va)
            sb = "(unset)" if vb is missing else _plain(vb)
            diffs.append(f"{section}.{key}: {sa} vs {sb}")
    return "; ".join(diffs) if diffs else "no difference in shared settings"


def _allowed(section: str, key: str, f: dataclasses.Field) -> str:
    kind, meta = _kind(f), f.metadata
    if meta.get("choices"):
        text = "one of " + ", ".join(_toml_value(c) for c in meta["choices"])
    else:
        text = _TYPE_WORDS[kind].replace("a number", "a number (int or float)")
        if kind in ("int", "float") and (meta.get("min") is not None or meta.get("max") is not None):
            text += ", " + _range(key, f)
    note = _NOTES.get(f"{section}.{key}")
    return f"{text}; {note}" if note else text


_INIT_HEADER = """\
# locoswarm swarm descriptor (peers.toml).
# Every peer of a swarm reads the same file. Settings marked (shared) must be equal on all peers:
# they form the swarm fingerprint (`locoswarm config --fingerprint`), and peers with a different
# fingerprint are refused. Missing keys take the defaults shown here. Node-local settings (ports,
# data path, state dir, device) are CLI flags and environment variables, not part of this file.
# Check a file with `locoswarm config --config peers.toml`; override one key with --set outer.h=20.
"""


def render_init() -> str:
    """A fully commented peers.toml with every key at its default value."""
    lines = [_INIT_HEADER.rstrip("\n")]
    for section, cls in SECTIONS.items():
        lines += ["", f"[{section}]"]
        for f in dataclasses.fields(cls):
            shared = "shared" if f.metadata.get("shared") else "local"
            for comment in (str(f.metadata.get("help", "")), f"({shared}) {_allowed(section, f.name, f)}"):
                lines += textwrap.wrap(comment, width=100, initial_indent="# ", subsequent_indent="#   ",
                                       break_on_hyphens=False, break_long_words=False)
            lines.append(f"{f.name} = {_toml_value(_default(f))}")
    return "\n".join(lines) + "\n"
