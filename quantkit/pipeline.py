"""Pieces of the quantization pipeline that both the API and the search use.

``quantkit.api`` orchestrates one run and ``quantkit.search`` proposes and measures mixes; both call
these functions, which sit *below* them (this module imports neither), so the search never imports the
API: calibrated activation ranges (one cached statistics pass), the evaluation dataset of a recipe, and
saving a model atomically.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantkit.calibrate import get_calibrator
from quantkit.calibrate.collect import collect_statistics
from quantkit.data import Dataset, as_dataset, dataset_labels, make_dataset, model_inputs
from quantkit.errors import DataError, ModelError, QuantkitError
from quantkit.evaluate.latency import compare_latency, make_session
from quantkit.evaluate.metrics import FidelityAccumulator
from quantkit.frontends import LoadedModel
from quantkit.irtools import proto_size
from quantkit.lowering.select import QuantPlan
from quantkit.recipe import RecipeModel
from quantkit.staging import StagedModel

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "Fp32Outputs",
    "bias_mean_inputs",
    "calibrate_ranges",
    "decoder_context",
    "check_context",
    "check_not_empty",
    "eval_dataset",
    "evaluate_fidelity",
    "fidelity_and_layer_sqnr",
    "graph_key",
    "layer_probe",
    "latency_feed",
    "layer_sqnr",
    "measure_pair_latency",
    "model_bytes",
    "save_model",
    "verify_kernels",
    "verify_model",
]

log = logging.getLogger("quantkit")

EXTERNAL_DATA_THRESHOLD = 1_800_000_000



def save_model(model: ir.Model, path: Path, external: str = "auto") -> Path:
    """Serialize ``model`` atomically to ``path`` (external data ``path.data`` when large)."""
    proto = ir.to_proto(model)
    use_external = external == "always" or (external == "auto" and proto_size(proto) > EXTERNAL_DATA_THRESHOLD)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".quantkit-") as tmp:
        tmp_model = Path(tmp) / path.name
        if use_external:
            data_name = path.name + ".data"
            onnx.save_model(proto, tmp_model, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
            os.replace(Path(tmp) / data_name, path.parent / data_name)
        else:
            onnx.save_model(proto, tmp_model)
        os.replace(tmp_model, path)
    return path



def model_bytes(model: ir.Model) -> bytes:
    """Serialized model (for ONNX Runtime sessions); models > 2 GB are not supported here."""
    return ir.to_proto(model).SerializeToString()



def eval_dataset(recipe: RecipeModel, loaded: LoadedModel, evaluation_data: Any, inputs: list[Any]) -> Dataset | None:
    """The evaluation set (``evaluation_data``, else the recipe's ``evaluation.data``), None when neither is given.

    Raises:
        DataError: the data was asked for but holds no sample (nothing to evaluate the model on).
    """
    if evaluation_data is not None:
        try:
            ds = as_dataset(evaluation_data, inputs, tokenizer=loaded.tokenizer)
        except DataError as exc:
            raise DataError(f"evaluation_data: {exc}") from exc
        check_not_empty(ds, "evaluation_data (passed through the API)")
        check_shapes(ds, inputs, "evaluation_data")
        return ds
    if recipe.evaluation.data is not None:
        spec = recipe.evaluation.data.model_dump()
        ds = make_dataset(spec, inputs=inputs, tokenizer=loaded.tokenizer, split="evaluation")
        check_not_empty(ds, "evaluation.data (" + ", ".join(f"{k}={v}" for k, v in spec.items() if v is not None) + ")")
        check_shapes(ds, inputs, "evaluation.data")
        return ds
    return None


def check_shapes(ds: Dataset, inputs: Sequence[Any], what: str, hint: str = "", *, every: bool = False) -> None:
    """Refuse data whose first sample (``every``: any sample - data in memory) does not fit the model's inputs
    (``InputInfo``: rank, fixed dims) before any work: ONNX Runtime would reject it only in calibration or the
    kernel check, with its own message.  ``hint``: appended to the message (how to get a model with other sizes)."""
    for i, feed in enumerate(ds.batches(1)):
        for info in inputs:
            a = feed.get(info.name)
            if a is None or info.shape is None:
                continue
            got = tuple(np.shape(a))
            bad = len(got) != len(info.shape) or any(d is not None and g != d for g, d in zip(got, info.shape, strict=False))
            if bad:
                which = "the first sample" if i == 0 else f"sample {i}"
                raise DataError(f"{what}: input {info.name!r} of {which} has shape {list(got)}, the model "
                                f"takes {info.describe()} (? = any size); allowed: samples of that shape{hint}")
        if not every:
            return


def decoder_context(model: ir.Model) -> int | None:
    """The positions a built KV-cache decoder covers (its ``cos_cache`` rows), or the longest sequence an exported
    text encoder takes (its ``quantkit.max_positions`` metadata); None for other graphs."""
    limit = model.metadata_props.get("quantkit.max_positions")
    if limit is not None and limit.isdigit():
        return int(limit)
    cos = model.graph.initializers.get("cos_cache")
    if cos is None or cos.shape is None or not cos.shape.dims or not isinstance(cos.shape[0], int):
        return None
    return int(cos.shape[0])


def check_context(ds: Dataset, positions: int | None, what: str) -> None:
    """Refuse token sequences longer than a decoder's context before any work (ONNX Runtime would fail in the
    middle of calibration or evaluation)."""
    if positions is None:
        return
    longest = 0
    for feed in ds.batches(64):
        ids = feed.get("input_ids")
        if ids is not None and ids.ndim == 2:
            longest = max(longest, int(ids.shape[1]))
    if longest > positions:
        raise DataError(f"{what}: sequences of {longest} tokens do not fit the model's context of {positions} "
                        f"positions; allowed: seq_len <= {positions}")  # fmt: skip


def check_not_empty(ds: Dataset, what: str) -> None:
    """Refuse an evaluation set with no sample: the report would have no quality numbers and say nothing."""
    if len(ds) == 0:
        raise DataError(f"{what} holds no sample: there is nothing to evaluate the quantized model on; allowed: data "
                        "with at least one sample, or no evaluation data at all")  # fmt: skip



def extra_perplexities(recipe: RecipeModel, tokenizer: Any, inputs: list[Any], models: dict[str, Any],
                       progress: bool = True, datasets: Mapping[str, Any] | None = None
                       ) -> dict[str, dict[str, Any]]:
    """Perplexity of each model (``name -> ONNX bytes or path``) on every ``evaluation.extra`` text.

    Returns ``{label: {name: {"ppl", "nll", "tokens", ...}, "increase": quantized / fp32 - 1}}`` with ``label`` the
    text's source (``austen:sensesensibility``, ``pydoc``, a file path): held-out text of other domains than the
    main evaluation, to see whether the calibration overfit its own domain.  ``datasets``: the texts made into
    datasets already, by label (:func:`quantkit.evaluate.streamed.extra_datasets`)."""
    from quantkit.evaluate.perplexity import perplexity
    from quantkit.progress import tqdm

    out: dict[str, dict[str, Any]] = {}
    for spec in recipe.evaluation.extra:
        d = spec.model_dump()
        label = str(d.get("source") or d.get("path") or d.get("kind"))
        ds = (datasets or {}).get(label)
        if ds is None:
            ds = make_dataset(d, inputs=inputs, tokenizer=tokenizer, split="evaluation")
        row: dict[str, Any] = {}
        for name, m in models.items():
            with tqdm(total=len(ds), desc=f"perplexity {name} ({label})", unit="window", disable=not progress) as bar:
                def tick(done: int, total: int, bar: Any = bar) -> None:
                    bar.n = done
                    bar.refresh()

                row[name] = perplexity(m, ds, progress=tick)
        if "fp32" in row and "quantized" in row:
            row["increase"] = row["quantized"]["ppl"] / row["fp32"]["ppl"] - 1.0
        out[label] = row
    return out


def calibrate_ranges(
    float_model: ir.Model,
    float_proto: onnx.ModelProto,
    float_bytes: bytes | None,
    plan: QuantPlan,
    cal: Dataset,
    rec: RecipeModel,
    *,
    progress: bool,
    use_cache: bool,
    tensors: Collection[str] | None = None,
    mean_layers: Collection[str] | None = None,
    candidates: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] | None = None,
    source: str | None = None,
    digest: Callable[[], str] | None = None,
    transient: Mapping[str, Any] | None = None,
    transient_out: dict[str, Any] | None = None,
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray] | None, dict[str, Any]]:
    """Ranges of every planned tensor (+ per-channel input means for bias correction), or of ``tensors`` and the
    means of ``mean_layers`` only (what an earlier plan on the same model did not calibrate yet).

    Calibrators that can work from collected statistics (``from_statistics``: all built-ins)
    share one cached pass; others stream in a pass of their own.  ``candidates`` (filled when given): for the
    tensors of the ``auto`` calibrator, ``candidate calibrator -> tensor -> range`` (the returned range of such a
    tensor is its first candidate's, until the run chooses).  ``source``: the float model staged on disk
    (:mod:`quantkit.staging`), which the statistics pass opens instead of serializing ``float_proto``;
    ``digest``: the model's content hash for the statistics cache (else the hash of ``float_bytes``).
    ``transient``: gather requests collected in the same pass and never cached (a pair-safe target's kernel-order
    second moments); their collectors go to ``transient_out``.
    """
    from quantkit.algorithms.bias_correction import ChannelMean
    from quantkit.calibrate.cache import StatsCache, cache_key, model_hash
    from quantkit.calibrate.gather import Request, gather
    from quantkit.calibrate.stats import TensorStatistics
    from quantkit.frontends.cache import cache_dir

    bins = rec.calibration.histogram_bins
    cal_tensors = plan.calibrated_tensors()
    if tensors is not None:
        cal_tensors = {k: v for k, v in cal_tensors.items() if k in set(tensors)}
    classes = {name: get_calibrator(tq.calibrator) for name, tq in cal_tensors.items()}
    requests: dict[str, Request] = {
        name: Request(name, lambda: TensorStatistics(bins=bins), TensorStatistics.from_state)
        for name, cls in classes.items()
        if hasattr(cls, "from_statistics")
    }
    mean_keys: dict[str, str] = {}
    if rec.quantization.bias_correction:
        for layer, (tensor, axis) in bias_mean_inputs(float_model, plan).items():
            if mean_layers is not None and layer not in mean_layers:
                continue
            key = f"{tensor}//mean{axis}"
            mean_keys[layer] = key
            requests[key] = Request(tensor, functools.partial(ChannelMean, axis), ChannelMean.from_state)
    cache = None
    if use_cache and rec.calibration.cache:
        if digest is not None:
            model_digest = digest()
        else:
            model_digest = model_hash(float_bytes if float_bytes is not None else float_proto.SerializeToString())
        key = cache_key(model_digest, cal.fingerprint(), {"bins": bins})
        cache = StatsCache(cache_dir(), key)
    uncached = uncached_reason(use_cache, rec)
    got = gather(source if source is not None else float_proto, cal, requests, cache=cache, batch_size=rec.calibration.batch_size,
                 max_batch_output_bytes=rec.calibration.max_batch_output_bytes, progress=progress,
                 uncached=uncached, transient=transient,
                 transient_what="pair-safe rounding input second moments (never cached: K x 256 floats per layer)")
    if transient and transient_out is not None:
        transient_out.update({k: got.collectors[k] for k in transient})
    options = dict(rec.calibration.calibrator_options)
    streaming = {name: _factory(classes[name], tq.dtype, tq.symmetric, options)
                 for name, tq in cal_tensors.items() if name not in requests}
    calibrators: dict[str, Any] = {}
    if streaming:
        log.info("calibrators without from_statistics (%s) need a pass of their own",
                 ", ".join(sorted({cal_tensors[n].calibrator for n in streaming})))
        calibrators.update(collect_statistics(
            source if source is not None else float_proto, cal, streaming, batch_size=rec.calibration.batch_size,
            max_batch_output_bytes=rec.calibration.max_batch_output_bytes, progress=progress))
    for name, tq in cal_tensors.items():
        if name in requests:
            calibrators[name] = classes[name].from_statistics(  # type: ignore[attr-defined]
                got.collectors[name], dtype=tq.dtype, symmetric=tq.symmetric,
                **(options if tq.calibrator == rec.calibration.calibrator else {}))
    ranges = {name: c.compute_range() for name, c in calibrators.items()}
    if candidates is not None:
        for name, c in calibrators.items():
            if hasattr(c, "ranges_by_candidate"):  # the auto calibrator
                for cand, rng in c.ranges_by_candidate().items():
                    candidates.setdefault(cand, {})[name] = rng
    means = None
    if mean_keys:
        means = {layer: got.collectors[k].mean for layer, k in mean_keys.items() if got.collectors[k].mean is not None}
    info = {"reused": got.reused, "collected": got.collected, "cache": got.cache_path,
            "uncached": None if cache is not None else uncached, "streamed_separately": len(streaming)}
    return ranges, means, info



def bias_mean_inputs(float_model: ir.Model, plan: QuantPlan) -> dict[str, tuple[str, int]]:
    """``layer -> (input tensor, channel axis)`` of the planned weighted layers (Conv / Gemm / MatMul) whose bias
    correction needs the per-channel mean of their input; the plan's other int8 layers need none."""
    from quantkit.ops import WEIGHTED

    out: dict[str, tuple[str, int]] = {}
    for node in float_model.graph:
        lp = plan.layers.get(node.name or "")
        if lp is None or node.op_type not in WEIGHTED or node.inputs[0] is None:
            continue
        out[node.name or ""] = (node.inputs[0].name or "", 1 if node.op_type == "Conv" else -1)
    return out


def uncached_reason(use_cache: bool, rec: RecipeModel) -> str:
    """Why statistics that could be cached are not: what switched the cache off."""
    if not use_cache:
        return "--no-cache (use_cache=False)"
    return "calibration.cache: false in the recipe" if not rec.calibration.cache else ""


def _factory(cls: Any, dtype: str, symmetric: bool, options: dict[str, Any]) -> Any:
    return lambda: cls(dtype=dtype, symmetric=symmetric, **options)


KERNEL_CHECK_TOKENS = 64
"""Token sequences are cut to this many positions for the kernel check: it tests kernel arithmetic, which
does not depend on the context length (a 512-token LLM window costs 8x the time and finds nothing more)."""


def _seq_axes(proto: onnx.ModelProto) -> tuple[str | None, set[str]]:
    """``(token input, inputs whose axis 1 may be cut with it)`` of ``proto``'s graph: the token input is
    ``input_ids`` (else the only 2-D int64 input) when its axis 1 is dynamic; the others are the inputs whose axis 1
    is dynamic too (an attention mask of any type, ``token_type_ids``, a ``bbox [N, S, 4]``, position ids).  A
    model whose sequence length is fixed is never cut (``(None, set())``)."""
    dims: dict[str, list[Any]] = {}
    for i in proto.graph.input:
        t = i.type.tensor_type
        if t.HasField("shape"):
            dims[i.name] = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim]
    elem = {i.name: i.type.tensor_type.elem_type for i in proto.graph.input}
    token = "input_ids" if "input_ids" in dims else None
    if token is None:
        cands = [n for n, d in dims.items() if len(d) == 2 and elem.get(n) == onnx.TensorProto.INT64]
        token = cands[0] if len(cands) == 1 else None
    if token is None or len(dims[token]) < 2 or isinstance(dims[token][1], int):
        return None, set()
    return token, {n for n, d in dims.items() if len(d) >= 2 and not isinstance(d[1], int)}


