"""The latency guard: when the int8 model measures slower than FP32, the layers whose int8 kernel is slower
than float are kept in float and the faster model ships (quantkit.guard)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx_ir as ir
import pytest

import quantkit
import quantkit.run  # noqa: E402 - the real latency measurement, before any test replaces it
from tests.conftest import image_batches, tiny_cnn

_REAL_LATENCY = quantkit.run._latency
RECIPE = {"version": 1, "name": "guard",
          "report": {"latency": {"warmup": 1, "repeat": 3, "guard": True}, "kernel_check_samples": 2}}


def _force(monkeypatch: pytest.MonkeyPatch, speedups: list[float]) -> list[float]:
    """Let the real latency run, then report the given speedups in turn (timings are not asserted in tests)."""
    import quantkit.run as run_mod

    real = _REAL_LATENCY
    seen: list[float] = []

    def fake(*a: Any, **k: Any) -> dict[str, Any]:
        out = real(*a, **k)
        out["speedup"] = speedups[len(seen)]
        seen.append(out["speedup"])
        return out

    monkeypatch.setattr(run_mod, "_latency", fake)
    return seen


def test_slower_layers_are_kept_in_float_when_that_measures_faster(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    seen = _force(monkeypatch, [0.8, 1.1])
    monkeypatch.setattr(guard, "slow_int8_layers", lambda *a, **k: {"conv0": (0.1, 0.2)})
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, evaluation_data=image_batches(2, seed=1),
                            progress=False)
    assert seen == [0.8, 1.1]  # the plan ran twice
    g = res.report["latency_guard"]
    assert g["decision"].startswith("shipped with 1 layer(s) in float") and g["slower_int8_layers"]["conv0"]
    assert "conv0" not in res.plan.layers and "dwconv" in res.plan.layers
    assert res.census.quantized_kernels.get("QLinearConv") == 2  # conv0 runs as a float Conv now


def test_the_faster_model_ships_and_the_guard_can_be_turned_off(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    _force(monkeypatch, [0.8, 0.7])
    monkeypatch.setattr(guard, "slow_int8_layers", lambda *a, **k: {"conv0": (0.1, 0.2)})
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, evaluation_data=image_batches(2, seed=1),
                            progress=False)
    assert res.report["latency_guard"]["decision"].startswith("kept all layers int8")
    assert "conv0" in res.plan.layers and any("latency guard" in w for w in res.report["warnings"])
    seen = _force(monkeypatch, [0.8])
    off = {**RECIPE, "report": {**RECIPE["report"], "latency": {"warmup": 1, "repeat": 3, "guard": False}}}
    res = quantkit.quantize(tiny_cnn(), image_batches(4), off, progress=False)
    assert seen == [0.8] and "latency_guard" not in res.report


def test_layer_times_attribute_every_layer_in_both_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    from quantkit.guard import layer_times

    res = quantkit.quantize(tiny_cnn(), image_batches(4), {**RECIPE, "report": {"latency": {"enabled": False}}},
                            progress=False, evaluate=False)
    layers = sorted(n for n, lp in res.plan.layers.items() if lp.op_type in ("Conv", "Gemm"))
    feed = next(iter(image_batches(1)))
    times = layer_times(ir.to_proto(res.float_model).SerializeToString(),
                        ir.to_proto(res.model).SerializeToString(), res.float_model, layers, feed, threads=1, runs=5)
    assert set(times) == set(layers)
    assert all(f > 0 and q > 0 for f, q in times.values()), times  # every layer found in both profiles
