"""The search space of linear layers (``MatMul(x, W)`` with a constant ``W [K, N]``): transformers.

Every searched layer takes one candidate format, independently of its neighbours (each
lowering reads and writes float tensors, so no boundary cost arises):

=============  =====================================================  ==========================
format          emitted (ONNX Runtime CPU)                             numeric effect
=============  =====================================================  ==========================
fp32            the float MatMul                                       none
fp16 / bf16     16-bit weight + Cast (storage; :mod:`..lowering.cast`)  W rounded to 16 bits
int8_dynamic    SmoothQuant + per-token (or per-tensor) dynamic int8    W int8 per column, x int8
                (:mod:`..lowering.dynamic`)                            per token at run time
int8_weight     MatMulNBits bits=8                                     W int8 per group
int4            MatMulNBits bits=4 (RTN / GPTQ / AWQ)                  W int4 per group
=============  =====================================================  ==========================

A *unit* is what the solver decides on.  With ``tie: shared_input`` the layers that read the same
tensor (q/k/v, gate/up) form one unit: they then share one SmoothQuant scale, which folds into
the preceding normalization for free.  Layers that a recipe override names (``layer`` /
``pattern`` / ``op_type``) are *pinned*: they take the override's format in every point and are
not searched.  A tied lm_head (``MatMul(h, Transpose(E))`` with ``E`` the embedding table) is a unit
of its own when no override pins it: its candidates are fp32 and the weight-only formats (the table
is then stored once, quantized, for both the ``Gather`` and the ``lm_head``).

An assignment (unit -> candidate) becomes a :class:`~quantkit.recipe.plan.PrecisionPlan`
(:meth:`LinearSpace.plan_of`) that the format handlers execute (:func:`quantkit.formats.lower_plan`),
exactly as ``quantize`` executes a recipe's plan.  The handlers' :class:`~quantkit.formats.Artifacts`
are shared by every point, so each (layer, candidate) artifact (weight codes, smoothing scales) is
computed once; the space also knows each unit's exact size in bytes and its effective float weight
(for sensitivity).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.errors import RecipeError, UnsupportedOpError
from quantkit.formats import Artifacts, Job, lower_plan
from quantkit.formats.dynamic import DynamicArtifact, DynamicInt8
from quantkit.formats.weight_only import WeightOnly
from quantkit.lowering.select import constant_array, layer_plan, recipe_op_type
from quantkit.ops import module_path
from quantkit.recipe.patterns import pattern_search
from quantkit.recipe.plan import LayerPlan, PrecisionPlan, class_default, overridden, with_candidate
from quantkit.recipe.schema import Candidate, RecipeModel
from quantkit.scheme.target import resolve_target

log = logging.getLogger("quantkit")

__all__ = ["LinearLayer", "LinearSpace", "Unit", "find_linear_layers", "make_units", "nearest_allowed",
           "weight_only_bytes"]

WEIGHT_ONLY = ("int4", "int8_weight")
LINEAR_FORMATS = ("fp32", "fp16", "bf16", "int8_dynamic", "int8_weight", "int4")


@dataclass(frozen=True)
class LinearLayer:
    name: str
    input: str
    weight: str  # the initializer of W [K, N]; for a tied lm_head the embedding table E [N, K]
    K: int
    N: int
    tied: str | None = None  # the Gather reading the same table (tied embedding / lm_head)


@dataclass(frozen=True)
class Unit:
    """One decision of the solver: layers that take the same format."""

    name: str
    layers: tuple[str, ...]
    input: str


def search_candidates(rec: RecipeModel, allowed: tuple[str, ...], family: str) -> dict[str, Candidate]:
    """The recipe's candidates by name, checked against the formats a search family can emit."""
    if rec.search is None:
        raise RecipeError("the recipe has no 'search' section")
    cands = {c.name: c for c in rec.search.candidate_list()}
    bad = {n: c.format for n, c in cands.items() if c.format not in allowed}
    if bad:
        raise RecipeError(f"search.candidates {bad}: {family} mix only {list(allowed)}")
    return cands


_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int8_dynamic": 8, "int8_weight": 8, "int4": 4}


