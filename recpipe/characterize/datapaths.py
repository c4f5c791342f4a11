"""The data paths between CPU and GPU: what a platform's link gives the stages that cross it.

The section measures, on the GPU the stages use:

- copy bandwidth host -> device and device -> host, from pinned and from pageable host memory, at
  sizes from 64 KB to 256 MB (``Plan.copy_bytes``);
- the latency of one small copy each way from pinned memory (the floor of a per-request transfer),
  timed on the device (CUDA events) and on the host (the call and a synchronize: what a caller waits);
- the GPU gathering table rows (``index_select``, the lookup of ``F.embedding``) in place from pinned
  host memory (a host-mapped tensor, as ``recpipe.accel.transfer.host_mapped`` builds for
  ``--embeddings host``) against the same gather from GPU memory, at the row sizes of recpipe's tables
  (the DLRM embedding dim and the retrieval item embedding dim, fp32 and fp16), with random and with
  sorted row ids: GB/s and ns per row;
- a cross-check: the event-timed pinned H2D figure at ``Plan.check_bytes`` (256 MB) against a plain
  torch copy of the same bytes timed on the host clock; they should agree within ``TORCH_TOLERANCE``.

Everything here is pure: the plan of what to time, the arithmetic (bytes and seconds -> GB/s, ns per
row, medians), the section's JSON block, the placement advice, and the share of a stage's latency its
copies take (``stage_transfers``, from the bytes per query the sequential section read from the
stages' GetInfo). A ``DeviceTimer`` is the only part that touches a device: ``CudaTimer``
(``recpipe.characterize.cuda_timer``) on a GPU, a fake one in the tests. GB/s are decimal (1e9 bytes
per second), as link speeds are quoted (NVLink-C2C 900 GB/s, PCIe Gen5 x16 ~64 GB/s each way).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

from recpipe.accel.traffic import Traffic
from recpipe.errors import UsageError
from recpipe.percentiles import percentile

H2D, D2H = "h2d", "d2h"
DIRECTIONS = (H2D, D2H)
DEVICE, HOST = "device", "host"
RANDOM, SORTED = "random", "sorted"
DTYPE_BYTES = {"fp32": 4, "fp16": 2}
#: host-memory tables are "within 10%" of GPU-resident ones at this fraction of their gather throughput
PLACEMENT_FRACTION = 0.9
#: the event-timed pinned H2D figure and the plain torch copy's must agree within this fraction
TORCH_TOLERANCE = 0.2
KB, MB = 1 << 10, 1 << 20
GB = 1e9
#: how each figure was taken (recorded in the section)
METHOD = ("CUDA events around each operation on one stream after warm-up runs; the median of the repeats. "
          "host_us and torch_gbps: the host's clock around the call and a synchronize")


@dataclass(frozen=True)
class Copy:
    """One copy of ``nbytes`` between host memory (pinned or pageable) and device memory."""

    direction: str
    pinned: bool
    nbytes: int

    @property
    def memory(self) -> str:
        return "pinned" if self.pinned else "pageable"


@dataclass(frozen=True)
class Gather:
    """The GPU gathering ``lookups`` rows of ``dim`` x ``dtype`` from a table of ``table_bytes`` that
    lives in GPU memory (``DEVICE``) or in pinned host memory read in place (``HOST``)."""

    table: str
    where: str
    dtype: str
    dim: int
    order: str
    lookups: int
    table_bytes: int

    @property
    def row_bytes(self) -> int:
        return self.dim * DTYPE_BYTES[self.dtype]

    @property
    def rows(self) -> int:
        """Rows in the table (its bytes divided by the row size)."""
        return self.table_bytes // self.row_bytes


class DeviceTimer(Protocol):
    """Times operations on a device. ``time`` runs ``op`` ``warmup`` times untimed, then ``repeats``
    times, and returns the seconds of each timed run: with ``clock`` "device", between two CUDA events
    recorded around the operation; with "host", the host's clock around the operation (blocking) and a
    synchronize."""

    def describe(self) -> str: ...
    def time(self, op: Copy | Gather, repeats: int, warmup: int, clock: str = DEVICE) -> list[float]: ...


@dataclass(frozen=True)
class Plan:
    """What the section times. Its own sizes, not ``Settings.sizes``: they change no other section,
    and its figures (GB/s, ns per row) compare between plans; the block records the plan it ran."""

    copy_bytes: tuple[int, ...]
    repeats: int
    warmup: int
    #: rows gathered per timed gather
    lookups: int
    #: bytes of each gathered-from table (larger than a GPU's L2 cache, so reads reach memory)
    table_bytes: int
    #: the small copy whose latency is the floor of a per-request transfer
    small_bytes: int
    #: the pinned H2D size checked against a plain torch copy
    check_bytes: int

    def __post_init__(self) -> None:
        if not self.copy_bytes or min(self.copy_bytes) < 1 or self.small_bytes < 1:
            raise UsageError("data paths: copy sizes must be >= 1 byte")
        if self.repeats < 1 or self.warmup < 0 or self.lookups < 1:
            raise UsageError("data paths: repeats and lookups must be >= 1, warm-up >= 0")
        if self.check_bytes not in self.copy_bytes:
            raise UsageError("data paths: the torch cross-check size must be one of the copy sizes")


#: ``--quick``: four sizes, five repeats (a second or two on a GPU)
QUICK = Plan(copy_bytes=(64 * KB, MB, 16 * MB, 256 * MB), repeats=5, warmup=2, lookups=1 << 16,
             table_bytes=256 * MB, small_bytes=256, check_bytes=256 * MB)
#: the default: 64 KB x 4^i up to 256 MB, twenty repeats (seconds)
FULL = Plan(copy_bytes=tuple(64 * KB * 4**i for i in range(7)), repeats=20, warmup=3, lookups=1 << 18,
            table_bytes=256 * MB, small_bytes=256, check_bytes=256 * MB)


def plan_for(quick: bool) -> Plan:
    return QUICK if quick else FULL


@dataclass(frozen=True)
class Tables:
    """The tables the stages gather from: the DLRM's (fused, ``ranking_rows`` x ``ranking_dim``, fp32
    as served) and the retrieval item embeddings (``retrieval_rows`` x ``retrieval_dim``)."""

    ranking_dim: int
    ranking_rows: int
    retrieval_dim: int
    retrieval_rows: int
    ranking_dtype: str = "fp32"

    @property
    def ranking_bytes(self) -> int:
        """What the DLRM tables hold in GPU memory (what ``--embeddings host`` frees)."""
        return self.ranking_rows * self.ranking_dim * DTYPE_BYTES[self.ranking_dtype]

    def to_json(self) -> dict[str, Any]:
        return {"ranking": {"dim": self.ranking_dim, "rows": self.ranking_rows, "dtype": self.ranking_dtype,
                            "bytes": self.ranking_bytes},
                "retrieval": {"dim": self.retrieval_dim, "rows": self.retrieval_rows}}


def tables_of(models: Path) -> Tables:
    """The tables of the model repository at ``models`` (its configs; no weights are read)."""
    from recpipe.ranking import artifacts as ranking_artifacts
    from recpipe.repository import Repository
    from recpipe.retrieval import artifacts as retrieval_artifacts

    repo = Repository.open(Path(models))
    dlrm = ranking_artifacts.load_config(repo)
    spec = retrieval_artifacts.load_spec(repo)
    return Tables(ranking_dim=dlrm.embedding_dim, ranking_rows=int(sum(dlrm.table_sizes)),
                  retrieval_dim=spec.dim, retrieval_rows=spec.num_items)


# ---- arithmetic ------------------------------------------------------------------------------------


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50)


def gbps(nbytes: float, seconds: float) -> float | None:
    """Decimal GB/s; None for a time that is not positive (nothing to divide by)."""
    return nbytes / seconds / GB if seconds > 0 else None


def ns_per_row(seconds: float, rows: int) -> float | None:
    return seconds / rows * 1e9 if rows > 0 else None


def _r(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _sig(x: float | None, digits: int = 6) -> float | None:
    """``x`` to ``digits`` significant digits (seconds span ns to s)."""
    return None if x is None else float(f"{x:.{digits}g}")


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def fmt_bytes(n: float) -> str:
    """``"64 KB"``, ``"1 MB"``, ``"256 MB"``, ``"12.5 MB"`` (binary units, as the sizes are chosen)."""
    for unit, size in (("GB", 1 << 30), ("MB", MB), ("KB", KB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


# ---- the section -----------------------------------------------------------------------------------


def skipped(reason: str) -> dict[str, Any]:
    """The block of a section that measured nothing, and why."""
    return {"measured": False, "reason": reason}


def gathers(plan: Plan, tables: Tables) -> list[Gather]:
    """Every gather the section times: each table's row size in fp32 and fp16, sorted and random ids,
    from GPU memory and from host memory."""
    out = []
    for table, dim in (("ranking", tables.ranking_dim), ("retrieval", tables.retrieval_dim)):
        for dtype in DTYPE_BYTES:
            for order in (RANDOM, SORTED):
                for where in (DEVICE, HOST):
                    out.append(Gather(table, where, dtype, dim, order, plan.lookups, plan.table_bytes))
    return out


def copy_row(op: Copy, samples: Sequence[float]) -> dict[str, Any]:
    s = median(samples)
    return {"direction": op.direction, "memory": op.memory, "bytes": op.nbytes, "repeats": len(samples),
            "median_s": _sig(s), "gbps": _r(gbps(op.nbytes, s), 3)}


def gather_row(op: Gather, samples: Sequence[float]) -> dict[str, Any]:
    s = median(samples)
    return {"table": op.table, "dtype": op.dtype, "dim": op.dim, "row_bytes": op.row_bytes, "order": op.order,
            "where": op.where, "lookups": op.lookups, "table_rows": op.rows, "repeats": len(samples),
            "median_s": _sig(s), "gbps": _r(gbps(op.lookups * op.row_bytes, s), 3),
            "ns_per_row": _r(ns_per_row(s, op.lookups), 3)}


def measure(plan: Plan, tables: Tables, timer: DeviceTimer) -> dict[str, Any]:
    """The section's block from ``timer``'s timings (see the module doc for what is timed)."""
    copies = [copy_row(op, timer.time(op, plan.repeats, plan.warmup))
              for op in (Copy(d, pinned, n) for d in DIRECTIONS for pinned in (True, False) for n in plan.copy_bytes)]
    small: dict[str, Any] = {"bytes": plan.small_bytes}
    for d in DIRECTIONS:
        op = Copy(d, True, plan.small_bytes)
        small[d] = {"device_us": _r(median(timer.time(op, plan.repeats, plan.warmup)) * 1e6, 3),
                    "host_us": _r(median(timer.time(op, plan.repeats, plan.warmup, clock=HOST)) * 1e6, 3)}
    check = Copy(H2D, True, plan.check_bytes)
    torch_s = median(timer.time(check, plan.repeats, plan.warmup, clock=HOST))
    block: dict[str, Any] = {
        "measured": True, "reason": "", "device": timer.describe(), "method": METHOD,
        "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(plan).items()},
        "tables": tables.to_json(), "copies": copies, "small_copy": small,
    }
    block["torch_check"] = torch_check(block, gbps(plan.check_bytes, torch_s))
    block["gathers"] = [gather_row(op, timer.time(op, plan.repeats, plan.warmup)) for op in gathers(plan, tables)]
    block["placement"] = placement(block)
    return block


def find_copy(block: Mapping[str, Any], direction: str, memory: str, nbytes: int) -> dict[str, Any] | None:
    return next((c for c in block.get("copies") or [] if (c["direction"], c["memory"], c["bytes"])
                 == (direction, memory, nbytes)), None)


def find_gather(block: Mapping[str, Any], table: str, dtype: str, order: str, where: str) -> dict[str, Any] | None:
    return next((g for g in block.get("gathers") or [] if (g["table"], g["dtype"], g["order"], g["where"])
                 == (table, dtype, order, where)), None)


def torch_check(block: Mapping[str, Any], torch_gbps: float | None) -> dict[str, Any]:
    """The event-timed pinned H2D figure at the check size against a plain torch copy's (host clock)."""
    nbytes = block["plan"]["check_bytes"]
    row = find_copy(block, H2D, "pinned", nbytes)
    events = row["gbps"] if row else None
    r = ratio(events, torch_gbps)
    return {"bytes": nbytes, "events_gbps": events, "torch_gbps": _r(torch_gbps, 3), "ratio": _r(r, 4),
            "tolerance": TORCH_TOLERANCE, "within": None if r is None else abs(r - 1) <= TORCH_TOLERANCE}


