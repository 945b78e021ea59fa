"""Every decoder family of the streaming builder through the layer-wise path, at a realistic shape (issue 23).

For each family (``quantkit.frontends.families``) a Hugging Face folder of random bf16 weights is written at the
width of a published checkpoint (its ``config.json`` values: hidden size, heads, KV heads, head_dim, intermediate
size, vocabulary, tying, RoPE, windows, soft-capping), with fewer layers where the full depth is well above 0.5B
parameters, at two depths (about a quarter of the layers, and all of them) to show that the peak memory does not
grow with the depth.  The folder is written as transformers writes one: ``config.json`` by the family's config class
(``save_pretrained``), the tensor names and shapes of its model class (instantiated on the meta device, so nothing is
allocated), one tensor at a time into ~1 GB safetensors shards.  Random weights give meaningless tokens: the figures
here are memory and time, not quality.

Each case runs ``quantkit calibrate`` in a child process, as users run it, with a layer-wise recipe: int4, RTN,
group 128, ``calibration.layerwise: true``, two 64-token calibration windows of random token ids, no perplexity,
``--no-latency``.  Recorded per case: the wall time of the whole command (interpreter start, build, quantization and
save), the peak RSS of its process tree sampled every 0.1 s from outside (``eval/rss_tree.py``'s sampler), quantkit's
own measured peak and its estimate (``report.json`` ``memory``), the checkpoint and output sizes, and the load
average.

``--refusal`` measures the other half of the issue: a folder whose ``config.json`` says ``model_type: diffllama`` (not a
supported family) with ``calibration.layerwise: true`` is refused by ``quantkit calibrate`` (exit 2) before anything
heavy is imported; the whole command's wall time, five times (the median is the figure), and the heavy modules it
imported (``python -X importtime``; expected none).

    flock /tmp/quantkit-bench.lock python eval/bench_families.py --refusal --family all

``--e2e CASE ...`` runs a family the way a user does, end to end, at a published width (random bf16 weights, the
tokenizer of SmolLM2): the FP32 decoder against transformers on 64 token ids (max |logit diff|, greedy tokens equal),
``quantkit calibrate`` with the default recipe path (int4 GPTQ g128, 8 windows of 256 tokens of Pride and Prejudice,
perplexity on Emma, latency on), then ``quantkit generate``: exit codes, times, decode per token, report warnings.
Random weights: the perplexities and tokens are meaningless, the exactness, the exit codes and the times are not.

Rows go into ``eval/results/families_<cpu class>.json`` (one per family and depth, replaced when run again);
``python eval/render_results.py`` renders them into ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))
HEAVY = ("torch", "onnx", "onnx_ir", "onnxruntime", "transformers", "numpy", "scipy")

# The published configs (config.json values of the checkpoint named in "from"); "layers": the two depths measured.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"from": "Qwen/Qwen3-0.6B", "layers": (7, 28), "config": {
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 28, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645}},
    "qwen2": {"from": "Qwen/Qwen2.5-0.5B", "layers": (6, 24), "config": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
        "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
        "sliding_window": 32768, "max_window_layers": 24, "hidden_act": "silu", "bos_token_id": 151643,
        "eos_token_id": 151643}},
    "mistral": {"from": "mistralai/Mistral-7B-v0.1 (width; 1 and 2 of its 32 layers)", "layers": (1, 2), "config": {
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": 4096,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}},
    "smollm3": {"from": "HuggingFaceTB/SmolLM3-3B (width; 1 and 4 of its 36 layers)", "layers": (1, 4), "config": {
        "model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
        "num_key_value_heads": 4, "num_hidden_layers": 36, "vocab_size": 128256, "max_position_embeddings": 65536,
        "rope_theta": 5000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "no_rope_layer_interval": 4,
        "use_sliding_window": False, "sliding_window": None, "hidden_act": "silu", "bos_token_id": None,
        "eos_token_id": 128012, "pad_token_id": 128004}},
    "gemma": {"from": "google/gemma-2b (width; 1 and 4 of its 18 layers)", "layers": (1, 4), "config": {
        "model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
        "num_key_value_heads": 1, "head_dim": 256, "num_hidden_layers": 18, "vocab_size": 256000,
        "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "gelu",
        "hidden_activation": None, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}},
    "gemma2": {"from": "google/gemma-2-2b (width; 1 and 4 of its 26 layers)", "layers": (1, 4), "config": {
        "model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "num_hidden_layers": 26, "vocab_size": 256000,
        "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}},
    "gemma3_text": {"from": "google/gemma-3-1b-pt (width; 2 and 8 of its 26 layers)", "layers": (2, 8), "config": {
        "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "num_hidden_layers": 26, "vocab_size": 262144,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}},
    "phi3": {"from": "microsoft/Phi-3-mini-4k-instruct (width; 1 and 4 of its 32 layers)", "layers": (1, 4), "config": {
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 32064, "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "sliding_window": 2047, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1,
        "eos_token_id": 32000, "pad_token_id": 32000}},
    "gpt2": {"from": "openai-community/gpt2-medium", "layers": (6, 24), "config": {
        "model_type": "gpt2", "n_embd": 1024, "n_head": 16, "n_layer": 24, "n_positions": 1024, "vocab_size": 50257,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "bos_token_id": 50256,
        "eos_token_id": 50256}},
    "phi": {"from": "microsoft/phi-2 (width; 1 and 4 of its 32 layers)", "layers": (1, 4), "config": {
        "model_type": "phi", "hidden_size": 2560, "intermediate_size": 10240, "num_attention_heads": 32,
        "num_key_value_heads": 32, "num_hidden_layers": 32, "vocab_size": 51200, "max_position_embeddings": 2048,
        "partial_rotary_factor": 0.4, "rope_theta": 10000.0, "layer_norm_eps": 1e-5, "hidden_act": "gelu_new",
        "qk_layernorm": False, "tie_word_embeddings": False, "bos_token_id": 50256, "eos_token_id": 50256}},
    "gpt_neox": {"from": "EleutherAI/pythia-410m", "layers": (6, 24), "config": {
        "model_type": "gpt_neox", "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
        "num_hidden_layers": 24, "vocab_size": 50304, "max_position_embeddings": 2048, "rotary_pct": 0.25,
        "rotary_emb_base": 10000, "layer_norm_eps": 1e-5, "hidden_act": "gelu", "use_parallel_residual": True,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}},
    "stablelm": {"from": "stabilityai/stablelm-2-1_6b (width; 2 and 8 of its 24 layers)", "layers": (2, 8), "config": {
        "model_type": "stablelm", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
        "num_key_value_heads": 32, "num_hidden_layers": 24, "vocab_size": 100352, "max_position_embeddings": 4096,
        "partial_rotary_factor": 0.25, "rope_theta": 10000.0, "layer_norm_eps": 1e-5, "use_qkv_bias": True,
        "use_parallel_residual": False, "qk_layernorm": False, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 100257, "eos_token_id": 100257}},
    "olmo2": {"from": "allenai/OLMo-2-0425-1B (width; 2 and 8 of its 16 layers)", "layers": (2, 8), "config": {
        "model_type": "olmo2", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_hidden_layers": 16, "vocab_size": 100352, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": 100257, "pad_token_id": 100277}},
    "granite": {"from": "ibm-granite/granite-3.1-2b (width; 2 and 8 of its 40 layers)", "layers": (2, 8), "config": {
        "model_type": "granite", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_hidden_layers": 40, "vocab_size": 49155, "max_position_embeddings": 131072,
        "rope_theta": 5000000.0, "rms_norm_eps": 1e-5, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625, "logits_scaling": 8.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}},
    "opt": {"from": "facebook/opt-125m", "layers": (3, 12), "config": {
        "model_type": "opt", "hidden_size": 768, "ffn_dim": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768, "do_layer_norm_before": True,
        "activation_function": "relu", "enable_bias": True, "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}},
    "bloom": {"from": "bigscience/bloom-560m", "layers": (6, 24), "config": {
        "model_type": "bloom", "hidden_size": 1024, "n_head": 16, "n_layer": 24, "vocab_size": 250880,
        "layer_norm_epsilon": 1e-5, "apply_residual_connection_post_layernorm": False, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 3}},
    "falcon": {"from": "tiiuae/falcon-7b (width; 1 and 2 of its 32 layers)", "layers": (1, 2), "config": {
        "model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32,
        "vocab_size": 65024, "multi_query": True, "parallel_attn": True, "new_decoder_architecture": False,
        "alibi": False, "bias": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "bos_token_id": 11, "eos_token_id": 11}},
    "gpt_bigcode": {"from": "bigcode/gpt_bigcode-santacoder (2 and 8 of its 24 layers)", "layers": (2, 8), "config": {
        "model_type": "gpt_bigcode", "n_embd": 2048, "n_head": 16, "n_layer": 24, "n_positions": 2048,
        "vocab_size": 49280, "multi_query": True, "activation_function": "gelu_pytorch_tanh",
        "layer_norm_epsilon": 1e-5, "bos_token_id": 49152, "eos_token_id": 49152}},
    "olmo": {"from": "allenai/OLMo-1B-hf (2 and 8 of its 16 layers)", "layers": (2, 8), "config": {
        "model_type": "olmo", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_hidden_layers": 16, "vocab_size": 50304, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "clip_qkv": None, "hidden_act": "silu", "tie_word_embeddings": True,
        "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1}},
    "glm4": {"from": "THUDM/GLM-4-9B-0414 (width; 1 and 2 of its 40 layers)", "layers": (1, 2), "config": {
        "model_type": "glm4", "hidden_size": 4096, "intermediate_size": 13696, "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 40, "vocab_size": 151552,
        "max_position_embeddings": 32768, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
        "rms_norm_eps": 1.5625e-07, "attention_bias": True, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": 151329, "pad_token_id": 151329}},
    "olmoe": {"from": "allenai/OLMoE-1B-7B-0924 (width; 1 and 2 of its 16 layers)", "layers": (1, 2), "config": {
        "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_hidden_layers": 16, "vocab_size": 50304, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "num_experts": 64, "num_experts_per_tok": 8,
        "norm_topk_prob": False, "clip_qkv": None, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1}},
    "qwen3_moe": {"from": "Qwen/Qwen3-30B-A3B (width; 1 and 2 of its 48 layers)", "layers": (1, 2), "config": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_hidden_layers": 48,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}},
    # vision-language checkpoints: the text decoder is built (the vision tower stays in the folder, unread)
    "smolvlm": {"from": "HuggingFaceTB/SmolVLM-256M-Instruct's shapes (Idefics3: LLaMA text, SigLIP vision)",
                "layers": (8, 30), "config": {
        "model_type": "idefics3", "scale_factor": 4, "image_token_id": 49190, "tie_word_embeddings": False,
        "text_config": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
                        "vocab_size": 49280, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
        "vision_config": {"model_type": "idefics3_vision", "hidden_size": 768, "intermediate_size": 3072,
                          "num_hidden_layers": 12, "num_attention_heads": 12, "patch_size": 16, "image_size": 512}}},
    "gemma3_vlm": {"from": "google/gemma-3-4b-it's config.json (width; 1 of its 34 text layers, the full SigLIP "
                           "vision tower)", "layers": (1, 2), "config": {
        "model_type": "gemma3", "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
        "image_token_index": 262144, "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False}}},
    "gpt_oss": {"from": "openai/gpt-oss-20b (width; 1 and 2 of its 24 layers)", "layers": (1, 2), "config": {
        "model_type": "gpt_oss", "attention_bias": True, "eos_token_id": 200002, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "vocab_size": 201088}},
}  # fmt: skip

E2E_GROUP = {"gpt_oss": 32}
"""Group sizes other than 128 for the end-to-end recipe: gpt-oss's K = 2880 is a multiple of 32 (its MXFP4 block), not
of 128, and ONNX Runtime's QMoE kernel needs K to be a multiple of the group."""

