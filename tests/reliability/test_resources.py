"""No input can make a run hang or exhaust memory: it ends quickly with a clear error, or stays bounded.

Each case drives the command line (``quantkit.cli.main``, in a subprocess where a regression would hang or
blow up memory) or the API on a tiny ONNX model and data made here, and asserts the exit code (2: a user
error), the message (naming the file / key / value and what is allowed) and that every file outside the
private cache is byte-identical afterwards.  Inputs are small files that would blow up: a 6 MB ``.npz``
that inflates to 6 GiB, a 48 KB PNG of 20000 x 20000 pixels, counts of a billion, a backtracking regex.
"""

from __future__ import annotations

import os
import re
import resource
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from PIL import Image

from quantkit.cli import main
from quantkit.data import NpzDataset
from quantkit.errors import DataError, RecipeError
from quantkit.recipe.patterns import MATCH_TIMEOUT_S, pattern_search
from tests.conftest import image_batches, tiny_cnn
from tests.reliability.conftest import tree_digest

ROW = (3, 16, 16)  # one sample of the tiny CNN's input
AS_LIMIT = 3 * 2**30  # address-space limit of the subprocess runs: far below what a bomb inflates to


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny model, calibration / evaluation data and a private cache in ``tmp_path``."""
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QUANTKIT_NPZ_MAX_BYTES", raising=False)
    onnx.save(tiny_cnn(), tmp_path / "model.onnx")
    np.savez(tmp_path / "cal.npz", input=np.concatenate([b["input"] for b in image_batches(2)]))
    np.savez(tmp_path / "ev.npz", input=np.concatenate([b["input"] for b in image_batches(1, seed=7)]))
    return tmp_path


def _recipe(work: Path, *, cal: Any = None, **extra: Any) -> Path:
    rec: dict[str, Any] = {
        "version": 1, "name": "res",
        "model": {"source": str(work / "model.onnx")},
        "calibration": {"data": cal or {"kind": "npz", "path": str(work / "cal.npz")}, "batch_size": 4},
        "evaluation": {"data": {"kind": "npz", "path": str(work / "ev.npz")}},
        "report": {"formats": ["json"], "latency": {"enabled": False}, "kernel_check_samples": 2},
    }
    for key, value in extra.items():
        rec[key] = {**rec[key], **value} if isinstance(rec.get(key), dict) else value
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


def _snapshot(work: Path) -> dict[str, str]:
    return tree_digest(work, skip=["cache"])


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out + out.err


def _limit_memory() -> None:  # preexec_fn of the subprocess runs
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _run_limited(args: list[str], work: Path, timeout: float, **env: str) -> tuple[int, str, float]:
    """``quantkit ARGS`` in a subprocess under an address-space limit and a wall-clock timeout."""
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "quantkit.cli", *args], capture_output=True, text=True, timeout=timeout,
        preexec_fn=_limit_memory, cwd=work,
        env={**os.environ, "PYTHONPATH": os.getcwd(), "QUANTKIT_CACHE": str(work / "cache"), **env},
    )
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t


def _message(text: str) -> str:
    """The one ``quantkit: error:`` line (and its indented continuation lines, for recipe errors)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("quantkit: error:"))
    tail = [line for line in lines[start + 1 :] if line.startswith("  ")]
    return "\n".join([lines[start], *tail])


# -- .npz zip bombs and lying headers -------------------------------------------------------------
def _write_zip64(path: Path, member: str, raw_deflate: bytes, crc: int, size: int) -> None:
    """A zip with one deflated member whose sizes are given (zip64 records, as any >4 GiB member has)."""
    name = member.encode()
    extra_local = struct.pack("<HHQQ", 1, 16, size, len(raw_deflate))
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 8, 0, 0x21, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                        len(name), len(extra_local)) + name + extra_local
    extra_central = struct.pack("<HHQQ", 1, 16, size, len(raw_deflate))
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 8, 0, 0x21, crc, 0xFFFFFFFF,
                          0xFFFFFFFF, len(name), len(extra_central), 0, 0, 0, 0, 0) + name + extra_central
    body = local + raw_deflate
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(body), 0)
    path.write_bytes(body + central + end)


