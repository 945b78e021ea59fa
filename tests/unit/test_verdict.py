"""Whole-model verdicts: error growth along the graph and the warnings that name the layers."""

from __future__ import annotations

import math

import onnx
import pytest

from quantkit.report.verdict import IDEAL_INT8_DB, error_growth, layer_predecessors, verdict_warnings

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
    kernels["check"]["agree"] = False  # a layer that parts is reported by the kernel check itself
    assert verdict_warnings(good, growth, kernels, drift) == []