def nearest_allowed(cands: dict[str, Candidate], allowed: list[str], cand: str) -> str:
    """``cand`` if allowed, else the allowed candidate closest to it: the most weight bits not above its
    bits, the smallest group on a tie (used to apply a candidate "uniformly" to units that cannot take it,
    e.g. int8_dynamic on a tied lm_head); fp32 when nothing smaller is allowed."""
    if cand in allowed:
        return cand
    bits = _BITS[cands[cand].format] if cand in cands else 32
    pool = [c for c in allowed if c in cands and _BITS[cands[c].format] <= bits]
    if not pool:
        return "fp32"
    return max(pool, key=lambda c: (_BITS[cands[c].format], -(cands[c].group_size or 1 << 20)))


def find_linear_layers(model: ir.Model, rec: RecipeModel) -> tuple[dict[str, LinearLayer], list[str]]:
    """``(searched layers, pinned layer names)`` in graph order.

    Searched: default-domain ``MatMul`` nodes with a constant 2-D float weight (or a tied lm_head) that
    no override names and that match ``search.layers`` (when set).  Pinned: those an override names."""
    from quantkit.weight_only import _tied_gather

    layers_re = rec.search.layers if rec.search is not None and rec.search.layers else None
    out: dict[str, LinearLayer] = {}
    pinned: list[str] = []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or not node.name:
            continue
        x, wv = node.inputs[0], node.inputs[1]
        if x is None or wv is None:
            continue
        w = constant_array(wv)
        tied, table = (None, "") if w is not None else _tied_gather(model.graph, wv)
        if tied is not None:
            e = constant_array(model.graph.initializers.get(table))
            if e is None or e.ndim != 2:
                continue
            K, N, wname = int(e.shape[1]), int(e.shape[0]), table
        elif w is None or w.ndim != 2 or w.dtype.kind != "f":
            continue
        else:
            K, N, wname = int(w.shape[0]), int(w.shape[1]), wv.name or ""
        if overridden(rec, node.name, recipe_op_type(node), module_path(node)):
            pinned.append(node.name)
            continue
        if layers_re is not None and not pattern_search(layers_re, node.name, "search.layers"):
            continue
        out[node.name] = LinearLayer(node.name, x.name or "", wname, K, N, tied=tied)
    return out, pinned


def make_units(layers: dict[str, LinearLayer], tie: str) -> list[Unit]:
    """Group ``layers`` into units (``tie`` "shared_input" or "none"), in graph order."""
    if tie == "none":
        return [Unit(n, (n,), lay.input) for n, lay in layers.items()]
    groups: dict[str, list[str]] = {}
    for n, lay in layers.items():
        groups.setdefault(lay.input, []).append(n)
    return [
        Unit(names[0] if len(names) == 1 else f"{names[0]}+{len(names) - 1}", tuple(names), x)
        for x, names in groups.items()
    ]


_RTN_SLICE_BYTES = 32 << 20
"""float32 bytes of ``W`` rounded at once by :func:`_rtn_effective` (a wider weight goes by column slices)."""


