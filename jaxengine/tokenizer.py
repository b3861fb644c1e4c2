"""Tokenizer without torch: a `tokenizers` backend plus a jinja2 chat template.

From an HF directory it loads `tokenizer.json` (+ `tokenizer_config.json` for special tokens and
the chat template). From GGUF metadata it builds the byte-level BPE itself, because transformers'
GGUF tokenizer path imports torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from jaxengine.config import ModelLoadError

# llama.cpp pre-tokenizer names -> split regexes (applied before byte-level mapping)
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    regex = {"llama-bpe": _LLAMA3_RE, "llama3": _LLAMA3_RE, "qwen2": _QWEN2_RE}.get(pre)
    if regex is None:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, "
                             "gpt2, llama-bpe, qwen2); load the HF directory instead")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    byte_level])


class Tokenizer:
    """Encode/decode text and render chat templates."""

    def __init__(self, backend: Backend, *, eos_token_ids: Sequence[int],
                 bos_token_id: int | None = None, pad_token_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False) -> None:
        """Wrap a `tokenizers.Tokenizer`.

        Args:
            backend: the tokenizer proper.
            eos_token_ids: ids that end generation (the first is `eos_token_id`).
            bos_token_id, pad_token_id: special ids, if any.
            chat_template: jinja2 source of the chat template, if any.
            add_bos: prepend bos in `encode(add_special_tokens=True)` (GGUF's add_bos_token).
        """
        if not eos_token_ids:
            raise ModelLoadError("the tokenizer has no eos token; set eos_token in its config")
        self.backend = backend
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.bos_token_id, self.pad_token_id = bos_token_id, pad_token_id
        self.chat_template, self.add_bos = chat_template, add_bos

    @property
    def eos_token_id(self) -> int:
        """The primary end-of-sequence id."""
        return self.eos_token_ids[0]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_str(self, token_id: int | None) -> str:
        """The string of a (special) token, '' for None."""
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special-token strings in it map to their ids)."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Render `messages` ([{"role", "content"}]) with the chat template, as transformers does.

        Returns:
            The prompt text, or its ids (no extra bos: the template writes its own) if
            `tokenize`.
        """
        if not self.chat_template:
            raise ModelLoadError("this tokenizer has no chat template; pass a plain prompt")
        text = _compile_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.token_str(self.bos_token_id),
            eos_token=self.token_str(self.eos_token_id), **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str) -> list[str]:
        """Write this tokenizer as an HF tokenizer directory (`tokenizer.json`,
        `tokenizer_config.json` with the special tokens and the chat template), so tools that
        take `--tokenizer DIR` (vLLM's `vllm bench serve`, `AutoTokenizer.from_pretrained`)
        tokenize exactly as the engine does.

        Returns:
            The paths of the files written.
        """
        from transformers import PreTrainedTokenizerFast

        backend = Backend.from_str(self.backend.to_str())  # a copy: the post-processor below
        if self.add_bos and self.bos_token_id is not None:  # GGUF's add_bos_token, in-file
            bos = self.token_str(self.bos_token_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, self.bos_token_id)])
        special = {name: self.token_str(i) or None for name, i in (
            ("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
            ("pad_token", self.pad_token_id))}
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=self.chat_template,
                                     **{k: v for k, v in special.items() if v is not None})
        paths = list(hf.save_pretrained(directory))
        # transformers 5 writes its new class name, which transformers 4 cannot resolve; the
        # old name loads the same class in both.
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = _read_json(config_path)
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        return paths

    # ---- constructors --------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Byte-level BPE from `tokenizer.ggml.*` metadata (model "gpt2")."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' "
                                 "byte-level BPE); load the HF directory instead")
        if "tokenizer.ggml.tokens" not in meta:
            raise ModelLoadError("GGUF metadata lacks tokenizer.ggml.tokens; the file has no "
                                 "tokenizer")
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
        backend.decoder = decoders.ByteLevel()
        types = np.asarray(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i in np.flatnonzero(types == _CONTROL)])
        backend.add_tokens([AddedToken(tokens[i], normalized=False)
                            for i in np.flatnonzero(types == _USER_DEFINED)])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(backend, eos_token_ids=[] if eos is None else [int(eos)],
                   bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """From `tokenizer.json` (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json for extra eos ids)."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError(f"{path}: no tokenizer.json (only fast-tokenizer files are "
                                 "supported); add it or pass tokenizer=None handling upstream")
        backend = Backend.from_file(tok_file)
        conf = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = conf.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()

        def tid(key: str) -> int | None:
            tok = conf.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return None if tok is None else backend.token_to_id(tok)

        eos = [i for i in (tid("eos_token"),) if i is not None]
        gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if i is not None and i not in eos:
                eos.append(int(i))
        return cls(backend, eos_token_ids=eos, bos_token_id=tid("bos_token"),
                   pad_token_id=tid("pad_token"), chat_template=template)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers uses for chat templates.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    return env.from_string(source)
