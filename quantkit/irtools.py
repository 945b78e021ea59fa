"""Small helpers over ``onnx_ir`` models that keep their weights where they are.

A 135M-parameter decoder holds ~0.5 GB of float32 weights; ``onnx_ir.to_proto`` copies every one of them into the
proto and ``SerializeToString`` copies them once more.  Where only the graph is needed (a probe graph that is fed
its weights, a cache key), these helpers serialize it without them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["detached_initializers", "model_digest", "weightless_proto"]


@contextmanager
def detached_initializers(model: ir.Model, names: Iterable[str] | None = None) -> Iterator[list[tuple[str, Any]]]:
    """Inside the block, ``model``'s initializers ``names`` (all of them when None) are not initializers (the
    values stay where nodes read them); yields ``[(name, value)]`` of those, in the graph's order.  On exit every
    initializer is back, in its original order (also on error)."""
    inits = model.graph.initializers
    saved = list(inits.items())
    wanted = None if names is None else set(names)
    moved = [(n, v) for n, v in saved if wanted is None or n in wanted]
    for n, _ in moved:
        inits.pop(n)
    try:
        yield moved
    finally:
        inits.clear()
        for n, v in saved:
            inits[n] = v


def weightless_proto(model: ir.Model, names: Iterable[str] | None = None) -> tuple[onnx.ModelProto, list[tuple[str, Any]]]:
    """``model`` as a proto without the initializers ``names`` (all when None) and those ``[(name, value)]``."""
    with detached_initializers(model, names) as moved:
        return ir.to_proto(model), moved


def model_digest(model: ir.Model) -> str:
    """sha256 over the graph (serialized without weights) and every initializer's name, type, shape and bytes in
    order, one tensor at a time: a cache key of the model that never holds a second copy of its weights."""
    proto, moved = weightless_proto(model)
    h = hashlib.sha256(proto.SerializeToString())
    del proto
    for name, v in moved:
        h.update(f"\0{name}\0".encode())
        t = v.const_value
        if t is None:
            h.update(b"<no value>")
            continue
        h.update(f"{t.dtype}:{list(t.shape)}\0".encode())
        arr = np.ascontiguousarray(t.numpy())
        h.update(repr(arr.tolist()).encode() if arr.dtype == object else arr.reshape(-1).view(np.uint8).data)
    return h.hexdigest()
