"""``recpipe.serving.grpc_io``: the CLI puts every recpipe process on gRPC core's iomgr I/O path, and
the installed core knows the experiments it turns off. Each case runs in a child process: gRPC reads
``GRPC_EXPERIMENTS`` once, when ``grpc`` is imported, and this test process may have imported it already."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from recpipe.serving import grpc_io

# a real call over loopback, on whatever path GRPC_EXPERIMENTS chose
CALL = r"""
import asyncio, os, sys
from recpipe.cli import main
try:
    main(["--version"])  # the CLI chooses the path before it imports any command (and grpc)
except SystemExit:
    pass
import grpc
from grpc import aio

async def echo(request, context):
    return request

async def run():
    server = aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await channel.unary_unary("/t.Echo/Echo")(b"ping", timeout=10)
    await server.stop(None)
    return reply

print(asyncio.run(run()).decode(), os.environ.get("GRPC_EXPERIMENTS"))
"""


def _call(env_experiments: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != grpc_io.ENV}
    if env_experiments is not None:
        env[grpc_io.ENV] = env_experiments
    return subprocess.run([sys.executable, "-c", CALL], capture_output=True, text=True, timeout=60, env=env)


def test_the_cli_puts_its_process_and_children_on_iomgr_and_grpc_core_knows_the_names() -> None:
    if grpc_io.grpcio_version() not in grpc_io.MEASURED:
        pytest.skip(f"grpcio {grpc_io.grpcio_version()} is not one whose cost was measured: gRPC's defaults stay")
    out = _call(None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split() == ["ping", grpc_io.IOMGR]  # in os.environ: the stages it starts inherit it
    # core logs "Unknown experiment: NAME" for a name it does not know: a grpcio that dropped one fails here
    assert "Unknown experiment" not in out.stderr, out.stderr


def test_the_users_grpc_experiments_win_even_empty() -> None:
    out = _call("")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split() == ["ping"]  # left empty: gRPC's own defaults


def test_an_unmeasured_grpcio_or_one_already_imported_keeps_grpcs_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    import grpc  # noqa: F401 - imported: too late to choose

    env: dict[str, str] = {}
    assert "already" in grpc_io.prefer_iomgr(env) and env == {}
    monkeypatch.delitem(sys.modules, "grpc")
    monkeypatch.setattr(grpc_io, "grpcio_version", lambda: (1, 99))
    assert "not measured" in grpc_io.prefer_iomgr(env) and env == {}
    monkeypatch.setattr(grpc_io, "grpcio_version", lambda: (1, 85))
    assert grpc_io.prefer_iomgr(env) == f"{grpc_io.ENV}={grpc_io.IOMGR}" and env == {grpc_io.ENV: grpc_io.IOMGR}
