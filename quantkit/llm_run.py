"""A decoder LLM streamed block by block (``calibration.layerwise``: ``auto``, the default, or ``true``): build,
calibrate and quantize it block by block, then evaluate and report it; and the choice between that path and the
whole-graph one (:func:`choose_route`), guarded by an estimate of the whole graph's peak memory.

The weights never exist as one FP32 model in memory (see :mod:`quantkit.layerwise`): the checkpoint streams
through the builder, each decoder block is calibrated alone on the cached hidden states and written as
``MatMulNBits``.  The emitted model is then measured from its files, as users run it: perplexity on the
evaluation windows, prefill and per-token decode with the KV cache, FP32 against quantized in the same
run.  The FP32 baseline follows the same memory principle (``evaluation.fp32_baseline``,
:mod:`quantkit.evaluate.streamed`): held whole when its weights are no larger than the streamed run's own
estimated peak, else streamed - its perplexity block by block, its latency on decoders truncated to the blocks
that fit; the report's ``fp32_baseline`` says which and why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quantkit.data import InputInfo, as_dataset, make_dataset
from quantkit.errors import DataError, ModelError, QuantkitError, RecipeError
from quantkit.evaluate.streamed import extra_datasets, merge_extra, streamed_perplexity, truncated_latency
from quantkit.frontends.cache import cache_dir
from quantkit.int4_kernel import build_level, choose_for_file
from quantkit.layerwise import LAYERWISE_FORMATS, moe_dispatch_warnings, quantize_llm_layerwise
from quantkit.lowering.w4a8 import check_bytes
from quantkit.memory import (
    Available,
    Estimate,
    announce,
    available_memory,
    check_fits,
    choose_baseline,
    decoder_sizes,
    gb,
    layerwise_estimate,
    onnx_weight_bytes,
    whole_graph_estimate,
)
from quantkit.pipeline import check_context, check_not_empty, extra_perplexities
from quantkit.progress import stage
from quantkit.recipe import RecipeModel
from quantkit.recipe.plan import PrecisionPlan, class_section
from quantkit.report.build import complete_report, environment, load_average, map_layer_kernels, write_report
from quantkit.scheme.target import resolve_target
from quantkit.tempdirs import MARKER, clean_stale, owned_tempdir

log = logging.getLogger("quantkit")

__all__ = ["LayerwiseQuantizeResult", "Route", "check_layerwise_plan", "choose_route", "decoder_folder",
           "layerwise_blockers", "resolve_llm_folder", "run_layerwise"]

_LM_INPUTS = [InputInfo("input_ids", np.dtype(np.int64), (None, None)),
              InputInfo("attention_mask", np.dtype(np.int64), (None, None))]  # fmt: skip


@dataclass
class LayerwiseQuantizeResult:
    """What :func:`quantkit.quantize` returns for a layer-wise recipe: the files built and the report."""

    path: Path  # model.onnx (+ model.onnx.data, genai_config.json, tokenizer files beside it)
    report: dict[str, Any]
    recipe: RecipeModel
    timings: dict[str, float] = field(default_factory=dict)

    def save(self, directory: str | os.PathLike[str], *, report: bool = True, overwrite: bool = False
             ) -> dict[str, Path]:
        """Move the built files and the report into ``directory`` as one set (see :meth:`QuantizeResult.save`)."""
        from quantkit.recipe.load import recipe_inputs
        from quantkit.report.output import check_output_dir, write_outputs
        from quantkit.run import check_save_args

        check_save_args(directory, report)
        check_output_dir(directory, overwrite=overwrite)  # a bad folder or argument is refused before writing
        src = self.path.parent

        def fill(stage_dir: Path) -> None:
            # hard links (same file system) or copies: the built files stay where they are until the set is
            # in place, so a refused or interrupted save loses nothing and can be retried
            for f in sorted(src.iterdir()):
                if f.is_file() and f.name != MARKER:  # the build folder's ownership marker stays behind
                    try:
                        os.link(f, stage_dir / f.name)
                    except OSError:
                        shutil.copy2(f, stage_dir / f.name)
            if report:
                write_report(self.report, stage_dir, self.recipe.report.formats)

        paths = write_outputs(directory, fill, overwrite=overwrite, inputs=recipe_inputs(self.recipe))
        for f in sorted(src.iterdir()):
            if f.is_file():
                f.unlink()
        self.path = Path(directory) / "model.onnx"
        out = {"model": self.path}
        out.update({n: p for n, p in paths.items() if n.startswith("report.")})
        if src.is_dir() and not any(src.iterdir()):
            src.rmdir()
        return out


def resolve_llm_folder(source: Any) -> Path:
    """The LLaMA-family HF folder a layer-wise recipe builds from: a folder path, a GGUF file (converted once) or the
    ``smollm2-135m`` built-in."""
    from quantkit.frontends.llm import gguf_folder, is_gguf

    name = str(getattr(source, "name", source)) if not isinstance(source, (str, os.PathLike)) else str(source)
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        return Path(source)
    if is_gguf(source):
        return gguf_folder(source)
    if name == "smollm2-135m":
        from quantkit.frontends.llm import smollm2_folder

        return smollm2_folder()
    raise ModelError(
        f"calibration.layerwise builds from a LLaMA-family Hugging Face folder or the built-in 'smollm2-135m'; "
        f"got {name!r} (allowed: a folder path, smollm2-135m; or set calibration.layerwise: false)"
    )


def _dataset(given: Any, spec: Any, inputs: list[InputInfo], tokenizer: Any, split: str) -> Any:
    """Data passed through the API, else the recipe's section (``spec``), bound to ``inputs``."""
    if given is not None:
        return as_dataset(given, inputs, tokenizer=tokenizer)
    return make_dataset(spec.model_dump(), inputs=inputs, tokenizer=tokenizer, split=split)


