"""Decoder families beyond LLaMA through the streaming builder (quantkit.frontends.families / llm_builder).

For each family a tiny random-init Hugging Face folder is built from its transformers config (hidden 64,
2 layers, vocabulary 256, ``save_pretrained``; no tokenizer: token ids only) with non-trivial norm weights,
and checked against transformers in float32:

* the FP32 decoder's logits on the same token ids (max |diff| <= 1e-3, every greedy token equal);
* KV-cache decode of 16 tokens (one shared buffer per layer) equals the recomputation without a cache;
* the block graphs used for layer-wise calibration reproduce transformers' hidden states, block by block,
  from the embedding rows as the layer-wise path computes them;
* an INT4 RTN build (MatMulNBits, computed in float32) loads in ONNX Runtime and its logits equal those of
  transformers with the same RTN weights put into the PyTorch model;
* ``quantkit calibrate`` (calibration.layerwise, AWQ block by block) runs and writes a model that loads;
* ``quantkit generate`` prints transformers' greedy continuation (a character-level tokenizer).

Sliding windows are 4 positions and the sequences 24, so windowed layers differ from full ones; soft-capping
limits are small enough to bend the logits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.errors import ModelError  # noqa: E402
from quantkit.frontends import llm_builder  # noqa: E402
from quantkit.frontends.families import supported_model_types  # noqa: E402
from quantkit.frontends.llm_builder import (  # noqa: E402
    LLMSession,
    block_model,
    block_prefix,
    build_llm,
    embedded_stream,
    read_decoder_config,
    stream_extras,
)

VOCAB, PROMPT, NEW = 256, 8, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.15, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)  # fmt: skip
_WINDOW = 4


def _spec(kind: str) -> tuple[Any, Any]:
    """(model class, config) of a tiny model of family ``kind``."""
    t = transformers
    c = dict(_COMMON)
    if kind == "qwen3":
        return t.Qwen3ForCausalLM, t.Qwen3Config(**c, head_dim=16)
    if kind == "gemma":
        return t.GemmaForCausalLM, t.GemmaConfig(**c, head_dim=16)
    if kind == "gemma2":
        return t.Gemma2ForCausalLM, t.Gemma2Config(**c, head_dim=16, sliding_window=_WINDOW, query_pre_attn_scalar=24,
                                                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if kind == "gemma3_text":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}  # fmt: skip
        return t.Gemma3ForCausalLM, t.Gemma3TextConfig(**c, head_dim=16, sliding_window=_WINDOW, query_pre_attn_scalar=24,
                                                       layer_types=["sliding_attention", "full_attention"],
                                                       rope_parameters=rope)  # fmt: skip
    if kind == "phi3":  # head_dim 32, rotary on half of it (Phi-4-mini style), GQA 2:1
        c.update(num_attention_heads=2, num_key_value_heads=1)
        return t.Phi3ForCausalLM, t.Phi3Config(**c, partial_rotary_factor=0.5)
    if kind == "phi3_longrope":  # LongRoPE with an original context of 8 positions: sequences past it use long factors
        c.update(num_attention_heads=2, num_key_value_heads=2)
        rope = {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(16)],
                "long_factor": [2.0 + 0.3 * i for i in range(16)]}  # fmt: skip
        return t.Phi3ForCausalLM, t.Phi3Config(**c, rope_scaling=rope, original_max_position_embeddings=PROMPT)
    if kind == "qwen3_yarn":  # YaRN as Qwen3's long-context setting (factor 4 over an original context of 8)
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}
        return t.Qwen3ForCausalLM, t.Qwen3Config(**c, head_dim=16, rope_parameters=rope)
    if kind == "llama_yarn":  # YaRN with every option away from its default (DeepSeek-style mscale ratio)
        c.update(num_attention_heads=2, num_key_value_heads=1)  # head_dim 32: a ramp over 16 frequencies
        rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "rope_theta": 5000.0,
                "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}
        return t.LlamaForCausalLM, t.LlamaConfig(**c, rope_parameters=rope)
    if kind == "llama_dynamic":  # dynamic NTK RoPE: plain RoPE within the original context (64 positions)
        rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        return t.LlamaForCausalLM, t.LlamaConfig(**c, rope_parameters=rope)
    if kind == "gpt2":
        return t.GPT2LMHeadModel, t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                               initializer_range=0.15, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if kind == "smollm3":  # layer 1 without RoPE, and windowed (the NoPE layers are the sliding ones)
        return t.SmolLM3ForCausalLM, t.SmolLM3Config(**c, no_rope_layers=[1, 0], use_sliding_window=True,
                                                     sliding_window=_WINDOW)
    if kind == "mistral_window":
        return t.MistralForCausalLM, t.MistralConfig(**c, sliding_window=_WINDOW)
    if kind == "ministral":  # Mistral's block with per-layer windows (layer_types)
        return t.MinistralForCausalLM, t.MinistralConfig(**c, head_dim=16, sliding_window=_WINDOW,
                                                         layer_types=["sliding_attention", "full_attention"])
    if kind == "qwen2_window":  # the sliding window from layer max_window_layers on
        return t.Qwen2ForCausalLM, t.Qwen2Config(**c, use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1)
    if kind == "granite":  # every multiplier away from 1, biases on the attention and MLP linears
        return t.GraniteForCausalLM, t.GraniteConfig(**c, embedding_multiplier=3.0, residual_multiplier=0.4,
                                                     attention_multiplier=0.2, logits_scaling=4.0,
                                                     attention_bias=True, mlp_bias=True)  # fmt: skip
    if kind == "olmo":  # LayerNorms without parameters, q / k / v clamped
        return t.OlmoForCausalLM, t.OlmoConfig(**c, clip_qkv=0.5)
    if kind == "olmo2":  # norms after attention and MLP only, q / k norms over the whole projection
        return t.Olmo2ForCausalLM, t.Olmo2Config(**c)
    if kind == "olmo3":  # OLMo-2's block, layer 0 windowed, YaRN on the full layer only
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                   "rope_theta": 10000.0}}  # fmt: skip
        return t.Olmo3ForCausalLM, t.Olmo3Config(**c, sliding_window=_WINDOW, rope_parameters=rope,
                                                 layer_types=["sliding_attention", "full_attention"])
    if kind == "exaone4":  # post-norms only, per-head q/k norms, layer 0 windowed with RoPE, layer 1 full without
        return t.Exaone4ForCausalLM, t.Exaone4Config(**c, head_dim=16, sliding_window=_WINDOW, sliding_window_pattern=2)
    if kind == "exaone4_full":  # no window: every layer full, with RoPE
        return t.Exaone4ForCausalLM, t.Exaone4Config(**c, head_dim=16, sliding_window=None,
                                                     layer_types=["full_attention"] * 2)
    if kind == "arcee":  # LLaMA with a plain ReLU-squared MLP
        return t.ArceeForCausalLM, t.ArceeConfig(**c, head_dim=16)
    if kind == "seed_oss":  # LLaMA with q/k/v and o biases
        return t.SeedOssForCausalLM, t.SeedOssConfig(**c, head_dim=16, attention_out_bias=True)
    if kind == "ernie4_5":  # RoPE on adjacent pairs, biases, tied
        return t.Ernie4_5ForCausalLM, t.Ernie4_5Config(**c, head_dim=16, use_bias=True)
    if kind == "glm":  # RoPE on adjacent pairs of half of each head, packed gate_up, q/k/v biases
        c.update(num_attention_heads=2, num_key_value_heads=1)
        return t.GlmForCausalLM, t.GlmConfig(**c, head_dim=32)
    if kind == "glm4":  # GLM's attention and MLP with norms of their outputs too (four RMSNorms per block)
        c.update(num_attention_heads=2, num_key_value_heads=1)
        return t.Glm4ForCausalLM, t.Glm4Config(**c, head_dim=32)
    if kind == "hunyuan":  # q / k norms of the rotated q, k; the checkpoints' "dynamic" RoPE with an alpha (static)
        rope = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}
        return t.HunYuanDenseV1ForCausalLM, t.HunYuanDenseV1Config(**c, head_dim=16, rope_parameters=rope)
    if kind == "helium":  # RoPE on adjacent pairs
        return t.HeliumForCausalLM, t.HeliumConfig(**c, head_dim=16)
    c.pop("rms_norm_eps")
    if kind == "cohere":  # one bias-free LayerNorm read in parallel, RoPE on adjacent pairs, scaled logits, tied
        return t.CohereForCausalLM, t.CohereConfig(**c, layer_norm_eps=1e-5, logit_scale=0.5)
    if kind == "cohere2":  # as Cohere, layer 0 windowed with RoPE, layer 1 full without
        return t.Cohere2ForCausalLM, t.Cohere2Config(**c, layer_norm_eps=1e-5, logit_scale=0.5, sliding_window=_WINDOW,
                                                     layer_types=["sliding_attention", "full_attention"])
    if kind == "gptj":  # one LayerNorm in parallel, RoPE on adjacent pairs of the first rotary_dim, lm_head bias
        return t.GPTJForCausalLM, t.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64,
                                               rotary_dim=16, initializer_range=0.15, bos_token_id=1,
                                               eos_token_id=2)  # fmt: skip
    if kind == "nemotron":  # LayerNorm with 1 + weight, a plain ReLU-squared MLP, rotary on half of each head
        c.update(num_attention_heads=2, num_key_value_heads=1)
        return t.NemotronForCausalLM, t.NemotronConfig(**c, norm_eps=1e-5)
    if kind == "starcoder2":  # LayerNorm, biases, a plain GELU MLP, a sliding window on every layer, tied
        return t.Starcoder2ForCausalLM, t.Starcoder2Config(**c, sliding_window=_WINDOW, norm_epsilon=1e-5)
    if kind == "phi":  # one LayerNorm read by attention and MLP in parallel, biases everywhere (lm_head too)
        c.update(num_attention_heads=2, num_key_value_heads=2)  # head_dim 32, rotary on half of it
        return t.PhiForCausalLM, t.PhiConfig(**c, partial_rotary_factor=0.5, layer_norm_eps=1e-5)
    if kind in ("stablelm", "stablelm_parallel"):  # head_dim 64, rotary on a quarter (the default), q/k/v biases
        c.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)
        return t.StableLmForCausalLM, t.StableLmConfig(**c, use_qkv_bias=True,
                                                       use_parallel_residual=kind == "stablelm_parallel")
    if kind == "stablelm_rd20":  # StableLM-3B's head: 80 wide, rotary on a quarter = 20 (not a multiple of 16:
        # the rotary runs as its own RotaryEmbedding node before the attention)
        c.update(hidden_size=160, num_attention_heads=2, num_key_value_heads=2)
        return t.StableLmForCausalLM, t.StableLmConfig(**c, use_qkv_bias=True)
    if kind == "gptj_rd8":  # GPT-J rotating adjacent pairs of the first 8 of 32: RotaryEmbedding, interleaved
        return t.GPTJForCausalLM, t.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64,
                                               rotary_dim=8, initializer_range=0.15, bos_token_id=1,
                                               eos_token_id=2)  # fmt: skip
    if kind in ("gpt_neox", "gpt_neox_serial"):  # packed per-head qkv, rotary on a quarter, two norms in parallel
        c.update(hidden_size=128, num_attention_heads=2)
        del c["num_key_value_heads"]
        return t.GPTNeoXForCausalLM, t.GPTNeoXConfig(**c, layer_norm_eps=1e-5,
                                                     use_parallel_residual=kind == "gpt_neox")
    if kind == "opt":  # learned positions from row 2 of the table, ReLU, biases, pre-norm LayerNorms, tied
        return t.OPTForCausalLM, t.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=64, init_std=0.15,
                                             bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                             word_embed_proj_dim=64)  # fmt: skip
    if kind in ("bloom", "bloom_h6"):  # ALiBi, the embedding LayerNorm, per-head packed qkv; 6 heads: the slopes of a
        # head count that is not a power of two
        return t.BloomForCausalLM, t.BloomConfig(vocab_size=VOCAB, hidden_size=96 if kind == "bloom_h6" else 64,
                                                 n_layer=2, n_head=6 if kind == "bloom_h6" else 4,
                                                 initializer_range=0.15, bos_token_id=1, eos_token_id=2,
                                                 pad_token_id=0)  # fmt: skip
    if kind in ("gpt_bigcode", "gpt_bigcode_mha"):  # GPT-2's block with one shared key / value head (multi_query),
        # or per-head packed qkv without it
        return t.GPTBigCodeForCausalLM, t.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                           n_positions=64, initializer_range=0.15, bos_token_id=1,
                                                           eos_token_id=2,
                                                           multi_query=kind == "gpt_bigcode")  # fmt: skip
    if kind.startswith("falcon"):  # 8 heads, head_dim 16
        base = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                    max_position_embeddings=64, initializer_range=0.15, bos_token_id=1, eos_token_id=2)  # fmt: skip
        variant = {"falcon": {},  # Falcon-7B: multi-query, attention and MLP in parallel on one norm, no biases
                   "falcon_new": dict(new_decoder_architecture=True, num_kv_heads=2),  # 40B: groups, ln_attn + ln_mlp
                   "falcon_new1": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
                   "falcon_rw": dict(alibi=True, multi_query=False, parallel_attn=False, bias=True),  # RW-1B: ALiBi
                   }[kind]  # fmt: skip
        return t.FalconForCausalLM, t.FalconConfig(**base, **variant)
    if kind == "gpt_neo":  # learned positions, no attention scaling, layers alternating global / local (window 4)
        return t.GPTNeoForCausalLM, t.GPTNeoConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                                                   max_position_embeddings=64, window_size=_WINDOW,
                                                   attention_types=[[["local", "global"], 1]], initializer_range=0.15,
                                                   bos_token_id=1, eos_token_id=2)  # fmt: skip
    if kind == "codegen":  # GPT-J's block with the packed qkv in 4 shards of [q | v | k], lm_head bias
        return t.CodeGenForCausalLM, t.CodeGenConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                     rotary_dim=8, initializer_range=0.15, bos_token_id=1,
                                                     eos_token_id=2)  # fmt: skip
    if kind == "biogpt":  # learned positions from row 2, scaled embedding, biases, GELU, tied output_projection
        return t.BioGptForCausalLM, t.BioGptConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=128,
                                                   max_position_embeddings=64, initializer_range=0.15,
                                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    if kind == "xglm":  # sinusoidal positions from row 2 (computed, not stored), scaled embedding, biases
        return t.XGLMForCausalLM, t.XGLMConfig(vocab_size=VOCAB, d_model=64, num_layers=2, attention_heads=4,
                                               ffn_dim=128, max_position_embeddings=64, init_std=0.15,
                                               bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    if kind in ("exaone", "internlm3", "iquestcoder"):  # LLaMA's modules (transformers builds LlamaForCausalLM)
        conf = {"exaone": t.ExaoneConfig, "internlm3": t.InternLM3Config, "iquestcoder": t.IQuestCoderConfig}[kind]
        extra = {"internlm3": dict(qkv_bias=True, bias=True)}.get(kind, {})
        return t.LlamaForCausalLM, conf(**c, head_dim=16, **extra)
    if kind == "cwm":  # LLaMA, layer 0 full and layer 1 windowed (every 4th layer full, from the first)
        return t.CwmForCausalLM, t.CwmConfig(**c, head_dim=16, sliding_window=_WINDOW)
    if kind == "jais2":  # LayerNorm with biases, a plain ReLU-squared MLP, biases everywhere
        return t.Jais2ForCausalLM, t.Jais2Config(**c, layer_norm_eps=1e-5)
    if kind == "vaultgemma":  # Gemma 2 without the norms of the attention and MLP outputs
        return t.VaultGemmaForCausalLM, t.VaultGemmaConfig(**c, head_dim=16, sliding_window=_WINDOW,
                                                           attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
    if kind in ("mpt", "mpt_h6"):  # ALiBi, bias-free LayerNorm, packed [q | k | v]; 6 heads (slopes of a head count
        # that is not a power of two): q / k / v clamped and an explicit softmax_scale
        attn = {"clip_qkv": 0.5, "softmax_scale": 0.3} if kind == "mpt_h6" else {}
        return t.MptForCausalLM, t.MptConfig(vocab_size=VOCAB, d_model=96 if kind == "mpt_h6" else 64,
                                             n_heads=6 if kind == "mpt_h6" else 4, n_layers=2, max_seq_len=64,
                                             attn_config=attn, initializer_range=0.15, bos_token_id=1,
                                             eos_token_id=2)  # fmt: skip
    if kind in ("hyperclovax", "hyperclovax_plain"):  # Granite's scalars (logits multiplied), norms of the attention
        # and MLP outputs (use_post_norm) or not
        return t.HyperCLOVAXForCausalLM, t.HyperCLOVAXConfig(**c, head_dim=16, embedding_multiplier=3.0,
                                                             residual_multiplier=0.4, attention_multiplier=0.2,
                                                             logits_scaling=0.5,
                                                             use_post_norm=kind == "hyperclovax")  # fmt: skip
    if kind == "apertus":  # per-head q/k norms, a plain MLP with the xIELU activation (learned scalars per layer)
        return t.ApertusForCausalLM, t.ApertusConfig(**c, head_dim=16)
    if kind == "nanochat":  # weightless RMSNorms (the embedding's too), q / k norms after a RoPE of flipped sign,
        # a plain ReLU-squared MLP, soft-capped logits
        return t.NanoChatForCausalLM, t.NanoChatConfig(**c, final_logit_softcapping=2.0)
    if kind == "granite_swa":  # Granite's scalars, a learned sink logit per head, layer 0 full and without RoPE,
        # layer 1 windowed with RoPE
        return t.GraniteSWAForCausalLM, t.GraniteSWAConfig(**c, head_dim=16, embedding_multiplier=3.0,
                                                           residual_multiplier=0.4, attention_multiplier=0.2,
                                                           logits_scaling=4.0, sliding_window=_WINDOW,
                                                           layer_rope_theta=[0, 10000.0])  # fmt: skip
    # mixtures of experts: 4 experts of width 48, 2 per token (every expert gets rows of a 20-token sequence)
    if kind == "mixtral":  # the top-2 weights renormalized, windowed attention
        return t.MixtralForCausalLM, t.MixtralConfig(**{**c, "intermediate_size": 48}, num_local_experts=4,
                                                     num_experts_per_tok=2, sliding_window=_WINDOW)  # fmt: skip
    if kind == "qwen2_moe":  # top-2 softmax weights as they are, a shared expert behind a sigmoid gate, layer 1 dense
        return t.Qwen2MoeForCausalLM, t.Qwen2MoeConfig(**c, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                                       mlp_only_layers=[1])  # fmt: skip
    if kind == "qwen3_moe":  # per-head q / k norms, the top-2 weights renormalized
        return t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(**c, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=48, norm_topk_prob=True)  # fmt: skip
    if kind == "olmoe":  # q / k norms over the whole projection, q / k / v clamped, top-3 of 4 as they are
        return t.OlmoeForCausalLM, t.OlmoeConfig(**{**c, "intermediate_size": 48}, num_experts=4,
                                                 num_experts_per_tok=3, clip_qkv=0.5)  # fmt: skip
    if kind == "granitemoe":  # Granite's four scalars, the experts stored as two [experts, N, K] tensors
        return t.GraniteMoeForCausalLM, t.GraniteMoeConfig(**{**c, "intermediate_size": 48}, num_local_experts=4,
                                                           num_experts_per_tok=2, embedding_multiplier=3.0,
                                                           residual_multiplier=0.4, attention_multiplier=0.2,
                                                           logits_scaling=4.0)  # fmt: skip
    if kind == "gpt_oss":  # attention sinks, biases everywhere, a sliding and a full layer, YaRN (truncate false),
        # the router's top-2 logits softmaxed, clamped SwiGLU experts stored as [experts, K, N] with gate / up columns
        # interleaved (width 64: MXFP4 blocks of 32 along K)
        return t.GptOssForCausalLM, t.GptOssConfig(**{**c, "intermediate_size": 64}, head_dim=16, num_local_experts=4,
                                                   num_experts_per_tok=2, sliding_window=_WINDOW,
                                                   rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                    "beta_fast": 32.0, "beta_slow": 1.0,
                                                                    "original_max_position_embeddings": 16,
                                                                    "rope_theta": 150000.0, "truncate": False})
    if kind in ("glm4_moe", "glm4_moe_air"):  # DeepSeek-style routing: sigmoid scores, a choice bias, expert groups
        # (4 of 2 experts, the best 2 kept), x 2.5; a shared expert; layer 0 dense; q/k/v biases, half-rotary heads;
        # GLM-4.5: per-head q / k norms, renormalized weights; -Air: neither, one group
        full = kind == "glm4_moe"
        return t.Glm4MoeForCausalLM, t.Glm4MoeConfig(**c, head_dim=32, moe_intermediate_size=48, n_routed_experts=8,
                                                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                                     n_group=4 if full else 1, topk_group=2 if full else 1,
                                                     routed_scaling_factor=2.5, norm_topk_prob=full, use_qk_norm=full,
                                                     attention_bias=True)  # fmt: skip
    if kind == "dots1":  # GLM-4.5's routing (8 experts in 2 groups, 1 kept, not renormalized, x 1.5) with Qwen3's
        # attention, layers 0 dense
        return t.Dots1ForCausalLM, t.Dots1Config(**c, head_dim=16, moe_intermediate_size=48, n_routed_experts=8,
                                                 num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                                                 n_group=2, topk_group=1, routed_scaling_factor=1.5,
                                                 norm_topk_prob=False)  # fmt: skip
    if kind == "ernie4_5_moe":  # the softmax + a choice bias picks 2 of 4 experts, renormalized; a shared expert;
        # layer 0 dense (moe_layer_start_index), RoPE on adjacent pairs
        return t.Ernie4_5_MoeForCausalLM, t.Ernie4_5_MoeConfig(**c, head_dim=16, moe_intermediate_size=48,
                                                               moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                                                               moe_layer_start_index=1)  # fmt: skip
    if kind == "flex_olmo":  # OLMo-2's block (norms after attention and MLP, q / k norms over the projection) with
        # a mixture of experts: top-2 of 4, renormalized
        return t.FlexOlmoForCausalLM, t.FlexOlmoConfig(**{**c, "intermediate_size": 48}, num_experts=4,
                                                       num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    if kind == "phimoe":  # the sparse mixer's top-2 weights (threshold 2 x 0.3), LayerNorms, biases (the lm_head's too)
        return t.PhimoeForCausalLM, t.PhimoeConfig(**{**c, "intermediate_size": 48}, num_local_experts=4,
                                                   num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                                                   router_jitter_noise=0.3)  # fmt: skip
    if kind == "granitemoeshared":  # Granite-MoE with a shared MLP stored as one [gate | up] and one down linear
        return t.GraniteMoeSharedForCausalLM, t.GraniteMoeSharedConfig(
            **{**c, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=80,
            embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=4.0)  # fmt: skip
    if kind == "hunyuan_moe":  # Hunyuan's attention (q / k norms of the rotated q, k) with 4 experts, top 2
        # renormalized, and a shared MLP
        return t.HunYuanMoEV1ForCausalLM, t.HunYuanMoEV1Config(**{**c, "intermediate_size": 48}, head_dim=16,
                                                               num_experts=4, moe_topk=2)  # fmt: skip
    if kind == "minimax_m2":  # q / k norms over the whole projection, a rotary half of each head (the checkpoints'
        # rotary_dim), sigmoid scores + a choice bias picking 2 of 4 experts, renormalized
        return t.MiniMaxM2ForCausalLM, t.MiniMaxM2Config(**{**c, "intermediate_size": 48}, head_dim=32, rotary_dim=16,
                                                         num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    raise AssertionError(kind)


MOE_KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "glm4_moe", "glm4_moe_air",
             "dots1", "ernie4_5_moe", "flex_olmo", "phimoe", "granitemoeshared", "hunyuan_moe",
             "minimax_m2"]
KINDS = ["qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "phi3_longrope", "gpt2", "smollm3", "mistral_window",
         "qwen2_window", "llama_dynamic", "ministral", "granite", "phi", "stablelm", "stablelm_parallel", "gpt_neox", "gpt_neox_serial", "olmo2",
         "starcoder2", "helium", "exaone4", "exaone4_full", "arcee", "seed_oss", "ernie4_5", "glm", "glm4",
         "qwen3_yarn", "llama_yarn", "olmo3", "cohere", "cohere2", "nemotron", "gptj",
         "stablelm_rd20", "gptj_rd8", "hunyuan", "opt", "bloom", "bloom_h6", "gpt_bigcode", "gpt_bigcode_mha", "falcon", "falcon_new", "falcon_new1", "falcon_rw", "olmo", "gpt_neo", "codegen", "biogpt", "xglm", "exaone", "internlm3", "iquestcoder", "cwm", "jais2",
         "vaultgemma", "mpt", "mpt_h6", "hyperclovax", "hyperclovax_plain", "apertus",
         "nanochat", "granite_swa", *MOE_KINDS]


def make_family(kind: str, folder: Path, seed: int = 0) -> Any:
    """Save a random model of family ``kind`` into ``folder``; return it (float32) as reloaded."""
    cls, config = _spec(kind)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial norms (Gemma stores w of 1 + w: around 0)
        for name, p in model.named_parameters():
            if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n", "self_attn.sinks")):  # Apertus' xIELU, Granite
                p.uniform_(-1.0, 1.0)  # SWA's sinks: away from their initial values
            elif name.endswith(("_proj_bias", "router.bias")) or (kind.startswith("glm4_moe") and name.endswith(".bias")):
                p.normal_(0.0, 0.3)  # gpt-oss's expert and router biases, GLM-4.5's q/k/v biases (zeros at init)
            elif "norm" in name or ".ln_" in name:
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
                elif kind.startswith("gemma"):
                    p.uniform_(-0.5, 0.5)
                else:
                    p.uniform_(0.5, 1.5)
        for name, buf in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's / ERNIE's choice bias: zeros at init
                buf.normal_(0.0, {"ernie4_5_moe": 0.1, "minimax_m2": 0.05}.get(kind, 0.3))
    model.save_pretrained(folder)
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


class _Built:
    def __init__(self, base: Path, kind: str) -> None:
        self.kind, self.folder = kind, base / "hf"
        self.model = make_family(kind, self.folder)
        self.path = build_llm(self.folder, base / "onnx" / "model.onnx")


def _cached_builds(tmp_path_factory: pytest.TempPathFactory, make: Any) -> Any:
    """``get(kind)``: ``make(folder, kind)`` once per kind and module (a fresh temporary folder each)."""
    cache: dict[str, Any] = {}

    def get(kind: str) -> Any:
        if kind not in cache:
            cache[kind] = make(tmp_path_factory.mktemp(kind), kind)
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _cached_builds(tmp_path_factory, _Built)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path_factory.getbasetemp() / "quantkit-cache"))


def _ids(n: int, seed: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, (rows, n), dtype=np.int64)


def _reference(model: Any, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def _assert_exact(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert got.shape == ref.shape
    assert np.abs(ref).max() > 1.0  # the check is not vacuous
    diff = float(np.abs(got - ref).max())
    assert diff <= 1e-3, f"{what}: max |logit diff| {diff}"
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1), err_msg=f"{what}: greedy tokens differ")


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_decoder_matches_transformers(built: Any, kind: str) -> None:
    b = built(kind)
    ids = _ids(PROMPT + NEW, 1)
    _assert_exact(LLMSession(b.path)(ids), _reference(b.model, ids), kind)
    short = ids[:, :6]  # LongRoPE: a sequence within the original context keeps the short factors
    _assert_exact(LLMSession(b.path)(short), _reference(b.model, short), f"{kind} (6 tokens)")
    assert read_decoder_config(b.folder).model_type in supported_model_types()


def _greedy_with_cache(path: Path, prompt: np.ndarray) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """Greedy decode of ``NEW`` tokens with the KV cache (one shared buffer): each step's last logits, the tokens, and
    the sequence the steps saw (prompt + all tokens but the last)."""
    sess = LLMSession(path, max_length=PROMPT + NEW)
    steps = [sess(prompt)[:, -1]]
    tokens = [int(steps[-1].argmax())]
    for _ in range(NEW - 1):
        steps.append(sess(np.asarray([[tokens[-1]]], np.int64))[:, -1])
        tokens.append(int(steps[-1].argmax()))
    return steps, tokens, np.concatenate([prompt, np.asarray([tokens[:-1]], np.int64)], axis=1)


@pytest.mark.parametrize("kind", KINDS)
def test_kv_cache_decode_equals_recomputation(built: Any, kind: str) -> None:
    """Greedy decode of 16 tokens with the KV cache in one shared buffer: each step's logits equal a forward of the
    whole sequence without a cache, and every chosen token is transformers' greedy choice on that sequence."""
    b = built(kind)
    prompt = _ids(PROMPT, 2)
    steps, tokens, seq = _greedy_with_cache(b.path, prompt)
    if kind == "phi3_longrope":
        # transformers switches every position to the long factors once the sequence passes the original context;
        # a cache keeps the keys it rotated before (transformers' own cache does the same): compare with it
        with torch.no_grad():
            out = b.model(torch.from_numpy(prompt), use_cache=True)
            ref_steps, cache = [out.logits[:, -1].numpy()], out.past_key_values
            for t in tokens[:-1]:
                out = b.model(torch.tensor([[t]]), cache=cache, use_cache=True)
                ref_steps.append(out.logits[:, -1].numpy())
                cache = out.past_key_values
        _assert_exact(np.stack(steps, 1), np.stack(ref_steps, 1), "longrope decode vs transformers with its cache")
        return
    full = LLMSession(b.path)(seq)[:, PROMPT - 1 :]
    np.testing.assert_allclose(np.stack(steps, 1), full, atol=1e-4, rtol=0)
    ref = _reference(b.model, seq)[:, PROMPT - 1 :]
    assert ref.argmax(-1).tolist() == [tokens]
    _assert_exact(np.stack(steps, 1), ref, f"{kind} decode")


