"""Regenerate recpipe/v1/ from protos/recpipe/v1/*.proto (needs grpcio-tools).

    python protos/generate.py          # rewrite the generated modules
    python protos/generate.py --check  # exit 1 if they are stale (used by the tests)
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "recpipe" / "v1"
INIT = '"""Generated protobuf and gRPC modules. Never edit by hand: run `python protos/generate.py`."""\n'


def generate(dest: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc  # imported here: grpcio-tools is a dev dependency only

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "recpipe" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        dest.mkdir(parents=True, exist_ok=True)
        for f in (Path(tmp) / "recpipe" / "v1").iterdir():
            shutil.copy(f, dest / f.name)
    (dest / "__init__.py").write_text(INIT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if recpipe/v1 is stale")
    args = parser.parse_args(argv)
    if not args.check:
        for old in OUT.glob("*_pb2*.py*"):
            old.unlink()
        generate(OUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = sorted(p.name for p in Path(tmp).iterdir())
        current = sorted(p.name for p in OUT.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
        cmp = filecmp.cmpfiles(tmp, OUT, fresh, shallow=False)
        stale = cmp[1] + cmp[2] + sorted(set(current) - set(fresh))
        if stale:
            print(f"recpipe/v1 is stale ({', '.join(stale)}): run python protos/generate.py", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
