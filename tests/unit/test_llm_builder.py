"""The streaming LLaMA builder (quantkit.frontends.llm_builder) against transformers.

Tiny random LlamaForCausalLM folders (2 layers, hidden 64, 4 heads, 2 KV heads; tied and
untied; fp32 single file and bf16 sharded) are built and run with ORT's KV cache: a prefill of
7 tokens, then 3 decode steps, logits within 1e-4 of transformers.  The weights are drawn with
a large std so that attention is peaked and a wrong rotary / GQA wiring cannot hide.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.errors import ModelError  # noqa: E402
from quantkit.frontends import llm_builder  # noqa: E402
from quantkit.frontends.llm import check_linear_layout  # noqa: E402
from quantkit.frontends.llm_builder import LLMSession, build_llm, read_decoder_config  # noqa: E402
from quantkit.weight_only import _tied_gather  # noqa: E402

VOCAB, LAYERS, PREFILL, DECODE = 256, 2, 7, 3


def make_llama(
    folder: Path, *, tied: bool, dtype: Any = None, shard: str | None = None, seed: int = 0
) -> Any:
    """Save a random LlamaForCausalLM into ``folder``; return the float32 model as saved."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    if dtype is None:
        return model
    # reload rather than .float(): .to(bf16) also rounded the rotary inv_freq buffer
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def run_cached(path: Path, ids: np.ndarray, max_length: int | None = None) -> np.ndarray:
    """Logits of a prefill of PREFILL tokens then one token per step, with the KV cache (``max_length``:
    kept in one shared buffer per layer)."""
    sess = LLMSession(path, max_length=max_length)
    parts = [sess(ids[:, :PREFILL])]
    for t in range(PREFILL, ids.shape[1]):
        parts.append(sess(ids[:, t : t + 1]))
        if max_length is None:
            assert sess.past[sess.past_names[0]].shape[2] == t + 1  # the past grows one position a step
    return np.concatenate(parts, axis=1)


def reference(model: Any, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[Any, Path]]:
    out = {}
    for tied in (True, False):
        base = tmp_path_factory.mktemp(f"llama-{'tied' if tied else 'untied'}")
        model = make_llama(base / "hf", tied=tied)
        out[tied] = (model, build_llm(base / "hf", base / "onnx" / "model.onnx"))
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers_with_kv_cache(built: dict[bool, tuple[Any, Path]], tied: bool) -> None:
    model, path = built[tied]
    ids = np.random.default_rng(1).integers(0, VOCAB, (1, PREFILL + DECODE), dtype=np.int64)
    ref, got = reference(model, ids), run_cached(path, ids)
    assert got.shape == ref.shape == (1, PREFILL + DECODE, VOCAB)
    assert np.abs(ref).max() > 1.0  # the check is not vacuous
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("max_length", [None, PREFILL + DECODE, 40], ids=["concat", "shared-exact", "shared-long"])
def test_batch_of_two_equal_rows(built: dict[bool, tuple[Any, Path]], max_length: int | None) -> None:
    model, path = built[True]
    ids = np.random.default_rng(2).integers(0, VOCAB, (2, PREFILL + DECODE), dtype=np.int64)
    np.testing.assert_allclose(run_cached(path, ids, max_length), reference(model, ids), atol=1e-4, rtol=0)


