"""`SchedulerConfig`: every knob of the scheduler, validated on construction
(docs/SCHEDULING.md §2).
"""

import dataclasses
import warnings
from dataclasses import dataclass

from scheduler.kv.groups import FULL_ATTENTION, KVCacheGroup
from scheduler.policies.policies import POLICIES


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Frozen scheduler configuration with vLLM's names and defaults.

    Raises:
        ValueError: for inconsistent values; the message names them.
    """

    max_num_batched_tokens: int = 2048  # tokens one iteration may process (runner capacity)
    max_num_scheduled_tokens: int | None = None  # per-step hand-out; None -> batched tokens
    max_num_seqs: int = 128  # most requests in RUNNING at once
    max_model_len: int = 8192  # longest sequence, prompt + output
    enable_chunked_prefill: bool = True  # a prompt may be computed over several steps
    long_prefill_token_threshold: int = 0  # most tokens one request gets per step (0 = off)
    max_num_partial_prefills: int = 1  # > 1 turns on concurrent partial prefill limits (§6)
    max_long_partial_prefills: int = 1  # of those, most "long" ones at once
    policy: str = "fcfs"  # a name registered in scheduler.POLICIES
    block_size: int = 16  # tokens per KV block
    num_blocks: int  # KV blocks in the pool, including the reserved null block 0
    enable_prefix_caching: bool = True  # automatic prefix caching (§5)
    reserve_full_prompt: bool = True  # admit only if the whole sequence's blocks are free
    watermark: float = 0.0  # fraction of blocks kept free when admitting
    async_scheduling: bool = False  # schedule the next step before this one's tokens (§4.1)
    # The model's KV cache groups, in the runner's order (§13); one full group: no windows
    kv_cache_groups: tuple[KVCacheGroup, ...] = (FULL_ATTENTION,)
    # Most distinct LoRA adapters in one step (§14); None or 0: LoRA off, adapters refused
    max_loras: int | None = None

    def __post_init__(self) -> None:
        _validate(self)
        if self.max_num_scheduled_tokens is None:
            object.__setattr__(self, "max_num_scheduled_tokens", self.max_num_batched_tokens)
        if self.max_num_partial_prefills > 1 and self.long_prefill_token_threshold == 0:
            object.__setattr__(
                self, "long_prefill_token_threshold", int(self.max_model_len * 0.04)
            )

    def replace(self, **changes) -> "SchedulerConfig":
        """A copy with `changes` applied (and validated again). A `max_num_scheduled_tokens`
        that defaulted to the batched budget follows a changed budget."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if fields["max_num_scheduled_tokens"] == self.max_num_batched_tokens:
            fields["max_num_scheduled_tokens"] = None
        return SchedulerConfig(**(fields | changes))


def _validate(c: SchedulerConfig) -> None:
    for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len"):
        if getattr(c, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {name}={getattr(c, name)}")
    if c.max_num_scheduled_tokens is not None and not (
        1 <= c.max_num_scheduled_tokens <= c.max_num_batched_tokens
    ):
        change = ("the scheduler cannot hand out more tokens than a step takes: lower "
                  "max_num_scheduled_tokens (or leave it unset) or raise max_num_batched_tokens"
                  if c.max_num_scheduled_tokens > c.max_num_batched_tokens
                  else "set it to at least 1 (or leave it unset)")
        raise ValueError(
            f"max_num_scheduled_tokens={c.max_num_scheduled_tokens} must be in "
            f"[1, max_num_batched_tokens={c.max_num_batched_tokens}]; {change}"
        )
    if not c.enable_chunked_prefill and c.max_num_batched_tokens < c.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={c.max_num_batched_tokens} is smaller than "
            f"max_model_len={c.max_model_len} while chunked prefill is off: the longest prompt "
            "could never be scheduled. Raise max_num_batched_tokens, lower max_model_len or set "
            "enable_chunked_prefill=True."
        )
    if (not c.enable_chunked_prefill and c.max_num_scheduled_tokens is not None
            and c.max_num_scheduled_tokens < c.max_model_len):
        raise ValueError(
            f"max_num_scheduled_tokens={c.max_num_scheduled_tokens} is smaller than "
            f"max_model_len={c.max_model_len} while chunked prefill is off: the longest prompt "
            "could never be scheduled. Raise max_num_scheduled_tokens (or leave it unset), "
            "lower max_model_len or set enable_chunked_prefill=True."
        )
    if c.max_num_batched_tokens < c.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens={c.max_num_batched_tokens} must be >= "
            f"max_num_seqs={c.max_num_seqs} (every running request needs a token per step)"
        )
    if c.long_prefill_token_threshold < 0 or c.long_prefill_token_threshold > c.max_model_len:
        raise ValueError(
            f"long_prefill_token_threshold={c.long_prefill_token_threshold} must be in "
            f"[0, max_model_len={c.max_model_len}]"
        )
    if c.max_num_partial_prefills < 1 or c.max_long_partial_prefills < 1:
        raise ValueError(
            f"max_num_partial_prefills={c.max_num_partial_prefills} and "
            f"max_long_partial_prefills={c.max_long_partial_prefills} must be >= 1"
        )
    if c.max_num_partial_prefills > 1 and not c.enable_chunked_prefill:
        raise ValueError(
            f"max_num_partial_prefills={c.max_num_partial_prefills} > 1 needs "
            "enable_chunked_prefill=True"
        )
    if c.max_long_partial_prefills > c.max_num_partial_prefills:
        raise ValueError(
            f"max_long_partial_prefills={c.max_long_partial_prefills} must be <= "
            f"max_num_partial_prefills={c.max_num_partial_prefills}"
        )
    if c.policy not in POLICIES:
        raise ValueError(f"unknown policy={c.policy!r}; known: {sorted(POLICIES)}")
    if not 0.0 <= c.watermark < 1.0:
        raise ValueError(f"watermark={c.watermark} must be in [0, 1)")
    groups = c.kv_cache_groups
    if (not isinstance(groups, tuple) or not groups
            or not all(isinstance(g, KVCacheGroup) for g in groups)):
        raise ValueError(f"kv_cache_groups={groups!r} must be a non-empty tuple of "
                         "KVCacheGroup, e.g. (KVCacheGroup(), KVCacheGroup(sliding_window=512))")
    if c.max_loras is not None and (type(c.max_loras) is not int or c.max_loras < 0):
        raise ValueError(f"max_loras={c.max_loras!r} must be None or an int >= 0 "
                         "(None or 0: LoRA off)")
    if c.max_num_batched_tokens > c.max_num_seqs * c.max_model_len:
        warnings.warn(
            f"max_num_batched_tokens={c.max_num_batched_tokens} exceeds max_num_seqs * "
            f"max_model_len = {c.max_num_seqs} * {c.max_model_len}: part of the budget can "
            "never be used",
            stacklevel=4,
        )
