"""What the report and the console say is what happened (issue 26).

The report of an INT8, a weight-only, a mixed and a layer-wise LLM run (tiny models built in code): the same
summary fields for every family (quality vs FP32, size, latency, the machine and its load average, warnings),
the method and statistics actually run (no activation calibrator for weights only), why N layers became M
kernels, latency figures that say per what they are, and the model as the user named it.  The console of
``calibrate`` and ``sweep``: why statistics were not cached, one line per repeated step, each output once.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from quantkit.api import quantize
from quantkit.cli import main
from quantkit.report.build import PREFILL_NO_GAIN, llm_latency_warnings, render_html, render_markdown
from tests.conftest import image_batches, tiny_cnn, tiny_encoder

SUMMARY_KEYS = {"quantized", "quality", "size", "latency", "measured_on", "warnings", "time_s"}
SUMMARY_BULLETS = ("- quantized: ", "- quality vs FP32: ", "- size: ", "- latency", "- measured on: ", "- time: ",
                   "- warnings: ")
LOAD = (1.25, 0.5, 0.25)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "getloadavg", lambda: LOAD)


def _summary(md: str) -> list[str]:
    return md.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0].splitlines()


def _line(lines: list[str], prefix: str) -> str:
    found = [ln for ln in lines if ln.startswith(prefix)]
    assert len(found) == 1, (prefix, lines)
    return found[0]


def _check_common(rep: dict[str, Any]) -> tuple[str, list[str]]:
    """Every report: the summary keys and bullets, the machine and its load, JSON that round-trips."""
    assert set(rep["summary"]) == SUMMARY_KEYS
    assert json.loads(json.dumps(rep, default=str))["summary"]["warnings"] == len(rep["warnings"])
    m = rep["measurement"]
    assert m["cpu_class"] in ("x86-vnni", "x86-avx2", "arm64") and m["cores"] == os.cpu_count()
    md = render_markdown(rep)
    summary = _summary(md)
    for bullet in SUMMARY_BULLETS:
        _line(summary, bullet)
    measured = _line(summary, "- measured on: ")
    assert f"class `{m['cpu_class']}`" in measured and "load average 1.25 / 0.50 / 0.25 (1 / 5 / 15 min)" in measured
    assert "calibrator mse" not in md.split("## Summary")[0]
    html = re.sub(r"<[^>]+>", "", render_html(rep))
    assert "measured on: " in html and "quality vs FP32: " in html
    return md, summary


def test_int8_report_names_its_calibrator_kernels_latency_and_model(tmp_path: Path) -> None:
    path = tmp_path / "cnn.onnx"
    onnx.save(tiny_cnn(), path)
    rec = {"version": 1, "model": {"source": str(path)}, "target": {"isa": "portable"},
           "report": {"latency": {"warmup": 1, "repeat": 3, "guard": False}}}
    res = quantize(None, image_batches(4), rec, evaluation_data=image_batches(2, seed=3), progress=False)
    rep = res.report
    md, summary = _check_common(rep)
    assert rep["model"] == str(path) and rep["model_read_from"] == f"ONNX file {path}"
    assert f"Model: `{path}` (read from ONNX file {path})" in md.splitlines()
    # 7 layers, 6 kernels: the Flatten moves int8 data and has no kernel of its own
    q = rep["summary"]["quantized"]
    assert (q["layers"], q["kernels"]) == (7, 6) and "`flatten` Flatten" in q["why"][0]
    assert _line(summary, "- quantized: ").startswith("- quantized: 7 layers -> 6 kernels (QGemm x1, QLinearAdd x1, "
                                                      "QLinearConv x3, QLinearGlobalAveragePool x1): 1 int8 data-movement")
    assert rep["summary"]["quality"]["metric"] == "fidelity"
    lat = _line(summary, "- latency")
    assert lat.startswith("- latency, batch 1 (input=[1, 3, 16, 16]): ") and " ms per call (**" in lat
    assert rep["measurement"]["load_average"] == {"start": list(LOAD), "end": list(LOAD)}
    # the method actually run: static INT8 with its activation calibrator and the statistics it collected
    method = rep["method"]
    assert set(method) == {"static"} and set(method["static"]["activation_calibrators"]) == {"auto"}
    line = _line(md.splitlines(), "Method, static INT8")
    assert re.search(r"activation calibrator auto -> (mse|minmax) \(\d+ tensors; output SQNR on \d+ calibration "
                     r"samples: mse [\d.]+ dB, minmax [\d.]+ dB\)", line), line
    assert "input second moments in kernel order" in line
    assert re.search(r"\(0 of these \d+ statistics reused from the cache \S+, \d+ collected\)", line), line
    cal = _line(md.splitlines(), "Calibration data: ")
    assert "calibrator" not in cal


def test_a_run_without_evaluation_data_says_so_and_what_the_checks_ran_on(tmp_path: Path) -> None:
    """No evaluation section (the CLI, a recipe without one): the report said "Evaluation data: given through the
    API" and called the calibration samples the kernel check ran on "evaluation samples"."""
    rec = {"version": 1, "target": {"isa": "portable"}, "report": {"latency": {"enabled": False}}}
    md = render_markdown(quantize(tiny_cnn(), image_batches(4), rec, progress=False).report).splitlines()
    cal = _line(md, "Calibration data: ")
    assert ("Evaluation data: none (no evaluation section: no accuracy figures; the kernel check and the latency "
            "ran on calibration samples)") in cal and "Evaluation data: given" not in cal
    assert re.search(r" on \d+ calibration samples: agree\.$", _line(md, "Fused kernels (ORT_ENABLE_ALL) vs QDQ"))
    assert not [line for line in md if "evaluation samples" in line or "evaluation data:" in line]
    # data passed through the API is still named so
    api = quantize(tiny_cnn(), image_batches(4), rec, evaluation_data=image_batches(2, seed=3), progress=False)
    md = render_markdown(api.report).splitlines()
    assert "Evaluation data: given through the API." in _line(md, "Calibration data: ")
    assert re.search(r" on \d+ evaluation samples: agree\.$", _line(md, "Fused kernels (ORT_ENABLE_ALL) vs QDQ"))


