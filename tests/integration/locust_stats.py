"""Locust's final statistics, read from the summary it prints at exit (not from its CSV).

Locust rewrites ``--csv`` files about once a second while it runs and not again at exit, so on a busy
machine the CSV can trail the run, even miss rows. The summary printed at exit (``--only-summary``
prints only that one) holds the final numbers. Not imported from locust itself: importing it
monkey-patches the test process for gevent.
"""

from __future__ import annotations

import re

#: TYPE NAME  REQS  FAILS(PCT%) | AVG MIN MAX MED | REQ/S FAILURES/S   (Aggregated has no type)
_REQUESTS = re.compile(r"^(\S*)\s+(.+?)\s+(\d+)\s+(\d+)\(\d+\.\d+%\)\s+\|\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|"
                       r"\s+([\d.]+)\s+([\d.]+)\s*$")
#: TYPE NAME  50% 66% 75% 80% 90% 95% 98% 99% 99.9% 99.99% 100%  REQS
_PERCENTILES = re.compile(r"^(\S*)\s+(.*?[A-Za-z_])\s+((?:\d+\s+){11})(\d+)\s*$")


def final_stats(stderr: str) -> dict[str, dict[str, str]]:
    """``{name: row}`` with the CSV's column names (Type, Request Count, Failure Count, Average Response
    Time, Median Response Time, Requests/s, 50%) from the last tables locust printed; ``Aggregated``
    included (Type ``""``). Times are as printed: whole units."""
    rows: dict[str, dict[str, str]] = {}
    for line in stderr.splitlines():
        m = _REQUESTS.match(line)
        if m:
            rows[m.group(2)] = {"Type": m.group(1), "Request Count": m.group(3), "Failure Count": m.group(4),
                                "Average Response Time": m.group(5), "Median Response Time": m.group(8),
                                "Requests/s": m.group(9)}
            continue
        m = _PERCENTILES.match(line)
        if m and m.group(2) in rows:
            rows[m.group(2)]["50%"] = m.group(3).split()[0]
    return rows
