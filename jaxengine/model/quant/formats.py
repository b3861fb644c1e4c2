"""The `quantization` values and how each swaps a model's float modules for its own.

A weight format says, for each kind of float module that holds a matrix (`nnx.Linear`, the
`Embedder`, the MoE `Experts`), which module replaces it (`WeightFormat`), and, for the
loader, how a checkpoint tensor becomes that module's arrays (`host_weights` from its floats,
or `read_host` as the checkpoint holds them: GGUF blocks). `Model`
(jaxengine/model/decoder.py) builds each block and the outer parts through
`quantize_modules`, so the families never see the format, and the loader
(jaxengine/loading/weights.py) quantizes each tensor on the host as it reads it. Norms, biases
and MoE routers stay float. The modules are chosen per module path, so a format may hold each
weight its own way ("gguf": in the type the file stores it, quant/gguf.py).

Per-channel int8 and fp8 are our own small modules (quant/modules.py), not qwix 0.1.8: qwix's
PTQ quantizes a weight when its intercepted dot_general or einsum runs under a traced call of
the whole model (here with a KV cache and a batch), so the embedding's gather and the MoE
experts' grouped-matmul kernels would stay float, and it quantizes a float model already in
memory rather than each tensor as the loader reads it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from jaxengine.model.families.family import Path
from jaxengine.model.layers import Embedder
from jaxengine.model.moe import Experts, SparseMoE
from jaxengine.model.quant.channel import FP8, INT8, ChannelFormat, quantize
from jaxengine.model.quant.gguf import GGUFFormat
from jaxengine.model.quant.modules import (
    EMBEDDING_AXIS,
    EXPERT_WEIGHTS,
    KERNEL_AXIS,
    QuantizedEmbedder,
    QuantizedExperts,
    QuantizedLinear,
    scale_name,
    shards,
)
from jaxengine.model.tensor_parallel import TPLayout

ROUTERS = ("gate", "shared_expert_gate")  # `SparseMoE`'s float projections


class WeightFormat(Protocol):
    """A way to hold a model's matrices: the modules that replace the float ones, and the
    arrays a checkpoint tensor becomes."""

    name: str  # the `quantization` value

    def linear(self, linear: nnx.Linear, path: Path = ()) -> nnx.Module:
        """The module that replaces the projection `linear` at module `path` (scanned layout,
        e.g. ("layers", "self_attn", "q_proj")), called with x [T, in], live."""

    def embedder(self, embedder: Embedder, path: Path = ()) -> nnx.Module:
        """The module that replaces the embedding (`encode` and `decode` as `Embedder`'s)."""

    def experts(self, experts: Experts, path: Path = ()) -> nnx.Module:
        """The module that replaces MoE experts (`operands` and `matrices` as `Experts`')."""

    def read_host(self, path: Path, name: str, shape: tuple[int, ...], layout: TPLayout, *,
                  lacks: Callable[[int], bool], on_tensor: Callable[[], object]
                  ) -> dict[Path, np.ndarray] | None:
        """The arrays by module path of weight `path` (float `shape`, checkpoint tensor
        `name`, `lacks` and `on_tensor` as `load_weight`'s) read from the checkpoint as the
        format holds them and laid out for the mesh; None: read the floats for
        `host_weights`."""

    def host_weights(self, path: Path, host: np.ndarray, like: jax.ShapeDtypeStruct
                     ) -> dict[Path, np.ndarray]:
        """The arrays by module path that float weight `path` (at the model's layout,
        float32 on the host) becomes, `like` the model's array at `path` (its sharding)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PerChannel:
    """`WeightFormat` of scales along the contracted axis (quant/channel.py): int8's in groups
    of 32, fp8's per output channel."""

    channel: ChannelFormat

    @property
    def name(self) -> str:
        return self.channel.name

    # one format for every weight; the paths name a weight whose size the groups refuse
    def linear(self, linear: nnx.Linear, path: Path = ()) -> nnx.Module:
        self._check(linear.kernel, KERNEL_AXIS, (*path, "kernel"))
        fp8_dots = self.channel is FP8 and multiplies_fp8(linear.kernel.get_metadata()
                                                          .get("mesh"))
        return QuantizedLinear(linear, self.channel, fp8_dots=fp8_dots)

    def embedder(self, embedder: Embedder, path: Path = ()) -> nnx.Module:
        self._check(embedder.embedding, EMBEDDING_AXIS, (*path, "embedding"))
        return QuantizedEmbedder(embedder, self.channel)

    def experts(self, experts: Experts, path: Path = ()) -> nnx.Module:
        for name in EXPERT_WEIGHTS:
            self._check(getattr(experts, name), KERNEL_AXIS, (*path, name))
        return QuantizedExperts(experts, self.channel)

    def _check(self, weight: nnx.Variable, axis: int, path: Path) -> None:
        """`ChannelFormat.check` of float `weight` at `path`, split as its sharding says."""
        meta = weight.get_metadata()
        split = shards(meta.get("out_sharding"), meta.get("mesh"), axis, len(weight.shape))
        self.channel.check(weight.shape, axis=axis, shards=split, name="/".join(path))

    def read_host(self, path: Path, name: str, shape: tuple[int, ...], layout: TPLayout, *,
                  lacks: Callable[[int], bool], on_tensor: Callable[[], object]) -> None:
        return None  # quantized from the floats

    def host_weights(self, path: Path, host: np.ndarray, like: jax.ShapeDtypeStruct
                     ) -> dict[Path, np.ndarray]:
        axis = EMBEDDING_AXIS if path[-1] == "embedding" else KERNEL_AXIS
        sharding = like.sharding  # groups within each device's part, as the model's
        split = shards(getattr(sharding, "spec", None), getattr(sharding, "mesh", None), axis,
                       host.ndim)
        values, scale = quantize(host, self.channel, axis=axis, shards=split)
        return {path: values, (*path[:-1], scale_name(path[-1])): scale}


# "gguf" here has no file, and refuses to build; a GGUF load makes its own with the file's
# types (jaxengine/loading/gguf_weights.py)
FORMATS: dict[str, WeightFormat] = {**{f.name: PerChannel(f) for f in (INT8, FP8)},
                                    "gguf": GGUFFormat()}
QUANTIZATIONS = tuple(FORMATS)  # the values of `quantization` besides None (float weights)


def weight_format(quantization: str | WeightFormat | None) -> WeightFormat | None:
    """The format `quantization` names (None: float weights, no format; a format: itself).

    Raises:
        ValueError: an unknown value; the message names it and the supported ones.
    """
    if quantization is None or not isinstance(quantization, str):
        return quantization
    if quantization not in FORMATS:
        raise ValueError(f"quantization={quantization!r} is not supported; use one of "
                         f"{', '.join(QUANTIZATIONS)}, or None for float weights")
    return FORMATS[quantization]


def quantize_modules(node: Any, fmt: WeightFormat, path: Path = ()) -> Any:
    """`node` (a module, or a dict of modules and None) at module `path` (scanned layout)
    with every float matrix module in it swapped for `fmt`'s, in place where it is an
    attribute; returns the new node."""
    if isinstance(node, dict):
        return {k: None if v is None else quantize_modules(v, fmt, (*path, k))
                for k, v in node.items()}
    if isinstance(node, nnx.Linear):
        return fmt.linear(node, path)
    if isinstance(node, Embedder):
        return fmt.embedder(node, path)
    if isinstance(node, Experts):
        return fmt.experts(node, path)
    if isinstance(node, nnx.List):
        for i, child in enumerate(node):  # items share their path in the scanned layout
            node[i] = quantize_modules(child, fmt, path)
    elif isinstance(node, nnx.Module):
        for name, child in list(vars(node).items()):
            routed = isinstance(node, SparseMoE) and name in ROUTERS
            if isinstance(child, nnx.Module) and not routed:
                setattr(node, name, quantize_modules(child, fmt, (*path, name)))
    return node


def check_platform(fmt: WeightFormat, mesh: Mesh | AbstractMesh) -> None:
    """Raise if the mesh's devices cannot hold `fmt`'s values (fp8 needs the platform's
    float8_e4m3fn arrays; every XLA platform holds int8). An abstract mesh (lowering for
    devices this machine lacks) has no device to probe: lowering is its check.

    Raises:
        ValueError: naming the format, the device kind and what to use instead.
    """
    if fmt.name != "fp8" or isinstance(mesh, AbstractMesh):
        return
    device = mesh.devices.flat[0]
    problem = _fp8_problem(device)
    if problem is not None:
        raise ValueError(f"quantization='fp8' needs float8_e4m3fn arrays, which this "
                         f"{device.platform} device ({device.device_kind}) cannot hold "
                         f"({problem}); use quantization='int8'")


# device_kind prefixes of the TPUs whose matrix units multiply fp8 (v5p, v6e "TPU v6 lite",
# Ironwood "TPU7x"), and the NVIDIA GPUs' (compute capability 8.9 and up: Ada, Hopper,
# Blackwell), for an abstract device, which has no compute capability
FP8_TPU_KINDS = ("TPU v5p", "TPU v6", "TPU7")
FP8_GPU_KINDS = ("NVIDIA H100", "NVIDIA H200", "NVIDIA H800", "NVIDIA H20", "NVIDIA GH200",
                 "NVIDIA B100", "NVIDIA B200", "NVIDIA GB200", "NVIDIA L4", "NVIDIA L40",
                 "NVIDIA GeForce RTX 40", "NVIDIA RTX 6000 Ada")


def multiplies_fp8(mesh: Mesh | AbstractMesh | None) -> bool:
    """Whether the devices of `mesh` multiply fp8 x fp8 in their matrix units: TPU v5p and
    later, NVIDIA GPUs of compute capability 8.9 and up. There fp8 weights meet activations
    quantized to fp8 (`QuantizedLinear`); elsewhere they are widened in the dot. None (no
    mesh): jax's first device."""
    if isinstance(mesh, AbstractMesh):
        device = mesh.abstract_device
        if device is None:
            return False
        platform, kind, capability = device.platform, device.device_kind, None
    else:
        real = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
        platform, kind = real.platform, real.device_kind
        capability = getattr(real, "compute_capability", None)
    if platform == "tpu":
        return kind.startswith(FP8_TPU_KINDS)
    if platform in ("gpu", "cuda"):
        if capability is not None:
            return tuple(int(p) for p in str(capability).split(".")[:2]) >= (8, 9)
        return kind.startswith(FP8_GPU_KINDS)
    return False


@functools.cache
def _fp8_problem(device: jax.Device) -> str | None:
    """Why `device` cannot hold and convert float8_e4m3fn arrays, or None: one round trip,
    run eagerly even while a model is only traced."""
    try:
        with jax.ensure_compile_time_eval():
            probe = jax.device_put(np.array([1.0, -448.0], FP8.dtype), device)
            back = np.asarray(probe.astype(jnp.float32))
    except Exception as e:  # XLA reports an unsupported type in its own words
        return f"{type(e).__name__}: {e}"
    return None if back.tolist() == [1.0, -448.0] else f"a round trip gave {back.tolist()}"
