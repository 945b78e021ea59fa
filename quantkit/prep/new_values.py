"""Fresh names and initializers for prep passes that add constants to a graph."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["NewValues"]


class NewValues:
    """Names unused by ``graph``'s nodes and initializers (``unique``), and float initializers registered under
    such a name (``initializer``)."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.used = {n.name for n in graph if n.name} | set(graph.initializers)

    def unique(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name

    def initializer(self, base: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=self.unique(base), const_value=ir.tensor(np.ascontiguousarray(array)))
        value.const_value.name = value.name  # type: ignore[union-attr]
        self.graph.register_initializer(value)
        return value
