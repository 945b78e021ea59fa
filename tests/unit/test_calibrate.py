"""Calibration core: calibrator registry, MinMaxCalibrator, collect_statistics over ONNX Runtime."""

from __future__ import annotations

import functools
import gc
import os
import tempfile
import tracemalloc
import weakref
from collections.abc import Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import quantkit.calibrate.collect as collect_mod
from calibrators.minmax import MinMaxCalibrator
from quantkit.calibrate import CALIBRATORS, collect_statistics, get_calibrator, register_calibrator
from quantkit.errors import CalibrationError, DataError, RecipeError, UnknownNameError

RNG = np.random.default_rng(0)
W = RNG.normal(size=(4, 3)).astype(np.float32)
B = RNG.normal(size=(3,)).astype(np.float32)


def tiny_model(*, value_info: bool = True) -> onnx.ModelProto:
    """x[N,4] -MatMul W-> mm -Relu-> relu -Add B-> y."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["mm"], name="matmul"),
            helper.make_node("Relu", ["mm"], ["relu"], name="relu"),
            helper.make_node("Add", ["relu", "B"], ["y"], name="add"),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")],
        value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 3]) for n in ("mm", "relu")]
        if value_info
        else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class ArrayData:
    """Minimal in-test dataset: samples of one input, batched along axis 0."""

    def __init__(self, x: np.ndarray, name: str = "x") -> None:
        self.x, self.name = x, name

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        for i in range(0, len(self.x), batch_size):
            yield {self.name: self.x[i : i + batch_size]}

    def __len__(self) -> int:
        return len(self.x)

    def fingerprint(self) -> str:
        return f"array-{self.x.shape}"


X = RNG.normal(size=(10, 4)).astype(np.float32) * 3


def reference() -> dict[str, np.ndarray]:
    mm = X @ W
    relu = np.maximum(mm, 0)
    return {"x": X, "mm": mm, "relu": relu, "y": relu + B}


ALL = {"x": "minmax", "mm": "minmax", "relu": "minmax", "y": "minmax", "W": "minmax"}


def ranges(stats: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {k: c.compute_range() for k, c in stats.items()}


# ---------------------------------------------------------------- registry


def test_registry_lists_minmax() -> None:
    assert "minmax" in CALIBRATORS.names()
    assert get_calibrator("minmax") is MinMaxCalibrator
    with pytest.raises(UnknownNameError, match="minmax") as info:
        get_calibrator("nope")
    assert "nope" in str(info.value)


def test_register_twice_is_an_error() -> None:
    from quantkit.errors import QuantkitError

    with pytest.raises(QuantkitError, match="twice"):
        register_calibrator("minmax")(type("Other", (MinMaxCalibrator,), {}))


# ---------------------------------------------------------------- MinMaxCalibrator


def test_minmax_per_tensor_and_channel() -> None:
    x = RNG.normal(size=(5, 3, 4)).astype(np.float32)
    c = MinMaxCalibrator()
    c.update(x[:2])
    c.update(x[2:])
    lo, hi = c.compute_range()
    assert lo.dtype == np.float32 and lo.shape == ()
    assert (lo, hi) == (x.min(), x.max())
    c = MinMaxCalibrator(axis=1)
    for part in (x[:1], x[1:4], x[4:]):
        c.update(part)
    lo, hi = c.compute_range()
    np.testing.assert_array_equal(lo, x.min(axis=(0, 2)))
    np.testing.assert_array_equal(hi, x.max(axis=(0, 2)))


def test_minmax_ignores_nonfinite() -> None:
    c = MinMaxCalibrator(axis=0)
    c.update(np.array([[1.0, np.nan], [np.inf, np.nan], [-2.0, -np.inf]], np.float32))
    lo, hi = c.compute_range()
    np.testing.assert_array_equal(lo, [1.0, 0.0, -2.0])
    np.testing.assert_array_equal(hi, [1.0, 0.0, -2.0])
    assert c.state()["nonfinite"] == 4


def test_minmax_momentum() -> None:
    c = MinMaxCalibrator(momentum=0.9)
    c.update(np.array([-1.0, 1.0], np.float32))
    c.update(np.array([-11.0, 11.0], np.float32))
    lo, hi = c.compute_range()
    assert lo == np.float32(-2.0) and hi == np.float32(2.0)  # 0.9 * 1 + 0.1 * 11
    c.update(np.array([-2.0, 2.0], np.float32))
    assert c.compute_range()[1] == np.float32(2.0)
    plain = MinMaxCalibrator()
    for v in (1.0, 11.0, 2.0):
        plain.update(np.array([-v, v], np.float32))
    assert plain.compute_range()[1] == 11.0
    with pytest.raises(RecipeError, match="momentum=1.5"):
        MinMaxCalibrator(momentum=1.5)


def test_minmax_merge_and_state() -> None:
    x = RNG.normal(size=(8, 3)).astype(np.float32)
    a, b, whole = MinMaxCalibrator(axis=1), MinMaxCalibrator(axis=1), MinMaxCalibrator(axis=1)
    a.update(x[:3])
    b.update(x[3:])
    whole.update(x)
    a.merge(b)
    for got, want in zip(a.compute_range(), whole.compute_range(), strict=True):
        np.testing.assert_array_equal(got, want)
    restored = MinMaxCalibrator(axis=1)
    restored.load_state(a.state())
    np.testing.assert_array_equal(restored.compute_range()[0], whole.compute_range()[0])
    assert a.state()["batches"] == 2
    with pytest.raises(ValueError):
        a.merge(MinMaxCalibrator(axis=0))


def test_minmax_errors() -> None:
    with pytest.raises(CalibrationError, match="no data"):
        MinMaxCalibrator().compute_range()
    c = MinMaxCalibrator(axis=1)
    c.update(np.zeros((2, 3), np.float32))
    with pytest.raises(CalibrationError, match="channels"):
        c.update(np.zeros((2, 4), np.float32))
    with pytest.raises(CalibrationError, match="axis=3"):
        MinMaxCalibrator(axis=3).update(np.zeros((2, 3), np.float32))


# ---------------------------------------------------------------- collect_statistics


@pytest.mark.parametrize("value_info", [True, False])
def test_collect_matches_numpy(value_info: bool) -> None:
    stats = collect_statistics(
        tiny_model(value_info=value_info), ArrayData(X), ALL, batch_size=3, progress=False
    )
    assert list(stats) == list(ALL)
    ref = reference()
    got = ranges(stats)
    for name, arr in ref.items():
        assert got[name][0] == arr.min() and got[name][1] == arr.max(), name
    assert got["W"] == (W.min(), W.max())


def test_collect_from_path_with_external_data(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "m.onnx")
    onnx.save_model(tiny_model(), path, save_as_external_data=True, location="m.data", size_threshold=0)
    stats = collect_statistics(path, ArrayData(X), {"relu": "minmax"}, progress=False)
    assert stats["relu"].compute_range()[1] == reference()["relu"].max()


def test_collect_per_channel() -> None:
    req = {"mm": ("minmax", {"axis": 1}), "y": functools.partial(MinMaxCalibrator, axis=-1)}
    got = ranges(collect_statistics(tiny_model(), ArrayData(X), req, batch_size=4, progress=False))
    ref = reference()
    for name in req:
        np.testing.assert_array_equal(got[name][0], ref[name].min(axis=0))
        np.testing.assert_array_equal(got[name][1], ref[name].max(axis=0))


@pytest.mark.parametrize("kwargs", [{"max_outputs_per_pass": 1}, {"max_batch_output_bytes": 40}])
def test_chunked_equals_single_pass(kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    sessions: list[list[str]] = []
    real = collect_mod._Runner.session

    def spy(self: collect_mod._Runner, outputs: list[str]):  # type: ignore[no-untyped-def]
        sessions.append(list(outputs))
        return real(self, outputs)

    monkeypatch.setattr(collect_mod._Runner, "session", spy)
    one = ranges(collect_statistics(tiny_model(), ArrayData(X), ALL, batch_size=2, progress=False))
    assert len(sessions) == 1
    sessions.clear()
    chunked = ranges(
        collect_statistics(tiny_model(), ArrayData(X), ALL, batch_size=2, progress=False, **kwargs)
    )
    # "x" comes from the feeds; W, mm, relu, y are 4 exposed tensors. A batch of 2 rows x 3 floats is
    # 24 bytes, so a 40-byte budget also gives one tensor per pass (W is 48 bytes: alone).
    assert sorted(sessions) == [["W"], ["mm"], ["relu"], ["y"]]
    assert one == chunked


def test_plan_chunks_budget() -> None:
    sizes = {"a": 10, "b": 10, "c": 25, "d": 100, "e": 5}
    assert collect_mod._plan_chunks(list(sizes), sizes, None, 30) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert collect_mod._plan_chunks(list(sizes), sizes, 2, 1000) == [["a", "b"], ["c", "d"], ["e"]]
    assert collect_mod._plan_chunks([], {}, 2, None) == []


def test_budget_probe_for_unknown_shapes() -> None:
    """A Reshape to a shape fed at run time defeats shape inference; the size comes from a probe run."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    class Data(ArrayData):
        def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
            for b in super().batches(batch_size):
                yield {"x": b["x"], "s": np.array([-1, 2], np.int64)}

    stats = collect_statistics(
        model, Data(X), {"r": "minmax", "y": "minmax"}, max_batch_output_bytes=8, progress=False
    )
    assert stats["y"].compute_range() == (np.float32(0.0), X.max())


