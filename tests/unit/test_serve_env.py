"""``recpipe serve``'s bind host and the gateway's stage targets come from flags, else the environment
(what docker-compose.yml and its host-network override set), else today's defaults."""

from __future__ import annotations

import pytest

from recpipe.cli import build_parser
from recpipe.commands.serve import upstream_targets
from recpipe.stages import REGISTRY

ENV = ("RECPIPE_BIND_HOST", "RECPIPE_FEATURES_TARGET", "RECPIPE_RETRIEVAL_TARGET", "RECPIPE_RANKING_TARGET")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str):
    return build_parser().parse_args(["serve", "--stage", "gateway", *argv])


def gateway_targets(args) -> dict[str, str]:
    return upstream_targets(args, REGISTRY, "gateway")


def test_defaults_without_environment() -> None:
    args = parse()
    assert args.host == "127.0.0.1"
    assert gateway_targets(args) == {"features": "127.0.0.1:50052", "retrieval": "127.0.0.1:50053",
                                     "ranking": "127.0.0.1:50054"}


def test_wildcard_bind_reaches_stages_on_loopback() -> None:
    assert gateway_targets(parse("--host", "0.0.0.0"))["ranking"] == "127.0.0.1:50054"


def test_environment_sets_bind_host_and_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECPIPE_BIND_HOST", "0.0.0.0")
    monkeypatch.setenv("RECPIPE_RANKING_TARGET", "ipv4:127.0.0.1:50054,127.0.0.1:50055")
    monkeypatch.setenv("RECPIPE_FEATURES_TARGET", "dns:///features:50052")
    args = parse()
    assert args.host == "0.0.0.0"
    assert gateway_targets(args) == {"features": "dns:///features:50052", "retrieval": "127.0.0.1:50053",
                                     "ranking": "ipv4:127.0.0.1:50054,127.0.0.1:50055"}


def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECPIPE_BIND_HOST", "0.0.0.0")
    monkeypatch.setenv("RECPIPE_RANKING_TARGET", "dns:///ranking:50054")
    args = parse("--host", "127.0.0.1", "--ranking", "127.0.0.1:6000")
    assert args.host == "127.0.0.1"
    assert gateway_targets(args)["ranking"] == "127.0.0.1:6000"


def test_empty_environment_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECPIPE_BIND_HOST", "")
    monkeypatch.setenv("RECPIPE_RANKING_TARGET", "")
    args = parse()
    assert args.host == "127.0.0.1" and gateway_targets(args)["ranking"] == "127.0.0.1:50054"


def test_serve_checks_the_repository_where_a_stage_reads_it() -> None:
    """``recpipe serve`` checks --models against --data before any stage starts when one of its stages reads
    the repository (its spec says so): recpipe's model stages do, the gateway does not, and a registry of
    stages that read none (the tests' toy stages, served over empty directories) is not checked."""
    from recpipe.serving.spec import Registry, StageSpec

    assert {s.name for s in REGISTRY if s.reads_models} == {"features", "retrieval", "ranking"}
    assert REGISTRY.reads_models
    assert not Registry([StageSpec("toy", port_offset=0, build=lambda cfg: None)]).reads_models
