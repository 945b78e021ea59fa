"""The output folder of a run: checked before any work, written all-or-nothing, and nothing else touched.

The rules (``docs/output-folder.md`` says the same for users):

* **What quantkit may remove or replace** is only a file it can prove it wrote: a plain relative path listed
  in the folder's manifest (:data:`MANIFEST`) that resolves inside the folder (no ``..``, no absolute path,
  no symbolic link on the way), is a regular file, and whose size and SHA-256 match what the manifest
  recorded when quantkit wrote it; the manifest itself carries an HMAC under a key kept in quantkit's cache
  folder (``manifest.key``), so an edited, hand-written or copied manifest proves nothing.  Every other
  manifest entry is ignored with a warning: the manifest is data, never trusted.  Folders are never removed whole; a folder left empty by removing quantkit's own
  stale files is removed.
* **Foreign files** (anything else in the folder, at any depth) make :func:`check_output_dir` refuse the
  folder unless ``overwrite``; with ``overwrite`` they are left alone unless a new output has the same name
  (then it replaces that file: that is what ``--overwrite`` asks for).  A folder or a symbolic link where an
  output file or folder must go is always refused.
* **Inputs of the run** (model, its external data, data files, the recipe) are never written over: an output
  folder that holds one of them is refused, with or without ``overwrite``.
* :func:`write_outputs` writes every file of a run into a staging folder (:func:`quantkit.tempdirs.
  owned_tempdir`, next to or inside the destination), then moves them into place: a new folder appears by
  one rename; an existing one gets the new files one by one, then the new manifest.  A failure or an
  interrupt while staging leaves the destination as it was; :class:`SaveInterrupted` says exactly what was
  already replaced.  Staging folders of runs that were killed are removed by the next run (by pid).
* Files get the permissions of an ordinary new file (``0666 & ~umask``), not ``mkstemp``'s 0600.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.tempdirs import MARKER, clean_stale, owned_tempdir

__all__ = ["MANIFEST", "OutputError", "SaveInterrupted", "check_output_dir", "file_mode", "scan_output_dir",
           "write_outputs"]

log = logging.getLogger("quantkit")

MANIFEST = "quantkit-manifest.json"
"""Lists the files a quantkit run wrote into its output folder, each with its size and SHA-256."""
MANIFEST_VERSION = 2
STAGING_PREFIX = ".quantkit-stage-"
_MAX_MANIFEST_BYTES = 16 * 2**20


class OutputError(QuantkitError):
    """The output folder cannot be used (not a folder, not writable, holds other files or an input)."""


class SaveInterrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM arrived while saving; ``written`` lists the files already in place."""

    def __init__(self, directory: Path, written: list[str], total: int) -> None:
        self.directory = directory
        self.written = written
        self.total = total
        if written:
            msg = (f"interrupted while saving: {len(written)} of {total} files were already replaced in "
                   f"{directory} ({', '.join(written[:10])}{' ...' if len(written) > 10 else ''}); run again "
                   "to write a consistent set")
        else:
            msg = f"interrupted while saving; nothing was written to {directory}"
        super().__init__(msg)


def file_mode() -> int:
    """``0666 & ~umask``: what ``open()`` would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _key() -> bytes:
    """This machine's manifest key (32 random bytes in the cache folder, made on first use, mode 0600).

    A manifest carries an HMAC of its records under this key, so a manifest that was edited, copied from
    another machine or written by hand proves nothing: its files are treated as the user's."""
    from quantkit.frontends.cache import cache_dir

    path = cache_dir() / "manifest.key"
    for _ in range(3):
        try:
            data = path.read_bytes()
            if len(data) == 32:
                return data
            path.unlink()  # damaged: a new key (earlier manifests then prove nothing, which is safe)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # another run made it meanwhile: read that one
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return path.read_bytes()


