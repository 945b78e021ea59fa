"""Audio data: windows of real recordings (``kind: audio``).

Every ``.wav`` file under ``path`` (PCM, 8 / 16 / 24 / 32-bit, any channel count and rate) is read, mixed down to
mono, resampled to the model's rate, and cut into windows of ``seconds`` every ``hop`` seconds (default: back to
back); a file shorter than one window gives none.  Each window becomes one sample:

* for a Hugging Face audio folder, what its feature extractor makes of the window
  (:class:`quantkit.frontends.audio.FolderAudioProcessor`: the normalised waveform, a log-mel spectrogram, filter
  banks) at the extractor's sampling rate;
* for any other model, the raw window (float32 in [-1, 1]) at ``sampling_rate`` (default 16000).

Windows are decoded one batch at a time (a file is read when its first window is needed); the fingerprint covers
the settings, the relative file names and the file bytes.
"""

from __future__ import annotations

import os
import wave
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.data.base import check_batch_size, hash_file, new_hasher
from quantkit.errors import DataError

__all__ = ["AUDIO_SUFFIXES", "DEFAULT_RATE", "DEFAULT_SECONDS", "AudioFolderDataset", "is_audio_processor", "list_audio",
           "read_wav", "resample"]

AUDIO_SUFFIXES = (".wav",)
DEFAULT_SECONDS = 1.0
"""Window length when the spec names none."""
DEFAULT_RATE = 16000
"""Sampling rate of raw windows when the model brings no feature extractor and the spec names none."""


