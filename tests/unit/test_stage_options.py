"""A stage's options are declared once (``recpipe/<stage>/spec.py``): validated in the dataclass, turned
into ``recpipe serve`` flags and back, each shared flag once; and the batcher resolves "auto" once."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from recpipe.errors import UsageError
from recpipe.gateway.options import DEFAULT_HOP_UPSTREAM_WAIT_US, GatewayOptions
from recpipe.ranking.options import RankingOptions
from recpipe.retrieval.options import RetrievalOptions
from recpipe.serving.batcher import BatchConfig, Batcher
from recpipe.serving.options import merged_argv
from recpipe.stages import REGISTRY


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    REGISTRY.add_option_arguments(parser)
    return parser.parse_args(argv)


def test_options_validate_once_in_their_stage() -> None:
    for make, match in ((lambda: RetrievalOptions(precision="fp8"), "--retrieval-precision"),
                        (lambda: RetrievalOptions(rescore=-1), "--rescore"),
                        (lambda: RetrievalOptions(rescore=65), "--rescore"),
                        (lambda: RankingOptions(embeddings="disk"), "--embeddings"),
                        (lambda: RankingOptions(precision="fp16"), "--ranking-precision"),
                        (lambda: GatewayOptions(max_in_flight=0), "--max-in-flight"),
                        (lambda: GatewayOptions(hop_max_batch=0), r"--hop-max-batch must be 1\.\.256"),
                        (lambda: GatewayOptions(hop_max_batch=257), r"--hop-max-batch must be 1\.\.256 \(a stage's")):
        with pytest.raises(UsageError, match=match):
            make()


def test_options_round_trip_through_the_command_line() -> None:
    chosen = {"retrieval": RetrievalOptions(cuda_graphs=False, precision="bf16", rescore=4),
              "ranking": RankingOptions(cuda_graphs=False, precision="int8", embeddings="host"),
              "gateway": GatewayOptions(max_in_flight=7, hop_max_batch=8, hop_transport="rpc")}
    argv = merged_argv(chosen.values())
    assert argv.count("--no-cuda-graphs") == 1  # one flag for both torch stages
    assert argv == ["--no-cuda-graphs", "--retrieval-precision", "bf16", "--rescore", "4",
                    "--ranking-precision", "int8", "--embeddings", "host", "--max-in-flight", "7",
                    "--hop-max-batch", "8", "--hop-queue-delay-us", "0", "--hop-upstream-wait-us",
                    "auto", "--hop-max-in-flight", "0", "--hop-transport", "rpc"]
    back = REGISTRY.options(parse(argv))
    for name, opts in chosen.items():
        assert back[name] == opts
    assert REGISTRY.options(parse([]))["retrieval"] == RetrievalOptions()


def test_the_upstream_wait_is_on_only_where_the_chain_outnumbers_the_cores() -> None:
    auto = GatewayOptions()
    assert auto.hop_upstream_wait_us == "auto"
    assert auto.upstream_wait_us(processes=4, cores=2) == DEFAULT_HOP_UPSTREAM_WAIT_US  # the 2-core VM
    assert auto.hops(processes=5, cores=2).upstream_wait_us == DEFAULT_HOP_UPSTREAM_WAIT_US  # compose
    assert auto.upstream_wait_us(processes=4, cores=4) == 0
    assert auto.hops(processes=7, cores=16).upstream_wait_us == 0  # the H200 box, 2 replicas a stage
    for given in (0, 500, "0", "500"):
        chosen = REGISTRY.options(parse(["--hop-upstream-wait-us", str(given)]))["gateway"]
        assert isinstance(chosen, GatewayOptions)
        assert chosen == GatewayOptions(hop_upstream_wait_us=int(given))  # a number given is used as is
        assert chosen.upstream_wait_us(processes=4, cores=2) == chosen.upstream_wait_us(processes=4, cores=64) == int(given)
    for bad in ("-1", "2ms", ""):
        with pytest.raises(UsageError, match="--hop-upstream-wait-us must be a number of µs or auto"):
            REGISTRY.options(parse(["--hop-upstream-wait-us", bad]))
    assert auto.hops(processes=4, cores=2).stream and not GatewayOptions(hop_transport="rpc").hops(4, 2).stream
    with pytest.raises(UsageError, match="--hop-transport must be stream or rpc, got 'udp'"):
        GatewayOptions(hop_transport="udp")
    with pytest.raises(UsageError, match="--hop-upstream-wait-us"):
        GatewayOptions(hop_upstream_wait_us=-1)


def test_a_bad_value_on_the_command_line_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"--rescore must be in 0\.\.64"):
        REGISTRY.options(parse(["--rescore", "99"]))


def test_batch_config_round_trips_and_auto_resolves_without_mutating() -> None:
    cfg = BatchConfig(max_batch=4, max_queue_delay_us=50, max_queue=9)
    parser = argparse.ArgumentParser()
    BatchConfig.add_arguments(parser)
    assert BatchConfig.from_namespace(parser.parse_args(cfg.to_argv())) == cfg
    auto = BatchConfig()
    assert auto.for_device("cuda:0 (H100)").max_batch == 32 and auto.for_device("cpu").max_batch == 1
    assert auto.max_batch == 0


def test_a_batcher_given_auto_serves_instead_of_spinning() -> None:
    """``max_batch=0`` ("auto") once reached ``_take(0)``, which took nothing, so the worker spun forever
    and no request was answered. The batcher now resolves it at construction."""

    async def go() -> list[int]:
        config = BatchConfig()
        batcher: Batcher[int, int] = Batcher("toy.Double", lambda qs: [q * 2 for q in qs], config, inline=True)
        assert batcher.config.max_batch == 1 and config.max_batch == 0
        try:
            done = await asyncio.wait_for(asyncio.gather(*(batcher.submit(i) for i in range(3))), 10)
            return [d.value for d in done]
        finally:
            await batcher.close()

    assert asyncio.run(go()) == [0, 2, 4]


def test_threads_auto_shares_the_cores_by_each_stage_cost() -> None:
    import argparse as ap

    from recpipe.serving.launch import threads_arg

    assert REGISTRY.auto_threads(2) == {"features": 1, "retrieval": 1, "ranking": 1, "gateway": 0}
    big = REGISTRY.auto_threads(16)
    assert big["gateway"] == 0 and big["ranking"] > big["retrieval"] >= big["features"] >= 1
    assert 15 <= sum(big.values()) <= 17  # the cores, up to rounding
    assert threads_arg("auto") is None and threads_arg("3") == 3
    for bad in ("-1", "many"):
        with pytest.raises(ap.ArgumentTypeError, match="auto or a number"):
            threads_arg(bad)
