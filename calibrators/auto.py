"""``auto``: the range of each candidate calibrator, one of which the run picks by the emitted model's output error.

A tensor's own quantization error (what ``mse`` minimises) is not the model's: clipping a tail that the
following layers amplify can cost more at the output than the coarser grid of the full range, and the other
way round.  Which wins depends on the model, not on the tensor alone - measured on random-weight CNNs of the
conformance zoo: ShuffleNetV2 20.9 dB output SQNR with ``minmax`` ranges against 20.0 with ``mse``, RegNet-Y
8.2 against 8.8.  So ``auto`` holds every candidate's range of the tensor (all from the same statistics of
the one calibration pass), and the static INT8 handler lowers the model once per candidate, runs each on
``samples`` calibration samples with this CPU's fused kernels, and keeps the candidate whose outputs are
closest to FP32 (:func:`quantkit.formats.static_int8.choose_calibrator`).  Every tensor calibrated by
``auto`` moves together: one choice per model, recorded in the report.

:meth:`AutoCalibrator.compute_range` - the range used before the choice, and by code that calls a calibrator
directly - is the first candidate's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from calibrators._common import HistogramCalibrator, check_number
from quantkit.calibrate.base import get_calibrator, register_calibrator
from quantkit.calibrate.stats import TensorStatistics
from quantkit.errors import RecipeError

__all__ = ["AutoCalibrator"]

DEFAULT_CANDIDATES = ("mse", "minmax")


@register_calibrator("auto")
class AutoCalibrator(HistogramCalibrator):
    """Every candidate's range of the tensor; the run keeps the candidate with the least output error."""

    name: ClassVar[str] = "auto"

    def __init__(self, *, axis: int | None = None, dtype: str = "uint8", symmetric: bool = False,
                 candidates: Sequence[str] = DEFAULT_CANDIDATES, samples: int = 16) -> None:
        super().__init__(axis=axis, dtype=dtype, symmetric=symmetric)
        if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
            raise RecipeError(f"auto calibrator: candidates={candidates!r} is not allowed; allowed: a non-empty "
                              f"list of calibrator names, e.g. {list(DEFAULT_CANDIDATES)}")
        names: list[str] = []
        for c in candidates:
            if not isinstance(c, str) or c == "auto":
                raise RecipeError(f"auto calibrator: candidate {c!r} is not allowed; allowed: the name of another "
                                  "calibrator (mse, minmax, percentile, entropy or a registered plug-in)")
            cls = get_calibrator(c)  # UnknownNameError lists the registered names
            if not hasattr(cls, "from_statistics"):
                raise RecipeError(f"auto calibrator: candidate {c!r} cannot work from collected statistics (no "
                                  "from_statistics); allowed: mse, minmax, percentile, entropy")
            if c not in names:
                names.append(c)
        self.candidates = tuple(names)
        self.samples = int(check_number("auto", "samples", samples, integer=True, lo=1, hi=4096,
                                        allowed="an integer in [1, 4096]"))

    def options(self) -> dict[str, Any]:
        return {"candidates": list(self.candidates), "samples": self.samples}

    def ranges_by_candidate(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``candidate -> (lo, hi)``, each computed by that calibrator (default options) from these statistics."""
        out = {}
        for c in self.candidates:
            cal = get_calibrator(c).from_statistics(self.stats, dtype=self.dtype,  # type: ignore[attr-defined]
                                                    symmetric=self.symmetric)
            out[c] = cal.compute_range()
        return out

    def _range(self, stats: TensorStatistics) -> tuple[float, float]:
        cal = get_calibrator(self.candidates[0]).from_statistics(stats, dtype=self.dtype,  # type: ignore[attr-defined]
                                                                 symmetric=self.symmetric)
        lo, hi = cal.compute_range()
        return float(lo), float(hi)