def _zero_bomb(path: Path, samples: int, key: str = "input") -> int:
    """An ``.npz`` whose ``key`` is ``float32[samples, 3, 16, 16]`` of zeros, written in a few MB without
    ever holding the array: one deflated MiB of zeros, flushed to a byte boundary, repeated.  Returns the
    inflated size of the member."""
    head = _npy((samples, *ROW), b"")
    data_bytes = samples * int(np.prod(ROW)) * 4
    assert data_bytes % 2**20 == 0
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(2**20)) + c.flush(zlib.Z_FULL_FLUSH)  # a fresh dictionary: repeatable as is
    last = zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # the final (empty) block
    crc, zeros = zlib.crc32(head), bytes(64 * 2**20)
    for _ in range(data_bytes // len(zeros)):
        crc = zlib.crc32(zeros, crc)
    for _ in range(data_bytes % len(zeros) // 2**20):
        crc = zlib.crc32(zeros[: 2**20], crc)
    _write_zip64(path, f"{key}.npy", first + block * (data_bytes // 2**20) + last, crc, len(head) + data_bytes)
    return len(head) + data_bytes


def test_npz_zip_bomb_is_refused_before_inflating(work: Path) -> None:
    """6 MB that inflate to 6 GiB (what used to take > 5 GiB of memory): refused from the headers."""
    bomb = work / "bomb.npz"
    size = _zero_bomb(bomb, 2**21)  # 2M samples of 3 KiB: 6 GiB
    assert bomb.stat().st_size < 8 * 2**20 and size > 6 * 2**30
    with zipfile.ZipFile(bomb) as zf, zf.open("input.npy") as f:  # a genuine bomb: it does inflate
        assert np.lib.format.read_magic(f) == (1, 0)
        assert np.lib.format.read_array_header_1_0(f)[0] == (2**21, *ROW)
        assert f.read(2**20) == bytes(2**20)
    rec = _recipe(work, cal={"kind": "npz", "path": str(bomb)})
    before = _snapshot(work)
    rc, text, seconds = _run_limited(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")],
                                     work, timeout=120)
    msg = _message(text)
    assert rc == 2, text
    assert str(bomb) in msg and "array 'input'" in msg and f"6.0 GiB ({2**21 * 3072} bytes)" in msg
    assert "allowed: at most 4.0 GiB" in msg and "QUANTKIT_NPZ_MAX_BYTES" in msg
    assert "Traceback" not in text and seconds < 60
    assert _snapshot(work) == before and not (work / "o").exists()


def test_npz_limit_is_adjustable_and_reading_streams_in_bounded_memory(tmp_path: Path) -> None:
    """Under a raised limit a 1.5 GiB member is read batch by batch in a process limited to far less than
    it would take whole (its address space is capped at 0.5 GiB over what it holds before reading)."""
    bomb = tmp_path / "big.npz"
    _zero_bomb(bomb, 2**19)  # 512k samples: 1.5 GiB inflated
    script = (
        "import os, resource, sys\n"
        "from quantkit.data import NpzDataset\n"
        "from quantkit.errors import DataError\n"
        "try:\n"
        "    NpzDataset(sys.argv[1], ['input'])\n"
        "    sys.exit('the 64 MiB limit did not refuse a 1.5 GiB array')\n"
        "except DataError as e:\n"
        "    assert 'allowed: at most 64.0 MiB' in str(e), e\n"
        "os.environ['QUANTKIT_NPZ_MAX_BYTES'] = '2G'\n"
        "ds = NpzDataset(sys.argv[1], ['input'])\n"
        "with open('/proc/self/statm') as f:\n"
        "    vm = int(f.read().split()[0]) * resource.getpagesize()\n"
        "cap = vm + 2**29\n"
        "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
        "n = total = 0\n"
        "for b in ds.batches(4096):\n"
        "    n += b['input'].shape[0]; total += float(abs(b['input']).sum())\n"
        "print(n, total)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "QUANTKIT_NPZ_MAX_BYTES": "64M"}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, str(bomb)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(2**19), "0.0"]
    assert time.perf_counter() - t < 60


def test_bad_npz_limit_setting_is_named(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_NPZ_MAX_BYTES", "lots")
    with pytest.raises(DataError, match=r"QUANTKIT_NPZ_MAX_BYTES='lots' is not a size; allowed: a positive"):
        NpzDataset(work / "cal.npz", ["input"])


def _npy(shape: tuple[int, ...], data: bytes, dtype: str = "<f4") -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + data


@pytest.mark.parametrize("where", ["calibration", "evaluation"])
def test_npz_header_that_lies_about_its_length_is_a_data_error(work: Path, where: str, capsys: Any) -> None:
    lying = work / "lying.npz"
    half = np.ones((4, *ROW), np.float32).tobytes()
    with zipfile.ZipFile(lying, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("input.npy", _npy((8, *ROW), half))  # says 8 samples, holds 4
    spec = {"kind": "npz", "path": str(lying)}
    rec = _recipe(work, cal=spec if where == "calibration" else None,
                  **({"evaluation": {"data": spec}} if where == "evaluation" else {}))
    before = _snapshot(work)
    rc, text = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")], capsys)
    assert rc == 2, text
    assert (f"npz file {str(lying)!r}: array 'input' header says shape [8, 3, 16, 16] float32 (24576 bytes) "
            "but the file holds 12288 bytes") in _message(text)
    assert _snapshot(work) == before and not (work / "o").exists()


def test_npz_whose_data_ends_early_is_a_data_error_while_reading(work: Path) -> None:
    """The zip directory promises the bytes, the deflate stream ends before them: named, not internal."""
    short = work / "short.npz"
    body = _npy((8, *ROW), np.ones((8, *ROW), np.float32).tobytes())
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    deflated = raw.compress(body[: len(body) // 2]) + raw.flush()  # the stream ends half way
    _write_zip64(short, "input.npy", deflated, zlib.crc32(body), len(body))
    ds = NpzDataset(short, ["input"])  # the headers are consistent
    with pytest.raises(DataError, match=rf"npz file {str(short)!r}.*(cannot be read|ended after)"):
        list(ds.batches(4))


def test_npz_folder_with_different_sample_shapes_names_both_files(work: Path, capsys: Any) -> None:
    folder = work / "calset"
    folder.mkdir()
    np.savez(folder / "a.npz", input=np.zeros((2, *ROW), np.float32))
    np.savez(folder / "b.npz", input=np.zeros((2, 3, 16, 8), np.float32))
    rec = _recipe(work, cal={"kind": "npz", "path": str(folder)})
    before = _snapshot(work)
    rc, text = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")], capsys)
    assert rc == 2, text
    assert (f"npz files {str(folder / 'a.npz')!r} and {str(folder / 'b.npz')!r} hold different samples for "
            "input 'input': shape [2, 3, 16, 16] float32 vs shape [2, 3, 16, 8] float32") in _message(text)
    assert _snapshot(work) == before


def test_npz_arrays_of_objects_are_refused_without_unpickling(work: Path) -> None:
    path = work / "obj.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("input.npy", _npy((1,), b"\x80\x04N.", dtype="|O"))
    with pytest.raises(DataError, match=r"array 'input' holds Python objects \(object\)"):
        NpzDataset(path, ["input"])


# -- counts that would run for hours ---------------------------------------------------------------
@pytest.mark.parametrize(("patch", "key", "allowed"), [
    ({"calibration": {"data": {"kind": "sample_photos", "count": 10**9}}}, "calibration.data",
     "key 'count' is 1000000000; allowed: 1 to 100000"),
    ({"evaluation": {"data": {"kind": "text", "source": "pydoc", "count": 10**9}}}, "evaluation.data",
     "key 'count' is 1000000000; allowed: 1 to 100000"),
    ({"evaluation": {"data": {"kind": "text", "source": "pydoc", "seq_len": 10**9}}}, "evaluation.data",
     "key 'seq_len' is 1000000000; allowed: 2 to 131072"),
    ({"report": {"latency": {"repeat": 10**9}}}, "report.latency.repeat", "less than or equal to 10000"),
    ({"report": {"latency": {"warmup": 10**9}}}, "report.latency.warmup", "less than or equal to 10000"),
    ({"report": {"latency": {"long_prefill": 10**9}}}, "report.latency.long_prefill",
     "less than or equal to 131072"),
    ({"report": {"latency": {"batch_size": 10**9}}}, "report.latency.batch_size", "less than or equal to 4096"),
    ({"calibration": {"max_rows": 10**9}}, "calibration.max_rows", "less than or equal to 65536"),
])
def test_runaway_counts_are_refused_when_the_recipe_loads(work: Path, patch: dict[str, Any], key: str,
                                                          allowed: str, capsys: Any) -> None:
    rec = work / "recipe.yaml"
    data = yaml.safe_load(_recipe(work).read_text())
    for section, values in patch.items():
        data[section] = {**data.get(section, {}), **values}
        if section == "report":
            data["report"]["latency"] = {"enabled": False, **values["latency"]}
    rec.write_text(yaml.safe_dump(data))
    before = _snapshot(work)
    t = time.perf_counter()
    for args in (["validate", str(rec)], ["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")]):
        rc, text = _run(args, capsys)
        assert rc == 2, text
        msg = _message(text)
        assert f"  - {key}:" in msg and allowed in msg and "1000000000" in msg
    assert time.perf_counter() - t < 30
    assert _snapshot(work) == before and not (work / "o").exists()


def test_search_time_limit_and_sensitivity_lengths_are_bounded(work: Path) -> None:
    from quantkit.recipe import load_recipe

    base = yaml.safe_load(_recipe(work).read_text())
    for search, key in (({"time_limit_s": 1e9}, "search.time_limit_s"),
                        ({"sensitivity": {"seq_len": 10**9}}, "search.sensitivity.seq_len")):
        with pytest.raises(RecipeError, match=rf"{key}: Input should be less than or equal to"):
            load_recipe({**base, "search": {"candidates": ["int8", "fp32"], **search}})


@pytest.mark.parametrize(("where", "algorithm", "option", "value", "allowed"), [
    ("default", "signround", "iters", 10**9, "0 to 100000"),
    ("default", "awq", "n_grid", 10**9, "1 to 10000"),
    ("override", "gptq", "block_size", 1e12, "an integer from 1 to 65536"),
    ("candidate", "awq", "max_rows", 10**9, "1 to 65536"),
])
def test_runaway_algorithm_option_counts_are_refused(where: str, algorithm: str, option: str, value: Any,
                                                     allowed: str) -> None:
    from quantkit.recipe import load_recipe

    opts = {option: value}
    rec: dict[str, Any] = {"version": 1}
    if where == "default":
        rec["quantization"] = {"default": {"format": "int4", "algorithm": algorithm, "algorithm_options": opts}}
        key = "quantization.default"
    elif where == "override":
        rec["quantization"] = {"overrides": [{"pattern": "x", "algorithm": algorithm, "algorithm_options": opts}]}
        key = "quantization.overrides[0]"
    else:
        rec["search"] = {"candidates": ["fp32", {"name": "a4", "format": "int4", "algorithm": algorithm,
                                                 "algorithm_options": opts}]}
        key = "search.candidates[1]"
    with pytest.raises(RecipeError, match=rf"{re.escape(key)}\.algorithm_options\.{option} is {value} "
                                          rf"\(algorithm '{algorithm}'\); allowed: {allowed}"):
        load_recipe(rec)
    load_recipe({**rec, **({"search": {"candidates": ["fp32"]}} if where == "candidate" else {
        "quantization": {"default": {"format": "int4", "algorithm": algorithm}}})})  # the same without it


def test_api_datasets_refuse_runaway_counts_too() -> None:
    from quantkit.data import SamplePhotosDataset, make_dataset
    from quantkit.data.base import InputInfo

    with pytest.raises(DataError, match="sample photo count is 1000000000; allowed: 1 to 100000"):
        SamplePhotosDataset(10**9)
    info = [InputInfo("input", np.dtype(np.float32), (None, *ROW))]
    with pytest.raises(DataError, match="dataset 'sample_photos': key 'count' is 1000000000; allowed: 1 to"):
        make_dataset({"kind": "sample_photos", "count": 10**9}, inputs=info, split="calibration")
    with pytest.raises(DataError, match="dataset 'sample_photos': key 'seed' is -1; allowed: 0 to"):
        make_dataset({"kind": "sample_photos", "count": 2, "seed": -1}, inputs=info, split="calibration")


# -- regular expressions that backtrack forever ----------------------------------------------------
def _long_named_model(work: Path, name: str) -> None:
    model = tiny_cnn()
    model.graph.node[0].name = name
    onnx.save(model, work / "model.onnx")


def test_backtracking_override_pattern_is_a_recipe_error_in_seconds(work: Path) -> None:
    node = "a" * 3000 + "!"
    _long_named_model(work, node)
    rec = _recipe(work, quantization={"overrides": [{"layer": "dwconv", "format": "fp32"},
                                                    {"pattern": "(a+)+$", "format": "fp32"}]})
    before = _snapshot(work)
    rc, text, seconds = _run_limited(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")],
                                     work, timeout=120)
    msg = _message(text)
    assert rc == 2, text
    assert "quantization.overrides[1].pattern: pattern '(a+)+$' took more than" in msg
    assert "'" + "a" * 77 + "...' (3001 characters)" in msg
    assert seconds < 60 and "Traceback" not in text
    assert _snapshot(work) == before and not (work / "o").exists()


@pytest.mark.parametrize("pattern", ["(a+)+$", "(a|aa)+$", r"(\w+\s?)+$"])
def test_pattern_matching_is_bounded_in_time(pattern: str) -> None:
    t = time.perf_counter()
    with pytest.raises(RecipeError, match=r"search\.layers: pattern .* took more than 0.25 s"):
        pattern_search(pattern, "a" * 20000 + "!", "search.layers")
    assert time.perf_counter() - t < 2 + 4 * MATCH_TIMEOUT_S
    assert pattern_search(pattern, "aaaa", "search.layers")  # a short name still matches normally


def test_search_layers_pattern_is_matched_with_the_same_time_limit() -> None:
    import onnx_ir as ir

    from quantkit.recipe import load_recipe
    from quantkit.search.linear import find_linear_layers
    from tests.conftest import tiny_lm

    proto = tiny_lm()
    rec = load_recipe({"version": 1, "search": {"candidates": ["int4", "fp32"], "layers": "(a+)+$|_proj$"}})
    searched, _ = find_linear_layers(ir.from_proto(proto), rec)
    assert list(searched) == ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]
    next(n for n in proto.graph.node if n.name == "o_proj").name = "a" * 3000 + "!"
    t = time.perf_counter()
    with pytest.raises(RecipeError, match=r"^search\.layers: pattern '\(a\+\)\+\$\|_proj\$' took more than"):
        find_linear_layers(ir.from_proto(proto), rec)
    assert time.perf_counter() - t < 2 + 4 * MATCH_TIMEOUT_S


@pytest.mark.parametrize(("section", "value", "key"), [
    ("quantization", {"overrides": [{"pattern": "conv(", "format": "fp32"}]}, "quantization.overrides[0]"),
    ("search", {"candidates": ["int8", "fp32"], "layers": "[conv"}, "search.layers"),
])
def test_invalid_patterns_are_refused_when_the_recipe_loads(work: Path, section: str, value: Any, key: str,
                                                            capsys: Any) -> None:
    rec = _recipe(work, **{section: value})
    rc, text = _run(["validate", str(rec)], capsys)
    assert rc == 2, text
    assert f"  - {key}: Value error, pattern" in _message(text) and "is not a valid regular expression" in text


# -- images ------------------------------------------------------------------------------------------
def _image_recipe(work: Path, folder: Path) -> Path:
    spec = {"kind": "images", "path": str(folder), "preprocess": {"resize_short": 16, "crop": 16}}
    return _recipe(work, cal=spec)


def test_huge_png_in_an_image_folder_is_a_data_error_naming_it(work: Path) -> None:
    folder = work / "photos"
    folder.mkdir()
    Image.fromarray(np.full((20, 20, 3), 128, np.uint8)).save(folder / "a.png")
    Image.new("1", (20000, 20000)).save(folder / "b_huge.png")  # 48 KB, 400 million pixels
    assert (folder / "b_huge.png").stat().st_size < 2**20
    rec = _image_recipe(work, folder)
    before = _snapshot(work)
    rc, text, seconds = _run_limited(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")],
                                     work, timeout=120)
    assert rc == 2, text
    assert (f"image {str(folder / 'b_huge.png')!r} has 400000000 pixels; allowed: at most 178956970 pixels"
            in _message(text))
    assert seconds < 60 and "Traceback" not in text
    assert _snapshot(work) == before and not (work / "o").exists()


@pytest.mark.parametrize("content", ["truncated", "text"])
def test_broken_file_in_an_image_folder_is_a_data_error_naming_it(work: Path, content: str, capsys: Any) -> None:
    folder = work / "photos"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (24, 24, 3), np.uint8)).save(folder / f"{i}.png")
    bad = folder / "1.png"
    bad.write_bytes(bad.read_bytes()[:200] if content == "truncated" else b"this is not a picture\n")
    rec = _image_recipe(work, folder)
    before = _snapshot(work)
    rc, text = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o")], capsys)
    assert rc == 2, text
    assert f"cannot read image {str(bad)!r} (not an image, truncated or corrupt)" in _message(text)
    assert _snapshot(work) == before and not (work / "o").exists()
