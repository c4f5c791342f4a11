"""The gateway stage's own settings, declared once: each a ``recpipe serve`` flag with its default,
help and check (``recpipe.serving.options``)."""

from __future__ import annotations

from dataclasses import dataclass

from recpipe.errors import UsageError
from recpipe.serving.options import StageOptions, option

#: Recommend calls the gateway works on at once; more are refused with RESOURCE_EXHAUSTED.
DEFAULT_MAX_IN_FLIGHT = 512


@dataclass(frozen=True)
class GatewayOptions(StageOptions):
    group = "gateway"

    max_in_flight: int = option(DEFAULT_MAX_IN_FLIGHT, help=f"gateway: Recommend calls in progress at most; more are "
                                                            f"refused with RESOURCE_EXHAUSTED (default {DEFAULT_MAX_IN_FLIGHT})")

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise UsageError(f"--max-in-flight must be >= 1, got {self.max_in_flight}")
