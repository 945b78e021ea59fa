"""Decoder families of the streaming builder, each a small declarative description.

:mod:`quantkit.frontends.llm_builder` writes one decoder graph for every family: embedding, a stack of
blocks (norm, attention through ``GroupQueryAttention``, norm, MLP, residual adds), a final norm and the
lm_head.  What differs between LLaMA, Qwen3, Gemma, Phi-2, GPT-NeoX or OLMo-2 is described here, as data:

* :class:`Family` - the norm kind (RMSNorm, Gemma's RMSNorm with ``1 + weight``, LayerNorm with a bias),
  the MLP (gated ``act(gate) * up`` or plain ``act(fc)``), how the activation is named in ``config.json``,
  the positions (rotary - halves or adjacent pairs, full or partial -, or a learned absolute table), the attention
  extras (q/k RMSNorm per head or over the whole projection, soft-capping, the query scale, sliding-window
  layers, layers without RoPE), norms after attention and MLP (Gemma 2, with or without norms before them:
  OLMo-2), parallel attention + MLP blocks (Phi-2, GPT-NeoX), the embedding scale and Granite's multipliers, the
  ``config.json`` key aliases (GPT-2's ``n_embd`` ...) and the tensor names (:class:`Names`: packed ``qkv`` /
  ``gate_up`` weights as Phi-3 stores them, GPT-NeoX's per-head interleaved ``qkv``, GPT-2's ``Conv1D`` weights
  stored ``[K, N]``);
* :class:`DecoderConfig` - one checkpoint's values, read and checked by :func:`parse_config` before anything
  is tokenized, allocated or computed: an unknown ``model_type`` or a value the builder cannot honour is a
  :class:`~quantkit.errors.ModelError` naming it, what is allowed, and what to try instead.

Graph node names are the Hugging Face module names of the family (``model.layers.3.self_attn.qkv_proj`` for
Phi-3, ``transformer.h.3.mlp.c_fc`` for GPT-2), as the whole-graph path names them, so recipes address a
layer the same way on both paths.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import ModelError
from quantkit.frontends.checkpoint import check_config_values

__all__ = [
    "FAMILIES",
    "DecoderConfig",
    "Family",
    "Names",
    "ROTARY_CACHE_POSITIONS",
    "TEXT_TOWERS",
    "family_of",
    "parse_config",
    "read_config",
    "is_multimodal",
    "supported_model_types",
    "text_tensor_name",
]

ROTARY_CACHE_POSITIONS = 1 << 17
"""The most positions a built decoder's rotary (cos / sin) caches hold: its context is
``min(max_position_embeddings, ROTARY_CACHE_POSITIONS)`` (131072, Llama 3.1's; 64 MiB of caches at head_dim 128)."""

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Names:
    """Tensor / module names of a family, relative to the model (``layers``) or to a block (the rest).

    A role that the family does not have is ``None``.  ``qkv`` (one packed ``[q | k | v]`` weight) replaces
    ``q`` / ``k`` / ``v``; ``gate_up`` (packed ``[gate | up]``) replaces ``gate`` / ``up``; a plain MLP has
    ``up`` (its first linear) and ``down`` only."""

    embed: str = "model.embed_tokens"
    embed_norm: str | None = None
    """A norm (the family's kind) of the embedding rows before block 0 (BLOOM's ``word_embeddings_layernorm``;
    nanochat's weightless RMSNorm, its final norm used twice)."""
    positions: str | None = None
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    attn_norm: str | None = "input_layernorm"
    """None: attention reads the residual stream itself (OLMo-2 normalizes only the block's outputs)."""
    attn_post_norm: str | None = None
    mlp_norm: str | None = "post_attention_layernorm"
    """None: the MLP reads the attention's input norm (Phi-2's parallel block has one norm), or, in a sequential
    block, the residual stream itself (OLMo-2)."""
    mlp_post_norm: str | None = None
    q: str | None = "self_attn.q_proj"
    k: str | None = "self_attn.k_proj"
    v: str | None = "self_attn.v_proj"
    qkv: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None
    sinks: str | None = None
    """A per-head learned logit that joins every softmax's denominator (Granite SWA's ``self_attn.sinks``), as
    GroupQueryAttention's ``head_sink``."""
    qk_norm_whole: bool = False
    """q / k norms over the whole projection (``[heads * head_dim]`` weights, OLMo-2) instead of per head."""
    o: str = "self_attn.o_proj"
    gate: str | None = "mlp.gate_proj"
    up: str | None = "mlp.up_proj"
    gate_up: str | None = None
    down: str = "mlp.down_proj"
    act: str = "mlp.act_fn"
    qkv_per_head: bool = False
    """The packed ``qkv`` weight interleaves per head (``[q_0 k_0 v_0 q_1 k_1 v_1 ...]``: GPT-NeoX, BLOOM; with fewer
    key / value heads, per group ``[q_0 .. q_r-1 k_0 v_0 ...]``); its rows are reordered to ``[q | k | v]`` as they are
    read.  A multi-query checkpoint (:attr:`Family.multi_query_key`) stores ``[q | k | v]`` itself."""
    stored_aliases: tuple[tuple[str, str], ...] = ()
    """``(graph name, stored name)`` of tensors that older checkpoints store under another name (GPT-NeoX's
    ``embed_out.weight`` for ``lm_head.weight``)."""
    stored_renames: tuple[tuple[str, str], ...] = ()
    """``(stored pattern, graph replacement)`` regular-expression renames applied in order to every stored tensor name
    (EXAONE 3's ``transformer.h.0.attn.attention.q_proj`` is LLaMA's ``model.layers.0.self_attn.q_proj``): a
    checkpoint may carry either name."""
    qkv_mp: int = 0
    """The packed ``qkv`` weight is ``mp`` shards of ``[q | v | k]`` (CodeGen: 4); its rows are reordered to
    ``[q | k | v]`` as they are read."""
    stored_prefix: str = ""
    """A prefix that checkpoints may lack (GPT-2 on the Hub stores ``h.0.attn...``, ``save_pretrained`` of
    ``GPT2LMHeadModel`` ``transformer.h.0.attn...``): such a tensor is read under the shorter name."""
    router: str | None = None
    """A mixture-of-experts block's router: a linear ``[experts, H]`` giving every token its expert logits (kept in
    float32: it decides which experts run)."""
    experts: str | None = None
    """The experts of a mixture-of-experts block: expert ``e``'s linears are ``<experts>.<e>.<role>`` for the roles of
    :attr:`expert_roles`."""
    expert_roles: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """An expert's ``gate``, ``up`` and ``down`` linears (Mixtral: ``w1``, ``w3``, ``w2``)."""
    expert_store: tuple[str, str] | None = None
    """Experts stored as two ``[experts, N, K]`` tensors (suffixes after the block): ``gate`` and ``up`` rows in the
    first (``[gate | up]`` per expert), ``down`` in the second (Granite-MoE's ``input_linear`` / ``output_linear``);
    each expert's linears are read as slices under their graph names.  None: one tensor per expert linear."""
    expert_layout: str = "rows"
    """How :attr:`expert_store` holds the experts: ``rows`` - ``[experts, N, K]``, ``[gate | up]`` rows (Granite-MoE);
    ``oss`` - transformers' transposed experts ``[experts, K, N]`` with gate and up *columns* interleaved (gate 0,
    up 0, gate 1, ...) and their biases beside them (``<store>_bias``), or the same experts in MXFP4
    (``<store>_blocks`` ``[experts, N, K / 32, 16]`` bytes of two 4-bit e2m1 codes, the low nibble first, and
    ``<store>_scales`` ``[experts, N, K / 32]`` power-of-two exponents biased by 127; N = rows, interleaved the same
    way): gpt-oss."""
    shared_expert: str | None = None
    """An expert every token runs (Qwen2-MoE's ``mlp.shared_expert``: ``gate_proj`` / ``up_proj`` / ``down_proj``)."""
    shared_expert_fused: tuple[str, str] | None = None
    """The shared expert stored as two linears (suffixes after the block): ``[gate | up]`` rows ``[2 S, H]`` and down
    ``[H, S]`` (Granite-MoE-Shared's ``shared_mlp.input_linear`` / ``output_linear``), read as
    :attr:`shared_expert`'s ``gate_proj`` / ``up_proj`` / ``down_proj``."""
    router_choice_bias: str | None = None
    """A bias added to the router's sigmoid scores for choosing the experts only (DeepSeek-V3 / GLM-4.5's
    ``mlp.gate.e_score_correction_bias``; the weights are the scores without it)."""
    shared_expert_gate: str | None = None
    """A linear ``[1, H]`` whose sigmoid scales the shared expert's output per token (kept in float32)."""


@dataclass(frozen=True)
class Family:
    """What sets one decoder family apart (see the module docstring); the graph is built from this alone."""

    name: str
    model_types: tuple[str, ...]
    title: str
    names: Names = Names()
    norm: str = "rms"
    """``rms`` (``x / rms(x) * w``), ``rms_offset`` (Gemma: ``x / rms(x) * (1 + w)``) or ``layer`` (LayerNorm
    with weight and bias)."""
    gamma_offset: bool = False
    """A LayerNorm that multiplies by ``1 + weight`` (Nemotron's ``LayerNorm1P``)."""
    mlp: str = "gated"
    """``gated``: ``down(act(gate(x)) * up(x))``; ``plain``: ``down(act(up(x)))``."""
    act_keys: tuple[str, ...] = ("hidden_act",)
    act_default: str = "silu"
    act_remap: tuple[tuple[str, str], ...] = ()
    """Activation names the family's transformers code reads differently (Gemma: ``gelu`` is the tanh one)."""
    rotary: bool = True
    """False: learned absolute positions (``names.positions``) or ALiBi, no rotary embedding."""
    position_offset: int = 0
    """Rows of the learned position table before position 0 (OPT's table starts at row 2)."""
    alibi: str = ""
    """ALiBi: every head adds ``slope_h * key_position`` to its attention scores, as GroupQueryAttention's
    ``attention_bias``: ``bloom`` (float32), ``falcon`` (the slope and the product rounded to bfloat16, then divided
    by ``sqrt(head_dim)``, as transformers' Falcon computes it)."""
    multi_query_key: str = ""
    """A boolean config key for one key / value head shared by all (GPT-BigCode's, Falcon-7B's ``multi_query``)."""
    when: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    """For a ``model_type`` with several variants (Falcon): ``(key, values)`` that config.json must match (an absent
    key reads as its :attr:`defaults` value, else None) for this variant to be chosen; the first match wins."""
    rotary_interleaved: bool = False
    """RoPE rotates adjacent pairs ``(x0, x1), (x2, x3) ...`` instead of the two halves (Helium)."""
    qk_norm_after_rope: bool = False
    """The q / k norms apply to the rotated q and k (Hunyuan): the rotary embedding runs before the attention
    (:attr:`DecoderConfig.external_rotary`)."""
    ntk_alpha: bool = False
    """``rope_scaling`` ``dynamic`` with an ``alpha`` is a static NTK base stretch, ``theta * alpha ** (d / (d - 2))``
    (Hunyuan's checkpoints label it so)."""
    rotary_dim_key: str = ""
    """A config key giving the rotary dimension itself (GPT-J's ``rotary_dim``; null: the whole head), read as
    ``partial_rotary_factor = rotary_dim / head_dim``."""
    default_rope_partial: bool = False
    """The family's default RoPE honours ``partial_rotary_factor`` (Phi-3); elsewhere only the scaled RoPE types do."""
    embed_scale: bool = False
    """Embedding rows multiplied by ``sqrt(hidden_size)`` (Gemma)."""
    embed_scale_key: str = ""
    """A boolean config key switching :attr:`embed_scale` on (BioGPT's, XGLM's ``scale_embedding``; default true)."""
    sinusoidal: bool = False
    """The position table (``names.positions``) is not stored but computed: sines then cosines of the position times
    ``10000 ** (-i / (H / 2 - 1))`` (XGLM)."""
    rope_sign_flip: bool = False
    """RoPE rotates by ``-theta`` (nanochat's ``rotate_half`` is ``[x2, -x1]``): the two halves of every q and k head
    are swapped as the weights are read, which is the same attention (q and k permuted alike; nanochat's q / k norms
    have no weights)."""
    unscaled_attention: bool = False
    """Attention scores are not scaled by ``head_dim ** -0.5`` (GPT-Neo)."""
    conv1d: bool = False
    """Linear weights stored ``[in, out]`` (GPT-2's ``Conv1D``), transposed as they are read."""
    query_pre_attn_scalar: bool = False
    """Attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5`` (Gemma 2 / 3)."""
    softcap: bool = False
    """``attn_logit_softcapping`` / ``final_logit_softcapping`` are read (Gemma 2 / 3)."""
    windows: str = "none"
    """Which layers attend through a sliding window: ``none``; ``all`` (``sliding_window`` on every layer:
    Mistral, Phi-3); ``layer_types`` (``config.layer_types``, or the family's default pattern)."""
    window_rule: str = ""
    """For ``windows="layer_types"`` without ``layer_types`` in config.json, which layers are windowed: ``every-2`` /
    ``every-6`` (all but every n-th: Gemma 2 / 3), ``all`` (every layer when ``sliding_window`` is set: Ministral),
    ``qwen`` (from ``max_window_layers`` on, and only with
    ``use_sliding_window``, as Qwen2 / Qwen3), ``nope`` (the layers without RoPE, with ``use_sliding_window``:
    SmolLM3), ``pattern`` (every ``sliding_window_pattern``-th layer full: EXAONE 4)."""
    rope_sliding_only: str = ""
    """Only the sliding layers apply RoPE, the full ones none: ``windowed`` when ``sliding_window`` is set (without
    one every layer is full and rotated: EXAONE 4); ``always`` (without a window no layer is rotated: Cohere 2)."""
    norm_bias: bool = True
    """A LayerNorm family's norms have a bias (False: Cohere's LayerNorm, weight only)."""
    norm_free: bool = False
    """The norms have no parameters at all (OLMo 1's LayerNorm, nanochat's RMSNorm, q / k norms included): the
    checkpoint stores none, the graph's weights are ones."""
    clip_qkv: bool = False
    """``clip_qkv`` is read: q, k and v are clamped to ``[-clip_qkv, clip_qkv]`` after their projections (OLMo 1)."""
    logit_scale: bool = False
    """The logits are multiplied by ``logit_scale`` (Cohere)."""
    layer_theta_key: str = ""
    """A config key listing each layer's RoPE base, 0 for a layer without RoPE (Granite SWA's ``layer_rope_theta``);
    every non-zero base must be the same."""
    nope_layers: bool = False
    """``no_rope_layers`` (or every ``no_rope_layer_interval``-th layer) attend without a rotary embedding (SmolLM3)."""
    per_type_rope: bool = False
    """RoPE parameters per layer type (Gemma 3: ``rope_local_base_freq`` for the sliding layers)."""
    local_rope_key: bool = True
    """Without per-type RoPE parameters, the sliding layers' theta is ``rope_local_base_freq`` (Gemma 3; default
    1e4); False: the full layers' (OLMo-3)."""
    tie_default: bool = False
    config_aliases: tuple[tuple[str, str], ...] = ()
    """``(builder key, this family's config.json key)``: GPT-2's ``n_embd`` is the ``hidden_size``."""
    refuse_true: tuple[str, ...] = ()
    """Boolean config keys the builder cannot honour when true (GPT-2's ``add_cross_attention``)."""
    require: tuple[tuple[str, Any], ...] = ()
    """``(key, value)``: config keys the builder honours only at this value, when present (OPT-350m's post-norm
    ``do_layer_norm_before: false``)."""
    equal_hidden: tuple[str, ...] = ()
    """Config keys that must equal ``hidden_size`` when set (OPT-350m's ``word_embed_proj_dim``: a projection after
    the embedding that the builder does not write)."""
    defaults: tuple[tuple[str, Any], ...] = ()
    """Values of the family's transformers config class for keys a config.json may omit (a key present with
    ``null`` stays null), where they differ from the builder's generic defaults."""
    intermediate_default: int = 0
    """``intermediate_size`` as a multiple of ``hidden_size`` when config.json has none (GPT-2's ``n_inner``: 4)."""
    parallel: str = "never"
    """Whether attention and MLP read the same stream and add to it together (``x + attn(n1(x)) + mlp(n2(x))``):
    ``never``; ``always`` (Phi-2); ``config`` (as ``use_parallel_residual`` says, :attr:`parallel_default` when it
    is absent: StableLM, GPT-NeoX)."""
    parallel_default: bool = False
    parallel_key: str = "use_parallel_residual"
    """The config key of ``parallel="config"`` (Falcon: ``parallel_attn``)."""
    parallel_shared_norm: bool = True
    """In a parallel block the MLP reads the attention's input norm (Phi-2, StableLM; ``names.mlp_norm`` is then
    not in the checkpoint); False: its own norm of the block input (GPT-NeoX)."""
    scale_key: str = ""
    """A config key giving the attention scale itself when set (MPT's ``attn_config.softmax_scale``; null: the
    default)."""
    logits_multiply: bool = False
    """With :attr:`multipliers`: the logits are multiplied by ``logits_scaling`` (HyperCLOVA X), not divided."""
    multipliers: bool = False
    """Granite's scalars are read: ``embedding_multiplier`` (the embedding rows), ``residual_multiplier`` (attention
    and MLP outputs before each residual add), ``attention_multiplier`` (the attention scale, instead of
    ``head_dim ** -0.5``) and ``logits_scaling`` (the logits are divided by it)."""
    moe: bool = False
    """Mixture-of-experts blocks (:attr:`Names.router`, :attr:`Names.experts`): the router's softmax over the experts,
    the ``experts_per_token`` largest probabilities (renormalized to sum to 1 when :attr:`DecoderConfig.norm_topk_prob`)
    weight the outputs of those experts, each a gated MLP."""
    moe_norm_key: str = "norm_topk_prob"
    """The config key saying whether the top-k routing weights are renormalized; empty: always (Mixtral)."""
    moe_inter_key: str = "moe_intermediate_size"
    """The config key of an expert's intermediate size; empty: ``intermediate_size`` (Mixtral)."""
    moe_sparse_layers: bool = False
    """Only some layers are mixture-of-experts (Qwen-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``); the others
    have a dense MLP of ``intermediate_size``."""
    moe_routing: str = "softmax"
    """``softmax``: the top-k of the router's softmax; ``softmax_biased`` (ERNIE 4.5): the softmax plus
    :attr:`Names.router_choice_bias` chooses the top-k, their softmax probabilities renormalized weight them;
    ``sparsemixer`` (Phi-3.5-MoE, top-2): the best and then the second-best logit, each weighted by the softmax
    over the logits within ``2 * router_jitter_noise`` (relative) of it;
    ``sigmoid_grouped`` (DeepSeek-V3, GLM-4.5): each expert's sigmoid score plus :attr:`Names.router_choice_bias` chooses, within the ``topk_group`` of ``n_group`` expert groups
    whose two best choices sum highest, the top-k experts; their scores (without the bias), renormalized when
    ``norm_topk_prob``, times ``routed_scaling_factor``, weight them."""
    rope_mscale_keys: bool = False
    """LongRoPE's cos / sin scale from the config's ``short_mscale`` / ``long_mscale`` (Phi-3.5-MoE) instead of the
    ``sqrt(1 + log(factor) / log(original))`` transformers computes for Phi-3."""
    moe_dense_first_key: str = ""
    """The config key of how many first layers have a dense MLP (GLM-4.5's ``first_k_dense_replace``)."""
    moe_shared_key: str = "shared_expert_intermediate_size"
    """The config key of the shared expert's width; a key ending in ``shared_experts`` (``n_shared_experts``,
    ``moe_num_shared_experts``): that many experts' width (0: none)."""
    moe_ernie_layers: bool = False
    """Mixture-of-experts layers by ERNIE 4.5's keys: ``(i + 1) % moe_layer_interval == 0`` and
    ``moe_layer_start_index <= i <= moe_layer_end_index``; the others dense."""
    genai_type: str = ""

    @property
    def packed_qkv(self) -> bool:
        return self.names.qkv is not None

    @property
    def packed_gate_up(self) -> bool:
        return self.names.gate_up is not None

    @property
    def qk_norm(self) -> bool:
        return self.names.q_norm is not None

    @property
    def sandwich(self) -> bool:
        return self.names.attn_post_norm is not None

    @property
    def rotation_refusal(self) -> str | None:
        """Why the residual stream cannot carry an orthogonal rotation folded into the weights
        (:mod:`quantkit.algorithms.rotation`), or None when it can: only pre-norm RMSNorms (with or without Gemma's
        offset), linears and additions may touch it."""
        if self.norm == "layer":
            return "its norms are LayerNorms, whose mean subtraction does not commute with a rotation"
        if self.sandwich or self.names.mlp_post_norm is not None:
            return ("it normalizes the attention and MLP outputs before the residual add (their gammas cannot be "
                    "moved across a rotation)")  # fmt: skip
        if self.names.positions is not None:
            return "it adds a learned position table to the stream"
        if self.names.embed_norm is not None and (self.norm == "layer" or not self.norm_free):
            return "it normalizes the embedding rows with a weighted norm"
        if self.parallel != "never":
            return "its attention and MLP read the block input in parallel (not handled by the rotation)"
        if self.moe:
            return "its mixture-of-experts blocks (a router beside the experts) are not handled by the rotation"
        return None

    @property
    def rotation_invariant(self) -> bool:
        """The residual stream can be rotated exactly (see :attr:`rotation_refusal`)."""
        return self.rotation_refusal is None


_GEMMA2_NAMES = Names(attn_post_norm="post_attention_layernorm", mlp_norm="pre_feedforward_layernorm",
                      mlp_post_norm="post_feedforward_layernorm")  # fmt: skip

_OLMO_NAMES = Names(attn_norm=None, attn_post_norm="post_attention_layernorm", mlp_norm=None,
                    mlp_post_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                    qk_norm_whole=True)  # fmt: skip
"""Norms after attention and MLP only, q / k norms over the whole projection (OLMo-2 / 3; EXAONE 4 per head)."""

_GPT_ALIASES = (("hidden_size", "n_embd"), ("num_attention_heads", "n_head"), ("num_hidden_layers", "n_layer"),
                ("max_position_embeddings", "n_positions"), ("intermediate_size", "n_inner"),
                ("rms_norm_eps", "layer_norm_epsilon"))
"""GPT-2's config keys (GPT-2, GPT-J, CodeGen, GPT-BigCode)."""
_GPTJ_NAMES = Names(embed="transformer.wte", layers="transformer.h", final_norm="transformer.ln_f", attn_norm="ln_1",
                    mlp_norm=None, q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", o="attn.out_proj", gate=None,
                    up="mlp.fc_in", down="mlp.fc_out", act="mlp.act")  # fmt: skip
_GLM4_MOE_NAMES: dict[str, Any] = dict(router="mlp.gate", experts="mlp.experts", shared_expert="mlp.shared_experts",
                                        router_choice_bias="mlp.gate.e_score_correction_bias")
_DEEPSEEK_MOE: dict[str, Any] = dict(moe=True, moe_routing="sigmoid_grouped", moe_dense_first_key="first_k_dense_replace",
                                     moe_shared_key="n_shared_experts", genai_type="decoder")  # fmt: skip
"""DeepSeek-V3's mixture of experts (GLM-4.5, dots.llm1): grouped sigmoid routing, shared experts, dense first layers."""
_GLM4_MOE: dict[str, Any] = dict(**_DEEPSEEK_MOE, default_rope_partial=True,
                                 defaults=(("rms_norm_eps", 1e-5), ("partial_rotary_factor", 0.5)))
_GPTJ: dict[str, Any] = dict(norm="layer", mlp="plain", act_keys=("activation_function",), act_default="gelu_new",
                             rotary_interleaved=True, rotary_dim_key="rotary_dim", default_rope_partial=True,
                             parallel="always", config_aliases=_GPT_ALIASES,
                             defaults=(("n_positions", 2048), ("layer_norm_epsilon", 1e-5), ("rotary_dim", 64)),
                             intermediate_default=4, genai_type="decoder")  # fmt: skip
"""GPT-J's block (one LayerNorm read in parallel, RoPE on adjacent pairs of the first ``rotary_dim``): GPT-J, CodeGen."""
_FALCON_NAMES = Names(embed="transformer.word_embeddings", layers="transformer.h", final_norm="transformer.ln_f",
                      mlp_norm="post_attention_layernorm", q=None, k=None, v=None,
                      qkv="self_attention.query_key_value", o="self_attention.dense", gate=None,
                      up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", act="mlp.act", qkv_per_head=True)  # fmt: skip
"""Falcon's names; its packed qkv per key / value group (``[q_0 .. q_r-1 k v]``; per head ``[q k v]`` without
multi-query; ``[q | k | v]`` with one key / value head, the same reorder)."""
_FALCON: dict[str, Any] = dict(norm="layer", mlp="plain", act_keys=("activation",), act_default="gelu",
                               tie_default=True, intermediate_default=4,
                               defaults=(("layer_norm_epsilon", 1e-5), ("new_decoder_architecture", False),
                                         ("alibi", False), ("multi_query", True)),
                               genai_type="decoder")  # fmt: skip
_FALCON_ALIASES = (("rms_norm_eps", "layer_norm_epsilon"), ("intermediate_size", "ffn_hidden_size"),
                   ("hidden_size", "n_embed"), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"))

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama", "smollm", "smollm2"), "LLaMA / SmolLM", genai_type="llama"),
    Family("mistral", ("mistral",), "Mistral", windows="all", defaults=(("sliding_window", 4096),),
           genai_type="mistral"),
    Family("ministral", ("ministral",), "Ministral", windows="layer_types", window_rule="all",
           defaults=(("sliding_window", 4096),), genai_type="mistral"),
    Family("qwen2", ("qwen2",), "Qwen2 / Qwen2.5", windows="layer_types", window_rule="qwen", genai_type="qwen2"),
    Family("qwen3", ("qwen3",), "Qwen3", names=Names(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
           windows="layer_types", window_rule="qwen", genai_type="qwen3"),
    Family("smollm3", ("smollm3",), "SmolLM3", windows="layer_types", window_rule="nope", nope_layers=True,
           tie_default=True, genai_type="smollm3"),
    Family("gemma", ("gemma",), "Gemma", norm="rms_offset", act_default="gelu_pytorch_tanh",
           act_remap=(("gelu", "gelu_pytorch_tanh"),), embed_scale=True, tie_default=True,
           defaults=(("head_dim", 256),), genai_type="gemma"),
    Family("gemma2", ("gemma2",), "Gemma 2", names=_GEMMA2_NAMES, norm="rms_offset",
           act_keys=("hidden_activation",), act_default="gelu_pytorch_tanh", embed_scale=True,
           query_pre_attn_scalar=True, softcap=True, windows="layer_types", window_rule="every-2", tie_default=True,
           defaults=(("head_dim", 256), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
                     ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)),
           genai_type="gemma2"),
    Family("gemma3_text", ("gemma3_text",), "Gemma 3 (text)",
           names=Names(attn_post_norm="post_attention_layernorm", mlp_norm="pre_feedforward_layernorm",
                       mlp_post_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm",
                       k_norm="self_attn.k_norm"),
           norm="rms_offset", act_keys=("hidden_activation",), act_default="gelu_pytorch_tanh", embed_scale=True,
           query_pre_attn_scalar=True, softcap=True, windows="layer_types", window_rule="every-6", per_type_rope=True,
           tie_default=True, refuse_true=("use_bidirectional_attention",),
           defaults=(("head_dim", 256), ("query_pre_attn_scalar", 256), ("sliding_window", 4096)),
           genai_type="gemma3_text"),
    Family("phi3", ("phi3",), "Phi-3 / Phi-3.5 / Phi-4 (mini)",
           names=Names(q=None, k=None, v=None, qkv="self_attn.qkv_proj", gate=None, up=None,
                       gate_up="mlp.gate_up_proj"),
           default_rope_partial=True, windows="all", defaults=(("rms_norm_eps", 1e-5),), genai_type="phi3"),
    Family("gpt2", ("gpt2",), "GPT-2",
           names=Names(embed="transformer.wte", positions="transformer.wpe", layers="transformer.h",
                       final_norm="transformer.ln_f", attn_norm="ln_1", mlp_norm="ln_2", q=None, k=None, v=None,
                       qkv="attn.c_attn", o="attn.c_proj", gate=None, up="mlp.c_fc", down="mlp.c_proj",
                       act="mlp.act", stored_prefix="transformer."),
           norm="layer", mlp="plain", act_keys=("activation_function",), act_default="gelu_new", rotary=False,
           conv1d=True, tie_default=True,
           config_aliases=_GPT_ALIASES,
           refuse_true=("add_cross_attention",), defaults=(("n_positions", 1024), ("layer_norm_epsilon", 1e-5)),
           intermediate_default=4, genai_type="gpt2"),
    Family("granite", ("granite",), "Granite (3.x dense)", multipliers=True, genai_type="granite"),
    Family("phi", ("phi",), "Phi-1 / Phi-1.5 / Phi-2",
           names=Names(final_norm="model.final_layernorm", mlp_norm=None, o="self_attn.dense", gate=None,
                       up="mlp.fc1", down="mlp.fc2", act="mlp.activation_fn"),
           norm="layer", mlp="plain", act_default="gelu_new", default_rope_partial=True, parallel="always",
           config_aliases=(("rms_norm_eps", "layer_norm_eps"),), refuse_true=("qk_layernorm",),
           defaults=(("partial_rotary_factor", 0.5), ("layer_norm_eps", 1e-5)), genai_type="phi"),
    Family("gpt_neox", ("gpt_neox",), "GPT-NeoX / Pythia",
           names=Names(embed="gpt_neox.embed_in", layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
                       q=None, k=None, v=None, qkv="attention.query_key_value", o="attention.dense", gate=None,
                       up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", act="mlp.act", qkv_per_head=True,
                       stored_aliases=(("lm_head.weight", "embed_out.weight"),)),
           norm="layer", mlp="plain", act_default="gelu", default_rope_partial=True, parallel="config",
           parallel_default=True, parallel_shared_norm=False,
           config_aliases=(("rms_norm_eps", "layer_norm_eps"), ("rope_theta", "rotary_emb_base"),
                           ("partial_rotary_factor", "rotary_pct")),
           defaults=(("partial_rotary_factor", 0.25), ("layer_norm_eps", 1e-5)), genai_type="decoder"),
    Family("olmo", ("olmo",), "OLMo (1)", norm="layer", norm_bias=False, norm_free=True, clip_qkv=True,
           defaults=(("rms_norm_eps", 1e-5),), genai_type="decoder"),
    Family("mixtral", ("mixtral",), "Mixtral (mixture of experts)",
           names=Names(router="block_sparse_moe.gate", experts="block_sparse_moe.experts",
                       expert_roles=("w1", "w3", "w2")),
           windows="all", moe=True, moe_norm_key="", moe_inter_key="", genai_type="decoder"),
    Family("granitemoe", ("granitemoe",), "Granite-MoE (3.x)",
           names=Names(router="block_sparse_moe.router.layer", experts="block_sparse_moe.experts",
                       expert_store=("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")),
           multipliers=True, moe=True, moe_norm_key="", moe_inter_key="", genai_type="decoder"),
    Family("granitemoeshared", ("granitemoeshared",), "Granite-MoE with a shared MLP",
           names=Names(router="block_sparse_moe.router.layer", experts="block_sparse_moe.experts",
                       expert_store=("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight"),
                       shared_expert="shared_mlp",
                       shared_expert_fused=("shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight")),
           multipliers=True, moe=True, moe_norm_key="", moe_inter_key="", moe_shared_key="shared_intermediate_size",
           genai_type="decoder"),
    Family("qwen2_moe", ("qwen2_moe",), "Qwen1.5-MoE / Qwen2-MoE",
           names=Names(router="mlp.gate", experts="mlp.experts", shared_expert="mlp.shared_expert",
                       shared_expert_gate="mlp.shared_expert_gate"),
           windows="layer_types", window_rule="qwen", moe=True, moe_sparse_layers=True, genai_type="decoder"),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3-MoE",
           names=Names(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", router="mlp.gate", experts="mlp.experts"),
           windows="layer_types", window_rule="qwen", moe=True, moe_sparse_layers=True, genai_type="decoder"),
    Family("qwen3_vl_moe", ("qwen3_vl_moe_text",), "Qwen3-VL-MoE (its text decoder)",
           names=Names(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", router="mlp.gate", experts="mlp.experts",
                       expert_store=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
           windows="layer_types", window_rule="qwen", moe=True, moe_norm_key="", moe_sparse_layers=True,
           genai_type="decoder"),
    Family("olmoe", ("olmoe",), "OLMoE",
           names=Names(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_whole=True, router="mlp.gate",
                       experts="mlp.experts"),
           clip_qkv=True, moe=True, moe_inter_key="", defaults=(("rms_norm_eps", 1e-5),), genai_type="decoder"),
    Family("glm4_moe_qk", ("glm4_moe",), "GLM-4.5 (mixture of experts; q / k norms)",
           names=Names(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", **_GLM4_MOE_NAMES),
           when=(("use_qk_norm", (True,)),), **_GLM4_MOE),
    Family("glm4_moe", ("glm4_moe",), "GLM-4.5-Air (mixture of experts)", names=Names(**_GLM4_MOE_NAMES),
           when=(("use_qk_norm", (False, None)),), **_GLM4_MOE),
    Family("dots1", ("dots1",), "dots.llm1 (mixture of experts)",
           names=Names(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", **_GLM4_MOE_NAMES),
           windows="layer_types", window_rule="qwen", **_DEEPSEEK_MOE),
    Family("phimoe", ("phimoe",), "Phi-3.5-MoE",
           names=Names(router="block_sparse_moe.gate", experts="block_sparse_moe.experts",
                       expert_roles=("w1", "w3", "w2")),
           norm="layer", windows="all", moe=True, moe_routing="sparsemixer", moe_norm_key="", moe_inter_key="",
           rope_mscale_keys=True, defaults=(("rms_norm_eps", 1e-5),), genai_type="decoder"),
    Family("minimax_m2", ("minimax_m2",), "MiniMax-M2 (mixture of experts)",
           names=Names(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_whole=True,
                       router="block_sparse_moe.gate", experts="block_sparse_moe.experts",
                       expert_roles=("w1", "w3", "w2"), router_choice_bias="block_sparse_moe.e_score_correction_bias"),
           default_rope_partial=True, rotary_dim_key="rotary_dim", windows="layer_types", window_rule="all",
           moe=True, moe_routing="sigmoid_grouped", moe_norm_key="", moe_inter_key="",
           defaults=(("rms_norm_eps", 1e-6),), genai_type="decoder"),
    Family("gpt_oss", ("gpt_oss",), "gpt-oss",
           names=Names(sinks="self_attn.sinks", router="mlp.router", experts="mlp.experts",
                       expert_store=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), expert_layout="oss"),
           act_keys=(), act_default="swiglu_oss", windows="layer_types", window_rule="every-2", moe=True,
           moe_norm_key="", moe_inter_key="", defaults=(("sliding_window", 128), ("rms_norm_eps", 1e-5)),
           genai_type="decoder"),
    Family("olmo2", ("olmo2",), "OLMo-2",
           names=_OLMO_NAMES,
           defaults=(("rms_norm_eps", 1e-5),), genai_type="decoder"),
    Family("flex_olmo", ("flex_olmo",), "FlexOlmo (mixture of experts)",
           names=dataclasses.replace(_OLMO_NAMES, router="mlp.gate", experts="mlp.experts"),
           moe=True, moe_inter_key="", defaults=(("rms_norm_eps", 1e-6),), genai_type="decoder"),
    Family("olmo3", ("olmo3",), "OLMo-3",
           names=_OLMO_NAMES,
           windows="layer_types", window_rule="every-4", per_type_rope=True, local_rope_key=False,
           defaults=(("rms_norm_eps", 1e-5), ("sliding_window", 4096), ("rope_theta", 500000.0)),
           genai_type="decoder"),
    Family("exaone4", ("exaone4",), "EXAONE 4",
           names=dataclasses.replace(_OLMO_NAMES, qk_norm_whole=False),
           windows="layer_types", window_rule="pattern", rope_sliding_only="windowed",
           defaults=(("rms_norm_eps", 1e-5), ("sliding_window", 4096)), genai_type="decoder"),
    Family("arcee", ("arcee",), "Arcee (AFM)", names=Names(gate=None), mlp="plain", act_default="relu2",
           genai_type="decoder"),
    Family("seed_oss", ("seed_oss",), "Seed-OSS", genai_type="decoder"),
    Family("ernie4_5", ("ernie4_5",), "ERNIE 4.5 (dense)", rotary_interleaved=True, tie_default=True,
           defaults=(("head_dim", 128),), genai_type="decoder"),
    Family("ernie4_5_moe", ("ernie4_5_moe",), "ERNIE 4.5 (mixture of experts)",
           names=Names(router="mlp.gate", experts="mlp.experts", shared_expert="mlp.shared_experts",
                       router_choice_bias="mlp.moe_statics.e_score_correction_bias"),
           rotary_interleaved=True, tie_default=True, moe=True, moe_routing="softmax_biased", moe_norm_key="",
           moe_shared_key="moe_num_shared_experts", moe_ernie_layers=True,
           config_aliases=(("num_experts", "moe_num_experts"), ("num_experts_per_tok", "moe_k")),
           defaults=(("head_dim", 128), ("rms_norm_eps", 1e-5)), genai_type="decoder"),
    Family("glm", ("glm",), "GLM-4 (glm)", names=Names(gate=None, up=None, gate_up="mlp.gate_up_proj"),
           rotary_interleaved=True, default_rope_partial=True,
           defaults=(("partial_rotary_factor", 0.5), ("head_dim", 128), ("rms_norm_eps", 1.5625e-07)),
           genai_type="decoder"),
    Family("glm4", ("glm4",), "GLM-4 (glm4)",
           names=Names(attn_post_norm="post_self_attn_layernorm", mlp_norm="post_attention_layernorm",
                       mlp_post_norm="post_mlp_layernorm", gate=None, up=None, gate_up="mlp.gate_up_proj"),
           rotary_interleaved=True, default_rope_partial=True,
           defaults=(("partial_rotary_factor", 0.5), ("head_dim", 128), ("rms_norm_eps", 1.5625e-07)),
           genai_type="decoder"),
    Family("cohere", ("cohere",), "Cohere (Command R, Aya Expanse)", names=Names(mlp_norm=None), norm="layer",
           norm_bias=False, rotary_interleaved=True, parallel="always", logit_scale=True, tie_default=True,
           config_aliases=(("rms_norm_eps", "layer_norm_eps"),), refuse_true=("use_qk_norm",),
           defaults=(("layer_norm_eps", 1e-5), ("logit_scale", 0.0625)), genai_type="decoder"),
    Family("cohere2", ("cohere2",), "Cohere 2 (Command R7B)", names=Names(mlp_norm=None), norm="layer",
           norm_bias=False, rotary_interleaved=True, parallel="always", logit_scale=True, tie_default=True,
           windows="layer_types", window_rule="pattern", rope_sliding_only="always",
           config_aliases=(("rms_norm_eps", "layer_norm_eps"),),
           defaults=(("layer_norm_eps", 1e-5), ("logit_scale", 0.0625), ("sliding_window", 4096)),
           genai_type="decoder"),
    Family("nemotron", ("nemotron",), "Nemotron (Minitron, Nemotron-Mini)", norm="layer", gamma_offset=True,
           names=Names(gate=None), mlp="plain", act_default="relu2", default_rope_partial=True,
           config_aliases=(("rms_norm_eps", "norm_eps"),), defaults=(("norm_eps", 1e-5), ("partial_rotary_factor", 0.5)),
           genai_type="nemotron"),
    Family("gptj", ("gptj",), "GPT-J", names=_GPTJ_NAMES, **_GPTJ),
    Family("hunyuan_v1_dense", ("hunyuan_v1_dense",), "Hunyuan (dense)",
           names=Names(q_norm="self_attn.query_layernorm", k_norm="self_attn.key_layernorm"), qk_norm_after_rope=True,
           ntk_alpha=True, genai_type="decoder"),
    Family("hunyuan_v1_moe", ("hunyuan_v1_moe",), "Hunyuan (mixture of experts)",
           names=Names(q_norm="self_attn.query_layernorm", k_norm="self_attn.key_layernorm", router="mlp.gate.wg",
                       experts="mlp.experts", shared_expert="mlp.shared_mlp"),
           qk_norm_after_rope=True, ntk_alpha=True, moe=True, moe_norm_key="", moe_inter_key="",
           moe_shared_key="intermediate_size", config_aliases=(("num_experts_per_tok", "moe_topk"),),
           genai_type="decoder"),
    Family("starcoder2", ("starcoder2",), "StarCoder2",
           names=Names(gate=None, up="mlp.c_fc", down="mlp.c_proj", act="mlp.act"), norm="layer", mlp="plain",
           act_default="gelu_pytorch_tanh", windows="all", tie_default=True,
           config_aliases=(("rms_norm_eps", "norm_epsilon"),), defaults=(("norm_epsilon", 1e-5),),
           genai_type="decoder"),
    Family("helium", ("helium",), "Helium", rotary_interleaved=True, defaults=(("rms_norm_eps", 1e-8),),
           genai_type="decoder"),
    Family("opt", ("opt",), "OPT",
           names=Names(embed="model.decoder.embed_tokens", positions="model.decoder.embed_positions",
                       layers="model.decoder.layers", final_norm="model.decoder.final_layer_norm",
                       attn_norm="self_attn_layer_norm", mlp_norm="final_layer_norm", o="self_attn.out_proj",
                       gate=None, up="fc1", down="fc2", act="activation_fn", stored_prefix="model."),
           norm="layer", mlp="plain", act_keys=("activation_function",), act_default="relu", rotary=False,
           position_offset=2, tie_default=True, config_aliases=(("intermediate_size", "ffn_dim"),),
           require=(("do_layer_norm_before", True), ("_remove_final_layer_norm", False),
                    ("layer_norm_elementwise_affine", True)),
           equal_hidden=("word_embed_proj_dim",), defaults=(("rms_norm_eps", 1e-5),), genai_type="decoder"),
    Family("bloom", ("bloom",), "BLOOM",
           names=Names(embed="transformer.word_embeddings", embed_norm="transformer.word_embeddings_layernorm",
                       layers="transformer.h", final_norm="transformer.ln_f", q=None, k=None, v=None,
                       qkv="self_attention.query_key_value", o="self_attention.dense", gate=None,
                       up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", act="mlp.gelu_impl", qkv_per_head=True,
                       stored_prefix="transformer."),
           norm="layer", mlp="plain", act_keys=(), act_default="gelu_new", rotary=False, alibi="bloom",
           tie_default=True,
           config_aliases=(("hidden_size", "n_embed"), ("num_attention_heads", "n_head"),
                           ("num_hidden_layers", "n_layer"), ("rms_norm_eps", "layer_norm_epsilon"),
                           ("max_position_embeddings", "seq_length")),
           refuse_true=("apply_residual_connection_post_layernorm",), defaults=(("layer_norm_epsilon", 1e-5),),
           intermediate_default=4, genai_type="decoder"),
    Family("gpt_bigcode", ("gpt_bigcode",), "GPT-BigCode (StarCoder 1, SantaCoder)",
           names=Names(embed="transformer.wte", positions="transformer.wpe", layers="transformer.h",
                       final_norm="transformer.ln_f", attn_norm="ln_1", mlp_norm="ln_2", q=None, k=None, v=None,
                       qkv="attn.c_attn", o="attn.c_proj", gate=None, up="mlp.c_fc", down="mlp.c_proj",
                       act="mlp.act", qkv_per_head=True, stored_prefix="transformer."),
           norm="layer", mlp="plain", act_keys=("activation_function",), act_default="gelu_pytorch_tanh",
           rotary=False, multi_query_key="multi_query", tie_default=True,
           config_aliases=_GPT_ALIASES,
           refuse_true=("add_cross_attention",),
           defaults=(("n_positions", 1024), ("layer_norm_epsilon", 1e-5), ("multi_query", True)),
           intermediate_default=4, genai_type="decoder"),
    Family("falcon_new", ("falcon",), "Falcon (40B / 180B: new_decoder_architecture, ln_attn + ln_mlp)",
           names=dataclasses.replace(_FALCON_NAMES, attn_norm="ln_attn", mlp_norm="ln_mlp"), **_FALCON,
           when=(("new_decoder_architecture", (True,)), ("num_ln_in_parallel_attn", (None, 2)),
                 ("alibi", (False, None))),
           parallel="always", parallel_shared_norm=False,
           config_aliases=_FALCON_ALIASES + (("num_key_value_heads", "num_kv_heads"),)),
    Family("falcon_new1", ("falcon",), "Falcon 2 (new_decoder_architecture, one norm)", names=_FALCON_NAMES,
           **_FALCON, when=(("new_decoder_architecture", (True,)), ("num_ln_in_parallel_attn", (1,)),
                            ("alibi", (False, None))),
           parallel="always", config_aliases=_FALCON_ALIASES + (("num_key_value_heads", "num_kv_heads"),)),
    Family("falcon", ("falcon",), "Falcon (7B, RW)", names=_FALCON_NAMES, **_FALCON,
           when=(("new_decoder_architecture", (False, None)), ("alibi", (False, None))), parallel="config",
           parallel_key="parallel_attn", parallel_default=True, multi_query_key="multi_query",
           config_aliases=_FALCON_ALIASES),
    Family("falcon_alibi", ("falcon",), "Falcon RW (ALiBi)", names=_FALCON_NAMES,
           **{**_FALCON, "rotary": False, "alibi": "falcon"},
           when=(("new_decoder_architecture", (False, None)), ("alibi", (True,))), parallel="config",
           parallel_key="parallel_attn", parallel_default=True, multi_query_key="multi_query",
           config_aliases=_FALCON_ALIASES),
    Family("gpt_neo", ("gpt_neo",), "GPT-Neo",
           names=Names(embed="transformer.wte", positions="transformer.wpe", layers="transformer.h",
                       final_norm="transformer.ln_f", attn_norm="ln_1", mlp_norm="ln_2", q="attn.attention.q_proj",
                       k="attn.attention.k_proj", v="attn.attention.v_proj", o="attn.attention.out_proj", gate=None,
                       up="mlp.c_fc", down="mlp.c_proj", act="mlp.act", stored_prefix="transformer."),
           norm="layer", mlp="plain", act_keys=("activation_function",), act_default="gelu_new", rotary=False,
           unscaled_attention=True, windows="layer_types", window_rule="attention_types", tie_default=True,
           config_aliases=(("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_heads"),
                           ("rms_norm_eps", "layer_norm_epsilon"), ("sliding_window", "window_size")),
           defaults=(("layer_norm_epsilon", 1e-5), ("window_size", 256), ("max_position_embeddings", 2048)),
           intermediate_default=4, genai_type="decoder"),
    Family("codegen", ("codegen",), "CodeGen",  # GPT-J's block, the qkv packed in 4 shards of [q | v | k]
           names=dataclasses.replace(_GPTJ_NAMES, q=None, k=None, v=None, qkv="attn.qkv_proj", qkv_mp=4), **_GPTJ),
    Family("biogpt", ("biogpt",), "BioGPT",
           names=Names(embed="biogpt.embed_tokens", positions="biogpt.embed_positions", layers="biogpt.layers",
                       final_norm="biogpt.layer_norm", attn_norm="self_attn_layer_norm", mlp_norm="final_layer_norm",
                       o="self_attn.out_proj", gate=None, up="fc1", down="fc2", act="activation_fn",
                       stored_aliases=(("lm_head.weight", "output_projection.weight"),)),
           norm="layer", mlp="plain", act_default="gelu", rotary=False, position_offset=2, embed_scale=True,
           embed_scale_key="scale_embedding", tie_default=True,
           defaults=(("rms_norm_eps", 1e-5), ("max_position_embeddings", 1024)), genai_type="decoder"),
    Family("xglm", ("xglm",), "XGLM",
           names=Names(positions="model.embed_positions", layers="model.layers", final_norm="model.layer_norm",
                       attn_norm="self_attn_layer_norm", mlp_norm="final_layer_norm", o="self_attn.out_proj",
                       gate=None, up="fc1", down="fc2", act="activation_fn"),
           norm="layer", mlp="plain", act_keys=("activation_function",), act_default="gelu", rotary=False,
           position_offset=2, sinusoidal=True, embed_scale=True, embed_scale_key="scale_embedding", tie_default=True,
           config_aliases=(("hidden_size", "d_model"), ("num_hidden_layers", "num_layers"),
                           ("num_attention_heads", "attention_heads"), ("intermediate_size", "ffn_dim")),
           refuse_true=("add_cross_attention",), defaults=(("rms_norm_eps", 1e-5), ("max_position_embeddings", 2048)),
           genai_type="decoder"),
    Family("exaone", ("exaone",), "EXAONE 3 / 3.5",
           names=Names(stored_renames=((r"^transformer\.wte\.", "model.embed_tokens."),
                                       (r"^transformer\.h\.", "model.layers."), (r"^transformer\.ln_f\.", "model.norm."),
                                       (r"\.attn\.attention\.", ".self_attn."),
                                       (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
                                       (r"\.ln_1\.", ".input_layernorm."), (r"\.ln_2\.", ".post_attention_layernorm."),
                                       (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."), (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
                                       (r"\.mlp\.c_proj\.", ".mlp.down_proj."))),
           config_aliases=(("num_hidden_layers", "num_layers"), ("rms_norm_eps", "layer_norm_epsilon"),
                           ("hidden_act", "activation_function")),
           defaults=(("rope_theta", 500000.0), ("rms_norm_eps", 1e-5)), genai_type="decoder"),
    Family("internlm3", ("internlm3",), "InternLM3", defaults=(("head_dim", 128), ("rms_norm_eps", 1e-5)),
           genai_type="decoder"),
    Family("iquestcoder", ("iquestcoder",), "IQuest-Coder", defaults=(("head_dim", 128), ("rms_norm_eps", 1e-5)),
           genai_type="decoder"),
    Family("cwm", ("cwm",), "CWM", windows="layer_types", window_rule="every-4-first",
           defaults=(("head_dim", 128), ("sliding_window", 8192), ("rms_norm_eps", 1e-5)), genai_type="decoder"),
    Family("jais2", ("jais2",), "Jais 2", names=Names(gate=None), norm="layer", mlp="plain", act_default="relu2",
           config_aliases=(("rms_norm_eps", "layer_norm_eps"),), defaults=(("layer_norm_eps", 1e-5),),
           genai_type="decoder"),
    Family("vaultgemma", ("vaultgemma",), "VaultGemma", names=Names(mlp_norm="pre_feedforward_layernorm"),
           norm="rms_offset", act_keys=("hidden_activation",), act_default="gelu_pytorch_tanh", embed_scale=True,
           query_pre_attn_scalar=True, softcap=True, windows="layer_types", window_rule="every-2", tie_default=True,
           defaults=(("head_dim", 256), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
                     ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)),
           genai_type="decoder"),
    Family("mpt", ("mpt",), "MPT",
           names=Names(embed="transformer.wte", layers="transformer.blocks", final_norm="transformer.norm_f",
                       attn_norm="norm_1", mlp_norm="norm_2", q=None, k=None, v=None, qkv="attn.Wqkv",
                       o="attn.out_proj", gate=None, up="ffn.up_proj", down="ffn.down_proj", act="ffn.act"),
           norm="layer", norm_bias=False, mlp="plain", act_keys=(), act_default="gelu", rotary=False, alibi="bloom",
           clip_qkv=True, scale_key="attn_config.softmax_scale", tie_default=True,
           config_aliases=(("hidden_size", "d_model"), ("num_attention_heads", "n_heads"),
                           ("num_hidden_layers", "n_layers"), ("max_position_embeddings", "max_seq_len"),
                           ("rms_norm_eps", "layer_norm_epsilon"), ("clip_qkv", "attn_config.clip_qkv"),
                           ("attn_config.softmax_scale", "attn_config.softmax_scale"),
                           ("attn_config.qk_ln", "attn_config.qk_ln"), ("attn_config.attn_type", "attn_config.attn_type"),
                           ("attn_config.prefix_lm", "attn_config.prefix_lm")),
           require=(("attn_config.qk_ln", False), ("attn_config.attn_type", "multihead_attention"),
                    ("attn_config.prefix_lm", False)),
           defaults=(("layer_norm_epsilon", 1e-5), ("max_seq_len", 2048)), intermediate_default=4,
           genai_type="decoder"),
    Family("hyperclovax", ("hyperclovax",), "HyperCLOVA X (SEED)",
           names=Names(attn_post_norm="post_norm1", mlp_post_norm="post_norm2"), multipliers=True,
           logits_multiply=True, when=(("use_post_norm", (True, None)),), genai_type="decoder"),
    Family("hyperclovax_plain", ("hyperclovax",), "HyperCLOVA X (without post norms)", multipliers=True,
           logits_multiply=True, when=(("use_post_norm", (False,)),), genai_type="decoder"),
    Family("apertus", ("apertus",), "Apertus",
           names=Names(attn_norm="attention_layernorm", mlp_norm="feedforward_layernorm", q_norm="self_attn.q_norm",
                       k_norm="self_attn.k_norm", gate=None),
           mlp="plain", act_default="xielu", defaults=(("rms_norm_eps", 1e-5),), genai_type="decoder"),
    Family("nanochat", ("nanochat",), "nanochat",
           names=Names(embed_norm="model.norm", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", gate=None,
                       up="mlp.fc1", down="mlp.fc2"),
           mlp="plain", act_default="relu2", norm_free=True, qk_norm_after_rope=True, rope_sign_flip=True,
           softcap=True, defaults=(("final_logit_softcapping", 15.0),), genai_type="decoder"),
    Family("granite_swa", ("granite_swa",), "Granite SWA", names=Names(sinks="self_attn.sinks"), multipliers=True,
           windows="layer_types", window_rule="every-4-first", layer_theta_key="layer_rope_theta", tie_default=True,
           defaults=(("sliding_window", 128), ("rms_norm_eps", 1e-5)), genai_type="decoder"),
    Family("stablelm", ("stablelm",), "StableLM / StableLM 2", norm="layer", default_rope_partial=True,
           parallel="config", config_aliases=(("rms_norm_eps", "layer_norm_eps"),), refuse_true=("qk_layernorm",),
           defaults=(("partial_rotary_factor", 0.25), ("layer_norm_eps", 1e-5)), genai_type="decoder"),
)  # fmt: skip

_BY_TYPE: dict[str, Family] = {}
for _f in FAMILIES:
    for _t in _f.model_types:
        _BY_TYPE.setdefault(_t, _f)  # a model_type's first variant names it (family_of, the supported list)
_VARIANTS = {t: tuple(f for f in FAMILIES if t in f.model_types) for t in _BY_TYPE}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu2": "relu2", "relu": "relu",
                "xielu": "xielu", "swiglu_oss": "swiglu_oss"}  # fmt: skip
"""config.json activation names -> the kernel written (``gelu_tanh``: ONNX ``Gelu`` with ``approximate="tanh"``;
``relu2``: ``relu(x) ** 2``, as ``Relu`` x itself; ``relu``: ``Relu``; ``xielu``: Apertus' xIELU, with the
parameters each MLP stores under its ``act_fn``; ``swiglu_oss``: gpt-oss's gated unit
``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``, :attr:`DecoderConfig.swiglu_alpha` /
:attr:`DecoderConfig.swiglu_limit`)."""
_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "dynamic", "yarn", "ntk_alpha")
"""RoPE variants the builder computes exactly.  ``dynamic`` (dynamic NTK) is plain RoPE until a sequence passes the
original context, where transformers starts rescaling the frequencies by the sequence length: the built decoder's
context stops there (:attr:`DecoderConfig.context_length`), and a longer sequence is refused."""


def supported_model_types() -> tuple[str, ...]:
    """Every ``model_type`` the builder takes, in the order of :data:`FAMILIES`."""
    return tuple(_BY_TYPE)


_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


def moe_message(cfg: Mapping[str, Any], where: str) -> str | None:
    """Why the whole-graph path refuses a mixture-of-experts decoder (``config.json`` names experts), or None for a
    dense one: ``torch.export`` cannot trace the expert dispatch of transformers' MoE blocks (their grouped matrix
    products have no ONNX export) - refused at once instead of after the export.  A family of the streaming builder
    (Mixtral, Qwen-MoE, OLMoE) is pointed to the layer-wise path; another one is named unsupported, with the MoE
    families that are."""
    keys = [k for k in _MOE_KEYS if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool) and cfg[k] > 1]
    if not keys:
        return None
    model_type = str(cfg.get("model_type", "?")).lower()
    head = f"{where}: model_type {model_type!r} is a mixture-of-experts decoder ({keys[0]}: {cfg[keys[0]]})"
    moe_types = list(dict.fromkeys(t for f in FAMILIES if f.moe for t in f.model_types))  # (variants: once)
    if model_type in moe_types:
        return (f"{head}; the whole-graph path cannot export it (torch.export does not trace the expert dispatch): "
                "quantize it layer-wise (calibration.layerwise: true, the default for decoders)")
    return (f"{head}; quantkit supports the mixture-of-experts families {', '.join(moe_types)} (layer-wise); this "
            "one's routing is not supported, and the whole-graph path cannot export it (torch.export does not trace "
            f"the expert dispatch); supported decoder families: {', '.join(supported_model_types())}")


def unsupported_message(model_type: str, where: str, cfg: Mapping[str, Any] | None = None) -> str:
    """Why ``model_type`` is refused, what is supported, and what to try instead (``cfg``: the config, when read:
    a mixture-of-experts decoder gets :func:`moe_message`, the whole-graph path being no way out for it)."""
    moe = moe_message(cfg, where) if cfg is not None else None
    if moe is not None:
        return moe
    return (f"{where}: model_type {model_type!r} is not a decoder family the streaming builder supports "
            f"(calibration.layerwise and the KV-cache decoder); supported model_types: "
            f"{', '.join(supported_model_types())}. Try instead: calibration.layerwise: false (the whole-graph "
            "path: a PyTorch export of the full model, held in memory in FP32, without a KV cache), or convert the "
            "checkpoint to one of the supported families")  # fmt: skip


# --------------------------------------------------------------------------- multimodal checkpoints

TEXT_TOWERS = (("model.language_model.", "model."), ("language_model.model.", "model."),
                ("model.text_model.", "model."), ("language_model.lm_head.", "lm_head."))  # fmt: skip
"""Where a vision-language checkpoint stores its text decoder (stored prefix -> the decoder's own name):
transformers >= 4.52 (``model.language_model.``), the original LLaVA / Gemma 3 / Mistral 3 layout and what
transformers 5 writes again (``language_model.model.``, ``language_model.lm_head.``), Idefics3 / SmolVLM
(``model.text_model.``).  Qwen2-VL / Qwen2.5-VL store it under the plain names (``model.layers``, ``lm_head``)."""
_FLAT_TEXT = ("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")
_TEXT_ALIASES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
"""Text decoders of vision-language models that are a builder family on text alone: Qwen-VL's multimodal RoPE
(``mrope_section``) rotates each section by its own position (time / height / width), which are all the token's
position when there is no image - the plain RoPE of the family."""


_WRAPPER_LOGITS = ("paligemma", "aya_vision", "hyperclovax_vision_v2", "granite4_vision", "granite_docling")
"""Multimodal wrappers whose head applies the text decoder's logits post-processing (soft-capping, ``logit_scale``,
``logits_scaling``), as their transformers classes do; every other wrapper's head is the ``lm_head`` alone
(transformers 5.25: Gemma 3, LLaVA, LLaVA-Next / -OneVision, Mistral 3, Qwen-VL, SmolVLM / Idefics3, ...), so a
Gemma 3 text_config's ``final_logit_softcapping`` is not applied by Gemma3ForConditionalGeneration, nor here."""


def is_multimodal(raw: Any) -> bool:
    """Whether a parsed ``config.json`` is a multimodal wrapper (a ``text_config`` or a ``vision_config`` /
    ``audio_config`` beside the text decoder's values) whose ``model_type`` is not itself a builder family."""
    return (isinstance(raw, Mapping) and str(raw.get("model_type", "")).lower() not in _BY_TYPE
            and any(isinstance(raw.get(k), Mapping) for k in ("text_config", "vision_config", "audio_config")))


def text_tensor_name(stored: str) -> str | None:
    """The text decoder's name of tensor ``stored`` of a multimodal checkpoint (:data:`TEXT_TOWERS`), None for a
    tensor of another tower (vision encoder, projector, audio)."""
    for prefix, graph in TEXT_TOWERS:
        if stored.startswith(prefix):
            return graph + stored[len(prefix):]
    return stored if stored.startswith(_FLAT_TEXT) else None


def _text_config(raw: Mapping[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """``(text decoder config, its model_type)`` of multimodal ``raw``, as transformers reads it: a nested
    ``text_config`` is written by transformers without the values equal to its config class's defaults (Gemma 3's
    4B checkpoint states 5 of them), so the wrapper's config class fills them in - transformers is imported for
    multimodal checkpoints only."""
    wrapper = str(raw.get("model_type", "")).lower()
    try:
        from transformers import CONFIG_MAPPING
    except ImportError as e:
        raise ModelError(f"{where}: model_type {wrapper!r} is a multimodal checkpoint; reading its text decoder's "
                         f"configuration needs transformers (pip install 'quantkit[hf]'): {e}") from e
    if wrapper not in CONFIG_MAPPING:
        raise ModelError(f"{where}: model_type {wrapper!r} (a multimodal checkpoint) is not known to the installed "
                         "transformers, so its text decoder's configuration cannot be read; supported decoder "
                         f"families (as text_config.model_type): {', '.join(supported_model_types())}")  # fmt: skip
    try:
        conf = CONFIG_MAPPING[wrapper].from_dict(dict(raw))
        text = conf.get_text_config(decoder=True).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers' own validation: any error is the checkpoint's
        raise ModelError(f"{where}: transformers cannot read {wrapper!r}'s configuration: {e}") from e
    text_type = str(text.get("model_type", "")).lower()
    if text_type in ("", wrapper):
        raise ModelError(f"{where}: model_type {wrapper!r} has no separate text decoder configuration "
                         "(text_config); allowed: a multimodal checkpoint whose text_config is one of the supported "
                         f"decoder families: {', '.join(supported_model_types())}")  # fmt: skip
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the wrapper's own first (Gemma 3 IT: eos [1, 106]
        if raw.get(key) is not None:  # at the top level, the text config class's default 1 inside)
            text[key] = raw[key]
    if isinstance(raw.get("tie_word_embeddings"), bool):  # transformers 5 ties the wrapper's head by its own key
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    for key in ("rope_scaling", "rope_parameters"):  # Qwen-VL's multimodal RoPE: the plain RoPE on text alone
        rope = text.get(key)
        if isinstance(rope, dict) and ("mrope_section" in rope or rope.get("type") == "mrope"
                                       or rope.get("rope_type") == "mrope"):
            rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved", "type")}
            rope["rope_type"] = "default" if rope.get("rope_type") in (None, "mrope") else rope["rope_type"]
            text[key] = rope if (set(rope) - {"rope_type"} or key == "rope_parameters") else None
    return text, text_type


def family_of(model_type: str) -> Family:
    """The :class:`Family` of ``model_type``; :class:`ModelError` (with the supported list) when there is none."""
    fam = _BY_TYPE.get(str(model_type).lower())
    if fam is None:
        raise ModelError(unsupported_message(str(model_type), "config.json"))
    return fam


# --------------------------------------------------------------------------- the parsed config


@dataclass(frozen=True)
class DecoderConfig:
    """What the builder needs from ``config.json``, checked (see :func:`parse_config`)."""

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    """The epsilon of every norm (LayerNorm's ``layer_norm_epsilon`` for GPT-2)."""
    rope_theta: float
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    family: str = "llama"
    activation: str = "silu"
    """``silu``, ``gelu_tanh`` or ``gelu`` (see :data:`_ACTIVATIONS`)."""
    partial_rotary_factor: float = 1.0
    attention_scale: float | None = None
    """The attention scale of every layer (None: ``head_dim ** -0.5``)."""
    scale_by_inverse_layer: bool = False
    """GPT-2's ``scale_attn_by_inverse_layer_idx``: layer ``i`` scales its scores by ``1 / (i + 1)`` too."""
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_types: tuple[str, ...] = ()
    """Per layer ``full_attention`` / ``sliding_attention``; empty: every layer is full unless ``sliding_window``
    is set (then every layer is windowed: Mistral, Phi-3)."""
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    """Gemma 3: the RoPE of the sliding layers (None: the same as the full ones)."""
    rope_layers: tuple[bool, ...] = ()
    """Per layer, whether it applies the rotary embedding (SmolLM3's NoPE layers); empty: every layer does."""
    parallel_residual: bool = False
    """Attention and MLP read the same block input; their outputs are added to the stream together (Phi-2)."""
    embedding_multiplier: float | None = None
    """The embedding rows are multiplied by this (Gemma: ``sqrt(hidden_size)``; Granite: ``embedding_multiplier``)."""
    residual_multiplier: float | None = None
    """Attention and MLP outputs are multiplied by this before the residual add (Granite)."""
    logits_scaling: float | None = None
    """The logits are divided by this (Granite)."""
    logit_scale: float | None = None
    """The logits are multiplied by this (Cohere)."""
    embed_scaled: bool = False
    """The embedding rows are multiplied by ``sqrt(hidden_size)`` (:attr:`Family.embed_scale`, as its key says)."""
    clip_qkv: float | None = None
    """q, k and v are clamped to ``[-clip_qkv, clip_qkv]`` after their projections (OLMo 1)."""
    qkv_interleaved: bool = False
    """The packed ``qkv`` weight is stored per head (or per key / value group): see :attr:`Names.qkv_per_head`."""
    num_experts: int = 0
    """Experts of a mixture-of-experts block (0: a dense decoder)."""
    experts_per_token: int = 0
    """Experts each token runs (top-k of the router's probabilities)."""
    norm_topk_prob: bool = False
    """The top-k routing weights are renormalized to sum to 1 (else: the softmax over all experts, as they are)."""
    moe_intermediate_size: int = 0
    """An expert's intermediate size."""
    shared_expert_intermediate_size: int = 0
    """The shared expert's intermediate size (0: none)."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer, whether it is a mixture-of-experts block (the others have a dense MLP); empty with
    :attr:`num_experts`: every layer is."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    """gpt-oss's gated unit (activation ``swiglu_oss``): the sigmoid's slope and the clamp of gate and up."""
    moe_routing: str = "softmax"
    """:attr:`Family.moe_routing`."""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_jitter_noise: float = 0.0
    """``sparsemixer`` routing's relative threshold (half of it)."""
    """``sigmoid_grouped`` routing: the expert groups, how many of them a token may choose from, the weights' scale."""
    multimodal: str = ""
    """The ``model_type`` of the multimodal checkpoint this is the text decoder of (Gemma 3, LLaVA, Qwen2.5-VL ...;
    its vision / audio towers are not read: :func:`text_tensor_name`); empty for a text-only checkpoint."""

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` is a mixture-of-experts block."""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    @property
    def spec(self) -> Family:
        return _BY_NAME[self.family]

    @property
    def rotary(self) -> bool:
        return self.spec.rotary

    @property
    def rotary_dim(self) -> int:
        factor = float((self.rope_scaling or {}).get("partial_rotary_factor", self.partial_rotary_factor))
        return int(self.head_dim * factor)

    @property
    def context_length(self) -> int:
        """Positions a built decoder covers (its rotary caches' rows): see :data:`ROTARY_CACHE_POSITIONS`; a learned
        position table's rows (GPT-2)."""
        if not self.rotary:
            return self.max_position_embeddings
        if _rope_kind(self.rope_scaling) == "dynamic":  # exact up to the original context (_ROPE_TYPES)
            orig = (self.rope_scaling or {}).get("original_max_position_embeddings")
            limit = min(self.max_position_embeddings, int(orig or 0)) if _num(orig) else self.max_position_embeddings
            return min(limit, ROTARY_CACHE_POSITIONS)
        return min(self.max_position_embeddings, ROTARY_CACHE_POSITIONS)

    @property
    def mlp_norm(self) -> str | None:
        """The norm the MLP reads (a block suffix), None when it reads the attention's input norm."""
        if self.parallel_residual and self.spec.parallel_shared_norm:
            return None
        return self.spec.names.mlp_norm

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (keys it attends to, itself included), None when it sees all."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == SLIDING else None
        return self.sliding_window

    @property
    def external_rotary(self) -> bool:
        """The rotary embedding runs as its own ``RotaryEmbedding`` node before the attention: ONNX Runtime's
        GroupQueryAttention applies it only to a multiple of 8 pairs (StableLM-3B rotates 10)."""
        return self.rotary and (self.rotary_dim % 16 != 0 or self.spec.qk_norm_after_rope)

    def uses_rope(self, layer: int) -> bool:
        """Layer ``layer`` rotates q and k (False: learned positions, or one of SmolLM3's NoPE layers)."""
        return self.rotary and (not self.rope_layers or self.rope_layers[layer])

    def is_local(self, layer: int) -> bool:
        """Layer ``layer`` uses the sliding layers' RoPE (Gemma 3)."""
        return self.local_rope_theta is not None and bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def scale(self, layer: int) -> float:
        s = self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)
        return s / (layer + 1) if self.scale_by_inverse_layer else s


_BY_NAME = {f.name: f for f in FAMILIES}


def _num(value: Any, *, positive: bool = True) -> bool:
    """A finite real number (``> 0``, or ``>= 0`` when not ``positive``); never a bool or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and (value > 0 if positive else value >= 0)


def _rope_kind(sc: Mapping[str, Any] | None) -> str:
    kind = str((sc or {}).get("rope_type", (sc or {}).get("type", "default")))
    return "longrope" if kind in ("su", "longrope") else kind


def _split_rope(cfg: Mapping[str, Any], rope: Any, fam: Family) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` from transformers >= 5's ``rope_parameters`` (one flat dict) or the older
    ``rope_theta`` + ``rope_scaling``."""
    rope = dict(rope or {})
    scaling = cfg.get("rope_scaling") or None
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        if cfg.get("partial_rotary_factor") is not None:  # transformers copies it into the RoPE parameters
            scaling.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
        if fam.name == "phi3" and _rope_kind(scaling) == "yarn":  # transformers reads Phi-3's "yarn" as longrope
            scaling["rope_type"] = "longrope"
        if fam.ntk_alpha and _rope_kind(scaling) == "dynamic" and scaling.get("alpha"):  # static, as transformers
            scaling["rope_type"] = "ntk_alpha"
            scaling.pop("type", None)
        if _rope_kind(scaling) == "longrope":
            scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if _rope_kind(scaling) == "yarn":  # as transformers: config.json's own value first, else the context
            if cfg.get("original_max_position_embeddings") is not None:
                scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
            scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, scaling


def _normalized(cfg: Mapping[str, Any], fam: Family) -> dict[str, Any]:
    """``cfg`` with the family's key aliases read under the builder's names (GPT-2's ``n_embd`` ...); an alias with a
    dot reads a nested key (MPT's ``attn_config.clip_qkv``)."""
    out = dict(cfg)
    for key, alias in fam.config_aliases:
        value: Any = cfg
        for part in alias.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is not None:
            out[key] = value
    return out


def _variant(model_type: str, raw: Mapping[str, Any], where: str) -> Family:
    """The variant of ``model_type`` whose :attr:`Family.when` config.json matches (see there)."""
    variants = _VARIANTS[model_type]
    for fam in variants:
        cfg = {**dict(fam.defaults), **raw}
        if all(cfg.get(key) in values for key, values in fam.when):
            return fam
    keys = sorted({k for f in variants for k, _ in f.when})
    allowed = "; ".join(f"{f.title}: " + ", ".join(f"{k} {'/'.join(json.dumps(v) for v in vs)}" for k, vs in f.when)
                        for f in variants)  # fmt: skip
    raise ModelError(f"{where}: {model_type} with " + ", ".join(f"{k} {json.dumps(raw.get(k))}" for k in keys)
                     + f" is not a variant the streaming builder supports; allowed: {allowed} (or "
                     "calibration.layerwise: false, the whole-graph path)")


def parse_config(raw: Any, where: str) -> DecoderConfig:
    """Check a parsed ``config.json`` (``where``: its path, for the messages) and return its :class:`DecoderConfig`.

    Everything the builder relies on is checked here, from the JSON alone: the family, the sizes (range:
    :func:`~quantkit.frontends.checkpoint.check_config_values`), the activation, the norm epsilon, the RoPE
    type and its parameters, the sliding windows and layer types, soft-capping and attention scales.

    Raises:
        ModelError: naming the key, its value, and what is allowed.
    """
    if not isinstance(raw, dict):
        raise ModelError(f"{where}: config.json must hold a JSON object, got {type(raw).__name__}")
    model_type = str(raw.get("model_type", "")).lower()
    if is_multimodal(raw):
        text, text_type = _text_config(raw, where)
        family_type = _TEXT_ALIASES.get(text_type, text_type)
        if family_type not in _BY_TYPE:
            raise ModelError(f"{where}: model_type {model_type!r} is a multimodal checkpoint whose text decoder is "
                             f"{text_type!r}, not a decoder family the streaming builder supports; supported "
                             f"(as text_config.model_type): {', '.join(supported_model_types())}")  # fmt: skip
        out = parse_config({**text, "model_type": family_type}, f"{where} (text_config of {model_type})")
        if model_type not in _WRAPPER_LOGITS:
            out = dataclasses.replace(out, final_softcap=None, logit_scale=None, logits_scaling=None)
        return dataclasses.replace(out, multimodal=model_type)
    if model_type not in _BY_TYPE:
        raise ModelError(unsupported_message(model_type, where, raw))
    fam = _variant(model_type, raw, where)
    cfg = _normalized({**dict(fam.defaults), **raw}, fam)
    aliases = ", ".join(f"{a} as {k}" for k, a in fam.config_aliases if raw.get(a) is not None)
    check_config_values(cfg, f"{where} ({model_type}: read {aliases})" if aliases else where)
    for key in fam.refuse_true:
        if cfg.get(key):
            raise ModelError(f"{where}: {key} {cfg[key]!r} is not supported for {model_type}; allowed: false")
    for key, value in fam.require:
        if cfg.get(key) is not None and cfg[key] != value:
            raise ModelError(f"{where}: {key} {cfg[key]!r} is not supported for {model_type} by the streaming "
                             f"builder; allowed: {json.dumps(value)} (or calibration.layerwise: false, the "
                             "whole-graph path)")  # fmt: skip
    for key in fam.equal_hidden:
        if cfg.get(key) is not None and cfg[key] != cfg.get("hidden_size"):
            raise ModelError(f"{where}: {key} {cfg[key]!r} differs from hidden_size {cfg.get('hidden_size')!r}: "
                             f"{model_type}'s projection after the embedding is not supported by the streaming "
                             f"builder; allowed: {key} equal to hidden_size (or calibration.layerwise: false, the "
                             "whole-graph path)")  # fmt: skip
    act = next((cfg[k] for k in fam.act_keys if cfg.get(k) is not None), fam.act_default)
    act = dict(fam.act_remap).get(act, act)
    if act not in _ACTIVATIONS:
        raise ModelError(f"{where}: {fam.act_keys[0]} {act!r} is not supported; allowed: "
                         f"{', '.join(sorted(_ACTIVATIONS))}")  # fmt: skip
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if fam.multi_query_key:  # GPT-BigCode: one key / value head, or one per query head
            mq = cfg.get(fam.multi_query_key)
            if not isinstance(mq, bool):
                raise ModelError(f"{where}: {fam.multi_query_key} {mq!r}; allowed: true or false")
            kv_heads = 1 if mq else heads
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        inter = cfg.get("intermediate_size") or fam.intermediate_default * hidden or cfg["intermediate_size"]
        eps = cfg.get("rms_norm_eps", 1e-6)
        theta, scaling = _split_rope(cfg, cfg.get("rope_parameters"), fam)
        local_theta, local_scaling = None, None
        rope_params = cfg.get("rope_parameters")
        if fam.per_type_rope:
            # the family's defaults (Gemma 3: 1e6 for the full layers, rope_local_base_freq 1e4 for the sliding ones;
            # OLMo-3: rope_theta for both)
            full_theta = cfg.get("rope_theta", 1e6)
            local_default = cfg.get("rope_local_base_freq", 1e4) if fam.local_rope_key else full_theta
            if isinstance(rope_params, dict) and (FULL in rope_params or SLIDING in rope_params):
                theta, scaling = _split_rope({}, rope_params.get(FULL) or {"rope_theta": full_theta}, fam)
                local_theta, local_scaling = _split_rope({}, rope_params.get(SLIDING) or {"rope_theta": local_default},
                                                         fam)  # fmt: skip
            else:  # transformers < 5: rope_theta / rope_scaling for the full layers, rope_local_base_freq
                theta, scaling = _split_rope({**cfg, "rope_theta": full_theta}, None, fam)
                local_theta, local_scaling = local_default, None
        # config.json's own value, else the RoPE parameters', else the family's default (Phi-2: 0.5)
        partial = _normalized(raw, fam).get("partial_rotary_factor")
        if partial is None and isinstance(rope_params, dict):
            partial = rope_params.get("partial_rotary_factor")
        if partial is None:
            partial = dict(fam.defaults).get("partial_rotary_factor", 1.0)
        if fam.rotary_dim_key and cfg.get(fam.rotary_dim_key) is not None:
            rd = cfg[fam.rotary_dim_key]
            if isinstance(rd, bool) or not isinstance(rd, int) or not 0 < rd <= head_dim:
                raise ModelError(f"{where}: {fam.rotary_dim_key} {rd!r}; allowed: an integer in 1 .. {head_dim} "
                                 "(head_dim) or null")  # fmt: skip
            partial = rd / head_dim
        out = DecoderConfig(
            model_type=model_type,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(inter),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            rms_norm_eps=float(eps),
            rope_theta=float(theta),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.tie_default)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            rope_scaling=scaling,
            sliding_window=None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            raw=dict(raw),
            family=fam.name,
            activation=_ACTIVATIONS[act],
            partial_rotary_factor=float(partial) if fam.default_rope_partial else 1.0,
            local_rope_theta=float(local_theta) if local_theta is not None else None,
            local_rope_scaling=local_scaling,
            embed_scaled=fam.embed_scale and (not fam.embed_scale_key or bool(cfg.get(fam.embed_scale_key, True))),
            qkv_interleaved=fam.names.qkv is not None and fam.names.qkv_per_head and not (
                fam.multi_query_key and cfg.get(fam.multi_query_key)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{where}: missing or bad field: {e}") from e
    if heads % kv_heads:
        raise ModelError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if not cfg.get("head_dim") and hidden % heads:
        raise ModelError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                         "and there is no head_dim; allowed: a multiple, or an explicit head_dim")  # fmt: skip
    out = dataclasses.replace(out, **_attention_extras(cfg, fam, out, where))
    if fam.moe:
        out = dataclasses.replace(out, **_moe_fields(cfg, fam, out, where))
    _check_numbers(out, where)
    return out


def _count(cfg: Mapping[str, Any], key: str, where: str, *, minimum: int = 1) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ModelError(f"{where}: {key} {v!r}; allowed: an integer >= {minimum}")
    return v


def _moe_fields(cfg: Mapping[str, Any], fam: Family, out: DecoderConfig, where: str) -> dict[str, Any]:
    """The mixture-of-experts values of ``config.json`` (:attr:`Family.moe`), checked."""
    key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k) is not None),
               "num_experts")  # fmt: skip
    experts = _count(cfg, key, where, minimum=2)
    top = _count(cfg, "num_experts_per_tok", where)
    if top > experts:
        raise ModelError(f"{where}: num_experts_per_tok {top} exceeds {key} {experts}; allowed: 1 .. {experts}")
    norm = True
    if fam.moe_norm_key:
        norm = cfg.get(fam.moe_norm_key, False)
        if not isinstance(norm, bool):
            raise ModelError(f"{where}: {fam.moe_norm_key} {norm!r}; allowed: true or false")
    inter = _count(cfg, fam.moe_inter_key, where) if fam.moe_inter_key else out.intermediate_size
    shared = 0
    if fam.names.shared_expert is not None:
        per_expert = fam.moe_shared_key.endswith("shared_experts")  # a count of experts (0: none), else a width
        none_ok = fam.moe_shared_key in ("moe_num_shared_experts", "shared_intermediate_size")  # 0: no shared expert
        shared = _count(cfg, fam.moe_shared_key, where, minimum=0 if none_ok else 1)
        if per_expert:
            shared *= int(inter)
    layers: tuple[bool, ...] = ()
    if fam.moe_dense_first_key:
        dense_first = _count(cfg, fam.moe_dense_first_key, where, minimum=0) if cfg.get(
            fam.moe_dense_first_key) is not None else 0  # fmt: skip
        layers = tuple(i >= dense_first for i in range(out.num_hidden_layers))
    if fam.moe_sparse_layers:
        step = _count(cfg, "decoder_sparse_step", where) if cfg.get("decoder_sparse_step") is not None else 1
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise ModelError(f"{where}: mlp_only_layers {dense!r}; allowed: a list of layer indices")
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(out.num_hidden_layers))
    out_fields: dict[str, Any] = {
        "num_experts": experts, "experts_per_token": top, "norm_topk_prob": bool(norm),
        "moe_intermediate_size": int(inter), "shared_expert_intermediate_size": int(shared), "moe_layers": layers,
        "moe_routing": fam.moe_routing}
    if fam.moe_ernie_layers:
        start, end = (_count(cfg, k, where, minimum=0) if cfg.get(k) is not None else d for k, d in (
            ("moe_layer_start_index", 0), ("moe_layer_end_index", out.num_hidden_layers - 1)))  # fmt: skip
        every = _count(cfg, "moe_layer_interval", where) if cfg.get("moe_layer_interval") is not None else 1
        out_fields["moe_layers"] = tuple((i + 1) % every == 0 and start <= i <= end
                                         for i in range(out.num_hidden_layers))  # fmt: skip
    if fam.moe_routing == "sparsemixer":
        if top != 2:
            raise ModelError(f"{where}: num_experts_per_tok {top} with the sparse mixer's routing; allowed: 2")
        eps = cfg.get("router_jitter_noise", 0.01)
        if not _num(eps, positive=False):
            raise ModelError(f"{where}: router_jitter_noise {eps!r}; allowed: a number >= 0")
        out_fields["router_jitter_noise"] = float(eps)
    if fam.moe_routing == "sigmoid_grouped":
        groups = _count(cfg, "n_group", where) if cfg.get("n_group") is not None else 1
        chosen = _count(cfg, "topk_group", where) if cfg.get("topk_group") is not None else 1
        if experts % groups or (groups > 1 and experts // groups < 2):
            raise ModelError(f"{where}: n_group {groups} does not split {key} {experts} into groups of 2 or more "
                             f"experts; allowed: a divisor of {experts} (1: no groups)")  # fmt: skip
        if chosen > groups or top > chosen * (experts // groups):
            raise ModelError(f"{where}: topk_group {chosen} with n_group {groups} leaves fewer than "
                             f"num_experts_per_tok {top} experts to choose from; allowed: topk_group in 1 .. {groups} "
                             f"with topk_group x {experts // groups} >= {top}")  # fmt: skip
        scale = cfg.get("routed_scaling_factor", 1.0)
        if not _num(scale, positive=True):
            raise ModelError(f"{where}: routed_scaling_factor {scale!r}; allowed: a number > 0")
        out_fields.update({"n_group": groups, "topk_group": chosen,
                           "routed_scaling_factor": float(scale)})  # fmt: skip
    if out.activation == "swiglu_oss":
        for key, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
            v = cfg.get(key, default)
            if not _num(v, positive=True):
                raise ModelError(f"{where}: {key} {v!r}; allowed: a number > 0")
            out_fields[key] = float(v)
    return out_fields


def read_config(folder: str | os.PathLike[str]) -> DecoderConfig:
    """Read ``folder/config.json`` and check it (:func:`parse_config`), reading nothing else.

    This module imports only the standard library and :mod:`quantkit.errors` / :mod:`quantkit.frontends.checkpoint`
    (no numpy, onnx, onnx_ir, torch or transformers), so the command line refuses an unsupported family or value
    before it imports any of them (``quantkit calibrate`` with ``calibration.layerwise: true``).

    Raises:
        ModelError: the file cannot be read or parsed, or :func:`parse_config` refuses it.
    """
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {str(path)!r}: {e}") from e
    return parse_config(raw, str(path))


def _attention_extras(cfg: Mapping[str, Any], fam: Family, out: DecoderConfig, where: str) -> dict[str, Any]:
    """Sliding windows and layer types, the attention scale, soft-capping: checked, as DecoderConfig fields."""
    L = out.num_hidden_layers
    extra: dict[str, Any] = {}
    window = cfg.get("sliding_window")
    if window == 0 and fam.window_rule == "qwen" and not cfg.get("use_sliding_window"):
        window = None  # Qwen2-MoE's config class writes 0 for a window it does not use
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelError(f"{where}: sliding_window {window!r}; allowed: an integer >= 1 or null")
    types: tuple[str, ...] = ()
    rope_layers: tuple[bool, ...] = ()
    if fam.nope_layers:  # SmolLM3: 1 = the layer uses RoPE, 0 = it does not
        given = cfg.get("no_rope_layers")
        if given is None:
            every = cfg.get("no_rope_layer_interval", 4)
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ModelError(f"{where}: no_rope_layer_interval {every!r}; allowed: an integer >= 1")
            given = [int((i + 1) % every != 0) for i in range(L)]
        if not isinstance(given, list) or len(given) != L or any(v not in (0, 1) or isinstance(v, float) for v in given):
            raise ModelError(f"{where}: no_rope_layers {str(given)[:120]}; allowed: a list of {L} (num_hidden_layers) "
                             "entries, each 0 or 1")  # fmt: skip
        rope_layers = tuple(bool(v) for v in given)
        if all(rope_layers):
            rope_layers = ()
    if fam.layer_theta_key and cfg.get(fam.layer_theta_key) is not None:  # Granite SWA: per layer, 0 = no RoPE
        given = cfg[fam.layer_theta_key]
        if not isinstance(given, list) or len(given) != L or not all(_num(v, positive=False) for v in given):
            raise ModelError(f"{where}: {fam.layer_theta_key} {str(given)[:120]}; allowed: a list of {L} "
                             "(num_hidden_layers) numbers >= 0 (0: the layer has no RoPE)")  # fmt: skip
        bases = sorted({float(v) for v in given if v})
        if len(bases) > 1:
            raise ModelError(f"{where}: {fam.layer_theta_key} has {len(bases)} different RoPE bases {bases[:4]}; "
                             "allowed: one base for every layer with RoPE (0 for the others)")  # fmt: skip
        if bases:
            extra["rope_theta"] = bases[0]
        rope_layers = tuple(bool(v) for v in given)
        if all(rope_layers):
            rope_layers = ()
    extra["rope_layers"] = rope_layers
    if fam.windows == "layer_types":
        given = cfg.get("layer_types")
        use = bool(cfg.get("use_sliding_window", False))
        if given is not None:
            if not isinstance(given, list) or len(given) != L or any(t not in (FULL, SLIDING) for t in given):
                raise ModelError(f"{where}: layer_types {str(given)[:120]}; allowed: a list of {L} (num_hidden_layers) "
                                 f"entries, each {FULL!r} or {SLIDING!r}")  # fmt: skip
            types = tuple(given)
        elif fam.window_rule == "all":  # every layer windowed when there is a window (Ministral's default)
            types = tuple(SLIDING if window is not None else FULL for _ in range(L))
        elif fam.window_rule.startswith("every-"):  # every n-th layer full: the last of each n, or the first
            n = int(fam.window_rule.split("-")[1])
            first = fam.window_rule.endswith("-first")
            types = tuple(SLIDING if (i if first else i + 1) % n else FULL for i in range(L))
        elif fam.window_rule == "attention_types":  # GPT-Neo: [[["global", "local"], 12]] -> per layer
            types = _attention_types(cfg.get("attention_types", [[["global", "local"], L // 2]]), L, where)
        elif fam.window_rule == "qwen" and use and window is not None:  # from max_window_layers on
            first = cfg.get("max_window_layers", 28)  # transformers' default
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                raise ModelError(f"{where}: max_window_layers {first!r}; allowed: an integer >= 0")
            types = tuple(SLIDING if i >= first else FULL for i in range(L))
        elif fam.window_rule == "nope" and use and window is not None:  # the layers without RoPE
            types = tuple(SLIDING if rope_layers and not rope_layers[i] else FULL for i in range(L))
        elif fam.window_rule == "pattern" and window is not None:  # every n-th layer full (EXAONE 4)
            n = cfg.get("sliding_window_pattern", 4)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ModelError(f"{where}: sliding_window_pattern {n!r}; allowed: an integer >= 1 (or layer_types)")
            types = tuple(SLIDING if (i + 1) % n else FULL for i in range(L))
        if fam.window_rule == "qwen" and not use:
            window = None  # transformers drops it: every layer is full
        if fam.window_rule == "pattern" and window is None:
            types = ()  # no window: every layer full (and rotated)
        if fam.rope_sliding_only == "always" or (fam.rope_sliding_only and window is not None):  # the full layers
            # attend without RoPE (EXAONE 4, Cohere 2)
            rope_layers = tuple(t == SLIDING for t in (types or (FULL,) * L))
            extra["rope_layers"] = () if all(rope_layers) else rope_layers
        if SLIDING in types and window is None:
            if fam.window_rule != "qwen":
                raise ModelError(f"{where}: layer_types has sliding_attention layers but sliding_window is null; "
                                 "allowed: an integer >= 1")  # fmt: skip
            types = ()
        if SLIDING not in types:  # every layer full: no window anywhere (an empty layer_types windows them all)
            types, window = (), None
    elif fam.windows == "none":
        window = None
    extra["sliding_window"] = window
    extra["layer_types"] = types
    if fam.unscaled_attention:
        extra["attention_scale"] = 1.0
    if fam.scale_key and cfg.get(fam.scale_key) is not None:
        v = cfg[fam.scale_key]
        if not _num(v):
            raise ModelError(f"{where}: {fam.scale_key} {v!r}; allowed: a finite number > 0 or null")
        extra["attention_scale"] = float(v)
    if fam.query_pre_attn_scalar:
        s = cfg.get("query_pre_attn_scalar", 256)
        if not _num(s):
            raise ModelError(f"{where}: query_pre_attn_scalar {s!r}; allowed: a finite number > 0")
        extra["attention_scale"] = float(s) ** -0.5
    if fam.name in ("gpt2", "gpt_bigcode"):
        if not cfg.get("scale_attn_weights", True):
            extra["attention_scale"] = 1.0
        extra["scale_by_inverse_layer"] = bool(cfg.get("scale_attn_by_inverse_layer_idx", False))
    if fam.parallel != "never":
        par = True if fam.parallel == "always" else cfg.get(fam.parallel_key, fam.parallel_default)
        if par is None:
            par = fam.parallel_default
        if not isinstance(par, bool):
            raise ModelError(f"{where}: {fam.parallel_key} {par!r}; allowed: true or false")
        extra["parallel_residual"] = par
    if fam.multipliers:  # Granite: a value of 1 is no-op and writes no node
        for key, name in (("embedding_multiplier", "embedding_multiplier"), ("residual_multiplier",
                          "residual_multiplier"), ("attention_multiplier", "attention_scale"),
                          ("logits_scaling", "logits_scaling")):  # fmt: skip
            v = cfg.get(key, 1.0)
            if v is None and key == "attention_multiplier":  # HyperCLOVA X: null is head_dim ** -0.5
                continue
            if not _num(v):
                raise ModelError(f"{where}: {key} {v!r}; allowed: a finite number > 0")
            if key == "logits_scaling" and fam.logits_multiply:
                name = "logit_scale"
            extra[name] = float(v) if (float(v) != 1.0 or name == "attention_scale") else None
    if fam.clip_qkv:
        v = cfg.get("clip_qkv")
        if v is not None and not _num(v):
            raise ModelError(f"{where}: clip_qkv {v!r}; allowed: a finite number > 0 or null")
        extra["clip_qkv"] = float(v) if v is not None else None
    if fam.logit_scale:
        v = cfg.get("logit_scale")
        if v is not None and not _num(v):
            raise ModelError(f"{where}: logit_scale {v!r}; allowed: a finite number > 0 or null")
        extra["logit_scale"] = float(v) if v is not None and float(v) != 1.0 else None
    if fam.softcap:
        for key, name in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
            v = cfg.get(key)
            if v is not None and not _num(v):
                raise ModelError(f"{where}: {key} {v!r}; allowed: a finite number > 0 or null")
            extra[name] = float(v) if v is not None else None
    return extra


def _attention_types(given: Any, layers: int, where: str) -> tuple[str, ...]:
    """GPT-Neo's ``attention_types`` (``[[kinds, repeat], ...]``, each kind ``global`` or ``local``) as layer types."""
    out: list[str] = []
    try:
        for kinds, repeat in given:
            if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 0:
                raise ValueError(repeat)
            for _ in range(repeat):
                out += [{"global": FULL, "local": SLIDING}[k] for k in kinds]
    except (TypeError, ValueError, KeyError):
        out = []
    if len(out) != layers:
        raise ModelError(f"{where}: attention_types {str(given)[:120]}; allowed: a list of [[kind, ...], repeat] pairs, "
                         f"each kind 'global' or 'local', giving {layers} (num_layers) layers in all")  # fmt: skip
    return tuple(out)


def _check_rope(sc: Mapping[str, Any] | None, rotary_dim: int, where: str) -> None:
    kind = _rope_kind(sc)
    if kind not in _ROPE_TYPES:
        raise ModelError(f"{where}: rope_scaling type {kind!r} is not supported ({', '.join(_ROPE_TYPES)})")
    sc = sc or {}
    keys = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"),
            "longrope": ("original_max_position_embeddings",),
            "yarn": ("original_max_position_embeddings",)}.get(kind, ())  # fmt: skip
    for key in keys:
        if not _num(sc.get(key)):
            raise ModelError(f"{where}: rope_scaling {kind} {key} {sc.get(key)!r}; allowed: a finite number > 0")
    if kind == "llama3" and float(sc["high_freq_factor"]) == float(sc["low_freq_factor"]):
        raise ModelError(f"{where}: rope_scaling llama3 high_freq_factor equals low_freq_factor "
                         f"({sc['low_freq_factor']}); allowed: two different numbers")  # fmt: skip
    if kind == "ntk_alpha" and not _num(sc.get("alpha")):
        raise ModelError(f"{where}: rope_scaling dynamic alpha {sc.get('alpha')!r}; allowed: a finite number > 0")
    if kind == "yarn":
        for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if sc.get(key) is not None and not _num(sc[key]):
                raise ModelError(f"{where}: rope_scaling yarn {key} {sc[key]!r}; allowed: a finite number > 0")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            f = sc.get(key)
            if not isinstance(f, list) or len(f) != rotary_dim // 2 or not all(_num(x) for x in f):
                raise ModelError(f"{where}: rope_scaling longrope {key} {str(f)[:80]}; allowed: a list of "
                                 f"{rotary_dim // 2} (rotary dimension / 2) finite numbers > 0")  # fmt: skip
        for key in ("factor", "attention_factor"):
            if sc.get(key) is not None and not _num(sc[key]):
                raise ModelError(f"{where}: rope_scaling longrope {key} {sc[key]!r}; allowed: a finite number > 0")


def _check_numbers(cfg: DecoderConfig, where: str) -> None:
    """Refuse float settings the rotary caches and norms cannot use (NaN, zero or negative)."""
    if not _num(cfg.rms_norm_eps, positive=False):
        key = "layer_norm_epsilon" if cfg.spec.norm == "layer" else "rms_norm_eps"
        raise ModelError(f"{where}: {key} {cfg.rms_norm_eps!r}; allowed: a finite number >= 0")
    if not cfg.rotary:
        return
    for theta in (cfg.rope_theta, cfg.local_rope_theta):
        if theta is not None and not _num(theta):
            raise ModelError(f"{where}: rope_theta {theta!r}; allowed: a finite number > 0")
    factor = (cfg.rope_scaling or {}).get("partial_rotary_factor", cfg.partial_rotary_factor)
    if not _num(factor) or float(factor) > 1:
        raise ModelError(f"{where}: partial_rotary_factor {factor!r}; allowed: a number in (0, 1]")
    if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        raise ModelError(f"{where}: head_dim {cfg.head_dim} gives a rotary dimension of {cfg.rotary_dim}; allowed: "
                         "an even number >= 2")  # fmt: skip
    _check_rope(cfg.rope_scaling, cfg.rotary_dim, where)
    if cfg.local_rope_scaling is not None:
        _check_rope(cfg.local_rope_scaling, cfg.rotary_dim, where)