def test_weight_only_report_has_no_activation_calibrator_and_explains_a_slow_prefill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.test_weight_only import _recipe, tiny_lm, windows

    def fake_latency(*args: Any, **kwargs: Any) -> dict[str, Any]:  # a prefill as fast as FP32, decode faster
        return {"prefill": {"label": "prefill 1x8 (full sequence)", "tokens": 8, "fp32_ms": 2.0, "quantized_ms": 1.96,
                            "speedup": 2.0 / 1.96, "kv_cache": False},
                "decode": {"label": "decode with KV cache: 64 tokens after a 8-token prompt", "tokens": 1,
                           "fp32_ms": 1.0, "quantized_ms": 0.5, "speedup": 2.0, "kv_cache": True, "new_tokens": 64}}

    def fake_levels(models: Any, settings: Any, feed: Any = None) -> tuple[dict[str, Any], str]:
        return {"4": {"prefill_ms": 1.9, "decode_ms": 0.6}, "0": {"prefill_ms": 2.4, "decode_ms": 0.7}}, "fake"

    monkeypatch.setattr("quantkit.evaluate.decode.llm_latency", fake_latency)
    monkeypatch.setattr("quantkit.int4_kernel.measure_levels", fake_levels)  # MatMulNBits accuracy_level 4 vs 0
    monkeypatch.setenv("QUANTKIT_CPU_CLASS", "x86-avx2")  # a CPU without VNNI
    rec = _recipe("gptq")
    rec["report"] = {"latency": {"enabled": True}}
    res = quantize(tiny_lm(), windows(4, 1), rec, evaluation_data=windows(2, 9), progress=False)
    rep = res.report
    md, summary = _check_common(rep)
    assert rep["kind"] == "weight_only" and set(rep["method"]) == {"weight_only"}
    assert rep["method"]["weight_only"]["algorithms"] == {"gptq": 3}
    line = _line(md.splitlines(), "Method, weight-only")
    assert "algorithm gptq x3; no activation calibrator (activations stay float)" in line
    assert "input second moments" in line and "3 sequential stages" in line
    assert "calibrator mse" not in md
    # 3 layers, 4 kernels: the tied lm_head's table also serves the embedding
    assert _line(summary, "- quantized: ").startswith(
        "- quantized: 3 layers -> 4 kernels (GatherBlockQuantized x1, MatMulNBits x3): `lm_head`: tied")
    assert rep["summary"]["quality"]["metric"] == "perplexity"
    assert _line(summary, "- quality vs FP32: ").startswith("- quality vs FP32: perplexity ")
    lat = _line(summary, "- latency")
    assert "prefill 2.00 -> 1.96 ms per 8-token prompt (**1.02x**)" in lat
    assert "decode 1.00 -> 0.50 ms per token (median of 64 generated tokens) (**2.00x**)" in lat
    assert "| decode with KV cache: 64 tokens after a 8-token prompt | per token (median of 64 generated tokens) | " \
           "1.00 | 0.50 | 2.00x |" in md
    [warn] = [w for w in rep["warnings"] if w.startswith("prefill")]
    assert "accuracy_level 4, the faster of levels 4 and 0 on this CPU (class x86-avx2" in warn and "try" in warn
    # on a CPU without VNNI: the class, the level chosen and the measured alternative
    assert _line(summary, "- INT4 kernel: ") == (
        "- INT4 kernel: accuracy_level 4 (int8 activations) chosen for x86-avx2: prefill 1.9 ms vs 2.4 ms at level 0, "
        "decode 0.60 vs 0.70 ms/token (measured)")
    assert _line(summary, "- warnings: ") == f"- warnings: {len(rep['warnings'])} (see Warnings)"
    # the weight-only table has only columns some row fills: no eval SQNR (perplexity run), no decoder block
    header = next(ln for ln in md.splitlines() if ln.startswith("| layer | format | algorithm"))
    assert header == ("| layer | format | algorithm | bits | group | sym | K x N | weight rel. error | output SQNR dB "
                      "| kernel | stage |")
    assert all(r["kernel"] == "MatMulNBits" for r in rep["weight_only"])


