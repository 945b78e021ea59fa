"""Quantization schemes: integer grids, qparams, quantize / dequantize, int4 packing.

This is the only package in quantkit that computes a scale or a zero point.
"""

from quantkit.scheme.dtypes import INT_TYPES, IntType, int_type
from quantkit.scheme.packing import pack_int4, unpack_int4
from quantkit.scheme.qparams import (
    GRANULARITIES,
    QuantSpec,
    bias_int32,
    bias_scale,
    compute_qparams,
    dequantize,
    quantize,
    weight_qparams,
)

__all__ = [
    "GRANULARITIES",
    "INT_TYPES",
    "IntType",
    "QuantSpec",
    "bias_int32",
    "bias_scale",
    "compute_qparams",
    "dequantize",
    "int_type",
    "pack_int4",
    "quantize",
    "unpack_int4",
    "weight_qparams",
]
