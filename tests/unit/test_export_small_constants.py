"""A PyTorch export keeps every constant the module computes with.

onnxscript's optimizer (what ``torch.onnx.export(..., optimize=True)`` runs) drops ``Add(x, c)`` as "x + 0" when
|c| <= 1e-8 and ``Mul(x, c)`` as "x * 1" when c is within 1e-5 of 1: an RMSNorm with ``eps = 1e-8`` (Helium's
default) lost its epsilon, and an all-zero row (a padding token's embedding) became inf / NaN - silently.
:func:`quantkit.frontends.torch_module.from_torch` optimizes without those rules and removes exact no-ops only.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from quantkit.frontends.torch_module import from_torch  # noqa: E402


class RMSNorm(torch.nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(v + self.eps) * self.weight * 1.000001


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("eps", [1e-6, 1e-8, 1e-9])
def test_tiny_epsilon_and_near_one_factor_survive_the_export(eps: float) -> None:
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    x[1] = 0.0  # an all-zero row: rsqrt(0 + eps) is finite only with the epsilon
    m = RMSNorm(eps)
    model = from_torch(m, (torch.from_numpy(x),))
    ops = [n.op_type for n in model.graph]
    assert ops.count("Add") == 1 and ops.count("Mul") == 3, ops
    y = _run(model, x)
    assert np.isfinite(y).all()
    with torch.no_grad():
        ref = m(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


class Noops(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1.0 + 0.0) / 1.0 - 0.0 + x * torch.ones(8)


def test_exact_noops_are_still_removed() -> None:
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    model = from_torch(Noops(), (torch.from_numpy(x),))
    # x * 1, + 0, / 1, - 0 removed; the Mul by an 8-element constant (it could broadcast) and the sum kept
    assert [n.op_type for n in model.graph] == ["Mul", "Add"]
    np.testing.assert_allclose(_run(model, x), 2 * x, rtol=1e-6)
