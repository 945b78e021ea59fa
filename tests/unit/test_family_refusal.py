"""An unsupported decoder family (or a config.json value the builder cannot honour) is refused by
``quantkit calibrate`` before anything heavy is imported, tokenized or calibrated (issue 23).

The timing target (< 1 s for the whole command) is measured by ``eval/bench_families.py --refusal``, not here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quantkit.cli import _refuse_unbuildable_decoder
from quantkit.errors import ModelError
from quantkit.frontends.families import read_config, supported_model_types

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "onnx", "onnx_ir", "onnxruntime", "transformers", "numpy")
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 128}  # fmt: skip


def _setup(tmp: Path, config: dict[str, object], layerwise: object = True, source: str = "model") -> Path:
    (tmp / "model").mkdir(parents=True, exist_ok=True)
    (tmp / "model" / "config.json").write_text(json.dumps(config))
    cal: dict[str, object] = {"data": {"kind": "npz", "path": "cal.npz"}}
    if layerwise is not None:
        cal["layerwise"] = layerwise
    recipe = {"version": 1, "name": "fam", "model": {"source": source}, "calibration": cal,
              "quantization": {"default": {"format": "int4", "group_size": 128, "algorithm": "rtn"}}}  # fmt: skip
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    return tmp / "r.yaml"


def _imported(importtime_stderr: str) -> set[str]:
    """Top-level package names of every module ``python -X importtime`` reported."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}  # fmt: skip


def test_cli_refuses_an_unknown_family_before_heavy_imports(tmp_path: Path) -> None:
    recipe = _setup(tmp_path, {"model_type": "diffllama", "architectures": ["DiffLlamaForCausalLM"], "n_layer": 2})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "quantkit.cli", "calibrate", "-q", "--recipe",
                        str(recipe), "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)  # fmt: skip
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("quantkit: error:")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(errors) == 1, r.stderr[-2000:]
    msg = errors[0]
    assert "model_type 'diffllama'" in msg and str(tmp_path / "model" / "config.json") in msg
    assert "supported model_types: " + ", ".join(supported_model_types()) in msg
    assert "Try instead: calibration.layerwise: false" in msg
    mods = _imported(r.stderr)
    assert "quantkit" in mods and "yaml" in mods  # the importtime report was read
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))
    assert not (tmp_path / "out").exists()


def test_the_early_message_is_the_builders(tmp_path: Path) -> None:
    from quantkit.frontends.llm_builder import read_decoder_config

    recipe = _setup(tmp_path, {**LLAMA, "model_type": "diffllama"})
    with pytest.raises(ModelError) as early:
        _refuse_unbuildable_decoder(argparse.Namespace(recipe=str(recipe), model=None))
    with pytest.raises(ModelError) as full:
        read_decoder_config(tmp_path / "model")
    assert str(early.value) == str(full.value)


@pytest.mark.parametrize("change, named", [
    ({"hidden_act": "relu6"}, "hidden_act 'relu6'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_scaling type 'mrope'"),
    ({"max_position_embeddings": 1 << 30}, "max_position_embeddings"),
])  # fmt: skip
def test_a_bad_value_of_a_supported_family_is_refused_early(tmp_path: Path, change: dict[str, object],
                                                            named: str) -> None:
    recipe = _setup(tmp_path, {**LLAMA, **change})
    with pytest.raises(ModelError, match="config.json") as exc:
        _refuse_unbuildable_decoder(argparse.Namespace(recipe=str(recipe), model=None))
    assert named in str(exc.value)


def test_left_to_the_full_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bloom = {"model_type": "diffllama"}
    ns = argparse.Namespace
    # layerwise auto (or absent) or false: an unsupported family takes the whole-graph path, no refusal
    for lw in ("auto", False, None, "true"):
        recipe = _setup(tmp_path / str(lw), bloom, layerwise=lw)
        assert _refuse_unbuildable_decoder(ns(recipe=str(recipe), model=None)) is None
    # a supported config, a built-in name, a recipe that is no YAML mapping, a missing recipe: nothing to refuse here
    assert _refuse_unbuildable_decoder(ns(recipe=str(_setup(tmp_path / "ok", LLAMA)), model=None)) is None
    recipe = _setup(tmp_path / "builtin", bloom, source="smollm2-135m")
    assert _refuse_unbuildable_decoder(ns(recipe=str(recipe), model=None)) is None
    (tmp_path / "bad.yaml").write_text("[1, 2")
    assert _refuse_unbuildable_decoder(ns(recipe=str(tmp_path / "bad.yaml"), model=None)) is None
    assert _refuse_unbuildable_decoder(ns(recipe=str(tmp_path / "none.yaml"), model=None)) is None
    # --model overrides the source, relative to the working directory
    recipe = _setup(tmp_path / "over", LLAMA)
    _setup(tmp_path / "cwd", bloom)
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(ModelError, match="model_type 'diffllama'"):
        _refuse_unbuildable_decoder(ns(recipe=str(recipe), model="model"))


def test_read_config_names_an_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="cannot read"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert read_config(tmp_path).family == "llama"
