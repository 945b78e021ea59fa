"""Tests for quantkit.search.profile: ORT profiler parsing, layer attribution, roofline.

No timing assertions: only names, op types, call counts and bookkeeping.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.errors import DataError, ModelError, QuantkitError
from quantkit.search import profile as profile_mod
from quantkit.search.profile import OTHER, Profile, machine_peaks, profile_model, roofline

FEED = {"x": np.ones((4, 8), np.float32)}


def _two_matmuls() -> bytes:
    """x -> MatMul 'a' -> Mul 'a/scale' -> MatMul 'b' -> Relu 'zz' -> y."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "wa"),
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "wb"),
        numpy_helper.from_array(np.array(2.0, np.float32), "s"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["h"], name="a"),
        helper.make_node("Mul", ["h", "s"], ["h2"], name="a/scale"),
        helper.make_node("MatMul", ["h2", "wb"], ["h3"], name="b"),
        helper.make_node("Relu", ["h3"], ["y"], name="zz"),
    ]
    graph = helper.make_graph(
        nodes,
        "two_matmuls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def test_nodes_found_unoptimized(tmp_path: Path) -> None:
    prof = profile_model(_two_matmuls(), FEED, runs=3, warmup=2, level="disable", threads=1)
    assert set(prof.nodes) == {"a", "a/scale", "b", "zz"}
    assert {n: t.op_type for n, t in prof.nodes.items()} == {
        "a": "MatMul",
        "a/scale": "Mul",
        "b": "MatMul",
        "zz": "Relu",
    }
    assert all(t.calls == 1 for t in prof.nodes.values())
    assert all(t.median_us >= 0 for t in prof.nodes.values())
    assert prof.node_sum_ms == pytest.approx(sum(t.median_us for t in prof.nodes.values()) / 1000)
    assert prof.run_median_ms > 0
    assert (prof.level, prof.threads) == ("disable", 1)
    assert list(tmp_path.iterdir()) == []  # the trace never lands in the working directory

    layers = prof.by_layer(["a", "b", "not_in_graph"])
    assert set(layers) == {"a", "b", "not_in_graph", OTHER}
    ms = {n: t.median_us / 1000 for n, t in prof.nodes.items()}
    assert layers["a"] == pytest.approx(ms["a"] + ms["a/scale"])
    assert layers["b"] == pytest.approx(ms["b"])
    assert layers[OTHER] == pytest.approx(ms["zz"])
    assert layers["not_in_graph"] == 0.0
    assert sum(layers.values()) == pytest.approx(prof.node_sum_ms)
    assert sum(prof.by_op_type().values()) == pytest.approx(prof.node_sum_ms)


def test_fused_names_attributed_at_level_all(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(_two_matmuls())
    prof = profile_model(path, FEED, runs=2, warmup=1, level="all")
    assert prof.threads is None
    # ORT fuses MatMul 'a' + Mul 'a/scale' into a FusedMatMul named after 'a'.
    assert "b" in prof.nodes
    assert "a/scale" not in prof.nodes
    assert all(prof.layer_of(name, ["a", "b"]) in ("a", "b") for name in prof.nodes if name != "zz")
    layers = prof.by_layer(["a", "b", "zz"])
    assert layers[OTHER] == 0.0
    assert sum(layers.values()) == pytest.approx(prof.node_sum_ms)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        ("a", "a"),
        ("a/scale", "a"),
        ("a/MatMulIntegerToFloat", "a"),
        ("a/MatMulAddFusion", "a"),
        ("a_token_3", "a"),
        ("a_token_3_token_7", "a"),
        ("a_token_2/MatMulScaleFusion/", "a"),
        ("a/b/act_absmax", "a/b"),  # longest matching layer wins
        ("a/b", "a/b"),
        ("ab", OTHER),
        ("b", OTHER),
        ("Transpose_token_5", OTHER),
        ("x/a", OTHER),
    ],
)
def test_attribution_rules(node: str, expected: str) -> None:
    prof = Profile(nodes={}, run_median_ms=0.0, node_sum_ms=0.0, level="all", threads=None)
    assert prof.layer_of(node, ["a", "a/b"]) == expected


def _event(cat: str, name: str, ts: int, dur: int, op: str = "") -> dict[str, object]:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X", "args": {"op_name": op} if op else {}}


