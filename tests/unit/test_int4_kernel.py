"""The MatMulNBits accuracy_level shipped per CPU class (quantkit.int4_kernel, issue 24).

A graph that differs only in the attribute is written beside the built one (same weight file, nothing else
changed) and runs in ONNX Runtime; with ``export.accuracy_level: auto`` the faster level by a (faked, so the
tests do not depend on this machine's timing or its VNNI) measurement ships - the emitted file, the report's
figures and its ``int4_kernel`` section are of that level - on the layer-wise and the whole-graph paths; a target
class other than this CPU's, or latency off, ships the class default and says why; a number is obeyed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.api import quantize
from quantkit.errors import ModelError, RecipeError
from quantkit.int4_kernel import (
    CLASS_DEFAULT_LEVEL,
    build_level,
    nbits_nodes,
    set_accuracy_level,
    set_model_accuracy_level,
    write_level_sibling,
)
from quantkit.report.build import int4_kernel_line, llm_latency_warnings, render_markdown
from quantkit.scheme.target import detect_cpu

K, N, BLOCK = 64, 48, 32


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


def _levels(proto: onnx.ModelProto) -> list[int]:
    return [next((a.i for a in n.attribute if a.name == "accuracy_level"), -1) for n in nbits_nodes(proto)]


def _nbits_model(folder: Path, level: int = 4) -> tuple[Path, list[np.ndarray]]:
    """x[M, K] -> MatMulNBits (4-bit, block 32, zero point 8) -> Relu -> MatMulNBits -> y, its weights in
    model.onnx.data; returns the path and the dequantized weights of both layers ([K, N], [N, K])."""
    rng = np.random.default_rng(0)
    inits, nodes, deq = [], [], []
    src = "x"
    for i, (k, n) in enumerate(((K, N), (N, K))):
        kb = -(-k // BLOCK)
        codes = rng.integers(0, 16, (n, kb * BLOCK)).astype(np.uint8)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(n, kb, BLOCK // 2)
        scales = rng.uniform(0.01, 0.05, (n, kb)).astype(np.float32)
        w = ((codes.astype(np.float32) - 8).reshape(n, kb, BLOCK) * scales[:, :, None]).reshape(n, -1)[:, :k].T
        deq.append(w)
        inits += [numpy_helper.from_array(packed, f"B{i}"), numpy_helper.from_array(scales, f"s{i}")]
        out = "y" if i == 1 else f"h{i}"
        nodes.append(helper.make_node("MatMulNBits", [src, f"B{i}", f"s{i}"], [out], name=f"fc{i}",
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=BLOCK,
                                      accuracy_level=level))
        if i == 0:
            nodes.append(helper.make_node("Relu", [out], ["r0"], name="act"))
            src = "r0"
    g = helper.make_graph(nodes, "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", K])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 9
    path = folder / "model.onnx"
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
              size_threshold=0)
    return path, deq


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_the_sibling_differs_only_in_the_level_and_shares_the_weights(tmp_path: Path) -> None:
    path, (w0, w1) = _nbits_model(tmp_path)
    original = path.read_bytes()
    data = (tmp_path / "model.onnx.data").read_bytes()
    sib = write_level_sibling(path, 0)
    assert sib.parent == tmp_path and sib.name == "model.accuracy0.onnx"
    # no weight was copied: the one data file, untouched; the graph file small
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.accuracy0.onnx", "model.onnx", "model.onnx.data"]
    assert (tmp_path / "model.onnx.data").read_bytes() == data and path.read_bytes() == original
    assert sib.stat().st_size < len(data)
    proto = onnx.load(str(sib), load_external_data=False)
    assert _levels(proto) == [0, 0]
    assert all(t.data_location == TensorProto.EXTERNAL and t.external_data[0].value == "model.onnx.data"
               for t in proto.graph.initializer)
    assert set_accuracy_level(proto, 4) == 2
    assert proto.SerializeToString() == original  # set back, it is the built file byte for byte
    # both load in ONNX Runtime: level 0 is the exact float product of the dequantized weights, level 4 within
    # its int8 activations' error
    x = np.random.default_rng(1).standard_normal((5, K)).astype(np.float32)
    y0, y4 = _run(sib, x), _run(path, x)
    ref = np.maximum(x @ w0, 0) @ w1
    np.testing.assert_allclose(y0, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert np.abs(y4 - ref).max() <= 0.05 * np.abs(ref).max()
    with pytest.raises(ModelError, match="no com.microsoft.MatMulNBits"):
        onnx.save(helper.make_model(helper.make_graph([], "empty", [], [])), str(tmp_path / "e.onnx"))
        write_level_sibling(tmp_path / "e.onnx", 0)


def test_levels_in_memory_and_bad_levels(tmp_path: Path) -> None:
    path, _ = _nbits_model(tmp_path)
    model = ir.from_proto(onnx.load(str(path)))
    assert set_model_accuracy_level(model, 0) == 2
    assert _levels(ir.to_proto(model)) == [0, 0]
    assert build_level("auto") == 4 and build_level(1) == 1
    for bad in (5, "fast", True, -1):
        with pytest.raises(RecipeError, match="export.accuracy_level .*allowed: 'auto', 0, 1, 2, 3, 4"):
            build_level(bad)  # type: ignore[arg-type]


def test_the_schema_takes_auto_and_levels() -> None:
    from quantkit.recipe import load_recipe

    assert load_recipe({"version": 1}).export.accuracy_level == "auto"
    assert load_recipe({"version": 1, "export": {"accuracy_level": 0}}).export.accuracy_level == 0
    with pytest.raises(RecipeError, match="accuracy_level"):
        load_recipe({"version": 1, "export": {"accuracy_level": "fastest"}})


# -- choosing and shipping: a fake measurement (the tests never depend on this machine's timing) --------------


def _fake(times: dict[str, tuple[float, float]], seen: list[dict[str, Any]]) -> Any:
    """A measure_levels that records what it was given and answers ``times`` ({level: (prefill, decode)})."""

    def measure(models: Any, settings: Any, feed: Any = None) -> tuple[dict[str, dict[str, float]], str]:
        info: dict[str, Any] = {"keys": sorted(models), "feed": feed}
        for k, m in models.items():
            proto = onnx.load_model_from_string(m) if isinstance(m, bytes) else onnx.load(m, load_external_data=False)
            info[k] = (m if not isinstance(m, bytes) else None, _levels(proto))
        seen.append(info)
        if feed is not None:
            return {k: {"call_ms": times[k][0]} for k in models}, "one call (fake)"
        return {k: {"prefill_ms": times[k][0], "decode_ms": times[k][1]} for k in models}, "fake timing"

    return measure


def _this_class(monkeypatch: pytest.MonkeyPatch) -> str:
    """Pin the running CPU's class, so that isa: auto resolves the same on every machine."""
    monkeypatch.setenv("QUANTKIT_CPU_CLASS", "x86-avx2")
    return detect_cpu().cpu_class


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.unit.test_llm_builder import make_llama

    folder = tmp_path_factory.mktemp("int4-kernel") / "hf"
    make_llama(folder, tied=True, dtype=torch.bfloat16)
    return folder


