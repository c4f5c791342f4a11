"""SIGTERM to a real ``recpipe synth-data`` process while it writes: the temporary directory goes, as on
Ctrl-C, and the process exits 143 saying so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def test_sigterm_during_synth_data_removes_its_temporary_directory(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "recpipe", "synth-data", "--out", str(tmp_path / "data"), "--scale", "0.5", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(".data.tmp-") for p in tmp_path.iterdir()):
            assert proc.poll() is None, "synth-data finished before its temporary directory was seen"
            assert time.monotonic() < deadline, "no temporary directory after 60 s"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [], (proc.returncode, err)  # no .data.tmp-*, no dataset
    assert proc.returncode == 143, err
    assert err.strip() == "recpipe: terminated"
