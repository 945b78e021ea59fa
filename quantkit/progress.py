"""Console stages: every long step says when it starts, shows a heartbeat, and says how long it took.

``with stage("export the model"):`` logs ``quantkit: export the model ...`` at once, then
``quantkit: export the model: still working (15 s)`` every ``heartbeat_s`` seconds while the step runs
(so no stretch of a run is silent, even where no progress bar can be shown: an ONNX export, an
``apt-get download``), and ``quantkit: export the model: done in 41.2 s`` at the end.  Steps shorter
than ``quiet_below_s`` log only their start.

A step that repeats (a search lowers and calibrates once per probe and per point) is counted instead:
inside ``with grouped("sensitivity"):`` every :func:`stage` and every :func:`tally` logs nothing of its
own, and when the group ends one line per step says how often it ran, how long it took in all and what it
collected: ``quantkit: sensitivity: lower to INT8 QDQ: 48 times, 3.1 s in all``.
"""

from __future__ import annotations

import io
import logging
import math
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from tqdm.std import tqdm as std_tqdm

__all__ = ["grouped", "stage", "tally", "tally_active"]

log = logging.getLogger("quantkit")


@dataclass
class _Step:
    count: int = 0
    seconds: float = 0.0
    timed: bool = False
    totals: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Group:
    steps: dict[str, _Step] = field(default_factory=dict)  # in the order they first ran
    running: list[str] = field(default_factory=list)  # the stages running now, innermost last


_GROUP: ContextVar[_Group | None] = ContextVar("quantkit_progress_group", default=None)


@contextmanager
def grouped(name: str) -> Iterator[None]:
    """Count the repeated steps inside (module doc); on exit, one line per step.  Nested groups add to the
    outermost one."""
    if _GROUP.get() is not None:
        yield
        return
    group = _Group()
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)
        for step, s in group.steps.items():
            parts = [f"{s.count} time{'s' if s.count != 1 else ''}"]
            if s.timed:
                parts.append(f"{s.seconds:.1f} s in all")
            parts += [f"{k} {v}" for k, v in s.totals.items()]
            log.info("%s: %s: %s%s", name, step, ", ".join(parts), f" ({'; '.join(s.notes)})" if s.notes else "")


def tally_active() -> bool:
    """True inside :func:`grouped` (inner progress bars are then left off too)."""
    return _GROUP.get() is not None


def tally(step: str, note: str = "", **counts: int) -> bool:
    """Inside :func:`grouped`: add ``counts`` (and ``note``, once) to ``step`` - or to the :func:`stage` running
    now, whose line then says what it collected - and return True (the caller then logs nothing); outside:
    return False."""
    group = _GROUP.get()
    if group is None:
        return False
    if group.running:
        s = group.steps[group.running[-1]]
    else:
        s = group.steps.setdefault(step, _Step())
        s.count += 1
    for k, v in counts.items():
        s.totals[k] = s.totals.get(k, 0) + int(v)
    if note and note not in s.notes:
        s.notes.append(note)
    return True


@contextmanager
def stage(name: str, *, enabled: bool = True, heartbeat_s: float = 15.0, quiet_below_s: float = 2.0) -> Iterator[None]:
    if not enabled:
        yield
        return
    group = _GROUP.get()
    if group is not None:  # counted: one line when the group ends
        s = group.steps.setdefault(name, _Step())
        s.count += 1
        s.timed = True
        group.running.append(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            s.seconds += time.perf_counter() - t0
            group.running.pop()
        return
    log.info("%s ...", name)
    t0 = time.perf_counter()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat_s):
            log.info("%s: still working (%.0f s)", name, time.perf_counter() - t0)

    th = threading.Thread(target=beat, name=f"quantkit-heartbeat-{name}", daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join(timeout=1.0)
        dt = time.perf_counter() - t0
        if dt >= quiet_below_s:
            log.info("%s: done in %.1f s", name, dt)


# -- progress bars: tqdm on a terminal, log lines elsewhere ----------------------------------------------------

LINE_INTERVAL_S = 20.0
"""Without a terminal, a progress line at least this often (seconds), from a heartbeat when no step ends."""


def _line_mode() -> bool:
    """True when carriage-return bars would not be readable: stderr is not a terminal (CI, nohup, tee, a
    file) and this is no notebook.  ``QUANTKIT_PROGRESS=lines`` or ``bars`` decides instead."""
    import os
    import sys

    forced = os.environ.get("QUANTKIT_PROGRESS", "").strip().lower()
    if forced in ("lines", "bars"):
        return forced == "lines"
    if "ipykernel" in sys.modules:
        return False
    stream = sys.stderr
    return not (stream is not None and hasattr(stream, "isatty") and stream.isatty())


def tqdm(*args: Any, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm`` on a terminal; otherwise a bar that logs a full line (stage, done/total, rate,
    ETA) through the ``quantkit`` logger when it starts, at least every :data:`LINE_INTERVAL_S` seconds
    (a heartbeat repeats the line while a step runs) and when it ends, instead of carriage-return updates."""
    if kwargs.get("disable") or not _line_mode():
        from tqdm.auto import tqdm as auto_tqdm

        return auto_tqdm(*args, **kwargs)
    return _LineBar(*args, **kwargs)


class _Discard(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)


class _LineBar(std_tqdm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._interval = LINE_INTERVAL_S
        self._last_line = -math.inf
        self._stop = threading.Event()
        kwargs.update(file=_Discard(), mininterval=min(self._interval, 1.0), dynamic_ncols=False)
        super().__init__(*args, **kwargs)
        if not self.disable:
            threading.Thread(target=_heartbeat, args=(weakref.ref(self), self._stop, self._interval),
                             name=f"quantkit-progress-{self.desc}", daemon=True).start()

    def close(self) -> None:
        super().close()
        self._stop.set()

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        closing = bool(self.disable)  # close() sets it before its last display
        if msg == "" or (closing and self.leave is False):
            return True
        now = time.perf_counter()
        if closing or now - self._last_line >= self._interval:
            self._last_line = now
            log.info("%s", self.line(closing))
        return True

    def line(self, closing: bool = False) -> str:
        d = self.format_dict
        n, total, elapsed, unit = d["n"], d["total"], d["elapsed"], d["unit"]
        rate = n / elapsed if elapsed > 0 and n else None
        done = f"{n:g}/{total:g} {unit} ({100.0 * n / total:.0f}%)" if total else f"{n:g} {unit}"
        speed = None if not rate else f"{rate:.3g} {unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{unit}"
        parts = [f"{self.desc or 'progress'}: {done}", speed,
                 f"{'took' if closing else 'elapsed'} {self.format_interval(elapsed)}" if elapsed >= 1 else None]
        if total and rate and not closing and n < total:
            parts.append(f"ETA {self.format_interval((total - n) / rate)}")
        return ", ".join(p for p in parts if p)


def _heartbeat(ref: weakref.ref[_LineBar], stop: threading.Event, interval: float) -> None:
    while not stop.wait(max(interval / 4, 0.05)):
        bar = ref()
        if bar is None or bar.disable:
            return
        if time.perf_counter() - bar._last_line >= interval:
            bar.refresh()
        del bar
