"""User-given regular expressions, compiled and matched with a time limit.

Every regex a user writes (a recipe override's ``pattern``, ``search.layers``) goes through
:func:`compile_pattern` and :func:`pattern_search`, never through :mod:`re` directly:

* patterns are compiled with the `regex <https://pypi.org/project/regex/>`_ engine (the syntax of
  :mod:`re`), which needs no backtracking for many patterns that make :mod:`re` take exponential time
  (``(a+)+$``);
* every match runs under a time limit of :data:`MATCH_TIMEOUT_S` seconds.  A match that takes longer
  (catastrophic backtracking, e.g. ``(\\w+\\s?)+$`` against a long node name) is a
  :class:`~quantkit.errors.RecipeError` naming the recipe key, the pattern and the text, never a hang.
  Node names are matched in microseconds by any sensible pattern, so the limit never bites in real use;
* a pattern that does not compile, or is longer than :data:`MAX_PATTERN_CHARS`, is a
  :class:`~quantkit.errors.RecipeError` naming the key and the pattern.
"""

from __future__ import annotations

import functools
from typing import Any

import regex

from quantkit.errors import RecipeError

__all__ = ["MATCH_TIMEOUT_S", "MAX_PATTERN_CHARS", "compile_pattern", "pattern_search"]

MATCH_TIMEOUT_S = 0.25
"""Seconds one match of a user pattern against one name may take."""

MAX_PATTERN_CHARS = 4096
"""The longest pattern accepted."""


@functools.lru_cache(maxsize=512)
def _compile(pattern: str) -> Any:
    return regex.compile(pattern)


def compile_pattern(pattern: str, where: str) -> Any:
    """The compiled ``pattern`` (cached); ``where`` is the recipe key it came from, for messages ("" when
    the caller names it already).

    Raises:
        RecipeError: not a string, too long, or not a valid regular expression.
    """
    at = f"{where}: " if where else ""
    if not isinstance(pattern, str):
        raise RecipeError(f"{at}a pattern must be a string (a regular expression), got {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RecipeError(
            f"{at}pattern of {len(pattern)} characters is too long; allowed: at most {MAX_PATTERN_CHARS}"
        )
    try:
        return _compile(pattern)
    except (regex.error, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise RecipeError(f"{at}pattern {pattern!r} is not a valid regular expression: {exc}") from None


def pattern_search(pattern: str, text: str, where: str) -> bool:
    """Whether ``pattern`` matches anywhere in ``text`` (``re.search`` semantics), within the time limit.

    Raises:
        RecipeError: the pattern is invalid (see :func:`compile_pattern`) or the match took longer than
            :data:`MATCH_TIMEOUT_S` seconds; the message names ``where``, the pattern and ``text``.
    """
    compiled = compile_pattern(pattern, where)
    try:
        return compiled.search(text, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise RecipeError(
            f"{where}: pattern {pattern!r} took more than {MATCH_TIMEOUT_S} s to match the name {shown!r} "
            f"({len(text)} characters) and was stopped (catastrophic backtracking?); allowed: patterns "
            "without nested repeats such as (a+)+ or (\\w+\\s?)+"
        ) from None
