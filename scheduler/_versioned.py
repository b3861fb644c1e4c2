"""Persistent versions of one mutable object, by rerooting (Baker's trick).

The scheduler's KV block pool has up to hundreds of thousands of blocks, but a step changes only
a few of them. Copying the pool per step would cost milliseconds; sharing it mutably would break
purity. Instead every version of the pool is a `Version` node:

- exactly one node (the *root*) holds the real mutable data;
- every other node holds a *diff* (a list of `(container, key, value)` writes) and a pointer to
  the next node on the way to the root. Applying the diff to that node's data gives its own.

Editing version `v` first *reroots* at `v` (walks the path to the root, applying each diff and
reversing the pointers), then mutates the data while a `Journal` records the old value of every
write. Committing makes a new root node; `v` becomes a diff (the journal) pointing at it. So an
old state that is scheduled again still sees exactly its own data; the common case (always
editing the newest version) never copies or replays anything; and old versions nobody holds are
garbage-collected, because pointers run from old to new.

Containers are dicts (a missing key is `_MISSING`), lists (an int or a slice key) and, for
scalars, any other object (an attribute name key). The data must be changed only through the
`Journal` of an open `Edit`; reads go through `Version.read` or an open edit. Each lineage (a first
version and every version made from it) has one lock, held for the whole of an edit or a read,
because rerooting mutates the data every version of the lineage shares: two threads may work on
versions of the same lineage, one after the other.
"""

import threading
from collections.abc import Callable
from typing import Any

_MISSING = object()
_CUT = object()  # as the value of (list, n, _CUT): the list grew from n items; cut it back
Record = tuple[Any, Any, Any]  # (container, key, value to put back)


def _swap(obj: Any, key: Any, value: Any) -> Any:
    """Write `value` at obj[key] (delete for _MISSING), or obj.key for an object that is
    neither a dict nor a list, and return what was there."""
    kind = type(obj)
    if kind is dict:
        old = obj.get(key, _MISSING)
        if value is _MISSING:
            del obj[key]
        else:
            obj[key] = value
        return old
    if kind is list:
        old = obj[key]
        obj[key] = value
        return old
    old = getattr(obj, key)
    setattr(obj, key, value)
    return old


def _apply(diff: list[Record]) -> list[Record]:
    """Apply a diff (its last record first) and return its inverse, in the same convention."""
    inverse = []
    for obj, key, value in reversed(diff):
        if value is _CUT:
            inverse.append((obj, slice(key, None), obj[key:]))
            del obj[key:]
        else:
            inverse.append((obj, key, _swap(obj, key, value)))
    return inverse


class Journal:
    """Records the old value of every write made through it, so the writes can be undone."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list[Record] = []

    def set_item(self, lst: list, index: int, value: Any) -> None:
        """lst[index] = value."""
        self.records.append((lst, index, lst[index]))
        lst[index] = value

    def set_key(self, d: dict, key: Any, value: Any) -> None:
        """d[key] = value."""
        self.records.append((d, key, d.get(key, _MISSING)))
        d[key] = value

    def delete(self, obj: dict, key: Any) -> None:
        """del obj[key] (the key must exist)."""
        self.records.append((obj, key, obj.pop(key)))

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """obj.name = value (for scalars: `obj` is neither a dict nor a list)."""
        self.records.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def append(self, lst: list, item: Any) -> None:
        """lst.append(item)."""
        # The most frequent write (a token per request per step): one small tuple, no slice
        # or list until it is undone, so it adds no work for the garbage collector.
        self.records.append((lst, len(lst), _CUT))
        lst.append(item)

    def extend(self, lst: list, items: list) -> None:
        """lst.extend(items)."""
        self.records.append((lst, len(lst), _CUT))
        lst.extend(items)

    def rollback(self) -> None:
        """Undo every recorded write."""
        _apply(self.records)
        self.records = []


class Version:
    """One version of a mutable object. Obtain the first with `Version.initial(data)`."""

    __slots__ = ("_data", "_diff", "_next", "_lock")

    def __init__(self, lock: threading.Lock) -> None:
        self._data: Any = None  # the object, when this node is the root
        self._diff: list[Record] | None = None  # writes turning `_next`'s data into ours
        self._next: Version | None = None  # towards the root
        self._lock = lock  # one per lineage: rerooting mutates shared data

    @classmethod
    def initial(cls, data: Any) -> "Version":
        v = cls(threading.Lock())
        v._data = data
        return v

    def read[T](self, fn: Callable[[Any], T]) -> T:
        """Call fn on this version's data (read-only) and return its result."""
        with self._lock:
            return fn(self._reroot())

    def edit(self) -> "Edit":
        """Start editing this version; the caller must `commit()` or `abort()` the edit."""
        self._lock.acquire()
        try:
            data = self._reroot()
        except BaseException:
            self._lock.release()
            raise
        return Edit(self, data)

    def _reroot(self) -> Any:
        path = []
        node = self
        while node._next is not None:
            path.append(node)
            node = node._next
        for child in reversed(path):  # the node nearest the root first
            parent = child._next
            parent._diff = _apply(child._diff)
            parent._next, child._next, child._diff = child, None, None
            child._data, parent._data = parent._data, None
        return self._data


class Edit:
    """An open edit of a `Version`: mutate `data` only through `journal`."""

    __slots__ = ("_base", "data", "journal")

    def __init__(self, base: Version, data: Any) -> None:
        self._base = base
        self.data = data
        self.journal = Journal()

    def commit(self) -> Version:
        """Finish the edit: return the new version (the base itself if nothing changed)."""
        base = self._base
        try:
            if not self.journal.records:
                return base
            new = Version(base._lock)
            new._data, base._data = base._data, None
            base._diff, base._next = self.journal.records, new
            return new
        finally:
            base._lock.release()

    def abort(self) -> None:
        """Undo the edit; the base version is unchanged."""
        try:
            self.journal.rollback()
        finally:
            self._base._lock.release()
