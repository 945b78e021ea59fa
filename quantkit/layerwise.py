"""Layer-wise, streaming weight-only quantization of a LLaMA-family checkpoint (block by block).

The whole-graph path (:mod:`quantkit.weight_only`) loads the FP32 model and runs it in ONNX Runtime
once per stage: fine for SmolLM2 (0.5 GB), impossible for a 7B model (28 GB in FP32) on a 24 GB machine.
:func:`quantize_llm_layerwise` instead rides on the streaming builder
(:func:`quantkit.frontends.llm_builder.build_llm` with a :class:`~quantkit.frontends.llm_builder.BuildHook`):

1. the embedding rows of the calibration windows are the hidden states entering block 0, kept in a
   float32 ``.npy`` file in the work folder, memory-mapped (``windows x seq x hidden``: 32 MB for
   8 x 512 tokens of a 1.1B model);
2. for block ``i`` (its tensors read from the checkpoint, nothing else held) the block alone is built as
   an ONNX graph (:func:`~quantkit.frontends.llm_builder.block_model`: the same fused ops the shipped
   model has) and run in ONNX Runtime on the cached hidden states, one window at a time, to collect
   ``Σxᵀx`` / ``|x|`` statistics (:class:`~quantkit.calibrate.layer_stats.LayerStats`) of the layers'
   inputs, group by group in graph order (q/k/v, o_proj, gate/up, down_proj): each group is quantized
   (RTN / GPTQ / AWQ / SignRound, per the precision plan) before the next group's inputs are collected,
   so later layers see the quantized earlier ones (as GPTQ's "true sequential" order);
3. the block with all its layers quantized (``MatMulNBits``: what ships) produces the hidden states for
   block ``i + 1``; the builder writes the packed weights and moves on.

Peak memory is one block's float weights plus its ORT session plus the statistics of one group (a
``K x K`` float64 matrix: 254 MB for K = 5632), whatever the depth.  Resumable: every finished block's
packed weights go into the work folder with the hidden states after it; a run interrupted at block 17
restarts from there (the key: the checkpoint's files, the plan and the calibration tokens).  Layers
whose algorithm needs no statistics (RTN) need no calibration data at all: then no block is ever run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from quantkit.algorithms.woq import WOQResult, get_weight_algorithm
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import DataError, RecipeError
from quantkit.frontends.llm_builder import (
    BuildHook,
    DecoderConfig,
    PackedLinear,
    block_model,
    build_llm,
    linear_shapes,
    read_decoder_config,
)
from quantkit.lowering.nbits import matmul_nbits_arrays
from quantkit.recipe.plan import LayerPlan, PrecisionPlan
from quantkit.weight_only import STATS_ALGORITHMS

log = logging.getLogger("quantkit")

__all__ = ["LAYERWISE_FORMATS", "LayerwiseResult", "quantize_llm_layerwise"]

LAYERWISE_FORMATS = {"int4": 4, "int8_weight": 8, "fp32": None}
"""Formats the layer-wise builder writes (bits; ``None`` = kept in float)."""
# graph order of a block's linears, grouped by the tensor they read
_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
           ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # fmt: skip


@dataclass
class LayerwiseResult:
    """What :func:`quantize_llm_layerwise` did: the model written, one row per layer, timings."""

    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    resumed_blocks: int = 0
    calibration_tokens: int = 0


def _f32(t: Any) -> np.ndarray:
    """A stored checkpoint tensor (torch bf16/fp16/fp32 or numpy) as a float32 numpy array."""
    if isinstance(t, np.ndarray):
        return np.asarray(t, np.float32)
    import torch

    return t.to(torch.float32).numpy()


def _pack(res: WOQResult, accuracy_level: int) -> PackedLinear:
    B, scales, zp, bs = matmul_nbits_arrays(res)
    K, N = res.shape
    return PackedLinear(B, scales, zp, res.bits, bs, K, N, res.input_scale, accuracy_level)


# float32 bytes of W per column slice (RTN's temporaries are ~12x a slice; GPTQ factors the Hessian once per
# slice, so its slices are larger)
_COLUMN_WISE = {"rtn": 16 << 20, "gptq": 256 << 20}
_SLICE_BYTES = 64 << 20


def _concat(parts: list[WOQResult]) -> WOQResult:
    """Column slices of one layer's result, side by side."""
    return WOQResult(np.concatenate([p.codes for p in parts], axis=1),
                     np.concatenate([p.scales for p in parts], axis=1),
                     np.concatenate([p.zero_points for p in parts], axis=1), parts[0].bits, parts[0].group_size,
                     parts[0].symmetric, None)  # fmt: skip


