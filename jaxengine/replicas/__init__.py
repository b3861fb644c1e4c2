"""Engines made of several `LLMEngine`s, above the engine: data-parallel replicas behind a router
(`data_parallel.py`, `router.py`), and the multi-host engine whose processes step in lockstep
(`lockstep.py`). The mesh and tensor-parallel rules live with the model (`jaxengine/model/mesh.py`,
`tensor_parallel.py`); joining the multi-host runtime with the runner
(`jaxengine/runner/distributed.py`)."""

from jaxengine.replicas.data_parallel import DataParallelEngine, build_engines
from jaxengine.replicas.lockstep import LeaderEngine, follow

__all__ = ["DataParallelEngine", "LeaderEngine", "build_engines", "follow"]