# End-to-end cases (--e2e): a family's published config above, the depth, config changes (a variant's width) and,
# when they change it, the checkpoint whose shape that is.
E2E: dict[str, tuple[str, int, dict[str, Any], str]] = {
    "opt": ("opt", 12, {}, ""),
    "bloom": ("bloom", 4, {}, ""),
    "falcon_rw": ("falcon", 2, {"hidden_size": 2048, "num_attention_heads": 32, "vocab_size": 50304, "alibi": True,
                                 "multi_query": False, "parallel_attn": False, "bias": True},
                  "tiiuae/falcon-rw-1b (width; 2 of its 24 layers)"),
    "falcon40b": ("falcon", 1, {"hidden_size": 8192, "num_attention_heads": 128, "num_kv_heads": 8,
                                "new_decoder_architecture": True, "multi_query": True},
                  "tiiuae/falcon-40b (width; 1 of its 60 layers)"),
    "gpt_bigcode": ("gpt_bigcode", 2, {}, ""),
    "olmo": ("olmo", 2, {"clip_qkv": 8.0}, ""),
    "glm4": ("glm4", 1, {}, ""),
    "olmoe": ("olmoe", 2, {}, ""),
    "qwen3_moe": ("qwen3_moe", 1, {}, "Qwen/Qwen3-30B-A3B (width; 1 of its 48 layers)"),
    "smolvlm": ("smolvlm", 30, {}, ""),
    "gemma3_vlm": ("gemma3_vlm", 1, {}, ""),
    "gpt_oss": ("gpt_oss", 1, {}, "openai/gpt-oss-20b (width; 1 of its 24 layers)"),
}

