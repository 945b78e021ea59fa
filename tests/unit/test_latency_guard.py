"""The latency guard (on by default): layer regions whose int8 kernels are slower than float in every profile round
are tried in float, and the guarded model ships only when an interleaved A/B finds it faster by a sign test and a
margin; the decision is cached per int8 model and machine (quantkit.guard)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import pytest

import quantkit
from quantkit.guard import AB_MIN_WINS, AB_ROUNDS, TOTAL, ab_verdict, layer_regions, slow_regions
from quantkit.prep import prepare
from tests.conftest import image_batches, tiny_cnn

RECIPE = {"version": 1, "name": "guard",
          "report": {"latency": {"warmup": 1, "repeat": 3}, "kernel_check_samples": 2}}

pytestmark = pytest.mark.latency_guard


def _fake_profile(monkeypatch: pytest.MonkeyPatch, slow: dict[str, tuple[float, float]] | None) -> list[int]:
    """Every region takes 1 ms in float and 0.5 ms in int8, except ``slow`` (fp32 ms, int8 ms); returns the call
    counter."""
    import quantkit.guard as guard

    calls: list[int] = []

    def fake(float_bytes: bytes, quant_bytes: bytes, float_model: Any, layers: list[str], feed: Any, **kw: Any
             ) -> dict[str, list[tuple[float, float]]]:
        calls.append(1)
        return {**{n: [(slow or {}).get(n, (1.0, 0.5))] * 3 for n in layers}, TOTAL: [(1.0, 1.0)] * 3}

    monkeypatch.setattr(guard, "region_times", fake)
    return calls


def _fake_ab(monkeypatch: pytest.MonkeyPatch, guarded_ratio: float) -> None:
    import quantkit.guard as guard

    def fake(blobs: dict[str, bytes], feed: Any, **kw: Any) -> dict[str, list[float]]:
        times = {"fp32": 2.0, "int8": 1.0}
        return {k: [times.get(k, guarded_ratio)] * AB_ROUNDS for k in blobs}

    monkeypatch.setattr(guard, "ab_compare", fake)


def test_regions_take_the_activation_and_the_chain_entry_with_the_layer() -> None:
    model = prepare(ir.from_proto(tiny_cnn())).model
    int8 = ["conv0", "dwconv", "project", "residual", "pool", "flatten", "fc"]
    regions = layer_regions(model, ["conv0", "dwconv", "project", "fc"], int8)
    # the stem: its input's QuantizeLinear (a graph input) and its Clip; the depthwise conv: its Clip
    assert regions["conv0"] == ["conv0", "input_QuantizeLinear", "act0"]
    assert regions["dwconv"] == ["dwconv", "act1"]
    # the residual Add reads two regions (project and conv0's act0): nobody's; the pool, flatten go with nobody
    assert regions["project"] == ["project"]
    assert regions["fc"] == ["fc"]
    # with the pool and flatten in float, the classifier's int8 chain starts at its input
    assert layer_regions(model, ["fc"])["fc"] == ["fc", "f_QuantizeLinear"]


def test_a_region_is_slow_only_when_it_is_slower_in_every_round() -> None:
    times = {"a": [(1.0, 1.2), (1.0, 1.1), (1.0, 1.3)], "b": [(1.0, 1.5), (1.0, 0.9), (1.0, 1.4)],
             "c": [(1.0, 0.5)] * 3}
    assert slow_regions(times) == {"a": (1.0, 1.2)}


def test_ab_verdict_needs_wins_and_margin() -> None:
    i8 = [1.0] * AB_ROUNDS
    assert ab_verdict(i8, [0.9] * AB_ROUNDS)[0]
    assert not ab_verdict(i8, [0.99] * AB_ROUNDS)[0]  # faster in every round, but within the margin
    few = [0.9] * (AB_MIN_WINS - 1) + [1.1] * (AB_ROUNDS - AB_MIN_WINS + 1)
    assert not ab_verdict(i8, few)[0]  # too few wins: a tie keeps the all-int8 model


def test_slower_regions_ship_in_float_when_the_ab_finds_it_faster_and_the_decision_is_cached(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    calls = _fake_profile(monkeypatch, {"conv0": (0.1, 0.2)})
    _fake_ab(monkeypatch, 0.8)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, evaluation_data=image_batches(2, seed=1),
                            progress=False)
    g = res.report["latency_guard"]
    assert g["decision"].startswith("shipped with 1 layer(s) in float") and g["slower_int8_layers"]["conv0"]
    # the stem starts the int8 chain (its region holds the input's QuantizeLinear): one candidate, which won
    assert g["candidates"] == {"chain_entry": {"float_layers": ["conv0"], "stranded": [],
                                               "excess_ms": pytest.approx(0.1)}}
    assert g["float_layers"] == ["conv0"] and g["ab"]["chain_entry"]["wins"] == AB_ROUNDS
    assert "conv0" not in res.plan.layers and "dwconv" in res.plan.layers
    assert res.census.quantized_kernels.get("QLinearConv") == 2  # conv0 runs as a float Conv now
    assert len(calls) == 1
    # FP32 was not in the A/B: the speedup is the run's measured all-int8 speedup over the A/B ratio
    assert "fp32" not in g["ab"]["rounds_ms"] and g["ab"]["fp32_ms"] is None
    assert g["ab"]["chain_entry"]["speedup"] == pytest.approx(g["first_speedup"] / 0.8)
    # the same int8 model on the same machine: the cached decision ships without profiling again
    res2 = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, evaluation_data=image_batches(2, seed=1),
                             progress=False)
    assert len(calls) == 1 and res2.report["latency_guard"].get("cached")
    assert "conv0" not in res2.plan.layers
    # use_cache=False measures afresh
    quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False, use_cache=False)
    assert len(calls) == 2


def test_candidates_are_the_chain_entries_first_then_every_slower_region(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    _fake_profile(monkeypatch, {"conv0": (0.1, 0.2), "dwconv": (0.1, 0.2)})
    timed: list[list[str]] = []

    def fake(blobs: dict[str, bytes], feed: Any, **kw: Any) -> dict[str, list[float]]:
        timed.append(sorted(blobs))
        # within the margin: a tie ("shipped": the model the guard ships, timed against FP32 when the run measured
        # it slower than FP32 - the tiny model may be)
        times = {"fp32": 2.0, "int8": 1.0, "chain_entry": 0.9, "all_slower": 0.89, "shipped": 0.9}
        return {k: [times[k]] * AB_ROUNDS for k in blobs}

    monkeypatch.setattr(guard, "ab_compare", fake)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False)
    g = res.report["latency_guard"]
    # one A/B for both candidates; FP32 is not timed in it (the run measured its latency)
    assert timed[0] == ["all_slower", "chain_entry", "int8"] and timed[1:] in ([], [["fp32", "shipped"]])
    assert g["candidates"]["chain_entry"]["float_layers"] == ["conv0"]
    assert g["candidates"]["all_slower"]["float_layers"] == ["conv0", "dwconv"]
    assert g["float_layers"] == ["conv0"] and "dwconv" in res.plan.layers  # ties go to fewer float layers
    assert g["ab"]["all_slower"]["vs_chain_entry"]["faster"] is False


def test_a_larger_candidate_that_removes_less_than_the_margin_more_is_not_timed(monkeypatch: pytest.MonkeyPatch,
                                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    # the stem saves 0.1 ms of the int8 model's 1 ms; the depthwise conv only 0.01 ms more (under the 2% margin):
    # every slower region in float could replace the stem alone only by beating it by the margin - not timed
    _fake_profile(monkeypatch, {"conv0": (0.1, 0.2), "dwconv": (0.1, 0.11)})
    timed: list[list[str]] = []

    def fake(blobs: dict[str, bytes], feed: Any, **kw: Any) -> dict[str, list[float]]:
        timed.append(sorted(blobs))
        return {k: [{"int8": 1.0}.get(k, 0.9)] * AB_ROUNDS for k in blobs}

    monkeypatch.setattr(guard, "ab_compare", fake)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False)
    g = res.report["latency_guard"]
    assert timed[0] == ["chain_entry", "int8"] and timed[1:] in ([], [["fp32", "shipped"]])
    assert list(g["candidates"]) == ["chain_entry"]
    assert "0.010 ms more than the smaller candidate" in g["not_tried"]["all_slower"]
    assert g["float_layers"] == ["conv0"]


def test_a_float_prefix_is_tried_beside_the_islands_and_ships_when_it_beats_them(monkeypatch: pytest.MonkeyPatch,
                                                                                 tmp_path: Path) -> None:
    """A squeeze-excite CNN's case: its first blocks cost more in int8 than in float, one of them not.  The
    float islands (the chain entry; every slower region) are timed beside the float prefix - the first layers up to
    the cut that removes the most profiled time, here the three convolutions, the classifier left int8 - and
    the prefix ships when it beats them (float islands inside a chain add layout Transposes the profile does not
    see: the prefix was the fastest form measured on MobileNetV3-Small and EfficientNet-B0)."""
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    _fake_profile(monkeypatch, {"conv0": (0.1, 0.4), "dwconv": (1.0, 0.95), "project": (0.1, 0.2)})
    timed: list[list[str]] = []

    def fake(blobs: dict[str, bytes], feed: Any, **kw: Any) -> dict[str, list[float]]:
        timed.append(sorted(blobs))
        times = {"fp32": 2.0, "int8": 1.0, "chain_entry": 0.99, "all_slower": 0.95, "float_prefix": 0.8,
                 "shipped": 0.8}
        return {k: [times[k]] * AB_ROUNDS for k in blobs}

    monkeypatch.setattr(guard, "ab_compare", fake)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False)
    g = res.report["latency_guard"]
    assert timed[0] == ["all_slower", "chain_entry", "float_prefix", "int8"]
    assert g["candidates"]["float_prefix"]["float_layers"] == ["conv0", "dwconv", "project"]
    assert g["candidates"]["float_prefix"]["excess_ms"] == pytest.approx(0.35)
    assert g["candidates"]["all_slower"]["float_layers"] == ["conv0", "project"]
    assert g["ab"]["float_prefix"]["vs_all_slower"]["faster"] is True
    assert g["float_layers"] == ["conv0", "dwconv", "project"] and "fc" in res.plan.layers
    assert "(float_prefix)" in g["decision"]


def test_a_float_prefix_ends_where_one_tensor_crosses_the_cut() -> None:
    """Before the projection the block input is still live for the skip Add: a cut there would need a second
    QuantizeLinear and leave a DequantizeLinear on the skip.  The prefix ends where one tensor crosses (before the
    depthwise conv the block input is that tensor: the skip reads it too, quantized once)."""
    import onnx_ir as ir

    from quantkit.guard import float_prefix, single_input_cuts
    from quantkit.prep.pipeline import prepare

    model = prepare(ir.from_proto(tiny_cnn())).model
    layers = ["conv0", "dwconv", "project", "fc"]
    cuts = single_input_cuts(model, layers)
    assert cuts == {"conv0", "dwconv", "fc"}
    medians = {"conv0": (0.1, 0.4), "dwconv": (0.1, 0.3), "project": (0.1, 0.05), "fc": (1.0, 0.5)}
    assert float_prefix(layers, medians) == (["conv0", "dwconv"], pytest.approx(0.5))
    assert float_prefix(layers, medians, cuts) == (["conv0", "dwconv", "project"], pytest.approx(0.45))


def test_a_candidate_holding_every_int8_layer_is_reported_as_the_float_model(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """It read "shipped with 4 layer(s) in float (all_slower) ... estimated 1.13x FP32" beside "no layer was quantized:
    the output is the float model" (a ConvMixer probe)."""
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    _fake_profile(monkeypatch, {n: (0.1, 0.3) for n in ("conv0", "dwconv", "project", "fc")})
    _fake_ab(monkeypatch, 0.8)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False)
    g = res.report["latency_guard"]
    assert sorted(g["float_layers"]) == ["conv0", "dwconv", "fc", "project"]
    assert g["decision"].startswith("shipped in float (every layer: the ") and "holds all 4 int8 layers" in g["decision"]
    assert "estimated" not in g["decision"]


