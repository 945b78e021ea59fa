"""Pieces of the quantization pipeline that both the API and the search use.

``quantkit.api`` orchestrates one run and ``quantkit.search`` proposes and measures mixes; both call
these functions, which sit *below* them (this module imports neither), so the search never imports the
API: calibrated activation ranges (one cached statistics pass), the evaluation dataset of a recipe, and
saving a model atomically.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantkit.calibrate import get_calibrator
from quantkit.calibrate.collect import collect_statistics
from quantkit.data import Dataset, as_dataset, make_dataset
from quantkit.frontends import LoadedModel
from quantkit.lowering.select import QuantPlan
from quantkit.recipe import RecipeModel

__all__ = ["EXTERNAL_DATA_THRESHOLD", "calibrate_ranges", "eval_dataset", "model_bytes", "save_model"]

log = logging.getLogger("quantkit")

EXTERNAL_DATA_THRESHOLD = 1_800_000_000



def save_model(model: ir.Model, path: Path, external: str = "auto") -> Path:
    """Serialize ``model`` atomically to ``path`` (external data ``path.data`` when large)."""
    proto = ir.to_proto(model)
    use_external = external == "always" or (external == "auto" and proto.ByteSize() > EXTERNAL_DATA_THRESHOLD)
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
    if evaluation_data is not None:
        return as_dataset(evaluation_data, inputs, tokenizer=loaded.tokenizer)
    if recipe.evaluation.data is not None:
        return make_dataset(recipe.evaluation.data.model_dump(), inputs=inputs, tokenizer=loaded.tokenizer,
                            split="evaluation")
    return None



def calibrate_ranges(
    float_model: ir.Model,
    float_proto: onnx.ModelProto,
    float_bytes: bytes,
    plan: QuantPlan,
    cal: Dataset,
    rec: RecipeModel,
    *,
    progress: bool,
    use_cache: bool,
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray] | None, dict[str, Any]]:
    """Ranges of every planned tensor (+ per-channel input means for bias correction).

    Calibrators that can work from collected statistics (``from_statistics``: all built-ins)
    share one cached pass; others stream in a pass of their own.
    """
    from quantkit.algorithms.bias_correction import ChannelMean
    from quantkit.calibrate.cache import StatsCache, cache_key, model_hash
    from quantkit.calibrate.gather import Request, gather
    from quantkit.calibrate.stats import TensorStatistics
    from quantkit.frontends.cache import cache_dir
    from quantkit.ops import WEIGHTED

    bins = rec.calibration.histogram_bins
    cal_tensors = plan.calibrated_tensors()
    classes = {name: get_calibrator(tq.calibrator) for name, tq in cal_tensors.items()}
    requests: dict[str, Request] = {
        name: Request(name, lambda: TensorStatistics(bins=bins), TensorStatistics.from_state)
        for name, cls in classes.items()
        if hasattr(cls, "from_statistics")
    }
    mean_keys: dict[str, str] = {}
    if rec.quantization.bias_correction:
        for node in float_model.graph:
            lp = plan.layers.get(node.name or "")
            if lp is None or node.op_type not in WEIGHTED or node.inputs[0] is None:
                continue
            axis = 1 if node.op_type == "Conv" else -1
            tensor = node.inputs[0].name or ""
            key = f"{tensor}//mean{axis}"
            mean_keys[node.name or ""] = key
            requests[key] = Request(tensor, functools.partial(ChannelMean, axis), ChannelMean.from_state)
    cache = None
    if use_cache and rec.calibration.cache:
        key = cache_key(model_hash(float_bytes), cal.fingerprint(), {"bins": bins})
        cache = StatsCache(cache_dir(), key)
    got = gather(float_proto, cal, requests, cache=cache, batch_size=rec.calibration.batch_size,
                 max_batch_output_bytes=rec.calibration.max_batch_output_bytes, progress=progress)
    options = dict(rec.calibration.calibrator_options)
    streaming = {name: _factory(classes[name], tq.dtype, tq.symmetric, options)
                 for name, tq in cal_tensors.items() if name not in requests}
    calibrators: dict[str, Any] = {}
    if streaming:
        log.info("calibrators without from_statistics (%s) need a pass of their own",
                 ", ".join(sorted({cal_tensors[n].calibrator for n in streaming})))
        calibrators.update(collect_statistics(
            float_proto, cal, streaming, batch_size=rec.calibration.batch_size,
            max_batch_output_bytes=rec.calibration.max_batch_output_bytes, progress=progress))
    for name, tq in cal_tensors.items():
        if name in requests:
            calibrators[name] = classes[name].from_statistics(  # type: ignore[attr-defined]
                got.collectors[name], dtype=tq.dtype, symmetric=tq.symmetric,
                **(options if tq.calibrator == rec.calibration.calibrator else {}))
    ranges = {name: c.compute_range() for name, c in calibrators.items()}
    means = None
    if mean_keys:
        means = {layer: got.collectors[k].mean for layer, k in mean_keys.items() if got.collectors[k].mean is not None}
    info = {"reused": got.reused, "collected": got.collected, "cache": got.cache_path,
            "streamed_separately": len(streaming)}
    return ranges, means, info



def _factory(cls: Any, dtype: str, symmetric: bool, options: dict[str, Any]) -> Any:
    return lambda: cls(dtype=dtype, symmetric=symmetric, **options)


