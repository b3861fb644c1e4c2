"""The tiny fixtures: random tiny HF checkpoints of each family (`TINY`) and their
transformers oracle (tests/fixtures/tiny/<name>/), and the greedy decoding every oracle uses."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import torch
import transformers

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
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