def _mac(records: dict[str, Any]) -> str:
    body = json.dumps(records, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hmac.new(_key(), body, hashlib.sha256).hexdigest()


def _plain_name(entry: Any) -> str | None:
    """``entry`` as a normalised relative POSIX path, or None when it is not a plain name quantkit writes."""
    if not isinstance(entry, str) or not entry or "\x00" in entry or "\\" in entry or len(entry) > 4096:
        return None
    p = PurePosixPath(entry)
    if p.is_absolute() or any(part in ("", ".", "..") for part in entry.split("/")):
        return None
    if p.parts[0] == MANIFEST or p.parts[0].startswith(STAGING_PREFIX):
        return None
    return p.as_posix()


def _inside(path: Path, root: Path) -> bool:
    """True when ``path`` (symbolic links resolved) is ``root`` or under it (``root`` already resolved)."""
    try:
        path.resolve().relative_to(root)
        return True
    except (ValueError, OSError, RuntimeError):
        return False


@dataclass
class OutputTree:
    """What an existing output folder holds, as :func:`scan_output_dir` proved it."""

    own: dict[str, dict[str, Any]] = field(default_factory=dict)  # rel -> {"size", "sha256"}: provably quantkit's
    foreign: list[str] = field(default_factory=list)  # files / links that are not provably quantkit's
    ignored: list[str] = field(default_factory=list)  # manifest entries rejected, with the reason


def _manifest_entries(directory: Path) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """``rel -> accepted {size, sha256} records`` from the manifest, and the entries it ignored (why)."""
    path = directory / MANIFEST
    ignored: list[str] = []
    if not os.path.lexists(path):
        return {}, ignored
    try:
        if path.is_symlink() or not path.is_file():
            return {}, [f"{MANIFEST} is not a regular file"]
        if path.stat().st_size > _MAX_MANIFEST_BYTES:
            return {}, [f"{MANIFEST} is larger than {_MAX_MANIFEST_BYTES >> 20} MiB"]
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {}, [f"{MANIFEST} cannot be read ({exc})"]
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION or not isinstance(
            data.get("files"), dict):
        return {}, [f"{MANIFEST} is not a version-{MANIFEST_VERSION} manifest with checksums (from an older "
                    "quantkit, or not quantkit's): the files it lists are treated as the user's"]
    signed = {k: data.get(k) for k in ("files", "previous") if k in data}
    if not isinstance(data.get("mac"), str) or not hmac.compare_digest(data["mac"], _mac(signed)):
        return {}, [f"{MANIFEST} is not signed by quantkit on this machine (edited, copied from elsewhere, or "
                    "the cache folder's manifest.key was removed): the files it lists are treated as the user's"]
    out: dict[str, list[dict[str, Any]]] = {}
    for section in ("files", "previous"):
        sec = data.get(section) or {}
        if not isinstance(sec, dict):
            continue
        for raw, rec in sec.items():
            rel = _plain_name(raw)
            ok = (isinstance(rec, dict) and isinstance(rec.get("size"), int) and isinstance(rec.get("sha256"), str)
                  and len(rec["sha256"]) == 64)
            if rel is None or not ok:
                ignored.append(f"{raw!r} (not a plain file name inside the folder with a size and checksum)")
                continue
            out.setdefault(rel, []).append({"size": rec["size"], "sha256": rec["sha256"]})
    return out, ignored


def _walk(directory: Path) -> Iterable[tuple[str, Path]]:
    """Every file and symbolic link under ``directory`` (links not followed), as (rel POSIX path, path);
    the manifest and live/marked staging folders at the top are skipped."""
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=False):
        here = Path(dirpath)
        if here == directory:
            dirnames[:] = [d for d in dirnames
                           if not (d.startswith(STAGING_PREFIX) and (here / d / MARKER).is_file())]
        for d in list(dirnames):  # links to folders are entries of their own, never entered
            if (here / d).is_symlink():
                dirnames.remove(d)
                yield (here / d).relative_to(directory).as_posix(), here / d
        for f in filenames:
            p = here / f
            rel = p.relative_to(directory).as_posix()
            if here == directory and f == MANIFEST:
                continue
            yield rel, p


