"""W4A8 verified (issue 25): MatMulNBits at accuracy_level 4 against level 0, layer by layer, on calibration inputs;
greedy-token agreement with FP32.

A tiny random LLaMA gets a planted outlier input channel: one channel of a norm's weight multiplied by 256 and the
matching input rows of the layers reading it divided by 256 (the float model computes the same function, its
activations now have an outlier, as LLMs with "massive activations" do).  At level 4 the outlier sets the int8
step of its activation block and rounds the block's other channels away: those layers (and the others reading the
same input) are packed at level 0, the ordinary ones stay at 4, the emitted graph says so, and a resumed build
reproduces the levels.  The greedy-token figures are checked on planted token sequences and on the tiny model
against itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit.algorithms.equalize import act_fake_quant  # noqa: E402
from quantkit.algorithms.woq import get_weight_algorithm  # noqa: E402
from quantkit.errors import RecipeError  # noqa: E402
from quantkit.evaluate.greedy import agreement, greedy_agreement, greedy_decode, prompts_from  # noqa: E402
from quantkit.frontends.llm_builder import PackedLinear  # noqa: E402
from quantkit.layerwise import _Hook, _key, quantize_llm_layerwise  # noqa: E402
from quantkit.lowering.nbits import matmul_nbits_arrays  # noqa: E402
from quantkit.lowering.w4a8 import dequantize_nbits, level4_check, nbits_model  # noqa: E402
from quantkit.recipe import load_recipe  # noqa: E402
from quantkit.recipe.plan import PrecisionPlan  # noqa: E402
from quantkit.report.build import greedy_line, render_markdown, w4a8_line  # noqa: E402
from tests.unit.test_llm_builder import VOCAB, make_llama, reference, run_cached  # noqa: E402

FACTOR = 256.0  # a power of two: the planted model's bf16 / fp32 weights stay exact
CHANNEL = 5
THRESHOLD = 1.5


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path_factory.getbasetemp() / "quantkit-cache"))


def _plant(src: Path, dst: Path, edit: Any) -> Path:
    model = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        edit(dict(model.named_parameters()))
    model.save_pretrained(dst)
    return dst


def _qkv_outlier(p: dict[str, Any]) -> None:
    """Block 0's attention input gets an outlier channel; only q_proj's input row is scaled down to match (k and v
    read the outlier at full weight: their output is dominated by it, their level-4 error stays small)."""
    p["model.layers.0.input_layernorm.weight"][CHANNEL] *= FACTOR
    p["model.layers.0.self_attn.q_proj.weight"][:, CHANNEL] /= FACTOR


def _head_outlier(p: dict[str, Any]) -> None:
    """The final norm's output (what the tied lm_head reads) gets an outlier channel."""
    p["model.norm.weight"][CHANNEL] *= FACTOR
    p["model.embed_tokens.weight"][:, CHANNEL] /= FACTOR


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("w4a8")
    out = {}
    for tied in (False, True):
        name = "tied" if tied else "untied"
        make_llama(base / name, tied=tied)
    out["plain"] = base / "untied"
    out["qkv"] = _plant(base / "untied", base / "qkv", _qkv_outlier)
    out["tied"] = base / "tied"
    out["head"] = _plant(base / "tied", base / "head", _head_outlier)
    return out


def _plan(folder: Path, algorithm: str = "rtn", overrides: list[dict[str, Any]] | None = None) -> PrecisionPlan:
    rec = {"version": 1, "model": {"source": str(folder)}, "calibration": {"layerwise": True},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": algorithm},
                            "overrides": overrides or []}}  # fmt: skip
    return PrecisionPlan.from_recipe(load_recipe(rec))


def _windows(n: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (n, seq)).astype(np.int64)


def _levels(path: Path) -> dict[str, int]:
    m = onnx.load(str(path), load_external_data=False)
    return {n.name: next(a.i for a in n.attribute if a.name == "accuracy_level")
            for n in m.graph.node if n.op_type == "MatMulNBits"}  # fmt: skip


def _build(folder: Path, tmp: Path, name: str, algorithm: str = "rtn", threshold: float | None = THRESHOLD,
           windows: np.ndarray | None = None, overrides: list[dict[str, Any]] | None = None) -> Any:
    win = _windows(3, 16, 1) if windows is None else windows
    return quantize_llm_layerwise(folder, tmp / name / "model.onnx", _plan(folder, algorithm, overrides), win,
                                  work_dir=tmp / f"work-{name}", progress=False, w4a8_max_error_ratio=threshold)


