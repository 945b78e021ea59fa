"""One quantization job once its precision plan is chosen: execute, check, evaluate, report.

Both ways of choosing a plan end here - the recipe's overrides (:func:`quantkit.api.quantize`) and the
search (``search.target``) - so every model quantkit emits goes through the same steps::

    PrecisionPlan -> formats.lower_plan (handlers: static INT8, weight-only, dynamic INT8, 16-bit)
                  -> onnx.checker -> ORT census (what fused) -> kernel check (fused vs QDQ math, int8 only)
                  -> quality (fidelity per output, or perplexity for a causal LM) + per-layer SQNR
                  -> latency (FP32 vs quantized, same run; prefill/decode for a causal LM)
                  -> one report (report.build)

This module sits above :mod:`quantkit.formats`, :mod:`quantkit.pipeline` and :mod:`quantkit.report`, below
the API; the search never imports it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantkit.data import Dataset, as_dataset, make_dataset, model_inputs
from quantkit.errors import DataError, LoweringError, ModelError, QuantkitError
from quantkit.formats import Artifacts, Job, Lowered, lower_plan, prepare_float
from quantkit.frontends import LoadedModel, load_model
from quantkit.int4_kernel import choose_for_model
from quantkit.lowering.select import QuantPlan
from quantkit.lowering.verify import Census, census
from quantkit.pipeline import (
    Fp32Outputs,
    check_context,
    check_shapes,
    decoder_context,
    eval_dataset,
    extra_perplexities,
    fidelity_and_layer_sqnr,
    graph_key,
    latency_feed,
    layer_probe,
    measure_pair_latency,
    save_model,
    verify_kernels,
)
from quantkit.prep.pipeline import prepare
from quantkit.progress import stage
from quantkit.recipe import RecipeModel
from quantkit.recipe.plan import PrecisionPlan
from quantkit.report.build import build_report, load_average, write_report
from quantkit.scheme.target import resolve_target
from quantkit.staging import StageArea, StagedModel

log = logging.getLogger("quantkit")

__all__ = ["QuantizeResult", "check_save_args", "load_inputs", "run_plan"]


@dataclass
class QuantizeResult:
    """What :func:`quantkit.quantize` returns: the quantized model, its plan and its report."""

    model: ir.Model
    float_model: ir.Model
    plan: QuantPlan  # the static-INT8 part: layers, Q/DQ tensors, why others stayed float
    lowering: Any  # LoweringResult of the static-INT8 part (scales, zero points, notes)
    census: Census
    report: dict[str, Any]
    recipe: RecipeModel
    timings: dict[str, float] = field(default_factory=dict)
    precision: PrecisionPlan | None = None
    lowered: Lowered | None = None

    def save(self, directory: str | os.PathLike[str], *, report: bool = True, overwrite: bool = False
             ) -> dict[str, Path]:
        """Write ``model.onnx`` (+ external data when large), ``report.json`` and ``report.md``.

        All-or-nothing (:func:`quantkit.report.output.write_outputs`): the files are written into a
        staging folder and moved into ``directory`` as a set; quantkit's own earlier outputs there are
        replaced, a folder holding other files is refused unless ``overwrite``.
        """
        from quantkit.recipe.load import recipe_inputs
        from quantkit.report.output import check_output_dir, write_outputs

        check_save_args(directory, report)
        check_output_dir(directory, overwrite=overwrite)  # a bad folder or argument is refused before writing

        def fill(stage_dir: Path) -> None:
            save_model(self.model, stage_dir / "model.onnx", self.recipe.export.external_data)
            if report:
                write_report(self.report, stage_dir, self.recipe.report.formats)

        written = write_outputs(directory, fill, overwrite=overwrite, inputs=recipe_inputs(self.recipe))
        out = Path(directory)
        paths = {"model": out / "model.onnx"}
        paths.update({n: p for n, p in written.items() if n.startswith("report.")})
        return paths


def check_save_args(directory: Any, report: Any) -> None:
    """``save()``'s arguments have the allowed types (a path; True / False), else a typed error naming what came."""
    if not isinstance(directory, (str, os.PathLike)):
        raise QuantkitError(f"save(): directory must be a path (str or os.PathLike), got {type(directory).__name__} "
                            f"{directory!r}")  # fmt: skip
    if not isinstance(report, bool):
        raise QuantkitError(f"save(): report must be True or False, got {type(report).__name__} {report!r}")