def placement(block: Mapping[str, Any]) -> dict[str, Any] | None:
    """Where the DLRM tables belong, from the gathers at their row size and dtype with random ids:
    in host memory (read in place) when that gathers within 10% of GPU memory's throughput."""
    t = block["tables"]["ranking"]
    dev, host = (find_gather(block, "ranking", t["dtype"], RANDOM, w) for w in (DEVICE, HOST))
    if dev is None or host is None:
        return None
    r = ratio(host["gbps"], dev["gbps"])
    if r is None:
        return None
    sdev, shost = (find_gather(block, "ranking", t["dtype"], SORTED, w) for w in (DEVICE, HOST))
    sorted_r = ratio(shost["gbps"], sdev["gbps"]) if sdev and shost else None
    within = r >= PLACEMENT_FRACTION
    frees = t["bytes"]
    how = (f"DLRM tables read in place from host memory gather at {r:.0%} of the throughput of GPU-resident "
           f"ones ({dev['row_bytes']} B {t['dtype']} rows, random ids)")
    if within:
        advice = (f"{how}: within {1 - PLACEMENT_FRACTION:.0%}, so `--embeddings host` would free "
                  f"{fmt_bytes(frees)} of GPU memory (the DLRM tables) at little cost.")
    else:
        advice = (f"{how}: keep them in GPU memory (`--embeddings device`, the default); host memory would "
                  f"free {fmt_bytes(frees)} of GPU memory.")
    return {"row_bytes": dev["row_bytes"], "dtype": t["dtype"], "order": RANDOM, "device_gbps": dev["gbps"],
            "host_gbps": host["gbps"], "host_over_device": _r(r, 4), "host_over_device_sorted": _r(sorted_r, 4),
            "threshold": PLACEMENT_FRACTION, "host_within_10pct": within, "frees_gpu_bytes": frees,
            "advice": advice}


