"""Weight-only quantization (WOQ): the result type and the registry of weight algorithms.

A linear layer is ``y = x @ W`` with ``W`` ``[K, N]`` (K input features).  A weight
algorithm (RTN, GPTQ, AWQ ...) maps ``W`` to a :class:`WOQResult`: unsigned integer
codes on the grid ``[0, 2^bits - 1]``, one float32 scale and one zero point per group
of ``group_size`` consecutive rows along K and per output column::

    W_hat[k, n] = (codes[k, n] - zero_points[k // g, n]) * scales[k // g, n]

(exactly ONNX ``DequantizeLinear(axis=0, block_size=g)`` and ``MatMulNBits``).  For a
symmetric 4-bit grid the zero point is 8 and the signed int4 value ``v`` in ``[-8, 7]`` is
stored as ``code = v + 8``.  When an algorithm rescales input channels (AWQ), the
result carries ``input_scale`` ``s`` ``[K]`` and the layer computes
``y = (x / s) @ W_hat``; :meth:`WOQResult.effective_weight` folds it back.

Algorithms register with :func:`register_weight_algorithm` and have the signature
``fn(W, *, bits, group_size, symmetric, stats, **options) -> WOQResult``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from quantkit.errors import QuantkitError
from quantkit.registry import Registry
from quantkit.scheme.qparams import dequantize

if TYPE_CHECKING:
    from quantkit.calibrate.layer_stats import LayerStats

__all__ = [
    "RESERVED_OPTIONS",
    "WEIGHT_ALGORITHMS",
    "WOQResult",
    "WeightAlgorithm",
    "get_weight_algorithm",
    "register_weight_algorithm",
    "resolve_group_size",
]


@dataclass(frozen=True)
class WOQResult:
    """A weight-only quantized ``[K, N]`` MatMul weight.

    Attributes:
        codes: uint8 ``[K, N]`` in ``[0, 2^bits - 1]`` (unpacked).
        scales: float32 ``[ceil(K / group_size), N]``.
        zero_points: uint8 ``[ceil(K / group_size), N]`` (all ``2^(bits-1)`` when symmetric).
        bits: 4 or 8.
        group_size: rows of K per group (``K`` for one group per column, i.e. per channel).
        symmetric: whether the zero points are the grid middle.
        input_scale: float32 ``[K]`` or ``None``; when set the layer is ``y = (x / s) @ W_hat``.
    """

    codes: npt.NDArray[np.uint8]
    scales: npt.NDArray[np.float32]
    zero_points: npt.NDArray[np.uint8]
    bits: int
    group_size: int
    symmetric: bool
    input_scale: npt.NDArray[np.float32] | None = None

    def __post_init__(self) -> None:
        K, N = self.codes.shape
        kb = -(-K // self.group_size)
        # results also come from third-party registered algorithms: check, with a typed error
        problems = []
        if self.codes.dtype != np.uint8 or int(self.codes.max(initial=0)) >= (1 << self.bits):
            problems.append(f"codes must be uint8 in [0, {(1 << self.bits) - 1}] (dtype {self.codes.dtype})")
        if self.scales.shape != (kb, N) or self.scales.dtype != np.float32:
            problems.append(f"scales must be float32 {(kb, N)} (got {self.scales.dtype} {self.scales.shape})")
        if self.zero_points.shape != (kb, N) or self.zero_points.dtype != np.uint8:
            problems.append(f"zero_points must be uint8 {(kb, N)} (got {self.zero_points.dtype} {self.zero_points.shape})")
        if self.input_scale is not None and self.input_scale.shape != (K,):
            problems.append(f"input_scale must have shape {(K,)} (got {self.input_scale.shape})")
        if problems:
            raise QuantkitError(f"invalid WOQResult for a [{K}, {N}] weight: " + "; ".join(problems))

    @property
    def shape(self) -> tuple[int, int]:
        """``(K, N)``."""
        K, N = self.codes.shape
        return int(K), int(N)

    def dequantize(self) -> npt.NDArray[np.float32]:
        """``W_hat`` float32 ``[K, N]``: ``(codes - zero_points) * scales`` per group (ONNX DequantizeLinear)."""
        return dequantize(self.codes, self.scales, self.zero_points, axis=0, block_size=self.group_size)

    def effective_weight(self) -> npt.NDArray[np.float32]:
        """The float weight the layer applies to ``x``: ``diag(1 / s) @ W_hat`` (``W_hat`` if no input scale)."""
        w = self.dequantize()
        if self.input_scale is None:
            return w
        return (w / self.input_scale[:, None]).astype(np.float32)


class WeightAlgorithm(Protocol):
    """``fn(W, *, bits, group_size, symmetric, stats, **options) -> WOQResult``."""

    def __call__(
        self,
        W: np.ndarray,
        *,
        bits: int,
        group_size: int | None,
        symmetric: bool,
        stats: LayerStats | None,
        **options: Any,
    ) -> WOQResult: ...


WEIGHT_ALGORITHMS: Registry[WeightAlgorithm] = Registry("weight algorithm")


RESERVED_OPTIONS = frozenset({"W", "w", "bits", "group_size", "symmetric", "stats", "hessian", "factor"})
"""Keyword arguments of a weight algorithm that quantkit passes itself (the weight, the format's bits / group /
grid, the statistics, GPTQ's shared factorization): never ``algorithm_options`` a recipe may set."""


def register_weight_algorithm(name: str) -> Any:
    """Decorator: register a weight algorithm under ``name``."""
    return WEIGHT_ALGORITHMS.register(name)


def get_weight_algorithm(name: str) -> WeightAlgorithm:
    """The algorithm registered as ``name`` (imports the built-ins first)."""
    import quantkit.algorithms.awq
    import quantkit.algorithms.gptq
    import quantkit.algorithms.rtn
    import quantkit.algorithms.signround  # noqa: F401  (registration side effects)

    return WEIGHT_ALGORITHMS.get(name)


def resolve_group_size(K: int, group_size: int | None) -> int:
    """``group_size`` as rows per group: ``None`` / ``-1`` / ``0`` or ``>= K`` mean one group of K."""
    if group_size is None or group_size <= 0 or group_size >= K:
        return int(K)
    return int(group_size)


def check_weight(W: np.ndarray, bits: int) -> np.ndarray:
    """Validate a ``[K, N]`` float weight and the bit width; return it as float32."""
    from quantkit.errors import UnsupportedOpError

    arr = np.asarray(W)
    if arr.ndim != 2 or arr.dtype.kind != "f":
        raise UnsupportedOpError(
            f"weight-only quantization needs a float [K, N] weight, got {arr.dtype} {arr.shape}"
        )
    if bits not in (4, 8):
        raise UnsupportedOpError(f"weight-only quantization: bits={bits} is not supported; allowed: 4, 8")
    if not np.all(np.isfinite(arr)):
        raise UnsupportedOpError("weight-only quantization: the weight contains inf or NaN")
    return arr.astype(np.float32, copy=False)
