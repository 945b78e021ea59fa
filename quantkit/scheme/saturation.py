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

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

__all__ = [
    "PAIR_LIMIT",
    "emulate_u8s8",
    "constrained_round",
    "conv_saturation_excess",
    "exact_int_matmul",
    "from_kernel_view",
    "im2col_nhwc",
    "is_depthwise",
    "kernel_view",
    "pair_safe_codes",
    "pair_violations",
    "saturating_conv_reference",
    "saturation_excess",
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


_F32_EXACT = 2**24  # float32 holds every integer up to this
_F64_EXACT = 2**53  # float64 likewise: integer sums below these bounds are exact in any order (FMA included)


def _abs_max(x: np.ndarray) -> int:
    """``max |x|`` of an integer array, as a Python int (no widened copy of ``x``)."""
    return max(abs(int(x.max())), abs(int(x.min())))


def exact_int_matmul(a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
    """``a @ b`` of integer arrays (``np.matmul`` broadcasting) as exact int64.

    NumPy's integer matmul has no BLAS and runs ~100x slower than a float one.  A float GEMM whose every
    partial sum is an integer below its exact bound computes each product and sum exactly, whatever the
    summation order, so its result *is* the integer one: float32 over blocks of ``kb`` reduction steps with
    ``kb * max|a| * max|b| < 2**24`` (512 for uint8 x int8 codes; the blocks added in int64), else float64
    when ``K * max|a| * max|b| < 2**53``, else the int64 matmul."""
    a, b = np.asarray(a), np.asarray(b)
    if a.size == 0 or b.size == 0 or a.dtype.kind not in "iub" or b.dtype.kind not in "iub":
        return np.matmul(a.astype(np.int64), b.astype(np.int64))
    k = a.shape[-1]
    step = _abs_max(a) * _abs_max(b)
    if step == 0:
        return np.matmul(a.astype(np.int64), b.astype(np.int64))
    kb = (_F32_EXACT - 1) // step
    if kb >= min(k, 64):  # float32 blocks, each exact
        af, bf = a.astype(np.float32), b.astype(np.float32)
        acc = np.matmul(af[..., :kb], bf[:kb]).astype(np.int64)
        for s in range(kb, k, kb):
            acc += np.matmul(af[..., s : s + kb], bf[s : s + kb]).astype(np.int64)
        return acc
    if k * step < _F64_EXACT:
        return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.int64)
    return np.matmul(a.astype(np.int64), b.astype(np.int64))


def saturation_excess(a: npt.ArrayLike, q: npt.ArrayLike, *, max_elements: int = 1 << 22,
                      rows: int = 32) -> np.ndarray:
    """``sum_j sat16(pair_j) - pair_j`` per accumulator of ``a [M, K] @ q [K, N]`` (int64 ``[M, N]``): what the
    ``x86-avx2`` kernel's int16 pair saturation takes away from the exact sum (0 where it is exact).

    A pair can only clip where its activations are large enough: per block of ``rows`` rows, the largest
    activation at each K position bounds every pair's reach (``amax0 * q0+ + amax1 * q1+`` above, the
    negative parts below; ``max|a|`` and ``|q|`` for inputs of any sign), and only the pairs whose reach
    leaves int16 are formed - at most ``max_elements`` pair values at a time (bounded memory).  Exact: a
    pair left out cannot clip."""
    a, q = np.asarray(a), np.asarray(q)
    m, n = a.shape[0], q.shape[1]
    out = np.zeros(m * n, np.float64)  # bincount's sums: integers far below 2**53, exact
    if m == 0 or n == 0 or q.shape[0] == 0:
        return out.reshape(m, n).astype(np.int64)
    qp = _pairs(q.astype(np.int32))  # [P, 2, N]
    a32 = a.astype(np.int32)
    if a32.shape[1] % 2:
        a32 = np.concatenate([a32, np.zeros((m, 1), np.int32)], axis=1)
    ap = a32.reshape(m, -1, 2)  # [M, P, 2]
    signed = bool(a32.min(initial=0) < 0)

    def largest(x: np.ndarray) -> np.ndarray:
        """The largest activation (``|a|`` for signed inputs) at each K position of rows ``x``: ``[P, 2]``."""
        return (np.abs(x).max(axis=0) if signed else x.max(axis=0)).astype(np.int64)

    def reach(a0: np.ndarray, a1: np.ndarray, q0: np.ndarray, q1: np.ndarray) -> np.ndarray:
        """Pairs ``(q0, q1)`` that activations up to ``(a0, a1)`` can push out of int16."""
        if signed:
            return a0 * np.abs(q0) + a1 * np.abs(q1) > _I16_MAX
        return ((a0 * np.maximum(q0, 0) + a1 * np.maximum(q1, 0) > _I16_MAX)
                | (a0 * np.minimum(q0, 0) + a1 * np.minimum(q1, 0) < _I16_MIN))

    top = largest(ap)
    n_idx, p_idx = np.nonzero(reach(top[:, 0, None], top[:, 1, None], qp[:, 0], qp[:, 1]).T)  # by column
    if n_idx.size == 0:
        return out.reshape(m, n).astype(np.int64)
    q0, q1 = qp[p_idx, 0, n_idx], qp[p_idx, 1, n_idx]  # [V] candidates over all rows
    a0, a1 = np.ascontiguousarray(ap[:, :, 0]), np.ascontiguousarray(ap[:, :, 1])  # [M, P] each: fast gathers
    for s in range(0, m, max(1, rows)):
        blk = ap[s : s + max(1, rows)]
        top = largest(blk)
        keep = np.flatnonzero(reach(top[p_idx, 0], top[p_idx, 1], q0, q1))  # this block's candidates
        if keep.size == 0:
            continue
        pk, nk, k0, k1 = p_idx[keep], n_idx[keep], q0[keep], q1[keep]
        step = max(1, max_elements // keep.size)
        for r in range(0, blk.shape[0], step):
            lo_row, hi_row = s + r, s + min(r + step, blk.shape[0])
            pair = a0[lo_row:hi_row][:, pk] * k0 + a1[lo_row:hi_row][:, pk] * k1  # [rows, V]
            ri, vi = np.nonzero((pair > _I16_MAX) | (pair < _I16_MIN))
            if ri.size:
                v = pair[ri, vi]
                size = (hi_row - lo_row) * n
                out[lo_row * n : lo_row * n + size] += np.bincount(ri * n + nk[vi], minlength=size,
                                                                   weights=np.clip(v, _I16_MIN, _I16_MAX) - v)
    return out.reshape(m, n).astype(np.int64)


def emulate_u8s8(a: npt.ArrayLike, q: npt.ArrayLike, *, saturate: bool = True, chunk: int | None = None,
                 max_elements: int = 1 << 22) -> np.ndarray:
    """``a [M, K]`` uint8 codes times ``q [K, N]`` int8 codes as int32, with (``saturate=True``, the
    ``x86-avx2`` kernel) or without (the exact sum of every other class) the int16 pair saturation.

    Computed as the exact sum (:func:`exact_int_matmul`) plus :func:`saturation_excess` (``chunk``: its rows
    per block): identical to summing every clipped pair, at the cost of the pairs that can clip."""
    a = np.asarray(a)
    q = np.asarray(q)
    acc = exact_int_matmul(a, q)
    if saturate:
        acc += saturation_excess(a, q, max_elements=max_elements, **({} if chunk is None else {"rows": chunk}))
    return acc.astype(np.int32)


def constrained_round(u: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Round targets ``u [..., K, N]`` to codes on ``[qmin, qmax]`` with every same-sign pair obeying
    ``|q0 + q1| <= PAIR_LIMIT``, each pair at least squared error (exact: the cost is a convex
    quadratic along the boundary ``q0 + q1 = +-PAIR_LIMIT``, minimised at the rounded midpoint).

    Only the pairs that break the rule (a few percent) are solved on the boundary; with codes within
    ``[-PAIR_LIMIT, PAIR_LIMIT]`` a pair breaks it exactly when ``|q0 + q1| > PAIR_LIMIT`` (both codes then
    have the sum's sign)."""
    k = u.shape[-2]
    q = np.rint(u)
    np.clip(q, qmin, qmax, out=q)
    qp = _pairs(q)
    q0, q1 = qp[..., 0, :], qp[..., 1, :]
    if qmax <= PAIR_LIMIT and qmin >= -PAIR_LIMIT:
        total = q0 + q1
        pos, neg = total > PAIR_LIMIT, total < -PAIR_LIMIT
    else:
        pos = np.maximum(q0, 0) + np.maximum(q1, 0) > PAIR_LIMIT
        neg = np.minimum(q0, 0) + np.minimum(q1, 0) < -PAIR_LIMIT
    if pos.any() or neg.any():
        up = _pairs(u)
        for mask, bound in ((pos, PAIR_LIMIT), (neg, -PAIR_LIMIT)):
            idx = np.nonzero(mask)
            if not idx[0].size:
                continue
            # the pair on the boundary q0 + q1 = bound: q0 = t, q1 = bound - t, both on [qmin, qmax]
            d = up[..., 0, :][idx].astype(np.float64) - up[..., 1, :][idx].astype(np.float64)
            t = np.clip(np.rint((d + bound) / 2), max(qmin, bound - qmax), min(qmax, bound - qmin))
            q0[idx] = t
            q1[idx] = bound - t
    return qp.reshape(*u.shape[:-2], -1, u.shape[-1])[..., :k, :]


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
    alphas = np.geomspace(1.0, qmax / 64.0, steps)
    # the search in float32 (the scales are float32 already): half the memory traffic of its elementwise passes;
    # the codes are those of float64 division except where a target sits within float32 rounding of a .5 tie
    w32 = w.astype(np.float32)
    k = w.shape[1]
    # columns are searched independently: a slice of them at a time keeps the ~15 elementwise passes per scale
    # over arrays that stay in the CPU caches (the whole layer at once ran at memory speed: 1.5-2x slower)
    width = max(8, _SEARCH_ELEMENTS // max(k, 1))
    for gi in range(g):  # only the offending columns are searched
        all_cols = np.flatnonzero(bad[gi])
        for c0 in range(0, all_cols.size, width):
            cols = all_cols[c0 : c0 + width]
            wc, sc = w32[gi][:, cols], s0[gi, cols]
            best_err = np.full(cols.size, np.inf)
            for alpha in alphas:
                s = (sc * alpha).astype(np.float32)
                q = constrained_round(wc / s, qmin, qmax)
                err = np.square(q * s - wc).sum(axis=0)
                take = err < best_err
                best_err = np.where(take, err, best_err)
                best_s[gi, cols[take]] = s[take]
                best_q[gi][:, cols[take]] = q[:, take]
    return best_q.astype(np.int8), best_s.astype(np.float32), bad


_SEARCH_ELEMENTS = 1 << 15
"""Weights per column slice of :func:`pair_safe_codes`'s scale search (float64: 256 KB per array)."""


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


def _conv_groups(x_codes: np.ndarray, w_codes: np.ndarray, group: int, strides: tuple[int, int],
                 pads: tuple[int, int, int, int], dilations: tuple[int, int], x_zero_point: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, int, int]]:
    """Per group of a 2-D Conv: its im2col rows (NHWC, padding holding the zero point), its weight in kernel
    view ``[K, N_per_group]``, and the output height and width."""
    view = kernel_view(w_codes, "Conv", group=group)
    c_in_g = w_codes.shape[1]
    kernel = (int(w_codes.shape[2]), int(w_codes.shape[3]))
    for gi in range(group):
        xg = x_codes[:, gi * c_in_g : (gi + 1) * c_in_g]
        cols, oh, ow = im2col_nhwc(xg, kernel, strides, pads, dilations, x_zero_point)
        yield cols, view[gi], oh, ow


def saturating_conv_reference(
    x_codes: np.ndarray, w_codes: np.ndarray, *, group: int = 1, strides: tuple[int, int] = (1, 1),
    pads: tuple[int, int, int, int] = (0, 0, 0, 0), dilations: tuple[int, int] = (1, 1), x_zero_point: int = 0,
    saturate: bool = True,
) -> np.ndarray:
    """Raw int32 accumulators ``sum a*q`` of a 2-D u8 x s8 Conv ``[N, C_out, OH, OW]`` as the
    ``x86-avx2`` kernel forms them (``saturate=True``) or exactly; padding holds the zero point."""
    n = x_codes.shape[0]
    sat = saturate and not is_depthwise(w_codes.shape, group)
    outs = [emulate_u8s8(cols, view, saturate=sat).reshape(n, oh, ow, -1)
            for cols, view, oh, ow in _conv_groups(x_codes, w_codes, group, strides, pads, dilations, x_zero_point)]
    acc = np.concatenate(outs, axis=-1)  # [N, OH, OW, C_out]
    assert acc.shape[-1] == w_codes.shape[0]
    return acc.transpose(0, 3, 1, 2)


def conv_saturation_excess(
    x_codes: np.ndarray, w_codes: np.ndarray, *, group: int = 1, strides: tuple[int, int] = (1, 1),
    pads: tuple[int, int, int, int] = (0, 0, 0, 0), dilations: tuple[int, int] = (1, 1), x_zero_point: int = 0,
) -> np.ndarray:
    """:func:`saturation_excess` of a 2-D u8 x s8 Conv, ``[N, C_out, OH, OW]`` int64: the saturating
    accumulators of :func:`saturating_conv_reference` minus the exact ones, without forming either (a
    depthwise Conv never saturates: zeros)."""
    n = x_codes.shape[0]
    if is_depthwise(w_codes.shape, group):
        kernel = (int(w_codes.shape[2]), int(w_codes.shape[3]))
        _, oh, ow = _padded(x_codes[:1, :1], kernel, strides, pads, dilations, x_zero_point)
        return np.zeros((n, w_codes.shape[0], oh, ow), np.int64)
    outs = [saturation_excess(cols, view).reshape(n, oh, ow, -1)
            for cols, view, oh, ow in _conv_groups(x_codes, w_codes, group, strides, pads, dilations, x_zero_point)]
    return np.concatenate(outs, axis=-1).transpose(0, 3, 1, 2)
