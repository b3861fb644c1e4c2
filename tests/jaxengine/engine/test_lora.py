"""Multi-LoRA through the engine: requests of the base model and of several adapters, mixed in
one `generate` call with `max_loras=1` (so the adapters take turns in the one device slot, and
`max_cpu_loras=2` so one is read again from its directory), give the greedy tokens and
logprobs of the base model with each adapter merged into its weights, and nothing compiles
after warm-up while the slot changes hands. Adapters are PEFT directories written here from
random weights; the reference runs the same compiled programs with the merged weights
(`update_weights`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxengine import LLM, LoRARequest
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import model_fns
from jaxengine.loading.load import load_model
from jaxengine.loading.lora import load_peft_adapter, module_shapes
from jaxengine.model.fake import fake_model
from jaxengine.model.step import split_model
from scheduler import SamplingParams
from tests.engine_helpers import engine_over

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "llama_tied_mha"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# name -> (rank, alpha, rsLoRA, targets)
ADAPTERS = {"x": (8, 16, False, ATTENTION + ("gate_proj", "up_proj", "down_proj")),
            "y": (4, 8, True, ("v_proj", "down_proj")),
            "z": (2, 4, False, ("q_proj", "up_proj"))}


def write_adapter(root: Path, cfg: Any, *, rank: int, alpha: float, rslora: bool,
                  targets: tuple[str, ...], seed: int) -> Path:
    """A PEFT LoRA directory of random weights (large enough to change greedy tokens)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            fan_in, fan_out = module_shapes(cfg)[m]
            part = "self_attn" if m in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.3, (rank, fan_in)).astype(
                np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.3, (fan_out, rank)).astype(
                np.float32)
    root.mkdir(parents=True)
    save_file(tensors, str(root / "adapter_model.safetensors"))
    (root / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
        "target_modules": list(targets), "bias": "none"}))
    return root


@functools.cache
def _base() -> tuple[Any, Any, Any]:
    return load_model(str(TINY))


def _merged_state(model: Any, path: Path) -> Any:
    """The weights of `model` (unpacked) with the adapter at `path` merged into them."""
    merged = nnx.clone(model)
    adapter = load_peft_adapter(path, model.config, max_lora_rank=16)
    for i, block in enumerate(merged.layers):
        for m, (a, b) in adapter.weights.items():
            lin = getattr(block.self_attn if m in ATTENTION else block.mlp, m)
            lin.kernel[...] = lin.kernel[...] + adapter.scaling * (b[i] @ a[i]).T
    return split_model(merged)[1]


def test_adapters_interleaved_with_one_slot_give_the_merged_weights_outputs(tmp_path):
    model, cfg, tokenizer = _base()
    model = nnx.clone(model)
    fns = model_fns(model, cfg, attn_impl="reference", pack=False, lora=True)
    args = EngineArgs(max_num_batched_tokens=4, max_num_seqs=4, block_size=4,
                      max_model_len=64, enable_lora=True, max_loras=1, max_cpu_loras=2,
                      max_lora_rank=16, debug_recompiles=True, precompile=True)
    llm = LLM.from_engine(engine_over(fns, args, tokenizer=tokenizer, max_model_len=64,
                                      num_blocks=80))
    paths = {name: write_adapter(tmp_path / name, cfg, rank=r, alpha=a, rslora=rs,
                                 targets=t, seed=i)
             for i, (name, (r, a, rs, t)) in enumerate(ADAPTERS.items())}
    loras = {name: LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(paths.items())}
    rng = np.random.default_rng(7)
    # base, x, y, z, base, x, z: the same prompt for each of the first four
    which = [None, "x", "y", "z", None, "x", "z"]
    same = rng.integers(3, cfg.vocab_size, 9).tolist()
    prompts = [same] * 4 + [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 13, 3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[None if w is None else loras[w] for w in which])
    engine = llm.llm_engine
    assert len(engine.list_loras()) == 2  # max_cpu_loras: the others are read again
    assert engine.state.num_free_blocks == engine.scheduler_config.num_blocks - 1
    tokens = [o.outputs[0].token_ids for o in outs]
    assert len({tuple(t) for t in tokens[:4]}) == 4  # each adapter changes the tokens
    for name in (None, "x", "y", "z"):
        engine.update_weights(split_model(model)[1] if name is None
                              else _merged_state(_base()[0], paths[name]))
        mine = [i for i, w in enumerate(which) if w == name]
        want = llm.generate([{"prompt_token_ids": prompts[i]} for i in mine], GREEDY,
                            use_tqdm=False)
        for i, w in zip(mine, want, strict=True):
            got = outs[i].outputs[0]
            assert got.token_ids == w.outputs[0].token_ids, (name, i)
            for lp_got, lp_want in zip(got.logprobs, w.outputs[0].logprobs, strict=True):
                assert lp_got.keys() == lp_want.keys()
                for t in lp_got:
                    assert lp_got[t].logprob == pytest.approx(lp_want[t].logprob, abs=2e-4)
    assert engine.runner.stats.compilations_after_warmup == 0


def test_a_lora_request_needs_enable_lora():
    engine = engine_over(fake_model(64), EngineArgs(max_num_batched_tokens=16, max_num_seqs=2,
                                                    block_size=4),
                         tokenizer=None, max_model_len=32, num_blocks=20)
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_request("a", {"prompt_token_ids": [1, 2]},
                           lora_request=LoRARequest("x", 1, "/nowhere"))
    with pytest.raises(ValueError, match="enable_lora"):
        engine.list_loras()
    assert not engine.has_unfinished_requests()
