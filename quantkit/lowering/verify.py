"""Verify an emitted QDQ model: what did ONNX Runtime really fuse, layer by layer?

``optimized_graph`` loads a model in an ONNX Runtime CPU session with graph
optimizations on and returns the graph ORT will execute (saved by ORT into a
temporary directory, never the working directory; large initializers go to an
external-data file next to it). ``census`` counts its operators, the fused
quantized kernels and the ``QuantizeLinear`` / ``DequantizeLinear`` nodes that
were left unfused, and maps every layer that was meant to run quantized to the
node that now runs it.

What ORT does with node names (measured with ONNX Runtime 1.32, CPU EP)
----------------------------------------------------------------------
* ``ORT_ENABLE_EXTENDED`` runs the QDQ fusions. A fused ``DQ → Conv → Q`` group
  becomes ``QLinearConv`` **with the Conv's node name**; likewise
  ``QLinearMatMul``, ``MatMulIntegerToFloat`` (``com.microsoft``, float output),
  ``QLinearAdd`` … keep the name of the float node they replace. The fused node
  reads the *quantized weight initializer* (the DQ's input, e.g. ``w_q``) directly,
  and writes the output tensor of the ``QuantizeLinear`` that followed the layer.
* A float activation absorbed into the fused kernel (``Clip``/``Relu`` whose range
  contains the output quantization range) disappears; the kernel then writes the
  tensor of the ``QuantizeLinear`` that followed the activation.
* With int8 activations ORT converts them to uint8 itself (+128): tensors are
  renamed ``qdq_s8_to_u8_quant``, ``qdq_s8_to_u8_zp_conversion`` (with ``_token_<n>``
  suffixes), but node names and weight initializer names are kept.
* ``ORT_ENABLE_ALL`` then applies layout transforms: a ``QLinearConv`` becomes the
  ``com.microsoft`` NHWC ``QLinearConv`` named ``<conv name>_token_<n>`` between two
  new ``Transpose`` nodes named ``Transpose``, ``Transpose_token_<n>`` — and the
  NHWC node's *output tensor* is named after the original Conv. ORT's unique-name
  generator always appends ``_token_<n>`` when a name is taken.
* ``MatMul`` + ``Add`` (bias) is first rewritten by ``MatMulAddFusion`` into a
  ``Gemm`` named ``<matmul name>/MatMulAddFusion`` between two ``Reshape`` nodes
  (``gemm_input_reshape`` / ``gemm_output_reshape``); with a quantized output it
  becomes ``com.microsoft.QGemm`` of that name, with a float output the ``Gemm``
  stays float and its DQs stay (not ``MatMulIntegerToFloat``).
* ``DQ → Conv → Clip(0, 6) → Q`` with symmetric int8 (zero point 0) is not
  quantized at all: ``Conv`` + ``Clip`` become a float ``com.microsoft.FusedConv``
  that keeps the Conv's name, fed by the DQs. With uint8 zero point 0 (or int8
  zero point −128) the Clip is absorbed and the result is ``QLinearConv``. With an
  explicit ``Q → DQ`` between the Conv and the Clip, the Conv is fused either way;
  with symmetric int8 the Clip then runs in float between a leftover DQ and Q.

The mapping from an original layer to the optimized node that runs it
therefore works on the ``ORT_ENABLE_EXTENDED`` graph (the QDQ fusions are all
there, and no layout transform has renamed anything yet) and tries, in order:
(1) the same node name; (2) an optimized name derived from it by ORT's suffixes
(``<name>_token_<n>``, ``<name>/<Fusion>``); (3) the node that reads the layer's
own weight initializer (the input of its weight DQ, when no other layer uses
it); (4) the node that produces the layer's output tensor, or that of the
``QuantizeLinear`` consuming it (looking through ORT's inserted ``Reshape`` /
``Transpose``). Operator counts and leftover Q/DQ are taken at the requested
level; at ``"all"`` the per-layer note also names the NHWC kernel when there is one.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError

from quantkit.errors import LoweringError, ModelError, QuantkitError
from quantkit.irtools import proto_size

__all__ = [
    "QUANTIZED_KERNELS",
    "Census",
    "LayerFusion",
    "LeftoverQDQ",
    "census",
    "io_qdq_only",
    "optimized_graph",
]

Level = Literal["basic", "extended", "all"]

_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

#: Operator types (any domain) that run quantized arithmetic in ORT's CPU provider.
QUANTIZED_KERNELS: frozenset[str] = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QGemm",
        "QLinearAdd",
        "QLinearMul",
        "QLinearGlobalAveragePool",
        "QLinearAveragePool",
        "QLinearSigmoid",
        "QLinearLeakyRelu",
        "QLinearSoftmax",
        "QLinearConcat",
        "QLinearWhere",
        "QLinearReduceMean",
        "QLinearConvTranspose",
        "QAttention",
        "QEmbedLayerNormalization",
        "QOrderedMatMul",
        "DynamicQuantizeLSTM",
        "MatMulNBits",
        "MatMulBnb4",
        "GatherBlockQuantized",
        "NhwcMaxPool",  # uint8/int8 NHWC max pool produced from QDQ MaxPool
    }
)

_Q_OPS = frozenset({"QuantizeLinear"})
_DQ_OPS = frozenset({"DequantizeLinear"})
_QDQ_OPS = _Q_OPS | _DQ_OPS
# Layout / shape nodes that ORT inserts around fused kernels (NHWC transposes, Gemm reshapes).
_PASS_THROUGH = frozenset({"Transpose", "Reshape"})
_ACTIVATIONS = frozenset({"Clip", "Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh"})
_ORT_SUFFIX = re.compile(r"(_token_\d+)+$")
# Session-config keys that make ORT write big initializers of the optimized model to a side file.
_EXTERNAL_FILE_KEY = "session.optimized_model_external_initializers_file_name"
_EXTERNAL_MIN_KEY = "session.optimized_model_external_initializers_min_size_in_bytes"
_PROTO_LIMIT = 2**31 - 2**20  # stay clear of protobuf's 2 GiB message limit


@dataclass(frozen=True)
class LayerFusion:
    """How one original layer runs after ORT's graph optimizations.

    ``fused`` is True when the node that runs it is a quantized kernel
    (:data:`QUANTIZED_KERNELS`); ``kernel`` is that node's op type (None when no
    node of the optimized graph derives from the layer); ``note`` says how the
    mapping was found and, for an unfused layer, what ORT runs instead and why.
    """

    layer: str
    fused: bool
    kernel: str | None
    note: str


@dataclass(frozen=True)
class LeftoverQDQ:
    """A ``QuantizeLinear`` / ``DequantizeLinear`` that ORT did not fuse away."""

    name: str
    op_type: str
    input: str
    output: str
    consumers: tuple[str, ...]
    at_graph_input: bool
    at_graph_output: bool
    producer: str = ""  # op type of the node producing its input ("" for a graph input / initializer)
    feeds_requantize: bool = False  # its output reaches a QuantizeLinear through at most one float op
    q_feeds_kernel: bool = False  # a DQ whose codes come from a QuantizeLinear whose codes a quantized kernel reads

    def describe(self) -> str:
        """``"<op> '<name>': <input> -> <output> -> <consumers>"`` for reports."""
        feeds = ", ".join(self.consumers) if self.consumers else "nothing"
        return f"{self.op_type} {self.name!r}: {self.input} -> {self.output} -> {feeds}"


@dataclass(frozen=True)
class Census:
    """What ORT executes for a model at one optimization level.

    ``op_counts`` keys are op types, prefixed with the domain outside the ONNX
    domain (``"com.microsoft.QLinearConv"``). ``quantized_kernels`` counts the
    quantized kernels by bare op type, summed over domains (the NHWC
    ``com.microsoft.QLinearConv`` of level ``"all"`` counts as ``"QLinearConv"``).
    ``per_layer`` is always computed at level ``"extended"`` or lower (see the
    module docstring).
    """

    level: str
    op_counts: dict[str, int]
    quantized_kernels: dict[str, int]
    leftover_q: int
    leftover_dq: int
    leftover_qdq_nodes: list[str]
    per_layer: dict[str, LayerFusion]
    leftovers: tuple[LeftoverQDQ, ...] = ()
    graph_inputs: tuple[str, ...] = ()
    graph_outputs: tuple[str, ...] = ()

    @property
    def unfused_layers(self) -> list[str]:
        """Names of the ``per_layer`` entries that do not run as a quantized kernel."""
        return [name for name, fusion in self.per_layer.items() if not fusion.fused]


def _op_key(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def _check_level(level: str) -> ort.GraphOptimizationLevel:
    if level not in _LEVELS:
        raise QuantkitError(f"unknown optimization level {level!r}; allowed: {', '.join(_LEVELS)}")
    return _LEVELS[level]


def _load_structure(model: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    """The model's graph without loading external tensor data."""
    if isinstance(model, onnx.ModelProto):
        return model
    path = Path(model)
    if not path.is_file():
        raise ModelError(f"model file {str(path)!r} does not exist")
    try:
        return onnx.load(str(path), load_external_data=False)
    except (OSError, ValueError, DecodeError) as exc:
        raise ModelError(f"cannot read ONNX model {str(path)!r}: {exc}") from exc


