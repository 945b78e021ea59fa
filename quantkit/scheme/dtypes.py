"""Integer grids that quantized tensors live on.

An :class:`IntType` describes the closed integer interval ``[qmin, qmax]`` of one
ONNX integer element type, the NumPy container dtype that holds *unpacked*
values of that type (4-bit values are held one per ``int8`` / ``uint8``; see
:mod:`quantkit.scheme.packing` for the two-per-byte ONNX layout) and the
``onnx.TensorProto`` element type used when emitting it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from quantkit.errors import UnknownNameError

__all__ = ["INT_TYPES", "IntType", "int_type"]


@dataclass(frozen=True)
class IntType:
    """One integer quantization grid.

    Attributes:
        name: ONNX-style name, e.g. ``"int8"``.
        bits: width in bits.
        signed: two's complement (``True``) or unsigned.
        qmin, qmax: the full representable range, ``-2**(bits-1) .. 2**(bits-1)-1``
            for signed and ``0 .. 2**bits-1`` for unsigned types.
        numpy_dtype: container dtype of unpacked values (``int8`` for ``int4``).
        onnx_dtype: ``onnx.TensorProto`` element type.
    """

    name: str
    bits: int
    signed: bool
    qmin: int
    qmax: int
    numpy_dtype: np.dtype
    onnx_dtype: int

    def grid(self, reduce_range: bool = False) -> tuple[int, int]:
        """Return ``(qmin, qmax)``; with ``reduce_range`` one bit narrower.

        The reduced grid (``[-64, 63]`` for int8, ``[0, 127]`` for uint8, ...) is the
        one ONNX Runtime's quantizer uses to avoid int16 overflow in ``u8 x s8``
        pair-sums on CPUs without VNNI.
        """
        if not reduce_range:
            return self.qmin, self.qmax
        if self.signed:
            half = 1 << (self.bits - 2)
            return -half, half - 1
        return 0, (1 << (self.bits - 1)) - 1


def _make(name: str, bits: int, signed: bool, container: type[np.integer], onnx_dtype: int) -> IntType:
    qmin, qmax = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return IntType(name, bits, signed, qmin, qmax, np.dtype(container), onnx_dtype)


INT_TYPES: dict[str, IntType] = {
    t.name: t
    for t in (
        _make("int8", 8, True, np.int8, TensorProto.INT8),
        _make("uint8", 8, False, np.uint8, TensorProto.UINT8),
        _make("int4", 4, True, np.int8, TensorProto.INT4),
        _make("uint4", 4, False, np.uint8, TensorProto.UINT4),
        _make("int16", 16, True, np.int16, TensorProto.INT16),
        _make("uint16", 16, False, np.uint16, TensorProto.UINT16),
    )
}


def int_type(name: str) -> IntType:
    """Look up an integer grid by name; an unknown name raises :class:`UnknownNameError`."""
    try:
        return INT_TYPES[name]
    except KeyError:
        raise UnknownNameError("integer dtype", name, INT_TYPES) from None
