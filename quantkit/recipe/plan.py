"""Per-layer plans: the recipe's default and overrides resolved for one node.

Resolution order (first hit wins): an override naming the node exactly (``layer``),
then the first override whose ``pattern`` regex matches the node name
(``re.search``), then the first override naming the node's ``op_type``, then the
default.  Fields an override leaves unset are inherited from the default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.recipe.schema import ActivationScheme, LayerScheme, Override, RecipeModel, WeightScheme


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
    algorithm_options: tuple[tuple[str, object], ...] = ()  # which recipe rule decided: "default", "layer:<name>", "pattern:<re>", "op_type:<op>"


def _pick(recipe: RecipeModel, layer: str, op_type: str) -> tuple[Override | None, str]:
    ovs = recipe.quantization.overrides
    for ov in ovs:
        if ov.layer is not None and ov.layer == layer:
            return ov, f"layer:{ov.layer}"
    for ov in ovs:
        if ov.pattern is not None and re.search(ov.pattern, layer):
            return ov, f"pattern:{ov.pattern}"
    for ov in ovs:
        if ov.op_type is not None and ov.op_type == op_type:
            return ov, f"op_type:{ov.op_type}"
    return None, "default"


def resolve_layer(recipe: RecipeModel, layer: str, op_type: str) -> LayerPlan:
    """Resolve the scheme of node ``layer`` (of type ``op_type``) from ``recipe``."""
    d: LayerScheme = recipe.quantization.default
    ov, rule = _pick(recipe, layer, op_type)
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
    )


def _algorithm_options(ov: Override | None, d: LayerScheme) -> dict[str, object]:
    """An override's own options; none when it switches to another algorithm without giving any
    (the default's options belong to the default's algorithm)."""
    if ov is not None and ov.algorithm_options is not None:
        return dict(ov.algorithm_options)
    if ov is not None and ov.algorithm is not None and ov.algorithm != d.algorithm:
        return {}
    return dict(d.algorithm_options)
