"""Randomized Hadamard rotations folded into a decoder's weights (quantkit.algorithms.rotation,
``quantization.rotation: hadamard``).

* Q is orthogonal (to 1e-6; measured ~1e-15) for the hidden sizes and head sizes used here and in real models,
  made from Paley and Sylvester matrices (576 = 36 x 16 for SmolLM2);
* the FP32 decoder built with the rotation gives the logits of the one built without it (max |diff| <= 1e-4 on
  the same token ids) for LLaMA (tied, bf16, hidden 96 = 12 x 8), Qwen2 (q/k/v biases), Qwen3 (q/k norms), Phi-3
  (packed qkv / gate_up), Gemma (``1 + w`` norms, scaled embedding) and SmolLM3;
* families whose residual stream is not rotation-invariant (Gemma 2's norms after attention / MLP, GPT-2's
  LayerNorm and learned positions) are refused with a RecipeError naming the family and the allowed ones, before
  any work; so is a rotation on the whole-graph path, and an unknown rotation in a recipe;
* the INT4 RTN and GPTQ builds with the rotation load in ONNX Runtime (the tied table stored apart from the
  lm_head) and stay close to FP32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit.algorithms.rotation import HadamardRotation, hadamard, random_hadamard, rotation_for  # noqa: E402
from quantkit.errors import RecipeError  # noqa: E402
from quantkit.frontends.families import FAMILIES, parse_config  # noqa: E402
from quantkit.frontends.llm_builder import LLMSession, build_llm, read_decoder_config  # noqa: E402
from quantkit.layerwise import quantize_llm_layerwise  # noqa: E402
from quantkit.recipe import load_recipe  # noqa: E402
from quantkit.recipe.plan import PrecisionPlan  # noqa: E402
from tests.unit.test_llm_families import VOCAB, make_family  # noqa: E402

KINDS = ["llama96", "qwen2_window", "qwen3", "phi3", "gemma", "smollm3", "granite", "helium", "arcee", "seed_oss",
         "ernie4_5", "glm", "hunyuan", "exaone", "internlm3", "cwm", "vaultgemma", "hyperclovax_plain", "apertus", "nanochat", "granite_swa"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path_factory.getbasetemp() / "quantkit-cache"))


def _make(kind: str, folder: Path) -> None:
    if kind != "llama96":
        make_family(kind, folder)
        return
    # hidden 96 = 12 x 8 (not a power of two), head_dim 16, GQA 3:1, tied, stored in bf16
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.15)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = tmp_path_factory.mktemp(kind) / "hf"
            _make(kind, cache[kind])
        return cache[kind]

    return get


def _ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, (1, n), dtype=np.int64)


def _inits(path: Path) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t, base_dir=str(path.parent))
            for t in onnx.load(str(path), load_external_data=False).graph.initializer}  # fmt: skip


@pytest.mark.parametrize("n", [1, 2, 4, 12, 16, 20, 28, 36, 48, 64, 96, 576, 960, 1152, 3072, 22])
def test_q_is_orthogonal(n: int) -> None:
    q, how = random_hadamard(n, np.random.default_rng(n))
    assert float(np.abs(q @ q.T - np.eye(n)).max()) <= 1e-6, how
    if n in (1, 2) or n % 4 == 0:  # a true Hadamard matrix: every entry +-1/sqrt(n), every feature mixed
        np.testing.assert_allclose(np.abs(q), 1 / np.sqrt(n), rtol=1e-12)
        assert "block-diagonal" not in how
    else:  # no Hadamard matrix of this order exists: orthogonal blocks, said so
        assert "block-diagonal" in how


def test_hadamard_constructions_are_named() -> None:
    assert hadamard(576)[1] == "H36 (Paley II, q=17) ⊗ H16 (Sylvester)"  # SmolLM2's hidden size
    assert hadamard(96)[1] == "H12 (Paley I, q=11) ⊗ H8 (Sylvester)"
    assert hadamard(64)[1] == "H64 (Sylvester)"
    with pytest.raises(RecipeError, match="allowed: an integer >= 1"):
        hadamard(0)


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_rotation_is_exact(folders: Any, kind: str, tmp_path: Path) -> None:
    folder = folders(kind)
    cfg = read_decoder_config(folder)
    rot = HadamardRotation(cfg, seed=7)
    plain = build_llm(folder, tmp_path / "plain" / "model.onnx")
    rotated = build_llm(folder, tmp_path / "rotated" / "model.onnx", transform=rot)
    ids = _ids(24, 1)
    ref, got = LLMSession(plain)(ids), LLMSession(rotated)(ids)
    assert float(np.abs(ref).max()) > 1.0  # not vacuous
    diff = float(np.abs(got - ref).max())
    assert diff <= 1e-4, f"{kind}: max |logit diff| {diff}"
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
    # the weights did change: the stream is rotated, the norms' gammas folded out, the head stored apart
    emb = cfg.spec.names.embed + ".weight"
    a, b = _inits(plain), _inits(rotated)
    assert float(np.abs(a[emb] - b[emb]).max()) > 1e-2
    assert "lm_head.weight" in b
    norm = f"{cfg.spec.names.layers}.0.{cfg.spec.names.attn_norm}.weight"
    np.testing.assert_array_equal(b[norm], 1.0)  # the graph stores the factor (Gemma's 1 + w: 1 + 0)
    assert "H" in rot.describe() and str(cfg.hidden_size) in rot.describe()


def test_kv_cache_decode_with_rotation_equals_recomputation(folders: Any, tmp_path: Path) -> None:
    folder = folders("llama96")
    path = build_llm(folder, tmp_path / "m" / "model.onnx", transform=HadamardRotation(read_decoder_config(folder)))
    ids = _ids(12, 3)
    sess = LLMSession(path, max_length=12)
    steps = [sess(ids[:, :6])] + [sess(ids[:, t : t + 1]) for t in range(6, 12)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), LLMSession(path)(ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["gemma2", "gpt2", "gemma3_text", "phi", "stablelm", "olmo2", "exaone4", "bloom", "glm4",
                                  "hyperclovax"])
def test_non_invariant_families_are_refused(folders: Any, kind: str, tmp_path: Path) -> None:
    folder = folders(kind)
    cfg = read_decoder_config(folder)
    with pytest.raises(RecipeError, match=rf"model_type '{kind}'.*allowed: model types llama, .*phi3.*rotation: none"):
        rotation_for("hadamard", 0, cfg)
    if kind == "hyperclovax":  # the variant without the post norms is allowed, and named so
        with pytest.raises(RecipeError, match=r"hyperclovax \(use_post_norm: false\)"):
            rotation_for("hadamard", 0, cfg)
    plan = PrecisionPlan.from_recipe(load_recipe({
        "version": 1, "model": {"source": str(folder)}, "calibration": {"layerwise": True},
        "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"},
                         "rotation": "hadamard"}}))  # fmt: skip
    out = tmp_path / "q" / "model.onnx"
    with pytest.raises(RecipeError, match=f"cannot be folded into model_type '{kind}'"):
        quantize_llm_layerwise(folder, out, plan, None, work_dir=tmp_path / "w", progress=False)
    assert not out.parent.exists()  # refused before any work


def test_the_family_description_says_which_are_invariant() -> None:
    invariant = {f.name for f in FAMILIES if f.rotation_invariant}
    assert invariant == {"llama", "mistral", "ministral", "qwen2", "qwen3", "smollm3", "gemma", "phi3", "granite", "helium",
                         "arcee", "seed_oss", "ernie4_5", "glm", "hunyuan_v1_dense", "exaone", "internlm3", "iquestcoder",
                         "cwm", "vaultgemma", "hyperclovax_plain", "apertus", "nanochat", "granite_swa"}
    gpt2 = parse_config({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 1, "vocab_size": 16}, "x")
    assert rotation_for("none", 0, gpt2) is None  # nothing to refuse
    with pytest.raises(RecipeError, match="allowed: none, hadamard"):
        rotation_for("givens", 0, gpt2)


def test_recipe_key_is_checked() -> None:
    with pytest.raises(RecipeError, match="rotation.*'none'.*'hadamard'"):
        load_recipe({"version": 1, "quantization": {"rotation": "givens"}})
    with pytest.raises(RecipeError, match="rotation_seed"):
        load_recipe({"version": 1, "quantization": {"rotation": "hadamard", "rotation_seed": -1}})
    assert load_recipe({"version": 1}).quantization.rotation == "none"


def test_whole_graph_path_refuses_a_rotation(folders: Any) -> None:
    rec = {"version": 1, "model": {"source": str(folders("llama96"))}, "calibration": {"layerwise": False},
           "quantization": {"default": {"format": "int4", "algorithm": "rtn"}, "rotation": "hadamard"}}  # fmt: skip
    with pytest.raises(RecipeError, match="quantization.rotation 'hadamard'.*whole-graph path.*allowed"):
        quantkit.quantize(recipe=rec, progress=False, evaluate=False, measure_latency=False)


def _plan(folder: Path, **default: Any) -> PrecisionPlan:
    return PrecisionPlan.from_recipe(load_recipe({
        "version": 1, "model": {"source": str(folder)}, "calibration": {"layerwise": True},
        "quantization": {"default": {"format": "int4", "group_size": 32, **default}, "rotation": "hadamard",
                         "rotation_seed": 3}}))  # fmt: skip


def _rtn_weights_in(fp32: Path, out: Path, plan: PrecisionPlan) -> Path:
    """The FP32 graph ``fp32`` with every linear (and the embedding / lm_head) replaced by quantkit's RTN of it."""
    from quantkit.algorithms.woq import get_weight_algorithm

    rtn = get_weight_algorithm("rtn")
    model = onnx.load(str(fp32))
    for t in model.graph.initializer:
        layer = t.name.removesuffix(".weight")
        if not t.name.endswith(".weight") or len(t.dims) != 2:
            continue
        w = onnx.numpy_helper.to_array(t)  # [K, N]; the embedding table is [V, H]: rounded as its transpose
        table = layer == "model.embed_tokens"
        lp = plan.layer(layer, "MatMul", layer)
        eff = rtn(np.ascontiguousarray(w.T if table else w), bits=4, group_size=32, symmetric=lp.weight_symmetric,
                  stats=None, clip=table).effective_weight()  # the embedding's plan: rtn, default options
        t.CopyFrom(onnx.numpy_helper.from_array(np.ascontiguousarray(eff.T if table else eff), t.name))
    out.parent.mkdir(parents=True)
    onnx.save(model, str(out))
    return out


