"""The fidelity guard: a model whose quantized outputs collapsed is repaired by measurement before it ships.

Some networks amplify the error of a few int8 layers far beyond what those layers make themselves: a LayerNorm
over frames of almost no energy (the silent frames of speech after wav2vec2 / HuBERT / WavLM's convolutional
feature encoder), a normalization over a tensor whose power is mostly a common offset.  Every layer alone looks
fine; the output is a few dB from FP32.  The report's verdict (:mod:`quantkit.report.verdict`) already finds where
the error grows and which layers to keep in float.  This guard acts on it, on by default
(``evaluation.fidelity_guard``), for the whole-graph path with fidelity figures (not a causal LM, which is judged
by perplexity):

1. when an output of the emitted model is below the verdict's SQNR floor against FP32
   (:data:`~quantkit.report.verdict.FIDELITY_SQNR_DB`; the verdict's top-1 floor alone does not trigger it: the
   agreement of a few dozen samples moves with one sample, the SQNR does not) and the verdict names layers to
   keep in float, the plan is run
   again with those layers in float - the same calibrated ranges, the full run: lowering, census, kernel check,
   evaluation on the same samples, latency;
2. the candidate ships when its worst output SQNR is at least :data:`MIN_GAIN_DB` better (a quarter of the error
   power or less): a float layer costs speed, so a small gain does not pay for it; when it is still below the
   floor, the verdict of the candidate is tried once more (at most :data:`MAX_ROUNDS` rounds);
3. never more than :data:`MAX_FLOAT_SHARE` of the quantized layers are put back in float (beyond that the model
   is not an int8 model any more; the verdict's snippet stays in the warnings for the user to decide);
4. nothing is tried when an activation tensor had zero range over the calibration data (constant or all-zero
   samples): the data is the first thing to fix, and floating the layer that reads such a tensor would only hide
   it - and the warning that names it.

The decision, every candidate's figures and the rule are in the report (``fidelity_guard``); the layers it put
back in float carry the rule ``fidelity guard`` in the plan.  The latency guard runs afterwards on what this one
ships, so the model is still never slower than FP32.  The decision is made on the evaluation samples the report's
fidelity is measured on (the calibration samples when there are none): both models are run on the same inputs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from quantkit.report.verdict import FIDELITY_SQNR_DB, suggested_float_layers

log = logging.getLogger("quantkit")

__all__ = ["MAX_FLOAT_SHARE", "MAX_ROUNDS", "MIN_GAIN_DB", "RULE", "apply_fidelity_guard", "worst_sqnr_db"]

MIN_GAIN_DB = 6.0
"""A candidate ships only if its worst output SQNR is this much better (6 dB: the error power divided by four)."""
MAX_ROUNDS = 2
"""Candidates tried at most: the verdict's layers, then the verdict of that candidate once more."""
MAX_FLOAT_SHARE = 0.5
"""At most this share of the plan's quantized layers is put back in float."""
RULE = "fidelity guard"
"""The ``rule`` of a layer the guard put back in float (the report's plan shows it)."""


def worst_sqnr_db(fidelity: Mapping[str, Mapping[str, Any]]) -> float:
    """The lowest output SQNR against FP32 (dB; ``inf`` when no output has a finite figure)."""
    vals = [float(d["sqnr_db"]) for d in fidelity.values()
            if isinstance(d.get("sqnr_db"), (int, float)) and not math.isnan(float(d["sqnr_db"]))]
    return min(vals) if vals else math.inf


def _quantized_layers(result: Any) -> list[str]:
    """The layers the emitted model computes in a quantized or 16-bit format (every format family)."""
    return [n for n, f in result.lowered.formats().items() if f != "fp32"]


def _suggestion(result: Any) -> list[str]:
    rep = result.report
    return suggested_float_layers(rep.get("fidelity") or {}, (rep.get("error_growth") or {}).get("sqnr") or [])


def _figures(result: Any) -> dict[str, Any]:
    fid = result.report.get("fidelity") or {}
    return {"worst_sqnr_db": worst_sqnr_db(fid),
            "outputs": {n: {k: d[k] for k in ("sqnr_db", "top1_agreement") if k in d} for n, d in fid.items()},
            "speedup": (result.report.get("latency") or {}).get("speedup")}