def _layer_row(name: str, lp: LayerPlan, algo: str, w: np.ndarray, res: WOQResult, stats: LayerStats | None,
               block: int, seconds: float) -> dict[str, Any]:
    """The report row of one layer; the errors are summed over column slices (bounded temporaries)."""
    K, N = res.shape
    H = stats.hessian() if stats is not None and stats.count else None
    err2 = ref2 = num = den = 0.0
    step = max(256, _SLICE_BYTES // (8 * K))
    for j in range(0, N, step):
        part = WOQResult(res.codes[:, j : j + step], res.scales[:, j : j + step], res.zero_points[:, j : j + step],
                         res.bits, res.group_size, res.symmetric, res.input_scale)  # fmt: skip
        w64 = w[:, j : j + step].astype(np.float64)
        d = w64 - part.effective_weight().astype(np.float64)
        err2 += float(np.sum(d * d))
        ref2 += float(np.sum(w64 * w64))
        if H is not None:
            num += float(np.sum((H @ w64) * w64))  # tr(Wᵀ H W) = E‖xW‖²
            den += float(np.sum((H @ d) * d))  # E‖x(W - Ŵ)‖²
    row: dict[str, Any] = {
        "layer": name, "format": lp.format, "algorithm": algo, "bits": res.bits, "group_size": res.group_size,
        "symmetric": res.symmetric, "K": K, "N": N, "block": block,
        "weight_rel_error": float(np.sqrt(err2) / max(np.sqrt(ref2), 1e-30)),
        "awq_scaled": res.input_scale is not None, "seconds": round(seconds, 3),
    }  # fmt: skip
    if H is not None:
        row["output_sqnr_db"] = float("inf") if den <= 0 else float(10 * np.log10(max(num, 1e-300) / den))
    return row


class _Hook(BuildHook):
    def __init__(self, cfg: DecoderConfig, plan: PrecisionPlan, windows: np.ndarray | None, work: Path,
                 key: str, *, accuracy_level: int, max_rows: int, progress: bool, resume: bool) -> None:
        self.cfg, self.plan, self.windows, self.work, self.key = cfg, plan, windows, work, key
        self.accuracy_level, self.max_rows, self.progress = accuracy_level, max_rows, progress
        self.result_rows: list[dict[str, Any]] = []
        self.notes: dict[str, str] = {}
        self.resumed = 0
        self.hidden: np.ndarray | None = None  # memory-mapped [windows, seq, H] entering the current block
        self.plans = {f"model.layers.{i}.{s}": self._layer_plan(f"model.layers.{i}.{s}")
                      for i in range(cfg.num_hidden_layers) for s in linear_shapes(cfg)}  # fmt: skip
        self.plans["lm_head"] = self._layer_plan("lm_head")
        # the input embedding of a tied model whose head is rounded from statistics (stored apart): a Gather,
        # so rounded to the nearest level (its own plan entry, format / group as the recipe says)
        emb = self._layer_plan("model.embed_tokens")
        self.plans["model.embed_tokens"] = dataclasses.replace(emb, algorithm="rtn", algorithm_options=())
        self.needs_stats = windows is not None and any(
            LAYERWISE_FORMATS[lp.format] is not None and lp.algorithm in STATS_ALGORITHMS
            for lp in self.plans.values())  # fmt: skip
        if not resume:
            shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        state = self._state()
        if state.get("key") != key:
            for f in work.glob("*"):
                f.unlink()
            self._save_state({"key": key, "done": -1})
        self.bar = tqdm(total=cfg.num_hidden_layers, desc="quantize blocks", unit="block", disable=not progress)

    # -- state ------------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.work / "state.json").read_text()))
        except (OSError, ValueError):
            return {}

    def _save_state(self, state: dict[str, Any]) -> None:
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.work / "state.json")

    def _layer_plan(self, name: str) -> LayerPlan:
        lp = self.plan.layer(name, "MatMul", name)
        if lp.format not in LAYERWISE_FORMATS:
            raise RecipeError(
                f"layer {name!r}: format {lp.format!r} cannot be built layer-wise; allowed: {sorted(LAYERWISE_FORMATS)} "
                "(set calibration.layerwise: false for the whole-graph path)"
            )
        return lp

    # -- quantizing one layer ---------------------------------------------------------------------------
    def _quantize(self, name: str, w: np.ndarray, stats: LayerStats | None, block: int) -> PackedLinear | None:
        lp = self.plans[name]
        bits = LAYERWISE_FORMATS[lp.format]
        if bits is None:
            return None
        algo = lp.algorithm
        if algo in STATS_ALGORITHMS and stats is None:
            self.notes[name] = f"{algo} -> rtn (no calibration statistics for this layer)"
            algo = "rtn"
        t0 = time.perf_counter()
        opts = dict(lp.algorithm_options) if algo == lp.algorithm else {}
        fn = get_weight_algorithm(algo)
        K, N = w.shape
        # RTN and GPTQ treat every output column on its own (GPTQ: given the shared Hessian), so a wide
        # layer (an lm_head: 49152 or 128256 columns) is quantized in column slices: same result, a slice's
        # temporaries instead of the whole layer's
        step = N if algo not in _COLUMN_WISE else max(256, _COLUMN_WISE[algo] // (4 * K))
        parts = [fn(np.ascontiguousarray(w[:, j : j + step]), bits=bits, group_size=lp.group_size,
                    symmetric=lp.weight_symmetric, stats=stats, **opts) for j in range(0, N, step)]  # fmt: skip
        res = parts[0] if len(parts) == 1 else _concat(parts)
        del parts
        self.result_rows.append(_layer_row(name, lp, algo, w, res, stats, block, time.perf_counter() - t0))
        return _pack(res, self.accuracy_level)

    def _quantize_group(self, names: list[str], ws: dict[str, np.ndarray], stats: LayerStats | None,
                        block: int) -> dict[str, PackedLinear]:
        out: dict[str, PackedLinear] = {}
        awq = [n for n in names if LAYERWISE_FORMATS[self.plans[n].format] is not None
               and self.plans[n].algorithm == "awq" and stats is not None]  # fmt: skip
        keys = {(self.plans[n].format, self.plans[n].group_size, self.plans[n].weight_symmetric,
                 tuple(self.plans[n].algorithm_options)) for n in awq}  # fmt: skip
        if awq and len(keys) == 1:  # one AWQ input scale shared by the layers reading this input
            from quantkit.algorithms.awq import awq_shared

            lp = self.plans[awq[0]]
            bits = LAYERWISE_FORMATS[lp.format]
            assert bits is not None  # noqa: S101 - filtered above
            t0 = time.perf_counter()
            opts: dict[str, Any] = dict(lp.algorithm_options)
            results = awq_shared([ws[n] for n in awq], stats, bits=bits, group_size=lp.group_size,
                                 symmetric=lp.weight_symmetric, **opts)  # fmt: skip
            dt = (time.perf_counter() - t0) / len(awq)
            for n, r in zip(awq, results, strict=True):
                self.result_rows.append(_layer_row(n, lp, "awq", ws[n], r, stats, block, dt))
                out[n] = _pack(r, self.accuracy_level)
        for n in names:
            if n not in out:
                q = self._quantize(n, ws[n], stats, block)
                if q is not None:
                    out[n] = q
        return out

    # -- running a block on the cached hidden states ----------------------------------------------------
    def _session(self, index: int, weights: dict[str, Any], packed: dict[str, PackedLinear], taps: list[str]) -> Any:
        import onnxruntime as ort

        proto = block_model(self.cfg, index, weights, packed, taps)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        blob = proto.SerializeToString()
        del proto
        return ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])

    def _feeds(self, index: int) -> Iterable[tuple[int, dict[str, np.ndarray]]]:
        assert self.hidden is not None and self.windows is not None  # noqa: S101 - set by embedding()
        n, S = self.windows.shape
        empty = np.zeros((1, self.cfg.num_key_value_heads, 0, self.cfg.head_dim), np.float32)
        mask = np.ones((1, S), np.int64)
        for j in range(n):
            yield j, {"hidden": np.ascontiguousarray(self.hidden[j : j + 1]), "attention_mask": mask,
                      f"past_key_values.{index}.key": empty, f"past_key_values.{index}.value": empty}  # fmt: skip

    def _collect(self, index: int, weights: dict[str, Any], packed: dict[str, PackedLinear], tap: str, K: int
                 ) -> LayerStats:
        sess = self._session(index, weights, packed, [tap])
        stats = LayerStats(K, max_rows=self.max_rows)
        for _, feed in self._feeds(index):
            stats.update(sess.run([f"{tap}/input"], feed)[0])
        return stats

    def _advance(self, index: int, weights: dict[str, Any], packed: dict[str, PackedLinear]) -> None:
        """Run the quantized block on the cached states; they become block ``index + 1``'s input."""
        sess = self._session(index, weights, packed, [])
        nxt = np.lib.format.open_memmap(self.work / f"hidden_{index + 1}.npy.tmp", mode="w+", dtype=np.float32,
                                        shape=self.hidden.shape if self.hidden is not None else (0,))  # fmt: skip
        for j, feed in self._feeds(index):
            nxt[j : j + 1] = sess.run(["hidden_out"], feed)[0]
        nxt.flush()
        del nxt, sess
        os.replace(self.work / f"hidden_{index + 1}.npy.tmp", self.work / f"hidden_{index + 1}.npy")

    # -- the BuildHook ----------------------------------------------------------------------------------
    def untie_head(self) -> bool:
        lp = self.plans["lm_head"]
        return self.needs_stats and LAYERWISE_FORMATS[lp.format] is not None and lp.algorithm in STATS_ALGORITHMS

    def embedding(self, table: Any, tied: bool) -> PackedLinear | None:
        q = None
        if tied:
            E = _f32(table)
            q = self._quantize("model.embed_tokens" if self.untie_head() else "lm_head", np.ascontiguousarray(E.T),
                               None, -1)  # fmt: skip
            if q is not None and self.plans["lm_head"].algorithm in STATS_ALGORITHMS and not self.untie_head():
                self.notes["lm_head"] = (f"{self.plans['lm_head'].algorithm} -> rtn: a tied embedding / lm_head is "
                                         "quantized before any block runs")  # fmt: skip
            del E
        if self.needs_stats and self.windows is not None and self._state().get("done", -1) < 0:
            path = self.work / "hidden_0.npy"
            if not path.is_file():
                tmp = self.work / "hidden_0.npy.tmp"
                h = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32,
                                              shape=(*self.windows.shape, self.cfg.hidden_size))  # fmt: skip
                if q is not None and tied:  # the rows the shipped GatherBlockQuantized returns
                    rows = self._dequantized_rows(q, self.windows)
                else:
                    rows = None
                for j in range(self.windows.shape[0]):
                    h[j] = rows[j] if rows is not None else _f32(table[self.windows[j]])
                h.flush()
                del h
                os.replace(tmp, path)
            self.hidden = np.load(path, mmap_mode="r")
        return q

    @staticmethod
    def _dequantized_rows(q: PackedLinear, ids: np.ndarray) -> np.ndarray:
        from quantkit.scheme.packing import unpack_int4

        uniq, inv = np.unique(ids, return_inverse=True)
        V, kb, _ = q.B.shape
        u = len(uniq)
        codes = q.B[uniq]
        if q.bits == 4:
            codes = unpack_int4(codes, u * kb * q.block_size, False).reshape(u, kb, q.block_size)
        zp = np.full((u, kb), 1 << (q.bits - 1), np.float32)
        if q.zero_points is not None:
            zq = q.zero_points[uniq]
            if q.bits == 4:
                zq = unpack_int4(zq, zq.size * 2, False).reshape(u, -1)[:, :kb]
            zp = zq.astype(np.float32)
        rows = (codes.astype(np.float32) - zp[:, :, None]) * q.scales[uniq][:, :, None]
        rows = rows.reshape(len(uniq), kb * q.block_size)[:, : q.K]
        return rows[inv.reshape(ids.shape)]

    def block(self, index: int, weights: dict[str, Any]) -> dict[str, PackedLinear]:
        p = f"model.layers.{index}"
        saved = self.work / f"block_{index}.npz"
        state = self._state()
        if self.needs_stats and state.get("done", -1) >= index and saved.is_file():
            loaded = self._load(saved)
            self.resumed += 1
            if index == state["done"]:  # the last finished block: its output is the next block's input
                self.hidden = np.load(self.work / f"hidden_{index + 1}.npy", mmap_mode="r")
            self.bar.update(1)
            return loaded
        ws = {f"{p}.{s}": np.ascontiguousarray(_f32(weights[f"{p}.{s}.weight"]).T) for s in linear_shapes(self.cfg)}
        packed: dict[str, PackedLinear] = {}
        for group in _GROUPS:
            names = [f"{p}.{s}" for s in group]
            wants = [n for n in names if LAYERWISE_FORMATS[self.plans[n].format] is not None
                     and self.plans[n].algorithm in STATS_ALGORITHMS]  # fmt: skip
            stats = None
            if wants and self.needs_stats:
                stats = self._collect(index, weights, packed, names[0], ws[names[0]].shape[0])
            packed.update(self._quantize_group(names, ws, stats, index))
            del stats
        del ws
        if self.needs_stats:
            self._advance(index, weights, packed)
            self._save(saved, packed)
            self._save_state({"key": self.key, "done": index})
            self._next_hidden(index)
        self.bar.update(1)
        return packed

    def _next_hidden(self, index: int) -> None:
        self.hidden = np.load(self.work / f"hidden_{index + 1}.npy", mmap_mode="r")
        old = self.work / f"hidden_{index}.npy"
        if old.is_file() and index >= 0:
            old.unlink()

    def lm_head(self, weight: Any, norm_weight: Any) -> PackedLinear | None:
        stats = None
        lp = self.plans["lm_head"]
        if self.needs_stats and self.hidden is not None and lp.algorithm in STATS_ALGORITHMS and norm_weight is not None:
            gamma = _f32(norm_weight)
            stats = LayerStats(self.cfg.hidden_size, max_rows=self.max_rows)
            for j in range(self.hidden.shape[0]):
                x = np.asarray(self.hidden[j], np.float32)
                var = np.mean(x * x, axis=-1, keepdims=True)
                stats.update((x / np.sqrt(var + np.float32(self.cfg.rms_norm_eps))) * gamma)
        return self._quantize("lm_head", np.ascontiguousarray(_f32(weight).T), stats, self.cfg.num_hidden_layers)

    def finish(self) -> None:
        self.bar.close()

    # -- saved blocks -----------------------------------------------------------------------------------
    def _save(self, path: Path, packed: dict[str, PackedLinear]) -> None:
        arrays: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {}
        for n, q in packed.items():
            arrays[f"{n}|B"], arrays[f"{n}|scales"] = q.B, q.scales
            if q.zero_points is not None:
                arrays[f"{n}|zp"] = q.zero_points
            if q.input_scale is not None:
                arrays[f"{n}|s"] = np.asarray(q.input_scale, np.float32)
            meta[n] = [q.bits, q.block_size, q.K, q.N, q.accuracy_level]
        rows = [r for r in self.result_rows if r.get("block") == int(path.stem.split("_")[1])]
        arrays["__meta__"] = np.frombuffer(json.dumps({"layers": meta, "rows": rows}).encode(), np.uint8)
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)

    def _load(self, path: Path) -> dict[str, PackedLinear]:
        with np.load(path) as z:
            meta = json.loads(bytes(z["__meta__"]).decode())
            out = {}
            for n, (bits, bs, K, N, acc) in meta["layers"].items():
                out[n] = PackedLinear(z[f"{n}|B"], z[f"{n}|scales"], z[f"{n}|zp"] if f"{n}|zp" in z else None,
                                      bits, bs, K, N, z[f"{n}|s"] if f"{n}|s" in z else None, acc)  # fmt: skip
            self.result_rows.extend(meta["rows"])
        return out


