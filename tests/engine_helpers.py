"""`engine_over`: an `LLMEngine` over a model already in hand (the fake model, or a real one
loaded once for many engines), its arguments resolved by `create_engine_config`."""

from __future__ import annotations

import dataclasses

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.engine_config import create_engine_config
from jaxengine.engine.inputs import TokenizerLike
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.model.fns import ModelFns


def engine_over(model: ModelFns, args: EngineArgs, *, tokenizer: TokenizerLike | None,
                max_model_len: int, num_blocks: int, draft: ModelFns | None = None
                ) -> LLMEngine:
    """An engine over `model` (and the `draft` model, for speculative method "draft_model"),
    `args` resolved with `max_model_len` as the model's limit and a pool of `num_blocks` pages
    (the null block included).

    The pool may hold less than one request of max_model_len tokens, which
    `create_engine_config` refuses for a real engine: tests that preempt use such pools, so
    the pool is set after the resolution.
    """
    config = create_engine_config(
        dataclasses.replace(args, num_gpu_blocks_override=None, kv_cache_memory_bytes=None),
        model_max_model_len=max_model_len,
        kv_bytes_per_block=model.kv_bytes_per_block(args.block_size),
        device_kv_budget_bytes=1 << 50, kv_cache_groups=model.kv_cache_groups)
    config = dataclasses.replace(config,
                                 scheduler=config.scheduler.replace(num_blocks=num_blocks))
    return LLMEngine(model, args, config, tokenizer=tokenizer, draft=draft)
