"""Wrap arbitrary Python iterables (of dicts, arrays or tuples) as a :class:`Dataset`.

A plain iterator (a generator) can be consumed only once, but the pipeline reads its data several
times (fingerprint, calibration passes, evaluation): its samples are spooled to a private temporary
folder on disk as they are first read (memory stays bounded) and replayed from there; the folder is
removed when the dataset is garbage-collected or the process exits.  A *callable* returning a fresh
iterator, or a re-iterable such as a list, is read directly each time.

``fingerprint()`` hashes content as it streams: it is a sha256 over the input names
and every sample's arrays -- or only the first ``fingerprint_samples`` samples when
that is set -- computed by one streaming pass (no samples are kept in memory).  The
same data gives the same digest whatever form it came in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from quantkit.data.base import (
    LABEL_KEYS,
    as_array,
    check_batch_size,
    class_labels,
    float_cast,
    hash_array,
    new_hasher,
)
from quantkit.errors import DataError

__all__ = ["IterableDataset"]

_SPOOLED_TARGET = "__quantkit_labels__"
"""The key under which a spooled item keeps its labels (replayed as ``(feed, labels)``)."""



def _kept(labels: list[np.ndarray] | None, lab: np.ndarray | None) -> list[np.ndarray] | None:
    """``labels`` with ``lab`` appended (in place), None once any item had none."""
    if labels is None or lab is None:
        return None
    labels.append(lab)
    return labels


def _arrays_tuple(obj: Any, n: int) -> bool:
    """``obj`` is a tuple / list of ``n`` >= 2 arrays or tensors (the inputs part of ``(inputs, target)``)."""
    return (isinstance(obj, (tuple, list)) and n > 1 and len(obj) == n
            and all(hasattr(a, "shape") and not isinstance(a, (tuple, list)) for a in obj))


class IterableDataset:
    """Samples (or batches, with ``batched=True``) from a Python iterable or a callable."""

    def __init__(
        self,
        iterable_or_callable: Iterable[Any] | Callable[[], Iterable[Any]],
        input_names: Sequence[str],
        *,
        batched: bool = False,
        fingerprint_samples: int | None = None,
        dtypes: Mapping[str, np.dtype[Any]] | None = None,
    ) -> None:
        """Wrap the source.

        Args:
            iterable_or_callable: items are ``{name: array}`` dicts, bare arrays (one-input
                models) or tuples/lists of arrays in ``input_names`` order.
            input_names: the model inputs the items feed.
            batched: items already carry a leading batch dim (they are re-chunked to the
                requested batch size); otherwise each item is one sample.
            fingerprint_samples: hash only the first N samples (default all; 64 for a
                one-shot iterator fingerprinted before use).
            dtypes: the inputs' dtypes: float arrays of another precision are cast to them
                (:func:`~quantkit.data.base.float_cast`).

        Raises:
            DataError: no input names or a bad ``fingerprint_samples``.
        """
        if not input_names:
            raise DataError("IterableDataset needs at least one input name")
        if fingerprint_samples is not None and (
            isinstance(fingerprint_samples, bool)
            or not isinstance(fingerprint_samples, int)
            or fingerprint_samples < 1
        ):
            raise DataError(
                f"fingerprint_samples must be a positive integer or None, got {fingerprint_samples!r}"
            )
        self.input_names = list(input_names)
        self.dtypes = dict(dtypes or {})
        self.batched = batched
        self.fingerprint_samples = fingerprint_samples
        self._factory: Callable[[], Iterable[Any]] | None = None
        self._once: Iterator[Any] | None = None
        self._spool_dir: str | None = None
        self._spool_n = 0
        if callable(iterable_or_callable) and not isinstance(iterable_or_callable, Iterable):
            self._factory = iterable_or_callable
        elif isinstance(iterable_or_callable, Iterator):
            self._once = iterable_or_callable
            self._factory = self._spooled  # one-shot: replayed from a disk spool
        elif isinstance(iterable_or_callable, (Iterable, np.ndarray)):
            source = iterable_or_callable
            self._factory = lambda: source
        else:
            raise DataError(
                f"IterableDataset needs an iterable or a callable returning one, got {type(iterable_or_callable).__name__}"
            )
        self._len: int | None = None
        if self._factory is not None and isinstance(iterable_or_callable, Sequence | np.ndarray):
            self._len = None if batched else len(iterable_or_callable)
        self._fp: str | None = None
        self._labels: np.ndarray | None = None
        self._labels_read = False  # a complete pass recorded the labels (None: some item had none)

    # ------------------------------------------------------------------ items -> samples
    def _as_dict(self, item: Any, index: int) -> dict[str, np.ndarray]:
        return self._split(item, index)[0]

    def _split(self, item: Any, index: int) -> tuple[dict[str, np.ndarray], Any]:
        feed, target = self._split_raw(item, index)
        if self.dtypes:
            feed = {k: float_cast(self.dtypes.get(k), a, k) for k, a in feed.items()}
        return feed, target

    def _split_raw(self, item: Any, index: int) -> tuple[dict[str, np.ndarray], Any]:
        """``(feed, target)``: the item's model inputs, and the labels it carries (None when it has none): a
        dict's label key (:data:`~quantkit.data.base.LABEL_KEYS`), the last element of a tuple one longer than
        the inputs (PyTorch's ``(x, y)``), or the second of ``(inputs, target)`` whose first is a dict or a tuple
        of the inputs."""
        n = len(self.input_names)
        if isinstance(item, Mapping):
            missing = [k for k in self.input_names if k not in item]
            if missing:
                raise DataError(
                    f"item {index}: missing input(s) {missing}; the item has keys {sorted(map(str, item))}"
                )
            key = next((k for k in LABEL_KEYS if k in item and k not in self.input_names), None)
            return {k: as_array(item[k]) for k in self.input_names}, None if key is None else item[key]
        if isinstance(item, (tuple, list)):
            if len(item) == 2 and (isinstance(item[0], Mapping) or _arrays_tuple(item[0], n)):
                return self._split_raw(item[0], index)[0], item[1]
            if len(item) == n:
                return {k: as_array(a) for k, a in zip(self.input_names, item, strict=True)}, None
            if len(item) == n + 1:
                return {k: as_array(a) for k, a in zip(self.input_names, item[:n], strict=True)}, item[n]
            raise DataError(
                f"item {index}: a tuple of {len(item)} arrays for {n} inputs {self.input_names}; allowed: one array "
                f"per input in that order, optionally followed by the labels ({n + 1} elements), or (inputs, labels)"
            )
        if n != 1:
            raise DataError(
                f"item {index}: a bare {type(item).__name__} can only feed a single-input model; "
                f"this one has inputs {self.input_names} (yield dicts or tuples)"
            )
        return {self.input_names[0]: as_array(item)}, None

    def labels(self) -> np.ndarray | None:
        """The class labels the items carried (:func:`~quantkit.data.base.class_labels`), in sample order, as read
        by the last complete pass over the data (a pass is made when none was); None when any item had none."""
        if not self._labels_read:
            for _ in self.samples():
                pass
        return self._labels

    def _spooled(self) -> Iterator[Any]:
        """Yield the one-shot iterator's samples: those already read from the spool, the rest from the
        iterator (spooling each as it comes), so partial passes and later passes see the same data."""
        import shutil
        import tempfile
        import weakref

        if self._spool_dir is None:
            self._spool_dir = tempfile.mkdtemp(prefix="quantkit-data-")
            weakref.finalize(self, shutil.rmtree, self._spool_dir, True)
        i = 0
        while True:
            if i < self._spool_n:
                with np.load(f"{self._spool_dir}/{i}.npz", allow_pickle=False) as z:
                    got = {k: z[k] for k in z.files}
                target = got.pop(_SPOOLED_TARGET, None)
                yield got if target is None else (got, target)
            else:
                assert self._once is not None
                try:
                    item = next(self._once)
                except StopIteration:
                    return
                sample, target = self._split(item, i)
                kept = class_labels(target) if target is not None else None
                extra = {} if kept is None else {_SPOOLED_TARGET: kept}
                np.savez(f"{self._spool_dir}/{i}.npz", **sample, **extra)  # type: ignore[arg-type]
                self._spool_n += 1
                yield sample if kept is None else (sample, kept)
            i += 1

    def _source(self) -> Iterator[Any]:
        assert self._factory is not None  # set for every source kind in __init__
        return iter(self._factory())

    def samples(self) -> Iterator[dict[str, np.ndarray]]:
        """One feed dict per sample (no batch dim).  A complete pass also records the items' labels."""
        labels: list[np.ndarray] | None = []
        for index, item in enumerate(self._source()):
            d, target = self._split(item, index)
            if not self.batched:
                lab = None if target is None else class_labels(target, 1)
                labels = _kept(labels, lab)
                yield d
                continue
            sizes = {n: (a.shape[0] if a.ndim else None) for n, a in d.items()}
            if None in sizes.values() or len(set(sizes.values())) != 1:
                raise DataError(f"batched item {index}: arrays need a common leading batch dim; got {sizes}")
            rows = next(iter(sizes.values())) or 0
            lab = None if target is None else class_labels(target, rows)
            labels = _kept(labels, lab)
            for row in range(rows):
                yield {n: a[row] for n, a in d.items()}
        self._labels = np.concatenate(labels) if labels else None
        self._labels_read = True

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Stack ``batch_size`` samples at a time; hashes the content on the way.  Samples of another shape than
        the batch being filled (images of several sizes for a model with dynamic height / width) start a new batch:
        batches hold consecutive samples of one shape, at most ``batch_size``."""
        check_batch_size(batch_size)
        h = self._hasher() if self._fp is None else None
        limit = self.fingerprint_samples
        count = 0
        chunk: list[dict[str, np.ndarray]] = []

        def shapes(sample: Mapping[str, np.ndarray]) -> list[tuple[int, ...]]:
            return [np.shape(sample[n]) for n in self.input_names if n in sample]

        for sample in self.samples():
            if h is not None and (limit is None or count < limit):
                self._hash_sample(h, sample)
            count += 1
            if chunk and shapes(sample) != shapes(chunk[0]):
                yield self._stack(chunk)
                chunk = []
            chunk.append(sample)
            if len(chunk) == batch_size:
                yield self._stack(chunk)
                chunk = []
        if chunk:
            yield self._stack(chunk)
        self._len = count
        if h is not None:
            self._fp = self._finish(h, count)

    def _stack(self, chunk: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for n in self.input_names:
            shapes = {s[n].shape for s in chunk}
            if len(shapes) != 1:
                raise DataError(f"input {n!r}: samples in one batch have different shapes {sorted(shapes)}")
            out[n] = np.stack([s[n] for s in chunk])
        return out

    # ------------------------------------------------------------------ fingerprint
    def _hasher(self) -> Any:
        return new_hasher("iterable", {"inputs": self.input_names, "limit": self.fingerprint_samples})

    def _hash_sample(self, h: Any, sample: Mapping[str, np.ndarray]) -> None:
        for n in self.input_names:
            hash_array(h, n, sample[n])

    def _finish(self, h: Any, count: int) -> str:
        # The count is part of the digest only when every sample was hashed.
        if self.fingerprint_samples is None:
            h.update(f"|count={count}".encode())
        return str(h.hexdigest())

    def fingerprint(self) -> str:
        """sha256 over the (first ``fingerprint_samples``) samples; see the module docstring."""
        if self._fp is not None:
            return self._fp
        h = self._hasher()
        count = 0
        for sample in self.samples():
            if self.fingerprint_samples is not None and count >= self.fingerprint_samples:
                break
            self._hash_sample(h, sample)
            count += 1
        if self.fingerprint_samples is None:
            self._len = count
        self._fp = self._finish(h, count)
        return self._fp

    def __len__(self) -> int:
        """Number of samples; counted by one streaming pass if not known yet."""
        if self._len is None:
            self._len = sum(1 for _ in self.samples())
        return self._len
