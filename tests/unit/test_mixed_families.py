"""Formats of every family in one model, one pipeline: an override ``{op_type: Gemm, format: int4}`` on a
CNN's classifier is honoured (not silently ignored), and the int8 chain ends cleanly before it."""

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
    # the pool ends the int8 chain: QLinearGlobalAveragePool, then ONE dequantization of its small output
    assert k.get("QLinearGlobalAveragePool") == 1, k
    by_kind = res.report["census"]["leftover_by_kind"]
    assert by_kind["stray"] == 0 and by_kind["chain_exit"] == 1, res.report["census"]["leftover_qdq_nodes"]
    assert not [w for w in res.report["warnings"] if "stray" in w]


def test_the_gemm_rewrite_keeps_op_type_overrides_matching() -> None:
    from quantkit.prep.gemm_to_matmul import gemm_to_matmul

    m = ir.from_proto(tiny_cnn())
    assert gemm_to_matmul(m, only={"fc"}) == 1
    fc = next(n for n in m.graph if n.name == "fc")
    assert fc.op_type == "MatMul" and recipe_op_type(fc) == "Gemm"


def test_a_transformer_mixes_static_int8_dynamic_int8_int4_and_fp16() -> None:
    import numpy as np

    from tests.conftest import tiny_encoder

    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(4)]
    rec = {"version": 1, "report": {"latency": {"enabled": False}},
           "quantization": {"overrides": [{"layer": "k_proj", "format": "int8_dynamic"},
                                          {"layer": "o_proj", "format": "int4", "group_size": 16}]}}
    res = quantize(tiny_encoder(), data, rec, evaluation_data=data[:2], progress=False)
    assert list(res.plan.layers) == ["q_proj"]  # static int8 (the default)
    assert [{k: r[k] for k in ("layer", "format", "kernel")} for r in res.report["linear_formats"]] == [
        {"layer": "k_proj", "format": "int8_dynamic",
                                             "kernel": "MatMulIntegerToFloat"}]
    assert [r["layer"] for r in res.report["weight_only"]] == ["o_proj"]
    # every family's layers get their output SQNR on the evaluation data, in the emitted model
    sq = {r["layer"]: r["eval_output_sqnr_db"] for r in res.report["linear_formats"] + res.report["weight_only"]}
    assert all(isinstance(v, float) and 5 < v < 80 for v in sq.values()), sq
    k = res.census.quantized_kernels
    assert k.get("MatMulIntegerToFloat") == 2 and k.get("MatMulNBits") == 1, k  # static q_proj + dynamic k_proj
    ops = {n.name: n.op_type for n in res.model.graph}
    assert ops["k_proj"] == "MatMulIntegerToFloat" and ops["o_proj"] == "MatMulNBits"
    assert any(n.op_type == "ReduceMax" and n.name.startswith("k_proj/") for n in res.model.graph)  # per token
    assert res.report["fidelity"]["y"]["mean_cosine"] > 0.99
    fp16 = quantize(tiny_encoder(), data, {**rec, "quantization": {"overrides": [{"layer": "k_proj", "format": "fp16"}]}},
                    evaluate=False, progress=False)
    assert fp16.report["linear_formats"][0]["format"] == "fp16"
    k_w = next(n for n in fp16.model.graph if n.name == "k_proj").inputs[1]
    assert k_w is not None and k_w.producer() is not None and k_w.producer().op_type == "Cast"  # 16-bit storage
