"""PyTorch modules in the forms users hand over: a dict / ModelOutput result keeps its keys as output names (they
were linear_1, linear_2), a forward(*xs) and a torch.compile'd module export (both failed in torch.export's
dynamic-shapes check), and calibration tensors that require grad are read (np.asarray raised a raw
RuntimeError)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import quantkit  # noqa: E402
from quantkit.frontends import from_torch  # noqa: E402

RECIPE = {"version": 1, "name": "forms", "report": {"latency": {"enabled": False}}}


class _Heads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 32)
        self.cls = torch.nn.Linear(32, 10)
        self.box = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.body(x))
        return {"logits": self.cls(h), "boxes": self.box(h)}


class _VarArgs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fc(xs[0] + xs[1])


def test_dict_outputs_keep_their_keys_as_names() -> None:
    model = from_torch(_Heads().eval(), torch.randn(2, 16))
    assert [v.name for v in model.graph.outputs] == ["logits", "boxes"]
    data = [np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)]
    res = quantkit.quantize(_Heads().eval(), data, RECIPE, example_inputs=torch.randn(2, 16), evaluation_data=data,
                            progress=False)
    assert set(res.report["fidelity"]) == {"logits", "boxes"}


def test_varargs_and_compiled_modules_export_with_a_dynamic_batch() -> None:
    m = from_torch(_VarArgs().eval(), (torch.randn(2, 16), torch.randn(2, 16)))
    assert [str(v.shape[0]) for v in m.graph.inputs] == ["batch", "batch"]
    compiled = torch.compile(_Heads().eval())
    m = from_torch(compiled, torch.randn(2, 16))
    assert [v.name for v in m.graph.outputs] == ["logits", "boxes"]


def test_calibration_tensors_that_require_grad_are_read() -> None:
    data = [torch.randn(4, 16, requires_grad=True) for _ in range(3)]
    res = quantkit.quantize(_Heads().eval(), data, RECIPE, example_inputs=torch.randn(2, 16), evaluate=False,
                            progress=False)
    assert res.plan.layers and all(t.requires_grad for t in data)


def test_data_of_other_sizes_than_the_example_says_how_to_export_with_free_sizes() -> None:
    from quantkit.errors import DataError

    data = [np.zeros((2, 24), np.float32)]
    fc = torch.nn.Linear(16, 4)
    with pytest.raises(DataError, match=r"the calibration data: input .* has shape \[1, 24\].*exported with the "
                                        r"sizes of example_inputs.*dynamic_dims="):
        quantkit.quantize(fc, data, RECIPE, example_inputs=torch.randn(2, 16), progress=False)


def test_a_later_sample_of_another_size_is_named_with_the_hint_too() -> None:
    from quantkit.errors import DataError

    data = [np.zeros((2, 16), np.float32), np.zeros((2, 24), np.float32)]
    with pytest.raises(DataError, match=r"input .* of sample 2 has shape \[1, 24\].*dynamic_dims="):
        quantkit.quantize(torch.nn.Linear(16, 4), data, RECIPE, example_inputs=torch.randn(2, 16), progress=False)
