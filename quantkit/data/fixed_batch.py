"""Models whose inputs fix the batch dimension.

Many exported models have a static batch (``[1, 3, 224, 224]``: a legacy ``torch.onnx.export`` without
``dynamic_axes``, a TensorFlow conversion).  quantkit runs its data in batches of the recipe's sizes (evaluation
8 by default) and, for its per-layer probes and kernel checks, one sample at a time; a model fixed at batch 1
takes every batch one sample at a time instead (:class:`FixedBatchOne`).  A model fixed at a larger batch cannot
be fed single samples, so it is refused when its data is bound, with what to do instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from quantkit.data.base import Dataset, InputInfo
from quantkit.errors import DataError

__all__ = ["FixedBatchOne", "bind_fixed_batch", "fixed_batch"]

log = logging.getLogger("quantkit")


def fixed_batch(inputs: list[InputInfo]) -> tuple[int, str] | None:
    """``(batch, input name)`` when every data input of rank >= 1 fixes its first dimension (to the same size);
    None when any leaves it dynamic (or no input has a known rank)."""
    fixed: list[tuple[int, str]] = []
    for info in inputs:
        if info.shape is None or len(info.shape) == 0:
            continue
        if info.shape[0] is None:
            return None
        fixed.append((int(info.shape[0]), info.name))
    if not fixed:
        return None
    sizes = {b for b, _ in fixed}
    if len(sizes) > 1:  # inputs of different leading sizes: not a batch dimension
        return None
    return fixed[0]


class FixedBatchOne:
    """A dataset for a model fixed at batch 1: ``batches(n)`` yields one sample at a time whatever ``n``.

    Attributes:
        inner: the wrapped dataset (``len``, the fingerprint and the rest delegate to it).
    """

    def __init__(self, inner: Any, input_name: str) -> None:
        self.inner = inner
        self.input_name = input_name
        self._told = False

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        if batch_size != 1 and not self._told:
            log.info("the model's input %r fixes the batch at 1: batches of %d are fed one sample at a time",
                     self.input_name, batch_size)  # fmt: skip
            self._told = True
        yield from self.inner.batches(1)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "input_name", "_told"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def bind_fixed_batch(ds: Dataset, inputs: list[InputInfo]) -> Dataset:
    """``ds`` for a model whose ``inputs`` (data inputs, no KV cache) fix the batch: wrapped in
    :class:`FixedBatchOne` at batch 1; ``ds`` itself when the batch is dynamic.

    Raises:
        DataError: the inputs fix the batch at more than 1."""
    got = fixed_batch(inputs)
    if got is None or isinstance(ds, FixedBatchOne):
        return ds
    size, name = got
    if size == 1:
        return FixedBatchOne(ds, name)
    raise DataError(
        f"model input {name!r} fixes the batch dimension at {size}; quantkit feeds its calibration and evaluation "
        "samples one at a time to measure every layer, so the batch must be 1 or dynamic. Allowed: a model exported "
        f"with a dynamic batch (torch.onnx.export(..., dynamic_axes={{{name!r}: {{0: 'batch'}}}}) or dynamic_shapes) "
        "or at batch 1"
    )
