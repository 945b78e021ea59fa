"""Tokenised text datasets: sentences or fixed token windows.

Sources (``a+b`` mixes several, e.g. ``"austen:prideprejudice+pydoc"``: in ``windows`` mode the windows
come from each source in turn): ``"pydoc"`` (CPython's ``pydoc_data.topics.topics``, values joined in sorted
key order -- ships with every Python), ``"austen:<book>"`` (a Jane Austen novel, e.g.
``"austen:emma"``, see :mod:`quantkit.data.austen`), a path to a UTF-8 ``.txt`` file, or
an iterable of strings.

``mode="sentences"``: the text is cut into paragraphs (blank lines), the lines of a
paragraph are joined, and paragraphs are split into sentences after ``.``, ``!`` or ``?``.
Sentences of 30-600 characters and at least 5 words are kept, duplicates dropped.
(An iterable of strings is taken as given: each string is one sample.)  With a
``split``, a sentence belongs to ``"calibration"`` if the first byte of its sha256 is
even and to ``"evaluation"`` otherwise, so the splits are disjoint whatever the seed or
count.  ``count`` sentences are drawn without replacement with ``seed``; each is
tokenised (special tokens added), truncated to ``seq_len`` and right-padded with
``attention_mask = 0``.

``mode="windows"``: the whole text is tokenised once (no special tokens) and cut into
non-overlapping windows of ``seq_len`` tokens.  With a ``split`` the calibration split
owns the first half of the windows and the evaluation split the second half;
``offset`` skips that many windows of the split, ``count`` takes that many (default
all that remain).  The seed does not apply to windows.

Every dataset yields exactly the model's text inputs as int64: ``input_ids``,
``attention_mask``, ``token_type_ids`` (zeros) and ``position_ids`` (``0..seq_len-1``).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.data.base import MAX_SEQ_LEN, check_batch_size, hash_array, new_hasher
from quantkit.errors import DataError

__all__ = ["TEXT_INPUTS", "TEXT_MODES", "TextDataset", "load_text", "split_sentences"]

TEXT_MODES = ("sentences", "windows")
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
_SPLITS = ("calibration", "evaluation")
_MIN_CHARS, _MAX_CHARS, _MIN_WORDS = 30, 600, 5
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9])")


def load_text(source: str | os.PathLike[str]) -> str:
    """The text of ``"pydoc"``, of ``"austen:<book>"`` or of a UTF-8 text file (``a+b`` joins several;
    in ``windows`` mode a :class:`TextDataset` takes windows from each in turn instead).

    Raises:
        DataError: the file does not exist or cannot be decoded, or the book is unknown.
    """
    if isinstance(source, str) and "+" in source and not Path(source).expanduser().exists():
        return "\n\n".join(load_text(part) for part in source.split("+"))
    if isinstance(source, str) and source == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    if isinstance(source, str) and source.startswith("austen:"):
        from quantkit.data.austen import austen_text

        return austen_text(source.split(":", 1)[1])
    path = Path(source).expanduser()
    if not path.is_file():
        raise DataError(
            f"text source {str(source)!r} is neither 'pydoc', 'austen:<book>' nor an existing text file"
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read text file {str(path)!r} as UTF-8: {e}") from e


def split_sentences(text: str) -> list[str]:
    """Sentences of reasonable length (see module docstring), first occurrence order, unique."""
    seen: set[str] = set()
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        joined = " ".join(paragraph.split())
        for sentence in _SENTENCE_END.split(joined):
            s = sentence.strip()
            if _MIN_CHARS <= len(s) <= _MAX_CHARS and len(s.split()) >= _MIN_WORDS and s not in seen:
                seen.add(s)
                out.append(s)
    return out


def _in_split(sentence: str, split: str) -> bool:
    even = hashlib.sha256(sentence.encode("utf-8")).digest()[0] % 2 == 0
    return even if split == "calibration" else not even


class TextDataset:
    """Tokenised sentences or token windows (see the module docstring)."""

    def __init__(
        self,
        texts_or_source: str | os.PathLike[str] | Iterable[str],
        tokenizer: Any,
        *,
        mode: str = "sentences",
        seq_len: int = 128,
        count: int | None = None,
        seed: int = 0,
        split: str | None = None,
        offset: int = 0,
        input_names: Sequence[str] | None = None,
    ) -> None:
        """Select the samples (cheap); tokenisation of sentences happens per batch.

        Args:
            texts_or_source: ``"pydoc"``, ``"austen:<book>"``, a text-file path, or an
                iterable of strings.
            tokenizer: a Hugging Face tokenizer (callable, ``pad_token_id``, ``model_input_names``).
            mode: ``"sentences"`` or ``"windows"``.
            seq_len: tokens per sample (2 to :data:`~quantkit.data.base.MAX_SEQ_LEN`).
            count: number of samples (default: all available; more than there are is an error).
            seed: sentence sampling seed.
            split: None (all), ``"calibration"`` or ``"evaluation"`` (disjoint).
            offset: windows mode only, windows of the split to skip.
            input_names: inputs to produce (default: the tokenizer's ``model_input_names``).

        Raises:
            DataError: bad mode/split/seq_len/count/offset, unknown input names, or too
                little text for the request.
        """
        if mode not in TEXT_MODES:
            raise DataError(f"text mode {mode!r} is not allowed; allowed: {', '.join(TEXT_MODES)}")
        if split is not None and split not in _SPLITS:
            raise DataError(f"text split {split!r} is not allowed; allowed: {', '.join(_SPLITS)} or None")
        for key, value, low in (("seq_len", seq_len, 2), ("offset", offset, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise DataError(f"text {key} must be an integer >= {low}, got {value!r}")
        if seq_len > MAX_SEQ_LEN:
            raise DataError(f"text seq_len is {seq_len}; allowed: 2 to {MAX_SEQ_LEN}")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise DataError(f"text count must be a positive integer or None, got {count!r}")
        if offset and mode != "windows":
            raise DataError("text offset applies to mode 'windows' only")
        if tokenizer is None or not callable(tokenizer):
            raise DataError("a text dataset needs a tokenizer (the model's, e.g. from a Hugging Face folder)")
        names = (
            list(input_names)
            if input_names is not None
            else list(getattr(tokenizer, "model_input_names", []))
        )
        names = names or ["input_ids", "attention_mask"]
        unknown = sorted(set(names) - set(TEXT_INPUTS))
        if unknown:
            raise DataError(
                f"text datasets cannot produce model input(s) {unknown}; they produce {list(TEXT_INPUTS)}"
            )
        self.tokenizer = tokenizer
        self.mode = mode
        self.seq_len = seq_len
        self.seed = seed
        self.split = split
        self.offset = offset
        self.input_names = names
        self._fp: str | None = None
        if isinstance(texts_or_source, (str, os.PathLike)):
            self.source = str(texts_or_source)
            text = load_text(texts_or_source)
            pieces: list[str] | None = None
        else:
            self.source = "<texts>"
            pieces = [str(t) for t in texts_or_source]
            if not pieces:
                raise DataError("text dataset got an empty list of texts")
            text = "\n\n".join(pieces)
        self._sentences: list[str] = []
        self._windows: np.ndarray = np.zeros((0, seq_len), np.int64)
        if mode == "sentences":
            pool = pieces if pieces is not None else split_sentences(text)
            if split is not None:
                pool = [s for s in pool if _in_split(s, split)]
            if count is None:
                self._sentences = pool
            elif count > len(pool):
                raise DataError(
                    f"text source {self.source!r} has {len(pool)} sentences"
                    + (f" in split {split!r}" if split else "")
                    + f", fewer than count={count}"
                )
            else:
                pick = np.random.default_rng(seed).choice(len(pool), size=count, replace=False)
                self._sentences = [pool[int(i)] for i in pick]
        else:
            parts = (self.source.split("+") if pieces is None and "+" in self.source
                     and not Path(self.source).expanduser().exists() else None)
            if parts is None:
                self._windows = self._window_split(tokenizer, text, self.source, split, offset, count)
            else:
                # a mix of domains: windows are taken in turn from each source (its own split), so the
                # calibration set does not overfit one kind of text
                per = None if count is None else [count // len(parts) + (i < count % len(parts))
                                                  for i in range(len(parts))]
                chunks = [self._window_split(tokenizer, load_text(src), src, split, offset,
                                             None if per is None else per[i])
                          for i, src in enumerate(parts)]
                order = [c[j] for j in range(max(len(c) for c in chunks)) for c in chunks if j < len(c)]
                self._windows = np.stack(order) if order else np.zeros((0, seq_len), np.int64)

    def _window_split(self, tokenizer: Any, text: str, source: str, split: str | None, offset: int,
                      count: int | None) -> np.ndarray:
        """Windows ``[count, seq_len]`` of ``text``: the first half for calibration, the second for evaluation."""
        seq_len = self.seq_len
        ids = np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)
        n = len(ids) // seq_len
        lo, hi = (0, n) if split is None else ((0, n // 2) if split == "calibration" else (n // 2, n))
        start = lo + offset
        stop = hi if count is None else start + count
        if start >= hi or stop > hi:
            raise DataError(
                f"text source {source!r} gives {n} windows of {seq_len} tokens "
                f"({hi - lo} in split {split or 'all'}); offset={offset} count={count} do not fit"
            )
        return ids[: n * seq_len].reshape(n, seq_len)[start:stop]

    @property
    def texts(self) -> list[str]:
        """The selected sentences (sentences mode)."""
        return list(self._sentences)

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded token ids [n, seq_len] and the unpadded lengths."""
        ids = np.zeros((len(texts), self.seq_len), np.int64)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "eos_token_id", None) or 0
        ids[:] = pad
        encoded = self.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=self.seq_len)[
            "input_ids"
        ]
        lengths = np.zeros(len(texts), np.int64)
        for row, seq in enumerate(encoded):
            ids[row, : len(seq)] = seq
            lengths[row] = len(seq)
        return ids, lengths

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Feed dicts with the requested text inputs, int64, shape [batch, seq_len]."""
        check_batch_size(batch_size)
        for start in range(0, len(self), batch_size):
            if self.mode == "sentences":
                ids, lengths = self._encode(self._sentences[start : start + batch_size])
                mask = (np.arange(self.seq_len)[None, :] < lengths[:, None]).astype(np.int64)
            else:
                ids = self._windows[start : start + batch_size].copy()
                mask = np.ones_like(ids)
            batch = {
                "input_ids": ids,
                "attention_mask": mask,
                "token_type_ids": np.zeros_like(ids),
                "position_ids": np.broadcast_to(np.arange(self.seq_len, dtype=np.int64), ids.shape).copy(),
            }
            yield {n: batch[n] for n in self.input_names}

    def __len__(self) -> int:
        return len(self._sentences) if self.mode == "sentences" else int(self._windows.shape[0])

    def fingerprint(self) -> str:
        """sha256 over the settings and the token arrays (computed by streaming the batches)."""
        if self._fp is None:
            settings = {
                "mode": self.mode,
                "seq_len": self.seq_len,
                "split": self.split,
                "offset": self.offset,
                "inputs": self.input_names,
                "seed": self.seed if self.mode == "sentences" else None,
            }
            h = new_hasher("text", settings)
            for batch in self.batches(256):
                for name in self.input_names:
                    hash_array(h, name, batch[name])
            self._fp = h.hexdigest()
        return self._fp
