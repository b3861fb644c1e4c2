"""Map checkpoint tensors (HF names and layouts) into the model's module tree.

The set of weights and their shapes come from the model itself: `load_weights` traces a model
of the config (`nnx.eval_shape`, nothing allocated) and fills each of its parameters, by module
path, from the one table below. A source is anything with `get(hf_name) -> np.ndarray | None`
(HF safetensors, GGUF). Weights are converted one at a time: each stacked array is filled layer
by layer in the target dtype on the host, laid out for the model's mesh (KV heads repeated
when tp > K, the vocabulary zero-padded to a multiple of tp: `to_layout`), and handed to
`jax.make_array_from_callback` with the weight's sharding, which copies to each device only
its own shard (and, multi-host, asks each process only for its addressable shards); then it is
dropped, so the host holds one tensor at a time and no device ever holds the whole model.
A quantized model's matrices are read in float32 and turned into the weight format's arrays
(values and scales: `jaxengine.model.quant.WeightFormat.host_weights`) on the host in the same
pass, so no device holds them in float.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxengine.loading.weight_cache import WeightCache
from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.decoder import Model
from jaxengine.model.families import family
from jaxengine.model.families.family import Path
from jaxengine.model.mesh import make_mesh
from jaxengine.model.quant import WeightFormat, weight_format
from jaxengine.model.tensor_parallel import TPLayout


class TensorSource(Protocol):
    """Checkpoint tensors by HF name, in HF layout (float or bf16 numpy)."""

    def get(self, name: str) -> np.ndarray | None: ...


def model_weight_shapes(cfg: ModelConfig) -> Mapping[Path, tuple[int, ...]]:
    """Every weight of a model of `cfg` by module path (scanned layout: layers stacked), at
    the checkpoint's sizes (one device: no KV head repeated, no vocabulary padding)."""
    _, specs = _float_specs(cfg, make_mesh(jax.devices()[:1]), jnp.dtype(jnp.float32), False)
    return MappingProxyType({path: spec.shape for path, spec in specs.items()})


def model_weight_specs(cfg: ModelConfig, mesh: Mesh, *, dtype: jnp.dtype = jnp.float32,
                       expert_parallel: bool = False,
                       quantization: str | WeightFormat | None = None
                       ) -> tuple[TPLayout, dict[Path, jax.ShapeDtypeStruct]]:
    """The layout of a model of `cfg` on `mesh`, and each of its weights' shape, dtype and
    sharding (scanned layout; a quantized matrix's values at its float path, its scales at
    `jaxengine.model.quant.scale_name`'s)."""
    if weight_format(quantization) is None:
        layout, specs = _float_specs(cfg, mesh, jnp.dtype(dtype), expert_parallel)
        return layout, dict(specs)
    return _specs(cfg, mesh, jnp.dtype(dtype), expert_parallel, quantization)


# A float model's specs are traced once in a process, not at each ask: a load asks for its
# shapes (the source's names, the loader's) and for its shardings, and on one device in float32
# both are one trace of the whole model (docs/BENCHMARKS.md §14).
@functools.lru_cache(maxsize=16)
def _float_specs(cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, expert_parallel: bool
                 ) -> tuple[TPLayout, Mapping[Path, jax.ShapeDtypeStruct]]:
    """`_specs` of a float model, its specs read-only."""
    layout, specs = _specs(cfg, mesh, dtype, expert_parallel, None)
    return layout, MappingProxyType(specs)


def _specs(cfg: ModelConfig, mesh: Mesh, dtype: jnp.dtype, expert_parallel: bool,
           quantization: str | WeightFormat | None
           ) -> tuple[TPLayout, dict[Path, jax.ShapeDtypeStruct]]:
    """`model_weight_specs`, traced now."""
    abstract = nnx.eval_shape(lambda: Model(cfg, dtype=dtype, scan_layers=True, mesh=mesh,
                                            expert_parallel=expert_parallel,
                                            quantization=quantization))
    state = nnx.state(abstract, nnx.Param)
    shardings = dict(nnx.to_flat_state(nnx.get_named_sharding(state, mesh)))
    return abstract.layout, {
        path: jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype,
                                   sharding=shardings[path].get_value())
        for path, var in nnx.to_flat_state(state)}