def test_an_int8_chain_left_stranded_and_no_faster_joins_the_float_layers(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    # the stem starts the chain and is slower in int8; with it in float, the depthwise conv and the projection
    # form an int8 chain of their own (the residual Add now reads the float stem) that measured no faster in
    # int8: stranded, it would pay a Q and a DQ for nothing, so the candidate keeps it in float too; the
    # classifier's chain is faster in int8 and stays
    _fake_profile(monkeypatch, {"conv0": (0.1, 0.3), "dwconv": (0.1, 0.3), "project": (0.1, 0.1)})
    _fake_ab(monkeypatch, 0.8)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False)
    g = res.report["latency_guard"]
    assert list(g["candidates"]) == ["chain_entry"]  # all_slower came out the same set
    assert g["candidates"]["chain_entry"]["stranded"] == ["dwconv", "project"]
    assert g["float_layers"] == ["conv0", "dwconv", "project"] and "fc" in res.plan.layers


def test_a_tie_keeps_the_all_int8_model_and_the_guard_can_be_turned_off(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    _fake_profile(monkeypatch, {"conv0": (0.1, 0.2)})
    _fake_ab(monkeypatch, 0.995)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, evaluation_data=image_batches(2, seed=1),
                            progress=False)
    assert res.report["latency_guard"]["decision"].startswith("kept all layers int8")
    assert res.report["latency_guard"]["float_layers"] == [] and "conv0" in res.plan.layers
    calls = _fake_profile(monkeypatch, {"conv0": (0.1, 0.2)})
    off = {**RECIPE, "report": {**RECIPE["report"], "latency": {"warmup": 1, "repeat": 3, "guard": False}}}
    res = quantkit.quantize(tiny_cnn(), image_batches(4), off, progress=False)
    assert not calls and "latency_guard" not in res.report


