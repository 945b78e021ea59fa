"""The built KV-cache decoder (quantkit.frontends.llm_builder) as the graph quantkit quantizes, evaluates and
times: past feeds filled in centrally, weight-only INT4 (RTN / GPTQ / AWQ) on the built graph, AWQ scales folded
into (Skip)SimplifiedLayerNormalization exactly, decode latency with the cache, the recipe's model.graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from quantkit.data import KVCacheFeeds, as_dataset, make_dataset, model_inputs  # noqa: E402
from quantkit.errors import ModelError, RecipeError  # noqa: E402
from quantkit.frontends import GRAPHS, load_model  # noqa: E402
from quantkit.recipe import load_recipe  # noqa: E402
from tests.unit.test_llm_builder import VOCAB, make_llama, reference  # noqa: E402

HEADS_KV, HEAD_DIM, LAYERS = 2, 16, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random tied LLaMA folder (no tokenizer) and its torch model."""
    base = tmp_path_factory.mktemp("llama-pipeline")
    model = make_llama(base / "hf", tied=True)
    return base / "hf", model


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path_factory.getbasetemp() / "quantkit-cache"))


def _windows(n: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, VOCAB, (n, seq)).astype(np.int64),
            "attention_mask": np.ones((n, seq), np.int64)}  # fmt: skip


def test_load_model_builds_the_decoder_and_the_recipe_carries_graph(tiny: tuple[Path, Any]) -> None:
    folder, _ = tiny
    lm = load_model(folder)  # auto -> the built decoder for a LLaMA-family folder
    assert lm.graph == "decoder" and lm.kind == "hf" and lm.tokenizer is None
    names = [i.name for i in model_inputs(lm.model)]
    assert names[:2] == ["input_ids", "attention_mask"] and len(names) == 2 + 2 * LAYERS
    assert [o.name for o in lm.model.graph.outputs][0] == "logits"
    assert load_model(folder, graph="decoder").graph == "decoder"  # cached build reused
    rec = load_recipe({"version": 1, "model": {"source": str(folder), "graph": "full_sequence"}})
    assert rec.model is not None and rec.model.graph == "full_sequence"
    assert getattr(rec.model.source, "graph", None) == "full_sequence"  # what run.load_inputs hands load_model
    assert rec.model_dump(mode="json")["model"]["source"] == str(folder)
    with pytest.raises(RecipeError, match="'auto', 'decoder' or 'full_sequence'"):
        load_recipe({"version": 1, "model": {"source": "x", "graph": "kv"}})
    with pytest.raises(ModelError, match="allowed"):
        load_model(folder, graph="nope")
    assert GRAPHS == ("auto", "decoder", "full_sequence")


def test_past_feeds_filled_centrally_and_perplexity_matches_transformers(tiny: tuple[Path, Any]) -> None:
    folder, model = tiny
    lm = load_model(folder, graph="decoder")
    inputs = model_inputs(lm.model)
    data = _windows(3, 12, 0)
    for ds in (as_dataset(data, inputs), make_dataset({"kind": "npz", "path": _npz(folder, data)}, inputs=inputs,
                                                      split="evaluation")):  # fmt: skip
        assert isinstance(ds, KVCacheFeeds) and len(ds) == 3
        batch = next(iter(ds.batches(2)))
        assert batch["attention_mask"].shape == (2, 12)  # past 0 + S
        past = [k for k in batch if k.startswith("past_key_values.")]
        assert len(past) == 2 * LAYERS
        assert all(batch[k].shape == (2, HEADS_KV, 0, HEAD_DIM) and batch[k].dtype == np.float32 for k in past)
    assert as_dataset(ds, inputs) is ds  # bound once
    assert ds.fingerprint() != ds.inner.fingerprint()
    from quantkit.evaluate.perplexity import perplexity

    got = perplexity(ir.to_proto(lm.model).SerializeToString(), ds, batch_size=2)
    logits = reference(model, data["input_ids"])
    z = torch.log_softmax(torch.from_numpy(logits).double(), -1)[:, :-1]
    nll = -z.gather(-1, torch.from_numpy(data["input_ids"][:, 1:, None])).mean().item()
    assert got["tokens"] == 3 * 11 and got["nll"] == pytest.approx(nll, abs=1e-4)


