"""The gateway's batched hops (``recpipe.gateway.hops``) over fake senders: what goes alone, what goes
together, per-call answers and errors, deadlines while queued, and the calls out at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from recpipe.config import MAX_BATCH_ROWS
from recpipe.errors import BadRequest, DeadlineExceeded, StageUnavailable
from recpipe.gateway.hops import Hop, HopConfig, Route, replica_targets


class Stage:
    """Records what the hop sent; each call is held until ``release`` (so calls can pile up meanwhile)."""

    def __init__(self) -> None:
        self.sent: list[list[Any]] = []
        self.timeouts: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_whole = False

    async def unary(self, request: Any, timeout: float | None) -> Any:
        self.sent.append([request])
        await self.gate.wait()
        if request == "bad":
            raise BadRequest("bad request")
        return f"answer {request}"

    async def batch(self, requests: list[Any], timeouts_us: list[int], timeout: float | None) -> list[Any]:
        self.sent.append(list(requests))
        self.timeouts.append(timeouts_us)
        await self.gate.wait()
        if self.fail_whole:
            raise StageUnavailable("stage down")
        return [BadRequest("bad request") if r == "bad" else f"answer {r}" for r in requests]


def _hop(stage: Stage, **config: Any) -> Hop[Any, Any]:
    return Hop("stage.Method", [Route(stage.unary, stage.batch)], HopConfig(**config))


def test_a_lone_call_goes_alone_at_once_and_the_calls_that_pile_up_go_together() -> None:
    async def go() -> None:
        stage = Stage()
        hop = _hop(stage)
        assert await hop("a", None) == "answer a" and stage.sent == [["a"]]
        stage.gate.clear()  # the next call is held at the stage: the ones after it queue in the gateway
        first = asyncio.create_task(hop("b", None))
        await asyncio.sleep(0.01)
        rest = [asyncio.create_task(hop(r, 5.0)) for r in ("c", "bad", "d")]
        await asyncio.sleep(0.01)
        assert stage.sent == [["a"], ["b"]]  # one batch call out at a time
        stage.gate.set()
        assert await first == "answer b"
        results = await asyncio.gather(*rest, return_exceptions=True)
        assert stage.sent[-1] == ["c", "bad", "d"]  # together, in one batch call
        assert results[0] == "answer c" and results[2] == "answer d"
        assert isinstance(results[1], BadRequest)  # failed alone
        assert all(0 < t <= 5_000_000 for t in stage.timeouts[-1])  # each entry's time left
        assert (hop.calls, hop.batches) == (5, 3)

    asyncio.run(go())


def test_max_batch_one_sends_every_call_alone_and_at_once() -> None:
    async def go() -> None:
        stage = Stage()
        stage.gate.clear()
        hop = _hop(stage, max_batch=1)
        calls = [asyncio.create_task(hop(r, None)) for r in "abc"]
        await asyncio.sleep(0.01)
        assert stage.sent == [["a"], ["b"], ["c"]]
        stage.gate.set()
        assert await asyncio.gather(*calls) == ["answer a", "answer b", "answer c"]

    asyncio.run(go())


def test_max_batch_and_calls_out_at_once_bound_the_batch_calls() -> None:
    async def go() -> None:
        stage = Stage()
        stage.gate.clear()
        hop = _hop(stage, max_batch=2, max_in_flight=2)
        calls = [asyncio.create_task(hop(r, None)) for r in "abcdef"]
        await asyncio.sleep(0.01)
        assert stage.sent == [["a", "b"], ["c", "d"]]  # two out at once, two calls each
        stage.gate.set()
        await asyncio.gather(*calls)
        assert stage.sent[2] == ["e", "f"]

    asyncio.run(go())


def test_a_batch_call_carries_no_more_rows_than_a_stage_takes_in_one_message() -> None:
    async def go() -> None:
        stage = Stage()
        hop = Hop("ranking.Rank", [Route(stage.unary, stage.batch)], HopConfig(), rows=lambda request: request[1])
        stage.gate.clear()
        first = asyncio.create_task(hop(("a", 10), None))  # out at the stage: the next ones queue
        await asyncio.sleep(0.01)
        # MAX_BATCH_ROWS is 100,000: 60k + 50k would be over it, so the second starts the next batch call
        rest = [asyncio.create_task(hop(r, None)) for r in (("b", 60_000), ("c", 50_000), ("d", 30_000),
                                                              ("e", 20_001))]
        await asyncio.sleep(0.01)
        stage.gate.set()
        await asyncio.gather(first, *rest)
        assert [[name for name, _ in batch] for batch in stage.sent] == [["a"], ["b"], ["c", "d"], ["e"]]
        assert MAX_BATCH_ROWS == 100_000

    asyncio.run(go())


def test_a_call_whose_deadline_passes_in_the_queue_is_not_sent_and_a_failed_batch_call_fails_each() -> None:
    async def go() -> None:
        stage = Stage()
        stage.gate.clear()
        hop = _hop(stage)
        first = asyncio.create_task(hop("a", None))
        await asyncio.sleep(0.01)
        late = asyncio.create_task(hop("late", 0.001))
        others = [asyncio.create_task(hop(r, None)) for r in "bc"]
        await asyncio.sleep(0.02)
        stage.fail_whole = True
        stage.gate.set()
        assert await first == "answer a"
        with pytest.raises(DeadlineExceeded, match="queued in the gateway"):
            await late
        for task in others:
            with pytest.raises(StageUnavailable, match="stage down"):
                await task
        assert ["late"] not in stage.sent and stage.sent[-1] == ["b", "c"]

    asyncio.run(go())


def test_a_cancelled_call_leaves_the_queue() -> None:
    async def go() -> None:
        stage = Stage()
        stage.gate.clear()
        hop = _hop(stage)
        first = asyncio.create_task(hop("a", None))
        await asyncio.sleep(0.01)
        gone = asyncio.create_task(hop("gone", None))
        kept = asyncio.create_task(hop("kept", None))
        await asyncio.sleep(0.01)
        gone.cancel()
        stage.gate.set()
        await first
        assert await kept == "answer kept" and all("gone" not in s for s in stage.sent)

    asyncio.run(go())


def test_a_target_listing_replicas_gives_one_route_each_and_one_call_out_per_replica() -> None:
    assert replica_targets("ipv4:127.0.0.1:5001,127.0.0.1:5002") == ["ipv4:127.0.0.1:5001", "ipv4:127.0.0.1:5002"]
    assert replica_targets("ipv6:[::1]:5001,[::1]:5002") == ["ipv6:[::1]:5001", "ipv6:[::1]:5002"]
    assert replica_targets("127.0.0.1:5001") == ["127.0.0.1:5001"]
    assert replica_targets("dns:///ranking:50054") == ["dns:///ranking:50054"]
    stages = [Stage() for _ in range(3)]
    hop = Hop("s.M", [Route(s.unary, s.batch) for s in stages], HopConfig())
    assert hop.max_in_flight == 3 and hop.per_route == 1
    assert Hop("s.M", [Route(s.unary, s.batch) for s in stages], HopConfig(max_in_flight=4)).per_route == 2


class Replica(Stage):
    def __init__(self) -> None:
        super().__init__()
        self.up = True


def _replicas(n: int, kind: type[Replica] = Replica, **config: Any) -> tuple[list[Any], Hop[Any, Any]]:
    replicas = [kind() for _ in range(n)]
    routes = [Route(r.unary, r.batch, lambda r=r: r.up) for r in replicas]  # type: ignore[misc]
    return replicas, Hop("s.M", routes, HopConfig(**config))


def test_lone_calls_meet_the_first_replica_and_a_busy_one_passes_the_next_batch_on() -> None:
    async def go() -> None:
        (a, b, c), hop = _replicas(3)
        for r in ("1", "2", "3"):
            assert await hop(r, None) == f"answer {r}"
        assert a.sent == [["1"], ["2"], ["3"]] and b.sent == [] and c.sent == []  # the same warm replica
        a.gate.clear()
        held = [asyncio.create_task(hop("x", None))]
        await asyncio.sleep(0.01)
        assert await hop("y", None) == "answer y"  # a is busy: b takes it, c stays idle
        assert b.sent == [["y"]] and c.sent == []
        b.gate.clear()
        c.gate.clear()
        for r in ("p", "q"):  # b and c take one each
            held.append(asyncio.create_task(hop(r, None)))
            await asyncio.sleep(0.01)
        assert b.sent[-1] == ["p"] and c.sent == [["q"]]
        queued = [asyncio.create_task(hop(r, None)) for r in ("r", "s")]
        await asyncio.sleep(0.01)
        assert a.sent[-1] == ["x"]  # every replica busy: they wait in the gateway
        a.gate.set()
        assert await asyncio.gather(*queued) == ["answer r", "answer s"] and a.sent[-1] == ["r", "s"]
        b.gate.set()
        c.gate.set()
        assert await asyncio.gather(*held) == ["answer x", "answer p", "answer q"]
        assert hop.sent_per_route == [5, 2, 1]

    asyncio.run(go())


def test_a_replica_that_is_down_is_passed_over_and_with_all_down_the_call_fails_at_once() -> None:
    async def go() -> None:
        (a, b), hop = _replicas(2)
        a.up = False
        assert await hop("1", None) == "answer 1" and a.sent == [] and b.sent == [["1"]]
        a.up = True
        assert await hop("2", None) == "answer 2" and a.sent == [["2"]]  # back first in the order
        a.up = b.up = False
        assert await hop("3", None) == "answer 3" and a.sent[-1] == ["3"]  # none up: the first is tried
        (a, b), hop = _replicas(2, max_batch=1)  # unbatched: the replicas in turn, skipping one that is down
        for r in "1234":
            await hop(r, None)
        assert a.sent == [["1"], ["3"]] and b.sent == [["2"], ["4"]]
        b.up = False
        await hop("5", None)
        await hop("6", None)
        assert a.sent[-2:] == [["5"], ["6"]]

    asyncio.run(go())



class Gone(Replica):
    """A replica whose calls fail whole with UNAVAILABLE once ``gone`` (killed under them), after ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gone = False

    async def unary(self, request: Any, timeout: float | None) -> Any:
        answer = await super().unary(request, timeout)
        if self.gone:
            raise StageUnavailable("replica gone")
        return answer

    async def batch(self, requests: list[Any], timeouts_us: list[int], timeout: float | None) -> list[Any]:
        answers = await super().batch(requests, timeouts_us, timeout)
        if self.gone:
            raise StageUnavailable("replica gone")
        return answers


