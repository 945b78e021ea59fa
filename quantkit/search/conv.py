"""The search space of a static-INT8 network (CNNs): each weighted layer is int8 (QDQ) or float.

Candidates: ``int8`` (static W8A8 QDQ as the recipe's default scheme says: per-channel weights,
calibrated activations, bias correction), ``fp32`` (keep), ``fp16`` / ``bf16`` (16-bit weight
storage + Cast; on ONNX Runtime's CPU provider the compute stays FP32).

Unlike linear layers, formats here interact: an int8 layer feeding an int8 layer passes uint8
tensors (the glue ops between them - Add, pooling - run in int8 too), while a boundary between
an int8 and a float layer costs a QuantizeLinear or DequantizeLinear.  The emitted model of an
assignment is therefore lowered as a whole: the recipe plus one ``fp32`` override per float
unit goes through :func:`quantkit.lowering.select.select` (which decides the glue) and
:func:`quantkit.lowering.qdq.lower_int8`; the 16-bit units then get their weight casts.
Ranges come from one cached statistics pass (:func:`quantkit.pipeline.calibrate_ranges`); tensors a
particular mix needs that the all-int8 plan did not quantize are gathered on demand (cached).

:meth:`ConvSpace.edges` gives the solver the boundary cost: for every unit ``v`` whose input is
produced by unit ``u`` (through Relu / Clip / passthrough ops), ``Q`` or ``DQ`` of that tensor
when exactly one of them is int8, timed on this machine per element.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.errors import RecipeError, UnsupportedOpError
from quantkit.lowering.select import constant_array
from quantkit.recipe.schema import Candidate, RecipeModel
from quantkit.scheme.target import resolve_target
from quantkit.search.linear import Unit, search_candidates

log = logging.getLogger("quantkit")

__all__ = ["CONV_FORMATS", "ConvSpace"]

CONV_FORMATS = ("fp32", "fp16", "bf16", "int8")


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
    _ranges: dict[str, Any] = field(default_factory=dict)
    _means: dict[str, np.ndarray] = field(default_factory=dict)
    _hessian_cache: dict[str, np.ndarray] = field(default_factory=dict)
    _pair_cache: dict[tuple[str, bytes], Any] = field(default_factory=dict)
    _proto: Any = None
    _bytes: bytes = b""
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
        import re

        pattern = re.compile(rec.search.layers) if rec.search is not None and rec.search.layers else None
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
            if lp.rule != "default" or (pattern is not None and not pattern.search(name)):
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
        sp._proto = ir.to_proto(model)
        sp._bytes = sp._proto.SerializeToString()
        sp._shapes = shapes
        sp._calibrate(plan)
        return sp

    # -- calibration -------------------------------------------------------------------------------
    def _calibrate(self, plan: Any) -> None:
        from quantkit.pipeline import calibrate_ranges

        missing = {k for k in plan.calibrated_tensors() if k not in self._ranges}
        needs_means = self.rec.quantization.bias_correction and any(k not in self._means for k in plan.layers)
        if not missing and not needs_means:
            return
        ranges, means, _ = calibrate_ranges(
            self.model,
            self._proto,
            self._bytes,
            plan,
            self.calibration,
            self.rec,
            progress=self.progress,
            use_cache=self.use_cache,
        )
        self._ranges.update(ranges)
        if means:
            self._means.update(means)

    def _hessians(self, plan: Any) -> dict[str, Any] | None:
        """Input second moments (kernel K order) for pair-constrained rounding, once per layer."""
        if not resolve_target(self.rec.target.isa, self.rec.target.device).pair_safe:
            return None
        from quantkit.calibrate.kernel_hessian import collect_kernel_hessians
        from quantkit.lowering.qdq import hessian_requests

        cache = self._hessian_cache
        todo = {k: v for k, v in hessian_requests(self.model, plan).items() if k not in cache}
        if todo:
            cache.update(collect_kernel_hessians(
                self._proto, self.calibration, todo, batch_size=self.rec.calibration.batch_size,
                max_batch_output_bytes=self.rec.calibration.max_batch_output_bytes, progress=self.progress))
        return {k: v for k, v in cache.items() if k in plan.layers}

    def _recipe_for(self, float_units: list[str]) -> RecipeModel:
        from quantkit.recipe import load_recipe

        d = self.rec.model_dump()
        d["search"] = None
        d["quantization"]["overrides"] = [{"layer": u, "format": "fp32"} for u in float_units] + list(
            d["quantization"]["overrides"]
        )
        return load_recipe(d)

    # -- emission ----------------------------------------------------------------------------------
    def emit(self, assignment: dict[str, str]) -> ir.Model:
        """The ONNX model of ``assignment`` (unit -> candidate); units not named stay fp32."""
        from quantkit.lowering.cast import lower_cast
        from quantkit.lowering.qdq import lower_int8
        from quantkit.lowering.select import select

        fmt = {}
        for u in self.units:
            cand = assignment.get(u.name, "fp32")
            if cand != "fp32" and cand not in self.candidates:
                raise RecipeError(
                    f"unit {u.name!r}: unknown candidate {cand!r}; allowed: {sorted(self.candidates)}"
                )
            fmt[u.name] = self.candidates[cand].format if cand in self.candidates else "fp32"
        float_units = [u for u, f in fmt.items() if f != "int8"]
        rec_a = self._recipe_for(float_units)
        plan = select(self.model, rec_a)
        self._calibrate(plan)
        m = ir.from_proto(self._proto)
        means = (
            {k: v for k, v in self._means.items() if k in plan.layers}
            if self.rec.quantization.bias_correction
            else None
        )
        lower_int8(
            m,
            plan,
            {k: self._ranges[k] for k in plan.calibrated_tensors()},
            activation_storage=self.rec.export.activation_storage,
            matmul_form=self.rec.export.matmul_form,
            input_means=means,
            target=resolve_target(self.rec.target.isa, self.rec.target.device),
            hessians=self._hessians(plan),
            pair_cache=self._pair_cache,
        )
        for layer, f in fmt.items():
            if f in ("fp16", "bf16"):
                lower_cast(m, layer, f, compute="storage")
        return m

    # -- costs -------------------------------------------------------------------------------------
    def unit_bytes(self, unit: Unit, cand: str) -> int:
        f = self.candidates[cand].format if cand in self.candidates else "fp32"
        lay = self.layers[unit.layers[0]]
        n = int(np.prod(lay.weight_shape))
        bias = 4 * lay.out_channels
        if f == "int8":
            return n + 4 * lay.out_channels + bias  # int8 weights, per-channel scales, int32 bias
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
            for a, ca in self.candidates.items():
                for b, cb in self.candidates.items():
                    if (ca.format == "int8") != (cb.format == "int8"):
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
                    "K": int(np.prod(lay.weight_shape[1:])),
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