def test_shared_cache_refuses_overflow(built: dict[bool, tuple[Any, Path]]) -> None:
    _, path = built[False]
    sess = LLMSession(path, max_length=PREFILL)
    sess(np.zeros((1, PREFILL), np.int64))
    with pytest.raises(ModelError, match="max_length=7"):
        sess(np.zeros((1, 1), np.int64))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_graph_layout(built: dict[bool, tuple[Any, Path]], tied: bool) -> None:
    _, path = built[tied]
    onnx.checker.check_model(str(path))
    model = ir.load(path)
    ops = [n.op_type for n in model.graph]
    assert ops.count("GroupQueryAttention") == LAYERS
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * LAYERS  # post-attn x L, input x (L-1), final
    assert "SimplifiedLayerNormalization" not in ops  # default-domain ORT op: onnx.checker rejects it
    first = next(n for n in model.graph if n.name == "model.layers.0.input_layernorm")
    assert first.op_type == "Mul" and first.inputs[1].name == "model.layers.0.input_layernorm.weight"
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert gqa.domain == "com.microsoft" and gqa.attributes["do_rotary"].as_int() == 1
    assert gqa.name == "model.layers.0.self_attn.GroupQueryAttention"
    if tied:  # ORT fuses the standard-op first norm into its SimplifiedLayerNormalization kernel
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.optimized_model_filepath = str(path.with_name("optimized.onnx"))
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        fused = [
            n.op_type for n in onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node
        ]
        assert fused.count("SimplifiedLayerNormalization") == 1 and "Pow" not in fused
    lins = check_linear_layout(model, LAYERS)  # 7 MatMul(x, W[K, N]) per layer + lm_head, named after HF
    q = lins[0]
    assert (
        q.name == "model.layers.0.self_attn.q_proj"
        and q.weight.name == "model.layers.0.self_attn.q_proj.weight"
    )
    assert q.shape == (64, 64) and lins[1].shape == (64, 32)  # k_proj: 2 KV heads x 16
    head = lins[-1]
    inits = set(model.graph.initializers)
    assert "model.embed_tokens.weight" in inits
    gather = next(n for n in model.graph if n.op_type == "Gather" and n.name == "model.embed_tokens")
    if tied:
        assert head.transpose is not None and head.transpose.name == "lm_head.weight_transpose"
        assert head.weight.name == "model.embed_tokens.weight" and "lm_head.weight" not in inits
        assert _tied_gather(model.graph, head.node.inputs[1]) == (gather.name, "model.embed_tokens.weight")
    else:
        assert head.transpose is None and head.weight.name == "lm_head.weight" and head.shape == (64, VOCAB)
    # every weight lives in the one external-data file, page aligned
    data = path.with_name(path.name + ".data")
    proto = onnx.load(str(path), load_external_data=False)
    ext = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {t.name for t in ext} >= {lin.weight.name for lin in lins}
    for t in ext:
        info = {e.key: e.value for e in t.external_data}
        assert info["location"] == data.name and int(info["offset"]) % 4096 == 0
    assert (
        sum(int(dict((e.key, e.value) for e in t.external_data)["length"]) for t in ext)
        <= data.stat().st_size
    )


