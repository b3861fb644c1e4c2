"""The device mesh an engine replica runs on: one axis, "tp", over its devices.

Every engine builds one, a 1-device mesh included (tp=1 takes the same code path as tp=N).
Weights declare their sharding over the axis where they are created (docs/STYLE.md rule 17);
GSPMD inserts the collectives, and attention runs per device under `jax.shard_map`.
The axis is *Auto* (not jax's default *Explicit*), so that sharding propagates through
ordinary jnp code and XLA chooses the all-reduces and all-gathers.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

TP_AXIS = "tp"  # the tensor-parallel mesh axis (docs/STYLE.md rule 8)


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D mesh over `devices` with the Auto axis "tp" (its size is the TP degree).

    Args:
        devices: the engine replica's devices, in order (global devices in multi-host).
    Raises:
        ValueError: no devices, or the same device twice.
    """
    devices = list(devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError(f"make_mesh got a device twice: {[d.id for d in devices]}")
    return Mesh(np.asarray(devices, dtype=object), (TP_AXIS,), axis_types=(AxisType.Auto,))


def tp_size(mesh: Mesh) -> int:
    """The tensor-parallel degree: the size of the mesh's "tp" axis."""
    return int(mesh.shape[TP_AXIS])


def mesh_platform(mesh: Mesh | AbstractMesh) -> str:
    """The jax platform of the mesh's devices ("cpu", "gpu", "tpu"), of an abstract mesh's
    abstract device too (lowering for a device this machine lacks)."""
    if isinstance(mesh, AbstractMesh):
        device = mesh.abstract_device
        return jax.default_backend() if device is None else device.platform
    return mesh.devices.flat[0].platform


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of an array every device of `mesh` holds whole."""
    return NamedSharding(mesh, PartitionSpec())


def engine_devices(tensor_parallel_size: int,
                   devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices of one engine replica: `devices` as given, else the first N of jax's.

    Args:
        tensor_parallel_size: N, the number of devices the replica needs.
        devices: an explicit device group (data parallel passes one per replica).
    Raises:
        ValueError: the count does not match N, or fewer than N devices exist.
    """
    if devices is None:
        available = jax.devices()
        if len(available) < tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} "
                f"devices, but jax sees {len(available)} ({jax.default_backend()}); lower "
                f"tensor_parallel_size (on CPU, XLA_FLAGS="
                f"--xla_force_host_platform_device_count=N gives N virtual devices)")
        return list(available[:tensor_parallel_size])
    devices = list(devices)
    if len(devices) != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but {len(devices)} "
                         f"devices were given; pass exactly tensor_parallel_size devices")
    return devices