def _rtn_effective(fn: Any, w: np.ndarray, tied: bool, **kw: Any) -> np.ndarray:
    """Round-to-nearest's effective weight of ``w [K, N]`` (``fn`` the registered ``rtn``), by column slices of
    :data:`_RTN_SLICE_BYTES` when ``w`` is wider: RTN's groups run along ``K``, so every output column is rounded
    on its own and the slices give the whole matrix's values bit for bit, without the whole matrix's temporaries
    (~65 MB beside a 49k x 576 lm_head's result).  ``tied`` (``w`` a view of a ``[N, K]`` table): the result is
    built in the table's layout and returned as its ``[K, N]`` view, so the probe feeds it without a transposed
    copy."""
    K, N = (int(d) for d in w.shape)
    step = max(1, _RTN_SLICE_BYTES // (4 * max(K, 1)))
    if not tied and N <= step:
        return fn(w, **kw).effective_weight()
    out = np.empty((N, K) if tied else (K, N), np.float32)
    for j in range(0, N, step):
        e = fn(np.ascontiguousarray(w[:, j : j + step], np.float32), **kw).effective_weight()
        if tied:
            out[j : j + step] = e.T
        else:
            out[:, j : j + step] = e
        del e
    return out.T if tied else out


def _format_bytes(fmt: str, K: int, N: int, group_size: int | None, symmetric: bool) -> int:
    """Bytes of a ``[K, N]`` weight stored in ``fmt`` (``group_size`` None: one group per column)."""
    if fmt in ("fp16", "bf16"):
        return 2 * K * N
    if fmt == "int8_dynamic":
        return K * N + 4 * N
    if fmt in ("int4", "int8_weight"):
        return weight_only_bytes(K, N, 4 if fmt == "int4" else 8, group_size or K, symmetric)
    return 4 * K * N


def weight_only_bytes(K: int, N: int, bits: int, group_size: int, symmetric: bool) -> int:
    """Bytes of a MatMulNBits layer (packed codes + float32 scales + zero points when asymmetric)."""
    from quantkit.algorithms.woq import resolve_group_size

    g = resolve_group_size(K, group_size)
    bs = g if (g >= 16 and g & (g - 1) == 0) else max(16, 1 << (K - 1).bit_length())
    kb = -(-K // bs)
    codes = N * kb * bs * bits // 8
    scales = N * kb * 4
    zp = 0 if symmetric else (N * ((kb + 1) // 2) if bits == 4 else N * kb)
    return codes + scales + zp


@dataclass
class LinearSpace:
    """Units, candidates and the shared artifacts of one float model; assignments become plans."""

    model: ir.Model
    rec: RecipeModel
    candidates: dict[str, Candidate]
    layers: dict[str, LinearLayer]
    units: list[Unit]
    pinned: list[str]
    calibration: Any = None
    progress: bool = True
    use_cache: bool = True
    artifacts: Artifacts = field(default_factory=Artifacts)
    _weights: dict[str, np.ndarray] = field(default_factory=dict)
    _base: dict[str, LayerPlan] = field(default_factory=dict)

    @classmethod
    def build(
        cls, model: ir.Model, rec: RecipeModel, calibration: Any, *, progress: bool = True, use_cache: bool = True
    ) -> LinearSpace:
        cands = search_candidates(rec, LINEAR_FORMATS, "linear (MatMul) layers")
        if any(
            n.op_type == "Gemm" for n in model.graph
        ):  # nn.Linear on 2-D input: Gemm -> MatMul (+ Add), exact
            from quantkit.prep.gemm_to_matmul import gemm_to_matmul

            model = ir.from_proto(ir.to_proto(model))
            gemm_to_matmul(model)
        layers, pinned = find_linear_layers(model, rec)
        if not layers:
            raise UnsupportedOpError(
                "no MatMul layer with a constant weight to search (all pinned or none found)"
            )
        units = make_units(layers, rec.search.tie if rec.search is not None else "shared_input")
        sp = cls(model, rec, cands, layers, units, pinned, calibration, progress, use_cache)
        for u in [u for u in units if not sp.allowed(u)]:  # a tied lm_head without a weight-only candidate
            log.info("unit %s stays as the recipe says: no candidate applies to it", u.name)
            units.remove(u)
            for n in u.layers:
                del layers[n]
            sp.pinned.extend(u.layers)
        plan = PrecisionPlan.from_recipe(rec)
        for node in model.graph:
            if node.name in layers:
                sp._base[node.name] = layer_plan(plan, node)
        for n, lay in layers.items():
            w = constant_array(model.graph.initializers.get(lay.weight))
            if w is None:
                raise UnsupportedOpError(f"layer {n!r}: weight {lay.weight!r} is not an initializer")
            # a tied lm_head's [K, N] weight is a view of the table [N, K] (no 113 MB copy on SmolLM2)
            sp._weights[n] = np.asarray(w, np.float32).T if lay.tied else np.ascontiguousarray(w, np.float32)
        return sp

    # -- plans -------------------------------------------------------------------------------------
    def allowed(self, unit: Unit) -> list[str]:
        """Candidates ``unit`` can take: a tied lm_head only fp32 and the weight-only formats."""
        if any(self.layers[n].tied for n in unit.layers):
            return [c for c, cand in self.candidates.items() if cand.format in ("fp32", *WEIGHT_ONLY)]
        return list(self.candidates)

    def layer_choice(self, layer: str, cand: str) -> LayerPlan:
        """``layer``'s plan entry under candidate ``cand`` ("fp32" always allowed)."""
        base = self._base[layer]
        c = self.candidates.get(cand)
        if c is None:
            if cand != "fp32":
                raise RecipeError(f"layer {layer!r}: unknown candidate {cand!r}; allowed: {sorted(self.candidates)}")
            return dataclasses.replace(base, format="fp32", rule="search:fp32")
        return with_candidate(base, c, class_default(self.rec))

    def plan_of(self, assignment: Mapping[str, str]) -> PrecisionPlan:
        """The precision plan of ``assignment`` (unit name -> candidate; units not named stay fp32); pinned
        layers as the recipe's overrides say."""
        unknown = sorted(set(assignment) - {u.name for u in self.units})
        if unknown:
            raise RecipeError(f"assignment names unknown units {unknown[:5]}")
        decided = {}
        for unit in self.units:
            cand = assignment.get(unit.name, "fp32")
            if cand != "fp32" and cand not in self.allowed(unit):
                raise RecipeError(f"unit {unit.name!r}: candidate {cand!r} is not allowed; allowed: {self.allowed(unit)}")
            decided.update({n: self.layer_choice(n, cand) for n in unit.layers})
        return PrecisionPlan.from_recipe(self.rec).choose(decided)

    def job(self, plan: PrecisionPlan) -> Job:
        target = resolve_target(self.rec.target.isa, self.rec.target.device)
        return Job(self.model, plan, self.calibration, target, progress=self.progress, use_cache=self.use_cache,
                   artifacts=self.artifacts)

    # -- artifacts ------------------------------------------------------------------------------
    def weight(self, layer: str) -> np.ndarray:
        return self._weights[layer]

    def _group_size(self, c: Candidate) -> int | None:
        if c.per_channel:
            return None
        return c.group_size if c.group_size is not None else self.rec.quantization.default.group_size

    def woq_results(self, cand: str) -> dict[str, Any]:
        """``layer -> WOQResult`` of a weight-only candidate over all searched layers that can take it
        (computed once, by the weight-only handler: GPTQ/AWQ statistics from the calibration data,
        sequential as the recipe says)."""
        from quantkit.weight_only import select_weight_only

        names = [n for u in self.units if cand in self.allowed(u) for n in u.layers]
        plan = PrecisionPlan.from_recipe(self.rec).choose({n: self.layer_choice(n, cand) for n in names})
        wl = {n: lay for n, lay in select_weight_only(self.model, plan).items() if n in names}
        return WeightOnly().results(self.job(plan), wl).results

    def int8_artifact(self, unit: Unit, cand: str) -> DynamicArtifact:
        """Smoothing scale (shared by the unit) and int8 codes of an int8_dynamic candidate."""
        from quantkit.formats.dynamic import channel_absmax

        lp = self.layer_choice(unit.layers[0], cand)
        plan = PrecisionPlan.from_recipe(self.rec).choose({n: self.layer_choice(n, cand) for n in unit.layers})
        if lp.smoothquant != "off" and unit.input not in self.artifacts.absmax:  # every unit input in one pass
            channel_absmax(self.job(plan), sorted({u.input for u in self.units if "int8_dynamic" in {
                self.candidates[c].format for c in self.allowed(u)}}))
        weights = {n: self._weights[n] for n in unit.layers}
        return DynamicInt8().artifact(self.job(plan), list(unit.layers), weights, lp.smoothquant, lp.granularity,
                                      unit.input)

    def effective_weights(self, unit: Unit, cand: str) -> dict[str, np.ndarray] | None:
        """What each layer of ``unit`` multiplies by under ``cand`` when that is a pure weight
        change (fp32 / fp16 / bf16 / weight-only), else None (int8_dynamic also quantizes ``x``)."""
        from quantkit.lowering.cast import round_to

        c = self.candidates[cand]
        if c.format == "fp32":
            return {n: self._weights[n] for n in unit.layers}
        if c.format in ("fp16", "bf16"):
            return {n: round_to(self._weights[n], c.format) for n in unit.layers}
        if c.format in WEIGHT_ONLY:
            plans = {n: self.layer_choice(n, cand) for n in unit.layers}
            if all(p.algorithm == "rtn" for p in plans.values()):
                # round-to-nearest needs no statistics: the unit's layers alone, nothing kept (the sensitivity asks
                # once per unit; every layer's codes at once held ~0.3 GB and ~1 GB of temporaries on a 135M model)
                from quantkit.algorithms.woq import get_weight_algorithm

                fn = get_weight_algorithm("rtn")
                return {n: _rtn_effective(fn, self._weights[n], bool(self.layers[n].tied),
                                          bits=4 if p.format == "int4" else 8, group_size=p.group_size,
                                          symmetric=p.weight_symmetric, stats=None, **dict(p.algorithm_options))
                        for n, p in plans.items()}
            res = self.woq_results(cand)
            return {n: res[n].effective_weight() for n in unit.layers}
        return None

    def unit_bytes(self, unit: Unit, cand: str) -> int:
        """Bytes the unit's weights take in the emitted file under ``cand``."""
        c = self.candidates[cand] if cand in self.candidates else Candidate(name=cand, format="fp32")
        total = 0
        for n in unit.layers:
            lay = self.layers[n]
            total += _format_bytes(c.format, lay.K, lay.N, self._group_size(c),
                                   self.rec.quantization.default.weights.symmetric)
        if c.format == "int8_dynamic" and c.smoothquant is not None:
            art = self.int8_artifact(unit, cand)
            if art.s is not None and not self._foldable(unit):
                total += 4 * self.layers[unit.layers[0]].K  # an explicit Mul(x, 1/s)
        return total

    def pinned_bytes(self) -> tuple[int, int]:
        """``(float32 bytes, bytes in their recipe format)`` of the pinned layers' weights (a tied lm_head: the
        table it shares with the embedding, which the emitted model stores once, in the head's format)."""
        plan = PrecisionPlan.from_recipe(self.rec)
        pinned = set(self.pinned)
        f32 = fmt = 0
        for node in self.model.graph:
            if node.name not in pinned or len(node.inputs) < 2 or node.inputs[1] is None:
                continue
            w = node.inputs[1]
            arr = constant_array(w)
            if arr is not None and arr.ndim == 2:
                K, N = arr.shape
            else:  # MatMul(h, Transpose(E)): the table E [N, K]
                prod = w.producer()
                table = constant_array(prod.inputs[0]) if prod is not None and prod.op_type == "Transpose" else None
                if table is None or table.ndim != 2:
                    continue
                N, K = table.shape
            lp = layer_plan(plan, node)
            f32 += 4 * K * N
            fmt += _format_bytes("int8_dynamic" if lp.format == "int8" else lp.format, K, N, lp.group_size,
                                 lp.weight_symmetric)
        return f32, fmt

    def _foldable(self, unit: Unit) -> bool:
        """Whether a SmoothQuant ``1/s`` on the unit's input folds into its producer (a norm or a Mul by a
        constant read only by the unit), as :func:`quantkit.lowering.nbits.apply_input_scale` does."""
        from quantkit.lowering.nbits import _NORMS

        for node in self.model.graph:
            if node.name == unit.layers[0]:
                x = node.inputs[0]
                if x is None or x.is_graph_output() or {u.node.name for u in x.uses()} != set(unit.layers):
                    return False
                prod = x.producer()
                if prod is None:
                    return False
                if prod.op_type in _NORMS:
                    return True
                return prod.op_type == "Mul" and any(constant_array(i) is not None for i in prod.inputs)
        return False

    def unit_work(self, unit: Unit, rows: int) -> tuple[float, float]:
        """``(FLOPs, activation bytes in + out)`` of one call of the unit on ``rows`` rows."""
        flops = float(sum(2 * rows * self.layers[n].K * self.layers[n].N for n in unit.layers))
        act = float(sum(4 * rows * (self.layers[n].K + self.layers[n].N) for n in unit.layers))
        return flops, act

    # -- emission --------------------------------------------------------------------------------
    def emit(self, assignment: dict[str, str]) -> ir.Model:
        """The ONNX model of ``assignment`` (unit name -> candidate name); pinned layers as the recipe says."""
        return lower_plan(self.job(self.plan_of(assignment))).model

    def assignment_table(self, assignment: dict[str, str]) -> list[dict[str, Any]]:
        """Per layer: unit, candidate, format, K, N (for reports)."""
        rows = []
        for u in self.units:
            cand = assignment.get(u.name, "fp32")
            c = self.candidates.get(cand)
            for n in u.layers:
                lay = self.layers[n]
                row: dict[str, Any] = {
                    "layer": n,
                    "unit": u.name,
                    "candidate": cand,
                    "format": c.format if c is not None else "fp32",
                    "K": lay.K,
                    "N": lay.N,
                }
                if c is not None and c.format == "int8_dynamic":
                    row["smoothquant_alpha"] = self.int8_artifact(u, cand).alpha
                rows.append(row)
        return rows