def _cropped(ds: Dataset, tokens: int, state: dict[str, bool] | None = None, *, proto: onnx.ModelProto) -> Any:
    """``ds``'s samples one at a time, token sequences cut to ``tokens`` (:func:`_seq_axes`: the token input and the
    inputs of the same length along a dynamic axis 1; nothing when ``proto``'s sequence is fixed); ``state["cropped"]``:
    whether the feed just yielded was cut."""
    token, axes = _seq_axes(proto)
    for feed in ds.batches(1):
        if token is None or token not in feed or np.ndim(feed[token]) != 2:
            out = dict(feed)
        else:
            length = np.shape(feed[token])[1]
            out = {k: (v[:, :tokens] if k in axes and np.ndim(v) >= 2 and np.shape(v)[1] == length else v)
                   for k, v in feed.items()}
        if state is not None:
            state["cropped"] = any(out[k].shape != np.shape(v) for k, v in feed.items())
        yield out


class _UncutOnly:
    """A :class:`_LayerProbe` seen by the kernel check: it observes only the feeds the check did not cut (the
    per-layer SQNR stays a figure of the evaluation samples as they are)."""

    def __init__(self, probe: _LayerProbe, state: dict[str, bool]) -> None:
        self.probe, self.state = probe, state
        self.tensors = probe.tensors

    def wants_more(self) -> bool:
        return self.probe.wants_more()

    def observe(self, feed: Mapping[str, np.ndarray], quantized: Sequence[np.ndarray]) -> None:
        if not self.state.get("cropped"):
            self.probe.observe(feed, quantized)


