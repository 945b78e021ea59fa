"""The Python API: ``quantize(model, calibration_data, recipe)`` - what the CLI calls.

Pipeline (each stage in its own package)::

    recipe ─┬─ overrides ──────────────> PrecisionPlan ─┐
            └─ search (search.target) ─> PrecisionPlan ─┤
                                                        v
    frontends (ONNX in onnx_ir) -> prep passes -> run.run_plan: formats.lower_plan (one handler per format
    family: static INT8, weight-only, dynamic INT8, 16-bit) -> onnx.checker -> ORT census -> kernel check
    -> quality + latency (same run) -> one report

See ``docs/architecture.md`` for the picture and the floors each folder may import.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from quantkit.errors import QuantkitError, RecipeError
from quantkit.evaluate.metrics import sqnr_db
from quantkit.pipeline import save_model
from quantkit.recipe import RecipeModel, load_recipe
from quantkit.recipe.plan import PrecisionPlan
from quantkit.run import QuantizeResult, load_inputs, run_plan

log = logging.getLogger("quantkit")


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
    a built-in name (``"efficientnet-lite0"``, ``"all-MiniLM-L6-v2"``, ``"smollm2-135m"``) or a
    ``torch.nn.Module`` (then ``example_inputs`` is required).  ``None`` takes the
    recipe's ``model.source``.

    ``calibration_data``: a :class:`quantkit.data.Dataset`, any iterable of feed dicts /
    arrays, or ``None`` to use the recipe's ``calibration.data``.

    ``recipe``: a YAML path, a mapping, a :class:`RecipeModel`, or ``None`` for the
    defaults (INT8 per-channel symmetric weights, uint8 asymmetric activations, min-max),
    in which case ``model`` and ``calibration_data`` are required.  Any per-layer mix of formats
    (``quantization.overrides``) is one precision plan, executed by one pipeline; with
    ``search.target`` the search chooses the plan.

    A decoder LLM that quantkit's builder supports (a Hugging Face folder, the ``smollm2-135m`` built-in) is built,
    calibrated and quantized block by block while its checkpoint streams (:mod:`quantkit.layerwise`) whenever the
    recipe can be built that way - ``calibration.layerwise: auto``, the default; ``true`` insists - and the result
    is a :class:`quantkit.llm_run.LayerwiseQuantizeResult`: the model is on disk (``.path``), with the same
    ``.report`` and ``.save(folder)``; ``calibration_data`` may then be omitted when every layer is RTN.  The
    whole-graph path (``calibration.layerwise: false``, or a recipe that needs it: static / dynamic INT8, 16-bit
    formats, a search) runs only when its estimated peak memory fits (:mod:`quantkit.memory`); otherwise a
    :class:`~quantkit.errors.MemoryBudgetError` before any work.  Every report holds ``memory``: the estimate
    and the measured peak of the process tree.

    A model judged by output fidelity (not a causal LM) passes two guards after its first run, both on by default:
    the fidelity guard (``evaluation.fidelity_guard``, :mod:`quantkit.fidelity_guard`: an output below 20 dB SQNR
    against FP32 is re-run with the layers the report's verdict names in float, shipped when >= 6 dB better), then
    the latency guard (``report.latency.guard``, :mod:`quantkit.guard`: never slower than FP32).

    ``use_cache=False`` ignores the statistics cache (``calibration.cache`` in the recipe too).
    ``evaluate=False`` skips the fidelity evaluation; ``measure_latency`` overrides the
    recipe's ``report.latency.enabled``.
    """
    t_start = time.perf_counter()
    check_flags("quantize", progress=progress, evaluate=evaluate, use_cache=use_cache)
    if measure_latency is not None and not isinstance(measure_latency, bool):
        raise RecipeError(f"quantize(): measure_latency must be True, False or None, got "
                          f"{type(measure_latency).__name__} {measure_latency!r}")  # fmt: skip
    rec = load_recipe(recipe if recipe is not None else {"version": 1, "name": "api"})
    if model is None and rec.model is None:
        raise QuantkitError("quantize() needs a model: pass one, or name it in the recipe's model.source")
    from quantkit.llm_run import check_layerwise_plan, choose_route, memory_section, run_layerwise
    from quantkit.memory import PeakMeter, gb

    meter = PeakMeter().start()  # the measured peak of this run (process and children), beside the estimate
    try:
        model, gguf = _gguf_as_folder(model, rec)
        if rec.calibration.layerwise is True:
            check_layerwise_plan(rec)
        # streamed block by block (bounded memory) or the whole graph, whose estimate must fit: before any work
        route = choose_route(model, rec, check_memory=rec.search is None)
        if not route.layerwise and rec.quantization.rotation != "none":
            raise RecipeError(f"quantization.rotation {rec.quantization.rotation!r} is folded into a decoder's weights "
                              f"as they stream block by block, and this run takes the whole-graph path "
                              f"({route.reason}); allowed here: quantization.rotation: none (or a decoder of a "
                              "rotation-invariant family, calibration.layerwise: auto or true)")  # fmt: skip
        if not route.layerwise and rec.export.kv_cache != "float32":
            raise RecipeError(f"export.kv_cache {rec.export.kv_cache!r} is written into the KV-cache decoder the "
                              f"layer-wise builder emits, and this run takes the whole-graph path ({route.reason}); "
                              "allowed here: export.kv_cache: float32 (or a decoder the layer-wise builder supports, "
                              "calibration.layerwise: auto or true)")  # fmt: skip
        hot = [i for i, o in enumerate(rec.quantization.overrides) if o.hot_rows]
        if not route.layerwise and hot:
            raise RecipeError(f"quantization.overrides[{hot[0]}].hot_rows splits the vocabulary rows of the lm_head / "
                              f"embedding the layer-wise builder emits, and this run takes the whole-graph path "
                              f"({route.reason}); "
                              "allowed here: hot_rows: 0 (or a decoder the layer-wise builder supports, "
                              "calibration.layerwise: auto or true)")  # fmt: skip
        if route.layerwise and rec.search is not None:  # weight-only candidates: searched, then streamed
            from quantkit.llm_mix import run_layerwise_mix

            result: Any = run_layerwise_mix(model, calibration_data, rec, evaluation_data=evaluation_data,
                                            evaluate=evaluate, measure_latency=measure_latency, progress=progress,
                                            use_cache=use_cache, t_start=t_start)
        elif route.layerwise:
            result = run_layerwise(model, calibration_data, rec, evaluation_data=evaluation_data,
                                        evaluate=evaluate, measure_latency=measure_latency, progress=progress,
                                        t_start=t_start)  # fmt: skip
        else:
            from quantkit.llm_run import unstreamed_decoder_note
            from quantkit.threads import blas_threads

            unstreamed = unstreamed_decoder_note(model if model is not None else
                                                 rec.model.source if rec.model is not None else None)
            if unstreamed:
                log.warning("%s", unstreamed)

            with blas_threads():  # NumPy's BLAS beside ONNX Runtime's pools: one thread (quantkit.threads)
                result = _quantize_whole(model, calibration_data, rec, evaluation_data, evaluate, measure_latency,
                                         progress, use_cache, example_inputs, t_start)  # fmt: skip
            result.report.setdefault("memory", memory_section(route.estimate, route.available))
            if unstreamed:
                result.report.setdefault("warnings", []).append(unstreamed)
    finally:
        peak = meter.stop()
    if gguf is not None:
        result.report["model"], result.report["model_read_from"] = gguf[0], gguf[1]
        if gguf[2]:
            result.report.setdefault("warnings", []).append(gguf[2])
    summary = result.report.get("summary")
    if isinstance(summary, dict):  # warnings added after the report was built (the latency guard's) count too
        summary["warnings"] = len(result.report.get("warnings") or [])
    mem = result.report.setdefault("memory", memory_section(None, None))
    mem["measured_peak_bytes"] = int(peak)
    if mem.get("estimated_peak_bytes"):
        log.info("memory: measured peak %s (estimated ~%s)", gb(peak), gb(mem["estimated_peak_bytes"]))
    return result


