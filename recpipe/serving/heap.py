"""The serving process's heap, settled once it has loaded: collected, then frozen out of the collector.

A loaded stage holds hundreds of thousands of long-lived Python objects (torch, Polars, FAISS, the
compiled forward's graphs: 488k in the ranking stage at scale 0.1). CPython's full (generation 2)
collection walks all of them: 225 ms in that process, 70-200 ms seen in the stages while they loaded,
and the event loop answers nothing meanwhile. One falls due whenever the objects that survived
collections grow by a quarter, so a long run meets them. ``gc.freeze()`` moves every object alive at
load into a permanent generation that collections skip, so a later full collection walks only what
serving allocated since; the objects frozen stay alive, as they would have anyway (the process holds
them until it exits). Instagram's web servers do the same after fork.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def settle(name: str) -> int:
    """Collect what loading left behind, then freeze the rest (see module doc); returns the objects
    frozen in all. Cheap when called again: only what was allocated since is collected and frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects frozen out of the garbage collector after load (%.0f ms)", name, frozen,
             (time.perf_counter() - t0) * 1e3)
    return frozen
