"""Weight-only quantization (INT4 / INT8 weights, float activations) of linear layers.

Pipeline, for every ``MatMul(x, W)`` with a constant ``W [K, N]`` that the recipe resolves
to ``int4`` or ``int8_weight``:

1. **Statistics** (only when an algorithm needs them, GPTQ / AWQ): ONNX Runtime runs the
   float graph over the calibration windows and a :class:`~quantkit.calibrate.layer_stats.LayerStats`
   per distinct layer input accumulates ``H = Σ xᵀx`` and a bounded row sample.  With
   ``calibration.sequential`` the layers are processed in *stages* (one per dependency level
   group, i.e. one decoder block of a transformer): stage ``k``'s statistics are collected on a
   model whose stage ``< k`` weights already hold their quantized values, so later layers see
   the error of earlier ones (GPTQ's sequential mode).  The weights are fed as graph inputs of
   one session, so a stage costs one pass over the data and no session rebuild.
2. **Algorithm** per layer (registered by name: ``rtn``, ``gptq``, ``awq``); layers reading
   the same input share one AWQ scale (``awq_shared``).  The returned codes/scales are stored
   as chosen - never re-quantized onto another grid.
3. **Lowering**: ``com.microsoft.MatMulNBits`` (or the opset-21 blocked ``DequantizeLinear``
   form); a tied embedding / lm_head is stored once and read by ``GatherBlockQuantized`` and
   ``MatMulNBits``.  No float copy of a quantized weight remains.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from quantkit.algorithms.woq import WOQResult, get_weight_algorithm
from quantkit.calibrate.layer_stats import LayerStats, quadratic_form
from quantkit.errors import DataError, UnsupportedOpError
from quantkit.lowering.select import _weighted_ok, constant_array, layer_plan
from quantkit.progress import tqdm
from quantkit.recipe.plan import LayerPlan, PrecisionPlan, as_plan
from quantkit.recipe.schema import RecipeModel

log = logging.getLogger("quantkit")

WEIGHT_ONLY_FORMATS = ("int4", "int8_weight")
STATS_ALGORITHMS = ("gptq", "awq", "signround")  # the weight algorithms that read LayerStats


@dataclass
class WOQLayer:
    name: str
    plan: LayerPlan
    input: str  # name of the activation tensor the layer reads
    weight: str  # initializer name of W [K, N]
    K: int
    N: int
    stage: int = 0
    tied_gather: str | None = None  # Gather node reading the same table (tied embedding)

    @property
    def bits(self) -> int:
        return 4 if self.plan.format == "int4" else 8


@dataclass
class WOQOutcome:
    layers: dict[str, WOQLayer]
    results: dict[str, WOQResult]
    rows: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def _tied_gather(graph: ir.Graph, w_val: ir.Value) -> tuple[str | None, str]:
    """(Gather node name, table name) when ``W`` is the transpose of a Gather's table."""
    prod = w_val.producer()
    table = prod.inputs[0] if prod is not None and prod.op_type == "Transpose" else None
    for node in graph:
        if node.op_type != "Gather" or node.inputs[0] is None:
            continue
        t = node.inputs[0]
        if table is not None and t is table:
            return node.name, t.name or ""
        if table is None and t.const_value is not None and w_val.const_value is not None:
            e, w = t.const_value, w_val.const_value
            if tuple(e.shape) == tuple(reversed(w.shape)) and np.array_equal(e.numpy().T, w.numpy()):
                return node.name, t.name or ""
    return None, ""


def select_weight_only(model: ir.Model, rec: RecipeModel | PrecisionPlan) -> dict[str, WOQLayer]:
    """The MatMul layers that the plan (or recipe) puts in a weight-only format, in graph order."""
    plan = as_plan(rec)
    out: dict[str, WOQLayer] = {}
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        lp = layer_plan(plan, node)
        if lp.format not in WEIGHT_ONLY_FORMATS:
            continue
        w_val = node.inputs[1]
        tied, table = (None, "")
        if w_val is not None and constant_array(w_val) is None and w_val.producer() is not None:
            tied, table = _tied_gather(model.graph, w_val)  # lm_head = MatMul(x, Transpose(E))
        elif w_val is not None:
            tied, table = _tied_gather(model.graph, w_val)
        if tied is None and _weighted_ok(node) is not None:
            continue
        w = constant_array(w_val) if tied is None or constant_array(w_val) is not None else None
        if w is None:
            e = constant_array(model.graph.initializers.get(table))
            if e is None:
                continue
            K, N = int(e.shape[1]), int(e.shape[0])
        else:
            K, N = int(w.shape[0]), int(w.shape[1])
        x = node.inputs[0]
        out[node.name or ""] = WOQLayer(node.name or "", lp, x.name or "" if x is not None else "",
                                        w_val.name or "" if w_val is not None else "", K, N, tied_gather=tied)
    return out