def _windows(rec: RecipeModel, calibration_data: Any, tokenizer: Any) -> np.ndarray | None:
    if calibration_data is None and rec.calibration.data is None:
        return None
    ds = _dataset(calibration_data, rec.calibration.data, _LM_INPUTS, tokenizer, "calibration")
    rows = [np.asarray(b["input_ids"], np.int64) for b in ds.batches(1)]
    if not rows:
        raise DataError("the calibration dataset is empty")
    lengths = {r.shape[-1] for r in rows}
    if len(lengths) != 1:
        raise DataError(f"layer-wise calibration needs windows of one length; got lengths {sorted(lengths)}")
    return np.concatenate([r.reshape(-1, r.shape[-1]) for r in rows])


def _longest(ds: Any) -> int:
    """The longest token sequence of a dataset (0 when it holds no token ids)."""
    longest = 0
    for feed in ds.batches(64):
        ids = feed.get("input_ids")
        if ids is not None and getattr(ids, "ndim", 0) == 2:
            longest = max(longest, int(ids.shape[1]))
    return longest


_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")  # how recipes name a block's layers (plan lookups for the estimate)


def _layerwise_estimate(rec: RecipeModel, plan: PrecisionPlan, sizes: Any, cfg: Any, windows: np.ndarray | None,
                        evaluation: dict[str, Any] | None) -> Estimate:
    """:func:`quantkit.memory.layerwise_estimate` for this recipe's plan (formats and algorithms by layer)."""
    lps = [plan.layer(f"model.layers.0.{s}", "MatMul", f"model.layers.0.{s}") for s in _LINEARS]
    head = plan.layer("lm_head", "MatMul", "lm_head")
    bits = max([LAYERWISE_FORMATS.get(lp.format) or 0 for lp in [*lps, head]] + [4])
    return layerwise_estimate(
        sizes, bits=bits, algorithms=[lp.algorithm for lp in lps if LAYERWISE_FORMATS.get(lp.format)] or ["rtn"],
        head_algorithm=head.algorithm, head_quantized=LAYERWISE_FORMATS.get(head.format) is not None,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)) or not sizes.head,
        windows=None if windows is None else (int(windows.shape[0]), int(windows.shape[1])),
        max_rows=rec.calibration.max_rows, evaluation=evaluation,
        w4a8_bytes=check_bytes() if (build_level(rec.export.accuracy_level) == 4 and windows is not None
                                     and rec.export.w4a8_max_error_ratio is not None
                                     and any(LAYERWISE_FORMATS.get(lp.format) == 4 for lp in [*lps, head])) else 0,
    )  # fmt: skip


def memory_section(est: Estimate | None, avail: Available | None) -> dict[str, Any]:
    """The report's ``memory`` section: the estimate made before the run (the measured peak is added after it)."""
    out: dict[str, Any] = {"estimated_peak_bytes": None, "measured_peak_bytes": None}
    if est is not None:
        out.update(est.as_dict())
    if avail is not None:
        out["available_bytes"], out["available_source"] = int(avail.bytes), avail.source
    return out


def _census(path: Path) -> dict[str, Any]:
    m = onnx.load(str(path), load_external_data=False)
    ops: dict[str, int] = {}
    for n in m.graph.node:
        k = f"{n.domain}.{n.op_type}" if n.domain else n.op_type
        ops[k] = ops.get(k, 0) + 1
    kernels = {k.split(".")[-1]: v for k, v in ops.items() if k.split(".")[-1] in ("MatMulNBits", "GatherBlockQuantized")}
    return {"op_counts": ops, "quantized_kernels": kernels, "float_matmul_left": ops.get("MatMul", 0),
            "leftover_quantize_linear": 0, "leftover_dequantize_linear": 0, "leftover_qdq_nodes": [],
            "leftover_by_kind": {"boundary": 0, "chain_exit": 0, "feeds_fused_kernel": 0, "stray": 0},
            "graph": "emitted (ONNX Runtime adds no fusion to MatMulNBits / GroupQueryAttention)"}  # fmt: skip


_MAIN = "\x00evaluation.data"  # the main evaluation windows among the texts of a streamed FP32 perplexity


