"""``--affinity`` and ``--cpus``: where the stage processes run (``recpipe.serving.affinity``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from recpipe.cli import main
from recpipe.serving.affinity import format_cpus, parse_cpus, plan
from recpipe.serving.launch import allocate_ports, supervised_stages
from recpipe.serving.threads import usable_cores, usable_cpus
from recpipe.stages import registry


@pytest.mark.parametrize(("text", "cpus"), [("1", (1,)), ("0-3", (0, 1, 2, 3)), ("5,0-1,1", (0, 1, 5))])
def test_cpu_lists_parse_and_print_as_the_kernel_writes_them(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1,,2", "1-"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="CPU list"):
        parse_cpus(text)


def test_auto_gives_ranking_a_core_of_its_own_where_the_processes_outnumber_the_cores() -> None:
    placement, line = plan(registry(), "auto", {}, registry().auto_threads(2), cores=[0, 1])
    assert placement == {"ranking": [(1,)], "features": [(0,)], "retrieval": [(0,)]}
    assert line.startswith("affinity: auto on 2 cores, 4 processes: ranking on CPU 1; features, retrieval on CPU 0; "
                           "gateway on any")


def test_the_entry_stage_is_never_confined() -> None:
    """The door keeps every core it may use, so it can still refuse at once when the stages are saturated."""
    stages = registry()
    for cores, replicas in (([0, 1], {}), ([0, 1, 2], {"ranking": 2}), ([0, 1, 2, 3, 4], {"gateway": 3, "ranking": 2})):
        placement, _ = plan(stages, "auto", replicas, 1, cores=cores)
        assert placement and stages.entry.name not in placement, (cores, replicas)


def test_auto_sizes_the_own_cores_by_threads_and_replicas() -> None:
    placement, _ = plan(registry(), "auto", {"ranking": 2, "gateway": 2}, 2, cores=[0, 2, 4, 6, 8])
    assert placement["ranking"] == [(6, 8), (2, 4)]
    assert "gateway" not in placement and placement["features"] == [(0,)]


@pytest.mark.parametrize(("cores", "replicas", "threads", "why"), [
    ([0, 1, 2, 3], {}, 1, "4 processes on 4 cores"),  # each process can have a core
    ([0], {}, 1, "would take 1 of 1 cores"),  # the others would have none
    ([0, 1], {"ranking": 2}, 1, "would take 2 of 2 cores"),
    ([0, 1, 2], {}, 3, "would take 3 of 3 cores"),
])
def test_auto_leaves_placement_to_the_kernel_where_pinning_cannot_help(cores, replicas, threads, why) -> None:
    placement, line = plan(registry(), "auto", replicas, threads, cores=cores)
    assert placement == {}
    assert "every process anywhere" in line and why in line


def test_off_places_nothing() -> None:
    assert plan(registry(), "off", {}, 1, cores=[0, 1]) == ({}, "affinity: off (every stage process may run on any core)")


def test_the_supervisor_passes_each_process_its_cpus(tmp_path) -> None:
    stages = registry()
    replicas = {"ranking": 2}
    cpus, _ = plan(stages, "auto", replicas, 1, cores=[0, 1, 2])
    ports = allocate_ports(stages, "127.0.0.1", 0, -1, replicas)
    processes = supervised_stages(stages, models=tmp_path, data=tmp_path, host="127.0.0.1", ports=ports, threads=1,
                                  cpus=cpus)
    given = {p.name: p.argv[p.argv.index("--cpus") + 1] if "--cpus" in p.argv else None for p in processes}
    assert given == {"features": "0", "retrieval": "0", "ranking#1": "2", "ranking#2": "1", "gateway": None}
    unplaced = supervised_stages(stages, models=tmp_path, data=tmp_path, host="127.0.0.1", ports=ports, threads=1)
    assert not any("--cpus" in p.argv for p in unplaced)


def test_cpus_pins_every_thread_of_the_process() -> None:
    """In a child process: a thread started before the pin and one started after both run on the CPU
    given, and the cores the chain shares (what the gateway weighs its processes against) are still all."""
    cpu = usable_cpus()[-1]
    code = (
        "import os, threading\n"
        "from recpipe.serving.affinity import chain_cores, pin\n"
        "ev = threading.Event(); before = threading.Thread(target=ev.wait); before.start()\n"
        f"pin(({cpu},))\n"
        "after = threading.Thread(target=ev.wait); after.start()\n"
        "print(sorted({c for t in os.listdir('/proc/self/task') for c in os.sched_getaffinity(int(t))}), chain_cores())\n"
        "ev.set()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{cpu}] {len(usable_cpus())}"  # the chain's cores stay the machine's


def test_bad_affinity_flags_are_one_line_usage_errors(capsys, tmp_path) -> None:
    beyond = max(usable_cpus()) + 1
    assert main(["serve", "--stage", "ranking", "--cpus", str(beyond), "--models", str(tmp_path),
                 "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--cpus {beyond}: this process may only run on CPUs {format_cpus(usable_cpus())}" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["serve", "--stage", "ranking", "--affinity", "auto"]) == 2
    assert "--affinity only applies to --stage all" in capsys.readouterr().err
    assert main(["serve", "--cpus", "0", "--models", str(tmp_path), "--data", str(tmp_path)]) == 2
    assert "--cpus only applies to --stage NAME" in capsys.readouterr().err
    for argv in (["serve", "--affinity", "sometimes"], ["serve", "--cpus", "x"], ["demo", "--affinity", "1"],
                 ["characterize", "--out", str(tmp_path), "--affinity", "on"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert ("--cpus" if "--cpus" in argv else "--affinity") in err and len(err.strip().splitlines()) == 1, err


def test_the_usable_cpus_are_this_process_s_mask_and_usable_cores_their_count() -> None:
    assert set(usable_cpus()) == os.sched_getaffinity(0)
    assert usable_cores() == len(os.sched_getaffinity(0))
