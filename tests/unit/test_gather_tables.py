"""Select rule 13: a Gather of rows from a constant table (an embedding) gets 8-bit rows in ONNX Runtime's
``GatherBlockQuantized`` - the rows it returns are checked against ONNX Runtime's own blocked DequantizeLinear - and a
table a MatMul reads too, a small one, or one the recipe keeps in fp32 stays float."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import quantkit  # noqa: E402
from quantkit.lowering.tables import block_size, quantize_table  # noqa: E402


@pytest.mark.parametrize(("width", "block"), [(384, 128), (312, 128), (48, 32), (20, 16)])
def test_gathered_rows_equal_onnx_runtimes_blocked_dequantize_linear(width: int, block: int) -> None:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    assert block_size(width) == block
    rng = np.random.default_rng(width)
    table = rng.standard_normal((50, width)).astype(np.float32) * rng.uniform(0.01, 2.0, (50, 1)).astype(np.float32)
    table[7] = 0.0  # a padding row stays exactly zero
    codes, scales, zps = quantize_table(table, block)
    assert codes.shape == table.shape and scales.shape == zps.shape == (50, -(-width // block))
    ids = np.array([[0, 7, 49, 3, 7, 12]], np.int64)
    inits = [numpy_helper.from_array(codes, "q"), numpy_helper.from_array(scales, "s"), numpy_helper.from_array(zps, "z")]
    gbq = helper.make_node("GatherBlockQuantized", ["q", "ids", "s", "z"], ["y"], domain="com.microsoft",
                           gather_axis=0, quantize_axis=1, block_size=block, bits=8)
    dq = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["t"], axis=1, block_size=block),
          helper.make_node("Gather", ["t", "ids"], ["y"], axis=0)]
    outs = []
    for nodes, opsets in ((gbq,), [("", 21), ("com.microsoft", 1)]), (dq, [("", 21)]):
        g = helper.make_graph(list(nodes), "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
        outs.append(ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0])
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not outs[0][0, 1].any()
    err = np.abs(outs[0][0] - table[ids[0]]).max(-1)
    assert np.all(err <= np.repeat(scales, block, 1)[:, :width][ids[0]].max(-1) / 2 * 1.0001)  # half a step


class _Encoder(torch.nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb, self.tt = torch.nn.Embedding(1000, 64), torch.nn.Embedding(2, 64)
        self.l1, self.ln, self.out = torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
        self.tied = tied

    def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(ids) + self.tt(types))
        h = torch.relu(self.l1(h))
        if self.tied:  # a masked-LM head reading the embedding table
            return (h @ self.emb.weight.T).mean(1)
        return self.out(h).mean(1)


def _quantize(module: Any, **rec: Any) -> Any:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    data = [{"ids": rng.integers(0, 1000, (2, 16)).astype(np.int64), "types": rng.integers(0, 2, (2, 16)).astype(np.int64)}
            for _ in range(4)]  # fmt: skip
    recipe = {"version": 1, "name": "emb", "report": {"latency": {"enabled": False}}, **rec}
    example = (torch.from_numpy(data[0]["ids"]), torch.from_numpy(data[0]["types"]))
    return quantkit.quantize(module.eval(), data, recipe, example_inputs=example, evaluation_data=data[:2],
                             progress=False)


def test_an_embedding_gets_8_bit_rows_and_the_file_shrinks() -> None:
    torch.manual_seed(0)
    res = _quantize(_Encoder())
    (name,) = res.plan.tables  # the word embedding; the 2-row token-type table is too small to matter
    assert res.census.op_counts.get("com.microsoft.GatherBlockQuantized") == 1
    assert res.report["formats"]["int8"] == 3  # two MatMuls and the table
    (row,) = [r for r in res.report["layers"] if r["layer"] == name]
    assert row["kernel"] == "GatherBlockQuantized" and row["weights"]["weight_sqnr_db"] > 40.0
    assert "GatherBlockQuantized" in row["lowering_note"]
    assert res.report["size"]["ratio"] < 0.35  # 256 KB of float table -> 64 KB of codes
    assert res.report["fidelity"]["mean"]["sqnr_db"] > 35.0


def test_a_tied_table_a_small_one_and_an_fp32_override_stay_float() -> None:
    torch.manual_seed(0)
    tied = _quantize(_Encoder(tied=True))
    assert not tied.plan.tables
    assert any("also read by" in why and "tied weight" in why for why in tied.plan.skipped.values()), tied.plan.skipped
    torch.manual_seed(0)
    kept = _quantize(_Encoder(), quantization={"overrides": [{"op_type": "Gather", "format": "fp32"}]})
    assert not kept.plan.tables and "GatherBlockQuantized" not in str(kept.census.op_counts)