def _optimize(
    model: onnx.ModelProto | str | Path,
    level: str,
    session_config: Mapping[str, str] | None,
    *,
    load_external_data: bool,
) -> onnx.ModelProto:
    opt_level = _check_level(level)
    config = dict(session_config or {})
    for key, value in config.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise QuantkitError(
                f"session_config entries must be str -> str, got {key!r}: {value!r} ({type(value).__name__})"
            )
    with tempfile.TemporaryDirectory(prefix="quantkit-verify-") as tmp:
        source: str | bytes
        if isinstance(model, onnx.ModelProto):
            if proto_size(model) < _PROTO_LIMIT:
                source = model.SerializeToString()
            else:
                source = os.path.join(tmp, "input.onnx")
                onnx.save_model(model, source, save_as_external_data=True, location="input.onnx.data")
        else:
            path = Path(model)
            if not path.is_file():
                raise ModelError(f"model file {str(path)!r} does not exist")
            source = str(path)
        options = ort.SessionOptions()
        options.graph_optimization_level = opt_level
        options.log_severity_level = 3  # level "all" warns that the saved graph is hardware specific
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        options.add_session_config_entry(_EXTERNAL_FILE_KEY, "optimized.onnx.data")
        options.add_session_config_entry(_EXTERNAL_MIN_KEY, "1024")
        for key, value in config.items():
            options.add_session_config_entry(key, value)
        try:
            ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
            raise LoweringError(f"ONNX Runtime could not load the model at level {level!r}: {exc}") from exc
        return onnx.load(options.optimized_model_filepath, load_external_data=load_external_data)


