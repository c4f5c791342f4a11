"""What a CLI test asks of a refusal, shared by the CLI tests: exit code 2 and one line on stderr,
"recpipe: error: ...", the project's answer to bad input on the command line."""

from __future__ import annotations

import pytest

from recpipe.cli import main


def one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str = "", *,
                    quiet: bool = False) -> str:
    """Run ``recpipe ARGV``: it exits 2 with one stderr line that starts "recpipe: error:" and holds
    ``needle``; -> that line. ``quiet``: nothing on stdout either (refused before it printed anything)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("recpipe: error:"), err
    assert needle in err[0], err[0]
    if quiet:
        assert captured.out == "", captured.out
    return err[0]