def _key(folder: Path, plan: PrecisionPlan, windows: np.ndarray | None, accuracy_level: int) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update(repr(sorted((k, repr(v)) for k, v in plan.recipe.quantization.model_dump().items())).encode())
    h.update(str(accuracy_level).encode())
    if windows is not None:
        h.update(np.ascontiguousarray(windows).tobytes())
    return h.hexdigest()[:24]


def quantize_llm_layerwise(
    folder: str | Path,
    out_path: str | Path,
    plan: PrecisionPlan,
    windows: np.ndarray | None,
    *,
    work_dir: str | Path,
    accuracy_level: int = 4,
    max_rows: int = 4096,
    progress: bool = True,
    resume: bool = True,
) -> LayerwiseResult:
    """Build ``out_path`` (an INT4 / INT8 weight-only KV-cache decoder) from the HF ``folder``, block by block.

    Args:
        folder: local LLaMA-family HF folder (safetensors, bf16 / fp16 / fp32, sharded or not).
        out_path: the ``.onnx`` to write (weights in ``<name>.onnx.data``, plus ``genai_config.json``).
        plan: the precision plan (recipe default + overrides, by layer name: ``model.layers.3.mlp.down_proj``,
            ``lm_head``); formats ``int4``, ``int8_weight`` or ``fp32``.
        windows: calibration token ids ``[n, seq]`` (int64), or ``None`` when every layer is RTN.
        work_dir: where the hidden states and finished blocks are kept (resumable; removed on success).
        accuracy_level: ``MatMulNBits`` accuracy level (4: int8 activations inside the kernel).
        max_rows: rows of each layer input kept as a sample (AWQ's search).
        resume: continue from the blocks an earlier, interrupted run with the same key finished.

    Raises:
        RecipeError: a layer's format cannot be built layer-wise.
        DataError: an algorithm needs statistics and ``windows`` is missing or not ``[n, seq]`` ids.
    """
    folder, out, work = Path(folder), Path(out_path), Path(work_dir)
    cfg = read_decoder_config(folder)
    if windows is not None:
        windows = np.asarray(windows, np.int64)
        if windows.ndim != 2 or windows.size == 0:
            raise DataError(f"calibration windows must be token ids [n, seq]; got shape {windows.shape}")
        if int(windows.max()) >= cfg.vocab_size or int(windows.min()) < 0:
            raise DataError(f"calibration token ids outside the vocabulary [0, {cfg.vocab_size})")
    t0 = time.perf_counter()
    key = _key(folder, plan, windows, accuracy_level)
    hook = _Hook(cfg, plan, windows, work, key, accuracy_level=accuracy_level, max_rows=max_rows,
                 progress=progress, resume=resume)  # fmt: skip
    if any(lp.algorithm in STATS_ALGORITHMS and LAYERWISE_FORMATS[lp.format] for lp in hook.plans.values()) \
            and windows is None:
        raise DataError("GPTQ / AWQ / SignRound need calibration data: set calibration.data")
    path = build_llm(folder, out, hook=hook)
    shutil.rmtree(work, ignore_errors=True)
    res = LayerwiseResult(path, hook.result_rows, hook.notes, {"build_s": time.perf_counter() - t0},
                          hook.resumed, int(windows.size) if windows is not None else 0)  # fmt: skip
    return res