def test_no_slow_region_or_too_little_to_gain_keeps_the_model_without_a_rerun(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    def fake(blobs: dict[str, bytes], feed: Any, **kw: Any) -> dict[str, list[float]]:
        if "int8" in blobs:
            pytest.fail("no A/B of candidates without a slow region")
        return {"shipped": [1.0] * AB_ROUNDS, "fp32": [2.0] * AB_ROUNDS}  # only the check against FP32

    monkeypatch.setattr(guard, "ab_compare", fake)
    for slow in (None, {"conv0": (0.1, 0.101)}):  # 1 us more in a 1 ms model: below the A/B margin
        _fake_profile(monkeypatch, slow)
        res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False, use_cache=False)
        assert res.report["latency_guard"]["float_layers"] == [] and "conv0" in res.plan.layers


def test_region_times_attribute_every_layer_in_both_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    from quantkit.guard import layer_times

    res = quantkit.quantize(tiny_cnn(), image_batches(4), {**RECIPE, "report": {"latency": {"enabled": False}}},
                            progress=False, evaluate=False)
    layers = sorted(n for n, lp in res.plan.layers.items() if lp.op_type in ("Conv", "Gemm"))
    feed = next(iter(image_batches(1)))
    times = layer_times(ir.to_proto(res.float_model).SerializeToString(),
                        ir.to_proto(res.model).SerializeToString(), res.float_model, layers, feed, threads=1, runs=5)
    assert set(times) == set(layers)
    assert all(f > 0 and q > 0 for f, q in times.values()), times  # every layer found in both profiles