def _gone(n: int, **config: Any) -> tuple[list[Gone], Hop[Any, Any]]:
    return _replicas(n, Gone, **config)


def test_calls_out_on_a_replica_that_dies_go_once_more_to_another() -> None:
    async def go() -> None:
        (a, b), hop = _gone(2)
        a.gate.clear()
        alone = asyncio.create_task(hop("1", 5.0))  # sent alone, from its own task
        await asyncio.sleep(0.01)
        b.gate.clear()
        batch = [asyncio.create_task(hop(r, 5.0)) for r in ("2", "3")]  # a is busy: to b, held there
        await asyncio.sleep(0.01)
        more = [asyncio.create_task(hop(r, 5.0)) for r in ("4", "5")]  # both busy: queued, then a batch
        await asyncio.sleep(0.01)
        a.gone = True  # killed with "1" out on it
        a.up = False
        a.gate.set()
        await asyncio.sleep(0.01)
        b.gate.set()
        assert await asyncio.gather(alone, *batch, *more) == [f"answer {r}" for r in "12345"]
        assert ["1"] in b.sent and hop.resent_elsewhere >= 1
        # a batch out on a replica that dies is sent again whole, to the one left
        a.gone, a.up, b.gone = False, True, False
        a.gate.clear()
        b.gate.clear()
        held = []
        for r in ("x", "y"):  # one each
            held.append(asyncio.create_task(hop(r, 5.0)))
            await asyncio.sleep(0.01)
        queued = [asyncio.create_task(hop(r, 5.0)) for r in ("p", "q", "r")]
        await asyncio.sleep(0.01)
        assert a.sent[-1] == ["x"] and b.sent[-1] == ["y"]
        b.gone, b.up = True, False
        b.gate.set()
        await asyncio.sleep(0.01)
        a.gate.set()
        assert await asyncio.gather(*held, *queued) == ["answer x", "answer y", "answer p", "answer q", "answer r"]
        assert a.sent[-1] in (["y"], ["p", "q", "r"]) and ["y"] in a.sent

    asyncio.run(go())


