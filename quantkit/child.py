"""Heavy work in a fresh (spawned) process: its memory goes back to the system when it ends.

A process's freed memory mostly stays in its heap (and torch, once imported, keeps ~220 MB): a step that holds a
lot and is followed by another that holds a lot - the layer-wise build, then the evaluation's FP32 and quantized
sessions; a mixed-precision search, then the build - peaks at their sum when both run in one process.  Run the
first in a child and the second starts from the parent's own floor.  Used by :mod:`quantkit.llm_run` (the build)
and :mod:`quantkit.llm_mix` (the search).

The child is a fresh interpreter started with ``python -c`` (never multiprocessing's spawn, which re-runs the
caller's ``__main__`` script in the child: a user's script without an ``if __name__ == "__main__"`` guard would
call quantkit again there); the work goes in pickled on its stdin, the result comes back pickled through a pipe
of its own.  The child's log records go to stderr with the parent's level and format; its progress bars write to the
stderr it inherits.  Ctrl-C reaches both (one process group): the parent stops the child and raises; a SIGKILL of the parent
takes the child along (Linux ``PR_SET_PDEATHSIG``).  An exception in the child is raised again in the parent (its
traceback at DEBUG).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError

log = logging.getLogger("quantkit")

__all__ = ["CHILD_GRACE_S", "in_child", "picklable"]

CHILD_GRACE_S = 10.0
"""Seconds an interrupted parent waits for its child to end on its own (Ctrl-C reaches both: the layer-wise build
keeps its finished blocks for a resume) before it terminates it."""


def picklable(args: tuple[Any, ...]) -> bool:
    """Whether ``args`` can go to a child process (a model path or name, data the recipe names) and this system
    can start one the way :func:`in_child` does (POSIX: it passes the child a pipe)."""
    import pickle

    if os.name != "posix":
        return False
    try:
        pickle.dumps(args)
    except Exception:  # noqa: BLE001 - an in-memory model or dataset that does not pickle: run in-process
        return False
    return True


def _main(fd: int) -> None:
    """The child's body (``python -c``): the pickled work from stdin, its result (or its exception) pickled to the
    pipe ``fd``."""
    import pickle

    from quantkit.frontends.tokenizer_worker import isolate

    fn, args, kwargs, level, fmt = pickle.load(sys.stdin.buffer)
    isolate()  # text is tokenized in a worker process that ends before the heavy work: no torch for it here
    if level:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(fmt or "%(message)s"))
        log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False
    try:
        msg: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
        import traceback

        msg = ("error", (e, traceback.format_exc()))
    try:
        data = pickle.dumps(msg)
    except Exception as e:  # noqa: BLE001 - an exception (or result) that does not pickle: its text
        data = pickle.dumps(("error", (RuntimeError(str(msg[1][0]) if msg[0] == "error" else
                                                    f"unpicklable result: {e}"), "")))
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    except (BrokenPipeError, KeyboardInterrupt):  # the parent stopped listening (Ctrl-C reached both): it reports
        os._exit(130 if msg[0] == "error" and isinstance(msg[1][0], KeyboardInterrupt) else 1)


def in_child(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
             name: str = "quantkit-child") -> Any:
    """``fn(*args, **kwargs)`` in a fresh Python process (module doc); ``fn`` must be importable by name."""
    import pickle
    import subprocess

    from quantkit.frontends.llm import _die_with_parent

    handler = next((h for h in log.handlers if h.formatter is not None), None)
    level = log.getEffectiveLevel() if log.handlers else 0
    fmt = handler.formatter._fmt if handler is not None and handler.formatter is not None else None
    work = pickle.dumps((fn, args, dict(kwargs or {}), level, fmt))
    pkg_root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", f"from quantkit.child import _main; _main({w})"],
                                stdin=subprocess.PIPE, pass_fds=(w,), env=env,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509 - a prctl, no locks taken
    finally:
        os.close(w)
    data = b""
    try:
        with os.fdopen(r, "rb") as res:
            assert proc.stdin is not None  # noqa: S101 - stdin=PIPE above
            try:
                proc.stdin.write(work)
                proc.stdin.close()
            except BrokenPipeError:  # the child ended before reading its work: its exit code says why
                pass
            data = res.read()
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C reached the child too): a moment to end cleanly, then it goes
            try:
                proc.wait(timeout=CHILD_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait()
    if not data:
        raise QuantkitError(f"the {name} process ended without a result (exit code {proc.returncode})")
    kind, payload = pickle.loads(data)
    if kind == "error":
        exc, tb = payload
        log.debug("%s process failed:\n%s", name, tb)
        raise exc
    return payload