def weight_of(model: ir.Model, layer: WOQLayer) -> np.ndarray:
    """``W [K, N]`` of a layer (the transposed embedding table for a tied lm_head)."""
    v = model.graph.initializers.get(layer.weight)
    if v is not None and v.const_value is not None:
        return np.asarray(v.const_value.numpy(), np.float32)
    for node in model.graph:
        if node.name == layer.tied_gather:
            e = constant_array(node.inputs[0])
            if e is not None:
                return np.ascontiguousarray(e.T, dtype=np.float32)
    raise UnsupportedOpError(f"layer {layer.name!r}: cannot find its weight {layer.weight!r}")


def assign_stages(model: ir.Model, layers: dict[str, WOQLayer], max_stages: int) -> int:
    """Dependency levels of the layers (a layer's level is 1 + the highest level of a layer
    upstream of its input), grouped into at most ``max_stages`` consecutive stages."""
    # the graph is topologically sorted (prep); lv(v) = max lv(inputs) + 1 if the producer is a layer
    lv: dict[str, int] = {}
    for node in model.graph:
        base = max((lv.get(i.name or "", 0) for i in node.inputs if i is not None), default=0)
        here = base + (1 if (node.name or "") in layers else 0)
        for o in node.outputs:
            if o.name:
                lv[o.name] = here
    levels = {name: lv.get(layer.input, 0) for name, layer in layers.items()}
    distinct = sorted(set(levels.values()))
    per_stage = max(1, -(-len(distinct) // max(1, max_stages)))
    stage_of_level = {lv: i // per_stage for i, lv in enumerate(distinct)}
    for name, layer in layers.items():
        layer.stage = stage_of_level[levels[name]]
    return max(stage_of_level.values(), default=-1) + 1


def _weights_as_inputs(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``proto`` whose initializers ``names`` are graph inputs instead (fed per pass)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    keep = []
    wanted = set(names)
    for init in m.graph.initializer:
        if init.name in wanted:
            m.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            keep.append(init)
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    return m


def _stats_pass(
    session: ort.InferenceSession,
    dataset: Any,
    inputs: dict[str, int],
    weights: dict[str, np.ndarray],
    max_rows: int,
    desc: str,
    progress: bool,
) -> dict[str, LayerStats]:
    stats = {t: LayerStats(k, max_rows=max_rows) for t, k in inputs.items()}
    names = list(inputs)
    with tqdm(total=len(dataset), desc=desc, unit="window", disable=not progress, leave=False) as bar:
        for feed in _batches(dataset):
            outs = session.run(names, {**feed, **weights})
            for t, x in zip(names, outs, strict=True):
                stats[t].update(x)
            bar.update(next(iter(feed.values())).shape[0])
    return stats


def _batches(dataset: Any) -> Iterator[dict[str, np.ndarray]]:
    yield from dataset.batches(1)


def quantize_weights(
    model: ir.Model,
    rec: RecipeModel,
    layers: dict[str, WOQLayer],
    dataset: Any | None,
    *,
    progress: bool = True,
) -> WOQOutcome:
    """Choose the quantized weights of ``layers`` (no graph edits)."""
    outcome = WOQOutcome(layers, {})
    t0 = time.perf_counter()
    needs_stats = any(lay.plan.algorithm in STATS_ALGORITHMS for lay in layers.values())
    if needs_stats and dataset is None:
        raise DataError("GPTQ/AWQ need calibration data: set calibration.data or pass calibration_data")
    n_stages = assign_stages(model, layers, 10**6 if rec.calibration.sequential else 1) if needs_stats else 1
    if needs_stats and rec.calibration.sequential:
        # group dependency levels into at most calibration.stages passes over the data
        n_stages = assign_stages(model, layers, rec.calibration.stages)
    weights = {name: weight_of(model, lay) for name, lay in layers.items()}
    session = None
    feedable = [lay.weight for lay in layers.values() if lay.tied_gather is None]
    if needs_stats:
        proto = ir.to_proto(model)
        calib = _weights_as_inputs(proto, feedable if rec.calibration.sequential else [])
        have = {o.name for o in calib.graph.output}
        for lay in layers.values():
            if lay.input not in have:
                calib.graph.output.append(onnx.helper.make_empty_tensor_value_info(lay.input))
                have.add(lay.input)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        session = ort.InferenceSession(calib.SerializeToString(), so, providers=["CPUExecutionProvider"])
        del calib, proto
    current = {lay.weight: weights[name] for name, lay in layers.items() if lay.tied_gather is None}
    stage_bar = tqdm(range(n_stages), desc="quantize weights", unit="stage", disable=not progress)
    for stage in stage_bar:
        members = {n: lay for n, lay in layers.items() if lay.stage == stage}
        stats: dict[str, LayerStats] = {}
        if session is not None and any(m.plan.algorithm in STATS_ALGORITHMS for m in members.values()):
            ins = {m.input: m.K for m in members.values() if m.plan.algorithm in STATS_ALGORITHMS}
            feeds = {k: v for k, v in current.items()} if rec.calibration.sequential else {}
            stats = _stats_pass(session, dataset, ins, feeds, rec.calibration.max_rows,
                                f"statistics {stage + 1}/{n_stages}", progress)
        # AWQ layers reading one input share one scale
        groups: dict[tuple[str, int, int | None, bool], list[str]] = {}
        for n, m in members.items():
            if m.plan.algorithm == "awq" and m.tied_gather is None:
                groups.setdefault((m.input, m.bits, m.plan.group_size, m.plan.weight_symmetric), []).append(n)
        done: set[str] = set()
        from quantkit.algorithms.awq import awq_shared

        for (inp, bits, g, sym), names in groups.items():
            opts: dict[str, Any] = dict(members[names[0]].plan.algorithm_options)
            res_list = awq_shared([weights[n] for n in names], stats.get(inp), bits=bits, group_size=g,
                                  symmetric=sym, **opts)
            for n, r in zip(names, res_list, strict=True):
                outcome.results[n] = r
                done.add(n)
        for n, m in members.items():
            if n in done:
                continue
            algo = m.plan.algorithm
            if algo == "awq":  # a tied lm_head cannot take an input scale (the Gather shares the table)
                algo = "gptq" if m.input in stats else "rtn"
                outcome.notes[n] = f"tied with embedding: awq -> {algo} (an input scale cannot be shared with the Gather)"
            fn = get_weight_algorithm(algo)
            opts = dict(m.plan.algorithm_options) if algo == m.plan.algorithm else {}
            outcome.results[n] = fn(weights[n], bits=m.bits, group_size=m.plan.group_size,
                                    symmetric=m.plan.weight_symmetric, stats=stats.get(m.input), **opts)
        for n, m in members.items():
            # the quantized weight feeds the next stages' statistics (sequential); without a statistics session
            # (RTN alone) nothing reads it - not kept (a float32 copy of every weight)
            if m.tied_gather is None and session is not None and rec.calibration.sequential:
                current[m.weight] = outcome.results[n].effective_weight().astype(np.float32)
            row = _layer_row(m, weights[n], outcome.results[n], stats.get(m.input), outcome.notes.get(n, ""))
            outcome.rows.append(row)
    outcome.timings["weights_s"] = time.perf_counter() - t0
    return outcome


def _layer_row(m: WOQLayer, w: np.ndarray, res: WOQResult, stats: LayerStats | None, note: str) -> dict[str, Any]:
    w_hat = res.effective_weight()
    err = float(np.linalg.norm(w - w_hat)) / max(float(np.linalg.norm(w)), 1e-30)
    row: dict[str, Any] = {
        "layer": m.name, "format": m.plan.format, "algorithm": m.plan.algorithm if not note else note,
        "bits": res.bits, "group_size": res.group_size, "symmetric": res.symmetric, "K": m.K, "N": m.N,
        "weight_rel_error": err, "awq_scaled": res.input_scale is not None, "tied": m.tied_gather is not None,
        "stage": m.stage,
    }
    if stats is not None and stats.count:
        H = stats.hessian(np.float32)  # dB figures: float32 is plenty (twice as fast on a wide layer)
        d = (w - w_hat).astype(np.float64)
        num = quadratic_form(H, w)  # tr(Wᵀ H W) = E‖xW‖²
        den = quadratic_form(H, d)  # E‖x(W - Ŵ)‖²
        row["output_sqnr_db"] = float("inf") if den <= 0 else float(10 * np.log10(max(num, 1e-300) / den))
    return row


def lower_weight_only(model: ir.Model, rec: RecipeModel, outcome: WOQOutcome) -> list[str]:
    """Edit ``model`` in place: every quantized layer becomes MatMulNBits (or DQ -> MatMul)."""
    from quantkit.int4_kernel import build_level
    from quantkit.lowering.nbits import (
        apply_input_scale,
        lower_dq_matmul,
        lower_matmul_nbits,
        lower_tied_embedding,
    )

    lowered = []
    form = rec.export.weight_only_form
    acc = build_level(rec.export.accuracy_level)  # auto: built at 4, the shipped level is chosen after (int4_kernel)
    # shared AWQ scales: fold once per shared input
    by_input: dict[tuple[str, bytes], list[str]] = {}
    for n, res in outcome.results.items():
        if res.input_scale is not None:
            by_input.setdefault((outcome.layers[n].input, res.input_scale.tobytes()), []).append(n)
    shared = set()
    for (_, _), names in by_input.items():
        if len(names) > 1:
            apply_input_scale(model, names, outcome.results[names[0]].input_scale)  # type: ignore[arg-type]
            shared.update(names)
    for n, lay in outcome.layers.items():
        res = outcome.results[n]
        if lay.tied_gather is not None:
            if form != "matmulnbits":
                raise UnsupportedOpError(
                    f"layer {n!r}: a tied embedding is stored once only as MatMulNBits + GatherBlockQuantized "
                    f"(form {form!r}); allowed: export.weight_only_form matmulnbits, or keep the lm_head fp32 "
                    "with an override"
                )
            lower_tied_embedding(model, lay.tied_gather, n, res, accuracy_level=acc)
        elif form == "matmulnbits":
            lower_matmul_nbits(model, n, res, accuracy_level=acc, apply_scale=n not in shared)
        else:
            lower_dq_matmul(model, n, res, apply_scale=n not in shared)
        lowered.append(n)
    return lowered
