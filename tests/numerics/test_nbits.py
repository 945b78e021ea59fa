"""Weight-only lowering against ONNX Runtime: MatMulNBits, blocked DequantizeLinear, tied embeddings.

Tolerances: ``MatMulNBits`` at ``accuracy_level=0`` dequantizes and runs a float32 GEMM, so its
output differs from ``x @ W_hat`` (NumPy, float32) only by summation order: <= 1e-5 relative to
max|y| (measured ~2e-7).  The GatherBlockQuantized output is exact (one multiply per element).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.algorithms.rtn import rtn
from quantkit.algorithms.woq import WOQResult
from quantkit.lowering.nbits import (
    lower_dq_matmul,
    lower_matmul_nbits,
    lower_tied_embedding,
    matmul_nbits_arrays,
)

REL = 1e-5


def _linear_model(W: np.ndarray, opset: int = 17, norm: str | None = None) -> ir.Model:
    K, N = W.shape
    nodes, inits = [], [numpy_helper.from_array(W, "W")]
    src = "x"
    if norm == "mul":
        inits.append(numpy_helper.from_array(np.linspace(0.5, 1.5, K).astype(np.float32), "g"))
        nodes.append(helper.make_node("Mul", ["x", "g"], ["h"], name="pre"))
        src = "h"
    elif norm == "ln":
        inits.append(numpy_helper.from_array(np.linspace(0.5, 1.5, K).astype(np.float32), "g"))
        inits.append(numpy_helper.from_array(np.linspace(-0.1, 0.1, K).astype(np.float32), "b"))
        nodes.append(helper.make_node("LayerNormalization", ["x", "g", "b"], ["h"], name="pre", axis=-1))
        src = "h"
    nodes.append(helper.make_node("MatMul", [src, "W"], ["y"], name="fc"))
    g = helper.make_graph(
        nodes,
        "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3, N])],
        inits,
    )
    return ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))


def _run(
    model: ir.Model, feeds: dict[str, np.ndarray], level: str = "all", config: dict | None = None
) -> list:
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    for k, v in (config or {}).items():
        opts.add_session_config_entry(k, v)
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _close(y: np.ndarray, ref: np.ndarray) -> None:
    err = float(np.max(np.abs(y - ref)))
    assert err <= REL * float(np.max(np.abs(ref))), err


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_golden_bytes_matmul_nbits_layout() -> None:
    # K = 3 (one partial block of 16), N = 2; column n's codes run along K, low nibble first
    codes = np.array([[1, 4], [2, 5], [3, 6]], np.uint8)
    res = WOQResult(codes, np.ones((1, 2), np.float32), np.full((1, 2), 8, np.uint8), 4, 16, True)
    B, scales, zp, bs = matmul_nbits_arrays(res)
    assert bs == 16 and B.shape == (2, 1, 8) and zp is None and scales.shape == (2, 1)
    # padding = zero point (8) so that it dequantizes to 0
    assert B[0, 0].tolist() == [0x21, 0x83, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88]
    assert B[1, 0].tolist() == [0x54, 0x86, 0x88, 0x88, 0x88, 0x88, 0x88, 0x88]
    # asymmetric zero points: [N, ceil(kb / 2)], kb = 3 -> 2 bytes per column
    zps = np.array([[1, 9], [2, 10], [3, 11]], np.uint8)
    res = WOQResult(np.zeros((40, 2), np.uint8), np.ones((3, 2), np.float32), zps, 4, 16, False)
    _, _, zp, _ = matmul_nbits_arrays(res)
    assert zp is not None and zp.tolist() == [[0x21, 0x03], [0xA9, 0x0B]]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("K,g", [(200, 32), (96, 64), (576, 128), (100, None)])
def test_matmul_nbits_equals_dequantized(bits: int, symmetric: bool, K: int, g: int | None) -> None:
    rng = np.random.default_rng(K + bits)
    N = 48
    W = (rng.standard_normal((K, N)) * 0.1 + (0 if symmetric else 0.05)).astype(np.float32)
    res = rtn(W, bits=bits, group_size=g, symmetric=symmetric)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    model = _linear_model(W)
    lower_matmul_nbits(model, "fc", res, accuracy_level=0)
    assert _ops(model) == ["MatMulNBits"]
    assert all(
        v.const_value is None or v.const_value.dtype != ir.DataType.FLOAT or v.name.endswith("scales")
        for v in model.graph.initializers.values()
    )
    assert "W" not in model.graph.initializers
    (y,) = _run(model, {"x": x})
    _close(y, x @ res.dequantize())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dq_matmul_equals_dequantized(bits: int, symmetric: bool) -> None:
    rng = np.random.default_rng(7)
    K, N = 200, 40
    W = (rng.standard_normal((K, N)) * 0.1 + (0 if symmetric else 0.05)).astype(np.float32)
    res = rtn(W, bits=bits, group_size=32, symmetric=symmetric)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    model = _linear_model(W, opset=17)
    lower_dq_matmul(model, "fc", res)
    assert model.opset_imports[""] == 21 and _ops(model) == ["DequantizeLinear", "MatMul"]
    assert "W" not in model.graph.initializers
    (y,) = _run(model, {"x": x}, level="basic")  # no fusion: the standard DQ kernel
    _close(y, x @ res.dequantize())
    (y,) = _run(model, {"x": x}, config={"session.qdq_matmulnbits_accuracy_level": "0"})  # fused, exact
    _close(y, x @ res.dequantize())


@pytest.mark.parametrize("norm", [None, "mul", "ln"])
def test_input_scale_mul_and_folds(norm: str | None) -> None:
    rng = np.random.default_rng(3)
    K, N = 128, 32
    W = (rng.standard_normal((K, N)) * 0.1).astype(np.float32)
    base = rtn(W, bits=4, group_size=32, symmetric=True)
    s = np.exp(rng.uniform(-1, 1, K)).astype(np.float32)
    res = WOQResult(base.codes, base.scales, base.zero_points, 4, 32, True, input_scale=s)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    model = _linear_model(W, norm=norm)
    (h,) = _run(_linear_model(np.eye(K, dtype=np.float32), norm=norm), {"x": x})  # the MatMul's input
    lower_matmul_nbits(model, "fc", res, accuracy_level=0)
    ops = _ops(model)
    assert ops.count("Mul") == (1 if norm in (None, "mul") else 0) and ops[-1] == "MatMulNBits"
    (y,) = _run(model, {"x": x})
    _close(y, (h / s) @ res.dequantize())


@pytest.mark.parametrize("transposed", ["node", "copy"])
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_tied_embedding(tmp_path: Path, block: int, transposed: str, bits: int) -> None:
    rng = np.random.default_rng(block)
    V, H = 1000, 576
    E = (rng.standard_normal((V, H)) * 0.05).astype(np.float32)
    inits = [numpy_helper.from_array(E, "E")]
    if transposed == "node":
        nodes = [helper.make_node("Transpose", ["E"], ["Et"], name="tr", perm=[1, 0])]
    else:
        nodes, inits = [], [*inits, numpy_helper.from_array(np.ascontiguousarray(E.T), "Et")]
    nodes += [
        helper.make_node("Gather", ["E", "ids"], ["emb"], name="embed"),
        helper.make_node("MatMul", ["h", "Et"], ["logits"], name="lm_head"),
    ]
    g = helper.make_graph(
        nodes,
        "tied",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "S", H]),
        ],
        [
            helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["B", "S", H]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", V]),
        ],
        inits,
    )
    model = ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    res = rtn(np.ascontiguousarray(E.T), bits=bits, group_size=block, symmetric=bits == 8)
    lower_tied_embedding(model, "embed", "lm_head", res, accuracy_level=0)
    ids = rng.integers(0, V, (2, 5)).astype(np.int64)
    h = rng.standard_normal((2, 5, H)).astype(np.float32)
    emb, logits = _run(model, {"ids": ids, "h": h})
    Wt = res.dequantize()  # [H, V]
    np.testing.assert_array_equal(emb, Wt.T[ids])
    _close(logits, h @ Wt)
    path = tmp_path / "tied.onnx"
    ir.save(model, path)
    saved = onnx.load(str(path))
    big = [t for t in saved.graph.initializer if np.prod(t.dims) >= V * H // 4]
    assert len(big) == 1 and big[0].data_type == TensorProto.UINT8  # the table is stored once, packed
    assert path.stat().st_size < V * H * bits / 8 * 1.4  # codes + block scales, no float copy left
