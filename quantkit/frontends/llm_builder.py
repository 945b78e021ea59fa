"""A streaming builder of decoder LLMs with ONNX Runtime's fused contrib ops.

The families it builds (LLaMA / SmolLM, Mistral, Qwen2 / 3, Gemma 1 / 2 / 3, Phi-2 / 3, GPT-2, GPT-NeoX, OLMo-2 ...:
:data:`~quantkit.frontends.families.FAMILIES`) are declarative descriptions in :mod:`quantkit.frontends.families` (norm kind, MLP and activation, positions,
attention extras, tensor names) over the shared building blocks below; ``docs/llm-families.md`` lists them.
The LLaMA layout is described here; the others differ as their :class:`~quantkit.frontends.families.Family` says.

:func:`build_llm` reads a local Hugging Face folder (``config.json`` + ``*.safetensors``, sharded
or not, bf16 / fp16 / fp32) and writes the decoder graph directly, the way onnxruntime-genai's
model builder does, instead of tracing the PyTorch model:

* the weights are streamed: a decoder block's tensors are read from the safetensors files (plain reads at the
  header's offsets, in the stored dtype, no torch), then each is converted to float32 and
  transposed to ``[K, N]`` in row chunks that are **written straight into the external-data
  file** (``<model>.onnx.data``); the graph only holds a reference (location, offset, length).
  Peak memory is about one block in its stored dtype plus a chunk, whatever the model size,
  and the model may exceed protobuf's 2 GB limit;
* the graph has a KV cache and fused kernels: ``SkipSimplifiedLayerNormalization``
  (``com.microsoft``: RMSNorm with the residual add inside; the first norm, which has no
  residual to add, is written in standard ops that ORT fuses into ``SimplifiedLayerNormalization``),
  ``GroupQueryAttention`` (``com.microsoft``; rotary embedding inside with ``do_rotary=1`` and
  cos/sin caches as initializers), SiLU as ``Sigmoid`` x ``Mul``.

Inputs and outputs are onnxruntime-genai's LLaMA ones, so the ``genai_config.json`` written
next to the model lets ``onnxruntime_genai.Model`` load it:

=====================================  =========================================  =======
name                                   shape                                      type
=====================================  =========================================  =======
``input_ids``                          ``[batch_size, sequence_length]``          int64
``attention_mask``                     ``[batch_size, total_sequence_length]``    int64
``past_key_values.<i>.key|value``      ``[batch_size, kv_heads, past_sequence_length, head_dim]``  float32
``logits_to_keep`` (optional)          ``[1]`` (default ``[0]``: every position)  int64
``logits``                             ``[batch_size, logits_length, vocab]``     float32
``present.<i>.key|value``              ``[batch_size, kv_heads, total_sequence_length, head_dim]`` float32
=====================================  =========================================  =======

The cache is float32 as built; :func:`quantkit.frontends.kv_cache.int8_kv_cache` (recipe ``export.kv_cache: int8``)
turns it into an int8 cache that ``GroupQueryAttention`` quantizes and reads itself (calibrated scales as inputs).

Nodes are named after the HF modules so that quantkit recipes address them like the
torch-exported graphs of :mod:`quantkit.frontends.llm`: ``model.embed_tokens`` (Gather),
``model.layers.<i>.self_attn.q_proj`` ... ``model.layers.<i>.mlp.down_proj`` (MatMul with a
``[K, N]`` initializer of the same name + ``.weight``), ``lm_head`` (MatMul).  With tied
embeddings the table is stored once: ``lm_head`` reads it through the Transpose node
``lm_head.weight_transpose`` (the pattern :mod:`quantkit.weight_only` recognises).

GroupQueryAttention takes two tensors derived from ``attention_mask`` (as genai computes them):
``seqlens_k = ReduceSum(attention_mask, axis 1) - 1`` (int32 ``[batch]``, the index of the
last valid position, *not* a length) and ``total_sequence_length = Shape(attention_mask)[1]``
(an int32 scalar).  With ``do_rotary=1`` the kernel derives the rotary positions from them
(no ``position_ids`` input), so prompts must be right-aligned in the usual sense: a batch of
one, or rows padded on the right.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from quantkit.errors import ModelError
from quantkit.frontends.checkpoint import TensorInfo, checkpoint_tensors, read_tensor
from quantkit.frontends.families import (
    ROTARY_CACHE_POSITIONS,
    TEXT_TOWERS,
    DecoderConfig,
    read_config,
    supported_model_types,
    text_tensor_name,
)

__all__ = [
    "BuildHook",
    "WeightTransform",
    "ContextFullError",
    "DecoderConfig",
    "LOGITS_TO_KEEP",
    "PackedLinear",
    "ROTARY_CACHE_POSITIONS",
    "block_model",
    "block_norms",
    "block_prefix",
    "LLMSession",
    "build_llm",
    "check_decoder_folder",
    "StreamExtras",
    "alibi_slopes",
    "embedded_stream",
    "stream_extras",
    "generate",
    "expert_linears",
    "float_linears",
    "input_groups",
    "input_stages",
    "linear_groups",
    "linear_shapes",
    "norm_gamma",
    "norm_params",
    "read_decoder_config",
]

OPSET = 21
HEAD_BIAS = "lm_head.bias"
"""The lm_head's bias (Phi-2), added to the logits when the checkpoint has it."""
_MS = "com.microsoft"
_ALIGN = 4096  # external-data offsets page-aligned: ORT can memory-map them
_SUPPORTED_TYPES = supported_model_types()  # every model_type of quantkit.frontends.families


# --------------------------------------------------------------------------- config


def read_decoder_config(folder: str | Path) -> DecoderConfig:
    """Parse ``folder/config.json``; :class:`ModelError` on an architecture or a value this builder cannot do
    (see :func:`quantkit.frontends.families.parse_config`: everything is checked from the JSON alone)."""
    return read_config(folder)


def _inv_freq(cfg: DecoderConfig, theta: float, sc: dict[str, Any] | None, long: bool) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies (float32, as transformers computes them) and the cos / sin scale."""
    dim = cfg.rotary_dim
    kind = str((sc or {}).get("rope_type", (sc or {}).get("type", "default")))
    kind = "longrope" if kind == "su" else kind
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    if kind == "longrope":
        assert sc is not None  # noqa: S101 - checked by parse_config
        orig = float(sc["original_max_position_embeddings"])
        ext = np.asarray(sc["long_factor" if long else "short_factor"], np.float32)
        inv = (np.float32(1.0) / (ext * (np.float32(theta) ** shape))).astype(np.float32)
        factor = sc.get("factor") or cfg.max_position_embeddings / orig
        attention = sc.get("attention_factor")
        if cfg.spec.rope_mscale_keys and sc.get("long_mscale" if long else "short_mscale") is not None:
            attention = sc["long_mscale" if long else "short_mscale"]  # Phi-3.5-MoE: the config's own scale
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return inv, float(attention)
    if kind == "yarn":
        assert sc is not None  # noqa: S101 - checked by parse_config
        return _yarn(cfg, theta, sc, shape)
    if kind == "ntk_alpha":  # Hunyuan: a fixed NTK stretch of the base over the whole head
        assert sc is not None  # noqa: S101 - checked by parse_config
        d = cfg.head_dim
        theta = theta * float(sc["alpha"]) ** (d / (d - 2))
    inv = (1.0 / (np.float32(theta) ** shape)).astype(np.float32)
    if kind == "linear":
        assert sc is not None  # noqa: S101 - checked by parse_config
        inv = (inv / np.float32(sc["factor"])).astype(np.float32)
    elif kind == "llama3":
        assert sc is not None  # noqa: S101 - checked by parse_config
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv, 1.0


def _yarn(cfg: DecoderConfig, theta: float, sc: dict[str, Any], shape: np.ndarray) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies and cos / sin scale, as transformers computes them (``_compute_yarn_parameters``):
    interpolated (divided by ``factor``) below a ramp over the dimensions between ``beta_fast`` and ``beta_slow``
    rotations in the original context, extrapolated (plain) above it."""
    dim = cfg.rotary_dim
    orig = float(sc["original_max_position_embeddings"])
    factor = sc.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = sc.get("attention_factor")
    if attention is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attention = mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)
    fast, slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def correction(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos = (np.float32(theta) ** shape).astype(np.float32)
    extrapolated = (np.float32(1.0) / pos).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(factor) * pos)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)  # the share of the extrapolated (plain) frequency
    inv = (interpolated * (np.float32(1.0) - keep) + extrapolated * keep).astype(np.float32)
    return inv, float(attention)


