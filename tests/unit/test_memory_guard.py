"""The memory guard (quantkit.memory, quantkit.llm_run.choose_route): decoders stream by default, the whole-graph
path runs only when its estimated peak fits, and every run prints its estimate and records the measured peak.

On tiny random LLaMA folders: a plain int4 recipe (no ``calibration.layerwise`` key) takes the streamed path and
writes the same bytes as ``layerwise: true``; a whole-graph request that cannot fit under a lowered limit
(``QUANTKIT_MEMORY_LIMIT``) is refused in seconds, before any work, naming the estimate, the memory and the key
that streams instead (exit 2 through the CLI); the estimate is printed and recorded beside the measured peak.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit import llm_run, memory  # noqa: E402
from quantkit.cli import main  # noqa: E402
from quantkit.errors import MemoryBudgetError, QuantkitError  # noqa: E402
from quantkit.llm_run import LayerwiseQuantizeResult, choose_route, decoder_folder, layerwise_blockers  # noqa: E402
from quantkit.recipe import load_recipe  # noqa: E402
from quantkit.search.sweep import latency_groups  # noqa: E402
from tests.unit.test_llm_builder import VOCAB, make_llama  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(memory.ENV_LIMIT, raising=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("guard")
    make_llama(base / "hf", tied=False, dtype=torch.bfloat16)
    return base / "hf"


def _recipe(folder: Path, **calibration: Any) -> dict[str, Any]:
    """A plain int4 RTN recipe, as a new user writes it: no calibration.layerwise key unless given."""
    return {"version": 1, "name": "plain", "model": {"source": str(folder)}, "calibration": dict(calibration),
            "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
            "report": {"formats": ["json"], "latency": {"enabled": False}}}  # fmt: skip


def _bytes(res: LayerwiseQuantizeResult) -> tuple[bytes, bytes]:
    graph = onnx.load(str(res.path), load_external_data=False)
    return graph.SerializeToString(), res.path.with_name(res.path.name + ".data").read_bytes()


def test_plain_int4_recipe_streams_by_default_and_equals_layerwise_true(folder: Path) -> None:
    rec = _recipe(folder)
    assert load_recipe(rec).calibration.layerwise == "auto"  # the default
    plain = quantkit.quantize(recipe=rec, progress=False, evaluate=False)
    assert isinstance(plain, LayerwiseQuantizeResult)
    assert plain.report["calibration"]["mode"] == "layerwise"
    forced = quantkit.quantize(recipe=_recipe(folder, layerwise=True), progress=False, evaluate=False)
    graph_a, data_a = _bytes(plain)
    graph_b, data_b = _bytes(forced)
    assert data_a == data_b and graph_a == graph_b  # the same model, byte for byte
    assert len(data_a) > 1000
    mem = plain.report["memory"]
    assert mem["path"].startswith("layer-wise") and mem["estimated_peak_bytes"] > 0
    assert mem["measured_peak_bytes"] > 0 and mem["available_bytes"] > 0
    assert set(mem["phases"]) >= {"embedding", "blocks", "lm_head"}


def test_recipes_that_need_the_whole_graph_are_named(folder: Path) -> None:
    rec = load_recipe(_recipe(folder))
    assert layerwise_blockers(rec) == [] and decoder_folder(str(folder)) == folder
    rec = load_recipe({**_recipe(folder), "quantization": {
        "default": {"format": "int8_dynamic"}, "overrides": [{"layer": "lm_head", "format": "fp16"}]}})
    assert layerwise_blockers(rec) == ["quantization.default.format: int8_dynamic",
                                       "quantization.overrides[0].format: fp16"]  # fmt: skip
    full = load_recipe({**_recipe(folder), "model": {"source": str(folder), "graph": "full_sequence"}})
    assert layerwise_blockers(full) == ["model.graph: full_sequence"]
    assert decoder_folder(str(folder.parent)) is None  # not a Hugging Face folder
    assert choose_route(None, load_recipe(_recipe(folder))).layerwise  # auto + a decoder + int4: streamed
    assert not choose_route(None, load_recipe(_recipe(folder, layerwise=False))).layerwise


def test_whole_graph_request_that_cannot_fit_is_refused_before_any_work(folder: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(folder, layerwise=False)))
    monkeypatch.setenv(memory.ENV_LIMIT, "300MB")  # below what any run needs: the whole graph cannot fit
    t = time.perf_counter()
    rc = main(["calibrate", "-q", "--recipe", str(path), "--output", str(tmp_path / "out")])
    took = time.perf_counter() - t
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("quantkit: error:")][-1]
    assert rc == 2 and took < 30
    assert "whole-graph path (calibration.layerwise: false)" in line
    assert "would need ~" in line and "0.30 GB available (QUANTKIT_MEMORY_LIMIT=300MB)" in line
    assert "calibration.layerwise: auto (the default) or true streams this checkpoint" in line
    assert "memory: expected peak ~" in err and "of 0.30 GB available" in err  # announced before the refusal
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache" / "models").exists()  # no FP32 build


def test_auto_with_a_format_that_cannot_stream_is_refused_naming_it(folder: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _recipe(folder)
    rec["quantization"] = {"default": {"format": "int8_dynamic"}}
    rec["calibration"] = {"data": {"kind": "npz", "path": str(folder / "nope.npz")}}
    monkeypatch.setenv(memory.ENV_LIMIT, "0.2GB")
    with pytest.raises(MemoryBudgetError) as info:
        quantkit.quantize(recipe=rec, progress=False)
    msg = str(info.value)
    assert "quantization.default.format: int8_dynamic need(s) the whole graph" in msg
    assert "0.20 GB available" in msg and "Nothing was run" in msg
    # with room for it, the same recipe goes on to the whole-graph path (here: to the missing data file)
    monkeypatch.setenv(memory.ENV_LIMIT, "1000GB")
    with pytest.raises(QuantkitError, match="nope.npz"):
        quantkit.quantize(recipe=rec, progress=False)


def test_the_estimate_is_printed_and_recorded_beside_the_measured_peak(folder: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 16)).astype(np.int64)
    np.savez(tmp_path / "cal.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    rec = _recipe(folder, data={"kind": "npz", "path": str(tmp_path / "cal.npz")})
    rec["quantization"]["default"]["algorithm"] = "gptq"
    rec["evaluation"] = {"data": {"kind": "npz", "path": str(tmp_path / "cal.npz")}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    assert main(["calibrate", "-q", "--recipe", str(path), "--output", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    announced = [ln for ln in err.splitlines() if "memory: expected peak ~" in ln]
    assert len(announced) == 1 and " GB available (layer-wise, streamed block by block" in announced[0]
    assert "memory: measured peak " in err
    mem = json.loads((tmp_path / "out" / "report.json").read_text())["memory"]
    est, peak = mem["estimated_peak_bytes"], mem["measured_peak_bytes"]
    assert mem["peak_phase"] in mem["phases"] and "evaluation (FP32 and quantized)" in mem["phases"]
    assert est == max(mem["phases"].values()) and f"~{memory.gb(est)} of" in announced[0]
    # the measured peak is this process's (pytest's) resident memory at least; the estimate starts from it too
    assert peak >= 50e6 and est >= memory.process_tree_rss() * 0.5


def test_a_large_onnx_file_is_guarded_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import tiny_cnn

    model = tiny_cnn()
    onnx.save(model, tmp_path / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0)  # fmt: skip
    weights = memory.onnx_weight_bytes(tmp_path / "model.onnx")
    assert weights > (tmp_path / "model.onnx").stat().st_size  # the external data counted
    rec = load_recipe({"version": 1, "model": {"source": str(tmp_path / "model.onnx")}})
    route = choose_route(None, rec)  # small: recorded, not guarded
    assert not route.layerwise and route.estimate is not None and route.estimate.weights_bytes == weights
    monkeypatch.setattr(llm_run, "LARGE_MODEL_BYTES", 1)  # "a few GB" of external data, at this model's scale
    monkeypatch.setenv(memory.ENV_LIMIT, "100MB")
    with pytest.raises(MemoryBudgetError, match=r"an ONNX model held whole.*0.10 GB available.*quantized whole"):
        choose_route(None, rec)


def test_memory_limits_and_sizes() -> None:
    assert memory.parse_bytes("3GB") == 3 * 10**9 and memory.parse_bytes("512 MiB") == 512 << 20
    assert memory.parse_bytes("2.5e9") == 2_500_000_000 and memory.parse_bytes(1234) == 1234
    for bad in ("lots", "3 parsecs", "-1GB", "0"):
        with pytest.raises(QuantkitError, match=memory.ENV_LIMIT):
            memory.parse_bytes(bad)
    assert memory.available_memory("2GB").bytes == 2 * 10**9
    free = memory.available_memory()
    assert free.bytes > memory.process_tree_rss() and "this process" in free.source
    est = memory.Estimate("x", {"a": 5, "b": 9}, "headers")
    memory.check_fits(est, memory.Available(9, "test"), what="w", instead="i")  # equal: fits
    with pytest.raises(MemoryBudgetError, match="w would need ~0.00 GB.*at its peak \\(x; largest at b;.*headers.*test\\); i"):
        memory.check_fits(est, memory.Available(8, "test"), what="w", instead="i")


def test_the_layerwise_estimate_grows_with_width_not_depth(folder: Path) -> None:
    sizes = memory.decoder_sizes(folder)
    assert sizes.blocks == 2 and sizes.hidden == 64 and sizes.vocab == VOCAB and sizes.itemsize == 2
    assert sizes.block_shapes and max(k for k, _ in sizes.block_shapes) == sizes.max_k == 128
    deep = memory.DecoderSizes(**{**sizes.__dict__, "blocks": 80, "params": sizes.params * 40})
    kw: dict[str, Any] = {"bits": 4, "algorithms": ["rtn"], "head_algorithm": "rtn", "head_quantized": True,
                          "tied": False, "windows": None, "base": 0}  # fmt: skip
    a, b = memory.layerwise_estimate(sizes, **kw), memory.layerwise_estimate(deep, **kw)
    assert a.peak_bytes == b.peak_bytes  # blocks stream: the depth does not count
    gptq = memory.layerwise_estimate(sizes, **{**kw, "algorithms": ["gptq"], "windows": (2, 16)})
    assert gptq.phases["blocks"] > a.phases["blocks"]  # statistics and GPTQ's arrays


def test_sweep_latency_sessions_are_grouped_to_fit() -> None:
    sizes = {"fp32": 100, "a": 50, "b": 50, "c": 50}
    assert latency_groups(sizes, budget=10_000) == [["fp32", "a", "b", "c"]]
    assert latency_groups(sizes, budget=250) == [["fp32", "a", "b"], ["fp32", "c"]]  # 1.15 x bytes per session
    assert latency_groups(sizes, budget=10) == [["fp32", "a"], ["fp32", "b"], ["fp32", "c"]]  # one point at least


def test_a_search_is_estimated_as_the_whole_graph_and_refused_before_loading(folder: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 16)).astype(np.int64)
    np.savez(tmp_path / "cal.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    rec = _recipe(folder, data={"kind": "npz", "path": str(tmp_path / "cal.npz")})
    rec["evaluation"] = {"data": {"kind": "npz", "path": str(tmp_path / "cal.npz")}}
    rec["search"] = {"candidates": ["fp32", "int4"], "target": {"size": 0.5}}
    monkeypatch.setenv(memory.ENV_LIMIT, "250MB")
    with pytest.raises(MemoryBudgetError, match=r"the search \(it measures the whole graph\).*0.25 GB available.*"
                                                 r"without a search section"):
        quantkit.quantize(recipe=rec, progress=False)
    with pytest.raises(MemoryBudgetError, match="the search"):
        quantkit.sweep(recipe=rec, output=tmp_path / "sweep", progress=False)
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "cache" / "models").exists()  # nothing loaded


def _table_sizes(vocab: int, hidden: int, itemsize: float = 2.0) -> memory.DecoderSizes:
    """A decoder whose tied table dominates (one small block): the shape of gemma2's 256000 x 2304 table."""
    block = 3 * hidden * hidden
    return memory.DecoderSizes(params=vocab * hidden + block, stored_bytes=int(itemsize * (vocab * hidden + block)),
                               blocks=1, block_stored=int(itemsize * block), block_linear=block,
                               largest_linear=hidden * hidden, max_k=hidden, widest_n=hidden, embedding=vocab * hidden,
                               head=0, hidden=hidden, vocab=vocab, itemsize=itemsize,
                               block_shapes=((hidden, hidden),) * 3)  # fmt: skip


