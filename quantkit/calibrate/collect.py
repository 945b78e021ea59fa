"""Run ONNX Runtime over calibration data and stream chosen intermediate tensors into calibrators.

How :func:`collect_statistics` works:

1. The model is loaded without its external weights (a path) or used as given (a
   ``ModelProto``); an in-memory model too large for one protobuf (> 2 GB) is written once,
   with external data, into a ``tempfile.TemporaryDirectory`` (never the working directory)
   that is removed on exit, also on error or ``KeyboardInterrupt``.  Sessions are created
   from the serialised graph with ``session.model_external_initializers_file_folder_path``
   pointing at the weights, so weights are never copied for instrumentation.
2. For each *pass*, a copy of the graph is made whose outputs are exactly the requested
   tensors of that pass (element types from ONNX shape inference where known; an
   untyped output otherwise, which ONNX Runtime infers).  Requested graph inputs are read
   from the feeds instead.
3. Every batch's outputs go straight to their calibrator's ``update`` and are dropped, so
   peak memory is one batch of outputs (two when they fit the budget together: ONNX Runtime then
   runs the next batch in a worker thread while this one is binned), independent of the number of
   samples.
4. Chunking: with ``max_outputs_per_pass`` and/or ``max_batch_output_bytes``, tensors are
   split into several passes over the data.  Bytes per tensor per batch are estimated on
   the first batch: from shape inference with the batch's concrete input shapes, and
   where that leaves a shape unknown, by running the first batch once with those
   tensors exposed.  A single tensor larger than the budget gets a pass of its own.
"""

from __future__ import annotations

import difflib
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from typing import Any, Protocol, TypeAlias

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from quantkit.calibrate.base import Calibrator, CalibratorFactory, get_calibrator
from quantkit.errors import CalibrationError, DataError, RecipeError
from quantkit.progress import tqdm

__all__ = ["CalibrationDataset", "TensorRequest", "collect_statistics"]

# Serialised protobuf messages must stay below 2 GiB; keep a margin for the graph itself.
_PROTOBUF_LIMIT = 2**31 - 2**26
_EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"

TensorRequest: TypeAlias = CalibratorFactory | tuple[str, Mapping[str, Any]] | str
"""How to make the calibrator of one tensor: a factory, ``(registered_name, options)`` or a registered name."""

Batch = Mapping[str, np.ndarray]


