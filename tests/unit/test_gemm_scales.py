"""``Gemm`` with ``alpha`` / ``beta`` other than 1: folded into its constant operands by prep, so ONNX Runtime fuses
the QDQ Gemm into QGemm (a scaled one stayed a float Gemm between stray DequantizeLinear nodes)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort


def _model() -> object:
    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    y = g.node("Relu", [g.node("Conv", ["input", g.w("w", 16, 3, 3, 3)], "c", pads=[1, 1, 1, 1])], "r")
    y = g.node("Flatten", [g.node("GlobalAveragePool", [y], "p")], "f")
    y = g.node("Gemm", [y, g.w("fc", 16, 10), g.w("fb", 10)], "logits", alpha=0.5, beta=0.25)
    return g.model("scaled_gemm", y, ["N", 10])


def test_prep_folds_alpha_and_beta_exactly() -> None:
    from quantkit.prep.pipeline import prepare
    from tests.conftest import image_batches

    model = _model()
    prepped = prepare(ir.from_proto(model)).model
    gemm = next(n for n in prepped.graph if n.op_type == "Gemm")
    assert "alpha" not in gemm.attributes and "beta" not in gemm.attributes
    x = image_batches(1)[0]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
    got = ort.InferenceSession(ir.to_proto(prepped).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_a_scaled_gemm_is_fused() -> None:
    from quantkit.api import quantize
    from tests.conftest import image_batches

    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(_model(), image_batches(2), recipe, evaluation_data=image_batches(1, seed=2), progress=False)
    assert "logits_node" in res.plan.layers and not res.report["unfused"], res.report["unfused"]
    assert not [w for w in res.report["warnings"] if "stray" in w or "NOT fused" in w], res.report["warnings"]
