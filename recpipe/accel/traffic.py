"""What a stage's core copies between host and device: bytes and copies each way, and its core calls.

``DeviceIO`` (``recpipe.accel.transfer``) counts into one ``Traffic`` per core, cumulatively since the
core was loaded (warm-ups and graph captures included); a reader takes two readings and subtracts.
A stage reports it in its GetInfo details under ``KEY``, as ``describe()`` writes it and ``parse()``
reads it back (``recpipe characterize`` reads it before and after its sequential run). Nothing here
imports torch: the characterization and the report read the figures without it.

Only what crosses between host and device memory counts: on the CPU the counters stay at zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

#: the GetInfo details entry a stage reports its ``Traffic`` under
KEY = "transfers"


@dataclass
class Traffic:
    """Cumulative counters (``calls``: core calls that fetched a result, one per forward)."""

    calls: int = 0
    h2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_bytes: int = 0
    d2h_copies: int = 0

    def add_h2d(self, nbytes: int, copies: int = 1) -> None:
        self.h2d_bytes += int(nbytes)
        self.h2d_copies += copies

    def add_d2h(self, nbytes: int, copies: int = 1) -> None:
        self.d2h_bytes += int(nbytes)
        self.d2h_copies += copies

    def add_call(self) -> None:
        self.calls += 1

    def minus(self, earlier: Traffic) -> Traffic:
        """The traffic since ``earlier`` (a reading of the same counters)."""
        return Traffic(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def describe(self) -> str:
        """``"calls=3 h2d_bytes=1024 h2d_copies=12 d2h_bytes=96 d2h_copies=3"`` (what ``parse`` reads)."""
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())

    @classmethod
    def parse(cls, text: str | None) -> Traffic | None:
        """``describe()``'s text back as counters; None when ``text`` is absent or not that text."""
        if not text:
            return None
        values: dict[str, int] = {}
        for part in text.split():
            key, sep, value = part.partition("=")
            if not sep or not value.isdigit():
                return None
            values[key] = int(value)
        if set(values) != {f.name for f in fields(cls)}:
            return None
        return cls(**values)
