"""On-disk cache directory and atomic writes.

Everything quantkit caches (exported ONNX models, statistics ...) lives under
:func:`cache_dir`.  Files are written atomically: a temporary file (or folder) is
created *in the same directory* as the destination and then renamed with
:func:`os.replace`, so a reader never sees a half-written file and two processes
racing to fill the same entry both end up with a complete one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_dir", "cache_dir"]


_FALLBACK: list[Path] = []


def cache_dir() -> Path:
    """Return the quantkit cache directory, creating it if needed.

    ``$QUANTKIT_CACHE`` when set (and non-empty), else ``~/.cache/quantkit``.  When that folder cannot
    be created or written (read-only, not a folder), a warning is logged once and a private temporary
    folder, removed when the process exits, stands in: the run carries on without a persistent cache.
    """
    env = os.environ.get("QUANTKIT_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"{path} is not writable")
        return path
    except OSError as exc:
        if not _FALLBACK:
            import atexit
            import logging

            tmp = Path(tempfile.mkdtemp(prefix="quantkit-cache-"))
            atexit.register(shutil.rmtree, tmp, True)
            _FALLBACK.append(tmp)
            logging.getLogger("quantkit").warning(
                "cache folder %s is unusable (%s); carrying on with a temporary cache (set QUANTKIT_CACHE to a "
                "writable folder to keep results between runs)", path, exc)
        return _FALLBACK[0]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, then ``os.replace``)."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def atomic_write_dir(path: str | os.PathLike[str], fill: Callable[[Path], None]) -> Path:
    """Create the folder ``path`` atomically.

    ``fill(tmp)`` writes the content into a fresh temporary folder next to ``path``;
    the folder is then renamed into place.  Used for multi-file entries such as an
    ONNX model plus its external-data file, which must appear together.  If another
    process created ``path`` in the meantime, its entry is kept and ours discarded.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        fill(tmp)
        try:
            os.replace(tmp, dest)
        except OSError:
            # ``dest`` exists and is not empty: someone else won the race.
            if not dest.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
