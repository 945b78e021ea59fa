"""The dataset protocol, model-input descriptions and shared helpers.

A dataset yields *feed dicts*: ``{onnx_input_name: array}`` whose leading dim is the
batch.  Batches are produced lazily so that memory does not grow with the number of
samples, and every dataset has a ``fingerprint()`` -- a sha256 hex digest over its
content and settings -- that the statistics cache uses as a key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import onnx_ir as ir

from quantkit.errors import DataError

__all__ = [
    "ArrayDataset",
    "Dataset",
    "InputInfo",
    "LABEL_KEYS",
    "check_batch",
    "class_labels",
    "dataset_labels",
    "as_array",
    "float_cast",
    "hash_array",
    "hash_file",
    "model_inputs",
    "new_hasher",
]

MAX_SAMPLES = 100_000
"""The most samples a dataset may be asked for (``count`` of ``sample_photos`` and ``text``): more than any
calibration or evaluation set needs, and few enough that a typo (``count: 1000000000``) is refused at once
instead of running for hours."""

MAX_SEQ_LEN = 131_072
"""The longest token window a text dataset (``seq_len``) may ask for (128k tokens, the longest LLM context
in common use); a larger value would allocate ``batch x seq_len`` token arrays for nothing."""


LABEL_KEYS = ("labels", "label", "targets", "target", "y")
"""Names under which data that is not a model input carries class labels (an ``.npz`` array, a dict key); a
tuple item with one element more than the model has inputs carries them last (PyTorch's ``(inputs, target)``).
Labels turn the evaluation's agreement with FP32 into accuracy, FP32's and the quantized model's."""


def class_labels(value: Any, rows: int | None = None) -> np.ndarray | None:
    """``value`` as a 1-D int64 array of class ids (shape ``[N]`` or ``[N, 1]``, integers or integral floats,
    none negative; ``rows``: the expected N), else None: anything else (one-hot rows, regression targets, masks)
    is not a class label."""
    try:
        a = as_array(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim == 0 and rows in (None, 1):
        a = a.reshape(1)
    if a.ndim != 1 or (rows is not None and a.shape[0] != rows) or a.size == 0:
        return None
    if np.issubdtype(a.dtype, np.floating):
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            return None
    elif not np.issubdtype(a.dtype, np.integer):
        return None
    a = a.astype(np.int64)
    return None if int(a.min()) < 0 else a


def dataset_labels(ds: Any) -> np.ndarray | None:
    """The class labels ``ds`` carries for its samples, in order (``ds.labels()``), None when it has none or
    they do not cover every sample."""
    fn = getattr(ds, "labels", None)
    if not callable(fn):
        return None
    got = fn()
    if got is None:
        return None
    lab = class_labels(got)
    return lab if lab is not None and lab.shape[0] == len(ds) else None


@runtime_checkable
class Dataset(Protocol):
    """What calibration and evaluation consume."""

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Feed dicts keyed by ONNX input name; leading dim = batch (the last may be short)."""
        ...

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def fingerprint(self) -> str:
        """Stable sha256 hex digest over content + settings."""
        ...


@dataclass(frozen=True)
class InputInfo:
    """One graph input of a model.

    Attributes:
        name: ONNX input name.
        dtype: numpy dtype of the input.
        shape: static dims as ints, dynamic (symbolic or unknown) dims as None; None if
            even the rank is unknown.
    """

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int | None, ...] | None

    @property
    def rank(self) -> int | None:
        """Number of dims, or None if unknown."""
        return None if self.shape is None else len(self.shape)

    def describe(self) -> str:
        """E.g. ``float32[N,3,224,224]`` (``?`` for dynamic dims)."""
        if self.shape is None:
            return f"{self.dtype}[unknown rank]"
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"


def model_inputs(model: ir.Model) -> list[InputInfo]:
    """The graph inputs of ``model`` that are not initializers, in graph order.

    Raises:
        DataError: an input has no tensor type (sequence/map inputs are not supported).
    """
    infos: list[InputInfo] = []
    for value in model.graph.inputs:
        if value.name in model.graph.initializers:
            continue
        if value.dtype is None:
            raise DataError(f"model input {value.name!r} has no tensor element type")
        try:
            dtype = np.dtype(value.dtype.numpy())
        except Exception as e:
            raise DataError(
                f"model input {value.name!r} has dtype {value.dtype}, which numpy cannot hold"
            ) from e
        shape: tuple[int | None, ...] | None = None
        if value.shape is not None:
            shape = tuple(d if isinstance(d, int) else None for d in value.shape)
        infos.append(InputInfo(str(value.name), dtype, shape))
    return infos


def new_hasher(kind: str, settings: Mapping[str, Any]) -> Any:
    """A sha256 pre-loaded with the dataset kind and its settings (JSON, sorted keys)."""
    h = hashlib.sha256()
    h.update(json.dumps({"kind": kind, "settings": settings}, sort_keys=True, default=str).encode())
    return h


def hash_array(h: Any, name: str, array: np.ndarray) -> None:
    """Feed ``name``, dtype, shape and the C-order bytes of ``array`` into hasher ``h``."""
    a = np.ascontiguousarray(array)
    h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
    h.update(a.tobytes())


def hash_file(h: Any, path: Path) -> None:
    """Feed the bytes of ``path`` into hasher ``h``, streamed in 1 MiB chunks."""
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    h.update(b"|eof|")


def check_batch(batch: Mapping[str, np.ndarray], inputs: list[InputInfo], where: str = "data") -> None:
    """Check a feed dict against the model inputs: every input present, dtype, rank, static dims.

    The leading (batch) dim is not compared.

    Raises:
        DataError: naming the input, the expected and the received dtype/shape.
    """
    for info in inputs:
        if info.name not in batch:
            raise DataError(
                f"{where}: model input {info.name!r} is missing; the data provides {sorted(batch)}"
            )
        check_array(info, as_array(batch[info.name]), where, batched=True)


_CAST_TOLD: set[tuple[str, str, str]] = set()


def as_array(value: Any) -> np.ndarray:
    """``value`` as a NumPy array; a PyTorch tensor is detached and moved to the CPU first (a tensor that requires
    grad cannot be read by ``np.asarray``: "Can't call numpy() on Tensor that requires grad")."""
    detach = getattr(value, "detach", None)
    if callable(detach) and hasattr(value, "cpu"):
        return np.asarray(detach().cpu().numpy())
    return np.asarray(value)


def float_cast(dtype: np.dtype[Any] | None, array: np.ndarray, name: str) -> np.ndarray:
    """``array`` in the input's ``dtype`` when the cast loses nothing a user meant: floats of another precision
    (float64 data for a float32 model: NumPy's default), or integers (token ids) of another width whose values
    all fit (int32 ids for an int64 model; int64 ids for an int32 one) - logged once per input; anything else
    as it is (a wrong dtype is then refused by :func:`check_array`, naming the input)."""
    if dtype is None or array.dtype == dtype:
        return array
    floats = np.issubdtype(array.dtype, np.floating) and np.issubdtype(dtype, np.floating)
    ints = (np.issubdtype(array.dtype, np.integer) and np.issubdtype(dtype, np.integer)
            and (array.size == 0 or (np.iinfo(dtype).min <= int(array.min()) and int(array.max()) <= np.iinfo(dtype).max)))
    if not (floats or ints):
        return array
    told = (name, str(array.dtype), str(dtype))
    if told not in _CAST_TOLD:
        _CAST_TOLD.add(told)
        import logging

        logging.getLogger("quantkit").info("data for input %r is %s: cast to the model's %s", name, array.dtype,
                                           dtype)  # fmt: skip
    return array.astype(dtype)


def check_array(info: InputInfo, array: np.ndarray, where: str, *, batched: bool) -> None:
    """Check one array (with a leading batch dim if ``batched``) against ``info``.

    Raises:
        DataError: dtype, rank or a static dim differs.
    """
    shape = array.shape if batched else (None, *array.shape)
    expected = info.describe()
    received = f"{array.dtype}{list(array.shape)}"
    if array.dtype != info.dtype:
        raise DataError(
            f"{where}: input {info.name!r} expects dtype {info.dtype} ({expected}), received dtype {array.dtype} "
            f"(shape {received})"
        )
    if info.shape is None:
        return
    if len(shape) != len(info.shape):
        hint = ""
        if len(shape) == len(info.shape) + 1:  # the model reads this input whole, with no axis for the samples
            hint = ("; quantkit stacks the samples of every input along its first axis, so an input without a batch "
                    "axis (a scalar, a table the model reads whole) cannot be fed per sample: make it a constant of "
                    "the model (an initializer) or export the model with a batch axis on it")  # fmt: skip
        raise DataError(
            f"{where}: input {info.name!r} expects rank {len(info.shape)} ({expected}, leading dim = batch), "
            f"received shape {received}{hint}"
        )
    for axis, (want, got) in enumerate(zip(info.shape, shape, strict=True)):
        if axis > 0 and want is not None and want != got:
            raise DataError(
                f"{where}: input {info.name!r} expects {expected}, received shape {received} (dim {axis}: {want} != {got})"
            )


class ArrayDataset:
    """In-memory arrays ``{name: array}`` with a common leading sample dim."""

    def __init__(self, arrays: Mapping[str, np.ndarray], *, labels: np.ndarray | None = None) -> None:
        """Wrap ``arrays``; all must share the leading dim.  ``labels``: class ids of the samples (not fed).

        Raises:
            DataError: empty mapping, scalar arrays or different leading dims.
        """
        if not arrays:
            raise DataError("ArrayDataset needs at least one array")
        self._arrays = {k: as_array(v) for k, v in arrays.items()}
        shapes = {k: v.shape for k, v in self._arrays.items()}
        if any(len(s) == 0 for s in shapes.values()) or len({s[0] for s in shapes.values()}) != 1:
            raise DataError(f"ArrayDataset arrays must share a leading (sample) dim; got shapes {shapes}")
        self._n = int(next(iter(shapes.values()))[0])
        self._labels = None if labels is None else class_labels(labels, self._n)
        self._fp: str | None = None

    def labels(self) -> np.ndarray | None:
        """The samples' class labels, when given (:func:`class_labels`)."""
        return self._labels

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Consecutive slices of ``batch_size`` samples (views, no copies)."""
        check_batch_size(batch_size)
        for start in range(0, self._n, batch_size):
            yield {k: v[start : start + batch_size] for k, v in self._arrays.items()}

    def __len__(self) -> int:
        return self._n

    def fingerprint(self) -> str:
        """sha256 over names, dtypes, shapes and bytes of the arrays."""
        if self._fp is None:
            h = new_hasher("arrays", {})
            for k in sorted(self._arrays):
                hash_array(h, k, self._arrays[k])
            self._fp = h.hexdigest()
        return self._fp


def check_batch_size(batch_size: int) -> None:
    """Raise DataError unless ``batch_size`` is a positive int."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