def test_mixed_report_lists_every_family_with_its_method() -> None:
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(4)]
    rec = {"version": 1, "report": {"latency": {"warmup": 1, "repeat": 3, "guard": False}},
           "quantization": {"overrides": [{"layer": "k_proj", "format": "int8_dynamic"},
                                          {"layer": "o_proj", "format": "int4", "group_size": 16}]}}
    res = quantize(tiny_encoder(), data, rec, evaluation_data=data[:2], progress=False)
    rep = res.report
    md, summary = _check_common(rep)
    assert rep["kind"] == "mixed" and set(rep["method"]) == {"static", "weight_only", "dynamic"}
    lines = md.splitlines()
    assert "activation calibrator auto -> " in _line(lines, "Method, static INT8 (W8A8, Q/DQ) on 1 layer: ")
    assert "algorithm rtn x1; no activation calibrator" in _line(lines, "Method, weight-only (MatMulNBits) on 1 layer: ")
    assert "(SmoothQuant)" in _line(lines, "Method, int8_dynamic")
    assert _line(summary, "- formats: ") == "- formats: int4 1, int8 1, int8_dynamic 1"
    q = rep["summary"]["quantized"]
    assert q["layers"] == 3 and q["kernels"] == sum(rep["census"]["quantized_kernels"].values())
    assert rep["summary"]["latency"]["kind"] == "one call"
    # every family's layers get their SQNR in the emitted model: the column is there, filled
    header = next(ln for ln in lines if ln.startswith("| layer | format | algorithm"))
    assert "| eval SQNR dB | kernel | stage |" in header and "block" not in header
    assert isinstance(rep["weight_only"][0]["eval_output_sqnr_db"], float)


