"""A Hugging Face tokenizer served by a worker process, for a process that must stay free of torch.

``transformers`` imports torch as soon as it is imported (when torch is installed): ~200 MB of resident
libraries and ~100 MB of Python objects that a process keeps until it ends.  The layer-wise mix's search runs
in a child process (:mod:`quantkit.llm_mix`) whose peak is the process tree's peak; it needs the tokenizer only
to cut the calibration text into token windows.  :func:`isolate` makes :func:`quantkit.frontends.hf_folder.
load_hf_tokenizer` return a :class:`WorkerTokenizer` in such a process: the tokenizer lives in a spawned worker
(which imports transformers, with torch hidden from it when the tokenizer loads without: ~170 MB instead of
~370 MB), calls are sent to it through a pipe, and :meth:`WorkerTokenizer.release`
ends it once the datasets are built, so its memory is returned before the search's heavy work.  A call after
``release`` starts a new worker (correct, only slower).  The token ids are the tokenizer's own (the same
``AutoTokenizer`` class and call; hiding torch only removes what needs it, such as ``return_tensors="pt"``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from quantkit.errors import ModelError

__all__ = ["WorkerTokenizer", "isolate", "isolated"]

log = logging.getLogger("quantkit")

_ISOLATED = False
_ATTRS = ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id", "model_max_length", "padding_side")


def isolate(on: bool = True) -> None:
    """Whether :func:`~quantkit.frontends.hf_folder.load_hf_tokenizer` serves tokenizers from a worker process
    (this process then never imports transformers for them)."""
    global _ISOLATED
    _ISOLATED = bool(on)


def isolated() -> bool:
    return _ISOLATED


def _serve(conn: Any, folder: str, without_torch: bool) -> None:
    """The worker's body: load the tokenizer, answer calls until told to stop or the pipe closes.

    ``without_torch``: torch is hidden from transformers (``sys.modules["torch"] = None``: transformers then
    loads tokenizers, configuration and file utilities only), so the worker holds ~170 MB instead of ~370 MB
    while it is alive beside the caller; a tokenizer that needs torch fails to load here and the caller starts a
    worker with torch."""
    try:
        if without_torch:
            import os
            import sys

            sys.modules["torch"] = None  # type: ignore[assignment]
            os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # not "PyTorch was not found" on every run
        from quantkit.frontends.hf_folder import load_hf_tokenizer

        tok = load_hf_tokenizer(folder)
        attrs = {a: getattr(tok, a, None) for a in _ATTRS}
        attrs["__len__"] = len(tok)
        conn.send(("ok", attrs))
    except BaseException as e:  # noqa: BLE001 - reported to the caller, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] != "call":
            return
        _, args, kwargs = msg
        try:
            enc = tok(*args, **kwargs)
            conn.send(("ok", {k: enc[k] for k in enc.keys()}))
        except BaseException as e:  # noqa: BLE001 - reported to the caller, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class WorkerTokenizer:
    """The tokenizer of HF folder ``folder``, called in a worker process (module doc).

    ``tok(text_or_texts, **kwargs)`` returns the encoding as a plain dict (``input_ids``, ``attention_mask``,
    ...); ``len(tok)`` and the special-token ids (``pad_token_id``, ``eos_token_id``, ``bos_token_id``, ...)
    are the tokenizer's, read when the worker starts.

    Raises:
        ModelError: the worker cannot load the tokenizer (the message of the error it met).
    """

    def __init__(self, folder: str) -> None:
        self.folder = str(folder)
        self._proc: Any = None
        self._conn: Any = None
        self._attrs: dict[str, Any] = {}
        self._torch = False  # whether the tokenizer needed a worker with torch
        self._start()

    def _start(self) -> None:
        """A worker without torch; where the tokenizer cannot be loaded that way, one with torch."""
        if self._torch is False:
            try:
                self._spawn(without_torch=True)
                return
            except ModelError as e:
                log.debug("tokenizer worker without torch: %s; starting one with torch", e)
                self._torch = True
        self._spawn(without_torch=False)

    def _spawn(self, *, without_torch: bool) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs, self.folder, without_torch), name="quantkit-tokenizer",
                           daemon=True)  # fmt: skip
        with _main_not_rerun():
            proc.start()
        theirs.close()
        try:
            kind, payload = mine.recv()
        except EOFError:
            proc.join()
            raise ModelError(f"the tokenizer process for {self.folder!r} ended without an answer "
                             f"(exit code {proc.exitcode})") from None  # fmt: skip
        if kind != "ok":
            proc.join()
            raise ModelError(f"cannot load a tokenizer from {self.folder!r}: {payload}")
        self._proc, self._conn, self._attrs = proc, mine, payload

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self._proc is None:
            self._start()
        self._conn.send(("call", args, kwargs))
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.release()
            raise ModelError(f"the tokenizer process for {self.folder!r} ended during a call") from None
        if kind != "ok":
            raise ModelError(f"the tokenizer of {self.folder!r} failed: {payload}")
        return payload

    def __len__(self) -> int:
        return int(self._attrs["__len__"])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self.__dict__.get("_attrs", {}):
            raise AttributeError(name)
        return self._attrs[name]

    def release(self) -> None:
        """End the worker (its memory goes back to the system); a later call starts a new one."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
        conn.close()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """While a spawned worker starts: hide the user's script from multiprocessing, which would otherwise run it
    again in the child to find ``__main__`` - a script without ``if __name__ == "__main__":`` then called
    quantkit again there and the worker died ("ended without an answer").  The worker's code is quantkit's own."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None or getattr(main, "__file__", None) is None:
        yield
        return
    path = main.__file__
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path
