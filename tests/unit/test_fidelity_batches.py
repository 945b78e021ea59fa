"""The fidelity pass compares the quantized model's outputs with FP32's for the same batch.  FP32 outputs kept
from one-sample runs (the kernel check's, the per-layer probe's) stand for a batch only while they equal the
batched run: a model whose outputs mix the samples of a batch (a normalization over the batch axis) was measured
against per-sample FP32 outputs - a wrong SQNR - and a model with a scalar output crashed (np.concatenate)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

import quantkit


def _model(batch_mix: bool, scalar: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [16, 8], rng.standard_normal((16, 8)).astype(np.float32).ravel())
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc")]
    if batch_mix:  # y = h - mean over the batch: each sample's output depends on the others
        nodes += [helper.make_node("ReduceMean", ["h"], ["m"], name="batch_mean", axes=[0], keepdims=1),
                  helper.make_node("Sub", ["h", "m"], ["y"], name="centre")]
    else:
        nodes += [helper.make_node("Relu", ["h"], ["y"], name="act")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])]
    if scalar:
        nodes += [helper.make_node("ReduceSum", ["h"], ["total"], name="total", keepdims=0)]
        outs.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, []))
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])], outs, [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((ref - got).astype(np.float64) ** 2)))


RECIPE = {"version": 1, "name": "fid", "evaluation": {"batch_size": 4},
          "report": {"latency": {"enabled": False}, "kernel_check_samples": 8}}


def test_a_model_mixing_its_batch_is_measured_against_batched_fp32() -> None:
    rng = np.random.default_rng(1)
    cal = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(4)]
    ev = [{"x": (rng.standard_normal((1, 16)) + 3 * rng.standard_normal(16)).astype(np.float32)} for _ in range(8)]
    model = _model(batch_mix=True, scalar=False)
    res = quantkit.quantize(model, cal, RECIPE, evaluation_data=ev, progress=False)
    reported = res.report["fidelity"]["y"]["sqnr_db"]
    x = np.concatenate([e["x"] for e in ev])
    f = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    q = ort.InferenceSession(ir.to_proto(res.model).SerializeToString(), providers=["CPUExecutionProvider"])
    want = _sqnr(np.concatenate([f.run(["y"], {"x": x[i:i + 4]})[0] for i in (0, 4)]),
                 np.concatenate([q.run(["y"], {"x": x[i:i + 4]})[0] for i in (0, 4)]))
    assert abs(reported - want) < 0.05, (reported, want)


def test_a_scalar_output_is_compared_batch_by_batch() -> None:
    rng = np.random.default_rng(2)
    cal = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(4)]
    ev = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(8)]
    res = quantkit.quantize(_model(batch_mix=False, scalar=True), cal, RECIPE, evaluation_data=ev, progress=False)
    fid = res.report["fidelity"]
    assert fid["total"]["samples"] > 0 and np.isfinite(fid["y"]["sqnr_db"])


def test_evaluation_data_of_the_wrong_shape_is_refused_before_any_work() -> None:
    """It used to reach ONNX Runtime in the kernel check, after calibration, as a raw InvalidArgument (or, for a
    fixed spatial size, leave the run without figures)."""
    import pytest

    from quantkit.errors import DataError
    from tests.conftest import image_batches, tiny_cnn

    for shape in ((1, 3, 20, 20), (1, 3, 16)):
        ev = [{"input": np.zeros(shape, np.float32)}]
        with pytest.raises(DataError, match=r"evaluation_data: input 'input' .* the model takes float32\[\?,3,16,16\]"):
            quantkit.quantize(tiny_cnn(), image_batches(2), RECIPE, evaluation_data=ev, progress=False)
