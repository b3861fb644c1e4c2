"""Data-parallel replicas on distinct virtual CPU devices, with a real tiny checkpoint: the same
greedy tokens (and logprobs) as one engine, each replica's arrays on its own device group, and
after `LLM.update_weights` the same new tokens.

One child process with 4 devices (`tests/parallel_helpers.py`) runs dp=1, dp=2 and
dp=2 x tp=2 one after another, so jax starts once.
"""

from __future__ import annotations

import json

import pytest

from tests.parallel_helpers import run_python

CHECKS = """
import json, jax
from jaxengine.llm import LLM
from jaxengine.replicas.data_parallel import DataParallelEngine
from scheduler import SamplingParams

KW = dict(skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=64,
          block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = [{"prompt_token_ids": list(range(i + 1, 9 + 4 * i))} for i in range(5)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
devices = jax.devices()

def placed(engine):
    arrays = jax.tree.leaves(engine.runner.model.params) + [engine.runner.kv]
    return sorted({d.id for x in arrays for d in x.devices()})

results = {}
for dp, tp in ((1, 1), (2, 1), (2, 2)):
    llm = LLM("tests/fixtures/tiny/llama_tied_mha", data_parallel_size=dp,
              tensor_parallel_size=tp, **KW)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    engine = llm.llm_engine
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else (engine,)
    # New weights (replica 0's, scaled) reach every replica, on its own devices.
    llm.update_weights(jax.tree.map(lambda x: x * 1.25, replicas[0].runner.model.params))
    updated = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    results[f"{dp}x{tp}"] = dict(
        tokens=[list(o.outputs[0].token_ids) for o in outs],
        updated=[list(o.outputs[0].token_ids) for o in updated],
        logprobs=[o.outputs[0].cumulative_logprob for o in outs],
        devices=[placed(r) for r in replicas],
        kv_devices=[sorted(d.id for d in r.runner.kv.devices()) for r in replicas],
        requests=[r.snapshot().counters.prefix_cache_queries > 0 for r in replicas])
print(json.dumps(results))
"""


@pytest.mark.slow  # 79 s: four engines in a subprocess; test_data_parallel*.py cover routing
def test_replicas_on_their_own_devices_give_one_engines_outputs() -> None:
    out = run_python(CHECKS, num_devices=4, timeout=240)
    results = json.loads(out.strip().splitlines()[-1])
    one = results["1x1"]
    assert one["devices"] == [[0]]
    for config, groups in (("2x1", [[0], [1]]), ("2x2", [[0, 1], [2, 3]])):
        r = results[config]
        assert r["tokens"] == one["tokens"], config
        assert r["updated"] == one["updated"] != one["tokens"], config
        assert all(abs(a - b) < 1e-4 for a, b in zip(r["logprobs"], one["logprobs"],
                                                       strict=True)), config
        assert r["devices"] == groups and r["kv_devices"] == groups, config
        assert r["requests"] == [True, True], config  # both replicas served some


MOE_CHECKS = """
import json
from jaxengine.llm import LLM
from scheduler import SamplingParams

KW = dict(skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=64,
          block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = [{"prompt_token_ids": list(range(i + 1, 9 + 4 * i))} for i in range(5)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)
tokens = {}
for dp, tp, ep in ((1, 1, False), (2, 2, True)):
    llm = LLM("tests/fixtures/tiny/qwen2_moe", data_parallel_size=dp, tensor_parallel_size=tp,
              enable_expert_parallel=ep, **KW)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    tokens[f"{dp}x{tp}"] = [list(o.outputs[0].token_ids) for o in outs]
print(json.dumps(tokens))
"""


@pytest.mark.slow  # two MoE engines, one of two replicas, in a subprocess
def test_moe_replicas_with_expert_parallelism_give_one_engines_tokens() -> None:
    """Data parallelism is unchanged for a MoE model: two replicas, each with its experts
    split whole over its two devices, give one device's greedy tokens."""
    out = run_python(MOE_CHECKS, num_devices=4, timeout=240)
    tokens = json.loads(out.strip().splitlines()[-1])
    assert tokens["2x2"] == tokens["1x1"] and all(len(t) == 6 for t in tokens["1x1"])
