"""Runs the sections of a characterization in order, saving the document after each one.

A finished section (present in the document) is skipped on a rerun, save one the budget cut short
(``document.cut_short``), which runs again whole; a section is not started once the budget is spent,
and the document says which were not run, or cut short, and why. The chain of stage processes
is started only when a serving section is still to run; the data paths run last, in this process, on
an idle GPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from recpipe.characterize import document, sections
from recpipe.characterize.gpu import BusySampler
from recpipe.characterize.settings import Settings

SERVING = ("sequential", "sweep", "slo")


def run(settings: Settings, out: Path, doc: dict[str, Any], log_level: str) -> dict[str, Any]:
    path = out / document.FILENAME
    t0 = time.monotonic()

    def time_left() -> float:
        return settings.budget_s - (time.monotonic() - t0)

    done = doc["sections"]
    todo = [s for s in document.SECTIONS if s not in done or document.cut_short(s, done[s])]
    for name in document.SECTIONS:
        if name in done and name not in todo:
            sections.say(f"{name}: finished in an earlier run, skipped")
        elif name in done:
            sections.say(f"{name}: {document.cut_short(name, done[name])} in an earlier run, measured again")
    doc["not_run"] = {}

    def finish(name: str, block: dict[str, Any], started: float) -> None:
        block["elapsed_s"] = round(time.monotonic() - started, 2)
        block["finished_utc"] = document.now_utc()
        done[name] = block
        if short := document.cut_short(name, block):
            doc["not_run"][name] = short
        document.save(path, doc)
        sections.say(f"{name}: {short or 'done'} in {block['elapsed_s']:.1f} s, saved to {path}")

    def out_of_budget(name: str) -> bool:
        if time_left() > 0:
            return False
        doc["not_run"][name] = f"budget of {settings.budget_s:g} s spent"
        sections.say(f"{name}: not started, the budget of {settings.budget_s:g} s is spent (rerun to resume)")
        return True

    if "platform" in todo and not out_of_budget("platform"):
        started = time.monotonic()
        finish("platform", sections.platform_section(settings), started)
    serving = [s for s in SERVING if s in todo]
    if serving and time_left() > 0:
        gpu_wanted = settings.device != "cpu" and done.get("platform", {}).get("gpu", "none") != "none"
        why_not = "CPU run (--device cpu)" if settings.device == "cpu" else "no GPU on this machine"
        with sections.chain(settings, log_level) as ch:
            for name in serving:
                if out_of_budget(name):
                    continue
                started = time.monotonic()
                with BusySampler(gpu_wanted, why_not=why_not) as gpu:
                    if name == "sequential":
                        block = sections.sequential_section(settings, ch)
                    elif name == "sweep":
                        block = sections.sweep_section(settings, ch, time_left, busy=gpu)
                    else:
                        peak = (done.get("sweep") or {}).get("peak_throughput")
                        block = sections.slo_section(settings, ch, peak, time_left)
                block["gpu_busy"] = gpu.result()
                finish(name, block, started)
    else:
        for name in serving:
            out_of_budget(name)
    if "micro" in todo and not out_of_budget("micro"):
        started = time.monotonic()
        finish("micro", sections.micro_section(settings, time_left), started)
    # last: the GPU is idle once the stages and the benches are done with it
    if "data_paths" in todo and not out_of_budget("data_paths"):
        started = time.monotonic()
        finish("data_paths", sections.data_paths_section(settings), started)
    document.save(path, doc)
    if doc["not_run"]:
        sections.say(f"not run or cut short for lack of budget: {', '.join(doc['not_run'])} (rerun with the same "
                     "--out to resume)")
    return doc
