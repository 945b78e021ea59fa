"""Models whose inputs fix the batch: batch 1 is fed one sample at a time whatever the recipe's batch sizes (the
default evaluation batch of 8 used to crash the run); a larger fixed batch is refused with what to do."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from quantkit.data.base import InputInfo
from quantkit.data.fixed_batch import FixedBatchOne, bind_fixed_batch, fixed_batch
from quantkit.errors import DataError


def _info(shape: tuple[int | None, ...] | None, name: str = "x") -> InputInfo:
    return InputInfo(name, np.dtype(np.float32), shape)


def test_fixed_batch_of_the_inputs() -> None:
    assert fixed_batch([_info((1, 3, 8, 8))]) == (1, "x")
    assert fixed_batch([_info((None, 3, 8, 8))]) is None
    assert fixed_batch([_info((1, 3)), _info((None, 5), "m")]) is None  # one dynamic input: not fixed
    assert fixed_batch([_info((1, 3)), _info((4, 5), "m")]) is None  # different sizes: not a batch
    assert fixed_batch([_info(None)]) is None


def test_batch_one_is_fed_one_sample_at_a_time_and_larger_is_refused() -> None:
    from quantkit.data.base import ArrayDataset

    ds = ArrayDataset({"x": np.zeros((5, 3), np.float32)})
    bound = bind_fixed_batch(ds, [_info((1, 3))])
    assert isinstance(bound, FixedBatchOne) and len(bound) == 5
    assert [b["x"].shape for b in bound.batches(8)] == [(1, 3)] * 5
    assert bind_fixed_batch(ds, [_info((None, 3))]) is ds
    with pytest.raises(DataError, match=r"input 'x' fixes the batch dimension at 2.*dynamic_axes=\{'x': \{0: 'batch'\}\}"):
        bind_fixed_batch(ds, [_info((2, 3))])


def test_a_model_fixed_at_batch_one_quantizes_with_the_default_recipe() -> None:
    from quantkit.api import quantize
    from tests.conftest import image_batches
    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    y = g.node("Relu", [g.node("Conv", ["input", g.w("w", 8, 3, 3, 3)], "c", pads=[1, 1, 1, 1])], "r")
    y = g.node("Conv", [y, g.w("w2", 4, 8, 3, 3)], "y", pads=[1, 1, 1, 1])
    model = g.model("static_b1", y, [1, 4, 16, 16])
    model.graph.input[0].type.tensor_type.shape.dim[0].ClearField("dim_param")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    onnx.checker.check_model(model)
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": True, "warmup": 1, "repeat": 2}}}
    res = quantize(model, image_batches(2), recipe, evaluation_data=image_batches(2, seed=2), progress=False)
    assert len(res.plan.layers) == 2
    fid = res.report["quality"]["fidelity"]["y"]
    assert fid["samples"] == 8 and fid["sqnr_db"] > 25
