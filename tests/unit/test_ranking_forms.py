"""The DCN interaction, old configs, and the ranking forward's precisions on the CPU."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from recpipe.errors import ArtifactMismatch, UsageError
from recpipe.ranking import precision
from recpipe.ranking.factorised import FOLD_MIN_ROWS, user_split
from recpipe.ranking.model import DLRM, DLRMConfig, LowRankCrossNet
from recpipe.ranking.predictor import Predictor

SIZES = (7, 3, 11, 5, 2, 9)  # 4 "user" + 2 "item" tables
#: a wide part over the products of user dense columns 1-3 with item dense columns 0-2 and the last table
WIDE = {"wide_table": 5, "wide_user_columns": (1, 4), "wide_item_columns": (0, 3)}


def model_with(interaction: str, seed: int = 0, wide: bool = False) -> DLRM:
    torch.manual_seed(seed)
    model = DLRM(DLRMConfig(user_dense_dim=5, item_dense_dim=4, table_sizes=SIZES, embedding_dim=8,
                            bottom_dims=(16,), top_dims=(32, 8), interaction=interaction, dcn_layers=2, dcn_rank=6,
                            **WIDE if wide else {}))
    # trained-looking weights: the cross layers' zero-initialised biases and the wide part are not zero
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def requests(counts: list[int], seed: int = 1) -> tuple[np.ndarray, ...]:
    g = np.random.default_rng(seed)
    b, n = len(counts), sum(counts)
    return (g.standard_normal((b, 5)).astype(np.float32), np.stack([g.integers(0, s, b) for s in SIZES[:4]], 1),
            g.standard_normal((n, 4)).astype(np.float32), np.stack([g.integers(0, s, n) for s in SIZES[4:]], 1))


def plain_scores(model: DLRM, ud: np.ndarray, us: np.ndarray, idn: np.ndarray, isp: np.ndarray,
                 counts: list[int]) -> np.ndarray:
    seg = np.repeat(np.arange(len(counts)), counts)
    dense = torch.from_numpy(np.concatenate([ud[seg], idn], 1))
    sparse = torch.from_numpy(np.concatenate([us[seg], isp], 1))
    with torch.inference_mode():
        return torch.sigmoid(model(dense, sparse)).numpy()


def test_cross_layer_is_the_dcn_v2_formula() -> None:
    torch.manual_seed(0)
    net = LowRankCrossNet(6, layers=1, rank=2)
    x0 = torch.randn(3, 6)
    v, w = net.v[0], net.w[0]
    assert isinstance(v, torch.nn.Linear) and isinstance(w, torch.nn.Linear)
    expect = x0 * (x0 @ v.weight.T @ w.weight.T + w.bias) + x0
    torch.testing.assert_close(net(x0), expect)
    assert DLRMConfig(5, 4, SIZES, 8, interaction="dcn").over_in_dim == 8 * 8


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
@pytest.mark.parametrize("graphs", ["eager", "padded"])
# one user folded (25 >= FOLD_MIN_ROWS) or not (3); several users all unfolded, or some of each
@pytest.mark.parametrize("counts", [[25], [3], [5, 1, 12], [30, 2, 40, 1]])
@pytest.mark.parametrize("wide", [False, True])
def test_factorised_forward_equals_the_plain_one(interaction: str, graphs: str, counts: list[int], wide: bool) -> None:
    assert 12 < FOLD_MIN_ROWS <= 25  # the counts above take both ways
    model = model_with(interaction, wide=wide)
    assert (model.wide is not None) == wide
    predictor = Predictor(model, torch.device("cpu"), graphs)
    predictor.set_user_tables(4)
    args = requests(counts)
    np.testing.assert_allclose(predictor.score_batch(*args, counts), plain_scores(model, *args, counts),
                               rtol=1e-5, atol=1e-6)


def test_old_configs_load_as_the_dot_interaction() -> None:
    data = DLRMConfig(5, 4, SIZES).to_json()
    for key in ("interaction", "dcn_layers", "dcn_rank"):
        del data[key]
    assert DLRMConfig.from_json(data).interaction == "dot"
    with pytest.raises(ValueError, match="interaction"):
        DLRMConfig(5, 4, SIZES, interaction="cross")


def test_the_wide_part_round_trips_and_refuses_a_table_it_cannot_serve() -> None:
    config = DLRMConfig(5, 4, SIZES, **WIDE)  # type: ignore[arg-type]
    data = json.loads(json.dumps(config.to_json()))
    assert DLRMConfig.from_json(data) == config
    for key in WIDE:  # written before the wide part: none
        del data[key]
    assert DLRMConfig.from_json(data).wide_table is None and DLRM(DLRMConfig.from_json(data)).wide is None
    with pytest.raises(ValueError, match="wide_table"):
        DLRMConfig(5, 4, SIZES, **{**WIDE, "wide_table": len(SIZES)})  # type: ignore[arg-type]
    for bad in ((0, 0), (3, 2), (0, 6), (-1, 2)):
        with pytest.raises(ValueError, match="wide_user_columns"):
            DLRMConfig(5, 4, SIZES, **{**WIDE, "wide_user_columns": bad})  # type: ignore[arg-type]
    with pytest.raises(ArtifactMismatch, match="malformed"):
        DLRMConfig.from_json({**config.to_json(), "wide_item_columns": [1, 9]})
    # the factorised forward looks the wide part's table up per candidate: it must be an item table
    with pytest.raises(ValueError, match="must be an item table"):
        user_split(DLRM(DLRMConfig(5, 4, SIZES, **{**WIDE, "wide_table": 1})), 4)  # type: ignore[arg-type]
    # the wide part is x_u^T A x_i + x_u^T B e + c . x + b, added to the deep part's logit
    model = model_with("dot", wide=True)
    assert model.wide is not None
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(6, 9, generator=g)
    sparse = torch.stack([torch.randint(0, n, (6,), generator=g) for n in SIZES], 1)
    wide = model.wide
    a, b = wide.user_item.weight.T, wide.user_table.weight.T  # (3, 3), (3, 8)
    e = model.sparse_arch(sparse)[:, 5]
    xu, xi = dense[:, :5], dense[:, 5:]
    pu, pi = xu[:, 1:4], xi[:, 0:3]
    want = (torch.einsum("nu,ui,ni->n", pu, a, pi) + torch.einsum("nu,ud,nd->n", pu, b, e)
            + xu @ wide.user_linear.weight[0] + wide.user_linear.bias + xi @ wide.item_linear.weight[0])
    with torch.no_grad():
        deep = model.over_arch(model.interaction(torch.stack([model.user_dense_arch(xu), model.item_dense_arch(xi)], 1),
                                                 model.sparse_arch(sparse)))
        torch.testing.assert_close(model(dense, sparse) - deep, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("interaction", "form"), [pytest.param("dot", "bf16", marks=pytest.mark.slow),
                                                   ("dot", "int8"), ("dcn", "int8"), ("dot+wide", "int8")])
def test_lower_precisions_stay_close_to_fp32_and_leave_its_weights_alone(interaction: str, form: str) -> None:
    # bf16 runs on every CPU here (emulated where it is not native), so neither kind of CPU hides the path
    model = model_with(interaction.removesuffix("+wide"), wide=interaction.endswith("+wide"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    counts = [40, 7]
    args = requests(counts)
    fp32 = Predictor(model, torch.device("cpu"))
    fp32.set_user_tables(4)
    low = Predictor(model, torch.device("cpu"), precision=form)
    low.set_user_tables(4)
    ref, got = fp32.score_batch(*args, counts), low.score_batch(*args, counts)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert not np.array_equal(got, ref)  # it really ran in another precision
    np.testing.assert_allclose(got, ref, atol=0.05)
    assert np.corrcoef(got, ref)[0, 1] > 0.98
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert low.compiled == (form == "bf16")  # bf16 runs compiled (this CPU has a compiler), int8 eagerly
    if form == "int8":  # served one user per forward; one_forward (the probe, train's AUC) scales over both
        assert low.per_user
        ud, us, idn, isp = args
        bounds = np.r_[0, np.cumsum(counts)]
        alone = [low.score_batch(ud[i : i + 1], us[i : i + 1], idn[lo:hi], isp[lo:hi], [int(hi - lo)])
                 for i, (lo, hi) in enumerate(itertools.pairwise(bounds))]
        np.testing.assert_array_equal(got, np.concatenate(alone))
        together = low.score_batch(*args, counts, one_forward=True)
        assert not np.array_equal(together, got) and np.abs(together - ref).max() < 0.05
    # the item x item triangle wherever the dot interaction runs on the CPU, eagerly or segmented
    assert (fp32.gram_pairs, low.gram_pairs) == (interaction != "dcn", interaction != "dcn")
    if form == "bf16":  # compiled with dynamic shapes: another candidate count, the same answers as eager
        eager = precision.convert(user_split(model, 4), "bf16", compile=False)
        with torch.inference_mode():
            t = [torch.from_numpy(a) for a in requests([9])]
            want = torch.sigmoid(eager(t[0], t[1], t[2], t[3], None).float()).numpy()
        np.testing.assert_allclose(low.score_batch(*requests([9]), [9]), want, atol=2e-2)


class _Check:
    """A form's check at load, as ``recpipe.ranking.probe.FormCheck`` reports it."""

    def __init__(self, ok: bool, auc_delta: float | None = 0.0) -> None:
        self.ok, self.auc_delta = ok, auc_delta

    def describe(self) -> str:
        return "within the bound" if self.ok else "BREAKS the bound"