# ---- the stages' transfers -------------------------------------------------------------------------


def per_query(before: Mapping[str, Traffic | None], after: Mapping[str, Traffic | None],
              queries: int) -> dict[str, dict[str, Any] | None]:
    """Per stage, what it copied per query between two readings of its counters (None where a reading
    is missing or the counters went back: the stage restarted)."""
    out: dict[str, dict[str, Any] | None] = {}
    for name in after:
        a, b = before.get(name), after[name]
        if a is None or b is None or queries <= 0:
            out[name] = None
            continue
        d = b.minus(a)
        values = asdict(d)
        if min(values.values()) < 0:
            out[name] = None
            continue
        out[name] = {"queries": queries, **{k: round(v / queries, 3) for k, v in values.items()}}
    return out


def copy_seconds(block: Mapping[str, Any], direction: str, nbytes: float) -> float | None:
    """Seconds one pinned copy of ``nbytes`` takes, read off the measured curve: linear between the
    measured sizes (the small copy's device latency the first point), at the largest size's
    bandwidth beyond it; the small copy's latency below it."""
    small = (block.get("small_copy") or {}).get(direction) or {}
    points = sorted((c["bytes"], c["median_s"]) for c in block.get("copies") or []
                    if c["direction"] == direction and c["memory"] == "pinned" and c["median_s"])
    if small.get("device_us") is not None:
        points = sorted([(block["small_copy"]["bytes"], small["device_us"] / 1e6), *points])
    if not points:
        return None
    if nbytes <= points[0][0]:
        return float(points[0][1])
    for (b0, s0), (b1, s1) in pairwise(points):
        if nbytes <= b1:
            return float(s0 + (s1 - s0) * (nbytes - b0) / (b1 - b0))
    b_last, s_last = points[-1]
    return float(s_last * nbytes / b_last)


def stage_transfers(block: Mapping[str, Any], traffic: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per stage with copies, the time its copies take per query on the measured pinned paths: each
    direction's copies per query times the time of one copy of its mean size (µs)."""
    out: dict[str, dict[str, Any]] = {}
    if not block.get("measured"):
        return out
    for stage, q in traffic.items():
        if not q:
            continue
        us: dict[str, float | None] = {}
        for d in DIRECTIONS:
            copies, nbytes = q[f"{d}_copies"], q[f"{d}_bytes"]
            one = copy_seconds(block, d, nbytes / copies) if copies > 0 else 0.0
            us[d] = None if one is None else round(copies * one * 1e6, 3)
        total = None if None in us.values() else round(sum(v for v in us.values() if v is not None), 3)
        out[stage] = {"h2d_us": us[H2D], "d2h_us": us[D2H], "total_us": total}
    return out
