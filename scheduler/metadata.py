"""`RequestMetadata`: who sent a request (tenant, user, ...), as a read-only mapping.

Carried from the API (`LLMEngine.add_request(metadata=...)`, the server's `user` and `tenant`
fields) to the scheduler's policies (docs/SCHEDULING.md §8), which may group requests by it.
The scheduler itself never reads it.
"""

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

_VALUE_TYPES = (str, int, float, bool)


class RequestMetadata(Mapping[str, str | int | float | bool]):
    """An immutable copy of a mapping of str keys to str/int/float/bool values."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str | int | float | bool] | None = None, *,
                 owner: str = "") -> None:
        """Copy `items`.

        Raises:
            ValueError: `items` is not a mapping, or a key is not a str, or a value is not a
                str, int, float or bool (`owner`, a request id, is named in the message).
        """
        where = f"request {owner!r}: " if owner else ""
        if items is None:
            items = {}
        if not isinstance(items, Mapping):
            raise ValueError(f"{where}metadata must be a mapping such as {{'tenant': 'a'}}, "
                             f"got {type(items).__name__}")
        copy = dict(items)
        for key, value in copy.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}metadata key {key!r} is a {type(key).__name__}; "
                                 "use str keys")
            if not isinstance(value, _VALUE_TYPES):
                raise ValueError(f"{where}metadata[{key!r}] is a {type(value).__name__}; use a "
                                 "str, int, float or bool value")
        self._items = MappingProxyType(copy)

    def __getitem__(self, key: str) -> str | int | float | bool:
        return self._items[key]

    def get(self, key: str, default: Any = None) -> Any:
        """`self[key]`, or `default` if absent (at C speed: policies call it per request)."""
        return self._items.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"RequestMetadata({dict(self._items)!r})"


NO_METADATA = RequestMetadata()
