"""The worker side of a KV connector: `KVWorker`, what the engine calls around each step
(docs/DESIGN.md, "KV connectors"). Host offloading (`kv_offload/`) and prefill/decode
disaggregation (`kv_transfer/`) implement it; the base class is the engine's worker when
neither is configured."""

from jaxengine.kv_connector.worker import KVWorker

__all__ = ["KVWorker"]
