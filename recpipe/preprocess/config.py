"""Preprocessing settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreprocessConfig:
    """``max_vocab``: rows per categorical table including bucket 0 (null/unseen/beyond the cap).

    Values are ranked by frequency in the training split; the ``max_vocab - 1`` most frequent keep an
    index of their own, the long tail shares bucket 0 (brand and shop have hundreds of thousands of
    values at full scale, most seen a handful of times).
    """

    max_vocab: int = 50_000

    def __post_init__(self) -> None:
        if self.max_vocab < 2:
            raise ValueError("max_vocab must be >= 2 (bucket 0 plus at least one value)")