def _streamed_fp32(folder: Path, ev: Any, rec: RecipeModel, tokenizer: Any, inputs: list[InputInfo], root: Path,
                   progress: bool) -> dict[str, Any]:
    """The FP32 perplexity of the evaluation windows (key :data:`_MAIN`) and of every ``evaluation.extra`` text
    (by label), streamed block by block in one pass (:func:`quantkit.evaluate.streamed.streamed_perplexity`)."""
    work = owned_tempdir(root, "quantkit-fp32-baseline-")
    try:
        return streamed_perplexity(folder, {_MAIN: ev, **extra_datasets(rec, tokenizer, inputs)}, work_dir=work,
                                   progress=progress)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _files_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + ".data")) if p.is_file())


def run_layerwise(model: Any, calibration_data: Any, rec: RecipeModel, *, evaluation_data: Any = None,
                  evaluate: bool = True, measure_latency: bool | None = None, progress: bool = True,
                  t_start: float | None = None) -> LayerwiseQuantizeResult:
    """Quantize an LLM block by block as ``rec`` says; evaluate the emitted files; build the report."""
    t_start = time.perf_counter() if t_start is None else t_start
    timings: dict[str, float] = {}
    source = model if model is not None else (rec.model.source if rec.model is not None else None)
    if source is None:
        raise QuantkitError("quantize() needs a model: pass one, or name it in the recipe's model.source")
    t = time.perf_counter()
    with stage("locate the checkpoint (the first use of a built-in converts it, cached)", enabled=progress):
        folder = resolve_llm_folder(source)
    timings["load_s"] = time.perf_counter() - t
    from quantkit.frontends import _optional_tokenizer
    from quantkit.frontends.llm_builder import check_decoder_folder

    # config.json's sizes and the safetensors headers are checked against each other before any tokenization,
    # allocation or calibration
    cfg = check_decoder_folder(folder)
    from quantkit.frontends.tokenizer_worker import isolate, isolated

    # a build in a child process lets this one stay free of torch (transformers imports it with the tokenizer):
    # the tokenizer is then served by a worker process, ended before the build
    before = isolated()
    isolate(before or build_process(None) == "child")
    try:
        tokenizer = _optional_tokenizer(folder)
    finally:
        isolate(before)
    windows = _windows(rec, calibration_data, tokenizer)
    if windows is not None and windows.shape[1] > cfg.context_length:
        raise DataError(f"the calibration data: sequences of {windows.shape[1]} tokens do not fit the model's "
                        f"context of {cfg.context_length} positions; allowed: seq_len <= {cfg.context_length}")
    if rec.export.kv_cache == "int8" and windows is None:
        raise RecipeError("export.kv_cache: int8 calibrates the cache's scales on the calibration windows, and this "
                          "run has none; allowed: export.kv_cache: float32 (the default), or set calibration.data "
                          "(or pass calibration data)")  # fmt: skip
    inputs = _LM_INPUTS + [InputInfo(f"past_key_values.{i}.{kv}", np.dtype(np.float32),
                                     (None, cfg.num_key_value_heads, None, cfg.head_dim))
                           for i in range(cfg.num_hidden_layers) for kv in ("key", "value")]  # fmt: skip
    ev = None
    if evaluate and rec.evaluation.perplexity and (evaluation_data is not None or rec.evaluation.data is not None):
        ev = _dataset(evaluation_data, rec.evaluation.data, inputs, tokenizer, "evaluation")  # before the work
        check_not_empty(ev, "evaluation_data (passed through the API)" if evaluation_data is not None
                        else f"evaluation.data ({rec.evaluation.data})")  # fmt: skip
        check_context(ev, cfg.context_length, "the evaluation data")
    spec = rec.calibration.data.model_dump() if calibration_data is None and rec.calibration.data else None
    if windows is not None:
        log.info("calibration set: %d windows x %d tokens (%s)", windows.shape[0], windows.shape[1],
                 ", ".join(f"{k}={v}" for k, v in spec.items()) if spec else "given through the API")
    plan = PrecisionPlan.from_recipe(rec)
    # what the evaluation will run, decided now: the estimate covers it, and it is refused before the work
    latency_on = bool(rec.report.latency.enabled if measure_latency is None else measure_latency)
    avail = available_memory()
    sizes = decoder_sizes(folder)
    fp32_bytes = sizes.fp32_bytes
    warnings: list[str] = []
    eval_seq = _longest(ev) if ev is not None else 0
    prefill = max(rec.report.latency.seq_len or 128, rec.report.latency.long_prefill or 0) if latency_on else 0
    prefill = min(prefill, cfg.context_length)

    def estimate(fp32: str, blocks: int = 0) -> Estimate:
        evaluation = {"fp32": fp32, "seq_len": eval_seq, "prefill": prefill, "perplexity": ev is not None,
                      "latency_blocks": blocks} if (ev is not None or fp32 != "off") else None  # fmt: skip
        return _layerwise_estimate(rec, plan, sizes, cfg, windows, evaluation)

    # the FP32 baseline: held whole, streamed block by block (memory of about one block) or not evaluated
    baseline = choose_baseline(rec.evaluation.fp32_baseline, perplexity=ev is not None, latency=latency_on,
                               fp32_bytes=fp32_bytes, layers=cfg.num_hidden_layers, estimate=estimate, avail=avail)
    est = baseline.estimate
    warnings += baseline.warnings
    log.info("FP32 baseline: %s", baseline.text())
    announce(est, avail)
    check_fits(est, avail, what="this layer-wise run", instead=(
        "it streams already; fewer or shorter calibration windows (calibration.data count / seq_len), a lower "
        "calibration.max_rows, algorithm rtn or a machine with more memory lower it"))
    root = cache_dir()
    work = root / "layerwise" / hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    # the build folder is marked as this process's: one left by a killed run is removed here, never a live one
    clean_stale(root, "quantkit-layerwise-")
    clean_stale(root, "quantkit-fp32-baseline-")
    build_dir = owned_tempdir(root, "quantkit-layerwise-")
    # the evaluation's other texts cut into windows now, while the tokenizer is at hand (a worker's is ended here)
    extras = extra_datasets(rec, tokenizer, inputs) if ev is not None and rec.evaluation.extra else None
    release = getattr(tokenizer, "release", None)
    if callable(release):
        release()
    t = time.perf_counter()
    try:
        build_args = (folder, build_dir / "model.onnx", plan, windows)
        build_kwargs: dict[str, Any] = {"work_dir": work, "accuracy_level": build_level(rec.export.accuracy_level),
                        "max_rows": rec.calibration.max_rows,
                        "w4a8_max_error_ratio": rec.export.w4a8_max_error_ratio, "progress": progress}
        where = build_process(build_args)
        if where == "child":
            from quantkit.child import in_child

            res = in_child(quantize_llm_layerwise, build_args, build_kwargs, name="quantkit-build")
        else:
            res = quantize_llm_layerwise(*build_args, **build_kwargs)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    timings["quantize_s"] = time.perf_counter() - t
    from quantkit.memory import return_free_memory

    return_free_memory()  # the build's freed arrays, before the evaluation's sessions (its peak)
    if res.resumed_blocks:
        log.info("resumed: %d finished blocks reused from %s", res.resumed_blocks, work)
    q_path = res.path
    warnings += moe_dispatch_warnings(q_path, res.rows)
    kv_cache: dict[str, Any] = {"type": rec.export.kv_cache}
    if rec.export.kv_cache == "int8" and windows is not None:  # (refused above without windows) the shipped
        # graph's cache, in place before anything is measured on it
        try:
            kv_cache.update(_int8_kv_cache(q_path, windows, cfg, progress))
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
        timings["kv_cache_s"] = kv_cache["calibrate_s"]
    # the MatMulNBits accuracy_level, decided (and the shipped graph put in place) before anything is measured on it
    tgt = resolve_target(rec.target.isa, rec.target.device)
    try:
        int4 = choose_for_file(q_path, rec.export.accuracy_level, tgt.cpu_class, isa=tgt.isa, latency_on=latency_on,
                               settings=rec.report.latency, progress=progress,
                               blocks=baseline.latency_blocks if baseline.mode != "whole" else None)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    if int4 is not None and int4["how"] == "measured":
        timings["accuracy_level_s"] = int4["time_s"]
    if int4 is not None and len(int4["shipped"]) == 1:  # the layer rows say the level their kernel ships at
        for r in res.rows:
            if "accuracy_level" in r:
                r["accuracy_level"] = int(next(iter(int4["shipped"])))
    fp32_path: Path | None = None
    if baseline.mode == "whole":  # only when something uses it (perplexity, latency) and it fits
        from quantkit.frontends.llm import built_decoder_path

        with stage("build the FP32 baseline decoder (cached)", enabled=progress):
            fp32_path = built_decoder_path(folder)
    quality: dict[str, Any] = {}
    ev_count = 0
    if ev is not None:
        from quantkit.evaluate.perplexity import perplexity
        from quantkit.progress import tqdm

        ev_count = len(ev)
        t = time.perf_counter()
        fp32_streamed: dict[str, Any] = {}
        if baseline.mode == "streamed":  # block by block through the FP32 block graphs: about one block in memory
            fp32_streamed = _streamed_fp32(folder, ev, rec, tokenizer, inputs, root, progress)
            quality["perplexity_fp32"] = fp32_streamed.pop(_MAIN)
        for key, p in (("perplexity_fp32", fp32_path), ("perplexity_quantized", q_path)):
            if p is None:
                continue
            with tqdm(total=len(ev), desc=key.replace("_", " "), unit="window", disable=not progress) as bar:
                def tick(done: int, total: int, bar: Any = bar) -> None:
                    bar.n = done
                    bar.refresh()

                quality[key] = perplexity(str(p), ev, progress=tick)
        models = {k: str(p) for k, p in (("fp32", fp32_path), ("quantized", q_path)) if p is not None}
        extra = merge_extra(extra_perplexities(rec, tokenizer, inputs, models, progress, datasets=extras),
                            fp32_streamed)
        if extra:
            quality["perplexity_extra"] = extra
        if "perplexity_fp32" in quality:
            quality["perplexity_increase"] = quality["perplexity_quantized"]["ppl"] / quality["perplexity_fp32"]["ppl"] - 1
        timings["evaluate_s"] = time.perf_counter() - t
    if ev is not None and rec.evaluation.greedy_agreement is not None:  # quantkit.evaluate.greedy
        from quantkit.evaluate.greedy import greedy_agreement

        t = time.perf_counter()
        no_fp32 = next((w for w in warnings if w.startswith("FP32 baseline not evaluated")),
                       "greedy decoding needs the whole FP32 decoder, not held in this run (the report's "
                       "fp32_baseline says why)")  # fmt: skip
        with stage("greedy decoding, FP32 vs quantized (evaluation.greedy_agreement)", enabled=progress):
            quality["greedy_agreement"] = greedy_agreement(
                fp32_path, q_path, (np.asarray(b["input_ids"])[np.asarray(b["attention_mask"]) > 0]
                                    if "attention_mask" in b else np.asarray(b["input_ids"]) for b in ev.batches(1)),
                rec.evaluation.greedy_agreement, why_no_fp32=no_fp32, context=cfg.context_length)  # fmt: skip
        timings["greedy_s"] = time.perf_counter() - t
    latency: dict[str, Any] = {}
    load: dict[str, Any] | None = None
    if latency_on and fp32_path is not None:
        from quantkit.evaluate.decode import llm_latency

        t = time.perf_counter()
        load = {"start": load_average()}  # the machine's load while the figures were measured
        with stage("measure latency (FP32 vs quantized, interleaved)", enabled=progress):
            latency = llm_latency(str(fp32_path), str(q_path), rec.report.latency)
        load["end"] = load_average()
        timings["latency_s"] = time.perf_counter() - t
    elif latency_on and baseline.mode == "streamed":  # FP32 and quantized truncated alike to k blocks
        t = time.perf_counter()
        load = {"start": load_average()}
        lat_dir = owned_tempdir(root, "quantkit-fp32-baseline-")
        try:
            latency = truncated_latency(folder, q_path, baseline.latency_blocks, rec.report.latency,
                                        work_dir=lat_dir, progress=progress)  # fmt: skip
        finally:
            shutil.rmtree(lat_dir, ignore_errors=True)
        load["end"] = load_average()
        timings["latency_s"] = time.perf_counter() - t
    timings.update(res.timings)
    timings["total_s"] = time.perf_counter() - t_start
    q_bytes = _files_bytes(q_path)
    formats: dict[str, int] = {}
    for r in res.rows:
        formats[r["format"]] = formats.get(r["format"], 0) + 1
    report = {
        "kind": "weight_only", "recipe": rec.name, "environment": environment(),
        "model": str(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__,
        "model_read_from": f"Hugging Face folder {folder}" + ("" if str(source) == str(folder) else
                                                              " (the checkpoint, converted once and cached)"),
        "settings": rec.model_dump(mode="json"),
        "samples": {"calibration": 0 if windows is None else int(windows.shape[0]), "evaluation": ev_count},
        "calibration": {"mode": "layerwise", "tokens": res.calibration_tokens, "resumed_blocks": res.resumed_blocks,
                        "build_process": where},
        "formats": formats,
        "size": {"fp32_bytes": fp32_bytes, "quantized_bytes": q_bytes, "ratio": q_bytes / max(fp32_bytes, 1)},
        "latency": latency, "fidelity": {}, "quality": quality, "timings": timings, "census": _census(q_path),
        "layers": res.rows, "weight_only": res.rows, "linear_formats": [], "unfused": [], "float_layers": [],
        "notes": dict(res.notes), "search": None, "kernels": {}, "warnings": warnings,
        "memory": memory_section(est, avail),  # the measured peak is added by quantize() when the run ends
        "fp32_baseline": baseline.as_dict(),  # how the FP32 figures were measured, and why
        # q/k/v computed by one MatMulNBits: which layers share a kernel of the emitted graph
        "kernel_sharing": map_layer_kernels(onnx.load(str(q_path), load_external_data=False), res.rows),
        "int4_kernel": int4,  # the MatMulNBits accuracy_level shipped, how and why
        "by_cpu_class": class_section(rec),  # the recipe's grid for this CPU class, when it has one
        "w4a8_check": res.w4a8,  # accuracy_level 4 vs 0 per layer on its calibration inputs (quantkit.lowering.w4a8)
        "kv_cache": kv_cache,  # the KV cache's element type (export.kv_cache) and, for int8, how it was calibrated
    }  # fmt: skip
    complete_report(report, load=load, latency_note="" if latency else
                    f"not measured: no FP32 baseline to compare with (FP32 baseline {baseline.text()})")
    return LayerwiseQuantizeResult(q_path, report, rec, timings)


BUILD_PROCESS_ENV = "QUANTKIT_BUILD_PROCESS"


def build_process(args: tuple[Any, ...] | None) -> str:
    """Where the layer-wise build runs: ``child`` (a spawned process, :mod:`quantkit.child`: the build's memory -
    torch's ~220 MB once SignRound / GPTQ import it, the blocks' arrays the heap keeps - goes back to the system
    before the evaluation's sessions, the run's peak; SmolLM2's recipe: ~1.5 -> see docs/llm-layerwise.md) or
    ``this`` process.  ``$QUANTKIT_BUILD_PROCESS``: ``child``, ``this`` or ``auto`` (default: a child, unless
    torch is loaded here already - then it is paid for - or the arguments do not pickle)."""
    import sys

    how = os.environ.get(BUILD_PROCESS_ENV, "auto").strip().lower() or "auto"
    if how not in ("auto", "child", "this"):
        raise QuantkitError(f"{BUILD_PROCESS_ENV}={how!r}: allowed values: auto, child, this")
    if how == "this":
        return "this"
    from quantkit.child import picklable

    if args is not None and not picklable(args):  # None: asked before the build's arguments exist
        return "this"
    return "child" if how == "child" or "torch" not in sys.modules else "this"


def _int8_kv_cache(path: Path, windows: np.ndarray, cfg: Any, progress: bool) -> dict[str, Any]:
    """Calibrate the KV-cache scales of the built decoder ``path`` on ``windows`` and rewrite it to an int8 cache
    (:mod:`quantkit.frontends.kv_cache`); the report's ``kv_cache`` section."""
    from quantkit.frontends.kv_cache import calibrate_kv_scales, kv_cache_bytes, write_int8_kv_cache

    t = time.perf_counter()
    with stage(f"calibrate the int8 KV cache ({windows.shape[0]} windows x {windows.shape[1]} tokens)",
               enabled=progress):  # fmt: skip
        k, v = calibrate_kv_scales(path, windows)
        write_int8_kv_cache(path, k, v)
    per_pos = {kind: kv_cache_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 1, kind)
               for kind in ("float32", "int8")}  # fmt: skip
    return {"quant_type": "PER_CHANNEL", "bits": 8,
            "scales": "per layer, KV head and channel: the largest |K| (after the rotary embedding; one scale per "
                      "rotated channel pair, the pair's largest norm) and |V| of the shipped decoder over the "
                      "calibration windows, / 127",
            "calibration_windows": [int(windows.shape[0]), int(windows.shape[1])],
            "bytes_per_position": per_pos["int8"], "float32_bytes_per_position": per_pos["float32"],
            "calibrate_s": time.perf_counter() - t}  # fmt: skip


