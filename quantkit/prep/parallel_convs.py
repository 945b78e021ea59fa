"""Merge parallel convolutions of one input that are summed into one convolution.

Rule
----
Re-parameterisable blocks (RepVGG, ACNet's asymmetric convolutions, MobileOne, TextNet, YOLOv6/v7's ``RepConv`` in
their training form) sum branches that convolve the *same* input: ``Conv3x3(x) + Conv1x3(x) + Conv3x1(x)`` (each
BatchNorm already folded into its Conv by :mod:`quantkit.prep.fold_batchnorm`).  Convolution is linear in its
weights, so when the branches sample one grid of input positions the sum is one convolution::

    Conv(W_a, x) + Conv(W_b, x) = Conv(W_a' + W_b', x)      (W' : each kernel zero-padded into the common window)

In a quantized model the branches cost one ``QLinearConv`` each and the sum a float ``Add`` between
DequantizeLinear / QuantizeLinear nodes (an ``Add`` of int8 branches whose sum a float op also reads stays float);
merged, the block is one ``QLinearConv`` - one rounding of the output instead of one per branch, and the int8
chain goes on through it.

``Add(Conv_a(x), Conv_b(x))`` is rewritten when: both Convs are default-domain, read the same value ``x`` with
constant float weights (and constant biases or none), have the same ``group``, ``strides``, output channels and
dilation on every axis where both have more than one tap, no ``auto_pad``, and each is read by the ``Add`` alone; and their windows lie on one grid - per
spatial axis, the first tap ``-pad_begin`` of both on the same lattice of the dilation, the combined window's end
padding the same from both branches (so the output size is unchanged).  The merged Conv takes the first branch's
name (recipe overrides by name keep matching) and replaces the ``Add``; a sum of three or more branches
(``(a + b) + c``) merges pairwise until no rule applies.  The result equals the sum up to float rounding (the
weights are added in float64).  A BatchNorm branch of ``x`` itself (RepVGG's identity branch) becomes a depth-wise
1x1 Conv beside the block (:func:`identity_branches_as_convs`), an int8 layer whose sum with the block is a
``QLinearAdd``, but is *not* merged into the block's kernel: an identity folded into the kernel widens each
channel's weight range to the identity's weight, which costs 8-bit weights their resolution (the known
post-training-quantization failure of re-parameterised RepVGG).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

__all__ = ["merge_parallel_convs"]


def _ints(node: ir.Node, key: str, default: list[int]) -> list[int]:
    a = node.attributes.get(key)
    return list(a.as_ints()) if a is not None else default


def _conv_parts(node: ir.Node) -> tuple[np.ndarray, np.ndarray | None] | None:
    """``(W, b)`` of a default-domain Conv with a constant float weight (and constant bias or none), else None."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    w = node.inputs[1]
    if w is None or w.const_value is None or w.is_graph_input():
        return None
    arr = np.asarray(w.const_value.numpy())
    if arr.dtype != np.float32 or arr.ndim < 3:
        return None
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    if bias is None:
        return arr, None
    if bias.const_value is None or bias.is_graph_input():
        return None
    b = np.asarray(bias.const_value.numpy())
    return (arr, b) if b.dtype == np.float32 and b.shape == (arr.shape[0],) else None