@pytest.mark.parametrize("kind", KINDS)
def test_block_graphs_reproduce_transformers_hidden_states(built: Any, kind: str) -> None:
    """What layer-wise calibration runs: the embedding stream (Gemma's scale, GPT-2's positions, BLOOM's norm) then each block graph
    alone, fed the previous one's output, against transformers' hidden states."""
    b = built(kind)
    cfg = read_decoder_config(b.folder)
    ckpt = llm_builder._Checkpoint(b.folder, cfg)
    n = cfg.spec.names
    ids = _ids(20, 3)
    with torch.no_grad():
        hs = b.model(torch.from_numpy(ids), output_hidden_states=True).hidden_states
    table = dict(ckpt.read([f"{n.embed}.weight"]))
    h = embedded_stream(cfg, np.asarray(table[f"{n.embed}.weight"], np.float32)[ids], stream_extras(cfg, ckpt))
    np.testing.assert_allclose(h, hs[0].numpy(), atol=1e-5, rtol=0)
    import onnxruntime as ort

    for i in range(cfg.num_hidden_layers):
        w = dict(ckpt.read(llm_builder.block_tensor_names(cfg, i, ckpt.__contains__)))
        last = list(llm_builder.linear_shapes(cfg, i))[-1]  # down_proj (of the last expert in a mixture)
        tap = f"{block_prefix(cfg, i)}.{last}"
        sess = ort.InferenceSession(block_model(cfg, i, w, {}, [tap], positions=20).SerializeToString(),
                                    providers=["CPUExecutionProvider"])  # fmt: skip
        empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
        h, x = sess.run(None, {"hidden": h, "attention_mask": np.ones((1, 20), np.int64),
                               f"past_key_values.{i}.key": empty, f"past_key_values.{i}.value": empty})  # fmt: skip
        assert x.shape[-1] == llm_builder.linear_shapes(cfg, i)[last][1]
        if not cfg.is_moe(i):
            assert x.shape == (1, 20, cfg.intermediate_size)
        else:  # the rows routed to the expert (every expert gets some of 20 tokens here)
            assert 0 < x.shape[0] < 20 and x.ndim == 2
        if i + 1 < cfg.num_hidden_layers:  # transformers' last hidden state is after the final norm
            want = hs[i + 1].numpy()
            np.testing.assert_allclose(h, want, atol=2e-5 * float(np.abs(want).max()), rtol=0)