def _gguf_as_folder(model: Any, rec: RecipeModel) -> tuple[Any, tuple[str, str, str] | None]:
    """A GGUF file (the ``model`` argument or the recipe's ``model.source``) as the Hugging Face folder it is
    dequantized into once (:func:`quantkit.frontends.llm.gguf_folder`), with the report's ``model``,
    ``model_read_from`` and a warning when its weights were quantized already; any other model as it is (and
    None)."""
    from quantkit.frontends import ModelSource
    from quantkit.frontends.llm import GGUF_FLOAT_TYPES, gguf_folder, gguf_tensor_types, is_gguf

    source = model if model is not None else (rec.model.source if rec.model is not None else None)
    if source is None or not is_gguf(source):
        return model, None
    folder = gguf_folder(str(source))
    graph = getattr(source, "graph", rec.model.graph if rec.model is not None else "auto")
    quantized = sorted(((k, n) for k, n in gguf_tensor_types(str(source)).items() if k not in GGUF_FLOAT_TYPES),
                       key=lambda kv: -kv[1])
    warning = "" if not quantized else (
        f"the GGUF file's weights are quantized already ({', '.join(f'{k} x{n}' for k, n in quantized)}): "
        "quantizing them again stacks a second rounding on the first - start from an F16 / BF16 / F32 GGUF or the "
        "original checkpoint when you have one")
    return ModelSource(str(folder), graph), (str(source), f"a GGUF file, dequantized once into the Hugging Face "
                                                          f"folder {folder}", warning)