def _npz(folder: Path, data: dict[str, np.ndarray]) -> str:
    path = folder.parent / "windows.npz"
    np.savez(path, **data)
    return str(path)


def _recipe(folder: Path, algorithm: str, **opts: Any) -> dict[str, Any]:
    return {
        "version": 1, "name": f"decoder-{algorithm}",
        "model": {"source": str(folder), "graph": "decoder"},
        "calibration": {"sequential": True, "stages": 2, "layerwise": False},  # the whole-graph path
        "quantization": {
            "default": {"format": "int4", "group_size": 32, "algorithm": algorithm, "algorithm_options": opts},
            "overrides": [{"layer": "lm_head", "format": "int8_weight", "algorithm": "rtn", "algorithm_options": {}}],
        },
        "report": {"latency": {"enabled": False}},
    }  # fmt: skip


@pytest.mark.parametrize("algorithm,opts", [("rtn", {}), ("gptq", {}), ("awq", {"gptq": True})],
                         ids=["rtn", "gptq", "awq+gptq"])  # fmt: skip
def test_weight_only_int4_on_the_built_decoder(tiny: tuple[Path, Any], algorithm: str, opts: dict[str, Any]) -> None:
    from quantkit.api import quantize

    folder, _ = tiny
    res = quantize(None, _windows(8, 32, 1), _recipe(folder, algorithm, **opts), evaluation_data=_windows(4, 32, 2),
                   progress=False)  # fmt: skip
    rep = res.report
    k = rep["census"]["quantized_kernels"]
    assert k.get("MatMulNBits") == 7 * LAYERS + 1 and k.get("GatherBlockQuantized") == 1, k  # tied: stored once
    q = rep["quality"]
    assert np.isfinite(q["perplexity_quantized"]["ppl"]) and np.isfinite(q["perplexity_fp32"]["ppl"])
    assert abs(q["perplexity_quantized"]["nll"] - q["perplexity_fp32"]["nll"]) < 0.1 * q["perplexity_fp32"]["nll"]
    qproto = ir.to_proto(res.model)
    ops = [n.op_type for n in qproto.graph.node]
    assert ops.count("GroupQueryAttention") == LAYERS and "Transpose" not in ops
    assert sum(1 for t in qproto.graph.initializer if t.name == "model.embed_tokens.weight") == 0  # no float table
    # logits and the KV cache of the quantized decoder stay close to FP32 (prefill then one cached step)
    feed = _windows(1, 9, 3)
    f_sess = ort.InferenceSession(ir.to_proto(res.float_model).SerializeToString(), providers=["CPUExecutionProvider"])
    q_sess = ort.InferenceSession(qproto.SerializeToString(), providers=["CPUExecutionProvider"])
    ds = as_dataset(feed, model_inputs(res.float_model))
    full = next(iter(ds.batches(1)))
    ref, got = f_sess.run(None, full), q_sess.run(None, full)
    cos = float(np.sum(ref[0] * got[0]) / (np.linalg.norm(ref[0]) * np.linalg.norm(got[0])))
    assert cos > 0.9, cos  # 4-bit g32 on random weights drawn wide (peaked attention): measured 0.93 (RTN)
    assert got[1].shape == ref[1].shape == (1, HEADS_KV, 9, HEAD_DIM)
    if algorithm == "awq":  # the AWQ scales went into the norms' gammas, no Mul inserted
        norms = [n for n in qproto.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"
                 and n.input[2].endswith("_gamma_awq")]  # fmt: skip
        assert len(norms) >= 2 * LAYERS - 1, [n.input[2] for n in qproto.graph.node if n.op_type.startswith("Skip")]
        inserted = {n.name for n in qproto.graph.node if n.name.endswith("_input_scale")}
        # o_proj / down_proj read no norm (GQA output, the SwiGLU product): their scales stay a Mul
        assert inserted and all(".o_proj_" in n or ".down_proj_" in n for n in inserted), inserted


