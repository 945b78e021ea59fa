"""Heavy work in a spawned child process (quantkit.child): the result comes back, the child's exception is raised
in the parent with its type, and inputs that do not pickle stay in this process."""

from __future__ import annotations

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