def test_precision_choice(monkeypatch) -> None:
    monkeypatch.setattr(precision, "native_bf16", lambda flags=None: True)  # every form offered, any CPU
    cpu = torch.device("cpu")
    calls: list[str] = []
    timers = {f: (lambda f=f: calls.append(f)) for f in precision.FORMS}
    assert precision.check("int8") == "int8"
    with pytest.raises(UsageError, match="--ranking-precision"):
        precision.check("fp16")
    assert precision.choose("fp32", cpu, None, timers).form == "fp32"
    old = precision.choose("auto", cpu, None, timers)
    assert old.form == "fp32" and "no per-precision AUC" in old.reason and not calls
    # int8 loses too much AUC: never timed, never picked
    picked = precision.choose("auto", cpu, {"fp32": 0.80, "bf16": 0.7995, "int8": 0.79}, timers, rounds=2)
    assert picked.form in ("fp32", "bf16") and "int8" not in calls and "int8: over the AUC budget" in picked.reason
    # within the AUC budget but breaking the |dp| bound at load: never timed, never picked
    calls.clear()
    checks = {"bf16": _Check(True), "int8": _Check(False)}
    picked = precision.choose("auto", cpu, {"fp32": 0.80, "bf16": 0.80, "int8": 0.80}, timers, rounds=2, checks=checks)
    assert picked.form in ("fp32", "bf16") and "int8" not in calls and "int8: breaks the bound at load" in picked.reason
    # no AUC in the manifest, but the probe measured it at load: that is evidence enough
    calls.clear()
    picked = precision.choose("auto", cpu, None, timers, rounds=2, checks={"int8": _Check(True)})
    assert "int8" in calls and "bf16" not in calls  # bf16: no AUC measured for it either way
    assert "bf16: no AUC measured for it" in picked.reason
    # asked for by name: served, with its check in the reason, whether or not it keeps the bound
    named = precision.choose("int8", cpu, None, timers, checks={"int8": _Check(False)})
    assert named.form == "int8" and "BREAKS the bound" in named.reason
    with pytest.raises(UsageError, match="CUDA"):
        precision.choose("int8", torch.device("cuda"), None, timers)
    assert precision.choose("auto", torch.device("cuda"), {"fp32": 0.8}, timers).form == "fp32"


