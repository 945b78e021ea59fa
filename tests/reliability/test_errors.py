"""Inputs that used to end in "internal error ... this is a bug" (or in silent garbage) end in one clear line.

Every row drives the command line (``quantkit.cli.main``) or the Python API as a user would, on tiny inputs
made here (a LLaMA-shaped Hugging Face folder of 0.3 MB, a tiny ONNX CNN, ``.npz`` data), and asserts the
exit code or the exception type, the message (naming the file / key / value and what is allowed) and that
every file outside what quantkit may write (its cache) is byte-identical afterwards.
Exit codes: 0 ok, 1 internal bug, 2 user error, 3 verify: kernels part.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

import quantkit
from quantkit.cli import main
from quantkit.errors import DataError, ModelError, QuantkitError, RecipeError
from quantkit.pipeline import verify_model
from tests.conftest import image_batches, tiny_cnn
from tests.reliability.conftest import tree_digest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.frontends.llm_builder import ROTARY_CACHE_POSITIONS  # noqa: E402
from tests.unit.test_llm_frontend import char_tokenizer  # noqa: E402

VOCAB, MAX_POS = 128, 64
REPO = Path(__file__).resolve().parents[2]


# -- helpers ---------------------------------------------------------------------------------------
def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line_error(err: str) -> str:
    """The error line; there is exactly one and no traceback."""
    lines = [ln for ln in err.splitlines() if ln.startswith("quantkit: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    return lines[0]


def _make_llama(folder: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POS, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama-base") / "llama"
    _make_llama(folder)
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_safetensors(path: Path, header: dict[str, Any], data: bytes) -> None:
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def _set_config(folder: Path, **values: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(values)
    (folder / "config.json").write_text(json.dumps(cfg))


def _llm_recipe(tmp: Path, folder: Path, mode: str, *, evaluation: bool = True, cal_len: int = 16,
                ev_len: int = 16) -> Path:
    text = tmp / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    data = {"kind": "text", "source": str(text), "mode": "windows", "seq_len": cal_len, "count": 2}
    rec: dict[str, Any] = {
        "version": 1, "name": "llm", "model": {"source": str(folder)},
        "calibration": {"data": data},
        "quantization": {"default": {"format": "int4", "group_size": 32}},
        "report": {"formats": ["json"], "latency": {"enabled": False}},
    }  # fmt: skip
    if evaluation:
        rec["evaluation"] = {"data": {**data, "seq_len": ev_len}}
    if mode == "layerwise":
        rec["calibration"]["layerwise"] = True
    elif mode == "full_sequence":
        rec["model"]["graph"] = "full_sequence"
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


# -- broken Hugging Face folders ---------------------------------------------------------------------
def _heads0(d: Path) -> list[str]:
    _set_config(d, num_attention_heads=0)
    return ["config.json", "num_attention_heads 0", "allowed: an integer in 1 .."]


def _hidden_float(d: Path) -> list[str]:
    _set_config(d, hidden_size=64.5)
    return ["config.json", "hidden_size 64.5", "allowed: an integer in 1 .."]


def _huge_header(d: Path) -> list[str]:
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 1 << 60) + raw[8:])
    return ["model.safetensors", f"header length {1 << 60}", "larger than the file"]


def _offsets_past_end(d: Path) -> list[str]:
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    return ["model.safetensors", "data_offsets", "lie outside the file"]


def _index(d: Path, target: Any) -> None:
    h, _ = _header(d / "model.safetensors")
    names = [k for k in h if k != "__metadata__"]
    wmap = {k: (target if i == 0 else "model.safetensors") for i, k in enumerate(names)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))


def _map_dotdot(d: Path) -> list[str]:
    shutil.copy(d / "model.safetensors", d.parent / "outside.safetensors")  # a valid file, outside the folder
    _index(d, "../outside.safetensors")
    return ["model.safetensors.index.json", "'model.embed_tokens.weight' -> '../outside.safetensors'",
            "not a file inside the folder"]


def _map_absolute(d: Path) -> list[str]:
    _index(d, "/etc/passwd")
    return ["model.safetensors.index.json", "-> '/etc/passwd'", "not a file inside the folder"]


def _map_not_mapping(d: Path) -> list[str]:
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    return ["model.safetensors.index.json", "weight_map is a JSON list", "allowed: a mapping"]


def _dtype(code: str) -> Any:
    def damage(d: Path) -> list[str]:
        f = d / "model.safetensors"
        h, data = _header(f)
        name = "model.layers.0.self_attn.q_proj.weight"
        n = int(np.prod(h[name]["shape"]))
        h[name] = {"dtype": code, "shape": h[name]["shape"], "data_offsets": [len(data), len(data) + n]}
        _write_safetensors(f, h, data + bytes(n))
        return ["model.safetensors", repr(name), f"dtype {code}", "allowed: BF16, F16, F32"]

    return damage


BROKEN = {
    "num_attention_heads_0": _heads0, "hidden_size_not_integer": _hidden_float, "huge_header": _huge_header,
    "offsets_past_end": _offsets_past_end, "weight_map_dotdot": _map_dotdot, "weight_map_absolute": _map_absolute,
    "weight_map_not_a_mapping": _map_not_mapping, "int8_weight": _dtype("I8"), "bool_weight": _dtype("BOOL"),
}  # fmt: skip


@pytest.mark.parametrize("mode", ["auto", "full_sequence", "layerwise"])
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_hf_folder_is_a_clear_error_before_any_work(llama_base: Path, tmp_path: Path, cache: Path, case: str,
                                                            mode: str, capsys: Any) -> None:
    folder = tmp_path / "hf" / "llama"
    shutil.copytree(llama_base, folder)
    expect = BROKEN[case](folder)
    rec = _llm_recipe(tmp_path, folder, mode)
    before = tree_digest(tmp_path, skip=["cache"])
    t = time.perf_counter()
    rc, _, err = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(tmp_path / "o")], capsys)
    line = _one_line_error(err)
    assert rc == 2
    for part in expect:
        assert part in line, (part, line)
    assert time.perf_counter() - t < 30
    assert tree_digest(tmp_path, skip=["cache"]) == before  # nothing of the user's changed, no output
    assert not (tmp_path / "o").exists()
    assert not (cache / "stats").exists() and not list(cache.glob("layerwise/*/block_*"))  # refused before calibrating


@pytest.mark.parametrize("mode", ["auto", "layerwise"])
def test_config_sizes_are_checked_against_the_weights(llama_base: Path, tmp_path: Path, cache: Path, mode: str,
                                                      capsys: Any) -> None:
    folder = tmp_path / "hf" / "llama"
    shutil.copytree(llama_base, folder)
    _set_config(folder, vocab_size=1_000_000)  # in range, but the embedding has 128 rows
    rec = _llm_recipe(tmp_path, folder, mode)
    before = tree_digest(tmp_path, skip=["cache"])
    rc, _, err = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(tmp_path / "o")], capsys)
    line = _one_line_error(err)
    assert rc == 2 and "'model.embed_tokens.weight'" in line and "[128, 64]" in line and "[1000000, 64]" in line
    assert tree_digest(tmp_path, skip=["cache"]) == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("mode", ["auto", "layerwise"])
@pytest.mark.parametrize("section", ["calibration", "evaluation"])
def test_windows_longer_than_the_context_are_refused_before_the_work(llama_base: Path, tmp_path: Path, cache: Path,
                                                                     mode: str, section: str, capsys: Any) -> None:
    lengths = {"cal_len": 100} if section == "calibration" else {"ev_len": 100}
    rec = _llm_recipe(tmp_path, llama_base, mode, **lengths)
    before = tree_digest(tmp_path, skip=["cache"]), tree_digest(llama_base)
    rc, _, err = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(tmp_path / "o")], capsys)
    line = _one_line_error(err)
    assert rc == 2 and f"the {section} data: sequences of 100 tokens" in line
    assert f"context of {MAX_POS} positions" in line and f"seq_len <= {MAX_POS}" in line
    assert (tree_digest(tmp_path, skip=["cache"]), tree_digest(llama_base)) == before
    assert not (tmp_path / "o").exists() and not (cache / "stats").exists()


# -- runaway memory from config.json -----------------------------------------------------------------
def _limited_run(args: list[str], cache: Path, limit: int = 4 << 30) -> tuple[subprocess.CompletedProcess[str], float]:
    """``quantkit ARGS`` in a child process whose address space is capped at ``limit`` bytes."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(REPO), "QUANTKIT_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", *args], env=env, capture_output=True, text=True,
                          preexec_fn=cap, timeout=300, check=False)  # fmt: skip
    return proc, time.perf_counter() - t


