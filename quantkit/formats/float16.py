"""16-bit float weights (``fp16``, ``bf16``) and plain ``fp32``.

``compute: storage`` (default): the weight is stored in 16 bits and cast to float32 once when the
session loads (ONNX Runtime's CPU provider has no fp16 / bf16 MatMul): half the bytes, float speed.
``compute: native``: activations are cast to 16 bits around the layer (GPU providers).  Needs nothing;
float tensors in and out.  ``fp32`` layers are left as they are.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from quantkit.formats.base import FormatHandler, Job, Lowered


class Float16(FormatHandler):
    name = "float16"
    formats = ("fp16", "bf16")
    family = "float"
    needs = "nothing"
    boundary = "none (storage: a Cast of the constant weight; native: Casts around the layer)"

    def select(self, job: Job) -> dict[str, Any]:
        from quantkit.formats.execute import linear_layers_in

        return linear_layers_in(job, self.formats, ops=("MatMul", "Conv", "Gemm"))

    def lower(self, job: Job, model: ir.Model, layers: dict[str, Any], out: Lowered) -> None:
        from quantkit.lowering.cast import lower_cast, merge_casts

        for n, (_, lp) in layers.items():
            lower_cast(model, n, lp.format, compute=lp.compute)
        merge_casts(model)
        out.layers[self.name] = {n: lp.format for n, (_, lp) in layers.items()}
        out.sections[self.name] = [{"layer": n, "format": lp.format, "compute": lp.compute}
                                   for n, (_, lp) in layers.items()]


class Float32(FormatHandler):
    name = "float32"
    formats = ("fp32",)
    family = "float"
    needs = "nothing"
    boundary = "none"

    def select(self, job: Job) -> dict[str, Any]:
        return {}

    def lower(self, job: Job, model: ir.Model, layers: dict[str, Any], out: Lowered) -> None:
        return None