def _merge_plan(a: ir.Node, b: ir.Node, wa: np.ndarray, wb: np.ndarray
                ) -> tuple[list[int], list[int], list[tuple[int, int]], list[int]] | None:
    """``(kernel, pads, [(offset_a, offset_b) per axis], dilations)`` of the merged Conv, or None when the windows do not
    lie on one grid (module doc)."""
    if a.attributes.get("auto_pad") is not None and a.attributes["auto_pad"].as_string() not in ("", "NOTSET"):
        return None
    if b.attributes.get("auto_pad") is not None and b.attributes["auto_pad"].as_string() not in ("", "NOTSET"):
        return None
    nd = wa.ndim - 2
    if wb.ndim != wa.ndim or wa.shape[:2] != wb.shape[:2]:
        return None
    ga, gb = a.attributes.get("group"), b.attributes.get("group")
    if (ga.as_int() if ga is not None else 1) != (gb.as_int() if gb is not None else 1):
        return None
    if _ints(a, "strides", [1] * nd) != _ints(b, "strides", [1] * nd):
        return None
    ka, kb = wa.shape[2:], wb.shape[2:]
    da, db = _ints(a, "dilations", [1] * nd), _ints(b, "dilations", [1] * nd)
    dil = []  # per axis: the dilation of the branches with more than one tap there (a 1-tap axis has none)
    for d in range(nd):
        taps = {x for x, k in ((da[d], ka[d]), (db[d], kb[d])) if k > 1}
        if len(taps) > 1:
            return None
        dil.append(taps.pop() if taps else 1)
    pa, pb = _ints(a, "pads", [0] * 2 * nd), _ints(b, "pads", [0] * 2 * nd)
    kernel, begin, end, offsets = [], [], [], []
    for d in range(nd):
        start_a, start_b = -pa[d], -pb[d]
        stop_a, stop_b = start_a + dil[d] * (ka[d] - 1), start_b + dil[d] * (kb[d] - 1)
        if (start_a - start_b) % dil[d]:
            return None
        lo, hi = min(start_a, start_b), max(stop_a, stop_b)
        end_a, end_b = pa[nd + d] + (hi - stop_a), pb[nd + d] + (hi - stop_b)
        if end_a != end_b or end_a < 0 or -lo < 0:
            return None
        kernel.append((hi - lo) // dil[d] + 1)
        begin.append(-lo)
        end.append(end_a)
        offsets.append(((start_a - lo) // dil[d], (start_b - lo) // dil[d]))
    return kernel, begin + end, offsets, dil


def _embed(w: np.ndarray, kernel: list[int], offs: list[int]) -> np.ndarray:
    out = np.zeros((*w.shape[:2], *kernel), np.float64)
    out[(slice(None), slice(None), *(slice(o, o + k) for o, k in zip(offs, w.shape[2:], strict=True)))] = w
    return out


def _only_reader(v: ir.Value, node: ir.Node) -> bool:
    uses = list(v.uses())
    return not v.is_graph_output() and len(uses) == 1 and uses[0].node is node


_EPS = 1e-5


def _affine_branch(bn: ir.Node) -> tuple[np.ndarray, np.ndarray] | None:
    """``(a, b)`` of an inference-mode ``BatchNormalization`` with constant float parameters (``a x + b`` per channel),
    else None."""
    mode = bn.attributes.get("training_mode")
    if (bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or len(bn.inputs) != 5
            or (mode is not None and mode.as_int() != 0) or any(o.uses() for o in bn.outputs[1:])):  # fmt: skip
        return None
    params = []
    for v in bn.inputs[1:]:
        if v is None or v.const_value is None or v.is_graph_input():
            return None
        params.append(np.asarray(v.const_value.numpy(), np.float64))
    if any(p.ndim != 1 or p.shape != params[0].shape for p in params):
        return None
    gamma, beta, mean, var = params
    eps = bn.attributes["epsilon"].as_float() if "epsilon" in bn.attributes else _EPS
    a = gamma / np.sqrt(var + eps)
    return (a, beta - a * mean) if np.all(np.isfinite(a)) else None


def identity_branches_as_convs(model: ir.Model) -> set[str]:
    """A BatchNorm branch of a re-parameterisable block - ``Add(Conv(x), BatchNormalization(x))``, ``x`` 4-D - becomes
    a depth-wise 1x1 ``Conv`` (weight ``a``, bias ``b`` per channel: the same function), so it quantizes like a
    convolution (one weight per channel: exact on a per-channel grid) and the ``Add`` joins the int8 chain; a float
    BatchNorm island there cost a DequantizeLinear, the float op and Transposes out of the int8 layout and back.
    Returns the names of the new Convs (never merged into the block's kernel: module doc)."""
    from quantkit.lowering.nbits import _replace_node
    from quantkit.prep.new_values import NewValues

    graph = model.graph
    new = NewValues(graph)
    made: set[str] = set()
    for bn in list(graph):
        affine = _affine_branch(bn)
        x, y = (bn.inputs[0] if bn.inputs else None), bn.outputs[0]
        if affine is None or x is None or x.shape is None or len(x.shape) != 4 or y.is_graph_output():
            continue
        uses = list(y.uses())
        if len(uses) != 1 or uses[0].node.op_type != "Add" or len(uses[0].node.inputs) != 2:
            continue
        other = uses[0].node.inputs[1 - uses[0].idx]
        sib = other.producer() if other is not None else None
        if sib is None or _conv_parts(sib) is None or sib.inputs[0] is not x:
            continue
        a, b = affine
        c = a.shape[0]
        base = bn.name or "batchnorm"
        w = new.initializer(f"{base}_as_conv_weight", a.astype(np.float32).reshape(c, 1, 1, 1))
        bias = new.initializer(f"{base}_as_conv_bias", b.astype(np.float32))
        conv = ir.node("Conv", [x, w, bias], attributes={"group": c, "kernel_shape": [1, 1]}, name=bn.name)
        bn.name = None
        _replace_node(graph, bn, conv)
        made.add(conv.name or "")
    return made


def merge_parallel_convs(model: ir.Model) -> int:
    """Merge every ``Add(Conv_a(x), Conv_b(x))`` the module doc allows, until none is left, then make the BatchNorm
    branches beside the merged blocks depth-wise Convs (:func:`identity_branches_as_convs`; never merged); returns
    how many rewrites."""
    done = _merge_pairs(model, set())
    keep = identity_branches_as_convs(model)
    return done + len(keep) + (_merge_pairs(model, keep) if keep else 0)


def _merge_pairs(model: ir.Model, keep: set[str]) -> int:
    from quantkit.lowering.nbits import _drop_if_unused, _replace_node
    from quantkit.prep.new_values import NewValues

    graph = model.graph
    new = NewValues(graph)
    done = 0
    changed = True
    while changed:
        changed = False
        for add in list(graph):
            if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
                continue
            va, vb = add.inputs
            a, b = (v.producer() if v is not None else None for v in (va, vb))
            if a is None or b is None or a is b or va is None or vb is None or {a.name, b.name} & keep:
                continue
            pa, pb = _conv_parts(a), _conv_parts(b)
            if pa is None or pb is None or a.inputs[0] is None or a.inputs[0] is not b.inputs[0]:
                continue
            if not (_only_reader(va, add) and _only_reader(vb, add)):
                continue
            plan = _merge_plan(a, b, pa[0], pb[0])
            if plan is None:
                continue
            kernel, pads, offsets, dil = plan
            w = _embed(pa[0], kernel, [o[0] for o in offsets]) + _embed(pb[0], kernel, [o[1] for o in offsets])
            bias = np.zeros(pa[0].shape[0], np.float64)
            for part in (pa[1], pb[1]):
                if part is not None:
                    bias += part
            base = a.name or "conv"
            inputs = [a.inputs[0], new.initializer(f"{base}_merged_weight", w.astype(np.float32))]
            if pa[1] is not None or pb[1] is not None:
                inputs.append(new.initializer(f"{base}_merged_bias", bias.astype(np.float32)))
            attrs: dict[str, Any] = {"kernel_shape": kernel, "pads": pads,
                                        "strides": _ints(a, "strides", [1] * len(kernel)),
                                        "dilations": dil}
            g = a.attributes.get("group")
            if g is not None:
                attrs["group"] = g.as_int()
            conv = ir.node("Conv", inputs, attributes=attrs, name=a.name)
            conv.metadata_props.update(a.metadata_props)
            old = [x for n in (a, b) for x in n.inputs[1:] if x is not None]
            a.name = None
            _replace_node(graph, add, conv)
            for n in (a, b):
                graph.remove(n, safe=True)
            for x in old:
                _drop_if_unused(graph, x)
            done += 1
            changed = True
    return done