def scan_output_dir(directory: str | os.PathLike[str]) -> OutputTree:
    """Sort every file of an existing output folder into provably quantkit's and not (module doc)."""
    out = Path(directory)
    root = out.resolve()
    entries, ignored = _manifest_entries(out)
    tree = OutputTree(ignored=ignored)
    for rel, p in _walk(out):
        accepted = entries.get(rel)
        if accepted and not p.is_symlink() and p.is_file() and _inside(p, root):
            size = p.stat().st_size
            cands = [r for r in accepted if r["size"] == size]
            if cands:
                digest = _sha256(p)
                match = next((r for r in cands if r["sha256"] == digest), None)
                if match is not None:
                    tree.own[rel] = match
                    continue
            tree.ignored.append(f"{rel!r} (changed since quantkit wrote it)")
        tree.foreign.append(rel)
    return tree


def _input_inside(out: Path, inputs: Iterable[str | os.PathLike[str]]) -> str | None:
    root = out.resolve()
    for i in inputs:
        p = Path(i)
        if os.path.lexists(p) and _inside(p, root):
            return str(p)
    return None


def check_output_dir(directory: str | os.PathLike[str], *, overwrite: bool = False,
                     inputs: Iterable[str | os.PathLike[str]] = (), _warn: bool = True) -> Path:
    """Refuse an output folder that cannot be used, before any work is done (module doc)."""
    if not isinstance(overwrite, bool):
        raise OutputError(f"overwrite must be True or False, got {overwrite!r}")
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise OutputError(f"the output folder must be a path (str or os.PathLike), got {directory!r}")
    out = Path(directory)
    if out.is_symlink() and not out.exists():
        raise OutputError(f"output folder {str(out)!r} is a symbolic link to {os.readlink(out)!r}, which does not "
                          "exist; allowed: a new or empty folder, or one quantkit wrote before")
    if out.exists() and not out.is_dir():
        raise OutputError(f"output folder {str(out)!r} is a file, not a folder; allowed: a new or empty folder, or "
                          "one quantkit wrote before")
    probe = out.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"output folder {str(out)!r}: {str(probe)!r} is not a writable folder")
    held = _input_inside(out, inputs)
    if held is not None:
        raise OutputError(f"output folder {str(out)!r} holds an input of this run ({held}); quantkit never writes "
                          "over its inputs: choose another output folder")
    if out.is_dir():
        clean_stale(out, STAGING_PREFIX)
        tree = scan_output_dir(out)
        if tree.ignored and _warn:
            log.warning("%s: %d manifest entr%s ignored, those files are left alone: %s", out, len(tree.ignored),
                        "y" if len(tree.ignored) == 1 else "ies", "; ".join(tree.ignored[:5]))
        if tree.foreign and not overwrite:
            names = sorted(tree.foreign)
            raise OutputError(
                f"output folder {str(out)!r} holds files quantkit did not write ({', '.join(names[:5])}"
                f"{' ...' if len(names) > 5 else ''}); allowed: a new or empty folder, a folder of an earlier "
                "quantkit run, or overwrite (--overwrite, overwrite=True: it replaces only files of the same names as "
                "the new outputs and leaves the others)"
            )
    return out


def _move(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def _write_manifest(path: Path, files: dict[str, Any], previous: dict[str, Any] | None = None) -> None:
    signed: dict[str, Any] = {"files": files}
    if previous is not None:
        signed["previous"] = previous
    _write_json(path, {"version": MANIFEST_VERSION, "tool": "quantkit", **signed, "mac": _mac(signed)})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.chmod(tmp, file_mode())
    os.replace(tmp, path)


def _disk_error(exc: OSError, out: Path) -> OutputError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"no space left on the device while writing the outputs for {str(out)!r} "
                           f"({exc.strerror}); nothing was written there: free some space or choose another "
                           "output folder")
    return OutputError(f"cannot write the outputs for {str(out)!r}: {exc}; nothing was written there")


