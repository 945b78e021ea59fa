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
``pattern`` / ``op_type``) are *pinned*: they take the override's format in every point (e.g.
the tied lm_head / embedding at int8_weight) and are not searched.

:class:`LinearSpace` computes each (unit, candidate) artifact once (weight codes, smoothing
scales), knows its exact size in bytes, its effective float weight (for sensitivity), and emits
the ONNX model of any assignment.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.errors import RecipeError, UnsupportedOpError
from quantkit.lowering.select import constant_array, recipe_op_type
from quantkit.recipe.schema import Candidate, RecipeModel

log = logging.getLogger("quantkit")

__all__ = ["LinearLayer", "LinearSpace", "Unit", "find_linear_layers", "make_units", "weight_only_bytes"]

WEIGHT_ONLY = ("int4", "int8_weight")
LINEAR_FORMATS = ("fp32", "fp16", "bf16", "int8_dynamic", "int8_weight", "int4")


@dataclass(frozen=True)
class LinearLayer:
    name: str
    input: str
    weight: str
    K: int
    N: int


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


def find_linear_layers(model: ir.Model, rec: RecipeModel) -> tuple[dict[str, LinearLayer], list[str]]:
    """``(searched layers, pinned layer names)`` in graph order.

    Searched: default-domain ``MatMul`` nodes with a constant 2-D float weight that no override
    names and that match ``search.layers`` (when set).  Pinned: those an override names."""
    from quantkit.recipe.plan import resolve_layer

    pattern = re.compile(rec.search.layers) if rec.search is not None and rec.search.layers else None
    out: dict[str, LinearLayer] = {}
    pinned: list[str] = []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or not node.name:
            continue
        lp = resolve_layer(rec, node.name, recipe_op_type(node))
        if lp.rule != "default":
            pinned.append(node.name)
            continue
        w = constant_array(node.inputs[1])
        x = node.inputs[0]
        if w is None or w.ndim != 2 or w.dtype.kind != "f" or x is None or node.inputs[1] is None:
            continue
        if pattern is not None and not pattern.search(node.name):
            continue
        out[node.name] = LinearLayer(
            node.name, x.name or "", node.inputs[1].name or "", int(w.shape[0]), int(w.shape[1])
        )
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
class _Int8Artifact:
    s: np.ndarray | None
    alpha: float | None
    codes: dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass
