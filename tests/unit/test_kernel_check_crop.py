"""The kernel check cuts token sequences to 64 positions (it tests arithmetic, not context) - only along a dynamic
sequence axis, and every input of that length with it.  It used to cut each 2-D int64 input alone: a model with a
fixed sequence length, a float attention mask or a ``bbox [N, S, 4]`` input crashed with an internal error."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.data import ArrayDataset
from quantkit.pipeline import KERNEL_CHECK_TOKENS, _cropped, _seq_axes


def _encoder(seq: Any) -> onnx.ModelProto:
    """input_ids [N, seq] (int64), attention_mask [N, seq] (float), bbox [N, seq, 4] (int64) -> a tiny encoder."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((100, 16)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((50, 16)).astype(np.float32), "bemb"),
             numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32) * 0.3, "w2"),
             numpy_helper.from_array(np.array([-1], np.int64), "ax"),
             numpy_helper.from_array(np.array([2], np.int64), "ax2")]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["e"], name="embed"),
             helper.make_node("Gather", ["bemb", "bbox"], ["b4"], name="bbox_embed"),
             helper.make_node("ReduceSum", ["b4", "ax2"], ["b"], keepdims=0, name="bsum"),
             helper.make_node("Add", ["e", "b"], ["h0"], name="add"),
             helper.make_node("Unsqueeze", ["attention_mask", "ax"], ["m"], name="unsq"),
             helper.make_node("Mul", ["h0", "m"], ["h"], name="mask"),
             helper.make_node("MatMul", ["h", "w1"], ["x1"], name="fc1"),
             helper.make_node("Relu", ["x1"], ["r1"], name="relu"),
             helper.make_node("MatMul", ["r1", "w2"], ["out"], name="fc2")]
    graph = helper.make_graph(nodes, "enc", [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", seq]),
        helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["N", seq]),
        helper.make_tensor_value_info("bbox", TensorProto.INT64, ["N", seq, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", seq, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _data(n: int, seq: int) -> ArrayDataset:
    rng = np.random.default_rng(1)
    return ArrayDataset({"input_ids": rng.integers(0, 100, (n, seq)), "attention_mask": np.ones((n, seq), np.float32),
                         "bbox": rng.integers(0, 50, (n, seq, 4))})


def test_only_a_dynamic_sequence_is_cut_and_every_input_of_its_length_with_it() -> None:
    assert _seq_axes(_encoder(128)) == (None, set())
    assert _seq_axes(_encoder("seq")) == ("input_ids", {"input_ids", "attention_mask", "bbox"})
    fixed = next(_cropped(_data(2, 128), KERNEL_CHECK_TOKENS, proto=_encoder(128)))
    assert fixed["input_ids"].shape == (1, 128)
    cut = next(_cropped(_data(2, 128), KERNEL_CHECK_TOKENS, proto=_encoder("seq")))
    assert {k: v.shape for k, v in cut.items()} == {"input_ids": (1, 64), "attention_mask": (1, 64), "bbox": (1, 64, 4)}


@pytest.mark.parametrize("seq", [128, "seq"])
def test_an_encoder_with_a_float_mask_and_a_bbox_input_quantizes(seq: Any) -> None:
    from quantkit.api import quantize

    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(_encoder(seq), _data(8, 128), recipe, evaluation_data=_data(4, 128), progress=False)
    assert res.report["kernels"]["check"]["agree"]
    assert res.report["quality"]["fidelity"]["out"]["sqnr_db"] > 25