def verify_kernels(qproto: onnx.ModelProto, target: Any, ds: Dataset | None, samples: int,
                   staged: StagedModel | None = None, probe: _LayerProbe | None = None) -> dict[str, Any]:
    """The target, the CPU we run on, the model's portability per CPU class (from its weights) and, on
    ``samples`` feeds of ``ds`` (token sequences cut to :data:`KERNEL_CHECK_TOKENS`), whether this CPU's
    fused kernels agree with the QDQ math (``staged``: the model staged on disk, opened by path).  ``probe``: a
    :func:`layer_probe` fed the reference run's layer tensors of every feed that was not cut (so the evaluation
    does not run the QDQ math again for them)."""
    from quantkit.lowering.kernel_check import kernel_vs_reference, portability, random_ops
    from quantkit.scheme.target import detect_cpu

    port = portability(qproto)
    out: dict[str, Any] = {"target": target.as_dict(), "cpu": detect_cpu().as_dict(), "portability": port}
    rand = random_ops(qproto)
    if rand and ds is not None and samples > 0:
        out["check_skipped"] = (f"the graph draws random numbers ({', '.join(rand[:3])}"
                                + (f" and {len(rand) - 3} more" if len(rand) > 3 else "") + "): two runs of the same "
                                "model differ, so the fused kernels cannot be compared with the QDQ math run by run")
    elif ds is not None and samples > 0:
        at_risk = {r["layer"] for r in port["layers_at_risk"]}
        state: dict[str, bool] = {}
        out["check"] = kernel_vs_reference(qproto, _cropped(ds, KERNEL_CHECK_TOKENS, state, proto=qproto), samples=samples,
                                           emulate=at_risk, staged=staged,
                                           observer=None if probe is None else _UncutOnly(probe, state)).as_dict()
    return out



