"""Build datasets from recipe dicts (:func:`make_dataset`) or Python objects (:func:`as_dataset`)."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.data.audio import DEFAULT_SECONDS, AudioFolderDataset, is_audio_processor
from quantkit.data.base import (
    LABEL_KEYS,
    MAX_SAMPLES,
    MAX_SEQ_LEN,
    ArrayDataset,
    Dataset,
    InputInfo,
    check_array,
    check_batch,
    float_cast,
)
from quantkit.data.fixed_batch import bind_fixed_batch
from quantkit.data.images import MODEL_PRESET, ImageFolderDataset, get_preprocess, is_folder_processor
from quantkit.data.iterable import IterableDataset
from quantkit.data.kv import bind_kv_cache, split_past
from quantkit.data.npz import NpzDataset
from quantkit.data.photos import SPLITS, SamplePhotosDataset
from quantkit.data.text import TextDataset
from quantkit.errors import DataError

__all__ = ["DATASET_KINDS", "SPEC_FLOAT_RANGES", "SPEC_INT_RANGES", "as_dataset", "check_spec_ints", "make_dataset"]

log = logging.getLogger(__name__)

#: Allowed keys per ``kind`` (besides ``kind``); required ones first in the messages.
DATASET_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sample_photos": (("count",), ("preprocess", "seed", "input")),
    "images": (("path",), ("preprocess", "limit", "seed", "input")),
    "npz": (("path",), ()),
    "text": (("source",), ("mode", "count", "seq_len", "seed", "offset")),
    "audio": (("path",), ("seconds", "hop", "sampling_rate", "limit", "seed", "input")),
}

#: Integer keys of a dataset spec and their allowed range (inclusive).  Counts and lengths that drive loops
#: and allocations are bounded, so that ``count: 1000000000`` is refused when the recipe loads instead of
#: running for hours; ``limit`` (images) only ever keeps fewer of the files there are.
SPEC_INT_RANGES: dict[str, tuple[int, int]] = {
    "count": (1, MAX_SAMPLES),
    "limit": (1, 2**63 - 1),
    "seq_len": (2, MAX_SEQ_LEN),
    "offset": (0, 2**63 - 1),
    "seed": (0, 2**63 - 1),
    "sampling_rate": (1000, 768_000),
}

#: Number keys of a dataset spec (seconds) and their allowed range (inclusive).
SPEC_FLOAT_RANGES: dict[str, tuple[float, float]] = {"seconds": (0.01, 3600.0), "hop": (0.001, 3600.0)}


def check_spec_ints(spec: Mapping[str, Any]) -> None:
    """Check the integer keys of a dataset spec (:data:`SPEC_INT_RANGES`) and its number keys
    (:data:`SPEC_FLOAT_RANGES`) that are present and not null.

    Raises:
        DataError: a value that is not an integer or is out of range, naming the key, the value and the
            allowed range.
    """
    kind = spec.get("kind")
    for key, (flo, fhi) in SPEC_FLOAT_RANGES.items():
        value = spec.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(f"dataset {kind!r}: key {key!r} must be a number (seconds), got {value!r}")
        if not flo <= value <= fhi:
            raise DataError(f"dataset {kind!r}: key {key!r} is {value}; allowed: {flo:g} to {fhi:g}")
    for key, (lo, hi) in SPEC_INT_RANGES.items():
        value = spec.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise DataError(f"dataset {kind!r}: key {key!r} must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise DataError(f"dataset {kind!r}: key {key!r} is {value}; allowed: {lo} to {hi}")


def _image_input(inputs: list[InputInfo], name: Any, preprocess: Any, kind: str) -> str:
    """Pick the image input and check that the preprocessing output fits it."""
    if name is not None:
        matches = [i for i in inputs if i.name == name]
        if not matches:
            raise DataError(
                f"dataset {kind!r}: input {name!r} is not a model input; inputs: {[i.name for i in inputs]}"
            )
        info = matches[0]
    elif len(inputs) == 1:
        info = inputs[0]
    else:
        raise DataError(
            f"dataset {kind!r}: the model has inputs {[i.name for i in inputs]}; say which one takes the "
            "images with the key 'input'"
        )
    pre = get_preprocess(preprocess)
    fake = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (1, *pre.output_shape), [0] * 4)
    check_array(
        info, fake, f"dataset {kind!r} (preprocess layout {pre.layout}, sample shape {list(pre.output_shape)})",
        batched=True,
    )
    return info.name


def _audio_input(inputs: list[InputInfo], name: Any, processor: Any) -> str:
    """The input that takes the audio: the feature extractor's, the spec's ``input``, or the only one."""
    names = [i.name for i in inputs]
    wanted = processor.input_name if processor is not None and name is None else name
    if wanted is not None:
        if wanted not in names:
            raise DataError(f"dataset 'audio': input {wanted!r} is not a model input; inputs: {names}")
        return str(wanted)
    if len(inputs) == 1:
        return names[0]
    raise DataError(f"dataset 'audio': the model has inputs {names}; say which one takes the audio with the key "
                    "'input'")


def _preprocess(spec: Mapping[str, Any], processor: Any, kind: str) -> Any:
    """An image dataset's preprocessing: the spec's, else the model folder's own image processor
    (``processor``, :class:`quantkit.frontends.vision.FolderImageProcessor`), else ``efficientnet``.
    ``model`` names the folder's processor explicitly."""
    own = processor if is_folder_processor(processor) else None
    given = spec.get("preprocess")
    if given is None or given == MODEL_PRESET:
        return own if own is not None else (given or "efficientnet")
    if own is not None:
        log.warning("dataset %r: the model folder ships its own image preprocessing (%s); the spec's preprocess "
                    "%r is used instead (leave 'preprocess' out or write 'preprocess: model' for the folder's)",
                    kind, own.name, given)
    return given


