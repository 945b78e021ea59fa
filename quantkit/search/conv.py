"""The search space of a static-INT8 network (CNNs): each weighted layer is int8 (QDQ), float or, for
its linear layers (the classifier), weight-only.

Candidates: ``int8`` (static W8A8 QDQ as the recipe's default scheme says: per-channel weights,
calibrated activations, bias correction), ``fp32`` (keep), ``fp16`` / ``bf16`` (16-bit weight
storage + Cast; on ONNX Runtime's CPU provider the compute stays FP32), and for MatMul / Gemm layers
``int4`` / ``int8_weight`` (MatMulNBits; a Gemm is rewritten as MatMul + Add first, exactly).

Unlike linear layers, formats here interact: an int8 layer feeding an int8 layer passes uint8
tensors (the glue ops between them - Add, pooling - run in int8 too), while a boundary between
an int8 and a float layer costs a QuantizeLinear or DequantizeLinear.  The emitted model of an
assignment is therefore lowered as a whole: the assignment becomes a
:class:`~quantkit.recipe.plan.PrecisionPlan` (:meth:`ConvSpace.plan_of`) that the format handlers
execute (:func:`quantkit.formats.lower_plan`; static INT8 decides the glue ops of its chains), with
one :class:`~quantkit.formats.Artifacts` shared by every point: ranges come from one cached statistics
pass, and tensors a particular mix needs that the all-int8 plan did not quantize are gathered on
demand (cached).

:meth:`ConvSpace.edges` gives the solver the boundary cost: for every unit ``v`` whose input is
produced by unit ``u`` (through Relu / Clip / passthrough ops), ``Q`` or ``DQ`` of that tensor
when exactly one of them is int8, timed on this machine per element.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.errors import RecipeError, UnsupportedOpError
from quantkit.formats import Artifacts, Job, lower_plan
from quantkit.formats.static_int8 import StaticInt8
from quantkit.lowering.select import constant_array, layer_plan
from quantkit.recipe.plan import LayerPlan, PrecisionPlan, class_default, with_candidate
from quantkit.recipe.schema import Candidate, RecipeModel
from quantkit.scheme.target import resolve_target
from quantkit.search.linear import Unit, search_candidates, weight_only_bytes

log = logging.getLogger("quantkit")

__all__ = ["CONV_FORMATS", "ConvSpace"]

CONV_FORMATS = ("fp32", "fp16", "bf16", "int8", "int8_weight", "int4")
LINEAR_ONLY = ("int8_weight", "int4")  # candidates only MatMul / Gemm units can take


@dataclass
class _Layer:
    name: str
    op_type: str
    weight_shape: tuple[int, ...]
    out_channels: int
    flops_per_sample: float
    act_elems: float  # input + output elements per sample
    input: str


@dataclass
class ConvSpace:
    model: ir.Model
    rec: RecipeModel
    candidates: dict[str, Candidate]
    layers: dict[str, _Layer]
    units: list[Unit]
    pinned: list[str]
    calibration: Any
    progress: bool = True
    use_cache: bool = True
    artifacts: Artifacts = field(default_factory=Artifacts)
    _base: dict[str, LayerPlan] = field(default_factory=dict)
    _shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        model: ir.Model,
        rec: RecipeModel,
        calibration: Any,
        *,
        progress: bool = True,
        use_cache: bool = True,
    ) -> ConvSpace:
        from quantkit.lowering.select import select
        from quantkit.ops import WEIGHTED

        cands = search_candidates(rec, CONV_FORMATS, "a static-int8 search (a candidate of format int8) may")
        if rec.quantization.default.format != "int8":
            raise RecipeError(
                f"quantization.default.format is {rec.quantization.default.format!r}: a search with an int8 "
                "candidate takes its int8 scheme from the default; allowed: int8"
            )
        from quantkit.recipe.patterns import pattern_search

        layers_re = rec.search.layers if rec.search is not None and rec.search.layers else None
        if any(c.format in LINEAR_ONLY for c in cands.values()):  # weight-only classifier: Gemm -> MatMul + Add
            from quantkit.prep.gemm_to_matmul import gemm_to_matmul

            precision = PrecisionPlan.from_recipe(rec)
            gemms = {n.name or "" for n in model.graph if n.op_type == "Gemm" and layer_plan(precision, n).rule == "default"}
            if gemms:
                model = ir.from_proto(ir.to_proto(model))
                gemm_to_matmul(model, only=gemms)
        plan = select(model, rec)
        shapes = _infer_shapes(model)
        layers: dict[str, _Layer] = {}
        pinned: list[str] = []
        for node in model.graph:
            name = node.name or ""
            if node.op_type not in WEIGHTED:
                continue
            lp = plan.layers.get(name)
            if lp is None:
                continue
            if lp.rule != "default" or (layers_re is not None and not pattern_search(layers_re, name, "search.layers")):
                pinned.append(name)
                continue
            w = constant_array(node.inputs[1])
            if w is None:
                continue
            out_shape = shapes.get(node.outputs[0].name or "")
            in_shape = shapes.get(node.inputs[0].name or "") if node.inputs[0] is not None else None
            out_ch = (
                int(w.shape[0])
                if node.op_type == "Conv"
                else int(
                    w.shape[-1]
                    if node.op_type == "MatMul"
                    else (w.shape[0] if _trans_b(node) else w.shape[1])
                )
            )
            spatial = float(np.prod(out_shape[2:])) if out_shape and node.op_type == "Conv" else 1.0
            per_out = (
                float(np.prod(w.shape[1:])) if node.op_type == "Conv" else float(w.size / max(out_ch, 1))
            )
            flops = 2.0 * spatial * out_ch * per_out
            act = float(np.prod(in_shape[1:]) if in_shape else 0) + float(
                np.prod(out_shape[1:]) if out_shape else 0
            )
            layers[name] = _Layer(
                name,
                node.op_type,
                tuple(int(d) for d in w.shape),
                out_ch,
                flops,
                act,
                node.inputs[0].name or "" if node.inputs[0] is not None else "",
            )
        if not layers:
            raise UnsupportedOpError(
                "no int8 layer to search in this model (all pinned, or none quantizable)"
            )
        units = [Unit(n, (n,), lay.input) for n, lay in layers.items()]
        sp = cls(model, rec, cands, layers, units, pinned, calibration, progress, use_cache)
        sp._shapes = shapes
        sp._base = {n: plan.layers[n] for n in layers}
        if calibration is not None:
            StaticInt8._calibrate(sp.job(PrecisionPlan.from_recipe(rec)), plan)  # the all-int8 ranges, cached
        return sp

    # -- plans -------------------------------------------------------------------------------------
    def allowed(self, unit: Unit) -> list[str]:
        """Candidates ``unit`` can take: weight-only ones only on MatMul layers (a classifier)."""
        linear = self.layers[unit.name].op_type == "MatMul"
        return [c for c, cand in self.candidates.items() if linear or cand.format not in LINEAR_ONLY]

    def plan_of(self, assignment: dict[str, str]) -> PrecisionPlan:
        """The precision plan of ``assignment`` (unit -> candidate; units not named stay fp32)."""
        decided = {}
        for u in self.units:
            cand = assignment.get(u.name, "fp32")
            c = self.candidates.get(cand)
            if c is None and cand != "fp32":
                raise RecipeError(f"unit {u.name!r}: unknown candidate {cand!r}; allowed: {sorted(self.candidates)}")
            if c is not None and cand not in self.allowed(u):
                raise RecipeError(f"unit {u.name!r}: candidate {cand!r} is not allowed; allowed: {self.allowed(u)}")
            base = self._base[u.name]
            decided[u.name] = (dataclasses.replace(base, format="fp32", rule="search:fp32") if c is None
                               else with_candidate(base, c, class_default(self.rec)))
        return PrecisionPlan.from_recipe(self.rec).choose(decided)

    def job(self, plan: PrecisionPlan) -> Job:
        target = resolve_target(self.rec.target.isa, self.rec.target.device)
        return Job(self.model, plan, self.calibration, target, progress=self.progress, use_cache=self.use_cache,
                   artifacts=self.artifacts)

    # -- emission ----------------------------------------------------------------------------------
    def emit(self, assignment: dict[str, str]) -> ir.Model:
        """The ONNX model of ``assignment`` (unit -> candidate); units not named stay fp32."""
        return lower_plan(self.job(self.plan_of(assignment))).model

    # -- costs -------------------------------------------------------------------------------------
    def unit_bytes(self, unit: Unit, cand: str) -> int:
        f = self.candidates[cand].format if cand in self.candidates else "fp32"
        lay = self.layers[unit.layers[0]]
        n = int(np.prod(lay.weight_shape))
        bias = 4 * lay.out_channels
        if f == "int8":
            return n + 4 * lay.out_channels + bias  # int8 weights, per-channel scales, int32 bias
        if f in LINEAR_ONLY:
            c = self.candidates[cand]
            g = None if c.per_channel else (c.group_size or self.rec.quantization.default.group_size)
            K = int(lay.weight_shape[0])
            return weight_only_bytes(K, lay.out_channels, 4 if f == "int4" else 8, g or K,
                                     self.rec.quantization.default.weights.symmetric) + bias
        if f in ("fp16", "bf16"):
            return 2 * n + bias
        return 4 * n + bias

    def unit_work(self, unit: Unit, rows: int) -> tuple[float, float]:
        lay = self.layers[unit.layers[0]]
        return lay.flops_per_sample * rows, 4.0 * lay.act_elems * rows

    def edges(self, costs: Any) -> list[Any]:
        """Boundary Q/DQ cost between connected units whose int8-ness differs (see the module doc)."""
        from quantkit.search.cost import qdq_ns_per_element
        from quantkit.search.solver import Edge

        rate_ms = qdq_ns_per_element() * 1e-6
        producer: dict[str, ir.Node] = {}
        for n in self.model.graph:
            for o in n.outputs:
                if o.name:
                    producer[o.name] = n
        unit_names = {u.name for u in self.units}
        shapes = self._shapes
        out = []
        for u in self.units:
            v_in = self.layers[u.name].input
            node: ir.Node | None = producer.get(v_in)
            hops = 0
            while (
                node is not None
                and (node.name or "") not in unit_names
                and node.op_type
                in ("Relu", "Clip", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze")
                and hops < 4
            ):
                src = node.inputs[0]
                node = producer.get(src.name or "") if src is not None else None
                hops += 1
            if node is None or (node.name or "") not in unit_names:
                continue
            shp = shapes.get(v_in)
            numel = float(np.prod(shp[1:])) if shp else 0.0
            c = numel * rate_ms
            if c <= 0:
                continue
            pairs = {}
            src_unit = next(w for w in self.units if w.name == (node.name or ""))
            for a in self.allowed(src_unit):
                for b in self.allowed(u):
                    if (self.candidates[a].format == "int8") != (self.candidates[b].format == "int8"):
                        pairs[(a, b)] = c
            out.append(Edge(node.name or "", u.name, "latency_ms", pairs))
        return out

    def assignment_table(self, assignment: dict[str, str]) -> list[dict[str, Any]]:
        rows = []
        for u in self.units:
            cand = assignment.get(u.name, "fp32")
            lay = self.layers[u.name]
            rows.append(
                {
                    "layer": u.name,
                    "unit": u.name,
                    "candidate": cand,
                    "format": self.candidates[cand].format if cand in self.candidates else "fp32",
                    "op_type": lay.op_type,
                    "K": int(lay.weight_shape[0]) if lay.op_type == "MatMul" else int(np.prod(lay.weight_shape[1:])),
                    "N": lay.out_channels,
                }
            )
        return rows


def _trans_b(node: ir.Node) -> bool:
    a = node.attributes.get("transB")
    return a is not None and a.as_int() == 1


def _infer_shapes(model: ir.Model) -> dict[str, tuple[int, ...]]:
    """Static shapes of the model's values (batch taken as 1) via ONNX shape inference."""
    import onnx

    proto = ir.to_proto(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # noqa: BLE001 - shape inference is best effort for FLOP counts only
        inferred = proto
    out: dict[str, tuple[int, ...]] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") or i == 0 for i, d in enumerate(dims)):
            out[vi.name] = tuple([1] + [int(d.dim_value) for d in dims[1:]])
    return out
