"""Closed-loop load on the recpipe gateway with locust, one statistics row per pipeline stage.

    locust -f loadtest/ --headless -u 8 -r 8 -t 30s --host 127.0.0.1:50051 --csv OUT

Every task sends ``Recommend`` for one user and records:

- ``grpc Recommend``: the end-to-end call as the client saw it (interceptor wall clock); a gRPC error
  is a failure named by its status code;
- ``stage_us stage:augment_user``, ``stage:retrieve``, ``stage:augment_items``, ``stage:rank``: each
  stage's time **in microseconds** (type ``stage_us``) from the response's ``StageTiming`` entries —
  ``server_us`` (time inside the stage's server) by default, ``observed_us`` (time the gateway waited
  for the stage, network included) with ``--stage-time observed``. A response lacking a stage's timing
  is a failure of that stage's row;
- ``stage_us stage:NAME queue`` / ``stage:NAME compute``: where a stage reports its batcher's split
  (``batch_size`` > 0), the time its request queued and the time of the core call, in microseconds.

The stage rows are not request events: locust's ``Aggregated`` row counts ``Recommend`` calls only.

Options (flags, or the environment variables in brackets): ``--user-dist uniform|zipf``
[RECPIPE_USER_DIST]; ``--data-dir DIR`` [RECPIPE_DATA], the ``recpipe synth-data`` directory the
gateway serves (``zipf`` then weights users by their interaction count); ``--num-user-ids N``
[RECPIPE_NUM_USERS] when the data is not at hand (without either, the user count is found by asking
the gateway, which answers NOT_FOUND past the last id); ``--num-candidates`` / ``--num-results``;
``--deadline-ms``; ``--user-seed``. The target is ``--host`` or [RECPIPE_TARGET].

Ramp experiments: ``RECPIPE_SHAPE=step locust -f loadtest/ --headless -u 64 -t 5m --step-users 8
--step-time 30 ...`` adds 8 users every 30 s up to 64. The shape is off unless RECPIPE_SHAPE=step,
because locust runs *any* shape class it finds in the locustfiles and would ignore ``-u``/``-r``.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any, ClassVar

import gevent
import gevent.lock
import grpc
import numpy as np
from grpc_user import GrpcUser
from locust import LoadTestShape, constant, events, task
from locust.env import Environment
from workload import (
    USER_DISTRIBUTIONS,
    UserSampler,
    WorkloadError,
    sampler_from_count,
    sampler_from_data,
)

from recpipe.config import STEPS
from recpipe.v1 import recommend_pb2, recommend_pb2_grpc

logger = logging.getLogger("recpipe.loadtest")

SHAPE_ENV = "RECPIPE_SHAPE"
_MAX_PROBED_USERS = 1 << 40


#: request type of the per-stage rows: their times are in microseconds
STAGE_TYPE = "stage_us"


class MissingStageTiming(Exception):
    """The gateway answered without a timing entry for this stage (a contract violation)."""


def _log_stage_error(stats: Any, name: str, error: Exception) -> None:
    """A failure of one stage row, kept out of the Aggregated row like its timings."""
    from locust.stats import StatsError

    stats.get(name, STAGE_TYPE).log_error(error)
    key = StatsError.create_key(STAGE_TYPE, name, error)
    entry = stats.errors.get(key)
    if entry is None:
        entry = stats.errors[key] = StatsError(STAGE_TYPE, name, error)
    entry.occurred()


@events.init_command_line_parser.add_listener
def _add_options(parser: Any, **_kwargs: Any) -> None:
    group = parser.add_argument_group("recpipe", "what the recpipe load test sends")
    group.add_argument("--user-dist", choices=USER_DISTRIBUTIONS, default="uniform", env_var="RECPIPE_USER_DIST",
                       help="how user ids are drawn: uniform, or zipf (by activity with --data-dir)")
    group.add_argument("--data-dir", default="", env_var="RECPIPE_DATA",
                       help="the synth-data directory the gateway serves (users.parquet, interactions.parquet)")
    group.add_argument("--num-user-ids", type=int, default=0, env_var="RECPIPE_NUM_USERS",
                       help="draw from user ids 0..N-1 (instead of --data-dir or asking the gateway)")
    group.add_argument("--zipf-s", type=float, default=1.0, env_var="RECPIPE_ZIPF_S",
                       help="Zipf exponent when --user-dist zipf has no --data-dir")
    group.add_argument("--num-candidates", type=int, default=0, env_var="RECPIPE_NUM_CANDIDATES",
                       help="candidates retrieved per query (0 = the service default, 500)")
    group.add_argument("--num-results", type=int, default=0, env_var="RECPIPE_NUM_RESULTS",
                       help="items returned per query (0 = the service default, 10)")
    group.add_argument("--stage-time", choices=("server", "observed"), default="server",
                       env_var="RECPIPE_STAGE_TIME",
                       help="per-stage rows from StageTiming.server_us (default) or .observed_us")
    group.add_argument("--deadline-ms", type=float, default=10_000.0, env_var="RECPIPE_DEADLINE_MS",
                       help="gRPC deadline of each Recommend call")
    group.add_argument("--user-seed", type=int, default=0, env_var="RECPIPE_USER_SEED",
                       help="seed of the user-id draws (each locust user gets its own stream)")
    group.add_argument("--step-users", type=int, default=4, env_var="RECPIPE_STEP_USERS",
                       help=f"users added per step ({SHAPE_ENV}=step)")
    group.add_argument("--step-time", type=float, default=30.0, env_var="RECPIPE_STEP_TIME",
                       help=f"seconds per step ({SHAPE_ENV}=step)")


class RecommendUser(GrpcUser):
    """Sends Recommend for random users back to back (closed loop) and reports every stage."""

    stub_class = recommend_pb2_grpc.RecommendServiceStub
    wait_time = constant(0)

    # One sampler per locust process, built by the first user that starts (it may read Parquet
    # or ask the gateway); the lock keeps the other users from doing the same work meanwhile.
    _sampler: ClassVar[UserSampler | None] = None
    _setup_error: ClassVar[str | None] = None
    _sampler_lock: ClassVar[gevent.lock.Semaphore] = gevent.lock.Semaphore()
    _user_index: ClassVar[itertools.count[int]] = itertools.count()

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        opts = environment.parsed_options
        self.num_candidates = getattr(opts, "num_candidates", 0)
        self.num_results = getattr(opts, "num_results", 0)
        self.deadline_s = getattr(opts, "deadline_ms", 10_000.0) / 1000.0
        self.timing_field = "observed_us" if getattr(opts, "stage_time", "server") == "observed" else "server_us"
        seed = getattr(opts, "user_seed", 0)
        self.rng = np.random.default_rng([seed, next(self._user_index)])

    def on_start(self) -> None:
        with self._sampler_lock:
            if RecommendUser._sampler is None and RecommendUser._setup_error is None:
                try:
                    RecommendUser._sampler = self._build_sampler()
                except WorkloadError as e:
                    RecommendUser._setup_error = str(e)
                    self._stop_the_test(str(e))

    def _stop_the_test(self, reason: str) -> None:
        """A setting that cannot work ends the whole run (exit code 2), not just this user.

        Done in a separate greenlet: quit()/stop() kill every user greenlet, this one included.
        """
        logger.error("recpipe load test: %s", reason)
        self.environment.process_exit_code = 2
        runner = self.environment.runner
        if runner is not None:
            headless = bool(getattr(self.environment.parsed_options, "headless", False))
            gevent.spawn(runner.quit if headless else runner.stop)

    @task
    def recommend(self) -> None:
        if self._sampler is None:  # set-up failed; the test is being stopped
            gevent.sleep(1.0)
            return
        user_id = int(self._sampler.draw(self.rng)[0])
        request = recommend_pb2.RecommendRequest(
            user_id=user_id, num_candidates=self.num_candidates, num_results=self.num_results
        )
        try:
            response = self.stub.Recommend(request, timeout=self.deadline_s)
        except grpc.RpcError:
            return  # the interceptor has recorded it as a failure of Recommend
        self.report_stages(response)

    def report_stages(self, response: recommend_pb2.RecommendResponse) -> None:
        """One ``stage_us`` row per pipeline stage (and, where the stage reports its batcher's split,
        ``stage:NAME queue`` and ``stage:NAME compute`` rows), from the response's StageTiming entries.

        Logged straight into the stage rows' own statistics, not as request events: a request event also
        counts in locust's Aggregated row, which would then add four (or twelve) stage "requests" to every
        Recommend call. Times are in microseconds, because locust keeps whole units below 100 and its CSV
        writes whole-unit percentiles: in milliseconds a 0.3 ms stage would read 0.
        """
        timings = {t.stage: t for t in response.timings}
        stats = self.environment.stats
        for stage in STEPS:
            timing = timings.get(stage)
            name = f"stage:{stage}"
            if timing is None:
                _log_stage_error(stats, name, MissingStageTiming(f"no {stage} timing in response"))
                continue
            stats.get(name, STAGE_TYPE).log(int(getattr(timing, self.timing_field)), 0)
            # queue/compute arrive as 0 from stages without a batcher (batch_size 0): no rows then.
            if int(getattr(timing, "batch_size", 0) or 0) > 0:
                stats.get(f"{name} queue", STAGE_TYPE).log(int(getattr(timing, "queue_us", 0)), 0)
                stats.get(f"{name} compute", STAGE_TYPE).log(int(getattr(timing, "compute_us", 0)), 0)

    def _build_sampler(self) -> UserSampler:
        opts = self.environment.parsed_options
        if self.deadline_s <= 0:
            raise WorkloadError(f"--deadline-ms must be > 0, got {self.deadline_s * 1000:g}")
        if self.num_candidates < 0 or self.num_results < 0:
            raise WorkloadError("--num-candidates and --num-results must be >= 0 (0 = the service default)")
        dist = getattr(opts, "user_dist", "uniform")
        data_dir = getattr(opts, "data_dir", "")
        num_users = getattr(opts, "num_user_ids", 0)
        if data_dir:
            sampler = sampler_from_data(Path(data_dir), dist)
            source = f"{data_dir} ({'weighted by interactions' if dist == 'zipf' else 'uniform'})"
        else:
            if not num_users:
                num_users = self._probe_num_users()
                source = f"{num_users} users found by asking {self.target}"
            else:
                source = f"user ids 0..{num_users - 1}"
            sampler = sampler_from_count(num_users, dist, getattr(opts, "zipf_s", 1.0), getattr(opts, "user_seed", 0))
        logger.info("recpipe load test: %s users from %s, target %s", dist, source, self.target)
        return sampler

    def _probe_num_users(self) -> int:
        """The number of users, found by binary search on NOT_FOUND (user ids are 0..n-1).

        About 2·log2(n) cheap calls through the uninstrumented stub, so they do not count as load.
        """

        def exists(user_id: int) -> bool:
            request = recommend_pb2.RecommendRequest(user_id=user_id, num_candidates=1, num_results=1)
            t0 = time.perf_counter()
            try:
                self.raw_stub.Recommend(request, timeout=self.deadline_s)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return False
                raise WorkloadError(
                    f"could not ask {self.target} for its users ({e.code().name} after "
                    f"{time.perf_counter() - t0:.2f} s: {e.details()}); "
                    "is the gateway up? (or pass --num-user-ids / --data-dir)"
                ) from e
            return True

        if not exists(0):
            raise WorkloadError(f"{self.target} knows no user 0; pass --num-user-ids or --data-dir")
        lo, hi = 0, 1  # exists(lo), hi untested
        while hi < _MAX_PROBED_USERS and exists(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if exists(mid) else (lo, mid)
        return lo + 1


@events.test_start.add_listener
def _forget_previous_run(**_kwargs: Any) -> None:
    # In the web UI a new run may name another host; find its users afresh.
    RecommendUser._sampler = None
    RecommendUser._setup_error = None


class StepLoadShape(LoadTestShape):
    """Step load for ramp experiments: ``--step-users`` more users every ``--step-time`` seconds.

    Climbs to ``-u`` users (give it: headless locust otherwise means 1), holds the last step for one
    step time, then stops; ``-t`` ends it earlier. Users spawn at ``-r`` per second (default: a whole
    step at once).
    Active only with RECPIPE_SHAPE=step (see the module docstring).
    """

    abstract = os.environ.get(SHAPE_ENV, "").strip().lower() != "step"
    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        assert self.runner is not None
        opts = self.runner.environment.parsed_options
        step_users = max(1, int(getattr(opts, "step_users", 4)))
        step_time = max(0.1, float(getattr(opts, "step_time", 30.0)))
        max_users = int(getattr(opts, "num_users", None) or 10 * step_users)
        spawn_rate = float(getattr(opts, "spawn_rate", None) or step_users)
        run_time = getattr(opts, "run_time", None)
        elapsed = self.get_run_time()
        steps = -(-max_users // step_users)  # ceil
        if (run_time and elapsed >= run_time) or elapsed >= (steps + 1) * step_time:
            return None
        users = min(max_users, (int(elapsed // step_time) + 1) * step_users)
        return users, spawn_rate
