from __future__ import annotations

import subprocess
import sys

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


def test_building_the_parser_imports_no_compute_library():
    """Every recpipe process, each stage's included, builds the whole parser (the bench modules add their
    flags). Polars sizes its thread pool when it is imported, so an import here would fix it before a
    stage applies --threads (it did: the features stage ran 2 Polars threads under --threads 1)."""
    code = ("import sys; from recpipe.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('polars', 'torch', 'faiss') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
