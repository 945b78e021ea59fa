"""A DequantizeLinear that ONNX Runtime moved below int8 data movement (QLinearConv -> Slice on the codes -> DQ ->
float GELU: wav2vec2's positional convolution) is a chain exit, not a stray round trip: the census walks back
through the ops that run on codes to the kernel the codes came from.  It used to be reported as "stray" - and
the latency guard rejects candidates with stray nodes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import quantkit  # noqa: E402


class _SliceGelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv1d(16, 32, 3, padding=1)
        self.c2 = torch.nn.Conv1d(32, 32, 8, padding=4, groups=4)
        self.c3 = torch.nn.Conv1d(32, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        y = torch.nn.functional.gelu(self.c2(h)[..., :-1])  # conv -> drop the last frame -> GELU
        return self.c3(h + y).mean(-1)


def test_a_dq_below_an_int8_slice_is_a_chain_exit() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cal = [rng.standard_normal((4, 16, 40)).astype(np.float32) for _ in range(4)]
    rec = {"version": 1, "name": "slice", "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(_SliceGelu().eval(), cal, rec, example_inputs=torch.from_numpy(cal[0]),
                            evaluation_data=cal[:2], progress=False)
    from quantkit.report.build import classify_leftovers

    kinds = classify_leftovers(res.census)
    below_slice = [k for d, k in kinds if "slice" in d.split("->")[0].lower() and d.startswith("DequantizeLinear")]
    assert below_slice and set(below_slice) == {"chain_exit"}, kinds


def test_a_model_quantized_already_is_refused_naming_its_quantized_ops() -> None:
    """It was accepted, emitted unchanged and reported as "no layer was quantized ... weight is not a constant"."""
    import onnx_ir as ir

    from quantkit.errors import ModelError
    from tests.conftest import image_batches, tiny_cnn

    rec = {"version": 1, "name": "twice", "report": {"latency": {"enabled": False}}}
    once = quantkit.quantize(tiny_cnn(), image_batches(4), rec, evaluate=False, progress=False)
    with pytest.raises(ModelError, match=r"is quantized already \(.*QuantizeLinear.*quantkit verify"):
        quantkit.quantize(ir.to_proto(once.model), image_batches(4), rec, evaluate=False, progress=False)


def test_an_lstm_quantized_by_quantize_dynamic_is_refused(tmp_path: Path) -> None:
    """ONNX Runtime's quantize_dynamic writes DynamicQuantizeLSTM (int8 weights, no QuantizeLinear node): it was
    quantized again and its report called the quantized model "FP32"."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from quantkit.errors import ModelError

    class _Lstm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.head = torch.nn.LSTM(8, 16, batch_first=True), torch.nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(x)[0][:, -1])

    torch.manual_seed(0)
    src, dst = tmp_path / "lstm.onnx", tmp_path / "lstm_dynamic.onnx"
    torch.onnx.export(_Lstm().eval(), (torch.randn(1, 5, 8),), str(src), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}}, opset_version=17, dynamo=False)  # fmt: skip
    quantize_dynamic(str(src), str(dst), op_types_to_quantize=["LSTM"], weight_type=QuantType.QInt8)
    assert any(n.op_type == "DynamicQuantizeLSTM" for n in onnx.load(str(dst)).graph.node)
    data = [{"x": np.random.default_rng(i).standard_normal((1, 5, 8)).astype(np.float32)} for i in range(4)]
    rec = {"version": 1, "name": "lstm", "report": {"latency": {"enabled": False}}}
    with pytest.raises(ModelError, match=r"is quantized already \(DynamicQuantizeLSTM x1\)"):
        quantkit.quantize(str(dst), data, rec, evaluate=False, progress=False)