# Child: the FP32 decoder built by quantkit against transformers' model (argv: folder, output .onnx).
_CHILD_EXACT = r"""
import sys, json, numpy as np, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from quantkit.frontends.llm_builder import build_llm, LLMSession
hf, out = sys.argv[1], sys.argv[2]
vlm = "vision_config" in json.loads((Path(hf) / "config.json").read_text())  # the reference: the multimodal model
m = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(hf, dtype=torch.float32).eval()
p = build_llm(hf, out)
ids = np.random.default_rng(0).integers(3, 49000, (1, 64)).astype(np.int64)
with torch.no_grad():
    ref = m(input_ids=torch.from_numpy(ids)).logits.numpy()
got = LLMSession(p)(ids)
print(json.dumps({"fp32_max_diff": float(np.abs(got - ref).max()), "ref_max": float(np.abs(ref).max()),
                  "greedy_equal": int((got.argmax(-1) == ref.argmax(-1)).sum()), "tokens": int(ids.shape[1])}))
"""


def run_e2e(case: str, work: Path) -> dict[str, Any]:
    """One ``--e2e`` case (module docstring): its row."""
    from quantkit.frontends.llm import smollm2_folder

    fam, layers, change, label = E2E[case]
    hf = work / "hf"
    hf.mkdir(parents=True)
    cfg = {**FAMILIES[fam]["config"], **change}
    _child(_CHILD_GEN, str(hf), json.dumps(cfg), str(layers))
    tok = smollm2_folder()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / f).is_file():
            shutil.copy(tok / f, hf / f)
    row: dict[str, Any] = {"case": case, "family": fam, "from": label or FAMILIES[fam]["from"], "layers": layers,
                           "config_changes": change, "load_start": [round(x, 2) for x in os.getloadavg()]}
    row.update(_child(_CHILD_EXACT, str(hf), str(work / "fp32" / "model.onnx")))
    shutil.rmtree(work / "fp32", ignore_errors=True)
    recipe = {"version": 1, "name": f"{case}-int4", "model": {"source": str(hf)},
              "calibration": {"data": {"kind": "text", "source": "austen:prideprejudice", "mode": "windows",
                                       "seq_len": 256, "count": 8, "seed": 0}},
              "quantization": {"default": {"format": "int4", "group_size": E2E_GROUP.get(fam, 128),
                                           "algorithm": "gptq"}},
              "evaluation": {"data": {"kind": "text", "source": "austen:emma", "mode": "windows", "seq_len": 256,
                                      "count": 4, "seed": 0}}}  # fmt: skip
    (work / "r.yaml").write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    r = subprocess.run([*_quantkit(), "calibrate", "-q", "--recipe", str(work / "r.yaml"), "--output",
                        str(work / "out")], capture_output=True, text=True, env=env, check=False)  # fmt: skip
    row.update({"calibrate_rc": r.returncode, "calibrate_s": round(time.perf_counter() - t0, 1)})
    if r.returncode != 0:
        row["calibrate_error"] = r.stderr.strip().splitlines()[-1][:600] if r.stderr.strip() else ""
        return row
    rep = json.loads((work / "out" / "report.json").read_text())
    row["warnings"] = [str(w)[:200] for w in rep.get("warnings", [])]
    row["peak_GB"] = round((rep.get("memory") or {}).get("measured_peak_bytes", 0) / 1e9, 2)
    row["estimated_GB"] = round(((rep.get("memory") or {}).get("estimated_peak_bytes") or 0) / 1e9, 2)
    row["timings_s"] = {k: round(v, 1) for k, v in (rep.get("timings") or {}).items() if isinstance(v, (int, float))}
    t0 = time.perf_counter()
    g = subprocess.run([*_quantkit(), "generate", "--model", str(work / "out"), "--prompt",
                        "It is a truth universally acknowledged", "--max-new-tokens", "16"],
                       capture_output=True, text=True, env=env, check=False)  # fmt: skip
    row.update({"generate_rc": g.returncode, "generate_s": round(time.perf_counter() - t0, 1)})
    decode = [ln for ln in (g.stdout + g.stderr).splitlines() if "ms/token" in ln]
    row["generate_timing"] = decode[-1].strip() if decode else ""
    return row


