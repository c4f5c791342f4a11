"""``--replicas``: its values, ``auto`` from the cores and each stage's cost, the ports and targets of
every replica, and the command lines the supervisor runs (recpipe.serving.launch, Registry.auto_replicas)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from recpipe.cli import main
from recpipe.config import normalize_target
from recpipe.errors import UsageError
from recpipe.serving import launch
from recpipe.serving.spec import CORES_PER_PROCESS, GPU_CORES_PER_PROCESS
from recpipe.stages import REGISTRY

ONE_EACH = {"features": 1, "retrieval": 1, "ranking": 1, "gateway": 1}


def _flag(argv: tuple[str, ...], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_named_counts_and_the_others_one() -> None:
    counts, line = launch.resolve_replicas(REGISTRY, launch.replicas_arg(" ranking=2,gateway=3 "))
    assert counts == {"features": 1, "retrieval": 1, "ranking": 2, "gateway": 3}
    assert line == "replicas: features 1, retrieval 1, ranking 2, gateway 3"
    assert launch.resolve_replicas(REGISTRY, None) == (ONE_EACH, "replicas: one process per stage")
    assert launch.resolve_replicas(REGISTRY, "2")[0] == dict.fromkeys(ONE_EACH, 2)


@pytest.mark.parametrize("bad", ["", "ranking", "ranking=", "ranking=0", "ranking=-1", "ranking=x",
                                 f"ranking={launch.MAX_REPLICAS + 1}", "0", "ranking=2,ranking=3", "ranking=2;gateway=2",
                                 "ranking=2,"])
def test_bad_values_are_refused_by_the_parser(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        launch.replicas_arg(bad)


def test_an_unknown_stage_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown stage 'rankin': choose features, retrieval, ranking, gateway"):
        launch.resolve_replicas(REGISTRY, "rankin=2")


@pytest.mark.parametrize("argv", [
    ["serve", "--replicas", "ranking=0"],
    ["serve", "--replicas", "nonsense"],
    ["serve", "--replicas", "nosuchstage=2"],
    ["serve", "--stage", "ranking", "--replicas", "ranking=2"],
    ["serve", "--reuse-port"],
    ["demo", "--replicas", "ranking=99"],
    ["characterize", "--out", "x", "--replicas", "ranking=0"],
])
def test_cli_refuses_bad_replicas_in_one_line_with_exit_2(argv: list[str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    if "--stage" not in argv and argv[0] == "serve":  # real directories: the replicas are what is wrong
        argv = [*argv, "--models", str(tmp_path), "--data", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:"), err
    assert "replicas" in err[0] or "--reuse-port" in err[0], err


def test_auto_keeps_one_process_per_stage_on_two_cores() -> None:
    # The four processes already share two cores: a fifth adds memory and context switches, no CPU.
    assert REGISTRY.auto_replicas(2, launch.MAX_REPLICAS) == ONE_EACH
    smallest = CORES_PER_PROCESS * (len(REGISTRY) + 1)
    assert REGISTRY.auto_replicas(smallest - 1, launch.MAX_REPLICAS) == ONE_EACH
    assert sum(REGISTRY.auto_replicas(smallest, launch.MAX_REPLICAS).values()) == len(REGISTRY) + 1


def test_auto_on_this_machine() -> None:
    cores = len(os.sched_getaffinity(0))
    counts, line = launch.resolve_replicas(REGISTRY, "auto")
    assert line.startswith(f"replicas: auto on {cores} core")
    if cores < CORES_PER_PROCESS * (len(REGISTRY) + 1):
        assert counts == ONE_EACH and "one process per stage" in line


def test_auto_grows_the_costliest_stages_within_the_cores() -> None:
    for cores in (16, 32, 64, 512):
        counts = REGISTRY.auto_replicas(cores, launch.MAX_REPLICAS)
        assert min(counts.values()) >= 1 and max(counts.values()) <= launch.MAX_REPLICAS
        assert sum(counts.values()) <= max(len(REGISTRY), cores // CORES_PER_PROCESS)
        with_gpu = REGISTRY.auto_replicas(cores, launch.MAX_REPLICAS, gpu=True)
        assert sum(with_gpu.values()) <= max(len(REGISTRY), int(cores // GPU_CORES_PER_PROCESS))
    big = REGISTRY.auto_replicas(16, launch.MAX_REPLICAS)  # ranking costs most per query, then the gateway
    assert big["ranking"] > big["features"] and big["gateway"] > big["features"]
    assert sum(big.values()) == 8
    # with a GPU the model stages cost their serving alone and a process keeps about one core busy at
    # the peak, so there are more processes and the gateway grows first: on the H200 machine (78cf8d1)
    # these counts gave 1.6x the rate at p99 <= 20 ms of 2 per stage, in the same lease
    gpu = REGISTRY.auto_replicas(16, launch.MAX_REPLICAS, gpu=True)
    assert gpu == {"features": 3, "retrieval": 2, "ranking": 2, "gateway": 4}
    assert REGISTRY.auto_replicas(10, launch.MAX_REPLICAS, gpu=True)["gateway"] == 2
    assert REGISTRY.auto_replicas(6, launch.MAX_REPLICAS, gpu=True) == ONE_EACH
    assert sum(REGISTRY.auto_replicas(7, launch.MAX_REPLICAS, gpu=True).values()) == len(REGISTRY) + 1
    counts, line = launch.resolve_replicas(REGISTRY, "auto", "cpu")
    assert "with a GPU" not in line


def test_threads_auto_are_shared_among_a_stage_replicas() -> None:
    one = REGISTRY.auto_threads(16)
    split = REGISTRY.auto_threads(16, {"ranking": 3})
    assert split["ranking"] == round(one["ranking"] / 3) and split["features"] == one["features"]
    assert REGISTRY.auto_threads(2, {"ranking": 2}) == {"features": 1, "retrieval": 1, "ranking": 1, "gateway": 0}
    _, line = launch.resolve_threads(REGISTRY, None, {"ranking": 2})
    assert "x2 processes" in line and line.startswith("threads: auto on")


def test_ports_and_targets_of_replicas_from_a_base_port() -> None:
    replicas = {"features": 1, "retrieval": 1, "ranking": 2, "gateway": 2}
    ports = launch.allocate_ports(REGISTRY, "127.0.0.1", 50051, None, replicas)
    assert [(p.port, p.own, p.metrics) for p in ports["ranking"]] == [(50054, 50054, 51054), (50154, 50154, 51154)]
    # the gateway, which no stage calls, shares its port; each replica answers alone on its own
    assert [(p.port, p.own, p.metrics) for p in ports["gateway"]] == [(50051, 50151, 51151), (50051, 50251, 51251)]
    assert [p.shared for p in ports["gateway"]] == [True, True] and not ports["ranking"][1].shared
    stages = launch.supervised_stages(REGISTRY, models=Path("m"), data=Path("d"), host="127.0.0.1", ports=ports)
    by_name = {s.name: s for s in stages}
    assert list(by_name) == ["features", "retrieval", "ranking#1", "ranking#2", "gateway#1", "gateway#2"]
    rank2, gw1 = by_name["ranking#2"], by_name["gateway#1"]
    assert rank2.stage == "ranking" and rank2.address == "127.0.0.1:50154"
    assert rank2.target == "ipv4:127.0.0.1:50054,127.0.0.1:50154"
    assert _flag(rank2.argv, "--port") == "50154" and "--bind-after-load" in rank2.argv and "--reuse-port" not in rank2.argv
    assert gw1.address == "127.0.0.1:50151" and gw1.target == "127.0.0.1:50051"
    assert _flag(gw1.argv, "--port") == "50051" and _flag(gw1.argv, "--own-port") == "50151"
    assert "--reuse-port" in gw1.argv and "--bind-after-load" in gw1.argv
    assert _flag(gw1.argv, "--ranking") == "ipv4:127.0.0.1:50054,127.0.0.1:50154"
    assert _flag(gw1.argv, "--features") == "127.0.0.1:50052"
    # one process per stage: the names, ports and command lines of before
    alone = launch.supervised_stages(REGISTRY, models=Path("m"), data=Path("d"), host="127.0.0.1",
                                     ports=launch.allocate_ports(REGISTRY, "127.0.0.1", 50051, None))
    assert [s.name for s in alone] == list(ONE_EACH)
    assert all("--bind-after-load" not in s.argv and "--reuse-port" not in s.argv for s in alone)


def test_free_ports_for_replicas_and_the_port_ceiling() -> None:
    ports = launch.allocate_ports(REGISTRY, "127.0.0.1", 0, -1, {"ranking": 3, "gateway": 2})
    ranking = [p.port for p in ports["ranking"]]
    assert len(set(ranking)) == 3 and all(p.metrics is None for ps in ports.values() for p in ps)
    assert len({p.port for p in ports["gateway"]}) == 1 and len({p.own for p in ports["gateway"]}) == 2
    with pytest.raises(UsageError, match="over 65535"):
        launch.allocate_ports(REGISTRY, "127.0.0.1", 64000, None, {"ranking": 9})


def test_replica_targets_list_addresses() -> None:
    assert launch.replica_target(["127.0.0.1:50054"]) == "127.0.0.1:50054"
    assert launch.replica_target(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert launch.replica_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    with pytest.raises(UsageError, match="IP address"):
        launch.replica_target(["localhost:1", "localhost:2"])
    with pytest.raises(UsageError, match="IPv4 and IPv6"):
        launch.replica_target(["127.0.0.1:1", "[::1]:2"])
    # one generator process reaches every gateway replica at its own port, balanced per call
    ports = launch.allocate_ports(REGISTRY, "127.0.0.1", 50051, None, {"gateway": 2})
    stages = launch.supervised_stages(REGISTRY, models=Path("m"), data=Path("d"), host="127.0.0.1", ports=ports)
    assert launch.direct_target(stages, "gateway") == "ipv4:127.0.0.1:50151,127.0.0.1:50251"
    assert launch.direct_target(stages, "ranking") == "127.0.0.1:50054"
    # the channel helper takes such a target as it is (tests/integration/test_round_robin.py calls over one)
    assert normalize_target("ipv4:127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"


def test_free_ports_are_distinct_even_when_the_kernel_hands_one_out_twice(monkeypatch) -> None:
    handed = iter([41000, 41000, 41001, 41000, 41002, 41003, 41001, *range(41004, 41100)])
    monkeypatch.setattr(launch, "free_port", lambda host: next(handed))
    ports = launch.allocate_ports(REGISTRY, "127.0.0.1", 0, 0, {"ranking": 2, "gateway": 2})
    every = [p for ps in ports.values() for q in ps for p in (q.own, q.metrics)]
    assert len(every) == len(set(every))


def test_plan_chain_is_the_steps_serve_demo_and_characterize_take(tmp_path: Path) -> None:
    """``plan_chain`` from the flags: replicas, ports, threads and CPUs as the separate steps give them."""
    models, data = tmp_path / "m", tmp_path / "d"
    models.mkdir()
    data.mkdir()
    planned = launch.plan_chain(REGISTRY, models=models, data=data, host="127.0.0.1", replicas="ranking=2",
                                threads=1, affinity="auto", device="cpu", base=50051, metrics=None,
                                extra=["--max-batch", "8"])
    names = [p.name for p in planned.processes]
    assert names == ["features", "retrieval", "ranking#1", "ranking#2", "gateway"]
    by_name = {p.name: p for p in planned.processes}
    assert _flag(by_name["ranking#2"].argv, "--port") == "50154"
    assert _flag(by_name["gateway"].argv, "--ranking") == "ipv4:127.0.0.1:50054,127.0.0.1:50154"
    assert all(_flag(p.argv, "--threads") == "1" and _flag(p.argv, "--max-batch") == "8" for p in planned.processes)
    replicas_line, threads_line, placed = planned.said
    assert replicas_line == launch.resolve_replicas(REGISTRY, "ranking=2", "cpu")[1]
    assert threads_line == "threads: 1 per stage process" and placed.startswith("affinity: ")
    off = launch.plan_chain(REGISTRY, models=models, data=data, host="127.0.0.1", affinity="off")
    assert all("--cpus" not in p.argv for p in off.processes) and off.said[2].startswith("affinity: off")
    with pytest.raises(UsageError, match=r"--models .*: no such directory"):
        launch.plan_chain(REGISTRY, models=tmp_path / "none", data=data, host="127.0.0.1")
    with pytest.raises(UsageError, match=r"--data .*: no such directory"):
        launch.plan_chain(REGISTRY, models=models, data=tmp_path / "none", host="127.0.0.1")