def _preflight(out: Path, names: list[str], tree: OutputTree) -> None:
    """Refuse before moving anything when a folder or a link stands where an output must go."""
    root = out.resolve()
    for rel in names:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            d = out.joinpath(*parts[:i])
            if os.path.lexists(d) and (d.is_symlink() or not d.is_dir()):
                raise OutputError(f"output folder {str(out)!r}: {d} is in the way of the output {rel} (a file or "
                                  "symbolic link where quantkit needs a folder); nothing was written")
        dest = out / rel
        if dest.is_symlink() and rel not in tree.own:
            raise OutputError(f"output folder {str(out)!r}: {dest} is a symbolic link where quantkit writes {rel}; "
                              "nothing was written (remove the link or choose another folder)")
        if dest.is_dir():
            raise OutputError(f"output folder {str(out)!r}: {dest} is a folder where quantkit writes the file {rel}; "
                              "nothing was written")
        if not _inside(dest.parent if dest.parent.exists() else out, root):
            raise OutputError(f"output folder {str(out)!r}: {rel} would land outside the folder; nothing was written")


def write_outputs(directory: str | os.PathLike[str], fill: Callable[[Path], object], *,
                  overwrite: bool = False, inputs: Iterable[str | os.PathLike[str]] = ()) -> dict[str, Path]:
    """Run ``fill(staging)`` to write the files of a run, then put them into ``directory`` as a set.

    Returns ``name -> final path`` of every top-level entry written (files, and sub-folders as one entry)."""
    inputs = [os.fspath(i) for i in inputs]
    out = check_output_dir(directory, overwrite=overwrite, inputs=inputs, _warn=False)
    parent = out if out.is_dir() else out.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        clean_stale(parent, STAGING_PREFIX)
        staging = owned_tempdir(parent, STAGING_PREFIX)
    except OSError as exc:
        raise _disk_error(exc, out) from None
    moved: list[str] = []
    names: list[str] = []
    try:
        try:
            fill(staging)
            records: dict[str, dict[str, Any]] = {}
            mode = file_mode()
            for p in sorted(staging.rglob("*")):
                if p.is_symlink():
                    raise OutputError(f"internal: the run left a symbolic link {p.name} among its outputs")
                if p.is_file() and p != staging / MARKER:
                    os.chmod(p, mode)
                    rel = p.relative_to(staging).as_posix()
                    records[rel] = {"size": p.stat().st_size, "sha256": _sha256(p)}
            names = sorted(records)
        except KeyboardInterrupt:
            raise SaveInterrupted(out, [], len(names)) from None
        except OSError as exc:
            raise _disk_error(exc, out) from None
        top = sorted({n.split("/", 1)[0] for n in names})
        if not os.path.lexists(out):
            _write_manifest(staging / MANIFEST, records)
            marker = (staging / MARKER).read_bytes()
            (staging / MARKER).unlink()
            try:
                os.replace(staging, out)  # the whole set appears by one rename
                return {n: out / n for n in top}
            except OSError:  # another run created the folder meanwhile: merge file by file below
                (staging / MANIFEST).unlink()
                (staging / MARKER).write_bytes(marker)
        tree = scan_output_dir(out)  # again: the folder may have changed while the run worked
        if tree.foreign and not overwrite:
            check_output_dir(out, overwrite=False, inputs=inputs)  # raises, naming the files
        held = _input_inside(out, inputs)
        if held is not None:
            raise OutputError(f"output folder {str(out)!r} holds an input of this run ({held}); nothing was written")
        _preflight(out, names, tree)
        stale = sorted(set(tree.own) - set(names))
        try:
            # the manifest first: the old files' records stay valid ("previous") while they are replaced
            previous = {r: tree.own[r] for r in tree.own}
            _write_manifest(out / MANIFEST, {**previous, **records}, previous)
            for rel in names:
                dest = out / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                _move(staging / rel, dest)
                moved.append(rel)
            for rel in stale:
                p = out / rel
                if p.is_file() and not p.is_symlink():
                    p.unlink()
                d = p.parent
                while d != out and d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
                    d = d.parent
            _write_manifest(out / MANIFEST, records)
        except KeyboardInterrupt:
            raise SaveInterrupted(out, moved, len(names)) from None
        except OSError as exc:
            raise OutputError(f"cannot move the outputs into {str(out)!r}: {exc}; {len(moved)} of {len(names)} "
                              "files were replaced, run again to write a consistent set") from None
        return {n: out / n for n in top}
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
