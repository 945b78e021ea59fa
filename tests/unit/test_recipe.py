"""Recipe loading, validation errors and per-layer override resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit.errors import RecipeError
from quantkit.recipe import load_recipe, resolve_layer

ROOT = Path(__file__).resolve().parents[2]


def _base(**over: object) -> dict:
    rec: dict = {
        "version": 1,
        "name": "t",
        "model": {"source": "m.onnx"},
        "calibration": {"data": {"kind": "npz", "path": "x.npz"}},
    }
    rec.update(over)
    return rec


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(path: Path) -> None:
    rec = load_recipe(path)
    assert rec.version == 1


def test_defaults() -> None:
    rec = load_recipe(_base())
    d = rec.quantization.default
    assert (d.format, d.weights.dtype, d.weights.symmetric, d.weights.granularity) == ("int8", "int8", True, "channel")
    assert (d.activations.dtype, d.activations.symmetric) == ("uint8", False)


def test_unknown_key_names_key_and_allowed() -> None:
    with pytest.raises(RecipeError) as ei:
        load_recipe(_base(quantization={"defualt": {}}))
    msg = str(ei.value)
    assert "quantization.defualt" in msg and "unknown key" in msg and "default" in msg


def test_wrong_type_names_value() -> None:
    with pytest.raises(RecipeError) as ei:
        load_recipe(_base(quantization={"default": {"weights": {"dtype": "int3"}}}))
    msg = str(ei.value)
    assert "quantization.default.weights.dtype" in msg and "'int3'" in msg and "int8" in msg


def test_missing_version_and_bad_version() -> None:
    rec = _base()
    del rec["version"]
    with pytest.raises(RecipeError, match="missing key 'version'"):
        load_recipe(rec)
    with pytest.raises(RecipeError, match="version 7 is not supported; allowed: 1"):
        load_recipe(_base(version=7))


def test_impossible_combination_symmetric_uint8() -> None:
    with pytest.raises(RecipeError, match="symmetric uint8"):
        load_recipe(_base(quantization={"default": {"activations": {"dtype": "uint8", "symmetric": True}}}))


def test_unknown_calibrator_lists_known() -> None:
    with pytest.raises(RecipeError) as ei:
        load_recipe(_base(calibration={"data": {"kind": "npz", "path": "x"}, "calibrator": "magic"}))
    assert "'magic'" in str(ei.value) and "minmax" in str(ei.value)


def test_override_needs_exactly_one_selector_and_valid_regex() -> None:
    with pytest.raises(RecipeError, match="exactly one of"):
        load_recipe(_base(quantization={"overrides": [{"format": "fp32"}]}))
    with pytest.raises(RecipeError, match="not a valid regular expression"):
        load_recipe(_base(quantization={"overrides": [{"pattern": "(", "format": "fp32"}]}))


def test_unknown_op_type_in_op_types() -> None:
    with pytest.raises(RecipeError, match="unsupported op types"):
        load_recipe(_base(quantization={"op_types": ["Conv", "LSTM"]}))


def test_yaml_file_errors(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodel: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    evil = tmp_path / "evil.yaml"
    evil.write_text("!!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(RecipeError):  # safe_load refuses python tags
        load_recipe(evil)


def test_override_resolution_order() -> None:
    rec = load_recipe(
        _base(
            quantization={
                "overrides": [
                    {"op_type": "Conv", "format": "fp32"},
                    {"pattern": "^block1/", "weights": {"dtype": "int8", "symmetric": False}},
                    {"layer": "block1/conv", "activations": {"dtype": "int8", "symmetric": True}},
                ]
            }
        )
    )
    exact = resolve_layer(rec, "block1/conv", "Conv")
    assert exact.rule == "layer:block1/conv" and exact.act_dtype == "int8" and exact.format == "int8"
    regex = resolve_layer(rec, "block1/other", "Conv")
    assert regex.rule == "pattern:^block1/" and not regex.weight_symmetric and regex.format == "int8"
    by_op = resolve_layer(rec, "block2/conv", "Conv")
    assert by_op.rule == "op_type:Conv" and by_op.format == "fp32"
    default = resolve_layer(rec, "block2/mm", "MatMul")
    assert default.rule == "default" and default.format == "int8" and default.calibrator == "auto"


def test_relative_paths_resolve_against_recipe_folder(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"")
    (tmp_path / "r.yaml").write_text(
        "version: 1\nmodel: {source: m.onnx}\ncalibration: {data: {kind: npz, path: m.onnx}}\n"
    )
    rec = load_recipe(tmp_path / "r.yaml")
    assert rec.model.source == str(tmp_path / "m.onnx")


def test_weight_only_override_options_do_not_leak_across_algorithms() -> None:
    rec = load_recipe(_base(quantization={
        "default": {"format": "int4", "algorithm": "gptq", "algorithm_options": {"act_order": True}},
        "overrides": [{"layer": "lm_head", "format": "int8_weight", "algorithm": "rtn"},
                      {"layer": "x", "algorithm": "rtn", "algorithm_options": {}},
                      {"layer": "y", "group_size": 32}]}))
    assert resolve_layer(rec, "lm_head", "MatMul").algorithm_options == ()
    assert resolve_layer(rec, "x", "MatMul").algorithm_options == ()
    y = resolve_layer(rec, "y", "MatMul")
    assert y.algorithm == "gptq" and dict(y.algorithm_options) == {"act_order": True} and y.group_size == 32
    with pytest.raises(RecipeError, match="unknown weight algorithm 'hqq'"):
        load_recipe(_base(quantization={"default": {"format": "int4", "algorithm": "hqq"}}))
    with pytest.raises(RecipeError, match="power of two"):
        load_recipe(_base(quantization={"default": {"format": "int4", "group_size": 96}}))


def test_unquoted_yaml_off_means_no_smoothing_not_alpha_zero() -> None:
    import yaml

    from quantkit.errors import RecipeError
    from quantkit.recipe import load_recipe

    rec = load_recipe(yaml.safe_load("version: 1\nquantization: {default: {format: int8_dynamic, smoothquant: off}}"))
    assert rec.quantization.default.smoothquant == "off"
    with pytest.raises(RecipeError, match="smoothquant: true is ambiguous"):
        load_recipe(yaml.safe_load("version: 1\nquantization: {default: {format: int8_dynamic, smoothquant: yes}}"))
