"""Chained block hashes for automatic prefix caching (docs/SCHEDULING.md §5).

hash(block i) = H(hash(block i-1) or ROOT, token ids of block i, extra keys). The chain makes a
block's hash name its whole prefix, so one dict lookup per block finds the longest cached prefix.
The request's `cache_salt` is an extra key of the first block only: it separates tenants' caches
without changing anything else. Its LoRA adapter's name is an extra key of every block (as
vLLM's): KV computed under one adapter is never reused under another, nor under the base model.
SHA-256 (as vLLM's default) makes collisions, and so cross-request leaks, practically impossible
even for adversarial prompts.
"""

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = hashlib.sha256(b"jaxengine prefix cache root").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], salt: str | None = None, *,
               lora_name: str | None = None) -> BlockHash:
    """The hash of one full block, chained on its parent's hash."""
    return _digest(parent, array("q", token_ids).tobytes(), salt, lora_name)


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], count: int, block_size: int,
    salt: str | None, *, lora_name: str | None = None,
) -> list[BlockHash]:
    """The hashes of blocks len(hashes)..count-1 of `token_ids` (which must hold them all), for
    a request with that `cache_salt` and LoRA adapter name (None: the base model)."""
    first = len(hashes)
    # One conversion to bytes for all the blocks, then a slice (no copy) per block.
    data = memoryview(array("q", token_ids[first * block_size:count * block_size]).tobytes())
    step = 8 * block_size
    new = []
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(count - first):
        parent = _digest(parent, data[i * step:(i + 1) * step],
                         salt if first + i == 0 else None, lora_name)
        new.append(parent)
    return new


def _digest(parent: BlockHash, tokens: bytes | memoryview, salt: str | None,
            lora_name: str | None) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(tokens)
    if lora_name is not None:
        h.update(b"\x00lora\x00" + lora_name.encode())
    if salt is not None:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()
