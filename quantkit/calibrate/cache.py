"""On-disk cache of calibration statistics.

One pass over the calibration data collects, for every planned tensor, a
:class:`~quantkit.calibrate.stats.TensorStatistics` (exact min/max/mean and a streaming
histogram) - enough for every built-in calibrator to choose a range.  The statistics are
stored under ``cache_dir()/stats/<key>.npz`` where the key hashes

* the prepared float model's content (its serialized bytes),
* the calibration data's fingerprint (``Dataset.fingerprint()``),
* the collector settings (histogram bins, the statistics format version),

so re-running a recipe with another calibrator, override or format reuses the pass; a
new tensor (say an override now quantizes another layer) is collected alone and added.
Files are written atomically (temporary file + ``os.replace``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.checksum import array_digest

log = logging.getLogger("quantkit")

FORMAT_VERSION = 1


def model_hash(model_bytes: bytes) -> str:
    """sha256 of the serialized model."""
    return hashlib.sha256(model_bytes).hexdigest()


def cache_key(model_digest: str, data_fingerprint: str, settings: Mapping[str, Any]) -> str:
    blob = json.dumps(
        {"model": model_digest, "data": data_fingerprint, "settings": dict(settings), "format": FORMAT_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


_DIGEST = "__sha256__"


_digest = array_digest  # the checksum every quantkit cache uses (quantkit.checksum)


class StatsCache:
    """Per-tensor statistics states (``state()`` dicts) stored in one ``.npz`` per key.

    The file carries a sha256 of its contents: a truncated, emptied, edited or bit-flipped file is a
    cache miss with a warning (and is recomputed), never an error.  A cache folder that cannot be
    written (read-only, disk full) is a warning too: the run carries on without caching."""

    def __init__(self, root: Path, key: str) -> None:
        self.path = root / "stats" / f"{key}.npz"

    def load(self) -> dict[str, dict[str, Any]]:
        """tensor -> state dict ({} when there is no cache file or it is unreadable or corrupt)."""
        if not self.path.is_file():
            return {}
        try:
            with np.load(self.path, allow_pickle=False) as z:
                flat = {k: z[k] for k in z.files}
            stored = flat.pop(_DIGEST, None)
            if stored is None:
                log.info("statistics cache %s has no checksum (an older format); collecting again", self.path)
                return {}
            if str(stored) != _digest(flat):
                raise ValueError("content does not match its checksum")
        except Exception as exc:  # noqa: BLE001 - zipfile/zlib/numpy raise many types; a bad cache is a miss
            log.warning("ignoring corrupt statistics cache %s (%s: %s); collecting again", self.path,
                        type(exc).__name__, exc)
            return {}
        out: dict[str, dict[str, Any]] = {}
        for k, arr in flat.items():
            tensor, _, field = k.rpartition("//")
            out.setdefault(tensor, {})[field] = arr.item() if arr.ndim == 0 else arr
        return out

    def save(self, states: Mapping[str, Mapping[str, Any]]) -> bool:
        """Write atomically; False (and a warning) when the cache folder cannot be written."""
        flat = {f"{t}//{f}": np.asarray(v) for t, st in states.items() for f, v in st.items()}
        flat[_DIGEST] = np.asarray(_digest(flat))
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".stats-", suffix=".npz")
            os.close(fd)
            np.savez(tmp, **flat)  # type: ignore[arg-type]
            os.replace(tmp, self.path)
            return True
        except OSError as exc:
            log.warning("cannot write the statistics cache %s (%s); carrying on without it", self.path, exc)
            return False
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
