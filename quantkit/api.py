"""The Python API: ``quantize(model, calibration_data, recipe)`` - what the CLI calls.

Pipeline (each stage in its own package)::

    recipe -> frontends (ONNX in onnx_ir) -> prep passes -> select (QuantPlan)
           -> calibrate (ORT + streaming calibrators) -> lower (QDQ) -> verify (ORT census)
           -> evaluate (fidelity + latency, same run) -> report
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import psutil

from quantkit.calibrate.kernel_hessian import collect_kernel_hessians
from quantkit.data import Dataset, as_dataset, make_dataset, model_inputs
from quantkit.errors import DataError, LoweringError, QuantkitError
from quantkit.evaluate.metrics import sqnr_db
from quantkit.frontends import LoadedModel, load_model
from quantkit.lowering.qdq import LoweringResult, hessian_requests, lower_int8
from quantkit.lowering.select import QuantPlan, select
from quantkit.lowering.verify import Census, census
from quantkit.pipeline import (
    calibrate_ranges,
    eval_dataset,
    evaluate_fidelity,
    layer_sqnr,
    linear_format_layers,
    lower_linear_formats,
    measure_pair_latency,
    save_model,
    verify_kernels,
    weight_only_layers,
)
from quantkit.prep.pipeline import prepare
from quantkit.progress import stage
from quantkit.recipe import RecipeModel, load_recipe
from quantkit.report.build import build_report, write_report
from quantkit.scheme.target import resolve_target

log = logging.getLogger("quantkit")

# Models above this size are saved with their weights in an external-data file.
@dataclass
class QuantizeResult:
    """What :func:`quantize` returns: the quantized model, its plan and its report."""

    model: ir.Model
    float_model: ir.Model
    plan: QuantPlan
    lowering: LoweringResult
    census: Census
    report: dict[str, Any]
    recipe: RecipeModel
    timings: dict[str, float] = field(default_factory=dict)

    def save(self, directory: str | os.PathLike[str], *, report: bool = True, overwrite: bool = False
             ) -> dict[str, Path]:
        """Write ``model.onnx`` (+ external data when large), ``report.json`` and ``report.md``.

        All-or-nothing (:func:`quantkit.report.output.write_outputs`): the files are written into a
        staging folder and moved into ``directory`` as a set; quantkit's own earlier outputs there are
        replaced, a folder holding other files is refused unless ``overwrite``.
        """
        from quantkit.report.output import write_outputs

        def fill(stage: Path) -> None:
            save_model(self.model, stage / "model.onnx", self.recipe.export.external_data)
            if report:
                write_report(self.report, stage, self.recipe.report.formats)

        written = write_outputs(directory, fill, overwrite=overwrite)
        out = Path(directory)
        paths = {"model": out / "model.onnx"}
        paths.update({n: p for n, p in written.items() if n.startswith("report.")})
        return paths


def _checked_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as a proto that passes ``onnx.checker`` (else :class:`LoweringError`)."""
    proto = ir.to_proto(model)
    try:
        onnx.checker.check_model(proto, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise LoweringError(f"the emitted model fails onnx.checker: {exc}") from None
    return proto


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _clone(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def quantize(
    model: Any = None,
    calibration_data: Any = None,
    recipe: str | os.PathLike[str] | Mapping[str, Any] | RecipeModel | None = None,
    *,
    evaluation_data: Any = None,
    example_inputs: Any = None,
    progress: bool = True,
    measure_latency: bool | None = None,
    evaluate: bool = True,
    use_cache: bool = True,
) -> QuantizeResult:
    """Quantize ``model`` with ``calibration_data`` as ``recipe`` says.

    ``model``: an ONNX path / ``onnx.ModelProto`` / ``onnx_ir.Model``, a Hugging Face folder,
    a built-in name (``"efficientnet-lite0"``, ``"all-MiniLM-L6-v2"``) or a
    ``torch.nn.Module`` (then ``example_inputs`` is required).  ``None`` takes the
    recipe's ``model.source``.

    ``calibration_data``: a :class:`quantkit.data.Dataset`, any iterable of feed dicts /
    arrays, or ``None`` to use the recipe's ``calibration.data``.

    ``recipe``: a YAML path, a mapping, a :class:`RecipeModel`, or ``None`` for the
    defaults (INT8 per-channel symmetric weights, uint8 asymmetric activations, min-max),
    in which case ``model`` and ``calibration_data`` are required.

    ``use_cache=False`` ignores the statistics cache (``calibration.cache`` in the recipe too).
    ``evaluate=False`` skips the fidelity evaluation; ``measure_latency`` overrides the
    recipe's ``report.latency.enabled``.
    """
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    rec = load_recipe(recipe if recipe is not None else {"version": 1, "name": "api"})
    if model is None and rec.model is None:
        raise QuantkitError("quantize() needs a model: pass one, or name it in the recipe's model.source")
    if calibration_data is None and rec.calibration.data is None:
        raise QuantkitError(
            "quantize() needs calibration data: pass calibration_data, or set the recipe's calibration.data"
        )
    if rec.search is not None:
        return _quantize_searched(model, calibration_data, rec, evaluation_data, evaluate, measure_latency, progress,
                                  use_cache, example_inputs)
    t = time.perf_counter()
    source = model if model is not None else rec.model.source  # type: ignore[union-attr]
    load_kw: dict[str, Any] = {}
    if example_inputs is not None:
        load_kw["example_inputs"] = example_inputs
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir() and rec.model is not None:
        load_kw["seq_len"] = rec.model.seq_len
    with stage("load the model (the first use of a built-in exports it to ONNX, cached)", enabled=progress):
        loaded = load_model(source, **load_kw)
    timings["load_s"] = time.perf_counter() - t

    t = time.perf_counter()
    with stage("prepare the graph (shape inference, constant folding, BatchNorm folding)", enabled=progress):
        prep = prepare(loaded.model)
    float_model = prep.model
    timings["prepare_s"] = time.perf_counter() - t
    inputs = model_inputs(float_model)

    if calibration_data is not None:
        cal = as_dataset(calibration_data, inputs, tokenizer=loaded.tokenizer)
    elif rec.calibration.data is not None:
        cal = make_dataset(rec.calibration.data.model_dump(), inputs=inputs, tokenizer=loaded.tokenizer,
                           split="calibration")
    else:  # unreachable: checked before loading the model
        raise QuantkitError("quantize() needs calibration data")
    if len(cal) == 0:
        raise DataError("the calibration dataset is empty")
    spec = rec.calibration.data.model_dump() if calibration_data is None and rec.calibration.data else None
    log.info("calibration set: %d samples (%s)", len(cal),
             ", ".join(f"{k}={v}" for k, v in spec.items()) if spec else "given through the API")


    woq_layers = weight_only_layers(float_model, rec)
    linear_layers = linear_format_layers(float_model, rec)
    plan = select(float_model, rec)
    if woq_layers and not plan.layers and not linear_layers:
        return _quantize_weight_only(loaded, float_model, woq_layers, cal, rec, evaluation_data, evaluate,
                                     measure_latency, progress, timings, t_start)
    log.info("quantizing %d layers, %d activation tensors", len(plan.layers), len(plan.tensors))

    # calibration: one streaming pass (chunked if many tensors) over the data, or none if cached
    t = time.perf_counter()
    rss0 = _rss_mb()
    float_proto = ir.to_proto(float_model)
    float_bytes = float_proto.SerializeToString()
    with stage("calibrate: activation statistics over the calibration data", enabled=progress):
        ranges, input_means, cal_info = calibrate_ranges(
            float_model, float_proto, float_bytes, plan, cal, rec, progress=progress, use_cache=use_cache
        )
    timings["calibrate_s"] = time.perf_counter() - t
    timings["calibrate_peak_rss_mb"] = max(_rss_mb(), rss0)
    zero_range = sorted(n for n, (lo, hi) in ranges.items() if float(np.max(hi)) - float(np.min(lo)) <= 0.0)
    if zero_range:
        log.warning("%d activation tensor(s) never varied over the calibration data: %s", len(zero_range),
                    ", ".join(zero_range[:8]))

    t = time.perf_counter()
    qmodel = _clone(float_model)
    target = resolve_target(rec.target.isa, rec.target.device)
    hessians = None
    if target.pair_safe:
        with stage("pair-safe rounding: input second moments (one pass)", enabled=progress):
            hessians = collect_kernel_hessians(
                float_proto, cal, hessian_requests(float_model, plan), batch_size=rec.calibration.batch_size,
                max_batch_output_bytes=rec.calibration.max_batch_output_bytes, progress=progress)
        timings["pair_hessians_s"] = time.perf_counter() - t
        t = time.perf_counter()
    with stage("lower to INT8 QDQ", enabled=progress):
        lowering = lower_int8(qmodel, plan, ranges, activation_storage=rec.export.activation_storage,
                              matmul_form=rec.export.matmul_form, input_means=input_means, target=target,
                              hessians=hessians)
    woq_outcome = None
    if woq_layers:  # a mixed model: these layers are weight-only (MatMulNBits), the rest static int8
        from quantkit.weight_only import lower_weight_only, quantize_weights

        with stage(f"weight-only layers ({len(woq_layers)}): {rec.quantization.default.algorithm} and lowering",
                   enabled=progress):
            woq_outcome = quantize_weights(float_model, rec, woq_layers, cal, progress=progress)
            lower_weight_only(qmodel, rec, woq_outcome)
    if linear_layers:
        with stage(f"int8_dynamic / fp16 / bf16 layers ({len(linear_layers)})", enabled=progress):
            lower_linear_formats(qmodel, linear_layers, target.pair_safe)
    qmodel.metadata_props["quantkit.target"] = json.dumps(target.as_dict())
    qproto = _checked_proto(qmodel)
    timings["lower_s"] = time.perf_counter() - t

    t = time.perf_counter()
    from quantkit.ops import PASSTHROUGH

    # passthrough ops (Reshape, Transpose, ...) have no quantized kernel: ORT drops their DQ/Q
    # pair; stray Q/DQ around them would show up in the census' leftovers instead.
    cen = census(qproto, quantizable=[k for k, lp in plan.layers.items() if lp.op_type not in PASSTHROUGH]
                 + list(woq_layers) + [k for k, f in linear_layers.items() if f == "int8_dynamic"])
    timings["verify_s"] = time.perf_counter() - t

    ev = eval_dataset(rec, loaded, evaluation_data, inputs) if evaluate else None
    t = time.perf_counter()
    with stage("check the fused kernels against the QDQ math", enabled=progress):
        kernels = verify_kernels(qproto, target, ev or cal, rec.report.kernel_check_samples)
    timings["kernel_check_s"] = time.perf_counter() - t
    fidelity: dict[str, Any] = {}
    per_layer_sqnr: dict[str, float] = {}
    latency: dict[str, Any] = {}
    q_bytes = qproto.SerializeToString()
    if ev is not None:
        t = time.perf_counter()
        fidelity = evaluate_fidelity(float_bytes, q_bytes, ev, batch_size=rec.evaluation.batch_size,
                                     metric=rec.evaluation.metric, progress=progress)
        per_layer_sqnr = layer_sqnr(float_proto, qproto, plan, ev, limit=16)
        timings["evaluate_s"] = time.perf_counter() - t
    do_lat = rec.report.latency.enabled if measure_latency is None else measure_latency
    if do_lat:
        t = time.perf_counter()
        with stage("measure latency (FP32 vs quantized, interleaved)", enabled=progress):
            latency = measure_pair_latency(float_bytes, q_bytes, ev or cal, rec)
        timings["latency_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start
    report = build_report(
        recipe=rec, source=loaded.source, float_proto=float_proto, quant_proto=qproto, plan=plan,
        lowering=lowering, census=cen, fidelity=fidelity, per_layer_sqnr=per_layer_sqnr, latency=latency,
        timings=timings, calibration=cal_info, calibration_samples=len(cal), evaluation_samples=len(ev) if ev is not None else 0,
        kernels=kernels,
    )
    if linear_layers:
        report["linear_formats"] = [
            {"layer": k, "format": f, "kernel": getattr(cen.per_layer.get(k), "kernel", None)}
            for k, f in linear_layers.items()
        ]
        report["float_layers"] = [f for f in report["float_layers"] if f["layer"] not in linear_layers]
    if woq_outcome is not None:
        report["weight_only"] = [
            {**{k: (v if not isinstance(v, float) or np.isfinite(v) else str(v)) for k, v in r.items()},
             "kernel": getattr(cen.per_layer.get(r["layer"]), "kernel", None),
             "fused": getattr(cen.per_layer.get(r["layer"]), "fused", None)}
            for r in woq_outcome.rows
        ]
        report["float_layers"] = [f for f in report["float_layers"] if f["layer"] not in woq_layers]
        unfused = [r["layer"] for r in report["weight_only"] if r["fused"] is False]
        if unfused:
            report["warnings"].append(f"{len(unfused)} weight-only layers do not run as MatMulNBits: "
                                      + ", ".join(unfused[:5]))
    if zero_range:
        report["warnings"].append(
            f"{len(zero_range)} activation tensor(s) had zero range over the calibration data (constant or all "
            f"zero: their scale is a placeholder and any other value will saturate): {', '.join(zero_range[:8])}"
            + (" ..." if len(zero_range) > 8 else "") + ". Calibrate on representative data"
        )
    return QuantizeResult(qmodel, float_model, plan, lowering, cen, report, rec, timings)


def _quantize_weight_only(
    loaded: LoadedModel, float_model: ir.Model, layers: dict[str, Any], cal: Dataset, rec: RecipeModel,
    evaluation_data: Any, evaluate: bool, measure_latency: bool | None, progress: bool,
    timings: dict[str, float], t_start: float,
) -> QuantizeResult:
    """Weight-only INT4/INT8 (RTN / GPTQ / AWQ -> MatMulNBits): see :mod:`quantkit.weight_only`."""
    from quantkit.report.woq import build_woq_report
    from quantkit.weight_only import lower_weight_only, quantize_weights

    t = time.perf_counter()
    rss0 = _rss_mb()
    outcome = quantize_weights(float_model, rec, layers, cal, progress=progress)
    timings["weights_s"] = time.perf_counter() - t
    timings["weights_peak_rss_mb"] = max(_rss_mb(), rss0)
    t = time.perf_counter()
    qmodel = _clone(float_model)
    with stage("lower to MatMulNBits / GatherBlockQuantized", enabled=progress):
        lower_weight_only(qmodel, rec, outcome)
    qproto = _checked_proto(qmodel)
    timings["lower_s"] = time.perf_counter() - t
    float_proto = ir.to_proto(float_model)
    t = time.perf_counter()
    cen = census(qproto, quantizable=list(layers))
    timings["verify_s"] = time.perf_counter() - t
    inputs = model_inputs(float_model)
    with stage("prepare the evaluation data", enabled=progress):
        ev = eval_dataset(rec, loaded, evaluation_data, inputs) if evaluate else None
    quality: dict[str, Any] = {}
    fbytes = float_proto.SerializeToString()
    qbytes = qproto.SerializeToString()
    if ev is not None:
        from quantkit.evaluate.perplexity import perplexity

        t = time.perf_counter()
        if rec.evaluation.perplexity and any(o.name == "logits" for o in float_proto.graph.output):
            from tqdm.auto import tqdm

            for key, blob in (("perplexity_fp32", fbytes), ("perplexity_quantized", qbytes)):
                with tqdm(total=len(ev), desc=key.replace("_", " "), unit="window", disable=not progress) as bar:
                    def tick(done: int, total: int, bar: Any = bar) -> None:
                        bar.n = done
                        bar.refresh()

                    quality[key] = perplexity(blob, ev, progress=tick)
        else:
            quality.update(evaluate_fidelity(fbytes, qbytes, ev, batch_size=1, metric=rec.evaluation.metric,
                                             progress=progress))
        timings["evaluate_s"] = time.perf_counter() - t
    latency: dict[str, Any] = {}
    if (rec.report.latency.enabled if measure_latency is None else measure_latency):
        from quantkit.evaluate.decode import llm_latency

        t = time.perf_counter()
        with stage("measure prefill / decode latency (FP32 vs quantized, interleaved)", enabled=progress):
            latency = llm_latency(fbytes, qbytes, rec.report.latency, vocab_input=inputs)
        timings["latency_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start
    report = build_woq_report(recipe=rec, source=loaded.source, float_proto=float_proto, quant_proto=qproto,
                              outcome=outcome, census=cen, quality=quality, latency=latency, timings=timings,
                              calibration_samples=len(cal), evaluation_samples=len(ev) if ev is not None else 0)
    empty = QuantPlan()
    return QuantizeResult(qmodel, float_model, empty, LoweringResult(), cen, report, rec, timings)


def _quantize_searched(
    model: Any, calibration_data: Any, rec: RecipeModel, evaluation_data: Any, evaluate: bool,
    measure_latency: bool | None, progress: bool, use_cache: bool, example_inputs: Any = None,
) -> QuantizeResult:
    """A recipe with ``search.target``: measure sensitivity and costs, solve for the target, emit that mix
    (see :mod:`quantkit.search.sweep`; ``quantkit sweep`` gives the whole front instead)."""
    from quantkit.search.sweep import prepare_search

    srch = rec.search
    if srch is None or srch.target is None:
        raise QuantkitError(
            "the recipe has a 'search' section but no search.target: run `quantkit sweep` (or "
            "quantkit.search.sweep.sweep) for the whole front, or set search.target: {size|latency|damage: ...}"
        )
    ctx = prepare_search(model, calibration_data, rec, evaluation_data=evaluation_data, example_inputs=example_inputs,
                         progress=progress, use_cache=use_cache)
    timings = ctx.timings
    t = time.perf_counter()
    sol = ctx.solve_target(srch.target)
    qmodel = ctx.space.emit(sol.assignment)
    qproto = _checked_proto(qmodel)
    timings["solve_emit_s"] = time.perf_counter() - t
    quantized_layers = [n for u in ctx.space.units if sol.assignment[u.name] != "fp32"
                        and ctx.space.candidates.get(sol.assignment[u.name]) is not None
                        and ctx.space.candidates[sol.assignment[u.name]].format not in ("fp32", "fp16", "bf16")
                        for n in u.layers]
    cen = census(qproto, quantizable=quantized_layers + list(ctx.space.pinned))
    qbytes = qproto.SerializeToString()
    quality: dict[str, Any] = {}
    if evaluate:
        t = time.perf_counter()
        if ctx.is_lm:
            from quantkit.evaluate.perplexity import perplexity

            quality["perplexity_fp32"] = perplexity(ctx.float_bytes, ctx.ev)
            quality["perplexity_quantized"] = perplexity(qbytes, ctx.ev)
            quality["perplexity_increase"] = quality["perplexity_quantized"]["ppl"] / quality["perplexity_fp32"]["ppl"] - 1
        else:
            quality["fidelity"] = evaluate_fidelity(ctx.float_bytes, qbytes, ctx.ev, batch_size=rec.evaluation.batch_size,
                                                    metric=rec.evaluation.metric, progress=progress)
        timings["evaluate_s"] = time.perf_counter() - t
    latency: dict[str, Any] = {}
    if rec.report.latency.enabled if measure_latency is None else measure_latency:
        t = time.perf_counter()
        if ctx.is_lm:
            from quantkit.evaluate.decode import llm_latency

            latency = llm_latency(ctx.float_bytes, qbytes, rec.report.latency)
        else:
            latency = measure_pair_latency(ctx.float_bytes, qbytes, ctx.ev, rec)
        timings["latency_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - ctx.t_start
    from quantkit.report.build import environment

    f_size, q_size = len(ctx.float_bytes), len(qbytes)
    counts: dict[str, int] = {}
    for u in ctx.space.units:
        counts[sol.assignment[u.name]] = counts.get(sol.assignment[u.name], 0) + len(u.layers)
    report: dict[str, Any] = {
        "kind": "mixed", "recipe": rec.name, "model": str(ctx.loaded.source), "environment": environment(),
        "settings": rec.model_dump(mode="json"), "target": dict(srch.target), "status": sol.status,
        "predicted": ctx.predicted(sol.assignment), "formats": counts,
        "size": {"fp32_bytes": f_size, "quantized_bytes": q_size, "ratio": q_size / max(f_size, 1)},
        "quality": quality, "fidelity": quality.get("fidelity", {}), "latency": latency, "timings": timings,
        "census": {"op_counts": dict(cen.op_counts), "quantized_kernels": dict(cen.quantized_kernels),
                   "leftover_quantize_linear": cen.leftover_q, "leftover_dequantize_linear": cen.leftover_dq},
        "layers": ctx.space.assignment_table(sol.assignment), "pinned": list(ctx.space.pinned),
        "warnings": [f"{len(cen.unfused_layers)} quantized layers are not fused: {cen.unfused_layers[:5]}"]
        if cen.unfused_layers else [],
    }
    return QuantizeResult(qmodel, ctx.float_model, QuantPlan(), LoweringResult(), cen, report, rec, timings)


__all__ = ["QuantizeResult", "quantize", "save_model", "sqnr_db", "Iterable"]
