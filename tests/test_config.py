"""The swarm descriptor: strict validation, messages, round trip, fingerprint, ``locoswarm config``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from locoswarm.node.config import (
    SECTIONS,
    SwarmConfig,
    config_from_dict,
    describe_difference,
    fingerprint,
    iter_settings,
    load_config,
    render_init,
    shared_settings,
    to_dict,
    to_toml,
    validate,
)
from locoswarm.node.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]


def error_of(data: dict | None = None, overrides: tuple[str, ...] = (), path=None) -> str:
    with pytest.raises(ConfigError) as exc:
        if data is not None:
            config_from_dict(data)
        else:
            load_config(path, overrides)
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def write(tmp_path: Path, text: str, name: str = "peers.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return p


# ---- loading ----

def test_defaults_and_example_file():
    assert load_config(None) == SwarmConfig()
    assert load_config("") == SwarmConfig()
    assert load_config(REPO / "peers.toml") == SwarmConfig()


def test_file_and_overrides(tmp_path):
    p = write(tmp_path, """
        [outer]
        h = 20
        codec = "int8"
        [swarm]
        name = "my.swarm_1"
        """)
    cfg = load_config(p, ["outer.fragments=4", "outer.codec=bf16", 'outer.method="alpha"',
                          'swarm.bootstrap=["/ip4/1.2.3.4/tcp/31337/p2p/QmPeer"]', "inner.lr=1",
                          "outer.error_feedback=false", "swarm.name=2024"])
    assert (cfg.outer.h, cfg.outer.fragments, cfg.outer.codec, cfg.outer.method) == (20, 4, "bf16", "alpha")
    assert cfg.swarm.bootstrap == ["/ip4/1.2.3.4/tcp/31337/p2p/QmPeer"]
    assert cfg.inner.lr == 1.0 and isinstance(cfg.inner.lr, float)
    assert cfg.outer.error_feedback is False
    assert cfg.swarm.name == "2024"  # a bare value for a string setting is the string
    assert cfg.model == SwarmConfig().model  # missing keys take defaults


def test_override_fixes_file_cross_field(tmp_path):
    p = write(tmp_path, "[outer]\ntau = 60\n")
    assert "[outer] tau = 60" in error_of(path=p)
    assert load_config(p, ["outer.h=100"]).outer.tau == 60


def test_init_output_loads_to_defaults(tmp_path):
    text = render_init()
    assert config_from_dict(tomllib.loads(text)) == SwarmConfig()
    for section, key, f in iter_settings():
        assert f"{key} = " in text and f.metadata["help"][:20] in text.replace("\n#   ", " ")
        assert f"[{section}]" in text
    assert '"fp32", "bf16", "int8", "fp4"' in text and "1 <= h <= 100000" in text


# ---- messages ----

@pytest.mark.parametrize("data, parts", [
    ({"outr": {"h": 1}}, ["peers.toml:", "[outr]", "did you mean [outer]", "[network]"]),
    ({"outer": {"codex": "fp4"}}, ["peers.toml:", '[outer] codex = "fp4"', 'did you mean "codec"',
                                   "known keys of [outer]", "sends_per_h"]),
    ({"inner": {"h": 5}}, ["[inner] h = 5", "belongs in [outer]"]),
    ({"h": 5}, ["h = 5", "outside any section", "[outer]"]),
    ({"outer": 5}, ["outer = 5", "not a section"]),
    ({"outer": {"h": True}}, ["[outer] h = true", "wrong type (boolean)", "integer", "h = 50"]),
    ({"outer": {"h": "20"}}, ['[outer] h = "20"', "wrong type (string)", "integer"]),
    ({"outer": {"h": 2.5}}, ["[outer] h = 2.5", "wrong type (float)", "integer"]),
    ({"outer": {"lr": True}}, ["[outer] lr = true", "wrong type (boolean)", "number"]),
    ({"outer": {"lr": "0.7"}}, ['[outer] lr = "0.7"', "number"]),
    ({"outer": {"error_feedback": 1}}, ["[outer] error_feedback = 1", "true or false"]),
    ({"swarm": {"name": 5}}, ["[swarm] name = 5", "string"]),
    ({"swarm": {"bootstrap": "/ip4/x/p2p/y"}}, ["[swarm] bootstrap", "list of strings", "/p2p/"]),
    ({"data": {"extensions": [".txt", 3]}}, ['[data] extensions = [".txt", 3]', "list of strings"]),
    ({"data": {"eval_fraction": float("nan")}}, ["[data] eval_fraction = nan", "finite"]),
    ({"outer": {"h": 0}}, ["[outer] h = 0", "out of range", "1 <= h <= 100000"]),
    ({"outer": {"h": 100001}}, ["[outer] h = 100001", "1 <= h <= 100000"]),
    ({"outer": {"lr": 0.0}}, ["[outer] lr = 0.0", "0.0 < lr <= 10.0"]),
    ({"data": {"eval_fraction": 0}}, ["[data] eval_fraction = 0", "0.0 < eval_fraction <= 0.5"]),
    ({"data": {"seed": -1}}, ["[data] seed = -1", "0 <= seed"]),
    ({"outer": {"codec": "fp5"}}, ['peers.toml: [outer] codec = "fp5" is not allowed',
                                   'choose one of "fp32", "bf16", "int8", "fp4"']),
    ({"model": {"preset": "huge"}}, ['[model] preset = "huge"', '"tiny", "small", "125m"']),
    # cross-field rules
    ({"outer": {"tau": 51}}, ["[outer] tau = 51", "[outer] h = 50", "tau <= 50"]),
    ({"outer": {"method": "eager"}}, ['[outer] method = "eager"', "tau = h", "tau = 50"]),
    ({"outer": {"method": "delay"}}, ['[outer] method = "delay"', "tau = h", "tau = 50"]),
    ({"outer": {"method": "replace"}}, ['[outer] method = "replace"', "tau = 0", '"alpha"', '"compensate"',
                                        '"rebase"']),
    ({"outer": {"fragments": 51, "tau": 0}}, ["[outer] fragments = 51", "schedule", "distinct",
                                              "fragments <= 50"]),
    ({"outer": {"sends_per_h": 51, "schedule": "adaptive"}}, ["[outer] sends_per_h = 51",
                                                              "sends_per_h <= 50"]),
    ({"model": {"tokenizer": "no/such/dir"}}, ['[model] tokenizer = "no/such/dir"', '"bytes"', "directory"]),
    ({"swarm": {"name": ""}}, ['[swarm] name = ""', "empty"]),
    ({"swarm": {"name": "my swarm"}}, ['[swarm] name = "my swarm"', "letters, digits"]),
    ({"swarm": {"name": "x" * 65}}, ["[swarm] name", "at most 64"]),
    ({"swarm": {"bootstrap": ["/ip4/1.2.3.4/tcp/31337"]}}, ['"/ip4/1.2.3.4/tcp/31337"', "multiaddr",
                                                            "/p2p/"]),
    ({"swarm": {"bootstrap": ["1.2.3.4/p2p/Qm"]}}, ['"1.2.3.4/p2p/Qm"', "multiaddr"]),
    ({"model": {"d_model": 100, "n_heads": 3}}, ["[model] d_model = 100", "n_heads = 3", "divid"]),
    ({"inner": {"seq_len": 2048}}, ["[inner] seq_len = 2048", "max_seq_len = 1024"]),
])
def test_bad_config_messages(data, parts):
    msg = error_of(data)
    assert msg.startswith("peers.toml: "), msg
    for part in parts:
        assert part in msg, (part, msg)


@pytest.mark.parametrize("data", [
    {"outer": {"fragments": 51, "tau": 0, "schedule": "adaptive"}},  # fragments > h ok when adaptive
    {"outer": {"method": "eager", "tau": 50}},
    {"outer": {"method": "delay", "tau": 50}},
    {"outer": {"method": "replace", "tau": 0}},
    {"outer": {"tau": 50}},
    {"outer": {"lr": 1}},  # int for float
    {"model": {"d_model": 96, "n_heads": 3}},
    {"model": {"d_model": 100}},  # n_heads from preset: not checked here
    {"swarm": {"name": "a" * 64, "bootstrap": ["/ip4/1.2.3.4/tcp/31337/p2p/QmPeer"]}},
])
def test_good_edge_cases(data):
    config_from_dict(data)


def test_tokenizer_directory(tmp_path):
    assert config_from_dict({"model": {"tokenizer": str(tmp_path)}}).model.tokenizer == str(tmp_path)


def test_validate_checks_constructed_configs():
    cfg = SwarmConfig()
    cfg.outer.h = 0
    with pytest.raises(ConfigError, match=r"^x\.toml: \[outer\] h = 0 is out of range"):
        validate(cfg, "x.toml")
    cfg = SwarmConfig()
    cfg.outer.tau = 99
    with pytest.raises(ConfigError, match="tau = 99"):
        validate(cfg)


def test_bad_toml(tmp_path):
    p = write(tmp_path, "[outer\nh = 1\n")
    msg = error_of(path=p)
    assert msg.startswith(f"{p}: invalid TOML: ") and "line 1" in msg


def test_missing_file(tmp_path):
    p = tmp_path / "nope.toml"
    msg = error_of(path=p)
    assert msg.startswith(f"{p}: file does not exist") and "locoswarm config --init > peers.toml" in msg
    assert error_of(path=tmp_path).startswith(f"{tmp_path}: is a directory")


def test_file_errors_name_the_file(tmp_path):
    p = write(tmp_path, '[outer]\ncodec = "fp5"\n', name="swarm.toml")
    assert error_of(path=p).startswith(f'{p}: [outer] codec = "fp5" is not allowed')


@pytest.mark.parametrize("override, parts", [
    ("outerh=20", ['--set: "outerh=20" is not SECTION.KEY=VALUE', "outer.h=20"]),
    ("outer.h", ['"outer.h" is not SECTION.KEY=VALUE']),
    ("outer.h.x=1", ["not SECTION.KEY=VALUE"]),
    (".h=1", ["not SECTION.KEY=VALUE"]),
    ("outr.h=1", ["--set: unknown section [outr]", "did you mean [outer]"]),
    ("outer.hh=1", ["--set: outer.hh", "not a known setting", 'did you mean "h"']),
    ("outer.h=abc", ['--set: outer.h = "abc"', "integer", "outer.h=50"]),
    ("outer.h=true", ["--set: outer.h = true", "wrong type (boolean)"]),
    ("outer.h=0", ["--set: outer.h = 0 is out of range", "1 <= h <= 100000"]),
    ("outer.codec=fp5", ['--set: outer.codec = "fp5" is not allowed', '"int8"']),
    ("outer.tau=51", ["--set: outer.tau = 51 is larger than outer.h = 50"]),
    ("outer.h=20\nouter.tau=1", ["--set: outer.h = ", "\\n", "integer"]),
    ("swarm.bootstrap=/ip4/x", ["--set: swarm.bootstrap", "list of strings"]),
])
def test_bad_overrides(override, parts):
    msg = error_of(overrides=(override,))
    assert msg.startswith("--set: "), msg
    for part in parts:
        assert part in msg, (part, msg)


def test_errors_are_user_errors():
    assert issubclass(ConfigError, UserError) and ConfigError.exit_code == 2


# ---- round trip, shared settings, fingerprint ----

def test_toml_round_trip(tmp_path):
    cfg = config_from_dict({
        "swarm": {"name": "rt-1", "bootstrap": ['/ip4/1.2.3.4/tcp/1/p2p/Qm"\\x', "/dns/a.b/p2p/Qm\u00e9"]},
        "model": {"arch": "gpt2", "d_model": 96, "n_heads": 3, "tokenizer": str(tmp_path)},
        "data": {"extensions": [], "text_field": "t\tx\u007f", "eval_fraction": 1e-5, "seed": 2**62},
        "inner": {"lr": 3e-4, "grad_clip": 0},
        "outer": {"method": "eager", "h": 7, "tau": 7, "codec": "int8", "error_feedback": False},
    })
    assert config_from_dict(tomllib.loads(to_toml(cfg))) == cfg
    assert config_from_dict(tomllib.loads(to_toml(SwarmConfig()))) == SwarmConfig()
    assert config_from_dict(to_dict(cfg)) == cfg


def test_shared_settings_are_exactly_the_shared_fields():
    shared = shared_settings(SwarmConfig())
    expected = {(s, k) for s, k, f in iter_settings() if f.metadata["shared"]}
    assert {(s, k) for s, t in shared.items() for k in t} == expected
    assert set(to_dict(SwarmConfig())) == set(SECTIONS)


def _candidates(section: str, key: str, f: dataclasses.Field, value, tmp_path: Path) -> list:
    special = {"swarm.name": ["other-swarm"], "model.tokenizer": [str(tmp_path)],
               "swarm.bootstrap": [["/ip4/1.2.3.4/tcp/31337/p2p/QmPeer"]], "data.extensions": [[".txt"]]}
    if f"{section}.{key}" == "swarm.owner_key":
        from locoswarm.node.swarm.admission import new_owner_key

        return [new_owner_key()[1]]
    if f"{section}.{key}" in special:
        return special[f"{section}.{key}"]
    if f.metadata["choices"]:
        return [c for c in f.metadata["choices"] if c != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1, value * 2]
    if isinstance(value, float):
        return [value / 2 if value else 0.5, value + 0.1, value - 0.1]
    if isinstance(value, str):
        return [value + "x"]
    raise AssertionError(f"no candidate values for {section}.{key}; extend _candidates")


def _variants(tmp_path: Path, shared: bool):
    found = []
    for section, key, f in iter_settings():
        if f.metadata["shared"] != shared:
            continue
        base = SwarmConfig()
        for candidate in _candidates(section, key, f, getattr(getattr(base, section), key), tmp_path):
            cfg = SwarmConfig()
            setattr(getattr(cfg, section), key, candidate)
            if (section, key) == ("swarm", "owner_key"):
                # a closed swarm needs a certificate file beside its key (its content is checked at start)
                cert = tmp_path / "member.cert"
                cert.write_text("{}")
                cfg.swarm.certificate = str(cert)
            try:
                validate(cfg)
            except ConfigError:
                continue
            found.append((f"{section}.{key}", cfg))
            break
        else:
            raise AssertionError(f"no valid alternative value for {section}.{key}")
    assert found
    return found


def test_fingerprint_format():
    fp = fingerprint(SwarmConfig())
    assert len(fp) == 16 and int(fp, 16) >= 0 and fp == fp.lower()
    assert fingerprint(SwarmConfig()) == fp


def test_fingerprint_changes_with_every_shared_setting(tmp_path):
    base = fingerprint(SwarmConfig())
    seen = {base}
    for name, cfg in _variants(tmp_path, shared=True):
        fp = fingerprint(cfg)
        assert fp != base, name
        seen.add(fp)
        assert describe_difference(shared_settings(SwarmConfig()), shared_settings(cfg)).startswith(name)
    assert len(seen) == 1 + sum(f.metadata["shared"] for _, _, f in iter_settings())


def test_fingerprint_ignores_local_settings(tmp_path):
    base = fingerprint(SwarmConfig())
    for name, cfg in _variants(tmp_path, shared=False):
        assert fingerprint(cfg) == base, name


def test_fingerprint_ignores_number_spelling():
    assert fingerprint(config_from_dict({"outer": {"lr": 1}})) == fingerprint(
        config_from_dict({"outer": {"lr": 1.0}}))


def test_fingerprint_stable_across_processes(tmp_path):
    p = write(tmp_path, '[outer]\ncodec = "int8"\nh = 20\n[model]\npreset = "small"\n')
    code = ("import sys; from locoswarm.node.config import fingerprint, load_config; "
            "print(fingerprint(load_config(sys.argv[1])))")
    out = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, env=env,
                             cwd=REPO, timeout=60)
        assert res.returncode == 0, res.stderr
        out.add(res.stdout.strip())
    assert out == {fingerprint(load_config(p))}


def test_describe_difference():
    a = shared_settings(SwarmConfig())
    b = shared_settings(config_from_dict({"outer": {"codec": "int8"}, "model": {"preset": "small"}}))
    assert describe_difference(a, b) == "model.preset: tiny vs small; outer.codec: fp4 vs int8"
    assert describe_difference(a, a) == "no difference in shared settings"
    del b["outer"]["codec"]
    assert "outer.codec: fp4 vs (unset)" in describe_difference(a, b)


# ---- the command ----

def run_cli(*args: str) -> subprocess.CompletedProcess:
    launcher = ["-m", "locoswarm.node.cli"]
    env = {k: v for k, v in os.environ.items() if k != "LOCOSWARM_CONFIG"}
    return subprocess.run([sys.executable, *launcher, *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)


@pytest.mark.parametrize("content, args", [
    ('[outer]\ncodec = "fp5"\n', ()),
    ("[outer\n", ()),
    (None, ()),
    ("", ()),
    ("# comments only\n", ()),
    ("[swarm]\n", ("--set", "outer.h=0")),
    ("[swarm]\n", ("--set", "outerh")),
])
def test_cli_errors(tmp_path, content, args):
    p = tmp_path / "bad.toml"
    if content is not None:
        p.write_text(content)
    res = run_cli("config", "--config", str(p), *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("locoswarm: error: "), res.stderr
    assert res.stdout == ""


def test_cli_config_outputs(tmp_path):
    p = write(tmp_path, "[outer]\nh = 20\n")
    res = run_cli("config", "--config", str(p), "--set", "outer.codec=int8")
    assert res.returncode == 0, res.stderr
    cfg = load_config(p, ["outer.codec=int8"])
    assert f"# swarm fingerprint: {fingerprint(cfg)}" in res.stdout
    assert config_from_dict(tomllib.loads(res.stdout)) == cfg

    res = run_cli("config", "--config", str(p), "--fingerprint")
    assert res.returncode == 0 and res.stdout == fingerprint(load_config(p)) + "\n"

    res = run_cli("config", "--init")
    assert res.returncode == 0 and res.stdout == render_init()
