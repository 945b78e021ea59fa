"""Fold inference-mode ``BatchNormalization`` into the affine layer that feeds it.

Rule
----
``BatchNormalization`` in inference mode is a per-channel affine map on channel
axis 1 of its input ``Y``::

    BN(Y)[:, c] = gamma[c] * (Y[:, c] - mean[c]) / sqrt(var[c] + eps) + beta[c]
                = s[c] * Y[:, c] + (beta[c] - s[c] * mean[c]),   s = gamma / sqrt(var + eps)

When ``Y = W ⊛ X + B`` is itself affine in ``X`` with output channel ``c``
carried by a constant weight slice, the two maps compose into one layer of the
same kind::

    W' = W * s   (along the weight's output-channel axis)
    B' = (B - mean) * s + beta        (B = 0 when the layer has no bias)

so the ``BatchNormalization`` node disappears and quantization later sees one
weight tensor with the BN scale already in it (otherwise the BN would run in
float between a quantized layer and its consumer).

Layers handled, and the output-channel axis of their weight:

* ``Conv`` (with or without bias, any ``group`` count including depthwise):
  ``W`` is ``[O, C/group, k...]``; the output channel is always axis 0.
* ``Gemm``: ``Y = alpha * A' @ B' + beta_g * C``. ``B`` is ``[K, N]`` (axis 1)
  with ``transB = 0`` and ``[N, K]`` (axis 0) with ``transB = 1``; ``alpha``
  commutes with the per-column scale, and ``beta_g`` is folded into the new bias
  (``B = beta_g * C``) so the rewritten ``Gemm`` has ``beta = 1``.
* ``MatMul`` with a constant 2-D ``W [K, N]`` (axis 1), optionally followed by
  ``Add`` with a constant bias broadcastable to ``[N]``. The result is written as
  ``MatMul`` + ``Add`` (the ``Add`` keeps the original ``Add``'s name, or the BN's
  name when there was no bias). The product must be 2-D (``[M, N]``): on a rank-3
  ``[B, T, N]`` product BN's channel axis 1 is ``T``, not ``N``, and it cannot be
  folded into ``W``.

Each rule's ``check`` refuses, with a reason, when a weight / bias / BN
parameter is not a constant initializer (or is a graph input), when the weight
is shared with another node, when the layer's output has another consumer or is
a graph output, when the BN runs in training mode, or when the shapes do not
line up. The folded node keeps the original layer's name (quantization reports
are keyed by node name), and its output keeps the BN output's name. The math is
done in float64 and cast back to the weight's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

__all__ = [
    "FoldBatchNormIntoConv",
    "FoldBatchNormIntoGemm",
    "FoldBatchNormIntoMatMul",
    "FoldBatchNormIntoMatMulAdd",
    "fold_batchnorm_rules",
]

_DEFAULT_EPSILON = 1e-5  # ONNX BatchNormalization default


def _const_initializer_reason(value: ir.Value | None, role: str) -> str | None:
    """Return why ``value`` is not usable as a constant initializer, or None if it is."""
    if value is None:
        return f"{role} is missing"
    if value.is_graph_input():
        return f"{role} {value.name!r} is a graph input"
    if not value.is_initializer() or value.const_value is None:
        return f"{role} {value.name!r} is not a constant initializer"
    return None


def _bn_reason(bn: ir.Node, channels: int | None) -> str | None:
    """Return why ``bn`` cannot be folded, or None when it is an inference-mode BN with constant params."""
    training = bn.attributes.get("training_mode")
    if training is not None and training.as_int() != 0:
        return f"BatchNormalization {bn.name!r} has training_mode=1"
    if any(out.uses() or out.is_graph_output() for out in bn.outputs[1:]):
        return f"BatchNormalization {bn.name!r} produces running statistics (training mode)"
    if len(bn.inputs) != 5:
        return f"BatchNormalization {bn.name!r} has {len(bn.inputs)} inputs, expected 5"
    for role, value in zip(("scale", "B", "input_mean", "input_var"), bn.inputs[1:], strict=True):
        reason = _const_initializer_reason(value, f"BatchNormalization {bn.name!r} {role}")
        if reason is not None:
            return reason
        assert value is not None and value.const_value is not None  # checked just above
        if channels is not None and value.const_value.size != channels:
            return (
                f"BatchNormalization {bn.name!r} {role} has {value.const_value.size} elements, "
                f"the layer has {channels} output channels"
            )
    return None


def _exclusive_reason(value: ir.Value, allowed: set[ir.Node], role: str) -> str | None:
    """Return why ``value`` has users outside ``allowed`` (or is a graph output), or None."""
    if value.is_graph_output():
        return f"{role} {value.name!r} is a graph output"
    for user, _ in value.uses():
        if user not in allowed:
            return f"{role} {value.name!r} is also used by {user.op_type} {user.name!r}"
    return None


def _bn_scale_shift(bn: ir.Node) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(s, mean, beta)`` in float64 with ``s = gamma / sqrt(var + eps)``."""
    gamma, beta, mean, var = (
        np.asarray(v.const_value.numpy(), dtype=np.float64).reshape(-1)  # type: ignore[union-attr]
        for v in bn.inputs[1:]
    )
    eps_attr = bn.attributes.get("epsilon")
    eps = eps_attr.as_float() if eps_attr is not None else _DEFAULT_EPSILON
    return gamma / np.sqrt(var + eps), mean, beta