def _norm_model(op: str, K: int, N: int, rng: np.random.Generator) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """``op(x, skip, gamma[, beta]) -> y``; two MatMuls read y (q/k-like), the skip-sum is a graph output."""
    gamma = rng.uniform(0.5, 1.5, K).astype(np.float32)
    beta = rng.normal(0, 0.1, K).astype(np.float32)
    w1, w2 = rng.normal(0, 0.3, (K, N)).astype(np.float32), rng.normal(0, 0.3, (K, N)).astype(np.float32)
    inits = [helper.make_tensor("gamma", TensorProto.FLOAT, [K], gamma.tolist()),
             helper.make_tensor("w1", TensorProto.FLOAT, [K, N], w1.flatten().tolist()),
             helper.make_tensor("w2", TensorProto.FLOAT, [K, N], w2.flatten().tolist())]  # fmt: skip
    ins = ["x", "skip", "gamma"]
    if op == "SkipLayerNormalization":
        inits.append(helper.make_tensor("beta", TensorProto.FLOAT, [K], beta.tolist()))
        ins.append("beta")
    nodes = [
        helper.make_node(op, ins, ["y", "", "", "sum"], name="norm", domain="com.microsoft", epsilon=1e-5),
        helper.make_node("MatMul", ["y", "w1"], ["o1"], name="q"),
        helper.make_node("MatMul", ["y", "w2"], ["o2"], name="k"),
    ]
    f = TensorProto.FLOAT
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, f, [1, 5, K]) for n in ("x", "skip")],
        [helper.make_tensor_value_info(n, f, None) for n in ("o1", "o2", "sum")], initializer=inits,
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m, w1, w2


@pytest.mark.parametrize("op", ["SkipSimplifiedLayerNormalization", "SkipLayerNormalization"])
def test_input_scale_folds_into_skip_norm_exactly(op: str) -> None:
    """AWQ: (x / s) @ (s W) = x @ W with 1/s folded into the norm's gamma (and beta); the skip-sum output is
    not scaled.  Checked against ONNX Runtime's own kernels, no Mul left in the graph."""
    from quantkit.lowering.nbits import apply_input_scale

    rng = np.random.default_rng(0)
    K, N = 32, 24
    proto, w1, w2 = _norm_model(op, K, N, rng)
    s = rng.uniform(0.25, 4.0, K).astype(np.float32)
    model = ir.from_proto(proto)
    for name, w in (("w1", w1), ("w2", w2)):  # what lowering stores: the weights scaled by s along K
        model.graph.initializers[name].const_value = ir.tensor((w * s[:, None]).astype(np.float32), name=name)
    how = apply_input_scale(model, ["q", "k"], s)
    assert how == f"1/s folded into {op} 'norm'"
    folded = ir.to_proto(model)
    assert [n.op_type for n in folded.graph.node] == [op, "MatMul", "MatMul"]
    feed = {"x": rng.normal(0, 1, (1, 5, K)).astype(np.float32), "skip": rng.normal(0, 1, (1, 5, K)).astype(np.float32)}
    ref = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    got = ort.InferenceSession(folded.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[2], ref[2])  # the residual stream is untouched
    # a norm whose output feeds another node too cannot take the scale: one Mul is inserted instead
    model2 = ir.from_proto(proto)
    assert apply_input_scale(model2, ["q"], s) == "Mul(x, 1/s) inserted"