@pytest.mark.parametrize("mode", ["auto", "layerwise"])
def test_huge_max_position_embeddings_is_refused_at_once_under_a_memory_cap(llama_base: Path, tmp_path: Path,
                                                                           cache: Path, mode: str) -> None:
    folder = tmp_path / "hf" / "llama"
    shutil.copytree(llama_base, folder)
    _set_config(folder, max_position_embeddings=300_000_000)  # used to allocate > 5 GiB of rotary caches
    rec = _llm_recipe(tmp_path, folder, mode)
    before = tree_digest(tmp_path, skip=["cache"])
    proc, took = _limited_run(["calibrate", "-q", "--recipe", str(rec), "--output", str(tmp_path / "o")], cache)
    line = _one_line_error(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert "config.json" in line and "max_position_embeddings 300000000" in line and "1 .. 16777216" in line
    assert took < 60
    assert tree_digest(tmp_path, skip=["cache"]) == before and not (tmp_path / "o").exists()


def test_rotary_caches_are_sized_to_the_context_used_not_the_config(llama_base: Path, tmp_path: Path,
                                                                   cache: Path) -> None:
    """A legal but huge max_position_embeddings (16 M): the build stays under a 4 GiB address-space cap (the
    caches used to take 16 M x 8 x 2 floats = 1 GiB, plus copies) and the decoder's context is capped."""
    folder = tmp_path / "hf" / "llama"
    shutil.copytree(llama_base, folder)
    _set_config(folder, max_position_embeddings=16_000_000)
    rec = _llm_recipe(tmp_path, folder, "layerwise", evaluation=False)
    before = tree_digest(tmp_path, skip=["cache"])
    proc, took = _limited_run(["calibrate", "-q", "--recipe", str(rec), "--output", str(tmp_path / "o")], cache)
    assert proc.returncode == 0, proc.stderr
    assert took < 120
    m = onnx.load(str(tmp_path / "o" / "model.onnx"), load_external_data=False)
    rows = {i.name: i.dims[0] for i in m.graph.initializer if i.name in ("cos_cache", "sin_cache")}
    assert rows == {"cos_cache": ROTARY_CACHE_POSITIONS, "sin_cache": ROTARY_CACHE_POSITIONS}
    genai = json.loads((tmp_path / "o" / "genai_config.json").read_text())
    assert genai["model"]["context_length"] == ROTARY_CACHE_POSITIONS
    assert tree_digest(tmp_path, skip=["cache", "o"]) == before


# -- ONNX models -----------------------------------------------------------------------------------
@pytest.fixture
def work(tmp_path: Path, cache: Path) -> Path:
    np.savez(tmp_path / "cal.npz", input=np.concatenate([b["input"] for b in image_batches(2)]))
    np.savez(tmp_path / "ev.npz", input=np.concatenate([b["input"] for b in image_batches(1, seed=7)]))
    onnx.save(tiny_cnn(), tmp_path / "model.onnx")
    return tmp_path


def _recipe(work: Path, *, ev: str | None = "ev.npz", **quant: Any) -> Path:
    rec: dict[str, Any] = {
        "version": 1, "name": "err", "model": {"source": str(work / "model.onnx")},
        "calibration": {"data": {"kind": "npz", "path": str(work / "cal.npz")}},
        "report": {"formats": ["json"], "latency": {"enabled": False}, "kernel_check_samples": 2},
    }  # fmt: skip
    if ev is not None:
        rec["evaluation"] = {"data": {"kind": "npz", "path": str(work / ev)}}
    if quant:
        rec["quantization"] = quant
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


def _empty_weight_model(kind: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 16, 16])
    const = [numpy_helper.from_array(np.asarray(v, np.int64), n) for n, v in (("st", [0]), ("en", [0]), ("ax", [1]))]
    if kind == "matmul":  # the layer's input has 0 channels: the bias correction's mean divided by 0
        nodes = [helper.make_node("Flatten", ["input"], ["f"], name="flatten"),
                 helper.make_node("Slice", ["f", "st", "en", "ax"], ["s"], name="slice"),
                 helper.make_node("MatMul", ["s", "w"], ["m"], name="fc"),
                 helper.make_node("Add", ["m", "b"], ["out"], name="bias")]  # fmt: skip
        inits = [numpy_helper.from_array(np.zeros((0, 10), np.float32), "w"),
                 numpy_helper.from_array(np.ones(10, np.float32), "b"), *const]  # fmt: skip
        y = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 10])
    else:
        nodes = [helper.make_node("Conv", ["input", "w", "b"], ["c"], name="fc", pads=[1, 1, 1, 1]),
                 helper.make_node("Relu", ["c"], ["out"], name="relu")]  # fmt: skip
        inits = [numpy_helper.from_array(np.zeros((0, 3, 3, 3), np.float32), "w"),
                 numpy_helper.from_array(np.zeros(0, np.float32), "b")]  # fmt: skip
        y = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 0, 16, 16])
    m = helper.make_model(helper.make_graph(nodes, "empty", [x], [y], inits), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("kind", ["matmul", "conv"])
def test_zero_sized_weight_is_a_model_error_naming_the_layer(work: Path, cache: Path, kind: str, capsys: Any) -> None:
    onnx.save(_empty_weight_model(kind), work / "model.onnx")
    rec = _recipe(work, bias_correction=True)
    before = tree_digest(work, skip=["cache"])
    rc, _, err = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")], capsys)
    line = _one_line_error(err)
    shape = "[0, 10]" if kind == "matmul" else "[0, 3, 3, 3]"
    assert rc == 2 and "node 'fc'" in line and f"empty weight 'w' of shape {shape}" in line
    assert tree_digest(work, skip=["cache"]) == before and not (work / "o").exists()
    assert not (cache / "stats").exists()  # refused before calibrating


def _old_opset_cnn(opset: int) -> onnx.ModelProto:
    """tiny_cnn as an opset-9/10 model: Clip(min, max) as attributes (opset 11 made them inputs)."""
    m = tiny_cnn()
    for n in m.graph.node:
        if n.op_type == "Clip":
            del n.input[1:]
            n.attribute.extend([helper.make_attribute("min", 0.0), helper.make_attribute("max", 6.0)])
    keep = [i for i in m.graph.initializer if i.name not in ("lo", "hi")]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    del m.opset_import[:]
    m.opset_import.extend([helper.make_opsetid("", opset)])
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("opset", [9, 10])
def test_old_opset_is_converted_before_the_work(work: Path, opset: int, capsys: Any, caplog: Any) -> None:
    onnx.save(_old_opset_cnn(opset), work / "model.onnx")
    rec = _recipe(work)
    before = tree_digest(work, skip=["cache"])
    rc, out, err = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")], capsys)
    assert rc == 0, err
    assert f"opset {opset} was converted to opset 13" in err
    q = onnx.load(str(work / "o" / "model.onnx"))
    onnx.checker.check_model(q)  # quantkit's own check failed here: Clip's min / max attributes were kept
    assert {o.domain: o.version for o in q.opset_import}[""] >= 13
    assert not [a for n in q.graph.node if n.op_type == "Clip" for a in n.attribute]
    rep = json.loads((work / "o" / "report.json").read_text())
    assert rep["fidelity"]["logits"]["top1_agreement"] > 0.9  # the converted float model is the same function
    assert tree_digest(work, skip=["cache", "o"]) == before


def test_old_opset_that_cannot_be_converted_is_refused_before_the_work(work: Path, cache: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: Any) -> None:
    from onnx import version_converter

    def fail(*a: Any, **k: Any) -> None:
        raise RuntimeError("No Adapter For Upsample")

    monkeypatch.setattr(version_converter, "convert_version", fail)
    onnx.save(_old_opset_cnn(9), work / "model.onnx")
    rec = _recipe(work)
    before = tree_digest(work, skip=["cache"])
    rc, _, err = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")], capsys)
    line = _one_line_error(err)
    assert rc == 2 and "opset is 9" in line and "No Adapter For Upsample" in line and "opset >= 13" in line
    assert tree_digest(work, skip=["cache"]) == before and not (work / "o").exists()
    assert not (cache / "stats").exists()


# -- verify ----------------------------------------------------------------------------------------
def test_verify_on_a_float_model_says_there_is_nothing_to_verify(work: Path, capsys: Any) -> None:
    before = tree_digest(work)
    rc, out, err = _run(["verify", str(work / "model.onnx"), "--data", str(work / "ev.npz")], capsys)
    line = _one_line_error(err)
    assert rc == 2 and "model.onnx" in line and "no quantized layer" in line and "nothing to verify" in line
    assert "exact" not in out
    assert tree_digest(work) == before
    with pytest.raises(ModelError, match="nothing to verify"):
        verify_model(str(work / "model.onnx"))


@pytest.mark.parametrize("samples", ["0", "-3"])
def test_verify_samples_out_of_range_is_an_error_naming_the_range(work: Path, samples: str, capsys: Any) -> None:
    before = tree_digest(work)
    rc, out, err = _run(["verify", str(work / "model.onnx"), "--samples", samples], capsys)
    line = _one_line_error(err)
    assert rc == 2 and f"--samples {samples}" in line and "allowed: an integer >= 1" in line
    assert "no --data" not in out
    assert tree_digest(work) == before
    with pytest.raises(QuantkitError, match="allowed: an integer >= 1"):
        verify_model(str(work / "model.onnx"), samples=int(samples))


# -- the evaluation set ----------------------------------------------------------------------------
def test_empty_evaluation_file_is_a_data_error_before_the_work(work: Path, cache: Path, capsys: Any) -> None:
    np.savez(work / "empty.npz", input=np.zeros((0, 3, 16, 16), np.float32))
    rec = _recipe(work, ev="empty.npz")
    before = tree_digest(work, skip=["cache"])
    rc, _, err = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")], capsys)
    line = _one_line_error(err)
    assert rc == 2 and "empty.npz" in line
    assert tree_digest(work, skip=["cache"]) == before and not (work / "o").exists()
    assert not (cache / "stats").exists()  # refused before calibrating


def test_empty_evaluation_data_through_the_api_is_a_data_error(work: Path, cache: Path) -> None:
    rec = _recipe(work, ev=None)
    before = tree_digest(work, skip=["cache"])
    with pytest.raises(DataError, match=r"evaluation_data \(passed through the API\) holds no sample"):
        quantkit.quantize(recipe=str(rec), progress=False, measure_latency=False,
                          evaluation_data={"input": np.zeros((0, 3, 16, 16), np.float32)})  # fmt: skip
    assert tree_digest(work, skip=["cache"]) == before
    assert not (cache / "stats").exists()


# -- API argument types ----------------------------------------------------------------------------
def test_save_with_a_wrong_type_names_the_type_and_what_is_allowed(work: Path) -> None:
    res = quantkit.quantize(recipe=str(_recipe(work)), progress=False, measure_latency=False)
    before = tree_digest(work, skip=["cache"])
    with pytest.raises(QuantkitError, match=r"directory must be a path \(str or os.PathLike\), got int 42"):
        res.save(42)  # type: ignore[arg-type]
    with pytest.raises(QuantkitError, match="report must be True or False, got str 'no'"):
        res.save(work / "o", report="no")  # type: ignore[arg-type]
    assert tree_digest(work, skip=["cache"]) == before and not (work / "o").exists()


@pytest.mark.parametrize(("key", "value", "expect"), [
    ("use_cache", "no", "use_cache must be True or False, got str 'no'"),
    ("progress", 0, "progress must be True or False, got int 0"),
    ("evaluate", "false", "evaluate must be True or False, got str 'false'"),
    ("measure_latency", "yes", "measure_latency must be True, False or None, got str 'yes'"),
])
def test_api_switches_refuse_non_bool_values(work: Path, cache: Path, key: str, value: Any, expect: str) -> None:
    rec = _recipe(work)
    before = tree_digest(work, skip=["cache"])
    with pytest.raises(RecipeError) as info:
        quantkit.quantize(recipe=str(rec), **{key: value})
    assert expect in str(info.value)
    assert tree_digest(work, skip=["cache"]) == before and not cache.exists()  # refused before any work


def test_sweep_refuses_a_non_bool_use_cache(work: Path, cache: Path) -> None:
    with pytest.raises(RecipeError, match="use_cache"):
        quantkit.sweep(recipe=str(_recipe(work)), output=work / "sw", use_cache="no")  # type: ignore[arg-type]
    assert not (work / "sw").exists()


# -- generate --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder(llama_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An emitted int4 decoder of the tiny LLaMA (context 64) with its tokenizer beside it."""
    base = tmp_path_factory.mktemp("decoder")
    rec = {"version": 1, "name": "dec", "model": {"source": str(llama_base)}, "calibration": {"layerwise": True},
           "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
           "report": {"formats": ["json"], "latency": {"enabled": False}}}  # fmt: skip
    mp = pytest.MonkeyPatch()
    mp.setenv("QUANTKIT_CACHE", str(base / "cache"))
    try:
        res = quantkit.quantize(recipe=rec, progress=False, evaluate=False, measure_latency=False)
        res.save(base / "out")
    finally:
        mp.undo()
    return base / "out"


def test_generate_past_the_context_prints_the_text_and_stops_clearly(decoder: Path, capsys: Any) -> None:
    before = tree_digest(decoder)
    prompt = "The quick brown fox"  # 19 tokens: 64 - 19 + 1 = 46 new tokens fit
    rc, out, err = _run(["generate", "--model", str(decoder), "--prompt", prompt, "--max-new-tokens", "100"], capsys)
    line = _one_line_error(err)
    assert rc == 2
    assert "stopped after 46 of 100 new tokens" in line and "context holds 64 positions" in line
    assert "the prompt took 19" in line and "at most 46 new tokens" in line
    assert out.startswith(prompt) and len(out.strip()) > len(prompt)  # the text so far is not lost
    assert tree_digest(decoder) == before


def test_generate_with_a_prompt_longer_than_the_context_is_refused(decoder: Path, capsys: Any) -> None:
    rc, out, err = _run(["generate", "--model", str(decoder), "--prompt", "a" * 70, "--max-new-tokens", "4"], capsys)
    line = _one_line_error(err)
    assert rc == 2 and "the prompt has 70 tokens" in line and "64 positions" in line and out == ""


def test_generate_with_a_tokenizer_larger_than_the_vocabulary_is_refused(decoder: Path, tmp_path: Path,
                                                                        capsys: Any) -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *sorted(set("abcdefghij ")),
                                         *[f"<x{j}>" for j in range(200)]])}  # fmt: skip
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(tmp_path / "tok")  # fmt: skip
    before = tree_digest(tmp_path), tree_digest(decoder)
    rc, out, err = _run(["generate", "--model", str(decoder), "--tokenizer", str(tmp_path / "tok"), "--prompt",
                         "abc", "--max-new-tokens", "4"], capsys)  # fmt: skip
    line = _one_line_error(err)
    assert rc == 2 and f"has {len(vocab)} tokens" in line and "vocabulary has 128 (ids 0 .. 127)" in line
    assert out == ""  # no garbage
    assert (tree_digest(tmp_path), tree_digest(decoder)) == before
