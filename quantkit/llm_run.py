"""A recipe with ``calibration.layerwise: true``: build, calibrate and quantize an LLM block by block, then
evaluate and report it.

The weights never exist as one FP32 model in memory (see :mod:`quantkit.layerwise`): the checkpoint streams
through the builder, each decoder block is calibrated alone on the cached hidden states and written as
``MatMulNBits``.  The emitted model is then measured from its files, as users run it: perplexity on the
evaluation windows, prefill and per-token decode with the KV cache, FP32 against quantized in the same
run — when the FP32 model fits in memory (at most 40% of the available RAM); otherwise only the quantized
model is evaluated and the report says why.
"""

from __future__ import annotations

import hashlib
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
from quantkit.frontends.cache import cache_dir
from quantkit.layerwise import LAYERWISE_FORMATS, quantize_llm_layerwise
from quantkit.pipeline import check_context, check_not_empty, extra_perplexities
from quantkit.progress import stage
from quantkit.recipe import RecipeModel
from quantkit.recipe.plan import PrecisionPlan
from quantkit.report.build import complete_report, environment, load_average, map_layer_kernels, write_report
from quantkit.tempdirs import MARKER, clean_stale, owned_tempdir

log = logging.getLogger("quantkit")

__all__ = ["LayerwiseQuantizeResult", "check_layerwise_plan", "resolve_llm_folder", "run_layerwise"]

_LM_INPUTS = [InputInfo("input_ids", np.dtype(np.int64), (None, None)),
              InputInfo("attention_mask", np.dtype(np.int64), (None, None))]  # fmt: skip
FP32_BASELINE_RAM_FRACTION = 0.4
"""The FP32 baseline is evaluated only when its weights take at most this share of the available RAM."""


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
    """The LLaMA-family HF folder a layer-wise recipe builds from: a folder path or the ``smollm2-135m`` built-in."""
    name = str(getattr(source, "name", source)) if not isinstance(source, (str, os.PathLike)) else str(source)
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        return Path(source)
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


def _fp32_bytes(folder: Path) -> int:
    """What the checkpoint takes in FP32 (from the safetensors headers, checked; no tensor is read)."""
    from quantkit.frontends.checkpoint import checkpoint_tensors

    return sum(4 * math.prod(t.shape) for t in checkpoint_tensors(folder).values())


def _available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


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
    tokenizer = _optional_tokenizer(folder)
    windows = _windows(rec, calibration_data, tokenizer)
    if windows is not None and windows.shape[1] > cfg.context_length:
        raise DataError(f"the calibration data: sequences of {windows.shape[1]} tokens do not fit the model's "
                        f"context of {cfg.context_length} positions; allowed: seq_len <= {cfg.context_length}")
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
    root = cache_dir()
    work = root / "layerwise" / hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    # the build folder is marked as this process's: one left by a killed run is removed here, never a live one
    clean_stale(root, "quantkit-layerwise-")
    build_dir = owned_tempdir(root, "quantkit-layerwise-")
    t = time.perf_counter()
    try:
        res = quantize_llm_layerwise(folder, build_dir / "model.onnx", plan, windows, work_dir=work,
                                     accuracy_level=rec.export.accuracy_level, max_rows=rec.calibration.max_rows,
                                     progress=progress)  # fmt: skip
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    timings["quantize_s"] = time.perf_counter() - t
    if res.resumed_blocks:
        log.info("resumed: %d finished blocks reused from %s", res.resumed_blocks, work)
    q_path = res.path
    fp32_bytes = _fp32_bytes(folder)
    warnings: list[str] = []
    fp32_path: Path | None = None
    if fp32_bytes > FP32_BASELINE_RAM_FRACTION * _available_ram():
        warnings.append(f"FP32 baseline not evaluated: the FP32 weights ({fp32_bytes / 2**30:.1f} GiB) exceed "
                        f"{FP32_BASELINE_RAM_FRACTION:.0%} of the available memory")  # fmt: skip
    elif evaluate or measure_latency is not False:
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
        for key, p in (("perplexity_fp32", fp32_path), ("perplexity_quantized", q_path)):
            if p is None:
                continue
            with tqdm(total=len(ev), desc=key.replace("_", " "), unit="window", disable=not progress) as bar:
                def tick(done: int, total: int, bar: Any = bar) -> None:
                    bar.n = done
                    bar.refresh()

                quality[key] = perplexity(str(p), ev, progress=tick)
        models = {k: str(p) for k, p in (("fp32", fp32_path), ("quantized", q_path)) if p is not None}
        extra = extra_perplexities(rec, tokenizer, inputs, models, progress)
        if extra:
            quality["perplexity_extra"] = extra
        if "perplexity_fp32" in quality:
            quality["perplexity_increase"] = quality["perplexity_quantized"]["ppl"] / quality["perplexity_fp32"]["ppl"] - 1
        timings["evaluate_s"] = time.perf_counter() - t
    latency: dict[str, Any] = {}
    load: dict[str, Any] | None = None
    if (rec.report.latency.enabled if measure_latency is None else measure_latency) and fp32_path is not None:
        from quantkit.evaluate.decode import llm_latency

        t = time.perf_counter()
        load = {"start": load_average()}  # the machine's load while the figures were measured
        with stage("measure latency (FP32 vs quantized, interleaved)", enabled=progress):
            latency = llm_latency(str(fp32_path), str(q_path), rec.report.latency)
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
        "calibration": {"mode": "layerwise", "tokens": res.calibration_tokens, "resumed_blocks": res.resumed_blocks},
        "formats": formats,
        "size": {"fp32_bytes": fp32_bytes, "quantized_bytes": q_bytes, "ratio": q_bytes / max(fp32_bytes, 1)},
        "latency": latency, "fidelity": {}, "quality": quality, "timings": timings, "census": _census(q_path),
        "layers": res.rows, "weight_only": res.rows, "linear_formats": [], "unfused": [], "float_layers": [],
        "notes": dict(res.notes), "search": None, "kernels": {}, "warnings": warnings,
        # q/k/v computed by one MatMulNBits: which layers share a kernel of the emitted graph
        "kernel_sharing": map_layer_kernels(onnx.load(str(q_path), load_external_data=False), res.rows),
    }  # fmt: skip
    complete_report(report, load=load, latency_note="" if fp32_path is not None else
                    "not measured: no FP32 baseline to compare with (see warnings)")
    return LayerwiseQuantizeResult(q_path, report, rec, timings)


def check_layerwise_plan(rec: RecipeModel) -> None:
    """Refuse, before any work, a layer-wise recipe whose default format cannot be built that way."""
    fmt = rec.quantization.default.format
    if fmt not in LAYERWISE_FORMATS:
        raise RecipeError(f"calibration.layerwise: quantization.default.format {fmt!r} is not built layer-wise; "
                            f"allowed: {sorted(LAYERWISE_FORMATS)}")  # fmt: skip
    if rec.search is not None:
        raise RecipeError("calibration.layerwise and search cannot be combined (the search measures the whole "
                            "graph); set calibration.layerwise: false")  # fmt: skip