def test_the_embedding_phase_covers_the_arrays_of_the_rounded_tied_table() -> None:
    # quantkit.layerwise rounds a tied table before the first block with, alive at once: the bf16 tensor as read
    # (2 bytes a parameter), its float32 transpose (4), the uint8 codes (1) and the packed int4 codes (0.5) with
    # their float32 scales.  Measured (eval/results/embedding_phase.json, bf16, int4 RTN): 7.1 bytes a parameter
    # above the floor plus ~0.23 GB; the old estimate (12 bytes) was below the old code's 16-17.7 bytes a parameter.
    s = _table_sizes(256000, 2304)
    kw: dict[str, Any] = {"bits": 4, "algorithms": ["rtn"], "head_algorithm": "rtn", "head_quantized": True,
                          "tied": True, "windows": (2, 64), "base": 0, "w4a8_bytes": 0}  # fmt: skip
    est = memory.layerwise_estimate(s, **kw)
    measured_like = 7.1 * s.embedding + 0.23e9  # the fitted line through the measured phases
    assert est.peak_phase == "embedding"
    assert measured_like <= est.phases["embedding"] <= 1.15 * measured_like
    # the arrays named above, without the floor's temporaries, are a lower bound the estimate must not fall under
    assert est.phases["embedding"] >= (2 + 4 + 1 + 0.5) * s.embedding
    # an untied (or float) table is only read: twice its stored bytes
    flat = memory.layerwise_estimate(s, **{**kw, "head_quantized": False})
    assert flat.phases["embedding"] == 2 * 2 * s.embedding
    # the packed table stays alive through the blocks (the GatherBlockQuantized and the tied lm_head share it)
    assert est.phases["blocks"] - flat.phases["blocks"] == pytest.approx((4 / 8 + 4 / 32) * s.embedding)


