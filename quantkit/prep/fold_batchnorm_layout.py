"""Fold a ``BatchNormalization`` that reads a linear layer through a Reshape or Transpose into that layer.

Rule
----
A ``BatchNorm1d`` after a ``Linear`` on a sequence (LeViT's ``MLPLayerWithBN``, many tabular and audio models) is
exported as the product on ``[..., N]`` features, then a layout node that puts the features on BatchNormalization's
channel axis 1, then the BatchNormalization::

    y = MatMul(x, W) [+ b]                 # [..., N], W constant [K, N]
    z = Reshape(y, [M, N])                 # leading axes merged: feature n stays feature n
      | Transpose(y, perm) with perm[1] == rank - 1   # the feature axis moved to axis 1
    out = BatchNormalization(z)            # per channel n: s[n] * (z - mean[n]) + beta[n]

Per feature, BatchNormalization is ``s * z + (beta - s * mean)`` with ``s = gamma / sqrt(var + eps)``, and the
layout node only moves elements without mixing features, so the affine map moves before it into the layer::

    out = Reshape | Transpose (MatMul(x, W * s) + ((b - mean) * s + beta))

exactly the same function up to float rounding (the math in float64).  The BatchNormalization disappears: in the
quantized model it would otherwise run in float after the int8 product (ONNX Runtime's own FP32 graph folds it too,
``MatmulBNFusion``), and the per-channel weight quantization absorbs ``s``.

``fold_batchnorm`` already folds the 2-D case without a layout node.  This pass refuses (and leaves the graph as it
is) when a weight, bias or BatchNormalization parameter is not a constant float32 array, when the weight or bias is
shared, when the product, the sum or the layout node's output has another reader or is a graph output, when the
BatchNormalization's output is a graph output, when it runs in training mode, or when the shapes do not show that
the layout node keeps the features whole (a Reshape whose output is not ``[M, N]`` with the input's last axis
``N``; a Transpose that does not move the last axis to axis 1).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantkit.prep.new_values import NewValues

__all__ = ["fold_batchnorm_through_layout"]

_DEFAULT_EPSILON = 1e-5
_ONNX = ("", "ai.onnx")


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.is_graph_input() or value.const_value is None:
        return None
    return np.asarray(value.const_value.numpy())


def _only_reader(value: ir.Value, node: ir.Node) -> bool:
    """``value`` is read by ``node`` alone (once) and is not a graph output."""
    uses = list(value.uses())
    return not value.is_graph_output() and len(uses) == 1 and uses[0].node is node


def _static(dim: object) -> int | None:
    return dim if isinstance(dim, int) else None


def _keeps_features(layout: ir.Node, n: int) -> bool:
    """The Reshape / Transpose moves the last axis (``n`` features) of its input whole onto its output's axis 1."""
    src, dst = layout.inputs[0], layout.outputs[0]
    if src is None or src.shape is None or len(src.shape) < 2 or _static(src.shape[-1]) != n:
        return False
    if layout.op_type == "Transpose":
        perm_attr = layout.attributes.get("perm")
        if perm_attr is None:  # default: reverse the axes
            perm = list(range(len(src.shape)))[::-1]
        else:
            perm = list(perm_attr.as_ints())
        return len(perm) == len(src.shape) and perm[1] == len(src.shape) - 1
    # Reshape to [M, N]: row-major order keeps element (i..., n) at (flat(i...), n)
    return dst.shape is not None and len(dst.shape) == 2 and _static(dst.shape[1]) == n


