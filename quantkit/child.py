"""Heavy work in a fresh (spawned) process: its memory goes back to the system when it ends.

A process's freed memory mostly stays in its heap (and torch, once imported, keeps ~220 MB): a step that holds a
lot and is followed by another that holds a lot - the layer-wise build, then the evaluation's FP32 and quantized
sessions; a mixed-precision search, then the build - peaks at their sum when both run in one process.  Run the
first in a child and the second starts from the parent's own floor.  Used by :mod:`quantkit.llm_run` (the build)
and :mod:`quantkit.llm_mix` (the search).

The child's log records go to stderr with the parent's level and format; its progress bars write to the stderr it
inherits.  Ctrl-C reaches both (one process group): the parent stops the child and raises; a SIGKILL of the parent
takes the child along (Linux ``PR_SET_PDEATHSIG``).  An exception in the child is raised again in the parent (its
traceback at DEBUG).
"""

from __future__ import annotations

import logging
from typing import Any

from quantkit.errors import QuantkitError

log = logging.getLogger("quantkit")

__all__ = ["CHILD_GRACE_S", "in_child", "picklable"]

CHILD_GRACE_S = 10.0
"""Seconds an interrupted parent waits for its child to end on its own (Ctrl-C reaches both: the layer-wise build
keeps its finished blocks for a resume) before it terminates it."""


def picklable(args: tuple[Any, ...]) -> bool:
    """Whether ``args`` can go to a child process (a model path or name, data the recipe names), and this process
    may start one (a daemonic process - a multiprocessing pool's worker - may not)."""
    import multiprocessing as mp
    import pickle

    if mp.current_process().daemon:
        return False
    try:
        pickle.dumps(args)
    except Exception:  # noqa: BLE001 - an in-memory model or dataset that does not pickle: run in-process
        return False
    return True


def _child(conn: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], level: int, fmt: str | None) -> None:
    """The child process's body: ``fn(*args, **kwargs)``, its result (or its exception) sent back through
    ``conn``."""
    from quantkit.frontends.llm import _die_with_parent
    from quantkit.frontends.tokenizer_worker import isolate

    _die_with_parent()
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
        conn.send(msg)
    except Exception as e:  # noqa: BLE001 - an exception that does not pickle: its text
        conn.send(("error", (RuntimeError(str(msg[1][0]) if msg[0] == "error" else f"unpicklable result: {e}"),
                             "")))
    conn.close()


def in_child(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
             name: str = "quantkit-child") -> Any:
    """``fn(*args, **kwargs)`` in a fresh (spawned) process (module doc)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    handler = next((h for h in log.handlers if h.formatter is not None), None)
    level = log.getEffectiveLevel() if log.handlers else 0
    fmt = handler.formatter._fmt if handler is not None and handler.formatter is not None else None
    proc = ctx.Process(target=_child, args=(send, fn, args, dict(kwargs or {}), level, fmt), name=name)
    proc.start()
    send.close()
    try:
        try:
            kind, payload = recv.recv()
        except EOFError:
            proc.join()
            raise QuantkitError(f"the {name} process ended without a result (exit code {proc.exitcode})") from None
        proc.join()
    finally:
        if proc.is_alive():  # interrupted (Ctrl-C reached the child too): a moment to end cleanly, then it goes
            proc.join(timeout=CHILD_GRACE_S)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    if kind == "error":
        exc, tb = payload
        log.debug("%s process failed:\n%s", name, tb)
        raise exc
    return payload