def optimized_graph(
    model: onnx.ModelProto | str | Path,
    *,
    level: Level = "all",
    session_config: dict[str, str] | None = None,
) -> onnx.ModelProto:
    """The graph ORT's CPU provider executes for ``model`` after optimizations at ``level``.

    ``session_config`` entries are passed to ``SessionOptions.add_session_config_entry``
    (e.g. ``{"session.qdq_matmulnbits_accuracy_level": "0"}``). The returned model is
    self-contained (external data loaded in memory). Graphs of level ``"all"`` contain
    hardware-specific operators: inspect them, do not ship them.

    Raises:
        QuantkitError: unknown ``level`` or a malformed ``session_config``.
        ModelError: ``model`` is a path that does not exist.
        LoweringError: ONNX Runtime refuses to create a session for the model.
    """
    return _optimize(model, level, session_config, load_external_data=True)


class _OptIndex:
    """Lookup tables over an optimized graph."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.initializers = {init.name for init in graph.initializer}
        self.graph_inputs = {value.name for value in graph.input}
        self.graph_outputs = {value.name for value in graph.output}
        self.by_name: dict[str, onnx.NodeProto] = {}
        self.by_derived: dict[str, list[onnx.NodeProto]] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        self.readers_of_init: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            if node.name:
                self.by_name.setdefault(node.name, node)
                for base in _derived_bases(node.name):
                    self.by_derived.setdefault(base, []).append(node)
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if not inp:
                    continue
                self.consumers.setdefault(inp, []).append(node)
                if inp in self.initializers:
                    self.readers_of_init.setdefault(inp, []).append(node)

    def through_moves(self, tensor: str) -> onnx.NodeProto | None:
        """The producer of the codes ``tensor``, looking back through the ops ONNX Runtime runs on int8 codes
        as they are (:data:`quantkit.ops.PASSTHROUGH`: Slice, Split, Reshape, MaxPool ...): the kernel (or the
        QuantizeLinear) the codes came from."""
        from quantkit.ops import PASSTHROUGH

        node = self.producer.get(tensor)
        seen = 0
        while (node is not None and (node.op_type in _PASS_THROUGH or node.op_type in PASSTHROUGH) and node.input
               and seen < 16):
            node = self.producer.get(node.input[0])
            seen += 1
        return node

    def reaches_kernel(self, tensor: str) -> bool:
        """Whether a quantized kernel reads the codes ``tensor``, directly or through the ops ONNX Runtime runs on
        codes as they are (the other outputs of a Split on the codes included)."""
        from quantkit.ops import PASSTHROUGH

        todo, seen = [tensor], 0
        while todo and seen < 64:
            seen += 1
            for c in self.consumers.get(todo.pop(), []):
                if c.op_type in QUANTIZED_KERNELS:
                    return True
                if c.op_type in _PASS_THROUGH or c.op_type in PASSTHROUGH:
                    todo.extend(o for o in c.output if o)
        return False

    def through_layout(self, tensor: str) -> onnx.NodeProto | None:
        """The producer of ``tensor``, looking back through ORT-inserted Reshape/Transpose."""
        node = self.producer.get(tensor)
        seen = 0
        while node is not None and node.op_type in _PASS_THROUGH and node.input and seen < 8:
            node = self.producer.get(node.input[0])
            seen += 1
        return node


def _derived_bases(name: str) -> list[str]:
    """Original names ORT may have derived ``name`` from (``x_token_3`` → ``x``; ``x/Fusion`` → ``x``)."""
    bases: list[str] = []
    stripped = _ORT_SUFFIX.sub("", name)
    if stripped and stripped != name:
        bases.append(stripped)
    for candidate in (name, stripped):
        for i, char in enumerate(candidate):
            if char == "/" and i > 0:
                bases.append(candidate[:i])
    return bases


class _OrigIndex:
    """Lookup tables over the model as emitted (before ORT)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.by_name = {node.name: node for node in graph.node if node.name}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers.setdefault(inp, []).append(node)
        self.initializers = {init.name for init in graph.initializer}

    def own_weights(self, layer: onnx.NodeProto) -> list[str]:
        """Initializers only ``layer`` reads, directly or through a DequantizeLinear it alone consumes."""
        own: list[str] = []
        for inp in layer.input[1:]:
            if not inp:
                continue
            producer = self.producer.get(inp)
            if producer is not None and producer.op_type in _DQ_OPS:
                if len(self.consumers.get(inp, [])) != 1 or not producer.input:
                    continue
                source = producer.input[0]
            else:
                source = inp
            if source in self.initializers and len(self.consumers.get(source, [])) == 1:
                own.append(source)
        return own

    def output_tensors(self, layer: onnx.NodeProto) -> list[str]:
        """The layer's outputs and the outputs of QuantizeLinear nodes consuming them."""
        tensors: list[str] = []
        for out in layer.output:
            if not out:
                continue
            tensors.append(out)
            for consumer in self.consumers.get(out, []):
                if consumer.op_type in _Q_OPS:
                    tensors.extend(o for o in consumer.output if o)
        return tensors


