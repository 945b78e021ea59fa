"""Explicit name -> object registries (calibrators, weight algorithms, metrics ...).

No package walking, no if/elif factories: things register themselves with a
decorator, and an unknown name is an :class:`UnknownNameError` listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from quantkit.errors import QuantkitError, UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of objects of one kind.

    ``entry_point_group`` (optional) names a ``importlib.metadata`` entry-point group
    from which third-party plug-ins are loaded lazily on the first miss.
    """

    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._group = entry_point_group
        self._plugins_loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise QuantkitError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def _load_plugins(self) -> None:
        if self._plugins_loaded or self._group is None:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=self._group):
            if ep.name not in self._items:
                self._items[ep.name] = ep.load()

    def get(self, name: str) -> T:
        if name not in self._items:
            self._load_plugins()
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self._items) from None

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
