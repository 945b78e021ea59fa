"""Mixed-precision search on tiny graphs: units, per-format emission, exact sizes, sensitivity
(probe graph == emitted model), budgets, the sweep end to end and the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantkit.data import as_dataset, model_inputs
from quantkit.errors import RecipeError
from quantkit.prep.pipeline import prepare
from quantkit.recipe import load_recipe
from quantkit.search.linear import LinearSpace, weight_only_bytes
from quantkit.search.sensitivity import measure_sensitivity
from quantkit.search.sweep import _resolve_budget, sweep
from tests.conftest import image_batches, lm_feeds, tiny_cnn, tiny_lm

CANDS: list[Any] = [
    "fp16",
    "bf16",
    {"name": "int8", "format": "int8_dynamic", "smoothquant": "auto"},
    {"name": "int8-tensor", "format": "int8_dynamic", "granularity": "per_tensor", "smoothquant": 0.5},
    {"name": "int4-g16", "format": "int4", "group_size": 16},
    {"name": "w8", "format": "int8_weight", "group_size": 16},
]


def _recipe(pin: bool = True, **search: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "name": "tiny-mixed",
        "quantization": {
            "default": {"format": "fp32", "algorithm": "rtn", "group_size": 16},
            "overrides": [{"layer": "lm", "format": "int8_weight", "algorithm": "rtn", "group_size": 16}]
            if pin
            else [],
        },
        "export": {"accuracy_level": 0},  # MatMulNBits exact: probe (dequantized weights) == emitted model
        "report": {"latency": {"warmup": 1, "repeat": 3}},
        "search": {"candidates": CANDS, "sensitivity": {"samples": 3, "seq_len": None}, **search},
    }


def _space(pin: bool = True, **search: Any) -> tuple[LinearSpace, Any]:
    fm = prepare(ir.from_proto(tiny_lm())).model
    cal = as_dataset(lm_feeds(6), model_inputs(fm))
    rec = load_recipe(_recipe(pin, **search))
    return LinearSpace.build(fm, rec, cal, progress=False), cal


def _run(model: ir.Model, feed: dict[str, np.ndarray]) -> np.ndarray:
    s = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feed)[0]


def test_units_tie_layers_that_share_an_input_and_overrides_pin() -> None:
    sp, _ = _space()
    assert [u.layers for u in sp.units] == [("q_proj", "k_proj"), ("o_proj",), ("up_proj",), ("down_proj",)]
    assert sp.pinned == ["lm"]
    sp2, _ = _space(tie="none")
    assert len(sp2.units) == 5


# relative output error bounds on this 5-layer random stack (the pinned lm is 8-bit in every point)
@pytest.mark.parametrize(
    "cand,kernel,tol",
    [
        ("fp16", "Cast", 0.02),
        ("bf16", "Cast", 0.03),
        ("int8", "MatMulIntegerToFloat", 0.05),
        ("int8-tensor", "DynamicQuantizeMatMul", 0.1),
        ("int4-g16", "MatMulNBits", 0.3),
        ("w8", "MatMulNBits", 0.03),
    ],
)
def test_uniform_emission_runs_and_stays_close(cand: str, kernel: str, tol: float) -> None:
    sp, _ = _space()
    m = sp.emit({u.name: cand for u in sp.units})
    ops = [n.op_type for n in m.graph]
    assert kernel in ops
    assert ops.count("MatMul") == (
        5 if kernel == "Cast" else 0
    )  # the pinned lm is MatMulNBits in every point
    feed = lm_feeds(1, seed=9)[0]
    ref = _run(sp.model, feed)
    got = _run(m, feed)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel < tol, (cand, rel)


def test_smoothing_folds_into_the_norm_for_a_tied_unit() -> None:
    sp, _ = _space()
    m = sp.emit({"q_proj+1": "int8"})
    art = sp.int8_artifact(sp.units[0], "int8")
    assert art.s is not None and art.alpha is not None  # the outlier channel makes smoothing win
    gamma = next(n for n in m.graph if n.name == "norm").inputs[1]
    assert gamma is not None and gamma.name != "gamma"  # 1/s folded into the Mul's constant
    assert not any(n.op_type == "Mul" and n.name != "norm" for n in m.graph)


def test_unit_bytes_match_the_emitted_initializers() -> None:
    sp, _ = _space()
    base = {t.name for t in ir.to_proto(sp.emit({})).graph.initializer}
    for cand in sp.candidates:
        m = ir.to_proto(sp.emit({u.name: cand for u in sp.units}))
        arrays = [onnx.numpy_helper.to_array(t) for t in m.graph.initializer if t.name not in base]
        new = sum(a.nbytes for a in arrays if a.size > 8)  # not the scalar helpers (shapes, zero points)
        predicted = sum(sp.unit_bytes(u, cand) for u in sp.units)
        # int8: the norm's constant is replaced by a smoothed copy (K floats); nothing else differs
        assert predicted <= new <= predicted + 4 * 32, (cand, predicted, new)


def test_bytes_only_costs_agree_with_the_measured_table_on_bytes_and_emit_nothing(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    from quantkit.search.cost import measure_costs

    sp, cal = _space()
    feed = next(iter(cal.batches(1)))
    with pytest.raises(ValueError, match="int8"):  # activation-quantized formats need the emitted model
        measure_costs(sp, feed, progress=False, latency=False)
    sp, cal = _space(candidates=[c for c in CANDS if isinstance(c, str) or c["format"] in ("int4", "int8_weight")])
    full = measure_costs(sp, feed, runs=2, warmup=1, progress=False)
    emitted: list[int] = []
    real = sp.emit
    monkeypatch.setattr(sp, "emit", lambda *a, **k: emitted.append(1) or real(*a, **k))
    light = measure_costs(sp, feed, progress=False, latency=False)
    assert not emitted and set(light.bytes) == set(full.bytes)
    assert all(v == 0.0 for v in light.latency_ms.values())
    fp32_file = sum(full.bytes[(u.name, "fp32")] for u in sp.units) + full.base["bytes"]
    fp32_light = sum(light.bytes[(u.name, "fp32")] for u in sp.units) + light.base["bytes"]
    # the measured table counts the serialized graph too (a few hundred bytes here); the weights are the same
    assert 0 < fp32_file - fp32_light < 4096
    sizes = {u.name: len(u.layers) for u in sp.units}
    for (u, c), v in light.bytes.items():
        # the measured table adds the graph bytes a format's nodes take (a Cast, names: ~120 bytes a layer here)
        assert v == pytest.approx(full.bytes[(u, c)], abs=256 * sizes[u]), (u, c)


def test_weight_only_bytes_formula() -> None:
    # K=576 in blocks of 128: 5 blocks (the last one padded) x (64 code bytes + 4 scale bytes) per column
    assert weight_only_bytes(576, 10, 4, 128, True) == 10 * 5 * (64 + 4)
    assert weight_only_bytes(576, 10, 4, 64, True) == 10 * 9 * (32 + 4)
    assert weight_only_bytes(64, 2, 4, 32, False) == 2 * 2 * (16 + 4) + 2 * 1  # packed 4-bit zero points


def test_probe_graph_measures_what_the_emitted_model_does() -> None:
    sp, cal = _space(pin=False)  # (the probe runs pinned layers in float; the emitted models do not)
    probe = measure_sensitivity(sp, cal, samples=3, seq_len=None, metric="kl", progress=False, engine="probe")
    emit = measure_sensitivity(sp, cal, samples=3, seq_len=None, metric="kl", progress=False, engine="emit")
    assert probe.keys() == emit.keys()
    for k, v in emit.items():
        # weight-only / 16-bit: identical arithmetic; int8: the probe applies 1/s with a Mul, the emitted model
        # folds it into the norm's constant - float rounding may move a few activation codes by one step
        assert probe[k] == pytest.approx(v, rel=0.05, abs=1e-7), k
    assert all(v > 0 for (u, c), v in emit.items() if c != "fp16" and c != "bf16")


def test_the_probe_graph_holds_no_searched_weight_and_leaves_the_model_as_it_was() -> None:
    from quantkit.search.sensitivity import probe_model

    sp, _ = _space(pin=False)
    before = ir.to_proto(sp.model).SerializeToString()
    proto, weights, _ = probe_model(sp)
    assert ir.to_proto(sp.model).SerializeToString() == before  # the initializers back, in their order
    inits = {t.name for t in proto.graph.initializer}
    fed = {i.name: i for i in proto.graph.input}
    for layer, name in weights.items():
        assert name not in inits and name in fed, layer
        want = sp.weight(layer).shape
        assert tuple(d.dim_value for d in fed[name].type.tensor_type.shape.dim) == tuple(want), layer


def test_rtn_effective_weights_of_one_unit_equal_the_all_layers_path() -> None:
    """The sensitivity rounds one unit at a time (nothing kept); the codes are those the emitted model gets."""
    sp, _ = _space(pin=False)
    for cand in ("int4-g16", "w8"):
        res = sp.woq_results(cand)
        for u in sp.units:
            if cand not in sp.allowed(u):
                continue
            got = sp.effective_weights(u, cand)
            assert got is not None
            for n, w in got.items():
                np.testing.assert_array_equal(w, res[n].effective_weight())


def test_sensitivity_cache_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    sp, cal = _space()
    parts = {"test": 1}
    first = measure_sensitivity(
        sp, cal, samples=2, seq_len=None, metric="mse", progress=False, cache_parts=parts
    )
    files = list((tmp_path / "search").glob("sensitivity-*.json"))
    assert len(files) == 1

    def boom(*_: Any, **__: Any) -> Any:
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr("quantkit.search.sensitivity._probe_runner", boom)
    again = measure_sensitivity(
        sp, cal, samples=2, seq_len=None, metric="mse", progress=False, cache_parts=parts
    )
    assert again == first


def test_budget_expressions() -> None:
    uniform = {"a": {"bytes": 100.0}, "b": {"bytes": 300.0}}
    assert _resolve_budget(0.5, "bytes", uniform, 1000.0) == 500.0
    assert _resolve_budget("uniform:b", "bytes", uniform, 1000.0) == 300.0
    assert _resolve_budget("between:a:b:0.25", "bytes", uniform, 1000.0) == 150.0
    with pytest.raises(RecipeError, match="unknown candidate 'c'"):
        _resolve_budget("uniform:c", "bytes", uniform, 1000.0)
    with pytest.raises(RecipeError, match="outside"):
        _resolve_budget("between:a:b:2", "bytes", uniform, 1000.0)


@pytest.mark.parametrize(
    "search,match",
    [
        ({"candidates": ["fp8"]}, "unknown candidate 'fp8'"),
        ({"candidates": ["fp16", {"name": "fp16", "format": "int4"}]}, "repeated"),
        ({"candidates": ["fp16"], "budgets": ["half"]}, "budget 'half'"),
        ({"candidates": [{"name": "x", "format": "int8_dynamic", "smoothquant": 1.5}]}, "outside"),
        ({"candidates": ["fp16"], "metric": "flops"}, "metric"),
    ],
)
def test_search_section_errors_name_the_key(search: dict[str, Any], match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        load_recipe({"version": 1, "search": search})


def test_static_int8_candidate_cannot_mix_with_dynamic_int8() -> None:
    fm = prepare(ir.from_proto(tiny_cnn())).model
    rec = load_recipe({"version": 1, "search": {"candidates": ["int8", "int8_dynamic"]}})
    from quantkit.search.conv import ConvSpace

    with pytest.raises(RecipeError, match="may mix only"):
        ConvSpace.build(fm, rec, as_dataset(image_batches(2), model_inputs(fm)), progress=False)


def test_conv_search_offers_weight_only_to_the_classifier_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One space mixes families: int8 / fp16 / fp32 on every layer, INT4 on the classifier (a Gemm, rewritten
    to MatMul + Add); the emitted point runs the convs in QLinearConv and the classifier in MatMulNBits."""
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    fm = prepare(ir.from_proto(tiny_cnn())).model
    rec = load_recipe({"version": 1, "quantization": {"bias_correction": False},
                       "search": {"candidates": ["int8", "fp16", "fp32", {"name": "w4", "format": "int4", "group_size": 16}]}})
    from quantkit.lowering.verify import census
    from quantkit.search.conv import ConvSpace

    sp = ConvSpace.build(fm, rec, as_dataset(image_batches(2), model_inputs(fm)), progress=False)
    allowed = {u.name: sp.allowed(u) for u in sp.units}
    assert "w4" in allowed["fc"] and all("w4" not in a for u, a in allowed.items() if u != "fc")
    with pytest.raises(RecipeError, match="not allowed"):
        sp.plan_of({"conv0": "w4"})
    m = sp.emit({u.name: ("w4" if u.name == "fc" else "int8") for u in sp.units})
    cen = census(ir.to_proto(m), quantizable=[u.name for u in sp.units])
    assert cen.quantized_kernels.get("MatMulNBits") == 1 and cen.quantized_kernels.get("QLinearConv", 0) >= 2
    assert sp.unit_bytes(sp.units[-1], "w4") < sp.unit_bytes(sp.units[-1], "int8")


