"""A model that draws random numbers (ViTMAE's patch shuffle: RandomUniformLike + TopK) differs from itself run by
run: the kernel check is skipped and says why, instead of a false "DISAGREE" blaming this CPU's kernels."""

from __future__ import annotations

import numpy as np

from quantkit.lowering.kernel_check import random_ops


def test_a_model_with_random_ops_skips_the_kernel_check_saying_why() -> None:
    from quantkit.api import quantize
    from tests.conftest import image_batches
    from tests.tiny_graphs import TinyGraph

    g = TinyGraph(0)
    y = g.node("Relu", [g.node("Conv", ["input", g.w("w", 8, 3, 3, 3)], "c", pads=[1, 1, 1, 1])], "r")
    y = g.node("Conv", [y, g.w("w2", 4, 8, 3, 3)], "c2", pads=[1, 1, 1, 1])
    noise = g.node("RandomUniformLike", [y], "noise", low=0.0, high=1.0)
    y = g.node("Add", [y, g.node("Mul", [noise, g.c("tiny", np.float32(1e-3))], "scaled")], "y")
    model = g.model("noisy", y, ["N", 4, 16, 16])
    assert random_ops(model) == ["RandomUniformLike 'noise_node'"]
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(model, image_batches(2), recipe, evaluation_data=image_batches(1, seed=2), progress=False)
    kern = res.report["kernels"]
    assert "check" not in kern and "RandomUniformLike 'noise_node'" in kern["check_skipped"]
    assert any(w.startswith("fused kernels not checked against the QDQ math: the graph draws random numbers")
               for w in res.report["warnings"]), res.report["warnings"]
    assert len(res.plan.layers) == 2
