"""Data that carries class labels beside the inputs - PyTorch's ``(inputs, target)`` items, an ``.npz`` array or a
dict key named ``labels`` - feeds only the inputs, and the evaluation reports accuracy against the labels for FP32
and the quantized model.  (A DataLoader of ``(x, y)`` used to be refused: "a tuple of 2 arrays for 1 inputs".)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantkit.data import IterableDataset, NpzDataset, as_dataset, class_labels, dataset_labels
from quantkit.data.base import InputInfo
from quantkit.errors import DataError


def _inputs(*names: str, rank: int = 2) -> list[InputInfo]:
    return [InputInfo(n, np.dtype(np.float32), (None,) + (3,) * (rank - 1)) for n in names]


def test_class_labels_accepts_class_ids_only() -> None:
    assert class_labels([2, 0, 1]).tolist() == [2, 0, 1]
    assert class_labels(np.array([[1], [4]])).tolist() == [1, 4]
    assert class_labels(np.array([1.0, 3.0])).tolist() == [1, 3]
    assert class_labels(np.int64(3), 1).tolist() == [3]
    assert class_labels([1, 2], rows=3) is None  # not one per sample
    assert class_labels([0.5, 1.0]) is None  # regression targets
    assert class_labels([-1, 2]) is None  # an ignore index, not a class
    assert class_labels(np.eye(3)) is None  # one-hot rows
    assert class_labels(np.zeros((2, 4, 4), np.int64)) is None  # a segmentation mask


def test_tuple_items_carry_labels_unbatched_and_batched() -> None:
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((6, 3)).astype(np.float32)
    ys = np.array([0, 1, 2, 0, 1, 2])
    ds = as_dataset([(xs[i], ys[i]) for i in range(6)], _inputs("x"))
    batch = next(iter(ds.batches(6)))
    assert list(batch) == ["x"] and np.array_equal(batch["x"], xs)
    assert dataset_labels(ds).tolist() == ys.tolist()
    # batched, as a DataLoader yields them; a generator is spooled to disk with its labels and replayed
    ds = as_dataset(((xs[i : i + 2], ys[i : i + 2]) for i in range(0, 6, 2)), _inputs("x"))
    assert sum(b["x"].shape[0] for b in ds.batches(4)) == 6
    assert dataset_labels(ds).tolist() == ys.tolist()
    assert [b["x"].shape[0] for b in ds.batches(4)] == [4, 2]  # the replay
    assert dataset_labels(ds).tolist() == ys.tolist()


def test_multi_input_items_with_labels() -> None:
    a = np.ones((4, 3), np.float32)
    b = np.zeros((4, 3), np.float32)
    y = np.array([1, 0, 1, 0])
    for items in ([(a, b, y)], [((a, b), y)], [({"a": a, "b": b}, y)], [{"a": a, "b": b, "label": y}]):
        ds = as_dataset(items, _inputs("a", "b"))
        feed = next(iter(ds.batches(8)))
        assert sorted(feed) == ["a", "b"] and np.array_equal(feed["a"], a), items
        assert dataset_labels(ds).tolist() == y.tolist(), items
    assert dataset_labels(as_dataset([(a, b)], _inputs("a", "b"))) is None  # no labels: none reported
    with pytest.raises(DataError, match=r"a tuple of 4 arrays for 2 inputs \['a', 'b'\]; allowed: .*followed by the labels"):
        list(IterableDataset([(a, b, y, y)], ["a", "b"], batched=True).batches(2))


def test_npz_and_array_labels(tmp_path: Path) -> None:
    x = np.zeros((5, 3), np.float32)
    np.savez(tmp_path / "d.npz", x=x, labels=np.array([4, 3, 2, 1, 0]))
    ds = NpzDataset(tmp_path / "d.npz", ["x"])
    assert dataset_labels(ds).tolist() == [4, 3, 2, 1, 0]
    assert dataset_labels(ds).tolist() == [4, 3, 2, 1, 0]  # read once, kept
    np.savez(tmp_path / "r.npz", x=x, target=np.linspace(0, 1, 5))  # regression targets: no labels
    assert dataset_labels(NpzDataset(tmp_path / "r.npz", ["x"])) is None
    np.savez(tmp_path / "n.npz", x=x)
    assert dataset_labels(NpzDataset(tmp_path / "n.npz", ["x"])) is None
    assert dataset_labels(as_dataset({"x": x, "y": np.arange(5)}, _inputs("x"))).tolist() == [0, 1, 2, 3, 4]


def _classifier() -> onnx.ModelProto:
    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    y = g.node("Relu", [g.node("Conv", ["input", g.w("w", 8, 3, 3, 3)], "c", pads=[1, 1, 1, 1])], "r")
    y = g.node("Flatten", [g.node("GlobalAveragePool", [y], "p")], "f")
    y = g.node("Gemm", [y, g.w("fc", 10, 8), g.w("fb", 10)], "logits", transB=1)
    return g.model("classifier", y, ["N", 10])


def test_accuracy_against_labels_is_reported_for_fp32_and_the_quantized_model(tmp_path: Path) -> None:
    from quantkit.api import quantize
    from tests.conftest import image_batches

    model = _classifier()
    x = np.concatenate([b["input"] for b in image_batches(4, seed=3)])
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    labels = ref.argmax(-1)
    labels[::4] = (labels[::4] + 1) % 10  # FP32 is right on 3 of 4 samples by construction
    np.savez(tmp_path / "eval.npz", input=x, labels=labels)
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(model, image_batches(2), recipe, evaluation_data=str(tmp_path / "eval.npz"), progress=False)
    fid = res.report["quality"]["fidelity"]["logits"]
    assert fid["labelled_samples"] == 16 and fid["accuracy_fp32"] == pytest.approx(0.75)
    q = ort.InferenceSession(ir.to_proto(res.model).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    assert fid["accuracy"] == pytest.approx(float(np.mean(q.argmax(-1) == labels)))
    assert "accuracy" in res.report["summary"]["quality"]["outputs"]["logits"]


def test_a_generator_of_evaluation_data_serves_a_second_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The latency guard re-runs a plan with the same evaluation data: a generator passed in is bound once (it
    used to be read again, empty, and the re-run failed with "the data iterator is empty")."""
    import quantkit.api as api
    from tests.conftest import image_batches

    real = api.run_plan
    results = []

    def twice(*args, **kwargs):  # what a guard that ships a candidate does: the same plan runs again
        results.append(real(*args, **kwargs))
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(api, "run_plan", twice)
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    labelled = ((b["input"], np.arange(4) % 10) for b in image_batches(2, seed=4))
    api.quantize(_classifier(), image_batches(2), recipe, evaluation_data=labelled, progress=False)
    first, second = (r.report["quality"]["fidelity"]["logits"] for r in results)
    assert first["samples"] == second["samples"] == 8
    assert first["accuracy_fp32"] == second["accuracy_fp32"] and second["labelled_samples"] == 8


def test_a_torch_dataloader_needs_no_example_inputs() -> None:
    """quantize(net, loader): the export's example is the DataLoader's first batch (its labels dropped); other
    iterables still need example_inputs (samples or batches cannot be told apart without the model)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from quantkit.api import quantize
    from quantkit.errors import ModelError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 5)).eval()
    ds = TensorDataset(torch.randn(16, 3, 16, 16), torch.randint(0, 5, (16,)))
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(net, DataLoader(ds, batch_size=4), recipe, evaluation_data=DataLoader(ds, batch_size=4),
                   progress=False)
    fid = next(iter(res.report["quality"]["fidelity"].values()))
    assert fid["samples"] == 16 and fid["labelled_samples"] == 16
    with pytest.raises(ModelError, match="pass example_inputs=.*or calibration data as a torch DataLoader"):
        quantize(net, [torch.randn(4, 3, 16, 16)], recipe, progress=False)
