"""SIGTERM as an exception that unwinds like Ctrl-C, and a flag that commit points check.

The CLI's handler both raises ``Terminated`` in the main thread and sets the flag. The raise is what
normally stops a command, so its cleanup runs on the way out. The flag covers the case where that raise
lands somewhere Python swallows it: an exception raised inside a finalizer run by the garbage
collector (a ``__del__``, a generator closed at collection) is printed as "Exception ignored" and
execution goes on. ``files.swap_dir``, the one place a finished directory is moved into place (datagen,
train), refuses once a termination was requested, so such a run still leaves no dataset or
repository behind. CI once saw a SIGTERMed synth-data leave its finished dataset in place.
"""

from __future__ import annotations

import threading

_REQUESTED = threading.Event()


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived. Raised in the main thread so that it unwinds like Ctrl-C: the commands' cleanup
    (synth-data's and train's temporary directories) runs on the way out. Exit code 143 (128 + 15)."""


def request() -> None:
    """Record that the process was asked to terminate (from the signal handler)."""
    _REQUESTED.set()


def check() -> None:
    """``Terminated`` if a termination was requested: called before anything is committed."""
    if _REQUESTED.is_set():
        raise Terminated()


def reset() -> None:
    """Forget a request (a command run again in the same process, e.g. ``main(argv)`` in the tests)."""
    _REQUESTED.clear()
