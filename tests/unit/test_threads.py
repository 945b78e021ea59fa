"""quantkit.threads: the BLAS thread limit of the whole-graph path."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from quantkit.errors import QuantkitError
from quantkit.threads import BLAS_THREADS_ENV, blas_thread_limit, blas_threads


def _blas_threads() -> set[int]:
    return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}


def test_the_limit_defaults_to_one_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BLAS_THREADS_ENV, raising=False)
    assert blas_thread_limit() == 1
    monkeypatch.setenv(BLAS_THREADS_ENV, "3")
    assert blas_thread_limit() == 3
    monkeypatch.setenv(BLAS_THREADS_ENV, " ALL ")
    assert blas_thread_limit() is None


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_a_bad_value_names_the_variable_and_the_allowed_values(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(BLAS_THREADS_ENV, bad)
    with pytest.raises(QuantkitError, match=rf"{BLAS_THREADS_ENV}=.*allowed values: a positive integer.*'all'"):
        blas_thread_limit()


def test_the_block_limits_the_loaded_blas_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    np.ones((4, 4)) @ np.ones((4, 4))  # NumPy's BLAS is loaded
    before = _blas_threads()
    assert before, "no BLAS library visible to threadpoolctl"
    monkeypatch.delenv(BLAS_THREADS_ENV, raising=False)
    with blas_threads():
        assert _blas_threads() == {1}
    assert _blas_threads() == before
    monkeypatch.setenv(BLAS_THREADS_ENV, "all")
    with blas_threads():
        assert _blas_threads() == before


def test_the_whole_graph_path_runs_under_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """api.quantize's whole-graph run sees one BLAS thread; the caller's setting is back afterwards."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    import quantkit.api as api

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    seen: list[set[int]] = []
    real = api._quantize_whole

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(_blas_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "_quantize_whole", spy)
    monkeypatch.delenv(BLAS_THREADS_ENV, raising=False)
    before = _blas_threads()
    data = [{"x": rng.standard_normal((1, 8)).astype(np.float32)} for _ in range(4)]
    api.quantize(onnx.ModelProto.FromString(model.SerializeToString()), data, progress=False, evaluate=False,
                 measure_latency=False, use_cache=False)
    assert seen == [{1}]
    assert _blas_threads() == before
