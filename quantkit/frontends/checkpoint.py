"""Checks of a Hugging Face folder's ``config.json`` values and ``*.safetensors`` files, before any allocation.

Everything here reads a few bytes per file (the safetensors headers) and never a tensor:

* :func:`check_config_values` - the integer sizes of ``config.json`` (heads, layers, vocabulary, positions,
  ...) are integers in a sane range (:data:`CONFIG_LIMITS`), so that nothing is allocated from a size no
  checkpoint could back (a ``max_position_embeddings`` of 300 million asked for > 5 GiB of rotary caches);
* :func:`safetensors_header` - the header length fits the file (and safetensors' own 100 MB limit), the
  header is a JSON mapping of tensors whose ``dtype`` / ``shape`` / ``data_offsets`` agree and lie inside
  the file;
* :func:`weight_files` - ``model.safetensors.index.json``'s ``weight_map`` is a mapping of tensor names to
  plain relative file names inside the folder (no absolute path, no ``..``), each an existing file;
* :func:`checkpoint_tensors` - all of the above for a folder, plus: every ``*.weight`` / ``*.bias`` tensor has
  a floating-point dtype (:data:`FLOAT_DTYPES`; an int8 or bool weight is not something quantkit can read).

Every failure is a :class:`~quantkit.errors.ModelError` naming the file, the key or tensor, the value and
what is allowed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from quantkit.errors import ModelError

__all__ = [
    "CONFIG_LIMITS",
    "FLOAT_DTYPES",
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "TensorInfo",
    "check_config_values",
    "checkpoint_tensors",
    "read_tensor",
    "safetensors_header",
    "weight_files",
]

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header accepted (the safetensors library's own limit)."""
_MAX_INDEX_BYTES = 64 * 2**20

#: ``config.json`` integer sizes and their upper bounds (all must be >= 1).  The bounds are far above every
#: published model (context: 10M positions; vocabulary: 1M tokens) and far below what would exhaust memory.
CONFIG_LIMITS: dict[str, int] = {
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "head_dim": 1 << 14,
    "num_hidden_layers": 1 << 14,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 24,
}

#: safetensors dtypes -> bytes per element (the dtypes of the safetensors format).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
"""Weight dtypes quantkit reads (converted to float32 as they are read)."""


def check_config_values(cfg: Any, where: str) -> None:
    """Refuse nonsensical sizes in a parsed ``config.json`` (``where``: its path, for the messages).

    Keys of :data:`CONFIG_LIMITS` that are present and not null must be integers (``4.0`` is taken, ``4.5``,
    ``true`` and ``"4"`` are not) in ``1 .. limit``, or lists of such integers (one per stage of a vision
    model); ``num_key_value_heads`` must divide ``num_attention_heads``.

    Raises:
        ModelError: naming the file, the key, the value and the allowed range.
    """
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: config.json must hold a JSON object, got {type(cfg).__name__}")
    for key, limit in CONFIG_LIMITS.items():
        value = cfg.get(key)
        if value is None:
            continue
        # vision models with stages (SegFormer, PVT, CvT) give one value per stage
        values = value if isinstance(value, list) and value else [value]
        ns = [_int_value(v) for v in values]
        if any(n is None or not 1 <= n <= limit for n in ns):
            raise ModelError(f"{where}: {key} {value!r} is out of range; allowed: an integer in 1 .. {limit} "
                             "(or a list of them, one per stage)")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if isinstance(heads, (int, float)) and isinstance(kv, (int, float)) and int(heads) % int(kv):
        raise ModelError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; "
                         "allowed: a divisor of num_attention_heads")  # fmt: skip


