"""Model configuration: one frozen, validated `ModelConfig` for every decoder family.

The schema only: which families exist (`architecture`, an HF `model_type`) is the registry's
(jaxengine/model/families/), and the readers that fill a config live with the formats,
`jaxengine/loading/hf.py` (an HF `config.json`, through transformers' `AutoConfig`, with each
family's own fields read by its module) and `jaxengine/loading/gguf_file.py` (GGUF metadata).
Per-layer attention (a sliding window on some layers, their own RoPE base) is data here
(`layer_types`), so one compiled scan runs layers that differ only in it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types values
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation, by HF name


class ModelLoadError(ValueError):
    """A model cannot be built or loaded; the message says what to change."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (Llama 3.1+); `kind="linear"` divides positions."""

    kind: str  # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear"):
            raise ModelLoadError(f"rope scaling type {self.kind!r} is not supported "
                                 "(supported: 'llama3', 'linear', or none)")
        if self.factor <= 0:
            raise ModelLoadError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder.

    Axis names used across the model: D hidden, N query heads, K kv heads, H head dim,
    F MLP width, V vocab, W sliding window.
    """

    architecture: str  # the family's model_type (jaxengine/model/families)
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K; N % K == 0 (grouped-query attention)
    head_dim: int  # H
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    # W: a query at position p sees keys p-W < k <= p on its sliding layers
    sliding_window: int | None = None
    # per layer FULL or SLIDING; None: every layer slides when sliding_window is set (Mistral)
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    hidden_act: str = "silu"  # one of ACTIVATIONS
    # Mixture of experts (0 experts: dense). Routed layers replace the MLP by E experts of
    # width moe_intermediate_size, k per token; intermediate_size is the dense layers' width.
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the k routing weights (Mixtral: always)
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's gated shared expert
    # per layer: routed (True) or a dense MLP; None: every layer routed when num_experts > 0
    sparse_layers: tuple[bool, ...] | None = None
    # per layer (k_scale, v_scale): an fp8 KV cache holds k / k_scale and v / v_scale (the
    # checkpoint's scalars, jaxengine/loading/kv_scales.py); None: 1.0, as vLLM's default
    kv_scales: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads={self.num_heads} must be a multiple of "
                                 f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ModelLoadError(f"rms_norm_eps={self.rms_norm_eps} and "
                                 f"rope_theta={self.rope_theta} must be > 0")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"hidden_act={self.hidden_act!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        for name in ("sliding_window", "rope_local_theta", "attn_scale", "attn_softcap",
                     "final_softcap"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ModelLoadError(f"{name} must be > 0 or absent, got {value}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ModelLoadError(f"num_experts_per_tok={self.num_experts_per_tok} must be "
                                     f"between 1 and num_experts={self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ModelLoadError(f"moe_intermediate_size must be > 0, got "
                                     f"{self.moe_intermediate_size}")
        if self.sparse_layers is not None and len(self.sparse_layers) != self.num_layers:
            raise ModelLoadError(f"sparse_layers has {len(self.sparse_layers)} entries for "
                                 f"num_layers={self.num_layers}")
        if self.kv_scales is not None:
            _check_kv_scales(self.kv_scales, self.num_layers)
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for "
                                     f"num_layers={self.num_layers}")
            bad = [t for t in self.layer_types if t not in (FULL, SLIDING)]
            if bad:
                raise ModelLoadError(f"layer_types value {bad[0]!r} is not supported "
                                     f"(supported: {FULL!r}, {SLIDING!r})")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ModelLoadError("layer_types has sliding layers but sliding_window is "
                                     "not set")

    @property
    def layer_kv_scales(self) -> tuple[tuple[float, float], ...]:
        """Each layer's (k_scale, v_scale) for an fp8 KV cache (the kernels' scales)."""
        return self.kv_scales or ((1.0, 1.0),) * self.num_layers

    @property
    def max_model_len(self) -> int:
        """Longest context: the position limit (a sliding window limits what a layer sees,
        not the context)."""
        return self.max_position_embeddings

    @property
    def layer_sparse(self) -> tuple[bool, ...]:
        """Whether each layer's FFN is the routed experts (else a dense MLP)."""
        if self.sparse_layers is not None:
            return self.sparse_layers
        return (self.num_experts > 0,) * self.num_layers

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's window W, 0 for full attention (the kernels' `sliding_window`)."""
        if self.sliding_window is None:
            return (0,) * self.num_layers
        types = self.layer_types or (SLIDING,) * self.num_layers
        return tuple(self.sliding_window if t == SLIDING else 0 for t in types)

    # ---- named presets -------------------------------------------------------------------

    @classmethod
    def tiny(cls, architecture: str = "llama", **overrides: Any) -> ModelConfig:
        """A few-thousand-parameter config for tests; `overrides` replace any field."""
        fields: dict[str, Any] = dict(
            architecture=architecture, vocab_size=128, hidden_size=32, intermediate_size=64,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
            max_position_embeddings=256, qkv_bias=architecture == "qwen2",
            qk_norm=architecture == "qwen3")
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def smollm2_135m(cls) -> ModelConfig:
        """SmolLM2-135M(-Instruct): the embedded default model."""
        return cls(architecture="llama", vocab_size=49152, hidden_size=576,
                   intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                   head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                   max_position_embeddings=8192, tie_word_embeddings=True)


def _check_kv_scales(scales: tuple[tuple[float, float], ...], num_layers: int) -> None:
    """`ModelLoadError` unless there is one (k_scale, v_scale) pair of positive finite floats per
    layer (a zero or NaN scale would turn the cache into NaN)."""
    if len(scales) != num_layers:
        raise ModelLoadError(f"kv_scales has {len(scales)} entries for num_layers={num_layers}")
    for layer, pair in enumerate(scales):
        if not all(0 < s < float("inf") for s in pair):
            raise ModelLoadError(f"layer {layer}'s KV cache scales (k_scale, v_scale) must be "
                                 f"positive and finite, got {pair}")