def test_sweep_linear_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    rec = _recipe(points=3, budgets=["uniform:int4-g16", "between:int4-g16:int8:0.5"], frontier_points=6)
    res = sweep(
        ir.from_proto(tiny_lm()),
        lm_feeds(6),
        rec,
        evaluation_data=lm_feeds(4, seed=5),
        output=tmp_path / "out",
        progress=False,
    )
    ids = [p.id for p in res.points]
    assert any(i.startswith("uniform:int8") for i in ids) and any("budget:uniform:int4-g16" in i for i in ids)
    for p in res.points:
        assert p.measured["latency_ms"] > 0 and p.measured["size_bytes"] > 0
        assert p.measured["damage"] >= 0 and "sqnr_db" in p.measured
        assert set(p.on_measured_front) == {"latency", "size"}
        assert Path(p.model_path or "").is_file()
    for p in res.points:
        if p.kind.startswith("uniform"):  # weight bytes + measured graph overhead per layer = the file
            assert abs(p.predicted["bytes"] - p.measured["size_bytes"]) <= 16, (p.id, p.predicted, p.measured)
    budget = next(p for p in res.points if "budget:uniform:int4-g16" in p.id)
    uni4 = next(p for p in res.points if p.id.startswith("uniform:int4-g16"))
    assert budget.predicted["bytes"] <= uni4.predicted["bytes"] + 1e-6
    for name in (
        "sweep.json",
        "sweep.md",
        "quality_vs_latency.svg",
        "quality_vs_size.svg",
        "predicted_front.svg",
    ):
        assert (tmp_path / "out" / name).is_file(), name
    onnx.checker.check_model(str(res.points[0].model_path))
    assert len(list((tmp_path / "out" / "assignments").glob("*.csv"))) == len(res.points)
    # a re-run reuses the sensitivity and cost tables
    monkeypatch.setattr(
        "quantkit.search.sensitivity._probe_runner",
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("sensitivity measured again")),
    )
    monkeypatch.setattr(
        "quantkit.search.profile.profile_model",
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("costs measured again")),
    )
    sweep(
        ir.from_proto(tiny_lm()),
        lm_feeds(6),
        rec,
        evaluation_data=lm_feeds(4, seed=5),
        output=tmp_path / "out2",
        progress=False,
        save_models=False,
    )


