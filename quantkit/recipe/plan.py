"""The precision plan: what every layer becomes (format, scheme, algorithm, options).

:class:`LayerPlan` is one layer's entry; :class:`PrecisionPlan` is the frozen plan of a model.  Recipe
overrides and the search both produce a plan; the pipeline executes any plan the same way (one
statistics pass per kind of statistic the plan's format handlers need, one lowering walk, one report):

* :meth:`PrecisionPlan.from_recipe`: the recipe's default and overrides, resolved per node.
  Resolution order (first hit wins): an override naming the node exactly (``layer``), then the first
  override whose ``pattern`` regex matches the node name **or its module path** (``re.search`` semantics, run with a
  time limit by :func:`quantkit.recipe.patterns.pattern_search`: a runaway match is a ``RecipeError``; the
  module path is the PyTorch module a node was exported from, e.g. ``encoder.layer.0.intermediate.dense``
  for the exporter's ``node_MatMul_119``), then the first override naming the node's ``op_type``, then
  the default.  Fields an override leaves unset are inherited from the default.
* :meth:`PrecisionPlan.choose`: the search's decisions on top (layer -> candidate), a new frozen plan;
  nothing is edited in the recipe and nothing is re-validated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from quantkit.recipe.patterns import pattern_search
from quantkit.recipe.schema import (
    ActivationScheme,
    Candidate,
    LayerScheme,
    Override,
    RecipeModel,
    WeightScheme,
)


@dataclass(frozen=True)
class LayerPlan:
    """What one layer (ONNX node) will become."""

    layer: str
    op_type: str
    format: str  # "int8" | "fp32"
    weight_dtype: str
    weight_symmetric: bool
    weight_granularity: str  # "channel" | "tensor"
    act_dtype: str
    act_symmetric: bool
    calibrator: str
    rule: str
    group_size: int | None = 128
    algorithm: str = "rtn"
    algorithm_options: tuple[tuple[str, object], ...] = ()
    smoothquant: float | str = "auto"  # int8_dynamic: alpha, "auto" or "off"
    granularity: str = "per_token"  # int8_dynamic: "per_token" | "per_tensor"
    compute: str = "storage"  # fp16 / bf16: "storage" | "native"
    hot_rows: int = 0  # an int4 lm_head / embedding: its most frequent vocabulary rows also at 8 bits (layer-wise)
    # ``rule``: which recipe rule decided: "default", "layer:<name>", "pattern:<re>", "op_type:<op>", or
    # "search:<candidate>" when the search chose it


def _pick(recipe: RecipeModel, layer: str, op_type: str, module: str | None = None) -> tuple[Override | None, str]:
    ovs = recipe.quantization.overrides
    for ov in ovs:
        if ov.layer is not None and ov.layer == layer:
            return ov, f"layer:{ov.layer}"
    for ov in ovs:  # a layer: naming the node's PyTorch module (an exporter named the node node_MatMul_98)
        if ov.layer is not None and module is not None and ov.layer == module:
            return ov, f"layer:{ov.layer}"
    for i, ov in enumerate(ovs):
        if ov.pattern is None:
            continue
        where = f"quantization.overrides[{i}].pattern"
        if pattern_search(ov.pattern, layer, where) or (module and pattern_search(ov.pattern, module, where)):
            return ov, f"pattern:{ov.pattern}"
    for ov in ovs:
        if ov.op_type is not None and ov.op_type == op_type:
            return ov, f"op_type:{ov.op_type}"
    return None, "default"


_LAYER_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Gather", "Einsum")
"""Op types whose nodes a hint names as examples of the model's layers."""