def to_layout(path: Path, host: np.ndarray, layout: TPLayout, head_dim: int, *,
              out_axis: int = -1) -> np.ndarray:
    """A weight at the checkpoint's sizes laid out as the model on a mesh holds it.

    k/v projections repeat each head `kv_repeat` times in place along their output axis
    (a float kernel [..., K*H] and bias [..., K*H]); the embedding [V, ...] and the LM head
    (vocabulary on its output axis) get zero vocabulary entries up to V'. Anything else, and
    everything at tp=1, is returned as it is.

    Args:
        out_axis: the weight's output axis: -1 for floats ([..., in, out]), -2 for GGUF rows
            of blocks ([..., out, row_bytes], whose zero blocks are zeros too).
    """
    out = out_axis % host.ndim
    if len(path) >= 2 and path[-2] in ("k_proj", "v_proj") and layout.kv_repeat > 1:
        heads = host.reshape(*host.shape[:out], -1, head_dim, *host.shape[out + 1:])
        return np.repeat(heads, layout.kv_repeat, axis=out).reshape(
            *host.shape[:out], -1, *host.shape[out + 1:])
    axis = {("embed_tokens", "embedding"): 0, ("lm_head", "kernel"): out}.get(tuple(path))
    if axis is not None and host.shape[axis] < layout.vocab_size:
        pad = [(0, 0)] * host.ndim
        pad[axis] = (0, layout.vocab_size - host.shape[axis])
        return np.pad(host, pad)
    return host


def _read(source: TensorSource, name: str, transpose: bool, target: tuple[int, ...],
          where: str) -> np.ndarray:
    """One checkpoint tensor in our layout `target`, checked against the shape it implies."""
    arr = source.get(name)
    if arr is None:
        raise ModelLoadError(f"{where}: tensor {name} is missing; the checkpoint is "
                             "incomplete or its architecture does not match config")
    expected = target[::-1] if transpose else target
    if tuple(arr.shape) != expected:
        raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(arr.shape)}, but the "
                             f"config implies {expected}; the weights do not match the config")
    return arr.T if transpose else arr


def stacked_tensors(name: str, shape: tuple[int, ...], lacks: Callable[[int], bool]
                    ) -> list[tuple[int, int | None, str]]:
    """(layer, expert or None, checkpoint name) of each tensor behind a stacked weight
    `shape` [layers, (experts,) ...] named `name` (`{layer}`, `{expert}`), the layers for which
    `lacks(layer)` left out (a mixed stack's layer of the other kind)."""
    experts = range(shape[1]) if "{expert}" in name else [None]
    return [(layer, e, name.format(layer=layer, expert=e)) for layer in range(shape[0])
            if not lacks(layer) for e in experts]


def load_weight(path: Path, name: str, shape: tuple[int, ...], source: TensorSource,
                dtype: jnp.dtype, where: str, on_tensor: Callable[[], object] = lambda: None,
                lacks: Callable[[int], bool] = lambda layer: False) -> np.ndarray:
    """The weight at module `path`, checkpoint tensor `name` (`{layer}` for each layer,
    `{expert}` for each expert), assembled on the host in `dtype` (layers on axis 0, then
    experts).

    `on_tensor()` is called after each checkpoint tensor is read (a progress bar's tick);
    a layer for which `lacks(layer)` holds zeros (a mixed stack's layer of the other kind).
    """
    transpose = path[-1] == "kernel" or "{expert}" in name  # HF stores each matrix [out, in]
    if path[0] != "layers":
        out = _read(source, name, transpose, shape, where).astype(dtype)
        on_tensor()
        return out
    out = np.zeros(shape, dtype)
    for layer, e, tensor in stacked_tensors(name, shape, lacks):
        target = out[layer] if e is None else out[layer, e]
        target[...] = _read(source, tensor, transpose, target.shape, where)
        on_tensor()
    return out