def make_dataset(
    spec: Mapping[str, Any],
    *,
    inputs: list[InputInfo],
    tokenizer: Any = None,
    split: str,
) -> Dataset:
    """Build a dataset from a plain dict, as written in a recipe.

    Examples::

        {"kind": "sample_photos", "count": 100, "preprocess": "efficientnet", "seed": 0}
        {"kind": "images", "path": "photos/", "preprocess": "imagenet", "limit": 500}
        {"kind": "npz", "path": "calib.npz"}
        {"kind": "text", "source": "pydoc", "mode": "sentences", "count": 200, "seq_len": 128}

    ``split`` (``"calibration"`` or ``"evaluation"``) selects disjoint samples for
    ``sample_photos`` and ``text`` sources; files given by path are used as they are.
    The first batch is checked against ``inputs`` so that a mismatch fails here.

    A KV-cache decoder's ``past_key_values.*`` inputs are not asked of the data: every batch gets
    empty past tensors (:func:`quantkit.data.kv.bind_kv_cache`).  A model whose inputs fix the batch at 1 gets
    one sample per batch whatever the size asked (:func:`quantkit.data.fixed_batch.bind_fixed_batch`; a larger
    fixed batch is refused).

    Raises:
        DataError: unknown kind, unknown or missing key, a bad value, or data that does
            not match the model inputs (the message names the key or input).
    """
    data_inputs, past = split_past(inputs)
    ds = _make_dataset(spec, inputs=data_inputs, tokenizer=tokenizer, split=split)
    return bind_kv_cache(ds, past) if past else bind_fixed_batch(ds, data_inputs)


