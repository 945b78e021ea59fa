"""Feeds for KV-cache decoders: empty past tensors next to the data's own inputs.

A decoder with a KV cache (:mod:`quantkit.frontends.llm_builder`, onnxruntime-genai's layout) takes
``past_key_values.<i>.key|value`` ``[batch, kv_heads, past_seq, head_dim]`` besides ``input_ids`` and
``attention_mask`` ``[batch, past_seq + seq]``.  Everything quantkit runs a model on (calibration
passes, perplexity, fidelity, the search's sensitivity probe) processes whole windows from position 0,
i.e. a prefill with an *empty* past: ``past_seq = 0``, so the mask covers exactly the window.  The data
sources know nothing of caches; :func:`bind_kv_cache` wraps a dataset so that each batch also carries
zero-length past tensors (``float32 [B, kv_heads, 0, head_dim]``, B from the batch), and
:func:`quantkit.data.make_dataset` / :func:`quantkit.data.as_dataset` call it whenever the model has
past inputs.  Batches that already hold a past tensor keep it (the mask is then the caller's business).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from quantkit.data.base import Dataset, InputInfo, new_hasher
from quantkit.errors import DataError

__all__ = ["PAST_PREFIX", "KVCacheFeeds", "bind_kv_cache", "past_inputs", "split_past"]

PAST_PREFIX = "past_key_values."


def past_inputs(inputs: list[InputInfo]) -> list[InputInfo]:
    """The KV-cache inputs (``past_key_values.*``) among ``inputs``."""
    return [i for i in inputs if i.name.startswith(PAST_PREFIX)]


def split_past(inputs: list[InputInfo]) -> tuple[list[InputInfo], list[InputInfo]]:
    """``(data inputs, past inputs)``: what a data source must produce, and what :class:`KVCacheFeeds` adds."""
    past = past_inputs(inputs)
    return [i for i in inputs if not i.name.startswith(PAST_PREFIX)], past


class KVCacheFeeds:
    """A dataset whose batches also feed empty past tensors to a KV-cache decoder.

    Attributes:
        inner: the wrapped dataset (``len``, attributes and the rest delegate to it).
        past: ``name -> (kv_heads, head_dim)`` of the past inputs.
    """

    def __init__(self, inner: Any, past: list[InputInfo]) -> None:
        """Raises: DataError: a past input's heads or head_dim is not static."""
        self.inner = inner
        self.past: dict[str, tuple[int, int]] = {}
        for info in past:
            shape = info.shape
            if shape is None or len(shape) != 4 or shape[1] is None or shape[3] is None:
                raise DataError(
                    f"KV-cache input {info.name!r} is {info.describe()}; expected float32 [batch, kv_heads, "
                    "past_seq, head_dim] with static kv_heads and head_dim"
                )
            self.past[info.name] = (int(shape[1]), int(shape[3]))
        self._dtype = {i.name: i.dtype for i in past}
        self._fp: str | None = None

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """The inner batches plus ``past_key_values.* = zeros [B, kv_heads, 0, head_dim]``."""
        empty: dict[tuple[int, int, int, Any], np.ndarray] = {}
        for batch in self.inner.batches(batch_size):
            b = int(np.asarray(next(iter(batch.values()))).shape[0])
            out = dict(batch)
            for name, (heads, dim) in self.past.items():
                if name not in out:
                    key = (b, heads, dim, self._dtype[name])
                    if key not in empty:
                        empty[key] = np.zeros((b, heads, 0, dim), self._dtype[name])
                    out[name] = empty[key]
            yield out

    def __len__(self) -> int:
        return len(self.inner)

    def fingerprint(self) -> str:
        """The inner fingerprint and the past shapes (empty pasts add no content)."""
        if self._fp is None:
            h = new_hasher("kv_cache_feeds", {"inner": self.inner.fingerprint(), "past": sorted(self.past.items())})
            self._fp = h.hexdigest()
        return self._fp

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "past", "_dtype", "_fp"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def bind_kv_cache(ds: Dataset, inputs: list[InputInfo]) -> Dataset:
    """``ds`` wrapped in :class:`KVCacheFeeds` when ``inputs`` have past tensors (else ``ds`` itself)."""
    past = past_inputs(inputs)
    if not past or isinstance(ds, KVCacheFeeds):
        return ds
    return KVCacheFeeds(ds, past)
