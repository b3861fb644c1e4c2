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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.decoder import Model
from jaxengine.model.families import family
from jaxengine.model.families.family import Path
from jaxengine.model.mesh import make_mesh
from jaxengine.model.tensor_parallel import TPLayout


class TensorSource(Protocol):
    """Checkpoint tensors by HF name, in HF layout (float or bf16 numpy)."""

    def get(self, name: str) -> np.ndarray | None: ...


def model_weight_shapes(cfg: ModelConfig) -> dict[Path, tuple[int, ...]]:
    """Every weight of a model of `cfg` by module path (scanned layout: layers stacked), at
    the checkpoint's sizes (one device: no KV head repeated, no vocabulary padding)."""
    abstract = nnx.eval_shape(lambda: Model(cfg, scan_layers=True))
    return {path: tuple(var.get_value().shape)
            for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def model_weight_shardings(cfg: ModelConfig, mesh: Mesh, *, expert_parallel: bool = False
                           ) -> tuple[TPLayout, dict[Path, NamedSharding]]:
    """The layout of a model of `cfg` on `mesh`, and each weight's sharding (scanned layout)."""
    abstract = nnx.eval_shape(lambda: Model(cfg, scan_layers=True, mesh=mesh,
                                            expert_parallel=expert_parallel))
    shardings = nnx.get_named_sharding(nnx.state(abstract, nnx.Param), mesh)
    return abstract.layout, {path: s.get_value() for path, s in nnx.to_flat_state(shardings)}


def to_layout(path: Path, host: np.ndarray, layout: TPLayout, head_dim: int) -> np.ndarray:
    """A weight at the checkpoint's sizes laid out as the model on a mesh holds it.

    k/v projections (kernel [..., K*H] and bias [..., K*H]) repeat each head `kv_repeat`
    times in place; the embedding [V, D] and the LM head [D, V] get zero vocabulary entries
    up to V'. Anything else, and everything at tp=1, is returned as it is.
    """
    if len(path) >= 2 and path[-2] in ("k_proj", "v_proj") and layout.kv_repeat > 1:
        heads = host.reshape(*host.shape[:-1], -1, head_dim)
        return np.repeat(heads, layout.kv_repeat, axis=-2).reshape(*host.shape[:-1], -1)
    axis = {("embed_tokens", "embedding"): 0, ("lm_head", "kernel"): 1}.get(tuple(path))
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
                 expert_parallel: bool = False) -> dict[Path, jax.Array]:
    """All weights of `cfg` as device arrays in `dtype`, by module path, one at a time.

    Args:
        cfg: the architecture (decides which tensors exist and their shapes).
        source: checkpoint tensors by HF name.
        dtype: target dtype (float32 or bfloat16).
        where: path shown in error messages.
        mesh: the model's devices (`jaxengine.make_mesh`); default: jax's first one.
        progress: a tqdm bar over the checkpoint's tensors; None: only when stderr is a
            terminal (tqdm's rule), so server logs and captured output get none.
        expert_parallel: lay a MoE model's experts out whole over the mesh (as `Model`'s).
    Returns:
        Arrays by module path in the scanned layout, laid out and sharded for a model on
        `mesh`, for `Model(cfg, weights=..., mesh=mesh)`.
    Raises:
        ModelLoadError: a tensor is missing or has the wrong shape.
        ValueError: the model cannot be split over the mesh's tp size.
    """
    np_dtype = jnp.dtype(dtype)
    shapes = model_weight_shapes(cfg)
    fam = family(cfg.architecture)
    names = fam.hf_names(cfg)
    unmapped = shapes.keys() - names.keys()
    if unmapped:  # a module gained a weight the table does not know: a bug here, not user error
        raise RuntimeError(f"no checkpoint name for model weights {sorted(unmapped)}")
    layout, shardings = model_weight_shardings(cfg, mesh or make_mesh(jax.devices()[:1]),
                                               expert_parallel=expert_parallel)
    paths = [p for p in names if p in shapes]
    lacks = {p: functools.partial(fam.layer_lacks, cfg, p) for p in paths}
    total = sum(len(stacked_tensors(names[p], shapes[p], lacks[p])) if p[0] == "layers" else 1
                for p in paths)
    weights = {}
    with tqdm(total=total, desc="loading weights", unit="tensor",
              disable=None if progress is None else not progress) as bar:
        for path in paths:
            host = to_layout(path, load_weight(
                path, names[path], shapes[path], source, np_dtype, where, on_tensor=bar.update,
                lacks=lacks[path]), layout, cfg.head_dim)
            # dtype: a process holding none of the shards (multi-host) calls no callback at all
            weights[path] = jax.make_array_from_callback(
                host.shape, shardings[path], lambda index, host=host: host[index],
                dtype=host.dtype)
            del host  # the devices' shards are the only copy kept
    return weights