def _discard_cached_decoders(folder: Path) -> None:
    """Remove the FP32 decoders quantkit cached for ``folder`` (``models/decoder-<name>-<key>``, whose ``info.json``
    names that folder): the case's random checkpoint is deleted with its work folder, its cache entries would only
    take space (GBs at these widths)."""
    from quantkit.frontends.cache import cache_dir, discard_entry

    for entry in (cache_dir() / "models").glob(f"decoder-{folder.name}-*"):
        try:
            info = json.loads((entry / "info.json").read_text())
        except (OSError, ValueError):
            continue
        if Path(str(info.get("folder", ""))).resolve() == folder.resolve():
            discard_entry(entry)


# Child: write the folder (torch + transformers live only here).  argv: folder, config (JSON), layers.
_CHILD_GEN = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
folder, cfg, layers = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
if "text_config" in cfg:  # a vision-language model: made for real (vision tower included), in bfloat16, saved by it
    cfg["text_config"] = dict(cfg["text_config"], num_hidden_layers=layers)
    conf = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(conf, dtype=torch.bfloat16)
    model.save_pretrained(str(folder), max_shard_size="1GB")
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "architecture": type(model).__name__}))
    raise SystemExit(0)
cfg = dict(cfg, **{("n_layer" if "n_layer" in cfg else "num_hidden_layers"): layers})
conf = AutoConfig.for_model(**cfg)
conf.torch_dtype = torch.bfloat16
if any(cfg.get(k) for k in ("num_experts", "num_local_experts")):
    # a mixture of experts: transformers holds the experts as [experts, N, K] tensors and writes them one linear per
    # expert (the Hub's layout, the one quantkit reads): the model is made for real, in bfloat16, and saved by it
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    model.save_pretrained(str(folder), max_shard_size="1GB")
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "architecture": type(model).__name__}))
    raise SystemExit(0)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(conf)