def _describe(node: onnx.NodeProto) -> str:
    return f"{_op_key(node)} {node.name!r}"


def _describe_consumer(node: onnx.NodeProto) -> str:
    """:func:`_describe`, with a Resize's interpolation mode when it is not ``nearest`` (``Resize(linear)``): only
    a nearest Resize runs on int8 codes in ONNX Runtime, so a float island is told from a stray by it."""
    if node.op_type == "Resize" and node.domain in ("", "ai.onnx"):
        mode = next((a.s.decode() for a in node.attribute if a.name == "mode"), "nearest")
        if mode != "nearest":
            return f"Resize({mode}) {node.name!r}"
    return _describe(node)


def _match(layer: onnx.NodeProto, orig: _OrigIndex, opt: _OptIndex) -> tuple[onnx.NodeProto | None, str]:
    """Find the optimized node that runs ``layer``, and how it was found."""
    exact = opt.by_name.get(layer.name)
    if exact is not None:
        return exact, "same node name"
    derived = opt.by_derived.get(layer.name, [])
    if derived:
        best = next((n for n in derived if n.op_type in QUANTIZED_KERNELS), derived[0])
        return best, f"node {best.name!r} derives its name from the layer"
    for weight in orig.own_weights(layer):
        readers = opt.readers_of_init.get(weight, [])
        if len(readers) == 1:
            return readers[0], f"node {readers[0].name!r} reads the layer's weight {weight!r}"
    for tensor in orig.output_tensors(layer):
        producer = opt.through_layout(tensor)
        if producer is not None and producer.op_type not in _QDQ_OPS:
            return producer, f"absorbed into {_describe(producer)}, which writes {tensor!r}"
    if layer.op_type in _ACTIVATIONS and layer.input:
        # An activation removed as redundant with the quantization range that follows it
        # (Q -> DQ -> Clip -> Q): the quantized kernel before it now feeds its consumers.
        tensor = layer.input[0]
        dq = orig.producer.get(tensor)
        if dq is not None and dq.op_type in _DQ_OPS and dq.input:
            tensor = dq.input[0]
        producer = opt.through_layout(tensor)
        if (
            producer is not None
            and producer.op_type in QUANTIZED_KERNELS
            and all(o not in opt.producer for o in layer.output)
        ):
            return (
                producer,
                f"removed; its range is enforced by the quantized output of {_describe(producer)}",
            )
    return None, ""


