"""CPU targets: recipe section, detection, target-aware int8 lowering, kernel check and portability report.

Both CPU classes are exercised on whatever CPU runs the tests: ``QUANTKIT_CPU_CLASS`` makes ``auto``
build for the other class, and the NumPy emulator (:mod:`quantkit.scheme.saturation`) stands in for
the kernel the machine does not have.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.api import quantize
from quantkit.errors import RecipeError
from quantkit.lowering.kernel_check import emulate_saturation, kernel_vs_reference, pair_risks, portability
from quantkit.recipe import load_recipe
from quantkit.scheme.target import (
    CPU_CLASSES,
    _read_cpu,
    classify,
    cpu_class_saturates,
    detect_cpu,
    resolve_target,
)
from tests.conftest import image_batches, tiny_cnn

_RUNNING_SATURATES = cpu_class_saturates(_read_cpu().cpu_class)  # the real CPU, not QUANTKIT_CPU_CLASS


def _recipe(isa: str, **extra: Any) -> dict[str, Any]:
    return {"version": 1, "name": "unit", "target": {"isa": isa},
            "report": {"latency": {"enabled": False}, "kernel_check_samples": 4}, **extra}


def _big_weight_cnn() -> onnx.ModelProto:
    """tiny_cnn whose convolution weights are all of one sign in places, so full 8-bit codes form pairs
    that saturate int16 on x86 without VNNI."""
    m = tiny_cnn(seed=5)
    for init in m.graph.initializer:
        if init.name in ("w0", "w2", "fc_w"):
            w = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((np.abs(w) + 0.05).astype(np.float32), init.name))
    return m


def test_recipe_target_is_validated_with_the_allowed_values() -> None:
    with pytest.raises(RecipeError, match="isa") as e:
        load_recipe({"version": 1, "target": {"isa": "avx3"}})
    assert "x86-avx2" in str(e.value) and "portable" in str(e.value)
    with pytest.raises(RecipeError, match="tpu"):
        load_recipe({"version": 1, "target": {"device": "tpu"}})
    assert load_recipe({"version": 1}).target.isa == "auto"


def test_classify_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    assert classify("x86_64", {"avx2", "avx512_vnni"}) == "x86-vnni"
    assert classify("x86_64", {"avx2", "avx_vnni"}) == "x86-vnni"
    assert classify("x86_64", {"avx2", "avx512f", "avx512bw"}) == "x86-avx2"
    assert classify("aarch64", set()) == "arm64"
    for cls in CPU_CLASSES:
        monkeypatch.setenv("QUANTKIT_CPU_CLASS", cls)
        assert detect_cpu().cpu_class == cls
        assert resolve_target("auto").cpu_class == cls
    monkeypatch.setenv("QUANTKIT_CPU_CLASS", "pentium")
    with pytest.raises(RecipeError, match="allowed"):
        detect_cpu()
    assert resolve_target("portable").pair_safe and resolve_target("x86-avx2").pair_safe
    assert not resolve_target("x86-vnni").pair_safe and not resolve_target("arm64").pair_safe


@pytest.mark.parametrize("isa", ["x86-vnni", "x86-avx2", "portable"])
def test_lowering_for_each_target_and_its_portability_report(isa: str) -> None:
    model = _big_weight_cnn()
    res = quantize(model, image_batches(8), _recipe(isa), evaluation_data=image_batches(4, seed=9),
                   progress=False)
    proto = ir.to_proto(res.model)
    port = portability(proto)
    kern = res.report["kernels"]
    assert kern["target"]["isa"] == isa and kern["cpu"]["cpu_class"] in CPU_CLASSES
    meta = {p.key: json.loads(p.value) for p in proto.metadata_props}
    assert meta["quantkit.target"]["isa"] == isa
    risky = [r for r in pair_risks(proto) if r.at_risk]
    emu = kern["check"]["emulated_x86_avx2"]
    if isa == "x86-vnni" and _RUNNING_SATURATES and max(emu.values(), default=0.0) > 0.01:
        # on a CPU without VNNI this model's kernels really saturate: the check must say so, by layer
        assert not kern["check"]["agree"] and kern["check"]["first_parted"] is not None
        assert any("DISAGREE" in w for w in res.report["warnings"])
    else:
        # the fused kernels of this CPU compute the QDQ math, layer by layer
        assert kern["check"]["agree"], kern["check"]["first_parted"]
        assert all(r["off"] <= 1e-3 for r in kern["check"]["layers"])
    if isa == "x86-vnni":
        # full 8-bit codes: this model saturates on x86 without VNNI, and the report says so
        assert risky and not port["classes"]["x86-avx2"]["exact"]
        assert max(emu.values()) > 0
        assert any("not exact on CPU class(es) x86-avx2" in w for w in res.report["warnings"])
    else:
        assert not risky and all(v["exact"] for v in port["classes"].values())
        assert emu == {}
        assert not any("not exact" in w for w in res.report["warnings"])
        assert any("int16 pair bound" in r["lowering_note"] for r in res.report["layers"])


def test_auto_follows_the_cpu_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CPU_CLASS", "x86-avx2")
    res = quantize(_big_weight_cnn(), image_batches(8), _recipe("auto"), evaluate=False, progress=False)
    assert res.report["kernels"]["target"]["cpu_class"] == "x86-avx2"
    assert portability(ir.to_proto(res.model))["classes"]["x86-avx2"]["exact"]


def test_pair_safe_lowering_stays_close_to_the_unconstrained_one() -> None:
    model = _big_weight_cnn()
    ev = image_batches(4, seed=11)
    err = {}
    for isa in ("x86-vnni", "x86-avx2"):
        res = quantize(model, image_batches(8), _recipe(isa), evaluation_data=ev, progress=False)
        err[isa] = res.report["fidelity"]["logits"]["sqnr_db"]
    # pair-safe rounding (constrained GPTQ / scale search) costs little: measured 0.3 dB here
    assert err["x86-avx2"] > err["x86-vnni"] - 3.0


def _conv_with_wrapping_bias() -> onnx.ModelProto:
    """A QDQ Conv whose int32 bias sits next to INT32_MAX: the fused kernel's accumulator wraps around on
    every CPU, the QDQ math (float) does not."""
    rng = np.random.default_rng(0)
    wq = rng.integers(1, 60, (4, 4, 1, 1)).astype(np.int8)
    bq = np.array([2**31 - 10, 5, -7, 0], np.int32)
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "xs"), numpy_helper.from_array(np.array(0, np.uint8), "xz"),
        numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(np.full(4, 0.01, np.float32), "ws"),
        numpy_helper.from_array(np.zeros(4, np.int8), "wz"),
        numpy_helper.from_array(bq, "bq"), numpy_helper.from_array(np.full(4, 0.0002, np.float32), "bs"),
        numpy_helper.from_array(np.zeros(4, np.int32), "bz"),
        numpy_helper.from_array(np.array(2e4, np.float32), "ys"), numpy_helper.from_array(np.array(128, np.uint8), "yz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["x_q"], name="xq"),
        helper.make_node("DequantizeLinear", ["x_q", "xs", "xz"], ["x_dq"], name="xdq"),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w_dq"], name="wdq", axis=0),
        helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["b_dq"], name="bdq", axis=0),
        helper.make_node("Conv", ["x_dq", "w_dq", "b_dq"], ["y"], name="conv"),
        helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["y_q"], name="yq"),
        helper.make_node("DequantizeLinear", ["y_q", "ys", "yz"], ["out"], name="ydq"),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


def test_kernel_check_names_the_layer_where_kernels_and_qdq_math_part() -> None:
    model = _conv_with_wrapping_bias()
    feeds = [{"x": np.random.default_rng(i).uniform(0, 5, (1, 4, 8, 8)).astype(np.float32)} for i in range(2)]
    chk = kernel_vs_reference(model, feeds, samples=2)
    assert not chk.agree
    assert chk.first_parted is not None and chk.first_parted["layer"] == "conv"
    assert chk.first_parted["off"] > 0.1


def test_bias_safe_weight_scale_keeps_kernels_exact_with_dead_channels() -> None:
    """BatchNorm folding leaves dead channels (weights ~1e-8, large bias); their int32 bias must fit."""
    m = tiny_cnn(seed=2)
    for init in m.graph.initializer:
        if init.name == "w0":
            w = numpy_helper.to_array(init).copy()
            w[3] *= 1e-7
            init.CopyFrom(numpy_helper.from_array(w, "w0"))
        if init.name == "b0":
            b = numpy_helper.to_array(init).copy()
            b[3] = -2.0
            init.CopyFrom(numpy_helper.from_array(b, "b0"))
    # portable: pair-safe weights, so the check isolates the bias effect on every CPU class
    res = quantize(m, image_batches(8), _recipe("portable"), evaluation_data=image_batches(4, seed=3),
                   progress=False)
    assert res.report["kernels"]["check"]["agree"], res.report["kernels"]["check"]["first_parted"]


def test_emulated_saturation_of_a_matmul_integer_to_float() -> None:
    rng = np.random.default_rng(4)
    w = rng.integers(70, 128, (32, 8)).astype(np.int8)  # every pair sums past 128
    nodes = [helper.make_node("MatMulIntegerToFloat", ["a", "w", "sa", "sw", "za"], ["y"], name="mm",
                              domain="com.microsoft")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0.1, np.float32), "sa"),
             numpy_helper.from_array(np.full(8, 0.1, np.float32), "sw"),
             numpy_helper.from_array(np.array(0, np.uint8), "za")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [4, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1)])
    assert pair_risks(m)[0].at_risk == 16 * 8
    frac = emulate_saturation(m, {"a": np.full((4, 32), 255, np.uint8)}, {"mm"})
    assert frac["mm"] == 1.0
    assert emulate_saturation(m, {"a": np.full((4, 32), 60, np.uint8)}, {"mm"})["mm"] == 0.0


def _matmul_integer_to_float(w: np.ndarray) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMulIntegerToFloat", ["a", "w", "sa", "sw", "za", "", "bias"], ["y"], name="mm",
                              domain="com.microsoft")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0.1, np.float32), "sa"),
             numpy_helper.from_array(np.full(w.shape[1], 0.02, np.float32), "sw"),
             numpy_helper.from_array(np.array(3, np.uint8), "za"),
             numpy_helper.from_array(np.linspace(-1, 1, w.shape[1]).astype(np.float32), "bias")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [4, w.shape[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, w.shape[1]])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1)])


def test_kernel_check_judges_float_output_int8_layers_against_exact_integer_math() -> None:
    """A ``MatMulIntegerToFloat`` has no QDQ reference (ORT_DISABLE_ALL runs the same kernel): it is checked
    alone against exact integer arithmetic, so saturation on this CPU is seen and named."""
    rng = np.random.default_rng(4)
    feeds = [{"a": np.full((4, 32), 255, np.uint8)}, {"a": rng.integers(0, 256, (4, 32)).astype(np.uint8)}]
    safe = _matmul_integer_to_float(rng.integers(-64, 65, (32, 8)).astype(np.int8))  # |q0 + q1| <= 128
    chk = kernel_vs_reference(safe, feeds, samples=2)
    rows = [r for r in chk.layers if r.get("float_output")]
    assert chk.agree and len(rows) == 1 and rows[0]["off"] == 0.0 and rows[0]["sqnr_db"] > 100
    big = _matmul_integer_to_float(rng.integers(70, 128, (32, 8)).astype(np.int8))  # every pair saturates
    chk = kernel_vs_reference(big, feeds, samples=2)
    assert chk.agree is not _RUNNING_SATURATES
    if _RUNNING_SATURATES:
        assert chk.first_parted is not None and chk.first_parted["layer"] == "mm" and chk.first_parted["off"] > 0.1


def test_cli_verify_warns_about_other_classes_and_fails_when_kernels_part(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from quantkit.cli import main

    res = quantize(_big_weight_cnn(), image_batches(8), _recipe("x86-vnni"), evaluate=False, progress=False)
    path = res.save(tmp_path / "vnni")["model"]
    data = tmp_path / "in.npz"
    np.savez(data, input=np.concatenate([b["input"] for b in image_batches(2, seed=5)]))
    rc = main(["verify", str(path), "--data", str(data), "--samples", "4"])
    out = capsys.readouterr().out
    # on a CPU without VNNI this full-8-bit model may really part from its math there (exit 3, by design)
    assert rc == 0 or (_RUNNING_SATURATES and rc == 3 and "DISAGREE" in out)
    assert "model target: x86-vnni" in out and ("agree" in out or "DISAGREE" in out)
    assert "WARNING: not exact on CPU class(es) x86-avx2" in out
    bad = tmp_path / "wrap.onnx"
    onnx.save(_conv_with_wrapping_bias(), bad)
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).uniform(0, 5, (2, 4, 8, 8)).astype(np.float32))
    assert main(["verify", str(bad), "--data", str(tmp_path / "x.npz")]) == 3
    assert "DISAGREE" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "missing.onnx")]) == 2
    # the output folder names its model (it used to read "model file 'vnni' does not exist")
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "vnni")]) == 0
    assert "model target: x86-vnni" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 2
    assert "is a folder without a model.onnx" in capsys.readouterr().err


def test_pair_risks_read_qoperator_weights() -> None:
    """A QOperator-format model (QLinearConv / QGemm, ORT's quantize_static with QuantFormat.QOperator): its int8
    weights are checked too - `quantkit verify` said "exact on x86-avx2: all 0 int8 GEMM layers obey the bound"."""
    rng = np.random.default_rng(5)
    wc = rng.integers(70, 128, (8, 4, 3, 3)).astype(np.int8)  # every pair sums past 128
    wg = rng.integers(-20, 20, (6, 8)).astype(np.int8)  # QGemm transB: [N, K], safe
    f, u8, i8 = np.float32, np.uint8, np.int8
    inits = [numpy_helper.from_array(wc, "wc"), numpy_helper.from_array(wg, "wg"),
             numpy_helper.from_array(np.array(0.1, f), "s"), numpy_helper.from_array(np.array(128, u8), "z"),
             numpy_helper.from_array(np.array(0, i8), "zw")]  # fmt: skip
    nodes = [helper.make_node("QLinearConv", ["x", "s", "z", "wc", "s", "zw", "s", "z"], ["c"], name="conv"),
             helper.make_node("GlobalAveragePool", ["c"], ["p"]),
             helper.make_node("Flatten", ["p"], ["fl"]),
             helper.make_node("QGemm", ["fl", "s", "z", "wg", "s", "zw", "", "s", "z"], ["y"], name="gemm",
                              domain="com.microsoft", transB=1)]  # fmt: skip
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 6])], inits)  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1)])
    risks = {r.layer: r for r in pair_risks(m)}
    assert set(risks) == {"conv", "gemm"}
    assert risks["conv"].at_risk > 0 and risks["gemm"].at_risk == 0
    port = portability(m)
    assert not port["classes"]["x86-avx2"]["exact"] and port["int8_gemm_layers"] == 2