params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # a tied lm_head is not listed (shared)
offset = cfg["model_type"].startswith("gemma")  # Gemma's RMSNorm multiplies by 1 + weight
g = torch.Generator().manual_seed(0)
def make(name, shape):
    if len(shape) == 1:
        fill = 0.0 if name.endswith(".bias") or offset else 1.0
        return torch.full(shape, fill, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, (1 << 22) // shape[1])  # 16 MB of float32 at a time
    for s in range(0, shape[0], rows):
        n = min(rows, shape[0] - s)
        t[s:s + n] = torch.randn(n, shape[1], generator=g) * 0.02
    return t
shards, cur, size = [], [], 0
for name, shape in params:
    nbytes = 2 * int(torch.Size(shape).numel())
    if cur and size + nbytes > (1 << 30):
        shards.append(cur); cur, size = [], 0
    cur.append((name, shape)); size += nbytes
shards.append(cur)
weight_map, total = {}, 0
for k, names in enumerate(shards):  # one shard in memory at a time
    d = {n: make(n, s) for n, s in names}
    file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(d, str(folder / file), metadata={"format": "pt"})
    total += sum(t.numel() * 2 for t in d.values())
    weight_map.update({n: file for n in d})
    del d
(folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}))
conf.architectures = [type(model).__name__]
conf.save_pretrained(str(folder))
print(json.dumps({"params": sum(int(torch.Size(s).numel()) for _, s in params), "architecture": type(model).__name__}))
"""


def _child(code: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"child failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _cpu_name() -> str:
    """This machine's CPU model (rows measured on different machines keep their own)."""
    from quantkit.report.build import environment

    name = re.sub(r"\((R|TM)\)|\b(Processor|CPU)\b|@.*", "", str(environment().get("cpu", "?")))
    return " ".join(name.split()) or "?"  # "Intel(R) Xeon(R) Processor" -> "Intel Xeon", as the older rows


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _quantkit() -> list[str]:
    """The ``quantkit`` command as users run it (the console script beside this interpreter), else ``-m``."""
    script = Path(sys.executable).parent / "quantkit"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "quantkit.cli"]


