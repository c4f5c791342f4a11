"""recpipe train's torch threads and the wait policy of their OpenMP workers (recpipe/training/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from recpipe.training import threads

# a fresh interpreter: OpenMP reads the policy once, when torch loads, so only a new process shows it
PROBE = ("import os, sys; from recpipe.training import threads; threads.import_with_sleeping_workers(); "
         "import torch; print(threads.wait_policy(), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules, "
         "torch.get_num_threads(), threads.training_threads(0), threads.training_threads(3))")


def probe(policy: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != threads.WAIT_POLICY_ENV}
    if policy is not None:
        env[threads.WAIT_POLICY_ENV] = policy
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_torch_loads_with_sleeping_workers_and_the_environment_is_put_back() -> None:
    imported_with, env_after, loaded, default, auto, asked = probe(None)
    assert (imported_with, env_after, loaded) == ("PASSIVE", "None", "True")
    # sleeping workers do not take a shared machine's other core: every core, whatever the count
    assert auto == default and asked == "3"


def test_a_policy_the_user_chose_is_kept() -> None:
    imported_with, env_after, _, default, auto, _ = probe("ACTIVE")
    assert (imported_with, env_after) == ("ACTIVE", "ACTIVE")
    assert int(auto) == (1 if (os.cpu_count() or 1) <= 2 else int(default))


@pytest.mark.parametrize(("cores", "policy", "expected"), [
    (2, None, 1), (2, "ACTIVE", 1), (1, None, 1), (2, "passive", None), (16, None, None), (16, "ACTIVE", None)])
def test_auto_threads_once_torch_is_loaded(cores: int, policy: str | None, expected: int | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # torch is loaded in this process: the environment it started with is what its workers follow
    monkeypatch.setattr(threads, "_imported_with", [])
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    if policy is None:
        monkeypatch.delenv(threads.WAIT_POLICY_ENV, raising=False)
    else:
        monkeypatch.setenv(threads.WAIT_POLICY_ENV, policy)
    env_before = dict(os.environ)
    threads.import_with_sleeping_workers()  # too late to matter: changes nothing
    assert dict(os.environ) == env_before and threads._imported_with == []
    assert threads.training_threads(0) == (torch.get_num_threads() if expected is None else expected)
    assert threads.training_threads(5) == 5