def test_the_probe_check_measures_the_largest_probability_move_and_the_auc_delta() -> None:
    from recpipe.ranking import probe as probes
    from recpipe.ranking.contract import RankingLimits

    limits = RankingLimits(5, 4, np.array(SIZES[:4]), np.array(SIZES[4:]))
    rows = probes.synthetic(limits, users=3, per_user=40)
    assert rows.rows == 120 and rows.labels is None and [u[4] for u in rows.users()] == [[40]] * 3
    assert (rows.user_sparse < limits.user_table_sizes).all() and (rows.item_sparse < limits.item_table_sizes).all()
    g = np.random.default_rng(0)
    labelled = probes.Probe(rows.user_dense, rows.user_sparse, rows.item_dense, rows.item_sparse, rows.counts,
                            (g.random(120) < 0.3).astype(np.float32), "120 test rows")
    ref = g.random(120)
    close = probes.check("bf16", ref, ref + 0.01, labelled)
    assert close.ok and close.max_abs_dp == pytest.approx(0.01) and close.auc_delta == pytest.approx(0.0)
    far = probes.check("int8", ref, np.where(np.arange(120) == 7, ref + 0.05, ref), labelled)
    assert not far.ok and far.max_abs_dp == pytest.approx(0.05) and "BREAKS" in far.describe()
    shuffled = probes.check("int8", ref, g.permutation(ref), labelled)  # the order lost: the AUC moves
    assert shuffled.auc_delta is not None and shuffled.auc_delta != pytest.approx(0.0)
    assert probes.check("int8", ref, ref, rows).auc_delta is None  # no labels, no AUC
    # the probe's scores are what the predictor gives runs of whole users up to a request's candidates
    # (here all three users' 120 rows in one forward), and equal each user's alone up to rounding
    model = model_with("dot")
    predictor = Predictor(model, torch.device("cpu"))
    predictor.set_user_tables(4)
    scores = probes.scores(predictor, rows)
    together = predictor.score_batch(rows.user_dense, rows.user_sparse, rows.item_dense, rows.item_sparse, [40] * 3)
    np.testing.assert_array_equal(scores, together)
    alone = np.concatenate([predictor.score_batch(*user) for user in rows.users()])
    np.testing.assert_allclose(scores, alone, rtol=0, atol=1e-6)
    assert list(probes.user_runs(np.array([3, 600, 2, 2, 499]), 500)) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert [run[4] for run in probes.synthetic(limits, users=3, per_user=300).chunks(500)] == [[300]] * 3


