"""Whole-model verdicts: error growth along the graph and the warnings that name the layers."""

from __future__ import annotations

import math
from typing import Any

import onnx
import pytest

from quantkit.report.build import render_markdown
from quantkit.report.verdict import (
    IDEAL_INT8_DB,
    error_growth,
    layer_predecessors,
    layers_between,
    upstream_layers,
    verdict_warnings,
)

GRAPH = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4] x) => (float[1,4] y) <float[4,4] w1, float[4,4] w2, float[4,4] w3> {
    a = MatMul(x, w1)
    r = Relu(a)
    b = MatMul(r, w2)
    c = MatMul(r, w3)
    s = Add(b, c)
    y = Identity(s)
}
"""


def _model() -> onnx.ModelProto:
    m = onnx.parser.parse_model(GRAPH)
    for i, n in enumerate(m.graph.node):
        n.name = ["l1", "relu", "l2", "l3", "add", "id"][i]
    return m


def test_predecessors_walk_through_nodes_that_are_not_layers() -> None:
    preds = layer_predecessors(_model(), {"l1", "l2", "l3", "add"})
    assert sorted(preds["add"]) == ["l2", "l3"]
    assert preds["l2"] == ["l1"] and preds["l3"] == ["l1"] and preds["l1"] == []  # through the Relu


def test_growth_is_measured_from_the_worst_input() -> None:
    preds = layer_predecessors(_model(), {"l1", "l2", "l3", "add"})
    rows = error_growth({"l1": 40.0, "l2": 35.0, "l3": 20.0, "add": 19.0, "x": math.inf}, preds)
    by = {r["layer"]: r for r in rows}
    assert by["l1"]["in_db"] == pytest.approx(IDEAL_INT8_DB)  # fed by the exact graph input
    assert by["l3"]["growth_db"] == pytest.approx(20.0) and by["l2"]["growth_db"] == pytest.approx(5.0)
    assert by["add"]["in_db"] == pytest.approx(20.0) and by["add"]["growth_db"] == pytest.approx(1.0)
    assert rows[0]["layer"] == "l3"  # the largest growth first


def test_verdicts_name_the_layers_and_print_a_recipe_snippet() -> None:
    preds = layer_predecessors(_model(), {"l1", "l2", "l3", "add"})
    growth = error_growth({"l1": 40.0, "l2": 35.0, "l3": 20.0, "add": 19.0}, preds)
    good = {"logits": {"sqnr_db": 31.0, "top1_agreement": 0.98}}
    assert verdict_warnings(good, growth, {}, []) == []
    bad = {"logits": {"sqnr_db": 12.0, "top1_agreement": 0.6}}
    (w,) = verdict_warnings(bad, growth, {}, [])
    assert "l3 (40.0 -> 20.0 dB)" in w and "{layer: l3, format: fp32}" in w
    drift = error_growth({"l1": 90.0, "l2": 80.0, "l3": 45.0, "add": 44.0}, preds)
    kernels = {"check": {"agree": True, "outputs": {"logits": {"sqnr_db": 22.0, "top1_agreement": 0.8}}}}
    ws = verdict_warnings(good, growth, kernels, drift)
    assert len(ws) == 1 and ws[0].startswith("kernels:") and "l3 (90.0 -> 45.0 dB)" in ws[0]
    # a drift that grows at an op no override can name (a float GELU's output): the snippet names only layers
    (w,) = verdict_warnings(good, growth, kernels, drift, layers={"l1", "l2", "add"})
    assert "l3 (90.0 -> 45.0 dB)" in w and "{layer: l3," not in w and "{layer: add, format: fp32}" in w
    (w,) = verdict_warnings(good, growth, kernels, drift, layers={"l1"})
    assert "fp32" not in w and "read those ops' outputs in float" in w
    kernels["check"]["agree"] = False  # a layer that parts is reported by the kernel check itself
    assert verdict_warnings(good, growth, kernels, drift) == []


def test_growth_between_layers_is_split_from_the_layers_own() -> None:
    """With the SQNR of what a layer reads, the error that float ops between layers amplify is its own row,
    and the verdict names the layers before those ops, not the layer after them."""
    preds = layer_predecessors(_model(), {"l1", "l2", "l3", "add"})
    values = {"l1": 40.0, "l2": 15.0, "l3": 38.0, "add": 14.0}
    inputs = {"l2": 16.0, "l3": 39.5}  # the Relu between l1 and l2 made l2's input 24 dB worse than l1's output
    rows = error_growth(values, preds, inputs, {"l2": ["Relu"], "l3": ["Relu"]})
    first = rows[0]
    assert first["kind"] == "between" and first["layer"] == "l2" and first["after"] == ["l1"]
    assert first["growth_db"] == pytest.approx(24.0) and first["via"] == ["Relu"]
    own = {(r["kind"], r["layer"]): r for r in rows}
    assert own[("layer", "l2")]["in_db"] == pytest.approx(16.0) and own[("layer", "l2")]["growth_db"] == pytest.approx(1)
    assert own[("layer", "l1")]["in_db"] == pytest.approx(IDEAL_INT8_DB)  # no input figure: as before
    bad = {"y": {"sqnr_db": 12.0}}
    (w,) = verdict_warnings(bad, rows, {}, [])
    assert "the Relu between l1 and l2 (40.0 -> 16.0 dB" in w and "keeping l2 in float would not help" in w
    snippet = w.split("Try keeping")[1]
    assert "{layer: l1, format: fp32}" in snippet and "{layer: l2," not in snippet


def test_upstream_layers_are_nearest_first() -> None:
    m = _model()
    assert upstream_layers(m, {"l1", "l2", "l3", "add"}, "add") == (["l2", "l3", "l1"], 0) or \
        upstream_layers(m, {"l1", "l2", "l3", "add"}, "add") == (["l3", "l2", "l1"], 0)
    assert upstream_layers(m, {"l1", "l2", "l3", "add"}, "add", limit=1)[1] == 2
    assert layers_between(m, {"l1", "l2"})["l2"] == ["Relu"]


def _offset_ln_model() -> onnx.ModelProto:
    import numpy as np

    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    c = g.node("Conv", ["input", g.w("w", 8, 3, 3, 3, s=0.02), g.c("b", np.full(8, 10.0))], "conv", pads=[1, 1, 1, 1])
    t = g.node("Transpose", [c], "nhwc", perm=[0, 2, 3, 1])
    ln = g.node("LayerNormalization", [t, g.c("gamma", np.ones(8)), g.c("beta", np.zeros(8))], "ln", axis=-1)
    y = g.node("MatMul", [ln, g.w("wm", 8, 8)], "y")
    return g.model("offset_ln", y, ["N", 16, 16, 8])


@pytest.mark.latency_guard
@pytest.mark.fidelity_guard
def test_the_fidelity_guards_record_survives_a_latency_guard_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    """The latency guard runs on what the fidelity guard ships; when it re-runs the plan (a float prefix, say), the
    report it ships still holds the fidelity guard's decision and time."""
    import quantkit.guard
    from quantkit.api import quantize
    from tests.conftest import image_batches

    reruns: list[Any] = []

    def fake_latency_guard(result: Any, rerun: Any, feed: Any, **kw: Any) -> Any:
        reruns.append(result.precision)
        second = rerun(result.precision)
        second.report["latency_guard"] = {"decision": "re-run (faked)"}
        return second

    monkeypatch.setattr(quantkit.guard, "apply_latency_guard", fake_latency_guard)
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"repeat": 2, "warmup": 0}}}
    res = quantize(_offset_ln_model(), image_batches(4), recipe, evaluation_data=image_batches(2, seed=2),
                   progress=False)
    assert len(reruns) == 1 and reruns[0].decided["conv_node"].rule == "fidelity guard"
    assert res.report["fidelity_guard"]["float_layers"] == ["conv_node"]
    assert res.report["latency_guard"]["decision"] == "re-run (faked)"
    tim = list(res.report["timings"])
    assert tim.index("fidelity_guard_s") < tim.index("latency_guard_s") < tim.index("total_s") == len(tim) - 1