def _plan(folder: Path, **default: Any) -> Any:
    from quantkit.recipe import load_recipe
    from quantkit.recipe.plan import PrecisionPlan

    q = {"format": "int4", "group_size": 32, **default}
    return PrecisionPlan.from_recipe(load_recipe({"version": 1, "model": {"source": str(folder)},
                                                  "calibration": {"layerwise": True},
                                                  "quantization": {"default": q}}))  # fmt: skip


def _expert_weight(model: Any, layer: str) -> Any:
    """The ``[N, K]`` view of expert linear ``layer`` (``...mlp.experts.3.up_proj``, Mixtral's
    ``...block_sparse_moe.experts.3.w3``) inside transformers' ``[experts, N, K]`` tensors, or None."""
    import re

    shared = re.fullmatch(r"(.*)\.shared_mlp\.(gate|up|down)_proj", layer)
    mlp = model.get_submodule(f"{shared.group(1)}.shared_mlp") if shared is not None else None
    if shared is not None and hasattr(mlp, "input_linear"):  # Granite-MoE-Shared: one [gate | up] linear, one down
        half = mlp.input_linear.weight.shape[0] // 2
        return {"gate": mlp.input_linear.weight.data[:half], "up": mlp.input_linear.weight.data[half:],
                "down": mlp.output_linear.weight.data}[shared.group(2)]
    m = re.fullmatch(r"(.*)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)", layer)
    if m is None:
        return None
    try:  # transformers' module: mlp.experts (Mixtral's block_sparse_moe renamed), Granite-MoE's block_sparse_moe
        experts = model.get_submodule(f"{m.group(1)}.mlp.experts")
    except AttributeError:
        experts = model.get_submodule(f"{m.group(1)}.{m.group(2)}.experts")
    e, role = int(m.group(3)), m.group(4)
    if model.config.model_type == "gpt_oss":  # [experts, K, N], gate / up columns interleaved: [N, K] views
        return {"gate_proj": experts.gate_up_proj.data[e, :, 0::2].T, "up_proj": experts.gate_up_proj.data[e, :, 1::2].T,
                "down_proj": experts.down_proj.data[e].T}[role]
    half = experts.gate_up_proj.shape[1] // 2
    if role in ("gate_proj", "w1"):
        return experts.gate_up_proj.data[e, :half]
    if role in ("up_proj", "w3"):
        return experts.gate_up_proj.data[e, half:]
    return experts.down_proj.data[e]


