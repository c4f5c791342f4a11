from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_modules_are_fresh() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
