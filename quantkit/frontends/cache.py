"""On-disk cache directory, atomic writes, and verified cache folders.

Everything quantkit caches (exported ONNX models, converted checkpoints, built decoders, statistics ...)
lives under :func:`cache_dir`.  Files are written atomically: a temporary file (or folder) is
created *in the same directory* as the destination and then renamed with
:func:`os.replace`, so a reader never sees a half-written file and two processes
racing to fill the same entry both end up with a complete one.

Rules for cached folders (:func:`atomic_write_dir` writes them, :func:`verified_entry` reads them):

* every file of the entry is recorded with its sha256 in a sidecar (:data:`quantkit.checksum.SIDECAR`)
  written after the payload, before the folder is renamed into place;
* before reuse the files are hashed again; an entry that does not match (a zeroed block, a truncated or
  edited file, a missing or extra file, no sidecar) is a cache miss: it is removed with a one-line warning
  naming it, and rebuilt;
* the temporary folder an entry is built in carries an ownership marker (:mod:`quantkit.tempdirs`); one
  left by a killed process is removed by the next look-up or write in the same parent, never one of a live
  run, never a folder without a valid marker.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from quantkit.checksum import check_checksums, note_renamed, write_checksums
from quantkit.errors import QuantkitError
from quantkit.tempdirs import MARKER, clean_stale, owned_tempdir

__all__ = ["atomic_write_bytes", "atomic_write_dir", "cache_dir", "discard_entry", "verified_entry"]

log = logging.getLogger("quantkit")


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
    """Create the folder ``path`` atomically, with the checksums of its files.

    ``fill(tmp)`` writes the content into a fresh temporary folder next to ``path`` (one with an ownership
    marker, :func:`quantkit.tempdirs.owned_tempdir`); the checksums are recorded
    (:func:`quantkit.checksum.write_checksums`) and the folder is renamed into place.  Used for multi-file
    entries such as an ONNX model plus its external-data file, which must appear together.  If another
    process created ``path`` in the meantime, its entry is kept and ours discarded.  Temporary folders of
    processes that died while filling an entry of the same parent are removed first.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dest.parent, ".")
    tmp = owned_tempdir(dest.parent, f".{dest.name}.tmp-")
    try:
        fill(tmp)
        write_checksums(tmp)  # the ownership marker is not part of the entry (not listed)
        try:
            os.replace(tmp, dest)
        except OSError:
            # ``dest`` exists and is not empty: someone else won the race.
            if not dest.is_dir():
                raise
        else:
            note_renamed(tmp, dest)
            (dest / MARKER).unlink(missing_ok=True)  # names the temporary folder: inert in the entry
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def discard_entry(path: str | os.PathLike[str]) -> None:
    """Remove the cache folder (or file) ``path``: renamed aside into a marked temporary folder first, so that
    readers never see half of it and a removal cut short is finished by the next run."""
    dest = Path(path)
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_symlink() or not dest.is_dir():
        dest.unlink(missing_ok=True)
        return
    trash = owned_tempdir(dest.parent, f".{dest.name}.discard-")
    try:
        os.replace(dest, trash / "entry")
    except OSError:
        pass  # gone already (another process discarded it), or cannot be moved: removed in place below
    finally:
        shutil.rmtree(trash, ignore_errors=True)
    if dest.is_dir():
        shutil.rmtree(dest, ignore_errors=True)


def verified_entry(path: str | os.PathLike[str], what: str) -> bool:
    """Whether the cache folder ``path`` may be reused: it exists and every file matches the checksums recorded
    when it was written.  A folder that does not (corrupt, edited, incomplete, no checksums) is a cache miss:
    it is removed with a one-line warning naming ``what`` and the folder, and False is returned so that the
    caller builds it again.  Temporary folders left next to it by dead processes are removed first."""
    dest = Path(path)
    clean_stale(dest.parent, ".")
    if not dest.exists() and not dest.is_symlink():
        return False
    why = "it is not a folder" if dest.is_symlink() or not dest.is_dir() else check_checksums(dest)
    if why is None:
        return True
    log.warning("discarding the cached %s %s: %s; building it again", what, dest, why)
    try:
        discard_entry(dest)
    except OSError as exc:
        raise QuantkitError(f"the cached {what} {str(dest)!r} is corrupt ({why}) and cannot be removed: "
                            f"{exc}; remove it by hand") from exc
    return False
