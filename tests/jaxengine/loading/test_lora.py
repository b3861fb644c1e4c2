"""The PEFT LoRA adapter reader: peft's own adapters (tests/fixtures/lora, made by
tests/make_fixtures.py), merged into their base's weights, give transformers+peft's logits, which
checks the tensor mapping, the factors' orientation and the scaling (rsLoRA's too) for each
family; small adapters written here check the rest and each refusal."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxengine.loading import load_peft_adapter
from jaxengine.loading.hf import SafetensorsSource, read_hf_config
from jaxengine.loading.lora import LORA_MODULES, LoRAAdapter
from jaxengine.loading.weights import load_weights
from jaxengine.model.config import ModelConfig
from jaxengine.model.decoder import Model
from jaxengine.model.step import RequestChunk, split_model
from tests.fixtures.model_helpers import FIXTURES, PagedRunner

CFG = ModelConfig.tiny()  # D 32, N 4, K 2, H 8, F 64, 2 layers
ATTN = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32)}
MLP = {"gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}  # (in, out)
PREFIX = "base_model.model.model.layers"


class MergedSource:
    """A checkpoint's tensors with an adapter merged in: W [out, in] + scaling * B @ A."""

    def __init__(self, base: SafetensorsSource, adapter: LoRAAdapter) -> None:
        self.base, self.adapter = base, adapter

    def get(self, name: str) -> np.ndarray | None:
        w = self.base.get(name)
        parts = name.split(".")  # model.layers.{i}.{self_attn|mlp}.{module}.weight
        if parts[1:2] == ["layers"] and parts[4:] in ([m, "weight"] for m in self.adapter.weights):
            a, b = self.adapter.weights[parts[4]]
            layer = int(parts[2])
            w = w + self.adapter.scaling * b[layer] @ a[layer]
        return w


# Slow: each family compiles its model (seconds on a CPU); the default run checks peft's
# tokens and logprobs through the engine (tests/jaxengine/server/test_lora.py).
@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["llama3_gqa", "qwen2_bias_tied", "gemma3_text"])
def test_peft_adapters_merged_give_peft_logits(fixture: str) -> None:
    base_dir = FIXTURES / "tiny" / fixture
    cfg = read_hf_config(base_dir)
    source = SafetensorsSource(str(base_dir))
    runner = None
    try:
        for adapter_dir in sorted((FIXTURES / "lora" / fixture).glob("*/")):
            adapter = load_peft_adapter(adapter_dir, cfg, max_lora_rank=8)
            peft_config = json.loads((adapter_dir / "adapter_config.json").read_text())
            assert adapter.name == adapter_dir.name and adapter.rank == peft_config["r"]
            assert set(adapter.weights) == set(peft_config["target_modules"])
            model = Model(cfg, weights=load_weights(cfg, MergedSource(source, adapter),
                                                    dtype=jnp.float32, where=str(base_dir)),
                          scan_layers=True)
            if runner is None:
                runner = PagedRunner(model)
            runner.state = split_model(model)[1]  # the same graph: its step compiles once
            oracle = np.load(adapter_dir / "oracle.npz")
            ids = oracle["input_ids"].tolist()
            # pages 1..10: page 0 takes the padding tokens' writes
            got = runner.run([RequestChunk(token_ids=ids, start=0,
                                           block_table=list(range(1, 11)))], num_tokens=48)[0]
            np.testing.assert_allclose(got, oracle["logits"], atol=1e-4, rtol=0)
            base = np.load(adapter_dir.parent / "oracle.npz")["logits"]
            assert np.abs(got - base).max() > 0.05  # the adapter is really in the logits
    finally:
        source.close()
    assert runner is not None  # the fixture has adapters


