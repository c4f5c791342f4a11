"""``recpipe serve --max-connection-age/--max-connection-age-grace``: flags win over the environment,
which wins over the defaults; bad values are usage errors; the server options gRPC reads."""

from __future__ import annotations

import os

import pytest

from recpipe.cli import build_parser, main
from recpipe.commands.serve import _export_connection_age
from recpipe.errors import UsageError
from recpipe.serving.connection_age import (
    DEFAULT_MAX_CONNECTION_AGE_GRACE_S,
    DEFAULT_MAX_CONNECTION_AGE_S,
    MAX_CONNECTION_AGE_ENV,
    MAX_CONNECTION_AGE_GRACE_ENV,
    ConnectionAge,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MAX_CONNECTION_AGE_ENV, raising=False)
    monkeypatch.delenv(MAX_CONNECTION_AGE_GRACE_ENV, raising=False)


def test_defaults_become_grpc_options() -> None:
    age = ConnectionAge.from_env()
    assert (age.max_age_s, age.grace_s) == (DEFAULT_MAX_CONNECTION_AGE_S, DEFAULT_MAX_CONNECTION_AGE_GRACE_S)
    assert dict(age.options()) == {"grpc.max_connection_age_ms": 30_000, "grpc.max_connection_age_grace_ms": 10_000}
    assert ConnectionAge(max_age_s=0).options() == []  # 0 = never close


def test_environment_then_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_CONNECTION_AGE_ENV, "60")
    monkeypatch.setenv(MAX_CONNECTION_AGE_GRACE_ENV, "2.5")
    assert ConnectionAge.from_env() == ConnectionAge(60.0, 2.5)
    args = build_parser().parse_args(["serve", "--stage", "ranking", "--max-connection-age", "5"])
    _export_connection_age(args)  # what `recpipe serve` does before any server or stage process starts
    assert os.environ[MAX_CONNECTION_AGE_ENV] == "5.0"
    assert ConnectionAge.from_env() == ConnectionAge(5.0, 2.5)


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_bad_environment_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(MAX_CONNECTION_AGE_GRACE_ENV, value)
    with pytest.raises(UsageError, match=r"connection-age-grace|CONNECTION_AGE_GRACE"):
        ConnectionAge.from_env()


def test_bad_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--stage", "ranking", "--max-connection-age", "-3"]) == 2
    assert "--max-connection-age" in capsys.readouterr().err
