"""KV offloading to host memory: a KV connector (docs/SCHEDULING.md §11) whose store is an LRU
of KV blocks in host memory, keyed by prefix-cache block hash (docs/DESIGN.md, "KV offloading").

`offloading_worker(config, runner, page_axis)` builds what an engine needs when
`EngineArgs.kv_offloading_size` is set (`EngineConfig.cache.kv_offloading_bytes`): the
`OffloadingWorker`, which holds the `HostKVStore`, the scheduler-side `OffloadingConnector` and
the device copies (`BlockCopier`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from jaxengine.config import EngineConfig
from jaxengine.kv_offload.connector import OffloadingConnector
from jaxengine.kv_offload.copies import BLOCKS_PER_COPY, BlockCopier
from jaxengine.kv_offload.host_store import HostKVStore
from jaxengine.kv_offload.worker import OffloadingWorker

if TYPE_CHECKING:
    from jaxengine.runner.runner import Runner

__all__ = ["BLOCKS_PER_COPY", "BlockCopier", "HostKVStore", "OffloadingConnector",
           "OffloadingWorker", "offloading_worker"]


def offloading_worker(config: EngineConfig, runner: Runner, page_axis: int
                      ) -> OffloadingWorker | None:
    """The engine's offloading worker, or None when `kv_offloading_size` is unset or 0.

    Raises:
      ValueError: the size holds no KV block, or a multi-process run (each process would keep
        its own store; not supported yet). The message names kv_offloading_size.
    """
    capacity = config.cache.kv_offloading_bytes
    if capacity is None:
        return None
    if jax.process_count() > 1:
        raise ValueError("kv_offloading_size is not supported with more than one process yet; "
                         "unset it for multi-host runs")
    return OffloadingWorker(runner, capacity_bytes=capacity,
                            block_size=config.scheduler.block_size, page_axis=page_axis)
