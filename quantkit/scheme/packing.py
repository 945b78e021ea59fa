"""INT4 packing in ONNX layout — the only place in quantkit that packs nibbles.

ONNX (``INT4`` / ``UINT4`` tensors, ``MatMulNBits``, ``GatherBlockQuantized``)
stores two 4-bit values per byte, the element with the lower flat index in the
LOW nibble::

    byte[i] = (v[2i] & 0xF) | ((v[2i+1] & 0xF) << 4)        e.g. [1, 2] -> 0x21

An odd count is padded with a zero high nibble.  Signed values use the
two's-complement nibble (``-1 -> 0xF``); unpacking sign-extends when asked.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["pack_int4", "unpack_int4"]


_PACK_CHUNK = 1 << 24
"""Values packed per step (an even count): the temporaries are a few bytes per value of one chunk, not of the
whole array (a tied embedding's codes are hundreds of millions of values)."""


def pack_int4(values: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Pack 4-bit integers (``[-8, 7]`` or ``[0, 15]``) into ``ceil(n/2)`` bytes, low nibble first.

    ``values`` is flattened in C order.  Raises ``ValueError`` if a value does not fit
    in four bits (a caller bug: quantize first, then pack).  The result is the only array of
    the input's size made; the nibbles are formed :data:`_PACK_CHUNK` values at a time.
    """
    v = np.asarray(values)
    if v.dtype.kind not in "iu":
        raise ValueError(f"pack_int4 expects integer values, got dtype {v.dtype}")
    flat = v.reshape(-1)
    if flat.size:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < -8 or hi > 15:
            raise ValueError(f"pack_int4: values must lie in [-8, 15], got [{lo}, {hi}]")
    n = flat.size
    out = np.empty((n + 1) // 2, np.uint8)
    for s in range(0, n, _PACK_CHUNK):
        part = flat[s : s + _PACK_CHUNK]
        # the low nibble of the two's-complement value (as int16 & 0xF would give; in range, every dtype agrees)
        nib = (part.astype(np.uint8) if part.dtype != np.uint8 else part) & np.uint8(0xF)
        if nib.size % 2:
            nib = np.concatenate([nib, np.zeros(1, np.uint8)])
        o = out[s // 2 : s // 2 + nib.size // 2]
        np.left_shift(nib[1::2], np.uint8(4), out=o)
        o |= nib[0::2]
    return out


def unpack_int4(
    packed: npt.ArrayLike, count: int, signed: bool
) -> npt.NDArray[np.int8] | npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_int4`: the first ``count`` nibbles, as ``int8`` (sign-extended) or ``uint8``."""
    p = np.asarray(packed, dtype=np.uint8).reshape(-1)
    if count < 0 or count > 2 * p.size:
        raise ValueError(f"unpack_int4: count {count} does not fit in {p.size} packed bytes")
    nibbles = np.empty(2 * p.size, np.uint8)
    nibbles[0::2] = p & 0xF
    nibbles[1::2] = p >> 4
    nibbles = nibbles[:count]
    if signed:
        return (nibbles.astype(np.int8) ^ 8) - 8  # sign-extend bit 3: 0x8..0xF -> -8..-1
    return nibbles