def test_sweep_conv_latency_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    rec = {
        "version": 1,
        "name": "tiny-cnn-mixed",
        "quantization": {"default": {"format": "int8"}},
        "report": {"latency": {"warmup": 1, "repeat": 3}},
        "search": {
            "candidates": ["int8", "fp16", "fp32"],
            "metric": "latency",
            "points": 3,
            "sensitivity": {"samples": 4},
        },
    }
    res = sweep(
        ir.from_proto(tiny_cnn()),
        image_batches(4),
        rec,
        evaluation_data=image_batches(2, seed=3),
        output=tmp_path / "out",
        progress=False,
        save_models=False,
    )
    uni8 = next(p for p in res.points if p.id.startswith("uniform:int8"))
    uni32 = next(p for p in res.points if p.id.startswith("uniform:fp32"))
    for p in (uni8, uni32):  # uniform points: weight bytes + the format's measured graph overhead = the file
        assert abs(p.predicted["bytes"] - p.measured["size_bytes"]) <= 16, (p.id, p.predicted, p.measured)
    assert uni32.measured["damage"] == 0.0 < uni8.measured["damage"]
    assert "top1_agreement" in uni8.measured or "top1" in str(uni8.measured)
    assert res.report["family"] == "ConvSpace"


def test_cli_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantkit.cli import main

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    onnx.save(tiny_lm(), str(tmp_path / "lm.onnx"))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", x=rng.standard_normal((6, 8, 32)).astype(np.float32))
    np.savez(tmp_path / "ev.npz", x=rng.standard_normal((4, 8, 32)).astype(np.float32))
    rec = tmp_path / "mixed.yaml"
    rec.write_text(
        "version: 1\nname: cli-mixed\nmodel: {source: lm.onnx}\n"
        "calibration: {data: {kind: npz, path: cal.npz}}\n"
        "evaluation: {data: {kind: npz, path: ev.npz}}\n"
        "quantization: {default: {format: fp32, group_size: 16}}\n"
        "report: {latency: {warmup: 1, repeat: 3}}\n"
        "search: {candidates: [int8_dynamic, {name: int4, format: int4, group_size: 16}], points: 2,\n"
        "         budgets: ['between:int4:int8_dynamic:0.5'], sensitivity: {samples: 2, seq_len: null}}\n"
    )
    out = tmp_path / "sweep"
    assert main(["sweep", "--recipe", str(rec), "--output", str(out), "--quiet", "--no-models"]) == 0
    text = capsys.readouterr().out
    assert "uniform:int4" in text and "Spearman" in text and "budget:between" in text
    assert (out / "sweep.md").is_file() and not (out / "models").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodel: {source: lm.onnx}\nsearch: {candidates: [int9]}\n")
    assert main(["sweep", "--recipe", str(bad)]) == 2
    assert "int9" in capsys.readouterr().err