class CalibrationDataset(Protocol):
    """What calibration needs from a dataset (see ``quantkit.data``)."""

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Yield feeds ``{graph input name: array}`` of up to ``batch_size`` samples; re-iterable."""
        ...

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def fingerprint(self) -> str:
        """Stable identity of the data (for caching statistics)."""
        ...


def _make_calibrator(tensor: str, request: TensorRequest) -> Calibrator:
    if isinstance(request, str):
        return get_calibrator(request)()
    if isinstance(request, tuple):
        if len(request) != 2 or not isinstance(request[0], str) or not isinstance(request[1], Mapping):
            raise RecipeError(
                f"calibrator for tensor {tensor!r}: expected (name, options) with a dict of options, got {request!r}"
            )
        return get_calibrator(request[0])(**dict(request[1]))
    if callable(request):
        return request()
    raise RecipeError(
        f"calibrator for tensor {tensor!r}: {request!r} is not allowed; "
        "allowed: a registered name, (name, options) or a zero-argument factory"
    )


def _proto_size(model: onnx.ModelProto) -> int:
    """Approximate serialised size without serialising (which fails beyond 2 GiB)."""
    g = model.graph
    return sum(t.ByteSize() for t in g.initializer) + sum(n.ByteSize() for n in g.node) + 2**20


class _Source:
    """A graph proto that serialises below 2 GiB plus the folder holding its external weights."""

    def __init__(self, model: onnx.ModelProto | str | os.PathLike[str], stack: ExitStack) -> None:
        self.external_dir: str | None = None
        if isinstance(model, onnx.ModelProto):
            if _proto_size(model) <= _PROTOBUF_LIMIT:
                self.proto = model
            else:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="quantkit-calib-"))
                copy = onnx.ModelProto()
                copy.CopyFrom(model)
                # save_model strips raw_data from `copy`, leaving a small graph that references weights.data
                onnx.save_model(
                    copy,
                    os.path.join(tmp, "model.onnx"),
                    save_as_external_data=True,
                    all_tensors_to_one_file=True,
                    location="weights.data",
                    size_threshold=1024,
                )
                self.proto, self.external_dir = copy, tmp
        else:
            path = os.fspath(model)
            if not os.path.isfile(path):
                raise CalibrationError(f"model file {path!r} does not exist")
            self.proto = onnx.load(path, load_external_data=False)
            self.external_dir = os.path.dirname(os.path.abspath(path))

    def copy(self) -> onnx.ModelProto:
        m = onnx.ModelProto()
        m.CopyFrom(self.proto)
        return m


def _graph_names(graph: onnx.GraphProto) -> tuple[list[str], set[str], set[str]]:
    """(all tensor names in order, initializer names, graph input names)."""
    inits = {t.name for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    names: list[str] = [i.name for i in graph.input] + [t.name for t in graph.initializer]
    names += [o for n in graph.node for o in n.output if o]
    return list(dict.fromkeys(names)), inits, inputs


def _infer(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Name -> TypeProto from ONNX shape inference (empty where inference fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # an op without a shape-inference function must not stop calibration
        inferred = model
    g = inferred.graph
    types = {v.name: v.type for v in [*g.input, *g.value_info, *g.output] if v.type.HasField("tensor_type")}
    for t in g.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return types


def _skeleton(source: _Source, shapes: Mapping[str, tuple[int, ...]] | None = None) -> onnx.ModelProto:
    """A weight-free copy for shape inference: initializers become typed graph inputs.

    Element types and (given concrete input ``shapes``) output shapes do not depend on
    weight values; small integer initializers are kept because Reshape/Expand read them.
    """
    m = onnx.ModelProto()
    _copy_without_inits(source.proto, m)
    g = m.graph
    input_names = {i.name for i in g.input}
    for t in source.proto.graph.initializer:
        small_int = (
            t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and math.prod(t.dims) <= 64
        )
        if small_int and t.data_location != onnx.TensorProto.EXTERNAL:
            g.initializer.append(t)
        elif t.name not in input_names:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    if shapes:
        for inp in g.input:
            if inp.name in shapes:
                dims = inp.type.tensor_type.shape.dim
                del dims[:]
                for d in shapes[inp.name]:
                    dims.add().dim_value = int(d)
    return m


def _copy_without_inits(src: onnx.ModelProto, dst: onnx.ModelProto) -> None:
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(dst, field, getattr(src, field))
    dst.opset_import.extend(src.opset_import)
    dst.functions.extend(src.functions)
    g = dst.graph
    g.name = src.graph.name
    g.node.extend(src.graph.node)
    g.input.extend(src.graph.input)
    g.output.extend(src.graph.output)
    g.value_info.extend(src.graph.value_info)


def _tensor_bytes(t: onnx.TypeProto | None) -> int | None:
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    dims = t.tensor_type.shape.dim
    if any(not d.HasField("dim_value") for d in dims):
        return None
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None
    return math.prod(d.dim_value for d in dims) * itemsize


def _plan_chunks(
    names: Sequence[str], sizes: Mapping[str, int], max_outputs: int | None, budget: int | None
) -> list[list[str]]:
    """Greedy first-fit in graph order: each chunk has <= ``max_outputs`` names and <= ``budget`` bytes."""
    chunks: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in names:
        size = sizes.get(name, 0)
        full = (max_outputs is not None and len(current) >= max_outputs) or (
            budget is not None and current and used + size > budget
        )
        if full:
            chunks.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        chunks.append(current)
    return chunks


class _Runner:
    """Builds instrumented sessions exposing a chosen set of tensors."""

    def __init__(
        self,
        source: _Source,
        types: Mapping[str, onnx.TypeProto],
        providers: Sequence[str],
        intra_op_threads: int | None,
    ) -> None:
        self.source = source
        self.types = types
        self.providers = list(providers)
        self.intra_op_threads = intra_op_threads

    def session(self, outputs: Sequence[str]) -> ort.InferenceSession:
        m = self.source.copy()
        del m.graph.output[:]
        for name in outputs:
            t = self.types.get(name)
            if t is not None and t.tensor_type.elem_type:
                m.graph.output.append(helper.make_tensor_value_info(name, t.tensor_type.elem_type, None))
            else:
                m.graph.output.append(onnx.ValueInfoProto(name=name))  # untyped: ORT infers it
        opts = ort.SessionOptions()
        # BASIC keeps every exposed tensor bit-identical to the unoptimised graph's value
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if self.intra_op_threads is not None:
            opts.intra_op_num_threads = self.intra_op_threads
        if self.source.external_dir is not None:
            opts.add_session_config_entry(_EXTERNAL_FOLDER_KEY, self.source.external_dir)
        return ort.InferenceSession(m.SerializeToString(), opts, providers=self.providers)


def _check_feeds(batch: Batch, required: set[str], optional: set[str]) -> dict[str, np.ndarray]:
    if not isinstance(batch, Mapping):
        raise DataError(
            f"a dataset batch must be a dict of graph input name -> array, got {type(batch).__name__}"
        )
    received = set(batch)
    missing = required - received
    unexpected = received - required - optional
    if missing or unexpected:
        raise DataError(
            f"dataset batch inputs do not match the model: expected {sorted(required)}, received {sorted(received)}"
            + (f"; missing {sorted(missing)}" if missing else "")
            + (f"; unexpected {sorted(unexpected)}" if unexpected else "")
        )
    feeds = {k: np.asarray(v) for k, v in batch.items()}
    for k, v in feeds.items():
        if np.issubdtype(v.dtype, np.floating):
            bad = int(v.size - np.count_nonzero(np.isfinite(v)))
            if bad:
                rows: list[int] = (np.flatnonzero(~np.isfinite(v.reshape(v.shape[0], -1)).all(axis=1)).tolist()
                                   if v.ndim else [])
                raise DataError(
                    f"calibration input {k!r} holds {bad} non-finite value(s) (NaN/Inf) of {v.size} in this batch "
                    f"(samples {list(rows[:5])} of the batch): statistics of such data are meaningless; allowed: "
                    "finite values only - drop or repair those samples"
                )
    return feeds


def _run(
    sess: ort.InferenceSession, outputs: Sequence[str], feeds: dict[str, np.ndarray]
) -> list[np.ndarray]:
    try:
        return sess.run(list(outputs), feeds)
    except ort.capi.onnxruntime_pybind11_state.InvalidArgument as e:
        got = {k: (v.dtype.name, v.shape) for k, v in feeds.items()}
        raise DataError(f"ONNX Runtime rejected the calibration batch {got}: {e}") from e


def collect_statistics(
    model: onnx.ModelProto | str | os.PathLike[str],
    dataset: CalibrationDataset,
    tensors: Mapping[str, TensorRequest],
    *,
    batch_size: int = 1,
    max_outputs_per_pass: int | None = None,
    max_batch_output_bytes: int | None = None,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    progress: bool = True,
    intra_op_threads: int | None = None,
) -> dict[str, Calibrator]:
    """Run ``model`` over ``dataset`` and feed each tensor in ``tensors`` to a fresh calibrator.

    Args:
        model: an ONNX model or a path to one (external data next to it is fine).
        dataset: anything with ``batches(batch_size)``, ``__len__`` and ``fingerprint()``;
            ``batches`` is iterated once per pass.
        tensors: tensor name -> calibrator request (a registered name, ``(name, options)``
            or a zero-argument factory).  Names may be graph inputs, initializers or any node output.
        batch_size: samples per ``session.run``.
        max_outputs_per_pass: at most this many tensors exposed per pass over the data.
        max_batch_output_bytes: at most this many bytes of exposed outputs per batch (estimated
            on the first batch); more tensors mean more passes.
        providers: ONNX Runtime execution providers.
        progress: show a tqdm progress bar (one tick per batch per pass).
        intra_op_threads: ``SessionOptions.intra_op_num_threads`` (``None``: ORT's default).

    Returns:
        tensor name -> its calibrator, in the order of ``tensors``.

    Raises:
        CalibrationError: a tensor name not in the graph (with close matches), an empty
            dataset, or a model path that does not exist.
        DataError: a batch whose input names do not match the graph inputs, or that ORT rejects.
        RecipeError: an invalid option value.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise RecipeError(
            f"calibration: batch_size={batch_size!r} is not allowed; a positive integer is required"
        )
    for key, val in (
        ("max_outputs_per_pass", max_outputs_per_pass),
        ("max_batch_output_bytes", max_batch_output_bytes),
    ):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
            raise RecipeError(
                f"calibration: {key}={val!r} is not allowed; null or a positive integer is required"
            )
    calibrators = {name: _make_calibrator(name, req) for name, req in tensors.items()}
    if not calibrators:
        return {}
    if len(dataset) == 0:
        raise CalibrationError("the calibration dataset is empty (len(dataset) == 0)")

    with ExitStack() as stack:
        source = _Source(model, stack)
        graph = source.proto.graph
        all_names, inits, inputs = _graph_names(graph)
        known = set(all_names)
        for name in calibrators:
            if name not in known:
                close = difflib.get_close_matches(name, all_names, n=3)
                hint = f"; close matches: {close}" if close else ""
                raise CalibrationError(f"tensor {name!r} is not in the graph of the model{hint}")
        required = inputs - inits
        optional = inputs & inits  # inputs with an initializer default may be fed or not
        from_feeds = [n for n in calibrators if n in required]
        exposed = [n for n in all_names if n in calibrators and n not in required]  # graph order

        types = _infer(_skeleton(source))
        runner = _Runner(source, types, providers, intra_op_threads)

        batches: Iterator[Batch] = iter(dataset.batches(batch_size))
        first = next(batches, None)
        if first is None:
            raise CalibrationError("the calibration dataset yielded no batches")
        first_feeds = _check_feeds(first, required, optional)

        sizes: dict[str, int] = {}
        if max_batch_output_bytes is not None and exposed:
            sizes = _estimate_sizes(source, runner, exposed, first_feeds, max_outputs_per_pass)
        chunks = _plan_chunks(exposed, sizes, max_outputs_per_pass, max_batch_output_bytes) or [[]]
        del first_feeds

        per_pass = math.ceil(len(dataset) / batch_size)
        bar = stack.enter_context(
            tqdm(total=per_pass * len(chunks), disable=not progress, desc="calibrate", unit="batch")
        )
        budget = max_batch_output_bytes
        for i, chunk in enumerate(chunks):
            sess = runner.session(chunk) if chunk else None
            stream: Iterable[Batch]
            if i == 0:
                stream = _prepend(first, batches)
                del first  # only the stream holds it now
            else:
                stream = dataset.batches(batch_size)
            # one batch ahead: ONNX Runtime runs batch k + 1 (it releases the GIL) while the calibrators bin batch
            # k, when two batches' outputs fit the memory budget together (the update order is unchanged)
            ahead = sess is not None and (budget is None or 2 * sum(sizes.get(n, budget) for n in chunk) <= budget)
            pending: Future[list[np.ndarray]] | None = None
            with ThreadPoolExecutor(1, thread_name_prefix="quantkit-calibrate") if ahead else nullcontext() as pool:
                for batch in _then_none(stream):
                    feeds = _check_feeds(batch, required, optional) if batch is not None else None
                    if feeds is not None and i == 0:
                        for name in from_feeds:
                            calibrators[name].update(feeds[name])
                    if sess is not None and pool is not None:
                        running = pool.submit(_run, sess, chunk, feeds) if feeds is not None else None
                        if pending is not None:
                            _update(calibrators, chunk, pending.result())
                            bar.update(1)
                        pending = running
                    elif feeds is not None:
                        if sess is not None:
                            _update(calibrators, chunk, _run(sess, chunk, feeds))
                        bar.update(1)
                    del feeds, batch
            del sess, pending
    return calibrators


def _then_none(stream: Iterable[Batch]) -> Iterator[Batch | None]:
    """The batches, then ``None`` (the overlapped loop's last step bins the last batch)."""
    yield from stream
    yield None


def _update(calibrators: Mapping[str, Calibrator], chunk: Sequence[str], outs: list[np.ndarray]) -> None:
    for name, value in zip(chunk, outs, strict=True):
        calibrators[name].update(value)


def _prepend(first: Batch, rest: Iterator[Batch]) -> Iterator[Batch]:
    yield first
    del first
    yield from rest


def _estimate_sizes(
    source: _Source,
    runner: _Runner,
    exposed: Sequence[str],
    feeds: Mapping[str, np.ndarray],
    max_outputs: int | None,
) -> dict[str, int]:
    """Bytes of each exposed tensor for one batch: shape inference first, a probe run for the rest."""
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    concrete = _infer(_skeleton(source, shapes))
    sizes: dict[str, int] = {}
    unknown: list[str] = []
    for name in exposed:
        b = _tensor_bytes(concrete.get(name))
        if b is None:
            unknown.append(name)
        else:
            sizes[name] = b
    step = max_outputs or len(unknown) or 1
    for start in range(0, len(unknown), step):
        group = unknown[start : start + step]
        for name, value in zip(group, _run(runner.session(group), group, dict(feeds)), strict=True):
            sizes[name] = int(value.nbytes)
    return sizes