MIX_FORMATS = ("int4", "int8_weight", "fp32")


def is_layerwise_mix(rec: RecipeModel) -> bool:
    """A search whose candidates are all formats the layer-wise builder emits (weight-only, fp32): searched on the
    whole graph, built layer-wise (:mod:`quantkit.llm_mix`)."""
    return rec.search is not None and all(c.format in MIX_FORMATS for c in rec.search.candidate_list())


def check_layerwise_plan(rec: RecipeModel) -> None:
    """Refuse, before any work, a layer-wise recipe whose default format cannot be built that way."""
    fmt = rec.quantization.default.format
    if fmt not in LAYERWISE_FORMATS:
        raise RecipeError(f"calibration.layerwise: quantization.default.format {fmt!r} is not built layer-wise; "
                            f"allowed: {sorted(LAYERWISE_FORMATS)}")  # fmt: skip
    if rec.search is not None and not is_layerwise_mix(rec):
        raise RecipeError("calibration.layerwise: true and a search with candidates other than weight-only ones "
                          f"({sorted({c.format for c in rec.search.candidate_list()} - set(MIX_FORMATS))}) "
                          "cannot be combined (those formats need the whole graph); allowed: search candidates in "
                          f"{list(MIX_FORMATS)}, or calibration.layerwise: false")  # fmt: skip


