"""Jane Austen's six novels, read offline from the Debian package ``r-cran-janeaustenr``.

The package is fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into a
temporary folder (never installed: installing pulls in all of R).  The novels live in R's
lazy-load database ``usr/lib/R/site-library/janeaustenr/data/Rdata.{rdx,rdb}``:

* ``Rdata.rdx`` is a gzip-compressed serialized R list; its ``variables`` element maps each
  object name (``emma``, ``prideprejudice`` ...) to ``[offset, length]`` in ``Rdata.rdb``;
* each ``Rdata.rdb`` record is a 4-byte big-endian uncompressed length followed by a zlib
  stream holding one serialized R object: here a character vector, one element per line
  of the book (blank lines are empty strings).

Both are decoded with the ``rdata`` package; the lines are joined with ``"\\n"`` and the six
books are cached as UTF-8 text files in ``cache_dir()/janeaustenr/<name>.txt`` (written
atomically), so later calls only read a file.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

from quantkit.errors import DataError
from quantkit.frontends.cache import atomic_write_dir, cache_dir, verified_entry

__all__ = ["AUSTEN_BOOKS", "austen_folder", "austen_text", "book_key"]

#: R object name -> title.
AUSTEN_BOOKS: dict[str, str] = {
    "emma": "Emma",
    "mansfieldpark": "Mansfield Park",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
    "prideprejudice": "Pride and Prejudice",
    "sensesensibility": "Sense and Sensibility",
}
_PACKAGE = "r-cran-janeaustenr"
_DATA = Path("usr/lib/R/site-library/janeaustenr/data")


def book_key(book: str) -> str:
    """The R object name of ``book``: ``"Pride and Prejudice"``, ``"pride-prejudice"`` and
    ``"prideprejudice"`` all give ``"prideprejudice"``.

    Raises:
        DataError: not one of the six novels (the message lists them).
    """
    key = re.sub(r"[^a-z]", "", re.sub(r"\band\b", "", str(book).lower()))
    if key not in AUSTEN_BOOKS:
        raise DataError(
            f"unknown Jane Austen book {book!r}; known: "
            + ", ".join(f"{k} ({t})" for k, t in AUSTEN_BOOKS.items())
        )
    return key


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise DataError(
            f"the Jane Austen texts need {cmd[0]!r} (Debian/Ubuntu) to fetch the package {_PACKAGE}; "
            f"it is not available: {e}"
        ) from e
    except subprocess.CalledProcessError as e:
        raise DataError(
            f"{' '.join(cmd)!r} failed (exit {e.returncode}): {(e.stderr or e.stdout or '').strip()[-800:]}"
        ) from e


def _read_books(data_dir: Path) -> dict[str, str]:
    """Decode every character vector of the lazy-load database in ``data_dir``."""
    try:
        import rdata
    except ImportError as e:
        raise DataError(
            f"reading the Jane Austen texts needs the 'rdata' package (pip install rdata): {e}"
        ) from e
    rdx, rdb = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    if not rdx.is_file() or not rdb.is_file():
        raise DataError(f"{_PACKAGE} does not contain {str(rdx)!r} and {str(rdb)!r}")
    index = rdata.conversion.convert(rdata.parser.parse_data(rdx.read_bytes(), extension=".rds"))
    blob = rdb.read_bytes()
    books: dict[str, str] = {}
    for name, (offset, length) in index["variables"].items():
        key = str(name)
        if key not in AUSTEN_BOOKS:
            continue
        record = blob[int(offset) : int(offset) + int(length)]
        (size,) = struct.unpack(">I", record[:4])
        raw = zlib.decompress(record[4:])
        if len(raw) != size:
            raise DataError(f"{str(rdb)!r}: record {key!r} decompressed to {len(raw)} bytes, expected {size}")
        lines = rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))
        books[key] = "\n".join(str(line) for line in lines)
    missing = sorted(set(AUSTEN_BOOKS) - set(books))
    if missing:
        raise DataError(f"{_PACKAGE}: the data base lacks {missing}")
    return books


def austen_folder() -> Path:
    """``cache_dir()/janeaustenr``, holding ``<name>.txt`` for the six novels (created on first use).

    Raises:
        DataError: ``apt-get``/``dpkg-deb`` are missing or fail, or the package has an
            unexpected layout.
    """
    folder = cache_dir() / "janeaustenr"
    if verified_entry(folder, "Jane Austen texts") and all((folder / f"{k}.txt").is_file() for k in AUSTEN_BOOKS):
        return folder
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise DataError(
                f"the Jane Austen texts are read from the Debian package {_PACKAGE}, which needs {tool!r}; "
                "it is not on PATH (use source 'pydoc' or a text file instead)"
            )

    def fill(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="quantkit-janeaustenr-") as work:
            w = Path(work)
            _run(["apt-get", "download", _PACKAGE], w)
            debs = sorted(w.glob("*.deb"))
            if not debs:
                raise DataError(f"'apt-get download {_PACKAGE}' produced no .deb file")
            _run(["dpkg-deb", "-x", str(debs[0]), str(w / "root")], w)
            books = _read_books(w / "root" / _DATA)
        for key, text in books.items():
            (tmp / f"{key}.txt").write_text(text, encoding="utf-8")

    if folder.exists():  # incomplete (interrupted by hand): start again
        shutil.rmtree(folder)
    from quantkit.progress import stage

    with stage(f"fetch Jane Austen's novels once (apt-get download {_PACKAGE} + dpkg-deb -x, cached)"):
        return atomic_write_dir(folder, fill)


def austen_text(book: str = "Emma") -> str:
    """The full text of one of Jane Austen's novels (lines joined with ``"\\n"``).

    Args:
        book: a title or R name, case and punctuation free: ``"Emma"``, ``"prideprejudice"``,
            ``"Sense and Sensibility"`` ... (see :data:`AUSTEN_BOOKS`).

    Raises:
        DataError: unknown book, or the package cannot be fetched or read.
    """
    key = book_key(book)
    path = austen_folder() / f"{key}.txt"
    if not path.is_file():
        raise DataError(
            f"the Jane Austen cache {str(path.parent)!r} lacks {path.name}; delete the folder to refetch"
        )
    return path.read_text(encoding="utf-8")
