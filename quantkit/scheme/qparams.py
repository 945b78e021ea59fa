"""All scale / zero-point math of quantkit: choose qparams, quantize, dequantize.

Conventions (shared with ONNX ``QuantizeLinear`` / ``DequantizeLinear``, opset 21):

* **Quantize**: ``q = saturate(round_half_even(x / scale) + zero_point)`` onto the full
  grid ``[qmin, qmax]`` of the integer type.  ``x / scale`` is ONE IEEE float32
  division — ONNX Runtime's CPU kernel (MLAS, all integer types incl. int4) divides,
  it does NOT multiply by a reciprocal (``x * (1/scale)`` differs on ~10 % of
  values next to a .5 tie; pinned by ``tests/numerics``).  The rounding is applied
  *before* adding the zero point, so ``x/scale = 0.5`` with ``zero_point = 3`` gives 3,
  not 4.  NaN quantizes to ``qmin``; ``±inf`` saturates.
* **Dequantize**: ``x = float32(int32(q) - int32(zero_point)) * scale`` (one float32 multiply).
* **Granularity** (``axis`` / ``block_size`` as in ONNX): per-tensor (scalar scale),
  per-axis (1-D scale of length ``x.shape[axis]``), blocked (scale has ``x``'s shape
  except ``ceil(x.shape[axis] / block_size)`` along ``axis``; element ``i`` along
  ``axis`` uses scale index ``i // block_size``).

Choosing qparams (:func:`compute_qparams`), with ``[qmin, qmax]`` the grid and the
range first widened to contain 0 (``lo = min(min, 0)``, ``hi = max(max, 0)``) so that
0.0 — padding, ReLU zeros — is represented exactly:

* **asymmetric**: ``scale = (hi - lo) / (qmax - qmin)``,
  ``zero_point = clip(round_half_even(qmin - lo / scale), qmin, qmax)``.
* **symmetric**: ``scale = max(|lo|, |hi|) / ((qmax - qmin) / 2)`` and the zero point is the
  grid midpoint ``(qmin + qmax + 1) // 2``: 0 for signed types, 128 for uint8, 8 for
  uint4, 32768 for uint16.  So int8 symmetric uses ``absmax / 127.5`` (the same as
  torchao; ONNX Runtime's own quantizer narrows int8 to ``[-127, 127]`` and uses
  ``/ 127``).  Chosen because it is one formula for every type and because a uint8
  symmetric tensor is then exactly the int8 one shifted by +128 (what ORT does
  internally when it converts int8 activations to uint8).  ``±absmax`` maps to
  ``±(qmax - qmin)/2``, i.e. at most half a step outside the grid, so the error at the
  edges is still ``<= scale / 2``.
* **zero range** (``hi == lo == 0``): ``scale = 1.0`` (every value is 0 and maps to the
  zero point exactly).  A positive range so small that the float32 scale would be
  below the smallest normal float32 (``2**-126``) is given that smallest normal
  scale.  The scale is therefore always finite and > 0; a non-finite ``min`` / ``max``
  raises :class:`~quantkit.errors.CalibrationError`.

Scales are computed in float64 and stored as float32; the zero point is derived
from the stored float32 scale so the pair is self-consistent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from quantkit.errors import CalibrationError, RecipeError
from quantkit.scheme.dtypes import INT_TYPES, IntType, int_type

__all__ = [
    "GRANULARITIES",
    "QuantSpec",
    "bias_int32",
    "bias_scale",
    "compute_qparams",
    "dequantize",
    "group_weight_codes",
    "signed_group_scale",
    "quantize",
    "weight_qparams",
]

Granularity = Literal["tensor", "channel", "group"]
GRANULARITIES: tuple[str, ...] = ("tensor", "channel", "group")
_SMALLEST_SCALE = float(np.finfo(np.float32).tiny)  # 2**-126, smallest normal float32
_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.integer]


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized.  Validated on construction (raises :class:`RecipeError`).

    Attributes:
        dtype: integer grid name, one of :data:`quantkit.scheme.dtypes.INT_TYPES`.
        symmetric: symmetric (zero point at the grid midpoint) or asymmetric (min-max).
        granularity: ``"tensor"`` (one scale), ``"channel"`` (one scale per index of
            ``axis``) or ``"group"`` (one scale per ``group_size`` consecutive elements along ``axis``).
        axis: ONNX ``QuantizeLinear`` meaning.  For ``"channel"`` the axis that keeps its own
            scales (Conv weight ``[O, I, kh, kw]``: 0; MatMul weight ``[K, N]``: 1).  For
            ``"group"`` the axis along which blocks run (MatMul weight ``[K, N]`` grouped
            along K: 0).  Must be ``None`` for ``"tensor"``.  Negative values count from the end.
        group_size: block length for ``"group"``; ``None`` otherwise.
        reduce_range: use a grid one bit narrower (see :meth:`IntType.grid`).
        narrow: symmetric only: the restricted grid ``[-(2^(b-1) - 1), 2^(b-1) - 1]`` scale
            (``absmax / 127`` for int8), the usual choice for weights.
    """

    dtype: str
    symmetric: bool
    granularity: Granularity = "tensor"
    axis: int | None = None
    group_size: int | None = None
    reduce_range: bool = False
    narrow: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields against each other; raise :class:`RecipeError` naming field, value, allowed."""
        if self.dtype not in INT_TYPES:
            raise RecipeError(
                f"quant spec: dtype={self.dtype!r} is not allowed; allowed: {sorted(INT_TYPES)}"
            )
        if not isinstance(self.symmetric, bool):
            raise RecipeError(f"quant spec: symmetric={self.symmetric!r} must be true or false")
        if self.granularity not in GRANULARITIES:
            raise RecipeError(
                f"quant spec: granularity={self.granularity!r} is not allowed; allowed: {list(GRANULARITIES)}"
            )
        if self.granularity == "tensor":
            if self.axis is not None:
                raise RecipeError(
                    f"quant spec: axis={self.axis!r} is not allowed with granularity='tensor'; use null"
                )
        elif not isinstance(self.axis, int) or isinstance(self.axis, bool):
            raise RecipeError(
                f"quant spec: axis={self.axis!r} is not allowed with granularity={self.granularity!r}; "
                "an integer axis is required"
            )
        if self.granularity == "group":
            if (
                not isinstance(self.group_size, int)
                or isinstance(self.group_size, bool)
                or self.group_size < 1
            ):
                raise RecipeError(
                    f"quant spec: group_size={self.group_size!r} is not allowed with granularity='group'; "
                    "a positive integer is required"
                )
        elif self.group_size is not None:
            raise RecipeError(
                f"quant spec: group_size={self.group_size!r} is only allowed with granularity='group' "
                f"(got granularity={self.granularity!r})"
            )

    @property
    def int_type(self) -> IntType:
        """The :class:`IntType` of :attr:`dtype`."""
        return int_type(self.dtype)

    def resolve_axis(self, ndim: int) -> int | None:
        """``axis`` normalised to ``[0, ndim)`` for a tensor of rank ``ndim``; ``RecipeError`` if out of range."""
        if self.axis is None:
            return None
        if not -ndim <= self.axis < ndim:
            raise RecipeError(
                f"quant spec: axis={self.axis} is out of range for a tensor of rank {ndim}; "
                f"allowed: {-ndim}..{ndim - 1}"
            )
        return self.axis % ndim


def _as_int_type(dtype: str | IntType) -> IntType:
    return dtype if isinstance(dtype, IntType) else int_type(dtype)


def compute_qparams(
    min_val: npt.ArrayLike,
    max_val: npt.ArrayLike,
    dtype: str | IntType,
    *,
    symmetric: bool,
    reduce_range: bool = False,
    narrow: bool = False,
) -> tuple[FloatArray, IntArray]:
    """Scale and zero point covering ``[min_val, max_val]`` (elementwise; see the module docstring).

    ``narrow`` (symmetric only) maps ``absmax`` to ``(qmax - qmin - 1) / 2`` (127 for int8,
    7 for int4): the restricted ``[-127, 127]`` weight grid that ONNX Runtime, TensorRT and
    PyTorch use for weights, where the largest weight is represented exactly instead of
    saturating half a step, and where ``u8 x s8`` products cannot overflow int16 pairs.

    Returns ``(scale, zero_point)`` with the broadcast shape of the inputs: ``scale`` float32
    (finite, > 0), ``zero_point`` in the container dtype of ``dtype`` (``int8`` for int4).
    """
    it = _as_int_type(dtype)
    qmin, qmax = it.grid(reduce_range)
    mn, mx = np.broadcast_arrays(np.asarray(min_val, np.float64), np.asarray(max_val, np.float64))
    if not (np.all(np.isfinite(mn)) and np.all(np.isfinite(mx))):
        raise CalibrationError(
            f"cannot compute a scale from a non-finite range: min={mn.min() if mn.size else mn}, "
            f"max={mx.max() if mx.size else mx} (inf/NaN in the calibration data or weights)"
        )
    if np.any(mn > mx):
        raise ValueError("compute_qparams: min_val > max_val somewhere; the range is inverted")
    lo = np.minimum(mn, 0.0)
    hi = np.maximum(mx, 0.0)
    if symmetric:
        width = np.maximum(-lo, hi)
        scale64 = width / ((qmax - qmin - (1 if narrow else 0)) / 2.0)
    else:
        width = hi - lo
        scale64 = width / float(qmax - qmin)
    scale = scale64.astype(np.float32)
    scale = np.where(width == 0.0, np.float32(1.0), np.maximum(scale, np.float32(_SMALLEST_SCALE)))
    scale = scale.astype(np.float32)
    if not np.all(np.isfinite(scale)):
        raise CalibrationError(f"range [{lo.min()}, {hi.max()}] is too wide for a float32 scale")
    if symmetric:
        zp = np.full(scale.shape, (qmin + qmax + 1) // 2, np.int64)
    else:
        zp = np.clip(np.rint(qmin - lo / scale.astype(np.float64)), qmin, qmax).astype(np.int64)
    return scale, zp.astype(it.numpy_dtype)


def _infer_int_type(zero_point: np.ndarray | None, dtype: str | IntType | None) -> IntType:
    if dtype is not None:
        return _as_int_type(dtype)
    if zero_point is None:
        return INT_TYPES["uint8"]  # ONNX default when the zero point is omitted
    name = str(zero_point.dtype)  # numpy / ml_dtypes names coincide with ours
    if name not in INT_TYPES:
        raise ValueError(f"cannot infer the integer type from a zero point of dtype {name}; pass dtype=")
    return INT_TYPES[name]


def _expand(
    param: np.ndarray, shape: tuple[int, ...], axis: int | None, block_size: int | None, what: str
) -> np.ndarray:
    """Broadcast a scale / zero point to ``shape`` following ONNX per-tensor / per-axis / blocked rules."""
    ndim = len(shape)
    if block_size is None and param.size == 1 and param.ndim <= 1:
        return param.reshape(())
    if axis is None:
        raise ValueError(f"{what} has shape {param.shape}; a per-axis or blocked {what} needs axis=")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for rank {ndim}")
    a = axis % ndim
    if block_size is None:
        if param.ndim != 1 or param.shape[0] != shape[a]:
            raise ValueError(
                f"per-axis {what} must be 1-D of length {shape[a]} (axis {a}), got {param.shape}"
            )
        return param.reshape([shape[a] if i == a else 1 for i in range(ndim)])
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _blocked_param(param, shape, a, block_size, what)
    idx = np.arange(shape[a]) // block_size
    return np.take(param, idx, axis=a)


def quantize(
    x: npt.ArrayLike,
    scale: npt.ArrayLike,
    zero_point: npt.ArrayLike | None = None,
    *,
    axis: int | None = None,
    block_size: int | None = None,
    dtype: str | IntType | None = None,
) -> IntArray:
    """ONNX ``QuantizeLinear``, bit-exact with ONNX Runtime's CPU kernel.

    ``q = clip(round_half_even(float32(x) / scale) + zero_point, qmin, qmax)``, NaN -> ``qmin``.
    The integer type is ``dtype`` if given, else that of ``zero_point`` (int4 / uint4 need
    ``dtype=`` because they are held in int8 / uint8 containers), else uint8 (ONNX default).
    Returns unpacked values in the type's container dtype.
    """
    zp_arr = None if zero_point is None else np.asarray(zero_point)
    it = _infer_int_type(zp_arr, dtype)
    xs = np.asarray(x, dtype=np.float32)
    if _blockwise(xs, axis, block_size):
        params = [_blocked_param(np.asarray(scale, np.float32), xs.shape, axis, block_size, "scale")]
        if zp_arr is not None:
            params.append(_blocked_param(zp_arr.astype(np.int32), xs.shape, axis, block_size, "zero point"))
        return _by_blocks(xs, params, axis, block_size, lambda xp, sp, zp=_NO_ZERO_POINT: _quantize_core(
            xp, sp, zp, it), it.numpy_dtype)
    s = _expand(np.asarray(scale, np.float32), xs.shape, axis, block_size, "scale")
    z = (
        np.zeros((), np.int32)
        if zp_arr is None
        else _expand(zp_arr.astype(np.int32), xs.shape, axis, block_size, "zero point")
    )
    return _quantize_core(xs, s, z, it)


def _quantize_core(xs: np.ndarray, s: np.ndarray, z: np.ndarray, it: IntType) -> IntArray:
    """:func:`quantize`'s arithmetic on ``xs`` with ``s`` / ``z`` broadcast against it."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        v = np.rint(xs / s)  # float32 / float32: one IEEE division, like MLAS
    lo = (it.qmin - z).astype(np.float32)
    hi = (it.qmax - z).astype(np.float32)
    v = np.clip(v, lo, hi)
    v = np.where(np.isnan(v), lo, v)
    return (v.astype(np.int32) + z).astype(it.numpy_dtype)


