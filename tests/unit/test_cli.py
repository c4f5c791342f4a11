from __future__ import annotations

from recpipe.cli import main


def test_no_command_is_a_usage_error(capsys) -> None:
    assert main([]) == 2


def test_unknown_flag_is_one_line_error_exit_2(capsys) -> None:
    assert main(["synth-data", "--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:")


def test_help_shows_no_restructuredtext_double_backticks(capsys) -> None:
    import pytest

    from recpipe.cli import COMMANDS, build_parser

    parser = build_parser()
    texts = [parser.format_help()]
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in COMMANDS:
        texts.append(sub.choices[name].format_help())
    bench = next(a for a in sub.choices["bench"]._actions if a.dest == "benchmark")
    texts += [p.format_help() for p in bench.choices.values()]
    assert len(texts) > len(COMMANDS) + 3
    for text in texts:
        assert "``" not in text
    with pytest.raises(SystemExit):
        main(["querygen", "--help"])
    assert "``" not in capsys.readouterr().out