def test_quantize_with_search_target_emits_one_mixed_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantkit import quantize

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    rec = _recipe(target={"size": "between:int4-g16:int8:0.5"})
    res = quantize(
        ir.from_proto(tiny_lm()), lm_feeds(6), rec, evaluation_data=lm_feeds(4, seed=5), progress=False
    )
    rep = res.report
    # a tiny model may well be slower quantized (fixed per-op overhead); nothing else to warn about
    assert rep["kind"] == "mixed" and [w for w in rep["warnings"] if "slower" not in w] == [], rep["warnings"]
    srch = rep["search"]
    assert 0 < srch["predicted"]["bytes"] < rep["size"]["fp32_bytes"]
    # what was predicted is what shipped: every searched layer's format in the report is the solver's choice
    chosen = {r["layer"]: r["format"] for r in srch["assignment"]}
    shipped = {r["layer"]: r["format"] for r in rep["layers"]}
    assert all(shipped.get(k, "fp32") == f for k, f in chosen.items()), (chosen, shipped)
    kernels = rep["census"]["quantized_kernels"]
    assert any(k.endswith(("MatMulNBits", "MatMulIntegerToFloat")) for k in kernels), kernels
    paths = res.save(tmp_path / "out")
    assert paths["model"].is_file() and "report.md" in paths
    assert "mixed precision" in paths["report.md"].read_text()
    # a damage target: the cheapest assignment whose predicted damage is at most uniform int8's
    res2 = quantize(
        ir.from_proto(tiny_lm()),
        lm_feeds(6),
        _recipe(target={"damage": "uniform:int8"}),
        evaluation_data=lm_feeds(4, seed=5),
        progress=False,
        measure_latency=False,
    )
    s2 = res2.report["search"]
    assert s2["predicted"]["damage"] <= s2["uniform_predicted"]["int8"]["damage"] + 1e-12
    assert s2["predicted"]["bytes"] <= s2["uniform_predicted"]["int8"]["bytes"] + 1e-6  # the cheapest such
    with pytest.raises(RecipeError, match="no assignment"):
        quantize(
            ir.from_proto(tiny_lm()),
            lm_feeds(6),
            _recipe(target={"size": 0.01}),
            evaluation_data=lm_feeds(4, seed=5),
            progress=False,
        )
    from quantkit.errors import QuantkitError

    with pytest.raises(QuantkitError, match="no search.target"):
        quantize(ir.from_proto(tiny_lm()), lm_feeds(6), _recipe(), progress=False)


