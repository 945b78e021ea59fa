"""Mixed fp32/int8 static QDQ: an fp32 override inside an int8 chain must really stay float.

ONNX Runtime's Level-1 ``WeightBiasQuantization`` quantizes the float32 weight of a
``DQ(per-tensor) -> Conv/Gemm -> [Clip ->] Q`` group itself (per tensor, symmetric int8) and
runs it as ``QLinearConv``; an fp32 depthwise Conv in an int8 chain thus ended up *worse*
than the per-channel int8 it replaced (EfficientNet-Lite0: top-1 agreement 0.925 -> 0.58).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from quantkit.api import quantize
from tests.conftest import image_batches, tiny_cnn


def _recipe(**quant: Any) -> dict[str, Any]:
    return {"version": 1, "name": "unit", "quantization": quant, "report": {"latency": {"enabled": False}}}


def _spread_cnn() -> onnx.ModelProto:
    """tiny_cnn with depthwise / projection weights whose channel magnitudes span 3 decades
    (as in real depthwise layers): per-tensor int8 flattens the small channels to zero."""
    m = tiny_cnn(seed=3)
    for init in m.graph.initializer:
        if init.name in ("w1", "w2"):
            w = numpy_helper.to_array(init)
            gain = np.logspace(-2, 1, w.shape[0]).astype(np.float32)[np.random.default_rng(1).permutation(w.shape[0])]
            init.CopyFrom(numpy_helper.from_array((w * gain[:, None, None, None]).astype(np.float32), init.name))
    return m


def _session(model: onnx.ModelProto, level: ort.GraphOptimizationLevel, path: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = level
    if path:
        so.optimized_model_filepath = path
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((ref - got).astype(np.float64) ** 2)))


def _error(float_model: onnx.ModelProto, overrides: list[str]) -> tuple[float, Any]:
    rec = _recipe(overrides=[{"layer": name, "format": "fp32"} for name in overrides])
    res = quantize(float_model, image_batches(8), rec, evaluate=False, progress=False)
    feed = image_batches(4, seed=42, batch=8)
    ref_s = _session(float_model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    q_s = _session(ir.to_proto(res.model), ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    ref = np.concatenate([ref_s.run(None, f)[0] for f in feed])
    got = np.concatenate([q_s.run(None, f)[0] for f in feed])
    return _sqnr_db(ref, got), res


@pytest.mark.parametrize("layer", ["dwconv", "project", "conv0"])
def test_single_fp32_override_never_worse_than_all_int8(layer: str) -> None:
    model = _spread_cnn()
    base, _ = _error(model, [])
    mixed, res = _error(model, [layer])
    assert layer not in res.plan.layers
    # one more float layer: the error may not grow (1 dB of slack for requantization noise)
    assert mixed >= base - 1.0, (layer, base, mixed)


def test_fp32_layer_inside_int8_chain_keeps_float_weights_in_ort(tmp_path: Any) -> None:
    """After ORT's optimizations the fp32 depthwise Conv still reads its float weight (no per-tensor
    int8 weight synthesized by ORT, no QLinearConv for it), and its DQ input is per-channel."""
    model = _spread_cnn()
    _, res = _error(model, ["dwconv"])
    proto = ir.to_proto(res.model)
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        path = str(tmp_path / f"opt_{int(level)}.onnx")
        _session(proto, level, path)
        opt = onnx.load(path)
        assert not [n.name for n in opt.graph.node if n.name.startswith("dwconv_weight")], "ORT quantized the fp32 layer"
        assert sum(n.op_type == "QLinearConv" for n in opt.graph.node) in (0, 2)  # conv0 + project only (ALL)
    dw = next(n for n in proto.graph.node if n.name == "dwconv")
    assert "w1" in dw.input  # float weight kept in the file
    dq = next(n for n in proto.graph.node if dw.input[0] in n.output)
    assert dq.op_type == "DequantizeLinear" and [a.i for a in dq.attribute if a.name == "axis"] == [1]
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    assert inits[dq.input[1]].shape == (16,) and np.all(inits[dq.input[1]] == inits[dq.input[1]][0])
    assert "stays float" in res.lowering.notes["dwconv"]
    # the per-channel DQ is bit-identical to the per-tensor one: unoptimized run == float math on DQ'd input
    feed = image_batches(1, seed=5, batch=2)[0]
    a = _session(proto, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, feed)[0]
    b = _session(proto, ort.GraphOptimizationLevel.ORT_ENABLE_ALL).run(None, feed)[0]
    np.testing.assert_allclose(a, b, atol=0.05 * np.abs(a).max())


def test_fp32_gemm_after_int8_chain_stays_float() -> None:
    """The classifier Gemm kept fp32 (logits are a graph output: ORT leaves it alone either way)."""
    model = _spread_cnn()
    base, _ = _error(model, [])
    mixed, res = _error(model, ["fc"])
    assert "QGemm" not in res.census.quantized_kernels
    assert mixed >= base - 1.0


def test_more_fp32_layers_move_toward_float() -> None:
    model = _spread_cnn()
    chain = ["conv0", "dwconv", "project", "residual", "pool", "fc"]
    errs = [_error(model, chain[:k])[0] for k in (0, 2, 3, 6)]
    assert all(b >= a - 1.0 for a, b in zip(errs[:-1], errs[1:], strict=True)), errs
    assert errs[-1] > 60  # everything float: the float model up to rounding
