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
