"""``locoswarm bench codecs`` runs end to end and writes its report (tiny sizes: not a measurement)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from locoswarm.node.core.codecs import CODECS

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOSWARM_")}
    return subprocess.run([sys.executable, "-m", "locoswarm.node.cli", "bench", "codecs", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)


def test_bench_codecs_writes_every_codec_next_to_the_memory_pass(tmp_path: Path) -> None:
    r = cli("--out", str(tmp_path / "rep"), "--numel", "300001", "--repeats", "1", "--devices", "cpu")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "rep" / "results.json").read_text())
    cpu = report["results"]["cpu"]
    assert cpu["memory_pass_mb_s"] > 0 and cpu["copy_into_buffer_mb_s"] > 0
    assert set(cpu["codecs"]) == {*CODECS, "sparseloco"}
    for name, row in cpu["codecs"].items():
        assert row["encode_mb_s"] > 0 and row["decode_mb_s"] > 0
        assert abs(row["encode_ratio"] - row["encode_mb_s"] / cpu["memory_pass_mb_s"]) < 1e-9
        assert row["bits_per_element"] >= {"fp32": 32, "bf16": 16, "int8": 8, "fp4": 4, "sparseloco": 0.28}[name]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert all(f"| {name} |" in md for name in CODECS)
    assert (tmp_path / "rep" / "codecs.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_codecs_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    for args, word in ((["--devices", "tpu"], "tpu"), (["--numel", "0"], "--numel 0")):
        r = cli("--out", str(tmp_path / "rep"), *args)
        assert r.returncode != 0 and word in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
