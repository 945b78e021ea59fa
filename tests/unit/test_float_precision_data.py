"""Floats of another precision than the model's: float64 data (NumPy's default) for a float32 model is cast, named
once in the log; a float64 (or half-precision) PyTorch module is exported as a float32 copy, the module itself
unchanged.  Before, the data was refused ("expects dtype float32, received dtype float64") and a float64 module
failed after lowering (ONNX Runtime has no float64 Conv)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quantkit.data import NpzDataset, as_dataset
from quantkit.data.base import InputInfo
from quantkit.errors import DataError


def _inputs() -> list[InputInfo]:
    return [InputInfo("x", np.dtype(np.float32), (None, 3))]


def test_float64_data_is_cast_and_other_dtypes_are_still_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantkit.data import base

    monkeypatch.setattr(base, "_CAST_TOLD", set())  # logged once per process: another test may have logged it
    x64 = np.linspace(-1, 1, 12).reshape(4, 3)
    with caplog.at_level("INFO", logger="quantkit"):
        for data in (x64, {"x": x64}, [x64[i] for i in range(4)], (b for b in (x64[:2], x64[2:]))):
            feed = next(iter(as_dataset(data, _inputs()).batches(4)))
            assert feed["x"].dtype == np.float32 and np.array_equal(feed["x"], x64.astype(np.float32)), type(data)
        np.savez(tmp_path / "d.npz", x=x64)
        ds = NpzDataset(tmp_path / "d.npz", ["x"])
        ds.validate(_inputs())
        assert next(iter(ds.batches(4)))["x"].dtype == np.float32
    assert "data for input 'x' is float64: cast to the model's float32" in caplog.text
    with pytest.raises(DataError, match="expects dtype float32.*received dtype int64"):
        as_dataset({"x": np.zeros((4, 3), np.int64)}, _inputs())
    np.savez(tmp_path / "i.npz", x=np.zeros((4, 3), np.int64))
    with pytest.raises(DataError, match="expects dtype float32.*received dtype int64"):
        NpzDataset(tmp_path / "i.npz", ["x"]).validate(_inputs())


def test_a_float64_torch_module_quantizes_and_is_left_as_it_was() -> None:
    import torch

    from quantkit.api import quantize

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)).double()
    net.train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    data = [torch.randn(4, 3, 16, 16, dtype=torch.float64) for _ in range(2)]
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(net, data, recipe, example_inputs=data[0], evaluation_data=data, progress=False)
    assert len(res.plan.layers) == 2
    fid = next(iter(res.report["quality"]["fidelity"].values()))
    assert fid["samples"] == 8 and fid["sqnr_db"] > 25
    assert net.training and all(v.dtype == torch.float64 for v in net.state_dict().values())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_token_ids_of_another_integer_width_are_cast_when_every_value_fits(tmp_path: Path) -> None:
    """int32 ids (what many tokenizers and torch.int32 tensors give) for an int64 model were refused; they are
    cast.  Values that do not fit the model's width still are refused, naming the input."""
    ids = [InputInfo("input_ids", np.dtype(np.int64), (None, 5))]
    x32 = np.arange(20, dtype=np.int32).reshape(4, 5)
    for data in ({"input_ids": x32}, [x32[i] for i in range(4)]):
        feed = next(iter(as_dataset(data, ids).batches(4)))
        assert feed["input_ids"].dtype == np.int64 and np.array_equal(feed["input_ids"], x32)
    np.savez(tmp_path / "ids.npz", input_ids=x32)
    ds = NpzDataset(tmp_path / "ids.npz", ["input_ids"])
    ds.validate(ids)
    assert next(iter(ds.batches(4)))["input_ids"].dtype == np.int64
    narrow = [InputInfo("input_ids", np.dtype(np.int32), (None, 5))]
    assert next(iter(as_dataset({"input_ids": x32.astype(np.int64)}, narrow).batches(4)))["input_ids"].dtype == np.int32
    with pytest.raises(DataError, match="expects dtype int32.*received dtype int64"):
        as_dataset({"input_ids": np.full((4, 5), 2**40, np.int64)}, narrow)