# -- which path: streamed block by block, or the whole graph (guarded by its memory estimate) -----------------


@dataclass
class Route:
    """What :func:`choose_route` decided for a recipe and a model."""

    layerwise: bool
    folder: Path | None = None  # the decoder's Hugging Face folder, when the model is one the builder supports
    estimate: Estimate | None = None  # the whole graph's, when it runs
    available: Available | None = None
    reason: str = ""


LARGE_MODEL_BYTES = 1 << 30
"""A model with at least this many bytes of weights (FP32) is guarded and its estimate printed, whatever it is (an
ONNX file with external data, an exported folder); an LLM always is.  Below it the estimate is only recorded: a
small model's peak is its activations, which the calibration bounds itself (``max_batch_output_bytes``)."""


def _weights_large(est: Estimate) -> bool:
    return est.weights_bytes >= LARGE_MODEL_BYTES


def unstreamed_decoder_note(source: Any) -> str | None:
    """For a Hugging Face folder of a causal LM (``config.json`` names a ``...ForCausalLM`` / ``...LMHeadModel``
    architecture) that the layer-wise builder does not stream - a family it does not support, or one it supports
    with a setting it refuses (a rotary dimension GroupQueryAttention cannot apply, a RoPE type it does not compute:
    the refusal is quoted) - what taking the whole-graph path instead means for the user; None for anything else
    (a streamed decoder, an encoder, an ONNX file, a module)."""
    from quantkit.frontends.families import read_config, supported_model_types

    if not isinstance(source, (str, os.PathLike)):
        return None
    cfg_path = Path(source).expanduser() / "config.json"
    if not cfg_path.is_file() or decoder_folder(source) is not None:
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not isinstance(archs, list) or not any(isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel"))
                                              for a in archs):
        return None
    consequence = ("it is exported whole and quantized as one full-sequence graph - no KV cache (`quantkit generate` "
                   "cannot run it, decoding speed is not measured) and the FP32 model held in memory several times "
                   "over instead of one block at a time")  # fmt: skip
    if cfg.get("model_type") in supported_model_types():  # a supported family with a setting the builder refuses
        try:
            read_config(cfg_path.parent)
        except ModelError as e:
            return (f"model_type {cfg['model_type']!r} is a family the layer-wise builder supports, but it refuses "
                    f"this checkpoint ({str(e).replace(str(cfg_path), 'config.json')}): {consequence}")
        return None
    return (f"model_type {str(cfg.get('model_type', '?'))!r} is not a decoder family the layer-wise builder supports "
            f"({', '.join(supported_model_types())}): {consequence}")


