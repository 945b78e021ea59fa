"""Tests for quantkit.lowering.verify: ORT fused-kernel census on small QDQ graphs.

Scales are computed here with plain numpy (symmetric per-channel int8 weights,
fixed activation scales); the graphs use realistic shapes (1x16x14x14 input,
32 output channels).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.errors import LoweringError, QuantkitError
from quantkit.lowering.verify import census, io_qdq_only, optimized_graph

C_IN, C_OUT, HW = 16, 32, 14


def _weight_qdq(rng: np.random.Generator, shape: tuple[int, ...], axis: int) -> list[onnx.TensorProto]:
    """Int8 symmetric per-channel weight along ``axis``: q = round(w / s), s = max|w| / 127."""
    w = rng.standard_normal(shape).astype(np.float32)
    reduce = tuple(i for i in range(w.ndim) if i != axis)
    scale = (np.abs(w).max(axis=reduce) / 127.0).astype(np.float32)
    bshape = [1] * w.ndim
    bshape[axis] = -1
    q = np.clip(np.rint(w / scale.reshape(bshape)), -127, 127).astype(np.int8)
    return [
        numpy_helper.from_array(q, "w_q"),
        numpy_helper.from_array(scale, "w_scale"),
        numpy_helper.from_array(np.zeros(scale.shape, np.int8), "w_zp"),
    ]


def _act(name: str, scale: float, zp: int, dtype: type[np.integer]) -> list[onnx.TensorProto]:
    return [
        numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale"),
        numpy_helper.from_array(np.array(zp, dtype), f"{name}_zp"),
    ]


def _model(
    nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], in_shape: list[int], out_shape: list[int]
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def conv_model(
    *, scale: float, zp: int, dtype: type[np.integer], clip: str | None = None, seed: int = 0
) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv(3x3, 16->32, DQ weights) -> [clip variant] -> Q -> DQ -> y.

    ``clip``: None (no activation), ``"qdq"`` (Conv -> Q -> DQ -> Clip(0,6) -> Q) or
    ``"direct"`` (Conv -> Clip(0,6) -> Q).
    """
    rng = np.random.default_rng(seed)
    inits = _weight_qdq(rng, (C_OUT, C_IN, 3, 3), axis=0) + _act("a", scale, zp, dtype)
    inits += [
        numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
        numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "a_scale", "a_zp"], ["x_q"], name="q_in"),
        helper.make_node("DequantizeLinear", ["x_q", "a_scale", "a_zp"], ["x_dq"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], name="dq_w", axis=0),
        helper.make_node("Conv", ["x_dq", "w_dq"], ["conv_out"], name="conv", pads=[1, 1, 1, 1]),
    ]
    last = "conv_out"
    if clip == "qdq":
        nodes += [
            helper.make_node("QuantizeLinear", ["conv_out", "a_scale", "a_zp"], ["c_q"], name="q_conv"),
            helper.make_node("DequantizeLinear", ["c_q", "a_scale", "a_zp"], ["c_dq"], name="dq_conv"),
            helper.make_node("Clip", ["c_dq", "lo", "hi"], ["clip_out"], name="relu6"),
        ]
        last = "clip_out"
    elif clip == "direct":
        nodes.append(helper.make_node("Clip", ["conv_out", "lo", "hi"], ["clip_out"], name="relu6"))
        last = "clip_out"
    nodes += [
        helper.make_node("QuantizeLinear", [last, "a_scale", "a_zp"], ["y_q"], name="q_out"),
        helper.make_node("DequantizeLinear", ["y_q", "a_scale", "a_zp"], ["y"], name="dq_out"),
    ]
    return _model(nodes, inits, [1, C_IN, HW, HW], [1, C_OUT, HW, HW])


def matmul_float_out_model(seed: int = 0) -> onnx.ModelProto:
    """x[1,128,64] -> Q(uint8) -> DQ -> MatMul(DQ int8 per-column W[64,32]) -> y (float)."""
    rng = np.random.default_rng(seed)
    inits = _weight_qdq(rng, (64, 32), axis=1) + _act("a", 0.02, 128, np.uint8)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "a_scale", "a_zp"], ["x_q"], name="q_in"),
        helper.make_node("DequantizeLinear", ["x_q", "a_scale", "a_zp"], ["x_dq"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], name="dq_w", axis=1),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"], name="fc"),
    ]
    return _model(nodes, inits, [1, 128, 64], [1, 128, 32])


UINT8 = {"scale": 8 / 255, "zp": 128, "dtype": np.uint8}
INT8_SYM_RELU6 = {"scale": 6 / 127, "zp": 0, "dtype": np.int8}
UINT8_RELU6 = {"scale": 6 / 255, "zp": 0, "dtype": np.uint8}


@pytest.mark.parametrize("level", ["extended", "all"])
def test_conv_uint8_becomes_qlinearconv(level: str) -> None:
    result = census(conv_model(**UINT8), level=level, quantizable=["conv"])  # type: ignore[arg-type]
    assert result.quantized_kernels == {"QLinearConv": 1}
    assert result.per_layer["conv"].fused
    assert result.per_layer["conv"].kernel == "QLinearConv"
    assert "Conv" not in result.op_counts
    assert result.leftover_q == 1 and result.leftover_dq == 1
    assert io_qdq_only(result)
    if level == "all":  # NHWC variant between two Transposes
        assert result.op_counts["com.microsoft.QLinearConv"] == 1
        assert result.op_counts["Transpose"] == 2
        assert "com.microsoft.QLinearConv" in result.per_layer["conv"].note


