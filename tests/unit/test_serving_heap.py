"""``recpipe.serving.heap.settle``: what a loaded stage does before it says SERVING. Run in a child
process, so that this test process's heap is left as it was."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import gc, json, time
from recpipe.serving import heap

class Node:
    def __init__(self): self.other = self

gc.disable()  # only the collections below
loaded = [list(range(10)) for _ in range(200_000)]  # a loaded process's long-lived objects
t0 = time.perf_counter(); gc.collect(); walked_ms = (time.perf_counter() - t0) * 1e3
for _ in range(1000):
    Node()  # cycles left behind by loading: only the collector frees them
before = sum(isinstance(o, Node) for o in gc.get_objects())
frozen = heap.settle("test")
after_nodes = sum(isinstance(o, Node) for o in gc.get_objects())  # frozen objects are not listed
t0 = time.perf_counter(); gc.collect(); full_ms = (time.perf_counter() - t0) * 1e3
print(json.dumps({"walked_ms": walked_ms, "before": before, "after": after_nodes, "frozen": frozen, "full_ms": full_ms,
                  "again": heap.settle("test") >= frozen, "loaded": len(loaded)}))
"""


def test_a_settled_heap_has_its_garbage_collected_and_the_rest_out_of_full_collections() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == 1000 and got["after"] == 0  # the cycles loading left were collected
    assert got["frozen"] >= 200_000 and got["again"]  # the rest is frozen; a second settle keeps it so
    assert got["full_ms"] < got["walked_ms"] / 4  # a full collection no longer walks the loaded objects


FAULTS = r"""
import json, resource, sys
from recpipe.serving import heap

kept = heap.keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def round_():  # a batch call's buffers: a few blocks of a megabyte, alive together, then freed
    held = [bytearray(1 << 20) for _ in range(3)]
    del held
for _ in range(3):
    round_()
f0 = faults()
for _ in range(50):
    round_()
print(json.dumps({"kept": kept, "faults_per_round": (faults() - f0) / 50}))
"""


def _faults(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_settled_stage_keeps_the_memory_it_frees_instead_of_faulting_it_in_again() -> None:
    import platform

    if platform.libc_ver()[0] != "glibc":
        assert _faults("keep")["kept"] is False  # left as it is where malloc is not glibc's
        return
    default, kept = _faults("default"), _faults("keep")
    assert kept["kept"] is True
    # 3 MB freed: glibc returns what is over its trim threshold to the kernel, and the next round
    # faults it back in page by page (480 faults a round here); kept, none
    assert default["faults_per_round"] >= 100 and kept["faults_per_round"] < 10, (default, kept)
