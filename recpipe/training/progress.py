"""Progress bars with loss and throughput — on a terminal only, never under --quiet."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any


class Progress:
    """Wraps an iterable of batches; ``update(loss, rows)`` sets the postfix when a bar is shown."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="row", unit_scale=True, leave=False, file=sys.stderr)

    def update(self, rows: int, loss: float) -> None:
        if self._bar is not None:
            self._bar.update(rows)
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def batches(n: int, batch: int, rng: Any) -> Iterator[Any]:
    """Shuffled index batches over ``range(n)``."""
    order = rng.permutation(n)
    for start in range(0, n, batch):
        yield order[start : start + batch]
