"""Prepare a float ONNX model for calibration and quantization.

Rule
----
``prepare`` runs, in this order, on the ``onnx_ir`` model (in place):

1. ``name_nodes`` — every node gets a unique non-empty name (before any other
   pass, so that names given later by library passes never replace ours); then a float16 model is rewritten
   to compute in float32, its float16 inputs and outputs kept through ``Cast`` nodes
   (:mod:`quantkit.prep.float16`).
2. ``shape_inference`` — ONNX shape inference (``onnx_ir`` ``ShapeInferencePass``,
   non-strict: a node it cannot infer keeps its old type/shape).
3. ``constant_folding`` (optional) — ``onnxscript.optimizer`` constant folding
   (subgraphs whose inputs are all constant are evaluated once; Q/DQ are never
   folded; weight arithmetic - standardization, normalization - also beyond onnxscript's
   size limits, so a computed weight becomes a constant and its layer quantizable), then every
   ``Constant`` node is lifted to an initializer.
4. ``fold_batchnorm`` — ``BatchNormalization`` folded into the preceding
   Conv / Gemm / MatMul(+Add) (see :mod:`quantkit.prep.fold_batchnorm` for the math), and into a
   MatMul(+Add) read through a Reshape / Transpose that keeps its features whole (a ``BatchNorm1d`` after a
   ``Linear`` on a sequence: :mod:`quantkit.prep.fold_batchnorm_layout`), then ``fold_pad`` — a zero ``Pad``
   folded into the ``Conv`` it feeds (:mod:`quantkit.prep.fold_pad`), so no Pad sits between a DQ and its Conv; then
   ``parallel_convs`` — convolutions of one input that are summed (a re-parameterisable block's 3x3, 1x3 and 3x1
   branches) become one convolution (:mod:`quantkit.prep.parallel_convs`); then ``global_pool`` — a
   spatial ``ReduceMean`` becomes ``GlobalAveragePool`` (:mod:`quantkit.prep.global_pool`), which
   ONNX Runtime fuses in int8 (it leaves a QDQ ReduceMean in float); then ``hard_swish`` — ``HardSwish(x)``
   becomes ``x * HardSigmoid(x)``, its definition (:mod:`quantkit.prep.hard_swish`), two nodes that lower to
   ``QLinearAdd`` + ``QLinearMul`` (ONNX Runtime has no QDQ fusion for ``HardSwish``); then ``erf_gelu`` - GELU
   written as ``x * 0.5 * (1 + Erf(x / sqrt 2))`` becomes one ``com.microsoft.Gelu`` (its tanh approximation one
   ``com.microsoft.FastGelu``), the node ONNX Runtime's own fusion makes of it in a float model, which its QDQ
   propagation can no longer split into stray Q/DQ pairs (:mod:`quantkit.prep.erf_gelu`); then ``preact_batchnorm`` -
   a remaining (pre-activation) ``BatchNormalization -> Relu -> Conv`` becomes ``Add(x, b/a) -> Relu -> Conv(W * a)``
   when every channel's scale ``a`` is positive (:mod:`quantkit.prep.preact_batchnorm`), so that it lowers to
   ``QLinearAdd`` instead of a float island.
5. ``identity_elimination``, ``unused_removal`` (dead nodes and initializers).
6. ``topological_sort``, ``name_nodes`` again (for nodes created above), value
   names made unique, and a last shape inference so every value a calibrator
   might observe has a type and, where inferable, a shape.

The opset imports are left as they are, except that a model older than opset 13 (:data:`MIN_OPSET`), or newer
than this ONNX Runtime's QuantizeLinear / DequantizeLinear kernels, is first converted with
``onnx.version_converter`` (:func:`upgrade_opset`). Every transform preserves the model's
function: ``f_prepared(x) == f(x)`` up to float rounding (BN folding reorders
a multiply and an add).

``PrepResult.applied`` counts per transform: nodes removed for the folding and
elimination passes (``unused_removal`` also counts removed initializers),
rule applications for ``fold_batchnorm``, renamed nodes for ``name_nodes``, and
1/0 (changed or not) for shape inference and the topological sort.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import _constant_folding

from quantkit.errors import ModelError
from quantkit.prep.erf_gelu import fuse_erf_gelu
from quantkit.prep.fold_batchnorm import fold_batchnorm_rules
from quantkit.prep.fold_batchnorm_layout import fold_batchnorm_through_layout
from quantkit.prep.fold_pad import fold_pad_rules
from quantkit.prep.global_pool import global_pool_rules
from quantkit.prep.hard_swish import hard_swish_rules
from quantkit.prep.name_nodes import NameNodesPass
from quantkit.prep.preact_batchnorm import preact_batchnorm

__all__ = ["MIN_OPSET", "PrepResult", "check_weights", "prepare", "upgrade_opset"]

log = logging.getLogger("quantkit")

MIN_OPSET = 13
"""The oldest default-domain opset quantkit works in (per-axis QuantizeLinear / DequantizeLinear, Squeeze / Split
with input axes): an older model is converted with ``onnx.version_converter`` before any work, so that no
operator keeps attributes its emitted opset no longer has (Clip's ``min`` / ``max`` in opset < 11)."""


@dataclass
class PrepResult:
    """The prepared model and how many times each transform changed it."""

    model: ir.Model
    applied: dict[str, int] = field(default_factory=dict)


def _node_count(model: ir.Model) -> int:
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


def _run(step: str, pass_: Callable[[ir.Model], ir.passes.PassResult], model: ir.Model) -> bool:
    """Run one in-place pass; turn library failures into a ModelError naming the step."""
    try:
        result = pass_(model)
    except (ir.passes.PassError, ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(
            f"graph preparation step {step!r} failed on graph {model.graph.name!r}: {exc}"
        ) from exc
    return bool(result.modified)


def _run_counting_nodes(step: str, pass_: Callable[[ir.Model], ir.passes.PassResult], model: ir.Model) -> int:
    before = _node_count(model)
    _run(step, pass_, model)
    return max(before - _node_count(model), 0)


# ONNX exporters compute small constants (e.g. the pads of TF-style "same" padding) with
# ConstantOfShape, which onnxscript never folds by default so as not to materialize large
# tensors; up to this many elements folding it is harmless and lets the rest of the chain fold.
_SMALL_CONSTANT_OF_SHAPE = 4096


# Weights computed from weights (weight standardization - BiT / NFNet "StdConv" -, weight normalization):
# onnxscript's size limits (8192 input elements) leave a 64 x 32 x 3 x 3 kernel unfolded,
# and a layer whose weight is not a constant stays float.  ONNX Runtime folds them at session creation anyway.  Only
# ops whose output is no larger than their (broadcast) inputs (no Expand / Tile / ConstantOfShape here).
_WEIGHT_MATH = frozenset({
    "Add", "Sub", "Mul", "Div", "Sqrt", "Pow", "Reciprocal", "Neg", "Abs", "Exp", "Log", "Max", "Min", "Clip",
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceMax", "ReduceMin",
})
# Not layout ops (Transpose, Reshape, Cast ...): folded, a weight read twice - a tied embedding and its lm_head's
# Transpose - becomes two copies, and the patterns that keep one table (quantkit.weight_only) no longer match.
_WEIGHT_FOLD_ELEMENTS = 1 << 24
"""Largest constant input (elements) of a :data:`_WEIGHT_MATH` node folded beyond onnxscript's limits."""


def _should_fold(node: ir.Node) -> bool | None:
    """Also fold small ``ConstantOfShape`` nodes and the weight math of :data:`_WEIGHT_MATH` on constants up to
    :data:`_WEIGHT_FOLD_ELEMENTS`; defer to onnxscript's rules for everything else."""
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "ConstantOfShape":
        shape = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
        if shape is not None and int(np.prod(shape.numpy(), dtype=np.int64)) <= _SMALL_CONSTANT_OF_SHAPE:
            return True
    elif node.op_type in _WEIGHT_MATH:
        consts = [v.const_value if v is not None else None for v in node.inputs]
        if consts and all(c is not None for c in consts):
            sizes = [int(c.size) for c in consts if c is not None]
            try:  # an elementwise op's output is the broadcast of its inputs
                out = int(np.prod(np.broadcast_shapes(*(c.shape.numpy() for c in consts if c is not None))))
            except ValueError:  # not broadcastable (a Reshape's shape input): the output is its data input's size
                out = max(sizes, default=0)
            if max(sizes + [out]) <= _WEIGHT_FOLD_ELEMENTS and sum(sizes) <= 2 * _WEIGHT_FOLD_ELEMENTS:
                return True
    return None


def _shape_inference(step: str, model: ir.Model) -> int:
    return int(_run(step, common_passes.ShapeInferencePass(strict_mode=False), model))


RUNNABLE_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
"""Operator domains ONNX Runtime's CPU provider implements (model-local functions are runnable too)."""


def check_runnable(model: ir.Model) -> None:
    """Refuse a model with operators of a domain ONNX Runtime's CPU provider cannot run, naming them,
    before any work (ONNX Runtime would fail later with a raw NOT_IMPLEMENTED traceback)."""
    local = {(f.domain, f.name) for f in model.functions.values()}
    bad = [n for n in model.graph.all_nodes() if n.domain not in RUNNABLE_DOMAINS and (n.domain, n.op_type) not in local]
    if bad:
        n = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ModelError(
            f"node {n.name or '(unnamed)'!r} is {n.op_type!r} of domain {n.domain!r}, which ONNX Runtime's CPU "
            f"provider cannot run{more}; allowed domains: {sorted(RUNNABLE_DOMAINS)} (or model-local functions)"
        )


_KNOWN_QDQ_OPSET = 21
"""A default-domain opset at which every supported ONNX Runtime runs QuantizeLinear / DequantizeLinear; a newer
model's opset is probed (:func:`qdq_opset_limit`)."""


@functools.cache
def _qdq_runs(opset: int) -> bool:
    """Whether this ONNX Runtime has QuantizeLinear / DequantizeLinear kernels at default-domain ``opset`` (a tiny
    session, a few milliseconds)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
        "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array(0.1, np.float32), "s"), numpy_helper.from_array(np.array(0, np.uint8), "z")],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = onnx.IR_VERSION
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            None, {"x": np.zeros(2, np.float32)})
    except Exception:  # noqa: BLE001 - NOT_IMPLEMENTED / INVALID_GRAPH / ...: not runnable at this opset
        return False
    return True


def qdq_opset_limit(version: int) -> int | None:
    """``version`` when this ONNX Runtime runs QuantizeLinear / DequantizeLinear at that default-domain opset, else
    the newest opset below it where it does (None: none down to :data:`MIN_OPSET`)."""
    if version <= _KNOWN_QDQ_OPSET or _qdq_runs(version):
        return version
    return next((v for v in range(version - 1, MIN_OPSET - 1, -1) if v <= _KNOWN_QDQ_OPSET or _qdq_runs(v)), None)


def upgrade_opset(model: ir.Model) -> ir.Model:
    """``model`` itself when its default-domain opset is :data:`MIN_OPSET` or newer and ONNX Runtime runs
    QuantizeLinear / DequantizeLinear at it, else a converted copy (older: up to :data:`MIN_OPSET`; newer than this
    ONNX Runtime's quantization kernels - a model exported at opset 28 for ONNX Runtime 1.32 - down to the newest
    opset it has them for).

    Raises:
        ModelError: ``onnx.version_converter`` cannot convert it (naming the opset and what is allowed).
    """
    version = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if version is None:
        return model
    if version >= MIN_OPSET:
        limit = qdq_opset_limit(version)
        if limit == version:
            return model
        return _downgrade_opset(model, version, limit)
    converted = _convert_opset(model, MIN_OPSET, why=f"quantkit needs {MIN_OPSET} or newer",
                               allowed=f"a model exported with opset >= {MIN_OPSET}")
    log.info("the model's opset %d was converted to opset %d (onnx.version_converter) before any work", version,
             MIN_OPSET)
    return converted


def _downgrade_opset(model: ir.Model, version: int, limit: int | None) -> ir.Model:
    """``model`` converted down to opset ``limit`` (module :func:`upgrade_opset`).

    Raises:
        ModelError: no such opset, or ``onnx.version_converter`` cannot convert the model to it.
    """
    import onnxruntime as ort

    if limit is None:
        raise ModelError(f"the model's default-domain opset is {version}; ONNX Runtime {ort.__version__} has no "
                         f"QuantizeLinear / DequantizeLinear kernel at it or at any opset down to {MIN_OPSET}")  # fmt: skip
    why = f"ONNX Runtime {ort.__version__} has QuantizeLinear / DequantizeLinear kernels up to opset {limit} only"
    allowed = f"a model exported with a default-domain opset from {MIN_OPSET} to {limit}"
    converted = _convert_opset(model, limit, why=why, allowed=allowed)
    log.warning("the model's opset %d is newer than ONNX Runtime %s's quantization kernels: converted to opset %d "
                "(onnx.version_converter) before any work", version, ort.__version__, limit)  # fmt: skip
    return converted


def _convert_opset(model: ir.Model, target: int, *, why: str, allowed: str) -> ir.Model:
    """``model`` converted to default-domain opset ``target`` by ``onnx.version_converter`` and checked.

    Raises:
        ModelError: the converter or the checker fails (``why`` the conversion was needed, ``allowed`` what to give).
    """
    import onnx
    from onnx import version_converter

    version = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    try:
        proto = version_converter.convert_version(ir.to_proto(model), target)
        proto.ir_version = max(proto.ir_version, 7)  # opset 13 and later need IR version 7
        onnx.checker.check_model(proto)
        converted = ir.from_proto(proto)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError / ValidationError / ...
        raise ModelError(
            f"the model's default-domain opset is {version}; {why}, and onnx.version_converter cannot convert it to "
            f"opset {target} ({type(exc).__name__}: {str(exc).strip()[:300]}); allowed: {allowed}"
        ) from None
    return converted


_WEIGHTED = {"Conv": 1, "ConvTranspose": 1, "MatMul": 1, "Gemm": 1}


def check_weights(model: ir.Model) -> None:
    """Refuse a layer whose weight is an empty tensor (a dimension of size 0), naming the node and the shape:
    no scale, range or bias correction can be computed from it."""
    for node in model.graph.all_nodes():
        pos = _WEIGHTED.get(node.op_type)
        if pos is None or node.domain not in ("", "ai.onnx") or len(node.inputs) <= pos:
            continue
        w = node.inputs[pos]
        if w is None or w.const_value is None or w.shape is None:
            continue
        dims = [d for d in w.shape if isinstance(d, int)]
        if 0 in dims:
            raise ModelError(
                f"node {node.name or '(unnamed)'!r} ({node.op_type}) has the empty weight {w.name!r} of shape "
                f"{list(w.shape)}; quantkit cannot quantize a layer with no weights; allowed: weights with every "
                "dimension >= 1 (remove the empty layer from the model)"
            )


def _drop_initializer_inputs(model: ir.Model) -> int:
    """Remove from the graph inputs the values that are initializers too (IR version < 4 requires that, and old
    exporters keep doing it): such a weight is an *overridable* input, never a constant - nothing would fold,
    quantize or drop it, and the emitted model would carry the float weights beside the int8 ones.  They stay
    initializers (constants), as every current exporter writes them; the count is returned."""
    graph = model.graph
    drop = [v for v in graph.inputs if v.name is not None and graph.initializers.get(v.name) is v]
    for v in drop:
        graph.inputs.remove(v)
    if drop:
        model.ir_version = max(model.ir_version or 0, 4)  # IR >= 4: initializers need not be inputs
        log.info("%d initializers were also listed as graph inputs (an IR version 3 convention): taken as constant "
                 "weights, no longer inputs", len(drop))  # fmt: skip
    return len(drop)


def _split_sizes_below_opset_18(model: ir.Model) -> int:
    """Give every ``Split(num_outputs=n)`` of a model below opset 18 its ``split`` sizes instead: onnxscript's
    folding rewrites ``SplitToSequence`` (Longformer's chunked attention) as a ``Split`` with ``num_outputs``,
    an attribute that exists only from opset 18, whatever the model's opset - ONNX Runtime then refuses the
    graph.  The folding emits it only for an even split of a known dimension.  Returns the nodes rewritten."""
    from quantkit.lowering.nbits import _replace_node

    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 18))
    if opset >= 18:
        return 0
    done = 0
    for node in list(model.graph):
        attr = node.attributes.get("num_outputs")
        if node.op_type != "Split" or node.domain not in ("", "ai.onnx") or attr is None:
            continue
        x = node.inputs[0]
        axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
        n = attr.as_int()
        dims = list(x.shape) if x is not None and x.shape is not None else []
        axis = axis + len(dims) if axis < 0 else axis
        size = dims[axis] if 0 <= axis < len(dims) else None
        if not isinstance(size, int) or n <= 0 or size % n:
            raise ModelError(f"graph preparation: Split node {node.name!r} got num_outputs={n} from constant folding "
                             f"in an opset-{opset} model and its split dimension is not known; export the model at "
                             "opset 18 or later")
        sizes = ir.Value(name=f"{node.name}_split_sizes", type=ir.TensorType(ir.DataType.INT64),
                         shape=ir.Shape([n]), const_value=ir.tensor(np.full(n, size // n, np.int64)))
        model.graph.register_initializer(sizes)
        new = ir.node("Split", [x, sizes], attributes={"axis": axis}, name=node.name,
                      outputs=[ir.Value(name=None) for _ in node.outputs])
        _replace_node(model.graph, node, new)
        done += 1
    return done


def prepare(model: ir.Model, *, fold_constants: bool = True) -> PrepResult:
    """Prepare ``model`` (modified in place) for quantization and return it with per-transform counts.

    Args:
        model: the float model, as ``onnx_ir.Model`` (``onnx_ir.load(path)`` or
            ``onnx_ir.serde.deserialize_model(proto)``).
        fold_constants: run constant folding (step 3); turn off to keep constant
            subgraphs as they are.

    Raises:
        ModelError: if ``model`` is not an ``onnx_ir.Model`` or a library pass fails on it.
    """
    if not isinstance(model, ir.Model):
        raise ModelError(f"prepare() expects an onnx_ir.Model, got {type(model).__name__}")
    check_runnable(model)
    model = upgrade_opset(model)  # a copy when converted
    applied: dict[str, int] = {"initializer_inputs": _drop_initializer_inputs(model)}
    namer = NameNodesPass()
    _run("name_nodes", namer, model)
    renamed = namer.renamed
    from quantkit.prep.float16 import float16_to_float32

    applied["float16_to_float32"] = float16_to_float32(model)

    applied["shape_inference"] = _shape_inference("shape_inference", model)

    if fold_constants:
        folder = _constant_folding.FoldConstantsPass(
            shape_inference=True,
            input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
            output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
            should_fold=_should_fold,
        )
        folded = _run_counting_nodes("constant_folding", folder, model)
        # Folding leaves Constant nodes behind; drop the dead ones before counting the lift.
        folded += _run_counting_nodes("constant_folding", common_passes.RemoveUnusedNodesPass(), model)
        applied["constant_folding"] = folded
        applied["split_num_outputs"] = _split_sizes_below_opset_18(model)
    # Weights must be initializers for the BN rules' checks (and for quantization).
    _run(
        "lift_constants",
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        model,
    )

    from quantkit.prep.einsum import einsum_to_matmul
    from quantkit.prep.gemm_to_matmul import fold_gemm_scales, untranspose_gemm_inputs
    from quantkit.prep.left_weight import constant_left_matmul
    from quantkit.prep.weight_subgraphs import fold_weight_subgraphs

    if fold_constants:
        applied["weight_subgraphs"] = fold_weight_subgraphs(model)
    applied["einsum_to_matmul"] = einsum_to_matmul(model)
    applied["constant_left_matmul"] = constant_left_matmul(model)
    applied["gemm_scales"] = fold_gemm_scales(model)
    applied["gemm_trans_a"] = untranspose_gemm_inputs(model)
    try:
        applied["fold_batchnorm"] = fold_batchnorm_rules().apply_to_model(model)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"graph preparation step 'fold_batchnorm' failed: {exc}") from exc
    try:
        applied["fold_batchnorm_layout"] = fold_batchnorm_through_layout(model)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"graph preparation step 'fold_batchnorm_layout' failed: {exc}") from exc
    try:
        applied["fold_pad"] = fold_pad_rules().apply_to_model(model)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"graph preparation step 'fold_pad' failed: {exc}") from exc
    from quantkit.prep.parallel_convs import merge_parallel_convs

    try:
        applied["parallel_convs"] = merge_parallel_convs(model)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"graph preparation step 'parallel_convs' failed: {exc}") from exc
    try:
        applied["global_pool"] = global_pool_rules().apply_to_model(model)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"graph preparation step 'global_pool' failed: {exc}") from exc
    try:
        applied["hard_swish"] = hard_swish_rules().apply_to_model(model)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"graph preparation step 'hard_swish' failed: {exc}") from exc
    try:
        applied["erf_gelu"] = fuse_erf_gelu(model)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"graph preparation step 'erf_gelu' failed: {exc}") from exc
    try:
        applied["preact_batchnorm"] = preact_batchnorm(model)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"graph preparation step 'preact_batchnorm' failed: {exc}") from exc

    from quantkit.prep.identity import eliminate_identities

    applied["identity_elimination"] = eliminate_identities(model)
    initializers_before = len(model.graph.initializers)
    removed_nodes = _run_counting_nodes("unused_removal", common_passes.RemoveUnusedNodesPass(), model)
    applied["unused_removal"] = removed_nodes + max(initializers_before - len(model.graph.initializers), 0)

    applied["topological_sort"] = int(_run("topological_sort", common_passes.TopologicalSortPass(), model))
    _run("name_nodes", namer, model)
    applied["name_nodes"] = renamed + namer.renamed
    _run("name_values", common_passes.NameFixPass(), model)
    _shape_inference("shape_inference", model)
    check_weights(model)
    from quantkit.irtools import fill_missing_types

    applied["fill_types"] = fill_missing_types(model)
    return PrepResult(model=model, applied=applied)
