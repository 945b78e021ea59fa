"""Tiny ONNX Runtime graphs for bit-exact checks of quantkit.scheme against QuantizeLinear / DequantizeLinear."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from quantkit.scheme import int_type, pack_int4

_OUT_CONTAINER = {TensorProto.INT4: TensorProto.INT8, TensorProto.UINT4: TensorProto.UINT8}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    onnx.checker.check_model(model)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # run the plain kernel
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def int_initializer(name: str, values: np.ndarray, dtype: str) -> TensorProto:
    """An initializer of integer type ``dtype`` (int4/uint4 packed with quantkit's own packer)."""
    it = int_type(dtype)
    v = np.asarray(values)
    if it.bits == 4:
        t = TensorProto(name=name, data_type=it.onnx_dtype, dims=list(v.shape))
        t.raw_data = pack_int4(v).tobytes()
        return t
    return numpy_helper.from_array(v.astype(it.numpy_dtype), name)


def _attrs(axis: int | None, block_size: int | None) -> dict[str, int]:
    attrs: dict[str, int] = {}
    if axis is not None:
        attrs["axis"] = axis
    if block_size is not None:
        attrs["block_size"] = block_size
    return attrs


def ort_quantize(
    x: np.ndarray,
    scale: np.ndarray,
    zero_point: np.ndarray,
    dtype: str,
    *,
    axis: int | None = None,
    block_size: int | None = None,
    opset: int = 21,
) -> np.ndarray:
    """Run ``QuantizeLinear`` in ORT; the result is cast to the container dtype (int4 -> int8)."""
    it = int_type(dtype)
    out_t = _OUT_CONTAINER.get(it.onnx_dtype, it.onnx_dtype)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **_attrs(axis, block_size))]
    nodes.append(helper.make_node("Cast", ["q"], ["y"], to=out_t))
    graph = helper.make_graph(
        nodes,
        "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", out_t, list(x.shape))],
        initializer=[
            numpy_helper.from_array(np.asarray(scale, np.float32), "s"),
            int_initializer("z", np.asarray(zero_point), dtype),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return _session(model).run(None, {"x": np.asarray(x, np.float32)})[0]


def ort_dequantize(
    q: np.ndarray,
    scale: np.ndarray,
    zero_point: np.ndarray | None,
    dtype: str,
    *,
    axis: int | None = None,
    block_size: int | None = None,
    opset: int = 21,
) -> np.ndarray:
    """Run ``DequantizeLinear`` in ORT on ``q`` stored as an initializer of type ``dtype``."""
    inits = [int_initializer("q", q, dtype), numpy_helper.from_array(np.asarray(scale, np.float32), "s")]
    inputs = ["q", "s"]
    if zero_point is not None:
        inits.append(int_initializer("z", np.asarray(zero_point), dtype))
        inputs.append("z")
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", inputs, ["y"], **_attrs(axis, block_size))],
        "dq",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(np.shape(q)))],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return _session(model).run(None, {})[0]