def test_auto_damage_metric() -> None:
    from quantkit.search.sweep import _damage_metric

    rec = load_recipe({"version": 1, "search": {"candidates": ["fp16"]}})
    assert _damage_metric(rec, "logits") == "kl"
    assert _damage_metric(rec, "last_hidden_state") == "mse"
    rec_c = load_recipe(
        {"version": 1, "evaluation": {"metric": "classification"}, "search": {"candidates": ["fp16"]}}
    )
    assert _damage_metric(rec_c, "output") == "kl"
    rec_m = load_recipe({"version": 1, "search": {"candidates": ["fp16"], "sensitivity": {"metric": "mse"}}})
    assert _damage_metric(rec_m, "logits") == "mse"


def test_sweep_torch_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(32, 64)
            self.down = torch.nn.Linear(64, 10)

        def forward(self, x: Any) -> Any:
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((2, 32)).astype(np.float32) for _ in range(4)]
    rec = {
        "version": 1,
        "name": "torch-mixed",
        "quantization": {"default": {"format": "fp32", "group_size": 16}},
        "report": {"latency": {"warmup": 1, "repeat": 3}},
        "search": {
            "candidates": ["int8_dynamic", {"name": "int4", "format": "int4", "group_size": 16}],
            "points": 2,
            "sensitivity": {"samples": 2, "metric": "mse"},
        },
    }
    res = sweep(
        MLP().eval(),
        data,
        rec,
        evaluation_data=data,
        example_inputs=(torch.randn(2, 32),),
        output=tmp_path / "out",
        progress=False,
        save_models=False,
    )
    assert {p.id.split(" = ")[0] for p in res.points} >= {"uniform:int8_dynamic", "uniform:int4"}
    assert all(p.measured["damage"] >= 0 for p in res.points)


