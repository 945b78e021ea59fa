"""Shared fixtures: tiny graphs built in code (no files, no downloads)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tests never write into the user's own cache (~/.cache/quantkit): a cache inside the checkout
# (git-ignored) keeps exported models between test runs without touching anything outside.
os.environ.setdefault("QUANTKIT_CACHE", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     ".cache", "quantkit"))

try:  # property tests check values, never speed: no per-example deadline, no "input generation is slow" health
    # check (CI on a loaded 2-core machine once failed a 4-bit packing round trip because one draw took 1.1 s)
    from hypothesis import HealthCheck
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("quantkit", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    _hypothesis_settings.load_profile("quantkit")
except ImportError:  # hypothesis comes with the test extras; without it the property tests are not collected
    pass


@pytest.fixture(autouse=True)
def _no_timed_latency_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The latency guard (``report.latency.guard``, on by default) decides from timings of this machine, so on
    the tiny models of the unit tests (where int8 and float kernels take microseconds) its verdict changes from
    run to run and with it the plan every other test checks. Tests of the guard itself are marked
    ``latency_guard`` and drive it with faked timings (tests/unit/test_latency_guard.py); everywhere else it
    ships the plan as built, as ``guard: false`` would."""
    if request.node.get_closest_marker("latency_guard") is None:
        import quantkit.guard

        monkeypatch.setattr(quantkit.guard, "apply_latency_guard", lambda result, *a, **k: result)