def test_a_second_try_fails_as_it_finds_and_other_errors_are_not_tried_again() -> None:
    async def go() -> None:
        (a, b), hop = _gone(2, max_batch=1)  # unbatched: each call alone, the replicas in turn
        a.gone = b.gone = True  # both die under their calls: once more, then the error stands
        with pytest.raises(StageUnavailable, match="replica gone"):
            await hop("1", 1.0)
        assert a.sent == [["1"]] and b.sent == [["1"]] and hop.resent_elsewhere == 1
        (only,), hop = _gone(1)  # a lone replica: nowhere else to go
        only.gone = True
        with pytest.raises(StageUnavailable):
            await hop("1", 1.0)
        assert only.sent == [["1"]] and hop.resent_elsewhere == 0
        (a, b), hop = _gone(2)
        with pytest.raises(BadRequest):  # the stage's own answer: not tried again
            await hop("bad", 1.0)
        assert a.sent == [["bad"]] and b.sent == [] and hop.resent_elsewhere == 0
        (a, b), hop = _gone(2)
        a.gone, b.up = True, False  # the other replica is down too: the error stands
        with pytest.raises(StageUnavailable):
            await hop("1", 1.0)
        assert b.sent == [] and hop.resent_elsewhere == 0

    asyncio.run(go())


