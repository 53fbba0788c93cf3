"""``locoswarm bench memory`` runs real nodes and reports their own memory (the numbers are the benchmark's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from swarm_util import REPO, run_bench, write_config, write_corpus
from test_adversarial import _cmdline_has


def _bench(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "locoswarm.node.cli", "bench", "memory", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(400)
def test_bench_memory_measures_two_real_nodes_and_writes_json_markdown_and_png(tmp_path: Path) -> None:
    out = tmp_path / "report"
    config = write_config(tmp_path / "peers.toml")
    data = write_corpus(tmp_path / "data")
    run_bench(["memory", "--out", str(out), "--presets", "tiny", "--offload", "off,cpu", "--rounds", "1", "--timeout",
               "150", "--config", str(config), "--device", "cpu", "--data", str(data)], tmp_path, 360)
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["configurations"]) == ["tiny offload=off", "tiny offload=cpu"]
    for r in doc["configurations"].values():
        assert r["error"] is None and len(r["nodes"]) == 2, r
        assert r["params"] > 0 and r["predicted_device_gib"] > 0
        for node in r["nodes"]:
            # Each node's own process: torch and the model take tens of MB; this machine has no accelerator.
            assert 30 < node["rss_mb"] <= node["peak_rss_mb"] < 20_000, node
            assert node["device"] == "cpu" and node["device_peak_mb"] is None, node
            assert node["rounds"] >= 1 and node["inner_steps"] > 0, node
            # Its processes: the node first, its lean watchdog, the DHT child and p2pd (no torch_shm_manager).
            names = [p["name"] for p in node["processes"]]
            assert names[0] == "python" and "locoswarm-watch" in names and "p2pd" in names, names
            assert "torch_shm_manag" not in names, names
            watchdog = next(p for p in node["processes"] if p["name"] == "locoswarm-watch")
            assert watchdog["uss_mb"] < 30, watchdog  # a fresh interpreter, no torch: about 6 MB
            assert node["total_pss_mb"] == pytest.approx(sum(p["pss_mb"] for p in node["processes"]), abs=0.5)
    # The outer state on the device (off) is predicted to cost memory that offloading saves.
    runs = doc["configurations"]
    assert runs["tiny offload=off"]["predicted_device_gib"] > runs["tiny offload=cpu"]["predicted_device_gib"]
    table = (out / "report.md").read_text()
    assert "| tiny offload=off |" in table and "memory.png" in table
    assert "| tiny offload=off | locoswarm-watch |" in table and "**total PSS**" in table
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((out / "logs").glob("*/node*.log"))) == 4
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, str(tmp_path))]
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not list(tmp_path.glob("locoswarm-memory-*")), "the benchmark left its scratch swarm behind"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "needle"), [
    (["--presets", "huge"], "--presets 'huge' is not allowed"),
    (["--offload", "gpu"], "--offload 'gpu' is not allowed"),
    (["--nodes", "1"], "--nodes 1 is not allowed"),
    (["--rounds", "0"], "--rounds 0 is not allowed"),
    (["--config", "/nonexistent/peers.toml"], "--config /nonexistent/peers.toml: cannot read it"),
])
def test_bench_memory_refuses_bad_input_in_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    res = _bench("--out", str(tmp_path / "out"), *args)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("locoswarm: error: ")]
    assert len(errors) == 1 and needle in errors[0], out
    assert not (tmp_path / "out").exists(), "a refused run started"
