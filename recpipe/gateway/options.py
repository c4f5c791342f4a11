"""The gateway stage's own settings, declared once: each a ``recpipe serve`` flag with its default,
help and check (``recpipe.serving.options``)."""

from __future__ import annotations

from dataclasses import dataclass

from recpipe.config import MAX_BATCH_ENTRIES
from recpipe.errors import UsageError
from recpipe.gateway.hops import HopConfig
from recpipe.serving.options import StageOptions, option

#: Recommend calls the gateway works on at once; more are refused with RESOURCE_EXHAUSTED.
DEFAULT_MAX_IN_FLIGHT = 512
#: Stage calls per batch call at most (``recpipe.gateway.hops``): the stages' batchers' GPU default.
DEFAULT_HOP_MAX_BATCH = 32
#: How long a batch may wait for the queries at the hop before its own, which reach it next (a lone
#: query has none behind it and never waits), where ``--hop-upstream-wait-us auto`` turns it on: on a
#: machine with fewer cores than the chain has processes, where the queries wait for CPU. On 2 cores,
#: closed loop of 8, it took the stage RPCs per query from 2.13-2.16 to 0.86 and the serving CPU per
#: query from 3.4-3.6 to 2.5-2.8 ms. With cores to spare it only adds waiting: on 16 cores with an
#: H200, the highest rate with p99 <= 20 ms was 454 q/s with it against 831 without (BENCHMARKS.md).
DEFAULT_HOP_UPSTREAM_WAIT_US = 2000


@dataclass(frozen=True)
class GatewayOptions(StageOptions):
    group = "gateway"

    max_in_flight: int = option(DEFAULT_MAX_IN_FLIGHT, help=f"gateway: Recommend calls in progress at most; more are "
                                                            f"refused with RESOURCE_EXHAUSTED (default {DEFAULT_MAX_IN_FLIGHT})")
    hop_max_batch: int = option(DEFAULT_HOP_MAX_BATCH, help="gateway: stage calls of the queries in flight sent as one batch "
                                                            f"call, at most (1 = every call alone, at most {MAX_BATCH_ENTRIES}; default {DEFAULT_HOP_MAX_BATCH})")
    hop_queue_delay_us: int = option(0, help="gateway: how long a stage call may wait for others to batch with, in µs "
                                             "(0 = send what is queued, so a lone query never waits; default 0)")
    hop_upstream_wait_us: int | str = option("auto", metavar="US|auto",
                                             help="gateway: how long a stage call may wait for the queries at the hop "
                                                  "before it, so they go in one batch call, in µs: fewer RPCs and less CPU "
                                                  "per query, more waiting (a lone query has none behind it and never "
                                                  "waits; 0 = never). auto (the default): "
                                                  f"{DEFAULT_HOP_UPSTREAM_WAIT_US} where the machine has fewer cores than "
                                                  "the chain has processes, else 0")
    hop_max_in_flight: int = option(0, help="gateway: batch calls out at once per stage method, spread evenly over its "
                                            "replicas (default 0 = one per replica)")
    hop_transport: str = option("stream", choices=("stream", "rpc"),
                                help="gateway: how a hop's batch calls travel: stream (the default), as the messages "
                                     "of one long-lived stream per stage method and replica, about half the CPU "
                                     "of an RPC; rpc, one unary or batch RPC each")

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise UsageError(f"--max-in-flight must be >= 1, got {self.max_in_flight}")
        if not 1 <= self.hop_max_batch <= MAX_BATCH_ENTRIES:
            raise UsageError(f"--hop-max-batch must be 1..{MAX_BATCH_ENTRIES} (a stage's batch message holds at "
                             f"most {MAX_BATCH_ENTRIES} entries), got {self.hop_max_batch}")
        wait = self.hop_upstream_wait_us
        if isinstance(wait, str) and wait != "auto":
            if not wait.isdigit():
                raise UsageError(f"--hop-upstream-wait-us must be a number of µs or auto, got {wait!r}")
            object.__setattr__(self, "hop_upstream_wait_us", int(wait))  # as given on a command line
        negative_wait = self.hop_upstream_wait_us != "auto" and int(self.hop_upstream_wait_us) < 0
        if self.hop_queue_delay_us < 0 or self.hop_max_in_flight < 0 or negative_wait:
            raise UsageError("--hop-queue-delay-us, --hop-upstream-wait-us and --hop-max-in-flight must be >= 0")
        if self.hop_transport not in ("stream", "rpc"):
            raise UsageError(f"--hop-transport must be stream or rpc, got {self.hop_transport!r}")

    def upstream_wait_us(self, processes: int, cores: int) -> int:
        """``--hop-upstream-wait-us`` for a chain of ``processes`` serving processes on ``cores`` cores
        (``auto``: ``DEFAULT_HOP_UPSTREAM_WAIT_US`` where the processes outnumber the cores, else 0)."""
        if self.hop_upstream_wait_us == "auto":
            return DEFAULT_HOP_UPSTREAM_WAIT_US if cores < processes else 0
        return int(self.hop_upstream_wait_us)

    def hops(self, processes: int, cores: int) -> HopConfig:
        """The hops' settings for a chain of ``processes`` serving processes on ``cores`` cores."""
        return HopConfig(self.hop_max_batch, self.hop_queue_delay_us, self.hop_max_in_flight,
                         self.upstream_wait_us(processes, cores), stream=self.hop_transport == "stream")