def test_output_type_unknown_to_onnx_is_inferred_by_ort() -> None:
    """com.microsoft.Gelu has no ONNX shape inference: "g" is exposed as an untyped graph output."""
    graph = helper.make_graph(
        [
            helper.make_node("Gelu", ["x"], ["g"], domain="com.microsoft"),
            helper.make_node("Neg", ["g"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    assert "g" not in collect_mod._infer(model)
    stats = collect_statistics(model, ArrayData(X), {"g": "minmax"}, progress=False)
    lo, hi = stats["g"].compute_range()
    assert hi == pytest.approx(X.max(), rel=1e-3) and -0.2 < lo < 0  # gelu(x) >= -0.17


def test_batch_size_does_not_change_minmax() -> None:
    a = ranges(collect_statistics(tiny_model(), ArrayData(X), ALL, batch_size=1, progress=False))
    b = ranges(collect_statistics(tiny_model(), ArrayData(X), ALL, batch_size=4, progress=False))
    assert a == b


def test_momentum_through_collect_depends_on_batches() -> None:
    req = {"mm": ("minmax", {"momentum": 0.5})}
    a = ranges(collect_statistics(tiny_model(), ArrayData(X), req, batch_size=1, progress=False))
    b = ranges(collect_statistics(tiny_model(), ArrayData(X), req, batch_size=10, progress=False))
    mm = reference()["mm"]
    assert b["mm"] == (mm.min(), mm.max())  # one batch: the EMA is that batch
    ema = mm[0].max()
    for row in mm[1:]:
        ema = 0.5 * ema + 0.5 * row.max()
    assert a["mm"][1] == pytest.approx(ema, rel=1e-6)


def test_unknown_tensor_names_close_matches() -> None:
    with pytest.raises(CalibrationError, match=r"'rel'.*close matches: \['relu'") as info:
        collect_statistics(tiny_model(), ArrayData(X), {"rel": "minmax"}, progress=False)
    assert "relu" in str(info.value)


def test_wrong_input_names_is_data_error() -> None:
    with pytest.raises(DataError, match=r"expected \['x'\], received \['input'\]"):
        collect_statistics(tiny_model(), ArrayData(X, name="input"), {"mm": "minmax"}, progress=False)


def test_wrong_input_dtype_is_data_error() -> None:
    with pytest.raises(DataError, match="rejected"):
        collect_statistics(tiny_model(), ArrayData(X.astype(np.float64)), {"mm": "minmax"}, progress=False)


def test_empty_dataset() -> None:
    with pytest.raises(CalibrationError, match="empty"):
        collect_statistics(tiny_model(), ArrayData(X[:0]), {"mm": "minmax"}, progress=False)

    class Liar(ArrayData):
        def __len__(self) -> int:
            return 5

    with pytest.raises(CalibrationError, match="no batches"):
        collect_statistics(tiny_model(), Liar(X[:0]), {"mm": "minmax"}, progress=False)


def test_bad_options() -> None:
    with pytest.raises(RecipeError, match="batch_size=0"):
        collect_statistics(tiny_model(), ArrayData(X), {"mm": "minmax"}, batch_size=0)
    with pytest.raises(RecipeError, match="max_outputs_per_pass=0"):
        collect_statistics(tiny_model(), ArrayData(X), {"mm": "minmax"}, max_outputs_per_pass=0)
    with pytest.raises(UnknownNameError, match="minmax"):
        collect_statistics(tiny_model(), ArrayData(X), {"mm": ("percentile9", {})})


def test_large_model_path_uses_temp_dir_and_cleans_up(monkeypatch: pytest.MonkeyPatch, tmp_path: str) -> None:
    """Models over the protobuf limit go through external data in a TemporaryDirectory, removed afterwards
    (also on KeyboardInterrupt); the limit is lowered so a tiny model takes that path."""
    monkeypatch.setattr(collect_mod, "_PROTOBUF_LIMIT", 0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = tiny_model()
    before = model.SerializeToString()
    cwd_before = sorted(os.listdir(os.getcwd()))
    stats = collect_statistics(model, ArrayData(X), {"relu": "minmax", "W": "minmax"}, progress=False)
    assert stats["relu"].compute_range()[1] == reference()["relu"].max()
    assert stats["W"].compute_range() == (W.min(), W.max())
    assert model.SerializeToString() == before  # the caller's model is untouched
    assert os.listdir(tmp_path) == []

    class Interrupting(ArrayData):
        def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
            it = super().batches(batch_size)
            yield next(it)
            assert os.listdir(tmp_path)  # the temp dir exists while running
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect_statistics(model, Interrupting(X), {"relu": "minmax"}, progress=False)
    assert os.listdir(tmp_path) == []
    assert sorted(os.listdir(os.getcwd())) == cwd_before


# ---------------------------------------------------------------- memory


class Spy(MinMaxCalibrator):
    """Records a weak reference to every array it is given and how many earlier ones are still alive."""

    refs: list[weakref.ref] = []
    max_alive_before: int = 0

    def update(self, x: np.ndarray) -> None:
        Spy.max_alive_before = max(Spy.max_alive_before, sum(r() is not None for r in Spy.refs))
        Spy.refs.append(weakref.ref(x))
        super().update(x)


def big_model() -> onnx.ModelProto:
    """x[N,4096] (16 KiB per sample) -> Relu -> big -> ReduceMax -> y."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["big"]),
            helper.make_node("ReduceMax", ["big", "axes"], ["y"], keepdims=0),
        ],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        initializer=[numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


class GeneratedData:
    """Makes every batch afresh (numpy allocations, visible to tracemalloc), like a real streaming dataset."""

    def __init__(self, n: int) -> None:
        self.n = n

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        rng = np.random.default_rng(1)
        for i in range(0, self.n, batch_size):
            yield {"x": rng.normal(size=(min(batch_size, self.n - i), 4096)).astype(np.float32)}

    def __len__(self) -> int:
        return self.n

    def fingerprint(self) -> str:
        return f"generated-{self.n}"


def test_at_most_one_batch_of_outputs_alive() -> None:
    """Deterministic memory check: when a batch's outputs arrive, every earlier one has been freed,
    and none survives the call (ORT-allocated outputs are invisible to tracemalloc)."""
    Spy.refs, Spy.max_alive_before = [], 0
    req = {"big": Spy, "y": Spy}
    collect_statistics(
        big_model(), GeneratedData(20), req, batch_size=2, max_outputs_per_pass=1, progress=False
    )
    assert len(Spy.refs) == 20  # 10 batches x 2 passes
    assert Spy.max_alive_before == 0
    gc.collect()
    assert all(r() is None for r in Spy.refs)


def _peak(n: int) -> int:
    req = {"big": ("minmax", {"axis": 1}), "y": "minmax"}
    collect_statistics(big_model(), GeneratedData(5), req, batch_size=5, progress=False)  # warm-up
    gc.collect()
    tracemalloc.start()
    try:
        collect_statistics(big_model(), GeneratedData(n), req, batch_size=5, progress=False)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_peak_memory_does_not_grow_with_samples() -> None:
    # Python-side (numpy) allocations: 200 samples of input are 3.2 MB, 50 are 0.8 MB, one batch 80 KB.
    # Keeping batches would add >= 2.4 MB to the 200-sample peak; allow 256 KB of noise.
    small, large = _peak(50), _peak(200)
    assert large - small < 256 * 1024, (small, large)


def test_overlapped_runs_bin_in_order_and_only_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime runs the next batch in a worker thread while this one is binned when two batches' outputs fit
    the budget; the calibrators see the batches in the same order either way (an order-dependent EMA agrees)."""
    import threading

    where: list[str] = []
    real = collect_mod._run

    def spy(sess, outputs, feeds):  # type: ignore[no-untyped-def]
        where.append(threading.current_thread().name)
        return real(sess, outputs, feeds)

    monkeypatch.setattr(collect_mod, "_run", spy)
    req = {"mm": ("minmax", {"momentum": 0.5}), "relu": ("minmax", {"momentum": 0.5})}
    # one batch of 1 row exposes mm + relu: 2 x 12 bytes = 24 bytes; two batches need 48
    roomy = ranges(collect_statistics(tiny_model(), ArrayData(X), req, progress=False, max_batch_output_bytes=48))
    assert len(where) == len(X) and all(w.startswith("quantkit-calibrate") for w in where)
    where.clear()
    tight = ranges(collect_statistics(tiny_model(), ArrayData(X), req, progress=False, max_batch_output_bytes=47))
    assert where == [threading.current_thread().name] * len(X)
    assert roomy == tight
    mm = reference()["mm"]
    ema = mm[0].max()
    for row in mm[1:]:
        ema = 0.5 * ema + 0.5 * row.max()
    assert roomy["mm"][1] == pytest.approx(ema, rel=1e-6)


def test_a_failing_batch_in_the_worker_raises_the_data_error_in_the_caller() -> None:
    class Bad(ArrayData):
        def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
            yield {"x": X[:1]}
            yield {"x": X[:1, :3]}  # wrong width: ONNX Runtime rejects it in the worker thread

    with pytest.raises(DataError, match="rejected the calibration batch"):
        collect_statistics(tiny_model(), Bad(X), {"mm": "minmax"}, progress=False)
