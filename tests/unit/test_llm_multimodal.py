"""The text decoder of a vision-language checkpoint through the streaming builder.

A user with Gemma 3 (4B and up), Mistral 3 / Pixtral, LLaVA, Qwen2.5-VL, Qwen3-VL, SmolVLM, LLaVA-OneVision or
PaliGemma holds one folder whose ``config.json`` is a multimodal wrapper (``text_config`` + ``vision_config``) and
whose checkpoint stores the text decoder under a prefix (``language_model.model.``, ``model.language_model.``,
``model.text_model.``) beside the vision tower. quantkit builds the text decoder (token ids in, logits out) of
any such checkpoint whose ``text_config`` is a builder family.

Each case is a tiny random-init model of the transformers class (``...ForConditionalGeneration``, 2 text layers,
hidden 64, non-trivial norms), saved with ``save_pretrained``; the reference is that model's own forward on
token ids alone (no image).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.errors import ModelError  # noqa: E402
from quantkit.frontends.families import parse_config  # noqa: E402
from quantkit.frontends.llm_builder import LLMSession, build_llm, read_decoder_config  # noqa: E402
from tests.unit.test_llm_families import (  # noqa: E402, F401 - _cache: autouse
    _assert_exact,
    _cache,
    _cached_builds,
    calibrate_cli,
)

VOCAB = 300
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.15, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)  # fmt: skip


def _model(kind: str) -> Any:
    """A tiny random ``...ForConditionalGeneration`` of ``kind``."""
    t = transformers
    if kind == "gemma3":  # gemma3_text: windowed layers (4 of 24 positions); Gemma3ForConditionalGeneration's head
        # does not apply the text config's final_logit_softcapping (PaliGemma's does)
        return t.Gemma3ForConditionalGeneration(t.Gemma3Config(
            text_config=dict(model_type="gemma3_text", **_TEXT, sliding_window=4, final_logit_softcapping=2.0,
                             layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(model_type="siglip_vision_model", **_VISION), mm_tokens_per_image=4,
            image_token_index=VOCAB - 1))  # fmt: skip
    if kind == "mistral3":  # an untied lm_head stored as language_model.lm_head
        return t.Mistral3ForConditionalGeneration(t.Mistral3Config(
            text_config=dict(model_type="mistral", **_TEXT, tie_word_embeddings=False),
            vision_config=dict(model_type="pixtral", **_VISION, head_dim=16), image_token_index=VOCAB - 1,
            tie_word_embeddings=False))  # fmt: skip
    if kind == "llava":
        return t.LlavaForConditionalGeneration(t.LlavaConfig(
            text_config=dict(model_type="llama", **_TEXT), vision_config=dict(model_type="clip_vision_model",
                                                                              **_VISION, projection_dim=32),
            image_token_index=VOCAB - 1))  # fmt: skip
    if kind == "qwen2_5_vl":  # multimodal RoPE (mrope_section), the text stored under the plain names
        return t.Qwen2_5_VLForConditionalGeneration(t.Qwen2_5_VLConfig(
            text_config=dict(**_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
            image_token_id=VOCAB - 1, video_token_id=VOCAB - 2))  # fmt: skip
    if kind == "qwen3_vl":  # interleaved multimodal RoPE, per-head q / k norms
        return t.Qwen3VLForConditionalGeneration(t.Qwen3VLConfig(
            text_config=dict(**_TEXT, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                    "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               deepstack_visual_indexes=[0]),
            image_token_id=VOCAB - 1, video_token_id=VOCAB - 2))  # fmt: skip
    if kind == "qwen3_vl_moe":  # Qwen3-MoE's text decoder (4 experts, top 2) with its experts stored together
        return t.Qwen3VLMoeForConditionalGeneration(t.Qwen3VLMoeConfig(
            text_config=dict(**_TEXT, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                             rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                                           "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               deepstack_visual_indexes=[0]),
            image_token_id=VOCAB - 1, video_token_id=VOCAB - 2))  # fmt: skip
    if kind == "smolvlm":  # model.text_model.*
        return t.SmolVLMForConditionalGeneration(t.SmolVLMConfig(
            text_config=dict(model_type="llama", **_TEXT), vision_config=_VISION, scale_factor=2,
            image_token_id=VOCAB - 1))  # fmt: skip
    if kind == "paligemma":  # Gemma 2 text, soft-capped logits
        return t.PaliGemmaForConditionalGeneration(t.PaliGemmaConfig(
            text_config=dict(model_type="gemma2", **_TEXT, final_logit_softcapping=2.0), vision_config=dict(model_type="siglip_vision_model",
                                                                               **_VISION),
            image_token_index=VOCAB - 1))  # fmt: skip
    raise AssertionError(kind)


KINDS = ["gemma3", "mistral3", "llava", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "smolvlm", "paligemma"]


class _Built:
    def __init__(self, base: Path, kind: str) -> None:
        torch.manual_seed(0)
        model = _model(kind).eval()
        with torch.no_grad():  # non-trivial norms (Gemma stores w of 1 + w: around 0)
            for name, p in model.named_parameters():
                if "norm" in name and not name.endswith(".bias"):
                    p.uniform_(-0.5, 0.5) if "gemma" in kind else p.uniform_(0.5, 1.5)
        self.folder = base / "hf"
        model.save_pretrained(self.folder)
        self.model = type(model).from_pretrained(self.folder, dtype=torch.float32).eval()
        self.path = build_llm(self.folder, base / "onnx" / "model.onnx")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _cached_builds(tmp_path_factory, _Built)


def _ids(n: int, seed: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB - 2, (rows, n), dtype=np.int64)


def _reference(model: Any, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


@pytest.mark.parametrize("kind", KINDS)
def test_text_decoder_matches_the_multimodal_model_on_token_ids(built: Any, kind: str) -> None:
    """FP32 logits of the built text decoder = the multimodal model's own forward on token ids; greedy decoding with
    the KV cache = recomputation; the built graph holds no tensor of the vision tower."""
    import onnx

    b = built(kind)
    cfg = read_decoder_config(b.folder)
    assert cfg.multimodal == kind
    ids = _ids(24, 1)
    _assert_exact(LLMSession(b.path)(ids), _reference(b.model, ids), kind)
    sess = LLMSession(b.path, max_length=24)
    prompt = ids[:, :8]
    steps = [sess(prompt)[:, -1]]
    tokens = [int(steps[-1].argmax())]
    for _ in range(7):
        steps.append(sess(np.asarray([[tokens[-1]]], np.int64))[:, -1])
        tokens.append(int(steps[-1].argmax()))
    seq = np.concatenate([prompt, np.asarray([tokens[:-1]], np.int64)], axis=1)
    ref = _reference(b.model, seq)[:, 7:]
    assert ref.argmax(-1).tolist() == [tokens]
    np.testing.assert_allclose(np.stack(steps, 1), ref, atol=1e-3, rtol=0)
    names = [t.name for t in onnx.load(str(b.path), load_external_data=False).graph.initializer]
    assert names and not [n for n in names if "vision" in n or "visual" in n or "projector" in n]


def test_newer_transformers_layout_builds_the_same_decoder(built: Any, tmp_path: Path) -> None:
    """transformers 4.52-4.57 saved vision-language models as ``model.language_model.*`` (+ ``model.vision_tower``,
    ``lm_head``): the same tensors under those names build the same decoder."""
    from safetensors.numpy import load_file, save_file

    b = built("mistral3")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text((b.folder / "config.json").read_text())
    tensors = load_file(str(b.folder / "model.safetensors"))
    renamed = {}
    for k, v in tensors.items():
        k2 = (k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head.")
              .replace("vision_tower.", "model.vision_tower.").replace("multi_modal_projector.",
                                                                     "model.multi_modal_projector."))  # fmt: skip
        renamed[k2] = v
    assert "lm_head.weight" in renamed and "model.language_model.embed_tokens.weight" in renamed
    save_file(renamed, str(folder / "model.safetensors"))
    path = build_llm(folder, tmp_path / "o" / "model.onnx")
    ids = _ids(20, 2)
    np.testing.assert_array_equal(LLMSession(path)(ids), LLMSession(b.path)(ids))


def test_qwen3_vl_moe_published_expert_layout_builds_the_same_decoder(built: Any, tmp_path: Path) -> None:
    """transformers 5 writes Qwen3-VL-MoE's experts as ``[experts, 2 I, H]`` / ``[experts, H, I]``; the published
    checkpoints store them transposed (``[experts, H, 2 I]``, gate | up columns, and ``[experts, I, H]``): told apart
    by shape, both build the same decoder (float and INT4 QMoE)."""
    from safetensors.numpy import load_file, save_file

    b = built("qwen3_vl_moe")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text((b.folder / "config.json").read_text())
    tensors = load_file(str(b.folder / "model.safetensors"))
    moved = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert moved
    for k in moved:
        tensors[k] = np.ascontiguousarray(tensors[k].transpose(0, 2, 1))
    save_file(tensors, str(folder / "model.safetensors"))
    ids = _ids(20, 2)
    np.testing.assert_array_equal(LLMSession(build_llm(folder, tmp_path / "o" / "model.onnx"))(ids),
                                  LLMSession(b.path)(ids))


def test_memory_estimate_counts_the_text_decoder_only(built: Any) -> None:
    from quantkit.memory import decoder_sizes

    b = built("llava")
    s = decoder_sizes(b.folder)
    text = b.model.model.language_model
    want = sum(p.numel() for p in text.parameters()) + b.model.lm_head.weight.numel()
    assert s.params == want < sum(p.numel() for p in b.model.parameters())
    assert (s.blocks, s.vocab, s.hidden, s.head) == (2, VOCAB, 64, VOCAB * 64)


# Gemma-3-4B-it's config.json as published: the text_config states 5 values and leaves the rest to transformers'
# Gemma3TextConfig defaults (vocabulary 262208, 8 heads of 256, 4 key / value heads, 1e6 / 1e4 RoPE bases, every
# 6th layer full)
_GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
              "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
              "mm_tokens_per_image": 256, "model_type": "gemma3",
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
              "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}  # fmt: skip
# Qwen2.5-VL-3B-Instruct's: the text values at the top level, the multimodal RoPE as rope_scaling
_QWEN25_VL = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "bos_token_id": 151643, "eos_token_id": 151645,
              "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 128000,
              "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16,
              "num_hidden_layers": 36, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
              "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "use_sliding_window": False, "vocab_size": 151936,
              "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
              "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                                "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                                "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                                "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                                "temporal_patch_size": 2}}  # fmt: skip


def test_published_configs_read_with_transformers_defaults() -> None:
    """What the builder reads from two published configs: the values a nested text_config leaves out come from
    transformers' config class (as transformers itself loads the model), Qwen-VL's multimodal RoPE is the plain one."""
    g = parse_config(_GEMMA3_4B, "config.json")
    assert (g.model_type, g.multimodal, g.vocab_size, g.num_attention_heads, g.num_key_value_heads, g.head_dim) == (
        "gemma3_text", "gemma3", 262208, 8, 4, 256)
    assert (g.num_hidden_layers, g.hidden_size, g.sliding_window, g.rope_theta, g.local_rope_theta) == (
        34, 2560, 1024, 1e6, 1e4)
    assert g.rope_scaling is not None and g.rope_scaling.get("factor") == 8.0  # linear x8 on the full layers
    assert g.layer_types.count("full_attention") == 5 and g.layer_types[5] == "full_attention"
    assert g.eos_token_id == [1, 106] and g.tie_word_embeddings
    q = parse_config(_QWEN25_VL, "config.json")
    assert (q.model_type, q.multimodal, q.num_hidden_layers, q.num_key_value_heads, q.rope_theta) == (
        "qwen2", "qwen2_5_vl", 36, 2, 1e6)
    assert q.rope_scaling is None and q.sliding_window is None and q.tie_word_embeddings


def test_a_text_decoder_the_builder_does_not_know_is_refused_naming_it() -> None:
    cfg = {"model_type": "llama4", "text_config": {"model_type": "llama4_text", "hidden_size": 64,
                                                   "num_hidden_layers": 2},
           "vision_config": {"model_type": "llama4_vision_model"}}  # fmt: skip
    with pytest.raises(ModelError, match=r"llama4_text.*supported.*gemma3_text"):
        parse_config(cfg, "config.json")
    with pytest.raises(ModelError, match=r"not known to the installed transformers"):
        parse_config({"model_type": "no_such_vlm", "text_config": {"model_type": "llama"}}, "config.json")


def test_whole_graph_path_points_to_the_layerwise_one(built: Any) -> None:
    from quantkit.frontends.hf_folder import text_model_problem

    b = built("gemma3")
    msg = text_model_problem(b.folder, json.loads((b.folder / "config.json").read_text()))
    assert msg is not None and "calibration.layerwise: true" in msg and "gemma3_text" in msg


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_5_vl", "qwen3_vl_moe"])
def test_quantkit_calibrate_layerwise_gptq(built: Any, kind: str, tmp_path: Path) -> None:
    """The command line as users run it on a multimodal folder: INT4 GPTQ block by block, perplexity, the report
    says what was built; the quantized logits track the multimodal model's."""
    import onnx

    b = built(kind)
    report = calibrate_cli(b.folder, kind, "gptq", tmp_path, _ids)
    assert np.isfinite(report["quality"]["perplexity_quantized"]["ppl"])
    assert report["census"]["quantized_kernels"]["MatMulNBits"] >= 4 * 2 + 1  # (q / k / v may run as one)
    assert f"multimodal checkpoint ({kind})" in report["notes"]["model"]
    names = [t.name for t in onnx.load(str(tmp_path / "o" / "model.onnx"), load_external_data=False).graph.initializer]
    assert not [n for n in names if "vision" in n or "visual" in n]
    ids = _ids(12, 7)
    got, ref = LLMSession(tmp_path / "o" / "model.onnx")(ids), _reference(b.model, ids)
    assert float(np.corrcoef(got.ravel(), ref.ravel())[0, 1]) > 0.85