class _TopDown(torch.nn.Module):
    """A feature pyramid's top-down path: an int8 lateral plus the coarser level upsampled by a bilinear Resize."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, 2, 1)
        self.c2 = torch.nn.Conv2d(16, 32, 3, 2, 1)
        self.lat1, self.lat2 = torch.nn.Conv2d(16, 16, 1), torch.nn.Conv2d(32, 16, 1)
        self.out = torch.nn.Conv2d(16, 4, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        b = torch.relu(self.c2(a))
        up = torch.nn.functional.interpolate(torch.relu(self.lat2(b)), size=a.shape[-2:], mode="bilinear")
        return self.out(torch.relu(self.lat1(a)) + up)


def test_an_add_of_an_int8_lateral_and_an_upsampled_level_is_a_qlinearadd() -> None:
    """Select rule 9: the Add keeps the chain (the Resize output gets its own QuantizeLinear) - it used to stay float
    between a stray DequantizeLinear of the lateral and the next Conv's QuantizeLinear (UperNet: 3 strays)."""
    from tests.conftest import quantize_portable

    res = quantize_portable(_TopDown(), (4, 3, 32, 32), "fpn")
    from quantkit.report.build import classify_leftovers

    kinds = [k for _, k in classify_leftovers(res.census)]
    assert "stray" not in kinds, classify_leftovers(res.census)
    assert res.report["census"]["quantized_kernels"].get("QLinearAdd") == 1
    assert [n for n, lp in res.plan.layers.items() if lp.op_type == "Add"]
    assert next(iter(res.report["fidelity"].values()))["sqnr_db"] > 25.0