def test_a_queue_delay_lets_a_lone_call_wait_for_company() -> None:
    async def go() -> None:
        stage = Stage()
        hop = _hop(stage, max_queue_delay_us=200_000, max_batch=2)
        first = asyncio.create_task(hop("a", None))
        await asyncio.sleep(0.02)
        assert stage.sent == []  # waiting for a second call, up to 200 ms
        second = asyncio.create_task(hop("b", None))
        assert await asyncio.gather(first, second) == ["answer a", "answer b"]
        assert stage.sent == [["a", "b"]]  # the batch filled: sent before the delay ran out

    asyncio.run(go())


def test_a_replica_that_goes_down_as_its_batch_is_cut_loses_no_call() -> None:
    async def go() -> None:
        (a, b), hop = _replicas(2)
        a.gate.clear()
        held = asyncio.create_task(hop("held", None))  # a busy
        await asyncio.sleep(0.01)
        looks = iter([True])  # b looks up once, when the worker finds it free, then is down
        hop.routes[1] = Route(b.unary, b.batch, lambda: next(looks, False))
        late = asyncio.create_task(hop("late", None))
        await asyncio.sleep(0.01)
        assert b.sent == [] and not late.done()  # not sent to b, and still queued
        a.gate.set()
        assert await asyncio.wait_for(late, 1.0) == "answer late" and a.sent[-1] == ["late"]
        assert await held == "answer held"

    asyncio.run(go())


def test_while_no_replica_is_connected_the_balanced_channel_carries_the_calls() -> None:
    async def go() -> None:
        replicas = [Replica(), Replica()]
        balanced = Stage()
        routes = [Route(r.unary, r.batch, lambda r=r: r.up) for r in replicas]  # type: ignore[misc]
        for max_batch in (32, 1):
            for r in replicas:
                r.up = False
            hop: Hop[Any, Any] = Hop("s.M", routes, HopConfig(max_batch=max_batch), Route(balanced.unary, balanced.batch))
            assert await hop("early", None) == "answer early" and balanced.sent[-1] == ["early"]
            replicas[1].up = True
            assert await hop("later", None) == "answer later" and replicas[1].sent[-1] == ["later"]
        assert replicas[0].sent == [] and len(balanced.sent) == 2

    asyncio.run(go())


