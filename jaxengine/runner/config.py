"""The runner's static sizes (`RunnerConfig`) and its counters (`RunnerStats`)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxengine.config import EngineConfig
from jaxengine.runner.buckets import request_buckets, token_buckets


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerConfig:
    """Static sizes of the runner (all fixed for its lifetime): an engine's are `of` its
    `EngineConfig`, whose parts checked them; a test may give plain numbers."""

    max_num_batched_tokens: int  # largest token bucket
    max_num_seqs: int  # R, size of every request-indexed array
    max_model_len: int  # sets the block-table width
    block_size: int  # L
    num_blocks: int  # P, pages in the KV pool (block 0 is the null block)
    max_logprobs: int  # n of the top-logprobs output
    intermediate_token_buckets: bool  # add 1.5x buckets: less padding, more compiles
    debug_recompiles: bool  # raise RecompileError on a compilation after warm-up
    num_speculative_tokens: int  # K: drafts a request may verify per step (jaxengine/spec)
    # G, the model's KV cache groups: above 1 the pool is in their layout and each batch
    # carries every group's tables (jaxengine/model/kv_groups.py)
    num_kv_cache_groups: int = 1
    # LoRA (jaxengine/runner/lora_inputs.py): adapter slots beside the zero slot, and their
    # rank; 0: LoRA off, no slots and no token slots in the batch
    max_loras: int = 0
    max_lora_rank: int = 0

    @classmethod
    def of(cls, config: EngineConfig) -> RunnerConfig:
        """The runner's part of an engine's resolved configuration."""
        s = config.scheduler
        return cls(max_num_batched_tokens=s.max_num_batched_tokens,
                   max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len,
                   block_size=s.block_size, num_blocks=s.num_blocks,
                   max_logprobs=config.max_logprobs,
                   intermediate_token_buckets=config.intermediate_token_buckets,
                   debug_recompiles=config.debug_recompiles,
                   num_speculative_tokens=config.num_speculative_tokens,
                   num_kv_cache_groups=len(s.kv_cache_groups),
                   max_loras=0 if config.lora is None else config.lora.max_loras,
                   max_lora_rank=0 if config.lora is None else config.lora.max_lora_rank)

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of `block_tables`: pages of the longest sequence."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_num_rows(self) -> int:
        """Hidden rows a step keeps, the sampler's largest bucket: R * (1 + K)."""
        return self.max_num_seqs * (1 + self.num_speculative_tokens)

    def buckets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The token buckets a step is padded to, and the sampler's request buckets."""
        return (token_buckets(self.max_num_batched_tokens,
                              intermediate=self.intermediate_token_buckets),
                request_buckets(self.max_num_rows))


@dataclass(slots=True)
class RunnerStats:
    """Counters over the runner's life (host side, cheap)."""

    steps: int = 0
    computed_tokens: int = 0  # scheduled (real) tokens
    padded_tokens: int = 0  # bucket padding on top of them
    compilations: int = 0  # of the step and the sampler, during this runner's calls
    compilations_after_warmup: int = 0
    compile_seconds: float = 0.0  # precompile, plus the dispatch of every step that compiled
    step_seconds: float = 0.0  # dispatch to tokens on the host, summed over steps

    @property
    def padding_waste(self) -> float:
        """Padded tokens / computed tokens."""
        return self.padded_tokens / max(self.computed_tokens, 1)