def _quantize_whole(model: Any, calibration_data: Any, rec: RecipeModel, evaluation_data: Any, evaluate: bool,
                    measure_latency: bool | None, progress: bool, use_cache: bool, example_inputs: Any,
                    t_start: float) -> QuantizeResult:
    """The whole-graph path: load and prepare the model, execute the plan (or the search's), report."""
    if calibration_data is None and rec.calibration.data is None:
        raise QuantkitError(
            "quantize() needs calibration data: pass calibration_data, or set the recipe's calibration.data"
        )
    if rec.search is not None:
        return _quantize_searched(model, calibration_data, rec, evaluation_data, evaluate, measure_latency, progress,
                                  use_cache, example_inputs)
    timings: dict[str, float] = {}
    loaded, float_model, cal = load_inputs(model, calibration_data, rec, example_inputs=example_inputs,
                                           progress=progress, timings=timings)
    if evaluate and evaluation_data is not None:
        # bound once: a latency guard's re-run reads the same samples (a generator passed in is spooled by the
        # first read, never read again)
        from quantkit.data import model_inputs
        from quantkit.pipeline import eval_dataset

        evaluation_data = eval_dataset(rec, loaded, evaluation_data, model_inputs(float_model))

    decided: dict[str, Any] = {}  # the MatMulNBits accuracy_level of the first run: a guard's re-run keeps it
    from quantkit.formats.base import Artifacts

    artifacts = Artifacts()  # a second plan (the latency guard's) reuses the calibrated ranges in memory

    def run(plan: PrecisionPlan) -> QuantizeResult:
        return run_plan(loaded, float_model, plan, cal, evaluation_data=evaluation_data, evaluate=evaluate,
                        measure_latency=measure_latency, progress=progress, use_cache=use_cache,
                        timings=dict(timings), t_start=t_start, int4_decided=decided.get("int4_kernel"),
                        artifacts=artifacts)

    result = run(PrecisionPlan.from_recipe(rec))
    decided["int4_kernel"] = result.report.get("int4_kernel")
    if rec.evaluation.fidelity_guard and result.report.get("fidelity"):  # a collapsed output, repaired by measurement
        from quantkit.fidelity_guard import apply_fidelity_guard

        first, t_guard = result, time.perf_counter()
        result = apply_fidelity_guard(result, run)
        if "fidelity_guard" in result.report:
            _guard_timings(first, result, time.perf_counter() - t_guard, t_start, "fidelity_guard")
    if rec.report.latency.guard and result.report.get("latency"):  # the guard times what the run timed
        import onnx_ir as ir

        from quantkit.guard import apply_latency_guard
        from quantkit.pipeline import first_feed
        from quantkit.run import execute
        from quantkit.staging import StageArea

        def lower(plan: PrecisionPlan) -> ir.Model:  # the guard's candidate, lowered only (a winner is re-run in full)
            return execute(float_model, plan, cal, progress=False, use_cache=use_cache, artifacts=artifacts)[1].model

        first = result
        t_guard = time.perf_counter()
        with StageArea() as area:  # the guard's sessions open the models staged on disk
            result = apply_latency_guard(result, run, first_feed(cal, rec.report.latency.batch_size),
                                         float_bytes=area.stage(result.float_model, "fp32-").path,
                                         use_cache=use_cache and rec.calibration.cache, lower=lower,
                                         stage_area=area)
        _guard_timings(first, result, time.perf_counter() - t_guard, t_start, "latency_guard")
        if result is not first and "fidelity_guard" in first.report:  # the latency guard's re-run keeps its record
            result.report["fidelity_guard"] = first.report["fidelity_guard"]
    return result


