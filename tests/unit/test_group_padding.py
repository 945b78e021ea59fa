"""A group size that does not divide a layer's input width K pads every column's last group with zero codes that
a MatMulNBits stores and reads on every token: the report says so, with the bytes, and names a group size that
divides every K (tiny weight-only models built in code; the padding is read from the emitted initializers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.api import quantize
from quantkit.report.build import GROUP_PADDING_NOTE, group_padding_warnings
from tests.conftest import lm_feeds, tiny_lm

K = 48  # the tiny decoder's width: its q / k / o / up / lm_head read 48 channels, its down_proj 96


def _padding(res: Any) -> list[str]:
    return [w for w in res.report["warnings"] if "does not divide the input width" in w]


def test_padded_groups_are_reported_with_the_bytes_the_model_stores() -> None:
    res = quantize(tiny_lm(K=K), lm_feeds(4, K=K), _recipe(32), evaluate=False, progress=False)
    [w] = _padding(res)
    assert "K = 48 (5 layers)" in w and "group_size: 16 divides every K" in w
    # the emitted MatMulNBits really store ceil(K / 128) groups of 64 bytes per column
    stored = padded = 0
    for node in ir.to_proto(res.model).graph.node:
        if node.op_type != "MatMulNBits":
            continue
        a = {x.name: x.i for x in node.attribute}
        k, n, g = a["K"], a["N"], a["block_size"]
        b = next(i for i in ir.to_proto(res.model).graph.initializer if i.name == node.input[1])
        assert list(b.dims) == [n, -(-k // g), g // 2]
        stored += int(np.prod(b.dims))
        padded += n * (-(-k // g) * g - k) // 2
    assert padded > 0
    share = float(w.split("% of the weight codes")[0].rsplit(" ", 1)[1])
    assert {r.get("kernel") for r in res.report["weight_only"]} == {"MatMulNBits"}
    assert abs(share - 100 * padded / stored) < 0.1
    # a group size that divides every K: nothing to say
    res = quantize(tiny_lm(K=K), lm_feeds(4, K=K), _recipe(16), evaluate=False, progress=False)
    assert _padding(res) == []


def _recipe(group: int) -> dict[str, Any]:
    return {"version": 1, "quantization": {"default": {"format": "int4", "group_size": group, "algorithm": "rtn"}},
            "report": {"latency": {"enabled": False}}}


def _row(k: int, n: int, g: int, kernel: str = "MatMulNBits", bits: int = 4, sym: bool = False) -> dict[str, Any]:
    return {"K": k, "N": n, "group_size": g, "bits": bits, "symmetric": sym, "kernel": kernel}


def test_padding_figures() -> None:
    # K = 576 at 128: 5 groups of 128 stored for 4.5 -> 64 of 640 codes per column are padding (10%)
    [w] = group_padding_warnings([_row(576, 1000, 128)])
    assert "10.0% of the weight codes' bytes" in w and "group_size: 64 divides every K" in w
    # g 64: 9 groups of (32 + 2 + 0.5) bytes against 5 of (64 + 2.5): 310.5 vs 332.5 per column
    assert f"{22 * 1000 / 2**20:.1f} MiB smaller" in w
    # a table read by GatherBlockQuantized stores its rows unpadded: no codes wasted
    assert group_padding_warnings([_row(576, 1000, 128, kernel="GatherBlockQuantized")]) == []
    # below the threshold: a large exact layer beside a small padded one
    small = [_row(4096, 10**6, 128), _row(576, 10, 128)]
    assert group_padding_warnings(small) == [] and GROUP_PADDING_NOTE > 0
    # no power of two from 16 divides K = 200 (8 x 25)
    [w] = group_padding_warnings([_row(200, 100, 128)])
    assert "no power-of-two group size from 16 up divides every K" in w
    # rows without the figures (a per-channel layer: group_size None) are skipped
    assert group_padding_warnings([{"K": 576, "N": 10, "group_size": None, "bits": 4}]) == []