def apply_fidelity_guard(result: Any, rerun: Callable[[Any], Any]) -> Any:
    """The guard of the module doc.  ``result``: a :class:`quantkit.run.QuantizeResult` of the recipe's plan, with
    its fidelity evaluated; ``rerun(plan)`` executes another plan the same way.  Returns the result to ship
    (``result`` itself, or a re-run with layers in float), with ``fidelity_guard`` in its report when the guard
    had something to decide."""
    rec = result.recipe
    fidelity = result.report.get("fidelity") or {}
    if not rec.evaluation.fidelity_guard or result.precision is None or not fidelity:
        return result
    if not worst_sqnr_db(fidelity) < FIDELITY_SQNR_DB:
        return result
    record: dict[str, Any] = {"first": _figures(result), "candidates": [], "float_layers": []}
    zero = list(getattr(result.lowered, "zero_range", None) or [])
    if zero:  # constant calibration data: floating layers would only hide it (and its warning, with the tensor)
        record["decision"] = (f"kept the plan: {len(zero)} activation tensor(s) had zero range over the calibration "
                              f"data ({', '.join(zero[:4])}{' ...' if len(zero) > 4 else ''}); the calibration data, "
                              f"not the plan, is the first thing to fix")
        return _ship(result, record)
    from quantkit.guard import _float_plan

    t0 = time.perf_counter()
    quantized = _quantized_layers(result)
    limit = int(MAX_FLOAT_SHARE * len(quantized))
    record["rule"] = (f"an output below {FIDELITY_SQNR_DB:.0f} dB SQNR against FP32: the layers the verdict names are "
                      f"run in float; the candidate ships when its worst output SQNR is >= {MIN_GAIN_DB:.0f} dB "
                      f"better, at most {MAX_ROUNDS} rounds, at most {MAX_FLOAT_SHARE:.0%} of the quantized layers in "
                      f"float; measured on the same evaluation samples")
    shipped, current_db = result, record["first"]["worst_sqnr_db"]
    floated: list[str] = []
    for _ in range(MAX_ROUNDS):
        names = [n for n in _suggestion(shipped) if n in quantized and n not in floated]
        if not names:
            record.setdefault("stopped", "the verdict names no further quantized layer")
            break
        wanted = floated + names
        if len(wanted) > limit:
            record["stopped"] = (f"the verdict's {len(names)} layer(s) would put {len(wanted)} of {len(quantized)} "
                                 f"quantized layers in float (more than {MAX_FLOAT_SHARE:.0%})")
            break
        log.info("fidelity guard: worst output %.1f dB against FP32; trying %d layer(s) in float: %s", current_db,
                 len(names), ", ".join(names))
        cand = rerun(_float_plan(shipped, wanted, rule=RULE))
        figs = _figures(cand)
        won = figs["worst_sqnr_db"] >= current_db + MIN_GAIN_DB
        record["candidates"].append({"float_layers": list(wanted), **figs,
                                     "gain_db": figs["worst_sqnr_db"] - current_db, "shipped": won})
        if not won:
            break
        shipped, floated, current_db = cand, wanted, figs["worst_sqnr_db"]
        if not current_db < FIDELITY_SQNR_DB:
            break
    record["float_layers"] = floated
    record["time_s"] = time.perf_counter() - t0
    first_db = record["first"]["worst_sqnr_db"]
    if floated:
        record["decision"] = (f"shipped with {len(floated)} layer(s) in float ({', '.join(floated[:8])}"
                              + (" ..." if len(floated) > 8 else "") + f"): worst output {first_db:.1f} -> "
                              f"{current_db:.1f} dB against FP32 on the same samples; to ship the plan as built: "
                              f"evaluation: {{fidelity_guard: false}}")
    elif record["candidates"]:
        c = record["candidates"][-1]
        record["decision"] = (f"kept the plan: {len(c['float_layers'])} layer(s) in float gave "
                              f"{c['worst_sqnr_db']:.1f} dB against {first_db:.1f} dB ({c['gain_db']:+.1f} dB, less "
                              f"than {MIN_GAIN_DB:.0f} dB)")
    else:
        record["decision"] = f"kept the plan: {record.get('stopped', 'no candidate')}"
    return _ship(shipped, record)


def _ship(result: Any, record: dict[str, Any]) -> Any:
    """``result`` with the guard's ``record`` in its report, the decision logged."""
    result.report["fidelity_guard"] = record
    log.info("fidelity guard: %s", record["decision"])
    return result