def _guard_timings(first: QuantizeResult, shipped: QuantizeResult, guard_s: float, t_start: float,
                   guard_key: str) -> None:
    """The shipped report's ``timings`` after a guard (``guard_key``: ``latency_guard`` or ``fidelity_guard``): one
    line per stage of the *first* run (load, prepare, calibrate + lower, verification, kernel check, evaluation,
    latency; after both guards, the fidelity guard's line too) plus ``<guard_key>_s``, the whole guard - profiles,
    candidates, A/B and, when a candidate won, its full re-run (whose own stages are in
    ``<guard_key>.rerun_timings``) - so the stages add up to ``total_s``, the run's time to the end
    (``calibrate_s`` and ``lower_<format>_s`` are parts of ``lower_s``)."""
    tim = shipped.report.setdefault("timings", {})
    if shipped is not first:
        guard = shipped.report.get(guard_key)
        if isinstance(guard, dict):
            guard["rerun_timings"] = {k: round(v, 3) for k, v in tim.items()
                                     if isinstance(v, (int, float)) and k != f"{guard_key}_s"}
        tim.clear()
        tim.update({k: v for k, v in first.timings.items() if k != "total_s"})
    tim.pop("total_s", None)  # re-added last: the stages in the order they ran, then the total
    tim[f"{guard_key}_s"] = guard_s
    tim["total_s"] = time.perf_counter() - t_start
    shipped.timings = tim
    if isinstance(shipped.report.get("summary"), dict):
        shipped.report["summary"]["time_s"] = tim["total_s"]


def check_flags(func: str, **flags: Any) -> None:
    """Refuse a non-bool value for an API switch (``use_cache="no"`` would be taken as true)."""
    for key, val in flags.items():
        if not isinstance(val, bool):
            raise RecipeError(f"{func}(): {key} must be True or False, got {type(val).__name__} {val!r}")


def _quantize_searched(
    model: Any, calibration_data: Any, rec: RecipeModel, evaluation_data: Any, evaluate: bool,
    measure_latency: bool | None, progress: bool, use_cache: bool, example_inputs: Any = None,
) -> QuantizeResult:
    """A recipe with ``search.target``: measure sensitivity and costs, solve for the target, and run the
    chosen plan through the same pipeline as any recipe (see :mod:`quantkit.search.sweep`;
    ``quantkit sweep`` gives the whole front instead)."""
    from quantkit.search.sweep import prepare_search

    srch = rec.search
    if srch is None or srch.target is None:
        raise QuantkitError(
            "the recipe has a 'search' section but no search.target: run `quantkit sweep` (or "
            "quantkit.search.sweep.sweep) for the whole front, or set search.target: {size|latency|damage: ...}"
        )
    ctx = prepare_search(model, calibration_data, rec, evaluation_data=evaluation_data, example_inputs=example_inputs,
                         progress=progress, use_cache=use_cache)
    t = time.perf_counter()
    sol = ctx.solve_target(srch.target)
    ctx.timings["solve_s"] = time.perf_counter() - t
    search = {"target": dict(srch.target), "status": sol.status, "predicted": ctx.predicted(sol.assignment),
              "assignment": ctx.space.assignment_table(sol.assignment), "pinned": list(ctx.space.pinned),
              "uniform_predicted": ctx.uniform_all}
    res = run_plan(ctx.loaded, ctx.space.model, ctx.space.plan_of(sol.assignment), ctx.cal,
                   evaluation_data=ctx.ev, evaluate=evaluate, measure_latency=measure_latency, progress=progress,
                   use_cache=use_cache, timings=ctx.timings, t_start=ctx.t_start, artifacts=ctx.space.artifacts,
                   search=search)
    res.report["memory"] = dict(ctx.memory)  # the search's estimate (measured peak: quantize())
    return res


__all__ = ["QuantizeResult", "quantize", "save_model", "sqnr_db", "Iterable"]