def verify_model(model: str | os.PathLike[str] | onnx.ModelProto, data: Any = None, *, samples: int = 16,
                 tokenizer: Any = None) -> dict[str, Any]:
    """Check an emitted int8 model on *this* machine: its target (from the model's metadata), this CPU's
    class, its portability per CPU class, and - given ``data`` (anything :func:`quantkit.data.as_dataset`
    takes) - whether this CPU's fused kernels compute its QDQ math, layer by layer.  ``warnings`` lists
    what a report would warn about; ``ok`` is False when the kernels part from the math here."""
    from quantkit.report.build import kernel_warnings
    from quantkit.scheme.target import Target

    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise QuantkitError(f"samples {samples!r}: allowed: an integer >= 1 (the samples to compare)")
    if isinstance(model, onnx.ModelProto):
        proto = model
    else:
        path = Path(model)
        if path.is_dir() and (path / "model.onnx").is_file():  # an output folder: its model
            path = path / "model.onnx"
        elif path.is_dir():
            raise QuantkitError(f"{str(path)!r} is a folder without a model.onnx; allowed: a quantized ONNX file or "
                                "the output folder quantkit wrote it to")
        if not path.is_file():
            raise QuantkitError(f"model file {str(path)!r} does not exist")
        try:
            proto = onnx.load(str(path))
        except Exception as exc:  # noqa: BLE001 - protobuf raises several types on a broken file
            raise QuantkitError(f"{path}: not a readable ONNX model ({exc})") from None
    if not _has_quantized_ops(proto):
        where = "the model" if isinstance(model, onnx.ModelProto) else repr(str(model))
        raise ModelError(f"{where} has no quantized layer (no QuantizeLinear / DequantizeLinear, integer or n-bit "
                         "kernel): there is nothing to verify; allowed: a model quantkit quantized (quantkit "
                         "calibrate writes one)")  # fmt: skip
    meta = {p.key: p.value for p in proto.metadata_props}
    tgt = json.loads(meta["quantkit.target"]) if "quantkit.target" in meta else None
    target = Target(**tgt) if tgt else Target(device="cpu", isa="unknown", cpu_class="unknown")
    ds = None
    if data is not None:
        ds = as_dataset(data, model_inputs(ir.from_proto(proto)), tokenizer=tokenizer, split="evaluation")
    out = verify_kernels(proto, target, ds, samples)
    out["warnings"] = kernel_warnings(out)
    out["ok"] = bool(out.get("check", {}).get("agree", True))
    return out



_QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
                            "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulNBits",
                            "GatherBlockQuantized", "QGemm", "MatMulInteger16",
                            # ONNX Runtime's contrib ops with integer weights or activations (quantize_dynamic's LSTM
                            # and attention, the transformer optimizer's quantized fusions, 4-bit variants)
                            "DynamicQuantizeLSTM", "QAttention", "QEmbedLayerNormalization", "MatMulBnb4",
                            "MatMulFpQ4", "QuantizeWithOrder", "DequantizeWithOrder", "QuantizeBFP", "DequantizeBFP",
                            "QMoE"})  # fmt: skip


def quantized_op_counts(model: ir.Model) -> dict[str, int]:
    """``op type -> count`` of the quantized operators in ``model`` (its main graph, subgraphs and functions)."""
    out: dict[str, int] = {}
    nodes = [*model.graph.all_nodes(), *(n for f in model.functions.values() for n in f)]
    for n in nodes:
        if _is_quantized_op(n.op_type):
            out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def _is_quantized_op(op_type: str) -> bool:
    return op_type in _QUANTIZED_OPS or op_type.startswith(("QLinear", "QOrdered"))


def _has_quantized_ops(proto: onnx.ModelProto) -> bool:
    nodes = [*proto.graph.node, *(n for f in proto.functions for n in f.node)]
    return any(_is_quantized_op(n.op_type) for n in nodes)


def first_feed(ds: Dataset, batch_size: int) -> dict[str, np.ndarray]:
    """The first ``batch_size`` samples of ``ds`` as one feed (the latency feed)."""
    return _first_feed(ds, batch_size)


def _first_feed(ds: Dataset, batch_size: int) -> dict[str, np.ndarray]:
    for feed in ds.batches(batch_size):
        return {k: np.ascontiguousarray(v[:batch_size]) for k, v in feed.items()}
    raise DataError("the dataset yielded no batch")