def is_audio_processor(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face folder's feature extractor (the model's own audio preprocessing)."""
    from quantkit.frontends.audio import FolderAudioProcessor

    return isinstance(obj, FolderAudioProcessor)


def list_audio(path: str | os.PathLike[str]) -> list[Path]:
    """``.wav`` files at ``path`` (one file, or a folder searched recursively), sorted by relative path.

    Raises:
        DataError: the path does not exist or holds no ``.wav`` file.
    """
    root = Path(path).expanduser()
    if root.is_file():
        if root.suffix.lower() not in AUDIO_SUFFIXES:
            raise DataError(f"audio file {str(root)!r} is not a .wav file; allowed: {', '.join(AUDIO_SUFFIXES)}")
        return [root]
    if not root.is_dir():
        raise DataError(f"audio path {str(root)!r} does not exist")
    files = sorted((p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"audio folder {str(root)!r} contains no {'/'.join(AUDIO_SUFFIXES)} files")
    return files


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the file's sampling rate.

    Raises:
        DataError: naming the file: not a PCM WAV file (a float or compressed WAV: convert it to 16-bit PCM), or
            truncated.
    """
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError, OSError) as e:
        raise DataError(f"cannot read audio file {str(path)!r} (allowed: PCM WAV, 8 / 16 / 24 / 32-bit; convert a "
                        f"float or compressed file to 16-bit PCM): {e}") from e
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:
        b = np.frombuffer(raw[: len(raw) // 3 * 3], np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v) / float(1 << 23)).astype(np.float32)
    elif width in (2, 4):
        dt = np.int16 if width == 2 else np.int32
        x = (np.frombuffer(raw[: len(raw) // width * width], dt).astype(np.float64) / float(1 << (8 * width - 1)))
        x = x.astype(np.float32)
    else:  # pragma: no cover - wave refuses other widths itself
        raise DataError(f"audio file {str(path)!r}: {8 * width}-bit samples are not supported")
    if channels > 1:
        x = x[: len(x) // channels * channels].reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(x, dtype=np.float32), int(rate)


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``x`` at ``rate`` Hz resampled to ``target`` Hz (polyphase filtering; linear interpolation without SciPy)."""
    if rate == target:
        return x
    try:
        from scipy.signal import resample_poly
    except ImportError:
        n = int(round(len(x) * target / rate))
        return np.interp(np.arange(n) * (rate / target), np.arange(len(x)), x).astype(np.float32)
    g = gcd(rate, target)
    return np.asarray(resample_poly(x, target // g, rate // g), dtype=np.float32)


@dataclass(frozen=True)
class _Window:
    file: int
    start: int


class AudioFolderDataset:
    """Windows of ``.wav`` recordings (see the module docstring), one model input per window."""

    def __init__(self, path: str | os.PathLike[str], input_name: str, *, processor: Any = None,
                 seconds: float = DEFAULT_SECONDS, hop: float | None = None, sampling_rate: int | None = None,
                 limit: int | None = None, seed: int = 0) -> None:
        """List the files and their windows (headers only: no samples are decoded here).

        ``limit`` keeps a random subset of that many windows drawn with ``seed`` (in file order).

        Raises:
            DataError: a bad path or setting, an unreadable file, or no file as long as one window.
        """
        self.files: Sequence[Path] = list_audio(path)
        root = Path(path).expanduser()
        self.root = root if root.is_dir() else root.parent
        self.input_name = input_name
        self.processor = processor
        if processor is not None and sampling_rate is not None and int(sampling_rate) != processor.sampling_rate:
            raise DataError(f"dataset 'audio': sampling_rate {sampling_rate} differs from the model's feature "
                            f"extractor ({processor.name}: {processor.sampling_rate} Hz); leave it out")
        self.rate = processor.sampling_rate if processor is not None else int(sampling_rate or DEFAULT_RATE)
        self.seconds, self.hop = float(seconds), float(hop if hop is not None else seconds)
        self.length, step = int(round(self.seconds * self.rate)), int(round(self.hop * self.rate))
        if self.length < 2 or step < 1:
            raise DataError(f"dataset 'audio': seconds {seconds} / hop {hop} are too short at {self.rate} Hz")
        windows: list[_Window] = []
        for i, f in enumerate(self.files):
            n = self._frames(f)
            windows += [_Window(i, s) for s in range(0, n - self.length + 1, step)]
        if not windows:
            raise DataError(f"dataset 'audio': no file under {str(path)!r} is {self.seconds:g} s long; allowed: a "
                            "shorter 'seconds' or longer recordings")
        if limit is not None and limit < len(windows):
            keep = np.random.default_rng(seed).choice(len(windows), size=limit, replace=False)
            windows = [windows[k] for k in sorted(keep)]
        self.windows = windows
        self.limit, self.seed = limit, seed
        self._cache: tuple[int, np.ndarray] | None = None
        self._fp: str | None = None

    def _frames(self, path: Path) -> int:
        """The file's length in samples at the target rate (from its header)."""
        try:
            with wave.open(str(path), "rb") as w:
                return int(w.getnframes() * self.rate / max(w.getframerate(), 1))
        except (wave.Error, EOFError, OSError) as e:
            raise DataError(f"cannot read audio file {str(path)!r} (allowed: PCM WAV, 8 / 16 / 24 / 32-bit; convert "
                            f"a float or compressed file to 16-bit PCM): {e}") from e

    def _samples(self, i: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != i:
            x, rate = read_wav(self.files[i])
            self._cache = (i, resample(x, rate, self.rate))
        return self._cache[1]

    def window(self, k: int) -> np.ndarray:
        """Window ``k`` as the model reads it."""
        w = self.windows[k]
        x = self._samples(w.file)[w.start : w.start + self.length]
        if len(x) < self.length:  # the header's length rounded up by resampling
            x = np.pad(x, (0, self.length - len(x)))
        return self.processor(x) if self.processor is not None else np.ascontiguousarray(x, dtype=np.float32)

    @property
    def output_shape(self) -> tuple[int, ...]:
        """Shape of one sample (no batch dim)."""
        return tuple(self.window(0).shape)

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """``batch_size`` windows at a time."""
        check_batch_size(batch_size)
        for start in range(0, len(self.windows), batch_size):
            yield {self.input_name: np.stack([self.window(k) for k in
                                              range(start, min(start + batch_size, len(self.windows)))])}

    def __len__(self) -> int:
        return len(self.windows)

    def settings(self) -> dict[str, Any]:
        """What decides the samples besides the files (for the fingerprint)."""
        return {"input": self.input_name, "rate": self.rate, "seconds": self.seconds, "hop": self.hop,
                "limit": self.limit, "seed": self.seed,
                "processor": self.processor.settings() if self.processor is not None else None}

    def fingerprint(self) -> str:
        """sha256 over the settings, relative file names and file bytes."""
        if self._fp is None:
            h = new_hasher("audio", self.settings())
            for p in self.files:
                h.update(p.relative_to(self.root).as_posix().encode() + b"|")
                hash_file(h, p)
            self._fp = h.hexdigest()
        return self._fp