class _Modulation(torch.nn.Module):
    """FocalNet's focal modulation in miniature: one Linear's output split into the query, the context and a gate;
    ``q * modulator`` (the modulator an int8 convolution of the context) read by an int8 convolution, the gate read
    only by float ops (a broadcast ``Mul`` with a GELU island)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, 2, 1)
        self.f = torch.nn.Linear(16, 33)
        self.dw = torch.nn.Conv2d(16, 16, 3, 1, 1, groups=16)
        self.mod = torch.nn.Conv2d(16, 16, 1)
        self.out = torch.nn.Conv2d(16, 8, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        q, ctx, gate = torch.split(self.f(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2), (16, 16, 1), 1)
        ctx = self.dw(ctx)
        y = self.out(q * self.mod(ctx))
        return y + (torch.nn.functional.gelu(ctx) * gate).mean((1, 2, 3), keepdim=True)


def test_a_split_read_by_an_int8_op_stays_in_the_chain() -> None:
    """A Split one of whose outputs only float ops read stays int8 (that output is dequantized, a chain exit): it
    was dropped from the chain, so ``q * modulator`` stayed float between a stray DequantizeLinear of the modulator
    and the next QuantizeLinear (FocalNet: 12 strays)."""
    from tests.conftest import quantize_portable

    res = quantize_portable(_Modulation(), (4, 3, 32, 32), "focal")
    from quantkit.report.build import classify_leftovers

    ops = {lp.op_type for lp in res.plan.layers.values()}
    assert {"Split", "Mul"} <= ops, res.plan.skipped
    kinds = [k for _, k in classify_leftovers(res.census)]
    assert "stray" not in kinds, classify_leftovers(res.census)
    assert res.report["census"]["quantized_kernels"].get("QLinearMul", 0) >= 1
    assert next(iter(res.report["fidelity"].values()))["sqnr_db"] > 25.0


class _ResidualConvUnits(torch.nn.Module):
    """DPT's fusion block in miniature: pre-activation residual units ``x + conv(relu(conv(relu(x))))`` - the stream
    read by the Relu and by the residual Add - summed with a lateral, then a bilinear upsample (a float island)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.lat = torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.Conv2d(16, 16, 1)
        self.units = torch.nn.ModuleList(
            [torch.nn.ModuleList([torch.nn.Conv2d(16, 16, 3, 1, 1), torch.nn.Conv2d(16, 16, 3, 1, 1)]) for _ in range(2)])
        self.out = torch.nn.Conv2d(16, 4, 3, 1, 1)

    def unit(self, i: int, x: torch.Tensor) -> torch.Tensor:
        a, b = self.units[i]
        return x + b(torch.relu(a(torch.relu(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        y = self.unit(1, self.unit(0, self.lat(h)) + h)
        y = torch.nn.functional.interpolate(y, scale_factor=2.0, mode="bilinear", align_corners=True)
        return self.out(torch.relu(y))


def test_a_relu_beside_a_residual_add_runs_on_the_codes() -> None:
    """Select rule 12: the residual Adds stay int8 and each Relu that shares its input with one runs as
    ``QLinearLeakyRelu`` - they were a float Add and a DequantizeLinear -> QuantizeLinear requantization per unit
    (Depth Anything: 7 strays)."""
    from tests.conftest import quantize_portable

    torch.manual_seed(0)
    res = quantize_portable(_ResidualConvUnits(), (4, 3, 32, 32), "rcu")
    from quantkit.report.build import classify_leftovers

    kinds = [k for _, k in classify_leftovers(res.census)]
    assert "stray" not in kinds, classify_leftovers(res.census)
    kernels = res.report["census"]["quantized_kernels"]
    assert kernels.get("QLinearLeakyRelu") == 2 and kernels.get("QLinearAdd", 0) >= 2, kernels
    assert next(iter(res.report["fidelity"].values()))["sqnr_db"] > 25.0


@pytest.mark.parametrize("op", ["Relu", "Clip"])
def test_relu_between_two_grids_becomes_a_leaky_relu_bit_exact(op: str, tmp_path: Path) -> None:
    """``DQ -> Relu -> Q`` on two grids is emitted as ``LeakyRelu(alpha=0)``: ONNX Runtime fuses it into
    ``QLinearLeakyRelu``, whose codes equal the unoptimized QDQ graph's (checked against ORT's own Q / DQ)."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from quantkit.lowering.qdq import _relus_on_codes

    inits = [helper.make_tensor("s1", TensorProto.FLOAT, [], [0.037]), helper.make_tensor("z1", TensorProto.UINT8, [], [131]),
             helper.make_tensor("s2", TensorProto.FLOAT, [], [0.0213]), helper.make_tensor("z2", TensorProto.UINT8, [], [0]),
             helper.make_tensor("lo", TensorProto.FLOAT, [], [0.0]), helper.make_tensor("hi", TensorProto.FLOAT, [], [6.0])]
    act = helper.make_node("Relu", ["d"], ["r"]) if op == "Relu" else helper.make_node("Clip", ["d", "lo", "hi"], ["r"])
    nodes = [helper.make_node("DequantizeLinear", ["x", "s1", "z1"], ["d"]), act,
             helper.make_node("QuantizeLinear", ["r", "s2", "z2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [256])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [256])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = ir.from_proto(proto)
    assert _relus_on_codes(model.graph) == 1
    lowered = ir.to_proto(model)
    assert [n.op_type for n in lowered.graph.node] == ["DequantizeLinear", "LeakyRelu", "QuantizeLinear"]
    codes = {"x": np.arange(256, dtype=np.uint8)}
    ref_opts = ort.SessionOptions()
    ref_opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(proto.SerializeToString(), ref_opts, providers=["CPUExecutionProvider"])
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    fused = ort.InferenceSession(lowered.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node] == ["QLinearLeakyRelu"]
    np.testing.assert_array_equal(fused.run(None, codes)[0], ref.run(None, codes)[0])


def test_the_kernel_check_names_the_layer_behind_a_requantized_relu() -> None:
    """The Q after ``DQ -> LeakyRelu(0)`` belongs to the Conv that made the stream: the drift verdict's recipe
    snippet named ``..._DequantizeLinear`` nodes, which no override can name (Depth Anything)."""
    import onnx_ir as ir

    from quantkit.lowering.kernel_check import _quantized_tensors
    from tests.conftest import quantize_portable

    torch.manual_seed(0)
    res = quantize_portable(_ResidualConvUnits(), (4, 3, 32, 32), "rcu")
    proto = ir.to_proto(res.model)
    ops = {n.name: n.op_type for n in proto.graph.node}
    named = {ops.get(layer, "input") for _, layer, _ in _quantized_tensors(proto)}
    assert named.isdisjoint({"DequantizeLinear", "QuantizeLinear", "LeakyRelu", "Relu"}), named