class Upstream:
    """The count a hop waits for (``Chain.ahead`` for its step), moved by hand."""

    def __init__(self, hop: Hop[Any, Any], n: int) -> None:
        self.n = n
        self.hop = hop
        hop.upstream = lambda: self.n

    def arrive(self, request: Any) -> asyncio.Task[Any]:
        self.n -= 1
        self.hop.nudge()
        return asyncio.create_task(self.hop(request, 5.0))

    def leave(self) -> None:
        self.n -= 1
        self.hop.nudge()


def test_a_batch_waits_for_the_queries_that_have_yet_to_reach_its_hop_and_a_lone_one_never_waits() -> None:
    async def go() -> None:
        stage = Stage()
        hop = _hop(stage, upstream_wait_us=5_000_000)  # long: each wait below must end by itself
        upstream = Upstream(hop, 0)
        t0 = time.monotonic()
        assert await hop("alone", 5.0) == "answer alone" and time.monotonic() - t0 < 1.0  # none ahead: at once
        upstream.n = 3  # three queries in flight before this hop: the first to arrive waits for the others
        first = upstream.arrive("a")
        await asyncio.sleep(0.02)
        assert stage.sent == [["alone"]]
        second = upstream.arrive("b")
        await asyncio.sleep(0.02)
        assert stage.sent == [["alone"]]  # one still to come
        upstream.leave()  # it failed before this hop: nothing more to wait for
        assert await first == "answer a" and await second == "answer b"
        assert stage.sent == [["alone"], ["a", "b"]] and time.monotonic() - t0 < 1.0

    asyncio.run(go())


def test_the_wait_for_upstream_queries_is_bounded_by_its_setting_and_by_the_deadlines() -> None:
    async def go() -> None:
        stage = Stage()
        hop = _hop(stage, upstream_wait_us=50_000)
        Upstream(hop, 5)  # they never come
        t0 = time.monotonic()
        assert await hop("a", 5.0) == "answer a"
        assert 0.04 <= time.monotonic() - t0 < 1.0  # waited its 50 ms, then went
        slow = _hop(Stage(), upstream_wait_us=5_000_000)
        Upstream(slow, 5)
        t0 = time.monotonic()
        assert await slow("b", 0.2) == "answer b"
        assert 0.08 <= time.monotonic() - t0 < 0.15  # at most half of its 200 ms left

    asyncio.run(go())


def test_while_one_replica_works_a_free_one_takes_the_next_batch_without_waiting_upstream() -> None:
    async def go() -> None:
        replicas, hop = _replicas(2, upstream_wait_us=5_000_000)
        upstream = Upstream(hop, 0)
        replicas[0].gate.clear()  # the first replica holds its call
        first = asyncio.create_task(hop("a", 5.0))
        await asyncio.sleep(0.02)
        upstream.n = 3  # queries on their way, but the hop already has a call out
        t0 = time.monotonic()
        second = upstream.arrive("b")
        await asyncio.sleep(0.02)
        assert replicas[1].sent == [["b"]]  # sent to the free replica at once
        assert await second == "answer b" and time.monotonic() - t0 < 1.0
        replicas[0].gate.set()
        assert await first == "answer a"

    asyncio.run(go())


