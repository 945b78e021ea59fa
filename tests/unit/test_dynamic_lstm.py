"""LSTM layers become ONNX Runtime's DynamicQuantizeLSTM (select rule 11): int8 weights, one scale per gate row;
their weights, written by the dynamo exporter as Concats of Slices of the parameters, are folded first."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")

import quantkit  # noqa: E402
from quantkit.run import QuantizeResult  # noqa: E402


class _BiLstm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(24, 32, num_layers=2, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0].mean(1))


def _data(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((4, 12, 24)).astype(np.float32) for _ in range(n)]


def _quantize(module: torch.nn.Module, **recipe: object) -> QuantizeResult:
    torch.manual_seed(0)
    cal = _data(4, 0)
    rec = {"version": 1, "name": "lstm", "report": {"latency": {"enabled": False}}, **recipe}
    return quantkit.quantize(module.eval(), cal, rec, example_inputs=torch.from_numpy(cal[0]),
                             evaluation_data=_data(2, 1), progress=False)


def test_lstms_become_dynamic_quantize_lstm() -> None:
    res = _quantize(_BiLstm())
    assert res.report["census"]["quantized_kernels"].get("DynamicQuantizeLSTM") == 2
    assert len(res.plan.dynamic_lstms) == 2
    nodes = [n for n in res.model.graph if n.op_type == "DynamicQuantizeLSTM"]
    w = nodes[0].inputs[1]
    assert w is not None and w.const_value is not None and w.const_value.dtype == ir.DataType.INT8
    assert next(iter(res.report["fidelity"].values()))["sqnr_db"] > 30.0
    assert res.report["size"]["ratio"] < 0.5  # int8 weights (the float model: 1.0)


def test_quantize_rows_is_symmetric_per_gate_row() -> None:
    from quantkit.lowering.lstm import quantize_rows

    w = np.random.default_rng(0).standard_normal((2, 8, 5)).astype(np.float32)
    w[1, 3] = 0.0
    codes, scale = quantize_rows(w)
    assert codes.dtype == np.int8 and scale.shape == (2, 8) and scale[1, 3] == 1.0
    assert np.abs(codes).max() == 127 and not codes[1, 3].any()
    np.testing.assert_allclose(codes * scale[..., None], w, atol=float(scale.max()) / 2 + 1e-7)


def test_an_lstm_kept_float_by_the_recipe_stays_an_lstm() -> None:
    torch.manual_seed(0)
    cal = _data(4, 0)
    rec = {"version": 1, "name": "lstm", "report": {"latency": {"enabled": False}},
           "quantization": {"overrides": [{"op_type": "LSTM", "format": "fp32"}]}}
    res = quantkit.quantize(_BiLstm().eval(), cal, rec, example_inputs=torch.from_numpy(cal[0]), evaluate=False,
                            progress=False)
    assert not res.plan.dynamic_lstms
    assert sum(n.op_type == "LSTM" for n in res.model.graph) == 2
    assert any("keeps it fp32" in why for why in res.plan.skipped.values())


class _LstmOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(24, 32, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def test_a_model_of_an_lstm_alone_is_quantized() -> None:
    """No static int8 layer at all: the LSTM is still lowered (and the report does not call the model float)."""
    res = _quantize(_LstmOnly())
    assert not res.plan.layers and len(res.plan.dynamic_lstms) == 1
    assert res.report["census"]["quantized_kernels"].get("DynamicQuantizeLSTM") == 1
    assert not any(w.startswith("no layer was quantized") for w in res.report["warnings"])
    assert next(iter(res.report["fidelity"].values()))["sqnr_db"] > 30.0


def test_portable_lstm_codes_cannot_saturate_pair_sums() -> None:
    """For a CPU class whose u8 x s8 kernels saturate int16 pair sums (and for ``portable``) the codes stay in
    [-64, 64]: any two sum to at most 128, so 255 * 128 fits."""
    res = _quantize(_LstmOnly(), target={"isa": "portable"})
    node = next(n for n in res.model.graph if n.op_type == "DynamicQuantizeLSTM")
    for i in (1, 2):
        codes = np.asarray(node.inputs[i].const_value.numpy())  # type: ignore[union-attr]
        assert np.abs(codes.astype(np.int32)).max() == 64
    assert next(iter(res.report["fidelity"].values()))["sqnr_db"] > 25.0

