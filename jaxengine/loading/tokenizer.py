"""Tokenizer without torch: a `tokenizers` tokenizer, for HF directories and GGUF files.

An HF directory loads through transformers' `PreTrainedTokenizerFast.from_pretrained`
(tokenizer.json, tokenizer_config.json, the chat template). A GGUF file carries a byte-level BPE
in its metadata; transformers' GGUF tokenizer path imports torch, so the `tokenizers` model is
built here. Either way `tokenizers` encodes and decodes; chat templates render through
transformers' `apply_chat_template` (so exactly as transformers renders them), on a
`PreTrainedTokenizerFast` that a GGUF tokenizer builds at its first chat template, so that a
start which only encodes and decodes never imports transformers.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from jaxengine.model.config import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

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
    """Encode/decode text through a `tokenizers.Tokenizer`; render chat templates through a
    transformers fast tokenizer over it, built at its first use."""

    def __init__(self, backend: Backend, *, eos_token_ids: Sequence[int],
                 bos_token_id: int | None = None, pad_token_id: int | None = None,
                 chat_template: str | None = None,
                 hf: PreTrainedTokenizerFast | None = None) -> None:
        """Args:
            backend: the tokenizer proper, which encodes and decodes.
            eos_token_ids: ids that end generation (the tokenizer's eos token first; a
                model's generation_config may add more).
            bos_token_id, pad_token_id: the special ids, if the tokenizer has them.
            chat_template: the jinja source of the chat template, if any.
            hf: transformers' tokenizer over `backend` where one was loaded (an HF
                directory); else `hf` builds one when first asked.
        """
        if not eos_token_ids:
            raise ModelLoadError("the tokenizer has no eos token; set eos_token in its config")
        self.backend = backend
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self._hf = hf
        self._hf_lock = threading.Lock()

    @property
    def hf(self) -> PreTrainedTokenizerFast:
        """transformers' fast tokenizer, for what only it does (chat templates, structured
        outputs' `llguidance.hf`, `save_pretrained`): built at first use over a copy of
        `backend`, since importing transformers and building it take most of a second that
        encoding and decoding never need (docs/BENCHMARKS.md §14)."""
        with self._hf_lock:
            if self._hf is None:
                self._hf = self._build_hf()
            return self._hf

    def _build_hf(self) -> PreTrainedTokenizerFast:
        # imported here, not with the package: transformers takes ~0.7 s to import
        # (docs/STYLE.md rule 19)
        from transformers import PreTrainedTokenizerFast

        special = {"eos_token": self.eos_token_id, "bos_token": self.bos_token_id,
                   "pad_token": self.pad_token_id}
        return PreTrainedTokenizerFast(
            tokenizer_object=Backend.from_str(self.backend.to_str()),
            chat_template=self.chat_template,
            **{key: self.backend.id_to_token(i) for key, i in special.items() if i is not None})

    @property
    def eos_token_id(self) -> int:
        """The primary end-of-sequence id."""
        return self.eos_token_ids[0]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def max_chars_per_token(self) -> int:
        """The most characters of a text one token can stand for, so a text of C characters
        has at least ceil(C / this) tokens (the server refuses a prompt before tokenizing it
        when that many tokens could not fit the context).

        A token's string in the vocabulary (added tokens included) covers at most as many
        characters as it has: a byte-level token's string has one character per byte, and a
        character takes at least one byte; a SentencePiece-style token's characters are the
        text's own (its "▁" a space). A composing normalizer (NFC, NFKC) turns up to 4
        characters into one (U+1FAF is 4 code points decomposed), so it multiplies the bound
        by 4. Characters a tokenizer drops (a BERT normalizer's control characters) or fuses
        into one unknown token are not bounded by this: a text made of them may tokenize to
        fewer tokens than the bound says.
        """
        longest = max(map(len, self.backend.get_vocab(with_added_tokens=True)))
        normalizer = self.backend.normalizer  # its JSON alone, not the whole tokenizer's
        state = b"" if normalizer is None else normalizer.__getstate__()
        return longest * (4 if b'"NFC"' in state or b'"NFKC"' in state else 1)

    def token_str(self, token_id: int | None) -> str:
        """The string of a (special) token, '' for None."""
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special-token strings in it map to their ids; with
        `add_special_tokens`, the tokenizer's own bos/eos rule applies)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_stream(self, *, skip_special_tokens: bool = True) -> DecodeStream:
        """A fresh incremental decoder of one sequence (`tokenizers`' `DecodeStream`)."""
        return DecodeStream(self.backend, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Render `messages` ([{"role", "content"}]) with transformers' `apply_chat_template`.

        Args:
            kwargs: extra template variables (e.g. `tools`, `documents`), as in transformers.
        Returns:
            The prompt text, or its ids (no extra bos: the template writes its own) if
            `tokenize`.
        """
        if not self.chat_template:
            raise ModelLoadError("this tokenizer has no chat template; pass a plain prompt")
        text = self.hf.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str) -> list[str]:
        """Write this tokenizer as an HF tokenizer directory (`tokenizer.json`,
        `tokenizer_config.json` with the special tokens, the chat template), so tools that take
        `--tokenizer DIR` (vLLM's `vllm bench serve`, `AutoTokenizer.from_pretrained`)
        tokenize exactly as the engine does.

        Returns:
            The paths of the files written.
        """
        paths = list(self.hf.save_pretrained(directory))
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
    def from_backend(cls, backend: Backend, *, eos_token_id: int | None,
                     bos_token_id: int | None = None, pad_token_id: int | None = None,
                     chat_template: str | None = None, add_bos: bool = False) -> Tokenizer:
        """Wrap a bare `tokenizers.Tokenizer` whose special ids are known.

        Args:
            add_bos: prepend bos when special tokens are added (GGUF's add_bos_token); kept in
                the tokenizer's post-processor, so an exported tokenizer.json does it too.
        """
        return cls._wrap(Backend.from_str(backend.to_str()),  # a copy: its post-processor is ours
                         eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                         pad_token_id=pad_token_id, chat_template=chat_template, add_bos=add_bos)

    @classmethod
    def _wrap(cls, backend: Backend, *, eos_token_id: int | None, bos_token_id: int | None,
              pad_token_id: int | None, chat_template: str | None, add_bos: bool) -> Tokenizer:
        """`from_backend` over a backend of our own (its post-processor set here)."""
        if add_bos and bos_token_id is not None:
            bos = backend.id_to_token(bos_token_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, bos_token_id)])
        return cls(backend, eos_token_ids=[] if eos_token_id is None else [eos_token_id],
                   bos_token_id=bos_token_id, pad_token_id=pad_token_id,
                   chat_template=chat_template)

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
        return cls._wrap(  # built here, ours to change: not copied as `from_backend` copies
            backend, eos_token_id=None if eos is None else int(eos),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """From an HF directory (tokenizer.json, tokenizer_config.json, the chat template;
        local files only), with the extra eos ids of generation_config.json."""
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ModelLoadError(f"{path}: no tokenizer.json (only fast-tokenizer files are "
                                 "supported); add it, or pass skip_tokenizer_init=True and "
                                 "token-id prompts")
        from transformers import PreTrainedTokenizerFast  # as in `hf`

        # tokenizer.json as written, not a model-specific class that may rebuild the pipeline
        # from the vocabulary (transformers 5's Qwen2Tokenizer does).
        hf = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        eos = [] if hf.eos_token_id is None else [hf.eos_token_id]
        gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if i is not None and i not in eos:
                eos.append(int(i))
        return cls(hf.backend_tokenizer, eos_token_ids=eos, bos_token_id=hf.bos_token_id,
                   pad_token_id=hf.pad_token_id, chat_template=hf.chat_template, hf=hf)


class DecodeStream:
    """`tokenizers.decoders.DecodeStream` bound to its tokenizer: feed ids one at a time, get
    the text each completes (None while a UTF-8 character is incomplete or a special token is
    skipped)."""

    __slots__ = ("_backend", "_stream")

    def __init__(self, backend: Backend, *, skip_special_tokens: bool) -> None:
        """Args:
            backend: the tokenizer whose decoder turns ids into text.
            skip_special_tokens: special tokens add no text.
        """
        self._backend = backend
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        """Add one token; the new text, if it completed any."""
        return self._stream.step(self._backend, token_id)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)
