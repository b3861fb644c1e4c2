"""`PrefixIndex`: which prompt prefixes the proxy has sent to one prefill instance.

The proxy cannot see an instance's prefix cache, so it estimates it from its own traffic: a
prompt it sent there is assumed cached, in chunks of `CHUNK_CHARS` characters (a chunk stands
for a few KV blocks; a partly matching chunk counts for nothing, as a partly filled block does
not in the cache). Each chunk's key chains the previous one's, so a key names its whole prefix,
as the scheduler's block hashes do (docs/SCHEDULING.md §5), and a long prompt costs one hash per
chunk. The index forgets the least recently used keys beyond its capacity, as the instance's
cache evicts.
"""

from __future__ import annotations

from collections import OrderedDict

CHUNK_CHARS = 64  # characters per prefix chunk (about 16 tokens of English text)


class PrefixIndex:
    """The chunked prefixes of the prompts sent to one instance (an LRU of chained keys)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        """Args:
          capacity: the most chunk keys kept.
        """
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def hit(self, text: str) -> int:
        """Characters of `text`'s longest chunk-aligned prefix sent here before."""
        found = 0
        for key in _chain(text):
            if key not in self._keys:
                break
            found += CHUNK_CHARS
        return found

    def add(self, text: str) -> None:
        """Record `text`'s whole chunks as sent here (most recently used)."""
        for key in _chain(text):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


def _chain(text: str) -> list[int]:
    """One key per whole chunk of `text`, each naming the prefix up to its chunk's end."""
    keys, key = [], 0
    for end in range(CHUNK_CHARS, len(text) + 1, CHUNK_CHARS):
        key = hash((key, text[end - CHUNK_CHARS:end]))
        keys.append(key)
    return keys