def decoder_folder(source: Any) -> Path | None:
    """The Hugging Face folder of ``source`` when it is a decoder that the layer-wise builder supports - a folder
    or a built-in decoder (converted once and cached) - else None.  The builder itself is asked
    (:func:`quantkit.frontends.llm_builder.read_decoder_config`: its families, from ``config.json`` alone), so a
    family added there streams here too.  A folder the builder refuses is left to the whole-graph path, which
    reports what is wrong with it."""
    from quantkit.frontends.llm import BUILT_DECODERS, gguf_folder, is_gguf
    from quantkit.frontends.llm_builder import read_decoder_config

    if not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        folder = path
    elif is_gguf(path):
        folder = gguf_folder(path)
    elif not path.exists() and str(source) in BUILT_DECODERS:
        folder = BUILT_DECODERS[str(source)]()
    else:
        return None
    try:
        read_decoder_config(folder)
    except ModelError:
        return None
    return folder


def layerwise_blockers(rec: RecipeModel) -> list[str]:
    """The recipe settings that need the whole graph (each as ``key: value``); empty when it can stream."""
    out = []
    fmt = rec.quantization.default.format
    if fmt not in LAYERWISE_FORMATS:
        out.append(f"quantization.default.format: {fmt}")
    for i, o in enumerate(rec.quantization.overrides):
        if o.format is not None and o.format not in LAYERWISE_FORMATS:
            out.append(f"quantization.overrides[{i}].format: {o.format}")
    if rec.search is not None and not is_layerwise_mix(rec):
        out.append("a search section with candidates other than int4 / int8_weight / fp32")
    if rec.export.weight_only_form != "matmulnbits":
        out.append(f"export.weight_only_form: {rec.export.weight_only_form}")
    if rec.model is not None and rec.model.graph == "full_sequence":
        out.append("model.graph: full_sequence")
    return out


