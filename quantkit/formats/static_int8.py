"""Static INT8 (W8A8 QDQ): per-channel int8 weights, calibrated uint8/int8 activations.

Needs: the statistics of every activation tensor its chains quantize (one cached streaming pass,
calibrators from the plan), per-channel input means when ``bias_correction`` is on, and, for a
target whose kernels saturate int16 pair sums (x86 without VNNI, ``portable``), the second moment of
each layer's input in the kernel's K order (one more pass).  Selection and Q/DQ placement are
:func:`quantkit.lowering.select.select`; the graph edits are :func:`quantkit.lowering.qdq.lower_int8`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.formats.base import FormatHandler, Job, Lowered
from quantkit.irtools import fill_missing_types
from quantkit.progress import stage

log = logging.getLogger("quantkit")


class StaticInt8(FormatHandler):
    name = "static"
    formats = ("int8",)
    family = "static"
    needs = ("activation statistics (histograms, one cached pass); input means (bias correction); "
             "kernel-order input second moments (pair-safe targets)")
    boundary = "QuantizeLinear where a float tensor enters an int8 chain, DequantizeLinear where it leaves"

    def select(self, job: Job) -> Any:
        from quantkit.lowering.select import select

        return select(job.float_model, job.plan)

    def lower(self, job: Job, model: ir.Model, layers: Any, out: Lowered) -> None:

        qplan = layers
        art = job.artifacts
        rec = job.recipe
        t = time.perf_counter()
        self._calibrate(job, qplan)
        out.timings["calibrate_s"] = time.perf_counter() - t
        means = {k: v for k, v in art.means.items() if k in qplan.layers} if rec.quantization.bias_correction else None
        hessians = None
        if job.target.pair_safe:
            t = time.perf_counter()
            hessians = self._hessians(job, qplan)
            if hessians is not None:
                out.timings["pair_hessians_s"] = time.perf_counter() - t
        auto = self._auto_tensors(job, qplan)
        chosen = None
        if auto:  # every candidate lowered and run; the winner's lowered model is the one that ships
            t = time.perf_counter()
            chosen = choose_calibrator(job, qplan, auto, means, hessians)
            out.timings["calibrator_choice_s"] = time.perf_counter() - t
        ranges = {k: art.ranges[k] for k in qplan.calibrated_tensors()}
        out.zero_range = sorted(n for n, (lo, hi) in ranges.items() if float(np.max(hi)) - float(np.min(lo)) <= 0.0)
        if out.zero_range:
            log.warning("%d activation tensor(s) never varied over the calibration data: %s", len(out.zero_range),
                        ", ".join(out.zero_range[:8]))
        if chosen is not None:
            out.model, out.lowering = chosen
        else:
            with stage("lower to INT8 QDQ", enabled=job.progress):
                out.lowering = _lower(job, model, qplan, ranges, means, hessians)
        out.static = qplan
        out.layers[self.name] = {k: "int8" for k in (*qplan.layers, *qplan.dynamic_lstms, *qplan.tables)}

    @staticmethod
    def _calibrate(job: Job, qplan: Any) -> None:
        """Ranges of the plan's tensors (and input means) not yet in the artifacts: one cached pass."""
        from quantkit.errors import DataError
        from quantkit.pipeline import bias_mean_inputs, calibrate_ranges

        art = job.artifacts
        missing = [k for k in qplan.calibrated_tensors() if k not in art.ranges]
        # only weighted layers have a bias to correct: the plan's other int8 layers (Add, Mul, Transpose...) never
        # get a mean, and asking for theirs would re-run the whole pass for every later plan (a guard's candidates)
        means_missing = ([k for k in bias_mean_inputs(job.float_model, qplan) if k not in art.means]
                         if job.recipe.quantization.bias_correction else [])
        if not missing and not means_missing:
            return
        if job.calibration is None:
            raise DataError("static int8 layers need calibration data: set calibration.data or pass calibration_data")
        # a pair-safe target's kernel-order second moments ride along in the same pass (never cached)
        todo = StaticInt8._hessian_todo(job, qplan)
        transient = None
        if todo:
            from quantkit.calibrate.kernel_hessian import gather_requests

            transient = gather_requests(todo, job.calibration, job.recipe.calibration.batch_size)
        collected: dict[str, Any] = {}
        with stage("calibrate: activation statistics over the calibration data", enabled=job.progress):
            staged = job.float_staged
            ranges, means, info = calibrate_ranges(
                job.float_model, job.float_proto, None, qplan, job.calibration, job.recipe, progress=job.progress,
                use_cache=job.use_cache, tensors=missing, mean_layers=means_missing,
                candidates=art.range_candidates, source=None if staged is None else staged.path,
                digest=job.float_digest, transient=transient, transient_out=collected)
        if todo:
            from quantkit.calibrate.kernel_hessian import finished_hessians

            art.hessians.update(finished_hessians(collected, todo))
            info = {**info, "pair_hessians_in_pass": len(todo)}
        chosen = art.calibrator_choice.get("chosen")
        if chosen:  # an earlier plan on this model chose: its new ``auto`` tensors take the same candidate
            ranges.update({k: v for k, v in art.range_candidates.get(chosen, {}).items() if k in ranges})
        art.ranges.update(ranges)
        art.means.update(means or {})
        art.calibration_info.update(info)

    @staticmethod
    def _auto_tensors(job: Job, qplan: Any) -> list[str]:
        """The plan's tensors calibrated by ``auto`` while no candidate is chosen yet (empty once one is)."""
        art = job.artifacts
        if art.calibrator_choice or len(art.range_candidates) < 2:
            return []
        first = next(iter(art.range_candidates.values()))
        return sorted(k for k in qplan.calibrated_tensors() if k in first)

    @staticmethod
    def _hessian_todo(job: Job, qplan: Any) -> dict[str, Any]:
        """The plan's layers whose kernel-order second moment a pair-safe target needs and the run has not
        collected yet (``layer -> (input tensor, K, conv geometry)``; empty for other targets)."""
        if not job.target.pair_safe or job.calibration is None:
            return {}
        from quantkit.lowering.qdq import hessian_requests

        return {k: v for k, v in hessian_requests(job.float_model, qplan).items() if k not in job.artifacts.hessians}

    @staticmethod
    def _hessians(job: Job, qplan: Any) -> dict[str, Any] | None:
        """Input second moments in kernel K order, for pair-constrained rounding (pair-safe targets only)."""
        if not job.target.pair_safe or job.calibration is None:
            return None
        from quantkit.calibrate.kernel_hessian import collect_kernel_hessians

        cache = job.artifacts.hessians
        todo = StaticInt8._hessian_todo(job, qplan)
        if todo:  # the activation statistics were all known already (a later plan): a pass of their own
            rec = job.recipe
            with stage("pair-safe rounding: input second moments (one pass)", enabled=job.progress):
                staged = job.float_staged
                cache.update(collect_kernel_hessians(
                    job.float_proto if staged is None else staged.path, job.calibration, todo, batch_size=rec.calibration.batch_size,
                    max_batch_output_bytes=rec.calibration.max_batch_output_bytes, progress=job.progress))
        return {k: v for k, v in cache.items() if k in qplan.layers}



