"""The int16 pair saturation of u8 x s8 kernels on x86 CPUs without VNNI: bound, emulation, safe rounding.

On ``x86-avx2`` (see :mod:`quantkit.scheme.target`) ONNX Runtime's MLAS kernels multiply the raw
uint8 activation codes ``a`` with the raw int8 weight codes ``q`` using ``vpmaddubsw``, which adds
two adjacent products along the reduction axis into a saturating int16::

    acc[m, n] = sum_j  sat16( a[m, 2j] * q[2j, n] + a[m, 2j+1] * q[2j+1, n] )     (K odd: a zero pad)
    sat16(v)  = clip(v, -32768, 32767)

Zero points are compensated separately with exact int32 row/column sums, so only the raw codes
matter.  The QDQ math (and every VNNI / ARM kernel) computes the same sum without ``sat16``.

**The pair bound.**  Over every possible activation ``a in [0, 255]`` a pair saturates iff
``255 * (q0+ + q1+) > 32767`` or ``255 * (q0- + q1-) < -32768`` (``v+``/``v-`` the positive /
negative parts).  So a weight matrix is exact *for every input* iff every same-sign pair has
``|q0 + q1| <= 128`` (``floor(32767 / 255) = 128``; ``-128 * 255 = -32640`` fits too).  Pairs of
opposite sign never saturate (``255 * 128 < 32767``).  7-bit weights (``|q| <= 64``) satisfy it
trivially; :func:`pair_safe_codes` satisfies it at a much smaller cost.

**K order** (which two products form a pair) is the order the kernel walks the reduction axis:
the weight matrix as ``[K, N]`` for ``MatMul``; ``W^T`` for ``Gemm`` with ``transB``; for
``Conv`` in ONNX Runtime's NHWC form the im2col order ``k = (kh * KW + kw) * C_in_group + c``
(channels fastest), per group.  :func:`kernel_view` builds that view.  Depthwise convolutions
run a separate kernel that widens to int16 and accumulates in int32: they never saturate.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "PAIR_LIMIT",
    "emulate_u8s8",
    "constrained_round",
    "from_kernel_view",
    "im2col_nhwc",
    "is_depthwise",
    "kernel_view",
    "pair_safe_codes",
    "pair_violations",
    "saturating_conv_reference",
]

PAIR_LIMIT = 128
"""The largest ``|q0 + q1|`` of a same-sign weight pair that no uint8 activation can push out of int16."""
_I16_MIN, _I16_MAX = -32768, 32767


def is_depthwise(weight_shape: tuple[int, ...], group: int) -> bool:
    """A Conv whose every group has one input channel (MLAS's exact depthwise kernel)."""
    return group > 1 and len(weight_shape) >= 3 and weight_shape[1] == 1


def kernel_view(w: np.ndarray, op_type: str, *, trans_b: bool = False, group: int = 1) -> np.ndarray:
    """The weight as the kernel sees it: ``[groups, K, N_per_group]`` in the kernel's K order.

    ``Conv`` weights ``[C_out, C_in/g, *kernel]`` become ``[g, prod(kernel) * C_in/g, C_out/g]`` with
    channels fastest (NHWC im2col); ``MatMul`` ``[K, N]`` and ``Gemm`` ``[K, N]`` / ``[N, K]`` (transB)
    become ``[1, K, N]``."""
    w = np.asarray(w)
    if op_type == "Conv":
        c_out, c_in_g = w.shape[0], w.shape[1]
        spatial = w.shape[2:]
        n_g = c_out // group
        # [g, n_g, c_in_g, *sp] -> [g, *sp, c_in_g, n_g] -> [g, prod(sp)*c_in_g, n_g]
        wg = w.reshape(group, n_g, c_in_g, *spatial)
        order = (0, *range(3, 3 + len(spatial)), 2, 1)
        return np.ascontiguousarray(wg.transpose(order)).reshape(group, -1, n_g)
    if op_type == "Gemm" and trans_b:
        return np.ascontiguousarray(w.T)[None]
    return w[None] if w.ndim == 2 else w.reshape(1, -1, w.shape[-1])


def from_kernel_view(v: np.ndarray, like_shape: tuple[int, ...], op_type: str, *, trans_b: bool = False,
                     group: int = 1) -> np.ndarray:
    """Inverse of :func:`kernel_view`."""
    if op_type == "Conv":
        c_out, c_in_g = like_shape[0], like_shape[1]
        spatial = tuple(like_shape[2:])
        n_g = c_out // group
        wg = v.reshape(group, *spatial, c_in_g, n_g)
        nsp = len(spatial)
        # [g, *sp, c_in_g, n_g] -> [g, n_g, c_in_g, *sp]
        order = (0, 2 + nsp, 1 + nsp, *range(1, 1 + nsp))
        return np.ascontiguousarray(wg.transpose(order)).reshape(like_shape)
    if op_type == "Gemm" and trans_b:
        return np.ascontiguousarray(v[0].T)
    return v.reshape(like_shape)


def _pairs(q: np.ndarray) -> np.ndarray:
    """``[..., K, N] -> [..., ceil(K/2), 2, N]`` (an odd K padded with a zero code)."""
    k = q.shape[-2]
    if k % 2:
        pad = np.zeros((*q.shape[:-2], 1, q.shape[-1]), q.dtype)
        q = np.concatenate([q, pad], axis=-2)
    return q.reshape(*q.shape[:-2], q.shape[-2] // 2, 2, q.shape[-1])


def pair_violations(q_view: npt.ArrayLike) -> np.ndarray:
    """Boolean ``[..., ceil(K/2), N]``: the weight pairs some uint8 activation can saturate."""
    p = _pairs(np.asarray(q_view, np.int32))
    pos = np.maximum(p, 0).sum(axis=-2)
    neg = np.minimum(p, 0).sum(axis=-2)
    return (pos * 255 > _I16_MAX) | (neg * 255 < _I16_MIN)


def emulate_u8s8(a: npt.ArrayLike, q: npt.ArrayLike, *, saturate: bool = True, chunk: int | None = None,
                 max_elements: int = 1 << 22) -> np.ndarray:
    """``a [M, K]`` uint8 codes times ``q [K, N]`` int8 codes as int32, with (``saturate=True``, the
    ``x86-avx2`` kernel) or without (the exact sum of every other class) the int16 pair saturation.
    Rows are processed in chunks whose ``[rows, K/2, N]`` pair sums hold at most ``max_elements`` values
    (bounded memory: a 1536 x 576 layer at 256 rows would otherwise need ~1 GB per temporary)."""
    a = np.asarray(a)
    q = np.asarray(q)
    if not saturate:
        return (a.astype(np.int64) @ q.astype(np.int64)).astype(np.int32)
    qp = _pairs(q.astype(np.int32))  # [P, 2, N]
    a32 = a.astype(np.int32)
    if a32.shape[1] % 2:
        a32 = np.concatenate([a32, np.zeros((a32.shape[0], 1), np.int32)], axis=1)
    ap = a32.reshape(a32.shape[0], -1, 2)  # [M, P, 2]
    out = np.empty((a.shape[0], q.shape[1]), np.int64)
    if chunk is None:
        chunk = max(1, max_elements // max(1, qp.shape[0] * qp.shape[2]))
    for s in range(0, a.shape[0], chunk):
        blk = ap[s : s + chunk]
        pair = blk[:, :, 0, None] * qp[None, :, 0, :] + blk[:, :, 1, None] * qp[None, :, 1, :]  # [m, P, N]
        out[s : s + chunk] = np.clip(pair, _I16_MIN, _I16_MAX).sum(axis=1, dtype=np.int64)
    return out.astype(np.int32)


def constrained_round(u: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Round targets ``u [..., K, N]`` to codes on ``[qmin, qmax]`` with every same-sign pair obeying
    ``|q0 + q1| <= PAIR_LIMIT``, each pair at least squared error (exact: the cost is a convex
    quadratic along the boundary ``q0 + q1 = +-PAIR_LIMIT``, minimised at the rounded midpoint)."""
    k = u.shape[-2]
    q = np.clip(np.rint(u), qmin, qmax)
    up = _pairs(u.astype(np.float64))
    qp = _pairs(q)
    pos = np.maximum(qp, 0).sum(axis=-2) > PAIR_LIMIT
    neg = np.minimum(qp, 0).sum(axis=-2) < -PAIR_LIMIT
    u0, u1 = up[..., 0, :], up[..., 1, :]
    # positive pairs on the boundary q0 + q1 = L: q0 = t, q1 = L - t, both on [qmin, qmax]
    t = np.clip(np.rint((u0 - u1 + PAIR_LIMIT) / 2), max(qmin, PAIR_LIMIT - qmax), min(qmax, PAIR_LIMIT - qmin))
    qp[..., 0, :] = np.where(pos, t, qp[..., 0, :])
    qp[..., 1, :] = np.where(pos, PAIR_LIMIT - t, qp[..., 1, :])
    # negative pairs on q0 + q1 = -L
    t = np.clip(np.rint((u0 - u1 - PAIR_LIMIT) / 2), max(qmin, -PAIR_LIMIT - qmax), min(qmax, -PAIR_LIMIT - qmin))
    qp[..., 0, :] = np.where(neg, t, qp[..., 0, :])
    qp[..., 1, :] = np.where(neg, -PAIR_LIMIT - t, qp[..., 1, :])
    out = qp.reshape(*u.shape[:-2], -1, u.shape[-1])[..., :k, :]
    return out


def pair_safe_codes(
    w_view: npt.ArrayLike,
    scale: npt.ArrayLike,
    *,
    qmin: int = -127,
    qmax: int = 127,
    steps: int = 24,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric int8 codes for ``w_view [G, K, N]`` (kernel order) that no uint8 input can saturate.

    Per output column, tries the scale ``scale * alpha`` for ``alpha`` on a geometric grid from 1 to
    ``qmax / 64`` (where plain rounding is 7-bit and needs no constraint), rounds each with
    :func:`constrained_round`, and keeps the alpha of least error ``sum_k (s * q_k - w_k)^2`` (data-free;
    :mod:`quantkit.algorithms.pair_rounding` weighs the choice by the layer's inputs).  Columns that already obey the bound keep their codes
    and scale unchanged.  Returns ``(codes [G, K, N] int8, scale [G, N] float32, changed [G, N])``.
    """
    w = np.asarray(w_view, np.float64)
    g, _, n = w.shape
    s0 = np.broadcast_to(np.asarray(scale, np.float64).reshape(g, n) if np.size(scale) == g * n
                         else np.asarray(scale, np.float64), (g, n)).astype(np.float64)
    q_plain = np.clip(np.rint(w / s0[:, None, :]), qmin, qmax)
    bad = np.asarray(pair_violations(q_plain).any(axis=-2))  # [G, N]
    best_q = q_plain.copy()
    best_s = s0.copy()
    for gi in range(g):  # only the offending columns are searched
        cols = np.flatnonzero(bad[gi])
        if cols.size == 0:
            continue
        wc, sc = w[gi][:, cols], s0[gi, cols]
        best_err = np.full(cols.size, np.inf)
        for alpha in np.geomspace(1.0, qmax / 64.0, steps):
            s = (sc * alpha).astype(np.float32).astype(np.float64)
            q = constrained_round(wc / s, qmin, qmax)
            err = ((q * s - wc) ** 2).sum(axis=0)
            take = err < best_err
            best_err = np.where(take, err, best_err)
            best_s[gi, cols[take]] = s[take]
            best_q[gi][:, cols[take]] = q[:, take]
    return best_q.astype(np.int8), best_s.astype(np.float32), bad


def _padded(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int], pads: tuple[int, int, int, int],
            dilations: tuple[int, int], pad_value: float) -> tuple[np.ndarray, int, int]:
    """``x [N, C, H, W]`` padded with ``pad_value``, and the convolution's output height and width."""
    n, c, h, w = x.shape
    xp = np.full((n, c, h + pads[0] + pads[2], w + pads[1] + pads[3]), pad_value, x.dtype)
    xp[:, :, pads[0] : pads[0] + h, pads[1] : pads[1] + w] = x
    oh = (xp.shape[2] - dilations[0] * (kernel[0] - 1) - 1) // strides[0] + 1
    ow = (xp.shape[3] - dilations[1] * (kernel[1] - 1) - 1) // strides[1] + 1
    return xp, oh, ow


def im2col_nhwc(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int], pads: tuple[int, int, int, int],
                 dilations: tuple[int, int], pad_value: float) -> tuple[np.ndarray, int, int]:
    """``x [N, C, H, W]`` -> ``[N*OH*OW, KH*KW*C]`` (channels fastest), and OH, OW."""
    n, c = x.shape[:2]
    kh, kw = kernel
    xp, oh, ow = _padded(x, kernel, strides, pads, dilations, pad_value)
    cols = np.empty((n, oh, ow, kh, kw, c), x.dtype)
    for i in range(kh):
        for j in range(kw):
            hs, ws = i * dilations[0], j * dilations[1]
            patch = xp[:, :, hs : hs + strides[0] * oh : strides[0], ws : ws + strides[1] * ow : strides[1]]
            cols[:, :, :, i, j, :] = patch.transpose(0, 2, 3, 1)
    return cols.reshape(n * oh * ow, kh * kw * c), oh, ow


def im2col_rows_nhwc(x: np.ndarray, kernel: tuple[int, int], strides: tuple[int, int],
                     pads: tuple[int, int, int, int], dilations: tuple[int, int], pad_value: float,
                     rows: np.ndarray) -> np.ndarray:
    """The rows ``rows`` (flat indices into ``N*OH*OW``) of :func:`im2col_nhwc`, built without the others:
    ``[len(rows), KH*KW*C]`` (channels fastest).  Equal to ``im2col_nhwc(...)[0][rows]``."""
    n, c = x.shape[:2]
    kh, kw = kernel
    xp, oh, ow = _padded(x, kernel, strides, pads, dilations, pad_value)
    b, rem = np.divmod(np.asarray(rows, np.int64), oh * ow)
    r, q = np.divmod(rem, ow)
    hi = r[:, None] * strides[0] + np.arange(kh)[None, :] * dilations[0]  # [R, KH]
    wi = q[:, None] * strides[1] + np.arange(kw)[None, :] * dilations[1]  # [R, KW]
    xt = xp.transpose(0, 2, 3, 1)  # NHWC view
    cols = xt[b[:, None, None], hi[:, :, None], wi[:, None, :]]  # [R, KH, KW, C]
    return cols.reshape(len(rows), kh * kw * c)


def saturating_conv_reference(
    x_codes: np.ndarray, w_codes: np.ndarray, *, group: int = 1, strides: tuple[int, int] = (1, 1),
    pads: tuple[int, int, int, int] = (0, 0, 0, 0), dilations: tuple[int, int] = (1, 1), x_zero_point: int = 0,
    saturate: bool = True,
) -> np.ndarray:
    """Raw int32 accumulators ``sum a*q`` of a 2-D u8 x s8 Conv ``[N, C_out, OH, OW]`` as the
    ``x86-avx2`` kernel forms them (``saturate=True``) or exactly; padding holds the zero point."""
    n = x_codes.shape[0]
    c_out = w_codes.shape[0]
    view = kernel_view(w_codes, "Conv", group=group)
    c_in_g = w_codes.shape[1]
    kernel = (int(w_codes.shape[2]), int(w_codes.shape[3]))
    sat = saturate and not is_depthwise(w_codes.shape, group)
    outs = []
    for gi in range(group):
        xg = x_codes[:, gi * c_in_g : (gi + 1) * c_in_g]
        cols, oh, ow = im2col_nhwc(xg, kernel, strides, pads, dilations, x_zero_point)
        outs.append(emulate_u8s8(cols, view[gi], saturate=sat).reshape(n, oh, ow, -1))
    acc = np.concatenate(outs, axis=-1)  # [N, OH, OW, C_out]
    assert acc.shape[-1] == c_out
    return acc.transpose(0, 3, 1, 2)
