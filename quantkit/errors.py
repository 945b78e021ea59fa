"""Typed errors for everything a user controls.

Every message names the offending key / layer / value and, where it makes
sense, the allowed values.  ``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

from collections.abc import Iterable


class QuantkitError(Exception):
    """Base class of every error quantkit raises on purpose."""


class RecipeError(QuantkitError):
    """A recipe (YAML file, dict or object) is invalid."""


class ModelError(QuantkitError):
    """A model cannot be loaded, exported or is malformed."""


class DataError(QuantkitError):
    """Calibration or evaluation data is missing, malformed or does not match the model."""


class CalibrationError(QuantkitError):
    """Calibration failed (e.g. a tensor never received data)."""


class UnsupportedOpError(QuantkitError):
    """An operator or format combination quantkit cannot lower."""


class LoweringError(QuantkitError):
    """The emitted graph failed verification."""


class MemoryBudgetError(QuantkitError):
    """A run whose estimated peak memory exceeds the memory available, refused before any work
    (:mod:`quantkit.memory`); the message names the estimate, the memory available and the setting that fits."""


class UnknownNameError(QuantkitError, KeyError):
    """A registry lookup with a name that is not registered."""

    def __init__(self, kind: str, name: str, known: Iterable[str]) -> None:
        self.kind = kind
        self.name = name
        self.known = sorted(known)
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])