@pytest.mark.parametrize("kind", KINDS)
def test_int4_rtn_equals_the_same_weights_in_pytorch(built: Any, kind: str, tmp_path: Path) -> None:
    """INT4 RTN g32, layer-wise (no calibration data): the model loads in ONNX Runtime, every linear is a
    MatMulNBits, and with float32 compute (accuracy_level 1) its logits equal transformers' with the same RTN weights
    (from quantkit's RTN, as the builder got them) put into the PyTorch model."""
    import copy

    import onnx

    from quantkit.algorithms.woq import get_weight_algorithm
    from quantkit.layerwise import quantize_llm_layerwise

    b = built(kind)
    plan = _plan(b.folder, algorithm="rtn", algorithm_options={"clip": False})
    res = quantize_llm_layerwise(b.folder, tmp_path / "q" / "model.onnx", plan, None, work_dir=tmp_path / "w",
                                 accuracy_level=1, progress=False)  # fmt: skip
    nodes = onnx.load(str(res.path), load_external_data=False).graph.node
    ops = [nd.op_type for nd in nodes]
    cfg = read_decoder_config(b.folder)
    routers = {f"{block_prefix(cfg, i)}.{s}" for i in range(cfg.num_hidden_layers) for s in llm_builder.float_linears(cfg, i)}
    # every linear is 4-bit but a mixture's router (and shared-expert gate): float32, as they choose the experts
    assert {nd.name for nd in nodes if nd.op_type == "MatMul"} == routers
    assert ops.count("MatMulNBits") + 3 * cfg.num_experts * ops.count("QMoE") >= 4 * 2 + 1  # (QMoE: 3 per expert)
    model = copy.deepcopy(b.model)
    rtn = get_weight_algorithm("rtn")
    conv1d = read_decoder_config(b.folder).spec.conv1d
    with torch.no_grad():
        for row in res.rows:
            expert = _expert_weight(model, row["layer"])
            if expert is not None:  # transformers holds the experts as [experts, N, K] tensors
                lp = plan.layer(row["layer"], "MatMul", row["layer"])
                eff = rtn(np.ascontiguousarray(expert.numpy().T), bits=4, group_size=32, symmetric=lp.weight_symmetric,
                          stats=None, clip=False).effective_weight()  # fmt: skip
                expert.copy_(torch.from_numpy(eff.T))
                continue
            # (BioGPT's lm_head is its output_projection)
            mod = model.get_output_embeddings() if row["layer"] == "lm_head" else model.get_submodule(row["layer"])
            stored_kn = conv1d and row["layer"] != "lm_head"  # GPT-2's Conv1D keeps [K, N]
            w = mod.weight.numpy() if stored_kn else mod.weight.numpy().T
            lp = plan.layer(row["layer"], "MatMul", row["layer"])
            eff = rtn(np.ascontiguousarray(w), bits=4, group_size=32, symmetric=lp.weight_symmetric, stats=None,
                      clip=False).effective_weight()  # fmt: skip
            mod.weight.copy_(torch.from_numpy(eff if stored_kn else eff.T))
    ids = _ids(PROMPT + NEW, 4)
    ref, got = _reference(model, ids), LLMSession(res.path)(ids)
    _assert_exact(got, ref, f"{kind} int4 rtn")
    assert float(np.abs(ref - _reference(b.model, ids)).max()) > 1e-2  # the RTN weights did change the logits


def calibrate_cli(folder: Path, name: str, algorithm: str, tmp_path: Path, ids: Any) -> dict[str, Any]:
    """``quantkit calibrate`` (layer-wise INT4 g32 by ``algorithm``) on ``folder`` with 3 x 16 calibration and evaluation
    ids (``ids(n, seed, rows)``) as ``.npz`` files, output in ``tmp_path / "o"``: its report."""
    from quantkit.cli import main

    for part, seed in (("cal", 5), ("ev", 6)):
        rows = ids(16, seed, rows=3)
        np.savez(tmp_path / f"{part}.npz", input_ids=rows, attention_mask=np.ones_like(rows))
    rec = {"version": 1, "name": name, "model": {"source": str(folder)},
           "calibration": {"layerwise": True, "data": {"kind": "npz", "path": str(tmp_path / "cal.npz")}},
           "evaluation": {"data": {"kind": "npz", "path": str(tmp_path / "ev.npz")}},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": algorithm}},
           "report": {"formats": ["json"], "latency": {"enabled": False}}}  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(rec))
    assert main(["calibrate", "-q", "--recipe", str(tmp_path / "r.yaml"), "--output", str(tmp_path / "o")]) == 0
    return json.loads((tmp_path / "o" / "report.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_quantkit_calibrate_layerwise_awq(built: Any, kind: str, tmp_path: Path) -> None:
    """The command line, as users run it: calibration.layerwise with AWQ block by block (the block graphs run, the
    input scales fold into the norms / up columns), perplexity FP32 vs quantized on held-out ids."""
    b = built(kind)
    report = calibrate_cli(b.folder, kind, "awq", tmp_path, _ids)
    q = report["quality"]
    assert np.isfinite(q["perplexity_fp32"]["ppl"]) and np.isfinite(q["perplexity_quantized"]["ppl"])
    assert report["census"]["quantized_kernels"]["MatMulNBits"] >= 4 * 2
    ids = _ids(12, 7)
    got = LLMSession(tmp_path / "o" / "model.onnx")(ids)
    ref = _reference(b.model, ids)
    # tracks FP32: int4 g32 from 48 random calibration tokens on random weights gives 0.89 (StableLM-3B's head
    # shape) to 0.98 - RTN of the same weights 0.93 / 0.98: the tiny calibration, not the graph (the RTN test is exact)
    assert float(np.corrcoef(got.ravel(), ref.ravel())[0, 1]) > 0.85
    genai = json.loads((tmp_path / "o" / "genai_config.json").read_text())
    assert genai["model"]["type"] == read_decoder_config(b.folder).spec.genai_type
    moe = [w for w in report["warnings"] if "mixture-of-experts block(s) run their experts through the standard-op" in w]
    if read_decoder_config(b.folder).num_experts:  # AWQ's per-expert input scales: no QMoE, and the report says why
        assert len(moe) == 1 and "AWQ" in moe[0], report["warnings"]
    else:
        assert not moe


@pytest.mark.parametrize("kind", ["phi3", "olmo2", "gpt_neox", "phi", "gpt2", "gemma", "mixtral"])
def test_signround_equalize_folds_on_every_block_layout(built: Any, kind: str, tmp_path: Path) -> None:
    """SignRound's W4A8 input equalization on the block layouts that differ where its scale folds: a packed gate/up
    (Phi-3), no norm before attention or MLP (OLMo-2: only down_proj's scale folds, into up), parallel blocks with
    and without an MLP norm (GPT-NeoX, Phi-2), a plain MLP and a LayerNorm with a bias (GPT-2), Gemma's ``1 + w``
    norm, a mixture of experts (q/k/v only).  Every searched scale folds (the graph has the same nodes as without
    equalization), and the model is as close to FP32 as without it (the folds' exactness: the AWQ tests, same code)."""
    import onnx

    from quantkit.layerwise import quantize_llm_layerwise

    b = built(kind)
    win = _ids(16, 1, rows=3)
    ids = _ids(PROMPT + NEW, 4)
    ref = _reference(b.model, ids)
    out = {}
    for eq in (False, True):
        opts: dict[str, Any] = {"iters": 10, "equalize": True} if eq else {"iters": 10}
        res = quantize_llm_layerwise(b.folder, tmp_path / f"q{eq}" / "model.onnx",
                                     _plan(b.folder, algorithm="signround", algorithm_options=opts), win,
                                     work_dir=tmp_path / f"w{eq}", progress=False, w4a8_max_error_ratio=1.5)  # fmt: skip
        got = LLMSession(res.path)(ids)
        out[eq] = (res, float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                   sorted(nd.op_type for nd in onnx.load(str(res.path), load_external_data=False).graph.node))
    (_, e0, ops0), (res, e1, ops1) = out[False], out[True]
    sec = res.w4a8["equalize"]
    assert sec["groups_searched"] >= 2 and sec["not_applied"], sec  # o_proj at least is left alone
    assert ops1 == ops0
    assert e1 < 1.5 * e0 + 1e-3, (e0, e1)


def _awq_graph(b: Any, kind: str, tmp_path: Path, overrides: list[dict[str, Any]] | None = None) -> Any:
    """``quantkit calibrate`` layer-wise, int4 g32 AWQ, on 3 x 16 random ids; the emitted graph (no weights)."""
    import onnx

    from quantkit.cli import main

    ids = _ids(16, 5, rows=3)
    np.savez(tmp_path / "cal.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    rec = {"version": 1, "name": kind, "model": {"source": str(b.folder)},
           "calibration": {"layerwise": True, "data": {"kind": "npz", "path": str(tmp_path / "cal.npz")}},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "awq"},
                            "overrides": overrides or []},
           "report": {"formats": ["json"], "latency": {"enabled": False}}}  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(rec))
    assert main(["calibrate", "-q", "--recipe", str(tmp_path / "r.yaml"), "--output", str(tmp_path / "o")]) == 0
    return onnx.load(str(tmp_path / "o" / "model.onnx"), load_external_data=False).graph


