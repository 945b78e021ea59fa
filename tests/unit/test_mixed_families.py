"""Static INT8 and weight-only formats in one model (a first slice of the one-precision-plan work):
an override ``{op_type: Gemm, format: int4}`` on a CNN's classifier is honoured, not silently ignored."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from quantkit.api import quantize
from quantkit.lowering.select import recipe_op_type
from tests.conftest import image_batches, tiny_cnn


@pytest.mark.parametrize("fmt", ["int4", "int8_weight"])
def test_int8_convs_and_a_weight_only_classifier_in_one_model(fmt: str) -> None:
    rec = {"version": 1, "report": {"latency": {"enabled": False}},
           "quantization": {"overrides": [{"op_type": "Gemm", "format": fmt, "group_size": 16}]}}
    res = quantize(tiny_cnn(), image_batches(8), rec, evaluation_data=image_batches(2, seed=4), progress=False)
    k = res.census.quantized_kernels
    assert k.get("QLinearConv") == 3 and k.get("MatMulNBits") == 1, k
    [row] = res.report["weight_only"]
    assert row["layer"] == "fc" and row["format"] == fmt and row["kernel"] == "MatMulNBits"
    assert "fc" not in res.plan.layers  # not static int8
    fc = next(n for n in res.model.graph if n.name == "fc")
    assert fc.op_type == "MatMulNBits"
    assert res.report["fidelity"]["logits"]["top1_agreement"] >= 0.75  # 8 samples; a broken model gives ~0.1


def test_the_gemm_rewrite_keeps_op_type_overrides_matching() -> None:
    from quantkit.prep.gemm_to_matmul import gemm_to_matmul

    m = ir.from_proto(tiny_cnn())
    assert gemm_to_matmul(m, only={"fc"}) == 1
    fc = next(n for n in m.graph if n.name == "fc")
    assert fc.op_type == "MatMul" and recipe_op_type(fc) == "Gemm"