def test_parse_trace_skips_warmup_and_counts_calls() -> None:
    events = [
        _event("Session", "session_initialization", 0, 500),
        # warm-up run: huge times that must not count
        _event("Node", "n_kernel_time", 1000, 900, "Add"),
        _event("Session", "model_run", 990, 950),
        # measured run 1: node n runs twice (e.g. inside a Loop body)
        _event("Node", "n_fence_before", 2001, 0, "Add"),
        _event("Node", "n_kernel_time", 2001, 10, "Add"),
        _event("Node", "n_kernel_time", 2020, 12, "Add"),
        _event("Session", "model_run", 2000, 40),
        # measured run 2
        _event("Node", "n_kernel_time", 3001, 20, "Add"),
        _event("Node", "n_kernel_time", 3030, 20, "Add"),
        _event("Session", "model_run", 3000, 60),
        # measured run 3
        _event("Node", "n_kernel_time", 4001, 8, "Add"),
        _event("Node", "n_kernel_time", 4010, 8, "Add"),
        _event("Session", "model_run", 4000, 20),
    ]
    nodes, run_ms = profile_mod._parse_trace(events, warmup=1, runs=3)
    assert set(nodes) == {"n"}
    assert nodes["n"].op_type == "Add"
    assert nodes["n"].calls == 2
    assert nodes["n"].median_us == 22.0  # per-run totals 22, 40, 16
    assert run_ms == pytest.approx(0.040)
    with pytest.raises(ModelError, match="model_run"):
        profile_mod._parse_trace(events, warmup=2, runs=3)


@pytest.mark.parametrize("level", ["fast", "ALL", ""])
def test_bad_level(level: str) -> None:
    with pytest.raises(QuantkitError, match="disable, basic, extended, all") as info:
        profile_model(_two_matmuls(), FEED, level=level)
    assert type(info.value) is not QuantkitError  # a subclass
    assert repr(level) in str(info.value)


@pytest.mark.parametrize("kwargs", [{"threads": 0}, {"runs": 0}, {"warmup": -1}, {"threads": 1.5}])
def test_bad_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(QuantkitError):
        profile_model(_two_matmuls(), FEED, **kwargs)  # type: ignore[arg-type]


def test_bad_model_and_feed(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        profile_model(tmp_path / "missing.onnx", FEED)
    with pytest.raises(DataError, match="missing"):
        profile_model(_two_matmuls(), {"z": FEED["x"]}, runs=1, warmup=0)
    with pytest.raises(DataError):
        profile_model(_two_matmuls(), {"x": np.ones((3, 8), np.float32)}, runs=1, warmup=0)
    assert list(tmp_path.iterdir()) == []


def test_roofline_classification() -> None:
    # ridge = 100 / 10 = 10 flop/byte
    mem = roofline(1e9, 1e9, 200.0, peak_gflops=100.0, peak_gbps=10.0)
    assert mem["bound"] == "memory-bound"
    assert mem["intensity"] == pytest.approx(1.0)
    assert mem["ridge"] == pytest.approx(10.0)
    assert mem["achieved_gflops"] == pytest.approx(5.0)
    assert mem["achieved_gbps"] == pytest.approx(5.0)
    assert mem["attainable_gflops"] == pytest.approx(10.0)
    assert mem["efficiency"] == pytest.approx(0.5)

    comp = roofline(5e10, 1e9, 1000.0, peak_gflops=100.0, peak_gbps=10.0)
    assert comp["bound"] == "compute-bound"
    assert comp["intensity"] == pytest.approx(50.0)
    assert comp["achieved_gflops"] == pytest.approx(50.0)
    assert comp["attainable_gflops"] == pytest.approx(100.0)

    assert roofline(1e9, 1e8, 1.0, peak_gflops=100.0, peak_gbps=10.0)["bound"] == "compute-bound"  # at ridge
    no_bytes = roofline(1e6, 0.0, 1.0, peak_gflops=100.0, peak_gbps=10.0)
    assert math.isinf(float(no_bytes["intensity"])) and no_bytes["bound"] == "compute-bound"
    for bad in ({"time_ms": 0.0}, {"peak_gbps": -1.0}, {"flops": -1.0}, {"bytes_moved": math.nan}):
        args = {"flops": 1.0, "bytes_moved": 1.0, "time_ms": 1.0, "peak_gflops": 1.0, "peak_gbps": 1.0}
        args.update(bad)
        with pytest.raises(QuantkitError):
            roofline(
                args["flops"],
                args["bytes_moved"],
                args["time_ms"],
                peak_gflops=args["peak_gflops"],
                peak_gbps=args["peak_gbps"],
            )


def test_machine_peaks_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile_mod, "_PEAKS", None)
    monkeypatch.setattr(profile_mod, "_COPY_BYTES", 16 * 2**20)  # keep the unit test light
    gflops, gbps = machine_peaks()
    assert gflops > 0 and gbps > 0
    assert machine_peaks() == (gflops, gbps)  # cached for the process
    monkeypatch.setattr(profile_mod, "_PEAKS", (1.0, 2.0))
    assert machine_peaks() == (1.0, 2.0)
    assert machine_peaks(cache=False) != (1.0, 2.0)
