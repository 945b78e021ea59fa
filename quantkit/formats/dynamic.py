"""Dynamic INT8 (``int8_dynamic``): int8 weights per output column, activations quantized at run time
per token (``DynamicQuantizeLinear`` per row -> ``MatMulIntegerToFloat``) or per tensor
(``DynamicQuantizeMatMul``), with SmoothQuant.

SmoothQuant: layers that read the same input share one scale ``s`` (``y = (x / s) @ (s W)``), chosen per
group (``smoothquant: auto``: the alpha on the grid, or no smoothing, with the least W8A8 output error on
a sample of real input rows; a number: that alpha; ``off``).  ``1/s`` folds into the producing
normalization when it has no other reader, else it is an explicit ``Mul``.  Needs: per-channel
``max |x|`` and a row sample of each group's input (one cached pass) when smoothing.  Weight codes obey
the int16 pair bound when the target needs it.  Float tensors in and out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.formats.base import FormatHandler, Job, Lowered


@dataclass
class DynamicArtifact:
    """Shared SmoothQuant scale (None: no smoothing) and the int8 codes + scales of each layer."""

    s: np.ndarray | None
    alpha: float | None
    codes: dict[str, tuple[np.ndarray, np.ndarray]]


def dynamic_artifact(weights: dict[str, np.ndarray], stats: Any, smoothquant: float | str, granularity: str,
                     pair_safe: bool) -> DynamicArtifact:
    """Choose the group's SmoothQuant scale and its int8 codes (pair-safe when asked).  Alpha is chosen on
    plain codes: pair-safe rounding moves the error far less than alpha does."""
    from quantkit.algorithms.smoothquant import choose_alpha, int8_weight_per_column

    s, alpha = None, None
    ws = list(weights.values())
    if smoothquant != "off" and stats is not None:
        s, alpha, _ = choose_alpha(stats, ws, smoothquant, per_token=granularity == "per_token")
    codes = {n: int8_weight_per_column(w if s is None else w * s[:, None], pair_safe=pair_safe)
             for n, w in weights.items()}
    return DynamicArtifact(s, alpha, codes)


def channel_absmax(job: Job, inputs: list[str]) -> dict[str, Any]:
    """``max |x|`` per channel + a row sample of each tensor in ``inputs`` (cached in the artifacts and on disk)."""
    from quantkit.algorithms.smoothquant import ChannelAbsMax
    from quantkit.calibrate.cache import StatsCache, cache_key, model_hash
    from quantkit.calibrate.gather import Request, gather
    from quantkit.errors import DataError
    from quantkit.frontends.cache import cache_dir

    art = job.artifacts.absmax
    todo = sorted({t for t in inputs if t not in art})
    if todo:
        if job.calibration is None:
            raise DataError("int8_dynamic with SmoothQuant needs calibration data (or smoothquant: off)")
        reqs = {f"{t}//absmax": Request(t, ChannelAbsMax, ChannelAbsMax.from_state) for t in todo}
        cache = None
        if job.recipe.calibration.cache and job.use_cache:
            key = cache_key(model_hash(job.float_bytes), job.calibration.fingerprint(),
                            {"statistic": "channel-absmax", "rows": 256})
            cache = StatsCache(cache_dir(), key)
        from quantkit.pipeline import uncached_reason

        got = gather(job.float_proto, job.calibration, reqs, cache=cache, batch_size=1,
                     max_batch_output_bytes=job.recipe.calibration.max_batch_output_bytes, progress=job.progress,
                     what="SmoothQuant statistics (per-channel max |x|)",
                     uncached=uncached_reason(job.use_cache, job.recipe))
        art.update({t: got.collectors[f"{t}//absmax"] for t in todo})
    return {t: art[t] for t in inputs}


class DynamicInt8(FormatHandler):
    name = "dynamic"
    formats = ("int8_dynamic",)
    family = "dynamic"
    needs = "per-channel max|x| + a row sample of each shared input (SmoothQuant; one cached pass)"
    boundary = "none: float activations in and out (quantized per token inside the kernel)"

    def select(self, job: Job) -> dict[str, Any]:
        from quantkit.formats.execute import linear_layers_in

        return linear_layers_in(job, self.formats)

    def groups(self, job: Job, layers: dict[str, Any]) -> dict[tuple[Any, ...], list[str]]:
        """Layers sharing an input and a scheme share one SmoothQuant scale."""
        out: dict[tuple[Any, ...], list[str]] = {}
        for n, (node, lp) in layers.items():
            x = node.inputs[0]
            out.setdefault((x.name if x is not None else n, lp.smoothquant, lp.granularity), []).append(n)
        return out

    def artifact(self, job: Job, names: list[str], weights: dict[str, np.ndarray], smoothquant: Any,
                 granularity: str, x: str) -> DynamicArtifact:
        key = (tuple(names), repr(smoothquant), granularity, job.target.pair_safe)
        art = job.artifacts.dynamic
        if key not in art:
            stats = channel_absmax(job, [x])[x] if smoothquant != "off" else None
            art[key] = dynamic_artifact(weights, stats, smoothquant, granularity, job.target.pair_safe)
        return art[key]

    def lower(self, job: Job, model: ir.Model, layers: dict[str, Any], out: Lowered) -> None:
        from quantkit.lowering.dynamic import lower_int8_dynamic
        from quantkit.lowering.nbits import apply_input_scale
        from quantkit.lowering.select import constant_array

        rows = []
        groups = self.groups(job, layers)
        channel_absmax(job, sorted({x for (x, sq, _) in groups if sq != "off"}))  # one pass for every group
        for (x, sq, gran), names in groups.items():
            weights = {n: np.asarray(constant_array(layers[n][0].inputs[1]), np.float32) for n in names}
            a = self.artifact(job, names, weights, sq, gran, x)
            if a.s is not None:
                apply_input_scale(model, names, a.s)
            for n in names:
                q, sc = a.codes[n]
                lower_int8_dynamic(model, n, q, sc, granularity=gran)
                rows.append({"layer": n, "format": "int8_dynamic", "granularity": gran,
                             "smoothquant_alpha": a.alpha, "shared_with": len(names) - 1})
        out.layers[self.name] = {n: "int8_dynamic" for n in layers}
        out.sections[self.name] = rows
