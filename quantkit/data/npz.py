"""Datasets stored as ``.npz`` files: one file, or a folder of them.

Each file maps input names to arrays with a leading sample dim.  Shapes and dtypes (for ``len`` and
validation) come from the ``.npy`` headers inside the zip, without reading array data.

Reading is bounded and checked before any array data is inflated:

* **Checked up front.**  For every array a model input uses, the header's ``shape x itemsize`` must fit in
  the bytes its zip entry declares (a header that lies about its length, or a truncated entry, is a
  :class:`~quantkit.errors.DataError` naming the file and the array) and may not exceed
  :func:`max_array_bytes`: 4 GiB by default, raised or lowered with the environment variable
  ``QUANTKIT_NPZ_MAX_BYTES`` (bytes, or with a ``K`` / ``M`` / ``G`` / ``T`` suffix, powers of 1024).  So a
  zip bomb (a few MB that inflate to many GB) is refused before anything is inflated.  Arrays of Python
  objects are refused (nothing is ever unpickled).
* **Streamed.**  ``batches`` reads each array's rows from its zip member as the batches need them, in
  chunks of at most 1 MiB, straight into the batch's array: memory is bounded by a batch, not by the file
  or the dataset (a Fortran-order array, whose rows are not contiguous, is read whole -- it is within the
  limit above).  One file is open at a time.
* **One sample shape.**  Every file of a folder must hold samples of one shape (the dims past the first)
  and dtype per input, since batches cross file boundaries; otherwise a DataError names both files and
  their shapes.
"""

from __future__ import annotations

import logging
import math
import os
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from quantkit.data.base import (
    LABEL_KEYS,
    InputInfo,
    check_array,
    check_batch_size,
    class_labels,
    float_cast,
    hash_file,
    new_hasher,
)
from quantkit.errors import DataError

log = logging.getLogger("quantkit")

__all__ = ["DEFAULT_MAX_ARRAY_BYTES", "MAX_BYTES_ENV", "NpzDataset", "max_array_bytes"]

DEFAULT_MAX_ARRAY_BYTES = 4 * 2**30
"""The largest array (uncompressed) read from an ``.npz`` file unless ``QUANTKIT_NPZ_MAX_BYTES`` says more."""

MAX_BYTES_ENV = "QUANTKIT_NPZ_MAX_BYTES"
_CHUNK = 2**20
# What reading a damaged zip / npy member can raise (zipfile, zlib and numpy's header parser).
_READ_ERRORS = (OSError, EOFError, zipfile.BadZipFile, zlib.error, ValueError, RuntimeError, NotImplementedError)
_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def max_array_bytes() -> int:
    """The per-array size limit: ``QUANTKIT_NPZ_MAX_BYTES`` if set, else :data:`DEFAULT_MAX_ARRAY_BYTES`.

    Raises:
        DataError: the variable is set to something other than a positive number of bytes.
    """
    raw = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_ARRAY_BYTES
    text = raw.upper().removesuffix("IB").removesuffix("B")
    scale = _SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    if not digits.isdigit() or int(digits) * scale < 1:
        raise DataError(
            f"{MAX_BYTES_ENV}={raw!r} is not a size; allowed: a positive number of bytes, optionally with a "
            "K, M, G or T suffix (e.g. 8G)"
        )
    return int(digits) * scale


