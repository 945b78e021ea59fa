"""The Python API (torch module, iterables, save) and the CLI on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import quantkit
from quantkit.cli import main
from tests.conftest import image_batches, tiny_cnn

NO_LATENCY = {"version": 1, "name": "t", "report": {"latency": {"enabled": False}}}


def test_public_api_is_frozen() -> None:
    assert sorted(quantkit.__all__) == sorted([
        "CalibrationError", "DataError", "LoweringError", "ModelError", "QuantizeResult", "QuantkitError",
        "RecipeError", "RecipeModel", "UnknownNameError", "UnsupportedOpError", "__version__", "load_recipe",
        "quantize", "sweep", "SweepResult",
    ])
    for name in quantkit.__all__:
        assert getattr(quantkit, name) is not None


def test_torch_module_with_iterable_of_arrays(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.relu6(self.bn(self.conv(x)))
            return self.fc(torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))

    torch.manual_seed(0)
    net = Net().eval()
    rng = np.random.default_rng(0)
    samples = [rng.standard_normal((1, 3, 12, 12)).astype(np.float32) for _ in range(8)]
    res = quantkit.quantize(net, samples, NO_LATENCY, example_inputs=torch.randn(2, 3, 12, 12),
                            evaluation_data=samples[:4], progress=False)
    assert res.census.quantized_kernels.get("QLinearConv") == 1
    assert res.report["fidelity"]
    paths = res.save(tmp_path / "out")
    assert (tmp_path / "out" / "model.onnx").is_file() and paths["report.json"].is_file()
    onnx.checker.check_model(str(tmp_path / "out" / "model.onnx"))
    # nothing half-written or temporary left behind
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model.onnx", "quantkit-manifest.json", "report.json", "report.md"]


def test_save_is_atomic_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res = quantkit.quantize(tiny_cnn(), image_batches(2), NO_LATENCY, evaluate=False, progress=False)
    out = tmp_path / "o"
    res.save(out)
    before = (out / "model.onnx").read_bytes()

    def boom(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx, "save_model", boom)
    with pytest.raises(KeyboardInterrupt):
        res.save(out)
    assert (out / "model.onnx").read_bytes() == before  # the old file is intact
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp leftovers


def _write_recipe(tmp_path: Path) -> Path:
    model = tmp_path / "cnn.onnx"
    onnx.save(tiny_cnn(), model)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", input=rng.uniform(-1, 1, (8, 3, 16, 16)).astype(np.float32))
    np.savez(tmp_path / "ev.npz", input=rng.uniform(-1, 1, (4, 3, 16, 16)).astype(np.float32))
    rec = tmp_path / "r.yaml"
    rec.write_text(
        "version: 1\nname: cli\nmodel: {source: cnn.onnx}\n"
        "calibration: {data: {kind: npz, path: cal.npz}, batch_size: 4}\n"
        "evaluation: {data: {kind: npz, path: ev.npz}}\n"
        "report: {formats: [json, md, html], latency: {warmup: 1, repeat: 3, guard: false}}\n"
    )
    return rec


def test_cli_calibrate_writes_model_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = _write_recipe(tmp_path)
    out = tmp_path / "out"
    assert main(["calibrate", "--recipe", str(rec), "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    for f in ("model.onnx", "report.json", "report.md", "report.html"):
        assert (out / f).is_file()
        assert str(out / f) in printed
    rep = json.loads((out / "report.json").read_text())
    assert rep["latency"]["speedup"] > 0 and rep["size"]["quantized_bytes"] > 0  # tiny model: overhead dominates size
    assert {r["layer"] for r in rep["layers"]} >= {"conv0", "dwconv", "project", "fc"}
    md = (out / "report.md").read_text()
    assert "## Static INT8 layers" in md and "QLinearConv" in md


def test_cli_model_override_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = _write_recipe(tmp_path)
    rc = main(["calibrate", "--recipe", str(rec), "--output", str(tmp_path / "o"), "--model",
               str(tmp_path / "missing.onnx"), "--quiet", "--no-latency"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "missing.onnx" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ncalibration: {batch_size: -1}\n")
    assert main(["calibrate", "--recipe", str(bad)]) == 2
    assert "calibration.batch_size" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing written on failure


def test_verbose_turns_on_debug_messages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from quantkit.cli import main

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    rc = main(["calibrate", "-v", "--recipe", str(tmp_path / "missing.yaml")])
    assert rc == 2 and logging.getLogger("quantkit").level == logging.DEBUG
    main(["calibrate", "--recipe", str(tmp_path / "missing.yaml")])
    assert logging.getLogger("quantkit").level == logging.INFO


def test_cli_data_overrides_keep_the_recipe_options_that_still_apply(tmp_path: Path) -> None:
    """--calibration-data / --evaluation-data used to replace the whole data spec: a photo recipe lost its
    preprocessing, and a .txt for a text recipe became an image folder."""
    from quantkit.cli import data_override

    photos = {"kind": "sample_photos", "count": 200, "preprocess": "imagenet", "seed": 3}
    (tmp_path / "imgs").mkdir()
    assert data_override(photos, str(tmp_path / "imgs")) == {
        "kind": "images", "path": str(tmp_path / "imgs"), "preprocess": "imagenet", "seed": 3, "limit": 200}
    text = {"kind": "text", "source": "pydoc", "mode": "windows", "seq_len": 512, "count": 16}
    assert data_override(text, "notes.txt") == {"kind": "text", "source": "notes.txt", "mode": "windows",
                                                "seq_len": 512, "count": 16}
    assert data_override(text, "austen:emma")["source"] == "austen:emma"
    assert data_override(text, "calib.npz") == {"kind": "npz", "path": "calib.npz"}
    assert data_override({}, "book.md") == {"kind": "text", "source": "book.md"}
    (tmp_path / "arrays").mkdir()
    np.savez(tmp_path / "arrays" / "a.npz", x=np.zeros((1, 2), np.float32))
    assert data_override({"kind": "npz", "path": "old"}, str(tmp_path / "arrays"))["kind"] == "npz"
    assert data_override({"kind": "images", "path": "old", "limit": 5}, "new/")["limit"] == 5
    # recordings: a folder holding .wav files (or one file) is audio data, keeping an audio recipe's windows
    (tmp_path / "rec" / "day1").mkdir(parents=True)
    (tmp_path / "rec" / "day1" / "a.wav").write_bytes(b"")
    audio = {"kind": "audio", "path": "old", "seconds": 2.0, "hop": 0.5}
    assert data_override(audio, str(tmp_path / "rec")) == {"kind": "audio", "path": str(tmp_path / "rec"),
                                                           "seconds": 2.0, "hop": 0.5}
    assert data_override(photos, "clip.wav") == {"kind": "audio", "path": "clip.wav"}


def test_python_dash_m_quantkit_is_the_command_line() -> None:
    import subprocess
    import sys

    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "quantkit", "calibrate", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "--recipe" in proc.stdout, proc.stderr


def test_validate_takes_the_recipe_either_way(capsys: pytest.CaptureFixture[str]) -> None:
    rec = str(Path(__file__).resolve().parents[2] / "recipes" / "llama-int4.yaml")
    assert main(["validate", rec]) == 0 and '"name": "llama-int4"' in capsys.readouterr().out
    assert main(["validate", "--recipe", rec]) == 0 and '"name": "llama-int4"' in capsys.readouterr().out
    assert main(["validate"]) == 2 and "validate takes one recipe" in capsys.readouterr().err
