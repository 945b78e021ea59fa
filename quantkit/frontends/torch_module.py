"""Export a ``torch.nn.Module`` to ONNX with ``torch.onnx.export`` and load it as ``onnx_ir``.

Exporter choice: the dynamo exporter (``dynamo=True``).  On EfficientNet-Lite0 it
produces a classic graph -- ``Conv`` (BatchNorm folded, "same" padding folded into
``pads``), ``Clip`` (ReLU6), ``Add``, ``ReduceMean`` (rewritten here to
``GlobalAveragePool``), ``Reshape``, ``Gemm`` -- whereas the TorchScript exporter
leaves 17 dynamic ``Pad`` subgraphs (Shape/Slice/Concat/ConstantOfShape/Transpose/Cast,
~380 extra nodes).  On BERT both are comparable, with dynamo slightly cleaner.  The
price is export time (~8 s vs ~0.6 s on EfficientNet-Lite0), which the built-in
model cache hides.

Trap: ``torch.export`` specialises a dimension whose example size is 0 or 1, so a
dynamic batch needs an example batch of at least 2; :func:`from_torch` repeats a
batch of one along dim 0 for tracing.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx_ir as ir
import onnx_ir.external_data

from quantkit.errors import ModelError
from quantkit.frontends._canonicalize import ReduceMeanToGlobalAveragePoolPass

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_OPSET", "example_from_loader", "from_torch", "optimize_exported"]

#: The dynamo exporter's native opset in torch 2.13; asking for a lower one triggers a
#: version conversion that fails on ``Pad`` (17), a higher one a conversion we do not need.
DEFAULT_OPSET = 18


def optimize_exported(model: ir.Model) -> None:
    """What ``torch.onnx.export(..., optimize=True)`` does to the exported graph (onnxscript's ``optimize_ir``:
    constant folding, its pattern rewrites, unused-node removal, lifting constants), in place - without its
    arithmetic no-op rules.

    Those rules drop ``Add(x, c)`` / ``Sub(x, c)`` as "x + 0" and ``Mul(x, c)`` / ``Div(x, c)`` as "x * 1" when
    ``c`` is within onnxscript's pattern tolerance of 0 or 1 (absolute 1e-8, relative 1e-5): an RMSNorm with
    ``eps = 1e-8`` (Helium's default) lost its epsilon, an all-zero embedding row (a padding token) became
    ``rsqrt(0) = inf`` and NaN spread through attention to every position of the sequence, silently; a
    ``Mul`` by 1.000001 vanished too.  Exact no-ops go afterwards (:func:`remove_exact_noops`).  Falls back to
    onnxscript's own ``optimize_ir`` when its rule tables are not where this version keeps them."""
    from onnxscript import optimizer

    try:
        import onnx_ir.passes.common as common
        from onnxscript import rewriter
        from onnxscript.optimizer import _constant_folding
        from onnxscript.rewriter.rules.common import _no_op

        exact = {id(_no_op.dropout_zero_rule), id(_no_op.dropout_inference_rule)}
        tolerant = {id(r) for r in _no_op.rules.rules if id(r) not in exact}
        rules = [r for r in rewriter._DEFAULT_REWRITE_RULES if id(r) not in tolerant]
    except (ImportError, AttributeError):
        optimizer.optimize_ir(model)
        return
    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager([_constant_folding.FoldConstantsPass(
                                   shape_inference=True,
                                   input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                                   output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT),
                               rewriter.RewritePass(rules), common.RemoveUnusedNodesPass(),
                               common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass()],
                              steps=2, early_stop=True),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)  # fmt: skip
    remove_exact_noops(model)


_NEUTRAL = {"Add": (0.0, (0, 1)), "Sub": (0.0, (1,)), "Mul": (1.0, (0, 1)), "Div": (1.0, (1,))}
"""Binary ops that are the identity when one operand (at the positions given) is exactly this scalar."""


