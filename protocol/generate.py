"""Regenerate the checked-in Python code of every ``protocol/*.proto``: ``python -m locoswarm.protocol.generate``.

``--check`` exits 1 (naming the files) when the checked-in code differs from what protoc generates,
which is what the test suite runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(HERE.glob("*.proto"))
    base = ["protoc", f"-I{HERE}"]
    if protoc.main([*base, f"--python_out={out_dir}", f"--pyi_out={out_dir}", *map(str, protos)]) != 0:
        raise SystemExit("protoc failed")
    # gRPC stubs only for the protos that define a service (no empty *_pb2_grpc.py for the others)
    grpc_protos = [p for p in protos if "\nservice " in p.read_text()]
    if grpc_protos and protoc.main([*base, f"--grpc_python_out={out_dir}", *map(str, grpc_protos)]) != 0:
        raise SystemExit("protoc failed")
    generated = sorted(out_dir.glob("*_pb2*.py*"))
    for path in generated:  # generated grpc code imports siblings as top-level modules
        text = path.read_text()
        for proto in protos:
            mod = proto.stem + "_pb2"
            text = text.replace(f"\nimport {mod} as", f"\nfrom locoswarm.protocol import {mod} as")
        path.write_text(text)
    return generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the checked-in code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        stale = [f.name for f in files if not (HERE / f.name).exists()
                 or (HERE / f.name).read_text() != f.read_text()]
        if args.check:
            if stale:
                print(f"stale generated protocol code: {', '.join(stale)}; run python -m locoswarm.protocol.generate",
                      file=sys.stderr)
                return 1
            return 0
        for f in files:
            (HERE / f.name).write_text(f.read_text())
            print(f"wrote protocol/{f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
