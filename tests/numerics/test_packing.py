"""INT4 packing: golden bytes, round trip, and the layout ORT reads (DequantizeLinear, MatMulNBits)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from ort_qdq import ort_dequantize

from quantkit.scheme import compute_qparams, pack_int4, quantize, unpack_int4


def test_golden_bytes() -> None:
    assert pack_int4([1, 2]).tolist() == [0x21]
    assert pack_int4([-1, 3, 7]).tolist() == [0x3F, 0x07]  # odd count: zero high nibble
    assert pack_int4([-8, 7]).tolist() == [0x78]
    assert pack_int4(np.array([[15, 0], [5, 10]], np.uint8)).tolist() == [0x0F, 0xA5]
    assert pack_int4(np.array([], np.int8)).tolist() == []
    assert unpack_int4(np.array([0x3F, 0x07], np.uint8), 3, signed=True).tolist() == [-1, 3, 7]
    assert unpack_int4(np.array([0x3F], np.uint8), 2, signed=False).tolist() == [15, 3]


def test_pack_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        pack_int4([16])
    with pytest.raises(ValueError):
        pack_int4([-9])
    with pytest.raises(ValueError):
        unpack_int4(np.zeros(1, np.uint8), 3, signed=True)


@given(st.lists(st.integers(-8, 7), max_size=65))
def test_roundtrip_signed(values: list[int]) -> None:
    packed = pack_int4(np.array(values, np.int8))
    assert packed.dtype == np.uint8 and packed.size == (len(values) + 1) // 2
    out = unpack_int4(packed, len(values), signed=True)
    assert out.dtype == np.int8
    np.testing.assert_array_equal(out, np.array(values, np.int8))


@given(st.lists(st.integers(0, 15), max_size=65))
def test_roundtrip_unsigned(values: list[int]) -> None:
    out = unpack_int4(pack_int4(np.array(values, np.uint8)), len(values), signed=False)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, np.array(values, np.uint8))


@pytest.mark.parametrize(("dtype", "lo", "hi"), [("int4", -8, 8), ("uint4", 0, 16)])
def test_ort_reads_our_layout(dtype: str, lo: int, hi: int) -> None:
    values = np.random.default_rng(0).integers(lo, hi, size=(3, 7)).astype(np.int8 if lo else np.uint8)
    out = ort_dequantize(values, np.array(np.float32(1.0)), None, dtype)
    np.testing.assert_array_equal(out, values.astype(np.float32))


def test_matmulnbits_reads_our_layout() -> None:
    """uint4 weight [K, N] in blocks of 16 along K; B[n, kb, :] packs column n's block kb, low nibble first."""
    k, n, block = 48, 5, 16
    rng = np.random.default_rng(1)
    w = rng.normal(size=(k, n)).astype(np.float32)
    blocks = w.T.reshape(n, k // block, block)
    scale, zp = compute_qparams(blocks.min(axis=2), blocks.max(axis=2), "uint4", symmetric=False)  # [N, kb]
    q = quantize(w.T, scale, zp, axis=1, block_size=block, dtype="uint4")  # [N, K]
    b = np.stack([pack_int4(row).reshape(k // block, block // 2) for row in q])
    zp_packed = np.stack([pack_int4(row) for row in zp])
    w_deq = ((q.astype(np.float32) - np.repeat(zp, block, axis=1)) * np.repeat(scale, block, axis=1)).T
    node = helper.make_node(
        "MatMulNBits", ["a", "b", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block
    )
    graph = helper.make_graph(
        [node],
        "mnb",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])],
        initializer=[
            numpy_helper.from_array(b, "b"),
            numpy_helper.from_array(scale, "s"),
            numpy_helper.from_array(zp_packed, "z"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a = rng.normal(size=(2, k)).astype(np.float32)
    # accuracy_level 0 is exact dequantize-then-MatMul up to float summation order (RUNTIME.md: <= 2e-6)
    np.testing.assert_allclose(sess.run(None, {"a": a})[0], a @ w_deq, rtol=1e-5, atol=1e-5)