@pytest.mark.parametrize("kind", ["phi", "stablelm_parallel", "cohere"])
def test_parallel_block_awq_scale_folds_into_its_one_norm(built: Any, kind: str, tmp_path: Path) -> None:
    """In a parallel block whose attention and MLP read one norm, AWQ searches one input scale for q/k/v and the MLP's
    input linears together, so it folds into that norm: no ``Mul`` by the scale before them, and q/k/v still run as
    one fused ``MatMulNBits`` (searched apart, the scales differ: three unfused kernels and four ``Mul`` nodes)."""
    b = built(kind)
    graph = _awq_graph(b, kind, tmp_path)
    cfg = read_decoder_config(b.folder)
    n = cfg.spec.names
    first_mlp = n.gate or n.up
    for i in range(cfg.num_hidden_layers):
        p = block_prefix(cfg, i)
        scaled = [x.name for x in graph.node if x.name.endswith("/input_scale")
                  and any(x.name.startswith(f"{p}.{s}") for s in (n.q, n.k, n.v, first_mlp))]  # fmt: skip
        assert not scaled, scaled
        fused = [x for x in graph.node if x.op_type == "MatMulNBits" and x.name.startswith(f"{p}.")
                 and x.name.endswith("qkv_proj")]  # fmt: skip
        assert len(fused) == 1, [x.name for x in graph.node if x.op_type == "MatMulNBits"]
    got = LLMSession(tmp_path / "o" / "model.onnx")(_ids(12, 7))
    assert float(np.corrcoef(got.ravel(), _reference(b.model, _ids(12, 7)).ravel())[0, 1]) > 0.9


def test_parallel_block_with_a_float_mlp_input_reads_the_unscaled_norm(built: Any, tmp_path: Path) -> None:
    """Phi-2 with its fc1 kept in float: the norm's readers no longer share one AWQ scale, so it cannot fold; q/k/v
    scale their input with one ``Mul`` - and the MLP must still read the norm's own output, not that scaled copy
    (a first version handed it the scaled one: the float fc1 saw x / s)."""
    b = built("phi")
    float_fc1 = [{"pattern": r"mlp\.fc1$", "format": "fp32"}]
    graph = _awq_graph(b, "phi", tmp_path, float_fc1)
    assert any(x.name.endswith("/attn_input_scale") for x in graph.node)  # the case: a shared, unfolded scale
    fc1 = [x for x in graph.node if x.op_type == "MatMul" and x.name.endswith("mlp.fc1")]
    norms = {x.output[0] for x in graph.node if x.name.endswith("input_layernorm")}
    assert fc1 and all(x.input[0] in norms for x in fc1), [x.input[0] for x in fc1]
    got = LLMSession(tmp_path / "o" / "model.onnx")(_ids(12, 7))
    assert float(np.corrcoef(got.ravel(), _reference(b.model, _ids(12, 7)).ravel())[0, 1]) > 0.9


@pytest.mark.parametrize("kind", ["olmo2", "exaone4"])
def test_awq_scale_without_a_norm_to_fold_into_is_one_mul_per_input(built: Any, kind: str, tmp_path: Path) -> None:
    """No norm before attention or MLP (OLMo-2, EXAONE 4): the AWQ input scale shared by q/k/v (and by gate/up) cannot
    fold into a norm, so the block scales its input once per group - one ``Mul`` - instead of once per linear (the
    same product: ``x / s`` read by every linear of the group), and the model still tracks FP32."""
    b = built(kind)
    graph = _awq_graph(b, kind, tmp_path)
    cfg = read_decoder_config(b.folder)
    for i in range(cfg.num_hidden_layers):
        p = block_prefix(cfg, i)
        muls = sorted(x.name for x in graph.node if x.op_type == "Mul" and x.name.startswith(p)
                      and x.name.endswith("input_scale") and "o_proj" not in x.name)  # fmt: skip
        assert muls == [f"{p}/attn_input_scale", f"{p}/mlp_input_scale"], muls  # o_proj keeps its own (no norm)
    got = LLMSession(tmp_path / "o" / "model.onnx")(_ids(12, 7))
    assert float(np.corrcoef(got.ravel(), _reference(b.model, _ids(12, 7)).ravel())[0, 1]) > 0.9


