"""Weights computed in the graph from constants, folded into constants (exact: ONNX Runtime computes them).

Weight standardization (BiT, timm's ``StdConv2d``, NFNets) exports as ``W -> Reshape -> BatchNormalization
(training_mode=1) -> Reshape -> Conv``, other models scale, transpose or concatenate their weights in the graph:
a weight input that is not a constant leaves the layer in float ("weight is not a constant").  onnxscript's
folding stops at ops it has no rule for (a training-mode ``BatchNormalization``) and at layout ops quantkit keeps
unfolded on purpose (a table read twice - a tied embedding and its lm_head's ``Transpose`` - would become two
copies).

:func:`fold_weight_subgraphs` takes the rest: for every ``Conv`` / ``ConvTranspose`` / ``Gemm`` / ``MatMul``
whose weight input (input 1) - and every ``LSTM`` / ``GRU`` / ``RNN`` whose ``W`` or ``R`` - is computed only from
constants, by nodes whose outputs feed nothing else and whose
large constants are read by nothing else (a shared table - a tied embedding - is left alone), the weight is
evaluated once by ONNX Runtime (every such weight of the model in one session, the way the float model computes
it) and becomes an initializer; the nodes that computed it and the constants only they read are removed.  Nothing random (``RandomNormal`` ...) or stateful is folded.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir

log = logging.getLogger("quantkit")

__all__ = ["fold_weight_subgraphs"]

_CONSUMERS = {"Conv": (1,), "ConvTranspose": (1,), "Gemm": (1,), "MatMul": (1,), "LSTM": (1, 2), "GRU": (1, 2),
              "RNN": (1, 2)}
"""The weight inputs of each layer op (a recurrent layer's ``W`` and ``R``: the dynamo exporter writes them as
``Concat`` nodes of ``Slice`` nodes of the parameters, reordering the gates)."""
_NEVER = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                    "Bernoulli", "If", "Loop", "Scan", "SequenceConstruct", "SplitToSequence"})
MAX_NODES = 64
"""Largest subgraph folded for one weight."""
MAX_ELEMENTS = 1 << 26
"""Largest total of constant elements a subgraph may read (and of the weight it computes)."""
SMALL_SHARED = 4096
"""A constant a subgraph reads may also be read elsewhere only when it is this small (a shape, a scale): a larger
one - a tied embedding table under the lm_head's ``Transpose`` - would be copied by the folding."""


def _subgraph(weight: ir.Value, consumer: ir.Node) -> list[ir.Node] | None:
    """The nodes computing ``weight`` from constants only, each output read only inside the subgraph (or, for
    ``weight``, only by ``consumer``); None when there is no such subgraph."""
    if weight.const_value is not None or weight.producer() is None or weight.is_graph_output():
        return None
    if any(user is not consumer for user, _ in weight.uses()):
        return None
    nodes: dict[int, ir.Node] = {}
    stack = [weight.producer()]
    elements = 0
    while stack:
        node = stack.pop()
        if node is None or id(node) in nodes:
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER or len(nodes) >= MAX_NODES:
            return None
        if any(isinstance(a, ir.Attr) and a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
               for a in node.attributes.values()):
            return None
        nodes[id(node)] = node
        for v in node.inputs:
            if v is None:
                continue
            if v.const_value is not None:
                elements += int(v.const_value.size)
                continue
            if v.producer() is None or v.is_graph_input():
                return None  # a graph input: not a constant
            stack.append(v.producer())
    if elements > MAX_ELEMENTS:
        return None
    inside = set(nodes)
    for node in nodes.values():  # a large constant also read outside (a tied table): folding would copy it
        for v in node.inputs:
            if (v is not None and v.const_value is not None and v.const_value.size > SMALL_SHARED
                    and any(id(user) not in inside for user, _ in v.uses())):
                return None
    for node in nodes.values():
        for out in node.outputs:
            if out is weight:
                continue
            if out.is_graph_output() or any(id(user) not in inside for user, _ in out.uses()):
                return None  # read elsewhere too: folding would duplicate it
    return list(nodes.values())


def fold_weight_subgraphs(model: ir.Model) -> int:
    """Fold every weight computed from constants (module doc); returns the number of weights folded."""
    graph = model.graph
    found: list[tuple[ir.Node, ir.Value, list[ir.Node]]] = []
    index: list[int] = []
    for node in graph:
        if node.op_type not in _CONSUMERS or node.domain not in ("", "ai.onnx"):
            continue
        for i in _CONSUMERS[node.op_type]:
            w = node.inputs[i] if len(node.inputs) > i else None
            sub = _subgraph(w, node) if w is not None else None
            if sub is not None:
                found.append((node, w, sub))  # type: ignore[arg-type]
                index.append(i)
    if not found:
        return 0
    from quantkit.lowering.nbits import _const, _drop_if_unused
    from quantkit.lowering.qdq import _Namer

    values = _evaluate(model, found)
    if values is None:
        return 0
    namer = _Namer(graph)
    folded = 0
    for (node, w, _sub), i, arr in zip(found, index, values, strict=True):
        if arr.size <= MAX_ELEMENTS:
            node.replace_input_with(i, _const(graph, namer, f"{w.name or node.name}_folded", arr))
            folded += 1
    order = {id(n): i for i, n in enumerate(graph)}
    dead = sorted({id(n): n for _, _, sub in found for n in sub}.values(), key=lambda n: -order[id(n)])
    consts = {id(v): v for n in dead for v in n.inputs if v is not None and v.const_value is not None}
    for n in dead:  # consumers first: each is unused once those after it are gone
        if all(not out.uses() and not out.is_graph_output() for out in n.outputs):
            graph.remove(n, safe=True)
    for v in consts.values():  # the raw weights the folded ones replace: not kept beside them
        if not v.is_graph_input():
            _drop_if_unused(graph, v)
    return folded


def _evaluate(model: ir.Model, found: list[tuple[ir.Node, ir.Value, list[ir.Node]]]) -> list[np.ndarray] | None:
    """Every found weight, computed by ONNX Runtime in one session over the subgraphs and their constants; None
    (nothing folded, logged) when ONNX Runtime cannot run them apart from the model."""
    import onnxruntime as ort

    nodes: dict[int, ir.Node] = {}
    for _, _, sub in found:
        for n in sub:
            nodes[id(n)] = n
    order = {id(n): i for i, n in enumerate(model.graph)}
    protos = [ir.serde.serialize_node(n) for n in sorted(nodes.values(), key=lambda n: order[id(n)])]
    inits: dict[str, onnx.TensorProto] = {}
    for n in nodes.values():
        for v in n.inputs:
            if v is not None and v.const_value is not None and v.name not in inits:
                inits[v.name or ""] = onnx.numpy_helper.from_array(np.asarray(v.const_value.numpy()), v.name or "")
    outs = [onnx.helper.make_tensor_value_info(w.name or "", int(w.dtype) if w.dtype is not None else 1, None)
            for _, w, _ in found]
    g = onnx.helper.make_graph(protos, "weights", [], outs, list(inits.values()))
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items() if d in ("", "ai.onnx")]
    proto = onnx.helper.make_model(g, opset_imports=opsets or [onnx.helper.make_opsetid("", 17)])
    proto.ir_version = min(model.ir_version or 8, 10)
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return [np.asarray(a) for a in sess.run([w.name or "" for _, w, _ in found], {})]
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises several types: those layers stay float
        log.info("graph preparation: the weights %s computed in the graph were not folded (%s); their layers "
                 "stay float", [w.name for _, w, _ in found][:3], exc)
        return None