# -- the figures of one layer ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "group", "symmetric", "K"), [(4, 32, True, 96), (4, 32, False, 80),
                                                               (4, 128, True, 200), (8, 64, False, 128)])
def test_dequantized_packed_weights_are_what_the_level0_kernel_computes(bits: int, group: int, symmetric: bool,
                                                                        K: int) -> None:
    rng = np.random.default_rng(0)
    N = 48
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    res = get_weight_algorithm("rtn")(w, bits=bits, group_size=group, symmetric=symmetric, stats=None)
    B, s, zp, bs = matmul_nbits_arrays(res)
    q = PackedLinear(B, s, zp, bits, bs, K, N, None, 4)
    np.testing.assert_array_equal(dequantize_nbits(q), res.dequantize())
    np.testing.assert_array_equal(dequantize_nbits(q, slice(8, 20)), res.dequantize()[:, 8:20])
    x = rng.standard_normal((64, K)).astype(np.float32)
    fig = level4_check(x, w, q)
    assert fig["level0_vs_math"] < 1e-5  # level 0 is exact against the dequantized weights
    assert fig["w4a8_added_error"] < 0.03  # ordinary inputs: int8 activations add little
    if bits == 4:  # ...next to a 4-bit weight error (an 8-bit one is ~16x smaller: the ratio means little there)
        assert 1.0 <= fig["w4a8_error_ratio"] < 1.2


def test_a_planted_outlier_channel_raises_the_ratio_and_the_row_budget_is_kept() -> None:
    rng = np.random.default_rng(1)
    K, N = 256, 64
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    x = rng.standard_normal((512, K)).astype(np.float32)
    x[:, 7] *= FACTOR  # an outlier channel whose weights are small: the float function is unchanged
    w[7] /= FACTOR
    res = get_weight_algorithm("rtn")(w, bits=4, group_size=128, symmetric=True, stats=None)
    B, s, zp, bs = matmul_nbits_arrays(res)
    q = PackedLinear(B, s, zp, 4, bs, K, N, None, 4)
    fig = level4_check(x, w, q)
    assert fig["w4a8_error_ratio"] > 2 * THRESHOLD and fig["w4a8_added_error"] > 0.2
    assert fig["w4a8_rows"] == 512
    assert level4_check(x, w, q, max_outputs=64 * N)["w4a8_rows"] == 64  # thinned to the output budget
    # an AWQ-style input scale: the kernel reads x / s, the math is the same
    sc = np.linspace(0.5, 2.0, K).astype(np.float32)
    res_s = get_weight_algorithm("rtn")(w * sc[:, None], bits=4, group_size=128, symmetric=True, stats=None)
    B, s2, zp, bs = matmul_nbits_arrays(res_s)
    fig_s = level4_check(x, w, PackedLinear(B, s2, zp, 4, bs, K, N, sc, 4))
    assert fig_s["level0_vs_math"] < 1e-5 and fig_s["w4a8_error_ratio"] > THRESHOLD


@pytest.mark.parametrize(("K", "group", "symmetric"), [(200, 128, True), (576, 128, False), (256, 32, False)])
def test_the_activation_emulation_is_what_the_level4_kernel_computes(K: int, group: int, symmetric: bool) -> None:
    """:func:`act_fake_quant` (AWQ's ``act_bits`` search) rounds the input as level 4 does: per row and block of the
    weights' block size (a short last block included), symmetric int8; what is left is float rounding."""
    rng = np.random.default_rng(3)
    N = 48
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    x = rng.standard_normal((64, K)).astype(np.float32)
    x[:, 5] *= 30.0  # an outlier: the int8 step of its block is large, so the activation error is too
    res = get_weight_algorithm("rtn")(w, bits=4, group_size=group, symmetric=symmetric, stats=None)
    B, s, zp, bs = matmul_nbits_arrays(res)
    q = PackedLinear(B, s, zp, 4, bs, K, N, None, 4)
    wd = dequantize_nbits(q)
    y = {lv: _run_level(q, lv, x) for lv in (0, 4)}
    level4_error = float(np.linalg.norm(y[4] - y[0]))
    assert level4_error > 1e-3 * float(np.linalg.norm(y[0]))  # the check has something to explain
    assert float(np.linalg.norm(y[4] - act_fake_quant(x, bs) @ wd)) < 0.05 * level4_error
    # a block of another length explains much less of it (the emulation's block is the kernel's)
    other = 64 if bs != 64 else 128
    assert float(np.linalg.norm(y[4] - act_fake_quant(x, other) @ wd)) > 0.3 * level4_error


