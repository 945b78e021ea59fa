"""A causal LM of a family the layer-wise builder does not support takes the whole-graph path - and says so.

A tiny random DiffLlama decoder (transformers' DiffLlamaForCausalLM: LLaMA with differential attention, which the
builder does not write; ``rms_norm_eps = 1e-8`` as Helium's, its padding row all zero) through the default recipe path: the report warns that the model is
exported whole, without a KV cache, and the export keeps the epsilon - before, onnxscript's optimizer dropped it as "x + 0", the padding token's
norm divided by zero, NaN reached every position, and quantkit silently evaluated the model as a generic one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.api import quantize  # noqa: E402
from quantkit.llm_run import unstreamed_decoder_note  # noqa: E402
from tests.unit.test_llm_frontend import VOCAB, char_tokenizer  # noqa: E402

PAD = 2


def _diffllama(folder: Path) -> None:
    config = transformers.DiffLlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-8, pad_token_id=PAD,
        bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DiffLlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[PAD].zero_()
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)


def test_an_unsupported_decoder_family_is_named_and_its_norm_epsilon_kept(tmp_path: Path) -> None:
    folder = tmp_path / "diffllama"
    _diffllama(folder)
    rng = np.random.default_rng(0)
    ids = [{"input_ids": rng.integers(3, VOCAB, (1, 32)).astype(np.int64), "attention_mask": np.ones((1, 32), np.int64)}
           for _ in range(4)]
    ids[0]["input_ids"][0, 5] = PAD  # the all-zero embedding row inside a calibration window
    rec = {"version": 1, "quantization": {"default": {"format": "int4", "group_size": 32, "algorithm": "rtn"}},
           "report": {"latency": {"enabled": False}}}
    res = quantize(str(folder), ids, rec, evaluation_data=ids[:2], progress=False)
    [w] = [w for w in res.report["warnings"] if "is not a decoder family the layer-wise builder supports" in w]
    assert "'diffllama'" in w and "no KV cache" in w and "llama" in w
    # evaluated as a causal LM: the FP32 logits are finite, so perplexity is measured
    q = res.report["quality"]
    assert np.isfinite(q["perplexity_fp32"]["ppl"]) and np.isfinite(q["perplexity_quantized"]["ppl"])
    assert res.report["summary"]["warnings"] == len(res.report["warnings"])


def test_the_note_is_for_unsupported_causal_lms_only(tmp_path: Path) -> None:
    def folder(name: str, cfg: dict[str, object]) -> Path:
        f = tmp_path / name
        f.mkdir()
        (f / "config.json").write_text(json.dumps(cfg))
        return f

    assert "'diffllama'" in str(unstreamed_decoder_note(folder("o", {"model_type": "diffllama",
                                                                  "architectures": ["DiffLlamaForCausalLM"]})))
    assert unstreamed_decoder_note(folder("b", {"model_type": "bert", "architectures": ["BertForMaskedLM"]})) is None
    # a supported family with a setting the builder refuses (a RoPE type it does not compute): the refusal quoted
    ok = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512}
    note = unstreamed_decoder_note(folder("s", ok | {"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}))
    assert note is not None and "supports, but it refuses this checkpoint" in note and "'mrope'" in note
    assert "no KV cache" in note
    assert unstreamed_decoder_note(folder("l", ok)) is None  # streamed: nothing to say
    assert unstreamed_decoder_note(tmp_path / "absent") is None and unstreamed_decoder_note(None) is None
