"""The fidelity guard's decisions (quantkit.fidelity_guard), driven by fake runs: when it tries the verdict's layers,
when a candidate ships, and when it stops.  The end-to-end path on a real graph is in test_verdict.py."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

import quantkit.guard
from quantkit.fidelity_guard import MIN_GAIN_DB, apply_fidelity_guard, worst_sqnr_db
from quantkit.recipe import load_recipe

LAYERS = [f"conv{i}" for i in range(5)]


def _result(sqnr: float, float_layers: tuple[str, ...] = (), suggest: tuple[str, ...] = ("conv0",),
            guard: bool = True, top1: float | None = None, zero_range: tuple[str, ...] = ()) -> Any:
    rec = load_recipe({"version": 1, "name": "unit", "evaluation": {"fidelity_guard": guard}})
    out: dict[str, Any] = {"sqnr_db": sqnr}
    if top1 is not None:
        out["top1_agreement"] = top1
    rows = [{"kind": "layer", "layer": n, "in_db": 48.0, "out_db": sqnr, "growth_db": 10.0} for n in suggest]
    formats = {n: "int8" for n in LAYERS if n not in float_layers}
    lowered = SimpleNamespace(formats=lambda: formats, zero_range=list(zero_range))
    return SimpleNamespace(recipe=rec, precision=object(), lowered=lowered,
                           report={"fidelity": {"y": out}, "error_growth": {"sqnr": rows}, "latency": {}})


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The plans the guard re-runs (as their float layer lists): ``_float_plan`` returns the list itself."""
    monkeypatch.setattr(quantkit.guard, "_float_plan", lambda result, layers, rule=None: list(layers))
    return []


def _rerun(runs: list[list[str]], outcome: dict[tuple[str, ...], tuple[float, tuple[str, ...]]]) -> Any:
    def rerun(plan: list[str]) -> Any:
        runs.append(plan)
        sqnr, suggest = outcome[tuple(plan)]
        return _result(sqnr, tuple(plan), suggest)
    return rerun


def test_a_candidate_that_gains_the_margin_ships(runs: list[list[str]]) -> None:
    first = _result(4.0, suggest=("conv0", "conv1"))
    shipped = apply_fidelity_guard(first, _rerun(runs, {("conv0", "conv1"): (28.0, ())}))
    assert runs == [["conv0", "conv1"]] and shipped is not first
    rec = shipped.report["fidelity_guard"]
    assert rec["float_layers"] == ["conv0", "conv1"] and rec["candidates"][0]["gain_db"] == pytest.approx(24.0)
    assert rec["decision"].startswith("shipped with 2 layer(s) in float")


def test_a_small_gain_keeps_the_plan(runs: list[list[str]]) -> None:
    first = _result(10.0)
    shipped = apply_fidelity_guard(first, _rerun(runs, {("conv0",): (10.0 + MIN_GAIN_DB - 0.5, ("conv1",))}))
    assert shipped is first and runs == [["conv0"]]
    rec = first.report["fidelity_guard"]
    assert rec["float_layers"] == [] and not rec["candidates"][0]["shipped"] and rec["decision"].startswith("kept")


def test_a_second_round_follows_the_candidates_own_verdict(runs: list[list[str]]) -> None:
    first = _result(3.0)
    outcome = {("conv0",): (12.0, ("conv1",)), ("conv0", "conv1"): (30.0, ())}
    shipped = apply_fidelity_guard(first, _rerun(runs, outcome))
    assert runs == [["conv0"], ["conv0", "conv1"]]
    assert shipped.report["fidelity_guard"]["float_layers"] == ["conv0", "conv1"]


def test_no_more_than_half_of_the_layers_go_back_to_float(runs: list[list[str]]) -> None:
    first = _result(3.0, suggest=tuple(LAYERS[:3]))
    shipped = apply_fidelity_guard(first, _rerun(runs, {}))
    assert shipped is first and runs == []
    assert "3 of 5 quantized layers" in first.report["fidelity_guard"]["stopped"]


@pytest.mark.parametrize("first", [_result(25.0), _result(3.0, guard=False), _result(3.0, suggest=())])
def test_nothing_to_decide(runs: list[list[str]], first: Any) -> None:
    """Above the floor, the guard off, or no layer named by the verdict: no re-run; no record unless it was asked."""
    assert apply_fidelity_guard(first, _rerun(runs, {})) is first and runs == []
    if first.recipe.evaluation.fidelity_guard and first.report["fidelity"]["y"]["sqnr_db"] < 20:
        assert first.report["fidelity_guard"]["decision"].startswith("kept the plan: the verdict names no")


def test_a_low_top1_agreement_alone_does_not_trigger_it(runs: list[list[str]]) -> None:
    """Top-1 agreement on a few dozen samples moves with one sample: the verdict warns, the guard waits for the SQNR."""
    first = _result(24.0, top1=0.5)
    assert apply_fidelity_guard(first, _rerun(runs, {})) is first and runs == []
    assert "fidelity_guard" not in first.report


def test_worst_sqnr_ignores_missing_figures() -> None:
    assert worst_sqnr_db({"a": {"sqnr_db": 12.0}, "b": {"sqnr_db": math.nan}, "c": {}}) == 12.0
    assert worst_sqnr_db({}) == math.inf


def test_constant_calibration_data_is_not_hidden_by_floating_layers(runs: list[list[str]]) -> None:
    """An activation with zero range over the calibration data: the data is broken; floating the layer that reads
    it would hide the tensor from the zero-range warning."""
    first = _result(3.0, zero_range=("input",))
    assert apply_fidelity_guard(first, _rerun(runs, {})) is first and runs == []
    assert "zero range over the calibration data (input)" in first.report["fidelity_guard"]["decision"]