def _numpy(value: ir.Value) -> np.ndarray:
    """The constant array of an initializer value (checked by the caller)."""
    assert value.const_value is not None
    return np.asarray(value.const_value.numpy())


def _bias_vector(bias: np.ndarray, channels: int) -> np.ndarray | None:
    """Broadcast a bias to shape ``[channels]`` if it only varies along the last axis, else None."""
    if bias.size == 1:
        return np.full((channels,), bias.reshape(-1)[0], dtype=np.float64)
    if bias.size == channels and (bias.ndim == 1 or all(d == 1 for d in bias.shape[:-1])):
        return bias.reshape(-1).astype(np.float64)
    return None


def _tensor(array: np.ndarray, like: np.ndarray, name: str | None) -> ir.TensorProtocol:
    """An ``ir.Tensor`` holding ``array`` cast to the dtype of ``like``."""
    return ir.tensor(np.ascontiguousarray(array.astype(like.dtype)), name=name)


class _FoldBatchNormBase(RewriteRuleClassBase):
    """Shared helpers for the BatchNormalization folding rules."""

    def __init__(self) -> None:
        super().__init__(name=type(self).__name__)

    @staticmethod
    def _weight_reasons(
        layer: ir.Node, constants: Sequence[tuple[ir.Value | None, str]], matched: set[ir.Node]
    ) -> str | None:
        for value, role in constants:
            reason = _const_initializer_reason(value, f"{layer.op_type} {layer.name!r} {role}")
            if reason is not None:
                return reason
            assert value is not None
            reason = _exclusive_reason(value, matched, f"{layer.op_type} {layer.name!r} {role}")
            if reason is not None:
                return reason
        return None