def _recipe_windows(rec: RecipeModel) -> tuple[int, int] | None:
    """``(count, seq_len)`` of the recipe's calibration windows when it says them, for an estimate."""
    spec = rec.calibration.data.model_dump() if rec.calibration.data is not None else {}
    n, seq = spec.get("count"), spec.get("seq_len")
    return (int(n), int(seq)) if isinstance(n, int) and isinstance(seq, int) else None


def _stream_estimate(rec: RecipeModel, folder: Path) -> Estimate | None:
    """What the same checkpoint would need streamed (quantization only), for a refusal's message."""
    from quantkit.frontends.llm_builder import read_decoder_config

    try:
        cfg, sizes = read_decoder_config(folder), decoder_sizes(folder)
        win = _recipe_windows(rec)
        alg = rec.quantization.default.algorithm
        return layerwise_estimate(sizes, bits=4 if rec.quantization.default.format != "int8_weight" else 8,
                                  algorithms=[alg], head_algorithm=alg, head_quantized=True,
                                  tied=bool(getattr(cfg, "tie_word_embeddings", False)) or not sizes.head,
                                  windows=win if alg != "rtn" else None, max_rows=rec.calibration.max_rows)  # fmt: skip
    except QuantkitError:
        return None


def whole_graph_memory(source: Any, rec: RecipeModel, folder: Path | None = None) -> tuple[Estimate, bool] | None:
    """The whole-graph path's estimate for ``source`` and whether it is an LLM, from file sizes and headers (no
    weight is read); None for a source whose size is not known before loading (an object, a small built-in)."""
    from quantkit.frontends.checkpoint import checkpoint_tensors

    act = rec.calibration.max_batch_output_bytes if _needs_activations(rec) else 0
    if folder is not None:
        s = decoder_sizes(folder)
        basis = (f"config.json and the safetensors headers: {s.params / 1e9:.2f}B parameters, "
                 f"{gb(s.fp32_bytes)} in FP32")  # fmt: skip
        return whole_graph_estimate(s.fp32_bytes, what="the FP32 decoder held and run whole", basis=basis,
                                    activation_bytes=act), True
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        try:
            fp32 = sum(4 * math.prod(t.shape) for t in checkpoint_tensors(path).values())
        except QuantkitError:
            return None  # the loader says what is wrong with the folder
        if fp32 == 0:
            fp32 = sum(f.stat().st_size for f in path.glob("*.bin"))
        basis = f"the checkpoint's headers: {gb(fp32)} of weights in FP32"
        causal = "ForCausalLM" in (path / "config.json").read_text(errors="replace")
        return whole_graph_estimate(fp32, what="the model exported and held whole", basis=basis,
                                    activation_bytes=act), causal
    onnx_path = path / "model.onnx" if path.is_dir() else path
    if onnx_path.is_file() and onnx_path.suffix == ".onnx":
        size = onnx_weight_bytes(onnx_path)
        return whole_graph_estimate(size, what="an ONNX model held whole", basis=(
            f"the file sizes: {gb(size)} of ONNX model and external data"), activation_bytes=act), False
    return None


