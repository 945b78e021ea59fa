"""Console stages: every long step says when it starts, shows a heartbeat, and says how long it took.

``with stage("export the model"):`` logs ``quantkit: export the model ...`` at once, then
``quantkit: export the model: still working (15 s)`` every ``heartbeat_s`` seconds while the step runs
(so no stretch of a run is silent, even where no progress bar can be shown: an ONNX export, an
``apt-get download``), and ``quantkit: export the model: done in 41.2 s`` at the end.  Steps shorter
than ``quiet_below_s`` log only their start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["stage"]

log = logging.getLogger("quantkit")


@contextmanager
def stage(name: str, *, enabled: bool = True, heartbeat_s: float = 15.0, quiet_below_s: float = 2.0) -> Iterator[None]:
    if not enabled:
        yield
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
