"""Model configuration: one frozen, validated `ModelConfig` for the Llama family.

Covers Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3
(q/k RMSNorm); any other architecture raises `ModelLoadError` naming it. This is the schema
only: the readers that fill it live with the formats, `jaxengine/loading/hf.py` (an HF
`config.json`, through transformers' `AutoConfig`) and `jaxengine/loading/gguf_file.py` (GGUF
metadata).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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
    """Shape and numerics of a Llama-family decoder.

    Axis names used across the model: D hidden, N query heads, K kv heads, H head dim,
    F MLP width, V vocab.
    """

    architecture: str  # one of SUPPORTED_ARCHITECTURES
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
    sliding_window: int | None = None  # Mistral; not applied: cap max_model_len to it

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {self.architecture!r}; "
                                 f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
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

    @property
    def max_model_len(self) -> int:
        """Longest context computed exactly: the position limit, capped by a sliding window
        (attention here is full, so past the window it would differ from the reference)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def num_params(self) -> int:
        """Number of weights (embedding counted once when tied)."""
        D, F, N, K, H = (self.hidden_size, self.intermediate_size, self.num_heads,
                         self.num_kv_heads, self.head_dim)
        per_layer = 2 * D + D * (N + 2 * K) * H + N * H * D + 3 * D * F
        per_layer += (N + 2 * K) * H if self.qkv_bias else 0
        per_layer += 2 * H if self.qk_norm else 0
        heads = 0 if self.tie_word_embeddings else self.vocab_size * D
        return self.vocab_size * D + D + heads + self.num_layers * per_layer

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
