"""Temporary folders that quantkit can prove it made, and the clean-up of those left by dead processes.

A run that is killed (SIGKILL, power loss) cannot remove its staging or build folders.  The next run
removes them, but only when it can prove that they are quantkit's and that their owner is gone:

* :func:`owned_tempdir` creates ``<parent>/<prefix><random>`` with ``mkdtemp`` and writes a marker file
  (:data:`MARKER`) into it: the creating process id, that process's start time (so a recycled pid is not
  mistaken for the owner), the host name and the folder's own name.
* :func:`clean_stale` removes a folder of that prefix only when its marker parses, names this host and the
  folder itself, and its process is gone (no process with that pid, or one that started at another
  time).  A folder without a valid marker, or of a live run, is never touched.  Folders that match the
  prefix but hold no marker (a user's, or of an older quantkit) are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

__all__ = ["MARKER", "clean_stale", "owned_tempdir", "process_start_time"]

log = logging.getLogger("quantkit")

MARKER = ".quantkit-owner.json"
"""Marker file in every temporary folder quantkit makes with :func:`owned_tempdir`."""


def process_start_time(pid: int) -> float | None:
    """Start time of process ``pid`` (seconds since the epoch), or None when no such process exists."""
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess, AccessDenied, ZombieProcess: treat as gone/unknown
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return -1.0  # alive, owned by someone else: never ours to judge
        return -1.0


def owned_tempdir(parent: str | os.PathLike[str], prefix: str) -> Path:
    """``mkdtemp`` in ``parent`` plus the ownership marker; the caller removes the folder when done."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    marker = {
        "pid": os.getpid(),
        "start": process_start_time(os.getpid()),
        "host": socket.gethostname(),
        "name": path.name,
    }
    (path / MARKER).write_text(json.dumps(marker), encoding="utf-8")
    return path


def _owner_gone(folder: Path) -> bool:
    """True only when ``folder``'s marker is valid and its process is provably gone."""
    try:
        if folder.is_symlink() or not folder.is_dir():
            return False
        marker = folder / MARKER
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 4096:
            return False
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    pid, start, host, name = data.get("pid"), data.get("start"), data.get("host"), data.get("name")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or name != folder.name:
        return False
    if host != socket.gethostname():
        return False  # another machine's run on a shared disk: it may still be alive
    if pid == os.getpid():
        return False
    now = process_start_time(pid)
    if now is None:
        return True
    if now < 0 or not isinstance(start, (int, float)):
        return False
    return abs(now - float(start)) > 1.0  # the pid was recycled by another process


def clean_stale(parent: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Remove ``parent/<prefix>*`` folders whose owning process is gone (module doc); returns them."""
    removed: list[Path] = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for p in entries:
        if not p.name.startswith(prefix) or not _owner_gone(p):
            continue
        try:
            shutil.rmtree(p)
        except OSError as exc:
            log.warning("could not remove the stale temporary folder %s: %s", p, exc)
            continue
        removed.append(p)
    if removed:
        log.warning("removed %d temporary folder(s) left by quantkit runs that ended abruptly: %s", len(removed),
                    ", ".join(str(p) for p in removed))
    return removed