def test_the_hops_of_one_stage_send_to_the_replica_the_others_left_free() -> None:
    """A replica computing one method's batch holds the next call of any method: the cheap method's
    batch goes to the replica with nothing out, and back to the first once that is free."""
    async def go() -> None:
        replicas = [Replica() for _ in range(2)]
        busy = [0, 0]

        def hop(name: str, shared: list[int] | None) -> Hop[Any, Any]:
            routes = [Route(r.unary, r.batch, lambda r=r: r.up) for r in replicas]  # type: ignore[misc]
            return Hop(name, routes, HopConfig(), busy=shared)

        items, user = hop("features.AugmentItems", busy), hop("features.AugmentUser", busy)
        alone = hop("features.AugmentUser", None)  # a hop that does not see the others' calls
        a, b = replicas
        a.gate.clear()
        held = asyncio.create_task(items("items 1", None))
        await asyncio.sleep(0.01)
        assert a.sent == [["items 1"]] and busy == [1, 0]
        assert await user("user 1", None) == "answer user 1" and b.sent == [["user 1"]]  # not behind it
        alone_call = asyncio.create_task(alone("user 2", None))
        await asyncio.sleep(0.01)
        assert a.sent[-1] == ["user 2"]  # unshared, the first replica looked free: it waits there
        a.gate.set()
        assert await held == "answer items 1" and await alone_call == "answer user 2"
        assert busy == [0, 0]
        assert await user("user 3", None) == "answer user 3" and a.sent[-1] == ["user 3"]  # nothing out: the first
        with pytest.raises(ValueError, match="1 replica counts for 2 routes"):
            Hop("s.M", [Route(r.unary, r.batch) for r in replicas], HopConfig(), busy=[0])

    asyncio.run(go())


def test_a_query_alone_in_the_gateway_sends_from_its_own_task_and_one_with_company_queues() -> None:
    async def go() -> None:
        stage = Stage()
        hop = _hop(stage)
        alone = [True]
        hop.alone = lambda: alone[0]
        assert await hop("a", 1.0) == "answer a"
        assert (hop.sent_alone, hop._worker) == (1, None)  # no queue, no worker, no send task
        with pytest.raises(BadRequest):  # its error is its own, raised where it called
            await hop("bad", None)
        stage.gate.clear()
        first = asyncio.create_task(hop("b", None))  # alone: out at once, held at the stage
        await asyncio.sleep(0.01)
        second = asyncio.create_task(hop("c", None))  # the hop is busy: it queues, as any call would
        await asyncio.sleep(0.01)
        assert stage.sent[-1] == ["b"] and hop._worker is not None and hop.sent_alone == 3
        stage.gate.set()
        assert (await first, await second) == ("answer b", "answer c")
        alone[0] = False  # company in the gateway: the worker sends, and may batch
        assert await hop("d", None) == "answer d"
        assert hop.sent_alone == 3 and (hop.calls, hop.batches) == (5, 5)
        alone[0] = True
        stage.gate.clear()
        cancelled = asyncio.create_task(hop("e", None))
        await asyncio.sleep(0.01)
        cancelled.cancel()  # a lone call cancelled at the stage gives its route back
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        stage.gate.set()
        assert hop._in_flight == 0 and await hop("f", None) == "answer f"

    asyncio.run(go())


def test_a_queue_delay_keeps_a_lone_query_waiting_for_company() -> None:
    async def go() -> None:
        stage = Stage()
        hop = _hop(stage, max_queue_delay_us=20_000)
        hop.alone = lambda: True
        calls = [asyncio.create_task(hop(r, None)) for r in ("a", "b")]
        assert await asyncio.gather(*calls) == ["answer a", "answer b"]
        assert stage.sent == [["a", "b"]] and hop.sent_alone == 0  # the delay asked for batches: kept

    asyncio.run(go())


def test_a_queued_call_is_compared_by_identity_and_shown_without_its_request() -> None:
    """``deque.remove`` of a call already taken into a batch (its caller cancelled) compares it with each
    queued call, then puts its repr in the ValueError: with the request compared and printed, a Rank
    request of 10,000 candidates held the gateway's loop 0.15-0.2 s per cancelled call."""
    from collections import deque

    from recpipe.gateway.hops import _Call
    from recpipe.serving.batcher import _Pending

    async def go() -> None:
        loop = asyncio.get_running_loop()
        big = "x" * 1_000_000
        a, b = _Call(big, None, loop.create_future()), _Call(big, None, loop.create_future())
        assert a != b and a == a and len(repr(a)) < 100
        queued = deque([a])
        with pytest.raises(ValueError) as info:
            queued.remove(b)
        assert len(str(info.value)) < 200
        p = _Pending(big, loop.create_future(), None, 0, 1)
        assert p != _Pending(big, p.future, None, 0, 1) and len(repr(p)) < 100

    asyncio.run(go())