TORCH_SIZES_HINT = (". A torch.nn.Module is exported with the sizes of example_inputs, only the batch axis free: "
                    "for other sizes (a sequence length, an image size) export it with quantkit.frontends.from_torch("
                    "module, example, dynamic_dims={'x': {1: 'seq'}}) and pass that model")
"""Appended to a shape mismatch of data for a model exported from PyTorch."""


def _refuse_quantized(loaded: LoadedModel) -> None:
    """Refuse a model that is quantized already (QDQ, QLinear*, MatMulNBits ...): there is nothing float left to
    quantize, and the run would emit it unchanged while saying "no layer was quantized"."""
    from quantkit.pipeline import quantized_op_counts

    counts = quantized_op_counts(loaded.model)
    if counts:
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
        raise ModelError(f"{loaded.source} is quantized already ({ops}): quantkit quantizes float models - give it "
                         "the float model this one was made from. To check a quantized model on this CPU (its fused "
                         "kernels against its QDQ math): quantkit verify MODEL.onnx --data DATA.npz")


def load_inputs(model: Any, calibration_data: Any, rec: RecipeModel, *, example_inputs: Any = None,
                progress: bool = True, timings: dict[str, float]) -> tuple[LoadedModel, ir.Model, Dataset]:
    """Load and prepare the float model; build the calibration dataset (logged: what the run calibrates on)."""
    t = time.perf_counter()
    source = model if model is not None else rec.model.source  # type: ignore[union-attr]
    load_kw: dict[str, Any] = {}
    torch = sys.modules.get("torch")  # loaded already when a torch module was passed
    if example_inputs is None and calibration_data is not None and torch is not None \
            and isinstance(source, torch.nn.Module):  # its export's example: the DataLoader's first batch
        from quantkit.frontends.torch_module import example_from_loader

        example_inputs = example_from_loader(source, calibration_data)
        if example_inputs is not None:
            log.info("example_inputs for the export: the first batch of the calibration DataLoader")
    if example_inputs is not None:
        load_kw["example_inputs"] = example_inputs
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir() and rec.model is not None:
        load_kw["seq_len"] = rec.model.seq_len
    if rec.model is not None:  # the recipe's causal-LM graph also for a model passed explicitly
        load_kw["graph"] = rec.model.graph
    with stage("load the model (the first use of a built-in exports it to ONNX, cached)", enabled=progress):
        loaded = load_model(source, **load_kw)
    timings["load_s"] = time.perf_counter() - t
    _refuse_quantized(loaded)
    t = time.perf_counter()
    with stage("prepare the graph (shape inference, constant folding, BatchNorm folding)", enabled=progress):
        float_model = prepare(loaded.model).model
    timings["prepare_s"] = time.perf_counter() - t
    inputs = model_inputs(float_model)
    if calibration_data is not None:
        cal = as_dataset(calibration_data, inputs, tokenizer=loaded.tokenizer)
    elif rec.calibration.data is not None:
        cal = make_dataset(rec.calibration.data.model_dump(), inputs=inputs, tokenizer=loaded.tokenizer,
                           split="calibration")
    else:
        raise QuantkitError("quantize() needs calibration data: pass calibration_data, or set the recipe's "
                            "calibration.data")
    if len(cal) == 0:
        raise DataError("the calibration dataset is empty")
    check_context(cal, decoder_context(float_model), "the calibration data")
    torch_model = loaded.kind == "torch"  # its data is in memory (tensors, arrays): every sample is checked
    check_shapes(cal, inputs, "the calibration data", TORCH_SIZES_HINT if torch_model else "", every=torch_model)
    spec = rec.calibration.data.model_dump() if calibration_data is None and rec.calibration.data else None
    log.info("calibration set: %d samples (%s)", len(cal),
             ", ".join(f"{k}={v}" for k, v in spec.items()) if spec else "given through the API")
    return loaded, float_model, cal


