"""INT8 QDQ lowering on tiny graphs: what is quantized, what ONNX Runtime fuses, and numerics."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantkit.api import quantize
from quantkit.lowering.qdq import activation_params
from quantkit.lowering.select import TensorQuant, select
from quantkit.recipe import load_recipe
from tests.conftest import image_batches, tiny_cnn, tiny_encoder


def _recipe(**quant: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "name": "unit",
        "quantization": quant,
        "report": {"latency": {"enabled": False}},
    }


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)


def test_cnn_uint8_fully_fused(cnn_model: onnx.ModelProto) -> None:
    data = image_batches(8)
    res = quantize(cnn_model, data, _recipe(), evaluation_data=image_batches(4, seed=9), progress=False)
    k = res.census.quantized_kernels
    # every Conv, the residual Add, the pool and the classifier run as quantized kernels
    assert k.get("QLinearConv") == 3 and k.get("QLinearAdd") == 1
    assert k.get("QLinearGlobalAveragePool") == 1 and k.get("QGemm") == 1
    assert all(f.fused for f in res.census.per_layer.values()), res.census.per_layer
    assert res.report["census"]["leftover_by_kind"]["stray"] == 0
    assert not res.report["unfused"]
    # both Clip(0, 6) were absorbed (their range is folded into the Conv output quantization)
    assert res.census.op_counts.get("Clip", 0) == 0
    # the tiny random net is not a real model; 20 dB is a loose sanity floor for 8-bit on it
    assert res.report["fidelity"]["logits"]["sqnr_db"] > 20


def test_symmetric_int8_activations_still_fuse_with_clip_folding(cnn_model: onnx.ModelProto) -> None:
    """The trap from RUNTIME.md: symmetric int8 (scale 6/127) keeps Clip(0,6) and the Conv unfused.
    quantkit folds the clip range (zero point -128, exact), so everything fuses."""
    rec = _recipe(default={"activations": {"dtype": "int8", "symmetric": True}})
    res = quantize(cnn_model, image_batches(4), rec, evaluate=False, progress=False)
    assert res.census.quantized_kernels.get("QLinearConv") == 3
    assert res.census.op_counts.get("Clip", 0) == 0
    notes = [t.note for t in res.lowering.tensors.values() if t.note.startswith("folded")]
    assert len(notes) == 2 and all("symmetric request overridden" in n for n in notes)
    # int8 zero point -128 stored as uint8 zero point 0 (the same grid)
    assert all(t.zero_point == 0 and t.dtype == "uint8" for t in res.lowering.tensors.values() if t.note.startswith("folded"))
    assert res.report["census"]["leftover_by_kind"]["stray"] == 0


def test_symmetric_int8_without_folding_is_reported_unfused(cnn_model: onnx.ModelProto) -> None:
    """Pinned: with folding disabled the symmetric int8 graph is NOT fully fused, and the report says so."""
    rec = _recipe(default={"activations": {"dtype": "int8", "symmetric": True}}, fold_clip_ranges=False)
    rec["export"] = {"activation_storage": "as_requested"}
    res = quantize(cnn_model, image_batches(4), rec, evaluate=False, progress=False)
    kinds = res.report["census"]["leftover_by_kind"]
    assert kinds["stray"] > 0
    # the activations are not folded: each runs between a DQ and a Q of two grids - as LeakyRelu(0) (select rule
    # 12), fused into QLinearLeakyRelu where its input and output codes share a type, else in float
    acts = ("Clip", "LeakyRelu", "com.microsoft.QLinearLeakyRelu")
    assert sum(res.census.op_counts.get(k, 0) for k in acts) == 2, res.census.op_counts
    assert any("stray" in w for w in res.report["warnings"])


def test_encoder_quantizes_linear_layers_only(encoder_model: onnx.ModelProto) -> None:
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(4)]
    res = quantize(encoder_model, data, _recipe(), evaluation_data=data, progress=False)
    assert set(res.plan.layers) == {"q_proj", "k_proj", "o_proj"}
    # activation x activation products, the residual Add and bias Adds stay float, with reasons
    assert "weight is not a constant" in res.plan.skipped["scores"]
    assert "not in an int8 chain" in res.plan.skipped["residual"]
    assert res.census.quantized_kernels.get("MatMulIntegerToFloat") == 3
    # q_proj and k_proj share their input: it is quantized once
    assert len([t for t in res.plan.tensors.values() if t.name == "h"]) == 1
    assert res.report["fidelity"]["y"]["mean_cosine"] > 0.99


def test_override_keeps_layer_float(cnn_model: onnx.ModelProto) -> None:
    rec = _recipe(overrides=[{"layer": "fc", "format": "fp32"}])
    res = quantize(cnn_model, image_batches(2), rec, evaluate=False, progress=False)
    assert "fc" not in res.plan.layers
    assert res.plan.skipped["fc"].startswith("the plan keeps it fp32")
    assert "QGemm" not in res.census.quantized_kernels


def test_weights_stored_as_int8_and_no_float_copy(cnn_model: onnx.ModelProto) -> None:
    res = quantize(cnn_model, image_batches(2), _recipe(), evaluate=False, progress=False)
    proto = ir.to_proto(res.model)
    names = {i.name: i for i in proto.graph.initializer}
    for w in ("w0", "w1", "w2", "fc_w"):
        assert w not in names, f"float copy of {w} left in the file"
    ints = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) > 1]
    assert len(ints) == 4
    biases = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.INT32 and i.name.endswith("_quantized")]
    assert len(biases) == 4  # three Conv biases and the Gemm bias as int32
    onnx.checker.check_model(proto)


def test_quantized_outputs_close_to_float_per_sample(cnn_model: onnx.ModelProto) -> None:
    res = quantize(cnn_model, image_batches(8), _recipe(), evaluate=False, progress=False)
    feed = image_batches(1, seed=42, batch=2)[0]
    ref = _run(cnn_model, feed)[0]
    got = _run(ir.to_proto(res.model), feed)[0]
    np.testing.assert_allclose(got, ref, atol=0.1 * np.abs(ref).max())


def test_clip_fold_scale_never_exceeds_clip_bound() -> None:
    """ORT removes Clip(0, hi) only if scale * (qmax - zp) <= hi (within one float epsilon)."""
    for hi in (6.0, 1.0, 0.1, 3.3, 1e-3):
        for dtype in ("uint8", "int8"):
            tq = TensorQuant("t", dtype, False, "minmax", clip=(0.0, hi))
            p = activation_params(tq, -1.0, hi * 2)  # calibrated range wider than the clip
            qmax = 255 if dtype == "uint8" else 127
            upper = np.float32(p.scale) * np.float32(qmax - p.zero_point)
            assert upper <= np.float32(hi) + np.finfo(np.float32).eps
            assert p.zero_point == (0 if dtype == "uint8" else -128)


def test_select_plan_is_what_calibration_observes(cnn_model: onnx.ModelProto) -> None:
    from quantkit.prep.pipeline import prepare

    model = prepare(ir.from_proto(cnn_model)).model
    plan = select(model, load_recipe(_recipe()))
    cal = plan.calibrated_tensors()
    # folded activations are observed after the Clip, never the raw Conv output
    assert "a0" in cal and "a1" in cal and "c0" not in cal and "c1" not in cal
    # Flatten inherits the pool output's parameters: not calibrated separately
    assert plan.tensors["f"].inherit_from == "p" and "f" not in cal


def test_no_calibration_data_is_a_clear_error(cnn_model: onnx.ModelProto) -> None:
    from quantkit.errors import QuantkitError

    with pytest.raises(QuantkitError, match="needs calibration data"):
        quantize(cnn_model, None, _recipe(), progress=False)


def test_relu_graph_fuses() -> None:
    res = quantize(tiny_cnn(clip=False), image_batches(2), _recipe(), evaluate=False, progress=False)
    assert res.census.quantized_kernels.get("QLinearConv") == 3
    assert res.census.op_counts.get("Relu", 0) == 0


def test_encoder_int8_weights_asymmetric_reports_per_layer(encoder_model: onnx.ModelProto) -> None:
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((1, 8, 32)).astype(np.float32)} for _ in range(2)]
    rec = _recipe(default={"weights": {"dtype": "int8", "symmetric": False}})
    res = quantize(tiny_encoder(), data, rec, evaluation_data=data, progress=False)
    rows = {r["layer"]: r for r in res.report["layers"]}
    assert rows["q_proj"]["weights"]["symmetric"] is False
    assert rows["q_proj"]["kernel"] == "MatMulIntegerToFloat" and rows["q_proj"]["fused"] is True
    assert rows["q_proj"]["output_sqnr_db"] is not None


def test_fused_linear_absorbs_bias_and_matches_qdq_form(encoder_model: onnx.ModelProto) -> None:
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(4)]
    fused = quantize(encoder_model, data, _recipe(), evaluate=False, progress=False)
    rec = _recipe()
    rec["export"] = {"matmul_form": "qdq"}
    qdq = quantize(encoder_model, data, rec, evaluate=False, progress=False)
    fp = ir.to_proto(fused.model)
    ops = [n.op_type for n in fp.graph.node]
    assert ops.count("MatMulIntegerToFloat") == 3 and "q_bias" not in {n.name for n in fp.graph.node}
    assert not any(n.op_type == "MatMul" and n.name.endswith("proj") for n in fp.graph.node)
    qp = ir.to_proto(qdq.model)
    assert [n.op_type for n in qp.graph.node].count("MatMulIntegerToFloat") == 0
    feed = {"x": rng.standard_normal((1, 8, 32)).astype(np.float32)}
    # the same integer arithmetic in two forms: equal up to float summation order
    np.testing.assert_allclose(_run(fp, feed)[0], _run(qp, feed)[0], atol=1e-4)


COMBOS = [(a, s, w, ws) for a, s in (("uint8", False), ("int8", True), ("int8", False))
          for w, ws in (("int8", True), ("int8", False), ("uint8", False))]


@pytest.mark.parametrize(("act", "act_sym", "w", "w_sym"), COMBOS)
def test_every_type_combination_fuses_or_is_reported(act: str, act_sym: bool, w: str, w_sym: bool) -> None:
    """Every activation/weight combination a recipe may ask for: with the default storage the CNN and
    the encoder fuse completely; keeping int8 Q/DQ as requested leaves layers unfused, and then the
    report names each one (pinned: symmetric int8 / int8)."""
    quant = {"default": {"activations": {"dtype": act, "symmetric": act_sym}, "weights": {"dtype": w, "symmetric": w_sym}}}
    res = quantize(tiny_cnn(), image_batches(2), _recipe(**quant), evaluate=False, progress=False)
    assert not res.report["unfused"] and res.report["census"]["leftover_by_kind"]["stray"] == 0
    assert res.census.quantized_kernels.get("QLinearConv") == 3
    rec = _recipe(**quant)
    rec["export"] = {"activation_storage": "as_requested"}
    res = quantize(tiny_cnn(), image_batches(2), rec, evaluate=False, progress=False)
    if act == "uint8":
        assert not res.report["unfused"]
    else:
        unfused = {u["layer"] for u in res.report["unfused"]}
        assert unfused and all(res.census.per_layer[name].fused is False for name in unfused)
        assert any("NOT fused" in w for w in res.report["warnings"])


def test_clip_search_in_blocks_of_columns_equals_the_whole_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide weight is searched in blocks of columns (bounded temporaries): the ranges are the same, bit for bit."""
    import quantkit.algorithms.rtn as rtn_mod

    rng = np.random.default_rng(3)
    w = rng.normal(size=(200, 37)).astype(np.float32)
    imp = rng.uniform(0.5, 2.0, size=200)
    whole = rtn_mod.clip_ranges(w, 4, 64, symmetric=False, importance=imp)
    monkeypatch.setattr(rtn_mod, "_CLIP_CHUNK", 200 * 5)  # 5 columns a block: 8 blocks, the last one of 2
    blocks = rtn_mod.clip_ranges(w, 4, 64, symmetric=False, importance=imp)
    for a, b in zip(whole, blocks, strict=True):
        np.testing.assert_array_equal(a, b)


def test_rtn_in_blocks_of_columns_equals_the_whole_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    import quantkit.algorithms.rtn as rtn_mod

    w = np.random.default_rng(4).normal(size=(130, 23)).astype(np.float32)
    for sym in (True, False):
        whole = rtn_mod.rtn(w, bits=4, group_size=64, symmetric=sym)
        with monkeypatch.context() as mp:
            mp.setattr(rtn_mod, "_CLIP_CHUNK", 130 * 4)  # 4 columns a block
            blocks = rtn_mod.rtn(w, bits=4, group_size=64, symmetric=sym)
        for a, b in ((whole.codes, blocks.codes), (whole.scales, blocks.scales),
                     (whole.zero_points, blocks.zero_points)):
            np.testing.assert_array_equal(a, b)