class FoldBatchNormIntoConv(_FoldBatchNormBase):
    """``BatchNormalization(Conv(x, W[, B]))`` → ``Conv(x, W * s, (B - mean) * s + beta)``."""

    def pattern(self, op: Any, x: ir.Value) -> Any:
        return op.BatchNormalization(
            op.Conv(x, _allow_other_inputs=True, _outputs=["layer_out"]),
            _allow_other_inputs=True,
            _outputs=["bn_out"],
        )

    def check(self, context: Any, x: ir.Value, layer_out: ir.Value, bn_out: ir.Value) -> MatchResult:
        del context, x
        result = MatchResult()
        conv, bn = layer_out.producer(), bn_out.producer()
        assert conv is not None and bn is not None  # guaranteed by the pattern
        matched = {conv, bn}
        reason = _exclusive_reason(layer_out, {bn}, f"output of Conv {conv.name!r}")
        if reason is None:
            constants: list[tuple[ir.Value | None, str]] = [(conv.inputs[1], "weight")]
            if len(conv.inputs) > 2 and conv.inputs[2] is not None:
                constants.append((conv.inputs[2], "bias"))
            reason = self._weight_reasons(conv, constants, matched)
        if reason is None:
            weight = conv.inputs[1]
            assert weight is not None and weight.const_value is not None
            reason = _bn_reason(bn, int(_numpy(weight).shape[0]))
        if reason is not None:
            return result.fail(reason)
        return result

    def rewrite(self, op: Any, x: ir.Value, layer_out: ir.Value, bn_out: ir.Value) -> Any:
        conv, bn = layer_out.producer(), bn_out.producer()
        assert conv is not None and bn is not None
        weight_value = conv.inputs[1]
        assert weight_value is not None
        weight = _numpy(weight_value)
        s, mean, beta = _bn_scale_shift(bn)
        has_bias = len(conv.inputs) > 2 and conv.inputs[2] is not None
        bias_value = conv.inputs[2] if has_bias else None
        bias = _numpy(bias_value).astype(np.float64) if bias_value is not None else np.zeros_like(mean)
        new_weight = weight.astype(np.float64) * s.reshape((-1,) + (1,) * (weight.ndim - 1))
        new_bias = (bias - mean) * s + beta
        # Reusing the weight's name is safe: check() made sure nothing else reads it.
        w_init = op.initializer(_tensor(new_weight, weight, weight_value.name), name=weight_value.name)
        bias_name = bias_value.name if bias_value is not None else f"{conv.name}.bias"
        b_init = op.initializer(_tensor(new_bias, weight, bias_name), name=bias_name)
        return op.op("Conv", x, w_init, b_init, _name=conv.name, **dict(conv.attributes))


class FoldBatchNormIntoGemm(_FoldBatchNormBase):
    """``BatchNormalization(Gemm(a, B[, C]))`` → ``Gemm(a, B * s, (beta_g * C - mean) * s + beta)``."""

    def pattern(self, op: Any, x: ir.Value) -> Any:
        return op.BatchNormalization(
            op.Gemm(x, _allow_other_inputs=True, _outputs=["layer_out"]),
            _allow_other_inputs=True,
            _outputs=["bn_out"],
        )

    @staticmethod
    def _out_axis(gemm: ir.Node) -> int:
        trans_b = gemm.attributes.get("transB")
        return 0 if trans_b is not None and trans_b.as_int() else 1

    def check(self, context: Any, x: ir.Value, layer_out: ir.Value, bn_out: ir.Value) -> MatchResult:
        del context, x
        result = MatchResult()
        gemm, bn = layer_out.producer(), bn_out.producer()
        assert gemm is not None and bn is not None
        reason = _exclusive_reason(layer_out, {bn}, f"output of Gemm {gemm.name!r}")
        if reason is None:
            constants: list[tuple[ir.Value | None, str]] = [(gemm.inputs[1], "B")]
            if len(gemm.inputs) > 2 and gemm.inputs[2] is not None:
                constants.append((gemm.inputs[2], "C"))
            reason = self._weight_reasons(gemm, constants, {gemm, bn})
        if reason is None:
            weight_value = gemm.inputs[1]
            assert weight_value is not None
            weight = _numpy(weight_value)
            if weight.ndim != 2:
                reason = f"Gemm {gemm.name!r} B has rank {weight.ndim}, expected 2"
            else:
                channels = int(weight.shape[self._out_axis(gemm)])
                reason = _bn_reason(bn, channels)
                bias_value = gemm.inputs[2] if len(gemm.inputs) > 2 else None
                if reason is None and bias_value is not None:
                    if _bias_vector(_numpy(bias_value), channels) is None:
                        reason = (
                            f"Gemm {gemm.name!r} C of shape {_numpy(bias_value).shape} is not "
                            f"broadcastable to [{channels}] along the output features"
                        )
        if reason is not None:
            return result.fail(reason)
        return result

    def rewrite(self, op: Any, x: ir.Value, layer_out: ir.Value, bn_out: ir.Value) -> Any:
        gemm, bn = layer_out.producer(), bn_out.producer()
        assert gemm is not None and bn is not None
        weight_value = gemm.inputs[1]
        assert weight_value is not None
        weight = _numpy(weight_value)
        axis = self._out_axis(gemm)
        channels = int(weight.shape[axis])
        s, mean, beta = _bn_scale_shift(bn)
        attributes = dict(gemm.attributes)
        beta_attr = attributes.pop("beta", None)
        beta_g = beta_attr.as_float() if beta_attr is not None else 1.0
        bias_value = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        bias = _bias_vector(_numpy(bias_value), channels) if bias_value is not None else None
        if bias is None:
            bias = np.zeros((channels,), dtype=np.float64)
        new_weight = weight.astype(np.float64) * (s[:, None] if axis == 0 else s[None, :])
        new_bias = (beta_g * bias - mean) * s + beta
        w_init = op.initializer(_tensor(new_weight, weight, weight_value.name), name=weight_value.name)
        bias_name = bias_value.name if bias_value is not None else f"{gemm.name}.bias"
        b_init = op.initializer(_tensor(new_bias, weight, bias_name), name=bias_name)
        return op.op("Gemm", x, w_init, b_init, _name=gemm.name, **attributes)