def checked_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as a proto that passes ``onnx.checker`` (else :class:`LoweringError`)."""
    proto = ir.to_proto(model)
    try:
        onnx.checker.check_model(proto, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise LoweringError(f"the emitted model fails onnx.checker: {exc}") from None
    return proto


def execute(float_model: ir.Model, plan: PrecisionPlan, cal: Dataset | None, *, progress: bool = True,
            use_cache: bool = True, artifacts: Artifacts | None = None, stage_area: StageArea | None = None
            ) -> tuple[Job, Lowered]:
    """Lower ``plan`` on ``float_model`` (Gemm layers in MatMul-only formats are rewritten in place first);
    ``stage_area``: where the job stages models for its sessions (:mod:`quantkit.staging`)."""
    rec = plan.recipe
    prepare_float(float_model, plan)
    job = Job(float_model, plan, cal, resolve_target(rec.target.isa, rec.target.device), progress=progress,
              use_cache=use_cache, artifacts=artifacts or Artifacts(), stage=stage_area)
    lowered = lower_plan(job)
    if not lowered.formats():
        log.warning("the plan quantizes no layer: the model is emitted in float")
    return job, lowered


def _is_lm(rec: RecipeModel, proto: onnx.ModelProto) -> bool:
    """A causal LM: perplexity and prefill / decode latency instead of output fidelity and one-call latency.

    Names alone (``input_ids`` in, ``logits`` out) also fit a text classifier, a token tagger, a masked LM or an
    RNN, so the model must also be causal: a KV cache in its I/O (``past*`` / ``present*``), or - measured once
    per model (:func:`_causal_logits`) - logits ``[batch, seq, vocab]`` whose earlier positions do not change
    when the last token does."""
    if not (rec.evaluation.perplexity and any(o.name == "logits" for o in proto.graph.output)
            and any(i.name == "input_ids" for i in proto.graph.input)):
        return False
    names = [v.name for v in (*proto.graph.input, *proto.graph.output)]
    if any(n.startswith(("past", "present")) for n in names):
        return True
    key = id(proto)
    if key not in _CAUSAL_MEMO or _CAUSAL_MEMO[key][0] is not proto:
        if len(_CAUSAL_MEMO) >= 4:  # the memo holds the protos it keys (ids are reused): a few at most
            _CAUSAL_MEMO.clear()
        _CAUSAL_MEMO[key] = (proto, _causal_logits(proto))
    return _CAUSAL_MEMO[key][1]


_CAUSAL_MEMO: dict[int, tuple[onnx.ModelProto, bool]] = {}
_PROBE_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "token_type_ids"})


def _causal_logits(proto: onnx.ModelProto) -> bool:
    """Run the float model on 16 token ids twice, the last one changed: causal when the logits are rank 3 over the
    16 positions, the vocabulary wider than the ids used, and the first 15 positions identical.  A model with
    other inputs, or one that fails to run on them, is not treated as a causal LM."""
    import onnxruntime as ort

    if any(i.name not in _PROBE_INPUTS for i in proto.graph.input):
        return False
    seq = 16
    ids = (np.arange(seq, dtype=np.int64) * 7 + 3).reshape(1, seq) % 97
    feeds: dict[str, np.ndarray] = {}
    for i in proto.graph.input:
        elem = i.type.tensor_type.elem_type
        dtype = np.int32 if elem == onnx.TensorProto.INT32 else np.int64
        base = {"input_ids": ids, "attention_mask": np.ones((1, seq)), "position_ids": np.arange(seq)[None],
                "token_type_ids": np.zeros((1, seq))}[i.name]
        feeds[i.name] = np.asarray(base, dtype=dtype)
    changed = {**feeds, "input_ids": feeds["input_ids"].copy()}
    changed["input_ids"][0, -1] = 98
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        out = [o.name for o in sess.get_outputs()].index("logits")
        a = np.asarray(sess.run(None, feeds)[out])
        b = np.asarray(sess.run(None, changed)[out])
    except Exception:  # noqa: BLE001 - any failure means: not a model the causal path can evaluate
        return False
    if a.ndim != 3 or a.shape[1] != seq or a.shape[2] <= 98:
        return False
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        log.warning("the FP32 model's logits are not finite (inf / NaN) on token ids %s: it is evaluated as a "
                    "generic model (output fidelity), not as a causal LM (no perplexity, no greedy agreement). "
                    "Check the float model first (a norm whose epsilon is missing, an overflow in float16)",
                    " ".join(str(int(t)) for t in ids[0]))
        return False
    return bool(np.allclose(a[:, :-1], b[:, :-1], rtol=1e-4, atol=1e-4) and not np.allclose(a[:, -1], b[:, -1]))


def _other_layers(lowered: Lowered) -> list[str]:
    """Layers of the formats other than static INT8 (weight-only, dynamic, 16-bit): their node keeps its output."""
    return [n for h, layers in lowered.layers.items() if h != "static" for n in layers]


def _quality(job: Job, lowered: Lowered, qproto: onnx.ModelProto, ev: Dataset, progress: bool, tokenizer: Any = None,
             q_staged: StagedModel | None = None, probe: Any = None, memo: Fp32Outputs | None = None
             ) -> tuple[dict[str, Any], dict[str, float]]:
    """Perplexity (causal LM) or fidelity per output, and the static layers' output SQNR."""
    rec = job.recipe
    if _is_lm(rec, job.float_proto):
        qbytes = qproto.SerializeToString()
        from quantkit.evaluate.perplexity import perplexity
        from quantkit.progress import tqdm

        quality: dict[str, Any] = {}
        for key, blob in (("perplexity_fp32", job.float_bytes), ("perplexity_quantized", qbytes)):
            with tqdm(total=len(ev), desc=key.replace("_", " "), unit="window", disable=not progress) as bar:
                def tick(done: int, total: int, bar: Any = bar) -> None:
                    bar.n = done
                    bar.refresh()

                quality[key] = perplexity(blob, ev, progress=tick)
        extra = extra_perplexities(rec, tokenizer, model_inputs(job.float_model),
                                   {"fp32": job.float_bytes, "quantized": qbytes}, progress)
        if extra:
            quality["perplexity_extra"] = extra
        if rec.evaluation.greedy_agreement is not None:  # as the layer-wise path reports it, without a KV cache
            from quantkit.evaluate.greedy import greedy_agreement

            with stage("greedy decoding, FP32 vs quantized (evaluation.greedy_agreement)", enabled=progress):
                quality["greedy_agreement"] = greedy_agreement(
                    job.float_bytes, qbytes, (np.asarray(b["input_ids"])[np.asarray(b["attention_mask"]) > 0]
                                              if "attention_mask" in b else np.asarray(b["input_ids"])
                                              for b in ev.batches(1)),
                    rec.evaluation.greedy_agreement)  # fmt: skip
        return quality, {}
    # one FP32 pass: the FP32 model also hands out the layer tensors of the first 16 samples
    fid, sq = fidelity_and_layer_sqnr(job.float_proto, qproto, lowered.static, ev,
                                      batch_size=rec.evaluation.batch_size, metric=rec.evaluation.metric,
                                      progress=progress, limit=16, extra_layers=_other_layers(lowered),
                                      float_staged=job.float_staged, quant_staged=q_staged, probe=probe,
                                      memo=memo)
    return {"fidelity": fid}, sq