def test_rtn_with_the_w4a8_check_holds_no_hessian() -> None:
    s = _table_sizes(1000, 1024)
    kw: dict[str, Any] = {"bits": 4, "head_algorithm": "rtn", "head_quantized": True, "tied": True,
                          "windows": (2, 64), "base": 0, "w4a8_bytes": 1 << 20}  # fmt: skip
    rtn = memory.layerwise_estimate(s, algorithms=["rtn"], **kw).phases["blocks"]
    gptq = memory.layerwise_estimate(s, algorithms=["gptq"], **kw).phases["blocks"]
    assert gptq - rtn >= 8 * s.max_k * s.max_k  # Σxᵀx float64 only when an algorithm reads statistics


def test_the_rounded_table_is_transposed_in_row_blocks_to_the_same_values() -> None:
    from quantkit.layerwise import _f32, _f32_transposed
    from quantkit.lowering.nbits import matmul_nbits_arrays
    from quantkit.scheme.packing import pack_int4

    t = torch.randn(1000, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = _f32_transposed(t, chunk_bytes=4 * 96 * 7)  # blocks of 7 rows
    np.testing.assert_array_equal(got, np.ascontiguousarray(_f32(t).T))
    assert got.flags.c_contiguous and got.dtype == np.float32
    # packed in row blocks: the bytes of the whole-array packing
    from quantkit.algorithms.woq import get_weight_algorithm

    res = get_weight_algorithm("rtn")(got, bits=4, group_size=32, symmetric=False, stats=None)
    B = matmul_nbits_arrays(res)[0]
    whole = np.full((res.shape[1], 96), 0, np.uint8)
    whole[:, :96] = res.codes.T
    np.testing.assert_array_equal(B, pack_int4(whole).reshape(B.shape))
    signed = np.arange(-8, 8, dtype=np.int8).repeat(3)
    ref = (signed.astype(np.int16) & 0xF).astype(np.uint8)
    np.testing.assert_array_equal(pack_int4(signed), (ref[0::2] | (ref[1::2] << 4)).astype(np.uint8))


def test_moe_block_session_holds_no_float_expert_weights() -> None:
    """A mixture-of-experts block's calibration sessions need no float expert weights (gate / up taps read the routed
    rows; down taps read gate / up already packed; the block that advances runs packed): the estimate counts them
    packed. Measured at published widths (eval/results/families_x86-vnni.json, e2e): OLMoE 5.13 GB, Qwen3-30B-A3B
    6.59 GB, estimated 6.60 / 8.68 GB; with the experts in float32 in the session it had said 7.17 / 10.27 GB."""
    from quantkit.memory import SESSION_COPIES, DecoderSizes, layerwise_estimate

    H, E, inter = 256, 16, 128
    shapes = tuple([(H, H)] * 4 + [(H, inter), (H, inter), (inter, H)] * E + [(H, E)])
    bl = sum(k * n for k, n in shapes)
    experts = E * 3 * H * inter

    def blocks(expert_linear: int, n_experts: int) -> int:
        s = DecoderSizes(params=bl, stored_bytes=2 * bl, blocks=1, block_stored=2 * bl, block_linear=bl,
                         largest_linear=H * H, max_k=H, widest_n=H, embedding=0, head=0, hidden=H, vocab=0,
                         itemsize=2.0, block_shapes=shapes, experts=n_experts, expert_linear=expert_linear)
        # RTN with the W4A8 check: the blocks run on the windows, no GPTQ temporaries outweigh the session
        return layerwise_estimate(s, bits=4, algorithms=["rtn"], head_algorithm="rtn", head_quantized=True, tied=True,
                                  windows=(4, 64), base=0, w4a8_bytes=1).phases["blocks"]  # fmt: skip

    per_param = 4 / 8 + 4 / 32
    saved = blocks(0, E) - blocks(experts, E)
    assert abs(saved - SESSION_COPIES * (4 - per_param) * experts) <= 2


def test_process_tree_rss_counts_children_and_grandchildren(monkeypatch: pytest.MonkeyPatch) -> None:
    """The /proc children walk sums the same tree as psutil's scan of every process (a child that holds ~80 MB and
    its own child), and the psutil path (kernels without the children files) gives the same sum."""
    import subprocess
    import sys

    import psutil

    code = ("import subprocess, sys, time; import numpy as np; a = np.ones(10_000_000); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
            "print('ready', flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        me = psutil.Process()
        tree = [me, *me.children(recursive=True)]
        assert len(tree) >= 3  # this process, the child, the grandchild
        ref = sum(p.memory_info().rss for p in tree)
        walked = memory.process_tree_rss()
        assert abs(walked - ref) < 0.05 * ref and walked > me.memory_info().rss + 70e6
        # the grandchild too: the walk from the child is its own RSS and its child's
        kid = psutil.Process(child.pid)
        grand = kid.children()[0].memory_info().rss
        assert memory.process_tree_rss(child.pid) == pytest.approx(kid.memory_info().rss + grand, rel=0.02)
        monkeypatch.setattr(memory, "_CHILDREN_FILES", False)
        assert abs(memory.process_tree_rss() - ref) < 0.05 * ref
        assert memory.process_tree_rss(child.pid) < walked
    finally:
        for p in psutil.Process(child.pid).children(recursive=True):
            p.kill()
        child.kill()
        child.wait()