def _compiles() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
@pytest.mark.parametrize("form", ["bf16"])
def test_a_compiled_form_serves_the_buckets_it_warmed_and_never_compiles_after(form: str) -> None:
    """Whatever the CPU (bf16 is emulated where not native): every bucket of users and candidates is
    compiled before serving, any candidate count runs without a compile, and a batch of more users than
    warmed for runs in warmed pieces of the segmented form, never compiling and never eager."""
    from recpipe.ranking.predictor import MAX_ROWS, ROWS_STEP, row_buckets

    model = model_with("dot", wide=True)
    low = Predictor(model, torch.device("cpu"), precision=form)
    low.set_user_tables(4)
    assert low.compiled and low.mode == "padded" and low.segmented and not low.per_user and low.gram_pairs
    eager = Predictor(model, torch.device("cpu"), precision=form, compile=False, full_gram=True)
    eager.set_user_tables(4)
    assert not eager.gram_pairs  # the other item x item layout: scores within bf16 rounding (asserted below)
    assert not eager.per_user and not eager.segmented
    low.warm_buckets(max_users=4)
    # users padded to at least 2: one graph for every batch size (see test_segmented_*)
    assert low.sealed and low.warmed == {(u, r) for u in (2, 4) for r in row_buckets(ROWS_STEP)}
    assert row_buckets(ROWS_STEP) == [64, 128, 256, 512, *range(1024, MAX_ROWS + 1, ROWS_STEP)]
    # 5 x 500 candidates run at 2560 rows, not 4096 (CUDA graphs and the padded twin keep powers of two)
    assert low._bucketed(5, 2500) == (8, 2560) and low._bucketed(1, 500) == (2, 512)
    compiled = _compiles()
    g = np.random.default_rng(5)
    for _ in range(12):
        counts = [int(c) for c in g.integers(1, 900, size=int(g.integers(1, 5)))]
        args = requests(counts, seed=int(g.integers(1000)))
        np.testing.assert_allclose(low.score_batch(*args, counts), eager.score_batch(*args, counts), atol=2e-2)
    for k in (1, 2, 3, 17, 500, MAX_ROWS):
        low.score_batch(*requests([k]), [k])
    # more users than warmed for, and a user with no candidates: still compiled, in warmed pieces
    counts = [3] * 8 + [0, 5]
    args = requests(counts)
    np.testing.assert_allclose(low.score_batch(*args, counts), eager.score_batch(*args, counts), atol=2e-2)
    assert _compiles() == compiled and low.unwarmed_forwards == 0


@pytest.mark.slow
def test_segmented_form_gives_a_query_the_same_scores_alone_and_in_any_batch() -> None:
    """The compiled CPU form runs a batch as one call for every user's and candidate's own terms, one
    matmul per user, one call for the rest (``recpipe.ranking.segmented``): each candidate's row meets
    the same operations whatever else is in the batch, so batched hops change no score, not even its
    last bit. The DCN interaction has no fold and keeps one forward per user."""
    model = model_with("dot", wide=True)
    low = Predictor(model, torch.device("cpu"), precision="bf16")
    low.set_user_tables(4)
    low.warm_buckets(max_users=8)
    g = np.random.default_rng(11)
    for trial in range(8):
        counts = [int(c) for c in g.integers(0, 700, size=int(g.integers(2, 12)))]
        counts[int(g.integers(len(counts)))] = max(1, counts[0])
        ud, us, idn, isp = requests(counts, seed=trial)
        together = low.score_batch(ud, us, idn, isp, counts)
        starts = np.concatenate([[0], np.cumsum(counts)])
        for i, c in enumerate(counts):
            a, z = int(starts[i]), int(starts[i + 1])
            alone = low.score_batch(ud[i : i + 1], us[i : i + 1], idn[a:z], isp[a:z], [c])
            np.testing.assert_array_equal(together[a:z], alone)
    assert low.unwarmed_forwards == 0
    dcn = Predictor(model_with("dcn"), torch.device("cpu"), precision="bf16")
    dcn.set_user_tables(4)
    assert dcn.compiled and dcn.per_user and not dcn.segmented


