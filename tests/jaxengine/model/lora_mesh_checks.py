"""LoRA slots over a tensor-parallel mesh, run on 4 virtual CPU devices in a child process by
test_lora.py (jax must see the devices from its first import, so this module is not collected
by the default run: `tests/parallel_helpers.py`). A and B shard with their layers, and a batch
of adapters gives on tp devices the hidden states it gives on one."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.kv_cache import init_kv_cache
from jaxengine.model.lora import lora_layout, write_slot
from jaxengine.model.mesh import make_mesh
from jaxengine.model.step import make_model_step, split_model
from tests.jaxengine.model.test_lora import SCALING, batch, random_adapter

if len(jax.devices()) < 4:
    raise RuntimeError(f"these checks need 4 devices, jax sees {len(jax.devices())}: run them "
                       "through tests/parallel_helpers.py")


def hidden(cfg: ModelConfig, tp: int) -> tuple[np.ndarray, object]:
    """The hidden states of `test_lora.PROMPTS` with two adapters, on `tp` devices."""
    mesh = make_mesh(jax.devices()[:tp])
    model = Model(cfg, seed=3, mesh=mesh)
    lay = lora_layout(cfg, model.layout, mesh=mesh, dtype=model.dtype)
    # the adapters at the checkpoint's sizes: drawn from the tp=1 layout's shapes
    one = lora_layout(cfg, Model(cfg, seed=3).layout, mesh=make_mesh(jax.devices()[:1]),
                      dtype=model.dtype)
    slots = lay.init_slots(3, 8)
    for slot, (rank, seed) in ((1, (8, 1)), (2, (4, 2))):
        a, b = lay.slot_arrays(random_adapter(one, rank, seed, tuple(one.modules)), 8)
        slots = write_slot(slots, np.int32(slot), a, b, np.float32(SCALING[slot]))
    graphdef, state = split_model(model)
    kv = init_kv_cache(cfg, num_blocks=8, block_size=8, dtype=model.dtype,
                       num_kv_heads=model.layout.num_kv_heads, mesh=mesh)
    step = jax.jit(make_model_step(graphdef, attn_impl="reference"))
    return np.asarray(step(state, kv, batch(cfg, lora=True), slots)[1]), slots


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_gives_one_devices_hidden_states_with_slots_split_with_their_layers(tp):
    cfg = ModelConfig.tiny()  # 2 KV heads: at tp=4 each is repeated twice, B's heads too
    want, _ = hidden(cfg, 1)
    got, slots = hidden(cfg, tp)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    def split(x: jax.Array) -> tuple[int, ...]:  # each axis: how many devices split it
        shard = x.sharding.shard_shape(x.shape)
        return tuple(n // s for n, s in zip(x.shape, shard, strict=True))

    assert split(slots.b["q_proj"]) == (1, 1, 1, tp)  # column-parallel: B on out
    assert split(slots.a["q_proj"]) == (1, 1, 1, 1)
    assert split(slots.a["down_proj"]) == (1, 1, tp, 1)  # row-parallel: A on in
    assert split(slots.b["down_proj"]) == (1, 1, 1, 1)
    k_out = cfg.num_kv_heads * max(1, tp // cfg.num_kv_heads) * cfg.head_dim
    assert slots.b["k_proj"].shape[-1] == k_out