@pytest.fixture(autouse=True)
def _plan_as_built(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fidelity guard (``evaluation.fidelity_guard``, on by default) re-runs a plan whose output is below 20 dB
    SQNR - as many tiny random graphs of the unit tests are - with layers in float: every such test would pay a
    second run and check a plan it did not write. Tests of the guard are marked ``fidelity_guard``
    (tests/unit/test_fidelity_guard.py, tests/unit/test_verdict.py); the CLI runs of the e2e tests (their own
    processes) keep it on (tests/e2e/test_zoo_ci.py: a speech encoder repaired by it)."""
    if request.node.get_closest_marker("fidelity_guard") is None:
        import quantkit.fidelity_guard

        monkeypatch.setattr(quantkit.fidelity_guard, "apply_fidelity_guard", lambda result, *a, **k: result)


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(arr, name)


def tiny_cnn(seed: int = 0, clip: bool = True) -> onnx.ModelProto:
    """input[N,3,16,16] -> Conv3x3 -> Clip(0,6) -> depthwise Conv -> Clip -> Conv1x1 -> (+ residual)
    -> GlobalAveragePool -> Flatten -> Gemm -> logits[N,10]  (an EfficientNet block in miniature)."""
    rng = np.random.default_rng(seed)
    c = 16
    inits = [
        _init("w0", (rng.standard_normal((c, 3, 3, 3)) * 0.3).astype(np.float32)),
        _init("b0", (rng.standard_normal(c) * 0.1).astype(np.float32)),
        _init("w1", (rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32)),
        _init("b1", (rng.standard_normal(c) * 0.1).astype(np.float32)),
        _init("w2", (rng.standard_normal((c, c, 1, 1)) * 0.2).astype(np.float32)),
        _init("b2", (rng.standard_normal(c) * 0.1).astype(np.float32)),
        _init("fc_w", (rng.standard_normal((10, c)) * 0.3).astype(np.float32)),
        _init("fc_b", (rng.standard_normal(10) * 0.1).astype(np.float32)),
        _init("lo", np.array(0.0, np.float32)),
        _init("hi", np.array(6.0, np.float32)),
    ]
    act = "Clip" if clip else "Relu"
    extra = ["lo", "hi"] if clip else []
    nodes = [
        helper.make_node("Conv", ["input", "w0", "b0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node(act, ["c0", *extra], ["a0"], name="act0"),
        helper.make_node("Conv", ["a0", "w1", "b1"], ["c1"], name="dwconv", pads=[1, 1, 1, 1], group=c),
        helper.make_node(act, ["c1", *extra], ["a1"], name="act1"),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], name="project"),
        helper.make_node("Add", ["c2", "a0"], ["r"], name="residual"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], name="fc", transB=1),
    ]
    g = helper.make_graph(
        nodes, "tiny_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def tiny_encoder(seed: int = 0) -> onnx.ModelProto:
    """x[N,T,32] -> LayerNorm -> (q = x Wq + bq, k = x Wk + bk) -> scores = q k^T (activation x activation)
    -> Softmax -> ctx = scores q -> ctx Wo + bo -> + x (residual) -> LayerNorm -> y: a transformer layer's
    linear/attention structure in miniature."""
    rng = np.random.default_rng(seed)
    d = 32

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    inits = [
        _init("ln_g", np.ones(d, np.float32)), _init("ln_b", np.zeros(d, np.float32)),
        _init("Wq", w(d, d)), _init("bq", w(d)), _init("Wk", w(d, d)), _init("bk", w(d)),
        _init("Wo", w(d, d)), _init("bo", w(d)), _init("perm", np.array([0, 2, 1], np.int64)),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "ln_g", "ln_b"], ["h"], name="ln0", axis=-1),
        helper.make_node("MatMul", ["h", "Wq"], ["q0"], name="q_proj"),
        helper.make_node("Add", ["q0", "bq"], ["q"], name="q_bias"),
        helper.make_node("MatMul", ["h", "Wk"], ["k0"], name="k_proj"),
        helper.make_node("Add", ["k0", "bk"], ["k"], name="k_bias"),
        helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "q"], ["ctx"], name="context"),
        helper.make_node("MatMul", ["ctx", "Wo"], ["o0"], name="o_proj"),
        helper.make_node("Add", ["o0", "bo"], ["o"], name="o_bias"),
        helper.make_node("Add", ["o", "x"], ["r"], name="residual"),
        helper.make_node("LayerNormalization", ["r", "ln_g", "ln_b"], ["y"], name="ln1", axis=-1),
    ]
    g = helper.make_graph(
        nodes, "tiny_encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", d])], inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def image_batches(n: int, seed: int = 1, batch: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input": rng.uniform(-1, 1, (batch, 3, 16, 16)).astype(np.float32)} for _ in range(n)]


@pytest.fixture
def cnn_model() -> onnx.ModelProto:
    return tiny_cnn()


@pytest.fixture
def encoder_model() -> onnx.ModelProto:
    return tiny_encoder()


def tiny_lm(seed: int = 0, K: int = 32, V: int = 48) -> onnx.ModelProto:
    """A decoder block in miniature, float input x[B,T,K] -> logits[B,T,V]:
    norm (Mul by gamma) -> q/k (one shared input) -> Add -> o -> residual -> up -> Relu -> down -> lm.
    Input channel 3 carries an outlier (x 30) as LLM activations do."""
    rng = np.random.default_rng(seed)

    def w(shape: tuple[int, int], s: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * s).astype(np.float32)

    gamma = (rng.random(K) + 0.5).astype(np.float32)
    gamma[3] = 30.0
    inits = [_init("gamma", gamma), _init("Wq", w((K, K))), _init("Wk", w((K, K))), _init("Wo", w((K, K))),
             _init("Wu", w((K, 2 * K))), _init("Wd", w((2 * K, K))), _init("Wlm", w((K, V), 0.5))]
    nodes = [
        helper.make_node("Mul", ["x", "gamma"], ["h"], name="norm"),
        helper.make_node("MatMul", ["h", "Wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["h", "Wk"], ["k"], name="k_proj"),
        helper.make_node("Add", ["q", "k"], ["a"], name="mix"),
        helper.make_node("MatMul", ["a", "Wo"], ["o"], name="o_proj"),
        helper.make_node("Add", ["o", "x"], ["r"], name="residual"),
        helper.make_node("MatMul", ["r", "Wu"], ["u"], name="up_proj"),
        helper.make_node("Relu", ["u"], ["g"], name="act"),
        helper.make_node("MatMul", ["g", "Wd"], ["d"], name="down_proj"),
        helper.make_node("MatMul", ["d", "Wlm"], ["logits"], name="lm"),
    ]
    graph = helper.make_graph(nodes, "tiny_lm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", V])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def lm_feeds(n: int, seed: int = 0, K: int = 32, T: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, T, K)).astype(np.float32)} for _ in range(n)]


def quantize_portable(module: Any, shape: tuple[int, ...], name: str) -> Any:
    """``quantkit.quantize`` of a small torch module (seed 0) on 4 random batches of ``shape`` for the portable
    target, latency off, evaluated on 2 of them: the result (its plan, census, report)."""
    import torch

    import quantkit

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cal = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    rec = {"version": 1, "name": name, "target": {"isa": "portable"}, "report": {"latency": {"enabled": False}}}
    return quantkit.quantize(module.eval(), cal, rec, example_inputs=torch.from_numpy(cal[0]),
                             evaluation_data=cal[:2], progress=False)

