"""The calibrator protocol and the calibrator registry.

A calibrator watches one tensor stream and summarises it in O(C) memory (C = number
of channels, 1 per-tensor): :meth:`Calibrator.update` receives one batch and must not keep
a reference to it; :meth:`Calibrator.compute_range` returns the ``(min, max)`` range that
:func:`quantkit.scheme.compute_qparams` turns into a scale.  Built-ins live in the top-level
``calibrators`` package (one file each) and register themselves by name; third-party
calibrators can register through the entry-point group ``quantkit.calibrators``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from quantkit.registry import Registry

__all__ = [
    "CALIBRATORS",
    "Calibrator",
    "CalibratorFactory",
    "get_calibrator",
    "register_calibrator",
]


@runtime_checkable
class Calibrator(Protocol):
    """Streaming range estimator for one tensor.

    ``axis``: per-channel along this axis of the activation (the range has shape ``(C,)``
    with ``C = x.shape[axis]``); ``None``: per-tensor (shape ``()``).
    """

    name: ClassVar[str]

    def __init__(self, *, axis: int | None = None, **options: Any) -> None: ...

    def update(self, x: np.ndarray) -> None:
        """Fold one batch of the tensor into the statistics; must not keep ``x``."""
        ...

    def compute_range(self) -> tuple[np.ndarray, np.ndarray]:
        """``(min, max)`` as float32 arrays of shape ``()`` or ``(C,)``."""
        ...

    def merge(self, other: Any) -> None:
        """Fold in the statistics of another calibrator of the same kind and settings."""
        ...

    def state(self) -> dict[str, np.ndarray | float | int]:
        """Serialisable statistics (plain arrays and numbers) for an on-disk cache."""
        ...


CalibratorFactory = Callable[[], Calibrator]
"""A zero-argument callable that makes a fresh calibrator (a class with defaults, a ``functools.partial`` …)."""

CALIBRATORS: Registry[type[Calibrator]] = Registry("calibrator", entry_point_group="quantkit.calibrators")


def register_calibrator(name: str) -> Callable[[type[Calibrator]], type[Calibrator]]:
    """Class decorator: register a calibrator class under ``name`` (and set its ``name``)."""

    register = CALIBRATORS.register(name)

    def deco(cls: type[Calibrator]) -> type[Calibrator]:
        cls.name = name
        return register(cls)

    return deco


def get_calibrator(name: str) -> type[Calibrator]:
    """The calibrator class registered as ``name``; :class:`UnknownNameError` lists the known ones."""
    return CALIBRATORS.get(name)