def _unfused_reasons(
    layer: onnx.NodeProto, node: onnx.NodeProto | None, orig: _OrigIndex, opt: _OptIndex
) -> list[str]:
    """Likely reasons why ``layer`` did not become a quantized kernel."""
    reasons: list[str] = []
    data_inputs = [inp for inp in layer.input if inp and inp not in orig.initializers]
    float_inputs = [
        inp for inp in data_inputs if (p := orig.producer.get(inp)) is None or p.op_type not in _DQ_OPS
    ]
    if float_inputs:
        reasons.append(f"input(s) {', '.join(map(repr, float_inputs))} are not produced by DequantizeLinear")
    outputs = [out for out in layer.output if out]
    for out in outputs:
        consumers = orig.consumers.get(out, [])
        if any(c.op_type in _Q_OPS for c in consumers):
            continue
        acts = [c for c in consumers if c.op_type in _ACTIVATIONS]
        if acts and all(
            any(cc.op_type in _Q_OPS for cc in orig.consumers.get(a.output[0], [])) for a in acts if a.output
        ):
            names = ", ".join(_describe(a) for a in acts)
            reasons.append(
                f"its output goes through {names} before QuantizeLinear; ORT absorbs the activation only "
                "when the output quantization range lies inside the activation's range (for ReLU6: uint8 "
                "zero point 0 or int8 zero point -128, not symmetric int8)"
            )
        elif layer.op_type in ("Conv", "Gemm", "Add", "Mul", "Concat") or not consumers:
            reasons.append(f"its output {out!r} is not quantized (no QuantizeLinear consumer)")
    if node is not None:
        dq_feeds = [
            p.name or p.output[0]
            for inp in node.input
            if inp and (p := opt.producer.get(inp)) is not None and p.op_type in _DQ_OPS
        ]
        if dq_feeds:
            reasons.append(f"it still reads dequantized inputs from {', '.join(map(repr, dq_feeds))}")
    return reasons


def _layer_fusion(name: str, orig: _OrigIndex, opt: _OptIndex, final: _OptIndex | None) -> LayerFusion:
    layer = orig.by_name.get(name)
    if layer is None:
        raise LoweringError(f"quantizable layer {name!r} is not a node of the model")
    node, how = _match(layer, orig, opt)
    if node is None:
        reasons = _unfused_reasons(layer, None, orig, opt)
        note = "no node of the optimized graph derives from it (removed or merged away)"
        return LayerFusion(name, False, None, "; ".join([note, *reasons]))
    fused = node.op_type in QUANTIZED_KERNELS
    parts = [f"runs as {_describe(node)} ({how})" if fused else f"runs as float {_describe(node)} ({how})"]
    if not fused:
        parts.extend(_unfused_reasons(layer, node, orig, opt))
    if final is not None:
        final_node = final.by_name.get(node.name) or next(iter(final.by_derived.get(node.name, [])), None)
        if final_node is not None and _op_key(final_node) != _op_key(node):
            parts.append(f"at level 'all' it is {_describe(final_node)}")
    return LayerFusion(name, fused, node.op_type, "; ".join(parts))


