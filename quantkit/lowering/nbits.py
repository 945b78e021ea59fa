"""Weight-only INT4/INT8 lowering of ``MatMul(x, W)`` layers (``onnx_ir`` edits, in place).

Three forms, all reading a :class:`~quantkit.algorithms.woq.WOQResult` (codes ``[K, N]`` on
``[0, 2^b - 1]``, scales / zero points ``[kb, N]``, ``kb = ceil(K / g)``)::

    W_hat[k, n] = (codes[k, n] - zp[k // g, n]) * scales[k // g, n]

* :func:`lower_matmul_nbits` -> ``com.microsoft.MatMulNBits(x, B, scales[, zero_points])`` with
  ``B`` uint8 ``[N, kb, g * b / 8]`` (column ``n``'s codes along K, blocks of ``g``, the last
  block padded with the zero point; 4-bit: first element in the low nibble), scales
  ``[N, kb]`` float32 and 4-bit zero points packed ``[N, ceil(kb / 2)]`` (8-bit: ``[N, kb]``),
  omitted when they all equal the default ``2^(b-1)``.
* :func:`lower_dq_matmul` -> opset-21 ``DequantizeLinear(axis=0, block_size=g)`` of an INT4/UINT4
  (INT8/UINT8) ``[K, N]`` initializer feeding the MatMul.  Symmetric results are stored signed
  (``code - 2^(b-1)``, no zero point), asymmetric ones unsigned with their zero points.  ORT
  fuses it into ``MatMulNBits`` at ORT_ENABLE_EXTENDED (at accuracy level 4 unless the session
  config ``session.qdq_matmulnbits_accuracy_level`` says otherwise).
* :func:`lower_tied_embedding` -> one packed uint8 table ``[V, Hp / 2]`` shared by
  ``com.microsoft.GatherBlockQuantized`` (the embedding) and, through a ``Reshape`` to
  ``[V, kb, g / 2]``, by ``MatMulNBits`` (the tied lm_head).  ``Hp`` is ``H`` rounded up to a
  multiple of ``g`` (``MatMulNBits`` needs whole blocks in the 3-D view); when ``Hp > H`` a
  ``Slice`` drops the padding after the gather.

An input scale ``s`` (AWQ: ``y = (x / s) @ W_hat``) is applied by :func:`apply_input_scale`:
folded into the constant weight (and bias) of a preceding ``SimplifiedLayerNormalization`` /
``LayerNormalization`` / ``SkipSimplifiedLayerNormalization`` / ``SkipLayerNormalization`` (their
normalized output 0 only: the skip-sum output 3 is not scaled) / ``Mul``-by-constant when all consumers of ``x`` are the layers that
share ``s``, else as one inserted ``Mul(x, 1 / s)``.  The float weights are removed when no
other node reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from quantkit.algorithms.woq import WOQResult
from quantkit.errors import ModelError, UnsupportedOpError
from quantkit.lowering.qdq import _Namer
from quantkit.lowering.select import constant_array
from quantkit.scheme.packing import pack_int4

__all__ = [
    "apply_input_scale",
    "lower_dq_matmul",
    "lower_matmul_nbits",
    "lower_tied_embedding",
    "matmul_nbits_arrays",
    "nbits_block_size",
]

_NORMS = {
    "SimplifiedLayerNormalization": (1, None),
    "LayerNormalization": (1, 2),
    # com.microsoft, residual add inside: y = norm(x + skip [+ bias]) * gamma [+ beta] is output 0 and the
    # sum x + skip is output 3; scaling gamma (and beta) scales output 0 only - the residual stream is untouched
    "SkipSimplifiedLayerNormalization": (2, None),
    "SkipLayerNormalization": (2, 3),
}  # op -> (gamma, beta) input; only output 0 (the normalized tensor) is scaled


def _find(graph: ir.Graph, name: str, ops: Sequence[str]) -> ir.Node:
    for node in graph:
        if node.name == name:
            if node.op_type not in ops:
                raise UnsupportedOpError(f"node {name!r} is a {node.op_type}; expected one of {list(ops)}")
            return node
    raise ModelError(f"no node named {name!r} in the graph")


def _const(graph: ir.Graph, namer: _Namer, base: str, value: np.ndarray | ir.TensorProtocol) -> ir.Value:
    t = value if not isinstance(value, np.ndarray) else ir.tensor(value)
    v = ir.Value(name=namer(base), const_value=t)
    t.name = v.name
    graph.register_initializer(v)
    return v


def _drop_if_unused(graph: ir.Graph, v: ir.Value | None) -> None:
    if v is None or v.name is None or list(v.uses()) or v.is_graph_output():
        return
    if graph.initializers.get(v.name) is v:
        del graph.initializers[v.name]


def _replace_node(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """Insert ``new`` before ``old``, move ``old``'s outputs (names, uses, graph-output slots) to ``new``'s, in
    order, remove ``old``."""
    graph.insert_before(old, new)
    for out, nout in zip(old.outputs, new.outputs, strict=True):
        nout.type, nout.shape = out.type, out.shape
        out.replace_all_uses_with(nout, replace_graph_outputs=True)
        name = out.name
        out.name = None
        nout.name = name
    graph.remove(old, safe=True)


def nbits_block_size(res: WOQResult) -> int:
    """The ``MatMulNBits`` block size for ``res``: its group size (a power of two >= 16), or for
    one group per column (``group_size == K``) the next power of two >= K (the last block padded)."""
    K, _ = res.shape
    g = res.group_size
    if g >= 16 and g & (g - 1) == 0:
        return g
    if g >= K:
        return max(16, 1 << (K - 1).bit_length())
    raise UnsupportedOpError(f"MatMulNBits needs a power-of-two block size >= 16; got group_size={g} (K={K})")


def matmul_nbits_arrays(res: WOQResult) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """``(B, scales, zero_points or None, block_size)`` in ``MatMulNBits`` layout (see the module docstring)."""
    K, N = res.shape
    bs = nbits_block_size(res)
    kb = -(-K // bs)
    if kb != res.scales.shape[0]:
        raise UnsupportedOpError(f"group_size={res.group_size} does not map onto MatMulNBits blocks of {bs}")
    mid = 1 << (res.bits - 1)
    # transposed (and for 4 bits packed) in row blocks of ~16 MB of codes: the only array of the weight's size
    # made here is B (a tied embedding's codes are hundreds of millions of values)
    width = kb * bs
    B = np.empty((N, kb, bs // 2 if res.bits == 4 else bs), np.uint8)
    step = max(1, (16 << 20) // width)
    for r in range(0, N, step):
        codes_t = np.full((min(step, N - r), width), 0, np.uint8)
        codes_t[:, :K] = res.codes[:, r : r + step].T
        codes_t[:, K:] = res.zero_points[-1][r : r + step, None]  # padding dequantizes to 0
        B[r : r + step] = (pack_int4(codes_t) if res.bits == 4 else codes_t).reshape(len(codes_t), kb, -1)
    scales = np.ascontiguousarray(res.scales.T, dtype=np.float32)
    zp: np.ndarray | None
    if np.all(res.zero_points == mid):
        zp = None
    elif res.bits == 4:
        zt = np.zeros((N, kb + kb % 2), np.uint8)
        zt[:, :kb] = res.zero_points.T
        zp = pack_int4(zt).reshape(N, (kb + 1) // 2)
    else:
        zp = np.ascontiguousarray(res.zero_points.T)
    return B, scales, zp, bs


def apply_input_scale(model: ir.Model, node_names: Sequence[str], s: np.ndarray) -> str:
    """Make the layers ``node_names`` (which read the same ``x``) compute on ``x / s`` (``s`` ``[K]``).

    Folds ``1 / s`` into the gamma (and beta) of a preceding ``SimplifiedLayerNormalization`` /
    ``LayerNormalization`` / ``Skip(Simplified)LayerNormalization`` (whose output 0 is ``x``) or into the constant of a preceding ``Mul`` when every consumer of ``x``
    is one of ``node_names``; otherwise inserts one ``Mul(x, 1 / s)``.  Returns what it did.
    """
    graph = model.graph
    namer = _Namer(graph)
    nodes = [_find(graph, n, ("MatMul", "MatMulNBits")) for n in node_names]
    x = nodes[0].inputs[0]
    if x is None or any(n.inputs[0] is not x for n in nodes):
        raise ModelError(
            f"layers {list(node_names)} do not share one input; they cannot share an input scale"
        )
    s = np.asarray(s, np.float32)
    inv = (np.float32(1.0) / s).astype(np.float32)
    users = {id(u.node) for u in x.uses()}
    prod = x.producer()
    exclusive = users == {id(n) for n in nodes} and not x.is_graph_output()
    if exclusive and prod is not None and prod.outputs[0] is x:
        if prod.op_type in _NORMS:
            gi, bi = _NORMS[prod.op_type]
            gamma = constant_array(prod.inputs[gi]) if len(prod.inputs) > gi else None
            if gamma is not None and gamma.shape in ((s.size,), (), (1,)):
                prod.replace_input_with(
                    gi, _const(graph, namer, f"{prod.name}_gamma_awq", (gamma / s).astype(gamma.dtype))
                )
                beta = constant_array(prod.inputs[bi]) if bi is not None and len(prod.inputs) > bi else None
                if beta is not None and bi is not None:
                    prod.replace_input_with(
                        bi, _const(graph, namer, f"{prod.name}_beta_awq", (beta / s).astype(beta.dtype))
                    )
                return f"1/s folded into {prod.op_type} {prod.name!r}"
        if prod.op_type == "Mul" and prod.domain == "":
            for ci in (0, 1):
                c = constant_array(prod.inputs[ci])
                other = prod.inputs[1 - ci]
                if c is None or other is None or constant_array(other) is not None:
                    continue
                if c.ndim == 0 or c.shape[-1] in (1, s.size):
                    prod.replace_input_with(
                        ci, _const(graph, namer, f"{prod.name}_awq", (c / s).astype(c.dtype))
                    )
                    return f"1/s folded into Mul {prod.name!r}"
    inv_v = _const(graph, namer, f"{nodes[0].name}_input_scale_inv", inv)
    mul = ir.node(
        "Mul",
        [x, inv_v],
        name=namer(f"{nodes[0].name}_input_scale"),
        outputs=[ir.Value(name=namer(f"{x.name}_awq_scaled"), type=x.type, shape=x.shape)],
    )
    graph.insert_before(nodes[0], mul)
    for n in nodes:
        n.replace_input_with(0, mul.outputs[0])
    return "Mul(x, 1/s) inserted"


def _weight_of(node: ir.Node, res: WOQResult) -> ir.Value:
    w = node.inputs[1]
    arr = constant_array(w)
    if w is None or arr is None:
        raise UnsupportedOpError(f"MatMul {node.name!r}: the weight (input 1) is not a constant")
    if arr.shape != res.shape:
        raise ModelError(f"MatMul {node.name!r}: weight shape {arr.shape} != quantized shape {res.shape}")
    return w


def _start_lowering(
    model: ir.Model, node_name: str, res: WOQResult, apply_scale: bool
) -> tuple[ir.Graph, ir.Node, ir.Value, _Namer]:
    """Find the MatMul and its weight, apply ``res.input_scale`` unless shared; common to both lowerings."""
    graph = model.graph
    node = _find(graph, node_name, ("MatMul",))
    w = _weight_of(node, res)
    if res.input_scale is not None and apply_scale:
        apply_input_scale(model, [node_name], res.input_scale)
    return graph, node, w, _Namer(graph)


def lower_matmul_nbits(
    model: ir.Model,
    node_name: str,
    res: WOQResult,
    *,
    accuracy_level: int = 4,
    apply_scale: bool = True,
) -> ir.Node:
    """Replace ``MatMul(x, W)`` named ``node_name`` by ``com.microsoft.MatMulNBits``; return the new node.

    ``apply_scale=False`` skips ``res.input_scale`` (the caller already applied a shared one).
    """
    graph, node, w, namer = _start_lowering(model, node_name, res, apply_scale)
    K, N = res.shape
    B, scales, zp, bs = matmul_nbits_arrays(res)
    base = w.name or node_name
    inputs = [
        node.inputs[0],
        _const(graph, namer, f"{base}_Q{res.bits}", B),
        _const(graph, namer, f"{base}_scales", scales),
    ]
    if zp is not None:
        inputs.append(_const(graph, namer, f"{base}_zero_points", zp))
    new = ir.node(
        "MatMulNBits",
        inputs,
        domain="com.microsoft",
        name=node.name,
        attributes={"K": K, "N": N, "bits": res.bits, "block_size": bs, "accuracy_level": accuracy_level},
        outputs=[ir.Value(name=None)],
    )
    _replace_node(graph, node, new)
    _drop_if_unused(graph, w)
    model.opset_imports.setdefault("com.microsoft", 1)
    return new


def lower_dq_matmul(model: ir.Model, node_name: str, res: WOQResult, *, apply_scale: bool = True) -> ir.Node:
    """Feed ``MatMul`` ``node_name`` from an opset-21 blocked ``DequantizeLinear`` of the int weight; return the DQ."""
    graph, node, w, namer = _start_lowering(model, node_name, res, apply_scale)
    K, N = res.shape
    mid = 1 << (res.bits - 1)
    base = w.name or node_name
    wq: ir.TensorProtocol
    zp_t: ir.TensorProtocol | None = None
    if res.symmetric and np.all(res.zero_points == mid):
        signed = res.codes.astype(np.int16) - mid
        if res.bits == 4:
            wq = ir.PackedTensor(pack_int4(signed.astype(np.int8)), ir.DataType.INT4, shape=[K, N])
        else:
            wq = ir.tensor(signed.astype(np.int8))
    elif res.bits == 4:
        wq = ir.PackedTensor(pack_int4(res.codes), ir.DataType.UINT4, shape=[K, N])
        zp_t = ir.PackedTensor(
            pack_int4(res.zero_points), ir.DataType.UINT4, shape=list(res.zero_points.shape)
        )
    else:
        wq = ir.tensor(res.codes)
        zp_t = ir.tensor(res.zero_points)
    inputs = [
        _const(graph, namer, f"{base}_quantized", wq),
        _const(graph, namer, f"{base}_scale", res.scales),
    ]
    if zp_t is not None:
        inputs.append(_const(graph, namer, f"{base}_zero_point", zp_t))
    dq = ir.node(
        "DequantizeLinear",
        inputs,
        attributes={"axis": 0, "block_size": res.group_size},
        name=namer(f"{node_name}_weight_DequantizeLinear"),
        outputs=[ir.Value(name=namer(f"{base}_dequantized"))],
    )
    graph.insert_before(node, dq)
    node.replace_input_with(1, dq.outputs[0])
    _drop_if_unused(graph, w)
    if model.opset_imports.get("", 0) < 21:
        model.opset_imports[""] = 21  # blocked DequantizeLinear, INT4/UINT4
    return dq


def _tied_table(gather: ir.Node, lm: ir.Node) -> tuple[ir.Value, ir.Value, ir.Node | None, np.ndarray]:
    """``(E value, lm_head weight value, Transpose node or None, E)`` after checking that they are tied."""
    e_val, b_val = gather.inputs[0], lm.inputs[1]
    E = constant_array(e_val)
    if e_val is None or b_val is None or E is None or E.ndim != 2:
        raise UnsupportedOpError(f"Gather {gather.name!r}: the table is not a constant 2-D initializer")
    ax = gather.attributes.get("axis")
    if ax is not None and ax.as_int() != 0:
        raise UnsupportedOpError(f"Gather {gather.name!r}: axis {ax.as_int()} is not 0")
    tr = b_val.producer()
    if tr is not None and tr.op_type == "Transpose" and tr.domain == "":
        perm = tr.attributes.get("perm")
        src = constant_array(tr.inputs[0])
        if (perm is None or list(perm.as_ints()) == [1, 0]) and (
            tr.inputs[0] is e_val or (src is not None and np.array_equal(src, E))
        ):
            return e_val, b_val, tr, E
    Bt = constant_array(b_val)
    if Bt is not None and Bt.shape == E.shape[::-1] and np.array_equal(Bt, E.T):
        return e_val, b_val, None, E
    raise ModelError(
        f"lm_head {lm.name!r} does not read the transpose of the table of Gather {gather.name!r}"
    )


def lower_tied_embedding(
    model: ir.Model,
    gather_node: str,
    lm_head_node: str,
    res: WOQResult,
    *,
    accuracy_level: int = 4,
) -> tuple[ir.Node, ir.Node]:
    """Quantize a tied embedding table ``E`` ``[V, H]`` once for the ``Gather`` and the lm_head.

    ``res`` is the quantized lm_head weight ``E^T`` ``[H, V]`` (4- or 8-bit, groups along H, no
    input scale).  Both kernels read one uint8 initializer: ``[V, Hp * bits / 8]`` for the
    gather, and the same bytes through a ``Reshape`` to ``[V, kb, block * bits / 8]`` for
    ``MatMulNBits``.  Returns ``(GatherBlockQuantized node, MatMulNBits node)``.
    """
    graph = model.graph
    gather = _find(graph, gather_node, ("Gather",))
    lm = _find(graph, lm_head_node, ("MatMul",))
    e_val, b_val, tr, E = _tied_table(gather, lm)
    V, H = E.shape
    if res.shape != (H, V):
        raise ModelError(f"tied embedding: quantized shape {res.shape} != lm_head weight shape {(H, V)}")
    if res.bits not in (4, 8) or res.input_scale is not None:
        raise UnsupportedOpError(
            f"tied embedding: needs a 4- or 8-bit result without an input scale (got {res.bits}-bit"
            f"{', AWQ input scale' if res.input_scale is not None else ''})"
        )
    bits = res.bits
    bs = res.group_size
    if bs < 16 or bs & (bs - 1):
        raise UnsupportedOpError(f"tied embedding: block size {bs} is not a power of two >= 16")
    namer = _Namer(graph)
    data, scales, zp, _ = matmul_nbits_arrays(res)  # [V, kb, bs/2]: row v of E along H
    kb = data.shape[1]
    Hp = kb * bs
    base = e_val.name or gather_node
    data_v = _const(graph, namer, f"{base}_Q{bits}", data.reshape(V, Hp * bits // 8))
    scales_v = _const(graph, namer, f"{base}_scales", scales)
    zp_v = _const(graph, namer, f"{base}_zero_points", zp) if zp is not None else None

    g_inputs = [data_v, gather.inputs[1], scales_v] + ([zp_v] if zp_v is not None else [])
    gbq = ir.node(
        "GatherBlockQuantized",
        g_inputs,
        domain="com.microsoft",
        name=gather.name,
        attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": bs, "bits": bits},
        outputs=[ir.Value(name=None)],
    )
    if Hp == H:
        _replace_node(graph, gather, gbq)
    else:
        gbq.outputs[0].name = namer(f"{gather.name}_padded")
        graph.insert_before(gather, gbq)
        zero = _const(graph, namer, f"{gather.name}_slice_start", np.array([0], np.int64))
        end = _const(graph, namer, f"{gather.name}_slice_end", np.array([H], np.int64))
        axis = _const(graph, namer, f"{gather.name}_slice_axis", np.array([-1], np.int64))
        sl = ir.node(
            "Slice",
            [gbq.outputs[0], zero, end, axis],
            name=namer(f"{gather.name}_unpad"),
            outputs=[ir.Value(name=None)],
        )
        _replace_node(graph, gather, sl)

    shape_v = _const(graph, namer, f"{base}_Q{bits}_blocks_shape", np.array([V, kb, bs * bits // 8], np.int64))
    reshape = ir.node(
        "Reshape",
        [data_v, shape_v],
        name=namer(f"{lm.name}_weight_view"),
        outputs=[ir.Value(name=namer(f"{base}_Q{bits}_blocks"))],
    )
    graph.insert_before(lm, reshape)
    mm_inputs = [lm.inputs[0], reshape.outputs[0], scales_v] + ([zp_v] if zp_v is not None else [])
    mm = ir.node(
        "MatMulNBits",
        mm_inputs,
        domain="com.microsoft",
        name=lm.name,
        attributes={"K": H, "N": V, "bits": bits, "block_size": bs, "accuracy_level": accuracy_level},
        outputs=[ir.Value(name=None)],
    )
    _replace_node(graph, lm, mm)
    if tr is not None and not list(tr.outputs[0].uses()) and not tr.outputs[0].is_graph_output():
        src = tr.inputs[0]
        graph.remove(tr, safe=True)
        _drop_if_unused(graph, src)
    _drop_if_unused(graph, b_val)
    _drop_if_unused(graph, e_val)
    model.opset_imports.setdefault("com.microsoft", 1)
    return gbq, mm
