"""Summed convolutions of one input become one convolution (quantkit.prep.parallel_convs): exact in float, one
QLinearConv in the int8 model; branches that do not share a grid are left alone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")

from quantkit.prep import prepare  # noqa: E402


class _AcBlock(torch.nn.Module):
    """ACNet / TextNet: 3x3 + 3x1 + 1x3 branches (each with BatchNorm) summed, then ReLU; strided in the second;
    the first with RepVGG's identity (BatchNorm) branch."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()

        def branch(k: tuple[int, int], s: int) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Conv2d(c, c, k, s, (k[0] // 2, k[1] // 2), bias=False),
                                       torch.nn.BatchNorm2d(c))

        self.stem = torch.nn.Conv2d(3, c, 3, 1, 1)
        self.b1 = torch.nn.ModuleList([branch(k, 1) for k in ((3, 3), (3, 1), (1, 3))])
        self.b2 = torch.nn.ModuleList([branch(k, 2) for k in ((3, 3), (3, 1), (1, 3))])
        self.identity = torch.nn.BatchNorm2d(c)  # RepVGG's identity branch (stride 1 only)
        self.dil = torch.nn.ModuleList([torch.nn.Conv2d(c, c, 3, 1, 2, dilation=2), torch.nn.Conv2d(c, c, 1)])
        self.head = torch.nn.Conv2d(c, 4, 1)
        for m in self.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.data.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = torch.relu(sum(b(h) for b in self.b1) + self.identity(h))
        h = torch.relu(sum(b(h) for b in self.b2))
        h = torch.relu(self.dil[0](h) + self.dil[1](h))  # dilation 2 with a 1x1: the 1x1 is the window's centre
        return self.head(h)


def _onnx(module: torch.nn.Module, x: torch.Tensor, path: str) -> None:
    torch.onnx.export(module.eval(), (x,), path, input_names=["x"], output_names=["y"], opset_version=17,
                      dynamo=False)


def test_summed_branches_become_one_conv_and_stay_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    torch.manual_seed(0)
    x = torch.randn(2, 3, 20, 20)
    path = str(tmp_path / "ac.onnx")
    _onnx(_AcBlock(), x, path)
    prep = prepare(ir.load(path))
    # (3 branches -> 2 merges) x 2 blocks + the dilated pair + the identity branch as a depth-wise Conv
    assert prep.applied["parallel_convs"] == 6
    convs = [n for n in prep.model.graph if n.op_type == "Conv"]
    assert len(convs) == 6 and len([n for n in prep.model.graph if n.op_type == "Add"]) == 1
    assert not [n for n in prep.model.graph if n.op_type == "BatchNormalization"]
    out = tmp_path / "prepared.onnx"
    ir.save(prep.model, str(out))
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


class _Mismatched(torch.nn.Module):
    """Sums the merge must leave alone: different strides; a 2x2 kernel beside a 3x3 (windows off the grid); one
    branch read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(8, 8, 3, 1, 1), torch.nn.Conv2d(8, 8, 3, 2, 1)
        self.c, self.d = torch.nn.Conv2d(8, 8, 3, 1, 1), torch.nn.Conv2d(8, 8, 2, 1, (1, 1))
        self.e, self.f = torch.nn.Conv2d(8, 8, 1), torch.nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = self.e(x)
        return (self.a(x)[..., ::2, ::2] + self.b(x), self.c(x) + self.d(x)[..., :-1, :-1],
                (e + self.f(x)) * e)


def test_branches_off_one_grid_are_left_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    path = str(tmp_path / "mm.onnx")
    torch.onnx.export(_Mismatched().eval(), (torch.randn(1, 8, 12, 12),), path, input_names=["x"], opset_version=17,
                      dynamo=False)
    prep = prepare(ir.load(path))
    assert prep.applied["parallel_convs"] == 0


def test_a_merged_block_quantizes_to_one_qlinearconv_per_block() -> None:
    from tests.conftest import quantize_portable

    res = quantize_portable(_AcBlock(), (4, 3, 20, 20), "ac")
    assert res.report["census"]["quantized_kernels"].get("QLinearConv") == 6
    assert res.report["census"]["quantized_kernels"].get("QLinearAdd") == 1
    assert not res.report["census"]["leftover_dequantize_linear"] or all(
        "graph output" in d for d in res.report["census"]["leftover_qdq_nodes"] if d.startswith("Dequantize"))
    assert next(iter(res.report["fidelity"].values()))["sqnr_db"] > 30.0
