"""Recipe values are checked when the recipe loads, not when (or after) the work runs: weight-algorithm option
values and types, a key written twice, numbers and switches written as something else."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit.errors import RecipeError
from quantkit.recipe import load_recipe


def _algo(algorithm: str, **options: object) -> dict:
    return {"version": 1, "quantization": {"default": {"format": "int4", "algorithm": algorithm,
                                                       "algorithm_options": options}}}


@pytest.mark.parametrize(("algorithm", "options", "allowed"), [
    ("gptq", {"percdamp": -1}, r"percdamp is -1 .*allowed: a number in \[0.0, 1.0\]"),
    ("gptq", {"act_order": "no"}, r"act_order is 'no' .*allowed: true or false"),
    ("signround", {"iters": "50"}, r"iters is '50' .*allowed: an integer from 0 to 100000"),
    ("signround", {"init": "awq"}, r"init is 'awq' .*allowed: gptq, rtn"),
    ("signround", {"lr": 0}, r"lr is 0 .*allowed: a number in \(0.0, 1000.0\] or null"),
    ("awq", {"max_shrink": 1.0}, r"max_shrink is 1.0 .*allowed: a number in \[0.0, 1.0\)"),
    ("signround", {"hessian": [[1.0]]}, r"unknown option\(s\) \['hessian'\]"),
])
def test_bad_algorithm_option_values_are_refused_at_load(algorithm: str, options: dict, allowed: str) -> None:
    with pytest.raises(RecipeError, match=allowed):
        load_recipe(_algo(algorithm, **options))


def test_good_algorithm_options_and_search_candidates_are_checked_alike() -> None:
    load_recipe(_algo("gptq", percdamp=0.05, act_order=False, block_size=64))
    load_recipe(_algo("signround", iters=10, lr=None, init="gptq", min_clip=1))
    cand = {"name": "g", "format": "int4", "algorithm": "gptq", "algorithm_options": {"percdam": 0.1}}
    with pytest.raises(RecipeError, match=r"search.candidates\[0\].algorithm_options: unknown option\(s\) "
                                          r"\['percdam'\] for algorithm 'gptq'"):
        load_recipe({"version": 1, "search": {"candidates": [cand, "fp32"], "target": {"size": 0.3}}})


def test_a_key_written_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    rec = tmp_path / "r.yaml"
    rec.write_text("version: 1\nquantization:\n  default:\n    format: int4\n    format: int8\n")
    with pytest.raises(RecipeError, match=r"key 'format' appears twice in one mapping \(lines 4 and 5\)"):
        load_recipe(rec)
    ok = tmp_path / "ok.yaml"  # merge keys and the same key in two mappings are fine
    ok.write_text("version: 1\nname: a\ncalibration: &c {batch_size: 4}\nevaluation: {<<: *c, batch_size: 2}\n")
    assert load_recipe(ok).evaluation.batch_size == 2


@pytest.mark.parametrize(("section", "message"), [
    ({"calibration": {"batch_size": True}}, r"calibration.batch_size: Value error, True \(bool\) is not accepted; "
                                            r"allowed: an integer"),
    ({"calibration": {"batch_size": "8"}}, r"calibration.batch_size: Value error, '8' \(str\) is not accepted"),
    ({"calibration": {"layerwise": "yes"}}, r"calibration.layerwise: Value error, 'yes' \(str\) is not accepted; "
                                            r"allowed: true / false or 'auto'"),
    ({"calibration": {"layerwise": 1}}, r"calibration.layerwise: Value error, 1 \(int\) is not accepted"),
    ({"report": {"latency": {"enabled": "false"}}}, r"report.latency.enabled: Value error, 'false' \(str\) is not "
                                                    r"accepted; allowed: true / false"),
])
def test_numbers_and_switches_are_not_coerced(section: dict, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe({"version": 1, **section})


def test_what_the_schema_accepts_stays_accepted() -> None:
    rec = load_recipe({"version": 1, "calibration": {"layerwise": "auto", "batch_size": 4},
                       "quantization": {"default": {"smoothquant": 0.5}}, "report": {"latency": {"repeat": 3}}})
    assert rec.calibration.batch_size == 4 and rec.report.latency.repeat == 3


@pytest.mark.parametrize(("op", "near"), [("conv", "Conv"), ("Matmul", "MatMul"), ("MatMull", "MatMul")])
def test_an_op_type_in_the_wrong_case_or_misspelt_is_refused_naming_the_operator(op: str, near: str) -> None:
    with pytest.raises(RecipeError, match=f"op_type '{op}' is not an ONNX operator; did you mean '{near}'"):
        load_recipe({"version": 1, "quantization": {"overrides": [{"op_type": op, "format": "fp32"}]}})


def test_an_op_type_of_another_domain_is_left_to_the_model() -> None:
    for op in ("Gemm", "MatMulNBits", "MyDomainOp"):
        load_recipe({"version": 1, "quantization": {"overrides": [{"op_type": op, "format": "fp32"}]}})