def load_weights(cfg: ModelConfig, source: TensorSource, *, dtype: jnp.dtype, where: str,
                 mesh: Mesh | None = None, progress: bool | None = None,
                 expert_parallel: bool = False,
                 quantization: str | WeightFormat | None = None,
                 cache: WeightCache | None = None) -> dict[Path, jax.Array]:
    """All weights of `cfg` as device arrays in `dtype`, by module path, one at a time.

    With `quantization` each matrix the format holds quantized is read in float32, laid out,
    and quantized on the host (`WeightFormat.host_weights`) before its arrays go to the
    devices, so no device ever holds it in float.

    Args:
        cfg: the architecture (decides which tensors exist and their shapes).
        source: checkpoint tensors by HF name.
        dtype: target dtype (float32 or bfloat16).
        where: path shown in error messages.
        mesh: the model's devices (`jaxengine.make_mesh`); default: jax's first one.
        progress: a tqdm bar over the checkpoint's tensors; None: only when stderr is a
            terminal (tqdm's rule), so server logs and captured output get none.
        expert_parallel: lay a MoE model's experts out whole over the mesh (as `Model`'s).
        quantization: the weight format (`Model`'s): None (float), "int8", "fp8", or a
            GGUF file's format (`jaxengine.loading.gguf_weights.gguf_format`).
        cache: where the weights `load_weight` assembles are read from when held, and saved
            to when not (jaxengine/loading/weight_cache.py); None: always from `source`.
    Returns:
        Arrays by module path in the scanned layout, laid out and sharded for a model on
        `mesh`, for `Model(cfg, weights=..., mesh=mesh, quantization=quantization)`.
    Raises:
        ModelLoadError: a tensor is missing or has the wrong shape.
        ValueError: the model cannot be split over the mesh's tp size, or an unknown
            `quantization`.
    """
    np_dtype = jnp.dtype(dtype)
    shapes = model_weight_shapes(cfg)
    fam = family(cfg.architecture)
    names = fam.hf_names(cfg)
    unmapped = shapes.keys() - names.keys()
    if unmapped:  # a module gained a weight the table does not know: a bug here, not user error
        raise RuntimeError(f"no checkpoint name for model weights {sorted(unmapped)}")
    fmt = weight_format(quantization)
    layout, specs = model_weight_specs(cfg, mesh or make_mesh(jax.devices()[:1]),
                                       dtype=np_dtype, expert_parallel=expert_parallel,
                                       quantization=quantization)
    paths = [p for p in names if p in shapes]
    lacks = {p: functools.partial(fam.layer_lacks, cfg, p) for p in paths}
    total = sum(len(stacked_tensors(names[p], shapes[p], lacks[p])) if p[0] == "layers" else 1
                for p in paths)
    weights = {}
    with tqdm(total=total, desc="loading weights", unit="tensor",
              disable=None if progress is None else not progress) as bar:
        for path in paths:
            # A weight the model holds in another dtype than its own is the format's: read as
            # the format holds it, or else in float32 and quantized from that.
            quantized = fmt is not None and specs[path].dtype != np_dtype
            arrays = None if not quantized else fmt.read_host(
                path, names[path], shapes[path], layout, lacks=lacks[path],
                on_tensor=bar.update)
            if arrays is None:
                host_dtype = np.dtype(np.float32) if quantized else np_dtype
                host = None if cache is None else cache.get(path, shapes[path], host_dtype)
                if host is None:
                    host = load_weight(path, names[path], shapes[path], source, host_dtype,
                                       where, on_tensor=bar.update, lacks=lacks[path])
                    if cache is not None:
                        cache.put(path, host)
                else:
                    bar.update(len(stacked_tensors(names[path], shapes[path], lacks[path]))
                               if path[0] == "layers" else 1)
                host = to_layout(path, host, layout, cfg.head_dim)
                arrays = fmt.host_weights(path, host, specs[path]) if quantized else {path: host}
                del host
            for key, array in arrays.items():
                weights[key] = _to_devices(array, specs[key])
            del arrays  # the devices' shards are the only copy kept
    return weights


def _to_devices(host: np.ndarray, spec: jax.ShapeDtypeStruct) -> jax.Array:
    """`host` copied to each device of `spec.sharding` as its shard, nothing more."""
    if host.shape != spec.shape or host.dtype != spec.dtype:  # a format's bug, not user error
        raise RuntimeError(f"loaded {host.shape} {host.dtype}, the model holds {spec.shape} "
                           f"{spec.dtype}")
    # dtype: a process holding none of the shards (multi-host) calls no callback at all
    return jax.make_array_from_callback(host.shape, spec.sharding,
                                        lambda index: host[index], dtype=host.dtype)
