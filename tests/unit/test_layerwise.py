"""Layer-wise, streaming weight-only quantization (quantkit.layerwise, calibration.layerwise in a recipe).

On tiny random LLaMA folders: the streamed RTN build equals the whole-graph path code for code (same
logits); GPTQ calibrated block by block runs what ships (MatMulNBits in the block graphs) and an interrupted
run resumes from its last finished block with the same result; a block graph alone matches the full model's
hidden states; bad recipes are refused naming the key and the allowed values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit.errors import RecipeError  # noqa: E402
from quantkit.frontends import llm_builder  # noqa: E402
from quantkit.frontends.llm_builder import LLMSession, block_model, read_decoder_config  # noqa: E402
from quantkit.layerwise import _Hook, quantize_llm_layerwise  # noqa: E402
from quantkit.recipe import load_recipe  # noqa: E402
from quantkit.recipe.plan import PrecisionPlan  # noqa: E402
from tests.unit.test_llm_builder import VOCAB, make_llama, reference  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path_factory.getbasetemp() / "quantkit-cache"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[Path, Any]]:
    out = {}
    for tied in (True, False):
        base = tmp_path_factory.mktemp(f"lw-{'tied' if tied else 'untied'}")
        out[tied] = (base / "hf", make_llama(base / "hf", tied=tied, dtype=torch.bfloat16))
    return out


def _recipe(folder: Path, **default: Any) -> dict[str, Any]:
    return {"version": 1, "model": {"source": str(folder)}, "calibration": {"layerwise": True},
            "quantization": {"default": {"format": "int4", "group_size": 32, **default}},
            "report": {"latency": {"enabled": False}}}  # fmt: skip


def _windows(n: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (n, seq)).astype(np.int64)


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return LLMSession(path)(ids)


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_rtn_equals_the_whole_graph_path(folders: dict[bool, tuple[Path, Any]], tied: bool,
                                                  tmp_path: Path) -> None:
    folder, _ = folders[tied]
    rec = _recipe(folder, algorithm="rtn", algorithm_options={"clip": False})
    lw = quantkit.quantize(recipe=rec, progress=False, evaluate=False)
    rec["calibration"]["layerwise"] = False
    cal = {"input_ids": _windows(2, 8, 0), "attention_mask": np.ones((2, 8), np.int64)}
    whole = quantkit.quantize(recipe=rec, calibration_data=cal, progress=False, evaluate=False, measure_latency=False)
    whole.save(tmp_path / "whole")
    ids = _windows(1, 12, 5)
    a, b = _logits(lw.path, ids), _logits(tmp_path / "whole" / "model.onnx", ids)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.abs(b).max()))
    kernels = lw.report["census"]["quantized_kernels"]
    # per block: q/k/v as one MatMulNBits (GroupQueryAttention reads the packed output), o, gate, up, down
    assert kernels["MatMulNBits"] == 5 * 2 + 1  # + lm_head
    assert kernels.get("GatherBlockQuantized", 0) == (1 if tied else 0)  # a tied table is stored once
    assert lw.report["calibration"]["tokens"] == 0  # RTN: no block was run


def test_block_graph_reproduces_the_decoders_hidden_states(folders: dict[bool, tuple[Path, Any]]) -> None:
    folder, model = folders[False]
    cfg = read_decoder_config(folder)
    ckpt = llm_builder._Checkpoint(folder)
    ids = _windows(1, 9, 3)
    with torch.no_grad():
        hs = model(torch.from_numpy(ids), output_hidden_states=True).hidden_states
    for i in range(cfg.num_hidden_layers):
        w = dict(ckpt.read(llm_builder.block_tensor_names(cfg, i, ckpt.__contains__)))
        proto = block_model(cfg, i, w, {}, [f"model.layers.{i}.mlp.down_proj"])
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
        out, tap = sess.run(None, {"hidden": hs[i].numpy(), "attention_mask": np.ones((1, 9), np.int64),
                                   f"past_key_values.{i}.key": empty, f"past_key_values.{i}.value": empty})  # fmt: skip
        want = hs[i + 1].numpy() if i + 1 < cfg.num_hidden_layers else None
        if want is not None:  # the last hidden state of transformers is after the final norm
            np.testing.assert_allclose(out, want, atol=2e-4 * float(np.abs(want).max()))
        assert tap.shape == (1, 9, cfg.intermediate_size)


def test_tap_only_block_graph_keeps_only_what_the_tap_needs(folders: dict[bool, tuple[Path, Any]]) -> None:
    """hidden_out=False: the block graph keeps only the nodes a tap depends on (ONNX Runtime runs every node of a
    graph whatever is fetched), and the tap's values are the full block graph's, bit for bit."""
    folder, _ = folders[False]
    cfg = read_decoder_config(folder)
    ckpt = llm_builder._Checkpoint(folder)
    i = 1
    w = dict(ckpt.read(llm_builder.block_tensor_names(cfg, i, ckpt.__contains__)))
    rng = np.random.default_rng(0)
    empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    feed = {"hidden": rng.standard_normal((1, 9, cfg.hidden_size)).astype(np.float32),
            "attention_mask": np.ones((1, 9), np.int64), f"past_key_values.{i}.key": empty,
            f"past_key_values.{i}.value": empty}  # fmt: skip
    full = block_model(cfg, i, w, {}, [])
    sizes = []
    for layer in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        tap = f"model.layers.{i}.{layer}"
        both = block_model(cfg, i, w, {}, [tap])
        only = block_model(cfg, i, w, {}, [tap], hidden_out=False)
        assert [o.name for o in only.graph.output] == [f"{tap}/input"]
        sizes.append(len(only.graph.node))
        assert len(only.graph.node) < len(both.graph.node)
        assert {t.name for t in only.graph.initializer} <= {t.name for t in both.graph.initializer}
        run = {k: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
               for k, m in (("both", both), ("only", only))}
        a = run["both"].run([f"{tap}/input"], feed)[0]
        b = run["only"].run(None, {k: v for k, v in feed.items()
                                   if k in {x.name for x in run["only"].get_inputs()}})[0]
        np.testing.assert_array_equal(a, b)
    assert sizes == sorted(sizes) and sizes[-1] < len(full.graph.node)  # later taps need more of the block
    with pytest.raises(ValueError, match="needs at least one tap"):
        block_model(cfg, i, w, {}, [], hidden_out=False)


def test_gptq_layerwise_resumes_after_an_interrupt(folders: dict[bool, tuple[Path, Any]], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_BUILD_PROCESS", "this")  # the patched code runs in this process
    folder, model = folders[True]
    plan = PrecisionPlan.from_recipe(load_recipe(_recipe(folder, algorithm="gptq")))
    win = _windows(3, 16, 1)
    full = quantize_llm_layerwise(folder, tmp_path / "a" / "model.onnx", plan, win, work_dir=tmp_path / "w1",
                                  progress=False)  # fmt: skip
    assert full.resumed_blocks == 0 and not (tmp_path / "w1").exists()  # work folder removed on success
    # the tied head is rounded by GPTQ from the final hidden states and stored apart from the embedding (a
    # Gather, rounded to the nearest level)
    algos = {r["layer"]: r["algorithm"] for r in full.rows}
    assert algos.pop("model.embed_tokens") == "rtn" and set(algos.values()) == {"gptq"} and "lm_head" in algos
    assert all(np.isfinite(r["output_sqnr_db"]) for r in full.rows if r["layer"] != "model.embed_tokens")

    real_block = _Hook.block

    def crash_on_block_1(self: _Hook, index: int, weights: dict[str, Any]) -> Any:
        if index == 1:
            raise KeyboardInterrupt
        return real_block(self, index, weights)

    monkeypatch.setattr(_Hook, "block", crash_on_block_1)
    with pytest.raises(KeyboardInterrupt):
        quantize_llm_layerwise(folder, tmp_path / "b" / "model.onnx", plan, win, work_dir=tmp_path / "w2",
                               progress=False)  # fmt: skip
    assert (tmp_path / "w2" / "block_0.npz").is_file()
    monkeypatch.setattr(_Hook, "block", real_block)
    again = quantize_llm_layerwise(folder, tmp_path / "b" / "model.onnx", plan, win, work_dir=tmp_path / "w2",
                                   progress=False)  # fmt: skip
    assert again.resumed_blocks == 1
    ids = _windows(1, 10, 9)
    np.testing.assert_array_equal(_logits(full.path, ids), _logits(again.path, ids))
    # on the data it was calibrated on, GPTQ block by block is closer to the float model than RTN
    rtn_plan = PrecisionPlan.from_recipe(load_recipe(_recipe(folder, algorithm="rtn")))
    rtn = quantize_llm_layerwise(folder, tmp_path / "r" / "model.onnx", rtn_plan, None, work_dir=tmp_path / "w3",
                                 progress=False)  # fmt: skip
    ref = reference(model, win)
    err = {k: float(np.mean((np.concatenate([_logits(p, win[j:j + 1]) for j in range(len(win))]) - ref) ** 2))
           for k, p in (("gptq", again.path), ("rtn", rtn.path))}  # fmt: skip
    assert err["gptq"] < err["rtn"], err


def test_tied_head_from_statistics_is_stored_apart(folders: dict[bool, tuple[Path, Any]], tmp_path: Path) -> None:
    """A tied model whose lm_head plan needs statistics: the embedding table (RTN, the embedding's own plan entry)
    feeds GatherBlockQuantized alone; the head is its own GPTQ MatMulNBits, rounded after the last block; on the
    calibration windows it is closer to the float model than the shared RTN table."""
    import onnx

    folder, model = folders[True]
    win = _windows(3, 16, 6)
    rec = _recipe(folder, algorithm="rtn", algorithm_options={"clip": False})
    rec["quantization"]["overrides"] = [{"layer": "lm_head", "format": "int4", "group_size": 32, "algorithm": "gptq"},
                                        {"layer": "model.embed_tokens", "format": "int8_weight"}]  # fmt: skip
    apart = quantize_llm_layerwise(folder, tmp_path / "a" / "model.onnx", PrecisionPlan.from_recipe(load_recipe(rec)),
                                   win, work_dir=tmp_path / "w1", progress=False)  # fmt: skip
    rec["quantization"]["overrides"] = [{"layer": "lm_head", "format": "int4", "group_size": 32, "algorithm": "rtn",
                                         "algorithm_options": {"clip": False}}]  # fmt: skip
    shared = quantize_llm_layerwise(folder, tmp_path / "s" / "model.onnx", PrecisionPlan.from_recipe(load_recipe(rec)),
                                    win, work_dir=tmp_path / "w2", progress=False)  # fmt: skip
    m = onnx.load(str(apart.path), load_external_data=False)
    nodes = {n.name: n for n in m.graph.node}
    gather, head = nodes["model.embed_tokens"], nodes["lm_head"]
    attrs = {a.name: a.i for a in gather.attribute}
    assert gather.op_type == "GatherBlockQuantized" and attrs["bits"] == 8
    assert head.op_type == "MatMulNBits" and head.input[1] != gather.input[0] and "lm_head.weight_view" not in nodes
    rows = {r["layer"]: r for r in apart.rows}
    assert rows["lm_head"]["algorithm"] == "gptq" and rows["model.embed_tokens"]["format"] == "int8_weight"
    ref = reference(model, win)
    err = {k: float(np.mean((np.concatenate([_logits(p, win[j:j + 1]) for j in range(len(win))]) - ref) ** 2))
           for k, p in (("apart", apart.path), ("shared", shared.path))}  # fmt: skip
    assert err["apart"] < err["shared"], err
    ms = onnx.load(str(shared.path), load_external_data=False)
    assert "lm_head.weight_view" in {n.name for n in ms.graph.node}  # an RTN head still shares the table
    # ... and its scales: one tensor read by both nodes, not a copy
    snodes = {n.name: n for n in ms.graph.node}
    assert snodes["lm_head"].input[2] == snodes["model.embed_tokens"].input[2]
    assert not any(t.name.startswith("lm_head.") for t in ms.graph.initializer)


def test_awq_scales_fold_into_the_norms_and_the_model_runs(folders: dict[bool, tuple[Path, Any]],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_BUILD_PROCESS", "this")  # the patched code runs in this process
    folder, model = folders[False]
    plan = PrecisionPlan.from_recipe(load_recipe(_recipe(folder, algorithm="awq")))
    res = quantize_llm_layerwise(folder, tmp_path / "m" / "model.onnx", plan, _windows(3, 16, 2),
                                 work_dir=tmp_path / "w", progress=False)  # fmt: skip
    import onnx

    m = onnx.load(str(res.path), load_external_data=False)
    muls = [n.name for n in m.graph.node if n.name.endswith("/input_scale")]
    # q/k/v and gate/up fold 1/s into their RMSNorm, down_proj's into up_proj's column scales; o_proj and lm_head
    # get an explicit Mul
    assert all(("o_proj" in n) or n.startswith("lm_head") for n in muls) and len(muls) == 2 + 1, muls
    assert not any("q_proj" in n or "gate_proj" in n or "down_proj" in n for n in muls)
    ids = _windows(1, 10, 4)
    assert float(np.corrcoef(_logits(res.path, ids).ravel(), reference(model, ids).ravel())[0, 1]) > 0.9
    # the fold is exact: the same codes with an explicit Mul(x, 1/s) before down_proj give the same logits
    monkeypatch.setattr(llm_builder, "_fold_into_up", lambda up, down, bias: (up, down, bias))
    unfolded = quantize_llm_layerwise(folder, tmp_path / "u" / "model.onnx", plan, _windows(3, 16, 2),
                                      work_dir=tmp_path / "w2", progress=False)  # fmt: skip
    a, b = _logits(res.path, ids), _logits(unfolded.path, ids)
    np.testing.assert_allclose(a, b, atol=1e-4 * float(np.abs(b).max()))


def test_layerwise_recipe_errors(folders: dict[bool, tuple[Path, Any]]) -> None:
    folder, _ = folders[True]
    with pytest.raises(RecipeError, match="allowed: .*int4"):
        quantkit.quantize(recipe={**_recipe(folder), "quantization": {"default": {"format": "int8"}}},
                          progress=False)  # fmt: skip
    rec = _recipe(folder)
    rec["quantization"]["overrides"] = [{"layer": "model.layers.1.mlp.down_proj", "format": "int8_dynamic"}]
    with pytest.raises(RecipeError, match="model.layers.1.mlp.down_proj.*int8_dynamic"):
        quantkit.quantize(recipe=rec, progress=False)
    with pytest.raises(quantkit.errors.ModelError, match="allowed: a folder path, smollm2-135m"):
        quantkit.quantize(recipe={**_recipe(folder), "model": {"source": "efficientnet-lite0"}}, progress=False)
    with pytest.raises(quantkit.errors.DataError, match="need calibration data"):
        quantkit.quantize(recipe=_recipe(folder, algorithm="gptq"), progress=False)


@pytest.mark.parametrize("layerwise", [True, False])
def test_evaluation_extra_texts_get_their_own_perplexity(folders: dict[bool, tuple[Path, Any]], tmp_path: Path,
                                                         layerwise: bool) -> None:
    folder, _ = folders[True]
    paths = []
    for k, seed in (("main", 11), ("other", 12)):
        ids = _windows(3, 16, seed)
        np.savez(tmp_path / f"{k}.npz", input_ids=ids, attention_mask=np.ones_like(ids))
        paths.append(str(tmp_path / f"{k}.npz"))
    rec = _recipe(folder, algorithm="rtn")
    rec["calibration"] = {"layerwise": layerwise, "data": {"kind": "npz", "path": paths[0]}}
    rec["evaluation"] = {"data": {"kind": "npz", "path": paths[0]}, "extra": [{"kind": "npz", "path": paths[1]}]}
    rep = quantkit.quantize(recipe=rec, progress=False, measure_latency=False).report
    extra = rep["quality"]["perplexity_extra"]
    (row,) = extra.values()
    assert row["fp32"]["tokens"] == row["quantized"]["tokens"] == 3 * 15
    assert row["increase"] == pytest.approx(row["quantized"]["ppl"] / row["fp32"]["ppl"] - 1)
    assert row["fp32"]["ppl"] != pytest.approx(rep["quality"]["perplexity_fp32"]["ppl"])  # another text
    from quantkit.report.build import render_markdown

    assert "Other held-out texts" in render_markdown(rep)


def _mix_recipe(folder: Path, tmp_path: Path, **search: Any) -> dict[str, Any]:
    for k, seed in (("cal", 21), ("ev", 22)):
        ids = _windows(4, 16, seed)
        np.savez(tmp_path / f"{k}.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    rec = _recipe(folder, algorithm="gptq")
    rec["calibration"] = {"layerwise": "auto", "data": {"kind": "npz", "path": str(tmp_path / "cal.npz")}}
    rec["evaluation"] = {"data": {"kind": "npz", "path": str(tmp_path / "ev.npz")}}
    rec["search"] = {"candidates": [{"name": "int4", "format": "int4", "group_size": 32},
                                    {"name": "w8", "format": "int8_weight", "group_size": 32, "algorithm": "rtn"}],
                     "target": {"size": "between:int4:w8:0.5"}, "tie": "none",
                     "sensitivity": {"samples": 2, "seq_len": 8}, **search}
    return rec


def test_a_weight_only_search_is_solved_on_the_whole_graph_and_built_layer_wise(
        folders: dict[bool, tuple[Path, Any]], tmp_path: Path) -> None:
    """The byte-budgeted 4/8-bit mix: the search's formats are the shipped model's, and the emitted file fits the
    budget (the embedding the build stores apart - a GPTQ head on a tied table - is counted)."""
    folder, _ = folders[True]
    res = quantkit.quantize(recipe=_mix_recipe(folder, tmp_path), progress=False, measure_latency=False)
    s = res.report["search"]
    assert s["counts"].get("int4") and s["counts"].get("w8"), s["counts"]  # a real mix at the midpoint
    assert s["embedding_apart_bytes"] == 0  # the tied lm_head is searched: its candidates carry those bytes
    # searched in a child process (a folder and recipe data pickle): its memory is gone before the build
    assert s["process"].startswith("a child process") and s["search_wall_s"] >= s["search_s"]
    # every searched layer was built in its candidate's format (q / k / v share one packed kernel)
    built = {r["layer"]: r for r in res.report["layers"]}
    fmt = {"int4": ("int4", 4), "w8": ("int8_weight", 8)}
    for row in s["assignment"]:
        assert (built[row["layer"]]["format"], built[row["layer"]]["bits"]) == fmt[row["candidate"]], row
    model = onnx.load(str(res.path), load_external_data=False)
    bits = {next(a.i for a in n.attribute if a.name == "bits") for n in model.graph.node if n.op_type == "MatMulNBits"}
    assert bits == {4, 8}
    # the budget is the emitted file's (whole-graph prediction + what the streamed build stores apart)
    # the budget bounds the emitted tensors (this tiny model's file is mostly the page padding of its weights file)
    assert s["emitted_tensor_bytes"] <= s["budget_bytes"]
    assert s["emitted_bytes"] > s["emitted_tensor_bytes"]
    assert np.isfinite(res.report["quality"]["perplexity_quantized"]["ppl"])


def test_a_fraction_budget_of_a_layer_wise_mix_is_of_the_fp32_model(
        folders: dict[bool, tuple[Path, Any]], tmp_path: Path) -> None:
    """With the lm_head pinned (GPTQ, 4-bit: the build stores the embedding apart) a size fraction bounds the emitted
    tensors against the FP32 weights, not against the search's own partly quantized FP32 point."""
    folder, _ = folders[True]
    rec = _mix_recipe(folder, tmp_path, target={"size": 0.45})
    rec["quantization"]["overrides"] = [{"layer": "lm_head", "format": "int4", "group_size": 32,
                                         "algorithm": "gptq"}]
    s = quantkit.quantize(recipe=rec, progress=False, measure_latency=False).report["search"]
    assert s["embedding_apart_bytes"] > 0 and s["budget_bytes"] == pytest.approx(0.45 * s["fp32_bytes"])
    assert s["emitted_tensor_bytes"] <= s["budget_bytes"]
    assert s["counts"].get("w8")  # the room left over went to 8-bit layers


def test_a_weight_only_search_built_layer_wise_takes_a_size_target_only(
        folders: dict[bool, tuple[Path, Any]], tmp_path: Path) -> None:
    folder, _ = folders[True]
    rec = _mix_recipe(folder, tmp_path, target={"latency": 0.5})
    with pytest.raises(RecipeError, match=r"search.target \{'latency': 0.5\}.*allowed: search.target: \{size"):
        quantkit.quantize(recipe=rec, progress=False, measure_latency=False)
    rec = _mix_recipe(folder, tmp_path)
    rec["search"]["candidates"].append({"name": "dyn", "format": "int8_dynamic"})
    rec["calibration"]["layerwise"] = True
    with pytest.raises(RecipeError, match=r"\['int8_dynamic'\].*allowed: search candidates in"):
        quantkit.quantize(recipe=rec, progress=False, measure_latency=False)
    # a budget nothing fits: refused inside the search's child process, raised here with its own type and text
    rec = _mix_recipe(folder, tmp_path, target={"size": 0.01})
    with pytest.raises(RecipeError, match=r"no assignment of the candidates fits .* the smallest these candidates "
                                          r"reach is .*allowed: a size target of at least that") as err:
        quantkit.quantize(recipe=rec, progress=False, measure_latency=False)
    import re

    least = float(re.search(r"reach is \S+ bytes \(([0-9.]+) of FP32", str(err.value)).group(1))
    assert 0.01 < least < 1.0
    # ... and that smallest size is one a target can ask for
    rec = _mix_recipe(folder, tmp_path, target={"size": least + 0.002})
    assert quantkit.quantize(recipe=rec, progress=False, measure_latency=False).report["search"]["counts"]


def test_the_mix_searches_in_a_child_only_when_its_inputs_pickle() -> None:
    from quantkit.child import picklable as _picklable

    assert _picklable(("smollm2-135m", None, {"version": 1}, None, False, True))
    assert not _picklable((lambda: None, None, None, None, False, True))  # an in-memory object: in-process


def test_the_build_in_a_child_process_emits_the_same_model(folders: dict[bool, tuple[Path, Any]],
                                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The layer-wise build runs in a spawned process by default (its memory returns to the system before the
    evaluation's sessions): the same model as in this process, the choice in the report, a bad setting refused."""
    import onnx

    from quantkit.errors import QuantkitError

    folder, _ = folders[True]
    rec = _recipe(folder, algorithm="gptq")
    cal = {"input_ids": _windows(2, 8, 0), "attention_mask": np.ones((2, 8), np.int64)}
    built = {}
    for how in ("child", "this"):
        monkeypatch.setenv("QUANTKIT_BUILD_PROCESS", how)
        res = quantkit.quantize(recipe=rec, calibration_data=cal, progress=False, evaluate=False)
        assert res.report["calibration"]["build_process"] == how
        res.save(tmp_path / how)
        m = onnx.load(str(tmp_path / how / "model.onnx"))
        built[how] = {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}
    assert built["child"] == built["this"]
    monkeypatch.setenv("QUANTKIT_BUILD_PROCESS", "elsewhere")
    with pytest.raises(QuantkitError, match="allowed values: auto, child, this"):
        quantkit.quantize(recipe=rec, calibration_data=cal, progress=False, evaluate=False)


def test_gptq_in_column_slices_gives_the_layer_quantized_whole(folders: dict[bool, tuple[Path, Any]],
                                                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """GPTQ treats every output column on its own given the layer's Hessian: a wide layer (an lm_head) quantized in
    column slices, for a bounded peak, is bit-identical to the layer quantized whole."""
    import onnx

    import quantkit.layerwise as lw

    monkeypatch.setenv("QUANTKIT_BUILD_PROCESS", "this")
    folder, _ = folders[False]
    rec = _recipe(folder, algorithm="gptq")
    cal = {"input_ids": _windows(2, 8, 0), "attention_mask": np.ones((2, 8), np.int64)}
    built = {}
    for how in ("whole", "slices"):
        if how == "slices":  # slices of 64 of the 256 columns
            monkeypatch.setattr(lw, "_COLUMN_WISE", {**lw._COLUMN_WISE, "gptq": 1})
            monkeypatch.setattr(lw, "_MIN_COLUMNS", 64)
        res = quantkit.quantize(recipe=rec, calibration_data=cal, progress=False, evaluate=False)
        res.save(tmp_path / how)
        m = onnx.load(str(tmp_path / how / "model.onnx"))
        built[how] = {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}
    assert built["whole"] == built["slices"]


@pytest.mark.parametrize("tied", [True, False])
def test_hot_rows_of_the_lm_head_are_8_bit_and_the_logits_keep_their_order(
        folders: dict[bool, tuple[Path, Any]], tmp_path: Path, tied: bool) -> None:
    """``hot_rows``: the lm_head's vocabulary rows most frequent in the calibration windows at 8 bits (a second
    MatMulNBits) written over the 4-bit logits by ScatterElements, the rest as planned.  Checked against the
    same build without hot rows: the cold columns' logits are the same numbers, the hot columns' are closer to the
    float model's, and the hot ids are exactly the most frequent calibration tokens."""
    folder, model = folders[tied]
    rng = np.random.default_rng(9)
    favourite = np.array([5, 17, 200, 41])  # calibration text that uses these tokens most
    win = np.where(rng.random((3, 16)) < 0.6, rng.choice(favourite, (3, 16)), rng.integers(0, VOCAB, (3, 16)))
    rec = _recipe(folder, format="fp32")  # the blocks float: the logits' error is the head's
    head = {"layer": "lm_head", "format": "int4", "group_size": 32, "algorithm": "gptq"}
    rec["quantization"]["overrides"] = [{**head, "hot_rows": 4}]
    hot = quantize_llm_layerwise(folder, tmp_path / "h" / "model.onnx", PrecisionPlan.from_recipe(load_recipe(rec)),
                                 win, work_dir=tmp_path / "w1", progress=False)  # fmt: skip
    rec["quantization"]["overrides"] = [head]
    plain = quantize_llm_layerwise(folder, tmp_path / "p" / "model.onnx", PrecisionPlan.from_recipe(load_recipe(rec)),
                                   win, work_dir=tmp_path / "w2", progress=False)  # fmt: skip
    m = onnx.load(str(hot.path), load_external_data=False)
    nodes = {n.name: n for n in m.graph.node}
    bits = {k: {a.name: a.i for a in nodes[k].attribute}["bits"] for k in ("lm_head", "lm_head.hot")}
    assert bits == {"lm_head": 4, "lm_head.hot": 8}
    assert nodes["lm_head/hot_rows"].op_type == "ScatterElements" and nodes["lm_head/hot_rows"].output[0] == "logits"
    rows = {r["layer"]: r for r in hot.rows}
    assert rows["lm_head.hot"]["N"] == 4 and rows["lm_head"]["N"] == VOCAB
    assert rows["lm_head"]["algorithm"] == "gptq" and rows["lm_head.hot"]["bits"] == 8
    ids = _windows(2, 12, 3)
    got, base = _logits(hot.path, ids), _logits(plain.path, ids)
    ref = reference(model, ids)
    cold = np.setdiff1d(np.arange(VOCAB), favourite)
    np.testing.assert_allclose(got[..., cold], base[..., cold], atol=1e-4, rtol=0)  # the same 4-bit head
    err_hot, err_plain = (float(np.mean((x[..., favourite] - ref[..., favourite]) ** 2)) for x in (got, base))
    assert err_hot < 0.5 * err_plain, (err_hot, err_plain)
    with pytest.raises(Exception, match="hot_rows"):
        load_recipe({**rec, "quantization": {"overrides": [{**head, "hot_rows": -1}]}})


def test_hot_rows_are_refused_off_the_lm_head_and_on_the_whole_graph_path(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"hot_rows splits .*it needs 'layer:'"):
        load_recipe({"version": 1, "quantization": {"overrides": [{"pattern": "head", "hot_rows": 8}]}})
    from tests.conftest import image_batches
    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    model = g.model("conv", g.node("Conv", ["input", g.w("w", 4, 3, 3, 3)], "y", pads=[1, 1, 1, 1]), ["N", 4, 16, 16])
    rec = {"version": 1, "quantization": {"overrides": [{"layer": "lm_head", "format": "int4", "hot_rows": 8}]}}
    with pytest.raises(RecipeError, match=r"overrides\[0\]\.hot_rows .*whole-graph path"):
        quantkit.quantize(model, image_batches(1), rec, progress=False)


def _subgraph(m: onnx.ModelProto, given: str, wanted: str) -> onnx.ModelProto:
    """The nodes of ``m`` that compute ``wanted`` from ``given`` (an int64 input) and initializers."""
    producer = {o: n for n in m.graph.node for o in n.output}
    inits = {t.name: t for t in m.graph.initializer}
    keep, stack, seen = [], [wanted], set()
    while stack:
        t = stack.pop()
        if t in seen or t == given or t in inits or t not in producer:
            continue
        seen.add(t)
        keep.append(producer[t])
        stack.extend(i for i in producer[t].input if i)
    order = [n for n in m.graph.node if any(n is k for k in keep)]
    used = {i for n in order for i in n.input}
    g = onnx.helper.make_graph(order, "sub", [onnx.helper.make_tensor_value_info(given, onnx.TensorProto.INT64, [1, None])],
                               [onnx.helper.make_tensor_value_info(wanted, onnx.TensorProto.FLOAT, None)],
                               [t for n, t in inits.items() if n in used])
    return onnx.helper.make_model(g, opset_imports=list(m.opset_import), ir_version=m.ir_version)


def test_hot_rows_of_the_embedding_are_read_from_the_8_bit_table(folders: dict[bool, tuple[Path, Any]],
                                                                  tmp_path: Path) -> None:
    """``hot_rows`` on the input embedding of a tied model: a GatherBlockQuantized over the 8-bit hot rows beside
    the 4-bit table, ``Where`` picks per token.  The shipped graph's embedding output: hot ids closer to the float
    table than the 4-bit rows, cold ids exactly the build without hot rows; the head still shares the 4-bit table."""
    folder, model = folders[True]
    rng = np.random.default_rng(9)
    favourite = np.array([5, 17, 200, 41])
    win = np.where(rng.random((3, 16)) < 0.6, rng.choice(favourite, (3, 16)), rng.integers(0, VOCAB, (3, 16)))
    rec = _recipe(folder, algorithm="rtn", algorithm_options={"clip": False})
    outs = {}
    for tag, extra in (("hot", {"hot_rows": 4}), ("plain", {})):
        rec["quantization"]["overrides"] = [{"layer": "model.embed_tokens", "format": "int4", **extra}]
        res = quantize_llm_layerwise(folder, tmp_path / tag / "model.onnx",
                                     PrecisionPlan.from_recipe(load_recipe(rec)), win, work_dir=tmp_path / f"w{tag}",
                                     progress=False)  # fmt: skip
        m = onnx.load(str(res.path))
        emb = "/model/embed_tokens/output_0"
        sub = _subgraph(m, "input_ids", emb)
        ids = np.arange(VOCAB, dtype=np.int64)[None]
        outs[tag] = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"input_ids": ids})[0][0]
        nodes = {n.name: n for n in m.graph.node}
        if tag == "hot":
            assert {a.name: a.i for a in nodes["model.embed_tokens.hot"].attribute}["bits"] == 8
            assert nodes["model.embed_tokens/hot_or_cold"].op_type == "Where"
            assert nodes["lm_head"].input[2] == nodes["model.embed_tokens"].input[2]  # the head: the 4-bit table
    table = model.get_input_embeddings().weight.detach().float().numpy()
    cold = np.setdiff1d(np.arange(VOCAB), favourite)
    np.testing.assert_array_equal(outs["hot"][cold], outs["plain"][cold])
    err = {k: float(np.mean((outs[k][favourite] - table[favourite]) ** 2)) for k in outs}
    assert err["hot"] < 0.05 * err["plain"], err


def test_an_untied_embedding_is_quantized_when_the_recipe_names_it(folders: dict[bool, tuple[Path, Any]],
                                                                   tmp_path: Path) -> None:
    """An untied input embedding (Mistral, Phi-3) stays a float Gather by default, with a note saying how to
    quantize it; an override naming it ships a GatherBlockQuantized whose rows are the table's to the rounding,
    and the blocks' statistics start from those rows."""
    folder, model = folders[False]
    rec = _recipe(folder, algorithm="rtn", algorithm_options={"clip": False})
    plain = quantkit.quantize(recipe=rec, progress=False, evaluate=False)
    kinds = {n.name: n.op_type for n in onnx.load(str(plain.path), load_external_data=False).graph.node}
    assert kinds["model.embed_tokens"] == "Gather"
    assert "override" in plain.report["notes"]["model.embed_tokens"]
    table = model.get_input_embeddings().weight.detach().float().numpy()
    for fmt, bits in (("int4", 4), ("int8_weight", 8)):
        rec["quantization"]["overrides"] = [{"layer": "model.embed_tokens", "format": fmt}]
        res = quantkit.quantize(recipe=rec, progress=False, evaluate=False)
        m = onnx.load(str(res.path))
        gather = next(n for n in m.graph.node if n.name == "model.embed_tokens")
        assert gather.op_type == "GatherBlockQuantized" and {a.name: a.i for a in gather.attribute}["bits"] == bits
        assert "model.embed_tokens.weight" not in {t.name for t in m.graph.initializer}
        assert any(r["layer"] == "model.embed_tokens" and r["format"] == fmt for r in res.report["layers"])
        sub = _subgraph(m, "input_ids", "/model/embed_tokens/output_0")
        rows = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"input_ids": np.arange(VOCAB, dtype=np.int64)[None]})[0][0]
        rel = float(np.abs(rows - table).max() / np.abs(table).max())
        assert 0 < rel < (0.15 if bits == 4 else 0.01), (fmt, rel)
    # the whole-graph path quantizes a Gather only as the table of a tied lm_head: the report says the override
    # changed nothing there (it used to be silent)
    whole_rec = {**rec, "calibration": {"layerwise": False}}
    cal = {"input_ids": _windows(2, 8, 0), "attention_mask": np.ones((2, 8), np.int64)}
    whole = quantkit.quantize(recipe=whole_rec, calibration_data=cal, progress=False, evaluate=False,
                              measure_latency=False)
    assert any("overrides[0] (layer: model.embed_tokens, format: int8_weight) selects only Gather" in w
               for w in whole.report["warnings"]), whole.report["warnings"]