def _latency(job: Job, qproto: onnx.ModelProto, ds: Dataset, q_staged: StagedModel | None = None) -> dict[str, Any]:
    rec = job.recipe
    if _is_lm(rec, job.float_proto):
        from quantkit.evaluate.decode import llm_latency

        return llm_latency(job.float_bytes, qproto.SerializeToString(), rec.report.latency,
                           vocab_input=model_inputs(job.float_model))
    return measure_pair_latency(job.float_source, qproto.SerializeToString() if q_staged is None else q_staged.path,
                                ds, rec)


def run_plan(loaded: LoadedModel, float_model: ir.Model, plan: PrecisionPlan, cal: Dataset, *,
             evaluation_data: Any = None, evaluate: bool = True, measure_latency: bool | None = None,
             progress: bool = True, use_cache: bool = True, timings: dict[str, float], t_start: float,
             artifacts: Artifacts | None = None, search: dict[str, Any] | None = None,
             int4_decided: dict[str, Any] | None = None) -> QuantizeResult:
    """Execute ``plan``, check the emitted model, evaluate it against FP32 and build the report.

    ``int4_decided``: the ``int4_kernel`` section of an earlier run of the same model (a latency guard's re-run):
    its MatMulNBits accuracy_level is kept instead of being timed again.  The run's sessions open the float and
    the quantized model staged in a private folder (:mod:`quantkit.staging`), removed when the run ends."""
    with StageArea() as area:
        return _run_plan(loaded, float_model, plan, cal, area, evaluation_data=evaluation_data, evaluate=evaluate,
                         measure_latency=measure_latency, progress=progress, use_cache=use_cache, timings=timings,
                         t_start=t_start, artifacts=artifacts, search=search, int4_decided=int4_decided)