def _make_dataset(spec: Mapping[str, Any], *, inputs: list[InputInfo], tokenizer: Any, split: str) -> Dataset:
    if not isinstance(spec, Mapping):
        raise DataError(f"a dataset spec must be a mapping with a 'kind' key, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in DATASET_KINDS:
        raise DataError(f"unknown dataset kind {kind!r}; allowed kinds: {', '.join(sorted(DATASET_KINDS))}")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    required, optional = DATASET_KINDS[kind]
    allowed = {"kind", *required, *optional}
    extra = sorted(set(spec) - allowed)
    if extra:
        raise DataError(f"dataset {kind!r}: unknown key(s) {extra}; allowed keys: {sorted(allowed)}")
    missing = [k for k in required if k not in spec]
    if missing:
        raise DataError(
            f"dataset {kind!r}: missing required key(s) {missing}; allowed keys: {sorted(allowed)}"
        )
    check_spec_ints(spec)
    if not inputs:
        raise DataError("the model has no inputs to feed")

    ds: SamplePhotosDataset | ImageFolderDataset | TextDataset | AudioFolderDataset
    if kind in ("sample_photos", "images") and is_audio_processor(tokenizer):
        raise DataError(f"dataset {kind!r}: this model takes audio ({tokenizer.input_name}), not images; allowed "
                        "kinds here: audio, npz")
    if kind == "audio":
        if is_folder_processor(tokenizer):
            raise DataError("dataset 'audio': this model takes images (pixel_values), not audio; allowed kinds here: "
                            "images, sample_photos, npz")
        processor = tokenizer if is_audio_processor(tokenizer) else None
        name = _audio_input(inputs, spec.get("input"), processor)
        ds = AudioFolderDataset(_path(spec, kind), name, processor=processor,
                                seconds=spec.get("seconds", DEFAULT_SECONDS), hop=spec.get("hop"),
                                sampling_rate=spec.get("sampling_rate"), limit=spec.get("limit"),
                                seed=_int(spec, "seed", 0))
    elif kind == "sample_photos":
        preprocess = _preprocess(spec, tokenizer, kind)
        name = _image_input(inputs, spec.get("input"), preprocess, kind)
        ds = SamplePhotosDataset(spec["count"], split, name, preprocess, _int(spec, "seed", 0))
    elif kind == "images":
        preprocess = _preprocess(spec, tokenizer, kind)
        name = _image_input(inputs, spec.get("input"), preprocess, kind)
        ds = ImageFolderDataset(_path(spec, kind), name, preprocess, spec.get("limit"), _int(spec, "seed", 0))
    elif kind == "npz":
        path = spec["path"]
        paths = [str(p) for p in path] if isinstance(path, (list, tuple)) else _path(spec, kind)
        npz = NpzDataset(paths, [i.name for i in inputs])
        npz.validate(inputs)
        return npz
    else:
        if is_folder_processor(tokenizer):
            raise DataError("dataset 'text': this model takes images (pixel_values), not text; allowed kinds "
                            "here: images, sample_photos, npz")
        if is_audio_processor(tokenizer):
            raise DataError(f"dataset 'text': this model takes audio ({tokenizer.input_name}), not text; allowed "
                            "kinds here: audio, npz")
        if tokenizer is None:
            raise DataError(
                "dataset 'text' needs the model's tokenizer; this model has none (use 'npz' data instead)"
            )
        source = spec["source"]
        if not isinstance(source, (str, list, tuple)):
            raise DataError(
                f"dataset 'text': key 'source' must be 'pydoc', a file path or a list of strings; got {source!r}"
            )
        ds = TextDataset(
            source if isinstance(source, str) else [str(s) for s in source],
            tokenizer,
            mode=spec.get("mode", "sentences"),
            seq_len=_int(spec, "seq_len", 128),
            count=spec.get("count"),
            seed=_int(spec, "seed", 0),
            split=split,
            offset=_int(spec, "offset", 0),
            input_names=[i.name for i in inputs],
        )
    check_batch(next(iter(ds.batches(1))), inputs, where=f"dataset {kind!r}")
    return ds


def _int(spec: Mapping[str, Any], key: str, default: int) -> int:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataError(f"dataset {spec.get('kind')!r}: key {key!r} must be an integer, got {value!r}")
    return value


def _path(spec: Mapping[str, Any], kind: str) -> str:
    value = spec["path"]
    if not isinstance(value, (str, os.PathLike)):
        raise DataError(f"dataset {kind!r}: key 'path' must be a path string, got {value!r}")
    return os.fspath(value)


def as_dataset(
    obj: Any, inputs: list[InputInfo], tokenizer: Any = None, *, split: str = "calibration"
) -> Dataset:
    """Turn what a Python API user passes as data into a :class:`Dataset`.

    Accepted:

    * a :class:`Dataset` -- returned as is;
    * a recipe-style dict with ``kind`` -- :func:`make_dataset`;
    * a dict ``{input name: array}`` with a leading sample dim, or one ndarray for a
      single-input model (a single sample without the batch dim is accepted too);
    * a path to a ``.npz`` file or a folder of them;
    * a list of strings, with a tokenizer -- a sentences :class:`TextDataset` (seq_len
      from the model's static sequence dim, else 128);
    * any other iterable (or a callable returning one) of dicts, arrays or tuples --
      :class:`IterableDataset`; whether items are samples or batches is inferred by
      comparing the first item's rank with the model input's rank.

    A KV-cache decoder's ``past_key_values.*`` inputs get empty past tensors (see :func:`make_dataset`).

    Raises:
        DataError: the object is of none of these kinds or does not match the inputs.
    """
    data_inputs, past = split_past(inputs)
    ds = _as_dataset(obj, data_inputs, tokenizer, split=split)
    return bind_kv_cache(ds, past) if past else bind_fixed_batch(ds, data_inputs)


def _as_dataset(obj: Any, inputs: list[InputInfo], tokenizer: Any = None, *, split: str = "calibration") -> Dataset:
    names = [i.name for i in inputs]
    if isinstance(obj, Dataset) and hasattr(obj, "batches") and hasattr(obj, "fingerprint"):
        return obj
    if isinstance(obj, Mapping) and "kind" in obj:
        return make_dataset(obj, inputs=inputs, tokenizer=tokenizer, split=split)
    if isinstance(obj, Mapping):
        arrays = {str(k): np.asarray(v) for k, v in obj.items()}
        return _arrays(arrays, inputs)
    if isinstance(obj, np.ndarray):
        if len(inputs) != 1:
            raise DataError(f"a single array can only feed a single-input model; this one has inputs {names}")
        return _arrays({names[0]: obj}, inputs)
    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj).expanduser()
        if path.suffix == ".npz" or path.is_dir():
            ds = NpzDataset(path, names)
            ds.validate(inputs)
            return ds
        raise DataError(
            f"data path {str(path)!r} is not a .npz file or folder; for images or text pass a spec such as "
            "{'kind': 'images', 'path': ..., 'preprocess': 'efficientnet'}"
        )
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, str) for t in obj):
        if is_folder_processor(tokenizer):
            raise DataError("a list of strings is text; this model takes images (pixel_values): pass "
                            "{'kind': 'images', 'path': <folder of photos>} (the model's own preprocessing), "
                            "arrays or a .npz path")
        if tokenizer is None:
            raise DataError("a list of strings needs the model's tokenizer; this model has none")
        ids = next((i for i in inputs if i.name == "input_ids"), None)
        seq = ids.shape[1] if ids is not None and ids.shape is not None and len(ids.shape) == 2 else None
        return TextDataset(list(obj), tokenizer, mode="sentences", seq_len=seq or 128, input_names=names)
    if callable(obj) or isinstance(obj, Iterable):
        return _iterable(obj, inputs)
    raise DataError(
        f"cannot use an object of type {type(obj).__name__} as data; pass a Dataset, a dict of arrays, an "
        "ndarray, a .npz path, a list of strings, an iterable or a callable returning an iterator"
    )


