"""The output folder of a run: checked before any work, written all-or-nothing, replaced as a set.

* :func:`check_output_dir` runs before the pipeline: ``--output`` must be a folder (or not exist) whose
  nearest existing parent is writable; a non-empty folder that quantkit did not write (no
  :data:`MANIFEST`) is refused unless ``overwrite``.
* :func:`write_outputs` writes every file of a run into a staging folder next to (or inside) the
  destination, then moves them into place: a new folder appears by one rename; an existing one gets
  the new set, and files of quantkit's previous run that the new run did not write (a stale
  ``report.html``) are removed.  A failure or an interrupt while staging leaves the destination as it
  was and removes the staging folder; :class:`SaveInterrupted` says exactly what was written.
* Files get the permissions of an ordinary new file (``0666 & ~umask``), not ``mkstemp``'s 0600.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from quantkit.errors import QuantkitError

__all__ = ["MANIFEST", "OutputError", "SaveInterrupted", "check_output_dir", "file_mode", "write_outputs"]

MANIFEST = "quantkit-manifest.json"
"""Lists the files a quantkit run wrote into its output folder (marks the folder as quantkit's)."""


class OutputError(QuantkitError):
    """The output folder cannot be used (not a folder, not writable, holds other files)."""


class SaveInterrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM arrived while saving; ``written`` lists the files already in place."""

    def __init__(self, directory: Path, written: list[str], total: int) -> None:
        self.directory = directory
        self.written = written
        self.total = total
        if written:
            msg = (f"interrupted while saving: {len(written)} of {total} files were already replaced in "
                   f"{directory} ({', '.join(written)}); run again to write a consistent set")
        else:
            msg = f"interrupted while saving; nothing was written to {directory}"
        super().__init__(msg)


def file_mode() -> int:
    """``0666 & ~umask``: what ``open()`` would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _own_files(directory: Path) -> set[str] | None:
    """Files listed in the folder's manifest, or None when quantkit did not write it."""
    try:
        data = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        return {str(f) for f in data.get("files", [])}
    except (OSError, ValueError, AttributeError):
        return None


def check_output_dir(directory: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Refuse an output folder that cannot be used, before any work is done."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise OutputError(f"--output {str(out)!r} is a file, not a folder; allowed: a new or empty folder, or one "
                          "quantkit wrote before")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"--output {str(out)!r}: {str(probe)!r} is not a writable folder")
    if out.is_dir() and not overwrite:
        others = [p.name for p in out.iterdir() if not p.name.startswith(".quantkit-")]
        own = _own_files(out)
        if others and own is None:
            raise OutputError(
                f"--output {str(out)!r} holds files quantkit did not write ({', '.join(sorted(others)[:5])}"
                f"{' ...' if len(others) > 5 else ''}); allowed: a new or empty folder, a folder of an earlier "
                "quantkit run, or --overwrite"
            )
    return out


def _move(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def write_outputs(directory: str | os.PathLike[str], fill: Callable[[Path], object], *,
                  overwrite: bool = False) -> dict[str, Path]:
    """Run ``fill(staging)`` to write the files of a run, then put them into ``directory`` as a set.

    Returns ``name -> final path`` of every file written (sub-folders are moved as one entry)."""
    out = check_output_dir(directory, overwrite=overwrite)
    parent = out if out.is_dir() else out.parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".quantkit-", dir=parent))
    moved: list[str] = []
    names: list[str] = []
    try:
        try:
            fill(staging)
            names = sorted(p.name for p in staging.iterdir())
            (staging / MANIFEST).write_text(json.dumps({"files": names}, indent=1), encoding="utf-8")
            mode = file_mode()
            for p in staging.rglob("*"):
                if p.is_file():
                    os.chmod(p, mode)
        except KeyboardInterrupt:
            raise SaveInterrupted(out, [], len(names)) from None
        if not out.exists():
            os.replace(staging, out)  # the whole set appears by one rename
            return {n: out / n for n in names}
        stale = (_own_files(out) or set()) - set(names)
        try:
            for n in [*names, MANIFEST]:
                dest = out / n
                if dest.is_dir() and not dest.is_symlink():
                    shutil.rmtree(dest)
                _move(staging / n, dest)
                moved.append(n)
            for n in stale:
                p = out / n
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists():
                    p.unlink()
        except KeyboardInterrupt:
            raise SaveInterrupted(out, [m for m in moved if m != MANIFEST], len(names)) from None
        return {n: out / n for n in names}
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