def test_prefill_warning_says_why_and_what_to_try() -> None:
    def lat(speedup: float) -> dict[str, Any]:
        return {"prefill": {"tokens": 128, "fp32_ms": 100.0, "quantized_ms": 100.0 / speedup, "speedup": speedup}}

    def kernel(how: str, level: int = 4, cls: str = "x86-avx2") -> dict[str, Any]:
        return {"cpu_class": cls, "accuracy_level": level, "how": how, "not_measured": "latency measurement is off"}

    assert llm_latency_warnings(lat(PREFILL_NO_GAIN + 0.01), kernel("measured")) == []
    assert llm_latency_warnings({}, kernel("measured")) == []
    [w] = llm_latency_warnings(lat(1.03), kernel("measured"))
    assert w.startswith("prefill is no faster than FP32 (1.03x FP32 per 128-token prompt)")
    assert "the faster of levels 4 and 0 on this CPU (class x86-avx2" in w and "int8_dynamic (W8A8)" in w
    [w] = llm_latency_warnings(lat(1.0), kernel("class default", cls="x86-vnni"))
    assert "compute-bound" in w and "default of class x86-vnni, not measured here" in w
    [w] = llm_latency_warnings(lat(0.9), kernel("recipe", level=0))
    assert "accuracy_level 0 is set by the recipe" in w and "export.accuracy_level: auto" in w
    [w] = llm_latency_warnings(lat(1.0), None)  # no MatMulNBits (W8A8, say)
    assert "compute-bound" in w and "accuracy_level" not in w


