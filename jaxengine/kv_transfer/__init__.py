"""Prefill/decode disaggregation: the built-in KV connector, `JaxEngineConnector`
(docs/DESIGN.md, "Prefill/decode disaggregation").

`kv_transfer_worker(config, runner, page_axis)` builds what an engine needs when
`EngineArgs.kv_transfer_config` is set (`EngineConfig.kv_transfer`): the `KVTransferWorker`,
which holds the scheduler-side `TransferConnector`, the transfer server (a producer's TCP
`TransferServer`, or with the "jax" transport a `DeviceTransferServer` on either side) and a
consumer's fetches. Pages move in the pool's own layout and dtype (`KVLayout`), copied by the
offloading code's `BlockCopier`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from jaxengine.config import EngineConfig
from jaxengine.kv_transfer.connector import TransferConnector
from jaxengine.kv_transfer.params import (
    KVLayout,
    RemoteDecode,
    RemoteHandle,
    kv_transfer_params_of,
)
from jaxengine.kv_transfer.transport import TransferError, TransferServer, fetch_pages
from jaxengine.kv_transfer.worker import KVTransferWorker

if TYPE_CHECKING:
    from jaxengine.runner.runner import Runner

__all__ = ["KVLayout", "KVTransferWorker", "RemoteDecode", "RemoteHandle", "TransferConnector",
           "TransferError", "TransferServer", "fetch_pages", "kv_transfer_params_of",
           "kv_transfer_worker"]


def kv_transfer_worker(config: EngineConfig, runner: Runner, page_axis: int
                       ) -> KVTransferWorker | None:
    """The engine's transfer worker, or None when `kv_transfer_config` is unset.

    Raises:
      ValueError: a multi-process run, or a producer's kv_ip / kv_port that cannot be bound
        (the message names the setting).
    """
    if config.kv_transfer is None:
        return None
    if jax.process_count() > 1:
        raise ValueError("kv_transfer_config is not supported with more than one process yet")
    return KVTransferWorker(runner, config.kv_transfer, block_size=config.scheduler.block_size,
                            page_axis=page_axis,
                            tp_size=config.parallel.tensor_parallel_size)
