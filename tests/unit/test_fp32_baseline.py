"""The FP32 baseline of a layer-wise run follows the run's memory principle (evaluation.fp32_baseline,
quantkit.evaluate.streamed; issue 27).

On tiny random LLaMA folders: the FP32 perplexity computed block by block through the FP32 block graphs equals the
whole FP32 decoder's; a built decoder cut after k blocks computes what the builder's k-block decoder computes;
``auto`` holds the baseline whole when the FP32 weights are no larger than the streamed run's own estimated peak and
streams it otherwise (the report and its summary say which and why, the latency ratios "measured on k of L
blocks"); ``whole`` that cannot fit is refused before any work, naming ``streamed``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit import llm_run, memory  # noqa: E402
from quantkit.data import InputInfo, make_dataset  # noqa: E402
from quantkit.errors import MemoryBudgetError  # noqa: E402
from quantkit.evaluate.perplexity import perplexity  # noqa: E402
from quantkit.evaluate.streamed import streamed_perplexity, truncate_decoder  # noqa: E402
from quantkit.frontends.llm_builder import LLMSession, build_llm, read_decoder_config  # noqa: E402
from quantkit.memory import choose_baseline, latency_phase  # noqa: E402
from quantkit.report.build import summary_lines  # noqa: E402
from tests.unit.test_llm_builder import VOCAB, make_llama  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(memory.ENV_LIMIT, raising=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    out = {}
    for tied in (True, False):
        base = tmp_path_factory.mktemp(f"fp32-baseline-{'tied' if tied else 'untied'}")
        make_llama(base / "hf", tied=tied, dtype=torch.bfloat16, seed=3)
        out[tied] = base / "hf"
    return out


def _eval_npz(path: Path, seed: int = 0) -> Path:
    """Three 24-token windows, the last right-padded (mask 0 over its last 5 positions)."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, (3, 24)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[2, -5:] = 0
    np.savez(path, input_ids=ids, attention_mask=mask)
    return path


def _dataset(folder: Path, npz: Path) -> Any:
    cfg = read_decoder_config(folder)
    inputs = [InputInfo("input_ids", np.dtype(np.int64), (None, None)),
              InputInfo("attention_mask", np.dtype(np.int64), (None, None))]  # fmt: skip
    inputs += [InputInfo(f"past_key_values.{i}.{kv}", np.dtype(np.float32), (None, cfg.num_key_value_heads, None,
                                                                             cfg.head_dim))
               for i in range(cfg.num_hidden_layers) for kv in ("key", "value")]  # fmt: skip
    return make_dataset({"kind": "npz", "path": str(npz)}, inputs=inputs, split="evaluation")


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_fp32_perplexity_equals_the_whole_decoders(folders: dict[bool, Path], tied: bool,
                                                            tmp_path: Path) -> None:
    folder = folders[tied]
    ds = _dataset(folder, _eval_npz(tmp_path / "eval.npz"))
    whole = perplexity(str(build_llm(folder, tmp_path / "fp32" / "model.onnx")), ds)
    got = streamed_perplexity(folder, {"main": ds, "again": ds}, work_dir=tmp_path / "work", progress=False)
    for name in ("main", "again"):
        s = got[name]
        assert s["tokens"] == whole["tokens"] == 3 * 23 - 5 and s["windows"] == 3
        assert abs(s["ppl"] / whole["ppl"] - 1) <= 1e-5, (s, whole)
    assert not any((tmp_path / "work").iterdir())  # the hidden-state files are removed


def test_a_decoder_cut_after_k_blocks_is_the_builders_k_block_decoder(folders: dict[bool, Path],
                                                                      tmp_path: Path) -> None:
    folder = folders[False]
    full = build_llm(folder, tmp_path / "full" / "model.onnx")
    cut = truncate_decoder(full, 1, full.with_name("model.first-1.onnx"))
    one = build_llm(folder, tmp_path / "one" / "model.onnx", blocks=1)
    ids = np.random.default_rng(1).integers(0, VOCAB, (1, 12)).astype(np.int64)
    a, b = LLMSession(cut)(ids), LLMSession(one)(ids)
    assert np.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.allclose(a, LLMSession(full)(ids), atol=1e-3)  # the second block is gone
    assert cut.stat().st_size < 64 << 10  # a graph reading full's weight file, nothing copied


def _fake_estimates(fp32: int, per_block: int, own: int) -> Any:
    def estimate(mode: str, k: int = 0) -> memory.Estimate:
        phases = {"blocks": own}
        if mode == "whole":
            phases["evaluation (FP32 and quantized)"] = own + fp32
        elif mode == "streamed":
            phases["FP32 baseline: perplexity block by block"] = own // 2
            if k:
                phases[latency_phase(k, 8)] = 100 + per_block * k
        return memory.Estimate(f"x {mode}", phases, "test", fp32)

    return estimate


