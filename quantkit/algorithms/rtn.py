"""Round-to-nearest (RTN) weight-only quantization with min-max group scales.

For each group ``G`` of ``g`` consecutive rows of ``W`` ``[K, N]`` and each column ``n``:

* asymmetric: ``s = (max - min) / (2^b - 1)``, ``z = round(-min / s)`` (range widened to contain 0),
* symmetric: ``s = absmax / (2^(b-1) - 1/2)``, ``z = 2^(b-1)`` (8 for 4 bits),

and ``code = clip(round_half_even(W / s) + z, 0, 2^b - 1)``, so ``|W - W_hat| <= s / 2``.

Symmetric grid: the *full* int4 grid ``[-8, 7]`` with ``s = absmax / 7.5`` (``+absmax``
rounds to 7.5 -> saturates at 7, half a step off; ``-absmax`` is exact at -8) versus the
*narrow* grid ``[-7, 7]`` with ``s = absmax / 7``.  The full grid has a 7 % smaller step and
uses all 16 levels; on Gaussian and on real LLM weights its output error is lower
(``tests/unit/test_woq.py::test_rtn_full_grid_beats_narrow`` pins it), so it is the default;
``narrow=True`` selects the other.  All the scale math is :func:`quantkit.scheme.qparams.group_weight_codes`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quantkit.algorithms.woq import WOQResult, check_weight, register_weight_algorithm, resolve_group_size
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import RecipeError
from quantkit.scheme.qparams import group_weight_codes

__all__ = ["rtn"]


@register_weight_algorithm("rtn")
def rtn(
    W: np.ndarray,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    stats: LayerStats | None = None,
    narrow: bool = False,
    **options: Any,
) -> WOQResult:
    """Round-to-nearest quantization of ``W`` ``[K, N]`` in groups of ``group_size`` rows along K.

    ``stats`` is ignored (RTN is data-free).  ``group_size`` ``None`` / ``-1`` means one
    group of ``K`` (per output channel).
    """
    if options:
        raise RecipeError(f"rtn: unknown options {sorted(options)}; allowed: narrow")
    w = check_weight(W, bits)
    g = resolve_group_size(w.shape[0], group_size)
    scales, codes, zps = group_weight_codes(w, bits, g, symmetric=symmetric, narrow=narrow)
    return WOQResult(codes, scales, zps, bits, g, symmetric)