@pytest.mark.parametrize(("int8_ms", "expected_rounds"), [((0.5, 0.5, 0.5), 1), ((2.0, 0.5, 2.0), 2),
                                                          ((2.0, 2.0, 2.0), 3)])
def test_region_times_stop_once_no_region_can_be_slower_in_every_round(
        monkeypatch: pytest.MonkeyPatch, int8_ms: tuple[float, ...], expected_rounds: int) -> None:
    """The profile rounds stop after a round that leaves no region slower in int8 in every round so far: the
    verdict (:func:`slow_regions`) cannot change, and a model with no slow region is profiled once, not three
    times."""
    import quantkit.guard as guard
    import quantkit.search.profile as profile

    model = prepare(ir.from_proto(tiny_cnn())).model
    calls: list[bytes] = []

    class FakeProfile:
        node_sum_ms = 1.0

        def __init__(self, ms: float) -> None:
            self.ms = ms

        def by_layer(self, names: Any, aliases: Any = None) -> dict[str, float]:
            return dict.fromkeys(names, self.ms)

    def fake(blob: bytes, feed: Any, **kw: Any) -> FakeProfile:
        calls.append(blob)
        return FakeProfile(1.0 if blob == b"fp32" else int8_ms[(len(calls) - 1) // 2])

    monkeypatch.setattr(profile, "profile_model", fake)
    times = guard.region_times(b"fp32", b"int8", model, ["conv0"], {}, threads=1)
    assert len(times["conv0"]) == expected_rounds and len(calls) == 2 * expected_rounds
    assert (set(slow_regions(times)) == {"conv0"}) == (expected_rounds == 3 and int8_ms[-1] > 1.0)


def test_wins_needed_is_the_sign_test_at_the_guard_level() -> None:
    from quantkit.guard import AB_EXTRA_ROUNDS, wins_needed

    assert wins_needed(AB_ROUNDS) == AB_MIN_WINS == 8  # P(X >= 8 | 10) = 0.055
    assert wins_needed(AB_ROUNDS + AB_EXTRA_ROUNDS) == 15  # P(X >= 15 | 20) = 0.021; 14 would be 0.058


@pytest.mark.parametrize(("first", "second", "ships"), [
    ([0.87] * 7 + [1.1] * 3, [0.87] * 8 + [1.1] * 2, True),  # 7 of 10, then 15 of 20: a blurred win confirmed
    ([0.87] * 7 + [1.1] * 3, [0.87] * 6 + [1.1] * 4, False),  # 13 of 20: still a tie
    ([0.87] * 5 + [1.1] * 5, None, False),  # no majority: no second batch
])
def test_an_ab_short_of_the_sign_test_by_a_majority_runs_one_more_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: list[float], second: list[float] | None,
        ships: bool) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    _fake_profile(monkeypatch, {"conv0": (0.1, 0.5)})
    batches = [first, second]

    def fake(blobs: dict[str, bytes], feed: Any, **kw: Any) -> dict[str, list[float]]:
        if "int8" not in blobs:  # the shipped model against FP32 (the tiny model may measure slower than FP32)
            return {"shipped": [1.0] * AB_ROUNDS, "fp32": [2.0] * AB_ROUNDS}
        ratios = batches.pop(0)
        assert ratios is not None, "a second batch was run without a majority in the first"
        return {k: [{"fp32": 2.0, "int8": 1.0}.get(k, r) for r in ratios] for k in blobs}

    monkeypatch.setattr(guard, "ab_compare", fake)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False, use_cache=False)
    rec = res.report["latency_guard"]
    assert len(rec["ab"]["rounds_ms"]["int8"]) == (10 if second is None else 20)
    assert bool(rec["float_layers"]) == ships, rec["decision"]