def write_adapter(path: Path, modules: dict[str, tuple[int, int]], *, r: int = 4,
                  ranks: dict[str, int] | None = None, layers: tuple[int, ...] = (0, 1),
                  prefix: str = PREFIX, dtype: type = np.float32,
                  **config: object) -> dict[str, np.ndarray]:
    """A PEFT adapter directory of random factors for `modules` {name: (in, out)}, of rank
    `r` or the module's in `ranks`, and its config with `config` over plain LoRA's; returns
    its tensors."""
    rng = np.random.default_rng(0)
    tensors = {}
    for module, (n_in, n_out) in modules.items():
        kind = "self_attn" if module in ATTN else "mlp"
        rank = (ranks or {}).get(module, r)
        for layer in layers:
            name = f"{prefix}.{layer}.{kind}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(size=(rank, n_in)).astype(dtype)
            tensors[f"{name}.lora_B.weight"] = rng.normal(size=(n_out, rank)).astype(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    fields = dict(peft_type="LORA", r=r, lora_alpha=8, target_modules=list(modules),
                  bias="none", use_dora=False, modules_to_save=None) | config
    (path / "adapter_config.json").write_text(json.dumps(fields))
    return {k: v.astype(np.float32) for k, v in tensors.items()}


def test_stacks_layers_and_leaves_untargeted_ones_zero(tmp_path: Path) -> None:
    tensors = write_adapter(tmp_path / "one", {"v_proj": ATTN["v_proj"]}, layers=(1,),
                            layers_to_transform=[1], dtype=ml_dtypes.bfloat16)
    adapter = load_peft_adapter(tmp_path / "one", CFG, max_lora_rank=4)
    a, b = adapter.weights["v_proj"]
    assert adapter.name == "one" and adapter.scaling == 2.0 and set(adapter.weights) == {"v_proj"}
    assert a.shape == (2, 4, 32) and b.shape == (2, 16, 4) and a.dtype == np.float32
    np.testing.assert_array_equal(a[1], tensors[f"{PREFIX}.1.self_attn.v_proj.lora_A.weight"])
    assert not a[0].any() and not b[0].any()


def test_rslora_rank_and_alpha_patterns(tmp_path: Path) -> None:
    # q_proj at rank 2 by rank_pattern; k_proj at the default 4, layer 1's with its own alpha
    tensors = write_adapter(tmp_path, {"q_proj": ATTN["q_proj"], "k_proj": ATTN["k_proj"]},
                            ranks={"q_proj": 2}, use_rslora=True, rank_pattern={"q_proj": 2},
                            alpha_pattern={"layers\\.1\\.self_attn\\.k_proj": 2})
    adapter = load_peft_adapter(tmp_path, CFG, max_lora_rank=4)
    assert adapter.rank == 4 and adapter.scaling == 8 / 2  # alpha / sqrt(r)
    (qa, qb), (_, kb) = adapter.weights["q_proj"], adapter.weights["k_proj"]
    assert qa.shape == (2, 4, 32) and not qa[:, 2:].any() and not qb[:, :, 2:].any()
    name = f"{PREFIX}.{{}}.self_attn.{{}}.lora_B.weight"
    np.testing.assert_allclose(qb[0, :, :2], tensors[name.format(0, "q_proj")]
                               * (8 / np.sqrt(2)) / adapter.scaling, rtol=1e-6)
    np.testing.assert_allclose(kb[0], tensors[name.format(0, "k_proj")], rtol=1e-6)
    np.testing.assert_allclose(kb[1], tensors[name.format(1, "k_proj")] * (2 / 2) / 4,
                               rtol=1e-6)


def test_a_multimodal_checkpoints_text_decoder(tmp_path: Path) -> None:
    write_adapter(tmp_path / "vl", {"o_proj": (64, 32)}, layers=(0,),
                  prefix="base_model.model.model.language_model.layers")
    gemma = ModelConfig.tiny("gemma3_text", head_dim=16)
    assert load_peft_adapter(tmp_path / "vl", gemma, max_lora_rank=4).weights["o_proj"][0].any()


def test_only_the_dense_layers_of_a_mixed_moe_model(tmp_path: Path) -> None:
    cfg = read_hf_config(FIXTURES / "tiny" / "qwen3_moe")  # layers 0, 2 dense; 1, 3 routed
    up = (cfg.hidden_size, cfg.intermediate_size)
    write_adapter(tmp_path / "dense", {"up_proj": up}, layers=(0, 2))
    assert load_peft_adapter(tmp_path / "dense", cfg, max_lora_rank=4).weights["up_proj"][0][
        [0, 2]].all(axis=(1, 2)).all()
    write_adapter(tmp_path / "routed", {"up_proj": up}, layers=(1,))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj.*not embeddings.*experts"):
        load_peft_adapter(tmp_path / "routed", cfg, max_lora_rank=4)


@pytest.mark.parametrize("config, message", [
    (dict(r=16), r"r=16 exceeds max_lora_rank=8; serve with --max-lora-rank 16"),
    (dict(rank_pattern={"q_proj": 12}), r"rank_pattern\['q_proj'\]=12 exceeds max_lora_rank"),
    (dict(use_dora=True), r"use_dora=True is not supported"),
    (dict(peft_type="LOHA"), r"peft_type='LOHA' is not supported"),
    (dict(modules_to_save=["lm_head"]), r"modules_to_save=\['lm_head'\] is not supported"),
    (dict(layer_replication=[[0, 2]]), r"layer_replication=.* is not supported"),
    (dict(bias="lora_only"), r"bias='lora_only' is not supported"),
    (dict(target_modules=["q_proj", "lm_head"]), r"target_modules entry 'lm_head' is not "
                                                 r"supported; LoRA is served on q_proj"),
    (dict(lora_alpha="x"), r"lora_alpha='x' must be a positive number"),
])
def test_config_refusals_name_the_field(tmp_path: Path, config: dict, message: str) -> None:
    write_adapter(tmp_path, {"q_proj": ATTN["q_proj"]}, **config)
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(tmp_path, CFG, max_lora_rank=8)


def test_tensor_refusals_name_the_tensor(tmp_path: Path) -> None:
    tensors = write_adapter(tmp_path, {"q_proj": ATTN["q_proj"]}, target_modules=".*proj")
    extra = {"lm_head": "base_model.model.lm_head.lora_A.weight",
             "embedding": "base_model.model.model.embed_tokens.lora_embedding_A",
             "layer 2": f"{PREFIX}.2.self_attn.q_proj.lora_A.weight"}
    for what, key in extra.items():
        save_file(tensors | {key: np.zeros((4, 32), np.float32)},
                  str(tmp_path / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=f"tensor '{key}'") as err:
            load_peft_adapter(tmp_path, CFG, max_lora_rank=8)
        assert ", ".join(LORA_MODULES) in str(err.value), what
    lone = {k: v for k, v in tensors.items() if "0.self_attn.q_proj.lora_B" not in k}
    save_file(lone, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj has no lora_B"):
        load_peft_adapter(tmp_path, CFG, max_lora_rank=8)


def test_an_adapter_of_another_base_is_refused(tmp_path: Path) -> None:
    write_adapter(tmp_path, {"q_proj": (48, 48)})  # a base with D=48
    with pytest.raises(ValueError, match=r"q_proj's lora_A has shape \(4, 48\), but the base "
                                         r"model with this rank implies \(4, 32\).*another base"):
        load_peft_adapter(tmp_path, CFG, max_lora_rank=8)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        load_peft_adapter(tmp_path / "nowhere", CFG, max_lora_rank=8)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_peft_adapter(tmp_path, CFG, max_lora_rank=8)
    write_adapter(tmp_path, {"q_proj": ATTN["q_proj"]})
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model.bin \(a pickle\) is not read; save the "
                                         r"adapter as adapter_model.safetensors"):
        load_peft_adapter(tmp_path, CFG, max_lora_rank=8)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_peft_adapter(tmp_path, CFG, max_lora_rank=8)
