"""Datasets stored as ``.npz`` files: one file, or a folder of them.

Each file maps input names to arrays with a leading sample dim.  Files are opened one
at a time while batching, so memory is bounded by the largest file, not the dataset.
Shapes and dtypes (for ``len`` and validation) come from the ``.npy`` headers inside the
zip, without reading array data.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.data.base import InputInfo, check_array, check_batch_size, hash_file, new_hasher
from quantkit.errors import DataError

__all__ = ["NpzDataset"]


def _headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """``{key: (shape, dtype)}`` of every array in the npz file, read from the headers only."""
    out: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
    try:
        with zipfile.ZipFile(path) as zf:
            for member in zf.namelist():
                if not member.endswith(".npy"):
                    continue
                with zf.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                out[member[: -len(".npy")]] = (tuple(shape), np.dtype(dtype))
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise DataError(f"{str(path)!r} is not a readable .npz file: {e}") from e
    return out


class NpzDataset:
    """Samples from ``.npz`` files, keyed by ONNX input name.

    A single-array file (e.g. saved with ``np.savez(f, x)``, key ``arr_0``) is accepted
    for a model with a single input.  Keys that are not inputs (labels ...) are ignored.
    """

    def __init__(
        self,
        path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        input_names: Sequence[str],
    ) -> None:
        """Collect the files (a folder is searched recursively for ``*.npz``, sorted).

        Raises:
            DataError: no files, unreadable file, missing input, inconsistent sample counts.
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
        self.files = files
        self.input_names = list(input_names)
        # Per file: input name -> key in the file, and (shape, dtype) per input.
        self._keys: list[dict[str, str]] = []
        self._meta: list[dict[str, tuple[tuple[int, ...], np.dtype[Any]]]] = []
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
            meta = {n: headers[k] for n, k in keys.items()}
            shapes = [s for s, _ in meta.values()]
            if any(len(s) == 0 for s in shapes) or len({s[0] for s in shapes}) != 1:
                raise DataError(
                    f"npz file {str(f)!r}: arrays must share a leading (sample) dim; got "
                    + ", ".join(f"{n}: shape {list(s)}" for n, (s, _) in meta.items())
                )
            self._keys.append(keys)
            self._meta.append(meta)
            self._counts.append(int(shapes[0][0]))
        self._fp: str | None = None

    def validate(self, inputs: list[InputInfo]) -> None:
        """Check names, dtypes, ranks and static dims of every file against the model inputs.

        Raises:
            DataError: naming the file, the input, and the expected and received dtype/shape.
        """
        wanted = {i.name: i for i in inputs}
        missing = sorted(set(wanted) - set(self.input_names))
        if missing:
            raise DataError(f"npz data provides {self.input_names} but the model also needs {missing}")
        for f, meta in zip(self.files, self._meta, strict=True):
            for name, (shape, dtype) in meta.items():
                if name in wanted:
                    # A zero-stride stand-in carries shape and dtype without allocating.
                    fake = np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, [0] * len(shape))
                    check_array(wanted[name], fake, f"npz file {str(f)!r}", batched=True)

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Batches of ``batch_size`` samples, crossing file boundaries; one file open at a time."""
        check_batch_size(batch_size)
        pending: list[dict[str, np.ndarray]] = []
        pending_n = 0
        for f, keys in zip(self.files, self._keys, strict=True):
            with np.load(f, allow_pickle=False) as data:
                arrays = {n: data[k] for n, k in keys.items()}
            n = next(iter(arrays.values())).shape[0]
            start = 0
            while start < n:
                take = min(batch_size - pending_n, n - start)
                pending.append({k: v[start : start + take] for k, v in arrays.items()})
                pending_n += take
                start += take
                if pending_n == batch_size:
                    yield _concat(pending)
                    pending, pending_n = [], 0
            del arrays
        if pending:
            yield _concat(pending)

    def __len__(self) -> int:
        return sum(self._counts)

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