@pytest.mark.parametrize("kind", ["gemma2", "phi", "granite"])
def test_hot_rows_lm_head_before_the_logits_post_processing(built: Any, kind: str, tmp_path: Path) -> None:
    """An lm_head with hot rows (8-bit columns scattered over the 4-bit logits) followed by soft-capping (Gemma 2),
    the lm_head's bias (Phi-2) or ``logits_scaling`` (Granite): the graph loads (before, soft-capping's
    intermediate took the hot head's output name: "Duplicate definition of name") and the hot columns' logits are
    closer to FP32 than the same build without hot rows."""
    from quantkit.cli import main

    b = built(kind)
    ids = _ids(16, 5, rows=3)
    np.savez(tmp_path / "cal.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    head = {"layer": "lm_head", "format": "int4", "group_size": 32, "algorithm": "rtn"}
    errors = []
    for hot in (0, 64):
        rec = {"version": 1, "name": kind, "model": {"source": str(b.folder)},
               "calibration": {"layerwise": True, "data": {"kind": "npz", "path": str(tmp_path / "cal.npz")}},
               "quantization": {"default": {"format": "fp32"}, "overrides": [head | ({"hot_rows": hot} if hot else {})]},
               "report": {"formats": ["json"], "latency": {"enabled": False}}}  # fmt: skip
        (tmp_path / f"r{hot}.yaml").write_text(yaml.safe_dump(rec))
        assert main(["calibrate", "-q", "--recipe", str(tmp_path / f"r{hot}.yaml"), "--output", str(tmp_path / f"o{hot}")]) == 0
        got = LLMSession(tmp_path / f"o{hot}" / "model.onnx")(_ids(12, 7))
        ref = _reference(b.model, _ids(12, 7))
        errors.append(float(np.abs(got - ref).mean()))
    assert errors[1] < errors[0], errors


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "granite", "phi"])
def test_quantkit_generate_equals_transformers_greedy(built: Any, kind: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``quantkit generate`` (prefill, then one token per step with the KV cache) writes transformers' greedy text."""
    import shutil

    from quantkit.cli import main
    from tests.unit.test_llm_frontend import char_tokenizer

    b = built(kind)
    out = tmp_path / "model"
    shutil.copytree(b.path.parent, out)
    tok = char_tokenizer()
    tok.save_pretrained(out)
    prompt = "It is a truth universally"
    ids = list(tok(prompt)["input_ids"])
    new: list[int] = []
    with torch.no_grad():
        while len(new) < NEW and (not new or new[-1] != 2):  # eos: id 2
            new.append(int(b.model(torch.tensor([ids + new])).logits[0, -1].argmax()))
    assert main(["generate", "--model", str(out), "--prompt", prompt, "--max-new-tokens", str(NEW)]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed == prompt + tok.decode(new, skip_special_tokens=True)
    _, timings = llm_builder.generate(out / "model.onnx", out, prompt, NEW, return_timings=True)
    assert timings["tokens"] == new  # token for token (ids past the char vocabulary print as nothing)


def test_graph_uses_the_fused_kernels(built: Any) -> None:
    import onnx

    def ops(kind: str) -> list[str]:
        return [n.op_type for n in onnx.load(str(built(kind).path), load_external_data=False).graph.node]

    gemma2 = onnx.load(str(built("gemma2").path), load_external_data=False)
    gqa = [n for n in gemma2.graph.node if n.op_type == "GroupQueryAttention"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in gqa]
    assert [a["local_window_size"] for a in attrs] == [_WINDOW, -1]  # alternating: sliding, full
    assert all(a["softcap"] == pytest.approx(5.0) and a["scale"] == pytest.approx(24**-0.5) for a in attrs)
    # input norm (after the first block: the residual add fused in), pre-feedforward norm, final norm; the norms of
    # the attention / MLP outputs have nothing to add (standard ops, fused by ORT)
    assert ops("gemma2").count("SkipSimplifiedLayerNormalization") == 1 + 2 + 1
    assert "Tanh" in ops("gemma2") and "Gelu" in ops("gemma2")  # final soft-capping, GeGLU
    gpt2 = ops("gpt2")
    assert gpt2.count("SkipLayerNormalization") == 2 * 2 + 1 and "LayerNormalization" not in gpt2
    assert {"GroupQueryAttention", "Range"} <= set(gpt2) and "Sigmoid" not in gpt2
    g2 = onnx.load(str(built("gpt2").path), load_external_data=False)
    attn = next(n for n in g2.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in attn.attribute}["do_rotary"] == 0
    assert len(attn.input) == 7  # no cos / sin caches: learned positions
    phi = ops("phi3_longrope")
    assert "If" in phi and "Split" in phi and ops("phi3").count("MatMul") == 4 * 2 + 1  # qkv, o, gate_up, down; lm_head
    qwen3 = ops("qwen3")
    assert qwen3.count("GroupQueryAttention") == 2 and qwen3.count("Reshape") == 2 * 4  # q/k norms per head


def test_gpt2_hub_names_without_the_transformer_prefix(built: Any, tmp_path: Path) -> None:
    """GPT-2 on the Hub stores ``h.0.attn.c_attn.weight`` (no ``transformer.``): the same decoder is built."""
    import shutil

    from safetensors.torch import load_file, save_file

    b = built("gpt2")
    folder = tmp_path / "hub"
    shutil.copytree(b.folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    path = build_llm(folder, tmp_path / "o" / "model.onnx")
    ids = _ids(12, 8)
    np.testing.assert_array_equal(LLMSession(path)(ids), LLMSession(b.path)(ids))


_HUB_RENAMES = {  # (regex on the saved name, the other name a checkpoint may carry): transformers loads both
    # EXAONE 3: save_pretrained writes the original names; LLaMA's module names (what transformers loads them as)
    "exaone": [(r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.h\.", "model.layers."),
               (r"^transformer\.ln_f\.", "model.norm."), (r"\.attn\.attention\.out_proj\.", ".self_attn.o_proj."),
               (r"\.attn\.attention\.", ".self_attn."), (r"\.ln_1\.", ".input_layernorm."),
               (r"\.ln_2\.", ".post_attention_layernorm."), (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
               (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj.")],
    "opt": [(r"^model\.", "")],  # facebook/opt-*: decoder.layers.0... (OPTModel's state dict)
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_HUB_RENAMES))
def test_original_checkpoint_names_build_the_same_decoder(built: Any, kind: str, tmp_path: Path) -> None:
    """A checkpoint under either of the names transformers loads (EXAONE 3's ``transformer.h.0.attn.attention.q_proj``
    or LLaMA's ``model.layers.0.self_attn.q_proj``; OPT's ``decoder.layers...`` or ``model.decoder.layers...``)
    builds the same decoder."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    b = built(kind)
    folder = tmp_path / "hub"
    shutil.copytree(b.folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {}
    for k, v in tensors.items():
        for pattern, repl in _HUB_RENAMES[kind]:
            k = re.sub(pattern, repl, k)
        renamed[k] = v
    assert set(renamed) != set(tensors), "the renames must change some names"
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = build_llm(folder, tmp_path / "o" / "model.onnx")
    ids = _ids(12, 8)
    np.testing.assert_array_equal(LLMSession(path)(ids), LLMSession(b.path)(ids))


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_decoder_equals_a_shallower_build(built: Any, kind: str, tmp_path: Path) -> None:
    """``truncate_decoder`` (the streamed run times and checks the first blocks of a decoder with it) cut after
    block 0 gives the logits of the same checkpoint built with one layer."""
    import shutil

    from quantkit.evaluate.streamed import truncate_decoder

    b = built(kind)
    cut = truncate_decoder(b.path, 1, b.path.with_name(f"model.first-1-{kind}.onnx"))
    folder = tmp_path / "one"
    shutil.copytree(b.folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if key in cfg:
            cfg[key] = 1
    if "attention_types" in cfg:  # GPT-Neo: the first layer's kind
        cfg["attention_types"] = [[[cfg["attention_types"][0][0][0]], 1]]
    for key in ("layer_types", "no_rope_layers", "layer_rope_theta"):
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:1]
    (folder / "config.json").write_text(json.dumps(cfg))
    one = build_llm(folder, tmp_path / "o" / "model.onnx")
    ids = _ids(12, 9)
    np.testing.assert_allclose(LLMSession(cut)(ids), LLMSession(one)(ids), rtol=0, atol=1e-5)


def test_gpt_neox_hub_layout_embed_out_and_legacy_rotary_keys(built: Any, tmp_path: Path) -> None:
    """Pythia on the Hub stores the lm_head as ``embed_out.weight`` (``save_pretrained`` writes it so too) and
    writes ``rotary_pct`` / ``rotary_emb_base`` instead of RoPE parameters: the same decoder is built from either
    name and either set of keys (and a rotary base other than the default is honoured)."""
    import shutil

    from safetensors.torch import load_file, save_file

    b = built("gpt_neox")
    folder = tmp_path / "hub"
    shutil.copytree(b.folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    assert "embed_out.weight" in tensors and "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.pop("partial_rotary_factor", None)
    cfg.update(rotary_pct=0.25, rotary_emb_base=10000)
    (folder / "config.json").write_text(json.dumps(cfg))
    path = build_llm(folder, tmp_path / "o" / "model.onnx")
    ids = _ids(12, 8)
    np.testing.assert_array_equal(LLMSession(path)(ids), LLMSession(b.path)(ids))
    cfg.update(rotary_pct=0.5, rotary_emb_base=500)  # other values: other logits, as transformers computes them
    (folder / "config.json").write_text(json.dumps(cfg))
    other = transformers.GPTNeoXForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert other.config.rope_parameters["rope_theta"] == 500  # transformers read the legacy keys too
    _assert_exact(LLMSession(build_llm(folder, tmp_path / "o2" / "model.onnx"))(ids), _reference(other, ids),
                  "gpt_neox rotary_pct 0.5, base 500")  # fmt: skip


def test_every_builder_family_is_in_the_docs_table() -> None:
    """docs/llm-families.md's table names every model_type the builder takes (a family added without its row fails)."""
    table = (Path(__file__).resolve().parents[2] / "docs" / "llm-families.md").read_text().split("\n## ")[0]
    missing = [t for t in supported_model_types() if f"`{t}`" not in table]
    assert not missing, missing


# -- refusals: before any tokenization, with what is allowed ------------------------------------------------


def _config(tmp_path: Path, kind: str, **changes: Any) -> Path:
    _, config = _spec(kind)
    d = config.to_dict()
    d.update(changes)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


@pytest.mark.parametrize(("kind", "changes", "match"), [
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping -1.0; allowed: a finite number > 0"),
    ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar 0; allowed"),
    ("gemma2", {"layer_types": ["full_attention"]}, "layer_types .* allowed: a list of 2"),
    ("gemma2", {"hidden_activation": "relu6"}, "hidden_activation 'relu6' is not supported; allowed: .*gelu_pytorch_tanh.*relu2"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention True is not supported"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention True is not supported"),
    ("gpt2", {"n_embd": 0}, r"n_embd as hidden_size.*hidden_size 0 is out of range"),
    ("gpt2", {"layer_norm_epsilon": -1.0}, "layer_norm_epsilon -1.0; allowed: a finite number >= 0"),
    ("phi3", {"partial_rotary_factor": 0.3}, "rotary dimension of 9; allowed: an even number >= 2"),
    ("phi3_longrope", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 3,
                                           "long_factor": [1.0] * 16, "original_max_position_embeddings": 8}},
     r"short_factor .*allowed: a list of 16"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": -2.0}},
     "rope_scaling yarn factor -2.0; allowed: a finite number > 0"),
    ("qwen2_window", {"layer_types": None, "max_window_layers": "one"}, "max_window_layers 'one'; allowed: an integer"),
    ("smollm3", {"no_rope_layers": [1, 2]}, r"no_rope_layers \[1, 2\]; allowed: a list of 2 .* each 0 or 1"),
    ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before False is not supported for opt .*allowed: true"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim 32 differs from hidden_size 64.*allowed: "),
    ("bloom", {"apply_residual_connection_post_layernorm": True},
     "apply_residual_connection_post_layernorm True is not supported for bloom; allowed: false"),
    ("falcon", {"new_decoder_architecture": True, "alibi": True},
     "falcon with alibi true, new_decoder_architecture true, num_ln_in_parallel_attn null is not a variant .*"
     r"allowed: Falcon \(40B"),
    ("falcon", {"parallel_attn": "yes"}, "parallel_attn 'yes'; allowed: true or false"),
    ("gpt_bigcode", {"multi_query": "yes"}, "multi_query 'yes'; allowed: true or false"),
    ("olmo", {"clip_qkv": -1.0}, r"clip_qkv -1.0; allowed: a finite number > 0 or null"),
    ("mpt", {"attn_config": {"qk_ln": True}}, "attn_config.qk_ln True is not supported for mpt .*allowed: false"),
    ("mpt", {"attn_config": {"softmax_scale": -1}}, r"attn_config.softmax_scale -1; allowed: a finite number > 0"),
    ("hyperclovax", {"logits_scaling": 0}, "logits_scaling 0; allowed: a finite number > 0"),
    ("granite_swa", {"layer_rope_theta": [1e4, 5e5]}, r"layer_rope_theta has 2 different RoPE bases .*allowed: one"),
    ("gpt_neo", {"attention_types": [[["global"], 5]]}, r"attention_types .*giving 2 \(num_layers\) layers in all"),
])  # fmt: skip
def test_config_values_are_refused_naming_the_key(tmp_path: Path, kind: str, changes: dict[str, Any],
                                                  match: str) -> None:
    with pytest.raises(ModelError, match=match):
        read_decoder_config(_config(tmp_path, kind, **changes))


def test_unknown_family_is_refused_by_calibrate_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model_type the builder does not know: exit 2 in under a second, before the calibration text is tokenized,
    naming the supported families and what to try instead.  (Timed after the imports every quantkit command pays.)"""
    import quantkit.api  # noqa: F401 - the command's start-up, not the refusal
    from quantkit.cli import main

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "diffllama", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 4, "vocab_size": 256}))
    rec = {"version": 1, "model": {"source": str(folder)},
           "calibration": {"layerwise": True, "data": {"kind": "text", "source": "austen:prideprejudice",
                                                       "mode": "windows", "seq_len": 512, "count": 64}},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "gptq"}}}  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(rec))
    t = time.perf_counter()
    code = main(["calibrate", "-q", "--recipe", str(tmp_path / "r.yaml"), "--output", str(tmp_path / "o")])
    took = time.perf_counter() - t
    err = capsys.readouterr().err
    assert code == 2 and took < 1.0, (code, took, err)
    assert "model_type 'diffllama'" in err and "calibration.layerwise: false" in err
    assert all(t in err for t in ("llama", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2"))
    assert not (tmp_path / "o").exists()


def test_dynamic_ntk_rope_is_built_for_its_original_context(built: Any) -> None:
    """Dynamic NTK RoPE is plain RoPE until a sequence passes the original context (transformers then rescales
    every frequency by the sequence length): the decoder covers exactly that context, a longer sequence is refused."""
    b = built("llama_dynamic")
    cfg = read_decoder_config(b.folder)
    assert cfg.context_length == 64
    ids = _ids(64, 5)
    _assert_exact(LLMSession(b.path)(ids), _reference(b.model, ids), "dynamic NTK, the whole original context")


@pytest.mark.parametrize("cfg", [{"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
                                 {"model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2}])
def test_mixture_of_experts_whole_graph_path_points_to_the_layerwise_one(tmp_path: Path, cfg: dict[str, Any]) -> None:
    """torch.export cannot trace transformers' expert dispatch: the whole-graph path refuses a mixture of experts at
    once (not after a long torch dump) and names the layer-wise path, which builds it."""
    from quantkit.frontends.hf_folder import check_hf_folder

    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "vocab_size": 256}))
    with pytest.raises(ModelError, match=r"is a mixture-of-experts decoder \(num_\w+: \d\); the whole-graph path "
                                         r"cannot export it.*calibration.layerwise: true"):
        check_hf_folder(tmp_path)


def test_unsupported_mixture_of_experts_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    from quantkit.frontends.hf_folder import check_hf_folder

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "n_routed_experts": 16,
                                                      "num_experts_per_tok": 2, "hidden_size": 64,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "vocab_size": 256}))  # fmt: skip
    for call in (read_decoder_config, check_hf_folder):
        with pytest.raises(ModelError, match=r"'deepseek_v3' is a mixture-of-experts decoder \(n_routed_experts: 16\); "
                                             r"quantkit supports the mixture-of-experts families mixtral, granitemoe, "
                                             r".*qwen3_moe, .*glm4_moe, dots1, .*phimoe, .*gpt_oss.* \(layer-wise\)"):
            call(tmp_path)


@pytest.mark.parametrize(("changes", "match"), [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok 5 exceeds num_experts 4; allowed: 1 \.\. 4"),
    ({"num_experts": 1}, r"num_experts 1; allowed: an integer >= 2"),
    ({"norm_topk_prob": "yes"}, r"norm_topk_prob 'yes'; allowed: true or false"),
    ({"mlp_only_layers": "0"}, r"mlp_only_layers '0'; allowed: a list of layer indices"),
    ({"moe_intermediate_size": 0}, r"moe_intermediate_size 0; allowed: an integer >= 1"),
])  # fmt: skip
def test_mixture_of_experts_config_values_are_checked(tmp_path: Path, changes: dict[str, Any], match: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4,
                                                      "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                                      "hidden_size": 64, "intermediate_size": 128,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "vocab_size": 256, **changes}))  # fmt: skip
    with pytest.raises(ModelError, match=match):
        read_decoder_config(tmp_path)


@pytest.mark.parametrize(("changes", "match"), [
    ({"n_group": 3}, r"n_group 3 does not split n_routed_experts 8 into groups of 2 or more experts; allowed: a divisor"),
    ({"n_group": 8}, r"n_group 8 does not split"),
    ({"topk_group": 5}, r"topk_group 5 with n_group 4 leaves fewer than num_experts_per_tok 2"),
    ({"topk_group": 1, "num_experts_per_tok": 3}, r"topk_group 1 with n_group 4 leaves fewer than num_experts_per_tok 3"),
    ({"routed_scaling_factor": 0}, r"routed_scaling_factor 0; allowed: a number > 0"),
    ({"first_k_dense_replace": -1}, r"first_k_dense_replace -1; allowed: an integer >= 0"),
    ({"n_shared_experts": 0}, r"n_shared_experts 0; allowed: an integer >= 1"),
])  # fmt: skip
def test_deepseek_style_routing_values_are_checked(tmp_path: Path, changes: dict[str, Any], match: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4_moe", "n_routed_experts": 8,
                                                      "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                                      "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
                                                      "hidden_size": 64, "intermediate_size": 128, "head_dim": 32,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "vocab_size": 256, **changes}))  # fmt: skip
    with pytest.raises(ModelError, match=match):
        read_decoder_config(tmp_path)


def test_family_names_are_unique() -> None:
    """A family's name finds its description (DecoderConfig.spec): two variants of one model_type need two names."""
    from quantkit.frontends.families import FAMILIES

    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_moe_experts_see_only_their_routed_tokens_and_an_idle_expert_is_rounded_without_statistics(
        built: Any, tmp_path: Path) -> None:
    """GPTQ layer-wise on a mixture of experts: each expert's gate / up / down statistics count exactly the tokens
    the router sends it (together ``tokens x experts_per_token``; the shared expert and attention every token), and an
    expert no calibration token reaches is rounded without statistics, saying so."""
    from quantkit.layerwise import quantize_llm_layerwise
    from quantkit.recipe import load_recipe
    from quantkit.recipe.plan import PrecisionPlan

    b = built("qwen2_moe")
    cfg = read_decoder_config(b.folder)
    windows = _ids(20, 9, rows=3)
    # attention kept in float: the router then sees transformers' FP32 stream, and routes as transformers does
    plan = PrecisionPlan.from_recipe(load_recipe({
        "version": 1, "model": {"source": str(b.folder)}, "calibration": {"layerwise": True},
        "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "gptq"},
                         "overrides": [{"pattern": r"self_attn\.", "format": "fp32"}]}}))  # fmt: skip
    res = quantize_llm_layerwise(b.folder, tmp_path / "q" / "model.onnx", plan, windows, work_dir=tmp_path / "w",
                                 accuracy_level=4, progress=False)  # fmt: skip
    rows = {r["layer"]: r for r in res.rows}
    p = block_prefix(cfg, 0)
    assert rows[f"{p}.mlp.shared_expert.up_proj"]["calibration_rows"] == 60
    assert rows[f"{p}.mlp.shared_expert.gate_proj"]["calibration_rows"] == 60
    routed = [rows[f"{p}.mlp.experts.{e}.gate_proj"]["calibration_rows"] for e in range(4)]
    assert sum(routed) == 60 * cfg.experts_per_token and min(routed) > 0
    for e in range(4):  # down_proj reads the same rows as its expert's gate / up
        assert rows[f"{p}.mlp.experts.{e}.down_proj"]["calibration_rows"] == routed[e]
    # transformers' routing on the same tokens: the counts per expert agree
    with torch.no_grad():
        hs = b.model(torch.from_numpy(windows), output_hidden_states=True).hidden_states[0]
        layer = b.model.model.layers[0]
        _, _, idx = layer.mlp.gate(layer.post_attention_layernorm(hs + layer.self_attn(
            layer.input_layernorm(hs), position_embeddings=b.model.model.rotary_emb(hs, torch.arange(20)[None]),
            attention_mask=None)[0]))  # fmt: skip
    assert routed == np.bincount(idx.numpy().ravel(), minlength=4).tolist()

    # one calibration token: the router picks 2 of the 4 experts; the other two are rounded without statistics
    res = quantize_llm_layerwise(b.folder, tmp_path / "q2" / "model.onnx", plan, windows[:1, :1],
                                 work_dir=tmp_path / "w2", accuracy_level=4, progress=False)  # fmt: skip
    rows = {r["layer"]: r for r in res.rows}
    algos = [rows[f"{p}.mlp.experts.{e}.{role}"]["algorithm"] for e in range(4) for role in ("gate_proj", "down_proj")]
    assert sorted(algos) == ["gptq"] * 4 + ["rtn"] * 4
    for e in range(4):
        r = rows[f"{p}.mlp.experts.{e}.gate_proj"]
        if r["algorithm"] == "rtn":
            assert "calibration_rows" not in r
            assert "no calibration statistics" in res.notes[f"{p}.mlp.experts.{e}.gate_proj"]
        else:
            assert r["calibration_rows"] == 1


@pytest.mark.parametrize(("cfg", "windows"), [
    ({"model_type": "ministral", "sliding_window": 8}, [8, 8, 8]),  # no layer_types: every layer (transformers' default)
    ({"model_type": "ministral", "sliding_window": None}, [None, None, None]),
    ({"model_type": "ministral", "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention",
                                                                      "full_attention"]}, [8, None, None]),
    # the window starts at max_window_layers; past the depth no layer is windowed (it used to window them all)
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 28},
     [None, None, None]),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, [None, 8, 8]),
    ({"model_type": "gemma2", "sliding_window": 8, "layer_types": ["full_attention"] * 3}, [None, None, None]),
    ({"model_type": "cwm", "sliding_window": 8}, [None, 8, 8]),  # every 4th layer full, from the first
    ({"model_type": "gemma2", "sliding_window": 8}, [8, None, 8]),  # every 2nd layer full, from the second
    ({"model_type": "gpt_neo", "window_size": 8, "attention_types": [[["global", "local"], 1], [["local"], 1]]},
     [None, 8, 8]),
])  # fmt: skip
def test_which_layers_attend_through_a_window(cfg: dict[str, Any], windows: list[int | None]) -> None:
    from quantkit.frontends.families import parse_config

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)  # fmt: skip
    c = parse_config({**base, **cfg}, "config.json")
    assert [c.window(i) for i in range(3)] == windows


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("level", [0, 4])
def test_moe_qmoe_kernel_equals_the_standard_op_dispatch(built: Any, kind: str, level: int, tmp_path: Path) -> None:
    """The shipped graph runs a block's 4-bit experts in one ``QMoE`` node (ONNX Runtime's CPU kernel); calibration
    runs the same packed weights as one ``MatMulNBits`` per expert (its taps).  The kernel is checked against that
    math on every block: float32 activations to float rounding, int8 activations (level 4) within their rounding."""
    import onnxruntime as ort

    from quantkit.algorithms.woq import get_weight_algorithm
    from quantkit.frontends.llm_builder import PackedLinear
    from quantkit.lowering.nbits import matmul_nbits_arrays

    b = built(kind)
    cfg = read_decoder_config(b.folder)
    ckpt = llm_builder._Checkpoint(b.folder, cfg)
    rtn = get_weight_algorithm("rtn")
    rng = np.random.default_rng(0)
    h = rng.standard_normal((1, 20, cfg.hidden_size)).astype(np.float32)
    checked = 0
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe(i):
            continue
        w = dict(ckpt.read(llm_builder.block_tensor_names(cfg, i, ckpt.__contains__)))
        p = block_prefix(cfg, i)
        packed = {}
        for s in llm_builder.linear_shapes(cfg, i):
            res = rtn(np.ascontiguousarray(np.asarray(w[f"{p}.{s}.weight"], np.float32).T), bits=4, group_size=16,
                      symmetric=s.endswith(("up_proj", "w3")), stats=None)  # mixed zero points: both layouts
            B, sc, zp, bs = matmul_nbits_arrays(res)
            packed[f"{p}.{s}"] = PackedLinear(B, sc, zp, 4, bs, *res.shape, None, level)
        fused = block_model(cfg, i, w, packed, positions=20)
        assert [nd.op_type for nd in fused.graph.node].count("QMoE") == 1
        dead = {"NonZero", "ConstantOfShape"} | ({"TopK"} if cfg.moe_routing == "softmax" else set())  # (DeepSeek-
        assert not dead & {nd.op_type for nd in fused.graph.node}  # style routing's own TopKs choose): no dead dispatch
        tap = f"{p}.{llm_builder.expert_linears(cfg)[-1][0]}"
        plain = block_model(cfg, i, w, packed, [tap], positions=20)
        assert "QMoE" not in [nd.op_type for nd in plain.graph.node]
        empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
        feed = {"hidden": h, "attention_mask": np.ones((1, 20), np.int64), f"past_key_values.{i}.key": empty,
                f"past_key_values.{i}.value": empty}  # fmt: skip
        got, want = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            ["hidden_out"], feed)[0] for m in (fused, plain))  # fmt: skip
        delta = h - want  # the block's own contribution
        err = float(np.abs(got - want).max()) / float(np.abs(delta).max())
        assert err < (1e-5 if level == 0 else 0.05), err
        checked += 1
    assert checked


