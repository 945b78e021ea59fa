"""Calibration inside quantize(): per-layer calibrators, the statistics cache, bias correction."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from quantkit.algorithms.bias_correction import ChannelMean, bias_shift
from quantkit.api import quantize
from tests.conftest import image_batches, tiny_cnn


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))


def _recipe(**quant: Any) -> dict[str, Any]:
    return {"version": 1, "quantization": quant, "report": {"latency": {"enabled": False}}}


def test_per_layer_calibrator_is_used_and_reported() -> None:
    # a tensor's calibrator is that of the quantized layer producing it (else of its first quantized consumer)
    rec = _recipe(overrides=[{"op_type": "GlobalAveragePool", "calibrator": "percentile"},
                             {"layer": "dwconv", "calibrator": "entropy"}])
    rec["calibration"] = {"calibrator": "minmax"}
    res = quantize(tiny_cnn(), image_batches(4), rec, evaluate=False, progress=False)
    by_tensor = {t.name: t.calibrator for t in res.plan.tensors.values()}
    assert by_tensor["p"] == "percentile" and by_tensor["f"] == "percentile"  # pool output, Flatten inherits it
    assert by_tensor["a1"] == "entropy"  # dwconv's (clip-folded) output
    assert by_tensor["input"] == "minmax"
    rows = {r["layer"]: r for r in res.report["layers"]}
    assert rows["project"]["inputs"][0]["calibrator"] == "entropy"


@pytest.mark.parametrize("cpu_class", ["x86-vnni", "x86-avx2"])
def test_second_run_with_another_calibrator_skips_the_data_pass(caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 cpu_class: str) -> None:
    """The cached ranges are reused by a run with another calibrator.  For a CPU class whose int8 weights must obey
    the int16 pair bound (x86-avx2) the pair-safe rounding's statistics are not cached (transient), so that run
    still makes one pass, for them alone."""
    monkeypatch.setenv("QUANTKIT_CPU_CLASS", cpu_class)
    data = image_batches(4)
    first = quantize(tiny_cnn(), data, _recipe(), evaluate=False, progress=False)
    assert first.report["calibration"]["collected"] > 0 and first.report["calibration"]["reused"] == 0
    rec = _recipe()
    rec["calibration"] = {"calibrator": "entropy"}
    with caplog.at_level(logging.INFO, logger="quantkit"):
        second = quantize(tiny_cnn(), data, rec, evaluate=False, progress=False)
    assert second.report["calibration"]["collected"] == 0
    assert second.report["calibration"]["reused"] == first.report["calibration"]["collected"]
    said = "no pass over the data" if cpu_class == "x86-vnni" else "one pass for"
    assert any(said in r.message for r in caplog.records), [r.message for r in caplog.records]
    # different data -> a different key -> a new pass
    third = quantize(tiny_cnn(), image_batches(4, seed=7), rec, evaluate=False, progress=False)
    assert third.report["calibration"]["collected"] > 0
    # use_cache=False never reads the cache
    fourth = quantize(tiny_cnn(), data, rec, evaluate=False, progress=False, use_cache=False)
    assert fourth.report["calibration"]["reused"] == 0 and fourth.report["calibration"]["cache"] is None


def test_cached_and_fresh_ranges_are_identical() -> None:
    data = image_batches(4)
    a = quantize(tiny_cnn(), data, _recipe(), evaluate=False, progress=False)
    b = quantize(tiny_cnn(), data, _recipe(), evaluate=False, progress=False)  # from cache
    assert b.report["calibration"]["collected"] == 0
    assert {k: (v.scale, v.zero_point) for k, v in a.lowering.tensors.items()} == {
        k: (v.scale, v.zero_point) for k, v in b.lowering.tensors.items()}


def test_bias_shift_matches_direct_expectation_conv_and_matmul() -> None:
    rng = np.random.default_rng(0)
    # depthwise 1x1-free case: a 3x3 'valid' conv over many samples, compare E[conv(x, Ŵ)] - E[conv(x, W)]
    w = rng.standard_normal((4, 1, 3, 3))
    w_hat = w + rng.standard_normal(w.shape) * 0.05
    x = rng.standard_normal((64, 4, 5, 5)) + np.array([0.5, -1.0, 2.0, 0.0])[None, :, None, None]
    cm = ChannelMean(axis=1)
    cm.update(x)
    assert cm.mean is not None
    shift = bias_shift("Conv", w, w_hat, cm.mean, group=4)
    d = w_hat - w
    direct = np.zeros(4)
    for o in range(4):
        acc = 0.0
        for i in range(3):
            for j in range(3):
                acc += (x[:, o, i:i + 3, j:j + 3] * d[o, 0]).sum(axis=(1, 2)).mean()
        direct[o] = acc / 9 * 9 / 9  # one output position per 3x3 window; mean over the 9 valid positions
    # direct expectation over valid positions equals the per-channel-mean formula up to sampling
    assert shift is not None and np.allclose(shift, [np.mean([(x[:, o, i:i + 3, j:j + 3] * d[o, 0]).sum(axis=(1, 2)).mean()
                                                              for i in range(3) for j in range(3)]) for o in range(4)],
                                             atol=0.05)
    wm = rng.standard_normal((6, 3))
    wm_hat = wm + 0.01
    xm = rng.standard_normal((10, 7, 6)) + 1.0
    cm2 = ChannelMean(axis=-1)
    cm2.update(xm)
    assert cm2.mean is not None
    np.testing.assert_allclose(bias_shift("MatMul", wm, wm_hat, cm2.mean), (xm @ wm_hat - xm @ wm).mean(axis=(0, 1)))
    np.testing.assert_allclose(bias_shift("Gemm", wm.T, wm_hat.T, cm2.mean, trans_b=True),
                               (xm @ wm_hat - xm @ wm).mean(axis=(0, 1)))


def test_bias_correction_removes_mean_output_error() -> None:
    """With bias correction the mean (over samples) error of the logits shrinks."""
    data = image_batches(16, seed=3)
    ev = image_batches(8, seed=4)
    off = _recipe(bias_correction=False)
    on = _recipe(bias_correction=True)
    a = quantize(tiny_cnn(), data, off, evaluation_data=ev, progress=False)
    b = quantize(tiny_cnn(), data, on, evaluation_data=ev, progress=False)
    assert any(n.startswith("bias corrected") for n in b.lowering.notes.values())
    assert not any(n.startswith("bias corrected") for n in a.lowering.notes.values())
    assert b.report["fidelity"]["logits"]["sqnr_db"] >= a.report["fidelity"]["logits"]["sqnr_db"] - 0.5


def test_a_second_plan_on_the_same_model_calibrates_only_what_the_first_did_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a latency guard's candidate (the same plan with a layer in float) reuses the ranges and bias-correction means
    # held in memory and collects only the tensors it newly quantizes - even with the cache off, where asking for
    # every tensor again (or for means of the non-weighted int8 layers, which never get one) repeated the whole pass
    import dataclasses

    import quantkit.calibrate.gather as gather_mod
    from quantkit.formats.base import Artifacts
    from quantkit.lowering.select import select
    from quantkit.recipe import load_recipe
    from quantkit.recipe.plan import PrecisionPlan
    from quantkit.run import execute, load_inputs

    passes: list[set[str]] = []
    real = gather_mod.collect_statistics

    def counting(model: Any, dataset: Any, tensors: Any, **kw: Any) -> Any:
        passes.append(set(tensors))
        return real(model, dataset, tensors, **kw)

    monkeypatch.setattr(gather_mod, "collect_statistics", counting)
    rec = load_recipe(_recipe(bias_correction=True))
    _, float_model, cal = load_inputs(tiny_cnn(), image_batches(4), rec, progress=False, timings={})
    art = Artifacts()
    plan = PrecisionPlan.from_recipe(rec)
    _, first = execute(float_model, plan, cal, progress=False, use_cache=False, artifacts=art)
    assert len(passes) == 1 and art.means
    assert any(lp.op_type not in ("Conv", "Gemm", "MatMul") for lp in first.static.layers.values())
    for layer in art.means:  # each weighted layer in float, in turn
        before, calibrated = len(passes), set(art.ranges)
        second = plan.choose({layer: dataclasses.replace(first.static.layers[layer], format="fp32")})
        new = set(select(float_model, second).calibrated_tensors()) - calibrated
        _, lowered = execute(float_model, second, cal, progress=False, use_cache=False, artifacts=art)
        assert layer not in lowered.static.layers
        assert passes[before:] == ([new] if new else []), (layer, passes[before:], new)


def test_pair_safe_second_moments_ride_in_the_calibration_pass_and_are_never_cached(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A pair-safe target needs each int8 GEMM's input second moment in kernel order: it is collected in the
    activation statistics' pass (one pass over the data, not two), never written to the statistics cache, and a
    rerun that reuses every cached statistic still collects it (one pass, said on the console) and builds the same
    weights."""
    import os

    import quantkit.calibrate.gather as gather_mod

    passes: list[int] = []
    real = gather_mod.collect_statistics

    def counting(*a: Any, **k: Any) -> Any:
        passes.append(1)
        return real(*a, **k)

    monkeypatch.setattr(gather_mod, "collect_statistics", counting)
    data = image_batches(4)
    rec = {**_recipe(), "target": {"isa": "portable"}}
    first = quantize(tiny_cnn(), data, rec, evaluate=False, progress=False)
    assert len(passes) == 1 and first.report["calibration"]["pair_hessians_in_pass"] == 3
    cached = list(Path(os.environ["QUANTKIT_CACHE"]).rglob("*.npz"))
    assert cached
    for path in cached:  # the cache holds the activation statistics only
        with np.load(path, allow_pickle=False) as z:
            assert z.files and not any("hessian" in k.lower() or "//" not in k and k.startswith("conv") for k in z.files)
    passes.clear()
    with caplog.at_level(logging.INFO, logger="quantkit"):
        second = quantize(tiny_cnn(), data, rec, evaluate=False, progress=False)
    assert len(passes) == 1 and second.report["calibration"]["collected"] == 0
    assert any("one pass for 3 pair-safe" in r.message for r in caplog.records)
    # the reused statistics and the same second moments: the same weights
    for k, v in first.model.graph.initializers.items():
        if v.const_value is not None:
            np.testing.assert_array_equal(v.const_value.numpy(),
                                          second.model.graph.initializers[k].const_value.numpy(), err_msg=k)