def test_tied_lm_head_is_a_searchable_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tied embedding / lm_head is one unit of the linear space: weight-only candidates only (the table is
    stored once), the probe feeds the candidate's weight to both the Gather and the lm_head, and its damage
    is what the emitted model shows."""
    from quantkit.lowering.verify import census
    from quantkit.search.sensitivity import measure_sensitivity
    from tests.unit.test_weight_only import tiny_lm as tied_lm
    from tests.unit.test_weight_only import windows

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    fm = prepare(ir.from_proto(tied_lm())).model
    rec = load_recipe({
        "version": 1, "quantization": {"default": {"format": "fp32", "group_size": 16}},
        "export": {"accuracy_level": 0},
        "search": {"candidates": [{"name": "int8", "format": "int8_dynamic"},
                                  {"name": "w4", "format": "int4", "group_size": 16},
                                  {"name": "w8", "format": "int8_weight", "group_size": 16}],
                   "sensitivity": {"samples": 2, "seq_len": None}}})
    cal = as_dataset(windows(4, 0), model_inputs(fm))
    sp = LinearSpace.build(fm, rec, cal, progress=False)
    lm = next(u for u in sp.units if "lm_head" in u.layers)
    assert sp.allowed(lm) == ["w4", "w8"] and "int8" in sp.allowed(sp.units[0])
    with pytest.raises(RecipeError, match="not allowed"):
        sp.plan_of({lm.name: "int8"})
    probe = measure_sensitivity(sp, cal, samples=2, seq_len=None, metric="kl", engine="probe", progress=False)
    emit = measure_sensitivity(sp, cal, samples=2, seq_len=None, metric="kl", engine="emit", progress=False)
    assert (lm.name, "int8") not in probe
    # the tied head keeps the graph's form: the table is fed (a candidate in the table's layout), no [K, N] copy
    from quantkit.search.sensitivity import probe_model

    probe_inputs = {i.name for i in probe_model(sp)[0].graph.input}
    assert "embed.weight" in probe_inputs and not any(n.startswith("quantkit_probe::") for n in probe_inputs)
    assert sp.weight("lm_head").base is not None  # a view of the table
    for c in ("w4", "w8"):
        assert probe[(lm.name, c)] > 0
        assert probe[(lm.name, c)] == pytest.approx(emit[(lm.name, c)], rel=1e-3, abs=1e-9)
    assert probe[(lm.name, "w4")] > probe[(lm.name, "w8")]
    m = sp.emit({lm.name: "w8"})
    k = census(ir.to_proto(m), quantizable=["lm_head"]).quantized_kernels
    assert k.get("MatMulNBits") == 1 and k.get("GatherBlockQuantized") == 1, k
    assert "embed.weight" not in {v.name for v in m.graph.initializers.values()}  # no float copy left


def test_sweep_points_evaluated_as_ray_tasks_match_the_local_run(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``sweep(ray_address=...)`` (CLI ``--ray``): each point's quality is a Ray task; same figures as locally."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    rec = _recipe(points=2, frontier_points=4)
    kw = {"evaluation_data": lm_feeds(4, seed=5), "progress": False, "save_models": False}
    local = sweep(ir.from_proto(tiny_lm()), lm_feeds(6), rec, output=tmp_path / "a", **kw)
    try:
        remote = sweep(ir.from_proto(tiny_lm()), lm_feeds(6), rec, output=tmp_path / "b", ray_address="local", **kw)
    finally:
        ray.shutdown()
    assert [p.id for p in remote.points] == [p.id for p in local.points]
    for a, b in zip(local.points, remote.points, strict=True):
        assert a.measured["damage"] == pytest.approx(b.measured["damage"], rel=1e-9)
    assert remote.report["timings"]["ray_tasks"] == len(remote.points)


def test_sweep_ray_without_ray_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from quantkit.errors import QuantkitError
    from quantkit.search.sweep import _ray_session

    real_import = builtins.__import__

    def no_ray(name: str, *a: Any, **k: Any) -> Any:
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(QuantkitError, match="pip install 'ray"):
        _ray_session("local")


def test_scaled_sensitivity_measures_one_weight_only_candidate_per_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure='scaled': the weight-only candidate with the largest input-weighted rounding error is run, the
    unit's other weight-only candidates get its damage times their error ratio (h = the input's per-channel sum
    of squares on the same samples, computed here independently); the other formats are run as before."""
    sp, cal = _space(pin=False)
    full = measure_sensitivity(sp, cal, samples=3, seq_len=None, metric="kl", progress=False)
    runs: list[tuple[str, str]] = []
    from quantkit.search import sensitivity as sens_mod

    real = sens_mod._probe_runner

    def counting(space: Any, feeds: Any, expose: bool = False) -> Any:
        run = real(space, feeds, expose)

        def wrapped(unit: Any, cand: str | None, eff: Any = None) -> Any:
            if unit is not None:
                runs.append((unit.name, str(cand)))
            return run(unit, cand, eff)

        wrapped.input_energy = run.input_energy  # type: ignore[attr-defined]
        return wrapped

    monkeypatch.setattr(sens_mod, "_probe_runner", counting)
    info: dict[str, Any] = {}
    scaled = measure_sensitivity(sp, cal, samples=3, seq_len=None, metric="kl", progress=False, measure="scaled",
                                 info=info)
    assert scaled.keys() == full.keys()
    wo = [c for c, cand in sp.candidates.items() if cand.format in ("int4", "int8_weight")]
    assert info["scaled"] == len([u for u in sp.units for c in wo if c in sp.allowed(u)]) - len(
        [u for u in sp.units if any(c in sp.allowed(u) for c in wo)]) > 0
    fp32_rows = sum(1 for (_, c) in scaled if sp.candidates[c].format == "fp32")  # not run
    assert len(runs) == info["measured"] - fp32_rows and info["measure"] == "scaled"
    # the unit inputs' energies, independently: the float model with every unit input as an output
    proto = ir.to_proto(sp.model)
    inputs = sorted({u.input for u in sp.units})
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in inputs)
    s = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    h: dict[str, np.ndarray] = {}
    for feed in list(cal.batches(1))[:3]:
        for n, x in zip(inputs, s.run(inputs, feed), strict=True):
            x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
            h[n] = h.get(n, 0.0) + (x2 ** 2).sum(0)
    for u in sp.units:
        err = {c: sum(float(h[u.input] @ ((np.asarray(w, np.float64) - sp.weight(n)) ** 2).sum(1))
                      for n, w in (sp.effective_weights(u, c) or {}).items()) for c in wo if c in sp.allowed(u)}
        top = max(err, key=lambda c: err[c])
        assert (u.name, top) in runs and scaled[(u.name, top)] == full[(u.name, top)]
        for c in err:
            if c != top:
                assert (u.name, c) not in runs
                assert scaled[(u.name, c)] == pytest.approx(full[(u.name, top)] * err[c] / err[top], rel=1e-6)
                # the approximation itself: the scaled damage of a finer grid is of the measured one's order
                assert full[(u.name, c)] / 5 < scaled[(u.name, c)] < full[(u.name, c)] * 5, (u.name, c)
        for c, cand in sp.candidates.items():
            if cand.format not in ("int4", "int8_weight", "fp32") and c in sp.allowed(u):
                assert (u.name, c) in runs and scaled[(u.name, c)] == full[(u.name, c)]