def _lw_recipe(folder: Path, **extra: Any) -> dict[str, Any]:
    return {"version": 1, "model": {"source": str(folder)}, "calibration": {"layerwise": True},
            "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
            "report": {"formats": ["json", "md"], "latency": {"warmup": 1, "repeat": 3, "seq_len": 8,
                                                                "long_prefill": None}}, **extra}  # fmt: skip


@pytest.mark.parametrize(("times", "shipped"), [({"4": (10.0, 2.0), "0": (6.0, 1.5)}, 0),
                                                 ({"4": (10.0, 2.0), "0": (12.0, 1.9)}, 4)])
def test_layerwise_ships_the_faster_level(llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          times: dict[str, tuple[float, float]], shipped: int) -> None:
    cls = _this_class(monkeypatch)
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr("quantkit.int4_kernel.measure_levels", _fake(times, seen))
    at_latency: list[list[int]] = []

    def fake_latency(fp32: Any, q: Any, settings: Any, **kw: Any) -> dict[str, Any]:
        at_latency.append(_levels(onnx.load(str(q), load_external_data=False)))  # what the report measures
        return {"prefill": {"label": "prefill", "tokens": 8, "fp32_ms": 20.0, "quantized_ms": 10.0, "speedup": 2.0}}

    monkeypatch.setattr("quantkit.evaluate.decode.llm_latency", fake_latency)
    res = quantize(recipe=_lw_recipe(llama), progress=False, evaluate=False)
    # the two graphs timed: the built one (level 4) and its sibling (level 0) in the same folder
    [info] = seen
    (p4, l4), (p0, l0) = info["4"], info["0"]
    assert set(l4) == {4} and set(l0) == {0} and Path(p0).parent == Path(p4).parent == res.path.parent
    assert not Path(p0).exists()  # shipped (renamed into place) or removed
    assert set(_levels(onnx.load(str(res.path), load_external_data=False))) == {shipped}
    assert at_latency == [[shipped] * len(l4)]  # the report's latency is of the shipped model
    sec = res.report["int4_kernel"]
    assert (sec["cpu_class"], sec["accuracy_level"], sec["how"]) == (cls, shipped, "measured")
    assert sec["measured"]["4"]["prefill_ms"] == times["4"][0] and sec["measured"]["0"]["decode_ms"] == times["0"][1]
    assert sec["shipped"] == {str(shipped): sec["kernels"]} and res.timings["accuracy_level_s"] >= 0
    other = 4 if shipped == 0 else 0
    line = int4_kernel_line(sec)
    assert line.startswith(f"INT4 kernel: accuracy_level {shipped} (") and f"chosen for {cls}: " in line
    assert f"prefill {times[str(shipped)][0]:.1f} ms vs {times[str(other)][0]:.1f} ms at level {other}" in line
    assert line.endswith("ms/token (measured)")
    md = render_markdown(res.report)
    assert f"- {line}" in md.split("## Summary", 1)[1] and "## INT4 kernel: MatMulNBits accuracy_level" in md
    # the saved set holds the shipped graph and one weight file, nothing else of the measurement
    out = res.save(tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "model.accuracy0.onnx" not in names and names.count("model.onnx.data") == 1
    assert set(_levels(onnx.load(str(out["model"]), load_external_data=False))) == {shipped}
    ids = np.arange(6, dtype=np.int64).reshape(1, 6) % 50
    from quantkit.frontends.llm_builder import LLMSession

    assert np.isfinite(LLMSession(out["model"])(ids)).all()


def test_layerwise_class_default_when_not_measured(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another target class (or latency off): not timed here; the class default ships, and the report says why."""
    monkeypatch.setenv("QUANTKIT_CPU_CLASS", "x86-vnni")

    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("measured although the target is another class")

    monkeypatch.setattr("quantkit.int4_kernel.measure_levels", never)
    monkeypatch.setattr("quantkit.evaluate.decode.llm_latency", lambda *a, **k: {})
    res = quantize(recipe=_lw_recipe(llama, target={"isa": "x86-avx2"}), progress=False, evaluate=False)
    sec = res.report["int4_kernel"]
    assert (sec["cpu_class"], sec["this_cpu_class"], sec["accuracy_level"], sec["how"]) == (
        "x86-avx2", "x86-vnni", CLASS_DEFAULT_LEVEL["x86-avx2"], "class default")
    assert "not this CPU's class x86-vnni" in sec["not_measured"] and "accuracy_level_s" not in res.timings
    assert int4_kernel_line(sec) == ("INT4 kernel: accuracy_level 4 (int8 activations) for x86-avx2, the class "
                                     "default (not measured: the target class x86-avx2 is not this CPU's class "
                                     "x86-vnni)")
    # portable: level 0 (exact on every class), written into the emitted graph
    res = quantize(recipe=_lw_recipe(llama, target={"isa": "portable"}), progress=False, evaluate=False)
    assert res.report["int4_kernel"]["accuracy_level"] == CLASS_DEFAULT_LEVEL["portable"] == 0
    assert set(_levels(onnx.load(str(res.path), load_external_data=False))) == {0}
    assert sorted(p.name for p in res.path.parent.iterdir() if p.suffix == ".onnx") == ["model.onnx"]
    # this CPU's class, latency off
    res = quantize(recipe=_lw_recipe(llama), progress=False, evaluate=False, measure_latency=False)
    sec = res.report["int4_kernel"]
    assert sec["how"] == "class default" and sec["not_measured"] == "latency measurement is off"
    assert "--no-latency" in sec["why"]
    # a number in the recipe is obeyed, never measured
    res = quantize(recipe=_lw_recipe(llama, export={"accuracy_level": 1}), progress=False, evaluate=False)
    assert (res.report["int4_kernel"]["how"], res.report["int4_kernel"]["accuracy_level"]) == ("recipe", 1)
    assert set(_levels(onnx.load(str(res.path), load_external_data=False))) == {1}


def test_whole_graph_ships_the_faster_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-graph path (a model in memory): the returned model and the report's figures are of the shipped
    level; a causal LM is timed by prefill and decode, another graph by one call on the latency feed."""
    from tests.conftest import tiny_encoder
    from tests.unit.test_weight_only import tiny_lm, windows

    cls = _this_class(monkeypatch)
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr("quantkit.int4_kernel.measure_levels", _fake({"4": (3.0, 2.0), "0": (2.0, 1.0)}, seen))
    at_latency: list[list[int]] = []

    def fake_latency(fp32: Any, q: Any, settings: Any, **kw: Any) -> dict[str, Any]:
        at_latency.append(_levels(onnx.load_model_from_string(q)))
        return {}

    monkeypatch.setattr("quantkit.evaluate.decode.llm_latency", fake_latency)
    rec = {"version": 1, "quantization": {"default": {"format": "int4", "group_size": 32}},
           "report": {"latency": {"warmup": 1, "repeat": 3}}}
    res = quantize(tiny_lm(), windows(2, 1), rec, evaluate=False, progress=False)
    assert seen[0]["feed"] is None and set(seen[0]["4"][1]) == {4} and set(seen[0]["0"][1]) == {0}
    assert at_latency == [[0, 0, 0]]
    assert _levels(ir.to_proto(res.model)) == [0, 0, 0]
    sec = res.report["int4_kernel"]
    assert (sec["cpu_class"], sec["accuracy_level"], sec["how"]) == (cls, 0, "measured")
    # not a causal LM: one call on the latency feed
    data = [{"x": np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(2)]
    rec = {"version": 1, "report": {"latency": {"warmup": 1, "repeat": 3}},
           "quantization": {"overrides": [{"layer": "o_proj", "format": "int4", "group_size": 16}]}}
    res = quantize(tiny_encoder(), data, rec, evaluate=False, progress=False)
    assert len(seen) == 2, "timed again (a latency guard's re-run keeps the first run's level)"
    assert set(seen[1]["feed"]) == {"x"} and res.report["int4_kernel"]["accuracy_level"] == 0
    assert "ms per call at level 4 (measured)" in int4_kernel_line(res.report["int4_kernel"])
    # a model without MatMulNBits has no section
    res = quantize(tiny_encoder(), data, {"version": 1, "report": {"latency": {"enabled": False}}}, evaluate=False,
                   progress=False)
    assert res.report["int4_kernel"] is None and len(seen) == 2


def test_a_rerun_keeps_the_level_decided_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A latency guard's re-run of the same model (other layers in float) ships the level the first run chose,
    with its figures, and times nothing."""
    from quantkit.int4_kernel import choose_for_model

    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("timed again")

    monkeypatch.setattr("quantkit.int4_kernel.measure_levels", never)
    path, _ = _nbits_model(tmp_path)
    proto = onnx.load(str(path))
    model = ir.from_proto(proto)
    first = {"accuracy_level": 0, "how": "measured", "why": "w", "measured": {"4": {"call_ms": 2.0},
                                                                             "0": {"call_ms": 1.0}}}
    shipped, sec = choose_for_model(model, proto, "auto", detect_cpu().cpu_class, latency_on=True, decided=first)
    assert sec is not None and (sec["accuracy_level"], sec["how"], sec["reused"]) == (0, "measured", True)
    assert sec["measured"] == first["measured"] and sec["shipped"] == {"0": 2}
    assert _levels(shipped) == [0, 0] and _levels(ir.to_proto(model)) == [0, 0]


def test_lines_and_warnings() -> None:
    measured = {"cpu_class": "x86-avx2", "accuracy_level": 0, "how": "measured", "bits": [4], "kernels": 3,
                "measured": {"4": {"prefill_ms": 20.3, "decode_ms": 3.4}, "0": {"prefill_ms": 12.1, "decode_ms": 3.1}},
                "shipped": {"0": 3}}
    assert int4_kernel_line(measured) == ("INT4 kernel: accuracy_level 0 (float, exact) chosen for x86-avx2: prefill "
                                          "12.1 ms vs 20.3 ms at level 4, decode 3.10 vs 3.40 ms/token (measured)")
    recipe = {"cpu_class": "x86-vnni", "accuracy_level": 4, "how": "recipe", "bits": [4, 8], "kernels": 3,
              "shipped": {"0": 1, "4": 2}}
    assert int4_kernel_line(recipe) == ("MatMulNBits kernel: accuracy_level 4 (int8 activations), set by the recipe "
                                        "(export.accuracy_level; not measured); kernels per level as shipped: 0 x1, "
                                        "4 x2")
    assert int4_kernel_line(None) == ""

    def lat(speedup: float) -> dict[str, Any]:
        return {"prefill": {"tokens": 128, "fp32_ms": 100.0, "quantized_ms": 100.0 / speedup, "speedup": speedup}}

    assert llm_latency_warnings(lat(2.0), measured) == []
    [w] = llm_latency_warnings(lat(1.0), measured)
    assert "the faster of levels 4 and 0 on this CPU (class x86-avx2" in w and "int8_dynamic" in w
    [w] = llm_latency_warnings(lat(1.0), recipe)
    assert "set by the recipe" in w and "export.accuracy_level: auto" in w
    [w] = llm_latency_warnings(lat(1.0), {**measured, "how": "class default", "not_measured": "latency is off"})
    assert "default of class x86-avx2, not measured here (latency is off)" in w
    [w] = llm_latency_warnings(lat(1.0), None)
    assert "compute-bound" in w and "accuracy_level" not in w


def test_a_streamed_run_times_the_levels_on_the_cut_decoder(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given ``blocks`` (the streamed FP32 baseline's k), both levels are timed on the decoder cut to k blocks (never
    the whole quantized model twice); the cut graphs are removed and the whole model ships at the chosen level."""
    from quantkit.int4_kernel import choose_for_file

    cls = _this_class(monkeypatch)
    monkeypatch.setattr("quantkit.evaluate.decode.llm_latency", lambda *a, **k: {})
    res = quantize(recipe=_lw_recipe(llama, export={"accuracy_level": 4}), progress=False, evaluate=False)
    built = _levels(onnx.load(str(res.path), load_external_data=False))
    assert set(built) == {4} and res.report["int4_kernel"]["how"] == "recipe"
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr("quantkit.int4_kernel.measure_levels", _fake({"4": (10.0, 2.0), "0": (6.0, 1.5)}, seen))
    before = sorted(p.name for p in res.path.parent.iterdir())
    sec = choose_for_file(res.path, "auto", cls, latency_on=True, settings=None, progress=False, blocks=1)
    assert sec is not None
    [info] = seen
    (p4, l4), (p0, l0) = info["4"], info["0"]
    L = sec["blocks"]["of"]
    assert sec["blocks"]["measured"] == 1 < L
    assert set(l4) == {4} and set(l0) == {0} and len(l4) == len(l0) < len(built)  # one block's kernels timed
    assert "first-1-blocks" in Path(p4).name and not Path(p4).exists() and not Path(p0).exists()
    assert sorted(p.name for p in res.path.parent.iterdir()) == before  # nothing of the measurement left
    shipped = _levels(onnx.load(str(res.path), load_external_data=False))
    assert set(shipped) == {0} and len(shipped) == len(built) and f"on the first 1 of {L} blocks" in sec["timed"]
