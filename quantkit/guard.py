"""Never slower than FP32: float islands chosen by measured latency.

An int8 kernel is not always faster than its float twin on a given CPU: ONNX Runtime's int8 depthwise
convolutions, a stem convolution over 3 input channels, or a convolution whose float version absorbs its
activation for free can each cost more than FP32 (see ``docs/int8-lowering.md``).  When the emitted model
*measures* slower than FP32 in the run's own latency comparison, this guard:

1. profiles the FP32 and the quantized model on the latency feed (ONNX Runtime's profiler, per node,
   attributed to the model's layers: :mod:`quantkit.search.profile`);
2. takes every static-int8 GEMM-like layer (Conv, Gemm, MatMul) whose int8 kernel time exceeds its
   float time, and re-runs the same plan with exactly those layers kept in float (the calibration
   statistics come from the cache);
3. ships whichever of the two models measured faster against FP32, and records both measurements, the
   per-layer times and the layers kept in float in the report (``latency_guard``).

Nothing is decided by model name or by a constant tuned to one model: the decision is the measured
per-layer comparison on this CPU.  It is opt-in (``report.latency.guard: true``): a decision by measured
time follows the machine's timing noise, so two runs near the threshold may ship different models.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("quantkit")

__all__ = ["GEMM_LIKE", "apply_latency_guard", "layer_times", "slow_int8_layers"]

GEMM_LIKE = ("Conv", "Gemm", "MatMul")


def layer_times(float_bytes: bytes, quant_bytes: bytes, float_model: Any, layers: list[str],
                feed: dict[str, Any], *, threads: int | None, runs: int = 20) -> dict[str, tuple[float, float]]:
    """``layer -> (fp32 ms, int8 ms)``: the median kernel time of each layer's node(s) in the float model and
    of its int8 kernel (the fused node and the helper nodes named after it) in the quantized one."""
    from quantkit.search.cost import output_aliases
    from quantkit.search.profile import profile_model

    f = profile_model(float_bytes, feed, runs=runs, warmup=5, threads=threads)
    q = profile_model(quant_bytes, feed, runs=runs, warmup=5, threads=threads)
    fb = f.by_layer(layers, aliases=output_aliases(float_model, layers))
    qb = q.by_layer(layers)
    return {name: (fb[name], qb[name]) for name in layers}


def slow_int8_layers(float_bytes: bytes, quant_bytes: bytes, float_model: Any, layers: list[str],
                     feed: dict[str, Any], *, threads: int | None, runs: int = 20) -> dict[str, tuple[float, float]]:
    """The entries of :func:`layer_times` whose int8 kernel took longer than the float node(s)."""
    times = layer_times(float_bytes, quant_bytes, float_model, layers, feed, threads=threads, runs=runs)
    return {name: (f, q) for name, (f, q) in times.items() if f > 0.0 and q > f}


def apply_latency_guard(result: Any, rerun: Callable[[Any], Any], feed: dict[str, Any], *,
                        float_bytes: bytes) -> Any:
    """The guard of the module doc.  ``result``: a :class:`quantkit.run.QuantizeResult` whose report holds
    the run's latency; ``rerun(plan)`` executes another plan the same way; ``feed``: the latency feed."""
    rep = result.report
    lat = rep.get("latency") or {}
    rec = result.recipe
    speedup = lat.get("speedup")
    if not rec.report.latency.guard or speedup is None or speedup >= 1.0 or result.precision is None:
        return result
    layers = [n for n, lp in result.plan.layers.items() if lp.op_type in GEMM_LIKE and lp.format == "int8"]
    if not layers:
        return result
    import onnx_ir as ir

    slow = slow_int8_layers(float_bytes, ir.to_proto(result.model).SerializeToString(), result.float_model,
                            layers, feed, threads=rec.report.latency.threads)
    record: dict[str, Any] = {"first_speedup": speedup, "slower_int8_layers": {
        k: {"fp32_ms": v[0], "int8_ms": v[1]} for k, v in sorted(slow.items())}}
    if not slow:
        record["decision"] = "no int8 layer measured slower than its float version: the model is kept as built"
        rep["latency_guard"] = record
        return result
    log.info("latency guard: the int8 model measured %.2fx FP32; %d layer(s) whose int8 kernel is slower than "
             "float are tried in float: %s", speedup, len(slow), ", ".join(sorted(slow)[:8]))
    plan = result.precision.choose({k: dataclasses.replace(result.plan.layers[k], format="fp32") for k in slow})
    second = rerun(plan)
    s2 = (second.report.get("latency") or {}).get("speedup")
    record["second_speedup"] = s2
    chosen = second if s2 is not None and s2 > speedup else result
    record["decision"] = (f"shipped with {len(slow)} layer(s) in float ({s2:.2f}x FP32 instead of {speedup:.2f}x)"
                          if chosen is second else
                          f"kept all layers int8: keeping the slower layers in float measured {s2:.2f}x FP32, "
                          f"no better than {speedup:.2f}x")
    chosen.report["latency_guard"] = record
    if (chosen.report.get("latency") or {}).get("speedup", 1.0) < 1.0:
        chosen.report.setdefault("warnings", []).append(
            f"latency guard: {record['decision']}; still slower than FP32 on this CPU (see latency_guard)")
    log.info("latency guard: %s", record["decision"])
    return chosen
