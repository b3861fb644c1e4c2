"""Scale-out on a `jax.sharding.Mesh`: the tensor-parallel mesh (`mesh.py`); joining the
multi-host runtime (`distributed.py`). Modules that need the engine (`lockstep.py`,
`data_parallel.py`) are imported by their path: the engine imports this package."""

from jaxengine.parallel.distributed import initialize_from_args, to_host
from jaxengine.parallel.mesh import TP_AXIS, engine_devices, make_mesh, replicated, tp_size

__all__ = ["TP_AXIS", "engine_devices", "initialize_from_args", "make_mesh", "replicated",
           "to_host", "tp_size"]