def _run_level(q: PackedLinear, level: int, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(nbits_model(q, level).SerializeToString(), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"X": x})[0])


def test_exact_weights_have_an_unbounded_ratio() -> None:
    """Weights already on the 4-bit grid (weight-only error 0): any level-4 error is infinitely larger."""
    rng = np.random.default_rng(2)
    K, N = 64, 32
    codes = rng.integers(0, 16, (K, N)) - 8
    codes[0::32], codes[1::32] = -8, 7  # every group spans the whole grid: min-max lands on it exactly
    w = (codes * 0.01).astype(np.float32)
    res = get_weight_algorithm("rtn")(w, bits=4, group_size=32, symmetric=False, stats=None, clip=False)
    B, s, zp, bs = matmul_nbits_arrays(res)
    q = PackedLinear(B, s, zp, 4, bs, K, N, None, 4)
    np.testing.assert_allclose(res.dequantize(), w, atol=1e-7)
    fig = level4_check(rng.standard_normal((32, K)).astype(np.float32), w, q)
    assert fig["w4a8_error_ratio"] > 1e3 or math.isinf(fig["w4a8_error_ratio"])


# -- the layer-wise build ------------------------------------------------------------------------------------------


def test_planted_outlier_keeps_its_input_group_at_level0(folders: dict[str, Path], tmp_path: Path) -> None:
    plain = _build(folders["plain"], tmp_path, "plain")
    planted = _build(folders["qkv"], tmp_path, "qkv")
    # the ordinary model: every 4-bit layer checked, every one stays at level 4
    rows = {r["layer"]: r for r in plain.rows}
    checked = {n: r for n, r in rows.items() if r.get("w4a8_error_ratio") is not None}
    assert len(checked) == 2 * 7 + 1  # 7 linears per block + the lm_head
    assert all(r["accuracy_level"] == 4 and r["w4a8_error_ratio"] <= THRESHOLD for r in checked.values())
    assert all(r["level0_vs_math"] < 1e-5 for r in checked.values())
    assert set(_levels(plain.path).values()) == {4}
    assert plain.w4a8["checked"] == 15 and plain.w4a8["kept_level0"] == [] and plain.w4a8["threshold"] == THRESHOLD
    # the planted one: q_proj's level-4 error is far above the threshold, k / v read the same input
    rows = {r["layer"]: r for r in planted.rows}
    p = "model.layers.0.self_attn"
    q, k, v = rows[f"{p}.q_proj"], rows[f"{p}.k_proj"], rows[f"{p}.v_proj"]
    assert q["w4a8_error_ratio"] > THRESHOLD and q["w4a8_level0"].startswith("level-4 error")
    assert k["w4a8_error_ratio"] <= THRESHOLD and v["w4a8_error_ratio"] <= THRESHOLD
    assert "reads the same input as model.layers.0.self_attn.q_proj" in k["w4a8_level0"]
    assert {q["accuracy_level"], k["accuracy_level"], v["accuracy_level"]} == {0}
    qkv = {f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"}
    others = [r for n, r in rows.items() if "accuracy_level" in r and n not in qkv]
    assert others and all(r["accuracy_level"] == 4 and not r.get("w4a8_level0") for r in others)
    # the emitted graph: q/k/v still one fused kernel, at level 0; every other MatMulNBits at level 4
    levels = _levels(planted.path)
    assert levels.pop(f"{p}.qkv_proj") == 0 and set(levels.values()) == {4}
    s = planted.w4a8
    assert s["kept_level0"] == [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"] and s["kept_level0_own"] == [f"{p}.q_proj"]
    assert s["max_ratio"] == q["w4a8_error_ratio"] and s["worst_layer"] == f"{p}.q_proj"
    line = w4a8_line(s)
    assert line.startswith("W4A8 check: 3 of 15 4-bit linears kept at accuracy_level 0 (level-4 error > 1.5x the "
                           "weight-only error: model.layers.0.self_attn.q_proj; 2 more read the same input)"), line
    # no check: all at level 4 again
    off = _build(folders["qkv"], tmp_path, "off", threshold=None)
    assert set(_levels(off.path).values()) == {4} and "null" in off.w4a8["why"]
    assert w4a8_line(off.w4a8).startswith("W4A8 check: not run (export.w4a8_max_error_ratio is null")


def test_an_8bit_layer_reading_the_outlier_input_stays_at_level4(folders: dict[str, Path], tmp_path: Path) -> None:
    """q_proj's level-4 error sends the 4-bit layers reading its input to level 0; k_proj, 8-bit, stays at level 4
    (an 8-bit MatMulNBits at level 0 runs ~40x slower on ONNX Runtime's CPU kernels)."""
    p = "model.layers.0.self_attn"
    res = _build(folders["qkv"], tmp_path, "k8", overrides=[{"layer": f"{p}.k_proj", "format": "int8_weight",
                                                              "group_size": 32, "algorithm": "rtn"}])
    rows = {r["layer"]: r for r in res.rows}
    assert rows[f"{p}.q_proj"]["w4a8_error_ratio"] > THRESHOLD
    assert rows[f"{p}.q_proj"]["accuracy_level"] == 0 and rows[f"{p}.v_proj"]["accuracy_level"] == 0
    assert rows[f"{p}.k_proj"]["accuracy_level"] == 4 and not rows[f"{p}.k_proj"].get("w4a8_level0")
    nodes = {n.name: n for n in onnx.load(str(res.path), load_external_data=False).graph.node
             if n.op_type == "MatMulNBits"}
    bits = {n: next(a.i for a in node.attribute if a.name == "bits") for n, node in nodes.items()}
    levels = _levels(res.path)
    assert all(levels[n] == 4 for n, b in bits.items() if b == 8) and 8 in bits.values()
    assert res.w4a8["kept_level0"] == [f"{p}.q_proj", f"{p}.v_proj"]


def test_a_resumed_build_reproduces_the_levels(folders: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    full = _build(folders["qkv"], tmp_path, "full", algorithm="gptq")
    real_block = _Hook.block

    def crash_on_block_1(self: _Hook, index: int, weights: dict[str, Any]) -> Any:
        if index == 1:
            raise KeyboardInterrupt
        return real_block(self, index, weights)

    monkeypatch.setattr(_Hook, "block", crash_on_block_1)
    with pytest.raises(KeyboardInterrupt):
        _build(folders["qkv"], tmp_path, "again", algorithm="gptq")
    monkeypatch.setattr(_Hook, "block", real_block)
    again = _build(folders["qkv"], tmp_path, "again", algorithm="gptq")
    assert again.resumed_blocks == 1
    assert _levels(again.path) == _levels(full.path) and _levels(full.path)["model.layers.0.self_attn.qkv_proj"] == 0
    assert again.w4a8["kept_level0"] == full.w4a8["kept_level0"] != []
    key = {r["layer"]: (r["accuracy_level"], r.get("w4a8_error_ratio")) for r in full.rows if "accuracy_level" in r}
    assert {r["layer"]: (r["accuracy_level"], r.get("w4a8_error_ratio")) for r in again.rows
            if "accuracy_level" in r} == key  # fmt: skip
    # the threshold is part of the resume key: another threshold is another run
    win = _windows(3, 16, 1)
    plan = _plan(folders["qkv"], "gptq")
    assert _key(folders["qkv"], plan, win, 4, 4096, 1.5) != _key(folders["qkv"], plan, win, 4, 4096, 2.0)


def test_tied_lm_head_is_checked_on_the_final_hidden_states(folders: dict[str, Path], tmp_path: Path) -> None:
    """A tied RTN head shares the embedding's packed table; its MatMulNBits level follows its own check."""
    plain = _build(folders["tied"], tmp_path, "tied")
    planted = _build(folders["head"], tmp_path, "head")
    for res, level in ((plain, 4), (planted, 0)):
        row = next(r for r in res.rows if r["layer"] == "lm_head")
        assert row["block"] == -1 and row["accuracy_level"] == level
        assert (row["w4a8_error_ratio"] > THRESHOLD) == (level == 0)
        nodes = {n.name: n for n in onnx.load(str(res.path), load_external_data=False).graph.node}
        assert "lm_head.weight_view" in nodes  # still one table for the Gather and the head
        assert _levels(res.path)["lm_head"] == level
    assert planted.w4a8["kept_level0"] == ["lm_head"]


def test_no_calibration_data_no_check(folders: dict[str, Path], tmp_path: Path) -> None:
    res = quantize_llm_layerwise(folders["qkv"], tmp_path / "m" / "model.onnx", _plan(folders["qkv"]), None,
                                 work_dir=tmp_path / "w", progress=False, w4a8_max_error_ratio=THRESHOLD)  # fmt: skip
    assert res.w4a8["checked"] == 0 and "no calibration data" in res.w4a8["why"]
    assert set(_levels(res.path).values()) == {4}
    level0 = quantize_llm_layerwise(folders["qkv"], tmp_path / "z" / "model.onnx", _plan(folders["qkv"]),
                                    _windows(2, 8, 0), work_dir=tmp_path / "w0", accuracy_level=0, progress=False,
                                    w4a8_max_error_ratio=THRESHOLD)  # fmt: skip
    assert level0.w4a8["checked"] == 0 and "accuracy_level is 0" in level0.w4a8["why"]


def test_the_threshold_key_is_validated(folders: dict[str, Path]) -> None:
    base = {"version": 1, "model": {"source": str(folders["plain"])}}
    assert load_recipe(base).export.w4a8_max_error_ratio == THRESHOLD  # the documented default
    assert load_recipe({**base, "export": {"w4a8_max_error_ratio": None}}).export.w4a8_max_error_ratio is None
    assert load_recipe({**base, "export": {"w4a8_max_error_ratio": 3}}).export.w4a8_max_error_ratio == 3.0
    for bad in (1.0, 0.5, -2, "high"):
        with pytest.raises(RecipeError, match="export.w4a8_max_error_ratio"):
            load_recipe({**base, "export": {"w4a8_max_error_ratio": bad}})
    for bad_g in ({"prompts": 0}, {"tokens": "many"}, {"prompt_len": 3}, {"batch": 0}):
        with pytest.raises(RecipeError, match="evaluation.greedy_agreement"):
            load_recipe({**base, "evaluation": {"greedy_agreement": bad_g}})


# -- greedy-token agreement ---------------------------------------------------------------------------------------


def test_agreement_counts_planted_sequences() -> None:
    ref = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    got = np.array([[1, 2, 3, 4],     # identical
                    [5, 0, 7, 8],     # diverges at position 1, meets again at 2 and 3
                    [0, 9, 9, 9]])  # diverges at once  # fmt: skip
    forced = np.array([[1, 2, 3, 4], [5, 0, 7, 8], [9, 9, 9, 0]])
    a = agreement(ref, got, forced)
    assert a["prefix_agreement"] == pytest.approx((4 + 1 + 0) / 12)
    assert a["position_agreement"] == pytest.approx((4 + 3 + 3) / 12)
    assert a["teacher_forced_agreement"] == pytest.approx(10 / 12)
    assert a["identical_prompts"] == 1 and a["mean_tokens_before_divergence"] == pytest.approx(5 / 3)
    assert agreement(ref, ref)["prefix_agreement"] == 1.0 and "teacher_forced_agreement" not in agreement(ref, ref)
    with pytest.raises(ValueError, match="two equal"):
        agreement(ref, got[:2])


def test_prompts_are_fixed_pieces_spread_over_the_windows() -> None:
    wins = [np.arange(100 * i, 100 * i + 40) for i in range(4)]  # 4 windows of 40 tokens: 5 pieces of 8 each
    p = prompts_from(wins, 10, 8)
    assert p.shape == (10, 8) and np.array_equal(p, prompts_from(wins, 10, 8))
    assert {int(r[0]) // 100 for r in p} == {0, 1, 2, 3}  # every window contributes
    assert all(np.array_equal(r, np.arange(r[0], r[0] + 8)) for r in p)  # contiguous, inside one window
    assert prompts_from(wins, 100, 8).shape == (20, 8)  # all the pieces there are
    assert prompts_from(wins, 5, 41).shape == (0, 41)


def test_greedy_agreement_of_a_model_with_itself_and_without_fp32(folders: dict[str, Path], tmp_path: Path) -> None:
    q = _build(folders["plain"], tmp_path, "q").path
    wins = list(_windows(4, 24, 3))
    spec = {"prompts": 6, "prompt_tokens": 8, "tokens": 5}
    same = greedy_agreement(q, q, wins, spec)
    assert same["measured"] and same["prefix_agreement"] == same["position_agreement"] == 1.0
    assert same["teacher_forced_agreement"] == 1.0 and same["identical_prompts"] == 6
    assert set(same["self_consistency"]) == {"fp32", "quantized"}
    assert all(0.5 < v <= 1.0 for v in same["self_consistency"].values())
    # the decode batch is a setting: one prompt at a time decodes the same prompts
    one = greedy_agreement(q, q, wins, {**spec, "batch": 1})
    assert one["batch"] == 1 and one["prefix_agreement"] == 1.0
    # batched decoding gives the tokens of one prompt at a time
    prompts = prompts_from(wins, 6, 8)
    np.testing.assert_array_equal(greedy_decode(q, prompts, 5, batch=4), greedy_decode(q, prompts, 5, batch=1))
    none = greedy_agreement(None, q, wins, spec, why_no_fp32="FP32 baseline not evaluated: too large")
    assert none == {"measured": False, "prompt_tokens": 8, "tokens": 5, "batch": 16,
                    "why": "FP32 baseline not evaluated: too large"}  # fmt: skip
    assert greedy_line(none) == "greedy tokens vs FP32: not measured (FP32 baseline not evaluated: too large)"
    assert not greedy_agreement(q, q, wins, {**spec, "tokens": 60}, context=64)["measured"]


def test_the_report_carries_both(folders: dict[str, Path], tmp_path: Path) -> None:
    ids = _windows(3, 24, 11)
    np.savez(tmp_path / "d.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    data = {"kind": "npz", "path": str(tmp_path / "d.npz")}
    rec = {"version": 1, "model": {"source": str(folders["qkv"])},
           "calibration": {"layerwise": True, "data": data},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
           "evaluation": {"data": data, "greedy_agreement": {"prompts": 8, "prompt_tokens": 8, "tokens": 6}},
           "export": {"accuracy_level": 4}, "report": {"latency": {"enabled": False}}}  # fmt: skip
    rep = quantkit.quantize(recipe=rec, progress=False, measure_latency=False).report
    chk = rep["w4a8_check"]
    assert chk["checked"] == 15 and chk["kept_level0_own"] == ["model.layers.0.self_attn.q_proj"]
    rows = {r["layer"]: r for r in rep["layers"]}
    assert rows["model.layers.0.self_attn.k_proj"]["accuracy_level"] == 0
    assert rows["model.layers.1.mlp.down_proj"]["accuracy_level"] == 4
    g = rep["quality"]["greedy_agreement"]
    assert g["measured"] and g["prompts"] == 8 and g["tokens"] == 6 and 0.0 <= g["prefix_agreement"] <= 1.0
    assert g["prefix_agreement"] <= g["position_agreement"]
    md = render_markdown(rep)
    summary = md.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert any(ln.startswith("- W4A8 check: 3 of 15 4-bit linears kept at accuracy_level 0") for ln in summary)
    assert any(ln.startswith("- greedy tokens vs FP32 (8 prompts of 8 tokens, 6 generated each): ") for ln in summary)
    assert "| acc. level | W4A8 ratio |" in md
    rec["evaluation"]["greedy_agreement"] = None
    rep = quantkit.quantize(recipe=rec, progress=False, measure_latency=False).report
    assert "greedy_agreement" not in rep["quality"]


def test_the_console_prints_both(folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from quantkit.cli import main

    ids = _windows(3, 24, 12)
    np.savez(tmp_path / "d.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    data = {"kind": "npz", "path": str(tmp_path / "d.npz")}
    rec = {"version": 1, "model": {"source": str(folders["plain"])}, "calibration": {"layerwise": True, "data": data},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
           "evaluation": {"data": data, "greedy_agreement": {"prompts": 4, "prompt_tokens": 8, "tokens": 4}},
           "export": {"accuracy_level": 4}}  # fmt: skip
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(rec))
    assert main(["calibrate", "-q", "--recipe", str(tmp_path / "r.yaml"), "--output", str(tmp_path / "out"),
                 "--no-latency"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("W4A8 check: 0 of 15 4-bit linears kept at accuracy_level 0") for ln in out) == 1
    assert sum(ln.startswith("greedy tokens vs FP32 (4 prompts of 8 tokens, 4 generated each): ") for ln in out) == 1


# -- signround's equalize: an input scale against the int8 activations -------------------------------------------


def test_equalize_scales_the_outlier_input_and_folds_it_for_free(folders: dict[str, Path], tmp_path: Path) -> None:
    """The planted outlier channels of block 0's attention input and down_proj input: SignRound alone leaves q/k/v at
    level 0 (the check); with ``equalize`` the search scales those inputs (folded into the norm and into up_proj's
    columns: no node added), q_proj's level-4 error falls back under the threshold and the group stays on the fast
    kernel; o_proj (whose scale would need a Mul) is left."""
    def plan(equalize: bool) -> PrecisionPlan:
        opts = {"iters": 10, "equalize": True} if equalize else {"iters": 10}
        rec = {"version": 1, "model": {"source": str(folder)}, "calibration": {"layerwise": True},
               "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "signround",
                                            "algorithm_options": opts}}}  # fmt: skip
        return PrecisionPlan.from_recipe(load_recipe(rec))

    def build(name: str, equalize: bool) -> Any:
        return quantize_llm_layerwise(folder, tmp_path / name / "model.onnx", plan(equalize), _windows(3, 16, 1),
                                      work_dir=tmp_path / f"work-{name}", progress=False, w4a8_max_error_ratio=THRESHOLD)

    def down_outlier(p: dict[str, Any]) -> None:  # block 0's down_proj input gets an outlier channel too
        p["model.layers.0.mlp.up_proj.weight"][CHANNEL] *= FACTOR
        p["model.layers.0.mlp.down_proj.weight"][:, CHANNEL] /= FACTOR

    folder = _plant(folders["qkv"], tmp_path / "planted", down_outlier)

    plain, eq = build("plain", False), build("eq", True)
    p = "model.layers.0.self_attn"
    rows0 = {r["layer"]: r for r in plain.rows}
    rows1 = {r["layer"]: r for r in eq.rows}
    assert rows0[f"{p}.q_proj"]["w4a8_error_ratio"] > THRESHOLD and rows0[f"{p}.q_proj"]["accuracy_level"] == 0
    assert rows1[f"{p}.q_proj"]["w4a8_error_ratio"] < rows0[f"{p}.q_proj"]["w4a8_error_ratio"] / 2
    assert all(rows1[f"{p}.{n}"]["w4a8_equalize"] != "1" and rows1[f"{p}.{n}"]["accuracy_level"] == 4
               for n in ("q_proj", "k_proj", "v_proj"))  # fmt: skip
    assert rows1["model.layers.0.mlp.down_proj"].get("w4a8_equalize") not in (None, "1")  # its scale folds into up
    sec = eq.w4a8["equalize"]
    assert sec["groups_searched"] == 6  # 2 blocks x (q/k/v, gate/up, down)
    assert sec["groups_scaled"] >= 1
    assert sec["not_applied"] == ["lm_head"] + [f"model.layers.{i}.self_attn.o_proj" for i in (0, 1)]
    assert "input equalization (signround `equalize`)" in w4a8_line(eq.w4a8)
    assert "equalize" not in plain.w4a8
    # the scale folded: the same nodes as without it (no Mul for an input scale)
    ops = [sorted(n.op_type for n in onnx.load(str(r.path), load_external_data=False).graph.node) for r in (plain, eq)]
    assert ops[0] == ops[1]
    # ... and applied: the equalized model is as close to FP32 as the plain one (a scale not applied takes it 3x
    # further; the folds' exactness is tested with AWQ's scales, which go through the same builder code)
    ids = _windows(2, 12, 5)
    fp32 = reference(transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), ids)
    err = [float(np.linalg.norm(run_cached(r.path, ids) - fp32) / np.linalg.norm(fp32)) for r in (plain, eq)]
    assert err[1] < 1.5 * err[0] + 1e-3, err
