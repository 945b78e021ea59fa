"""Identity elimination that keeps every graph's outputs what they were.

onnx_ir's ``IdentityEliminationPass`` (1.1) removes ``y = Identity(x)`` where ``y`` is a graph output by renaming
``x`` to ``y``.  That breaks three graphs real exporters write:

* ``x`` is itself a graph output (``outputs: y, y_copy = Identity(y)``): both outputs become one value, the
  model's output ``y`` disappears and ``y_copy`` is listed twice;
* ``x`` is a value of an enclosing graph (a branch of an ``If`` that returns an outer value unchanged: torch's
  export of ``out = h`` in one branch): the branch's output becomes an outer value, which ONNX Runtime refuses, and
  the outer value is renamed;
* ``x`` is another output of the same subgraph (a ``Scan`` body whose state and scan output are one value): the
  body lists one value twice and ONNX Runtime computes garbage for the Scan - silently.

:func:`eliminate_identities` removes an ``Identity`` only where that is exact: its output is no graph's output
(its readers then read ``x``), or its output is an output of the graph it lives in and ``x`` is produced by a node
of that same graph and is not itself an output, a graph input or an initializer of any graph (then ``x`` takes
the output's name).  Every other ``Identity`` stays; ONNX Runtime runs it as a copy.
"""

from __future__ import annotations

import onnx_ir as ir

from quantkit.irtools import all_graphs

__all__ = ["eliminate_identities"]


def _output_of(value: ir.Value, graphs: list[ir.Graph]) -> list[ir.Graph]:
    """The graphs that list ``value`` among their outputs."""
    return [g for g in graphs if any(o is value for o in g.outputs)]


def eliminate_identities(model: ir.Model) -> int:
    """Remove the ``Identity`` nodes of ``model`` (all its graphs) that can go exactly (module doc); returns how
    many were removed."""
    removed = 0
    graphs = all_graphs(model)  # removing an Identity adds or drops no subgraph
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1 \
                or len(node.outputs) != 1 or node.inputs[0] is None:
            continue
        graph = node.graph
        if not isinstance(graph, ir.Graph):
            continue
        x, y = node.inputs[0], node.outputs[0]
        owners = _output_of(y, graphs)
        if owners:
            producer = x.producer()
            if (owners != [graph] or producer is None or producer.graph is not graph or _output_of(x, graphs)
                    or x.is_graph_input() or x.is_initializer()):  # fmt: skip
                continue
        if x.type is None:
            x.type = y.type
        if x.shape is None:
            x.shape = y.shape
        ir.convenience.replace_all_uses_with(y, x, replace_graph_outputs=bool(owners))
        if owners:
            x.name = y.name
        graph.remove(node, safe=True)
        removed += 1
    return removed
