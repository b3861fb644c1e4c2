"""Model configuration: one frozen, validated `ModelConfig` for the Llama family.

Covers Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3
(q/k RMSNorm), read from an HF `config.json` dict or from GGUF metadata. Anything else raises
`ModelLoadError` naming the architecture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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

    # ---- readers -------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json`.

        Raises:
            ModelLoadError: unsupported architecture or feature, or a missing field.
        """
        arch = str(cfg.get("model_type", "")).lower()
        if arch not in SUPPORTED_ARCHITECTURES:
            names = cfg.get("architectures") or [arch or "<no model_type>"]
            raise ModelLoadError(f"unsupported architecture {names[0]!r} "
                                 f"(model_type={arch!r}); supported model_type values: "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("mlp_bias") or (arch != "qwen2" and cfg.get("attention_bias")):
            raise ModelLoadError(f"{arch}: mlp_bias / attention_bias=True is not supported")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(
                architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=_hf_rope_theta(cfg), rope_scaling=_hf_rope_scaling(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                sliding_window=_hf_sliding_window(cfg, arch))
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, tied: bool) -> ModelConfig:
        """Build from GGUF key/value metadata (`general.architecture`, `<arch>.block_count`...).

        Args:
            meta: GGUF fields as plain Python values.
            tied: whether the file lacks a separate `output.weight` (tied embeddings).
        """
        arch = str(meta.get("general.architecture", "<missing general.architecture>"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete")
            return value

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = None
        if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
            scaling = RopeScaling(kind=str(get("rope.scaling.type")),
                                  factor=float(get("rope.scaling.factor")))
        return cls(
            architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")), num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=_f32_value(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_f32_value(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=tied, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")


def _f32_value(x: Any) -> float:
    # GGUF stores these as float32 (1e-5 reads back as 9.99999974e-06): keep 7 digits.
    return float(f"{float(x):.7g}")


def _hf_rope_theta(cfg: Mapping[str, Any]) -> float:
    # transformers >= 5 nests rope_theta under rope_parameters; older configs keep it on top.
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _hf_rope_scaling(cfg: Mapping[str, Any]) -> RopeScaling | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"rope scaling type {kind!r} is not supported "
                             "(supported: 'llama3', 'linear', or none)")
    extra = {}
    if kind == "llama3":
        extra = dict(low_freq_factor=float(scaling["low_freq_factor"]),
                     high_freq_factor=float(scaling["high_freq_factor"]),
                     original_max_position_embeddings=int(
                         scaling["original_max_position_embeddings"]))
    return RopeScaling(kind=kind, factor=float(scaling["factor"]), **extra)


def _hf_sliding_window(cfg: Mapping[str, Any], arch: str) -> int | None:
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None