@pytest.mark.fidelity_guard
def test_report_names_the_layers_before_an_amplifying_layernorm() -> None:
    """End to end on a tiny graph: a Conv whose output is mostly a common offset (bias 10 on every channel), then a
    LayerNorm over the channels (it removes the offset: the int8 error of the Conv's output, small against 10, is
    large against what remains), then a MatMul.  The report must name the Conv (keeping it float fixes the model),
    not the MatMul (keeping that float changes nothing)."""
    from quantkit.api import quantize
    from tests.conftest import image_batches

    model = _offset_ln_model()
    recipe: dict[str, Any] = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}},
                              "evaluation": {"fidelity_guard": False}}
    res = quantize(model, image_batches(4), recipe, evaluation_data=image_batches(2, seed=2), progress=False)
    before = res.report["quality"]["fidelity"]["y"]["sqnr_db"]
    assert "fidelity_guard" not in res.report
    (w,) = [w for w in res.report["warnings"] if w.startswith("accuracy:")]
    assert "between conv_node and y_node" in w and "LayerNormalization" in w, w
    snippet = w.split("Try keeping")[1]
    assert "{layer: conv_node, format: fp32}" in snippet and "y_node" not in snippet, w
    fixed_by_hand = dict(recipe, quantization={"overrides": [{"layer": "conv_node", "format": "fp32"}]})
    fixed = quantize(model, image_batches(4), fixed_by_hand, evaluation_data=image_batches(2, seed=2), progress=False)
    assert fixed.report["quality"]["fidelity"]["y"]["sqnr_db"] > before + 10
    # the default (evaluation.fidelity_guard: true) measures the verdict's snippet and ships it: the same model
    guarded = quantize(model, image_batches(4), {k: v for k, v in recipe.items() if k != "evaluation"},
                       evaluation_data=image_batches(2, seed=2), progress=False)
    g_rec = guarded.report["fidelity_guard"]
    assert g_rec["float_layers"] == ["conv_node"] and g_rec["first"]["worst_sqnr_db"] == pytest.approx(before)
    assert g_rec["candidates"][0]["shipped"] and "shipped with 1 layer(s) in float" in g_rec["decision"]
    # the same layers in float as the hand-written override (the guard re-uses the first run's calibrator choice)
    assert guarded.report["quality"]["fidelity"]["y"]["sqnr_db"] > before + 10
    assert guarded.precision is not None and guarded.lowered is not None
    chosen = guarded.precision.decided["conv_node"]
    assert chosen.format == "fp32" and chosen.rule == "fidelity guard"
    assert guarded.lowered.formats() == {"y_node": "int8"}
    assert not [w for w in guarded.report["warnings"] if w.startswith("accuracy:")]
    assert "fidelity_guard_s" in guarded.report["timings"] and list(guarded.report["timings"])[-1] == "total_s"
    assert "Fidelity guard: shipped with 1 layer(s) in float" in render_markdown(guarded.report)