def _tiny_smollm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny tied LLaMA folder that the name ``smollm2-135m`` resolves to, and 3 windows of 16 random tokens."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import quantkit.llm_run
    from tests.unit.test_llm_builder import VOCAB, make_llama

    folder = tmp_path / "hf"
    make_llama(folder, tied=True, dtype=torch.bfloat16)
    monkeypatch.setattr(quantkit.llm_run, "resolve_llm_folder",
                        lambda source: folder if str(source) == "smollm2-135m" else Path(source))
    ids = np.random.default_rng(0).integers(0, VOCAB, (3, 16)).astype(np.int64)
    return folder, {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def test_layerwise_report_names_the_model_and_explains_the_shared_kernels(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The SmolLM2 recipe's shape on a tiny LLaMA, built block by block: q/k/v run as one MatMulNBits (the 212
    layers -> 151 MatMulNBits of the real run), the name the user gave and the folder it was read from."""
    folder, data = _tiny_smollm(tmp_path, monkeypatch)
    rec = {"version": 1, "name": "tiny-int4", "model": {"source": "smollm2-135m"}, "calibration": {"layerwise": True},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "gptq"}},
           "report": {"latency": {"warmup": 1, "repeat": 3, "seq_len": 8, "long_prefill": None}}}
    res = quantize(None, data, rec, evaluation_data=data, progress=False)
    rep = res.report
    md, summary = _check_common(rep)
    assert rep["model"] == "smollm2-135m" and rep["model_read_from"].startswith(f"Hugging Face folder {folder}")
    assert md.splitlines()[2].startswith(f"Model: `smollm2-135m` (read from Hugging Face folder {folder}")
    # 2 blocks x 7 linears + lm_head + embedding = 16 layers; q/k/v share a kernel per block: 12 kernels
    q = rep["summary"]["quantized"]
    assert (q["layers"], q["kernels"]) == (16, 12)
    assert q["why"] == ["q_proj + k_proj + v_proj read the same input and run as one MatMulNBits in each of 2 blocks "
                        "(6 layers -> 2 kernels)"]
    assert _line(summary, "- quantized: ") == ("- quantized: 16 layers -> 12 kernels (GatherBlockQuantized x1, "
                                               "MatMulNBits x11): " + q["why"][0])
    shared = rep["kernel_sharing"]["shared"]
    assert [g["node"] for g in shared] == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]
    assert all(r["kernel"] for r in rep["weight_only"])
    # the method: GPTQ from layer-input statistics gathered block by block; no activation calibrator
    line = _line(md.splitlines(), "Method, weight-only (MatMulNBits) on 16 layers: ")
    assert "algorithm gptq x15, rtn x1; no activation calibrator" in line and "block by block on 48 calibration" in line
    # the weight-only table: the columns a layer-wise run fills (kernel, block), none left all "-"
    header = next(ln for ln in md.splitlines() if ln.startswith("| layer | format | algorithm"))
    assert header.endswith("| weight rel. error | output SQNR dB | kernel | block | acc. level | W4A8 ratio |")
    assert "| MatMulNBits (shared: `model.layers.0.self_attn.qkv_proj`) | 0 |" in md
    # latency measured for real: prefill per prompt, decode per token; a prefill no faster than FP32 is a warning
    lat = rep["summary"]["latency"]
    assert lat["kind"] == "causal LM" and lat["prefill"]["per"] == "per 8-token prompt"
    assert re.fullmatch(r"per token \(median of \d+ generated tokens\)", lat["decode"]["per"])
    slow = rep["latency"]["prefill"]["speedup"] <= PREFILL_NO_GAIN
    assert slow == any(w.startswith("prefill is no faster than FP32") for w in rep["warnings"])


def _console(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What a user reads: stdout, and quantkit's lines on stderr (progress bars are not lines)."""
    cap = capsys.readouterr()
    err = [ln for ln in re.split(r"[\r\n]", cap.err) if ln.startswith("quantkit")]
    return [ln for ln in cap.out.splitlines() if ln.strip()] + err


def _no_repeats(lines: list[str]) -> None:
    rep = {ln: n for ln, n in Counter(lines).items() if n > 2}
    assert not rep, rep


def _cnn_files(tmp_path: Path, extra: str = "") -> Path:
    onnx.save(tiny_cnn(), tmp_path / "cnn.onnx")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", input=rng.uniform(-1, 1, (8, 3, 16, 16)).astype(np.float32))
    np.savez(tmp_path / "ev.npz", input=rng.uniform(-1, 1, (4, 3, 16, 16)).astype(np.float32))
    rec = tmp_path / "r.yaml"
    rec.write_text("version: 1\nname: cnn\nmodel: {source: cnn.onnx}\ntarget: {isa: portable}\n"
                   "calibration: {data: {kind: npz, path: cal.npz}, batch_size: 4}\n"
                   "evaluation: {data: {kind: npz, path: ev.npz}}\n"
                   "report: {latency: {warmup: 1, repeat: 3}}\n" + extra)
    return rec


def test_calibrate_console_says_why_statistics_are_not_cached(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    rec = _cnn_files(tmp_path)
    assert main(["calibrate", "--recipe", str(rec), "--output", str(tmp_path / "a")]) == 0
    lines = _console(capsys)
    _no_repeats(lines)
    text = "\n".join(lines)
    assert "cache disabled" not in text
    # the cache is on: the activation statistics go there; the pair-safe second moments are never cached, and
    # the line says why
    # the line says why (and they ride in the activation statistics' pass: no pass of their own)
    assert any(re.fullmatch(r"quantkit: calibration statistics: reused 0 from cache, collected \d+ in one pass \(.+\); "
                            r"3 pair-safe rounding input second moments \(never cached: K x 256 floats per layer\) in "
                            r"the same pass", ln) for ln in lines), lines
    assert not any("pair-safe rounding: input second moments:" in ln for ln in lines), lines
    assert any(ln.startswith("WARNING: ") or ln.startswith("latency: FP32 ") for ln in lines)
    assert main(["calibrate", "--recipe", str(rec), "--output", str(tmp_path / "b"), "--no-cache"]) == 0
    lines = _console(capsys)
    _no_repeats(lines)
    assert any(re.fullmatch(r"quantkit: calibration statistics: collected \d+ in one pass \(not cached: --no-cache "
                            r"\(use_cache=False\)\); 3 pair-safe .+ in the same pass", ln) for ln in lines), lines
    rep = json.loads((tmp_path / "b" / "report.json").read_text())
    assert rep["calibration"]["uncached"] == "--no-cache (use_cache=False)"
    assert "not cached: --no-cache (use_cache=False)" in _line(render_markdown(rep).splitlines(), "Method, static")


def test_sweep_console_counts_repeated_steps_and_prints_each_output_once(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    rec = _cnn_files(tmp_path, "search: {candidates: [int8, fp16, fp32], metric: latency, points: 2,\n"
                               "         sensitivity: {samples: 4}}\n")
    out = tmp_path / "sweep"
    assert main(["sweep", "--recipe", str(rec), "--output", str(out)]) == 0
    lines = _console(capsys)
    _no_repeats(lines)
    text = "\n".join(lines)
    assert "cache disabled" not in text and "lower to INT8 QDQ ..." not in text
    lowering = [ln for ln in lines if "lower to INT8 QDQ" in ln]
    assert 1 <= len(lowering) <= 3, lowering  # one line per phase (sensitivity, cost, emit points), with a count
    assert all(re.search(r": lower to INT8 QDQ: \d+ times?, [\d.]+ s in all$", ln) for ln in lowering), lowering
    sens = [ln for ln in lines if ln.startswith("quantkit: sensitivity: lower to INT8 QDQ: ")]
    assert sens and int(sens[0].split(": ")[3].split()[0]) > 1  # it did repeat, and is said once
    # the pair-safe second moments ride in the calibration pass, and the line says they are never cached
    assert any("pair-safe rounding input second moments (never cached: K x 256 floats per layer) in the same pass"
               in ln for ln in lines), lines
    for name in ("sweep.json", "sweep.md", "quality_vs_latency.svg", "quality_vs_size.svg", "predicted_front.svg"):
        assert (out / name).is_file()
        assert sum(str(out / name) in ln for ln in lines) == 1, name
    assert sum(str(out / "assignments") in ln for ln in lines) == 1


def test_layerwise_build_takes_the_grid_of_its_cpu_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``quantization.by_cpu_class``: the entry of the running CPU's class (every class has one here) replaces the
    default's group size and weights in every MatMulNBits the build emits - the lm_head's too, which inherits the
    default - and the report and its summary say which entry applied; the embedding's own override keeps its grid."""
    from quantkit.scheme.target import detect_cpu

    _, data = _tiny_smollm(tmp_path, monkeypatch)
    grid = {"group_size": 16, "weights": {"symmetric": True}}
    rec = {"version": 1, "name": "tiny-int4", "model": {"source": "smollm2-135m"}, "calibration": {"layerwise": True},
           "quantization": {"default": {"format": "int4", "group_size": 64, "algorithm": "gptq",
                                        "weights": {"symmetric": False}},
                            "overrides": [{"layer": "lm_head", "format": "int4", "algorithm": "gptq"},
                                          {"layer": "model.embed_tokens", "format": "int4", "group_size": 32}],
                            "by_cpu_class": {c: grid for c in ("x86-vnni", "x86-avx2", "arm64")}},
           "report": {"latency": {"enabled": False}}}
    res = quantize(None, data, rec, progress=False)
    rep = res.report
    cls = detect_cpu().cpu_class
    assert rep["by_cpu_class"] == {"cpu_class": cls, "target_isa": "auto", "group_size": 16,
                                   "weights": {"dtype": "int8", "symmetric": True, "granularity": "channel"}}
    proto = onnx.load(str(res.path), load_external_data=False)
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and any(n.name.startswith("lm_head") for n in nbits)
    for n in nbits:
        if n.name.endswith(".hot"):
            continue
        attrs = {a.name: a.i for a in n.attribute}
        assert attrs["block_size"] == 16, n.name
        assert len(n.input) < 4 or not n.input[3], f"{n.name}: a symmetric grid has no zero points"
    gather = [n for n in proto.graph.node if n.op_type == "GatherBlockQuantized"]
    assert [{a.name: a.i for a in n.attribute}["block_size"] for n in gather] == [32]
    md = render_markdown(rep)
    assert (f"Weight grid: quantization.by_cpu_class[{cls}] applied (this CPU's class): group_size 16, symmetric "
            "weights in place of the default's") in md
