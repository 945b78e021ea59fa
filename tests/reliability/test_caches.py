"""Caches and resumable state are verified before reuse, and temporaries of killed runs are cleaned up.

Rules under test (see quantkit.checksum, quantkit.frontends.cache, quantkit.layerwise, quantkit.tempdirs):

* every cached folder (built FP32 decoder, converted checkpoint, exported ONNX model) carries the sha256 of
  its files; a zeroed block, a truncated, extra or missing file is a cache miss: the entry is rebuilt with a
  one-line warning naming it, and the result equals a clean run's;
* layer-wise resume state (``state.json``, ``block_<i>.npz``, ``hidden_<i>.npy``) that was edited (a valid
  ``.npz`` with other scales), truncated or made inconsistent is discarded with a warning and recomputed from
  the last good block: the same model as a clean run, never an internal error;
* temporary folders of a process that is gone (SIGKILL) are removed by the next run; those of a live
  process, and folders without a valid ownership marker, are left alone;
* nothing outside the cache changes (:func:`tests.reliability.conftest.tree_digest`).

Everything runs on tiny random LLaMA folders (hidden 64, 2 layers) in seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import quantkit  # noqa: E402
from quantkit import checksum  # noqa: E402
from quantkit.checksum import SIDECAR, dumps_checked, loads_checked  # noqa: E402
from quantkit.cli import main  # noqa: E402
from quantkit.frontends.llm import built_decoder_path  # noqa: E402
from quantkit.frontends.llm_builder import LLMSession  # noqa: E402
from quantkit.layerwise import _Hook, quantize_llm_layerwise  # noqa: E402
from quantkit.recipe import load_recipe  # noqa: E402
from quantkit.recipe.plan import PrecisionPlan  # noqa: E402
from quantkit.tempdirs import MARKER  # noqa: E402
from tests.reliability.conftest import tree_digest, unchanged_outside  # noqa: E402
from tests.unit.test_llm_builder import VOCAB, make_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaMA-shaped HF folder (tied embedding, bf16 weights)."""
    folder = tmp_path_factory.mktemp("caches") / "hf"
    make_llama(folder, tied=True, dtype=torch.bfloat16)
    return folder