def unmatched_overrides(recipe: RecipeModel, nodes: list[tuple[str, str, str | None]]) -> list[str]:
    """One line per override that selects nothing in a graph whose nodes are ``(name, op_type, module path)``:
    a ``layer:`` that is no node's name nor module path, a ``pattern:`` that matches none - a misspelt name would
    otherwise change nothing, silently.  Each line names the override and the closest names of the graph.  (An
    ``op_type:`` the model lacks is not reported: recipes are shared between models.)"""
    import difflib

    out = []
    names = sorted({n for n, _, _ in nodes if n} | {m for _, _, m in nodes if m})
    # the examples shown: the layers' own names (weighted ops) and module paths, not the glue's (/Add_1)
    layers = sorted({n for n, op, _ in nodes if n and op in _LAYER_OPS} | {m for _, op, m in nodes
                                                                             if m and op in _LAYER_OPS})
    shown = ", ".join((layers or names)[:3])
    for i, ov in enumerate(recipe.quantization.overrides):
        where = f"quantization.overrides[{i}]"
        if ov.layer is not None and not any(ov.layer in (n, m) for n, _, m in nodes):
            near = difflib.get_close_matches(ov.layer, names, n=3, cutoff=0.6)
            out.append(f"{where} (layer: {ov.layer}) matches no layer of this model, so it changes nothing"
                       + (f"; did you mean {', '.join(near)}?" if near else
                          f"; its layers are named like {shown}") + " (or use pattern:)")
        elif ov.pattern is not None and not any(pattern_search(ov.pattern, n, f"{where}.pattern")
                                                or (m and pattern_search(ov.pattern, m, f"{where}.pattern"))
                                                for n, _, m in nodes):
            out.append(f"{where} (pattern: {ov.pattern}) matches no layer name or module path of this model, so it "
                       f"changes nothing; its layers are named like {shown}")
    return out


def inapplicable_overrides(recipe: RecipeModel, nodes: list[tuple[str, str, str | None]],
                           layer_ops: Mapping[str, Collection[str]]) -> list[str]:
    """One line per override whose format is lowered on a few op types only (``layer_ops``: format -> op types)
    that decides none of those nodes of the graph (``(name, op_type, module path)`` per node) but decides others:
    those stay as they were - int4 on a Conv, an untied embedding Gather - and the user would not know."""
    decided: dict[int, set[str]] = {}
    for name, op, module in nodes:
        ov, _ = _pick(recipe, name, op, module)
        if ov is not None and ov.format in layer_ops:
            decided.setdefault(id(ov), set()).add(op)
    out = []
    for i, ov in enumerate(recipe.quantization.overrides):
        ops = decided.get(id(ov))
        fits = tuple(layer_ops.get(ov.format or "", ()))
        if ops and not ops & set(fits):
            sel = (f"layer: {ov.layer}" if ov.layer is not None else f"pattern: {ov.pattern}" if ov.pattern is not None
                   else f"op_type: {ov.op_type}")
            out.append(f"quantization.overrides[{i}] ({sel}, format: {ov.format}) selects only {', '.join(sorted(ops))} "
                       f"node(s): {ov.format} applies to {' / '.join(fits)} layers, so they stay as they were")
    return out


def resolve_layer(recipe: RecipeModel, layer: str, op_type: str, module: str | None = None) -> LayerPlan:
    """Resolve the scheme of node ``layer`` (of type ``op_type``, exported from PyTorch module ``module``)."""
    d: LayerScheme = class_default(recipe)
    ov, rule = _pick(recipe, layer, op_type, module)
    w: WeightScheme = (ov.weights if ov and ov.weights else None) or d.weights
    a: ActivationScheme = (ov.activations if ov and ov.activations else None) or d.activations
    fmt = (ov.format if ov and ov.format else None) or d.format
    cal = (ov.calibrator if ov and ov.calibrator else None) or d.calibrator or recipe.calibration.calibrator
    return LayerPlan(
        layer=layer,
        op_type=op_type,
        format=fmt,
        weight_dtype=w.dtype,
        weight_symmetric=w.symmetric,
        weight_granularity=w.granularity,
        act_dtype=a.dtype,
        act_symmetric=a.symmetric,
        calibrator=cal,
        rule=rule,
        group_size=None if (ov and ov.per_channel) else ((ov.group_size if ov and ov.group_size else None) or d.group_size),
        algorithm=(ov.algorithm if ov and ov.algorithm else None) or d.algorithm,
        algorithm_options=tuple(sorted(_algorithm_options(ov, d).items())),
        smoothquant=ov.smoothquant if ov is not None and ov.smoothquant is not None else d.smoothquant,
        granularity=(ov.granularity if ov is not None and ov.granularity else None) or d.granularity,
        compute=(ov.compute if ov is not None and ov.compute else None) or d.compute,
        hot_rows=int(ov.hot_rows or 0) if ov is not None else 0,
    )


def applied_class(recipe: RecipeModel) -> str | None:
    """The CPU class whose ``quantization.by_cpu_class`` entry applies to ``recipe``: the class ``target.isa``
    names (``auto``: the running CPU's), when the recipe has an entry for it; else None."""
    by = recipe.quantization.by_cpu_class
    if not by:
        return None
    from quantkit.scheme.target import resolve_target

    cls = resolve_target(recipe.target.isa, recipe.target.device).cpu_class
    return cls if cls in by else None