def _run_plan(loaded: LoadedModel, float_model: ir.Model, plan: PrecisionPlan, cal: Dataset, area: StageArea, *,
              evaluation_data: Any, evaluate: bool, measure_latency: bool | None, progress: bool, use_cache: bool,
              timings: dict[str, float], t_start: float, artifacts: Artifacts | None, search: dict[str, Any] | None,
              int4_decided: dict[str, Any] | None) -> QuantizeResult:
    rec = plan.recipe
    # the evaluation set is built (and refused when empty) before the work, not after it
    ev = eval_dataset(rec, loaded, evaluation_data, model_inputs(float_model)) if evaluate else None
    if ev is not None:
        check_context(ev, decoder_context(float_model), "the evaluation data")
    t = time.perf_counter()
    job, lowered = execute(float_model, plan, cal, progress=progress, use_cache=use_cache, artifacts=artifacts,
                           stage_area=area)
    qproto = checked_proto(lowered.model)
    timings.update(lowered.timings)
    timings["lower_s"] = time.perf_counter() - t
    latency_on = bool(rec.report.latency.enabled if measure_latency is None else measure_latency)
    lowered_proto = qproto
    # the MatMulNBits accuracy_level, decided before the model is evaluated: every figure is of the shipped one
    qproto, int4 = choose_for_model(
        lowered.model, qproto, rec.export.accuracy_level, job.target.cpu_class, isa=job.target.isa,
        latency_on=latency_on, settings=rec.report.latency, progress=progress, decided=int4_decided,
        feed=None if _is_lm(rec, job.float_proto) else (lambda: latency_feed(ev or cal, rec)))
    if int4 is not None and int4["how"] == "measured":
        timings["accuracy_level_s"] = int4["time_s"]
    t = time.perf_counter()
    q_staged = None  # the shipped model staged for the sessions below (an LLM's perplexity and decode take bytes)
    if not _is_lm(rec, job.float_proto):
        q_staged = area.stage(lowered.model if qproto is lowered_proto else ir.from_proto(qproto), "quantized-")
    cen = census(qproto if q_staged is None else q_staged.path, quantizable=lowered.fused_layers())
    timings["verify_s"] = time.perf_counter() - t
    # the per-layer SQNR's probe: the kernel check's QDQ-math runs of evaluation samples fill it (no run of its own)
    probe = (layer_probe(job.float_proto, qproto, lowered.static, limit=16, extra_layers=_other_layers(lowered),
                         float_staged=job.float_staged, quant_staged=q_staged)
             if ev is not None and not _is_lm(rec, job.float_proto) else None)
    # FP32 outputs of evaluation samples: the kernel check's FP32 runs and a latency guard's earlier run fill it
    memo = Fp32Outputs(job.artifacts.fp32_outputs, graph_key(job.float_proto)) if probe is not None else None
    if probe is not None:
        probe.memo = memo
    kernels: dict[str, Any] = {}
    if lowered.static.layers or lowered.layers.get("dynamic"):
        t = time.perf_counter()
        with stage("check the fused kernels against the QDQ math", enabled=progress):
            kernels = verify_kernels(qproto, job.target, ev or cal, rec.report.kernel_check_samples,
                                     staged=q_staged, probe=probe)
        timings["kernel_check_s"] = time.perf_counter() - t
    quality: dict[str, Any] = {}
    per_layer: dict[str, float] = {}
    if ev is not None:
        t = time.perf_counter()
        quality, per_layer = _quality(job, lowered, qproto, ev, progress, loaded.tokenizer, q_staged, probe, memo)
        timings["evaluate_s"] = time.perf_counter() - t
    latency: dict[str, Any] = {}
    load: dict[str, Any] | None = None
    if latency_on:
        t = time.perf_counter()
        load = {"start": load_average()}  # the machine's load while the figures were measured
        with stage("measure latency (FP32 vs quantized, interleaved)", enabled=progress):
            latency = _latency(job, qproto, ev or cal, q_staged)
        load["end"] = load_average()
        timings["latency_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start
    report = build_report(
        recipe=rec, source=loaded.source, float_proto=job.float_proto, quant_proto=qproto, lowered=lowered,
        census=cen, quality=quality, per_layer_sqnr=per_layer, latency=latency, timings=timings,
        calibration_samples=len(cal), evaluation_samples=len(ev) if ev is not None else 0, kernels=kernels,
        zero_range=lowered.zero_range, search=search, calibration=job.artifacts.calibration_info, load=load,
        int4_kernel=int4, layer_input_sqnr=probe.input_result() if probe is not None else None)
    return QuantizeResult(lowered.model, float_model, lowered.static, lowered.lowering, cen, report, rec, timings,
                          precision=plan, lowered=lowered)
