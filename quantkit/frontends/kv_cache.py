"""An 8-bit KV cache for the decoders :mod:`quantkit.frontends.llm_builder` builds (recipe ``export.kv_cache: int8``).

ONNX Runtime's CPU ``GroupQueryAttention`` (``com.microsoft``, 1.32) keeps the cache itself in int8 when the node has
``k_quant_type = v_quant_type = "PER_CHANNEL"``, ``kv_cache_bit_width = 8`` and float32 scales as inputs 12 / 13
(``k_scale`` / ``v_scale``, ``[1, kv_heads, 1, head_dim]``): the new positions' keys (after the rotary embedding)
and values are stored as ``clamp(round(x / scale), -128, 127)`` and read back as ``q * scale``, in the prefill as
well as in decode (``docs/llm-layerwise.md``, "KV cache precision").

The cache's scales are calibrated on the decoder that ships (its quantized weights, the float32 cache):
:func:`calibrate_kv_scales` runs a prefill of each calibration window and takes, per layer, KV head and channel,
``max |x| / 127`` of the ``present.<i>.key|value`` outputs (exactly the post-rotary keys and the values the int8
cache will hold); :func:`int8_kv_cache` then rewrites the graph (a few attributes, two small initializers per
layer, the cache's graph inputs / outputs as int8; the weights' external data is not touched).

Keys of the rotated channels are stored with one scale per rotary pair (channels ``j`` and ``j + rotary_dim / 2``:
the rotation mixes them, position by position): the scale is the largest norm of the pair seen, which no position
can exceed, so a key never clips at positions longer than the calibration windows; on SmolLM2-135M it beat the
plain per-channel absmax at a 2048-token context (figures in ``docs/llm-layerwise.md``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from quantkit.errors import DataError, ModelError

__all__ = ["KV_CACHE_TYPES", "KV_SCALE_POLICIES", "cache_dtypes", "calibrate_kv_scales", "int8_kv_cache",
           "kv_cache_bytes", "kv_cache_type", "match_cache_feed", "ort_dtype"]  # fmt: skip

KV_CACHE_TYPES = ("float32", "int8")
"""``export.kv_cache``: the element type of the built decoder's ``past_key_values.*`` / ``present.*``."""

KV_SCALE_POLICIES = ("rotary_pair", "channel")
"""How the key scales are taken: ``rotary_pair`` (the default: one scale per rotated channel pair, the pair's
largest norm; the unrotated channels and the values per channel) or ``channel`` (every channel's own absmax)."""

_PAST, _PRESENT = "past_key_values.", "present."
_SCALE_INPUTS = 12  # k_scale is GroupQueryAttention's input 12, v_scale input 13
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8,
              "tensor(uint8)": np.uint8, "tensor(int64)": np.int64, "tensor(int32)": np.int32}  # fmt: skip


def ort_dtype(type_str: str) -> np.dtype:
    """The numpy dtype of an ONNX Runtime type string (``tensor(int8)`` -> int8)."""
    if type_str not in _ORT_TYPES:
        raise ModelError(f"input type {type_str!r} is not a KV-cache type quantkit feeds; known: {sorted(_ORT_TYPES)}")
    return np.dtype(_ORT_TYPES[type_str])


def cache_dtypes(session: Any) -> dict[str, np.dtype]:
    """``past_key_values.*`` input name -> the element type the session takes (float32, or int8 for an 8-bit cache)."""
    return {i.name: ort_dtype(i.type) for i in session.get_inputs() if i.name.startswith(_PAST)}


def match_cache_feed(session: Any, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feed`` with its ``past_key_values.*`` arrays in the element types ``session`` takes.

    A feed built for one decoder (float32 zeros of an empty or synthetic past) then runs another with an int8
    cache: zeros stay zeros.  Other inputs are passed as they are."""
    out = dict(feed)
    for name, dt in cache_dtypes(session).items():
        if name in out and np.asarray(out[name]).dtype != dt:
            if np.any(out[name]):
                raise ModelError(f"{name}: a {np.asarray(out[name]).dtype} cache with values cannot feed a {dt} "
                                 "cache input (only empty or zero pasts are converted)")  # fmt: skip
            out[name] = np.zeros(np.shape(out[name]), dt)
    return out


def kv_cache_type(model_path: str | os.PathLike[str]) -> str:
    """``"int8"`` or ``"float32"``: the element type of a built decoder's cache (from its first past input)."""
    m = onnx.load(str(model_path), load_external_data=False)
    for i in m.graph.input:
        if i.name.startswith(_PAST):
            return "int8" if i.type.tensor_type.elem_type == TensorProto.INT8 else "float32"
    raise ModelError(f"{str(model_path)!r} has no past_key_values.* inputs: not a KV-cache decoder")


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, positions: int, kv_cache: str = "float32",
                   batch: int = 1) -> int:
    """Bytes of the past keys and values of ``positions`` cached positions (all layers)."""
    item = 1 if kv_cache == "int8" else 4
    return 2 * layers * batch * kv_heads * positions * head_dim * item


