"""W4A8 verified: ``MatMulNBits`` at ``accuracy_level`` 4 against level 0, one layer at a time, on its real inputs.

At ``accuracy_level`` 4 ONNX Runtime's ``MatMulNBits`` quantizes the activations to int8 inside the kernel
(per row and per block of ``block_size`` input channels, symmetric, the block's largest ``|x|`` sets the step)
and multiplies in integers: fast, and harmless for ordinary activations (about 0.5% of ``max |y|``).  An input
channel much larger than its neighbours in the same block (the "massive activations" of many LLMs) sets a step
that rounds the rest of that block to a few levels or to zero: the layer's output changes and greedy tokens
follow.  Level 0 multiplies in float the same 4-bit weights (exact against dequantize-then-MatMul).

:func:`level4_check` runs one layer's packed weights as a single-node ``MatMulNBits`` session at level 4 and at
level 0 on rows of the layer's calibration input ``x`` and compares both with the float product of the original
weights, ``Y = x W``, and of the dequantized ones, ``Y_q = x Ŵ``:

* ``w4a8_error_ratio`` = ``||Y_4 - Y|| / ||Y_0 - Y||``: the layer's output error with int8 activations relative
  to its weight-only error (1.0: level 4 adds nothing; 1.5: the error is half as large again; the error energy
  2.25 times).  Scale-free and comparable across layers, algorithms and models: the quantization error the user
  already accepted (the weights') is the yardstick for the one level 4 adds.  A layer whose weights quantize
  exactly (weight-only error 0) has an infinite ratio whenever level 4 changes anything;
* ``w4a8_added_error`` = ``||Y_4 - Y_0|| / ||Y||``: what the int8 activations add, relative to the output;
* ``level0_vs_math`` = ``||Y_0 - Y_q|| / ||Y_q||``: the level-0 kernel against the math it states (the same
  "kernels vs math" check the INT8 path runs): it should be at float rounding (~1e-6).

Norms are Frobenius norms over the rows checked and every output column.  The work is bounded: at most
:data:`CHECK_OUTPUTS` output values per layer (rows are thinned evenly when ``rows x N`` is larger: a 49k-wide
lm_head is checked on ~170 rows, a 576-wide projection on every sampled row), and the weights are unpacked
``SLICE_BYTES`` of float32 at a time (column slices, each its own pair of sessions).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper

from quantkit.scheme.packing import unpack_int4

__all__ = ["CHECK_OUTPUTS", "SLICE_BYTES", "NBitsWeights", "check_bytes", "check_rows", "dequantize_nbits", "level4_check",
           "nbits_model", "w4a8_summary"]

CHECK_OUTPUTS = 1 << 23
"""At most this many output values per layer are computed by each of the four products (a cost bound, not a
tuning: 8.4M outputs are 4096 rows of a 2048-wide layer).  Measured: 23-26 s for the 136 4-bit layers of the
INT4 mix of SmolLM2-135M (K = 576 / 1536, 4096 rows) on two cores; the cost grows with K."""

SLICE_BYTES = 64 << 20
"""float32 bytes of dequantized weights per column slice (a 128k-vocabulary lm_head is not unpacked whole)."""


class NBitsWeights(Protocol):
    """A linear ``y = (x / s) @ Ŵ`` packed for ``MatMulNBits`` (:class:`quantkit.frontends.llm_builder.PackedLinear`)."""

    @property
    def B(self) -> np.ndarray: ...  # noqa: N802 - MatMulNBits' name
    @property
    def scales(self) -> np.ndarray: ...
    @property
    def zero_points(self) -> np.ndarray | None: ...
    @property
    def bits(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def K(self) -> int: ...  # noqa: N802
    @property
    def N(self) -> int: ...  # noqa: N802
    @property
    def input_scale(self) -> np.ndarray | None: ...


def nbits_model(q: NBitsWeights, accuracy_level: int, cols: slice | None = None) -> onnx.ModelProto:
    """One ``com.microsoft.MatMulNBits`` node ``Y [M, n] = X [M, K] @ Ŵ[:, cols]`` at ``accuracy_level``."""
    sl = cols or slice(0, q.N)
    B, scales = q.B[sl], q.scales[sl]
    n = int(B.shape[0])
    inits = [onnx.numpy_helper.from_array(np.ascontiguousarray(B), "B"),
             onnx.numpy_helper.from_array(np.ascontiguousarray(scales, np.float32), "scales")]  # fmt: skip
    ins = ["X", "B", "scales"]
    if q.zero_points is not None:
        inits.append(onnx.numpy_helper.from_array(np.ascontiguousarray(q.zero_points[sl]), "zero_points"))
        ins.append("zero_points")
    node = helper.make_node("MatMulNBits", ins, ["Y"], "w4a8_check", domain="com.microsoft", K=q.K, N=n,
                            bits=q.bits, block_size=q.block_size, accuracy_level=accuracy_level)  # fmt: skip
    graph = helper.make_graph([node], "w4a8_check", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", q.K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def dequantize_nbits(q: NBitsWeights, cols: slice | None = None) -> np.ndarray:
    """``Ŵ[:, cols]`` float32 ``[K, n]`` from the packed arrays, as ``MatMulNBits`` at level 0 computes it (the
    input scale ``s`` not applied)."""
    sl = cols or slice(0, q.N)
    B = q.B[sl]
    n, kb = int(B.shape[0]), int(B.shape[1])
    bs = q.block_size
    if q.bits == 4:
        codes = unpack_int4(B, n * kb * bs, False).reshape(n, kb, bs)
    else:
        codes = B.reshape(n, kb, bs)
    mid = float(1 << (q.bits - 1))
    if q.zero_points is None:
        zp = np.full((n, kb), mid, np.float32)
    elif q.bits == 4:
        zq = q.zero_points[sl]
        zp = unpack_int4(zq, zq.size * 2, False).reshape(n, -1)[:, :kb].astype(np.float32)
    else:
        zp = q.zero_points[sl].astype(np.float32)
    w = (codes.astype(np.float32) - zp[:, :, None]) * np.asarray(q.scales[sl], np.float32)[:, :, None]
    return np.ascontiguousarray(w.reshape(n, kb * bs)[:, : q.K].T)


def _session(model: onnx.ModelProto, threads: int | None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def check_bytes() -> int:
    """The check's temporaries at most: four products of :data:`CHECK_OUTPUTS` floats, one weight slice."""
    return 4 * 4 * CHECK_OUTPUTS + SLICE_BYTES