def rotary_caches(cfg: DecoderConfig, length: int | None = None, *, local: bool = False,
                  long: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``cos``, ``sin`` ``[length, rotary_dim / 2]`` float32, computed as transformers does (float32).

    ``length`` defaults to :attr:`DecoderConfig.context_length` (never more than :data:`ROTARY_CACHE_POSITIONS`
    rows, whatever ``max_position_embeddings`` says).  ``local``: the sliding layers' RoPE (Gemma 3);
    ``long``: LongRoPE's long factors (used once a sequence exceeds ``original_max_position_embeddings``)."""
    if local and cfg.local_rope_theta is not None:
        inv, scale = _inv_freq(cfg, cfg.local_rope_theta, cfg.local_rope_scaling, long)
    else:
        inv, scale = _inv_freq(cfg, cfg.rope_theta, cfg.rope_scaling, long)
    t = np.arange(length or cfg.context_length, dtype=np.float32)
    freqs = np.outer(t, inv).astype(np.float32)
    cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
    if scale != 1.0:
        cos, sin = (cos * np.float32(scale)).astype(np.float32), (sin * np.float32(scale)).astype(np.float32)
    return cos, sin


def _longrope_limit(sc: dict[str, Any] | None) -> int | None:
    kind = str((sc or {}).get("rope_type", (sc or {}).get("type", "default")))
    if kind in ("longrope", "su") and sc is not None:
        return int(sc["original_max_position_embeddings"])
    return None


# --------------------------------------------------------------------------- weights


class _Checkpoint:
    """Tensor name -> shard file of a safetensors checkpoint; reads tensors as float32, a few at a time.

    With ``cfg``, names are the family's graph names: a tensor stored without the family's optional prefix
    (GPT-2's ``h.0...`` for ``transformer.h.0...``) or under an older name (GPT-NeoX's ``embed_out``) is found
    under it, ``Conv1D`` weights (stored ``[K, N]``) are returned transposed (a view), as ``nn.Linear`` stores
    them (``[N, K]``), and a per-head interleaved ``qkv`` (GPT-NeoX) is returned as ``[q | k | v]``."""

    def __init__(self, folder: Path, cfg: DecoderConfig | None = None) -> None:
        # the headers are checked (lengths, offsets inside the files, float dtypes) and the index's weight_map
        # (plain file names inside the folder) before safetensors maps a file
        self.tensors: dict[str, TensorInfo] = checkpoint_tensors(folder)
        if not self.tensors:
            raise ModelError(f"no *.safetensors in {str(folder)!r}")
        if cfg is not None and cfg.multimodal:  # the text decoder of a vision-language checkpoint, under its own names
            text = {g: t for k, t in self.tensors.items() if (g := text_tensor_name(k)) is not None}
            if not text:
                raise ModelError(f"{str(folder)!r}: none of the checkpoint's tensors is a text decoder's (stored "
                                 f"under one of {', '.join(p for p, _ in TEXT_TOWERS)} or model.layers.*); first "
                                 f"names: {sorted(self.tensors)[:4]}")  # fmt: skip
            self.tensors = text
        self.where = {k: t.file for k, t in self.tensors.items()}
        self.cfg = cfg
        self.stored: dict[str, str] = {}  # graph name -> stored name, where they differ
        self.transposed: set[str] = set()  # graph names of Conv1D weights
        self.reordered: dict[str, np.ndarray] = {}  # graph name -> the order its rows are read in
        self.virtual: dict[str, np.ndarray] = {}  # graph name -> a tensor the checkpoint does not store (ones)
        # graph name -> (stored [experts, N, K] tensor, expert, first row, end row, N): experts stored together
        self.sliced: dict[str, tuple[str, int, int, int, int]] = {}
        # graph name -> (the stored tensors it is computed from, its shape, how): gpt-oss's experts
        self.derived: dict[str, tuple[tuple[str, ...], tuple[int, ...], Callable[[dict[str, Any]], Any]]] = {}
        self.expected: dict[str, tuple[int, ...]] = {}  # stored tensor -> the shape the config implies
        if cfg is not None:
            fam = cfg.spec
            for k in list(self.tensors) if fam.names.stored_renames else []:  # EXAONE 3's names for LLaMA's modules
                graph = k
                for pattern, repl in fam.names.stored_renames:
                    graph = re.sub(pattern, repl, graph)
                if graph != k and graph not in self.tensors:
                    self.stored[graph] = k
            if fam.sinusoidal and fam.names.positions is not None:  # XGLM: computed, not stored
                self.virtual[f"{fam.names.positions}.weight"] = sinusoidal_table(
                    cfg.max_position_embeddings + fam.position_offset, cfg.hidden_size)
            if fam.norm_free:  # OLMo 1, nanochat: parameter-free norms read as weights of ones
                n = fam.names
                norms = [f"{block_prefix(cfg, i)}.{s}" for i in range(cfg.num_hidden_layers) for s in block_norms(cfg)]
                for name in [*norms, n.final_norm, *([n.embed_norm] if n.embed_norm else [])]:
                    self.virtual[f"{name}.weight"] = np.ones(cfg.hidden_size, np.float32)
                for qk, heads in ((n.q_norm, cfg.num_attention_heads), (n.k_norm, cfg.num_key_value_heads)):
                    width = cfg.head_dim * (heads if n.qk_norm_whole else 1)
                    for i in range(cfg.num_hidden_layers if qk else 0):
                        self.virtual[f"{block_prefix(cfg, i)}.{qk}.weight"] = np.ones(width, np.float32)
            if fam.rope_sign_flip:  # nanochat rotates by -theta: the halves of every q / k head swapped instead
                half = cfg.rotary_dim // 2
                for role, heads in ((fam.names.q, cfg.num_attention_heads), (fam.names.k, cfg.num_key_value_heads)):
                    per = np.arange(cfg.head_dim)
                    per[:2 * half] = np.concatenate([per[half:2 * half], per[:half]])
                    rows = (np.arange(heads)[:, None] * cfg.head_dim + per[None, :]).reshape(-1)
                    for i in range(cfg.num_hidden_layers):
                        for t in ("weight", "bias"):
                            self.reordered[f"{block_prefix(cfg, i)}.{role}.{t}"] = rows
            prefix = fam.names.stored_prefix
            if prefix:
                for k in list(self.tensors):
                    if not k.startswith(prefix) and prefix + k not in self.tensors:
                        self.stored[prefix + k] = k
            for graph, stored in fam.names.stored_aliases:
                if graph not in self.tensors and stored in self.tensors:
                    self.stored[graph] = stored
            if fam.names.expert_store is not None and fam.names.expert_layout == "oss":
                self._oss_experts(cfg)
            elif fam.names.expert_store is not None:  # [experts, 2 I, H] and [experts, H, I] per block (Granite-MoE,
                # transformers 5's fused experts), or their transposes [experts, H, 2 I] / [experts, I, H] (Qwen3-VL-MoE
                # as published): told apart by the stored shape where it differs
                up_down = fam.names.expert_store
                inter, H, E = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
                for i in range(cfg.num_hidden_layers):
                    p = block_prefix(cfg, i)
                    gu, dn = f"{p}.{up_down[0]}", f"{p}.{up_down[1]}"
                    gu_t = self._stored_shape(gu) == (E, H, 2 * inter) != (E, 2 * inter, H)
                    dn_t = self._stored_shape(dn) == (E, inter, H) != (E, H, inter)
                    if gu_t:
                        self.expected[gu] = (E, H, 2 * inter)
                    if dn_t:
                        self.expected[dn] = (E, inter, H)
                    for e, (gate, up, down) in enumerate(routed_experts(cfg) if cfg.is_moe(i) else []):
                        if gu_t:
                            self.derived[f"{p}.{gate}.weight"] = ((gu,), (inter, H),
                                                                  functools.partial(_oss_kn, gu, e, slice(0, inter)))
                            self.derived[f"{p}.{up}.weight"] = (
                                (gu,), (inter, H), functools.partial(_oss_kn, gu, e, slice(inter, 2 * inter)))
                        else:
                            self.sliced[f"{p}.{gate}.weight"] = (gu, e, 0, inter, 2 * inter)
                            self.sliced[f"{p}.{up}.weight"] = (gu, e, inter, 2 * inter, 2 * inter)
                        if dn_t:
                            self.derived[f"{p}.{down}.weight"] = ((dn,), (H, inter),
                                                                  functools.partial(_oss_kn, dn, e, slice(None)))
                        else:
                            self.sliced[f"{p}.{down}.weight"] = (dn, e, 0, H, H)
            if fam.names.shared_expert_fused is not None and cfg.shared_expert_intermediate_size:
                gu_s, dn_s = fam.names.shared_expert_fused
                S, H, se = cfg.shared_expert_intermediate_size, cfg.hidden_size, fam.names.shared_expert
                for i in range(cfg.num_hidden_layers):
                    p = block_prefix(cfg, i)
                    if not cfg.is_moe(i):
                        continue
                    self.expected.update({f"{p}.{gu_s}": (2 * S, H), f"{p}.{dn_s}": (H, S)})
                    for role, src, part, shape in (("gate_proj", gu_s, slice(0, S), (S, H)),
                                                   ("up_proj", gu_s, slice(S, 2 * S), (S, H)),
                                                   ("down_proj", dn_s, slice(None), (H, S))):  # fmt: skip
                        self.derived[f"{p}.{se}.{role}.weight"] = ((f"{p}.{src}",), shape,
                                                                   functools.partial(_rows_of, f"{p}.{src}", part))
            if fam.conv1d:
                self.transposed = {f"{fam.names.layers}.{i}.{s}.weight" for i in range(cfg.num_hidden_layers)
                                   for s in linear_shapes(cfg, i)}  # fmt: skip
            if fam.names.qkv_mp and fam.names.qkv is not None:  # CodeGen: mp shards of [q | v | k] -> [q | k | v]
                sharded = np.arange(3 * cfg.hidden_size).reshape(fam.names.qkv_mp, 3, -1)
                rows = np.concatenate([sharded[:, 0].reshape(-1), sharded[:, 2].reshape(-1), sharded[:, 1].reshape(-1)])
                self.reordered.update({f"{fam.names.layers}.{i}.{fam.names.qkv}.{t}": rows
                                       for i in range(cfg.num_hidden_layers) for t in ("weight", "bias")})  # fmt: skip
            if cfg.qkv_interleaved and fam.names.qkv is not None:  # per key / value group [q_0 .. q_r-1 k v]
                # (per head [q_h k_h v_h] when every head has its own k, v) -> [q | k | v]
                nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
                r = nh // nkv
                grouped = np.arange((nh + 2 * nkv) * hd).reshape(nkv, r + 2, hd)
                rows = np.concatenate([grouped[:, :r].reshape(-1), grouped[:, r].reshape(-1),
                                       grouped[:, r + 1].reshape(-1)])  # fmt: skip
                self.reordered.update({f"{fam.names.layers}.{i}.{fam.names.qkv}.{t}": rows
                                       for i in range(cfg.num_hidden_layers) for t in ("weight", "bias")})  # fmt: skip

    def _oss_experts(self, cfg: DecoderConfig) -> None:
        """gpt-oss's experts (:attr:`~quantkit.frontends.families.Names.expert_layout` ``oss``) as one ``[N, K]``
        weight and one bias per expert linear, computed from the stored tensors as they are read: bfloat16
        ``[experts, K, N]`` with gate / up columns interleaved, or MXFP4 blocks and exponents (decoded exactly:
        every e2m1 value times a power of two is a float32)."""
        gu_store, down_store = cfg.spec.names.expert_store or ("", "")
        H, inter, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        for i in range(cfg.num_hidden_layers):
            p = block_prefix(cfg, i)
            for store, rows, k in ((gu_store, 2 * inter, H), (down_store, H, inter)):  # N = rows, as stored
                self.expected.update({f"{p}.{store}": (E, k, rows), f"{p}.{store}_bias": (E, rows),
                                      f"{p}.{store}_blocks": (E, rows, k // 32, 16),
                                      f"{p}.{store}_scales": (E, rows, k // 32)})  # fmt: skip
            for e, (gate, up, down) in enumerate(routed_experts(cfg) if cfg.is_moe(i) else []):
                for role, store, n, k, cols in ((gate, gu_store, inter, H, slice(0, None, 2)),
                                                (up, gu_store, inter, H, slice(1, None, 2)),
                                                (down, down_store, H, inter, slice(None))):  # fmt: skip
                    full, blocks, scales = f"{p}.{store}", f"{p}.{store}_blocks", f"{p}.{store}_scales"
                    if self._name(blocks) in self.where and self._name(scales) in self.where:
                        self.derived[f"{p}.{role}.weight"] = ((blocks, scales), (n, k),
                                                              functools.partial(_oss_mxfp4, blocks, scales, e, cols))
                    else:
                        self.derived[f"{p}.{role}.weight"] = ((full,), (n, k), functools.partial(_oss_kn, full, e, cols))
                    self.derived[f"{p}.{role}.bias"] = ((f"{full}_bias",), (n,),
                                                        functools.partial(_oss_bias, f"{full}_bias", e, cols))

    def _name(self, name: str) -> str:
        return self.stored.get(name, name)

    def _stored_shape(self, name: str) -> tuple[int, ...] | None:
        info = self.tensors.get(self._name(name))
        return None if info is None else tuple(info.shape)

    def __contains__(self, name: str) -> bool:
        if name in self.derived:
            return all(self._name(d) in self.where for d in self.derived[name][0])
        if name in self.sliced:
            return self._name(self.sliced[name][0]) in self.where
        return name in self.virtual or self._name(name) in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the header (``[N, K]`` for a Conv1D weight, as it is read; an expert's slice of the
        experts' tensor, which must hold that expert and those rows)."""
        if name in self.virtual:
            return tuple(self.virtual[name].shape)
        if name in self.derived:
            return self._derived_shape(name)
        if name in self.sliced:
            stored, _, a, b, rows = self.sliced[name]
            shape = self.tensors[self._name(stored)].shape
            if tuple(shape[:2]) != (self.cfg.num_experts if self.cfg else -1, rows):
                return tuple(shape)  # not [experts, rows, K]: reported as a mis-shaped tensor by check_checkpoint
            return (b - a, shape[2])
        shape = self.tensors[self._name(name)].shape
        return tuple(reversed(shape)) if name in self.transposed else shape

    def _derived_shape(self, name: str) -> tuple[int, ...]:
        """A derived tensor's shape when its stored tensors have the shapes the config implies, else the first
        stored tensor's own that does not (reported as a mis-shaped tensor by check_checkpoint)."""
        deps, shape, _ = self.derived[name]
        for d in deps:
            got = tuple(self.tensors[self._name(d)].shape)
            if got != self.expected[d]:
                return got
        return shape

    def file(self, name: str) -> Path:
        if name in self.derived:
            return self.where[self._name(self.derived[name][0][0])]
        if name in self.sliced:
            return self.where[self._name(self.sliced[name][0])]
        return self.where[self._name(name)] if name not in self.virtual else Path("(none: ones)")

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, tensor)``: numpy arrays in the stored dtype (bf16 as ``ml_dtypes.bfloat16``), read with
        plain file reads (:func:`quantkit.frontends.checkpoint.read_tensor`; no torch, no memory map).

        Each tensor is its own array, freed when the caller drops it; :meth:`_ExternalData.add` converts it to
        float32 in row chunks as it writes it.  Reading without torch keeps a process that builds or probes a
        decoder free of torch's ~300 MB (the search's child process never imports it).
        """
        names = list(names)
        missing = [n for n in names if n not in self]
        if missing:
            raise ModelError(f"checkpoint lacks tensors {missing[:4]}")
        together: dict[str, Any] = {}  # experts' tensors read once per call, sliced per expert
        for n in names:
            if n in self.virtual:
                yield n, self.virtual[n].copy()
                continue
            if n in self.derived:
                deps, _, how = self.derived[n]
                for d in deps:
                    if d not in together:
                        together[d] = read_tensor(self.tensors[self._name(d)])
                yield n, how(together)
                continue
            if n in self.sliced:
                stored, e, a, b, _ = self.sliced[n]
                if stored not in together:
                    together[stored] = read_tensor(self.tensors[self._name(stored)])
                yield n, together[stored][e, a:b]
                continue
            t = read_tensor(self.tensors[self._name(n)])
            order = self.reordered.get(n)
            if order is not None and t.shape[:1] == order.shape:
                t = t[order]
            yield n, (t.T if n in self.transposed else t)


def _oss_kn(stored: str, e: int, cols: slice, t: dict[str, Any]) -> Any:
    """Expert ``e``'s ``[N, K]`` weight: columns ``cols`` of its ``[K, N]`` slice of ``stored`` (a view; experts
    stored ``[experts, K, N]``: gpt-oss, Qwen3-VL-MoE as published)."""
    return t[stored][e][:, cols].T


def _rows_of(stored: str, rows: slice, t: dict[str, Any]) -> Any:
    """Rows ``rows`` of ``stored`` (a view)."""
    return t[stored][rows]


def _oss_mxfp4(blocks: str, scales: str, e: int, rows: slice, t: dict[str, Any]) -> np.ndarray:
    """Expert ``e``'s ``[N, K]`` weight: rows ``rows`` of its MXFP4 tensor, decoded."""
    return _mxfp4_rows(t[blocks][e], t[scales][e])[rows]


def _oss_bias(stored: str, e: int, cols: slice, t: dict[str, Any]) -> Any:
    return t[stored][e][cols]


_E2M1 = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
"""The 16 values of a 4-bit e2m1 code (MXFP4), by code."""


def _mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One expert's MXFP4 weight ``[N, K]`` (float32, exact) from its blocks ``[N, K / 32, 16]`` (two codes per byte,
    the low nibble first) and exponents ``[N, K / 32]`` (``2 ** (s - 127)``), as transformers decodes gpt-oss."""
    b = np.asarray(blocks, np.uint8)
    vals = np.empty((*b.shape[:-1], 32), np.float32)
    vals[..., 0::2] = _E2M1[b & 0x0F]
    vals[..., 1::2] = _E2M1[b >> 4]
    vals = np.ldexp(vals, (np.asarray(scales, np.int32) - 127)[..., None])
    return vals.reshape(b.shape[0], -1)


def sinusoidal_table(rows: int, width: int) -> np.ndarray:
    """XGLM's position table ``[rows, width]`` (float32): ``[sin(p f_i) | cos(p f_i)]`` for ``f_i = 10000 **
    (-i / (width / 2 - 1))``, zero-padded to an odd width, row 1 (the padding position) zero, as transformers
    computes it in float32."""
    half = width // 2
    freq = np.exp(np.arange(half, dtype=np.float32) * np.float32(-math.log(10000) / (half - 1))).astype(np.float32)
    ang = (np.arange(rows, dtype=np.float32)[:, None] * freq[None, :]).astype(np.float32)
    out = np.concatenate([np.sin(ang), np.cos(ang)], axis=1).astype(np.float32)
    if width % 2:
        out = np.concatenate([out, np.zeros((rows, 1), np.float32)], axis=1)
    if rows > 1:
        out[1] = 0.0
    return out


def _float32_rows(t: Any, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a numpy array (any float dtype, bfloat16 included; maybe a transposed view) or a
    torch tensor (a caller's own) as C-contiguous float32."""
    chunk = t[start:stop]
    if isinstance(chunk, np.ndarray):
        return np.ascontiguousarray(chunk, dtype=np.float32)
    import torch

    return chunk.to(torch.float32).contiguous().numpy()


# integer arrays only: a float array of any width (a checkpoint's float16 or bfloat16 tensor) is written as float32
_NP_TO_ONNX = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8,
               np.dtype(np.int64): TensorProto.INT64}  # fmt: skip


def _is_raw(arr: Any) -> bool:
    """A numpy array stored in its own dtype (packed codes), not converted to float32."""
    return isinstance(arr, np.ndarray) and arr.dtype in _NP_TO_ONNX


class _ExternalData:
    """Appends tensors to one external-data file; returns TensorProtos that point into it.

    Float tensors (torch or numpy, any float dtype) are written as float32, converted in row
    chunks of about ``chunk_bytes``, so a transposed view (``W.T`` for ``MatMul(x, W^T)``) or a
    bf16 tensor costs one chunk of extra memory, not a full float32 copy.  uint8 / int8 / int64 numpy
    arrays (packed 4-bit codes, ...) are written as they are.
    """

    def __init__(self, path: Path, chunk_bytes: int = 16 << 20) -> None:
        self.path = path
        self.fh = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.offset = 0
        self.chunk_bytes = chunk_bytes

    def add(self, name: str, arr: Any) -> TensorProto:
        shape = tuple(int(d) for d in arr.shape)
        raw = _is_raw(arr)
        if not shape:
            arr, shape = (np.asarray(arr).reshape(1) if raw else np.asarray(arr, np.float32).reshape(1)), ()
        pad = (-self.offset) % _ALIGN
        if pad:
            self.fh.write(b"\0" * pad)
            self.offset += pad
        itemsize = arr.dtype.itemsize if raw else 4
        rows = shape[0] if shape else 1
        row_bytes = itemsize * (math.prod(shape[1:]) if len(shape) > 1 else 1)
        step = max(1, self.chunk_bytes // max(1, row_bytes))
        length = 0
        for i in range(0, rows, step):
            chunk = np.ascontiguousarray(arr[i : min(rows, i + step)]) if raw else _float32_rows(
                arr, i, min(rows, i + step))  # fmt: skip
            self.fh.write(np.ascontiguousarray(chunk).data.cast("B"))
            length += chunk.nbytes
            del chunk
        t = TensorProto()
        t.name = name
        t.data_type = _NP_TO_ONNX[arr.dtype] if raw else TensorProto.FLOAT
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.offset += length
        return t

    def close(self) -> None:
        self.fh.close()


class _InMemoryData:
    """The :class:`_ExternalData` interface for a graph held in memory (a block graph for calibration)."""

    def add(self, name: str, arr: Any) -> TensorProto:
        if _is_raw(arr):
            return onnx.numpy_helper.from_array(np.ascontiguousarray(arr), name)
        a = np.asarray(arr, np.float32) if np.ndim(arr) == 0 else _float32_rows(arr, 0, int(arr.shape[0]))
        return onnx.numpy_helper.from_array(a, name)


# --------------------------------------------------------------------------- quantized linears


@dataclass(frozen=True)
class PackedLinear:
    """A linear layer ``y = x @ W`` (``W`` ``[K, N]``) quantized to ``bits``, in ``MatMulNBits`` layout.

    ``B`` uint8 ``[N, K_blocks, block_size * bits / 8]``, ``scales`` float32 ``[N, K_blocks]``,
    ``zero_points`` (packed, ``None`` when symmetric) as :func:`quantkit.lowering.nbits.matmul_nbits_arrays`
    makes them.  ``input_scale`` ``s`` ``[K]`` (AWQ): the layer computes ``(x / s) @ W_hat``; the builder
    folds ``1 / s`` into the RMSNorm weight before the layer when it is the layer's only reader
    (q/k/v, gate/up), else inserts ``Mul(x, 1 / s)``.
    """

    B: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bits: int
    block_size: int
    K: int
    N: int
    input_scale: np.ndarray | None = None
    accuracy_level: int = 4
    # hot rows (recipe ``hot_rows``; an lm_head or an embedding table): ``hot`` holds the columns ``hot_ids``
    # (ascending) of ``W`` again at 8 bits, read instead of this layer's 4-bit ones
    hot: PackedLinear | None = None
    hot_ids: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        own = self.B.nbytes + self.scales.nbytes + (0 if self.zero_points is None else self.zero_points.nbytes)
        return int(own + (self.hot.nbytes if self.hot is not None else 0))


class BuildHook:
    """What :func:`build_llm` asks while it streams a checkpoint: which linears to emit quantized.

    The default keeps every weight in float.  A subclass (e.g. quantkit's layer-wise quantizer) is
    called in checkpoint order with the tensors as stored (torch bf16/fp16/fp32 tensors, ``[N, K]``
    as in the HF checkpoint) and returns :class:`PackedLinear` results for the layers it quantized.
    """

    def embedding(self, table: Any, tied: bool, extras: StreamExtras | None = None) -> PackedLinear | None:
        """The embedding table ``[V, H]``; when ``tied``, a quantized lm_head weight ``[H, V]`` (the
        table transposed, groups along H) that the ``GatherBlockQuantized`` and the lm_head share.
        ``extras``: what the stream entering block 0 adds to the rows (GPT-2's position table, BLOOM's embedding
        LayerNorm: :func:`embedded_stream`), passed only for a family that has any."""
        return None

    def block(self, index: int, weights: dict[str, Any]) -> dict[str, PackedLinear]:
        """Block ``index``'s tensors by graph name (the HF module names of the family; ``Conv1D`` weights already
        transposed to ``[N, K]``); return quantized linears by layer name (``model.layers.<i>.self_attn.q_proj``
        ...).  May replace the norm weights in ``weights``."""
        return {}

    def lm_head(self, weight: Any, norm_weight: Any, norm_bias: Any = None) -> PackedLinear | None:
        """An untied lm_head weight ``[V, H]`` (``norm_weight``: the factor of the final norm, which precedes it --
        Gemma's ``1 + w`` already added; ``norm_bias``: a LayerNorm's bias, passed only when there is one).
        With :meth:`untie_head`, also a tied checkpoint's table, read again after the last block."""
        return None

    def tied_head(self, q: PackedLinear, read_table: Callable[[], Any], norm_weight: Any,
                  norm_bias: Any = None) -> PackedLinear:
        """The lm_head of a tied checkpoint that shares :meth:`embedding`'s packed table, called after the last block
        (``read_table()``: the float table ``[V, H]`` from the checkpoint; ``norm_weight`` / ``norm_bias`` as for
        :meth:`lm_head`).  Only its ``accuracy_level`` is used (the bytes stay the embedding's)."""
        return q

    def untie_head(self) -> bool:
        """For a tied checkpoint: store the lm_head apart from the embedding.  :meth:`embedding`'s result then
        serves the ``GatherBlockQuantized`` alone and :meth:`lm_head` is called after the last block with the
        table (a head rounded from statistics of the final hidden states, which exist only then)."""
        return False

    def finish(self) -> None:
        """Called once after the last tensor is written."""


class WeightTransform:
    """An exact rewrite of the float weights applied while :func:`build_llm` streams them, before the
    :class:`BuildHook` sees them (e.g. :class:`quantkit.algorithms.rotation.HadamardRotation`: an orthogonal
    rotation of the residual stream folded into the embedding, the linears and the lm_head).  The default changes
    nothing.  Tensors come as stored (torch or numpy, ``[N, K]``) and may be returned as float32 numpy arrays."""

    unties: bool = False
    """The lm_head differs from the embedding after the rewrite: a tied checkpoint's table is then written twice
    (the head read again after the last block, as with :meth:`BuildHook.untie_head`)."""

    def embedding(self, table: Any) -> Any:
        """The embedding table ``[V, H]`` as the graph stores it."""
        return table

    def block(self, index: int, weights: dict[str, Any]) -> None:
        """Rewrite block ``index``'s tensors (by graph name, as :meth:`BuildHook.block` gets them) in place."""

    def final_norm(self, gamma: Any) -> Any:
        """The factor the final norm keeps (``gamma``: its factor as stored, Gemma's ``1 + w`` already added)."""
        return gamma

    def head(self, weight: Any, gamma: Any) -> Any:
        """The lm_head weight ``[V, H]`` (``gamma``: the final norm's factor as stored)."""
        return weight


# --------------------------------------------------------------------------- graph


class _GraphBuilder:
    def __init__(self, cfg: DecoderConfig, data: _ExternalData | _InMemoryData) -> None:
        self.cfg, self.data = cfg, data
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self._consts: dict[tuple[str, bytes], str] = {}
        self.positions: str | None = None  # position ids [B, S] for RotaryEmbedding nodes, made once
        self.alibi: str | None = None  # ALiBi's attention bias [1, heads, S, T], made once
        self.tapped = False  # a calibration block graph: every linear a node of its own (no fused QMoE)

    def node(
        self, op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "", **attrs: Any
    ) -> list[str]:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def external(self, name: str, arr: Any) -> str:
        self.inits.append(self.data.add(name, arr))
        return name

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (str(arr.dtype) + str(arr.shape), arr.tobytes())
        if key not in self._consts:
            name = f"/model/constants/{arr.dtype}/{arr.tolist()}".replace(" ", "")
            self.inits.append(onnx.numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]


def _matmul_nbits(g: _GraphBuilder, x: str, prefix: str, q: PackedLinear, weight_name: str | None = None,
                  out: str | None = None, scales_name: str | None = None, zero_points_name: str | None = None) -> str:
    """``MatMulNBits(x, B, scales[, zero_points])`` named ``prefix`` (``weight_name``: B is computed;
    ``scales_name`` / ``zero_points_name``: tensors already stored, e.g. a shared table's)."""
    b = weight_name or g.external(f"{prefix}.weight_Q{q.bits}", q.B)
    ins = [x, b, scales_name or g.external(f"{prefix}.weight_scales", q.scales)]
    if q.zero_points is not None:
        ins.append(zero_points_name or g.external(f"{prefix}.weight_zero_points", q.zero_points))
    return g.node("MatMulNBits", ins, [out or f"{prefix}/output_0"], prefix, _MS, K=q.K, N=q.N, bits=q.bits,
                  block_size=q.block_size, accuracy_level=q.accuracy_level)[0]  # fmt: skip


def _hot_head(g: _GraphBuilder, x: str, prefix: str, q: PackedLinear, out: str) -> str:
    """An lm_head with hot rows: the 4-bit ``MatMulNBits`` of every column (``q``), the 8-bit one of the hot
    columns, and ``ScatterElements`` writing the hot logits over their 4-bit values along the vocabulary (``out``).
    (A split into hot and cold columns would need a ``Gather`` along the last axis to restore the order, which ONNX
    Runtime runs element by element: 0.3 ms per decoded token for 49152 logits, ~10% of a 135M model's step, against
    10 us for the scatter of 1830.)"""
    assert q.hot is not None and q.hot_ids is not None  # noqa: S101 - the caller checked
    full = _matmul_nbits(g, x, prefix, dataclasses.replace(q, hot=None, hot_ids=None))
    hot = _matmul_nbits(g, x, f"{prefix}.hot", q.hot)
    where = g.node("Expand", [g.external(f"{prefix}.hot_ids", np.asarray(q.hot_ids, np.int64)),
                              g.node("Shape", [hot], [f"{prefix}.hot/shape/output_0"], f"{prefix}.hot/shape")[0]],
                   [f"{prefix}.hot/ids/output_0"], f"{prefix}.hot/ids")[0]  # fmt: skip
    return g.node("ScatterElements", [full, where, hot], [out], f"{prefix}/hot_rows", axis=-1)[0]


def _scaled_input(g: _GraphBuilder, x: str, prefix: str, q: PackedLinear | None) -> str:
    """``x``, or ``Mul(x, 1 / s)`` when ``q`` carries an AWQ input scale that was not folded."""
    if q is None or q.input_scale is None:
        return x
    inv = (np.float32(1.0) / np.asarray(q.input_scale, np.float32)).astype(np.float32)
    c = g.external(f"{prefix}.input_scale_inv", inv)
    return g.node("Mul", [x, c], [f"{prefix}/input_scale/output_0"], f"{prefix}/input_scale")[0]


def _linear(g: _GraphBuilder, x: str, prefix: str, w: Any, bias: Any | None,
            q: PackedLinear | None = None) -> str:
    """``MatMul(x, W^T)`` named ``prefix`` (initializer ``prefix.weight`` ``[K, N]``), or ``MatMulNBits``
    when ``q`` is given; + bias Add."""
    if q is None:
        wname = g.external(f"{prefix}.weight", w.T)
        out = g.node("MatMul", [x, wname], [f"{prefix}/output_0"], prefix)[0]
    else:
        out = _matmul_nbits(g, _scaled_input(g, x, prefix, q), prefix, q)
    if bias is not None:
        bname = g.external(f"{prefix}.bias", bias)
        out = g.node("Add", [out, bname], [f"{prefix}/bias_add/output_0"], f"{prefix}/bias_add")[0]
    return out


def _rms_norm(g: _GraphBuilder, x: str, gamma: str, name: str, eps: float) -> str:
    """RMSNorm in standard ops; ORT fuses it into ``SimplifiedLayerNormalization`` at session creation.

    (``SimplifiedLayerNormalization`` itself is an ORT op registered in the default domain, which
    ``onnx.checker`` -- run by quantkit on every emitted model -- rejects; the first norm has no
    residual to add, so ``SkipSimplifiedLayerNormalization`` does not fit either.)  The last node,
    ``Mul(x_hat, gamma)``, is named ``name`` so that recipes and scale folding find the gamma.
    """
    p = g.node("Pow", [x, g.const(2.0, np.float32)], [f"{name}/Pow/output_0"], f"{name}/Pow")[0]
    m = g.node(
        "ReduceMean", [p, g.const([-1])], [f"{name}/ReduceMean/output_0"], f"{name}/ReduceMean", keepdims=1
    )[0]
    a = g.node("Add", [m, g.const(eps, np.float32)], [f"{name}/Add/output_0"], f"{name}/Add")[0]
    r = g.node("Sqrt", [a], [f"{name}/Sqrt/output_0"], f"{name}/Sqrt")[0]
    d = g.node("Div", [x, r], [f"{name}/Div/output_0"], f"{name}/Div")[0]
    return g.node("Mul", [d, gamma], [f"{name}/output_0"], name)[0]


def _check_shape(name: str, arr: Any, shape: tuple[int, ...]) -> None:
    if tuple(arr.shape) != shape:
        raise ModelError(f"tensor {name!r} has shape {tuple(arr.shape)}, config says {shape}")


def block_prefix(cfg: DecoderConfig, index: int) -> str:
    """The module path of block ``index``: ``model.layers.3``, GPT-2's ``transformer.h.3``."""
    return f"{cfg.spec.names.layers}.{index}"


def _moe_needs_index(cfg: DecoderConfig, index: int | None) -> None:
    if index is None and cfg.num_experts:
        raise ValueError("a mixture-of-experts decoder's blocks differ: pass the block index")


def has_shared_expert(cfg: DecoderConfig) -> bool:
    """Whether a mixture-of-experts block has a shared expert (ERNIE 4.5's ``moe_num_shared_experts`` may be 0)."""
    return cfg.spec.names.shared_expert is not None and cfg.shared_expert_intermediate_size > 0


def routed_experts(cfg: DecoderConfig) -> list[tuple[str, str, str]]:
    """:func:`expert_linears` without the shared expert: expert ``e``'s ``(gate, up, down)`` at index ``e``."""
    return expert_linears(cfg)[1:] if has_shared_expert(cfg) else expert_linears(cfg)


def expert_linears(cfg: DecoderConfig) -> list[tuple[str, str, str]]:
    """A mixture-of-experts block's gated MLPs as ``(gate, up, down)`` suffixes after :func:`block_prefix`: the
    shared expert first when there is one, then expert 0, 1, ..."""
    n = cfg.spec.names
    out: list[tuple[str, str, str]] = []
    if has_shared_expert(cfg):
        out.append((f"{n.shared_expert}.gate_proj", f"{n.shared_expert}.up_proj", f"{n.shared_expert}.down_proj"))
    g, u, d = n.expert_roles
    out += [(f"{n.experts}.{e}.{g}", f"{n.experts}.{e}.{u}", f"{n.experts}.{e}.{d}") for e in range(cfg.num_experts)]
    return out


def linear_shapes(cfg: DecoderConfig, index: int | None = None) -> dict[str, tuple[int, int]]:
    """A block's linear layers (suffix after :func:`block_prefix`) -> HF weight shape ``[N, K]``, in graph order
    (a packed ``qkv`` / ``gate_up`` weight is one layer, as the checkpoint stores it).  ``index``: the block (a
    mixture-of-experts decoder's blocks differ: its experts' linears, :func:`expert_linears`; the router stays
    float and is not listed)."""
    _moe_needs_index(cfg, index)
    H, nh, nkv, hd, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.intermediate_size)  # fmt: skip
    n = cfg.spec.names
    out: dict[str, tuple[int, int]] = {}
    if n.qkv is not None:
        out[n.qkv] = ((nh + 2 * nkv) * hd, H)
    else:
        assert n.q is not None and n.k is not None and n.v is not None  # noqa: S101 - a family has one or the other
        out[n.q], out[n.k], out[n.v] = (nh * hd, H), (nkv * hd, H), (nkv * hd, H)
    out[n.o] = (H, nh * hd)
    if index is not None and cfg.is_moe(index):
        for j, (g, u, d) in enumerate(expert_linears(cfg)):
            width = (cfg.shared_expert_intermediate_size if j == 0 and has_shared_expert(cfg)
                     else cfg.moe_intermediate_size)  # fmt: skip
            out[g], out[u], out[d] = (width, H), (width, H), (H, width)
        return out
    if n.gate_up is not None:
        out[n.gate_up] = (2 * inter, H)
    else:
        if n.gate is not None:
            out[n.gate] = (inter, H)
        assert n.up is not None  # noqa: S101 - every MLP has an up (or fc) layer
        out[n.up] = (inter, H)
    out[n.down] = (H, inter)
    return out


def linear_groups(cfg: DecoderConfig, index: int | None = None) -> tuple[tuple[str, ...], ...]:
    """A block's linears grouped by the tensor they read, in graph order: attention input, o_proj, MLP input,
    down_proj (suffixes as in :func:`linear_shapes`).  A mixture-of-experts block: attention input, o_proj, then
    every expert's ``(gate, up)`` (each reads the rows routed to it), then every expert's ``(down,)``."""
    _moe_needs_index(cfg, index)
    n = cfg.spec.names
    attn = (n.qkv,) if n.qkv is not None else (n.q, n.k, n.v)
    head = tuple(tuple(s for s in grp if s is not None) for grp in (attn, (n.o,)))
    if index is not None and cfg.is_moe(index):
        experts = expert_linears(cfg)
        return head + tuple((g, u) for g, u, _ in experts) + tuple((d,) for _, _, d in experts)
    mlp = (n.gate_up,) if n.gate_up is not None else tuple(s for s in (n.gate, n.up) if s is not None)
    return head + (mlp, (n.down,))


def input_groups(cfg: DecoderConfig, index: int | None = None) -> tuple[tuple[str, ...], ...]:
    """:func:`linear_groups` with the groups that read one tensor merged: a parallel block whose MLP reads the
    attention's norm (Phi-2, StableLM, Cohere) has q/k/v and the MLP's input linears in one group, so that an AWQ
    input scale searched for all of them folds into that norm (and q/k/v still fuse into one ``MatMulNBits``)."""
    groups = linear_groups(cfg, index)
    if index is not None and cfg.is_moe(index):
        return groups
    attn, o, mlp, down = groups
    if cfg.parallel_residual and cfg.mlp_norm is None:
        return (attn + mlp, o, down)
    return (attn, o, mlp, down)


def input_stages(cfg: DecoderConfig, index: int) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """:func:`input_groups` in the stages of layer-wise calibration: the groups of one stage read inputs that no other
    group of the stage changes, so their statistics come from one run of the block.  Dense blocks: a group per stage;
    a mixture-of-experts block: attention input, o_proj, every expert's gate / up (the rows routed to it), every
    expert's down (its own gate / up quantized)."""
    groups = input_groups(cfg, index)
    if not cfg.is_moe(index):
        return tuple((grp,) for grp in groups)
    half = (len(groups) - 2) // 2
    return ((groups[0],), (groups[1],), groups[2 : 2 + half], groups[2 + half :])


def block_norms(cfg: DecoderConfig) -> list[str]:
    """A block's norms (suffixes), in graph order."""
    n = cfg.spec.names
    return [s for s in (n.attn_norm, n.attn_post_norm, cfg.mlp_norm, n.mlp_post_norm) if s is not None]


def norm_params(cfg: DecoderConfig, name: str) -> list[str]:
    """The tensors of the norm ``name``: its weight, and its bias for a LayerNorm."""
    return [f"{name}.weight"] + ([f"{name}.bias"] if cfg.spec.norm == "layer" and cfg.spec.norm_bias else [])


def float_linears(cfg: DecoderConfig, index: int) -> dict[str, tuple[int, int]]:
    """The linears of block ``index`` that stay float32 (suffix -> HF shape ``[N, K]``): a mixture-of-experts
    block's router and its shared expert's gate."""
    n = cfg.spec.names
    if not cfg.is_moe(index) or n.router is None:
        return {}
    out = {n.router: (cfg.num_experts, cfg.hidden_size)}
    if n.shared_expert_gate is not None:
        out[n.shared_expert_gate] = (1, cfg.hidden_size)
    return out


def block_tensor_names(cfg: DecoderConfig, index: int, has: Any) -> list[str]:
    """The checkpoint tensors of block ``index`` (``has(name)``: whether an optional bias exists)."""
    p = block_prefix(cfg, index)
    n = cfg.spec.names
    names = [t for s in block_norms(cfg) for t in norm_params(cfg, f"{p}.{s}")]
    names += [f"{p}.{s}.weight" for s in (n.q_norm, n.k_norm) if s is not None]
    names += [f"{p}.{n.sinks}"] if n.sinks is not None else []
    names += [f"{p}.{s}.weight" for s in linear_shapes(cfg, index)]
    names += [f"{p}.{s}.bias" for s in linear_shapes(cfg, index) if has(f"{p}.{s}.bias")]
    names += [f"{p}.{s}.weight" for s in float_linears(cfg, index)]
    names += [f"{p}.{s}.bias" for s in float_linears(cfg, index) if has(f"{p}.{s}.bias")]  # gpt-oss's router
    if cfg.is_moe(index) and n.router_choice_bias is not None:  # GLM-4.5's e_score_correction_bias
        names.append(f"{p}.{n.router_choice_bias}")
    if cfg.activation == "xielu":  # Apertus: the activation's own parameters
        names += [f"{p}.{n.act}.{k}" for k in XIELU_PARAMS if has(f"{p}.{n.act}.{k}")]
    return names


def check_checkpoint(cfg: DecoderConfig, ckpt: _Checkpoint) -> None:
    """Every tensor the build reads exists with the shape ``config.json`` implies - from the headers, before
    anything is allocated from the config's sizes.

    Raises:
        ModelError: naming the first missing or mis-shaped tensor.
    """
    H, V = cfg.hidden_size, cfg.vocab_size
    n = cfg.spec.names
    want: dict[str, tuple[int, ...]] = {f"{n.embed}.weight": (V, H)}
    if n.positions is not None:
        want[f"{n.positions}.weight"] = (cfg.max_position_embeddings + cfg.spec.position_offset, H)
    for norm in (n.final_norm, n.embed_norm):
        if norm is not None:
            want.update({t: (H,) for t in norm_params(cfg, norm)})
    if not (cfg.tie_word_embeddings or "lm_head.weight" not in ckpt):
        want["lm_head.weight"] = (V, H)
    if HEAD_BIAS in ckpt:
        want[HEAD_BIAS] = (V,)
    for i in range(cfg.num_hidden_layers):
        p = block_prefix(cfg, i)
        for s in block_norms(cfg):
            want.update({t: (H,) for t in norm_params(cfg, f"{p}.{s}")})
        for qk, heads in ((n.q_norm, cfg.num_attention_heads), (n.k_norm, cfg.num_key_value_heads)):
            if qk is not None:
                want[f"{p}.{qk}.weight"] = (cfg.head_dim * (heads if n.qk_norm_whole else 1),)
        for s, shape in linear_shapes(cfg, i).items():
            want[f"{p}.{s}.weight"] = shape
            if f"{p}.{s}.bias" in ckpt:
                want[f"{p}.{s}.bias"] = shape[:1]
        want.update({f"{p}.{s}.weight": shape for s, shape in float_linears(cfg, i).items()})
        if n.sinks is not None:
            want[f"{p}.{n.sinks}"] = (cfg.num_attention_heads,)
        if cfg.activation == "xielu":  # Apertus: the two learned scalars (beta and eps fall back to their defaults)
            want.update({f"{p}.{n.act}.{k}": (1,) for k in XIELU_PARAMS[:2]})
    missing = [t for t in want if t not in ckpt]
    if missing:
        raise ModelError(f"the checkpoint lacks tensor(s) {missing[:4]} ({len(missing)} in all) that config.json "
                         f"implies (model_type {cfg.model_type}, num_hidden_layers {cfg.num_hidden_layers}, "
                         f"tie_word_embeddings {cfg.tie_word_embeddings})")  # fmt: skip
    for t, expected in want.items():
        got = ckpt.shape(t)
        if got != expected:
            raise ModelError(f"tensor {t!r} in {str(ckpt.file(t))!r} has shape {list(got)}, config.json "
                             f"implies {list(expected)} (hidden_size {H}, vocab_size {V}, num_attention_heads "
                             f"{cfg.num_attention_heads}, num_key_value_heads {cfg.num_key_value_heads}, head_dim "
                             f"{cfg.head_dim}, intermediate_size {cfg.intermediate_size}"
                             + (f", experts {cfg.num_experts} of intermediate size {cfg.moe_intermediate_size}"
                                if cfg.num_experts else "") + ")")  # fmt: skip


def check_decoder_folder(folder: str | Path) -> DecoderConfig:
    """:func:`read_decoder_config` plus :func:`check_checkpoint`: the folder can be built, checked from the config
    and the safetensors headers only (no tensor is read)."""
    cfg = read_decoder_config(folder)
    check_checkpoint(cfg, _Checkpoint(Path(folder), cfg))
    return cfg


def norm_gamma(cfg: DecoderConfig, weight: Any) -> Any:
    """The factor a norm multiplies by: its weight, or ``1 + weight`` in float32 (Gemma's RMSNorm, Nemotron's
    LayerNorm1P)."""
    if cfg.spec.norm != "rms_offset" and not cfg.spec.gamma_offset:
        return weight
    return (np.float32(1.0) + _float32_rows(weight, 0, int(weight.shape[0]))).astype(np.float32)


def _fold_norm(gamma: Any, qs: list[PackedLinear | None], beta: Any = None
               ) -> tuple[Any, Any, list[PackedLinear | None]]:
    """Fold a shared AWQ input scale of the layers ``qs`` (all readers of the norm) into the norm weight (and a
    LayerNorm's bias ``beta``: ``(LN(x) * g + b) / s``); returns ``(gamma, beta, qs)``."""
    s = _common_scale(qs)
    if s is None:
        return gamma, beta, qs
    g32 = _float32_rows(gamma, 0, int(gamma.shape[0]))
    folded = (g32 / s).astype(np.float32)
    if beta is not None:
        beta = (_float32_rows(beta, 0, int(beta.shape[0])) / s).astype(np.float32)
    return folded, beta, [dataclasses.replace(q, input_scale=None) for q in qs if q is not None]


def _common_scale(qs: list[PackedLinear | None]) -> np.ndarray | None:
    """The AWQ input scale every layer of ``qs`` carries (float32), or None: no layers, a reader in float, one
    without a scale, or scales that differ."""
    scales = [q.input_scale for q in qs if q is not None and q.input_scale is not None]
    if not qs or len(scales) != len(qs):
        return None
    s = np.asarray(scales[0], np.float32)
    return None if any(not np.array_equal(np.asarray(t, np.float32), s) for t in scales[1:]) else s


def _fusable(qs: list[PackedLinear | None]) -> list[PackedLinear] | None:
    """The layers reading one input (q/k/v, gate/up) as one ``MatMulNBits`` when all are quantized alike.

    Concatenating along N is exact (every output column has its own scales / zero points); the decode step
    then runs one kernel instead of three (or two): onnxruntime-genai's builder does the same."""
    if any(q is None for q in qs):
        return None
    ps = [q for q in qs if q is not None]
    same = {(q.bits, q.block_size, q.K, q.accuracy_level, q.B.shape[1:]) for q in ps}
    if len(same) != 1 or any(q.input_scale is not None for q in ps):
        return None
    return ps


def _fused_linear(g: _GraphBuilder, x: str, prefix: str, qs: list[PackedLinear], biases: list[Any]) -> str:
    """One ``MatMulNBits`` named ``prefix`` computing ``[x W_0 | x W_1 | ...]`` (+ the biases, concatenated)."""
    bits = qs[0].bits
    zps = None
    if any(q.zero_points is not None for q in qs):  # a symmetric member gets its (packed) mid-grid zero points
        mid = 0x88 if bits == 4 else 0x80
        width = next(q.zero_points for q in qs if q.zero_points is not None).shape[1]
        zps = np.concatenate([q.zero_points if q.zero_points is not None else np.full((q.N, width), mid, np.uint8)
                              for q in qs])  # fmt: skip
    fused = PackedLinear(np.concatenate([q.B for q in qs]), np.concatenate([q.scales for q in qs]), zps, bits,
                         qs[0].block_size, qs[0].K, sum(q.N for q in qs), None, qs[0].accuracy_level)  # fmt: skip
    out = _matmul_nbits(g, x, prefix, fused)
    if any(b is not None for b in biases):
        bias = np.concatenate([_float32_rows(b, 0, q.N) if b is not None else np.zeros(q.N, np.float32)
                               for b, q in zip(biases, qs, strict=True)])  # fmt: skip
        out = g.node("Add", [out, g.external(f"{prefix}.bias", bias)], [f"{prefix}/bias_add/output_0"],
                     f"{prefix}/bias_add")[0]  # fmt: skip
    return out


def _fold_into_up(up: PackedLinear | None, down: PackedLinear | None, bias: Any
                  ) -> tuple[PackedLinear | None, PackedLinear | None, Any]:
    """Fold down_proj's AWQ input scale into up_proj's per-column scales (``silu(gate) * (up / s)``) when up is
    quantized: no ``Mul`` before down_proj (the same math, up to the rounding of the scales)."""
    if up is None or down is None or down.input_scale is None or up.input_scale is not None or up.N != down.K:
        return up, down, bias
    s = np.asarray(down.input_scale, np.float32)
    up = dataclasses.replace(up, scales=(up.scales / s[:, None]).astype(np.float32))
    if bias is not None:
        bias = (_float32_rows(bias, 0, up.N) / s).astype(np.float32)
    return up, dataclasses.replace(down, input_scale=None), bias


def _fold_into_gate_up(gate_up: PackedLinear | None, down: PackedLinear | None, bias: Any
                       ) -> tuple[PackedLinear | None, PackedLinear | None, Any]:
    """:func:`_fold_into_up` for a packed ``[gate | up]`` layer (Phi-3): the scale divides the up half's columns."""
    if (gate_up is None or down is None or down.input_scale is None or gate_up.input_scale is not None
            or gate_up.N != 2 * down.K):  # fmt: skip
        return gate_up, down, bias
    s = np.concatenate([np.ones(down.K, np.float32), np.asarray(down.input_scale, np.float32)])
    gate_up = dataclasses.replace(gate_up, scales=(gate_up.scales / s[:, None]).astype(np.float32))
    if bias is not None:
        bias = (_float32_rows(bias, 0, gate_up.N) / s).astype(np.float32)
    return gate_up, dataclasses.replace(down, input_scale=None), bias


def _mask_inputs(g: _GraphBuilder) -> tuple[str, str]:
    """``attention_mask`` -> seqlens_k (int32 ``[B]``, last valid index) and total_sequence_length (int32 scalar)."""
    base = "/model/attn_mask_reformat"
    rs = g.node("ReduceSum", ["attention_mask", g.const([1])], [f"{base}/ReduceSum/output_0"],
                f"{base}/ReduceSum", keepdims=0)[0]  # fmt: skip
    sub = g.node("Sub", [rs, g.const(1)], [f"{base}/Sub/output_0"], f"{base}/Sub")[0]
    seqlens_k = g.node("Cast", [sub], ["/model/seqlens_k"], f"{base}/Sub/Cast", to=TensorProto.INT32)[0]
    shp = g.node("Shape", ["attention_mask"], [f"{base}/Shape/output_0"], f"{base}/Shape")[0]
    tot = g.node("Gather", [shp, g.const(1)], [f"{base}/Gather/output_0"], f"{base}/Gather", axis=0)[0]
    total = g.node("Cast", [tot], ["/model/total_seq_len"], f"{base}/Gather/Cast", to=TensorProto.INT32)[0]
    return seqlens_k, total


def _rotary_inputs(g: _GraphBuilder, layers: Iterable[int], length: int | None, total_len: str
                   ) -> dict[bool, tuple[str, str]]:
    """The cos / sin caches GroupQueryAttention reads, by ``local`` (Gemma 3's sliding layers have their own).

    Initializers ``cos_cache`` / ``sin_cache`` (``_local``); with LongRoPE, two pairs (``_short`` / ``_long``)
    and an ``If`` on ``total_sequence_length > original_max_position_embeddings`` choosing one, as transformers
    does from the largest position of the call (onnxruntime-genai's builder does the same)."""
    cfg = g.cfg
    out: dict[bool, tuple[str, str]] = {}
    for local in sorted({cfg.is_local(i) for i in layers}):
        suffix = "_local" if local else ""
        limit = _longrope_limit(cfg.local_rope_scaling if local else cfg.rope_scaling)
        if limit is None:
            cos, sin = rotary_caches(cfg, length, local=local)
            out[local] = (g.external(f"cos_cache{suffix}", cos), g.external(f"sin_cache{suffix}", sin))
            continue
        branches = []
        for long in (True, False):
            cos, sin = rotary_caches(cfg, length, local=local, long=long)
            tag = "long" if long else "short"
            names = (g.external(f"cos_cache{suffix}_{tag}", cos), g.external(f"sin_cache{suffix}_{tag}", sin))
            outs = [f"cos_cache{suffix}/{tag}", f"sin_cache{suffix}/{tag}"]
            nodes = [helper.make_node("Identity", [src], [dst], name=f"{dst}/Identity")
                     for src, dst in zip(names, outs, strict=True)]  # fmt: skip
            vis = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [None, cfg.rotary_dim // 2]) for o in outs]
            branches.append(helper.make_graph(nodes, f"rotary{suffix}_{tag}", [], vis))
        cond = g.node("Greater", [total_len, g.const(limit, np.int32)], [f"/model/rotary{suffix}/long"],
                      f"/model/rotary{suffix}/Greater")[0]  # fmt: skip
        cos_name, sin_name = g.node("If", [cond], [f"cos_cache{suffix}", f"sin_cache{suffix}"], f"/model/rotary{suffix}/If",
                                    then_branch=branches[0], else_branch=branches[1])  # fmt: skip
        out[local] = (cos_name, sin_name)
    return out


def _norm(g: _GraphBuilder, name: str, x: str, skip: str | None, gamma: Any, beta: Any = None, *,
          out: str | None = None, residual_out: bool = True) -> tuple[str, str | None]:
    """The family's norm named ``name`` of ``x`` (plus ``skip``, the residual add fused in); returns
    ``(normalized, x + skip or None)``.

    RMSNorm: ``SkipSimplifiedLayerNormalization``, or standard ops without ``skip`` (:func:`_rms_norm`; ORT fuses
    them); LayerNorm: ``SkipLayerNormalization`` or ``LayerNormalization``.  ``gamma`` is the factor (Gemma's
    ``1 + w`` already added: :func:`norm_gamma`)."""
    eps = g.cfg.rms_norm_eps
    ln = g.external(f"{name}.weight", gamma)
    out = out or f"{name}/output_0"
    outs = [out, "", "", f"{name}/output_3"] if residual_out else [out]
    if g.cfg.spec.norm == "layer":  # the bias is optional in both (Cohere's LayerNorm has none)
        b = [g.external(f"{name}.bias", beta)] if beta is not None else []
        if skip is None:
            return g.node("LayerNormalization", [x, ln, *b], [out], name, axis=-1, epsilon=eps)[0], None
        res = g.node("SkipLayerNormalization", [x, skip, ln, *b], outs, name, _MS, epsilon=eps)
    else:
        if skip is None:
            return _rms_norm(g, x, ln, name, eps), None
        res = g.node("SkipSimplifiedLayerNormalization", [x, skip, ln], outs, name, _MS, epsilon=eps)
    return res[0], (res[3] if residual_out else None)


def _head_norm(g: _GraphBuilder, x: str, name: str, gamma: Any, heads: int) -> str:
    """RMSNorm of every head of ``x`` (``[B, S, heads * head_dim]``) over its ``head_dim`` (Qwen3, Gemma 3), or
    over the whole projection when the family says so (OLMo-2)."""
    if g.cfg.spec.names.qk_norm_whole:
        return _rms_norm(g, x, g.external(f"{name}.weight", gamma), name, g.cfg.rms_norm_eps)
    hd = g.cfg.head_dim
    r = g.node("Reshape", [x, g.const([0, 0, heads, hd])], [f"{name}/Reshape/output_0"], f"{name}/Reshape")[0]
    y = _rms_norm(g, r, g.external(f"{name}.weight", gamma), name, g.cfg.rms_norm_eps)
    return g.node("Reshape", [y, g.const([0, 0, heads * hd])], [f"{name}/Reshape_1/output_0"],
                  f"{name}/Reshape_1")[0]  # fmt: skip


XIELU_PARAMS = ("alpha_p", "alpha_n", "beta", "eps")
"""The tensors of Apertus' xIELU under the MLP's ``act_fn`` (``beta`` / ``eps``: buffers, 0.5 / -1e-6 if absent)."""


def _xielu(g: _GraphBuilder, x: str, name: str, params: dict[str, Any]) -> str:
    """xIELU: ``a_p x^2 + b x`` for ``x > 0``, else ``(exp(min(x, eps)) - 1 - x) a_n + b x``, with ``a_p =
    softplus(alpha_p)`` and ``a_n = b + softplus(alpha_n)`` computed at build time (float32)."""

    def scalar(key: str, default: float) -> np.float32:
        t = params.get(key)
        return np.float32(default if t is None else np.asarray(_float32_rows(np.reshape(t, (-1,)), 0, 1))[0])

    beta, eps = scalar("beta", 0.5), scalar("eps", -1e-6)
    ap = np.float32(np.logaddexp(np.float32(0), scalar("alpha_p", 0.0)))
    an = np.float32(beta + np.logaddexp(np.float32(0), scalar("alpha_n", 0.0)))

    def c(v: np.float32) -> str:
        return g.const(v, np.float32)

    def op(kind: str, ins: list[str], tag: str) -> str:
        return g.node(kind, ins, [f"{name}/{tag}/output_0"], f"{name}/{tag}")[0]

    bx = op("Mul", [x, c(beta)], "beta_x")
    pos = op("Add", [op("Mul", [op("Mul", [x, x], "x2"), c(ap)], "ap_x2"), bx], "positive")
    em1 = op("Sub", [op("Exp", [op("Min", [x, c(eps)], "min")], "exp"), c(np.float32(1))], "expm1")
    neg = op("Add", [op("Mul", [op("Sub", [em1, x], "sub"), c(an)], "an_mul"), bx], "negative")
    return g.node("Where", [op("Greater", [x, c(np.float32(0))], "gt0"), pos, neg], [f"{name}/output_0"],
                  f"{name}/Where")[0]  # fmt: skip


def _activation(g: _GraphBuilder, x: str, name: str, params: dict[str, Any] | None = None) -> str:
    """The MLP's activation named ``name``: SiLU as ``Sigmoid`` x ``Mul``; GELU (tanh or exact) as ONNX ``Gelu``;
    ReLU squared as ``Relu`` x ``Mul``; xIELU in standard ops (``params``: its tensors, :data:`XIELU_PARAMS`)."""
    kind = g.cfg.activation
    if kind == "xielu":  # Apertus
        return _xielu(g, x, name, params or {})
    if kind == "relu2":  # ReLU squared (Arcee)
        r = g.node("Relu", [x], [f"{name}/Relu/output_0"], f"{name}/Relu")[0]
        return g.node("Mul", [r, r], [f"{name}/output_0"], f"{name}/Mul")[0]
    if kind == "relu":  # OPT
        return g.node("Relu", [x], [f"{name}/output_0"], f"{name}/Relu")[0]
    if kind == "silu":
        sig = g.node("Sigmoid", [x], [f"{name}/Sigmoid/output_0"], f"{name}/Sigmoid")[0]
        return g.node("Mul", [x, sig], [f"{name}/output_0"], f"{name}/Mul")[0]
    return g.node("Gelu", [x], [f"{name}/output_0"], name, approximate="tanh" if kind == "gelu_tanh" else "none")[0]


@dataclass
class _BlockIO:
    residual: str
    pending: str | None
    taps: dict[str, str]  # linear layer name -> the tensor it reads
    stream: str = "input_ids"  # a graph input whose second dimension is the sequence length


def _emit_block(g: _GraphBuilder, i: int, w: dict[str, Any], io: _BlockIO, packed: dict[str, PackedLinear],
                seqlens_k: str, total_len: str, rotary: dict[bool, tuple[str, str]]) -> _BlockIO:
    """Append decoder block ``i`` (weights ``w`` by graph name, consumed) after ``io``; return the new stream."""
    cfg = g.cfg
    fam, n = cfg.spec, cfg.spec.names
    p = block_prefix(cfg, i)
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = linear_shapes(cfg, i)
    for s, shape in shapes.items():
        _check_shape(f"{p}.{s}.weight", w[f"{p}.{s}.weight"], shape)
    q = {s: packed.get(f"{p}.{s}") for s in shapes}
    groups = linear_groups(cfg, i)
    attn_in, (o_proj,) = groups[0], groups[1]
    moe = cfg.is_moe(i)
    # a mixture-of-experts block's MLP input is read by the router and the experts: no AWQ scale folds into its norm
    mlp_in, down_proj = ((), "") if moe else (groups[2], groups[3][0])
    taps: dict[str, str] = {}
    residual, pending = io.residual, io.pending

    def norm(role: str, x: str, skip: str | None, readers: tuple[str, ...] = ()) -> tuple[str, str | None]:
        # an AWQ scale shared by the norm's readers (q/k/v, gate/up) folds into its weight
        name = f"{p}.{role}"
        gamma, beta, folded = _fold_norm(norm_gamma(cfg, w.pop(f"{name}.weight")), [q[s] for s in readers],
                                         w.pop(f"{name}.bias", None))  # fmt: skip
        q.update(dict(zip(readers, folded, strict=True)))
        return _norm(g, name, x, skip, gamma, beta)

    # input norm (+ the residual add of the previous block, or of the learned positions); in a parallel block
    # whose MLP reads the same norm (Phi-2), an AWQ scale folds into it only when all of its readers share one
    mlp_norm = cfg.mlp_norm
    shared = cfg.parallel_residual and mlp_norm is None
    if n.attn_norm is None:  # OLMo-2: attention reads the stream itself
        if pending is not None:
            residual = g.node("Add", [residual, pending], [f"{p}/input_add/output_0"], f"{p}/input_add")[0]
        h = residual
    else:
        h, added = norm(n.attn_norm, residual, pending, attn_in + (mlp_in if shared else ()))
        residual = added or residual
    for s in attn_in:
        taps[f"{p}.{s}"] = h
    # an AWQ scale no norm took (OLMo-2): one Mul for q/k/v (h itself stays unscaled: a parallel MLP reads it too)
    h_attn = _shared_scale(g, h, f"{p}/attn_input_scale", q, attn_in)
    fused = None if fam.qk_norm or len(attn_in) == 1 else _fusable([q[s] for s in attn_in])
    if fused:  # one MatMulNBits for q/k/v; GroupQueryAttention takes the packed [q | k | v] as its query
        qname = f"{p}.{attn_in[0].rsplit('.', 1)[0]}.qkv_proj"
        packed_qkv = _fused_linear(g, h_attn, qname, fused, [w.pop(f"{p}.{s}.bias", None) for s in attn_in])
        for s in attn_in:
            w.pop(f"{p}.{s}.weight")
        qkv = [packed_qkv, "", ""]
    else:
        qkv = [_linear(g, h_attn, f"{p}.{s}", w.pop(f"{p}.{s}.weight"), w.pop(f"{p}.{s}.bias", None), q[s])
               for s in attn_in]  # fmt: skip
        if len(qkv) == 1:  # a packed checkpoint weight (Phi-3's qkv_proj, GPT-2's c_attn)
            qkv += ["", ""]
        if n.q_norm is not None and n.k_norm is not None and not fam.qk_norm_after_rope:  # RMSNorm per head (or
            # whole) before the rotary embedding
            qkv[0] = _head_norm(g, qkv[0], f"{p}.{n.q_norm}", norm_gamma(cfg, w.pop(f"{p}.{n.q_norm}.weight")), nh)
            qkv[1] = _head_norm(g, qkv[1], f"{p}.{n.k_norm}", norm_gamma(cfg, w.pop(f"{p}.{n.k_norm}.weight")), nkv)
    if cfg.clip_qkv is not None:  # OLMo 1: q, k, v clamped after their projections
        lo, hi = g.const(np.float32(-cfg.clip_qkv), np.float32), g.const(np.float32(cfg.clip_qkv), np.float32)
        qkv = [g.node("Clip", [x, lo, hi], [f"{p}/qkv_clip_{j}/output_0"], f"{p}/qkv_clip_{j}")[0] if x else x
               for j, x in enumerate(qkv)]  # fmt: skip
    rotate_inside = cfg.uses_rope(i) and not cfg.external_rotary
    if cfg.uses_rope(i) and cfg.external_rotary:  # q and k rotated before the attention (RotaryEmbedding)
        if not qkv[1]:  # packed [q | k | v]: split
            qkv = g.node("Split", [qkv[0], g.const([nh * cfg.head_dim, nkv * cfg.head_dim, nkv * cfg.head_dim])],
                         [f"{p}/qkv_split/output_{j}" for j in range(3)], f"{p}/qkv_split", axis=-1)  # fmt: skip
        cos, sin = rotary[cfg.is_local(i)]
        qkv[0] = _rotate(g, qkv[0], f"{p}/q_rotary", nh, cos, sin)
        qkv[1] = _rotate(g, qkv[1], f"{p}/k_rotary", nkv, cos, sin)
    if fam.qk_norm_after_rope and n.q_norm is not None and n.k_norm is not None:  # Hunyuan: norms of the rotated q, k
        qkv[0] = _head_norm(g, qkv[0], f"{p}.{n.q_norm}", norm_gamma(cfg, w.pop(f"{p}.{n.q_norm}.weight")), nh)
        qkv[1] = _head_norm(g, qkv[1], f"{p}.{n.k_norm}", norm_gamma(cfg, w.pop(f"{p}.{n.k_norm}.weight")), nkv)
    attrs = {"num_heads": nh, "kv_num_heads": nkv, "scale": cfg.scale(i), "do_rotary": int(rotate_inside),
             "rotary_interleaved": int(fam.rotary_interleaved), "local_window_size": cfg.window(i) or -1, "softcap": cfg.attn_softcap or 0.0}
    ins = [*qkv, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total_len]
    if rotate_inside:
        ins += list(rotary[cfg.is_local(i)])
    if fam.alibi:  # inputs 7-9 (cos / sin caches, position ids) unused
        ins += [""] * (10 - len(ins)) + [_alibi_bias(g, io.stream)]
    if n.sinks is not None:  # Granite SWA: input 11, a logit per head added to every softmax's denominator
        sinks = _float32_rows(w.pop(f"{p}.{n.sinks}"), 0, nh)
        ins += [""] * (11 - len(ins)) + [g.external(f"{p}.{n.sinks}", sinks)]
    name = f"{p}.{o_proj.rsplit('.', 1)[0]}.GroupQueryAttention"
    attn = g.node("GroupQueryAttention", ins, [f"{name}/output_0", f"present.{i}.key", f"present.{i}.value"], name,
                  _MS, **attrs)[0]  # fmt: skip
    taps[f"{p}.{o_proj}"] = attn
    o = _linear(g, attn, f"{p}.{o_proj}", w.pop(f"{p}.{o_proj}.weight"), w.pop(f"{p}.{o_proj}.bias", None),
                q[o_proj])  # fmt: skip
    if n.attn_post_norm is not None:  # Gemma 2: a norm of the attention output before the residual add
        o, _ = norm(n.attn_post_norm, o, None)
    o = _residual_scaled(g, o, f"{p}.{o_proj}")
    if cfg.parallel_residual:
        if mlp_norm is not None:  # GPT-NeoX: the MLP's own norm of the block input (else it reads h, shared)
            h, _ = norm(mlp_norm, residual, None, mlp_in)
    elif mlp_norm is None:  # OLMo-2: the MLP reads the stream itself
        residual = g.node("Add", [residual, o], [f"{p}/attn_add/output_0"], f"{p}/attn_add")[0]
        h = residual
    else:
        h, added = norm(mlp_norm, residual, o, mlp_in)
        assert added is not None  # noqa: S101 - a norm with a skip input returns the sum
        residual = added
    for s in mlp_in:
        taps[f"{p}.{s}"] = h
    h = _shared_scale(g, h, f"{p}/mlp_input_scale", q, mlp_in)
    a = f"{p}.{n.act}"
    act_params = {k: w.pop(f"{a}.{k}") for k in XIELU_PARAMS if f"{a}.{k}" in w}
    if moe:
        mlp_out = _moe_mlp(g, i, h, w, q, taps)
        assert n.router is not None  # noqa: S101 - a MoE family names its router
        down_proj = n.router.rsplit(".", 1)[0]  # the block's MLP (mlp, block_sparse_moe) names its output's nodes
    elif fam.mlp == "plain":  # GPT-2: down(act(fc(x)))
        assert n.up is not None  # noqa: S101 - a plain MLP has its first linear as `up`
        prod = _activation(g, _linear(g, h, f"{p}.{n.up}", w.pop(f"{p}.{n.up}.weight"), w.pop(f"{p}.{n.up}.bias", None),
                                      q[n.up]), a, act_params)  # fmt: skip
    elif n.gate_up is not None:  # Phi-3: one packed [gate | up] weight, split after the MatMul
        gu_bias = w.pop(f"{p}.{n.gate_up}.bias", None)
        q[n.gate_up], q[down_proj], gu_bias = _fold_into_gate_up(q[n.gate_up], q[down_proj], gu_bias)
        gu = _linear(g, h, f"{p}.{n.gate_up}", w.pop(f"{p}.{n.gate_up}.weight"), gu_bias, q[n.gate_up])
        half = g.const([cfg.intermediate_size, cfg.intermediate_size])
        gate, up = g.node("Split", [gu, half], [f"{p}.mlp/Split/output_0", f"{p}.mlp/Split/output_1"],
                          f"{p}.mlp/Split", axis=-1)  # fmt: skip
        prod = g.node("Mul", [_activation(g, gate, a), up], [f"{p}.mlp/Mul/output_0"], f"{p}.mlp/Mul")[0]
    else:
        # gate and up stay two MatMulNBits: fused, the Split after them cost more per decoded token (0.72 ms for
        # 30 on SmolLM2) than the saved kernel launches
        assert n.gate is not None and n.up is not None  # noqa: S101 - a gated MLP without gate_up has both
        up_bias = w.pop(f"{p}.{n.up}.bias", None)
        q[n.up], q[down_proj], up_bias = _fold_into_up(q[n.up], q[down_proj], up_bias)
        gate = _linear(g, h, f"{p}.{n.gate}", w.pop(f"{p}.{n.gate}.weight"), w.pop(f"{p}.{n.gate}.bias", None),
                       q[n.gate])  # fmt: skip
        up = _linear(g, h, f"{p}.{n.up}", w.pop(f"{p}.{n.up}.weight"), up_bias, q[n.up])
        prod = g.node("Mul", [_activation(g, gate, a), up], [f"{p}.mlp/Mul/output_0"], f"{p}.mlp/Mul")[0]
    if not moe:
        taps[f"{p}.{down_proj}"] = prod
        mlp_out = _linear(g, prod, f"{p}.{down_proj}", w.pop(f"{p}.{down_proj}.weight"),
                          w.pop(f"{p}.{down_proj}.bias", None), q[down_proj])  # fmt: skip
    if n.mlp_post_norm is not None:  # Gemma 2: a norm of the MLP output before the residual add
        mlp_out, _ = norm(n.mlp_post_norm, mlp_out, None)
    pending = _residual_scaled(g, mlp_out, f"{p}.{down_proj}")
    if cfg.parallel_residual:  # x + (attn + mlp), the order transformers adds them in
        pending = g.node("Add", [o, pending], [f"{p}/parallel_add/output_0"], f"{p}/parallel_add")[0]
    return _BlockIO(residual, pending, taps, io.stream)


def _gated_mlp(g: _GraphBuilder, x: str, p: str, roles: tuple[str, str, str], w: dict[str, Any],
               q: dict[str, PackedLinear | None], taps: dict[str, str]) -> str:
    """``down(act(gate(x)) * up(x))`` of the linears ``roles`` (suffixes after ``p``), recording what each reads."""
    gate_s, up_s, down_s = roles
    for s in (gate_s, up_s):
        taps[f"{p}.{s}"] = x
    x = _shared_scale(g, x, f"{p}.{gate_s.rsplit('.', 1)[0]}/input_scale", q, (gate_s, up_s))
    up_bias = w.pop(f"{p}.{up_s}.bias", None)
    oss = g.cfg.activation == "swiglu_oss"
    if not oss:  # (gpt-oss's up is clamped and shifted: a scale of its columns does not pass through)
        q[up_s], q[down_s], up_bias = _fold_into_up(q[up_s], q[down_s], up_bias)
    gate = _linear(g, x, f"{p}.{gate_s}", w.pop(f"{p}.{gate_s}.weight"), w.pop(f"{p}.{gate_s}.bias", None), q[gate_s])
    up = _linear(g, x, f"{p}.{up_s}", w.pop(f"{p}.{up_s}.weight"), up_bias, q[up_s])
    name = f"{p}.{gate_s.rsplit('.', 1)[0]}"
    if oss:  # (clip(up, -l, l) + 1) * g * sigmoid(alpha g), g = min(gate, l)
        lim = g.const(g.cfg.swiglu_limit, np.float32)
        gate = g.node("Min", [gate, lim], [f"{name}/gate_clamp/output_0"], f"{name}/gate_clamp")[0]
        neg = g.const(-g.cfg.swiglu_limit, np.float32)
        up = g.node("Clip", [up, neg, lim], [f"{name}/up_clamp/output_0"], f"{name}/up_clamp")[0]
        up = g.node("Add", [up, g.const(1.0, np.float32)], [f"{name}/up_shift/output_0"], f"{name}/up_shift")[0]
        ag = g.node("Mul", [gate, g.const(g.cfg.swiglu_alpha, np.float32)], [f"{name}/gate_alpha/output_0"],
                    f"{name}/gate_alpha")[0]  # fmt: skip
        sig = g.node("Sigmoid", [ag], [f"{name}/Sigmoid/output_0"], f"{name}/Sigmoid")[0]
        glu = g.node("Mul", [gate, sig], [f"{name}/glu/output_0"], f"{name}/glu")[0]
        prod = g.node("Mul", [glu, up], [f"{name}/Mul/output_0"], f"{name}/Mul")[0]
    else:
        prod = g.node("Mul", [_activation(g, gate, f"{name}.act_fn"), up], [f"{name}/Mul/output_0"],
                      f"{name}/Mul")[0]  # fmt: skip
    taps[f"{p}.{down_s}"] = prod
    return _linear(g, prod, f"{p}.{down_s}", w.pop(f"{p}.{down_s}.weight"), w.pop(f"{p}.{down_s}.bias", None),
                   q[down_s])  # fmt: skip


QMOE_BLOCK_SIZES = (16, 32, 64, 128)
"""Block sizes of ONNX Runtime 1.32's CPU ``QMoE`` kernel for 4-bit weights (per-channel runs too, ~5x slower)."""


def _qmoe_weights(cfg: DecoderConfig, experts: list[tuple[PackedLinear | None, ...]]) -> Any:
    """The routed experts ``[(gate, up, down), ...]`` as ``QMoE`` inputs, or None when one ``QMoE`` node cannot run
    them as packed: ``((fc1 B, scales, zero points), (fc2 ...), bits, block_size, accuracy_level)``.

    ONNX Runtime 1.32's CPU kernel (measured: docs/llm-families.md) takes ``[experts, N, K]`` weights in
    ``MatMulNBits``' byte order (two 4-bit codes per byte, the even one low; zero point 8 when none is given; scales
    and packed zero points per block), fc1 the gate and up rows interleaved (``swiglu_fusion=1``: gate 0, up 0, gate 1,
    ...), and SiLU-gated experts only.  It needs every expert in float32 activations at 4 bits with one block size and
    one accuracy level (at 8 bits it quantizes the activations whatever the level), no AWQ input scale (its experts
    share one input) and ``K`` a multiple of the block; otherwise the standard-op dispatch is written."""
    flat = [t for trio in experts for t in trio]
    if cfg.activation not in ("silu", "swiglu_oss") or not flat or any(t is None for t in flat):
        return None
    ps = [t for t in flat if t is not None]
    if len({(t.bits, t.block_size, t.accuracy_level) for t in ps}) != 1 or ps[0].bits != 4:
        return None
    bits, bs, level = ps[0].bits, ps[0].block_size, ps[0].accuracy_level
    if bs not in QMOE_BLOCK_SIZES or any(t.K % bs or t.input_scale is not None or t.hot is not None for t in ps):
        return None
    mid = 0x88

    def arrays(ts: list[PackedLinear]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        B = np.stack([t.B.reshape(t.N, -1) for t in ts])
        S = np.stack([t.scales.reshape(t.N, -1) for t in ts]).astype(np.float32)
        if all(t.zero_points is None for t in ts):
            return B, S, None
        width = next(t.zero_points for t in ts if t.zero_points is not None).shape[-1]
        Z = np.stack([t.zero_points.reshape(t.N, -1) if t.zero_points is not None
                      else np.full((t.N, width), mid, np.uint8) for t in ts])  # fmt: skip
        return B, S, Z

    def interleave(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
        if a is None or b is None:
            return None
        out = np.empty((a.shape[0], 2 * a.shape[1], *a.shape[2:]), a.dtype)
        out[:, 0::2], out[:, 1::2] = a, b
        return out

    trios = [(g, u, d) for g, u, d in experts if g is not None and u is not None and d is not None]
    gate, up, down = (arrays([t[j] for t in trios]) for j in range(3))
    if (gate[2] is None) != (up[2] is None):  # one of them symmetric: its zero points written as the mid level
        width = (gate[2] if gate[2] is not None else up[2]).shape[-1]  # type: ignore[union-attr]
        fill = np.full((*gate[0].shape[:2], width), mid, np.uint8)
        gate = (gate[0], gate[1], gate[2] if gate[2] is not None else fill)
        up = (up[0], up[1], up[2] if up[2] is not None else fill)
    fc1 = (interleave(gate[0], up[0]), interleave(gate[1], up[1]), interleave(gate[2], up[2]))
    return fc1, down, bits, bs, 4 if level == 4 else 0


def _moe_mlp(g: _GraphBuilder, i: int, h: str, w: dict[str, Any], q: dict[str, PackedLinear | None],
             taps: dict[str, str]) -> str:
    """Block ``i``'s mixture of experts on the normed stream ``h`` ``[B, S, H]``, in standard ops (+ ``MatMulNBits``).

    The router (float32) gives each token's expert logits; their softmax's ``experts_per_token`` largest probabilities
    (``TopK``; renormalized when :attr:`DecoderConfig.norm_topk_prob`) weight the outputs of those experts.  Expert
    ``e`` runs on the rows routed to it only (``NonZero`` of ``top_indices == e``, ``Gather``), its weighted output
    added back into their rows (``ScatterND`` with ``reduction="add"``, in expert order as transformers' index_add);
    a shared expert (Qwen2-MoE) runs on every row, scaled by the sigmoid of its gate.  An expert no token is routed to
    runs on zero rows.  The taps of expert ``e``'s gate / up are its routed rows: layer-wise calibration gathers the
    statistics of exactly the tokens each expert sees."""
    cfg = g.cfg
    n, p = cfg.spec.names, block_prefix(cfg, i)
    assert n.router is not None  # noqa: S101 - a MoE family names its router
    H = cfg.hidden_size
    m = f"{p}.{n.router.rsplit('.', 1)[0]}"
    x = g.node("Reshape", [h, g.const([-1, H])], [f"{m}/tokens/output_0"], f"{m}/tokens")[0]
    logits = _linear(g, x, f"{p}.{n.router}", w.pop(f"{p}.{n.router}.weight"), w.pop(f"{p}.{n.router}.bias", None),
                     None)  # fmt: skip

    def probs() -> str:  # the softmax over all experts (ONNX Runtime runs every node: written only where read)
        return g.node("Softmax", [logits], [f"{m}/router_softmax/output_0"], f"{m}/router_softmax", axis=-1)[0]

    experts = expert_linears(cfg)
    if has_shared_expert(cfg):  # every row (Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x)))
        shared = _gated_mlp(g, x, p, experts.pop(0), w, q, taps)
        if n.shared_expert_gate is not None:
            sg = _linear(g, x, f"{p}.{n.shared_expert_gate}", w.pop(f"{p}.{n.shared_expert_gate}.weight"), None,
                         None)  # fmt: skip
            sig = g.node("Sigmoid", [sg], [f"{p}.{n.shared_expert_gate}/Sigmoid/output_0"],
                         f"{p}.{n.shared_expert_gate}/Sigmoid")[0]  # fmt: skip
            shared = g.node("Mul", [shared, sig], [f"{p}.{n.shared_expert}/gated/output_0"],
                            f"{p}.{n.shared_expert}/gated")[0]  # fmt: skip
    else:
        shared = None
    weights_apart = cfg.moe_routing != "softmax"  # routing weights computed apart from the choice of experts
    choice = weights = None
    if cfg.moe_routing == "sparsemixer":  # Phi-3.5-MoE: the logits choose, the sparse mixer weighs
        choice, weights = logits, _sparsemixer_weights(g, logits, m)
    elif weights_apart:  # DeepSeek-V3 / GLM-4.5: sigmoid scores; the choice adds a bias and keeps the best groups
        choice, weights = _biased_routing(g, logits, m, w.pop(f"{p}.{n.router_choice_bias}"))
    fused = None if g.tapped else _qmoe_weights(cfg, [tuple(q[s] for s in roles) for roles in experts])
    if weights_apart and fused is None:  # the float MoE kernel takes no routing weights of its own: the dispatch
        float_kernel = False
    else:
        float_kernel = not g.tapped
    # gpt-oss's gated unit in the kernels' terms: (clip(up) + beta) * g * sigmoid(alpha g), g = min(gate, limit)
    act = ({"activation_alpha": cfg.swiglu_alpha, "activation_beta": 1.0, "swiglu_limit": cfg.swiglu_limit}
           if cfg.activation == "swiglu_oss" else {})  # fmt: skip

    def biases() -> tuple[str, str]:  # fc1 (gate / up interleaved) and fc2 biases of the experts, "" when none
        have = [f"{p}.{s}.bias" in w for roles in experts for s in roles]
        if not any(have):
            return "", ""
        shapes = linear_shapes(cfg, i)

        def one(s: str) -> np.ndarray:
            b = w.pop(f"{p}.{s}.bias", None)
            return np.zeros(shapes[s][0], np.float32) if b is None else _float32_rows(b, 0, shapes[s][0])

        gate = np.stack([one(r[0]) for r in experts])
        up = np.stack([one(r[1]) for r in experts])
        fc1 = np.empty((gate.shape[0], 2 * gate.shape[1]), np.float32)
        fc1[:, 0::2], fc1[:, 1::2] = gate, up
        fc2 = np.stack([one(r[2]) for r in experts])
        return (g.external(f"{p}.{n.experts}.fc1.bias", fc1), g.external(f"{p}.{n.experts}.fc2.bias", fc2))

    if fused is not None:  # one QMoE node: the routed experts' 4-bit weights stacked, ONNX Runtime's CPU kernel
        for roles in experts:
            for s in roles:
                w.pop(f"{p}.{s}.weight")
        (b1, s1, z1), (b2, s2, z2), bits, bs, level = fused
        bias1, bias2 = biases()
        ins = [x, logits, g.external(f"{p}.{n.experts}.fc1.weight_Q{bits}", b1),
               g.external(f"{p}.{n.experts}.fc1.weight_scales", s1), bias1,
               g.external(f"{p}.{n.experts}.fc2.weight_Q{bits}", b2),
               g.external(f"{p}.{n.experts}.fc2.weight_scales", s2), bias2, "", "", "",
               g.external(f"{p}.{n.experts}.fc1.weight_zero_points", z1) if z1 is not None else "",
               g.external(f"{p}.{n.experts}.fc2.weight_zero_points", z2) if z2 is not None else "", ""]  # fmt: skip
        if choice is not None and weights is not None:  # the choice picks the experts, the weights weight them
            ins[1] = choice
            ins.append(weights)
        elif not cfg.norm_topk_prob:  # the kernel renormalizes the top-k of its own softmax unless given the weights
            ins.append(probs())
        # (routing weights given as they are - DeepSeek-style routing: no renormalization inside)
        out = g.node("QMoE", ins, [f"{p}.{n.experts}/output_0"], f"{p}.{n.experts}", _MS, k=cfg.experts_per_token,
                     activation_type="swiglu", swiglu_fusion=1,
                     normalize_routing_weights=0 if choice is not None else int(cfg.norm_topk_prob),
                     expert_weight_bits=bits, block_size=bs, weights_prepacked=0, accuracy_level=level,
                     **act)[0]  # fmt: skip
    elif (float_kernel and cfg.activation in ("silu", "swiglu_oss")
          and all(q[s] is None for roles in experts for s in roles)):  # fmt: skip
        # float experts: ONNX Runtime's CPU MoE kernel, the same layout in float32 (fc1 gate / up rows interleaved)
        def stack(j: int) -> np.ndarray:
            return np.stack([_float32_rows(w.pop(f"{p}.{roles[j]}.weight"), 0, shapes[roles[j]][0])
                             for roles in experts])  # fmt: skip

        shapes = linear_shapes(cfg, i)
        gate, up = stack(0), stack(1)
        fc1 = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
        fc1[:, 0::2], fc1[:, 1::2] = gate, up
        del gate, up
        bias1, bias2 = biases()
        out = g.node("MoE", [x, logits, g.external(f"{p}.{n.experts}.fc1.weight", fc1), bias1,
                             g.external(f"{p}.{n.experts}.fc2.weight", stack(2)), bias2],
                     [f"{p}.{n.experts}/output_0"], f"{p}.{n.experts}", _MS, k=cfg.experts_per_token,
                     activation_type="swiglu", swiglu_fusion=1,
                     normalize_routing_weights=int(cfg.norm_topk_prob), **act)[0]  # fmt: skip
        del fc1
    else:  # the standard-op dispatch: each expert on the rows routed to it
        if choice is not None and weights is not None:
            top_i = g.node("TopK", [choice, g.const([cfg.experts_per_token])],
                           [f"{m}/router_topk/values", f"{m}/router_topk/indices"], f"{m}/router_topk", axis=-1)[1]
            top_w = g.node("GatherElements", [weights, top_i], [f"{m}/router_weights/output_0"], f"{m}/router_weights",
                           axis=-1)[0]  # fmt: skip
        else:
            top_w, top_i = g.node("TopK", [probs(), g.const([cfg.experts_per_token])],
                                  [f"{m}/router_topk/values", f"{m}/router_topk/indices"], f"{m}/router_topk", axis=-1)
        if cfg.norm_topk_prob and choice is None:
            total = g.node("ReduceSum", [top_w, g.const([-1])], [f"{m}/router_norm/sum"], f"{m}/router_norm/sum",
                           keepdims=1)[0]  # fmt: skip
            top_w = g.node("Div", [top_w, total], [f"{m}/router_norm/output_0"], f"{m}/router_norm")[0]
        shape = g.node("Shape", [x], [f"{m}/zeros/shape"], f"{m}/zeros/shape")[0]
        out = g.node("ConstantOfShape", [shape], [f"{m}/zeros/output_0"], f"{m}/zeros",
                     value=onnx.numpy_helper.from_array(np.zeros(1, np.float32)))[0]  # fmt: skip
        zero = g.const(0)
        for e, roles in enumerate(experts):
            en = f"{p}.{n.experts}.{e}"
            sel = g.node("Equal", [top_i, g.const(e)], [f"{en}/routed/output_0"], f"{en}/routed")[0]
            where = g.node("NonZero", [sel], [f"{en}/where/output_0"], f"{en}/where")[0]  # [2, rows]: token, slot
            rows = g.node("Gather", [where, zero], [f"{en}/rows/output_0"], f"{en}/rows", axis=0)[0]
            xe = g.node("Gather", [x, rows], [f"{en}/input/output_0"], f"{en}/input", axis=0)[0]
            ye = _gated_mlp(g, xe, p, roles, w, q, taps)
            slots = g.node("Transpose", [where], [f"{en}/slots/output_0"], f"{en}/slots", perm=[1, 0])[0]
            we = g.node("GatherND", [top_w, slots], [f"{en}/weight/output_0"], f"{en}/weight")[0]
            we = g.node("Unsqueeze", [we, g.const([-1])], [f"{en}/weight/column"], f"{en}/weight/column")[0]
            ye = g.node("Mul", [ye, we], [f"{en}/weighted/output_0"], f"{en}/weighted")[0]
            idx = g.node("Unsqueeze", [rows, g.const([-1])], [f"{en}/rows/column"], f"{en}/rows/column")[0]
            out = g.node("ScatterND", [out, idx, ye], [f"{en}/add/output_0"], f"{en}/add", reduction="add")[0]
    if shared is not None:
        out = g.node("Add", [out, shared], [f"{m}/shared_add/output_0"], f"{m}/shared_add")[0]
    hshape = g.node("Shape", [h], [f"{m}/stream/shape"], f"{m}/stream/shape")[0]
    return g.node("Reshape", [out, hshape], [f"{m}/output_0"], f"{m}/output")[0]


def _sparsemixer_weights(g: _GraphBuilder, logits: str, m: str) -> str:
    """Phi-3.5-MoE's routing weights ``[T, E]`` (inference: no sampling) from the router ``logits``: the best expert's
    weight is the softmax, at it, of the logits within ``2 eps`` of the best (relative to ``max(|logit|, best)``;
    the rest -inf); the second's the same over the logits without the best one, relative to the second-best;
    every other expert 0.  The logits' top-2 are the experts chosen."""
    cfg = g.cfg
    eps2 = g.const(2.0 * cfg.router_jitter_noise, np.float32)
    ninf = g.const(-np.inf, np.float32)
    zero = g.const(0.0, np.float32)
    absl = g.node("Abs", [logits], [f"{m}/mixer/abs"], f"{m}/mixer/abs")[0]
    idx = g.node("Range", [g.const(0), g.const(cfg.num_experts), g.const(1)], [f"{m}/mixer/experts"],
                 f"{m}/mixer/experts")[0]  # fmt: skip
    scores, picked = logits, []
    for j in (1, 2):
        t = f"{m}/mixer/top{j}"
        best = g.node("ReduceMax", [scores, g.const([-1])], [f"{t}/max"], f"{t}/max", keepdims=1)[0]
        arg = g.node("ArgMax", [scores], [f"{t}/argmax"], f"{t}/argmax", axis=-1, keepdims=1)[0]
        factor = g.node("Max", [absl, best], [f"{t}/factor"], f"{t}/factor")[0]
        gap = g.node("Sub", [best, logits], [f"{t}/gap"], f"{t}/gap")[0]
        rel = g.node("Div", [gap, factor], [f"{t}/rel"], f"{t}/rel")[0]
        far = g.node("Greater", [rel, eps2], [f"{t}/far"], f"{t}/far")[0]
        masked = g.node("Where", [far, ninf, scores], [f"{t}/masked"], f"{t}/masked")[0]
        soft = g.node("Softmax", [masked], [f"{t}/softmax"], f"{t}/softmax", axis=-1)[0]
        hit = g.node("Equal", [idx, arg], [f"{t}/hit"], f"{t}/hit")[0]  # [T, E]: the chosen expert
        picked.append(g.node("Where", [hit, soft, zero], [f"{t}/weight"], f"{t}/weight")[0])
        if j == 1:  # the best one out of the second choice
            scores = g.node("Where", [hit, ninf, logits], [f"{t}/without"], f"{t}/without")[0]
    return g.node("Add", picked, [f"{m}/mixer/output_0"], f"{m}/mixer")[0]


def _biased_routing(g: _GraphBuilder, logits: str, m: str, bias: Any) -> tuple[str, str]:
    """DeepSeek-V3 / GLM-4.5's routing of the router ``logits`` ``[T, E]``: ``(choice, weights)``, both ``[T, E]``
    (ERNIE 4.5's the same with the softmax instead of the sigmoid, one group, renormalized, unscaled).

    ``choice`` = sigmoid scores + ``bias``, -inf outside the ``topk_group`` groups (of ``n_group``) whose two best
    choices sum highest: its top-k are the experts a token runs.  ``weights``: the scores (without the bias) of every
    expert, divided by the sum of the chosen experts' scores (+ 1e-20) when ``norm_topk_prob``, times
    ``routed_scaling_factor`` - read at the chosen experts only (``QMoE``'s ``router_weights``; ``GatherElements`` in
    the dispatch)."""
    cfg = g.cfg
    E, k = cfg.num_experts, cfg.experts_per_token
    if cfg.moe_routing == "softmax_biased":  # ERNIE 4.5: the softmax, the bias for the choice, renormalized
        scores = g.node("Softmax", [logits], [f"{m}/router_softmax/output_0"], f"{m}/router_softmax", axis=-1)[0]
    else:
        scores = g.node("Sigmoid", [logits], [f"{m}/router_sigmoid/output_0"], f"{m}/router_sigmoid")[0]
    choice_bias = np.asarray(bias, np.float32).reshape(-1)  # ([E], ERNIE's [1, E])
    _check_shape("e_score_correction_bias", choice_bias, (E,))
    choice = g.node("Add", [scores, g.external(f"{m}.gate.e_score_correction_bias", choice_bias)],
                    [f"{m}/router_choice/output_0"], f"{m}/router_choice")[0]  # fmt: skip
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        per = E // cfg.n_group
        grouped = g.node("Reshape", [choice, g.const([-1, cfg.n_group, per])], [f"{m}/router_groups/output_0"],
                         f"{m}/router_groups")[0]  # fmt: skip
        best2 = g.node("TopK", [grouped, g.const([2])], [f"{m}/router_groups/top2", f"{m}/router_groups/top2_i"],
                       f"{m}/router_groups/top2", axis=-1)[0]  # fmt: skip
        gscore = g.node("ReduceSum", [best2, g.const([-1])], [f"{m}/router_groups/score"], f"{m}/router_groups/score",
                        keepdims=0)[0]  # fmt: skip
        kth = g.node("TopK", [gscore, g.const([cfg.topk_group])], [f"{m}/router_groups/kept", f"{m}/router_groups/kept_i"],
                     f"{m}/router_groups/kept", axis=-1)[0]  # fmt: skip
        low = g.node("ReduceMin", [kth, g.const([-1])], [f"{m}/router_groups/floor"], f"{m}/router_groups/floor",
                     keepdims=1)[0]  # fmt: skip
        keep = g.node("GreaterOrEqual", [gscore, low], [f"{m}/router_groups/keep"], f"{m}/router_groups/keep")[0]
        keep = g.node("Unsqueeze", [keep, g.const([-1])], [f"{m}/router_groups/keep3"], f"{m}/router_groups/keep3")[0]
        ninf = g.const(-np.inf, np.float32)
        masked = g.node("Where", [keep, grouped, ninf], [f"{m}/router_groups/masked"], f"{m}/router_groups/masked")[0]
        choice = g.node("Reshape", [masked, g.const([-1, E])], [f"{m}/router_choice_masked/output_0"],
                        f"{m}/router_choice_masked")[0]  # fmt: skip
    weights = scores
    if cfg.norm_topk_prob:
        top_i = g.node("TopK", [choice, g.const([k])], [f"{m}/router_norm/top", f"{m}/router_norm/top_i"],
                       f"{m}/router_norm/top", axis=-1)[1]  # fmt: skip
        chosen = g.node("GatherElements", [scores, top_i], [f"{m}/router_norm/chosen"], f"{m}/router_norm/chosen",
                        axis=-1)[0]  # fmt: skip
        total = g.node("ReduceSum", [chosen, g.const([-1])], [f"{m}/router_norm/sum"], f"{m}/router_norm/sum",
                       keepdims=1)[0]  # fmt: skip
        total = g.node("Add", [total, g.const(1e-20, np.float32)], [f"{m}/router_norm/sum_eps"],
                       f"{m}/router_norm/sum_eps")[0]  # fmt: skip
        weights = g.node("Div", [weights, total], [f"{m}/router_norm/output_0"], f"{m}/router_norm")[0]
    if cfg.routed_scaling_factor != 1.0:
        weights = g.node("Mul", [weights, g.const(cfg.routed_scaling_factor, np.float32)],
                         [f"{m}/router_scale/output_0"], f"{m}/router_scale")[0]  # fmt: skip
    return choice, weights


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's slope per head (float32 ``[heads]``), as BLOOM computes them: ``2 ** (-8 i / n)`` for the largest
    power of two ``n <= heads``, then every other slope of ``2 n`` for the remaining heads.  (MPT's formula - the
    slopes of the next power of two, the odd-numbered ones first - gives the same list.)"""
    n = 2 ** int(math.floor(math.log2(heads)))
    base = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    slopes = [base**p for p in range(1, n + 1)]
    if n != heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * n) - 3)))
        slopes += [extra**p for p in range(1, 1 + 2 * min(n, heads - n), 2)]
    return np.asarray(slopes, np.float32)


def _alibi_bias(g: _GraphBuilder, stream: str) -> str:
    """GroupQueryAttention's ``attention_bias`` for ALiBi, ``[1, heads, S, T]`` = ``slope_h * key position`` (``T``:
    ``attention_mask``'s width; ``S``: ``stream``'s second dimension), made once per graph.  A shift of every key
    position by the same amount leaves the softmax unchanged, so left padding needs no correction."""
    if g.alibi is not None:
        return g.alibi
    base = "/model/alibi"
    nh = g.cfg.num_attention_heads
    shp = g.node("Shape", ["attention_mask"], [f"{base}/Shape/output_0"], f"{base}/Shape")[0]
    total = g.node("Gather", [shp, g.const([1])], [f"{base}/Gather/output_0"], f"{base}/Gather", axis=0)[0]
    sshp = g.node("Shape", [stream], [f"{base}/Shape_1/output_0"], f"{base}/Shape_1")[0]
    seq = g.node("Gather", [sshp, g.const([1])], [f"{base}/Gather_1/output_0"], f"{base}/Gather_1", axis=0)[0]
    t = g.node("Squeeze", [total, g.const([0])], [f"{base}/Squeeze/output_0"], f"{base}/Squeeze")[0]
    pos = g.node("Range", [g.const(0), t, g.const(1)], [f"{base}/Range/output_0"], f"{base}/Range")[0]
    posf = g.node("Cast", [pos], [f"{base}/Cast/output_0"], f"{base}/Cast", to=TensorProto.FLOAT)[0]
    slopes = alibi_slopes(nh).reshape(1, nh, 1, 1)
    if g.cfg.spec.alibi == "falcon":  # transformers' Falcon: bfloat16 slopes and products, / sqrt(head_dim)
        import ml_dtypes  # onnx's dependency

        slopes = slopes.astype(ml_dtypes.bfloat16).astype(np.float32)
    b = g.node("Mul", [g.const(slopes, np.float32), posf], [f"{base}/Mul/output_0"], f"{base}/Mul")[0]  # [1, nh, 1, T]
    if g.cfg.spec.alibi == "falcon":
        b16 = g.node("Cast", [b], [f"{base}/Cast_bf16/output_0"], f"{base}/Cast_bf16", to=TensorProto.BFLOAT16)[0]
        b32 = g.node("Cast", [b16], [f"{base}/Cast_f32/output_0"], f"{base}/Cast_f32", to=TensorProto.FLOAT)[0]
        b = g.node("Div", [b32, g.const(np.float32(math.sqrt(g.cfg.head_dim)), np.float32)], [f"{base}/Div/output_0"],
                   f"{base}/Div")[0]  # fmt: skip
    shape = g.node("Concat", [g.const([1, nh]), seq, total], [f"{base}/Concat/output_0"], f"{base}/Concat", axis=0)[0]
    g.alibi = g.node("Expand", [b, shape], [f"{base}/output_0"], f"{base}/Expand")[0]
    return g.alibi


def _rotate(g: _GraphBuilder, x: str, name: str, heads: int, cos: str, sin: str) -> str:
    """``x`` (``[B, S, heads * head_dim]``) with the rotary embedding applied to the first ``rotary_dim`` of every
    head (``RotaryEmbedding``, com.microsoft), at the positions ``past .. past + S - 1`` (``past``: the width of
    ``attention_mask`` minus ``S``, as GroupQueryAttention counts them for right-padded rows)."""
    cfg = g.cfg
    if g.positions is None:
        base = "/model/rotary_positions"
        shp = g.node("Shape", ["attention_mask"], [f"{base}/Shape/output_0"], f"{base}/Shape")[0]
        total = g.node("Gather", [shp, g.const(1)], [f"{base}/Gather/output_0"], f"{base}/Gather", axis=0)[0]
        bs = g.node("Shape", [x], [f"{base}/Shape_1/output_0"], f"{base}/Shape_1", start=0, end=2)[0]
        seq = g.node("Gather", [bs, g.const(1)], [f"{base}/Gather_1/output_0"], f"{base}/Gather_1", axis=0)[0]
        start = g.node("Sub", [total, seq], [f"{base}/Sub/output_0"], f"{base}/Sub")[0]
        pos = g.node("Range", [start, total, g.const(1)], [f"{base}/Range/output_0"], f"{base}/Range")[0]
        g.positions = g.node("Expand", [pos, bs], [f"{base}/output_0"], f"{base}/Expand")[0]
    return g.node("RotaryEmbedding", [x, g.positions, cos, sin], [f"{name}/output_0"], name, _MS,
                  interleaved=int(cfg.spec.rotary_interleaved), num_heads=heads,
                  rotary_embedding_dim=cfg.rotary_dim)[0]  # fmt: skip


def _shared_scale(g: _GraphBuilder, x: str, name: str, q: dict[str, PackedLinear | None], readers: tuple[str, ...]
                  ) -> str:
    """``x / s`` once (a ``Mul`` named ``name``) when the layers ``readers`` of ``x`` all carry the same AWQ input scale
    ``s`` that no norm took (no norm before them: OLMo-2, EXAONE 4); their entries in ``q`` lose it, so q/k/v can
    still fuse.  Otherwise ``x``, and each layer scales its own input (:func:`_scaled_input`)."""
    qs = [q[s] for s in readers]
    first = _common_scale(qs) if len(readers) > 1 else None
    if first is None:
        return x
    inv = (np.float32(1.0) / first).astype(np.float32)
    out = g.node("Mul", [x, g.external(f"{name}_inv", inv)], [f"{name}/output_0"], name)[0]
    for s, t in zip(readers, qs, strict=True):
        q[s] = dataclasses.replace(t, input_scale=None) if t is not None else None
    return out


def _residual_scaled(g: _GraphBuilder, x: str, prefix: str) -> str:
    """``x * residual_multiplier`` (Granite) before the residual add; ``x`` when there is none."""
    r = g.cfg.residual_multiplier
    if r is None:
        return x
    return g.node("Mul", [x, g.const(np.float32(r), np.float32)], [f"{prefix}/residual_scale/output_0"],
                  f"{prefix}/residual_scale")[0]  # fmt: skip


def _past_io(cfg: DecoderConfig, layers: Iterable[int]) -> tuple[list[Any], list[Any]]:
    f32, nkv, hd = TensorProto.FLOAT, cfg.num_key_value_heads, cfg.head_dim
    ins, outs = [], []
    for i in layers:
        for kv in ("key", "value"):
            ins.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", f32,
                                                     ["batch_size", nkv, "past_sequence_length", hd]))  # fmt: skip
            outs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", f32,
                                                      ["batch_size", nkv, "total_sequence_length", hd]))  # fmt: skip
    return ins, outs


def _model(g: _GraphBuilder, inputs: list[Any], outputs: list[Any], name: str = "main_graph") -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(_MS, 1)],
                              producer_name="quantkit.llm_builder")  # fmt: skip
    model.ir_version = 10
    return model


def block_model(cfg: DecoderConfig, index: int, weights: dict[str, Any], packed: dict[str, PackedLinear],
                taps: Iterable[str] = (), positions: int | None = None, *, hidden_out: bool = True
                ) -> onnx.ModelProto:
    """Decoder block ``index`` alone, in memory, for layer-wise calibration.

    Inputs ``hidden`` (the residual stream entering the block, ``[batch, seq, H]``), ``attention_mask``
    and empty ``past_key_values.<index>.*``; outputs ``hidden_out`` (the stream after the block: the
    input plus the attention and MLP outputs) and, for every layer name in ``taps``, the tensor that
    layer reads, as ``<layer>/input``.  The nodes are the ones :func:`build_llm` writes (same fused
    ops, same ``MatMulNBits`` for the layers in ``packed``), so what is calibrated is what ships.
    ``weights`` is not consumed (the block's tensors by graph name, as :meth:`BuildHook.block` gets them).
    ``positions``: the longest sequence the block graph will run (the rotary caches' rows; default the
    decoder's :attr:`DecoderConfig.context_length`).  ``hidden_out=False`` (``taps`` given): the taps are the only
    outputs and only the nodes they need are kept - ONNX Runtime runs every node of a graph whatever is fetched, so
    the input of ``q_proj`` costs a norm instead of the whole block (measured: 50 ms -> ~1 ms per 512-token window
    on SmolLM2-135M's blocks; ``o_proj``'s and ``gate_proj``'s about half a block).
    """
    g = _GraphBuilder(cfg, _InMemoryData())
    taps = list(taps)
    g.tapped = bool(taps)
    seqlens_k, total_len = _mask_inputs(g)
    length = min(positions, cfg.context_length) if positions else None
    rotary = _rotary_inputs(g, [index], length, total_len) if cfg.uses_rope(index) else {}
    io = _emit_block(g, index, dict(weights), _BlockIO("hidden", None, {}, "hidden"), packed, seqlens_k, total_len,
                     rotary)
    if io.pending is None:  # pragma: no cover - a block always ends in down_proj
        raise ModelError(f"block {index} has no MLP output")
    g.node("Add", [io.residual, io.pending], ["hidden_out"], f"{block_prefix(cfg, index)}/residual_add")
    f32, H = TensorProto.FLOAT, cfg.hidden_size
    past_in, present_out = _past_io(cfg, [index])
    inputs = [helper.make_tensor_value_info("hidden", f32, ["batch_size", "sequence_length", H]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"]), *past_in]  # fmt: skip
    outputs = [helper.make_tensor_value_info("hidden_out", f32, ["batch_size", "sequence_length", H])]
    if not hidden_out:
        if not taps:
            raise ValueError("block_model: hidden_out=False needs at least one tap")
        outputs = []
    for t in taps:
        src = io.taps[t]
        g.node("Identity", [src], [f"{t}/input"], f"{t}/input_tap")
        outputs.append(helper.make_tensor_value_info(f"{t}/input", f32, None))
    del present_out  # the block's KV cache is not needed during calibration
    if not hidden_out:
        _keep_needed(g, [o.name for o in outputs])
    return _model(g, inputs, outputs, f"block_{index}")


def _keep_needed(g: _GraphBuilder, outputs: list[str]) -> None:
    """Drop from ``g`` every node (and initializer) that none of ``outputs`` depends on."""
    needed = set(outputs)
    kept = []
    for node in reversed(g.nodes):
        if any(o in needed for o in node.output if o):
            kept.append(node)
            needed.update(i for i in node.input if i)
            needed.update(_outer_names(node))  # a branch (the rotary cache's If) reads outer values by name
    g.nodes[:] = kept[::-1]
    g.inits[:] = [t for t in g.inits if t.name in needed]


def _outer_names(node: onnx.NodeProto) -> set[str]:
    """Every name the nodes of ``node``'s subgraphs read (outer-scope values among them), recursively."""
    out: set[str] = set()
    for a in node.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                    list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
            for n in sub.node:
                out.update(i for i in n.input if i)
                out |= _outer_names(n)
    return out


LOGITS_TO_KEEP = "logits_to_keep"
"""Optional int64 ``[1]`` input of built decoders: logits only for the last ``k`` positions (default 0: all)."""


def _keep_last(g: _GraphBuilder, hidden: str) -> str:
    """The last ``logits_to_keep`` positions of ``hidden`` (``[B, S, H]``); all of them when it is 0.

    ``logits_to_keep`` is a graph input with an initializer of the same name (value ``[0]``): ONNX Runtime
    lists it among the overridable initializers, so callers that do not know it (onnxruntime-genai,
    perplexity) get every position, and a generation loop feeds ``[1]`` at the prompt.  The lm_head then
    projects one row instead of ``S``: at a 1024-token prompt of a 49k vocabulary that is 200 MB of logits
    and a fifth of the prompt's multiply-adds not computed."""
    g.inits.append(onnx.numpy_helper.from_array(np.zeros(1, np.int64), LOGITS_TO_KEEP))
    neg = g.node("Neg", [LOGITS_TO_KEEP], ["/model/logits_to_keep/Neg/output_0"], "/model/logits_to_keep/Neg")[0]
    big = g.const([np.iinfo(np.int64).max])
    return g.node("Slice", [hidden, neg, big, g.const([1])], ["/model/logits_to_keep/output_0"],
                  "/model/logits_to_keep/Slice")[0]  # fmt: skip


def _gather_quantized(g: _GraphBuilder, q: PackedLinear, ids: str, out: str, name: str
                      ) -> tuple[str, tuple[str, str, str | None]]:
    """``GatherBlockQuantized`` over a tied table stored once; returns ``(output, (packed bytes, scales, zero
    points))`` - the names the tied lm_head reads too.  With hot rows (``q.hot``): a second one over the 8-bit
    rows, read where the id is hot (``Where``); the 4-bit table keeps every row."""
    if q.hot is not None and q.hot_ids is not None:
        return _gather_hot(g, q, ids, out, name)
    V, H, bs, bits = q.N, q.K, q.block_size, q.bits
    kb = q.B.shape[1]
    Hp = kb * bs
    data = g.external(f"{name}.weight_Q{bits}", q.B.reshape(V, Hp * bits // 8))
    scales = g.external(f"{name}.weight_scales", q.scales)
    zp = g.external(f"{name}.weight_zero_points", q.zero_points) if q.zero_points is not None else None
    ins = [data, ids, scales] + ([zp] if zp else [])
    raw = out if Hp == H else f"{name}/padded/output_0"
    g.node("GatherBlockQuantized", ins, [raw], name, _MS, gather_axis=0, quantize_axis=1, block_size=bs,
           bits=bits)  # fmt: skip
    if Hp != H:
        g.node("Slice", [raw, g.const([0]), g.const([H]), g.const([-1])], [out], f"{name}/unpad")
    return out, (data, scales, zp)


def _gather_hot(g: _GraphBuilder, q: PackedLinear, ids: str, out: str, name: str
                ) -> tuple[str, tuple[str, str, str | None]]:
    """:func:`_gather_quantized` with hot rows: ``slot = Gather(slots, ids)`` (the row in the 8-bit table, -1 for a
    cold id), both tables gathered, ``Where(slot >= 0, hot, cold)``."""
    assert q.hot is not None and q.hot_ids is not None  # noqa: S101 - the caller checked
    slots = np.full(q.N, -1, np.int64)
    slots[np.asarray(q.hot_ids, np.int64)] = np.arange(len(q.hot_ids))
    slot = g.node("Gather", [g.external(f"{name}.hot_slots", slots), ids], [f"{name}/hot_slot/output_0"],
                  f"{name}/hot_slot", axis=0)[0]  # fmt: skip
    safe = g.node("Max", [slot, g.const(0)], [f"{name}/hot_slot_safe/output_0"], f"{name}/hot_slot_safe")[0]
    is_hot = g.node("GreaterOrEqual", [slot, g.const(0)], [f"{name}/is_hot/output_0"], f"{name}/is_hot")[0]
    is_hot = g.node("Unsqueeze", [is_hot, g.const([-1])], [f"{name}/is_hot_h/output_0"], f"{name}/is_hot_h")[0]
    cold, shared = _gather_quantized(g, dataclasses.replace(q, hot=None, hot_ids=None), ids,
                                     f"{name}/cold/output_0", name)  # fmt: skip
    hot, _ = _gather_quantized(g, q.hot, safe, f"{name}.hot/output_0", f"{name}.hot")
    g.node("Where", [is_hot, hot, cold], [out], f"{name}/hot_or_cold")
    return out, shared


def _learned_positions(g: _GraphBuilder, table: Any) -> str:
    """Rows ``past .. past + S - 1`` of the learned position table (GPT-2's ``wpe``; OPT's from its row 2: ``table``
    holds the rows of positions 0, 1 ...), ``[1, S, H]``; the positions come from ``attention_mask``'s width (right
    padding, as for the rotary positions)."""
    n = g.cfg.spec.names
    assert n.positions is not None  # noqa: S101 - only called for a family with learned positions
    base = f"/{n.positions.replace('.', '/')}"
    wpe = g.external(f"{n.positions}.weight", table)
    shp = g.node("Shape", ["attention_mask"], [f"{base}/Shape/output_0"], f"{base}/Shape")[0]
    total = g.node("Gather", [shp, g.const(1)], [f"{base}/Gather/output_0"], f"{base}/Gather", axis=0)[0]
    ids = g.node("Shape", ["input_ids"], [f"{base}/Shape_1/output_0"], f"{base}/Shape_1")[0]
    seq = g.node("Gather", [ids, g.const(1)], [f"{base}/Gather_1/output_0"], f"{base}/Gather_1", axis=0)[0]
    start = g.node("Sub", [total, seq], [f"{base}/Sub/output_0"], f"{base}/Sub")[0]
    pos = g.node("Range", [start, total, g.const(1)], [f"{base}/Range/output_0"], f"{base}/Range")[0]
    rows = g.node("Gather", [wpe, pos], [f"{base}/output_0"], n.positions)[0]
    return g.node("Unsqueeze", [rows, g.const([0])], [f"{base}/Unsqueeze/output_0"], f"{base}/Unsqueeze")[0]


def embedded_stream(cfg: DecoderConfig, rows: np.ndarray, extras: StreamExtras | None = None) -> np.ndarray:
    """The residual stream entering block 0 from embedding ``rows`` (``[..., S, H]`` float32, looked up, positions
    0 .. S - 1): scaled by ``sqrt(hidden_size)`` (Gemma) or a multiplier (Granite), then, with ``extras``
    (:func:`stream_extras`), the embedding LayerNorm (BLOOM) and the learned position rows (GPT-2, OPT), as the
    built decoder computes it."""
    out = np.asarray(rows, np.float32)
    if cfg.embed_scaled:
        out = (out * np.float32(math.sqrt(cfg.hidden_size))).astype(np.float32)
    if cfg.embedding_multiplier is not None:
        out = (out * np.float32(cfg.embedding_multiplier)).astype(np.float32)
    if extras is not None and extras.norm_weight is not None:  # LayerNorm (BLOOM) or RMSNorm (nanochat)
        c = out - out.mean(-1, keepdims=True, dtype=np.float32) if cfg.spec.norm == "layer" else out
        var = (c * c).mean(-1, keepdims=True, dtype=np.float32)
        out = c / np.sqrt(var + np.float32(cfg.rms_norm_eps)) * extras.norm_weight
        if extras.norm_bias is not None:
            out = out + extras.norm_bias
        out = out.astype(np.float32)
    if extras is not None and extras.positions is not None:
        out = (out + extras.positions[: out.shape[-2]]).astype(np.float32)
    return out


@dataclass(frozen=True)
class StreamExtras:
    """What the residual stream entering block 0 applies to the embedding rows besides a scale (see
    :func:`embedded_stream`): the learned position rows from position 0 on (``[P, H]`` float32; OPT's first two
    table rows already dropped) and the embedding LayerNorm's weight and bias (BLOOM)."""

    positions: np.ndarray | None = None
    norm_weight: np.ndarray | None = None
    norm_bias: np.ndarray | None = None


def stream_extras(cfg: DecoderConfig, ckpt: _Checkpoint) -> StreamExtras | None:
    """The :class:`StreamExtras` of ``cfg``'s family read from the checkpoint (shapes checked), None when it has
    none."""
    n, H = cfg.spec.names, cfg.hidden_size
    if n.positions is None and n.embed_norm is None:
        return None
    pos = nw = nb = None
    if n.positions is not None:
        ((_, wpe),) = list(ckpt.read([f"{n.positions}.weight"]))
        off = cfg.spec.position_offset
        _check_shape(f"{n.positions}.weight", wpe, (cfg.max_position_embeddings + off, H))
        pos = _float32_rows(wpe, off, off + cfg.max_position_embeddings)
    if n.embed_norm is not None:
        t = dict(ckpt.read(norm_params(cfg, n.embed_norm)))
        nw = _float32_rows(t[f"{n.embed_norm}.weight"], 0, H)
        b = t.get(f"{n.embed_norm}.bias")
        nb = _float32_rows(b, 0, H) if b is not None else None
    return StreamExtras(pos, nw, nb)


def _build(
    folder: Path, out_path: Path, cfg: DecoderConfig, ckpt: _Checkpoint, data: _ExternalData,
    hook: BuildHook | None = None, transform: WeightTransform | None = None,
) -> onnx.ModelProto:
    hook = hook or BuildHook()
    g = _GraphBuilder(cfg, data)
    n = cfg.spec.names
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt
    untie = tied and (hook.untie_head() or (transform is not None and transform.unties))
    seqlens_k, total_len = _mask_inputs(g)
    rope = [i for i in range(L) if cfg.uses_rope(i)]
    rotary = _rotary_inputs(g, rope, None, total_len) if rope else {}

    # embedding (scaled by sqrt(hidden) for Gemma; plus the learned positions for GPT-2)
    ((_, emb),) = list(ckpt.read([f"{n.embed}.weight"]))  # stored dtype; written as float32
    _check_shape(f"{n.embed}.weight", emb, (V, H))
    if transform is not None:
        emb = transform.embedding(emb)
    extras = stream_extras(cfg, ckpt)
    q_emb = hook.embedding(emb, tied) if extras is None else hook.embedding(emb, tied, extras)
    table = ""
    emb_out = f"/{n.embed.replace('.', '/')}/output_0"
    if q_emb is not None:  # tied, or untied and named by the recipe (the hook decides)
        residual, shared = _gather_quantized(g, q_emb, "input_ids", emb_out, n.embed)
    else:
        table = g.external(f"{n.embed}.weight", emb)
        residual = g.node("Gather", [table, "input_ids"], [emb_out], n.embed)[0]
    del emb
    if cfg.embed_scaled:  # transformers multiplies by a float32 sqrt(hidden_size)
        scale = g.const(np.float32(math.sqrt(H)), np.float32)
        residual = g.node("Mul", [residual, scale], [f"{emb_out[:-len('/output_0')]}/scale/output_0"],
                          f"{n.embed}/scale")[0]  # fmt: skip
    if cfg.embedding_multiplier is not None:  # Granite
        scale = g.const(np.float32(cfg.embedding_multiplier), np.float32)
        residual = g.node("Mul", [residual, scale], [f"{emb_out[:-len('/output_0')]}/multiplier/output_0"],
                          f"{n.embed}/multiplier")[0]  # fmt: skip
    if extras is not None and extras.norm_weight is not None:  # BLOOM: LayerNorm of the embedding rows
        assert n.embed_norm is not None  # noqa: S101 - stream_extras reads a norm only for a family that has one
        # (nanochat's embedding norm is its final norm, a module used twice: named apart in the graph)
        name = n.embed_norm if n.embed_norm != n.final_norm else f"{n.embed_norm}_embedding"
        residual, _ = _norm(g, name, residual, None, extras.norm_weight, extras.norm_bias)
    pending = _learned_positions(g, extras.positions) if extras is not None and extras.positions is not None else None
    del extras

    io = _BlockIO(residual, pending, {})
    for i in range(L):
        w = dict(ckpt.read(block_tensor_names(cfg, i, ckpt.__contains__)))  # released after the block
        for s, shape in linear_shapes(cfg, i).items():
            _check_shape(f"{block_prefix(cfg, i)}.{s}.weight", w[f"{block_prefix(cfg, i)}.{s}.weight"], shape)
        if transform is not None:
            transform.block(i, w)
        packed = hook.block(i, w)
        io = _emit_block(g, i, w, io, packed, seqlens_k, total_len, rotary)
        del w, packed

    norm_w = dict(ckpt.read(norm_params(cfg, n.final_norm)))
    gamma, beta = norm_gamma(cfg, norm_w[f"{n.final_norm}.weight"]), norm_w.get(f"{n.final_norm}.bias")
    head_gamma = gamma  # the factor the lm_head's rewrite folds in (the final norm keeps transform.final_norm's)
    if transform is not None:
        gamma = transform.final_norm(gamma)
    hidden, _ = _norm(g, n.final_norm, io.residual, io.pending, gamma, beta, out="/model/norm/output_0",
                      residual_out=False)  # fmt: skip
    hidden = _keep_last(g, hidden)
    head_bias = HEAD_BIAS in ckpt
    post = [s for s, on in (("bias_add", head_bias), ("scaling", cfg.logits_scaling is not None),
                            ("scale", cfg.logit_scale is not None), ("softcap", cfg.final_softcap is not None))
            if on]  # fmt: skip
    # (not "lm_head/output_0": a hot-rows head names its full-vocabulary MatMulNBits output so)
    logits = "logits" if not post else "lm_head/logits/output_0"
    if tied and q_emb is not None and not untie:
        def read_table() -> Any:
            ((_, table_w),) = list(ckpt.read([f"{n.embed}.weight"]))
            return table_w

        q_head = (hook.tied_head(q_emb, read_table, gamma) if beta is None else
                  hook.tied_head(q_emb, read_table, gamma, norm_bias=beta))  # fmt: skip
        blocks = g.const([V, q_emb.B.shape[1], q_emb.B.shape[2]])
        view = g.node("Reshape", [shared[0], blocks], ["lm_head.weight_Q/blocks"], "lm_head.weight_view")[0]
        # the same codes, scales and zero points as the embedding's: stored once
        _matmul_nbits(g, hidden, "lm_head", dataclasses.replace(q_emb, accuracy_level=q_head.accuracy_level),
                      weight_name=view, out=logits, scales_name=shared[1], zero_points_name=shared[2])  # fmt: skip
    elif tied and not untie:
        wt = g.node("Transpose", [table], ["lm_head.weight_transpose/output_0"], "lm_head.weight_transpose",
                    perm=[1, 0])[0]  # fmt: skip
        g.node("MatMul", [hidden, wt], [logits], "lm_head")
    else:
        ((_, lm),) = list(ckpt.read([f"{n.embed}.weight" if tied else "lm_head.weight"]))
        _check_shape("lm_head.weight", lm, (V, H))
        if transform is not None:
            lm = transform.head(lm, head_gamma)
        q_lm = hook.lm_head(lm, gamma) if beta is None else hook.lm_head(lm, gamma, norm_bias=beta)
        if q_lm is None:
            g.node("MatMul", [hidden, g.external("lm_head.weight", lm.T)], [logits], "lm_head")
        elif q_lm.hot is not None:
            _hot_head(g, _scaled_input(g, hidden, "lm_head", q_lm), "lm_head", q_lm, logits)
        else:
            _matmul_nbits(g, _scaled_input(g, hidden, "lm_head", q_lm), "lm_head", q_lm, out=logits)
        del lm
    for j, step in enumerate(post):  # after the lm_head's MatMul, in transformers' order; the last writes logits
        out = "logits" if j == len(post) - 1 else f"lm_head/{step}/output_0"
        if step == "bias_add":  # Phi-2's lm_head has a bias
            ((_, hb),) = list(ckpt.read([HEAD_BIAS]))
            logits = g.node("Add", [logits, g.external(HEAD_BIAS, _float32_rows(hb, 0, V))], [out],
                            "lm_head/bias_add")[0]  # fmt: skip
        elif step == "scaling":  # Granite: logits / logits_scaling
            logits = g.node("Div", [logits, g.const(np.float32(cfg.logits_scaling), np.float32)], [out],
                            "lm_head/scaling")[0]  # fmt: skip
        elif step == "scale":  # Cohere: logits * logit_scale
            logits = g.node("Mul", [logits, g.const(np.float32(cfg.logit_scale), np.float32)], [out],
                            "lm_head/scale")[0]  # fmt: skip
        else:  # Gemma 2: cap * tanh(logits / cap)
            cap = g.const(np.float32(cfg.final_softcap), np.float32)
            d = g.node("Div", [logits, cap], ["lm_head/softcap/Div/output_0"], "lm_head/softcap/Div")[0]
            t = g.node("Tanh", [d], ["lm_head/softcap/Tanh/output_0"], "lm_head/softcap/Tanh")[0]
            logits = g.node("Mul", [t, cap], [out], "lm_head/softcap")[0]
    hook.finish()

    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info(
            "attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]
        ),
    ]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch_size", "logits_length", V])]
    past_in, present_out = _past_io(cfg, range(L))
    keep = helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1])  # overridable: default 0 = all
    model = _model(g, inputs + past_in + [keep], outputs + present_out)
    onnx.helper.set_model_props(model, {"source": str(folder), "model_type": cfg.model_type,
                                        "context_length": str(cfg.context_length)})  # fmt: skip
    return model


def _genai_config(cfg: DecoderConfig, folder: Path, filename: str) -> dict[str, Any]:
    gen: dict[str, Any] = {}
    gpath = folder / "generation_config.json"
    if gpath.is_file():
        try:
            gen = json.loads(gpath.read_text())
        except ValueError:
            gen = {}

    def pick(key: str) -> Any:
        return gen.get(key, getattr(cfg, key))

    eos = pick("eos_token_id")
    pad = pick("pad_token_id")
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos
    ctx = cfg.context_length  # the rotary caches' rows
    return {
        "model": {
            "bos_token_id": pick("bos_token_id"),
            "context_length": ctx,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": cfg.head_dim,
                "hidden_size": cfg.hidden_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": cfg.num_attention_heads,
                "num_hidden_layers": cfg.num_hidden_layers,
                "num_key_value_heads": cfg.num_key_value_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": cfg.spec.genai_type or cfg.model_type,
            "vocab_size": cfg.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": ctx,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            # GroupQueryAttention writes the new positions into the past buffer in place when genai binds one
            # buffer as both past and present (checked: the same greedy tokens as with separate buffers)
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },  # fmt: skip
    }


def build_llm(
    folder: str | Path, out_path: str | Path, *, dtype: str = "fp32", genai_config: bool = True,
    hook: BuildHook | None = None, blocks: int | None = None, transform: WeightTransform | None = None,
) -> Path:
    """Build the KV-cache decoder ONNX graph of a HF folder (a family of :mod:`quantkit.frontends.families`),
    streaming its weights.

    Writes ``out_path`` (the graph, small), ``out_path.name + ".data"`` next to it (every weight,
    float32, page-aligned) and, with ``genai_config``, ``genai_config.json`` plus the tokenizer
    files of ``folder`` (so ``onnxruntime_genai.Model(out_path.parent)`` works when the folder
    holds one model).

    Args:
        folder: local HF folder with ``config.json`` and ``*.safetensors``
            (``model.safetensors.index.json`` when sharded); bf16, fp16 or fp32 tensors.
        out_path: the ``.onnx`` file to write (parent folders are created).
        dtype: weight/activation precision; only ``"fp32"`` (quantized linears come from ``hook``).
        hook: asked block by block which linears to write quantized (``MatMulNBits``,
            ``GatherBlockQuantized`` for a tied embedding); see :class:`BuildHook` and
            :mod:`quantkit.layerwise`, which calibrates and quantizes while the checkpoint streams.
        blocks: build only the first ``blocks`` decoder blocks (the embedding, blocks ``0 .. blocks - 1``, the
            final norm and the lm_head; their KV-cache inputs only): a truncated decoder, e.g. to time FP32
            against quantized on part of a model too large to hold whole (:mod:`quantkit.evaluate.streamed`).
        transform: an exact rewrite of the float weights as they stream, before ``hook`` sees them (e.g.
            :class:`quantkit.algorithms.rotation.HadamardRotation`); see :class:`WeightTransform`.

    Returns:
        ``out_path`` as a Path.

    Raises:
        ModelError: unsupported architecture/dtype, missing or mis-shaped tensors.
    """
    if dtype != "fp32":
        raise ModelError(
            f"dtype {dtype!r}: the builder emits fp32 only (quantize the built graph with quantkit)"
        )
    folder, out = Path(folder), Path(out_path)
    cfg = read_decoder_config(folder)
    if blocks is not None:
        if isinstance(blocks, bool) or not 1 <= blocks <= cfg.num_hidden_layers:
            raise ModelError(f"blocks {blocks!r}: allowed: 1 to {cfg.num_hidden_layers} (num_hidden_layers)")
        cfg = dataclasses.replace(cfg, num_hidden_layers=blocks)  # per-layer settings are read by index
    ckpt = _Checkpoint(folder, cfg)
    check_checkpoint(cfg, ckpt)  # before the rotary caches or any weight is allocated
    out.parent.mkdir(parents=True, exist_ok=True)
    data_path = out.with_name(out.name + ".data")
    tmp_onnx = out.with_name(out.name + ".tmp")
    data = _ExternalData(data_path)
    try:
        model = _build(folder, out, cfg, ckpt, data, hook, transform)
    except BaseException:
        data.close()
        data_path.unlink(missing_ok=True)
        raise
    data.close()
    with open(tmp_onnx, "wb") as fh:
        fh.write(model.SerializeToString())
    os.replace(tmp_onnx, out)
    if genai_config:
        (out.parent / "genai_config.json").write_text(
            json.dumps(_genai_config(cfg, folder, out.name), indent=4)
        )
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                     "generation_config.json", "tokenizer.model"):  # fmt: skip
            src = folder / name
            if src.is_file() and src.resolve() != (out.parent / name).resolve():
                (out.parent / name).write_bytes(src.read_bytes())
    return out


# --------------------------------------------------------------------------- running


class LLMSession:
    """An ORT session over a built decoder that keeps the KV cache between calls (batch 1 or more).

    Two ways to keep the cache:

    * ``max_length=None``: each call feeds the cache as ``past_key_values.*`` arrays and keeps the returned
      ``present.*`` (GroupQueryAttention copies the whole cache into new outputs every step);
    * ``max_length=N``: one ``[batch, kv_heads, N, head_dim]`` buffer per layer and kind, bound through
      ``io_binding`` as both past and present, so GroupQueryAttention writes the new positions in place (what
      onnxruntime-genai does with ``past_present_share_buffer``); calls past ``N`` positions are refused.

    The cache has the element type of the graph's ``past_key_values.*`` inputs (:attr:`cache_dtype`: float32, or
    int8 for a decoder built with ``export.kv_cache: int8``, see :mod:`quantkit.frontends.kv_cache`).
    """

    def __init__(self, model_path: str | Path, *, threads: int | None = None, max_length: int | None = None,
                 session: Any = None, arena: bool = True) -> None:
        import onnxruntime as ort

        if session is None:
            so = ort.SessionOptions()
            # arena=False: every tensor is freed when its run ends (the evaluation's sessions: the arena kept the
            # largest batch's activations for the session's life, the peak of a run that times nothing)
            so.enable_cpu_mem_arena = arena
            so.log_severity_level = 3  # not the "initializer logits_to_keep appears in graph inputs" notice
            # threads stop spinning when a run returns: decode timings interleave two models' sessions
            # (quantkit.evaluate.latency.make_session)
            so.add_session_config_entry("session.force_spinning_stop", "1")
            if threads:
                so.intra_op_num_threads = threads
            session = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        self.session = session
        self.past_names = [i.name for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        if not self.past_names:
            raise ModelError(f"{str(model_path)!r} has no past_key_values.* inputs: not a KV-cache decoder")
        shapes = {i.name: i.shape for i in self.session.get_inputs()}
        self.kv_heads, self.head_dim = shapes[self.past_names[0]][1], shapes[self.past_names[0]][3]
        from quantkit.frontends.kv_cache import cache_dtypes

        # float32, or int8 for a decoder built with export.kv_cache: int8 (quantkit.frontends.kv_cache)
        self.cache_dtype = cache_dtypes(self.session)[self.past_names[0]]
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        self.can_keep = any(i.name == LOGITS_TO_KEEP for i in self.session.get_overridable_initializers())
        if max_length is not None and max_length < 1:
            raise ModelError(f"max_length must be >= 1 (got {max_length})")
        self.max_length = max_length
        self.reset()

    def reset(self, batch: int = 1) -> None:
        self.mask = np.zeros((batch, 0), np.int64)
        if self.max_length is None:
            empty = np.zeros((batch, self.kv_heads, 0, self.head_dim), self.cache_dtype)
            self.past = {n: empty for n in self.past_names}
            return
        import onnxruntime as ort

        shape = (batch, self.kv_heads, self.max_length, self.head_dim)
        self.arrays = {n: np.zeros(shape, self.cache_dtype) for n in self.past_names}
        # the OrtValues wrap the arrays' memory (no copy): writing into an array fills the bound buffer
        self.buffers = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self.arrays.items()}

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None, *,
                 logits_to_keep: int = 0) -> np.ndarray:
        """Run ``input_ids [B, S]`` after the cached positions; return logits ``[B, S, V]`` (``[B, k, V]``: the
        last ``k = logits_to_keep`` positions only, when ``k > 0`` and the graph has that input)."""
        ids = np.asarray(input_ids, np.int64)
        if self.mask.shape[1] == 0 and self.mask.shape[0] != ids.shape[0]:
            self.reset(ids.shape[0])
        new = np.ones(ids.shape, np.int64) if attention_mask is None else np.asarray(attention_mask, np.int64)
        if self.max_length is not None and self.mask.shape[1] + ids.shape[1] > self.max_length:
            raise ModelError(f"the KV cache holds max_length={self.max_length} positions; "
                             f"{self.mask.shape[1]} cached + {ids.shape[1]} new do not fit")  # fmt: skip
        first = self.mask.shape[1] == 0
        self.mask = np.concatenate([self.mask, new], axis=1)
        keep = np.asarray([logits_to_keep], np.int64) if logits_to_keep > 0 and self.can_keep else None
        if self.max_length is None or first:  # the prompt of a shared cache too: io_binding cannot bind
            past = self.past if self.max_length is None else {  # logits_to_keep (an overridable initializer)
                n: np.zeros((ids.shape[0], self.kv_heads, 0, self.head_dim), self.cache_dtype) for n in self.past_names}
            feed = {"input_ids": ids, "attention_mask": self.mask, **past}
            if keep is not None:
                feed[LOGITS_TO_KEEP] = keep
            outs = self.session.run(["logits", *self.present_names], feed)
            if self.max_length is None:
                self.past = dict(zip(self.past_names, outs[1:], strict=True))
            else:
                for n, present in zip(self.past_names, outs[1:], strict=True):
                    self.arrays[n][:, :, : present.shape[2]] = present
            return outs[0]
        io = self.session.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        io.bind_cpu_input("attention_mask", self.mask)
        for past, present in zip(self.past_names, self.present_names, strict=True):
            io.bind_ortvalue_input(past, self.buffers[past])
            io.bind_ortvalue_output(present, self.buffers[past])
        io.bind_output("logits")
        self.session.run_with_iobinding(io)
        logits = io.get_outputs()[-1].numpy()  # outputs in binding order: logits last
        return logits[:, -logits_to_keep:] if logits_to_keep > 0 and self.can_keep else logits


class ContextFullError(ModelError):
    """:func:`generate` reached the end of the model's context before ``max_new_tokens``: ``text`` and
    ``timings`` hold what was generated until then."""

    def __init__(self, message: str, text: str, timings: dict[str, Any]) -> None:
        super().__init__(message)
        self.text = text
        self.timings = timings


def decoder_positions(model_path: str | Path) -> int | None:
    """The positions a built decoder covers (its ``context_length`` property, else its ``cos_cache`` rows), None
    when the graph says neither."""
    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - ORT read the file already; without a readable cache the limit is unknown
        return None
    for prop in proto.metadata_props:
        if prop.key == "context_length" and prop.value.isdigit():
            return int(prop.value)
    for init in proto.graph.initializer:
        if init.name == "cos_cache" and init.dims:
            return int(init.dims[0])
    return None


def _vocab_width(session: Any) -> int | None:
    for o in session.get_outputs():
        if o.name == "logits" and o.shape and isinstance(o.shape[-1], int):
            return int(o.shape[-1])
    return None


def generate(
    model_path: str | Path,
    tokenizer_folder: str | Path,
    prompt: str,
    max_new_tokens: int = 32,
    *,
    threads: int | None = None,
    return_timings: bool = False,
) -> str | tuple[str, dict[str, Any]]:
    """Greedy generation with the KV cache (prefill the prompt, then one token per step).

    Returns the generated text (prompt excluded); with ``return_timings`` also
    ``{"prefill_ms", "decode_ms": [...], "tokens": [...]}``.

    Raises:
        ModelError: the tokenizer's ids exceed the model's vocabulary (it is not the model's tokenizer), or the
            prompt alone is longer than the model's context.
        ContextFullError: the context filled up before ``max_new_tokens``; it carries the text generated so far.
    """
    from transformers import AutoTokenizer

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ModelError(f"max_new_tokens {max_new_tokens!r}; allowed: an integer >= 1")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    ids = np.asarray([tok(prompt)["input_ids"]], np.int64)
    if ids.shape[1] == 0:
        raise ModelError(f"the prompt {prompt!r} gives no tokens; allowed: a prompt of at least one token")
    eos = tok.eos_token_id
    limit = decoder_positions(model_path)
    P = int(ids.shape[1])
    if limit is not None and P > limit:
        raise ModelError(f"the prompt has {P} tokens, more than the {limit} positions of the model's context; "
                         f"allowed: a prompt of at most {limit} tokens")  # fmt: skip
    cap = P + max_new_tokens if limit is None else min(P + max_new_tokens, limit)
    sess = LLMSession(model_path, threads=threads, max_length=cap)
    vocab = _vocab_width(sess.session)
    if vocab is not None and (len(tok) > vocab or int(ids.max()) >= vocab):
        raise ModelError(f"the tokenizer in {str(tokenizer_folder)!r} has {len(tok)} tokens (the prompt's largest id "
                         f"is {int(ids.max())}), but the model's vocabulary has {vocab} (ids 0 .. {vocab - 1}): they "
                         "do not belong together; allowed: the model's own tokenizer")  # fmt: skip
    t0 = time.perf_counter()
    logits = sess(ids, logits_to_keep=1)
    timings: dict[str, Any] = {"prefill_ms": (time.perf_counter() - t0) * 1e3, "decode_ms": [], "tokens": []}
    out: list[int] = []
    full = False
    for _ in range(max_new_tokens):
        nxt = int(np.argmax(logits[0, -1]))
        out.append(nxt)
        if (eos is not None and nxt == eos) or len(out) == max_new_tokens:
            break
        if sess.mask.shape[1] >= cap:  # the next token would need a position past the context
            full = True
            break
        t0 = time.perf_counter()
        logits = sess(np.asarray([[nxt]], np.int64))
        timings["decode_ms"].append((time.perf_counter() - t0) * 1e3)
    timings["tokens"] = out
    text = str(tok.decode(out, skip_special_tokens=True))
    if full:
        raise ContextFullError(
            f"stopped after {len(out)} of {max_new_tokens} new tokens: the model's context holds {limit} positions "
            f"and the prompt took {P}; allowed: at most {cap - P + 1} new tokens for this prompt", text, timings)
    return (text, timings) if return_timings else text
