"""Fresh initializers for prep passes that add constants to a graph (names from the lowering's ``_Namer``)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantkit.lowering.qdq import _Namer

__all__ = ["NewValues"]


class NewValues:
    """Float initializers registered in ``graph`` under names no node, value or initializer of it uses."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.unique = _Namer(graph)

    def initializer(self, base: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=self.unique(base), const_value=ir.tensor(np.ascontiguousarray(array)))
        value.const_value.name = value.name  # type: ignore[union-attr]
        self.graph.register_initializer(value)
        return value
