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


class StatsCache:
    """Per-tensor statistics states (``state()`` dicts) stored in one ``.npz`` per key."""

    def __init__(self, root: Path, key: str) -> None:
        self.path = root / "stats" / f"{key}.npz"

    def load(self) -> dict[str, dict[str, Any]]:
        """tensor -> state dict ({} when there is no cache file or it is unreadable)."""
        if not self.path.is_file():
            return {}
        try:
            with np.load(self.path, allow_pickle=False) as z:
                out: dict[str, dict[str, Any]] = {}
                for k in z.files:
                    tensor, _, field = k.rpartition("//")
                    arr = z[k]
                    out.setdefault(tensor, {})[field] = arr.item() if arr.ndim == 0 else arr
                return out
        except (OSError, ValueError, KeyError) as exc:  # a corrupt cache is a miss, never a failure
            log.warning("ignoring unreadable statistics cache %s (%s)", self.path, exc)
            return {}

    def save(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        flat = {f"{t}//{f}": np.asarray(v) for t, st in states.items() for f, v in st.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".stats-", suffix=".npz")
        os.close(fd)
        try:
            np.savez(tmp, **flat)  # type: ignore[arg-type]
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