def run_case(family: str, layers: int, work: Path) -> dict[str, Any]:
    """Write the folder of ``family`` at ``layers`` layers, quantize it layer-wise, return its row."""
    from bench_memory_estimate import _plain, _tree_peak

    spec = FAMILIES[family]
    hf = work / f"{family}-{layers}"
    hf.mkdir(parents=True)
    t0 = time.perf_counter()
    gen = _child(_CHILD_GEN, str(hf), json.dumps(spec["config"]), str(layers))
    gen_s = time.perf_counter() - t0
    vocab = int(spec["config"].get("vocab_size") or spec["config"]["text_config"].get("vocab_size", 262208))
    ids = np.random.default_rng(0).integers(3, vocab, (2, 64)).astype(np.int64)
    np.savez(work / "cal.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    recipe = _plain(str(hf), {"kind": "npz", "path": str(work / "cal.npz")}, layerwise=True)
    recipe["name"] = f"{family}-int4"
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = work / "out"
    cmd = [*_quantkit(), "calibrate", "-q", "--no-latency", "--recipe", str(path), "--output", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peak = [0]
    th = threading.Thread(target=_tree_peak, args=(proc, peak), daemon=True)
    th.start()
    assert proc.stdout is not None  # noqa: S101 - set by Popen
    lines = [line.rstrip() for line in proc.stdout]
    proc.wait()
    th.join(timeout=5)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{family} x {layers}: exit {proc.returncode}\n" + "\n".join(lines[-30:]))
    rep = json.loads((out / "report.json").read_text())
    mem = rep["memory"]
    row = {
        "family": family, "model_type": spec["config"]["model_type"], "from": spec["from"], "layers": layers,
        "architecture": gen["architecture"], "params_M": round(gen["params"] / 1e6, 1),
        "checkpoint_GB": round(_du(hf) / 1e9, 3), "output_GB": round(_du(out) / 1e9, 3), "gen_s": round(gen_s, 1),
        "wall_s": round(wall, 1), "tree_peak_GB": round(peak[0] / 1e9, 3),
        "measured_GB": round(mem["measured_peak_bytes"] / 1e9, 3),
        "estimated_GB": round(mem["estimated_peak_bytes"] / 1e9, 3), "peak_phase": mem.get("peak_phase"),
        "phases_GB": {k: round(v / 1e9, 3) for k, v in (mem.get("phases") or {}).items()},
        "path": mem.get("path"), "layers_quantized": len(rep.get("layers", [])),
        "timings_s": {k: round(v, 1) for k, v in (rep.get("timings") or {}).items() if isinstance(v, (int, float))},
        "load_start": [round(x, 2) for x in load0], "load_end": [round(x, 2) for x in os.getloadavg()],
        "warnings": rep.get("warnings", []), "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": _cpu_name(),
    }  # fmt: skip
    row["estimate_over_measured"] = round(row["estimated_GB"] / max(row["tree_peak_GB"], 1e-9) - 1, 3)
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return row


def measure_refusal(work: Path, repeat: int = 5) -> dict[str, Any]:
    """``quantkit calibrate`` on a ``model_type: diffllama`` folder with ``calibration.layerwise: true``: exit code,
    message, the whole command's wall time (``repeat`` runs; the median is the figure) and what it imported."""
    hf = work / "diffllama"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({"model_type": "diffllama", "architectures": ["DiffLlamaForCausalLM"],
                                                "hidden_size": 1024, "n_layer": 24, "n_head": 16,
                                                "vocab_size": 250880}))  # fmt: skip
    recipe = {"version": 1, "name": "diffllama-int4", "model": {"source": str(hf)},
              "calibration": {"layerwise": True, "data": {"kind": "npz", "path": str(work / "cal.npz")}},
              "quantization": {"default": {"format": "int4", "group_size": 128, "algorithm": "rtn"}}}  # fmt: skip
    (work / "r.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [*_quantkit(), "calibrate", "--recipe", str(work / "r.yaml"), "--output", str(work / "out")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # this checkout's code
    walls, codes, load0 = [], set(), os.getloadavg()
    r = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        walls.append(round(time.perf_counter() - t0, 3))
        codes.add(r.returncode)
    assert r is not None  # noqa: S101 - repeat >= 1
    imp = subprocess.run([sys.executable, "-X", "importtime", "-m", "quantkit.cli", *cmd[len(_quantkit()):]],
                         capture_output=True, text=True, env=dict(env, PYTHONPATH=str(ROOT)), check=False)  # fmt: skip
    mods = {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in imp.stderr.splitlines()
            if ln.startswith("import time:") and ln.count("|") == 2}  # fmt: skip
    return {"command": "quantkit calibrate --recipe r.yaml (config.json: model_type diffllama; calibration.layerwise: "
                       "true)", "returncodes": sorted(codes), "wall_s": walls,
            "median_s": statistics.median(walls), "error": r.stderr.strip().splitlines()[-1],
            "heavy_modules_imported": sorted(mods & set(HEAVY)), "heavy_checked": list(HEAVY),
            "modules_imported": len(mods),
            "load_start": [round(x, 2) for x in load0], "load_end": [round(x, 2) for x in os.getloadavg()],
            "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip


def render(data: dict[str, Any]) -> str:
    lines = ["| family | from | layers | params M | wall s | peak GB (outside) | measured GB | estimated GB |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data.get("families", []):
        lines.append(f"| {r['family']} | {r['from']} | {r['layers']} | {r['params_M']:.0f} | {r['wall_s']:.0f} | "
                     f"{r['tree_peak_GB']:.2f} | {r['measured_GB']:.2f} | {r['estimated_GB']:.2f} |")
    ref = data.get("refusal")
    if ref:
        lines.append(f"\nrefusal: exit {ref['returncodes']}, median {ref['median_s']:.2f} s of {ref['wall_s']}; "
                     f"heavy modules imported: {ref['heavy_modules_imported'] or 'none'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="*", default=[], help=f"families to run ('all': {', '.join(FAMILIES)})")
    ap.add_argument("--depth", choices=("both", "small", "full"), default="both", help="which depths to run")
    ap.add_argument("--refusal", action="store_true", help="measure the refusal of an unsupported family")
    ap.add_argument("--e2e", nargs="*", default=[], help=f"end-to-end cases ({', '.join(E2E)}, or all)")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    from provenance import run_record

    from quantkit.report.build import environment
    from quantkit.scheme.target import detect_cpu

    families = list(FAMILIES) if args.family == ["all"] else args.family
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}, all")
    results = ROOT / "eval" / "results" / f"families_{detect_cpu().cpu_class}.json"
    data: dict[str, Any] = json.loads(results.read_text()) if results.is_file() else {}
    rows: list[dict[str, Any]] = data.get("families", [])
    commands: list[str] = data.get("commands", [])

    def save() -> None:
        order = {f: i for i, f in enumerate(FAMILIES)}
        data["families"] = sorted(rows, key=lambda r: (order.get(r["family"], 99), r["layers"]))
        rec = run_record()
        if rec["command"] not in commands:
            commands.append(rec["command"])
        data["commands"] = commands  # every run the file holds rows of (each row has its own date and load)
        data["environment"] = {**environment(), **rec, "command": "; ".join(commands)}
        cpus = sorted({str(r.get("cpu", "?")) for r in data.get("families") or []})
        if len(cpus) > 1:  # rows from several machines: each row names its CPU
            data["environment"]["cpu"] = f"{', '.join(cpus)} (each row names its own)"
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(data, indent=1) + "\n")

    if args.refusal:
        with tempfile.TemporaryDirectory(prefix="bench-fam-refusal-", dir=args.workdir) as w:
            data["refusal"] = measure_refusal(Path(w))
        print(json.dumps(data["refusal"]), flush=True)
        save()
    e2e = list(E2E) if args.e2e == ["all"] else args.e2e
    if [c for c in e2e if c not in E2E]:
        ap.error(f"unknown --e2e cases; known: {', '.join(E2E)}, all")
    for case in e2e:
        work = Path(tempfile.mkdtemp(prefix=f"bench-fam-e2e-{case}-", dir=args.workdir))
        try:
            row = {**run_e2e(case, work), "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": _cpu_name()}
        finally:
            _discard_cached_decoders(work / "hf")
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(row), flush=True)
        data["e2e"] = [r for r in data.get("e2e", []) if r["case"] != case] + [row]
        save()
    for family in families:
        small, full = FAMILIES[family]["layers"]
        for layers in {"both": (small, full), "small": (small,), "full": (full,)}[args.depth]:
            work = Path(tempfile.mkdtemp(prefix=f"bench-fam-{family}-", dir=args.workdir))
            try:
                row = run_case(family, layers, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(json.dumps(row), flush=True)
            rows = [r for r in rows if (r["family"], r["layers"]) != (family, layers)] + [row]
            save()
    print(render(data))


if __name__ == "__main__":
    main()