def remove_exact_noops(model: ir.Model) -> int:
    """Remove ``x + 0``, ``x - 0``, ``x * 1`` and ``x / 1`` from the main graph where the constant is a single element
    exactly 0 / 1 and the result has ``x``'s element type and shape (the constant broadcasts to nothing); a graph
    output is kept.  Returns how many were removed."""
    import numpy as np

    graph, removed = model.graph, 0
    outputs = set(map(id, graph.outputs))
    for node in list(graph):
        rule = _NEUTRAL.get(node.op_type)
        if rule is None or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2 or len(node.outputs) != 1:
            continue
        neutral, positions = rule
        out = node.outputs[0]
        if id(out) in outputs:
            continue
        for pos in positions:
            c, x = node.inputs[pos], node.inputs[1 - pos]
            tensor = None if c is None else ir.convenience.get_const_tensor(c)
            if x is None or tensor is None or tensor.size != 1 or x.shape is None or x.type is None:
                continue
            if x.type != out.type or len(tensor.shape) > len(x.shape) or not np.all(tensor.numpy() == neutral):
                continue
            ir.convenience.replace_all_uses_with(out, x)
            graph.remove(node, safe=True)
            removed += 1
            break
    return removed


@contextlib.contextmanager
def _quiet_export(log: io.StringIO) -> Iterator[None]:
    """Capture the exporter's progress prints, warnings and log lines into ``log``."""
    handler = logging.StreamHandler(log)
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    saved = [(lg, lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.ERROR)
        lg.propagate = False
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level, propagate in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def _fixed_positional(module: torch.nn.Module) -> int | None:
    """How many positional parameters ``forward`` names before its ``*args``; None when it has no ``*args``."""
    n = 0
    for p in inspect.signature(module.forward).parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return n
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            n += 1
    return None


def _flatten(shapes: Any) -> list[Any]:
    out: list[Any] = []
    for d in shapes:
        out.extend(_flatten(d) if isinstance(d, tuple) else [d])
    return out


def _name_outputs(model: ir.Model, program: Any) -> None:
    """Name the graph outputs after the keys of the dict / ``ModelOutput`` the module returns (``logits``,
    ``boxes``: the exported program's output tree, one tensor per key), else leave the exporter's names."""
    try:
        spec = program.exported_program.call_spec.out_spec
        keys = list(spec.context) if isinstance(spec.context, (list, tuple)) else []
        leaves = spec.num_leaves
        flat = spec.num_children == len(keys) == leaves
    except Exception:  # noqa: BLE001 - names are a nicety: the exporter's stay
        return
    if not flat or len(keys) != len(model.graph.outputs) or not all(isinstance(k, str) for k in keys):
        return
    taken = {v.name for n in model.graph for v in n.outputs} | {v.name for v in model.graph.inputs}
    taken |= set(model.graph.initializers)
    for value, key in zip(model.graph.outputs, keys, strict=True):
        if value.name != key and key not in taken:
            value.name = key
            taken.add(key)


def _forward_param_names(module: torch.nn.Module) -> list[str] | None:
    """Names of ``module.forward``'s positional parameters, or None if it takes ``*args``."""
    names: list[str] = []
    for p in inspect.signature(module.forward).parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names


def example_from_loader(module: torch.nn.Module, data: Any) -> Any:
    """``example_inputs`` for ``module`` from the first batch of a ``torch.utils.data.DataLoader`` (its items are
    batches by construction), else None: a dict of tensors (the keys ``forward`` takes), a tensor, or a tuple
    whose first ``forward``-required elements are the inputs (a trailing target is dropped).  Other iterables are
    not read: whether their items are samples or batches cannot be told without the model."""
    import torch
    from torch.utils.data import DataLoader

    if not isinstance(data, DataLoader) or data.batch_size is None:
        return None
    try:
        first = next(iter(data))
    except StopIteration:
        return None
    sig = inspect.signature(module.forward).parameters.values()
    required = [p.name for p in sig if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if isinstance(first, Mapping):
        names = {p.name for p in sig}
        got = {k: v for k, v in first.items() if k in names and isinstance(v, torch.Tensor)}
        return got or None
    if isinstance(first, torch.Tensor):
        return first
    if isinstance(first, (tuple, list)) and first:
        if len(first) == 2 and isinstance(first[0], (Mapping, tuple, list)):
            first = first[0]  # (inputs, target)
            if isinstance(first, Mapping):
                return {k: v for k, v in first.items() if isinstance(v, torch.Tensor)} or None
        keep = list(first[: len(required)] if 0 < len(required) < len(first) else first)
        return tuple(keep) if all(isinstance(t, torch.Tensor) for t in keep) else None
    return None


def _at_least_two(t: torch.Tensor) -> torch.Tensor:
    """Repeat a batch of one along dim 0 so that ``torch.export`` keeps dim 0 dynamic."""
    if t.dim() >= 1 and t.shape[0] == 1:
        return t.expand(2, *t.shape[1:]).contiguous()
    return t


def _as_float32(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A float32 copy of a module whose floating parameters or buffers are float64, float16 or bfloat16, with
    its floating example inputs cast the same way; the module and inputs themselves otherwise.  ONNX Runtime's
    CPU kernels are float32 (no float64 ``Conv``; half precision is slower than float32 there), and the quantized
    model's reference is FP32; the user's module is never changed (a copy is cast)."""
    import copy

    import torch

    other = sorted({str(t.dtype).replace("torch.", "") for t in [*module.parameters(), *module.buffers()]
                    if t.is_floating_point() and t.dtype != torch.float32})
    if not other:
        return module, args, kwargs
    logging.getLogger("quantkit").info(
        "the module holds %s parameters: a float32 copy is exported (ONNX Runtime's CPU kernels and the FP32 "
        "reference are float32); the module itself is not changed", "/".join(other))

    def cast(t: Any) -> Any:
        return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return copy.deepcopy(module).float(), tuple(cast(t) for t in args), {k: cast(t) for k, t in kwargs.items()}


def from_torch(
    module: torch.nn.Module,
    example_inputs: Any,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_batch: bool = True,
    dynamic_dims: Mapping[str, Mapping[int, str]] | None = None,
    opset: int = DEFAULT_OPSET,
    canonicalize: bool = True,
) -> ir.Model:
    """Export ``module`` with the dynamo ONNX exporter and return the graph as an ``ir.Model``.

    Args:
        module: the network; it is exported in eval mode under ``torch.no_grad()`` and its
            training flag is restored afterwards.
        example_inputs: a tensor, a sequence of tensors (positional arguments of
            ``forward``) or a mapping ``name -> tensor`` (keyword arguments).
        input_names: ONNX graph input names; default the ``forward`` parameter names
            (or the mapping keys).
        output_names: ONNX graph output names; default the exporter's.
        dynamic_batch: make dim 0 of every input (and so of the outputs) symbolic ``"batch"``.
        dynamic_dims: further symbolic dims per input name, e.g. ``{"input_ids": {1: "seq"}}``.
        opset: default-domain opset of the exported graph.
        canonicalize: run the small canonicalisation passes (see ``_canonicalize``).

    Raises:
        ModelError: the inputs are malformed or the exporter fails (its log is included).
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ModelError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}")

    # Normalise the example inputs into (positional args, keyword args) with names.
    args: tuple[torch.Tensor, ...] = ()
    kwargs: dict[str, torch.Tensor] = {}
    if isinstance(example_inputs, torch.Tensor):
        args = (example_inputs,)
    elif isinstance(example_inputs, Mapping):
        kwargs = dict(example_inputs)
    elif isinstance(example_inputs, Sequence) and not isinstance(example_inputs, str):
        args = tuple(example_inputs)
    else:
        raise ModelError(
            "example_inputs must be a torch.Tensor, a sequence of tensors or a mapping "
            f"name -> tensor; got {type(example_inputs).__name__}"
        )
    for key, t in [*enumerate(args), *kwargs.items()]:
        if not isinstance(t, torch.Tensor):
            raise ModelError(f"example input {key!r} must be a torch.Tensor, got {type(t).__name__}")

    inner = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule: export the module it wraps
    if isinstance(inner, torch.nn.Module):
        logging.getLogger("quantkit").info("a torch.compile'd module: exporting the module it wraps (_orig_mod)")
        module = inner
    module, args, kwargs = _as_float32(module, args, kwargs)
    if kwargs:
        names = list(kwargs)
    else:
        params = _forward_param_names(module)
        names = params[: len(args)] if params is not None and len(params) >= len(args) else []
        if len(names) != len(args):
            names = [f"input_{i}" for i in range(len(args))]
    if input_names is not None:
        if len(input_names) != len(names):
            raise ModelError(
                f"input_names has {len(input_names)} names but there are {len(names)} example inputs"
            )
        onnx_names = list(input_names)
    else:
        onnx_names = names
    extra = dict(dynamic_dims or {})
    unknown = sorted(set(extra) - set(onnx_names))
    if unknown:
        raise ModelError(f"dynamic_dims names unknown inputs {unknown}; the inputs are {onnx_names}")

    def dims_for(onnx_name: str, t: torch.Tensor) -> dict[int, str] | None:
        dims: dict[int, str] = {}
        if dynamic_batch and t.dim() >= 1:
            dims[0] = "batch"
        for axis, label in extra.get(onnx_name, {}).items():
            if not -t.dim() <= axis < t.dim():
                raise ModelError(
                    f"dynamic_dims[{onnx_name!r}] axis {axis} is out of range for rank {t.dim()}"
                )
            dims[axis % t.dim()] = label
        return dims or None

    if dynamic_batch:
        args = tuple(_at_least_two(t) for t in args)
        kwargs = {k: _at_least_two(t) for k, t in kwargs.items()}
    dynamic_shapes: Any
    if kwargs:
        dynamic_shapes = {k: dims_for(n, t) for (k, t), n in zip(kwargs.items(), onnx_names, strict=True)}
    else:
        flat = tuple(dims_for(n, t) for t, n in zip(args, onnx_names, strict=True))
        dynamic_shapes = flat
        fixed = _fixed_positional(module)
        if fixed is not None and fixed < len(flat):  # forward(self, a, *rest): the rest nest as one tuple
            dynamic_shapes = (*flat[:fixed], flat[fixed:])
    if all(d is None for d in (dynamic_shapes.values() if kwargs else _flatten(dynamic_shapes))):
        dynamic_shapes = None

    was_training = module.training
    module.eval()
    log = io.StringIO()
    try:
        with tempfile.TemporaryDirectory(prefix="quantkit-export-") as tmp:
            path = Path(tmp) / "model.onnx"
            try:
                with torch.no_grad(), _quiet_export(log):
                    program = torch.onnx.export(
                        module,
                        args,
                        str(path),
                        kwargs=kwargs or None,
                        input_names=onnx_names,
                        output_names=list(output_names) if output_names is not None else None,
                        opset_version=opset,
                        dynamo=True,
                        external_data=True,
                        dynamic_shapes=dynamic_shapes,
                        optimize=False,  # optimize_exported below: onnxscript's optimizer minus its tolerant no-ops
                    )
            except Exception as e:
                tail = log.getvalue()[-4000:]
                raise ModelError(
                    f"torch.onnx.export failed for {type(module).__name__}: {type(e).__name__}: {e}\n"
                    f"exporter log (tail):\n{tail}"
                ) from e
            model = ir.load(path)
            # Pull external data into memory before the temporary folder disappears.
            model = onnx_ir.external_data.load_to_model(model)
            optimize_exported(model)
        if output_names is None:
            _name_outputs(model, program)
    finally:
        module.train(was_training)
    if canonicalize:
        ReduceMeanToGlobalAveragePoolPass()(model)
    return model
