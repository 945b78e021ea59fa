"""Format handlers: one per family of precision formats, registered by name.

=============  ==================  ===============================================  ============================
handler        formats             needs (statistics)                               lowers to (ONNX Runtime CPU)
=============  ==================  ===============================================  ============================
``static``     int8                activation histograms; input means; kernel-      QDQ -> QLinearConv / QGemm /
                                   order Σxᵀx (pair-safe targets)                   MatMulIntegerToFloat, int8 glue
``weight_only`` int4, int8_weight  Σxᵀx + row sample (GPTQ / AWQ); none (RTN)        MatMulNBits, GatherBlockQuantized
``dynamic``    int8_dynamic        per-channel max|x| + row sample (SmoothQuant)    DynamicQuantizeLinear +
                                                                                    MatMulIntegerToFloat
``float16``    fp16, bf16          nothing                                          16-bit weight + Cast
``float32``    fp32                nothing                                          unchanged
=============  ==================  ===============================================  ============================

A :class:`~quantkit.recipe.plan.PrecisionPlan` assigns every layer one format; :func:`lower_plan` runs the
handlers over it (see :mod:`quantkit.formats.execute`).  :data:`FORMAT_HANDLERS` is the one list of
format names: the recipe schema's ``Format`` is checked against it by a test.
"""

from __future__ import annotations

from quantkit.formats.base import Artifacts, FormatHandler, Job, Lowered
from quantkit.formats.dynamic import DynamicInt8
from quantkit.formats.execute import LAYER_OPS, LINEAR_ONLY_FORMATS, lower_plan, prepare_float
from quantkit.formats.float16 import Float16, Float32
from quantkit.formats.static_int8 import StaticInt8
from quantkit.formats.weight_only import WeightOnly

__all__ = [
    "FORMAT_HANDLERS", "LAYER_OPS", "LINEAR_ONLY_FORMATS", "Artifacts", "FormatHandler", "Job", "Lowered", "family_of",
    "handler_for", "handlers", "lower_plan", "prepare_float",
]

FORMAT_HANDLERS: dict[str, FormatHandler] = {
    h.name: h for h in (StaticInt8(), WeightOnly(), DynamicInt8(), Float16(), Float32())
}
"""Handlers by name, in lowering order (static INT8 first: it places Q/DQ on the float graph)."""


def handlers() -> list[FormatHandler]:
    return list(FORMAT_HANDLERS.values())


def handler_for(fmt: str) -> FormatHandler:
    """The handler of format ``fmt`` (else :class:`~quantkit.errors.RecipeError` listing the formats)."""
    for h in FORMAT_HANDLERS.values():
        if fmt in h.formats:
            return h
    from quantkit.errors import RecipeError

    raise RecipeError(f"unknown format {fmt!r}; allowed: {', '.join(all_formats())}")


def all_formats() -> list[str]:
    return [f for h in FORMAT_HANDLERS.values() for f in h.formats]


def family_of(fmt: str) -> str:
    return handler_for(fmt).family
