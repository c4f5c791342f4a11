"""The ``recpipe`` command: parses flags and hands off to one module per subcommand.

Each subcommand lives in ``recpipe/commands/<name>.py`` and exposes ``add_arguments(parser)`` and
``run(args) -> int``. Command modules import their heavy dependencies (torch, faiss, grpc) inside
``run``, so ``recpipe --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from recpipe import __version__, termination
from recpipe.errors import ArtifactMismatch, BadRequest, RecpipeError, UnknownUser, UsageError
from recpipe.termination import Terminated

#: Errors that say the user's input cannot work (a request a stage refuses as sent, an unknown user, a
#: directory that is not the model repository or dataset asked for): exit code 2, as a usage error.
#: The others (a stage down or overloaded, a deadline) are failures of the run: exit code 1.
BAD_INPUT = (BadRequest, UnknownUser, ArtifactMismatch)

#: subcommand -> module under recpipe.commands
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "synth-data": "synth_data",
    "train": "train",
    "serve": "serve",
    "recommend": "recommend",
    "querygen": "querygen",
    "report": "report",
    "characterize": "characterize",
    "bench": "bench",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main`` owns every exit code."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # "recpipe: error: querygen: argument --rate: ..." (``main`` prints the "recpipe: error: ")
        command = self.prog.removeprefix("recpipe").strip()
        raise UsageError(f"{command}: {message}" if command else message)

    def format_help(self) -> str:
        # Help texts come from docstrings written in reStructuredText for readers of the code; a
        # terminal shows ``name`` literally, so --help drops the double backticks.
        return super().format_help().replace("``", "")


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While a command runs, SIGTERM raises ``Terminated`` instead of killing the process outright.
    Commands that handle SIGTERM themselves (``serve``) install their own handler over this one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        termination.request()  # checked again before any commit, in case this raise gets swallowed
        raise Terminated()

    termination.reset()
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="recpipe", description="A recommender latency pipeline service.")
    parser.add_argument("--version", action="version", version=f"recpipe {__version__}")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"recpipe.commands.{module_name}")
        doc = (module.__doc__ or "").strip()
        p = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (0 ok, 1 runtime failure, 2 bad usage or input)."""
    try:
        parser = build_parser()
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        with _sigterm_unwinds():
            return int(args._module.run(args))
    except UsageError as e:
        print(f"recpipe: error: {e}", file=sys.stderr)
        return 2
    except BAD_INPUT as e:  # what the user asked for can never work: their input, as a usage error is
        print(f"recpipe: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except RecpipeError as e:
        print(f"recpipe: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the machine refused (a full disk, a file gone): one line, not a traceback
        print(f"recpipe: error: {e}", file=sys.stderr)
        return 1
    except Terminated:
        print("recpipe: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("recpipe: interrupted", file=sys.stderr)
        return 130


def main_entry() -> None:
    """Console-script entry point. Once ``main`` has returned, its work is done (its files written): a
    Ctrl-C while the interpreter shuts down (joining threads, helper processes, gRPC's) ends the process
    at once with ``main``'s exit code, not with a traceback or killed by SIGINT with nothing said."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: as before, nothing more to say
            stream.flush()
    signal.signal(signal.SIGINT, lambda *_: os._exit(code))
    sys.exit(code)