def choose_calibrator(job: Job, qplan: Any, tensors: list[str], means: dict[str, np.ndarray] | None,
                      hessians: dict[str, Any] | None) -> tuple[ir.Model, Any]:
    """The ``auto`` calibrator's choice: the plan lowered once per candidate's ranges of ``tensors`` (the other
    tensors keep theirs), each run with this CPU's fused kernels (``ORT_ENABLE_ALL``: the model that ships) on the
    first ``samples`` calibration samples against the FP32 model; the candidate with the highest output SQNR
    (mean over the compared outputs, dB) wins, the first listed on a tie.  Sets the chosen ranges in the
    artifacts (a later plan on the same model - the latency guard's - keeps the choice; the record the report
    shows is in ``calibration_info``) and returns the winner's lowered model and its ``LoweringResult``."""
    import onnx_ir as ir

    from quantkit.evaluate.latency import make_session
    from quantkit.pipeline import compared_outputs

    art, rec = job.artifacts, job.recipe
    options = dict(rec.calibration.calibrator_options) if rec.calibration.calibrator == "auto" else {}
    samples = int(options.get("samples", 16))
    feeds: list[dict[str, np.ndarray]] = []
    for feed in job.calibration.batches(1) if job.calibration is not None else ():
        feeds.append(feed)
        if len(feeds) >= samples:
            break
    s_f = make_session(job.float_source)
    names = compared_outputs([o.name for o in s_f.get_outputs()])
    refs = [s_f.run(names, f) for f in feeds]
    del s_f
    scores: dict[str, float] = {}
    best: tuple[str, ir.Model, Any] | None = None
    with stage(f"calibrator auto: {', '.join(art.range_candidates)} compared on {len(feeds)} calibration samples",
               enabled=job.progress):
        for cand, cand_ranges in art.range_candidates.items():
            ranges = {k: art.ranges[k] for k in qplan.calibrated_tensors()}
            ranges.update({k: cand_ranges[k] for k in tensors})
            model = ir.from_proto(job.float_proto)
            low = _lower(job, model, qplan, ranges, means, hessians)
            fill_missing_types(model)
            sess = make_session(job.stage_model(model, f"candidate-{cand}-"))
            scores[cand] = _output_sqnr(refs, [sess.run(names, f) for f in feeds])
            del sess
            if best is None or scores[cand] > scores[best[0]]:  # a tie keeps the earlier candidate
                best = (cand, model, low)  # only the best so far is kept: one lowered model in memory at a time
    assert best is not None  # at least two candidates were scored (_auto_tensors)
    chosen = best[0]
    for k in tensors:
        art.ranges[k] = art.range_candidates[chosen][k]
    record = {"chosen": chosen, "output_sqnr_db": {c: round(v, 3) for c, v in scores.items()},
              "samples": len(feeds), "tensors": len(tensors),
              "how": "each candidate's ranges lowered and run with this CPU's fused kernels on the first calibration "
                     "samples; the highest output SQNR against FP32 wins"}
    art.calibrator_choice.update(record)
    art.calibration_info["calibrator_choice"] = record
    log.info("calibrator auto: %s chosen (output SQNR on %d calibration samples: %s)", chosen, len(feeds),
             ", ".join(f"{c} {v:.2f} dB" for c, v in scores.items()))
    return best[1], best[2]


