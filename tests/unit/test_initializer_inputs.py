"""Weights listed as graph inputs too (the IR version 3 convention, still written by old exporters) are taken as
constants: the emitted model used to keep every float weight as an overridable input beside the int8 ones, 1.26x
the FP32 file."""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx import helper


def test_initializers_listed_as_inputs_are_quantized_and_dropped_from_the_inputs() -> None:
    from quantkit.api import quantize
    from tests.conftest import image_batches
    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    y = g.node("Relu", [g.node("Conv", ["input", g.w("w", 16, 3, 3, 3)], "c", pads=[1, 1, 1, 1])], "r")
    y = g.node("Conv", [y, g.w("w2", 16, 16, 3, 3)], "y", pads=[1, 1, 1, 1])
    model = g.model("ir3_style", y, ["N", 16, 16, 16])
    for t in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    onnx.checker.check_model(model)
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(model, image_batches(2), recipe, evaluation_data=image_batches(1, seed=2), progress=False)
    out = ir.to_proto(res.model)
    assert [i.name for i in out.graph.input] == ["input"]
    assert len(res.plan.layers) == 2 and res.report["size"]["ratio"] < 0.6  # float weights kept: > 1
    assert res.report["quality"]["fidelity"]["y"]["sqnr_db"] > 25
