"""Spatial ReduceMean -> GlobalAveragePool (prep rule): count, numerics, and the int8 chain it keeps."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantkit.api import quantize
from quantkit.prep.global_pool import global_pool_rules
from quantkit.prep.pipeline import prepare
from tests.conftest import image_batches


def _cnn(opset: int, keepdims: int, axes: str) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    if opset >= 18:
        body = f"""
            ax = Constant <value = int64[{len(axes.split(','))}] {{{axes}}}> ()
            p = ReduceMean <keepdims = {keepdims}> (r, ax)"""
    else:
        body = f"""
            p = ReduceMean <keepdims = {keepdims}, axes = [{axes}]> (r)"""
    flat = "f = Flatten <axis = 1> (p)" if keepdims else "f = Identity (p)"
    text = f"""
    <ir_version: 9, opset_import: ["" : {opset}]>
    g (float[N, 3, 16, 16] input) => (float[N, 10] logits) {{
        c = Conv <pads = [1, 1, 1, 1]> (input, w0, b0)
        r = Relu (c){body}
        {flat}
        logits = Gemm <transB = 1> (f, fc_w, fc_b)
    }}"""
    m = onnx.parser.parse_model(text)
    m.graph.initializer.extend([
        onnx.numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w0"),
        onnx.numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "b0"),
        onnx.numpy_helper.from_array((rng.standard_normal((10, 8)) * 0.3).astype(np.float32), "fc_w"),
        onnx.numpy_helper.from_array((rng.standard_normal(10) * 0.1).astype(np.float32), "fc_b"),
    ])
    return m


def _run(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"input": x})[0]


@pytest.mark.parametrize(("opset", "keepdims", "axes"), [(17, 1, "2, 3"), (17, 0, "-2, -1"), (18, 0, "2, 3"),
                                                         (18, 1, "3, 2")])
def test_spatial_reduce_mean_becomes_global_average_pool(opset: int, keepdims: int, axes: str) -> None:
    m = _cnn(opset, keepdims, axes)
    x = np.random.default_rng(1).uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
    ref = _run(m, x)
    prep = prepare(ir.from_proto(m))
    assert prep.applied["global_pool"] == 1
    ops = Counter(n.op_type for n in prep.model.graph)
    assert ops["GlobalAveragePool"] == 1 and ops["ReduceMean"] == 0
    got = _run(ir.to_proto(prep.model), x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)  # float32 summation order only


def test_reduce_mean_over_channels_is_left_alone() -> None:
    m = _cnn(17, 1, "1")
    model = ir.from_proto(m)
    assert global_pool_rules().apply_to_model(model) == 0


def test_the_rewrite_keeps_the_int8_chain_fused() -> None:
    res = quantize(_cnn(18, 0, "2, 3"), image_batches(4), {"version": 1, "report": {"latency": {"enabled": False}}},
                   evaluate=False, progress=False)
    k = res.census.quantized_kernels
    assert k.get("QLinearGlobalAveragePool") == 1 and k.get("QLinearConv") == 1, k
    assert res.report["census"]["leftover_by_kind"]["stray"] == 0