def test_rtn_rotated_model_rounds_the_rotated_weights(folders: Any, tmp_path: Path) -> None:
    """INT4 RTN with the rotation, computed in float32 (accuracy_level 1), equals the rotated FP32 graph with the
    RTN of its own weights put in: the quantizer saw exactly the rotated weights (tied table stored twice)."""
    folder = folders("llama96")
    plan = _plan(folder, algorithm="rtn", algorithm_options={"clip": False})
    res = quantize_llm_layerwise(folder, tmp_path / "q" / "model.onnx", plan, None, work_dir=tmp_path / "w",
                                 accuracy_level=1, progress=False)  # fmt: skip
    assert "hadamard (seed 3)" in res.notes["rotation"] and "H12 (Paley I, q=11)" in res.notes["rotation"]
    ops = [nd.op_type for nd in onnx.load(str(res.path), load_external_data=False).graph.node]
    assert "MatMul" not in ops
    # the tied table: a GatherBlockQuantized of the embedding (E Q) and a MatMulNBits lm_head (E diag(g) Q)
    assert ops.count("GatherBlockQuantized") == 1 and "lm_head.weight_Q4" in _inits(res.path)
    rotated = build_llm(folder, tmp_path / "fp32" / "model.onnx",
                        transform=HadamardRotation(read_decoder_config(folder), seed=3))  # fmt: skip
    expected = _rtn_weights_in(rotated, tmp_path / "rtn-in-fp32" / "model.onnx", plan)
    ids = _ids(20, 5)
    ref, got = LLMSession(expected)(ids), LLMSession(res.path)(ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * float(np.abs(ref).max()))
    plain = LLMSession(build_llm(folder, tmp_path / "plain" / "model.onnx"))(ids)
    assert float(np.abs(got - plain).max()) > 1e-2  # the rounding did change the logits


def test_gptq_rotated_model_builds_and_loads(folders: Any, tmp_path: Path) -> None:
    """GPTQ with the rotation: the block graphs run on the rotated stream (norms of gamma 1), the lm_head is rounded
    from the final hidden states, stored apart from the tied embedding; the model loads and decodes."""
    folder = folders("llama96")
    windows = np.random.default_rng(0).integers(3, VOCAB, (4, 16)).astype(np.int64)
    res = quantize_llm_layerwise(folder, tmp_path / "q" / "model.onnx", _plan(folder, algorithm="gptq"), windows,
                                 work_dir=tmp_path / "w", progress=False)  # fmt: skip
    rows = {r["layer"]: r for r in res.rows}
    assert rows["lm_head"]["algorithm"] == "gptq" and np.isfinite(rows["lm_head"]["output_sqnr_db"])
    assert all(np.isfinite(r["output_sqnr_db"]) for r in res.rows if r["layer"] != "model.embed_tokens")
    ids = _ids(20, 5)
    sess = LLMSession(res.path, max_length=24)  # it decodes with its KV cache
    logits = sess(ids)
    assert logits.shape == (1, 20, VOCAB) and np.isfinite(logits).all()
    assert sess(ids[:, :1]).shape == (1, 1, VOCAB)
