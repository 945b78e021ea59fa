"""Execute any precision plan: one lowering walk over the format handlers, in a fixed order.

::

    PrecisionPlan ──> prepare_float (Gemm -> MatMul + Add for layers in a MatMul-only format)
                 ──> each handler selects its layers (disjoint: one format per layer)
                 ──> clone the float model; static INT8 lowers first (it places Q/DQ on the float graph),
                     then weight-only, dynamic INT8, 16-bit floats (they replace single nodes)
                 ──> Lowered (the model + per-handler layers, rows, timings) for census, checks, report

The API runs this once per job; the search runs it for every point it emits, sharing
:class:`~quantkit.formats.base.Artifacts` so nothing is computed twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir

from quantkit.formats.base import Job, Lowered
from quantkit.recipe.plan import PrecisionPlan

LINEAR_ONLY_FORMATS = ("int4", "int8_weight", "int8_dynamic", "fp16", "bf16")
"""Formats lowered on ``MatMul(x, W)``: a Gemm given one of them is rewritten to MatMul + Add first."""

from quantkit.ops import LAYER_OPS as LAYER_OPS  # noqa: E402 - re-exported beside LINEAR_ONLY_FORMATS


def prepare_float(float_model: ir.Model, plan: PrecisionPlan) -> list[str]:
    """Rewrite (in place, exactly) the Gemm layers ``plan`` puts in a MatMul-only format as MatMul + Add
    (same node name; overrides by ``op_type: Gemm`` keep matching).  Returns their names."""
    from quantkit.lowering.select import layer_plan
    from quantkit.prep.gemm_to_matmul import gemm_to_matmul

    gemms = [n.name or "" for n in float_model.graph
             if n.op_type == "Gemm" and n.domain in ("", "ai.onnx") and layer_plan(plan, n).format in LINEAR_ONLY_FORMATS]
    if gemms:
        gemm_to_matmul(float_model, only=set(gemms))
    return gemms


def linear_layers_in(job: Job, formats: Sequence[str], ops: Sequence[str] = ("MatMul",)) -> dict[str, Any]:
    """``name -> (node, LayerPlan)`` of the default-domain ``ops`` nodes with a constant float weight that
    the plan puts in one of ``formats``."""
    from quantkit.lowering.select import constant_array, layer_plan

    out: dict[str, Any] = {}
    for n in job.float_model.graph:
        if n.op_type not in ops or n.domain not in ("", "ai.onnx") or len(n.inputs) < 2:
            continue
        lp = layer_plan(job.plan, n)
        w = constant_array(n.inputs[1])
        if lp.format in formats and w is not None and w.dtype.kind == "f":
            out[n.name or ""] = (n, lp)
    return out


def lower_plan(job: Job) -> Lowered:
    """The quantized model of ``job.plan`` (the float model is not modified)."""
    from quantkit.formats import handlers
    from quantkit.lowering.qdq import LoweringResult
    from quantkit.lowering.select import QuantPlan

    hs = handlers()
    chosen: dict[str, Any] = {h.name: h.select(job) for h in hs}
    model = ir.from_proto(job.float_proto)
    out = Lowered(model, static=QuantPlan(), lowering=LoweringResult())
    for h in hs:
        sel = chosen[h.name]
        if h.name == "static":
            out.static = sel
            if not sel.layers and not sel.dynamic_lstms and not sel.tables:
                continue
        elif not sel:
            continue
        t = time.perf_counter()
        h.lower(job, out.model, sel, out)  # static INT8 (first) may replace the clone with its chosen lowering
        out.timings[f"lower_{h.name}_s"] = time.perf_counter() - t
    if out.static.layers:  # int8 codes were chosen for this CPU class
        out.model.metadata_props["quantkit.target"] = json.dumps(job.target.as_dict())
    from quantkit.irtools import fill_missing_types

    fill_missing_types(out.model)
    return out