def _lower(job: Job, model: ir.Model, qplan: Any, ranges: dict[str, Any], means: dict[str, np.ndarray] | None,
           hessians: dict[str, Any] | None) -> Any:
    """:func:`quantkit.lowering.qdq.lower_int8` of ``qplan`` on ``model`` (in place) with the recipe's export settings."""
    from quantkit.lowering.qdq import lower_int8

    rec = job.recipe
    return lower_int8(model, qplan, ranges, activation_storage=rec.export.activation_storage,
                      matmul_form=rec.export.matmul_form, input_means=means or None, target=job.target,
                      hessians=hessians, pair_cache=job.artifacts.pair_cache)


def _output_sqnr(refs: list[list[np.ndarray]], got: list[list[np.ndarray]]) -> float:
    """Mean over outputs of ``10 log10(sum ref^2 / sum (got - ref)^2)`` over all samples (float outputs only;
    an exact output counts as 200 dB)."""
    dbs = []
    for j in range(len(refs[0]) if refs else 0):
        if not np.issubdtype(np.asarray(refs[0][j]).dtype, np.floating):
            continue
        sig = sum(float(np.sum(np.asarray(r[j], np.float64) ** 2)) for r in refs)
        err = sum(float(np.sum((np.asarray(g[j], np.float64) - np.asarray(r[j], np.float64)) ** 2))
                  for r, g in zip(refs, got, strict=True))
        db = 200.0 if err == 0.0 else float(10 * np.log10(max(sig, 1e-300) / err))
        dbs.append(db if np.isfinite(db) else -np.inf)  # a NaN output never wins
    return float(np.mean(dbs)) if dbs else 0.0
