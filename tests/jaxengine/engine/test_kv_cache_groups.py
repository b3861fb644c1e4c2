"""The engine over a model of several KV cache groups (docs/SCHEDULING.md §13): sliding
layers give their slid-out blocks back while the tokens stay transformers'."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import attention_backend, model_fns, resolve_config
from jaxengine.engine.engine_config import create_engine_config
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.loading.load import load_model
from scheduler.kv.groups import KVCacheGroup
from tests.parallel_helpers import run_python

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"
LOGPROB_TOL = 2e-3


class UsedBlocks:
    """A stat logger: the pool's used blocks and running requests after every step."""

    def __init__(self, usable: int) -> None:
        self.usable, self.used, self.running, self.preempted = usable, [], [], 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        if iteration_stats is None:
            return
        self.used.append(round(scheduler_stats.kv_cache_usage * self.usable))
        self.running.append(scheduler_stats.num_running)
        self.preempted += iteration_stats.num_preempted_reqs


def _greedy(oracle) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=len(oracle["greedy_ids"]), logprobs=0,
                          ignore_eos=True)


def test_slid_out_blocks_go_back_to_the_pool_and_tokens_stay_transformers(caplog):
    """gemma3_text: layers (s, s, f) x 2, window 8 -> a full group and two sliding groups of
    two layers. A 40-token prompt in chunks of 16, then 11 decodes: the full group holds
    cdiv(c + n, 4) blocks and each sliding group only those after the first
    (c - 8 + 1) // 4 (c tokens computed before the step, n scheduled)."""
    oracle = np.load(TINY / "gemma3_text" / "oracle.npz")
    with caplog.at_level(logging.INFO, logger="jaxengine.engine"):
        llm = LLM(str(TINY / "gemma3_text"), skip_tokenizer_init=True, max_num_seqs=2,
                  block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=80,
                  async_scheduling=False)
    # 79 usable blocks over 64 full + 2 x (cdiv(8 - 1 + 16, 4) + 1) sliding ones per request
    assert "Maximum concurrency for 256 tokens per request: 1.01x" in caplog.text
    stats = UsedBlocks(79)
    llm.llm_engine.stat_loggers.append(stats)
    prompt = {"prompt_token_ids": oracle["input_ids"].tolist()}
    out = llm.generate([prompt], _greedy(oracle))[0].outputs[0]
    assert list(out.token_ids) == oracle["greedy_ids"].tolist()
    got = [step[t].logprob for step, t in zip(out.logprobs, out.token_ids, strict=True)]
    np.testing.assert_allclose(got, oracle["greedy_logprobs"], atol=LOGPROB_TOL, rtol=0)
    full = [4, 8, 10] + [11, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13]
    sliding = [4, 6, 4] + [3, 3, 3, 2, 3, 3, 3, 2, 3, 3, 3]
    assert stats.used == [f + 2 * s for f, s in zip(full, sliding, strict=True)][:-1] + [0]
    # Prefix caching: the same prompt again hits 9 blocks (36 tokens) in every group; the
    # sliding groups kept the blocks of positions 7 and 8 its last window needs.
    again = llm.generate([prompt], _greedy(oracle))[0]
    assert again.num_cached_tokens == 36
    assert list(again.outputs[0].token_ids) == oracle["greedy_ids"].tolist()
    # The group tables are part of every precompiled step: nothing compiled after warm-up.
    assert llm.llm_engine.runner.stats.compilations_after_warmup == 0


ON_A_MESH = """
import json
import numpy as np
from jaxengine import LLM, SamplingParams
path = "tests/fixtures/tiny/gemma3_text"
oracle = np.load(path + "/oracle.npz")
llm = LLM(path, skip_tokenizer_init=True, max_num_seqs=2, block_size=4,
          max_num_batched_tokens=16, num_gpu_blocks_override=80, tensor_parallel_size=2)
params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": oracle["input_ids"].tolist()}], params)[0].outputs[0]
kv = llm.llm_engine.runner.kv
print(json.dumps(dict(tokens=list(out.token_ids), shape=list(kv.shape),
                      shard=list(kv.addressable_shards[0].data.shape),
                      logprobs=[s[t].logprob for s, t in zip(out.logprobs, out.token_ids)])))
"""


def test_the_groups_serve_transformers_tokens_on_a_mesh():
    """tp=2: the grouped pool [2 slots, 80, 4, 2*K, H] split on its heads, one KV head each."""
    result = json.loads(run_python(ON_A_MESH, num_devices=2, timeout=300).splitlines()[-1])
    oracle = np.load(TINY / "gemma3_text" / "oracle.npz")
    assert result["tokens"] == oracle["greedy_ids"].tolist()
    np.testing.assert_allclose(result["logprobs"], oracle["greedy_logprobs"],
                               atol=LOGPROB_TOL, rtol=0)
    assert result["shape"] == [2, 80, 4, 4, 16] and result["shard"] == [2, 80, 4, 2, 16]


