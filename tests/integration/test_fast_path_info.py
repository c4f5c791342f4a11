"""GetInfo of a served chain reports the GPU fast-path settings (eager and fp32 on the CPU)."""

from __future__ import annotations


def test_getinfo_reports_the_fast_path_settings(serving_chain) -> None:
    from recpipe.client import RecommendClient

    with RecommendClient(serving_chain.ranking.address) as client:
        ranking = client.info().details
    with RecommendClient(serving_chain.retrieval.address) as client:
        retrieval = client.info().details
    assert ranking["cuda_graphs"] == "eager" and ranking["embeddings"] == "device"
    assert ranking["graphs_captured"] == "0"
    assert retrieval["precision"] == "fp32" and retrieval["cuda_graphs"] == "eager"
