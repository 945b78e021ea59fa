"""Write a pre-activation ``BatchNormalization -> Relu -> Conv`` as ``x + b/a -> Relu -> Conv(W * a)``.

Rule
----
A ``BatchNormalization`` that no preceding layer absorbs (:mod:`quantkit.prep.fold_batchnorm`) - DenseNet's
``norm1`` after the ``Concat`` of a dense block, a pre-activation ResNet's block input - is a per-channel affine
map ``a[c] * x + b[c]`` with ``a = gamma / sqrt(var + eps)`` and ``b = beta - a * mean``.  ONNX Runtime has no
int8 kernel for it: in a quantized model it is a float island (DequantizeLinear, the float op, QuantizeLinear,
and in NHWC two Transposes) that also keeps the ``Concat`` before it in float.  When every ``a[c] > 0`` and a
``Relu`` follows::

    Relu(a * x + b) = a * Relu(x + b / a)                   (a > 0 commutes with the Relu)
    Conv(W, a * y)  = Conv(W * a[c_in], y)                  (a per input channel scales the weights; zero padding
                                                             pads a * y and y alike)

so ``BatchNormalization -> Relu -> Conv(W)`` becomes ``Shift -> Relu -> Conv(W * a)``, the same function up to
float rounding, where *Shift* is the same ``BatchNormalization`` node with scale 1, mean 0, variance 1 and
epsilon 0: exactly ``x + b/a`` per channel (:func:`quantkit.ops.batchnorm_shift`).  It stays a ``BatchNormalization`` in the float
model because that is what ONNX Runtime runs fastest in FP32 (folded into an NCHWc depthwise convolution with
the Relu; written as an ``Add`` the FP32 DenseNet-121 measured ~10% slower) and the prepared model is the FP32
reference of every report; where it is quantized, the lowering emits it as ``Add(x, b/a)`` - int8 glue
(``QLinearAdd``, its constant on an 8-bit grid read through its own DequantizeLinear), the ``Relu`` folded into
its QuantizeLinear - so ``QLinearConcat -> QLinearAdd -> QLinearConv`` stays one NHWC int8 chain.  The scale also
passes through ``GlobalAveragePool -> Flatten / Reshape`` to the rows of a ``Gemm`` / ``MatMul`` weight (a
classifier head after the last pre-activation BatchNorm: the average of ``a * y`` is ``a`` times the average).

A BatchNorm is left as it is, with the reason (``_reason``): a training-mode BN or one whose parameters are not
constant initializers; a BN output with another consumer than one ``Relu`` (or a graph output); a Relu output
read by anything but the data input of a ``Conv`` with a constant float weight of matching channels (or the head
above); a scale ``a`` that is not finite and positive in every channel (a negative scale flips the Relu:
``Relu(-|a| x)`` is not ``|a| Relu(x)``).  The scaled weights are new initializers (the old ones are dropped
when unused).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantkit.ops import batchnorm_shift
from quantkit.prep.new_values import NewValues

__all__ = ["preact_batchnorm"]

_DEFAULT_EPSILON = 1e-5


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.is_graph_input() or value.const_value is None:
        return None
    return np.asarray(value.const_value.numpy())


def _reason(bn: ir.Node) -> str | tuple[np.ndarray, np.ndarray, ir.Node, list[ir.Node]]:
    """Why ``bn`` cannot be rewritten, else ``(a, b, relu, convs)``."""
    training = bn.attributes.get("training_mode")
    if training is not None and training.as_int() != 0:
        return "training mode"
    if len(bn.inputs) != 5 or any(o.uses() or o.is_graph_output() for o in bn.outputs[1:]):
        return "not an inference-mode BatchNormalization with 5 inputs"
    params = [_const(v) for v in bn.inputs[1:]]
    if any(p is None or p.dtype != np.float32 or p.ndim != 1 for p in params):
        return "scale / bias / mean / var are not constant float32 vectors"
    gamma, beta, mean, var = (np.asarray(p, np.float64) for p in params)
    if not (gamma.shape == beta.shape == mean.shape == var.shape):
        return "parameter shapes differ"
    eps_attr = bn.attributes.get("epsilon")
    eps = eps_attr.as_float() if eps_attr is not None else _DEFAULT_EPSILON
    with np.errstate(all="ignore"):
        a = gamma / np.sqrt(var + eps)
    if not np.all(np.isfinite(a)) or not np.all(a > 0.0):
        return "a channel's scale gamma / sqrt(var + eps) is not finite and positive"
    out = bn.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or len(uses) != 1 or uses[0].node.op_type != "Relu" or uses[0].node.domain not in (
            "", "ai.onnx"):
        return "its output is not read by exactly one Relu"
    relu = uses[0].node
    r_out = relu.outputs[0]
    convs = [u.node for u in r_out.uses()]
    if r_out.is_graph_output() or not convs:
        return "the Relu's output is a graph output or unused"
    channels = a.shape[0]
    layers = []
    for use in r_out.uses():
        layer = use.node if use.node.op_type == "Conv" and use.idx == 0 else _pooled_linear(use.node, channels)
        if layer is None:
            return (f"the Relu's output is read by {use.node.op_type} {use.node.name!r}, not as a Conv's data input "
                    "(nor through GlobalAveragePool -> Flatten / Reshape as a Gemm / MatMul's)")
        if layer.op_type == "Conv":
            w = _const(layer.inputs[1] if len(layer.inputs) > 1 else None)
            g = layer.attributes.get("group")
            group = g.as_int() if g is not None else 1
            if layer.domain not in ("", "ai.onnx") or w is None or w.dtype != np.float32 or w.ndim < 3 or (
                    w.shape[1] * group != channels or w.shape[0] % group):
                return f"Conv {layer.name!r} has no constant float32 weight over {channels} input channels"
        layers.append(layer)
    b_over_a = beta / a - mean
    return a, b_over_a, relu, layers


def _single_use(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and uses[0].idx == 0 and not value.is_graph_output() else None


def _pooled_linear(pool: ir.Node, channels: int) -> ir.Node | None:
    """The Gemm / MatMul that reads ``GlobalAveragePool -> Flatten(axis 1) | Reshape -> .`` as its data input with a
    constant ``[channels, N]`` weight (``[N, channels]`` for a Gemm with transB), else None: a per-channel scale
    ``a > 0`` passes through the average and the flattening to that weight's rows (a classifier head)."""
    if pool.op_type != "GlobalAveragePool" or pool.domain not in ("", "ai.onnx"):
        return None
    flat = _single_use(pool.outputs[0])
    if flat is None or flat.op_type not in ("Flatten", "Reshape") or flat.domain not in ("", "ai.onnx"):
        return None
    ax = flat.attributes.get("axis")
    shape = flat.outputs[0].shape
    if flat.op_type == "Flatten" and ax is not None and ax.as_int() != 1:
        return None
    if flat.op_type == "Reshape" and (shape is None or len(shape) != 2 or shape[1] != channels):
        return None
    lin = _single_use(flat.outputs[0])
    if lin is None or lin.op_type not in ("Gemm", "MatMul") or lin.domain not in ("", "ai.onnx"):
        return None
    w = _const(lin.inputs[1] if len(lin.inputs) > 1 else None)
    ta, tb = lin.attributes.get("transA"), lin.attributes.get("transB")
    if w is None or w.dtype != np.float32 or w.ndim != 2 or (ta is not None and ta.as_int() != 0):
        return None
    k_axis = 1 if lin.op_type == "Gemm" and tb is not None and tb.as_int() != 0 else 0
    return lin if w.shape[k_axis] == channels else None