def _class_update(recipe: RecipeModel) -> tuple[str, dict[str, Any]] | None:
    """The class of :func:`applied_class` and the default's keys its entry sets; None when no entry applies."""
    cls = applied_class(recipe)
    if cls is None:
        return None
    return cls, {k: v for k, v in recipe.quantization.by_cpu_class[cls] if v is not None}


def class_default(recipe: RecipeModel) -> LayerScheme:
    """``quantization.default`` with the entry of :func:`applied_class` applied (its ``group_size`` / ``weights``
    replace the default's); the default itself when no entry applies."""
    upd = _class_update(recipe)
    return recipe.quantization.default if upd is None else recipe.quantization.default.model_copy(update=upd[1])


def class_section(recipe: RecipeModel) -> dict[str, Any] | None:
    """The report's ``by_cpu_class`` section: the class whose entry applied and what it set; None when none did."""
    upd = _class_update(recipe)
    if upd is None:
        return None
    return {"cpu_class": upd[0], "target_isa": recipe.target.isa,
            **{k: (v.model_dump() if hasattr(v, "model_dump") else v) for k, v in upd[1].items()}}


def _algorithm_options(ov: Override | None, d: LayerScheme) -> dict[str, object]:
    """An override's own options; none when it switches to another algorithm without giving any
    (the default's options belong to the default's algorithm)."""
    if ov is not None and ov.algorithm_options is not None:
        return dict(ov.algorithm_options)
    if ov is not None and ov.algorithm is not None and ov.algorithm != d.algorithm:
        return {}
    return dict(d.algorithm_options)


def overridden(recipe: RecipeModel, layer: str, op_type: str, module: str | None = None) -> bool:
    """Whether a recipe override (not the default) decides ``layer``: such layers are pinned in a search."""
    return _pick(recipe, layer, op_type, module)[0] is not None


def with_candidate(lp: LayerPlan, cand: Candidate, default: LayerScheme) -> LayerPlan:
    """``lp`` turned into search candidate ``cand``: its format, group size and algorithm (the default's
    when the candidate names none; the default's options only for the default's algorithm)."""
    algo = cand.algorithm or default.algorithm
    opts = (cand.algorithm_options if cand.algorithm_options is not None
            else (default.algorithm_options if algo == default.algorithm else {}))
    group = None if cand.per_channel else (cand.group_size if cand.group_size is not None else default.group_size)
    return dataclasses.replace(lp, format=cand.format, group_size=group, algorithm=algo,
                               algorithm_options=tuple(sorted(dict(opts).items())), rule=f"search:{cand.name}",
                               smoothquant="off" if cand.smoothquant is None else cand.smoothquant,
                               granularity=cand.granularity, compute=cand.compute)


@dataclass(frozen=True)
class PrecisionPlan:
    """Frozen layer -> :class:`LayerPlan` of one model: the recipe's resolution plus decided layers.

    ``decided`` holds the layers whose plan was chosen outside the recipe (by the search); every other
    layer resolves from the recipe on demand (:meth:`layer`).  Plans are values: :meth:`choose` returns a
    new plan.
    """

    recipe: RecipeModel
    decided: Mapping[str, LayerPlan] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_recipe(cls, recipe: RecipeModel) -> PrecisionPlan:
        return cls(recipe)

    def layer(self, name: str, op_type: str, module: str | None = None) -> LayerPlan:
        """The plan of node ``name`` (its recipe ``op_type``, its PyTorch ``module`` path when known)."""
        lp = self.decided.get(name)
        return lp if lp is not None else resolve_layer(self.recipe, name, op_type, module)

    def choose(self, layers: Mapping[str, LayerPlan]) -> PrecisionPlan:
        """A new plan with ``layers`` decided (on top of this plan's decisions)."""
        return PrecisionPlan(self.recipe, MappingProxyType({**self.decided, **layers}))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # a mappingproxy does not pickle: a plan goes to a child
        return (_plan, (self.recipe, dict(self.decided)))


def _plan(recipe: RecipeModel, decided: dict[str, LayerPlan]) -> PrecisionPlan:
    return PrecisionPlan(recipe, MappingProxyType(decided))


def as_plan(plan_or_recipe: PrecisionPlan | RecipeModel) -> PrecisionPlan:
    return plan_or_recipe if isinstance(plan_or_recipe, PrecisionPlan) else PrecisionPlan.from_recipe(plan_or_recipe)
