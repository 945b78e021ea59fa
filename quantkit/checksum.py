"""Checksums of everything quantkit caches: the one mechanism every cache uses to tell a good entry from a
corrupt one.

Rule: a cache entry carries the sha256 of its content, recorded when quantkit wrote it; on read the content
is hashed again and any difference (a truncated, zeroed, edited or bit-flipped file; a missing or extra
file) makes the entry a cache miss.  Nothing is trusted because it parses.

* arrays (the statistics cache, the layer-wise block files): :func:`array_digest` over names, dtypes,
  shapes and bytes, stored inside the ``.npz`` next to the arrays;
* small JSON documents (the search caches): :func:`dumps_checked` / :func:`loads_checked` wrap the payload
  with its digest;
* files and folders (converted checkpoints, built decoders, exported ONNX models): :func:`file_digest`
  per file, recorded for a whole folder in the sidecar :data:`SIDECAR` by :func:`write_checksums` (written
  atomically, after the payload) and checked by :func:`check_checksums`.  Hashing runs at ~1 GB/s, so a
  500 MB entry costs ~0.5 s; a folder verified once is not hashed again by the same process unless one of
  its files changed (size, mtime, inode).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SIDECAR", "array_digest", "check_checksums", "dumps_checked", "file_digest", "loads_checked",
           "note_renamed", "write_checksums"]  # fmt: skip

SIDECAR = ".quantkit-checksums.json"
"""File, inside a cached folder, listing every other file of the folder with its size and sha256."""

_IGNORED = frozenset({SIDECAR, ".quantkit-owner.json"})  # the sidecar itself; quantkit.tempdirs.MARKER
_CHUNK = 1 << 20


def array_digest(flat: Mapping[str, np.ndarray]) -> str:
    """sha256 over every array's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(flat):
        a = np.ascontiguousarray(flat[k])
        h.update(k.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in 1 MB chunks (bounded memory whatever the size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def dumps_checked(payload: Any) -> str:
    """JSON text of ``payload`` together with the sha256 of its canonical form (see :func:`loads_checked`)."""
    body = json.dumps(payload, sort_keys=True)
    return json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "payload": payload}, sort_keys=True)


def loads_checked(text: str) -> Any:
    """The payload written by :func:`dumps_checked`.

    Raises:
        ValueError: not JSON, no checksum (an older format), or the payload does not match its checksum.
    """
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("sha256"), str) or "payload" not in doc:
        raise ValueError("no checksum (written by an older quantkit, or not quantkit's)")
    body = json.dumps(doc["payload"], sort_keys=True)
    if hashlib.sha256(body.encode()).hexdigest() != doc["sha256"]:
        raise ValueError("content does not match its checksum")
    return doc["payload"]


def _files(folder: Path) -> dict[str, Path]:
    """Relative POSIX path -> path of every file under ``folder`` but the sidecar and ownership markers."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames.sort()
        for name in filenames:
            if name in _IGNORED:
                continue
            p = Path(dirpath) / name
            out[p.relative_to(folder).as_posix()] = p
    return out


def _signature(files: Mapping[str, Path]) -> tuple[tuple[str, int, int, int], ...]:
    sig = []
    for rel in sorted(files):
        st = files[rel].lstat()
        sig.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sig)


_VERIFIED: dict[str, tuple[tuple[str, int, int, int], ...]] = {}
_LOCK = threading.Lock()


def write_checksums(folder: str | os.PathLike[str]) -> Path:
    """Record every file of ``folder`` (size + sha256) in ``folder/SIDECAR``, written atomically.

    Call it once the payload is complete: the sidecar is what makes the folder a valid cache entry."""
    root = Path(folder)
    files = _files(root)
    doc = {"format": 1, "files": {rel: {"size": p.stat().st_size, "sha256": file_digest(p)}
                                  for rel, p in sorted(files.items())}}  # fmt: skip
    fd, tmp = tempfile.mkstemp(prefix=f".{SIDECAR}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dumps_checked(doc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / SIDECAR)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with _LOCK:
        _VERIFIED[str(root.resolve())] = _signature(files)
    return root / SIDECAR


def note_renamed(old: str | os.PathLike[str], new: str | os.PathLike[str]) -> None:
    """A folder verified (or written) at ``old`` was renamed to ``new``: it need not be hashed again."""
    with _LOCK:
        sig = _VERIFIED.pop(str(Path(old).resolve()), None)
        if sig is not None:
            _VERIFIED[str(Path(new).resolve())] = sig


def check_checksums(folder: str | os.PathLike[str]) -> str | None:
    """None when ``folder`` holds exactly the files its sidecar lists, each with the recorded size and sha256;
    else why not (one line).  A folder already verified by this process and unchanged since is not re-hashed."""
    root = Path(folder)
    side = root / SIDECAR
    try:
        if side.is_symlink() or not side.is_file():
            return "it has no checksums (written by an older quantkit, or interrupted)"
        if side.stat().st_size > 16 << 20:
            return "its checksum file is implausibly large"
        doc = loads_checked(side.read_text(encoding="utf-8"))
        listed = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(listed, dict):
            return "its checksum file lists no files"
        files = _files(root)
        sig = _signature(files)
        with _LOCK:
            if _VERIFIED.get(str(root.resolve())) == sig:
                return None
        extra, missing = sorted(set(files) - set(listed)), sorted(set(listed) - set(files))
        if missing:
            return f"{missing[0]} is missing"
        if extra:
            return f"{extra[0]} was not written by quantkit"
        for rel in sorted(listed):
            rec, p = listed[rel], files[rel]
            if not isinstance(rec, dict):
                return f"its checksum file is malformed at {rel}"
            if p.is_symlink() or p.stat().st_size != rec.get("size"):
                return f"{rel} has another size than when it was written"
            if file_digest(p) != rec.get("sha256"):
                return f"{rel} does not match its checksum"
    except (OSError, ValueError) as exc:
        return f"it cannot be read ({type(exc).__name__}: {exc})"
    with _LOCK:
        _VERIFIED[str(root.resolve())] = sig
    return None