def test_basic_level_fuses_nothing() -> None:
    result = census(conv_model(**UINT8), level="basic", quantizable=["conv"])  # type: ignore[arg-type]
    assert result.quantized_kernels == {}
    assert not result.per_layer["conv"].fused
    assert result.per_layer["conv"].kernel == "Conv"
    assert not io_qdq_only(result)


def test_relu6_with_qdq_in_between_int8_symmetric_leaves_clip_unfused() -> None:
    """Conv -> Q -> DQ -> Clip(0,6) -> Q, int8 scale 6/127 zp 0.

    Measured on ORT 1.32: the Conv itself IS fused (its own Q follows it); the
    Clip cannot be absorbed (range [-6, 6] exceeds [0, 6]) and stays in float
    between a leftover DQ and Q, so Q/DQ are left inside the graph.
    """
    model = conv_model(**INT8_SYM_RELU6, clip="qdq")  # type: ignore[arg-type]
    result = census(model, level="all", quantizable=["conv", "relu6"])
    assert result.per_layer["conv"].fused
    clip = result.per_layer["relu6"]
    assert not clip.fused and clip.kernel == "Clip"
    assert "float" in clip.note and "dq_conv" in clip.note
    assert result.leftover_q == 2 and result.leftover_dq == 2
    assert not io_qdq_only(result)
    assert any("dq_conv" in line and "Clip" in line for line in result.leftover_qdq_nodes)


def test_relu6_direct_int8_symmetric_conv_not_quantized() -> None:
    """DQ -> Conv -> Clip(0,6) -> Q with symmetric int8: RUNTIME.md's trap, Conv runs as float FusedConv."""
    model = conv_model(**INT8_SYM_RELU6, clip="direct")  # type: ignore[arg-type]
    result = census(model, level="all", quantizable=["conv"])
    conv = result.per_layer["conv"]
    assert not conv.fused
    assert conv.kernel == "FusedConv"
    assert "Clip" in conv.note and "symmetric int8" in conv.note
    assert result.quantized_kernels == {}
    assert result.unfused_layers == ["conv"]
    assert not io_qdq_only(result)


@pytest.mark.parametrize("clip", ["qdq", "direct"])
def test_relu6_uint8_zero_point_0_is_fused(clip: str) -> None:
    model = conv_model(**UINT8_RELU6, clip=clip)  # type: ignore[arg-type]
    result = census(model, level="all", quantizable=["conv", "relu6"])
    assert result.per_layer["conv"].fused and result.per_layer["conv"].kernel == "QLinearConv"
    relu6 = result.per_layer["relu6"]
    assert relu6.fused and relu6.kernel == "QLinearConv"
    assert ("absorbed" if clip == "direct" else "removed") in relu6.note
    assert "Clip" not in result.op_counts
    assert io_qdq_only(result)


def test_matmul_float_output_becomes_matmulintegertofloat() -> None:
    result = census(matmul_float_out_model(), level="all", quantizable=["fc"])
    assert result.quantized_kernels == {"MatMulIntegerToFloat": 1}
    assert result.op_counts["com.microsoft.MatMulIntegerToFloat"] == 1
    assert result.per_layer["fc"].fused
    assert result.per_layer["fc"].kernel == "MatMulIntegerToFloat"
    assert result.leftover_q == 1 and result.leftover_dq == 0
    assert io_qdq_only(result)


def test_mapping_by_weight_when_names_are_lost() -> None:
    """A layer whose node name ORT changed is still found through its weight initializer."""
    model = conv_model(**UINT8)  # type: ignore[arg-type]
    result = census(model, level="extended", quantizable=["conv"])
    assert "same node name" in result.per_layer["conv"].note
    from quantkit.lowering.verify import _match, _OptIndex, _OrigIndex

    optimized = optimized_graph(model, level="extended")
    for node in optimized.graph.node:
        if node.op_type == "QLinearConv":
            node.name = "renamed_by_runtime"
    node, how = _match(
        next(n for n in model.graph.node if n.name == "conv"),
        _OrigIndex(model.graph),
        _OptIndex(optimized.graph),
    )
    assert node is not None and node.op_type == "QLinearConv" and "w_q" in how


def test_optimized_graph_from_path_uses_temp_dir_and_external_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = conv_model(**UINT8)  # type: ignore[arg-type]
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    optimized = optimized_graph(path, level="extended")
    assert list(workdir.iterdir()) == []  # nothing written to the working directory
    weights = {init.name: init for init in optimized.graph.initializer}
    assert numpy_helper.to_array(weights["w_q"]).shape == (C_OUT, C_IN, 3, 3)  # external data loaded


def test_session_config_and_bad_arguments() -> None:
    model = conv_model(**UINT8)  # type: ignore[arg-type]
    optimized_graph(model, level="extended", session_config={"session.disable_quant_qdq": "1"})
    result = census(
        model, level="extended", quantizable=["conv"], session_config={"session.disable_quant_qdq": "1"}
    )
    assert not result.per_layer["conv"].fused
    with pytest.raises(QuantkitError, match="allowed: basic, extended, all"):
        optimized_graph(model, level="max")  # type: ignore[arg-type]
    with pytest.raises(LoweringError, match="'nope'"):
        census(model, quantizable=["nope"])
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[3].op_type = "NoSuchOp"
    with pytest.raises(LoweringError, match="could not load"):
        optimized_graph(broken)
