"""How a model is laid out over the "tp" axis: which sizes grow so that every device gets an
equal part, and the refusals for shapes that cannot be split.

vLLM's rules: query heads and the MLP width split evenly (tp must divide them). KV heads split
when tp divides K; when K divides tp (tp > K), each KV head is repeated tp/K times so that every
device holds the one KV head its query heads read (tp heads in all, one per device); other
combinations are refused. The vocabulary is padded up to a multiple of tp (zero embedding rows,
whose logits are cut off before sampling).
"""

from __future__ import annotations

import dataclasses

from jaxengine.model.config import ModelConfig


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TPLayout:
    """Sizes of the model as laid out over `tp` devices (tp=1: the checkpoint's own)."""

    tp: int  # devices on the "tp" axis
    num_kv_heads: int  # K': KV heads in the k/v projections and the cache, max(K, tp)
    kv_repeat: int  # K' / K: copies of each checkpoint KV head (1 unless tp > K)
    vocab_size: int  # V': the vocabulary padded to a multiple of tp (embedding, LM head)
    expert_parallel: bool = False  # experts split whole over tp, not their width

    @property
    def kv_heads_per_device(self) -> int:
        """KV heads (K and V each) one device holds: K' / tp."""
        return self.num_kv_heads // self.tp


def tp_layout(cfg: ModelConfig, tp: int, *, expert_parallel: bool = False) -> TPLayout:
    """The layout of a model of `cfg` over `tp` devices; `expert_parallel` splits a MoE
    model's experts whole over tp (jaxengine/model/moe.py checks the expert sizes).

    Raises:
        ValueError: tp does not divide num_heads or a dense MLP's intermediate_size, or
            neither of tp and num_kv_heads divides the other, or expert parallelism for a
            dense model; the message names the field.
    """
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if expert_parallel and not cfg.num_experts:
        raise ValueError("enable_expert_parallel is for mixture-of-experts models; this "
                         f"{cfg.architecture} model has no experts")
    N, K, F = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    valid = ", ".join(map(str, valid_tp_sizes(cfg)))
    dense = {"intermediate_size": F} if not all(cfg.layer_sparse) else {}
    for name, size in {"num_heads": N, **dense}.items():
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                             f"{name}={size}; this model takes tensor_parallel_size {valid}")
    if K % tp and tp % K:
        raise ValueError(
            f"tensor_parallel_size={tp} and the model's num_kv_heads={K}: one must divide the "
            f"other (KV heads are split, or replicated when tensor_parallel_size > "
            f"num_kv_heads); this model takes tensor_parallel_size {valid}")
    kv_heads = max(K, tp)
    vocab = -(-cfg.vocab_size // tp) * tp
    return TPLayout(tp=tp, num_kv_heads=kv_heads, kv_repeat=kv_heads // K, vocab_size=vocab,
                    expert_parallel=expert_parallel)


def valid_tp_sizes(cfg: ModelConfig, *, up_to: int = 64) -> list[int]:
    """The tensor_parallel_size values (<= `up_to`) a model of `cfg` can be split over."""
    K = cfg.num_kv_heads
    return [t for t in range(1, up_to + 1)
            if cfg.num_heads % t == 0 and cfg.intermediate_size % t == 0
            and (K % t == 0 or t % K == 0)]
