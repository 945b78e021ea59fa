"""Gather calibration statistics once, reusing the on-disk cache.

A *request* names a statistic of one tensor (``key -> (tensor, new, restore)``): ``new()``
makes an empty streaming collector (anything with ``update``/``merge``/``state``) and
``restore(state)`` rebuilds one from a cached state.  Requests already in the cache are
restored; the rest are collected in one streaming pass (several statistics of the same
tensor share the pass through a :class:`_Fanout`), then written back to the cache.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import onnx

from quantkit.calibrate.cache import StatsCache
from quantkit.calibrate.collect import collect_statistics
from quantkit.progress import tally, tally_active

log = logging.getLogger("quantkit")


@dataclass(frozen=True)
class Request:
    tensor: str
    new: Callable[[], Any]
    restore: Callable[[Mapping[str, Any]], Any]


class _Fanout:
    """Feeds one tensor's batches to several collectors."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts = parts

    def update(self, x: Any) -> None:
        for p in self.parts.values():
            p.update(x)

    def merge(self, other: _Fanout) -> None:
        for k, p in self.parts.items():
            p.merge(other.parts[k])


@dataclass
class GatherResult:
    collectors: dict[str, Any]
    reused: int
    collected: int
    cache_path: str | None


def gather(
    model: onnx.ModelProto | str,
    dataset: Any,
    requests: Mapping[str, Request],
    *,
    cache: StatsCache | None,
    batch_size: int,
    max_batch_output_bytes: int,
    progress: bool,
    what: str = "calibration statistics",
    uncached: str = "cache disabled",
    transient: Mapping[str, Request] | None = None,
    transient_what: str = "statistics that are never cached",
) -> GatherResult:
    """Restore the cached requests, collect the rest in one pass (module doc).

    ``transient``: requests that are never cached (their keys apart from ``requests``'), collected in the same
    pass - which then runs even when every cached request is restored; ``transient_what`` names them on the
    console.

    ``what`` names the statistics on the console; ``uncached`` says why they are not cached when ``cache`` is
    None (``"--no-cache"``, ``"calibration.cache: false"``, or why this statistic is never cached).  Inside
    :func:`quantkit.progress.grouped` (a search gathers once per probe) the line is counted, not logged."""
    grouped = tally_active()
    cached = cache.load() if cache is not None else {}
    out: dict[str, Any] = {}
    missing: dict[str, dict[str, Any]] = {}
    for key, req in requests.items():
        if key in cached:
            try:
                out[key] = req.restore(cached[key])
                continue
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("cached statistics %r unusable (%s); collecting again", key, exc)
        missing.setdefault(req.tensor, {})[key] = req.new()
    n_missing = sum(len(v) for v in missing.values())
    for key, req in (transient or {}).items():
        if key in requests:
            raise ValueError(f"gather: {key!r} is both a cached and a transient request")
        missing.setdefault(req.tensor, {})[key] = req.new()
    if missing:
        factories: dict[str, Any] = {t: functools.partial(_Fanout, parts) for t, parts in missing.items()}
        got = collect_statistics(model, dataset, factories, batch_size=batch_size,
                                 max_batch_output_bytes=max_batch_output_bytes, progress=progress and not grouped)
        for fan in got.values():
            out.update(fan.parts)  # type: ignore[attr-defined]
        if cache is not None and n_missing:
            states = dict(cached)
            for parts in missing.values():
                for key in parts:
                    if transient is None or key not in transient:
                        states[key] = out[key].state()
            cache.save(states)
    reused = len(requests) - n_missing
    where = str(cache.path) if cache is not None else None
    more = f"; {len(transient)} {transient_what} in the same pass" if transient else ""
    if tally(what, f"not cached: {uncached}" if cache is None else f"cache {where}", collected=n_missing,
             reused=reused):
        pass  # inside a search phase: one line for all its gathers, when the phase ends
    elif cache is None:
        log.info("%s: collected %d in one pass (not cached: %s)%s", what, n_missing, uncached, more)
    elif n_missing == 0:
        log.info("%s: reused all %d from cache %s%s", what, reused, where,
                 f"; one pass for {len(transient)} {transient_what}" if transient else " - no pass over the data")
    else:
        log.info("%s: reused %d from cache, collected %d in one pass (%s)%s", what, reused, n_missing, where, more)
    return GatherResult(out, reused, n_missing, where)