def test_moe_calibration_stages_and_memory_sizes(built: Any) -> None:
    """A mixture-of-experts block is calibrated in four stages (attention input, o_proj, every expert's gate / up,
    every expert's down: one block run each), a dense block of the same decoder in one stage per input; the memory
    estimate counts the experts from the safetensors headers."""
    from quantkit.memory import decoder_sizes

    b = built("qwen2_moe")
    cfg = read_decoder_config(b.folder)
    moe, dense = llm_builder.input_stages(cfg, 0), llm_builder.input_stages(cfg, 1)
    assert [len(st) for st in moe] == [1, 1, 5, 5]  # the shared expert and 4 routed ones
    assert moe[2][0] == ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
    assert moe[3][-1] == ("mlp.experts.3.down_proj",)
    assert dense == (((("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),), (("self_attn.o_proj",),),
                     (("mlp.gate_proj", "mlp.up_proj"),), (("mlp.down_proj",),))  # fmt: skip
    assert decoder_sizes(b.folder).experts == 4
    assert decoder_sizes(built("qwen3").folder).experts == 0
    # experts stored together ([experts, N, K]): every expert's linears counted
    g = decoder_sizes(built("granitemoe").folder)
    assert g.experts == 4 and sorted(set(g.block_shapes)) == [(48, 64), (64, 4), (64, 32), (64, 64), (64, 96)]
    assert g.block_shapes.count((64, 96)) == 4 and g.block_shapes.count((48, 64)) == 4
    with pytest.raises(ValueError, match="pass the block index"):
        llm_builder.linear_shapes(cfg)


@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe"])
def test_moe_int4_qmoe_kv_cache_decode_equals_recomputation(built: Any, kind: str, tmp_path: Path) -> None:
    """The shipped INT4 mixture (QMoE, float32 activations) decodes with the KV cache one token at a time - the kernel
    routing a single row - exactly as the whole sequence recomputed."""
    import onnx

    from quantkit.layerwise import quantize_llm_layerwise

    b = built(kind)
    plan = _plan(b.folder, algorithm="rtn", group_size=16)  # experts 48 wide: QMoE blocks must divide K
    res = quantize_llm_layerwise(b.folder, tmp_path / "q" / "model.onnx", plan, None,
                                 work_dir=tmp_path / "w", accuracy_level=0, progress=False)  # fmt: skip
    assert "QMoE" in [nd.op_type for nd in onnx.load(str(res.path), load_external_data=False).graph.node]
    prompt = _ids(PROMPT, 2)
    steps, tokens, seq = _greedy_with_cache(res.path, prompt)
    full = LLMSession(res.path)(seq)[:, PROMPT - 1 :]
    np.testing.assert_allclose(np.stack(steps, 1), full, atol=1e-4, rtol=0)
    assert full.argmax(-1).tolist() == [tokens]


def test_experts_stored_together_must_match_the_config(built: Any, tmp_path: Path) -> None:
    """Granite-MoE's experts are read as slices of [experts, 2 x intermediate, H]: a config whose intermediate size
    does not fill those rows exactly (the up rows would start elsewhere) is refused naming the stored tensor."""
    import shutil

    shutil.copytree(built("granitemoe").folder, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 32}))
    with pytest.raises(ModelError, match=r"block_sparse_moe\.experts\.0\.w?\w*.*has shape \[4, 96, 64\]"):
        build_llm(tmp_path / "hf", tmp_path / "o" / "model.onnx")


def _to_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w`` ``[..., N, K]`` (K a multiple of 32) as MXFP4: blocks ``[..., N, K / 32, 16]`` (two e2m1 codes per byte,
    the low nibble first) and exponents ``[..., N, K / 32]`` biased by 127, nearest code per value (a writer of
    the format, to make a checkpoint as the Hub's gpt-oss stores its experts)."""
    grid = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    codes = np.abs(blocks[..., None] / np.exp2(exp)[..., None] - grid).argmin(-1).astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), (exp[..., 0] + 127).astype(np.uint8)


def test_gpt_oss_mxfp4_experts_are_read_as_transformers_decodes_them(built: Any, tmp_path: Path) -> None:
    """The Hub's gpt-oss checkpoints store the experts in MXFP4 (``gate_up_proj_blocks`` / ``_scales``, ``[experts, N,
    K / 32, 16]``): the decoder built from such a folder equals transformers' model with the experts decoded by
    transformers' own MXFP4 reader (``convert_moe_packed_tensors``): nibble order, exponent bias, layout."""
    import copy

    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    b = built("gpt_oss")
    folder = tmp_path / "hf"
    folder.mkdir()
    cfg = json.loads((b.folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(b.folder / "model.safetensors"))
    model = copy.deepcopy(b.model)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        kn = tensors.pop(name).astype(np.float32)  # [experts, K, N]
        blocks, scales = _to_mxfp4(np.ascontiguousarray(kn.transpose(0, 2, 1)))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        decoded = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
        assert float((decoded - torch.from_numpy(kn)).abs().max()) > 1e-3  # MXFP4 did round the weights
        with torch.no_grad():
            model.get_parameter(name).copy_(decoded)
    save_file(tensors, str(folder / "model.safetensors"))
    path = build_llm(folder, tmp_path / "o" / "model.onnx")
    ids = _ids(PROMPT + NEW, 4)
    _assert_exact(LLMSession(path)(ids), _reference(model, ids), "gpt-oss MXFP4")
    from quantkit.memory import decoder_sizes

    plain, packed = decoder_sizes(b.folder), decoder_sizes(folder)
    assert (packed.params, packed.experts, packed.max_k, packed.widest_n) == (
        plain.params, plain.experts, plain.max_k, plain.widest_n)
    assert packed.stored_bytes < plain.stored_bytes


def test_gpt_oss_experts_must_match_the_config(built: Any, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(built("gpt_oss").folder, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 32}))
    with pytest.raises(ModelError, match=r"mlp\.experts\.0\.gate_proj.*has shape \(?\[?4, 64, 128"):
        build_llm(tmp_path / "hf", tmp_path / "o" / "model.onnx")


def test_gpt_oss_published_config_is_read_as_transformers_reads_it() -> None:
    """gpt-oss-20b's config.json (transformers 4.55's): 32 experts, 4 per token, the experts' width from
    intermediate_size, alternating windowed / full layers, YaRN x32 without truncation, the clamp at 7 and the
    sigmoid slope transformers assumes when the file does not state it (1.702)."""
    from quantkit.frontends.families import parse_config

    raw = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002, "head_dim": 64,
           "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"],
                                   "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "vocab_size": 201088}  # fmt: skip
    c = parse_config(raw, "config.json")
    assert (c.family, c.num_experts, c.experts_per_token, c.moe_intermediate_size, c.norm_topk_prob) == (
        "gpt_oss", 32, 4, 2880, True)
    assert (c.activation, c.swiglu_alpha, c.swiglu_limit, c.sliding_window, c.rope_theta) == (
        "swiglu_oss", 1.702, 7.0, 128, 150000.0)
    assert c.layer_types[:2] == ("sliding_attention", "full_attention") and len(c.layer_types) == 24
    assert c.rope_scaling is not None and c.rope_scaling["factor"] == 32.0 and c.rope_scaling["truncate"] is False
    with pytest.raises(ModelError, match=r"swiglu_limit -1.*allowed: a number > 0"):
        parse_config({**raw, "swiglu_limit": -1}, "config.json")


