"""Give every node of the main graph a unique, non-empty name.

Rule
----
Quantization recipes, calibration statistics and reports are keyed by node
name, so every node needs one and no two may share one. Names that exist and
are unique are never touched. Walking the graph in order:

* a node without a name gets ``<op_type>_<i>``, with ``i`` the smallest
  integer (per op type, counting from 0) giving a name not used anywhere in the
  graph;
* a node whose name was already taken by an earlier node gets
  ``<name>_<i>`` in the same way (the first node keeps the name).

The result depends only on the graph's node order, so running the pass on the
same graph twice gives the same names. There is no math here: the pass changes
names only, never values or topology.
"""

from __future__ import annotations

import collections

import onnx_ir as ir

__all__ = ["NameNodesPass"]


class NameNodesPass(ir.passes.InPlacePass):
    """Assign ``<op_type>_<index>`` to unnamed nodes and make duplicate names unique.

    ``PassResult.modified`` is True when a name changed; ``renamed`` holds how many
    nodes were (re)named by the last call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.renamed = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Name the nodes of ``model.graph`` (subgraphs of control-flow nodes included)."""
        nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
        reserved = {node.name for node in nodes if node.name}
        used: set[str] = set()
        counters: collections.Counter[str] = collections.Counter()
        self.renamed = 0
        for node in nodes:
            name = node.name
            if name and name not in used:
                used.add(name)
                continue
            base = name if name else node.op_type
            while True:
                candidate = f"{base}_{counters[base]}"
                counters[base] += 1
                if candidate not in used and candidate not in reserved:
                    break
            node.name = candidate
            used.add(candidate)
            self.renamed += 1
        return ir.passes.PassResult(model, modified=self.renamed > 0)