def _needs_activations(rec: RecipeModel) -> bool:
    """Whether the whole-graph path collects activation statistics (static INT8, SmoothQuant, GPTQ / AWQ / ...)."""
    from quantkit.weight_only import STATS_ALGORITHMS

    schemes = [rec.quantization.default, *rec.quantization.overrides]
    return rec.search is not None or any(
        getattr(s, "format", None) in ("int8", "int8_dynamic") or getattr(s, "algorithm", None) in STATS_ALGORITHMS
        for s in schemes)  # fmt: skip


def choose_route(model: Any, rec: RecipeModel, *, check_memory: bool = True) -> Route:
    """Stream a decoder block by block, or run the whole graph - decided before any work.

    ``calibration.layerwise: true`` streams (the recipe is checked by :func:`check_layerwise_plan`).  ``auto``
    (the default) streams a decoder the builder supports whenever the recipe can be built that way (formats int4 /
    int8_weight / fp32, no search section, MatMulNBits, the KV-cache decoder).  Everything else - ``false``, a
    recipe that needs the whole graph, a model that is no such decoder - takes the whole-graph path, and only after
    :func:`whole_graph_memory`'s estimate fits in the memory available (a large ONNX file with external data, an
    exported folder, a decoder held in FP32); otherwise a :class:`~quantkit.errors.MemoryBudgetError` naming the
    estimate, the memory and the setting that streams instead.  ``check_memory=False`` leaves the guard to the
    caller (the search estimates its own)."""
    mode = rec.calibration.layerwise
    if mode is True:
        return Route(True, reason="calibration.layerwise: true")
    source = model if model is not None else (rec.model.source if rec.model is not None else None)
    blockers = layerwise_blockers(rec)
    folder = decoder_folder(source)
    if folder is not None and mode == "auto" and not blockers:
        return Route(True, folder, reason="calibration.layerwise: auto: a decoder the layer-wise builder supports "
                                          "and a recipe it can build")  # fmt: skip
    reason = ("calibration.layerwise: false" if mode is False else
              f"needs the whole graph: {', '.join(blockers)}" if folder is not None else "not a streamed decoder")
    if not check_memory:
        return Route(False, folder, reason=reason)
    got = whole_graph_memory(source, rec, folder)
    if got is None:
        return Route(False, folder, reason=reason)
    est, is_lm = got
    avail = available_memory()
    if not (is_lm or _weights_large(est)):  # a small model: recorded, not guarded (its activations dominate)
        return Route(False, folder, est, avail, reason)
    announce(est, avail)
    if folder is not None:
        lw = _stream_estimate(rec, folder)
        streamed = f" (expected peak ~{gb(lw.peak_bytes)})" if lw is not None else ""
        if blockers:
            instead = (f"{', '.join(blockers)} need(s) the whole graph; with formats int4 / int8_weight / fp32 only "
                       f"(a search over those only), calibration.layerwise: auto (the default) or true streams this "
                       f"checkpoint block by block{streamed}")  # fmt: skip
        else:
            instead = (f"calibration.layerwise: auto (the default) or true streams this checkpoint block by block"
                       f"{streamed}")  # fmt: skip
    else:
        instead = ("this model is quantized whole (only a decoder's Hugging Face folder streams block by block); "
                   "run it where more memory is available")  # fmt: skip
    check_fits(est, avail, what=f"the whole-graph path ({reason})", instead=instead)
    return Route(False, folder, est, avail, reason)
