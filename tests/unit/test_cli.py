from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from cli_support import one_line_exit_2

from recpipe.cli import main
from recpipe.errors import UsageError


def test_no_command_is_a_usage_error(capsys) -> None:
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("usage: recpipe")  # help on stderr: nothing ran


def test_unknown_flag_is_one_line_error_exit_2(capsys) -> None:
    assert main(["synth-data", "--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["recpipe: error: unrecognized arguments: --no-such-flag"]  # "recpipe" said once
    assert main(["querygen", "--rate", "x"]) == 2
    assert capsys.readouterr().err == "recpipe: error: querygen: argument --rate: invalid float value: 'x'\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--grace", "-1"], "--grace must be a finite number of seconds >= 0, got -1.0"),
    (["--grace", "nan"], "--grace must be a finite number of seconds >= 0, got nan"),
    (["--startup-timeout", "0"], "--startup-timeout must be a finite number of seconds > 0, got 0.0"),
    (["--workers", "-1"], "--workers must be >= 0, got -1"),
    (["--metrics-port", "-5"], "--metrics-port must be in 0..65535, or -1 (off), got -5"),
    (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--host", "999.1.1.1"], "--host '999.1.1.1' is not an address or name this machine can bind"),
    (["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
])
def test_serve_refuses_bad_shared_flags_before_any_stage_starts(argv, message, tmp_path, capsys) -> None:
    # nothing at --models or --data: a flag checked later would have failed on them instead
    serve = ["serve", "--models", str(tmp_path / "m"), "--data", str(tmp_path / "d"), *argv]
    assert one_line_exit_2(capsys, serve) == f"recpipe: error: {message}"


def test_serve_refuses_cuda_where_there_is_none(tmp_path, capsys) -> None:
    from recpipe.accel.device import no_gpu

    if not no_gpu():
        pytest.skip("a GPU driver is present: --device cuda may be right here")
    assert main(["serve", "--models", str(tmp_path), "--data", str(tmp_path), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--user-id", str(2**64)], f"--user-id {2**64} does not fit the request's int64 field"),
    (["--user-id", "1", "--num-candidates", str(2**31)], "does not fit the request's int32 field"),
    (["--user-id", "1", "--timeout", "nan"], "--timeout must be a number of seconds > 0, got nan"),
    (["--user-id", "1", "--timeout", "inf"], "--timeout must be a number of seconds > 0, got inf"),
])
def test_recommend_refuses_what_its_request_cannot_carry(argv, message, capsys) -> None:
    one_line_exit_2(capsys, ["recommend", "--target", "127.0.0.1:1", *argv], message)  # refused before connecting


def test_recommend_where_nothing_serves_is_one_line_exit_2_as_querygen(capsys) -> None:
    """A newcomer's first mistake: `recpipe recommend` before `recpipe serve`, or on the wrong port. Like
    querygen's "cannot reach", it is the user's to fix: one line, exit 2, not a run failure (1)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    message = one_line_exit_2(capsys, ["recommend", "--user-id", "1", "--target", f":{port}"])
    assert message.startswith(f"recpipe: error: cannot reach the gateway at 127.0.0.1:{port}: connection failed after ")
    assert message.endswith("; is `recpipe serve` running there?")
    assert one_line_exit_2(capsys, ["querygen", "--target", f":{port}", "--queries", "1"]).startswith(
        f"recpipe: error: cannot reach 127.0.0.1:{port}: connection failed after ")


def test_an_output_where_no_file_can_be_created_is_refused_before_the_work(tmp_path, capsys) -> None:
    from recpipe.files import check_writable

    assert main(["synth-data", "--out", "/proc/recpipe-data", "--scale", "0.001", "--quiet"]) == 2
    assert capsys.readouterr().err == ("recpipe: error: cannot write /proc/recpipe-data: cannot write in /proc: "
                                       "No such file or directory\n")
    assert main(["train", "--data", str(tmp_path), "--out", "/proc/recpipe-models"]) == 2
    assert "--out /proc/recpipe-models: cannot write in /proc" in capsys.readouterr().err
    with pytest.raises(UsageError, match="is a directory; give a file name"):
        check_writable(tmp_path, force=True)


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


def test_serve_refuses_a_busy_port_before_any_stage_starts(tmp_path, capsys) -> None:
    """A second chain on a busy port would die stage by stage while its supervisor's health probe, meeting
    the first chain there, took it for SERVING and restarted it from standby forever."""
    import socket

    (tmp_path / "m").mkdir()
    (tmp_path / "d").mkdir()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        base = ["serve", "--models", str(tmp_path / "m"), "--data", str(tmp_path / "d"), "--warm-standby"]
        assert main([*base, "--port", str(port), "--metrics-port", "-1"]) == 2
        assert capsys.readouterr().err == (f"recpipe: error: 127.0.0.1:{port} (gateway) is in use: another recpipe "
                                           "serve? Stop it, or choose another --port (or --metrics-port)\n")
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        other = free.getsockname()[1]
        free.close()
        assert main([*base, "--port", str(other), "--metrics-port", str(port)]) == 2  # the gateway's metrics
        assert f"127.0.0.1:{port} (gateway) is in use" in capsys.readouterr().err


def test_a_ctrl_c_once_the_work_is_done_exits_with_its_code_at_once(tmp_path) -> None:
    """Ctrl-C while the interpreter shuts down (here: joining a thread still running) ends the process at
    once with main's exit code and nothing on stderr, not a traceback or a death by SIGINT."""
    script = tmp_path / "shutdown.py"
    script.write_text(
        "import threading, time\nimport recpipe.cli as cli\n"
        "def linger():\n"
        "    while threading.main_thread().is_alive():  # until the interpreter's shutdown joins this thread\n"
        "        time.sleep(0.01)\n"
        "    print('shutting down', flush=True)\n"
        "    time.sleep(30)\n"
        "threading.Thread(target=linger).start()\n"
        "cli.main = lambda argv=None: 3\ncli.main_entry()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "shutting down\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert (proc.returncode, err) == (3, "")