def _gqa_nodes(model: onnx.ModelProto) -> dict[int, onnx.NodeProto]:
    """Layer index -> its ``GroupQueryAttention`` node (read from the node's ``past_key_values.<i>.key`` input)."""
    out: dict[int, onnx.NodeProto] = {}
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention" and len(n.input) > 4 and n.input[3].startswith(_PAST):
            out[int(n.input[3][len(_PAST):].split(".")[0])] = n
    return out


def _rotary_half(model: onnx.ModelProto) -> int:
    """``rotary_dim / 2``: the columns of the cos cache (0 when the graph has none)."""
    for t in model.graph.initializer:
        if t.name.startswith("cos_cache") and len(t.dims) == 2:
            return int(t.dims[1])
    return 0


def _pair_max(absmax: np.ndarray, sqmax: np.ndarray, half: int) -> np.ndarray:
    """Key scales (times 127) where channels ``j`` and ``j + half`` (``j < half``) share the largest norm of the
    pair (``sqmax``: the largest ``k_j^2 + k_{j+half}^2`` over positions, ``[kv, half]``); channels past
    ``2 * half`` keep their absmax."""
    out = absmax.copy()
    norm = np.sqrt(sqmax).astype(np.float32)
    out[..., :half] = norm
    out[..., half : 2 * half] = norm
    return out


