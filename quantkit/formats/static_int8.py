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
        from quantkit.lowering.qdq import lower_int8

        qplan = layers
        art = job.artifacts
        rec = job.recipe
        t = time.perf_counter()
        self._calibrate(job, qplan)
        out.timings["calibrate_s"] = time.perf_counter() - t
        ranges = {k: art.ranges[k] for k in qplan.calibrated_tensors()}
        out.zero_range = sorted(n for n, (lo, hi) in ranges.items() if float(np.max(hi)) - float(np.min(lo)) <= 0.0)
        if out.zero_range:
            log.warning("%d activation tensor(s) never varied over the calibration data: %s", len(out.zero_range),
                        ", ".join(out.zero_range[:8]))
        t = time.perf_counter()
        hessians = self._hessians(job, qplan)
        if hessians is not None:
            out.timings["pair_hessians_s"] = time.perf_counter() - t
        means = {k: v for k, v in art.means.items() if k in qplan.layers} if rec.quantization.bias_correction else None
        with stage("lower to INT8 QDQ", enabled=job.progress):
            out.lowering = lower_int8(model, qplan, ranges, activation_storage=rec.export.activation_storage,
                                      matmul_form=rec.export.matmul_form, input_means=means or None,
                                      target=job.target, hessians=hessians, pair_cache=art.pair_cache)
        out.static = qplan
        out.layers[self.name] = {k: "int8" for k in qplan.layers}

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
        with stage("calibrate: activation statistics over the calibration data", enabled=job.progress):
            ranges, means, info = calibrate_ranges(job.float_model, job.float_proto, job.float_bytes, qplan,
                                                   job.calibration, job.recipe, progress=job.progress,
                                                   use_cache=job.use_cache, tensors=missing,
                                                   mean_layers=means_missing)
        art.ranges.update(ranges)
        art.means.update(means or {})
        art.calibration_info.update(info)

    @staticmethod
    def _hessians(job: Job, qplan: Any) -> dict[str, np.ndarray] | None:
        """Input second moments in kernel K order, for pair-constrained rounding (pair-safe targets only)."""
        if not job.target.pair_safe or job.calibration is None:
            return None
        from quantkit.calibrate.kernel_hessian import collect_kernel_hessians
        from quantkit.lowering.qdq import hessian_requests

        cache = job.artifacts.hessians
        todo = {k: v for k, v in hessian_requests(job.float_model, qplan).items() if k not in cache}
        if todo:
            rec = job.recipe
            with stage("pair-safe rounding: input second moments (one pass)", enabled=job.progress):
                cache.update(collect_kernel_hessians(
                    job.float_proto, job.calibration, todo, batch_size=rec.calibration.batch_size,
                    max_batch_output_bytes=rec.calibration.max_batch_output_bytes, progress=job.progress))
        return {k: v for k, v in cache.items() if k in qplan.layers}