def test_ab_rounds_of_a_fast_model_hold_enough_runs_to_outlast_the_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    import quantkit.evaluate.latency as latency
    import quantkit.guard as guard
    from quantkit.guard import AB_ROUND_MS, ab_compare

    runs: dict[str, int] = {}
    clock = [0.0]  # a fake clock each run advances by its duration: no dependence on the machine's timer slack

    class Timed:
        def __init__(self, name: str, ms: float) -> None:
            self.name, self.ms = name, ms

        def run(self, *a: Any) -> None:
            runs[self.name] = runs.get(self.name, 0) + 1
            clock[0] += self.ms / 1e3

    monkeypatch.setattr(guard.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(latency, "make_session", lambda blob, threads=None, **kw: Timed(blob.decode(), 2.0))
    out = ab_compare({"fp32": b"fp32", "int8": b"int8"}, {}, threads=1, rounds=4, warmup=2)
    assert [len(v) for v in out.values()] == [4, 4]
    settle = int(np.ceil(latency.SETTLE_MS / 2.0))  # untimed runs before each round's timed ones
    per_round = (runs["int8"] - 2) // 4 - settle
    assert per_round == int(np.ceil(AB_ROUND_MS / 2.0)) == 10  # ~10 runs of 2 ms fill a round, not 3
    runs.clear()
    monkeypatch.setattr(latency, "make_session", lambda blob, threads=None, **kw: Timed(blob.decode(), 30.0))
    ab_compare({"fp32": b"fp32", "int8": b"int8"}, {}, threads=1, rounds=2, warmup=1)
    assert runs["int8"] == 1 + 2 * (1 + 3)  # a model slower than a round's budget keeps the 3 runs per round


def test_the_ab_stops_once_every_candidate_has_lost_half_the_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate slower than all-int8 in every round: after 5 of 10 rounds nothing can change the verdict (it
    can neither reach 8 wins nor the majority that earns extra rounds), so the A/B ends there; a candidate that
    wins keeps it running to the end."""
    import quantkit.evaluate.latency as latency
    import quantkit.guard as guard
    from quantkit.guard import AB_ROUNDS, ab_compare, ab_verdict, hopeless

    clock = [0.0]  # a fake clock each run advances by its duration: no dependence on the machine's timer slack

    class Sleepy:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def run(self, *a: Any) -> None:
            clock[0] += self.ms / 1e3

    monkeypatch.setattr(guard.time, "perf_counter", lambda: clock[0])

    speed = {"fp32": 6.0, "int8": 2.0, "slow": 4.0, "fast": 1.0}
    monkeypatch.setattr(latency, "make_session", lambda blob, threads=None, **kw: Sleepy(speed[blob.decode()]))
    out = ab_compare({k: k.encode() for k in ("fp32", "int8", "slow")}, {}, threads=1, warmup=1, max_per_round=3,
                     stop=lambda ab: hopeless(ab, ["slow"]))
    assert [len(v) for v in out.values()] == [5, 5, 5]
    assert not ab_verdict(out["int8"], out["slow"])[0]
    out = ab_compare({k: k.encode() for k in ("fp32", "int8", "slow", "fast")}, {}, threads=1, warmup=1,
                     max_per_round=3, stop=lambda ab: hopeless(ab, ["slow", "fast"]))
    assert [len(v) for v in out.values()] == [AB_ROUNDS] * 4
    # the arithmetic behind the rule: with half of 10 rounds lost, no shorter A/B passes the sign test either
    assert hopeless({"int8": [1.0] * 5, "c": [1.0, 2.0, 1.5, 1.1, 1.2]}, ["c"])
    assert not hopeless({"int8": [1.0] * 5, "c": [0.9, 2.0, 1.5, 1.1, 1.2]}, ["c"])


def test_sessions_stop_spinning_when_a_run_returns(tmp_path: Path) -> None:
    """A session whose intra-op threads keep spinning after its run slows the next session's first runs (on 2 cores
    an A/B's rounds came out 24 or 15 ms for the same model): every session quantkit times stops spinning when a
    run returns (within a run ONNX Runtime spins as by default; spinning off altogether would slow the runs)."""
    import onnx

    import quantkit.evaluate.latency as latency
    from quantkit.frontends.llm_builder import LLMSession

    path = tmp_path / "m.onnx"
    onnx.save(tiny_cnn(), str(path))
    stop = "session.force_spinning_stop"
    assert latency.make_session(str(path)).get_session_options().get_session_config_entry(stop) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):
        latency.make_session(str(path)).get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning")  # spinning within a run: ONNX Runtime's own default
    with pytest.raises(RuntimeError, match="does not have configuration"):
        latency.make_session(str(path), stop_spinning=False).get_session_options().get_session_config_entry(stop)
    import inspect

    assert '"session.force_spinning_stop", "1"' in inspect.getsource(LLMSession.__init__)  # the decode sessions


def _fake_run_latency(monkeypatch: pytest.MonkeyPatch, fp32_ms: float, quantized_ms: float) -> None:
    """The run's own FP32-vs-quantized latency (quantkit.pipeline.measure_pair_latency) at fixed figures."""
    import quantkit.pipeline as pipeline
    from quantkit.evaluate.latency import Latency

    def fake(sessions: dict[str, Any], feed: Any, **kw: Any) -> dict[str, Latency]:
        ms = {"fp32": fp32_ms, "quantized": quantized_ms}
        return {k: Latency(ms[k], ms[k], ms[k], ms[k], 3, 1, 0, "x") for k in sessions}

    monkeypatch.setattr(pipeline, "compare_latency", fake)


def test_a_model_still_slower_than_fp32_ships_in_float_when_fp32_wins_its_own_ab(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    _fake_profile(monkeypatch, None)  # no region slower in int8: the all-int8 model is the guard's choice
    _fake_run_latency(monkeypatch, 1.0, 1.25)  # ... and the run measured it slower than FP32 (0.8x)
    timed: list[list[str]] = []

    def fake(blobs: dict[str, bytes], feed: Any, **kw: Any) -> dict[str, list[float]]:
        timed.append(sorted(blobs))
        return {"shipped": [1.25] * AB_ROUNDS, "fp32": [1.0] * AB_ROUNDS}

    monkeypatch.setattr(guard, "ab_compare", fake)
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, evaluation_data=image_batches(2, seed=1),
                            progress=False)
    g = res.report["latency_guard"]
    assert timed == [["fp32", "shipped"]]
    assert g["fallback"]["fp32_faster"] and g["fallback"]["fp32_wins"] == AB_ROUNDS
    assert g["decision"].startswith("shipped in float") and "conv0" in g["float_layers"]
    # every layer in float: no int8 kernel, no Q/DQ left, the float weights
    assert not res.census.quantized_kernels and res.census.leftover_qdq_nodes == []
    assert any("not quantized" in w for w in res.report["warnings"])
    assert res.report["summary"]["warnings"] == len(res.report["warnings"])  # the guard's warnings counted too
    # a tie with FP32 keeps the int8 model (with the warning that it is slower)
    monkeypatch.setattr(guard, "ab_compare",
                        lambda blobs, feed, **kw: {"shipped": [1.0] * AB_ROUNDS, "fp32": [0.995] * AB_ROUNDS})
    res = quantkit.quantize(tiny_cnn(), image_batches(4), RECIPE, progress=False, use_cache=False)
    g = res.report["latency_guard"]
    assert not g["fallback"]["fp32_faster"] and g["float_layers"] == [] and res.census.quantized_kernels
    assert any("still slower than FP32" in w for w in res.report["warnings"])


def test_a_size_target_keeps_the_int8_model_even_when_fp32_is_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import quantkit.guard as guard
    from quantkit.recipe.load import load_recipe

    rec = load_recipe({**RECIPE, "search": {"candidates": ["int8", "fp32"], "target": {"size": 0.5}}})
    monkeypatch.setattr(guard, "ab_compare", lambda *a, **k: pytest.fail("no A/B: only int8 meets the size target"))
    chosen = types.SimpleNamespace(report={})
    result = types.SimpleNamespace(recipe=rec, plan=None)
    record: dict[str, Any] = {"decision": "kept all layers int8", "float_layers": []}
    out = guard._finish(result, chosen, b"", 0.8, record, b"", {}, lambda plan: pytest.fail("no rerun"), 0.0, None)
    assert out is chosen and "size target" in record["fallback"]["skipped"]
    assert any("still slower than FP32" in w for w in chosen.report["warnings"])


def test_each_round_times_the_steady_state_after_untimed_settling_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """After another model ran, a session's first runs are slow (its weights back into the caches): timed, they
    favoured the model with fewer bytes.  compare_latency (the run's, the zoo's latency) and the guard's A/B run
    each session untimed for ~SETTLE_MS first, and time the steady state."""
    import quantkit.evaluate.latency as latency
    from quantkit.guard import ab_compare

    clock = [0.0]
    last: list[str] = [""]

    class Cold:  # 3 ms for its first 4 runs after another session ran, then its steady time
        def __init__(self, name: str, ms: float) -> None:
            self.name, self.ms, self.warm = name, ms, 0

        def run(self, *a: Any) -> None:
            if last[0] != self.name:
                self.warm, last[0] = 0, self.name
            self.warm += 1
            clock[0] += (3.0 if self.warm <= 4 else self.ms) / 1e3

        def get_inputs(self) -> list[Any]:
            return []

    monkeypatch.setattr(latency.time, "perf_counter", lambda: clock[0])
    sessions = {"fp32": Cold("fp32", 1.0), "int8": Cold("int8", 1.2)}
    lat = latency.compare_latency(sessions, {}, warmup=1, repeat=30, rounds=10)  # 3 timed runs per round
    assert lat["fp32"].median_ms == pytest.approx(1.0) and lat["int8"].median_ms == pytest.approx(1.2)
    monkeypatch.setattr(latency, "make_session", lambda blob, threads=None, **kw: sessions[blob.decode()])
    ab = ab_compare({"fp32": b"fp32", "int8": b"int8"}, {}, threads=1, rounds=3, warmup=1, per_round=3,
                    max_per_round=3)
    assert np.median(ab["fp32"]) == pytest.approx(1.0) and np.median(ab["int8"]) == pytest.approx(1.2)


@pytest.mark.parametrize("fmt", ["int8_dynamic", "int4"])
def test_the_float_fallback_of_a_mixed_plan_puts_back_every_quantized_layer(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fmt: str) -> None:
    """A plan mixing static int8 with another format (here the classifier) that FP32 beats ships every layer in
    float - not only the int8 ones: the model FP32 beat held them too - and the plan says the guard decided."""
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    import quantkit.guard as guard

    _fake_profile(monkeypatch, None)
    _fake_run_latency(monkeypatch, 1.0, 1.25)
    monkeypatch.setattr(guard, "ab_compare",
                        lambda blobs, feed, **kw: {"shipped": [1.25] * AB_ROUNDS, "fp32": [1.0] * AB_ROUNDS})
    recipe = {**RECIPE, "quantization": {"overrides": [{"layer": "fc", "format": fmt}]}}
    res = quantkit.quantize(tiny_cnn(), image_batches(4), recipe, progress=False)
    g = res.report["latency_guard"]
    assert g["fallback"]["fp32_faster"] and "fc" in g["float_layers"] and "conv0" in g["float_layers"]
    assert fmt in g["decision"]
    decided = res.precision.decided
    assert {lp.format for lp in decided.values()} == {"fp32"} and decided["fc"].rule == guard.RULE
    assert not res.census.quantized_kernels and res.census.leftover_qdq_nodes == []
    assert not any(n.op_type in ("MatMulNBits", "DynamicQuantizeLinear", "MatMulInteger", "DequantizeLinear")
                   for n in res.model.graph)


def test_a_shipped_model_measured_slower_than_fp32_is_timed_against_it_even_when_the_estimate_is_faster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The A/B's estimate said 1.16x, the shipped model's own measurement 0.73x (wav2vec2, a 3 ms model): the
    guard used the estimate alone and shipped it with a generic warning.  Now either below 1 starts the
    FP32-vs-shipped A/B, which decides; its ratio is the figure the warning quotes."""
    import types

    import quantkit.guard as guard
    from quantkit.recipe.load import load_recipe

    timed: list[list[str]] = []

    def fake(blobs: dict[str, bytes], feed: Any, **kw: Any) -> dict[str, list[float]]:
        timed.append(sorted(blobs))
        return {"shipped": [1.0] * AB_ROUNDS, "fp32": [0.99] * AB_ROUNDS}  # a tie: kept, but slower

    monkeypatch.setattr(guard, "ab_compare", fake)
    rec = load_recipe(RECIPE)
    chosen = types.SimpleNamespace(report={"latency": {"speedup": 0.73}})
    result = types.SimpleNamespace(recipe=rec, plan=None)
    record: dict[str, Any] = {"decision": "kept all layers int8", "float_layers": []}
    out = guard._finish(result, chosen, b"", 1.16, record, b"", {}, lambda plan: pytest.fail("no rerun"), 0.0, None)
    assert out is chosen and timed == [["fp32", "shipped"]] and record["shipped_measured_speedup"] == 0.73
    assert any("still slower than FP32 on this CPU in its A/B (0.99x" in w for w in chosen.report["warnings"])
    # both at or above 1: no A/B
    timed.clear()
    chosen = types.SimpleNamespace(report={"latency": {"speedup": 1.2}})
    guard._finish(result, chosen, b"", 1.16, {"decision": "x", "float_layers": []}, b"", {}, lambda p: None, 0.0,
                  None)
    assert timed == []
