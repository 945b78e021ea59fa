"""The precision plan and the format-handler registry: one list of formats, frozen plans, module-path
overrides, and any mix of families executed by one pipeline."""

from __future__ import annotations

import typing

import onnx_ir as ir
import pytest

from quantkit.errors import RecipeError
from quantkit.formats import FORMAT_HANDLERS, all_formats, family_of, handler_for
from quantkit.lowering.select import layer_plan
from quantkit.ops import TORCH_NAME_SCOPES, module_path
from quantkit.recipe import load_recipe
from quantkit.recipe.plan import PrecisionPlan, with_candidate
from quantkit.recipe.schema import Candidate, CandidateFormat, Format


def test_every_recipe_format_has_exactly_one_handler() -> None:
    names = all_formats()
    assert len(names) == len(set(names))
    assert set(names) == set(typing.get_args(Format)) == set(typing.get_args(CandidateFormat))
    assert {family_of(f) for f in names} == {"static", "dynamic", "weight_only", "float"}
    assert list(FORMAT_HANDLERS)[0] == "static"  # Q/DQ placement runs on the float graph first
    with pytest.raises(RecipeError, match="allowed: int8"):
        handler_for("int3")


def _node(name: str, scopes: list[str] | None) -> ir.Node:
    n = ir.node("MatMul", [], name=name)
    if scopes is not None:
        n.metadata_props[TORCH_NAME_SCOPES] = repr(scopes)
    return n


def test_pattern_overrides_match_the_module_path_of_exported_nodes() -> None:
    node = _node("node_MatMul_119", ["", "model", "model.encoder.layer.0.intermediate.dense", "linear"])
    assert module_path(node) == "model.encoder.layer.0.intermediate.dense"
    assert module_path(_node("x", None)) is None
    rec = load_recipe({"version": 1, "quantization": {"overrides": [
        {"pattern": r"intermediate\.dense$", "format": "int4", "group_size": 32},
        {"op_type": "MatMul", "format": "int8_dynamic", "smoothquant": 0.5}]}})
    plan = PrecisionPlan.from_recipe(rec)
    lp = layer_plan(plan, node)
    assert (lp.format, lp.group_size, lp.rule) == ("int4", 32, r"pattern:intermediate\.dense$")
    other = layer_plan(plan, _node("node_MatMul_87", ["", "model.encoder.layer.0.attention.self.query", "linear"]))
    assert (other.format, other.smoothquant, other.rule) == ("int8_dynamic", 0.5, "op_type:MatMul")


def test_plans_are_frozen_values_and_the_search_decides_without_editing_the_recipe() -> None:
    rec = load_recipe({"version": 1, "quantization": {"default": {"format": "int8"}}})
    before = rec.model_dump()
    plan = PrecisionPlan.from_recipe(rec)
    base = plan.layer("fc", "Gemm")
    chosen = with_candidate(base, Candidate(name="w4", format="int4", group_size=64, algorithm="gptq"),
                            rec.quantization.default)
    p2 = plan.choose({"fc": chosen})
    assert p2.layer("fc", "Gemm").format == "int4" and p2.layer("fc", "Gemm").rule == "search:w4"
    assert p2.layer("fc", "Gemm").algorithm == "gptq" and p2.layer("fc", "Gemm").group_size == 64
    assert plan.layer("fc", "Gemm").format == "int8"  # the first plan is unchanged
    assert rec.model_dump() == before
    with pytest.raises(TypeError):
        p2.decided["fc"] = base  # type: ignore[index]


def test_override_fields_for_every_family_validate() -> None:
    with pytest.raises(RecipeError, match="smoothquant"):
        load_recipe({"version": 1, "quantization": {"overrides": [{"layer": "a", "smoothquant": 1.5}]}})
    with pytest.raises(RecipeError, match="granularity"):
        load_recipe({"version": 1, "quantization": {"overrides": [{"layer": "a", "granularity": "per_row"}]}})
    rec = load_recipe({"version": 1, "quantization": {"overrides": [
        {"layer": "a", "format": "fp16", "compute": "native"},
        {"layer": "b", "format": "int8_dynamic", "smoothquant": "off", "granularity": "per_tensor"}]}})
    plan = PrecisionPlan.from_recipe(rec)
    assert plan.layer("a", "MatMul").compute == "native"
    b = plan.layer("b", "MatMul")
    assert (b.smoothquant, b.granularity) == ("off", "per_tensor")


def _class_recipe(isa: str, **extra: object) -> dict[str, object]:
    return {
        "version": 1, "name": "by-class", "model": {"source": "m.onnx"}, "target": {"isa": isa},
        "quantization": {
            "default": {"format": "int4", "group_size": 128, "weights": {"symmetric": False}},
            "overrides": [{"layer": "lm_head", "format": "int4", "algorithm": "gptq"},
                          {"layer": "emb", "format": "int4", "group_size": 64}],
            "by_cpu_class": {"x86-avx2": {"group_size": 32, "weights": {"symmetric": True}}},
            **extra,
        },
    }


def test_by_cpu_class_replaces_the_default_grid_for_its_class_only() -> None:
    from quantkit.recipe.plan import applied_class, class_section

    avx2 = PrecisionPlan.from_recipe(load_recipe(_class_recipe("x86-avx2")))
    body, head, emb = (avx2.layer(n, "MatMul") for n in ("model.layers.0.mlp.down_proj", "lm_head", "emb"))
    assert (body.group_size, body.weight_symmetric) == (32, True)
    assert (head.group_size, head.weight_symmetric, head.algorithm) == (32, True, "gptq")  # inherits the default
    assert (emb.group_size, emb.weight_symmetric) == (64, True)  # an override's own group size still wins
    assert applied_class(avx2.recipe) == "x86-avx2"
    assert class_section(avx2.recipe) == {"cpu_class": "x86-avx2", "target_isa": "x86-avx2", "group_size": 32,
                                          "weights": {"dtype": "int8", "symmetric": True, "granularity": "channel"}}
    for isa in ("x86-vnni", "arm64", "portable"):
        other = PrecisionPlan.from_recipe(load_recipe(_class_recipe(isa)))
        lp = other.layer("model.layers.0.mlp.down_proj", "MatMul")
        assert (lp.group_size, lp.weight_symmetric) == (128, False)
        assert applied_class(other.recipe) is None and class_section(other.recipe) is None


def test_by_cpu_class_search_candidates_take_the_class_group_size() -> None:
    from quantkit.recipe.plan import class_default

    rec = load_recipe(_class_recipe("x86-avx2"))
    lp = PrecisionPlan.from_recipe(rec).layer("x", "MatMul")
    cand = Candidate(name="c", format="int4")
    assert with_candidate(lp, cand, class_default(rec)).group_size == 32
    assert class_default(load_recipe(_class_recipe("x86-vnni"))).group_size == 128


@pytest.mark.parametrize(("entry", "match"), [
    ({"x86-sse": {"group_size": 32}}, r"unknown CPU class \['x86-sse'\]; allowed: \['x86-vnni', 'x86-avx2', "),
    ({"x86-avx2": {"group_size": 48}}, "group_size 48 must be a power of two"),
    ({"x86-avx2": {"group_size": 8}}, "group_size"),
    ({"x86-avx2": {"algorithm": "gptq"}}, "algorithm"),
])
def test_by_cpu_class_bad_entries_are_refused_by_name(entry: dict[str, object], match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        load_recipe(_class_recipe("x86-avx2", by_cpu_class=entry))
