"""LoRA slots against merged weights: a batch whose requests use different adapters (and none)
gives each request the hidden states of the base model with that adapter merged into its
weights, W + scaling * (B @ A)^T, in every layout the engine runs (looped, scanned, packed for
the CPU kernels), for the families' attention and MLP."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.lora import LoRALayout, lora_layout, write_slot
from jaxengine.model.mesh import make_mesh
from jaxengine.model.packing import pack_projections
from jaxengine.model.step import RequestChunk, make_model_step, pack_batch, split_model
from jaxengine.model.tensor_parallel import tp_layout
from tests.parallel_helpers import run_pytest

MESH_CHECKS = "tests/jaxengine/model/lora_mesh_checks.py"

PROMPTS = ((5, 1), (3, 0), (6, 2), (2, 1))  # (tokens, slot) of each request; 0: no adapter
SCALING = (0.0, 2.0, 0.5)  # slot 0 holds no adapter


def random_adapter(layout: LoRALayout, rank: int, seed: int, modules: tuple[str, ...]
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT's (A [Ly, r, in], B [Ly, out, r]) for `modules`, large enough to change tokens."""
    rng = np.random.default_rng(seed)
    return {m: (rng.normal(0, 0.3, (layout.num_layers, rank, i)).astype(np.float32),
                rng.normal(0, 0.3, (layout.num_layers, o, rank)).astype(np.float32))
            for m, (i, o) in layout.modules.items() if m in modules}


def merge(model: Model, adapter: dict, scaling: float) -> None:
    """Add scaling * (B @ A)^T to each targeted kernel [in, out] (stacked [Ly, in, out] when
    the layers are scanned), in place."""
    scanned = not isinstance(model.layers, nnx.List)
    for m, (a, b) in adapter.items():
        delta = scaling * np.einsum("lor,lri->lio", b, a)  # [Ly, in, out]
        for i, block in enumerate([model.layers] if scanned else model.layers):
            lin = getattr(block.self_attn if m in ("q_proj", "k_proj", "v_proj", "o_proj")
                          else block.mlp, m)
            lin.kernel[...] = lin.kernel[...] + (delta if scanned else delta[i])


def batch(cfg: ModelConfig, *, lora: bool):
    """The requests of `PROMPTS` in one batch; each token's slot, or all 0 without `lora`."""
    rng = np.random.default_rng(0)
    chunks, table = [], 1
    for n, _ in PROMPTS:
        chunks.append(RequestChunk(token_ids=rng.integers(1, cfg.vocab_size, n).tolist(),
                                   start=0, block_table=[table]))
        table += 1
    b = pack_batch(chunks, num_tokens=32, max_seqs=4, max_blocks=2, block_size=8)
    slots = np.zeros(32, np.int32)
    for r, (n, slot) in enumerate(PROMPTS):
        slots[b.query_start_loc[r]:b.query_start_loc[r] + n] = slot if lora else 0
    return dataclasses.replace(b, lora_slots=slots)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("architecture, layout", [
    ("llama", "packed"), pytest.param("qwen2", "scanned", marks=SLOW),
    pytest.param("llama", "looped", marks=SLOW), pytest.param("gemma2", "looped", marks=SLOW),
    pytest.param("qwen2_moe", "looped", marks=SLOW)])
def test_slots_give_each_request_its_merged_adapter(architecture, layout):
    overrides = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=32) if architecture == "qwen2_moe" else {}
    cfg = ModelConfig.tiny(architecture, **overrides)

    base = Model(cfg, seed=3, scan_layers=layout == "scanned")
    model = nnx.clone(base)
    lay = lora_layout(cfg, model.layout, mesh=model.mesh, dtype=model.dtype)
    # X targets every module the model serves, Y (of a smaller rank) only v and down
    adapters = {1: random_adapter(lay, 8, 1, tuple(lay.modules)),
                2: random_adapter(lay, 4, 2, ("v_proj", "down_proj"))}
    slots = lay.init_slots(3, 8)
    for slot, adapter in adapters.items():
        a, b = lay.slot_arrays(adapter, 8)
        slots = write_slot(slots, np.int32(slot), a, b, np.float32(SCALING[slot]))
    if layout == "packed":
        assert pack_projections(model, fuse_swiglu=False) > 0
    graphdef = split_model(model)[0]
    step = jax.jit(make_model_step(graphdef, attn_impl="reference"))  # one program for all
    kv = np.zeros((cfg.num_layers, 8, 8, 2 * cfg.num_kv_heads, cfg.head_dim), np.float32)

    def hidden(m: Model, lora: bool) -> np.ndarray:
        return np.asarray(step(split_model(m)[1], kv, batch(cfg, lora=lora), slots)[1])

    got = hidden(model, lora=True)
    starts = np.cumsum([0] + [n for n, _ in PROMPTS])
    for slot in (0, 1, 2):
        want_model = nnx.clone(base)  # with every token in slot 0 (no adapter)
        if slot:
            merge(want_model, adapters[slot], SCALING[slot])
        if layout == "packed":
            pack_projections(want_model, fuse_swiglu=False)
        want = hidden(want_model, lora=False)
        for r, (n, s) in enumerate(PROMPTS):
            rows = slice(starts[r], starts[r] + n)
            if s == slot:
                np.testing.assert_allclose(got[rows], want[rows], rtol=2e-4, atol=2e-5)
            elif slot == 0:
                assert not np.allclose(got[rows], want[rows], atol=1e-3)  # adapters matter


def test_a_moe_model_refuses_an_adapter_on_its_experts():
    cfg = ModelConfig.tiny("qwen2_moe", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16)
    lay = lora_layout(cfg, tp_layout(cfg, 1), mesh=make_mesh(jax.devices()[:1]),
                      dtype=np.float32)
    assert set(lay.modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ValueError, match="gate_proj.*serves no LoRA"):
        lay.slot_arrays({"gate_proj": (np.zeros((2, 4, 32)), np.zeros((2, 64, 4)))}, 8)


@pytest.mark.slow  # 16-28 s: a child process on 2 devices; LoRA under tp runs with -m slow
def test_slots_split_over_a_tensor_parallel_mesh_give_one_devices_outputs():
    out = run_pytest([MESH_CHECKS], num_devices=4, timeout=600)
    assert "1 passed" in out


@pytest.mark.slow
def test_slots_split_over_four_devices_repeat_the_kv_heads():
    out = run_pytest([MESH_CHECKS], num_devices=4, timeout=600, args=("-m", "slow"))
    assert "1 passed" in out
