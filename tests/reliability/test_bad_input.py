"""Every bad input ends in a clear error, nothing is lost or half-written, a broken cache heals itself.

Each test drives the command line (``quantkit.cli.main``) as a user would, on a tiny ONNX model and
``.npz`` data made here, and asserts the exit code, the message and the exact set of files left behind.
Exit codes: 0 ok, 1 internal bug (traceback saved), 2 user error, 3 verify: kernels part, 130 interrupted.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from quantkit.errors import RecipeError
from quantkit.recipe import load_recipe
from tests.conftest import image_batches
from tests.reliability.conftest import OUTPUTS, _files, _npz, _recipe, _run


# -- the statistics cache --------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "empty", "flip", "edit"])
def test_corrupt_statistics_cache_is_a_miss_and_heals(work: Path, damage: str, capsys: Any, caplog: Any) -> None:
    rec = _recipe(work)
    assert _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o1")], capsys)[0] == 0
    [cache] = list((work / "cache" / "stats").glob("*.npz"))
    good = cache.read_bytes()
    if damage == "truncate":
        cache.write_bytes(good[: len(good) // 2])
    elif damage == "empty":
        cache.write_bytes(b"")
    elif damage == "flip":
        b = bytearray(good)
        for i in range(len(b) // 3, len(b) // 3 + 64):
            b[i] ^= 0xFF
        cache.write_bytes(bytes(b))
    else:  # a valid npz with an edited array: only the checksum can tell
        with np.load(cache) as z:
            arrs = {k: z[k] for k in z.files}
        key = next(k for k in arrs if k.endswith("//max"))
        arrs[key] = arrs[key] * 2
        np.savez(cache, **arrs)
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        rc, text = _run(["calibrate", "-q", "--recipe", str(rec), "--output", str(work / "o2")], capsys, caplog)
    assert rc == 0
    assert "ignoring corrupt statistics cache" in text
    assert "Traceback" not in text
    with np.load(cache) as z:  # recomputed and rewritten whole
        assert "__sha256__" in z.files


def test_unusable_cache_folder_is_a_warning(work: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any,
                                            caplog: Any) -> None:
    (work / "afile").write_text("x")
    monkeypatch.setenv("QUANTKIT_CACHE", str(work / "afile" / "cache"))  # cannot be created
    from quantkit.frontends import cache as cache_mod

    monkeypatch.setattr(cache_mod, "_FALLBACK", [])
    with caplog.at_level(logging.WARNING, logger="quantkit"):
        rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work / "o")], capsys,
                        caplog)
    assert rc == 0 and "carrying on with a temporary cache" in text
    assert _files(work / "o") == OUTPUTS


# -- data ------------------------------------------------------------------------------------------
def test_all_nan_calibration_data_is_a_data_error_naming_the_input(work: Path, capsys: Any) -> None:
    _npz(work / "nan.npz", np.full((8, 3, 16, 16), np.nan))
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work, cal="nan.npz")), "--output",
                     str(work / "o")], capsys)
    assert rc == 2
    assert "calibration input 'input'" in text and "non-finite" in text and "3072" in text  # a batch of 4 x 3 x 16 x 16
    assert not (work / "o").exists()


def test_a_few_nan_values_are_refused_too(work: Path, capsys: Any) -> None:
    x = np.random.default_rng(0).uniform(-1, 1, (8, 3, 16, 16))
    x[5, 0, 0, 0] = np.inf
    _npz(work / "some.npz", x)
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work, cal="some.npz")), "--output",
                     str(work / "o")], capsys)
    assert rc == 2 and "1 non-finite value(s)" in text and "samples [1]" in text


def test_constant_data_warns_about_zero_range_tensors(work: Path, capsys: Any) -> None:
    _npz(work / "zero.npz", np.zeros((8, 3, 16, 16)))
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work, cal="zero.npz")), "--output",
                     str(work / "o")], capsys)
    assert rc == 0 and "zero range over the calibration data" in text and "input" in text


# -- the output folder -----------------------------------------------------------------------------
def test_output_that_is_a_file_or_unwritable_is_refused_before_any_work(work: Path, capsys: Any) -> None:
    (work / "taken").write_text("mine")
    t = time.perf_counter()
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work / "taken")], capsys)
    assert rc == 2 and "is a file" in text and time.perf_counter() - t < 5.0
    assert (work / "taken").read_text() == "mine"
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output",
                     str(work / "taken" / "sub")], capsys)
    assert rc == 2 and "not a writable folder" in text
    assert not (work / "cache" / "stats").exists()  # refused before calibrating


def test_foreign_folder_needs_overwrite_and_own_outputs_are_replaced_as_a_set(work: Path, capsys: Any) -> None:
    out = work / "o"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)
    assert rc == 2 and "quantkit did not write" in text and "--overwrite" in text
    assert _files(out) == {"notes.txt"}
    rc, _ = _run(["calibrate", "-q", "--overwrite", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)
    assert rc == 0 and _files(out) == OUTPUTS | {"notes.txt"}
    own = work / "own"
    assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(own)], capsys)[0] == 0
    rc, _ = _run(["calibrate", "-q", "--recipe", str(_recipe(work, formats=["json"])), "--output", str(own)], capsys)
    assert rc == 0
    assert _files(own) == {"model.onnx", "report.json", "quantkit-manifest.json"}  # stale report.html gone


def test_reports_get_the_mode_of_the_model(work: Path, capsys: Any) -> None:
    out = work / "o"
    assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)[0] == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert modes["report.json"] & 0o044  # readable by others, not mkstemp's 0600


# -- interrupts ------------------------------------------------------------------------------------
def test_sigterm_during_the_pipeline_is_handled_like_ctrl_c(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: Any) -> None:
    import quantkit.api

    def term(*a: Any, **k: Any) -> None:
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(quantkit.api, "quantize", term)
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work / "o")], capsys)
    assert rc == 130 and "terminated (SIGTERM); nothing was written" in text
    assert not (work / "o").exists()
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is restored


def test_interrupt_while_staging_leaves_nothing(work: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    def boom(*a: Any, **k: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx, "save_model", boom)
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work / "o")], capsys)
    assert rc == 130 and "nothing was written" in text
    assert not (work / "o").exists()
    assert not [p for p in work.iterdir() if p.name.startswith(".quantkit-")]


def test_interrupt_while_replacing_says_what_was_written(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: Any) -> None:
    out = work / "o"
    assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)[0] == 0
    import quantkit.report.output as output_mod

    real = output_mod._move
    calls = {"n": 0}

    def flaky(a: Any, b: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(output_mod, "_move", flaky)
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)
    assert rc == 130 and "1 of 4 files were already replaced" in text and "model.onnx" in text
    assert "nothing was written" not in text
    assert not [p for p in out.iterdir() if p.name.startswith(".quantkit-")]


# -- recipes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("patch", "expect"), [
    ({"calibration": {"calibrator": "percentile", "calibrator_options": {"percentil": 99.9}}},
     "unknown option(s) ['percentil'] for calibrator 'percentile'; allowed: ['percentile']"),
    ({"calibration": {"calibrator": "percentile", "calibrator_options": {"percentile": 20}}},
     "allowed: a number in (50, 100]"),
    ({"quantization": {"overrides": [{"layer": "conv0", "activations": {"dtype": "uint8", "symmetric": True}}]}},
     "quantization.overrides[0].activations: symmetric uint8 is not supported"),
    ({"quantization": {"default": {"format": "int4", "algorithm": "gptq", "algorithm_options": {"damp": 1}}}},
     "unknown option(s) ['damp'] for algorithm 'gptq'"),
    ({"target": {"isa": "avx9"}}, "target.isa"),
])
def test_recipe_errors_name_key_value_and_allowed(work: Path, patch: dict[str, Any], expect: str, capsys: Any) -> None:
    rec = yaml.safe_load(_recipe(work).read_text())
    for k, v in patch.items():
        rec[k] = {**rec.get(k, {}), **v}
    (work / "bad.yaml").write_text(yaml.safe_dump(rec))
    rc, text = _run(["validate", str(work / "bad.yaml")], capsys)
    assert rc == 2 and expect in text and "Traceback" not in text


def test_yaml_bombs_are_refused_at_once(work: Path, capsys: Any) -> None:
    laughs = 'version: 1\na: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(9))
    (work / "laughs.yaml").write_text(laughs)
    (work / "deep.yaml").write_text("version: 1\nx: " + "[" * 5000 + "]" * 5000 + "\n")
    for name, expect in (("laughs.yaml", "aliases"), ("deep.yaml", "nested more than")):
        t = time.perf_counter()
        rc, text = _run(["validate", str(work / name)], capsys)
        assert rc == 2 and expect in text and time.perf_counter() - t < 5.0


def test_custom_domain_op_is_a_model_error_naming_node_and_domain(work: Path, capsys: Any) -> None:
    g = helper.make_graph([helper.make_node("Frobnicate", ["input"], ["y"], name="frob", domain="acme.ops")], "g",
                          [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 16, 16])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme.ops", 1)]),
              work / "model.onnx")
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work / "o")], capsys)
    assert rc == 2 and "'frob'" in text and "'acme.ops'" in text and "Traceback" not in text


# -- the command line itself ------------------------------------------------------------------------
def test_validate_into_a_closed_pipe_exits_quietly(work: Path) -> None:
    rec = _recipe(work)
    proc = subprocess.run(f"{sys.executable} -m quantkit.cli validate {rec} | head -1", shell=True,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
                          executable="/bin/bash")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_repeated_main_calls_keep_one_log_handler(work: Path, capsys: Any) -> None:
    for _ in range(3):
        _run(["validate", str(_recipe(work))], capsys)
    own = [h for h in logging.getLogger("quantkit").handlers if getattr(h, "_quantkit_cli", False)]
    assert len(own) == 1


def test_internal_bug_prints_one_line_and_saves_the_traceback(work: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: Any) -> None:
    import quantkit.api

    def bug(*a: Any, **k: Any) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(quantkit.api, "quantize", bug)
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work / "o")], capsys)
    assert rc == 1 and "internal error (ZeroDivisionError" in text and "Traceback" not in text
    path = text.split("traceback is in ")[1].split()[0]
    assert "ZeroDivisionError" in Path(path).read_text()
    Path(path).unlink()


def test_a_generator_is_accepted_as_calibration_data(work: Path) -> None:
    from quantkit.api import quantize

    gen = (b for b in image_batches(4))
    res = quantize(str(work / "model.onnx"), gen, {"version": 1, "report": {"latency": {"enabled": False}}},
                   evaluate=False, progress=False)
    assert res.plan.layers and res.report["samples"]["calibration"] == 16


# -- fuzz: any recipe dict is a recipe or a RecipeError ------------------------------------------------
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True),
                  st.text(max_size=12), st.sampled_from(["int8", "uint8", "int4", "mse", "auto", "portable", "npz"]))
_keys = st.sampled_from(["version", "name", "model", "calibration", "quantization", "evaluation", "export",
                         "report", "search", "target", "data", "kind", "default", "overrides", "format", "weights",
                         "activations", "dtype", "symmetric", "calibrator", "calibrator_options", "isa", "layer",
                         "pattern", "op_type", "group_size", "algorithm", "algorithm_options", "candidates",
                         "percentile", "formats", "latency", "bogus"])
_tree = st.recursive(_leaf, lambda ch: st.one_of(st.lists(ch, max_size=4), st.dictionaries(_keys, ch, max_size=5)),
                     max_leaves=30)


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _tree, max_size=6), st.booleans())
def test_fuzzed_recipe_dicts_are_valid_or_a_recipe_error(d: dict[str, Any], versioned: bool) -> None:
    if versioned:
        d = {**d, "version": 1}
    try:
        load_recipe(d)
    except RecipeError:
        pass


# -- rows that already held before this suite (kept held) ---------------------------------------------
@pytest.mark.parametrize("content", [b"", b"\x08\x01garbage" * 7, "truncate"])
def test_broken_onnx_file_is_a_model_error(work: Path, content: Any, capsys: Any) -> None:
    good = (work / "model.onnx").read_bytes()
    (work / "model.onnx").write_bytes(good[: len(good) // 3] if content == "truncate" else content)
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work / "o")], capsys)
    assert rc == 2 and "model.onnx" in text and "Traceback" not in text
    assert not (work / "o").exists()


def test_missing_model_and_data_paths_are_named(work: Path, capsys: Any) -> None:
    rec = yaml.safe_load(_recipe(work).read_text())
    rec["model"]["source"] = str(work / "nope.onnx")
    (work / "r1.yaml").write_text(yaml.safe_dump(rec))
    rc, text = _run(["calibrate", "-q", "--recipe", str(work / "r1.yaml"), "--output", str(work / "o")], capsys)
    assert rc == 2 and "nope" in text
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work, cal="missing.npz")), "--output",
                     str(work / "o")], capsys)
    assert rc == 2 and "missing.npz" in text


def test_recipe_typos_and_python_tags_are_refused(work: Path, capsys: Any) -> None:
    rec = yaml.safe_load(_recipe(work).read_text())
    rec["calibration"]["calibratr"] = "mse"
    (work / "typo.yaml").write_text(yaml.safe_dump(rec))
    rc, text = _run(["validate", str(work / "typo.yaml")], capsys)
    assert rc == 2 and "calibratr" in text
    (work / "evil.yaml").write_text("version: 1\nname: !!python/object/apply:os.system ['echo pwned']\n")
    rc, text = _run(["validate", str(work / "evil.yaml")], capsys)
    assert rc == 2 and "pwned" not in capsys.readouterr().out


def test_wrong_npz_names_and_shapes_are_data_errors(work: Path, capsys: Any) -> None:
    # (one array under another name feeds a one-input model on purpose; two that match nothing cannot)
    np.savez(work / "badname.npz", pixels=np.zeros((4, 3, 16, 16), np.float32), labels=np.zeros(4, np.int64))
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work, cal="badname.npz")), "--output",
                     str(work / "o")], capsys)
    assert rc == 2 and "input" in text and "pixels" in text
    np.savez(work / "badshape.npz", input=np.zeros((4, 5, 16, 16), np.float32))
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work, cal="badshape.npz")), "--output",
                     str(work / "o")], capsys)
    assert rc == 2 and "Traceback" not in text


def test_two_runs_give_byte_identical_models(work: Path, capsys: Any) -> None:
    for out in ("a", "b"):
        assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work / out)], capsys)[0] == 0
    assert (work / "a" / "model.onnx").read_bytes() == (work / "b" / "model.onnx").read_bytes()


def test_algorithm_options_taken_through_kwargs_are_accepted_by_name() -> None:
    ok = {"version": 1, "quantization": {"default": {"format": "int4", "algorithm": "awq",
                                                     "algorithm_options": {"n_grid": 10}}}}
    assert load_recipe(ok).quantization.default.algorithm_options == {"n_grid": 10}
    bad = {"version": 1, "quantization": {"default": {"format": "int4", "algorithm": "awq",
                                                      "algorithm_options": {"ngrid": 10}}}}
    with pytest.raises(RecipeError, match=r"unknown option\(s\) \['ngrid'\] for algorithm 'awq'; allowed: .*n_grid"):
        load_recipe(bad)
