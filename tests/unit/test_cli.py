from __future__ import annotations

from recpipe.cli import main


def test_no_command_is_a_usage_error(capsys) -> None:
    assert main([]) == 2


def test_unknown_flag_is_one_line_error_exit_2(capsys) -> None:
    assert main(["synth-data", "--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:")