def _kv_facts(groups):
    return dict(model_max_model_len=256, kv_bytes_per_block=1024,
                device_kv_budget_bytes=1 << 30, kv_cache_groups=groups)


def test_what_groups_cannot_serve_is_refused_at_config_time():
    hybrid = (KVCacheGroup(), KVCacheGroup(sliding_window=8))
    with pytest.raises(ValueError, match="kv_offloading_size=1.0 is not supported"):
        create_engine_config(EngineArgs(kv_offloading_size=1.0), **_kv_facts(hybrid))
    draft = EngineArgs(speculative_config={"method": "draft_model", "model": "x",
                                           "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_model.*every\\s+layer slides"):
        create_engine_config(draft, **_kv_facts((KVCacheGroup(sliding_window=8),)))
    config = create_engine_config(EngineArgs(block_size=4), **_kv_facts(hybrid))
    assert config.scheduler.kv_cache_groups == hybrid
    # One full group of any size is today's model: offloading serves it.
    one = (KVCacheGroup(num_layers=6),)
    config = create_engine_config(EngineArgs(kv_offloading_size=1.0), **_kv_facts(one))
    assert config.scheduler.kv_cache_groups == one


def test_a_pool_too_small_for_every_groups_blocks_is_refused_naming_the_length():
    hybrid = (KVCacheGroup(),) + (KVCacheGroup(sliding_window=8),) * 2
    args = EngineArgs(block_size=4, max_num_batched_tokens=16, num_gpu_blocks_override=72)
    # 64 full blocks + 2 x 7 sliding + the null block = 79; 72 hold 228 tokens
    with pytest.raises(ValueError, match="needs 78 .* at least 79, or lower max_model_len to "
                                         "at most 228"):
        create_engine_config(args, **_kv_facts(hybrid))


def _gemma3_shaped(tmp_path: Path, windows: bool) -> Path:
    """The gemma3_text fixture as a 5 local : 1 global model of window 32 (or without
    windows: every layer global), positions up to 512."""
    path = tmp_path / ("windows" if windows else "no_windows")
    shutil.copytree(TINY / "gemma3_text", path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(sliding_window=32, max_position_embeddings=512, sliding_window_pattern=6,
               _sliding_window_pattern=6,
               layer_types=["sliding_attention"] * 5 + ["full_attention"] if windows
               else ["full_attention"] * 6)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _most_running(path: Path, max_num_seqs: int, budget: int, n: int = 40
                  ) -> tuple[int, int, int]:
    """n requests of 8 windows of prompt (256 tokens) and 4 outputs through the engine:
    (the most running at once, the preemptions, the pool's blocks)."""
    model, cfg, _ = load_model(str(path), with_tokenizer=False)
    args = EngineArgs(model=str(path), skip_tokenizer_init=True, block_size=4,
                      max_num_batched_tokens=256, long_prefill_token_threshold=16,
                      max_num_seqs=max_num_seqs, max_model_len=320,
                      enable_prefix_caching=False, kv_cache_memory_bytes=budget,
                      async_scheduling=False)
    fns = model_fns(model, cfg, attn_impl=attention_backend(args, cfg))
    config = resolve_config(args, fns, cfg)
    stats = UsedBlocks(config.scheduler.num_blocks - 1)
    llm = LLM.from_engine(LLMEngine(fns, args, config, tokenizer=None, stat_loggers=[stats]))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 128, 256).tolist()} for _ in range(n)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    return max(stats.running), stats.preempted, config.scheduler.num_blocks


def test_windows_run_more_long_requests_at_once_in_the_same_bytes(tmp_path):
    """The issue's figure through the engine (docs/BENCHMARKS.md): the bytes of 3,846
    one-layer blocks are 641 six-layer blocks without windows, 3,846 one-layer ones with."""
    one_layer = 2 * 2 * 16 * 4 * 4  # K and V, 2 heads, head_dim 16, f32, 4 tokens
    budget = 3846 * one_layer
    no_windows, windows = _gemma3_shaped(tmp_path, False), _gemma3_shaped(tmp_path, True)
    # Without windows a few requests past max_num_seqs show the limit (40 would only repeat
    # the same waves); with them 40 are more than the 31 that fit.
    assert _most_running(no_windows, 9, budget, n=12) == (9, 0, 641)
    most, preempted, _ = _most_running(no_windows, 10, budget, n=12)
    assert preempted > 0  # 10 requests of 65 blocks do not fit in 640
    assert _most_running(windows, 64, budget) == (31, 0, 3846)  # 3.4x as many