def test_genai_config(built: dict[bool, tuple[Any, Path]]) -> None:
    _, path = built[True]
    cfg = json.loads((path.parent / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert dec["filename"] == "model.onnx" and dec["num_hidden_layers"] == LAYERS
    assert dec["num_key_value_heads"] == 2 and dec["head_size"] == 16
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert dec["outputs"]["present_value_names"] == "present.%d.value"
    assert cfg["model"]["context_length"] == 64 and cfg["model"]["eos_token_id"] == 2


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_to_keep(built: dict[bool, tuple[Any, Path]], tied: bool) -> None:
    """The overridable ``logits_to_keep`` input: default every position, k > 0 the last k, bit-identical."""
    import onnxruntime as ort

    _, path = built[tied]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert "logits_to_keep" not in {i.name for i in sess.get_inputs()}  # callers that do not know it are unaffected
    assert [i.name for i in sess.get_overridable_initializers()] == ["logits_to_keep"]
    ids = np.random.default_rng(3).integers(0, VOCAB, (2, PREFILL), dtype=np.int64)
    feed: dict[str, Any] = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    feed |= {i.name: np.zeros((2, 2, 0, 16), np.float32) for i in sess.get_inputs() if i.name.startswith("past")}
    full = sess.run(["logits"], feed)[0]
    assert full.shape == (2, PREFILL, VOCAB)
    for k, rows in ((1, 1), (3, 3), (PREFILL + 5, PREFILL)):
        got = sess.run(["logits"], feed | {"logits_to_keep": np.array([k], np.int64)})[0]
        assert got.shape == (2, rows, VOCAB)
        np.testing.assert_array_equal(got, full[:, -rows:])
    s = LLMSession(path)
    np.testing.assert_array_equal(s(ids[:1], logits_to_keep=1), full[:1, -1:])


def test_kv_cache_in_one_shared_buffer(built: dict[bool, tuple[Any, Path]]) -> None:
    """genai_config.json asks onnxruntime-genai for ``past_present_share_buffer``: one max-length buffer per
    layer bound as both past and present, GroupQueryAttention writing the new positions in place."""
    import onnxruntime as ort

    model, path = built[True]
    assert json.loads((path.parent / "genai_config.json").read_text())["search"]["past_present_share_buffer"]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(4).integers(0, VOCAB, (1, PREFILL + DECODE), dtype=np.int64)
    max_len = PREFILL + DECODE + 4  # longer than needed, as genai allocates max_length
    past = [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    bufs = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 2, max_len, 16), np.float32)) for n in past}
    parts, start = [], 0
    for stop in [PREFILL, *range(PREFILL + 1, PREFILL + DECODE + 1)]:
        io = sess.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids[:, start:stop]))
        io.bind_cpu_input("attention_mask", np.ones((1, stop), np.int64))
        for n in past:
            io.bind_ortvalue_input(n, bufs[n])
            io.bind_ortvalue_output(n.replace("past_key_values.", "present."), bufs[n])
        io.bind_output("logits")
        sess.run_with_iobinding(io)
        parts.append(io.copy_outputs_to_cpu()[-1])  # outputs come in binding order: logits last
        start = stop
    np.testing.assert_allclose(np.concatenate(parts, axis=1), reference(model, ids), atol=1e-4, rtol=0)


def test_sharded_bf16_streamed_block_by_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 checkpoint in several shards: read one block at a time, logits match the bf16-rounded model."""
    model = make_llama(tmp_path / "hf", tied=False, dtype=torch.bfloat16, shard="60KB", seed=3)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    reads: list[set[str]] = []
    real = llm_builder._Checkpoint.read

    def spy(self: Any, names: Any) -> Any:
        names = list(names)
        reads.append({n.split(".")[2] for n in names if n.startswith("model.layers.")})
        return real(self, names)

    monkeypatch.setattr(llm_builder._Checkpoint, "read", spy)
    path = build_llm(tmp_path / "hf", tmp_path / "onnx" / "model.onnx")
    assert all(len(r) <= 1 for r in reads) and sum(len(r) == 1 for r in reads) == LAYERS
    ids = np.random.default_rng(4).integers(0, VOCAB, (1, PREFILL + DECODE), dtype=np.int64)
    np.testing.assert_allclose(run_cached(path, ids), reference(model, ids), atol=1e-4, rtol=0)


def test_config_variants(tmp_path: Path) -> None:
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
            "num_hidden_layers": 1, "vocab_size": 10}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(base | {"rope_theta": 5e5}))
    cfg = read_decoder_config(tmp_path)
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16 and cfg.rope_theta == 5e5
    assert cfg.rope_scaling is None and not cfg.tie_word_embeddings
    rope = {"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(base | {"rope_parameters": rope}))
    cfg = read_decoder_config(tmp_path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    cos, sin = llm_builder.rotary_caches(cfg, 4)
    assert cos.shape == sin.shape == (4, 8) and cos.dtype == np.float32
    (tmp_path / "config.json").write_text(
        json.dumps(base | {"rope_scaling": {"type": "mrope", "factor": 2.0}})
    )
    with pytest.raises(ModelError, match="mrope"):
        read_decoder_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base | {"model_type": "diffllama"}))
    with pytest.raises(ModelError, match="model_type 'diffllama' is not .*supported model_types: llama.*gpt2.*"
                                         "calibration.layerwise: false"):
        read_decoder_config(tmp_path)


def test_dtype_other_than_fp32_refused(built: dict[bool, tuple[Any, Path]], tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="fp32"):
        build_llm(tmp_path, tmp_path / "m.onnx", dtype="int4")
