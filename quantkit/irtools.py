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

__all__ = ["all_graphs", "detached_initializers", "model_digest", "proto_size", "weightless_proto"]


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


_SAME_TYPE_OPS = frozenset({
    "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "GlobalAveragePool", "AveragePool", "MaxPool",
    "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Identity", "Slice", "Concat",
    "Split", "Expand", "Tile", "Pad", "Resize", "Gather", "DepthToSpace", "SpaceToDepth", "Add", "Sub", "Mul",
    "Div", "MatMul", "Gemm", "Conv", "ConvTranspose", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin",
    "Softmax", "LayerNormalization", "Erf", "Sqrt", "Pow", "Neg", "Abs", "Where",
})


def fill_missing_types(model: ir.Model) -> int:
    """Give node outputs that carry a shape but no element type (what rewrites and the lowering leave on new
    values) their type: a QuantizeLinear's is its zero point's, a DequantizeLinear's its scale's, a
    type-preserving op's (layout, pooling, activations, arithmetic) its data input's.  Untyped values are dropped
    from the serialized model with one stderr line each ("The value type for shape ... is not known").  Returns
    how many were filled."""
    filled = 0
    for node in model.graph.all_nodes():
        for out in node.outputs:
            if out.type is not None:
                continue
            src: ir.Value | None = None
            if node.op_type == "QuantizeLinear" and len(node.inputs) > 2:
                src = node.inputs[2]
            elif node.op_type == "DequantizeLinear" and len(node.inputs) > 1:
                src = node.inputs[1]
            elif node.op_type in _SAME_TYPE_OPS and node.domain in ("", "ai.onnx"):
                src = node.inputs[1] if node.op_type == "Where" and len(node.inputs) > 1 else (
                    node.inputs[0] if node.inputs else None)
            if src is not None and src.type is not None:
                out.type = src.type
                filled += 1
            elif src is not None and src.const_value is not None:
                out.type = ir.TensorType(src.const_value.dtype)
                filled += 1
    return filled


def _piece_size(msg: Any) -> int:
    """One sub-message's serialized size; a tensor over protobuf's limit by its raw bytes."""
    try:
        return int(msg.ByteSize())
    except Exception:  # noqa: BLE001 - protobuf's EncodeError beyond 2 GB (its type depends on the backend)
        raw = getattr(msg, "raw_data", b"")
        return len(raw) + 1024


def proto_size(proto: Any) -> int:
    """The serialized size of the ``onnx.ModelProto`` ``proto`` in bytes - also of a model over protobuf's 2 GB
    limit, where ``ByteSize()`` raises (a model loaded with its external data: the weights inline): then the sum of
    its parts' sizes (initializers, nodes with their subgraphs, functions), a close upper bound."""
    try:
        return int(proto.ByteSize())
    except Exception:  # noqa: BLE001 - see _piece_size
        g = proto.graph
        parts = [*g.initializer, *g.sparse_initializer, *g.node, *g.input, *g.output, *g.value_info,
                 *proto.functions, *proto.metadata_props, *proto.opset_import]
        return sum(_piece_size(m) for m in parts) + 1024


def all_graphs(model: ir.Model) -> list[ir.Graph]:
    """``model``'s main graph and every subgraph (``If`` / ``Loop`` / ``Scan`` bodies, nested), main graph first."""
    out = [model.graph]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                out.append(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                out.extend(attr.as_graphs())
    return out