def _match(bn: ir.Node) -> tuple[ir.Node, ir.Node, ir.Node | None, np.ndarray, np.ndarray | None] | None:
    """``(layout, matmul, add or None, W, b or None)`` when ``bn`` can be folded, else None."""
    training = bn.attributes.get("training_mode")
    if (training is not None and training.as_int() != 0) or len(bn.inputs) != 5:
        return None
    if bn.outputs[0].is_graph_output() or any(o.uses() or o.is_graph_output() for o in bn.outputs[1:]):
        return None
    params = [_const(v) for v in bn.inputs[1:]]
    if any(p is None or p.dtype != np.float32 or p.ndim != 1 for p in params):
        return None
    n = params[0].shape[0]  # type: ignore[union-attr]
    if any(p.shape != (n,) for p in params):  # type: ignore[union-attr]
        return None
    z = bn.inputs[0]
    layout = z.producer() if z is not None else None
    if layout is None or layout.op_type not in ("Reshape", "Transpose") or layout.domain not in _ONNX:
        return None
    if not _only_reader(z, bn) or not _keeps_features(layout, n):  # type: ignore[arg-type]
        return None
    y = layout.inputs[0]
    prod = y.producer() if y is not None else None
    if prod is None or prod.domain not in _ONNX or not _only_reader(y, layout):  # type: ignore[arg-type]
        return None
    add: ir.Node | None = None
    bias: np.ndarray | None = None
    if prod.op_type == "Add":
        add = prod
        a_in, b_in = add.inputs[0], add.inputs[1]
        mm_in, bias_v = (a_in, b_in) if _const(b_in) is not None else (b_in, a_in)
        bias = _const(bias_v)
        if bias is None or bias_v is None or len(list(bias_v.uses())) != 1:
            return None
        if bias.size not in (1, n) or (bias.size == n and any(d != 1 for d in bias.shape[:-1])):
            return None
        mm = mm_in.producer() if mm_in is not None else None
        if mm is None or not _only_reader(mm_in, add):  # type: ignore[arg-type]
            return None
    else:
        mm = prod
    if mm.op_type != "MatMul" or mm.domain not in _ONNX:
        return None
    w_v = mm.inputs[1]
    w = _const(w_v)
    if w is None or w_v is None or w.dtype != np.float32 or w.ndim != 2 or w.shape[1] != n:
        return None
    if len(list(w_v.uses())) != 1:
        return None
    return layout, mm, add, w, bias


def fold_batchnorm_through_layout(model: ir.Model) -> int:
    """Apply the rule of the module doc to every eligible ``BatchNormalization`` of ``model``'s main graph (in
    place); returns how many were folded."""
    graph = model.graph
    new = NewValues(graph)
    unique, initializer = new.unique, new.initializer

    done = 0
    for bn in list(graph):
        if bn.op_type != "BatchNormalization" or bn.domain not in _ONNX:
            continue
        got = _match(bn)
        if got is None:
            continue
        layout, mm, add, w, bias = got
        gamma, beta, mean, var = (np.asarray(_const(v), np.float64) for v in bn.inputs[1:])
        eps_attr = bn.attributes.get("epsilon")
        eps = eps_attr.as_float() if eps_attr is not None else _DEFAULT_EPSILON
        with np.errstate(all="ignore"):
            s = gamma / np.sqrt(var + eps)
        if not np.all(np.isfinite(s)):
            continue
        b = np.zeros_like(mean) if bias is None else np.broadcast_to(bias.reshape(-1).astype(np.float64),
                                                                    mean.shape)
        new_w = (w.astype(np.float64) * s[None, :]).astype(np.float32)
        new_b = ((b - mean) * s + beta).astype(np.float32)
        w_v = mm.inputs[1]
        assert w_v is not None
        mm.replace_input_with(1, initializer(f"{w_v.name}_bn_folded", new_w))
        if add is not None:
            idx = 1 if _const(add.inputs[1]) is not None else 0
            add.replace_input_with(idx, initializer(f"{bn.name}_bias", new_b))
        else:
            new_add = ir.node("Add", [mm.outputs[0], initializer(f"{bn.name}_bias", new_b)],
                              name=unique(f"{bn.name}_bias_add"))
            new_add.outputs[0].name = unique(f"{mm.outputs[0].name}_biased")
            if mm.outputs[0].dtype is not None:
                new_add.outputs[0].dtype = mm.outputs[0].dtype
            new_add.outputs[0].shape = mm.outputs[0].shape
            graph.insert_after(mm, new_add)
            layout.replace_input_with(0, new_add.outputs[0])
        bn.outputs[0].replace_all_uses_with(layout.outputs[0])
        graph.remove(bn, safe=True)
        done += 1
    return done
