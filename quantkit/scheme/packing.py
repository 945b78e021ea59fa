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


def pack_int4(values: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Pack 4-bit integers (``[-8, 7]`` or ``[0, 15]``) into ``ceil(n/2)`` bytes, low nibble first.

    ``values`` is flattened in C order.  Raises ``ValueError`` if a value does not fit
    in four bits (a caller bug: quantize first, then pack).
    """
    v = np.asarray(values)
    if v.dtype.kind not in "iu":
        raise ValueError(f"pack_int4 expects integer values, got dtype {v.dtype}")
    flat = v.reshape(-1).astype(np.int16)
    if flat.size and (flat.min() < -8 or flat.max() > 15):
        raise ValueError(f"pack_int4: values must lie in [-8, 15], got [{flat.min()}, {flat.max()}]")
    nibbles = (flat & 0xF).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)


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
