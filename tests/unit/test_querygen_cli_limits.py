"""querygen's limits, checked before anything is sent, allocated or written: the queries one run plans,
finite lengths and rates, the seed, results against candidates, and every output path (no server needed:
the target is a closed port, so an error about anything else proves that it came first)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cli_support import one_line_exit_2

from recpipe.cli import main
from recpipe.errors import UsageError
from recpipe.files import Writer, write_files
from recpipe.querygen.config import MAX_QUERIES, QuerygenConfig
from recpipe.querygen.slo import SloSearch, SloStep, find_max_rate
from recpipe.querygen.workload import CandidateSpec, fixed_candidates, parse_lognormal

TARGET = "127.0.0.1:1"  # nothing listens there: reaching it would fail with "cannot reach"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        # once grew to 23 GB of arrival times and was killed
        (["--mode", "open", "--rate", "1e9", "--duration", "1"], "plans 1,000,000,000 queries; at most 10,000,000 per run"),
        (["--mode", "open", "--rate", "1e6", "--warmup", "5", "--duration", "6"], "plans 11,000,000 queries"),
        (["--mode", "open", "--rate", "10", "--min-queries", "20000000"], "plans 20,000,000 queries"),
        (["--mode", "open", "--rate", "10", "--queries", "2000000000"], "--queries must be in 1..10,000,000"),
        (["--mode", "closed", "--queries", "20000000"], "--queries must be in 1..10,000,000"),
        (["--mode", "open", "--rate", "10", "--duration", "inf"], "--duration must be > 0 seconds (and finite)"),
        (["--duration", "inf"], "--duration must be > 0 seconds (and finite)"),  # sequential ran forever
        (["--duration", "nan"], "--duration must be > 0 seconds (and finite)"),
        (["--warmup", "inf"], "--warmup must be >= 0 seconds (and finite)"),
        (["--timeout", "inf"], "--timeout must be > 0 seconds (and finite)"),
        (["--mode", "open", "--rate", "10", "--slo-p99-ms", "inf"], "--slo-p99-ms must be > 0 (and finite)"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        # every query would be refused by the gateway (num_results > num_candidates)
        (["--num-results", "1000"], "--num-results 1000 is more than the 500 candidates per query"),
        (["--num-candidates", "20", "--num-results", "21"], "more than the 20 candidates per query"),
        (["--candidates-dist", "lognormal:200,1", "--num-results", "100"], "of the queries ask for (lognormal:200,1)"),
    ],
)
def test_limits_are_refused_before_connecting(capsys: pytest.CaptureFixture[str], extra: list[str], match: str) -> None:
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, *extra], match)


def test_results_against_a_candidate_distribution_refuse_only_a_real_share() -> None:
    def config(candidates: CandidateSpec, num_results: int) -> QuerygenConfig:
        return QuerygenConfig(TARGET, "sequential", candidates, num_results=num_results)

    # a lognormal can draw 1 candidate, but at median 200 almost never draws fewer than 10
    config(parse_lognormal("lognormal:200,0.5"), 10)
    config(fixed_candidates(10), 10)
    with pytest.raises(UsageError, match=r"candidates 2\.\d% of the queries"):  # P(X < 4.5) is 2.3%
        config(parse_lognormal("lognormal:10,0.4"), 5)


def test_candidate_quantile_files_are_checked_by_their_lowest_values(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    q = tmp_path / "q.txt"
    q.write_text("0 5\n0.5 100\n1 200\n")  # a quarter of the queries ask for 5..52 candidates
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, "--candidates-file", str(q), "--num-results", "50"],
                     "--num-results 50 is more than the candidates")
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, "--candidates-file", str(q), "--num-results", "5"],
                     "cannot reach")  # every query asks for at least 5


def test_the_slo_search_never_plans_a_step_above_its_max_rate() -> None:
    offered: list[float] = []

    async def measure(rate: float) -> SloStep:  # a server that meets any SLO at any rate
        offered.append(rate)
        return SloStep(rate, rate, 1000.0, 2000.0, 3000.0, 1000, 0)

    result = asyncio.run(find_max_rate(SloSearch(50_000.0, 100.0, max_rate=1000.0), measure))
    assert offered == [100.0, 200.0, 400.0, 800.0, 1000.0]
    assert result.max_rate == 1000.0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--rates", "1e12"], "at most 10,000,000 per run"),  # was numpy's _ArrayMemoryError
        (["--rates", "inf"], "--rates must be positive (and finite)"),
        (["--rates", "nan"], "--rates must be positive (and finite)"),
        (["--duration", "nan"], "--duration must be > 0 seconds"),
        (["--duration", "0"], "--duration must be > 0 seconds"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--num-candidates", "0"], "--num-candidates"),
    ],
)
def test_bench_querygen_validates_before_it_starts(capsys: pytest.CaptureFixture[str], extra: list[str],
                                                   match: str) -> None:
    one_line_exit_2(capsys, ["bench", "querygen", *extra], match, quiet=True)  # not even the header


def test_max_queries_is_what_the_help_says() -> None:
    from recpipe.commands import querygen

    assert f"at most {MAX_QUERIES:,} queries" in " ".join((querygen.__doc__ or "").split())


def test_per_component_help_says_the_gateway_does_not_serve_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["querygen", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "give each stage's own address" in text and "recpipe's gateway serves none of their services" in text


# --- output paths: each refused before the run, and nothing left behind


def test_out_where_no_file_can_be_written_is_refused_first(capsys: pytest.CaptureFixture[str]) -> None:
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, "--out", "/proc/run.json"], "cannot write in /proc")


def test_out_that_is_a_directory_is_refused_even_with_force(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, "--out", str(tmp_path), "--force"], "is a directory")


def test_plot_that_is_a_file_is_refused_first(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, "--plot", str(afile)], "is not a directory")
    assert afile.read_text() == "mine"


def test_plot_that_cannot_be_created_is_refused_first(capsys: pytest.CaptureFixture[str]) -> None:
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, "--plot", "/proc/x"], "cannot create the directory")


def test_plot_with_a_directory_where_a_chart_goes_is_refused_first(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    (tmp_path / "charts" / "latency_cdf.png").mkdir(parents=True)
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, "--plot", str(tmp_path / "charts"), "--force"],
                     "latency_cdf.png is a directory")


def test_a_failed_run_leaves_neither_its_plot_directory_nor_its_out(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    one_line_exit_2(capsys, ["querygen", "--target", TARGET, "--out", str(tmp_path / "run.json"),
                              "--plot", str(tmp_path / "new" / "charts")], "cannot reach")
    assert list(tmp_path.iterdir()) == []  # new/charts was created up front, and removed with new/


def test_a_set_of_files_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    def interrupted(path: Path) -> None:  # Ctrl-C while the second file is being written
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    files: dict[Path, bytes | str | Writer] = {tmp_path / "run.json": "{}", tmp_path / "stage_latency.png": interrupted, tmp_path / "x.png": b"z"}
    with pytest.raises(KeyboardInterrupt):
        write_files(files, force=False)
    assert list(tmp_path.iterdir()) == []  # neither the finished first file nor any temporary one
    written = write_files({tmp_path / "run.json": "{}", tmp_path / "x.png": b"z"}, force=False)
    assert [p.read_bytes() for p in written] == [b"{}", b"z"]
    with pytest.raises(UsageError, match="exists"):
        write_files({tmp_path / "y.png": b"y", tmp_path / "x.png": b"again"}, force=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "x.png"]