def latency_feed(ds: Dataset, rec: RecipeModel) -> dict[str, np.ndarray]:
    """The feed one-call latency is timed on: the first ``report.latency.batch_size`` samples, token ids cut to
    ``report.latency.seq_len``."""
    lat = rec.report.latency
    feed = _first_feed(ds, lat.batch_size)
    if lat.seq_len is not None:
        feed = {k: v[:, : lat.seq_len] if v.ndim == 2 and v.dtype == np.int64 else v for k, v in feed.items()}
    return feed


def measure_pair_latency(float_bytes: bytes | str, q_bytes: bytes | str, ds: Dataset, rec: RecipeModel
                         ) -> dict[str, Any]:
    """FP32 vs quantized latency on the same feed, interleaved, same run (each model as bytes or a path)."""
    lat = rec.report.latency
    feed = latency_feed(ds, rec)
    threads = lat.threads or 0
    sessions = {"fp32": make_session(float_bytes, threads=lat.threads),
                "quantized": make_session(q_bytes, threads=lat.threads)}
    res = compare_latency(sessions, feed, warmup=lat.warmup, repeat=lat.repeat, threads=threads)
    out: dict[str, Any] = {k: v.as_dict() for k, v in res.items()}
    out["speedup"] = res["fp32"].median_ms / max(res["quantized"].median_ms, 1e-9)
    return out



def compared_outputs(names: list[str]) -> list[str]:
    """The outputs a fidelity comparison looks at: all, except a KV-cache decoder's ``present.*``."""
    kept = [n for n in names if not n.startswith("present.")]
    return kept or names


def evaluate_fidelity(
    float_model: bytes, quant_model: bytes, ds: Dataset, *, batch_size: int = 8, metric: str = "auto",
    progress: bool = False,
) -> dict[str, Any]:
    """Run both models on ``ds`` (streaming) and compare every graph output (a KV-cache decoder: its
    ``logits`` only - the ``present.*`` caches are inputs of the next step, not results)."""
    return _fidelity_pass(float_model, quant_model, ds, batch_size=batch_size, metric=metric, progress=progress)


def _fidelity_pass(float_model: bytes | str, quant_model: bytes | str, ds: Dataset, *, batch_size: int, metric: str,
                   progress: bool, probe: _LayerProbe | None = None, memo: Fp32Outputs | None = None,
                   output_names: Sequence[str] | None = None) -> dict[str, Any]:
    """:func:`evaluate_fidelity`; with ``probe`` still short of samples, its FP32 session (exposing the layer
    tensors) runs the first samples one at a time and hands them to the probe, so the per-layer SQNR needs no FP32
    run of its own; ``float_model`` (the FP32 model as it is: exposed layer tensors block fusions, a ViT's FP32
    run is ~1.5x slower exposed) runs the rest.  ``memo``: FP32 outputs already computed for some samples (the
    kernel check's FP32 runs, or an earlier run of the same float model): those samples do not run FP32 again;
    the FP32 outputs computed here are kept there.  ``output_names``: the float model's graph outputs (read from
    a session when not given)."""
    from quantkit.progress import tqdm

    s_f: Any = None
    s_q = make_session(quant_model)
    if output_names is None:
        s_f = make_session(float_model)
        output_names = [o.name for o in s_f.get_outputs()]
    names = compared_outputs(list(output_names))
    cls = {"classification": True, "embedding": False, "sqnr": False}.get(metric)
    acc = FidelityAccumulator(classification=cls)
    tops: dict[str, tuple[list[np.ndarray], list[np.ndarray], int]] = {}  # output -> argmax rows FP32, quantized
    # FP32 outputs joined from one-sample runs (memo, probe) stand for the batch's until a batch shows they differ
    # from its batched run (a model whose outputs mix the samples: checked once, on the first joined batch)
    verdict = memo.joined_verdict() if memo is not None else None  # an earlier pass over this float graph
    joined_ok, checked = (True, False) if verdict is None else (verdict, True)
    with tqdm(total=len(ds), desc="evaluate", unit="sample", disable=not progress) as bar:
        for feed in ds.batches(batch_size):
            singles = _single_samples(feed)
            ref: list[np.ndarray] | None = None
            from_memo = False
            if memo is not None and joined_ok:
                hits = [memo.get(one, names) for one in singles]
                found = [h for h in hits if h is not None]
                if len(found) == len(hits):
                    memo.hits += len(hits)
                    ref, from_memo = _joined(found), True
            if ref is None and probe is not None and probe.wants_more():
                parts: list[list[np.ndarray]] = []
                # one sample at a time: a batch exposing every layer tensor allocates them all at once (ResNet-50,
                # 8 samples x 119 tensors: 3x slower per sample than one at a time)
                for one in singles:
                    got_f = probe.run_float(one, names)
                    parts.append([got_f[n] for n in names])
                    if probe.wants_more():  # exactly the first ``limit`` samples, whatever the batch size
                        probe.add(one, [got_f[t] for t in probe.tensors])
                ref = _joined(parts) if joined_ok else None
            got = s_q.run(names, feed)
            if ref is not None and len(singles) > 1 and (
                    not checked or any(np.shape(r) != np.shape(g) for r, g in zip(ref, got, strict=True))):
                if s_f is None:
                    s_f = make_session(float_model)
                batched = s_f.run(names, feed)
                checked = True
                same = _same_outputs(ref, batched)
                if memo is not None:
                    memo.set_joined_verdict(same)
                if not same:
                    joined_ok = False
                    log.info("the FP32 model's outputs for a batch differ from its outputs one sample at a time (the "
                             "model mixes the samples of a batch): the evaluation runs FP32 in whole batches")
                    ref, from_memo = batched, False
            if ref is None:
                if s_f is None:
                    s_f = make_session(float_model)
                ref = s_f.run(names, feed)
            if memo is not None and not from_memo and joined_ok:
                memo.put_batch(feed, names, ref)
            for n, r, g in zip(names, ref, got, strict=True):
                if np.issubdtype(r.dtype, np.floating):
                    acc.update(n, r, g)
                    if r.ndim == 2 and r.shape[-1] >= 2:
                        pred = tops.setdefault(n, ([], [], r.shape[-1]))
                        pred[0].append(np.argmax(r, axis=-1))
                        pred[1].append(np.argmax(g, axis=-1))
            first = next(iter(feed.values()))
            bar.update(first.shape[0] if np.ndim(first) else 1)
    out = acc.summary()
    _label_accuracy(out, tops, dataset_labels(ds))
    return out


