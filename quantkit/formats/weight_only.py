"""Weight-only INT4 / INT8 (``int4``, ``int8_weight``): ``MatMulNBits`` (or blocked DQ -> MatMul).

Needs: ``Σ xᵀx`` and a bounded row sample of each layer's input when its algorithm is GPTQ / AWQ (one
pass per sequential stage, :func:`quantkit.weight_only.quantize_weights`); RTN needs nothing.  A tied
lm_head / embedding is stored once (``GatherBlockQuantized`` + ``MatMulNBits``).  Float tensors in
and out: no boundary with the neighbours.
"""

from __future__ import annotations

import time
from typing import Any

import onnx_ir as ir

from quantkit.formats.base import FormatHandler, Job, Lowered
from quantkit.progress import stage, tally_active


def scheme_key(lp: Any) -> tuple[Any, ...]:
    """What a layer's weight-only result depends on (besides the data): format, group, algorithm, options."""
    return (lp.format, lp.group_size, lp.weight_symmetric, lp.algorithm, repr(lp.algorithm_options))


class WeightOnly(FormatHandler):
    name = "weight_only"
    formats = ("int4", "int8_weight")
    family = "weight_only"
    needs = "layer-input second moments Σxᵀx + a row sample (GPTQ / AWQ; sequential stages); none for RTN"
    boundary = "none: float activations in and out (MatMulNBits dequantizes its weight blocks inside)"

    def select(self, job: Job) -> dict[str, Any]:
        from quantkit.weight_only import select_weight_only

        return select_weight_only(job.float_model, job.plan)

    def results(self, job: Job, layers: dict[str, Any]) -> Any:
        """The :class:`~quantkit.weight_only.WOQOutcome` of ``layers``; reuses the artifacts' results of
        layers with the same scheme, computes the rest (one sequential run over them)."""
        from quantkit.weight_only import WOQOutcome, quantize_weights

        art = job.artifacts.woq
        keys = {n: (n, scheme_key(lay.plan)) for n, lay in layers.items()}
        todo = {n: lay for n, lay in layers.items() if keys[n] not in art}
        if todo:
            algos = sorted({lay.plan.algorithm for lay in todo.values()})
            with stage(f"weight-only layers ({len(todo)}): {', '.join(algos)}", enabled=job.progress):
                got = quantize_weights(job.float_model, job.recipe, todo, job.calibration,
                                       progress=job.progress and not tally_active())  # a search: counted
            rows = {r["layer"]: r for r in got.rows}
            for n in todo:
                art[keys[n]] = (got.results[n], rows.get(n, {}), got.notes.get(n, ""))
        outcome = WOQOutcome(layers, {})
        for n in layers:
            res, row, note = art[keys[n]]
            outcome.results[n] = res
            if row:
                outcome.rows.append(dict(row))
            if note:
                outcome.notes[n] = note
        return outcome

    def lower(self, job: Job, model: ir.Model, layers: dict[str, Any], out: Lowered) -> None:
        from quantkit.weight_only import lower_weight_only

        t = time.perf_counter()
        outcome = self.results(job, layers)
        out.timings["weights_s"] = time.perf_counter() - t
        with stage("lower to MatMulNBits / GatherBlockQuantized", enabled=job.progress):
            lower_weight_only(model, job.recipe, outcome)
        out.woq = outcome
        out.layers[self.name] = {n: lay.plan.format for n, lay in layers.items()}
        out.sections[self.name] = outcome.rows
        out.notes.update(outcome.notes)
