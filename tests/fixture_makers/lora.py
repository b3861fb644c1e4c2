"""The LoRA fixtures: random PEFT adapters of some tiny fixtures (`LORA`) and the
transformers+peft oracle of each (tests/fixtures/lora/<tiny name>/)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import torch
import transformers

from .tiny import FIXTURES, GREEDY_STEPS, MAX_SEEDS, MIN_GAP, SEED, TINY, greedy

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One random PEFT LoRA adapter of a tiny model."""

    targets: list[str]  # target_modules
    r: int
    alpha: float
    rslora: bool = False  # scaling alpha / sqrt(r), else alpha / r


# Each tiny model's adapters: all seven modules, attention only with rsLoRA, the MLP only.
ADAPTERS = {"all7": Adapter(ATTN + MLP, r=8, alpha=16),
            "attn_rs": Adapter(ATTN, r=4, alpha=8, rslora=True),
            "mlp": Adapter(MLP, r=2, alpha=4)}
LORA = {name: ADAPTERS for name in ("llama3_gqa", "qwen2_bias_tied", "gemma3_text")}


def base_of(name: str) -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    """tiny/<name> as saved (checked against its oracle's logits) and its oracle."""
    path = os.path.join(FIXTURES, "tiny", name)
    model = getattr(transformers, TINY[name].model).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    oracle = dict(np.load(os.path.join(path, "oracle.npz")))
    with torch.no_grad():
        logits = model(torch.tensor(oracle["input_ids"][None])).logits[0].float().numpy()
    np.testing.assert_allclose(logits, oracle["logits"], atol=1e-5)
    # adapter_config.json's base_model_name_or_path: the fixture, not this machine's path
    model.name_or_path = f"tests/fixtures/tiny/{name}"
    return model, oracle


def greedy_oracle(model: torch.nn.Module, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Prompt logits and GREEDY_STEPS greedy ids, margins and logprobs of `model` for `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor(ids[None])).logits[0].float().numpy()
    gen, margins, logprobs = greedy(model, ids.tolist(), GREEDY_STEPS)
    return dict(input_ids=ids.astype(np.int32), logits=logits.astype(np.float32),
                greedy_ids=np.array(gen, np.int32), greedy_logprobs=np.array(logprobs, np.float32),
                greedy_margins=np.array(margins, np.float32))


def lora_model(base: torch.nn.Module, spec: Adapter, seed: int) -> torch.nn.Module:
    """`base` with a fresh adapter of `spec` whose A and B are N(0, 0.1): peft starts B at zero,
    which would leave the outputs the base's."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=spec.targets,
                     use_rslora=spec.rslora, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def make_lora(name: str) -> None:
    """Write lora/<name>/: the base's greedy oracle and each adapter of LORA[name] (reseeded
    while its greedy oracle has a near-tie or equals the base's)."""
    base, tiny = base_of(name)
    out = os.path.join(FIXTURES, "lora", name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    ids = tiny["input_ids"]
    base_oracle = greedy_oracle(base, ids)
    np.savez(os.path.join(out, "oracle.npz"), **base_oracle)
    print(f"lora/{name}: base, min greedy margin {base_oracle['greedy_margins'].min():.4f}")
    for adapter, spec in LORA[name].items():
        for seed in range(SEED, SEED + MAX_SEEDS):
            model = lora_model(base, spec, seed)
            oracle = greedy_oracle(model, ids)
            changed = int((oracle["greedy_ids"] != base_oracle["greedy_ids"]).sum())
            if oracle["greedy_margins"].min() > MIN_GAP and changed:
                break
            base = model.unload()  # the base without the adapter's layers, for the next seed
        else:
            raise SystemExit(f"lora/{name}/{adapter}: a near-tie in each of seeds {SEED}..{seed}")
        where = os.path.join(out, adapter)
        model.save_pretrained(where)
        os.remove(os.path.join(where, "README.md"))  # peft's model card template
        np.savez(os.path.join(where, "oracle.npz"), **oracle, seed=np.int64(seed))
        print(f"lora/{name}/{adapter}: seed {seed}, min greedy margin "
              f"{oracle['greedy_margins'].min():.4f}, {changed} of {GREEDY_STEPS} greedy ids "
              "differ from the base's")
        base = model.unload()


def lora_version() -> str:
    """The installed peft's version (it is only needed for the LoRA part)."""
    from peft import __version__

    return __version__