def test_int8_runs_one_forward_per_request_so_batching_moves_no_score() -> None:
    """int8's dynamic quantization scales a call's activations by that call's range: in one forward a
    request's scores would depend on its batch-mates. So int8 runs a batch one request at a time."""
    low = Predictor(model_with("dot", wide=True), torch.device("cpu"), precision="int8")
    low.set_user_tables(4)
    assert low.per_user and not low.segmented
    counts = [40, 7, 300]
    ud, us, idn, isp = requests(counts, seed=3)
    together = low.score_batch(ud, us, idn, isp, counts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for i, c in enumerate(counts):
        a, z = int(starts[i]), int(starts[i + 1])
        np.testing.assert_array_equal(together[a:z], low.score_batch(ud[i : i + 1], us[i : i + 1], idn[a:z], isp[a:z], [c]))


def test_eager_forms_run_each_size_once_and_padded_twins_warm_every_bucket() -> None:
    from recpipe.ranking.predictor import row_buckets

    fp32 = Predictor(model_with("dot"), torch.device("cpu"))
    fp32.set_user_tables(4)
    # eager: each size run once (the first calls' one-time costs), nothing padded, nothing sealed
    assert fp32.warm_buckets(max_users=2) == 2 * len(row_buckets()) and not fp32.warmed and not fp32.sealed
    twin = Predictor(model_with("dot"), torch.device("cpu"), "padded")  # the CPU twin of CUDA graphs
    twin.set_user_tables(4)
    assert twin.row_step == 0 and twin._bucketed(5, 2500) == (8, 4096)  # powers of two, as CUDA graphs
    assert twin.warm_buckets(max_users=3) == 3 * len(row_buckets())  # users 1, 2, 4
    counts = [5, 1, 12]
    args = requests(counts)
    np.testing.assert_allclose(twin.score_batch(*args, counts), fp32.score_batch(*args, counts), rtol=1e-5, atol=1e-6)


def test_compiled_cpu_buckets_step_linearly_above_the_step() -> None:
    from recpipe.ranking.predictor import MAX_ROWS, ROWS_STEP, bucket_rows, row_buckets

    assert row_buckets() == [64, 128, 256, 512, 1024, 2048, 4096] == [bucket_rows(r) for r in (1, 65, 129, 257, 513, 1025, 2049)]
    stepped = row_buckets(ROWS_STEP)
    for rows in range(1, MAX_ROWS + 1):
        b = bucket_rows(rows, ROWS_STEP)
        assert b in stepped and b >= rows and not [s for s in stepped if rows <= s < b], rows
    assert [bucket_rows(n * 500, ROWS_STEP) for n in (1, 3, 5, 6, 8)] == [512, 1536, 2560, 3072, 4096]


def test_cpu_flags_are_read_from_cpuinfo(tmp_path, monkeypatch) -> None:
    for cap in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # a run capped below bf16 on purpose
        monkeypatch.delenv(cap, raising=False)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_int8\n")
    flags = precision.cpu_flags(info)
    assert flags == ("avx512_bf16", "amx_int8", "avx512f", "avx2")
    assert precision.native_bf16(flags) and not precision.native_bf16(("avx2",))
    assert precision.cpu_flags(tmp_path / "missing") == ()


def test_a_onednn_isa_cap_below_bf16_makes_bf16_not_native(monkeypatch) -> None:
    flags = ("avx512_bf16", "avx512f", "avx2")
    for cap in ("AVX2", "avx512_core_vnni"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert not precision.native_bf16(flags)
        assert precision.available(torch.device("cpu")) == ("fp32", "int8")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert precision.native_bf16(flags)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert not precision.native_bf16(flags)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_cuda_graph_replay_equals_the_cpu_forward(interaction: str) -> None:
    model = model_with(interaction)
    cpu = Predictor(model, torch.device("cpu"))
    cpu.set_user_tables(4)
    gpu = Predictor(model_with(interaction), torch.device("cuda"), "graph")
    gpu.set_user_tables(4)
    for counts in ([25], [5, 1, 12]):
        args = requests(counts)
        np.testing.assert_allclose(gpu.score_batch(*args, counts), cpu.score_batch(*args, counts), rtol=1e-3, atol=1e-4)
    assert gpu.graphs_captured == 2