@pytest.mark.parametrize(("group", "warned"), [(16, None), (32, "K = 48 is not a multiple of the group size (32); "
                                                             "group_size: 16 divides it")])
def test_moe_dispatch_in_the_shipped_graph_is_reported_with_why(built: Any, tmp_path: Path, group: int,
                                                               warned: str | None) -> None:
    """The experts' down_proj (K = 48 here; 2880 in gpt-oss-20b, not a multiple of 128) fit one QMoE node at group 16;
    at group 32 K is not a multiple of the group, the shipped graph dispatches per expert, and the report says so
    with a group that fits."""
    from quantkit.layerwise import moe_dispatch_warnings, quantize_llm_layerwise

    b = built("mixtral")
    plan = _plan(b.folder, algorithm="rtn", group_size=group)
    res = quantize_llm_layerwise(b.folder, tmp_path / "q" / "model.onnx", plan, None, work_dir=tmp_path / "w",
                                 progress=False)  # fmt: skip
    got = moe_dispatch_warnings(res.path, res.rows)
    if warned is None:
        assert got == []
    else:
        assert len(got) == 1 and "2 mixture-of-experts block(s)" in got[0] and warned in got[0], got


def test_phimoe_longrope_scales_are_the_checkpoints_own(tmp_path: Path) -> None:
    """Phi-3.5-MoE's LongRoPE scales cos / sin by the config's ``short_mscale`` / ``long_mscale``.  Within the original
    context the decoder equals transformers; past it the checkpoint's own code (and transformers 4.x) switch to the
    long factors, while transformers 5.25's Phimoe keeps the short ones (it builds the frequencies without the sequence
    length): the reference there is transformers with the long factors put in the short ones' place."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)], "short_mscale": 1.1, "long_mscale": 1.3,
            "original_max_position_embeddings": 16}  # fmt: skip
    cfg = transformers.PhimoeConfig(**{**_COMMON, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
                                    rope_parameters=rope)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.PhimoeForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    model = transformers.PhimoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    path = build_llm(tmp_path / "hf", tmp_path / "o" / "model.onnx")
    short = _ids(12, 1)
    _assert_exact(LLMSession(path)(short), _reference(model, short), "phimoe longrope (short)")
    long = _ids(24, 2)
    model.config.rope_parameters["short_factor"] = rope["long_factor"]
    _assert_exact(LLMSession(path)(long), _reference(model, long), "phimoe longrope (long)")