def _int_value(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = -1
    """Byte offset of the tensor's data in :attr:`file` (``-1``: not known)."""


def safetensors_header(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """The tensors of the safetensors file ``path`` (name -> :class:`TensorInfo`), from its header only.

    Raises:
        ModelError: the file cannot be read, its header length is larger than the file (or than
            :data:`MAX_HEADER_BYTES`), the header is not a JSON object of tensors, or a tensor's offsets lie
            outside the file or disagree with its dtype and shape.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelError(f"{str(p)!r} is not a safetensors file: {size} bytes, shorter than the 8-byte "
                                 "header length")  # fmt: skip
            n = int.from_bytes(head, "little")
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise ModelError(f"{str(p)!r}: safetensors header length {n} is larger than "
                                 f"{'the file' if n > size - 8 else 'the limit'}; allowed: at most "
                                 f"{min(MAX_HEADER_BYTES, size - 8)} bytes (the file has {size})")  # fmt: skip
            raw = fh.read(n)
    except OSError as e:
        raise ModelError(f"cannot read {str(p)!r}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"{str(p)!r}: the safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ModelError(f"{str(p)!r}: the safetensors header is a JSON {type(header).__name__}; allowed: an object "
                         "of tensors")  # fmt: skip
    data_bytes = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor_info(p, name, entry, data_bytes, 8 + n)
    return out


def _tensor_info(p: Path, name: str, entry: Any, data_bytes: int, data_start: int) -> TensorInfo:
    where = f"{str(p)!r}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ModelError(f"{where}: header entry is {entry!r}; allowed: an object with dtype, shape, data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise ModelError(f"{where}: dtype {dtype!r} is not a string; allowed: {', '.join(_ITEMSIZE)}")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ModelError(f"{where}: shape {shape!r}; allowed: a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)):  # fmt: skip
        raise ModelError(f"{where}: data_offsets {offsets!r}; allowed: [begin, end], two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise ModelError(f"{where}: data_offsets [{begin}, {end}] lie outside the file's {data_bytes} data bytes "
                         "(a truncated or corrupt file)")  # fmt: skip
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is not None and end - begin != math.prod(shape) * itemsize:
        raise ModelError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but {dtype} {shape} "
                         f"needs {math.prod(shape) * itemsize}")  # fmt: skip
    return TensorInfo(p, dtype, tuple(shape), data_start + begin)


def read_tensor(info: TensorInfo) -> Any:
    """The tensor's values as a numpy array in its stored float dtype (``BF16`` as ``ml_dtypes.bfloat16``: the
    bits as stored, converted to float32 exactly by ``np.asarray(a, np.float32)``), read from the file without
    torch or the safetensors library (a plain read of the bytes the header points to, little-endian as the format
    stores them).

    Raises:
        ModelError: the dtype is not one of :data:`FLOAT_DTYPES`, the offset is unknown, or the file is shorter
            than the header says.
    """
    import numpy as np

    if info.dtype == "BF16":
        import ml_dtypes

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        # U8: packed codes stored beside float scales (gpt-oss's MXFP4 experts: *_blocks / *_scales)
        dt = {"F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
              "U8": np.dtype(np.uint8)}.get(info.dtype)  # fmt: skip
    if dt is None or info.offset < 0:
        raise ModelError(f"{str(info.file)!r}: cannot read a {info.dtype} tensor; allowed dtypes: "
                         f"{', '.join(FLOAT_DTYPES)} (and U8 for packed codes)")  # fmt: skip
    count = math.prod(info.shape)
    try:
        with open(info.file, "rb") as fh:
            fh.seek(info.offset)
            arr = np.fromfile(fh, dtype=dt, count=count)
    except OSError as e:
        raise ModelError(f"cannot read {str(info.file)!r}: {e}") from e
    if arr.size != count:
        raise ModelError(f"{str(info.file)!r}: a {info.dtype} tensor of shape {list(info.shape)} needs {count} values "
                         f"at byte {info.offset}, the file holds {arr.size} (a truncated file)")  # fmt: skip
    return arr.reshape(info.shape)


def _plain_relative(entry: str) -> bool:
    if not entry or "\x00" in entry or "\\" in entry or os.path.isabs(entry) or entry.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in PurePosixPath(entry).parts) and ":" not in entry[:2]


def weight_files(folder: str | os.PathLike[str]) -> dict[str, Path] | None:
    """``tensor name -> shard file`` from the folder's ``model.safetensors.index.json``, or None without one.

    Raises:
        ModelError: the index is not JSON, ``weight_map`` is missing or not a mapping of names to file names,
            an entry is not a plain relative path inside the folder (``../x``, ``/etc/passwd``), or a listed
            file does not exist.
    """
    folder = Path(folder)
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    try:
        if index.stat().st_size > _MAX_INDEX_BYTES:
            raise ModelError(f"{str(index)!r} is larger than {_MAX_INDEX_BYTES} bytes; not a weight index")
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"cannot read {str(index)!r}: {e}") from e
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict):
        if not isinstance(data, dict):
            got = f"not there (the file holds a JSON {type(data).__name__}, not an object)"
        else:
            got = "missing" if wmap is None else f"a JSON {type(wmap).__name__} ({str(wmap)[:60]})"
        raise ModelError(f"{str(index)!r}: weight_map is {got}; allowed: a mapping of tensor names to shard file "
                         "names in the folder")  # fmt: skip
    out: dict[str, Path] = {}
    for name, entry in wmap.items():
        if not isinstance(entry, str) or not _plain_relative(entry):
            raise ModelError(f"{str(index)!r}: weight_map entry {name!r} -> {entry!r} is not a file inside the "
                             "folder; allowed: a relative file name without '..' (e.g. model-00001-of-00002."
                             "safetensors)")  # fmt: skip
        path = folder / entry
        if not path.is_file():
            raise ModelError(f"{str(index)!r}: weight_map entry {name!r} -> {entry!r}: no such file in "
                             f"{str(folder)!r}")  # fmt: skip
        out[name] = path
    if not out:
        raise ModelError(f"{str(index)!r}: weight_map is empty; allowed: a mapping of tensor names to shard files")
    return out


def checkpoint_tensors(folder: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Every tensor of the folder's safetensors checkpoint (sharded through the index, or ``*.safetensors``),
    from the headers; an empty dict when the folder has no safetensors file (e.g. ``pytorch_model.bin``).

    Raises:
        ModelError: see :func:`weight_files` and :func:`safetensors_header`; also a tensor the index names
            that its shard lacks, and a ``*.weight`` / ``*.bias`` tensor of a dtype other than
            :data:`FLOAT_DTYPES`.
    """
    folder = Path(folder)
    where = weight_files(folder)
    files = sorted(set(where.values())) if where is not None else sorted(folder.glob("*.safetensors"))
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        tensors.update(safetensors_header(f))
    if where is not None:
        missing = [n for n, f in where.items() if n not in tensors or tensors[n].file != f]
        if missing:
            n = missing[0]
            raise ModelError(f"{str(folder / INDEX_FILE)!r}: weight_map says tensor {n!r} is in "
                             f"{where[n].name!r}, which does not hold it ({len(missing)} such entries)")  # fmt: skip
    for name, info in tensors.items():
        if name.endswith((".weight", ".bias")) and info.dtype not in FLOAT_DTYPES:
            raise ModelError(f"{str(info.file)!r}: tensor {name!r} has dtype {info.dtype}; quantkit reads float "
                             f"weights only; allowed: {', '.join(FLOAT_DTYPES)}")  # fmt: skip
    return tensors