class LinearSpace:
    """Units, candidates and the cached per-(unit, candidate) artifacts of one float model."""

    model: ir.Model
    rec: RecipeModel
    candidates: dict[str, Candidate]
    layers: dict[str, LinearLayer]
    units: list[Unit]
    pinned: list[str]
    calibration: Any = None
    progress: bool = True
    _weights: dict[str, np.ndarray] = field(default_factory=dict)
    _woq: dict[str, dict[str, Any]] = field(default_factory=dict)  # candidate -> layer -> WOQResult
    _int8: dict[tuple[str, str], _Int8Artifact] = field(default_factory=dict)
    _absmax: dict[str, Any] | None = None
    _pinned_outcome: Any = None

    @classmethod
    def build(
        cls, model: ir.Model, rec: RecipeModel, calibration: Any, *, progress: bool = True
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
        sp = cls(model, rec, cands, layers, units, pinned, calibration, progress)
        for n, lay in layers.items():
            w = constant_array(model.graph.initializers.get(lay.weight))
            if w is None:
                raise UnsupportedOpError(f"layer {n!r}: weight {lay.weight!r} is not an initializer")
            sp._weights[n] = np.asarray(w, np.float32)
        return sp

    # -- artifacts ------------------------------------------------------------------------------
    def weight(self, layer: str) -> np.ndarray:
        return self._weights[layer]

    def _group_size(self, c: Candidate) -> int | None:
        if c.per_channel:
            return None
        return c.group_size if c.group_size is not None else self.rec.quantization.default.group_size

    def woq_results(self, cand: str) -> dict[str, Any]:
        """``layer -> WOQResult`` of a weight-only candidate over all searched layers (computed once;
        GPTQ/AWQ statistics come from the calibration data, sequential as the recipe says)."""
        if cand in self._woq:
            return self._woq[cand]
        from quantkit.recipe import load_recipe
        from quantkit.weight_only import quantize_weights, select_weight_only

        c = self.candidates[cand]
        d = self.rec.quantization.default
        scheme = {
            "format": c.format,
            "group_size": self._group_size(c),
            "weights": d.weights.model_dump(),
            "algorithm": c.algorithm or d.algorithm,
            "algorithm_options": dict(
                c.algorithm_options
                if c.algorithm_options is not None
                else (d.algorithm_options if (c.algorithm or d.algorithm) == d.algorithm else {})
            ),
        }
        rec_c = load_recipe(
            {
                "version": 1,
                "calibration": self.rec.calibration.model_dump(),
                "quantization": {"default": scheme},
            }
        )
        wl = {n: lay for n, lay in select_weight_only(self.model, rec_c).items() if n in self.layers}
        outcome = quantize_weights(self.model, rec_c, wl, self.calibration, progress=self.progress)
        self._woq[cand] = outcome.results
        return outcome.results

    def _absmax_stats(self) -> dict[str, Any]:
        if self._absmax is None:
            from quantkit.algorithms.smoothquant import ChannelAbsMax
            from quantkit.calibrate.cache import StatsCache, cache_key, model_hash
            from quantkit.calibrate.gather import Request, gather
            from quantkit.frontends.cache import cache_dir

            proto = ir.to_proto(self.model)
            inputs = sorted({u.input for u in self.units})
            reqs = {f"{t}//absmax": Request(t, ChannelAbsMax, ChannelAbsMax.from_state) for t in inputs}
            cache = None
            if self.rec.calibration.cache and self.calibration is not None:
                key = cache_key(
                    model_hash(proto.SerializeToString()),
                    self.calibration.fingerprint(),
                    {"statistic": "channel-absmax", "rows": 256},
                )
                cache = StatsCache(cache_dir(), key)
            got = gather(
                proto,
                self.calibration,
                reqs,
                cache=cache,
                batch_size=1,
                max_batch_output_bytes=self.rec.calibration.max_batch_output_bytes,
                progress=self.progress,
            )
            self._absmax = {t: got.collectors[f"{t}//absmax"] for t in inputs}
        return self._absmax

    def int8_artifact(self, unit: Unit, cand: str) -> _Int8Artifact:
        """Smoothing scale (shared by the unit) and int8 codes of an int8_dynamic candidate."""
        key = (unit.name, cand)
        if key not in self._int8:
            from quantkit.algorithms.smoothquant import choose_alpha, int8_weight_per_column
            from quantkit.scheme.target import resolve_target

            c = self.candidates[cand]
            ws = [self._weights[n] for n in unit.layers]
            safe = resolve_target(self.rec.target.isa, self.rec.target.device).pair_safe
            s, alpha = None, None
            if c.smoothquant is not None:
                st = self._absmax_stats()[unit.input]
                # alpha is chosen on plain codes (pair-safe rounding moves the error by far less than alpha
                # does, and costs a scale search per try); the final codes below are pair-safe
                s, alpha, _ = choose_alpha(st, ws, c.smoothquant, per_token=c.granularity == "per_token")
            codes = {}
            for n, w in zip(unit.layers, ws, strict=True):
                codes[n] = int8_weight_per_column(w if s is None else w * s[:, None], pair_safe=safe)
            self._int8[key] = _Int8Artifact(s, alpha, codes)
        return self._int8[key]

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
            res = self.woq_results(cand)
            return {n: res[n].effective_weight() for n in unit.layers}
        return None

    def unit_bytes(self, unit: Unit, cand: str) -> int:
        """Bytes the unit's weights take in the emitted file under ``cand``."""
        c = self.candidates[cand] if cand in self.candidates else Candidate(name=cand, format="fp32")
        total = 0
        for n in unit.layers:
            lay = self.layers[n]
            K, N = lay.K, lay.N
            if c.format == "fp32":
                total += 4 * K * N
            elif c.format in ("fp16", "bf16"):
                total += 2 * K * N
            elif c.format == "int8_dynamic":
                total += K * N + 4 * N
            else:
                bits = 4 if c.format == "int4" else 8
                g = self._group_size(c) or K
                total += weight_only_bytes(K, N, bits, g, self.rec.quantization.default.weights.symmetric)
        if c.format == "int8_dynamic" and c.smoothquant is not None:
            art = self.int8_artifact(unit, cand)
            if art.s is not None and not self._foldable(unit):
                total += 4 * self.layers[unit.layers[0]].K  # an explicit Mul(x, 1/s)
        return total

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

    # -- pinned layers -----------------------------------------------------------------------------
    def pinned_outcome(self) -> Any:
        """Weight-only results of the pinned layers the recipe resolves to int4 / int8_weight."""
        if self._pinned_outcome is None:
            from quantkit.weight_only import quantize_weights, select_weight_only

            wl = {n: lay for n, lay in select_weight_only(self.model, self.rec).items() if n in self.pinned}
            self._pinned_outcome = quantize_weights(
                self.model, self.rec, wl, self.calibration, progress=False
            )
        return self._pinned_outcome

    # -- emission --------------------------------------------------------------------------------
    def emit(self, assignment: dict[str, str]) -> ir.Model:
        """The ONNX model of ``assignment`` (unit name -> candidate name); pinned layers as the recipe says."""
        from quantkit.lowering.cast import lower_cast, merge_casts
        from quantkit.lowering.dynamic import lower_int8_dynamic
        from quantkit.lowering.nbits import apply_input_scale, lower_matmul_nbits
        from quantkit.weight_only import lower_weight_only

        unknown = sorted(set(assignment) - {u.name for u in self.units})
        if unknown:
            raise RecipeError(f"assignment names unknown units {unknown[:5]}")
        m = ir.from_proto(ir.to_proto(self.model))
        pinned = self.pinned_outcome()
        if pinned.layers:
            lower_weight_only(m, self.rec, pinned)
        acc = self.rec.export.accuracy_level
        for unit in self.units:
            cand = assignment.get(unit.name, "fp32")  # fp32 (keep) is always allowed
            if cand not in self.candidates and cand != "fp32":
                raise RecipeError(
                    f"unit {unit.name!r}: unknown candidate {cand!r}; allowed: {sorted(self.candidates)}"
                )
            c = self.candidates.get(cand)
            fmt = c.format if c is not None else "fp32"
            if fmt == "fp32":
                continue
            if fmt in ("fp16", "bf16"):
                for n in unit.layers:
                    lower_cast(m, n, fmt, compute=c.compute if c is not None else "storage")
            elif fmt == "int8_dynamic":
                art = self.int8_artifact(unit, cand)
                if art.s is not None:
                    apply_input_scale(m, list(unit.layers), art.s)
                for n in unit.layers:
                    q, sc = art.codes[n]
                    lower_int8_dynamic(
                        m, n, q, sc, granularity=c.granularity if c is not None else "per_token"
                    )
            else:
                res = self.woq_results(cand)
                scaled = [n for n in unit.layers if res[n].input_scale is not None]
                if len(scaled) > 1:
                    apply_input_scale(m, scaled, res[scaled[0]].input_scale)
                for n in unit.layers:
                    lower_matmul_nbits(m, n, res[n], accuracy_level=acc, apply_scale=len(scaled) <= 1)
        merge_casts(m)
        return m

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
                if c is not None and c.format == "int8_dynamic" and (u.name, cand) in self._int8:
                    row["smoothquant_alpha"] = self._int8[(u.name, cand)].alpha
                rows.append(row)
        return rows
