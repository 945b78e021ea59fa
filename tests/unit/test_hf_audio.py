"""Audio: ``kind: audio`` data (windows of ``.wav`` recordings, read, mixed down, resampled) and Hugging Face
audio folders (CTC, audio classification, bare encoders) exported with their own feature extractor: the ONNX
model computes the torch model's output, the windows are what the folder's extractor makes of them, and data or
folders that do not fit are refused by name."""

from __future__ import annotations

import json
import struct
import wave
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.data import make_dataset  # noqa: E402
from quantkit.data.audio import AudioFolderDataset, read_wav  # noqa: E402
from quantkit.data.base import InputInfo  # noqa: E402
from quantkit.errors import DataError, ModelError  # noqa: E402
from quantkit.frontends import load_model  # noqa: E402
from quantkit.frontends.audio import FolderAudioProcessor  # noqa: E402
from quantkit.frontends.hf_folder import detect_task  # noqa: E402


def _speech_like(seconds: float, rate: int, seed: int) -> np.ndarray:
    """Voiced segments (a 120-220 Hz fundamental with harmonics) and pauses, plus a little noise, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 100 * rng.random()
    voice = sum(np.sin(2 * np.pi * k * f0 * t) / k for k in range(1, 6))
    envelope = (np.sin(2 * np.pi * 2.5 * t) > -0.2).astype(np.float64)
    return (0.3 * voice * envelope + 0.01 * rng.standard_normal(len(t))).clip(-1, 1)


def _write_wav(path: Path, x: np.ndarray, rate: int, channels: int = 1, width: int = 2) -> None:
    data = np.repeat(x[:, None], channels, axis=1).reshape(-1)
    if width == 2:
        raw = (data * 32767).astype("<i2").tobytes()
    else:  # 24-bit little endian
        v = (data * (2**23 - 1)).astype(np.int32)
        raw = np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wav")
    _write_wav(folder / "a.wav", _speech_like(2.6, 22050, 0), 22050, channels=2)  # stereo, another rate
    _write_wav(folder / "b.wav", _speech_like(1.5, 16000, 1), 16000, width=3)  # 24-bit
    _write_wav(folder / "short.wav", _speech_like(0.4, 16000, 2), 16000)  # shorter than a window: none
    return folder


@pytest.fixture(scope="module")
def w2v_ctc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("w2v_ctc")
    torch.manual_seed(0)
    # two feature-encoder convolutions instead of seven: the same ops, a third of the export time
    config = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=[16, 16], conv_kernel=[10, 3],
                                         conv_stride=[5, 2], vocab_size=12, num_conv_pos_embeddings=16)
    config.architectures = ["Wav2Vec2ForCTC"]
    transformers.Wav2Vec2ForCTC(config).eval().save_pretrained(folder)
    transformers.Wav2Vec2FeatureExtractor().save_pretrained(folder)
    return folder


def test_wav_files_are_read_mixed_down_and_resampled(recordings: Path) -> None:
    x, rate = read_wav(recordings / "a.wav")
    assert rate == 22050 and x.dtype == np.float32 and len(x) == int(2.6 * 22050)
    np.testing.assert_allclose(x, _speech_like(2.6, 22050, 0), atol=1e-4)  # the two equal channels' mean
    y, rate = read_wav(recordings / "b.wav")
    np.testing.assert_allclose(y, _speech_like(1.5, 16000, 1), atol=1e-6)  # 24-bit
    ds = AudioFolderDataset(recordings, "input_values", seconds=1.0, hop=0.5)
    # a.wav: 2.6 s at 16 kHz -> windows at 0, 0.5, 1.0, 1.5 s; b.wav: 1.5 s -> 0, 0.5; short.wav: none
    assert len(ds) == 6 and ds.rate == 16000 and ds.output_shape == (16000,)
    batch = next(iter(ds.batches(6)))["input_values"]
    assert batch.shape == (6, 16000) and np.abs(batch).max() <= 1.0
    # the same window, resampled from 22.05 kHz, keeps its fundamental: compare the spectra's peaks
    ref = _speech_like(2.6, 16000, 0)[:16000]
    assert np.argmax(np.abs(np.fft.rfft(batch[0]))) == np.argmax(np.abs(np.fft.rfft(ref)))
    assert AudioFolderDataset(recordings, "x", seconds=1.0).fingerprint() != ds.fingerprint()  # hop counts
    assert len(AudioFolderDataset(recordings, "x", seconds=1.0, hop=0.5, limit=3, seed=1)) == 3


def test_bad_audio_is_refused_naming_the_file_or_key(recordings: Path, tmp_path: Path) -> None:
    floaty = tmp_path / "float.wav"  # WAVE_FORMAT_IEEE_FLOAT: the stdlib reader takes PCM only
    body = np.zeros(1600, "<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)
    floaty.write_bytes(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(body)) + b"WAVE" + b"fmt " +
                       struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(body)) + body)
    with pytest.raises(DataError, match=r"float.wav.*allowed: PCM WAV.*16-bit PCM"):
        AudioFolderDataset(floaty, "x")
    with pytest.raises(DataError, match=r"no file under .* is 5 s long; allowed: a shorter 'seconds'"):
        AudioFolderDataset(recordings, "x", seconds=5.0)
    inputs = [InputInfo("input_values", "float32", (None, None))]
    with pytest.raises(DataError, match=r"key 'seconds' is 0.001; allowed: 0.01 to 3600"):
        make_dataset({"kind": "audio", "path": str(recordings), "seconds": 0.001}, inputs=inputs, split="calibration")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"contains no .wav files"):
        make_dataset({"kind": "audio", "path": str(tmp_path / "empty")}, inputs=inputs, split="calibration")


def test_an_audio_folder_is_exported_with_its_feature_extractor(w2v_ctc: Path, recordings: Path) -> None:
    assert detect_task(w2v_ctc) == "audio"
    loaded = load_model(w2v_ctc)
    proc = loaded.tokenizer
    assert isinstance(proc, FolderAudioProcessor) and proc.input_name == "input_values" and proc.sampling_rate == 16000
    assert "audio model, input_values at 16000 Hz; feature extractor Wav2Vec2FeatureExtractor" in loaded.source
    (inp,) = loaded.model.graph.inputs
    assert inp.name == "input_values" and [str(d) for d in inp.shape] == ["batch", "time"]
    assert [v.name for v in loaded.model.graph.outputs] == ["logits"]
    # the windows are what the folder's extractor makes of them (per-window normalisation)
    ds = make_dataset({"kind": "audio", "path": str(recordings), "hop": 0.5}, inputs=[
        InputInfo("input_values", "float32", (None, None))], tokenizer=proc, split="calibration")
    x = next(iter(ds.batches(2)))["input_values"]
    raw = AudioFolderDataset(recordings, "input_values", seconds=1.0, hop=0.5).window(0)
    fx = transformers.Wav2Vec2FeatureExtractor.from_pretrained(str(w2v_ctc))
    np.testing.assert_allclose(x[0], fx(raw, sampling_rate=16000, return_tensors="np")["input_values"][0], atol=1e-6)
    # the ONNX model computes the torch model's logits, at the trace's length and at another one (time is symbolic)
    hf = transformers.Wav2Vec2ForCTC.from_pretrained(str(w2v_ctc), attn_implementation="eager").eval()
    sess = ort.InferenceSession(ir.to_proto(loaded.model).SerializeToString(), providers=["CPUExecutionProvider"])
    for feed in (x, x[:, :12000]):
        with torch.no_grad():
            want = hf(input_values=torch.from_numpy(np.ascontiguousarray(feed))).logits.numpy()
        np.testing.assert_allclose(sess.run(None, {"input_values": feed})[0], want, rtol=1e-4, atol=1e-4)


def test_data_of_the_wrong_modality_is_refused(w2v_ctc: Path, recordings: Path) -> None:
    proc = FolderAudioProcessor(w2v_ctc)
    inputs = [InputInfo("input_values", "float32", (None, None))]
    with pytest.raises(DataError, match=r"this model takes audio \(input_values\), not text; allowed kinds here: "
                                        r"audio, npz"):
        make_dataset({"kind": "text", "source": "pydoc"}, inputs=inputs, tokenizer=proc, split="calibration")
    with pytest.raises(DataError, match=r"this model takes audio \(input_values\), not images"):
        make_dataset({"kind": "sample_photos", "count": 2}, inputs=inputs, tokenizer=proc, split="calibration")
    with pytest.raises(DataError, match=r"sampling_rate 8000 differs from the model's feature extractor"):
        make_dataset({"kind": "audio", "path": str(recordings), "sampling_rate": 8000}, inputs=inputs,
                     tokenizer=proc, split="calibration")


def test_an_audio_folder_without_its_feature_extractor_is_refused(tmp_path: Path) -> None:
    config = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=[16] * 7, vocab_size=12)
    config.architectures = ["Wav2Vec2ForCTC"]
    transformers.Wav2Vec2ForCTC(config).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"audio model \(Wav2Vec2ForCTC\) without its feature extractor settings.*"
                                         r"save_pretrained"):
        load_model(tmp_path)


@pytest.mark.slow
def test_an_audio_folder_quantizes_through_the_cli(tmp_path: Path, recordings: Path) -> None:
    """The user's path: a recipe naming an audio-classification folder and a folder of recordings."""
    torch.manual_seed(0)
    config = transformers.ASTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                    num_mel_bins=32, max_length=48, num_labels=6)
    config.architectures = ["ASTForAudioClassification"]
    transformers.ASTForAudioClassification(config).eval().save_pretrained(tmp_path / "ast")
    transformers.ASTFeatureExtractor(num_mel_bins=32, max_length=48).save_pretrained(tmp_path / "ast")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"version: 1\nname: ast\nmodel: {{source: {tmp_path / 'ast'}}}\n"
        f"calibration: {{data: {{kind: audio, path: {recordings}, seconds: 0.5, hop: 0.25}}}}\n"
        f"evaluation: {{data: {{kind: audio, path: {recordings}, seconds: 0.5, hop: 0.3}}}}\n"
        "report: {latency: {enabled: false}}\n")
    from quantkit.cli import main

    assert main(["calibrate", "--recipe", str(recipe), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    # 0.5 s windows: a.wav (2.6 s) every 0.25 s -> 9, b.wav (1.5 s) -> 5; every 0.3 s -> 8 + 4; short.wav none
    assert report["samples"] == {"calibration": 14, "evaluation": 12}
    fid = report["quality"]["fidelity"]["logits"]
    assert fid["sqnr_db"] > 25, fid
    census = report["census"]
    assert census["leftover_by_kind"]["stray"] == 0 and census["quantized_kernels"].get("MatMulIntegerToFloat", 0) >= 4
    assert "feature extractor ASTFeatureExtractor" in report["model_read_from"]