def _label_accuracy(out: dict[str, Any], tops: Mapping[str, tuple[list[np.ndarray], list[np.ndarray], int]],
                    labels: np.ndarray | None) -> None:
    """Add accuracy against the data's class ``labels`` (FP32's and the quantized model's) to the first output
    whose rows are the labelled samples and whose classes cover the labels (logits ``[N, classes]``)."""
    if labels is None:
        return
    for name, (ref, got, classes) in tops.items():
        r, g = np.concatenate(ref), np.concatenate(got)
        if r.shape[0] != labels.shape[0] or int(labels.max()) >= classes:
            continue
        out[name]["accuracy_fp32"] = float(np.mean(r == labels))
        out[name]["accuracy"] = float(np.mean(g == labels))
        out[name]["labelled_samples"] = float(labels.shape[0])
        return
    log.info("the evaluation data carries %d class labels, but no output holds one row of class scores per "
             "sample with at least %d classes: no accuracy against labels", labels.shape[0], int(labels.max()) + 1)


def _joined(parts: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray] | None:
    """Per-sample outputs (``parts[sample][output]``) joined along axis 0 into a batch's; None when an output is a
    scalar (nothing to join along)."""
    if len(parts) == 1:
        return list(parts[0])
    if any(np.ndim(a) == 0 for p in parts for a in p):
        return None
    return [np.concatenate(c) for c in zip(*parts, strict=True)]