def _scaled_weight(layer: ir.Node, a: np.ndarray) -> np.ndarray:
    """``layer``'s weight with input channel ``c`` scaled by ``a[c]`` (float64 math, float32 result)."""
    w = _const(layer.inputs[1]).astype(np.float64)  # type: ignore[union-attr]
    if layer.op_type != "Conv":
        tb = layer.attributes.get("transB")
        k_axis = 1 if layer.op_type == "Gemm" and tb is not None and tb.as_int() != 0 else 0
        return (w * (a[None, :] if k_axis == 1 else a[:, None])).astype(np.float32)
    g = layer.attributes.get("group")
    group = g.as_int() if g is not None else 1
    out_ch, cg = w.shape[0], w.shape[1]
    per_out = np.repeat(a.reshape(group, cg), out_ch // group, axis=0)  # [O, C/group]: a of each input channel
    return (w * per_out.reshape(out_ch, cg, *([1] * (w.ndim - 2)))).astype(np.float32)


def preact_batchnorm(model: ir.Model) -> int:
    """Apply the rule of the module doc to every eligible ``BatchNormalization`` of ``model``'s main graph (in
    place); returns how many were rewritten."""
    graph = model.graph
    initializer = NewValues(graph).initializer

    done = 0
    for bn in list(graph):
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or batchnorm_shift(bn) is not None:
            continue
        got = _reason(bn)
        if isinstance(got, str):
            continue
        a, b_over_a, _, layers = got
        c = a.shape[0]
        for i, (role, value) in enumerate((("scale", np.ones(c)), ("B", b_over_a), ("mean", np.zeros(c)),
                                           ("var", np.ones(c))), start=1):
            bn.replace_input_with(i, initializer(f"{bn.name}_shift_{role}", value.astype(np.float32)))
        bn.attributes["epsilon"] = ir.AttrFloat32("epsilon", 0.0)
        for layer in layers:
            w_v = layer.inputs[1]
            assert w_v is not None
            layer.replace_input_with(1, initializer(f"{w_v.name}_bn_scaled", _scaled_weight(layer, a)))
        done += 1
    return done
