"""Per-stage micro-benchmarks, each printed beside its naive form (``recpipe bench NAME --help``).

Every module in ``recpipe/bench/`` is one benchmark: it exposes ``add_arguments(parser)`` and
``run(args) -> int`` and its docstring's first line is its help.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import recpipe.bench


def _benchmarks() -> dict[str, str]:
    return {m.name.replace("_", "-"): f"recpipe.bench.{m.name}" for m in pkgutil.iter_modules(recpipe.bench.__path__)
            if not m.name.startswith("_")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", parser_class=type(parser))
    for name, module_name in sorted(_benchmarks().items()):
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or "").strip()
        p = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc)
        module.add_arguments(p)
        p.add_argument("--nvtx", action="store_true",
                       help="NVTX ranges around each timed call (and each stage step) for nsys (CUDA only)")
        p.set_defaults(_bench=module)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_bench", None) is None:
        from recpipe.errors import UsageError

        raise UsageError(f"bench: name a benchmark: {', '.join(sorted(_benchmarks()))}")
    if args.nvtx:
        from recpipe.serving import nvtx

        nvtx.enable()  # no CUDA: a clear error, exit code 2
    return int(args._bench.run(args))