def check_rows(rows: int, N: int, max_outputs: int = CHECK_OUTPUTS) -> int:
    """How many of ``rows`` input rows a layer of ``N`` outputs is checked on (at least 16, when there are)."""
    return min(rows, max(16, max_outputs // max(N, 1)))


def level4_check(x: np.ndarray, w: np.ndarray, q: NBitsWeights, *, max_outputs: int = CHECK_OUTPUTS,
                 threads: int | None = None) -> dict[str, Any]:
    """The figures of the module doc for one layer: ``x`` ``[M, K]`` rows of its input as calibration saw it
    (before the input scale ``s``), ``w`` ``[K, N]`` its float weights, ``q`` the packed 4-bit weights.

    Returns ``{"w4a8_error_ratio", "w4a8_added_error", "level0_vs_math", "w4a8_rows"}`` (floats; ``inf`` ratio
    when the weight-only error is 0 and level 4 changes the output, 1.0 when neither changes it).
    """
    x = np.asarray(x, np.float32).reshape(-1, q.K)
    M = check_rows(x.shape[0], q.N, max_outputs)
    if M < x.shape[0]:  # evenly thinned: every part of the sample keeps its share
        x = x[np.linspace(0, x.shape[0] - 1, M).round().astype(np.int64)]
    xin = x if q.input_scale is None else (x / np.asarray(q.input_scale, np.float32)).astype(np.float32)
    xin = np.ascontiguousarray(xin)
    step = max(64, SLICE_BYTES // (4 * q.K))
    e4 = e0 = a4 = ref = m0 = mq = 0.0
    for j in range(0, q.N, step):
        cols = slice(j, min(j + step, q.N))
        y = x @ np.asarray(w[:, cols], np.float32)
        yq = xin @ dequantize_nbits(q, cols)
        y4 = _session(nbits_model(q, 4, cols), threads).run(["Y"], {"X": xin})[0]
        y0 = _session(nbits_model(q, 0, cols), threads).run(["Y"], {"X": xin})[0]
        e4 += _sq(y4, y)
        e0 += _sq(y0, y)
        a4 += _sq(y4, y0)
        ref += _sq(y)
        m0 += _sq(y0, yq)
        mq += _sq(yq)
    if e0 > 0:
        ratio = math.sqrt(e4 / e0)
    else:
        ratio = math.inf if e4 > 0 else 1.0
    return {"w4a8_error_ratio": ratio, "w4a8_added_error": math.sqrt(a4 / ref) if ref > 0 else 0.0,
            "level0_vs_math": math.sqrt(m0 / mq) if mq > 0 else 0.0, "w4a8_rows": int(M)}  # fmt: skip


_SQ_CHUNK = 1 << 20


def _sq(a: np.ndarray, b: np.ndarray | None = None) -> float:
    """``sum((a - b)**2)`` (``b`` None: ``sum(a**2)``): float32 differences and dot products over chunks of a
    million values, summed in float64 (a chunk's own rounding is ~1e-6 relative; float64 copies of a 4096 x 1536
    product took a third of a layer's check)."""
    fa = np.ascontiguousarray(a, np.float32).reshape(-1)
    fb = None if b is None else np.ascontiguousarray(b, np.float32).reshape(-1)
    total = 0.0
    for lo in range(0, fa.size, _SQ_CHUNK):
        c = fa[lo : lo + _SQ_CHUNK] if fb is None else fa[lo : lo + _SQ_CHUNK] - fb[lo : lo + _SQ_CHUNK]
        total += float(np.dot(c, c))
    return total


def w4a8_summary(rows: list[dict[str, Any]], *, threshold: float | None, accuracy_level: int, calibrated: bool,
                 seconds: float = 0.0) -> dict[str, Any]:
    """The report's ``w4a8_check``: the threshold, how many 4-bit layers were checked, which were kept at level 0,
    the distribution of ``w4a8_error_ratio`` (min / median / p95 / max), and why nothing was checked when so."""
    four = [r for r in rows if r.get("bits") == 4 and "accuracy_level" in r]
    ratios = sorted(float(r["w4a8_error_ratio"]) for r in four if isinstance(r.get("w4a8_error_ratio"), float))
    out: dict[str, Any] = {
        "threshold": threshold, "accuracy_level": accuracy_level, "linears_4bit": len(four), "checked": len(ratios),
        "kept_level0": [str(r["layer"]) for r in rows if r.get("w4a8_level0")],  # an 8-bit reader of the input too
        "kept_level0_own": [str(r["layer"]) for r in four if r.get("w4a8_level0") and
                            isinstance(r.get("w4a8_error_ratio"), float) and threshold is not None and
                            r["w4a8_error_ratio"] > threshold],
        "seconds": round(seconds, 3),
    }  # fmt: skip
    if ratios:
        worst = max((r for r in four if isinstance(r.get("w4a8_error_ratio"), float)),
                    key=lambda r: float(r["w4a8_error_ratio"]))  # fmt: skip
        out.update({"min_ratio": ratios[0], "median_ratio": float(np.median(ratios)),
                    "p95_ratio": float(np.percentile(ratios, 95)), "max_ratio": ratios[-1],
                    "worst_layer": str(worst["layer"]),
                    "max_added_error": max(float(r.get("w4a8_added_error", 0.0)) for r in four
                                           if isinstance(r.get("w4a8_error_ratio"), float)),
                    "max_level0_vs_math": max(float(r.get("level0_vs_math", 0.0)) for r in four
                                              if isinstance(r.get("w4a8_error_ratio"), float))})  # fmt: skip
    why = None
    if accuracy_level != 4:
        why = f"export.accuracy_level is {accuracy_level}: the kernels compute in float, no int8 activations to check"
    elif threshold is None:
        why = "export.w4a8_max_error_ratio is null: the check is off"
    elif not four:
        why = "no 4-bit layer"
    elif not calibrated:
        why = "no calibration data (calibration.data): the check runs each layer on its calibration inputs"
    elif len(ratios) < len(four):
        why = (f"{len(four) - len(ratios)} of {len(four)} 4-bit layers had no calibration inputs (a tied lm_head "
               "quantized before any block ran, or an lm_head without a final norm)")
    if why is not None:
        out["why"] = why
    return out
