"""Small name -> object registries: the extension points of relex.

Extrapolation methods, temporal models, verifiers and task sources each live in one `Registry`.
An unknown name fails with the list of valid ones.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from relex.errors import RelexError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RelexError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