_NO_ZERO_POINT = np.zeros((), np.int32)  # an omitted zero point (read-only: never written to)
_NO_ZERO_POINT.flags.writeable = False


def _dequantize_core(q: np.ndarray, s: np.ndarray, z: np.ndarray = _NO_ZERO_POINT) -> np.ndarray:
    """:func:`dequantize`'s arithmetic, ``float32(int32(q) - z) * s``, on a slice (``s`` / ``z`` broadcast)."""
    d = q.astype(np.int32) - z
    f = d.astype(np.float32)
    del d
    np.multiply(f, s, out=f)
    return f


def _blockwise(x: np.ndarray, axis: int | None, block_size: int | None) -> bool:
    """Whether a blocked scale / zero point can be applied block by block (:func:`_by_blocks`) instead of being
    expanded to ``x``'s shape: a blocked layout along a valid axis of an array of rank >= 1."""
    return block_size is not None and block_size >= 1 and axis is not None and x.ndim >= 1 and -x.ndim <= axis < x.ndim


def _blocked_param(param: np.ndarray, shape: tuple[int, ...], axis: int | None, block_size: int | None,
                   what: str) -> np.ndarray:
    """``param`` checked as a blocked scale / zero point of an array of ``shape`` (the rules of :func:`_expand`)."""
    a = int(axis or 0) % len(shape)
    bs = int(block_size or 1)
    expected = tuple(-(-d // bs) if i == a else d for i, d in enumerate(shape))
    if param.shape != expected:
        raise ValueError(f"blocked {what} must have shape {expected}, got {param.shape}")
    return param


def _by_blocks(x: np.ndarray, params: list[np.ndarray], axis: int | None, block_size: int | None, fn: Any,
               out_dtype: Any) -> np.ndarray:
    """``fn(x_part, *param_parts)`` (elementwise) over ``x`` with each blocked param broadcast along its blocks: the
    whole blocks as a ``[..., blocks, block_size, ...]`` view, a shorter last block apart.  The same values as
    applying ``fn`` to the params expanded to ``x``'s shape, without those full-size copies."""
    a = int(axis or 0) % x.ndim
    bs = int(block_size or 1)
    out = np.empty(x.shape, out_dtype)
    others = [i for i in range(x.ndim) if i != a]
    if others and x.size > _BLOCK_CHUNK:  # in slices of another axis: fn's temporaries stay ~_BLOCK_CHUNK values
        c = max(others, key=lambda i: x.shape[i])
        step = max(1, _BLOCK_CHUNK * x.shape[c] // x.size)
        for lo in range(0, x.shape[c], step):
            sl = (slice(None),) * c + (slice(lo, lo + step),)
            _blocks_into(out[sl], x[sl], [p[sl] for p in params], a, bs, fn)
        return out
    _blocks_into(out, x, params, a, bs, fn)
    return out


_BLOCK_CHUNK = 1 << 22
"""Values per slice of :func:`_by_blocks` (a 49k x 576 lm_head dequantized whole held ~5 float32 copies of itself)."""


def _blocks_into(out: np.ndarray, x: np.ndarray, params: list[np.ndarray], a: int, bs: int, fn: Any) -> None:
    """:func:`_by_blocks` on one slice (``out`` a view of the result)."""
    n = x.shape[a]
    kb = n // bs
    full = kb * bs

    def along(lo: int, hi: int | None) -> tuple[slice, ...]:
        return (slice(None),) * a + (slice(lo, hi),)

    if kb:
        shp = x.shape[:a] + (kb, bs) + x.shape[a + 1:]
        head = fn(x[along(0, full)].reshape(shp), *[np.expand_dims(p[along(0, kb)], a + 1) for p in params])
        out[along(0, full)] = head.reshape(x[along(0, full)].shape)
    if full < n:
        out[along(full, None)] = fn(x[along(full, None)], *[p[along(kb, kb + 1)] for p in params])


def dequantize(
    q: npt.ArrayLike,
    scale: npt.ArrayLike,
    zero_point: npt.ArrayLike | None = None,
    *,
    axis: int | None = None,
    block_size: int | None = None,
) -> FloatArray:
    """ONNX ``DequantizeLinear``: ``float32(int32(q) - int32(zero_point)) * scale``, bit-exact with ORT."""
    qa = np.asarray(q)
    if _blockwise(qa, axis, block_size):
        params = [_blocked_param(np.asarray(scale, np.float32), qa.shape, axis, block_size, "scale")]
        if zero_point is not None:
            params.append(_blocked_param(np.asarray(zero_point).astype(np.int32), qa.shape, axis, block_size,
                                         "zero point"))
        return _by_blocks(qa, params, axis, block_size, _dequantize_core, np.float32)
    qi = qa.astype(np.int32)
    s = _expand(np.asarray(scale, np.float32), qi.shape, axis, block_size, "scale")
    z = (
        np.zeros((), np.int32)
        if zero_point is None
        else _expand(np.asarray(zero_point).astype(np.int32), qi.shape, axis, block_size, "zero point")
    )
    return ((qi - z).astype(np.float32) * s).astype(np.float32)


def _block_reduce(w: np.ndarray, axis: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    starts = np.arange(0, w.shape[axis], block)
    return np.minimum.reduceat(w, starts, axis=axis), np.maximum.reduceat(w, starts, axis=axis)


def weight_qparams(w: npt.ArrayLike, spec: QuantSpec) -> tuple[FloatArray, IntArray]:
    """Min-max qparams of a weight under ``spec``, shaped for ONNX ``DequantizeLinear``.

    * ``"tensor"``: ``min(w)``, ``max(w)`` -> scalar scale / zero point.
    * ``"channel"``: min / max over every axis but ``spec.axis`` -> shape ``(w.shape[axis],)``.
    * ``"group"``: min / max over each run of ``group_size`` consecutive elements along
      ``spec.axis`` (last run may be shorter) -> ``w.shape`` with that axis replaced by
      ``ceil(w.shape[axis] / group_size)`` (the blocked ``DequantizeLinear`` layout; e.g. a
      MatMul weight ``[K, N]`` grouped along K=axis 0 gives ``[ceil(K/g), N]``).

    Then :func:`compute_qparams` with ``spec.symmetric`` / ``spec.reduce_range``.
    """
    arr = np.asarray(w)
    if arr.dtype.kind != "f":
        raise ValueError(f"weight_qparams expects a floating-point weight, got dtype {arr.dtype}")
    if arr.size == 0:
        raise ValueError("weight_qparams: empty weight")
    arr = arr.astype(np.float32, copy=False)
    axis = spec.resolve_axis(arr.ndim)
    if spec.granularity == "tensor" or axis is None:
        mn, mx = arr.min(), arr.max()
    elif spec.granularity == "channel":
        others = tuple(i for i in range(arr.ndim) if i != axis)
        mn, mx = arr.min(axis=others), arr.max(axis=others)
    else:
        assert spec.group_size is not None  # guaranteed by QuantSpec.validate
        mn, mx = _block_reduce(arr, axis, spec.group_size)
    return compute_qparams(
        mn, mx, spec.dtype, symmetric=spec.symmetric, reduce_range=spec.reduce_range,
        narrow=spec.narrow and spec.symmetric,
    )


def bias_scale(input_scale: npt.ArrayLike, weight_scale: npt.ArrayLike) -> FloatArray:
    """``input_scale * weight_scale`` as one float32 multiply (the scale of an int32 bias)."""
    return (np.asarray(input_scale, np.float32) * np.asarray(weight_scale, np.float32)).astype(np.float32)


def bias_int32(
    bias: npt.ArrayLike, input_scale: npt.ArrayLike, weight_scale: npt.ArrayLike
) -> npt.NDArray[np.int32]:
    """Quantize a bias to int32 with scale ``bias_scale(input_scale, weight_scale)`` and zero point 0.

    ``q = clip(round_half_even(float64(bias) / float64(bias_scale)), int32 min, int32 max)``
    (float64 so that large biases keep all their bits), as QLinearConv / QGemm and a
    ``DequantizeLinear(int32)`` bias in a QDQ graph expect.
    """
    bs = bias_scale(input_scale, weight_scale).astype(np.float64)
    if np.any(bs <= 0) or not np.all(np.isfinite(bs)):
        raise CalibrationError(
            f"bias scale input_scale * weight_scale must be finite and > 0, got values in [{bs.min()}, {bs.max()}]"
        )
    b = np.asarray(bias, np.float64)
    if not np.all(np.isfinite(b)):
        raise CalibrationError("bias contains inf or NaN")
    return np.clip(np.rint(b / bs), _INT32_MIN, _INT32_MAX).astype(np.int32)


def signed_group_scale(mn: npt.ArrayLike, mx: npt.ArrayLike, bits: int) -> npt.NDArray[np.float32]:
    """The symmetric grid's signed scale of groups with ranges ``[mn, mx]``: ``e / -2^(bits-1)``, ``e`` the group's
    value of largest magnitude (``mn`` on a tie), so that ``e`` is exact at code 0 (:func:`group_weight_codes`)."""
    mn64, mx64 = np.asarray(mn, np.float64), np.asarray(mx, np.float64)
    ext = np.where(np.abs(mn64) >= np.abs(mx64), mn64, mx64)  # signed value of largest magnitude
    raw = ext / -float(2 ** (bits - 1))
    # an all-zero group: scale 1 (every value is exact at the zero point); a scale below the smallest
    # normal float32 keeps its sign at that magnitude (as compute_qparams does for positive scales)
    raw = np.where(ext == 0, 1.0, np.where(np.abs(raw) < _SMALLEST_SCALE, np.sign(raw) * _SMALLEST_SCALE, raw))
    return raw.astype(np.float32)


def group_weight_codes(
    w: npt.ArrayLike,
    bits: int,
    group_size: int,
    *,
    symmetric: bool,
    narrow: bool = False,
    min_val: npt.ArrayLike | None = None,
    max_val: npt.ArrayLike | None = None,
) -> tuple[FloatArray, npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """Group-wise qparams and unsigned integer codes of a MatMul weight ``w`` ``[K, N]``.

    Groups are ``group_size`` consecutive rows along K (the last one may be shorter);
    ``ceil(K / group_size)`` scales per output column.  The codes live on the unsigned
    grid ``[0, 2^bits - 1]`` (``uint4`` / ``uint8``), the storage ``MatMulNBits`` and
    ``GatherBlockQuantized`` read: ``w ~ (code - zero_point) * scale``.

    * asymmetric: min-max of each group (widened to contain 0), :func:`compute_qparams`.
    * symmetric: zero point = grid middle ``2^(bits-1)`` (8 for 4 bits) and a **signed** scale
      ``scale = e / -2^(bits-1)`` with ``e`` the group's value of largest magnitude (``e / -8`` for 4
      bits, ONNX Runtime's RTN grid): ``e`` itself is exact at code 0 (value -8), the step is
      ``absmax / 8`` (6 % finer than ``absmax / 7.5``) and all 16 levels are used; the scale is
      negative when ``e > 0``, which ``MatMulNBits`` / ``DequantizeLinear`` compute like any other.
      ``narrow``: ``absmax / (2^(bits-1) - 1)``, grid ``[-7, 7]``.
      The symmetric int4 value ``v`` in ``[-8, 7]`` is stored as ``code = v + 8``.

    ``min_val`` / ``max_val`` (``[ceil(K/g), N]``) override the measured group range
    (clipping searches shrink it); values outside then saturate, as in ``QuantizeLinear``.

    Returns ``(scales float32 [kb, N], codes uint8 [K, N], zero_points uint8 [kb, N])``.
    """
    arr = np.asarray(w)
    if arr.ndim != 2 or arr.dtype.kind != "f":
        raise ValueError(f"group_weight_codes expects a float [K, N] weight, got {arr.dtype} {arr.shape}")
    if bits not in (4, 8):
        raise ValueError(f"group_weight_codes: bits={bits} is not supported; allowed: 4, 8")
    arr = arr.astype(np.float32, copy=False)
    dtype = "uint4" if bits == 4 else "uint8"
    if min_val is None or max_val is None:
        mn, mx = _block_reduce(arr, 0, group_size)
    else:
        mn, mx = np.asarray(min_val), np.asarray(max_val)
    if symmetric and not narrow:
        scale: npt.NDArray[np.float32] = signed_group_scale(mn, mx, bits)
        zp: npt.NDArray[np.integer] = np.full(scale.shape, 1 << (bits - 1), np.uint8)
    else:
        scale, zp = compute_qparams(mn, mx, dtype, symmetric=symmetric, narrow=narrow and symmetric)
    codes = quantize(arr, scale, zp, axis=0, block_size=group_size, dtype=dtype)
    return np.asarray(scale, np.float32), codes.astype(np.uint8), np.asarray(zp, np.uint8)
