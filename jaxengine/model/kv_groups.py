"""Which layers share block tables: the model's KV cache groups (docs/SCHEDULING.md §13).

One pure function of the config, `kv_cache_layout`, decides it for the scheduler (its
`kv_cache_groups`), the KV pool's size (`kv_block_layers` layer slots per page) and the step
(each layer's group and slot). The grouping is vLLM's (`_get_kv_cache_groups_uniform_page_size`):
layers of one attention kind (full, or one sliding window) are cut, in layer order, into groups
of the same number of layers, the fewest layers of any kind (or the most, when no kind has 25%
more layers than another, to pad less); the last group of a kind may be short and is padded.
So Gemma 3's 5 local : 1 global is one full group and five sliding ones, Gemma 2's 1 : 1 one of
each, and a model whose layers all attend alike one group of all its layers: the cache
`[Ly, P, L, 2K, H]` and every batch as without groups.

The `j`-th layer of every group uses layer slot `j` of the cache `[slots, P, L, 2K, H]`, so a
page belongs to whichever group's block table holds it.
"""

from __future__ import annotations

import dataclasses

from jaxengine.model.config import ModelConfig
from scheduler.kv.groups import KVCacheGroup, kv_block_layers


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheLayout:
    """The KV cache groups of a model and where each layer's KV lives."""

    groups: tuple[KVCacheGroup, ...]  # the scheduler's kv_cache_groups; full attention first
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its layer slot in a page (< num_slots)

    @property
    def num_slots(self) -> int:
        """Layer slots of one page: the cache's leading axis (`kv_block_layers`)."""
        return kv_block_layers(self.groups)


def kv_cache_layout(cfg: ModelConfig) -> KVCacheLayout:
    """Group `cfg`'s layers by attention kind into KV cache groups of equal size (vLLM's rule).

    Returns:
        The layout: full-attention groups first, then sliding ones by window, each kind's
        layers in layer order.
    """
    windows = cfg.layer_windows  # 0: full attention
    kinds: dict[int, list[int]] = {}
    for w in sorted(set(windows)):  # 0 sorts first: a full group, if any, is group 0
        kinds[w] = [i for i, lw in enumerate(windows) if lw == w]
    counts = [len(layers) for layers in kinds.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups, group_of, slot_of = [], [0] * len(windows), [0] * len(windows)
    for w, layers in kinds.items():
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                group_of[layer], slot_of[layer] = len(groups), slot
            groups.append(KVCacheGroup(sliding_window=w or None, num_layers=size))
    return KVCacheLayout(groups=tuple(groups), layer_group=tuple(group_of),
                         layer_slot=tuple(slot_of))
