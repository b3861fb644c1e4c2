"""What a model family is to the engine: its decoder block, its config fields, its tensor names.

A family is one module in this package that builds a `Family` and is listed in the registry
(`jaxengine/model/families/__init__.py`). The decoder (jaxengine/model/decoder.py) is common:
embedding, a stack of the family's blocks, final norm, LM head; a family brings the block and
says how its checkpoints name the weights and which config fields it reads beyond the common
ones. Axes as in jaxengine/model/layers.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxengine.model.batch import ModelBatch
from jaxengine.model.config import ModelConfig, ModelLoadError
from jaxengine.model.lora import LayerLoRA
from jaxengine.model.tensor_parallel import TPLayout

Path = tuple[str | int, ...]  # a weight's module path, e.g. ("layers", "mlp", "up_proj", "kernel")
Get = Callable[..., Any]  # a config reader's `get(key, default=None)`: a field's value


class DecoderBlock(Protocol):
    """One decoder layer: x [T, D] and its pages in, x [T, D] and the updated pages out.

    `layer` is the layer's index: a Python int when the layers are looped, an i32[] when they
    are scanned; what differs between layers (a window, a routed or dense FFN) the block reads
    from the config with `jaxengine.model.layers.per_layer`. `lora` is the layer's adapter
    slots with the tokens' adapters (jaxengine/model/lora.py), for its projections.
    """

    def __call__(self, x: jax.Array, pages: jax.Array, page_offset: jax.Array | int,
                 batch: ModelBatch, cos: jax.Array, sin: jax.Array,
                 layer: jax.Array | int, *, attn_impl: str, interpret: bool = False,
                 batch_invariant: bool = False, kv_cache_dtype: jnp.dtype | None = None,
                 lora: LayerLoRA | None = None) -> tuple[jax.Array, jax.Array]: ...


class BlockFactory(Protocol):
    """A family's block constructor (its weights created where their sharding is declared)."""

    def __call__(self, cfg: ModelConfig, layout: TPLayout, *, mesh: Mesh, dtype: jnp.dtype,
                 rngs: nnx.Rngs) -> nnx.Module: ...


def _no_fields(get: Get) -> dict[str, Any]:
    del get  # a family without fields of its own
    return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """A decoder family, registered under the HF `model_type`s it reads.

    Attributes:
        model_types: HF `model_type` values (e.g. "gemma3_text", "gemma3").
        block: the decoder layer's constructor.
        hf_names: module path (scanned layout, "layers" stacked) -> HF tensor name, with
            `{layer}` for the layer index and `{expert}` for the expert's (a weight stacked
            [layers, experts, ...] from one tensor per expert); a function of the config.
        hf_fields: the ModelConfig fields beyond the common ones, read from an HF config
            (`get(attribute, default)`); refuses a value it does not implement.
        gguf_archs: GGUF `general.architecture` values this family reads, -> model_type.
        gguf_expert_archs: GGUF architectures of another family under which llama.cpp also
            writes this family's models, told apart by `{arch}.expert_count` > 0 (Mixtral
            is written as "llama"), -> model_type.
        gguf_fields: as `hf_fields`, from GGUF metadata (`get(key, default)` by full key).
        gguf_permuted: the model_types whose Q/K rows llama.cpp stores permuted for its
            interleaved RoPE.
        norm_offset: RMSNorm scales by (offset + weight) (Gemma: 1), in float32.
        embed_scale: embeddings are multiplied by sqrt(hidden_size) (Gemma).
        text_config: the text decoder's config inside a multimodal one (Gemma 3); None when
            the config is the decoder's.
        layer_lacks: whether layer `layer` has no checkpoint tensor for the stacked weight at
            `path` (a layer of another kind in a mixed stack: the weight holds zeros there).
    """

    model_types: tuple[str, ...]
    block: BlockFactory
    hf_names: Callable[[ModelConfig], Mapping[Path, str]]
    hf_fields: Callable[[Get], dict[str, Any]] = _no_fields
    gguf_archs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_expert_archs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_fields: Callable[[Get], dict[str, Any]] = _no_fields
    gguf_permuted: tuple[str, ...] = ()
    norm_offset: float = 0.0
    embed_scale: bool = False
    text_config: Callable[[Any], Any] | None = None
    layer_lacks: Callable[[ModelConfig, Path, int], bool] = lambda cfg, path, layer: False


def refuse(field: str, value: Any, why: str) -> ModelLoadError:
    """The error for a config field whose value is not implemented, naming both."""
    return ModelLoadError(f"config field {field}={value!r} is not supported: {why}")


def layer_names(names: Mapping[str, str], prefix: str = "model.layers.{layer}.") -> dict[Path, str]:
    """`{"self_attn.q_proj.kernel": "self_attn.q_proj.weight", ...}` -> paths under "layers"
    mapped to `prefix + name`."""
    return {("layers", *path.split(".")): prefix + hf for path, hf in names.items()}
