"""The 8-bit KV cache (recipe ``export.kv_cache: int8``, quantkit.frontends.kv_cache) on tiny random LLaMA folders.

The rewritten graph's cache inputs / outputs are int8 and every GroupQueryAttention carries the quantization
attributes and its calibrated scales; a greedy decode of 16 tokens with the int8 cache (arrays fed back, and one
shared buffer) gives the tokens of its own recomputation without a cache (every call a prefill: the prefill
quantizes the keys / values too, so like is compared with like) and stays close to the float32 cache; the layer-wise
recipe builds, evaluates and reports it; bad settings are refused naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit.errors import DataError, ModelError, RecipeError  # noqa: E402
from quantkit.evaluate.decode import measure_decode, measure_generation  # noqa: E402
from quantkit.evaluate.perplexity import perplexity  # noqa: E402
from quantkit.frontends.kv_cache import (  # noqa: E402
    calibrate_kv_scales,
    int8_kv_cache,
    kv_cache_type,
    write_int8_kv_cache,
)
from quantkit.frontends.llm_builder import LLMSession, build_llm  # noqa: E402
from quantkit.recipe import load_recipe  # noqa: E402
from tests.unit.test_llm_builder import LAYERS, VOCAB, make_llama  # noqa: E402

PROMPT, NEW = 6, 16


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path_factory.getbasetemp() / "quantkit-cache"))


def _windows(n: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (n, seq)).astype(np.int64)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("kv8")
    make_llama(base / "hf", tied=True)
    fp = build_llm(base / "hf", base / "fp32" / "model.onnx", genai_config=False)
    q = build_llm(base / "hf", base / "int8" / "model.onnx", genai_config=False)
    k, v = calibrate_kv_scales(fp, _windows(4, 32, 1))
    write_int8_kv_cache(q, k, v)
    return {"folder": base / "hf", "fp32": fp, "int8": q, "k": k, "v": v}


def test_graph_has_an_int8_cache_with_the_attributes_and_scales(built: dict[str, Any]) -> None:
    m = onnx.load(str(built["int8"]), load_external_data=False)
    io = [v for v in [*m.graph.input, *m.graph.output] if v.name.startswith(("past_key_values.", "present."))]
    assert len(io) == 4 * LAYERS and all(v.type.tensor_type.elem_type == onnx.TensorProto.INT8 for v in io)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer if t.name.endswith("_scale")}
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == LAYERS
    for i, n in enumerate(gqa):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL" and attrs["kv_cache_bit_width"] == 8
        assert n.input[3] == f"past_key_values.{i}.key" and len(n.input) == 14
        assert list(n.input[9:12]) == ["", "", ""]
        ks, vs = inits[n.input[12]], inits[n.input[13]]
        assert ks.shape == vs.shape == (1, 2, 1, 16) and ks.dtype == np.float32
        np.testing.assert_array_equal(ks[0, :, 0], built["k"][i])
        np.testing.assert_array_equal(vs[0, :, 0], built["v"][i])
    assert kv_cache_type(built["int8"]) == "int8" and kv_cache_type(built["fp32"]) == "float32"
    assert {p.key: p.value for p in m.metadata_props}["kv_cache"] == "int8"
    # the scales cover what was calibrated: a key pair's norm, a value's absmax, over the windows
    assert np.all(built["k"] > 0) and np.all(built["v"] > 0)
    k = built["k"][:, :, :8]
    np.testing.assert_array_equal(k, built["k"][:, :, 8:16])  # one scale per rotary pair (head_dim 16, pairs j, j+8)


def _greedy_cached(path: Path, prompt: np.ndarray, max_length: int | None,
                   forced: list[int] | None = None) -> tuple[list[int], np.ndarray]:
    """Greedy tokens with the KV cache, and the last-position logits of the prompt and of every step
    (``forced``: feed these tokens instead of the greedy ones)."""
    sess = LLMSession(path, max_length=max_length)
    logits = sess(prompt)
    rows = [logits[0, -1].copy()]
    out: list[int] = []
    for t in range(NEW):
        out.append(int(np.argmax(logits[0, -1])))
        logits = sess(np.asarray([[out[-1] if forced is None else forced[t]]], np.int64))
        rows.append(logits[0, -1].copy())
    return out, np.stack(rows)


def _greedy_recomputed(path: Path, prompt: np.ndarray) -> list[int]:
    """Every token from a prefill of the whole sequence so far (no cache kept between calls)."""
    ids = prompt
    out: list[int] = []
    for _ in range(NEW):
        nxt = int(np.argmax(LLMSession(path)(ids)[0, -1]))
        out.append(nxt)
        ids = np.concatenate([ids, [[nxt]]], axis=1)
    return out


@pytest.mark.parametrize("seed", [3, 4])
def test_int8_cache_decode_equals_its_recomputation_and_is_close_to_float(built: dict[str, Any], seed: int) -> None:
    prompt = _windows(1, PROMPT, seed)
    toks, rows = _greedy_cached(built["int8"], prompt, None)
    shared, _ = _greedy_cached(built["int8"], prompt, PROMPT + NEW)
    assert toks == shared == _greedy_recomputed(built["int8"], prompt)
    assert LLMSession(built["int8"]).cache_dtype == np.int8
    # the float32 cache on the same tokens: the logits differ by the cache's rounding only (1 to 13 % per step, 3 to
    # 4 % on average here: this random model's attention is peaked; its greedy tokens are chaotic, a 1 % change
    # flips some, so they are not compared)
    _, frows = _greedy_cached(built["fp32"], prompt, PROMPT + NEW, forced=toks)
    err = np.linalg.norm(rows - frows, axis=1) / np.linalg.norm(frows, axis=1)
    assert 0 < err.mean() < 0.05 and err.max() < 0.2


def test_feeds_follow_the_cache_type(built: dict[str, Any]) -> None:
    ids = _windows(2, 12, 5)

    class Data:  # an evaluation set bound to the float32 decoder (float32 empty pasts), as llm_run makes it
        def __len__(self) -> int:
            return 2

        def batches(self, n: int) -> Any:
            for j in range(2):
                feed = {"input_ids": ids[j : j + 1], "attention_mask": np.ones((1, 12), np.int64)}
                feed.update({f"past_key_values.{i}.{kv}": np.zeros((1, 2, 0, 16), np.float32)
                             for i in range(LAYERS) for kv in ("key", "value")})  # fmt: skip
                yield feed

    p8, p32 = perplexity(str(built["int8"]), Data())["ppl"], perplexity(str(built["fp32"]), Data())["ppl"]
    assert p8 == pytest.approx(p32, rel=0.05) and p8 != p32
    models = {"fp32": str(built["fp32"]), "int8": str(built["int8"])}
    assert set(measure_decode(models, past_len=8, warmup=1, repeat=2, rounds=1)) == set(models)
    gen = measure_generation(models, prompt_len=8, new_tokens=4, rounds=1, warmup_tokens=1)
    gen2 = measure_generation(models, prompt_len=8, new_tokens=4, rounds=1, warmup_tokens=1, shared_cache=False)
    assert gen["int8"]["steps"] == gen2["int8"]["steps"] == 4


def test_bad_settings_are_refused(built: dict[str, Any]) -> None:
    with pytest.raises(RecipeError, match=r"export\.kv_cache.*float32.*int8|export\.kv_cache.*int8.*float32"):
        load_recipe({"version": 1, "export": {"kv_cache": "int4"}})
    assert load_recipe({"version": 1}).export.kv_cache == "float32"
    with pytest.raises(ModelError, match="not float32"):
        int8_kv_cache(onnx.load(str(built["int8"]), load_external_data=False), built["k"], built["v"])
    with pytest.raises(ModelError, match="expected"):
        int8_kv_cache(onnx.load(str(built["fp32"]), load_external_data=False), built["k"][:1], built["v"])
    with pytest.raises(ModelError, match="already has"):
        calibrate_kv_scales(built["int8"], _windows(1, 8, 0))
    with pytest.raises(DataError, match="policy"):
        calibrate_kv_scales(built["fp32"], _windows(1, 8, 0), policy="tensor")
    rec = {"version": 1, "model": {"source": str(built["folder"])}, "calibration": {"layerwise": True},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
           "export": {"kv_cache": "int8"}, "report": {"latency": {"enabled": False}}}  # fmt: skip
    with pytest.raises(RecipeError, match=r"export\.kv_cache: int8 .*calibration"):
        quantkit.quantize(recipe=rec, progress=False)
    # the whole-graph path emits no KV-cache decoder of the layer-wise builder: refused before any work
    whole = {**rec, "calibration": {"layerwise": False}}
    with pytest.raises(RecipeError, match=r"export\.kv_cache 'int8'.*whole-graph.*allowed here: export\.kv_cache: "
                                          r"float32"):
        quantkit.quantize(recipe=whole, progress=False)


def test_layerwise_recipe_ships_an_int8_cache(built: dict[str, Any], tmp_path: Path) -> None:
    ids = _windows(3, 24, 7)
    np.savez(tmp_path / "d.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    data = {"kind": "npz", "path": str(tmp_path / "d.npz")}
    rec = {"version": 1, "model": {"source": str(built["folder"])}, "calibration": {"layerwise": True, "data": data},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
           "evaluation": {"data": data}, "export": {"kv_cache": "int8"},
           "report": {"latency": {"enabled": False}}}  # fmt: skip
    res = quantkit.quantize(recipe=rec, progress=False, measure_latency=False)
    rep = res.report
    assert rep["kv_cache"]["type"] == "int8" and rep["kv_cache"]["calibration_windows"] == [3, 24]
    assert rep["kv_cache"]["bytes_per_position"] * 4 == rep["kv_cache"]["float32_bytes_per_position"]
    assert kv_cache_type(res.path) == "int8"
    assert rep["quality"]["perplexity_quantized"]["tokens"] == 3 * 23