def _human(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class _Entry:
    """One ``.npy`` member of an npz file, from its header."""

    member: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fortran: bool
    data_offset: int  # bytes of magic + header before the array data
    stored: int  # bytes of array data the zip entry declares

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        return f"shape {list(self.shape)} {self.dtype}"


def _read_header(f: IO[bytes], member: str, file_size: int) -> _Entry:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    offset = f.tell()
    return _Entry(member, shape, np.dtype(dtype), bool(fortran), offset, max(0, file_size - offset))


def _headers(path: Path) -> dict[str, _Entry]:
    """``{key: entry}`` of every array in the npz file, read from the headers only."""
    out: dict[str, _Entry] = {}
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as f:
                    out[info.filename[: -len(".npy")]] = _read_header(f, info.filename, info.file_size)
    except _READ_ERRORS as e:
        raise DataError(f"{str(path)!r} is not a readable .npz file: {e}") from e
    return out


def _check_entry(path: Path, key: str, entry: _Entry, limit: int) -> None:
    """Refuse an array before reading it: objects, a header that promises more than is stored, too large."""
    if entry.dtype.hasobject:
        raise DataError(
            f"npz file {str(path)!r}: array {key!r} holds Python objects ({entry.dtype}); allowed: numeric "
            "arrays (objects would need unpickling, which quantkit never does)"
        )
    if entry.nbytes > entry.stored:
        raise DataError(
            f"npz file {str(path)!r}: array {key!r} header says {entry.describe()} ({entry.nbytes} bytes) but "
            f"the file holds {entry.stored} bytes of data for it (truncated, or a header that lies about its length)"
        )
    if entry.nbytes > limit:
        raise DataError(
            f"npz file {str(path)!r}: array {key!r} ({entry.describe()}) is {_human(entry.nbytes)} "
            f"({entry.nbytes} bytes) uncompressed; allowed: at most {_human(limit)} ({limit} bytes) per array "
            f"(split the samples over several files of a folder, or set {MAX_BYTES_ENV} to raise the limit)"
        )


class _RowReader:
    """Reads the rows of one array member in order, ``take(n)`` rows at a time."""

    def __init__(self, zf: zipfile.ZipFile, path: Path, key: str, entry: _Entry) -> None:
        self.path, self.key, self.entry = path, key, entry
        self._f = zf.open(entry.member)
        now = _read_header(self._f, entry.member, zf.getinfo(entry.member).file_size)
        if now != entry:
            self._f.close()
            raise DataError(
                f"npz file {str(path)!r}: array {key!r} changed while in use (was {entry.describe()}, now "
                f"{now.describe()})"
            )
        self._row_shape = entry.shape[1:]
        self._row_bytes = math.prod(self._row_shape) * entry.dtype.itemsize
        self._next = 0
        self._whole: np.ndarray | None = None
        if entry.fortran and len(entry.shape) > 1:  # rows are not contiguous: read it whole (within the limit)
            flat = self._read(math.prod(entry.shape), ())
            self._whole = flat.reshape(entry.shape[::-1]).transpose()

    def _read(self, n: int, row_shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty((n, *row_shape), self.entry.dtype)
        need = out.nbytes
        raw = out.reshape(-1).view(np.uint8) if need else None
        pos = 0
        while pos < need:
            chunk = self._f.read(min(_CHUNK, need - pos))
            if not chunk:
                raise DataError(
                    f"npz file {str(self.path)!r}: array {self.key!r} ended after {pos} of {need} bytes of "
                    "the batch (truncated file, or sizes that lie)"
                )
            assert raw is not None
            raw[pos : pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
            pos += len(chunk)
        return out

    def take(self, n: int) -> np.ndarray:
        start, self._next = self._next, self._next + n
        if self._whole is not None:
            return self._whole[start : start + n]
        return self._read(n, self._row_shape)

    def close(self) -> None:
        self._f.close()


class NpzDataset:
    """Samples from ``.npz`` files, keyed by ONNX input name.

    A single-array file (e.g. saved with ``np.savez(f, x)``, key ``arr_0``) is accepted
    for a model with a single input.  Keys that are not inputs are not fed; one named as labels
    (:data:`~quantkit.data.base.LABEL_KEYS`) with one class id per sample is read by :meth:`labels`.
    See the module docstring for the size limit, the checks made before reading and the streaming.
    """

    def __init__(
        self,
        path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        input_names: Sequence[str],
    ) -> None:
        """Collect the files (a folder is searched recursively for ``*.npz``, sorted) and check their headers.

        Raises:
            DataError: no files, unreadable file, missing input, inconsistent sample counts, an array
                larger than :func:`max_array_bytes` or larger than its header says is stored, files of a
                folder whose sample shapes or dtypes differ.
        """
        if isinstance(path_or_paths, (str, os.PathLike)):
            root = Path(path_or_paths).expanduser()
            if root.is_dir():
                files = sorted(root.rglob("*.npz"))
                if not files:
                    raise DataError(f"folder {str(root)!r} contains no .npz files")
            elif root.is_file():
                files = [root]
            else:
                raise DataError(f"npz path {str(root)!r} does not exist")
        else:
            files = [Path(p).expanduser() for p in path_or_paths]
            if not files:
                raise DataError("NpzDataset got an empty list of files")
            for f in files:
                if not f.is_file():
                    raise DataError(f"npz file {str(f)!r} does not exist")
        if not input_names:
            raise DataError("NpzDataset needs at least one input name")
        limit = max_array_bytes()
        self.files = files
        self.input_names = list(input_names)
        # Per file: input name -> key in the file, and the header entry per input.
        self._keys: list[dict[str, str]] = []
        self._entries: list[dict[str, _Entry]] = []
        self._counts: list[int] = []
        for f in files:
            headers = _headers(f)
            keys: dict[str, str] = {}
            for name in self.input_names:
                if name in headers:
                    keys[name] = name
                elif len(self.input_names) == 1 and len(headers) == 1:
                    keys[name] = next(iter(headers))
                else:
                    raise DataError(
                        f"npz file {str(f)!r} has no array for model input {name!r}; it holds {sorted(headers)}"
                        + (
                            " (a single-array file is only accepted for a single-input model)"
                            if len(headers) == 1
                            else ""
                        )
                    )
            unused = sorted(set(headers) - set(keys.values()))
            if unused and f == files[0]:  # labels are expected; a misspelt input name is not
                lab = next((k for k in LABEL_KEYS if k in unused), None)
                log.info("npz file %s: arrays %s are not model inputs (%s) and are not fed%s", f, unused,
                         ", ".join(self.input_names),
                         f"; {lab!r} is read as class labels (accuracy)" if lab else "")  # fmt: skip
            entries = {n: headers[k] for n, k in keys.items()}
            shapes = [e.shape for e in entries.values()]
            if any(len(s) == 0 for s in shapes) or len({s[0] for s in shapes}) != 1:
                raise DataError(
                    f"npz file {str(f)!r}: arrays must share a leading (sample) dim; got "
                    + ", ".join(f"{n}: shape {list(e.shape)}" for n, e in entries.items())
                    + " (the first axis of every array counts the samples, as quantkit batches and feeds them; an "
                    "input whose batch axis is not the first - an RNN's initial state [layers, batch, hidden] - needs "
                    "a model that takes it batch-first: export a wrapper that transposes it inside the graph)"
                )
            for name, entry in entries.items():
                _check_entry(f, keys[name], entry, limit)
            if self._entries:
                self._check_same_samples(f, entries)
            self._keys.append(keys)
            self._entries.append(entries)
            self._counts.append(int(shapes[0][0]))
        self._fp: str | None = None
        self._label_cache: list[np.ndarray] | None = None
        self._cast: dict[str, np.dtype[Any]] = {}  # input -> its dtype, for float arrays of another precision

    def _check_same_samples(self, f: Path, entries: dict[str, _Entry]) -> None:
        """Every file must hold samples of the first file's shape and dtype (batches cross files)."""
        first, first_entries = self.files[0], self._entries[0]
        for name, e in entries.items():
            e0 = first_entries[name]
            if e.shape[1:] != e0.shape[1:] or e.dtype != e0.dtype:
                raise DataError(
                    f"npz files {str(first)!r} and {str(f)!r} hold different samples for input {name!r}: "
                    f"{e0.describe()} vs {e.describe()}; allowed: one sample shape and dtype (all dims but the "
                    "first) in every file of the data"
                )

    def validate(self, inputs: list[InputInfo]) -> None:
        """Check names, dtypes, ranks and static dims of every file against the model inputs.

        Raises:
            DataError: naming the file, the input, and the expected and received dtype/shape.
        """
        wanted = {i.name: i for i in inputs}
        missing = sorted(set(wanted) - set(self.input_names))
        if missing:
            raise DataError(f"npz data provides {self.input_names} but the model also needs {missing}")
        for f, entries in zip(self.files, self._entries, strict=True):
            for name, e in entries.items():
                if name in wanted:
                    dtype = e.dtype
                    if float_cast(wanted[name].dtype, np.zeros(0, dtype), name).dtype != dtype:
                        dtype = self._cast[name] = wanted[name].dtype  # float64 arrays for a float32 input ...
                    # A zero-stride stand-in carries shape and dtype without allocating.
                    fake = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), e.shape, [0] * len(e.shape))
                    check_array(wanted[name], fake, f"npz file {str(f)!r}", batched=True)

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Batches of ``batch_size`` samples, crossing file boundaries; one file open at a time, each array
        streamed from its zip member (memory bounded by a batch)."""
        check_batch_size(batch_size)
        pending: list[dict[str, np.ndarray]] = []
        pending_n = 0
        for f, entries, keys, n in zip(self.files, self._entries, self._keys, self._counts, strict=True):
            readers: dict[str, _RowReader] = {}
            try:
                with zipfile.ZipFile(f) as zf:
                    for name, entry in entries.items():
                        readers[name] = _RowReader(zf, f, keys[name], entry)
                    start = 0
                    while start < n:
                        take = min(batch_size - pending_n, n - start)
                        pending.append({name: float_cast(self._cast.get(name), r.take(take), name)
                                        for name, r in readers.items()})
                        pending_n += take
                        start += take
                        if pending_n == batch_size:
                            yield _concat(pending)
                            pending, pending_n = [], 0
            except _READ_ERRORS as e:
                raise DataError(f"npz file {str(f)!r} cannot be read: {e}") from e
            finally:
                for r in readers.values():
                    r.close()
        if pending:
            yield _concat(pending)

    def __len__(self) -> int:
        return sum(self._counts)

    def labels(self) -> np.ndarray | None:
        """The samples' class ids, from the first array of every file named as labels
        (:data:`~quantkit.data.base.LABEL_KEYS`, not a model input) with one integer per sample; None when a
        file has none."""
        if self._label_cache is not None:
            return np.concatenate(self._label_cache) if self._label_cache else None
        parts: list[np.ndarray] = []
        limit = max_array_bytes()
        for f, keys, n in zip(self.files, self._keys, self._counts, strict=True):
            headers = _headers(f)
            key = next((k for k in LABEL_KEYS if k in headers and k not in keys.values()), None)
            if key is None or headers[key].nbytes > limit:
                self._label_cache = []
                return None
            try:
                with np.load(f, allow_pickle=False) as z:
                    lab = class_labels(z[key], n)
            except _READ_ERRORS as e:
                raise DataError(f"npz file {str(f)!r} cannot be read: {e}") from e
            if lab is None:
                log.info("npz file %s: array %r is not one class id per sample; no accuracy against labels", f, key)
                self._label_cache = []
                return None
            parts.append(lab)
        self._label_cache = parts
        return np.concatenate(parts)

    def fingerprint(self) -> str:
        """sha256 over the input names and the bytes of every file, streamed in 1 MiB chunks."""
        if self._fp is None:
            h = new_hasher("npz", {"inputs": self.input_names, "keys": self._keys})
            for f in self.files:
                hash_file(h, f)
            self._fp = h.hexdigest()
        return self._fp


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}
