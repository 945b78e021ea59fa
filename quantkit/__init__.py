"""quantkit: post-training quantization to ONNX that ONNX Runtime really fuses.

Public API::

    result = quantkit.quantize(model, calibration_data, recipe)
    result.save("out/")          # model.onnx, report.json, report.md
    result.report                # the report as a dict
    sweep = quantkit.sweep(model, calibration_data, recipe, output="out/")   # mixed-precision front
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quantkit._version import __version__
from quantkit.errors import (
    CalibrationError,
    DataError,
    LoweringError,
    ModelError,
    QuantkitError,
    RecipeError,
    UnknownNameError,
    UnsupportedOpError,
)

if TYPE_CHECKING:
    from quantkit.api import QuantizeResult, quantize
    from quantkit.recipe import RecipeModel, load_recipe
    from quantkit.search.sweep import SweepResult, sweep

__all__ = [
    "CalibrationError",
    "DataError",
    "LoweringError",
    "ModelError",
    "QuantizeResult",
    "QuantkitError",
    "RecipeError",
    "RecipeModel",
    "SweepResult",
    "UnknownNameError",
    "UnsupportedOpError",
    "__version__",
    "load_recipe",
    "quantize",
    "sweep",
]

_LAZY = {
    "quantize": "quantkit.api",
    "QuantizeResult": "quantkit.api",
    "load_recipe": "quantkit.recipe",
    "RecipeModel": "quantkit.recipe",
    "sweep": "quantkit.search.sweep",
    "SweepResult": "quantkit.search.sweep",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import quantkit` stays fast (no onnxruntime/torch import).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
