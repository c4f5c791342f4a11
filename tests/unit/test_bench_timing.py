"""The benches' interleaved timing: which calls run, in what order, and which are timed."""

from __future__ import annotations

from collections.abc import Callable

from recpipe.bench._timing import measure_interleaved


def _recorded(n: int, warmup: int, block: int) -> tuple[list[str], list[int]]:
    order: list[str] = []

    def form(name: str) -> Callable[[int], object]:
        return lambda i: order.append(f"{name}{i}")

    timings = measure_interleaved([("a", form("a")), ("b", form("b"))], n, warmup, block=block)
    return order, [len(t.samples_ns) for t in timings]


def test_call_by_call_alternates_single_calls() -> None:
    order, counts = _recorded(n=3, warmup=1, block=1)
    assert order == ["a0", "b0", "a0", "b0", "a1", "b1", "a2", "b2"]
    assert counts == [3, 3]


def test_blocks_run_each_form_after_itself_with_one_untimed_call_per_switch() -> None:
    order, counts = _recorded(n=5, warmup=0, block=2)
    # per block: one untimed call (the switch), then the block's timed calls; the last block is short
    assert order == ["a0", "a0", "a1", "b0", "b0", "b1",
                     "a2", "a2", "a3", "b2", "b2", "b3",
                     "a4", "a4", "b4", "b4"]
    assert counts == [5, 5]


def test_every_timed_sample_is_filled() -> None:
    timings = measure_interleaved([("a", lambda i: sum(range(100))), ("b", lambda i: None)], 7, 0, block=3)
    assert all((t.samples_ns > 0).all() for t in timings)