def calibrate_kv_scales(model_path: str | os.PathLike[str], windows: np.ndarray | Iterable[np.ndarray], *,
                        policy: str = "rotary_pair", margin: float = 1.0, threads: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer, per-KV-head, per-channel scales of the keys and values ``model_path`` caches, on ``windows``.

    Args:
        model_path: a built KV-cache decoder with a float32 cache (:func:`~quantkit.frontends.llm_builder.build_llm`,
            or the layer-wise quantizer's output).
        windows: token ids ``[n, seq]`` (or rows of ids); each row is one prefill from position 0.
        policy: one of :data:`KV_SCALE_POLICIES`.
        margin: the scales are ``margin * max |x| / 127`` (1.0: the calibration's largest value maps to 127).
        threads: ONNX Runtime intra-op threads.

    Returns:
        ``(k_scales, v_scales)``, float32 ``[layers, kv_heads, head_dim]``.

    Raises:
        ModelError: not a decoder with a float32 cache; DataError: no window, or a policy / margin not allowed.
    """
    import onnxruntime as ort

    if policy not in KV_SCALE_POLICIES:
        raise DataError(f"KV scale policy {policy!r}; allowed: {', '.join(KV_SCALE_POLICIES)}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 1.0 <= margin <= 4.0:
        raise DataError(f"KV scale margin {margin!r}; allowed: a number from 1.0 to 4.0")
    proto = onnx.load(str(model_path), load_external_data=False)
    gqa = _gqa_nodes(proto)
    if not gqa:
        raise ModelError(f"{str(model_path)!r} has no GroupQueryAttention reading past_key_values.*: not a decoder "
                         "quantkit built")  # fmt: skip
    half = _rotary_half(proto)
    rotated = {i for i, n in gqa.items() if any(a.name == "do_rotary" and a.i for a in n.attribute)}
    del proto
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    types = cache_dtypes(sess)
    if any(dt != np.float32 for dt in types.values()):
        raise ModelError(f"{str(model_path)!r} already has a {next(iter(types.values()))} KV cache; the scales are "
                         "calibrated on the decoder with the float32 cache")  # fmt: skip
    shapes = {i.name: i.shape for i in sess.get_inputs() if i.name.startswith(_PAST)}
    layers = sorted(gqa)
    kv, hd = shapes[f"{_PAST}{layers[0]}.key"][1], shapes[f"{_PAST}{layers[0]}.key"][3]
    keep = any(i.name == "logits_to_keep" for i in sess.get_overridable_initializers())
    names = [f"{_PRESENT}{i}.{kind}" for i in layers for kind in ("key", "value")]
    absmax = {n: np.zeros((kv, hd), np.float32) for n in names}
    sqmax = {i: np.zeros((kv, half), np.float32) for i in layers if i in rotated}
    seen = 0
    for row in windows:
        ids = np.asarray(row, np.int64).reshape(1, -1)
        if ids.shape[1] == 0:
            continue
        feed: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        feed.update({n: np.zeros((1, kv, 0, hd), np.float32) for n in shapes})
        if keep:
            feed["logits_to_keep"] = np.ones(1, np.int64)
        for n, x in zip(names, sess.run(names, feed), strict=True):
            np.maximum(absmax[n], np.abs(x[0]).max(axis=1), out=absmax[n])
            i = int(n[len(_PRESENT):].split(".")[0])
            if n.endswith(".key") and i in sqmax:
                pair = x[0, :, :, :half] ** 2 + x[0, :, :, half : 2 * half] ** 2
                np.maximum(sqmax[i], pair.max(axis=1), out=sqmax[i])
        seen += 1
    if not seen:
        raise DataError("the KV-cache scales need calibration windows; got none")
    k = np.stack([_pair_max(absmax[f"{_PRESENT}{i}.key"], sqmax[i], half) if policy == "rotary_pair" and i in sqmax
                  else absmax[f"{_PRESENT}{i}.key"] for i in layers])  # fmt: skip
    v = np.stack([absmax[f"{_PRESENT}{i}.value"] for i in layers])
    tiny = np.float32(1e-8)  # a channel that was always 0 (a dead head dim): any scale stores it exactly
    scale = np.float32(margin) / np.float32(127.0)
    return (np.maximum(k, tiny) * scale).astype(np.float32), (np.maximum(v, tiny) * scale).astype(np.float32)


def int8_kv_cache(model: onnx.ModelProto, k_scales: np.ndarray, v_scales: np.ndarray) -> onnx.ModelProto:
    """Rewrite a built decoder (in place; returned) to keep its KV cache in int8 inside ``GroupQueryAttention``.

    Every ``GroupQueryAttention`` reading ``past_key_values.<i>.*`` gets ``k_quant_type = v_quant_type =
    "PER_CHANNEL"``, ``kv_cache_bit_width = 8`` and the initializers ``past_key_values.<i>.key_scale`` /
    ``.value_scale`` (``k_scales[i]`` / ``v_scales[i]`` as ``[1, kv_heads, 1, head_dim]``) as inputs 12 / 13; the
    ``past_key_values.*`` inputs and ``present.*`` outputs become int8; metadata ``kv_cache = int8``.

    Raises:
        ModelError: not a float32-cache decoder of quantkit's builder, or scales of the wrong shape / not positive.
    """
    g = model.graph
    gqa = _gqa_nodes(model)
    if not gqa:
        raise ModelError("the graph has no GroupQueryAttention reading past_key_values.*: not a decoder quantkit built")
    io = {v.name: v for v in [*g.input, *g.output] if v.name.startswith((_PAST, _PRESENT))}
    if any(v.type.tensor_type.elem_type != TensorProto.FLOAT for v in io.values()):
        raise ModelError("the decoder's KV cache is not float32: int8_kv_cache rewrites a float32-cache decoder once")
    k_scales, v_scales = np.asarray(k_scales, np.float32), np.asarray(v_scales, np.float32)
    first = io[f"{_PAST}{min(gqa)}.key"].type.tensor_type.shape.dim
    kv, hd = int(first[1].dim_value), int(first[3].dim_value)
    want = (max(gqa) + 1, kv, hd)
    for what, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if s.shape != want or not np.all(np.isfinite(s)) or not np.all(s > 0):
            raise ModelError(f"{what}: shape {list(s.shape)}, expected {list(want)} (layers, kv_heads, head_dim) of "
                             "positive finite scales")  # fmt: skip
    for i, n in sorted(gqa.items()):
        names = []
        for kind, s in (("key", k_scales[i]), ("value", v_scales[i])):
            name = f"{_PAST}{i}.{kind}_scale"
            g.initializer.append(onnx.numpy_helper.from_array(s.reshape(1, kv, 1, hd), name))
            names.append(name)
        ins = list(n.input) + [""] * (_SCALE_INPUTS - len(n.input))
        del n.input[:]
        n.input.extend(ins[:_SCALE_INPUTS] + names)
        n.attribute.extend([helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                            helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                            helper.make_attribute("kv_cache_bit_width", 8)])  # fmt: skip
    for v in io.values():
        v.type.tensor_type.elem_type = TensorProto.INT8
    props = {p.key: p.value for p in model.metadata_props}
    props["kv_cache"] = "int8"
    helper.set_model_props(model, props)
    return model


def write_int8_kv_cache(model_path: str | os.PathLike[str], k_scales: np.ndarray, v_scales: np.ndarray) -> Path:
    """:func:`int8_kv_cache` on the ``.onnx`` file ``model_path`` (the graph only: its external data stays)."""
    path = Path(model_path)
    m = int8_kv_cache(onnx.load(str(path), load_external_data=False), k_scales, v_scales)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(m.SerializeToString())
    os.replace(tmp, path)
    return path