def _arrays(arrays: dict[str, np.ndarray], inputs: list[InputInfo]) -> ArrayDataset:
    """An ArrayDataset, adding a batch dim to single samples, checked against ``inputs``."""
    for info in inputs:
        a = arrays.get(info.name)
        if a is not None:
            a = arrays[info.name] = float_cast(info.dtype, a, info.name)
        if a is not None and info.rank is not None and a.ndim == info.rank - 1:
            arrays[info.name] = a[None]
    check_batch(arrays, inputs, where="data")
    names = {i.name for i in inputs}
    key = next((k for k in LABEL_KEYS if k in arrays and k not in names), None)
    return ArrayDataset({i.name: arrays[i.name] for i in inputs}, labels=None if key is None else arrays[key])


def _iterable(obj: Iterable[Any] | Callable[[], Iterable[Any]], inputs: list[InputInfo]) -> IterableDataset:
    """IterableDataset with ``batched`` inferred from the first item (peeked, then replayed)."""
    names = [i.name for i in inputs]
    probe = IterableDataset([], names)
    source: Any = obj
    if isinstance(obj, Iterator):
        try:
            first = next(obj)
        except StopIteration:
            raise DataError("the data iterator is empty") from None
        source = itertools.chain([first], obj)
    else:
        it = iter(obj() if callable(obj) and not isinstance(obj, Iterable) else obj)
        try:
            first = next(it)
        except StopIteration:
            raise DataError("the data iterable is empty") from None
    probe.dtypes = {i.name: i.dtype for i in inputs}
    sample = probe._as_dict(first, 0)
    batched: bool | None = None
    for info in inputs:
        if info.rank is None:
            continue
        got = sample[info.name].ndim
        if got == info.rank:
            this = True
        elif got == info.rank - 1:
            this = False
        else:
            raise DataError(
                f"data item 0: input {info.name!r} expects {info.describe()} (or one sample without the batch "
                f"dim), received shape {list(sample[info.name].shape)}"
            )
        if batched is not None and batched != this:
            raise DataError("data item 0 mixes batched and unbatched arrays")
        batched = this
    return IterableDataset(source, names, batched=bool(batched), dtypes=probe.dtypes)