def _matmul_rank_reason(matmul: ir.Node, out: ir.Value) -> str | None:
    """BN normalizes axis 1; that is the MatMul's N axis only for a 2-D product."""
    rank = len(out.shape) if out.shape is not None else None
    if rank is None:
        a = matmul.inputs[0]
        rank = len(a.shape) if a is not None and a.shape is not None else None
    if rank is None:
        return f"rank of MatMul {matmul.name!r} output is unknown (run shape inference first)"
    if rank != 2:
        return (
            f"MatMul {matmul.name!r} output has rank {rank}; BatchNormalization normalizes axis 1, "
            "which is the weight's output axis only for a 2-D product"
        )
    return None


class FoldBatchNormIntoMatMul(_FoldBatchNormBase):
    """``BatchNormalization(MatMul(x, W))`` → ``Add(MatMul(x, W * s), beta - mean * s)``."""

    def pattern(self, op: Any, x: ir.Value) -> Any:
        return op.BatchNormalization(
            op.MatMul(x, _allow_other_inputs=True, _outputs=["layer_out"]),
            _allow_other_inputs=True,
            _outputs=["bn_out"],
        )

    def check(self, context: Any, x: ir.Value, layer_out: ir.Value, bn_out: ir.Value) -> MatchResult:
        del context, x
        result = MatchResult()
        matmul, bn = layer_out.producer(), bn_out.producer()
        assert matmul is not None and bn is not None
        reason = _exclusive_reason(layer_out, {bn}, f"output of MatMul {matmul.name!r}")
        if reason is None:
            reason = self._weight_reasons(matmul, [(matmul.inputs[1], "weight")], {matmul, bn})
        if reason is None:
            reason = _matmul_rank_reason(matmul, layer_out)
        if reason is None:
            weight_value = matmul.inputs[1]
            assert weight_value is not None
            weight = _numpy(weight_value)
            if weight.ndim != 2:
                reason = f"MatMul {matmul.name!r} weight has rank {weight.ndim}, expected 2"
            else:
                reason = _bn_reason(bn, int(weight.shape[1]))
        if reason is not None:
            return result.fail(reason)
        return result

    def rewrite(self, op: Any, x: ir.Value, layer_out: ir.Value, bn_out: ir.Value) -> Any:
        matmul, bn = layer_out.producer(), bn_out.producer()
        assert matmul is not None and bn is not None
        weight_value = matmul.inputs[1]
        assert weight_value is not None
        weight = _numpy(weight_value)
        s, mean, beta = _bn_scale_shift(bn)
        new_weight = weight.astype(np.float64) * s[None, :]
        new_bias = beta - mean * s
        w_init = op.initializer(_tensor(new_weight, weight, weight_value.name), name=weight_value.name)
        bias_name = f"{bn.name}.bias"
        b_init = op.initializer(_tensor(new_bias, weight, bias_name), name=bias_name)
        product = op.op("MatMul", x, w_init, _name=matmul.name)
        return op.op("Add", product, b_init, _name=bn.name)


