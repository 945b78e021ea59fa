"""Samples of several shapes from an iterable (images of several sizes for a model with dynamic height / width)
are batched in runs of one shape: at the default batch sizes this ended in "samples in one batch have different
shapes" (only batch_size: 1 worked)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import quantkit
from quantkit.data.iterable import IterableDataset


def _cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    g = h.make_graph([h.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["c"], ["r"]),
                      h.make_node("GlobalAveragePool", ["r"], ["p"]), h.make_node("Flatten", ["p"], ["f"]),
                      h.make_node("Gemm", ["f", "W2", "B2"], ["y"], transB=1)],
                     "cnn", [h.make_tensor_value_info("x", T.FLOAT, ["n", 3, "h", "w"])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["n", 5])],
                     [nh.from_array((rng.standard_normal((8, 3, 3, 3)) / 5).astype(np.float32), "W"),
                      nh.from_array(np.full(8, 0.1, np.float32), "B"),
                      nh.from_array((rng.standard_normal((5, 8)) / 3).astype(np.float32), "W2"),
                      nh.from_array(np.zeros(5, np.float32), "B2")])  # fmt: skip
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _samples(seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    sizes = [16] * 5 + [24] * 6 + [16] * 5
    return [{"x": rng.standard_normal((3, s, s)).astype(np.float32)} for s in sizes]


def test_batches_are_runs_of_one_shape() -> None:
    ds = IterableDataset(_samples(0), ["x"])
    got = [b["x"].shape for b in ds.batches(4)]
    assert got == [(4, 3, 16, 16), (1, 3, 16, 16), (4, 3, 24, 24), (2, 3, 24, 24), (4, 3, 16, 16), (1, 3, 16, 16)]


def test_a_dynamic_size_model_quantizes_from_images_of_two_sizes() -> None:
    rec = {"version": 1, "name": "sizes", "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(_cnn(), _samples(1), rec, evaluation_data=_samples(2), progress=False)
    fid = res.report["fidelity"]["y"]
    assert fid["sqnr_db"] > 25, fid

