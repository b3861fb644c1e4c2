"""Scale-out on a `jax.sharding.Mesh`: the tensor-parallel mesh (`mesh.py`)."""

from jaxengine.parallel.mesh import TP_AXIS, engine_devices, make_mesh, replicated, tp_size

__all__ = ["TP_AXIS", "engine_devices", "make_mesh", "replicated", "tp_size"]