def test_decode_latency_with_the_kv_cache(tiny: tuple[Path, Any]) -> None:
    from quantkit.evaluate.decode import llm_latency, measure_generation

    folder, _ = tiny
    blob = ir.to_proto(load_model(folder, graph="decoder").model).SerializeToString()

    class Settings:
        batch_size, seq_len, warmup, repeat, threads = 1, 8, 1, 10, 1

    rows = llm_latency(blob, blob, Settings())
    assert list(rows) == ["prefill", "decode"]  # no long_prefill asked
    Settings.long_prefill = 1024  # type: ignore[attr-defined]
    assert "prefill_long" not in llm_latency(blob, blob, Settings())  # beyond the 64-position context
    Settings.long_prefill = 48  # type: ignore[attr-defined]
    long = llm_latency(blob, blob, Settings())["prefill_long"]
    assert long["tokens"] == 48 and long["kv_cache"] and long["fp32_ms"] > rows["prefill"]["fp32_ms"] * 0.5
    for row in rows.values():
        assert {"label", "tokens", "fp32_ms", "quantized_ms", "fp32_p90_ms", "quantized_p90_ms", "speedup"} <= set(row)
        assert row["kv_cache"] is True and row["fp32_ms"] > 0 and row["speedup"] > 0
    dec = rows["decode"]
    # 8 + 64 positions exceed the tiny model's 64-position rotary cache: decoding stops where the context ends
    assert dec["prompt_len"] == 8 and 32 <= dec["new_tokens"] <= 64 and dec["steps"] == dec["new_tokens"]
    assert dec["label"].startswith(f"decode with KV cache: {dec['new_tokens']} tokens after a 8-token prompt")
    assert dec["label"].endswith("(cache in one shared buffer)")
    gen = measure_generation({"a": blob}, prompt_len=4, new_tokens=5, rounds=2)
    assert gen["a"]["steps"] == 10 and gen["a"]["new_tokens"] == 5 and gen["a"]["shared_cache"]
    gen = measure_generation({"a": blob}, prompt_len=4, new_tokens=5, rounds=1, shared_cache=False)
    assert gen["a"]["steps"] == 5 and not gen["a"]["shared_cache"]


def test_fidelity_compares_logits_not_the_cache() -> None:
    from quantkit.pipeline import compared_outputs

    assert compared_outputs(["logits", "present.0.key", "present.0.value"]) == ["logits"]
    assert compared_outputs(["a", "b"]) == ["a", "b"]


def test_int8_dynamic_smoothquant_on_the_built_decoder(tiny: tuple[Path, Any]) -> None:
    """SmoothQuant's scales fold into the decoder's Skip norms like AWQ's (same apply_input_scale)."""
    from quantkit.api import quantize

    folder, _ = tiny
    rec = {"version": 1, "model": {"source": str(folder)},
           "quantization": {"default": {"format": "int8_dynamic", "smoothquant": 0.5},
                            "overrides": [{"layer": "lm_head", "format": "fp32"}]},
           "report": {"latency": {"enabled": False}}}  # fmt: skip
    res = quantize(None, _windows(8, 32, 1), rec, evaluation_data=_windows(4, 32, 2), progress=False)
    assert res.report["census"]["quantized_kernels"] == {"MatMulIntegerToFloat": 7 * LAYERS}
    q = res.report["quality"]
    assert abs(q["perplexity_quantized"]["nll"] - q["perplexity_fp32"]["nll"]) < 0.02 * q["perplexity_fp32"]["nll"]
    proto = ir.to_proto(res.model)
    folded = [n for n in proto.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"
              and n.input[2].endswith("_gamma_awq")]  # fmt: skip
    assert len(folded) == 2 * LAYERS - 1  # every norm before q/k/v and gate/up (the first is a standard-op Mul)
    # the per-token layers (scale and zero point computed at run time) are checked against exact integer math
    check = res.report["kernels"]["check"]
    float_rows = [r for r in check["layers"] if r.get("float_output")]
    assert len(float_rows) == 7 * LAYERS
    assert all(r["sqnr_db"] > 40 for r in float_rows), [(r["layer"], r["sqnr_db"], r["off"]) for r in float_rows]


def test_gqa_detection_reads_the_file_in_chunks(tmp_path: Path) -> None:
    """The shared-cache decision scans the serialized model for the op type (no second parse of the weights),
    also when the name straddles two read chunks."""
    from quantkit.evaluate.decode import _uses_gqa

    f = tmp_path / "m.onnx"
    f.write_bytes(b"x" * ((8 << 20) - 5) + b"GroupQueryAttention" + b"y" * 10)
    assert _uses_gqa(str(f)) and _uses_gqa(b"..GroupQueryAttention..")
    f.write_bytes(b"z" * (9 << 20))
    assert not _uses_gqa(str(f)) and not _uses_gqa(b"Attention")
