"""``input_ids`` in and ``logits`` out is not enough to call a model a causal LM (``quantkit.run._is_lm``): a text
classifier, a token tagger or a bidirectional encoder is judged by output fidelity, not perplexity."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.recipe import load_recipe
from quantkit.run import _is_lm


def _encoder(kind: str, vocab: int = 128, d: int = 8) -> onnx.ModelProto:
    """Embedding -> (mean over the sequence mixed in: bidirectional) -> per-token or pooled logits."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((vocab, d)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((d, vocab)).astype(np.float32), "head")]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
             helper.make_node("ReduceMean", ["h"], ["m"], axes=[1], keepdims=1)]
    shape: list[object] = ["B", "S", vocab]
    if kind == "causal":  # each position sees only its own token (a bigram model): causal
        nodes.append(helper.make_node("MatMul", ["h", "head"], ["logits"]))
    elif kind == "pooled":  # a sequence classifier: logits [batch, classes]
        nodes.append(helper.make_node("ReduceMean", ["h"], ["p"], axes=[1], keepdims=0))
        nodes.append(helper.make_node("MatMul", ["p", "head"], ["logits"]))
        shape = ["B", vocab]
    else:  # every position sees the whole sequence: a bidirectional encoder's per-token logits
        nodes.append(helper.make_node("Add", ["h", "m"], ["hm"]))
        nodes.append(helper.make_node("MatMul", ["hm", "head"], ["logits"]))
    g = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "S"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, shape)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_only_causal_models_are_language_models() -> None:
    rec = load_recipe({"version": 1, "name": "unit"})
    assert not _is_lm(rec, _encoder("pooled"))
    assert not _is_lm(rec, _encoder("bidirectional"))
    assert _is_lm(rec, _encoder("causal"))
    off = load_recipe({"version": 1, "name": "unit", "evaluation": {"perplexity": False}})
    assert not _is_lm(off, _encoder("causal"))


def test_a_plan_that_quantizes_nothing_says_so_in_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP16 model (or a plan that keeps every layer float) is emitted unquantized: the report warns, naming why,
    and does not call the float model slower than itself (here timed at 0.9x FP32)."""
    import quantkit.run as run

    real = run._latency
    monkeypatch.setattr(run, "_latency", lambda *a, **k: {**real(*a, **k), "speedup": 0.9})
    from quantkit.api import quantize
    from tests.conftest import image_batches
    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    y = g.node("Conv", ["input", g.w("w", 4, 3, 3, 3)], "y", pads=[1, 1, 1, 1])
    model = g.model("float_only", y, ["N", 4, 16, 16])
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": True, "warmup": 1, "repeat": 3}},
              "quantization": {"default": {"format": "fp32"}}}
    res = quantize(model, image_batches(2), recipe, evaluation_data=image_batches(1), progress=False)
    first = res.report["warnings"][0]
    assert first.startswith("no layer was quantized"), res.report["warnings"]
    assert not any("slower than FP32" in w for w in res.report["warnings"])  # one model timed against itself
    assert "the plan keeps it fp32" in first