def test_auto_holds_the_baseline_whole_only_when_it_is_no_larger_than_the_runs_own_peak() -> None:
    big = memory.Available(10**12, "test")
    kw: dict[str, Any] = {"perplexity": True, "latency": True, "layers": 8, "avail": big}
    b = choose_baseline("auto", fp32_bytes=900, estimate=_fake_estimates(900, 100, 1000), **kw)
    assert b.mode == "whole" and "no larger than the streamed run's own estimated peak" in b.why
    b = choose_baseline("auto", fp32_bytes=5000, estimate=_fake_estimates(5000, 100, 1000), **kw)
    assert b.mode == "streamed" and "exceed the streamed run's own estimated peak" in b.why
    assert b.latency_blocks == 8  # 100 + 100 k <= 1000 up to k = 9, but there are 8 blocks
    b = choose_baseline("auto", fp32_bytes=5000, estimate=_fake_estimates(5000, 300, 1000), **kw)
    assert b.latency_blocks == 3 and "latency measured on 3 of 8 blocks" in b.text()
    b = choose_baseline("auto", fp32_bytes=5000, estimate=_fake_estimates(5000, 5000, 1000), **kw)
    assert b.latency_blocks == 1  # at least one block, even when it does not fit the run's own peak
    # whole would fit by size, but not in the memory available: streamed
    b = choose_baseline("auto", fp32_bytes=900, estimate=_fake_estimates(900, 100, 1000),
                        **{**kw, "avail": memory.Available(1500, "test")})  # fmt: skip
    assert b.mode == "streamed" and "more than the" in b.why
    assert choose_baseline("off", fp32_bytes=1, estimate=_fake_estimates(1, 1, 1000), **kw).mode == "off"
    nothing = choose_baseline("whole", fp32_bytes=1, estimate=_fake_estimates(1, 1, 1000),
                              **{**kw, "perplexity": False, "latency": False})  # fmt: skip
    assert nothing.mode == "off"
    with pytest.raises(MemoryBudgetError, match=r"evaluation.fp32_baseline: whole.*evaluation.fp32_baseline: "
                                                 r"streamed \(or auto\) evaluates it block by block"):
        choose_baseline("whole", fp32_bytes=5000, estimate=_fake_estimates(5000, 100, 1000),
                        **{**kw, "avail": memory.Available(2000, "test")})  # fmt: skip


def _recipe(folder: Path, npz: Path, baseline: str) -> dict[str, Any]:
    return {"version": 1, "name": "plain", "model": {"source": str(folder)},
            "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
            "evaluation": {"data": {"kind": "npz", "path": str(npz)}, "fp32_baseline": baseline},
            "export": {"accuracy_level": 4},
            "report": {"formats": ["json"], "latency": {"seq_len": 8, "long_prefill": None, "warmup": 0,
                                                        "repeat": 2}}}  # fmt: skip


def test_auto_streams_the_baseline_when_the_fp32_weights_exceed_the_streamed_estimate(
        folders: dict[bool, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = folders[False]
    npz = _eval_npz(tmp_path / "eval.npz", seed=2)
    whole = quantkit.quantize(recipe=_recipe(folder, npz, "whole"), progress=False)
    assert whole.report["fp32_baseline"]["mode"] == "whole"
    small = quantkit.quantize(recipe=_recipe(folder, npz, "auto"), progress=False)
    assert small.report["fp32_baseline"]["mode"] == "whole"  # tiny weights: held whole
    assert "no larger than" in small.report["fp32_baseline"]["why"]
    # the same folder as if its FP32 weights were larger than the streamed run's own peak (4 GB more parameters
    # outside the blocks), in a memory limit that holds the streamed run
    real = memory.decoder_sizes

    def inflated(f: Any) -> memory.DecoderSizes:
        s = real(f)
        return dataclasses.replace(s, params=s.params + 10**9)

    monkeypatch.setattr(llm_run, "decoder_sizes", inflated)
    monkeypatch.setenv(memory.ENV_LIMIT, "60GB")
    res = quantkit.quantize(recipe=_recipe(folder, npz, "auto"), progress=False)
    rep = res.report
    fb = rep["fp32_baseline"]
    assert fb["mode"] == "streamed" and fb["setting"] == "auto"
    assert "exceed the streamed run's own estimated peak" in fb["why"] and fb["latency_blocks"] == 1
    assert fb["fp32_bytes"] > fb["run_peak_bytes"]
    # the estimate covers the streamed baseline's phases, not the whole FP32 decoder
    phases = rep["memory"]["phases"]
    assert "FP32 baseline: perplexity block by block" in phases and latency_phase(1, 2) in phases
    assert "evaluation (FP32 and quantized)" not in phases
    # the streamed FP32 perplexity equals the whole decoder's; the quantized model is the same
    q = rep["quality"]
    assert abs(q["perplexity_fp32"]["ppl"] / whole.report["quality"]["perplexity_fp32"]["ppl"] - 1) <= 1e-5
    assert q["perplexity_quantized"] == whole.report["quality"]["perplexity_quantized"]
    # latency on the truncated decoders, labelled as such in the rows and the summary line
    assert rep["latency"] and all(r["scope"] == "measured on 1 of 2 blocks" for r in rep["latency"].values())
    text = "\n".join(summary_lines(rep))
    assert "measured on 1 of 2 blocks" in text and "- FP32 baseline: streamed block by block" in text
    assert "exceed the streamed run's own estimated peak" in text
    assert sorted(p.name for p in res.path.parent.iterdir() if p.suffix == ".onnx") == ["model.onnx"]
    # asked whole, that baseline cannot fit the limit: refused before any work, naming streamed
    monkeypatch.setenv(memory.ENV_LIMIT, "3GB")
    with pytest.raises(MemoryBudgetError, match=r"evaluation.fp32_baseline: streamed \(or auto\)"):
        quantkit.quantize(recipe=_recipe(folder, npz, "whole"), progress=False)