class FoldBatchNormIntoMatMulAdd(_FoldBatchNormBase):
    """``BatchNormalization(Add(MatMul(x, W), b))`` → ``Add(MatMul(x, W * s), (b - mean) * s + beta)``."""

    def pattern(self, op: Any, x: ir.Value, w: ir.Value, b: ir.Value) -> Any:
        return op.BatchNormalization(
            op.Add(op.MatMul(x, w, _outputs=["layer_out"]), b, _outputs=["add_out"]),
            _allow_other_inputs=True,
            _outputs=["bn_out"],
        )

    def check(
        self,
        context: Any,
        x: ir.Value,
        w: ir.Value,
        b: ir.Value,
        layer_out: ir.Value,
        add_out: ir.Value,
        bn_out: ir.Value,
    ) -> MatchResult:
        del context, x
        result = MatchResult()
        matmul, add, bn = layer_out.producer(), add_out.producer(), bn_out.producer()
        assert matmul is not None and add is not None and bn is not None
        matched = {matmul, add, bn}
        reason = _exclusive_reason(layer_out, {add}, f"output of MatMul {matmul.name!r}")
        if reason is None:
            reason = _exclusive_reason(add_out, {bn}, f"output of Add {add.name!r}")
        if reason is None:
            reason = self._weight_reasons(matmul, [(w, "weight")], matched)
        if reason is None:
            reason = self._weight_reasons(add, [(b, "bias")], matched)
        if reason is None:
            reason = _matmul_rank_reason(matmul, layer_out)
        if reason is None:
            weight = _numpy(w)
            if weight.ndim != 2:
                reason = f"MatMul {matmul.name!r} weight has rank {weight.ndim}, expected 2"
            else:
                channels = int(weight.shape[1])
                reason = _bn_reason(bn, channels)
                if reason is None and _bias_vector(_numpy(b), channels) is None:
                    reason = (
                        f"Add {add.name!r} bias of shape {_numpy(b).shape} is not broadcastable "
                        f"to [{channels}] along the output features"
                    )
        if reason is not None:
            return result.fail(reason)
        return result

    def rewrite(
        self,
        op: Any,
        x: ir.Value,
        w: ir.Value,
        b: ir.Value,
        layer_out: ir.Value,
        add_out: ir.Value,
        bn_out: ir.Value,
    ) -> Any:
        matmul, add, bn = layer_out.producer(), add_out.producer(), bn_out.producer()
        assert matmul is not None and add is not None and bn is not None
        weight = _numpy(w)
        channels = int(weight.shape[1])
        s, mean, beta = _bn_scale_shift(bn)
        bias = _bias_vector(_numpy(b), channels)
        assert bias is not None  # checked
        new_weight = weight.astype(np.float64) * s[None, :]
        new_bias = (bias - mean) * s + beta
        w_init = op.initializer(_tensor(new_weight, weight, w.name), name=w.name)
        b_init = op.initializer(_tensor(new_bias, weight, b.name), name=b.name)
        product = op.op("MatMul", x, w_init, _name=matmul.name)
        return op.op("Add", product, b_init, _name=add.name)


def fold_batchnorm_rules() -> RewriteRuleSet:
    """The rule set folding BatchNormalization into Conv, Gemm, MatMul and MatMul + Add.

    ``MatMul + Add`` is listed before ``MatMul`` so a biased product is folded as a whole.
    The ``Add``'s commuted form (``Add(b, MatMul(x, W))``) is covered with ``commute=True``.
    """
    return RewriteRuleSet(
        [
            FoldBatchNormIntoConv.rule(),
            FoldBatchNormIntoGemm.rule(),
            FoldBatchNormIntoMatMulAdd.rule(),
            FoldBatchNormIntoMatMul.rule(),
        ],
        commute=True,
    )