def _leftovers(opt: _OptIndex) -> list[LeftoverQDQ]:
    found: list[LeftoverQDQ] = []
    for node in opt.graph.node:
        if node.op_type not in _QDQ_OPS or not node.input or not node.output:
            continue
        data_in, data_out = node.input[0], node.output[0]
        consumers = [_describe_consumer(c) for c in opt.consumers.get(data_out, [])]
        if data_out in opt.graph_outputs:
            consumers.append(f"graph output {data_out!r}")
        prod = opt.through_layout(data_in)  # past ORT's NHWC Transposes
        if "Dequantize" in node.op_type:  # a DQ's codes: past int8 data movement (ORT moved the DQ below a Slice)
            prod = opt.through_moves(data_in)
        users = opt.consumers.get(data_out, [])
        requant = any(u.op_type in _QDQ_OPS and "Dequantize" not in u.op_type for u in users) or any(
            w.op_type in _QDQ_OPS and "Dequantize" not in w.op_type
            for u in users for o in u.output for w in opt.consumers.get(o, []))
        found.append(
            LeftoverQDQ(
                name=node.name,
                op_type=node.op_type,
                input=data_in,
                output=data_out,
                consumers=tuple(consumers),
                at_graph_input=data_in in opt.graph_inputs,
                at_graph_output=data_out in opt.graph_outputs,
                producer=prod.op_type if prod is not None else "",
                feeds_requantize=requant,
                q_feeds_kernel=("Dequantize" in node.op_type and prod is not None and prod.op_type in _QDQ_OPS
                                and "Dequantize" not in prod.op_type and opt.reaches_kernel(prod.output[0])),
            )
        )
    return found


def census(
    model: onnx.ModelProto | str | Path,
    *,
    level: Level = "all",
    quantizable: Iterable[str] | None = None,
    session_config: dict[str, str] | None = None,
) -> Census:
    """Count what ORT runs for ``model`` at ``level`` and map each ``quantizable`` layer to its kernel.

    Args:
        model: the emitted QDQ model (proto or path; external data is not loaded for the census).
        level: ORT graph optimization level for the counts and leftovers.
        quantizable: names of the original nodes (Conv, MatMul, Gemm, Add, ...) meant to run
            quantized; each gets a :class:`LayerFusion` in ``per_layer``.
        session_config: extra ORT session config entries (see :func:`optimized_graph`).

    Raises:
        LoweringError: ORT cannot load the model, or a ``quantizable`` name is not a node of it.
    """
    _check_level(level)
    original = _load_structure(model)
    optimized = _optimize(model, level, session_config, load_external_data=False)
    opt_index = _OptIndex(optimized.graph)

    op_counts = Counter(_op_key(node) for node in optimized.graph.node)
    kernels = Counter(node.op_type for node in optimized.graph.node if node.op_type in QUANTIZED_KERNELS)
    leftovers = _leftovers(opt_index)

    per_layer: dict[str, LayerFusion] = {}
    names = list(dict.fromkeys(quantizable or ()))
    if names:
        map_level = "extended" if level == "all" else level
        mapped = (
            opt_index
            if map_level == level
            else _OptIndex(_optimize(model, map_level, session_config, load_external_data=False).graph)
        )
        orig_index = _OrigIndex(original.graph)
        final = opt_index if mapped is not opt_index else None
        for name in names:
            per_layer[name] = _layer_fusion(name, orig_index, mapped, final)

    return Census(
        level=level,
        op_counts=dict(sorted(op_counts.items())),
        quantized_kernels=dict(sorted(kernels.items())),
        leftover_q=sum(1 for item in leftovers if item.op_type in _Q_OPS),
        leftover_dq=sum(1 for item in leftovers if item.op_type in _DQ_OPS),
        leftover_qdq_nodes=[item.describe() for item in leftovers],
        per_layer=per_layer,
        leftovers=tuple(leftovers),
        graph_inputs=tuple(value.name for value in original.graph.input),
        graph_outputs=tuple(value.name for value in original.graph.output),
    )


def io_qdq_only(
    result: Census,
    graph_inputs: Iterable[str] | None = None,
    graph_outputs: Iterable[str] | None = None,
) -> bool:
    """True when every leftover Q/DQ sits at the model boundary.

    A leftover ``QuantizeLinear`` is at the boundary when it reads a graph input;
    a leftover ``DequantizeLinear`` when it writes a graph output (or reads a graph
    input that is already quantized). ``graph_inputs`` / ``graph_outputs`` default to
    those of the model the census was taken on.
    """
    inputs = set(result.graph_inputs if graph_inputs is None else graph_inputs)
    outputs = set(result.graph_outputs if graph_outputs is None else graph_outputs)
    for item in result.leftovers:
        if item.op_type in _Q_OPS and not (item.input in inputs or item.output in outputs):
            return False
        if item.op_type in _DQ_OPS and not (item.output in outputs or item.input in inputs):
            return False
    return True