@pytest.fixture
def work(tmp_path: Path, llama: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path`` with a private cache (``cache/``), a copy of the tiny folder (``hf/``) and token data."""
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "hf").mkdir()
    for f in llama.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
        os.utime(tmp_path / "hf" / f.name, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
    for name, seed in (("cal", 1), ("ev", 2)):
        ids = _ids(3, 16, seed)
        np.savez(tmp_path / f"{name}.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    checksum._VERIFIED.clear()
    return tmp_path


def _ids(n: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (n, seq)).astype(np.int64)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _zero_4k(path: Path) -> None:
    """Zero 4 KB in the middle of ``path``; the size stays the same."""
    size = path.stat().st_size
    assert size > 3 * 4096
    off = (size // 2) & ~4095
    with open(path, "r+b") as f:
        f.seek(off)
        assert f.read(4096) != bytes(4096)
        f.seek(off)
        f.write(bytes(4096))
    assert path.stat().st_size == size


def _warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and needle in r.getMessage()]


def _fresh_process() -> None:
    """What a new process knows: nothing verified yet."""
    checksum._VERIFIED.clear()


# -- cached folders --------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["zero_4k", "truncate", "extra_file", "missing_file", "no_checksums",
                                    "edited_checksums"])  # fmt: skip
@pytest.mark.parametrize("new_process", [True, False])
def test_a_corrupt_built_decoder_is_rebuilt_with_a_warning(work: Path, damage: str, new_process: bool,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    before = tree_digest(work, skip=["cache"])
    path = built_decoder_path(work / "hf")
    data = path.with_name("model.onnx.data")
    clean, ids = _sha(data), _ids(1, 9, 3)
    logits = LLMSession(path)(ids)
    entry = path.parent
    listing = sorted(p.name for p in entry.iterdir())
    assert SIDECAR in listing and MARKER not in listing
    if damage == "zero_4k":
        _zero_4k(data)
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:-4096])
    elif damage == "extra_file":
        (entry / "model.onnx.data.bak").write_bytes(b"x")
    elif damage == "missing_file":
        (entry / "genai_config.json").unlink()
    elif damage == "no_checksums":
        (entry / SIDECAR).unlink()
        _zero_4k(data)
    else:  # the sidecar rewritten as valid JSON without fixing its own checksum
        doc = json.loads((entry / SIDECAR).read_text())
        doc["payload"]["files"]["model.onnx.data"]["sha256"] = "0" * 64
        (entry / SIDECAR).write_text(json.dumps(doc))
    if new_process:
        _fresh_process()
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        again = built_decoder_path(work / "hf")
    msgs = _warnings(caplog, "FP32 decoder")
    assert len(msgs) == 1 and str(entry) in msgs[0] and "\n" not in msgs[0], msgs
    assert again == path and _sha(data) == clean
    np.testing.assert_array_equal(LLMSession(again)(ids), logits)
    assert sorted(p.name for p in entry.iterdir()) == listing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        built_decoder_path(work / "hf")  # now intact: reused silently
    assert not caplog.records
    assert unchanged_outside(before, tree_digest(work, skip=["cache"])) == []
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_an_intact_entry_is_reused_and_its_check_is_cheap(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = built_decoder_path(work / "hf")
    mtime = path.stat().st_mtime_ns
    _fresh_process()
    calls: list[Path] = []
    real = checksum.file_digest
    monkeypatch.setattr(checksum, "file_digest", lambda p: calls.append(Path(p)) or real(p))
    assert built_decoder_path(work / "hf") == path and path.stat().st_mtime_ns == mtime
    assert len(calls) == len([p for p in path.parent.iterdir() if p.name != SIDECAR])  # hashed once each
    calls.clear()
    built_decoder_path(work / "hf")
    assert calls == []  # same process, files unchanged: not hashed again


def test_cli_layerwise_fp32_perplexity_is_not_changed_by_a_corrupt_decoder_cache(
        work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's row: the cached FP32 decoder's ``.data`` with 4 KB zeroed changed the FP32 perplexity."""
    rec = _layerwise_recipe(work)
    before = tree_digest(work, skip=["cache", "o1", "o2"])
    assert main(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o1")]) == 0
    [entry] = [p for p in (work / "cache" / "models").iterdir() if p.name.startswith("decoder-")]
    _zero_4k(entry / "model.onnx.data")
    _fresh_process()
    capsys.readouterr()
    assert main(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o2")]) == 0
    text = capsys.readouterr().err  # the CLI logs to stderr itself
    assert "Traceback" not in text
    assert len([ln for ln in text.splitlines() if "discarding the cached FP32 decoder" in ln]) == 1, text
    r1, r2 = (json.loads((work / o / "report.json").read_text()) for o in ("o1", "o2"))
    assert r2["quality"]["perplexity_fp32"] == r1["quality"]["perplexity_fp32"]
    assert r2["quality"]["perplexity_quantized"] == r1["quality"]["perplexity_quantized"]
    for o in ("o1", "o2"):
        assert not (work / o / MARKER).exists()  # the build folder's marker is not an output
    assert unchanged_outside(before, tree_digest(work, skip=["cache", "o1", "o2"])) == []
    assert not list((work / "cache").glob("quantkit-layerwise-*"))


def test_a_corrupt_converted_checkpoint_is_converted_again(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The GGUF -> HF folder conversion cache (``smollm2_folder``), with the converter stood in by a copy."""
    from quantkit.frontends import llm

    gguf = work / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    conversions: list[str] = []

    def convert(src: str, out: str) -> None:
        conversions.append(src)
        for f in (work / "hf").iterdir():
            (Path(out) / f.name).write_bytes(f.read_bytes())

    monkeypatch.setattr(llm, "_smollm2_gguf", lambda: gguf)
    monkeypatch.setattr(llm, "_convert_smollm2", convert)
    before = tree_digest(work, skip=["cache"])
    folder = llm.smollm2_folder()
    weights = folder / "model.safetensors"
    clean = _sha(weights)
    assert llm.smollm2_folder() == folder and len(conversions) == 1  # reused
    _zero_4k(weights)
    _fresh_process()
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        assert llm.smollm2_folder() == folder
    assert len(conversions) == 2 and _sha(weights) == clean
    assert len(_warnings(caplog, "converted checkpoint")) == 1
    assert unchanged_outside(before, tree_digest(work, skip=["cache"])) == []


def test_a_corrupt_builtin_export_is_exported_again(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    import onnx_ir as ir

    from quantkit.frontends.builtin import BUILTINS, BuiltinModel, builtin_cache_path, load_builtin
    from tests.conftest import tiny_cnn

    exports: list[int] = []

    def export() -> ir.Model:
        exports.append(1)
        return ir.from_proto(tiny_cnn())

    monkeypatch.setitem(BUILTINS._items, "tiny-cnn-test", BuiltinModel("tiny-cnn-test", export))
    first = ir.to_proto(load_builtin("tiny-cnn-test")).SerializeToString()
    entry = builtin_cache_path("tiny-cnn-test")
    model = entry / "model.onnx"
    b = bytearray(model.read_bytes())
    b[len(b) // 2] ^= 0x01  # one bit
    model.write_bytes(bytes(b))
    _fresh_process()
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        again = ir.to_proto(load_builtin("tiny-cnn-test")).SerializeToString()
    assert len(exports) == 2 and again == first
    assert len(_warnings(caplog, "export of the built-in 'tiny-cnn-test'")) == 1


def test_edited_search_caches_are_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from quantkit.search.sensitivity import measure_sensitivity
    from tests.unit.test_search import _space

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    sp, cal = _space()
    first = measure_sensitivity(sp, cal, samples=2, seq_len=None, metric="mse", progress=False,
                                cache_parts={"t": 1})  # fmt: skip
    [cache] = list((tmp_path / "search").glob("sensitivity-*.json"))
    doc = json.loads(cache.read_text())
    k = next(iter(doc["payload"]["damage"]))
    doc["payload"]["damage"][k] *= 100.0  # valid JSON, another number: only the checksum tells
    cache.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        again = measure_sensitivity(sp, cal, samples=2, seq_len=None, metric="mse", progress=False,
                                    cache_parts={"t": 1})  # fmt: skip
    assert again == first and len(_warnings(caplog, "sensitivity cache")) == 1
    assert loads_checked(cache.read_text())["damage"][k] == pytest.approx(first[tuple(k.split("\t"))])  # healed


# -- layer-wise resume state ------------------------------------------------------------------------------
def _layerwise_recipe(work: Path, algorithm: str = "gptq") -> Path:
    rec = {"version": 1, "name": "lw", "model": {"source": str(work / "hf")},
           "calibration": {"layerwise": True, "data": {"kind": "npz", "path": str(work / "cal.npz")}},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": algorithm}},
           "evaluation": {"data": {"kind": "npz", "path": str(work / "ev.npz")}},
           "report": {"formats": ["json"], "latency": {"enabled": False}}}  # fmt: skip
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


def _plan(work: Path, algorithm: str) -> PrecisionPlan:
    return PrecisionPlan.from_recipe(load_recipe(yaml.safe_load(_layerwise_recipe(work, algorithm).read_text())))


def _interrupted(work: Path, plan: PrecisionPlan, wdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped before block 1: the work folder holds block 0 and the hidden states after it."""
    monkeypatch.setenv("QUANTKIT_BUILD_PROCESS", "this")  # the patched code runs in this process
    real = _Hook.block

    def stop_at_1(self: _Hook, index: int, weights: dict[str, Any]) -> Any:
        if index == 1:
            raise KeyboardInterrupt
        return real(self, index, weights)

    monkeypatch.setattr(_Hook, "block", stop_at_1)
    with pytest.raises(KeyboardInterrupt):
        quantize_llm_layerwise(work / "hf", work / "b" / "model.onnx", plan, _ids(3, 16, 1), work_dir=wdir,
                               progress=False)  # fmt: skip
    monkeypatch.setattr(_Hook, "block", real)
    assert sorted(p.name for p in wdir.iterdir()) == ["block_0.npz", "hidden_1.npy", "state.json"]


def _rewrite_state(wdir: Path, **change: Any) -> None:
    """``state.json`` changed *with* a valid checksum: only the consistency checks can tell."""
    state = loads_checked((wdir / "state.json").read_text())
    state.update(change)
    (wdir / "state.json").write_text(dumps_checked(state))


# damage -> (what the warning names, blocks reused)
LAYERWISE_DAMAGE = {
    "edited_scales": ("block_0.npz does not match its checksum", 0),
    "truncated_block": ("block_0.npz does not match its checksum", 0),
    "missing_block": ("block_0.npz is missing", 0),
    "inconsistent_block": ("block_0.npz does not fit this run", 0),
    "zeroed_hidden": ("hidden_1.npy does not match its checksum", 1),
    "truncated_hidden": ("hidden_1.npy does not match its checksum", 1),
    "state_garbage": ("state.json is unusable", 0),
    "state_edited": ("state.json is unusable", 0),
    "state_list": ("state.json is unusable", 0),
    "state_done_beyond": ("block_1.npz is not recorded", 1),
    "state_done_out_of_range": ("state.json is unusable", 0),
    "state_forged_digest": ("block_0.npz", 0),
}


@pytest.mark.parametrize("damage", sorted(LAYERWISE_DAMAGE))
def test_damaged_layerwise_state_is_recomputed_into_the_clean_model(work: Path, damage: str,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    plan, win = _plan(work, "gptq"), _ids(3, 16, 1)
    clean = quantize_llm_layerwise(work / "hf", work / "a" / "model.onnx", plan, win, work_dir=work / "w1",
                                   progress=False)  # fmt: skip
    wdir = work / "w2"
    _interrupted(work, plan, wdir, monkeypatch)
    block, hidden, state = wdir / "block_0.npz", wdir / "hidden_1.npy", wdir / "state.json"
    if damage == "edited_scales":  # a valid .npz with other scales
        with np.load(block) as z:
            arrs = {k: z[k] for k in z.files}
        key = next(k for k in arrs if k.endswith("|scales"))
        arrs[key] = arrs[key] * np.float32(1.5)
        with open(block, "wb") as f:
            np.savez(f, **arrs)  # type: ignore[arg-type]
    elif damage == "truncated_block":
        block.write_bytes(block.read_bytes()[: block.stat().st_size // 2])
    elif damage == "missing_block":
        block.unlink()
    elif damage == "inconsistent_block":  # a valid file, its digest recorded, but not what this run writes
        with np.load(block) as z:
            arrs = {k: z[k] for k in z.files}
        arrs = {k: (v[:, :1] if k.endswith("|scales") else v) for k, v in arrs.items()}
        with open(block, "wb") as f:
            np.savez(f, **arrs)  # type: ignore[arg-type]
        _rewrite_state(wdir, files={**loads_checked(state.read_text())["files"], "block_0.npz": _sha(block)})
    elif damage == "zeroed_hidden":
        with open(hidden, "r+b") as f:
            f.seek(256)
            f.write(bytes(512))
    elif damage == "truncated_hidden":
        hidden.write_bytes(hidden.read_bytes()[:-1000])
    elif damage == "state_garbage":
        state.write_text("{")
    elif damage == "state_edited":  # hand-edited: its own checksum no longer matches
        state.write_text(state.read_text().replace('"done": 0', '"done": 1'))
    elif damage == "state_list":
        state.write_text("[]")
    elif damage == "state_done_beyond":  # claims block 1 is done; no such file is recorded
        _rewrite_state(wdir, done=1)
    elif damage == "state_done_out_of_range":
        _rewrite_state(wdir, done=7)
    else:  # the recorded digest of block 0 replaced
        _rewrite_state(wdir, files={**loads_checked(state.read_text())["files"], "block_0.npz": "0" * 64})
    needle, reused = LAYERWISE_DAMAGE[damage]
    for attempt in range(2):  # the damaged state is healed: a further run finds nothing to warn about
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="quantkit"):
            if attempt:
                _interrupted(work, plan, wdir, monkeypatch)
            again = quantize_llm_layerwise(work / "hf", work / "b" / "model.onnx", plan, win, work_dir=wdir,
                                           progress=False)  # fmt: skip
        if attempt == 0:
            assert len(_warnings(caplog, needle)) == 1, caplog.text
            assert again.resumed_blocks == reused
        else:
            assert _warnings(caplog, "layer-wise") == [] and again.resumed_blocks == 1
        ids = _ids(1, 10, 9)
        np.testing.assert_array_equal(LLMSession(clean.path)(ids), LLMSession(again.path)(ids))
        assert _sha(again.path.with_name("model.onnx.data")) == _sha(clean.path.with_name("model.onnx.data"))
        assert _rows(again.rows) == _rows(clean.rows)
        assert not wdir.exists()  # removed on success


def _rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(({k: v for k, v in r.items() if k != "seconds"} for r in rows), key=lambda r: r["layer"])


def test_a_block_changed_during_the_run_is_a_typed_error_then_recomputed(work: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_BUILD_PROCESS", "this")  # the patched code runs in this process
    plan, win = _plan(work, "gptq"), _ids(3, 16, 1)
    clean = quantize_llm_layerwise(work / "hf", work / "a" / "model.onnx", plan, win, work_dir=work / "w1",
                                   progress=False)  # fmt: skip
    wdir = work / "w2"
    _interrupted(work, plan, wdir, monkeypatch)
    real = _Hook._read_block
    seen: list[int] = []

    def damage_after_verification(self: _Hook, index: int, digest: str | None) -> Any:
        seen.append(index)
        if len(seen) == 2:  # verified at the start, then changed before it is used
            _zero_4k_small(wdir / "block_0.npz")
        return real(self, index, digest)

    monkeypatch.setattr(_Hook, "_read_block", damage_after_verification)
    with pytest.raises(quantkit.errors.QuantkitError, match="changed during the run.*run again"):
        quantize_llm_layerwise(work / "hf", work / "b" / "model.onnx", plan, win, work_dir=wdir, progress=False)
    monkeypatch.setattr(_Hook, "_read_block", real)
    again = quantize_llm_layerwise(work / "hf", work / "b" / "model.onnx", plan, win, work_dir=wdir,
                                   progress=False)  # fmt: skip
    assert again.resumed_blocks == 0
    assert _sha(again.path.with_name("model.onnx.data")) == _sha(clean.path.with_name("model.onnx.data"))


def _zero_4k_small(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2 : len(b) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(b))


def test_resume_state_of_another_configuration_is_not_used(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """State written for other calibration data (or another plan) is another key: started over silently."""
    plan = _plan(work, "gptq")
    wdir = work / "w"
    _interrupted(work, plan, wdir, monkeypatch)
    (wdir / "notes.txt").write_text("not quantkit's")  # a file quantkit did not write there: never removed
    clean = quantize_llm_layerwise(work / "hf", work / "a" / "model.onnx", plan, _ids(3, 16, 5),
                                   work_dir=work / "w1", progress=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        other = quantize_llm_layerwise(work / "hf", work / "b" / "model.onnx", plan, _ids(3, 16, 5), work_dir=wdir,
                                       progress=False)  # fmt: skip
    assert other.resumed_blocks == 0 and not _warnings(caplog, "layer-wise")
    assert [p.name for p in wdir.iterdir()] == ["notes.txt"]  # quantkit's own files removed on success
    assert _sha(other.path.with_name("model.onnx.data")) == _sha(clean.path.with_name("model.onnx.data"))


def test_cli_damaged_resume_state_never_gives_an_internal_error(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("QUANTKIT_BUILD_PROCESS", "this")  # the patched code runs in this process
    rec = _layerwise_recipe(work)
    before = tree_digest(work, skip=["cache", "o1", "o2"])
    assert main(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o1")]) == 0
    real = _Hook.block

    def stop_at_1(self: _Hook, index: int, weights: dict[str, Any]) -> Any:
        if index == 1:
            raise KeyboardInterrupt
        return real(self, index, weights)

    monkeypatch.setattr(_Hook, "block", stop_at_1)
    assert main(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o2")]) == 130
    monkeypatch.setattr(_Hook, "block", real)
    [wdir] = list((work / "cache" / "layerwise").iterdir())
    (wdir / "block_0.npz").write_bytes(b"PK\x03\x04 not a zip")
    (wdir / "state.json").write_text('{"key": 1, "done": "x"}')  # the old code's TypeError on every re-run
    capsys.readouterr()
    assert main(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o2")]) == 0
    text = capsys.readouterr().err  # the CLI logs to stderr itself
    assert "internal error" not in text and "Traceback" not in text
    assert len([ln for ln in text.splitlines() if "state.json is unusable" in ln]) == 1, text
    assert _sha(work / "o1" / "model.onnx.data") == _sha(work / "o2" / "model.onnx.data")
    assert unchanged_outside(before, tree_digest(work, skip=["cache", "o1", "o2"])) == []


# -- temporary folders of killed runs -----------------------------------------------------------------------
def _child(code: str, *, wait: bool = True) -> subprocess.Popen[str]:
    """A Python child process running ``code`` (quantkit importable); waited for unless ``wait`` is False."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    if wait:
        proc.wait(timeout=120)
    return proc


def _owned_by_child(parent: Path, prefix: str, *, alive: bool) -> tuple[Path, subprocess.Popen[str]]:
    """A marked temporary folder made by a child process that then dies by SIGKILL, or stays alive."""
    end = "import time; time.sleep(60)" if alive else "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    proc = _child(f"""
        import sys
        from quantkit.tempdirs import owned_tempdir
        p = owned_tempdir({str(parent)!r}, {prefix!r})
        (p / "partial.bin").write_bytes(b"x" * 1000)
        print(p, flush=True)
        {end}
        """, wait=False)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, proc.stderr.read() if proc.stderr else ""
    if not alive:
        assert proc.wait(timeout=60) == -signal.SIGKILL
    return Path(line), proc


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_stale_temporaries_of_dead_runs_go_live_and_unmarked_ones_stay(
        work: Path, children: list[subprocess.Popen[str]], caplog: pytest.LogCaptureFixture) -> None:
    cache = work / "cache"
    models = cache / "models"
    dead_build, p1 = _owned_by_child(cache, "quantkit-layerwise-", alive=False)
    live_build, p2 = _owned_by_child(cache, "quantkit-layerwise-", alive=True)
    dead_decoder, p3 = _owned_by_child(models, ".decoder-hf-0123.tmp-", alive=False)
    live_decoder, p4 = _owned_by_child(models, ".decoder-hf-0123.tmp-", alive=True)
    children.extend([p1, p2, p3, p4])
    unmarked = [cache / "quantkit-layerwise-mine", models / ".decoder-hf-4567.tmp-mine"]
    for u in unmarked:
        u.mkdir(parents=True)
        (u / "keep.txt").write_text("the user's")
    # a marker naming a dead process, but copied into another folder (its name does not match): not proof
    forged = cache / "quantkit-layerwise-copied"
    forged.mkdir()
    (forged / MARKER).write_text((dead_build / MARKER).read_text())
    before = tree_digest(work, skip=["cache", "o"])
    kept = [live_build, live_decoder, *unmarked, forged]
    snapshot = {p: tree_digest(p) for p in kept}

    with caplog.at_level(logging.WARNING, logger="quantkit"):
        built_decoder_path(work / "hf")  # a cache look-up in models/
        res = quantkit.quantize(recipe=_layerwise_recipe(work, "rtn"), progress=False, evaluate=False,
                                measure_latency=False)  # a layer-wise build in the cache root  # fmt: skip
        res.save(work / "o")
    assert not dead_build.exists() and not dead_decoder.exists()
    for p in kept:
        assert p.is_dir() and tree_digest(p) == snapshot[p], p
    gone = " ".join(_warnings(caplog, "ended abruptly"))
    assert str(dead_build) in gone and str(dead_decoder) in gone
    assert unchanged_outside(before, tree_digest(work, skip=["cache", "o"])) == []
    assert not (work / "o" / MARKER).exists()
    # the run's own build folder is gone once saved; only the live child's and the foreign ones remain
    assert sorted(cache.glob("quantkit-layerwise-*")) == sorted([live_build, unmarked[0], forged])


def test_sigkill_during_a_decoder_build_leaves_a_temporary_that_the_next_run_removes(
        work: Path, caplog: pytest.LogCaptureFixture) -> None:
    models = work / "cache" / "models"
    proc = _child(f"""
        import os, signal
        from quantkit.frontends import llm_builder
        real = llm_builder.build_llm
        def build_then_die(folder, out, **kw):
            real(folder, out, **kw)
            os.kill(os.getpid(), signal.SIGKILL)  # killed before the entry is renamed into place
        llm_builder.build_llm = build_then_die
        from quantkit.frontends.llm import built_decoder_path
        built_decoder_path({str(work / "hf")!r})
        """)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    [left] = [p for p in models.iterdir() if p.name.startswith(".decoder-")]
    assert (left / MARKER).is_file() and (left / "model.onnx.data").is_file()
    assert not [p for p in models.iterdir() if not p.name.startswith(".")]  # no entry was published
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        path = built_decoder_path(work / "hf")
    assert not left.exists() and path.is_file()
    assert [p.name for p in models.iterdir()] == [path.parent.name]


def test_sigkill_during_a_layerwise_build_is_cleaned_and_resumed(work: Path, caplog: pytest.LogCaptureFixture
                                                                 ) -> None:
    rec = _layerwise_recipe(work)
    clean = quantkit.quantize(recipe=rec, progress=False, evaluate=False, measure_latency=False)
    clean_data = _sha(clean.path.with_name("model.onnx.data"))
    clean.save(work / "o1")
    proc = _child(f"""
        import os, signal
        os.environ["QUANTKIT_BUILD_PROCESS"] = "this"  # the patched block runs in this process
        from quantkit.layerwise import _Hook
        real = _Hook.block
        def block(self, index, weights):
            if index == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, index, weights)
        _Hook.block = block
        import quantkit
        quantkit.quantize(recipe={str(rec)!r}, progress=False, evaluate=False, measure_latency=False)
        """)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    [left] = list((work / "cache").glob("quantkit-layerwise-*"))
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        again = quantkit.quantize(recipe=rec, progress=False, evaluate=False, measure_latency=False)
    assert not left.exists() and again.report["calibration"]["resumed_blocks"] == 1
    assert _sha(again.path.with_name("model.onnx.data")) == clean_data
    again.save(work / "o2")
    assert not list((work / "cache").glob("quantkit-layerwise-*"))