def _same_outputs(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Two runs' outputs equal up to the float noise of a different batch size (kernels block differently)."""
    for x, y in zip(a, b, strict=True):
        if np.shape(x) != np.shape(y):
            return False
        if np.issubdtype(np.asarray(x).dtype, np.floating):
            scale = float(np.max(np.abs(y))) if np.size(y) else 0.0
            if not np.allclose(x, y, rtol=0, atol=1e-4 * max(scale, 1e-12), equal_nan=True):
                return False
        elif not np.array_equal(x, y):
            return False
    return True


def _single_samples(feed: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """``feed`` split into feeds of one sample each (along axis 0; one feed when it holds one sample or a scalar)."""
    arrays = {k: np.asarray(v) for k, v in feed.items()}
    n = {a.shape[0] if a.ndim else 1 for a in arrays.values()}
    if len(n) != 1 or (count := n.pop()) <= 1 or any(a.ndim == 0 for a in arrays.values()):
        return [arrays]
    return [{k: a[i : i + 1] for k, a in arrays.items()} for i in range(count)]


def _exposed(p: onnx.ModelProto, tensors: Sequence[str]) -> bytes:
    """``p`` with ``tensors`` as extra graph outputs (serialized)."""
    from quantkit.lowering.kernel_check import with_outputs

    return with_outputs(p, tensors)


def _layer_tensors(float_proto: onnx.ModelProto, quant_proto: onnx.ModelProto, plan: QuantPlan,
                   extra_layers: Sequence[str]) -> dict[str, str]:
    """``layer -> tensor`` compared by :func:`layer_sqnr`: the layer's output as the quantized model computes it."""
    wanted = set(plan.layers) | set(extra_layers)
    names: dict[str, str] = {}
    q_values = {o for n in quant_proto.graph.node for o in n.output}
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in float_proto.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    for n in float_proto.graph.node:
        if n.name not in wanted or not n.output:
            continue
        out = n.output[0]
        # report the tensor that is actually quantized: after a folded Relu/Clip if there is one
        nxt = users.get(out, [])
        if len(nxt) == 1 and nxt[0].op_type in ("Relu", "Clip") and nxt[0].output[0] in plan.tensors:
            out = nxt[0].output[0]
        nxt = users.get(out, [])
        if out not in q_values and len(nxt) == 1 and nxt[0].op_type == "Add":
            out = nxt[0].output[0]  # bias folded into the fused kernel: compare after the bias
        if out in q_values:
            names[n.name] = out
    return names


def _layer_input_tensors(float_proto: onnx.ModelProto, quant_proto: onnx.ModelProto,
                         layers: Collection[str]) -> dict[str, list[str]]:
    """``layer -> the activation tensors it reads`` (computed by the graph, not its inputs or initializers, and
    present in the quantized model as a float value: the tensor before the layer's input quantizer).  Their SQNR
    against FP32 separates the error a layer makes from the error the float ops before it amplify
    (:mod:`quantkit.report.verdict`)."""
    wanted = set(layers)
    q_values = {o for n in quant_proto.graph.node for o in n.output}
    made = {o for n in float_proto.graph.node if n.op_type != "Constant" for o in n.output}
    out: dict[str, list[str]] = {}
    for n in float_proto.graph.node:
        if n.name not in wanted:
            continue
        data = n.input[:2] if n.op_type == "MatMul" else n.input[:1]
        ts = [t for t in data if t and t in made and t in q_values]
        if ts:
            out[n.name] = ts
    return out


class Fp32Outputs:
    """The FP32 model's graph outputs per evaluation sample, kept for the run: the kernel check's FP32 run of a
    sample (it exposes the probe's layer tensors) hands its outputs to the fidelity pass, and a latency guard's
    re-run of the same float model with another plan compares against them instead of running FP32 again.

    ``store``: where they live (:attr:`quantkit.formats.base.Artifacts.fp32_outputs`, shared by the runs of one
    float model); ``graph_key``: :func:`graph_key` of the float model (a Gemm rewritten to MatMul + Add for
    another plan is another key); a sample is keyed by the hash of its feed.  At most :attr:`limit_bytes` are
    kept (past that, later samples are run again)."""

    limit_bytes = 256 << 20

    def __init__(self, store: dict[str, Any], graph_key: str) -> None:
        self.store, self.graph_key = store, graph_key
        self.hits = 0

    def _key(self, feed: Mapping[str, np.ndarray]) -> str:
        import hashlib

        h = hashlib.blake2b(self.graph_key.encode(), digest_size=20)
        for k in sorted(feed):
            a = np.ascontiguousarray(feed[k])
            h.update(f"|{k}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.data)
        return h.hexdigest()

    def get(self, feed: Mapping[str, np.ndarray], names: Sequence[str]) -> list[np.ndarray] | None:
        got = self.store.get(self._key(feed))
        if got is None or any(n not in got for n in names):
            return None
        return [got[n] for n in names]

    def put(self, feed: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        size = sum(int(np.asarray(v).nbytes) for v in outputs.values())
        used = self.store.get("__bytes__", 0)
        if used + size > self.limit_bytes:
            return
        key = self._key(feed)
        if key not in self.store:
            self.store[key] = {k: np.array(v, copy=True) for k, v in outputs.items()}
            self.store["__bytes__"] = used + size

    def joined_verdict(self) -> bool | None:
        """Whether this float graph's outputs joined from one-sample runs equal its batched outputs (checked once
        per graph by the fidelity pass); None: not checked yet."""
        got = self.store.get(f"__joined__{self.graph_key}")
        return None if got is None else bool(got)

    def set_joined_verdict(self, same: bool) -> None:
        self.store[f"__joined__{self.graph_key}"] = bool(same)

    def put_batch(self, feed: Mapping[str, np.ndarray], names: Sequence[str], ref: Sequence[np.ndarray]) -> None:
        """Keep a batch's outputs sample by sample (when every output has the batch on axis 0)."""
        singles = _single_samples(feed)
        n = len(singles)
        if any(np.ndim(r) == 0 or np.shape(r)[0] != n for r in ref):
            return
        for i, one in enumerate(singles):
            self.put(one, {k: r[i : i + 1] for k, r in zip(names, ref, strict=True)})


def graph_key(model: onnx.ModelProto) -> str:
    """A cheap identity of a float graph's structure (ops, names, wiring, outputs; not the weights, which no plan
    edits): two plans that prepared the float model alike share it."""
    import hashlib

    h = hashlib.blake2b(digest_size=20)
    for n in model.graph.node:
        h.update(f"{n.domain}:{n.op_type}:{n.name}:{','.join(n.input)}>{','.join(n.output)};".encode())
    h.update(",".join(o.name for o in model.graph.output).encode())
    return h.hexdigest()


class _LayerProbe:
    """The per-layer SQNR's accumulator over the first ``limit`` samples: each sample's layer tensors from the FP32
    model (``float_exposed``: it exposes them) against the same tensors of the quantized model computed by the QDQ
    math as stated (no fusion hides a tensor).  The quantized tensors come either from the kernel check's
    reference run of the same sample (:meth:`observe`: no run of its own) or from the probe's own session of the
    quantized model (:meth:`add`, at ``basic``; ``staged``: the quantized model staged on disk, its variant opened
    by path)."""

    def __init__(self, quant_proto: onnx.ModelProto, names: Mapping[str, str], limit: int,
                 graph_outputs: Sequence[str], float_exposed: bytes | str, staged: StagedModel | None = None,
                 inputs: Mapping[str, Sequence[str]] | None = None) -> None:
        self.names = dict(names)
        self.inputs = {k: list(v) for k, v in (inputs or {}).items()}  # layer -> the tensors it reads
        self.tensors = list(dict.fromkeys([*names.values(), *(t for v in self.inputs.values() for t in v)]))
        self.extra = {t for t in self.tensors if t not in set(graph_outputs)}  # exposed only for the probe
        self.limit = limit
        self.seen = 0
        self.observed = 0  # samples whose quantized tensors came from the kernel check's reference run
        self.sig = dict.fromkeys(self.tensors, 0.0)
        self.noise = dict.fromkeys(self.tensors, 0.0)
        self._quant = (quant_proto, staged)
        self._float_exposed = float_exposed
        self._s_q: Any = None
        self._s_f: Any = None
        self.graph_outputs = list(graph_outputs)
        self.memo: Fp32Outputs | None = None  # where observe() keeps the FP32 graph outputs it computed

    def wants_more(self) -> bool:
        return self.seen < self.limit

    def run_float(self, feed: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """The FP32 model on ``feed``: ``outputs`` and the probe's layer tensors by name."""
        if self._s_f is None:
            self._s_f = make_session(self._float_exposed)
        want = list(dict.fromkeys([*outputs, *self.tensors]))
        return dict(zip(want, self._s_f.run(want, dict(feed)), strict=True))

    def add(self, feed: Mapping[str, np.ndarray], ref: Sequence[np.ndarray]) -> None:
        """Fold in one feed: ``ref`` the FP32 layer tensors (in :attr:`tensors` order); the quantized model runs."""
        if self._s_q is None:
            proto, staged = self._quant
            self._s_q = make_session(staged.variant(self.tensors) if staged is not None
                                     else _exposed(proto, self.tensors), level="basic")
        self._accumulate(feed, ref, self._s_q.run(self.tensors, dict(feed)))

    def observe(self, feed: Mapping[str, np.ndarray], quantized: Sequence[np.ndarray]) -> None:
        """Fold in one feed whose quantized layer tensors (QDQ math, :attr:`tensors` order) another run computed;
        the FP32 model runs."""
        got = self.run_float(feed, self.graph_outputs if self.memo is not None else [])
        if self.memo is not None:
            self.memo.put(feed, {n: got[n] for n in self.graph_outputs})
        self._accumulate(feed, [got[t] for t in self.tensors], quantized)
        self.observed += int(next(iter(feed.values())).shape[0]) if feed else 1

    def _accumulate(self, feed: Mapping[str, np.ndarray], ref: Sequence[np.ndarray],
                    rq: Sequence[np.ndarray]) -> None:
        from quantkit.lowering.kernel_check import energies

        for t, a, b in zip(self.tensors, ref, rq, strict=True):
            sig, noise, _ = energies(a, b)
            self.sig[t] += sig
            self.noise[t] += noise
        self.seen += int(next(iter(feed.values())).shape[0]) if feed else 1

    def _db(self, t: str) -> float:
        n, s = self.noise[t], self.sig[t]
        return float("inf") if n == 0 else float(10 * np.log10(max(s, 1e-300) / n))

    def result(self) -> dict[str, float]:
        """``layer -> output SQNR (dB)`` against FP32."""
        return {layer: self._db(t) for layer, t in self.names.items()}

    def input_result(self) -> dict[str, float]:
        """``layer -> SQNR (dB) of the worst tensor it reads``, before its input quantizer (``inf``: exact)."""
        return {layer: min(self._db(t) for t in ts) for layer, ts in self.inputs.items() if self.seen}


def layer_probe(float_proto: onnx.ModelProto, quant_proto: onnx.ModelProto, plan: QuantPlan, *, limit: int = 16,
                extra_layers: Sequence[str] = (), float_staged: StagedModel | None = None,
                quant_staged: StagedModel | None = None) -> _LayerProbe | None:
    """The per-layer SQNR's probe of ``plan``'s layers (and ``extra_layers``) over ``limit`` samples; ``None`` when
    no layer tensor can be compared.  Hand it to :func:`verify_kernels` (its reference run then supplies the
    quantized tensors) and to :func:`fidelity_and_layer_sqnr` (which fills what is still missing)."""
    names = _layer_tensors(float_proto, quant_proto, plan, extra_layers)
    if not names or limit <= 0:
        return None
    inputs = _layer_input_tensors(float_proto, quant_proto, names)
    tensors = list(dict.fromkeys([*names.values(), *(t for v in inputs.values() for t in v)]))
    exposed = (float_staged.variant(tensors) if float_staged is not None else _exposed(float_proto, tensors))
    return _LayerProbe(quant_proto, names, limit, [o.name for o in float_proto.graph.output], exposed,
                       staged=quant_staged, inputs=inputs)


def layer_sqnr(
    float_proto: onnx.ModelProto, quant_proto: onnx.ModelProto, plan: QuantPlan, ds: Dataset, *, limit: int = 16,
    extra_layers: Sequence[str] = (),
) -> dict[str, float]:
    """Output SQNR (dB) of every quantized layer: the layer's output tensor in the quantized model
    (exposed as an extra output, so ORT computes it with the same arithmetic) against the same tensor of
    the FP32 model, over the first ``limit`` evaluation samples.  ``plan``: the static-INT8 layers;
    ``extra_layers``: layers of other formats (weight-only, dynamic, 16-bit) whose node keeps its output."""
    names = _layer_tensors(float_proto, quant_proto, plan, extra_layers)
    if not names:
        return {}
    exposed = _exposed(float_proto, list(dict.fromkeys(names.values())))
    probe = _LayerProbe(quant_proto, names, limit, [o.name for o in float_proto.graph.output], exposed)
    s_f = make_session(exposed, level="basic")
    for feed in ds.batches(1):
        probe.add(feed, s_f.run(probe.tensors, feed))
        if not probe.wants_more():
            break
    return probe.result()


def fidelity_and_layer_sqnr(
    float_proto: onnx.ModelProto, quant_proto: onnx.ModelProto, plan: QuantPlan, ds: Dataset, *,
    float_bytes: bytes | None = None, quant_bytes: bytes | None = None, batch_size: int = 8, metric: str = "auto",
    progress: bool = False, limit: int = 16, extra_layers: Sequence[str] = (),
    float_staged: StagedModel | None = None, quant_staged: StagedModel | None = None,
    probe: _LayerProbe | None = None, memo: Fp32Outputs | None = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """:func:`evaluate_fidelity` and :func:`layer_sqnr` in one pass over ``ds``: on the first ``limit`` samples
    the FP32 run exposes the layer tensors (one sample at a time), instead of a second FP32 run of those samples
    for the per-layer figures.  ``probe``: a :func:`layer_probe` made earlier (the kernel check may have filled it
    already: then no sample is run for it here); ``float_staged`` / ``quant_staged``: the models staged on disk
    (:mod:`quantkit.staging`): sessions open them and their variants by path.  ``memo``: FP32 outputs kept for
    this float model (:class:`Fp32Outputs`)."""
    fb: bytes | str
    qb: bytes | str
    if float_staged is not None:
        fb = float_staged.path
    else:
        fb = float_bytes if float_bytes is not None else float_proto.SerializeToString()
    if quant_staged is not None:
        qb = quant_staged.path
    else:
        qb = quant_bytes if quant_bytes is not None else quant_proto.SerializeToString()
    if probe is None:
        probe = layer_probe(float_proto, quant_proto, plan, limit=limit, extra_layers=extra_layers,
                            float_staged=float_staged, quant_staged=quant_staged)
    fid = _fidelity_pass(fb, qb, ds, batch_size=batch_size, metric=metric, progress=progress, probe=probe,
                         memo=memo, output_names=[o.name for o in float_proto.graph.output])
    return fid, ({} if probe is None else probe.result())
