"""`LLM`: vLLM's offline API — `generate`, `chat` and `get_metrics` over an `LLMEngine`, or
over `data_parallel_size` replicas of one (`jaxengine.replicas.data_parallel`); it reads only
what `EngineClient` (`jaxengine/engine/client.py`) lists."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from tqdm.auto import tqdm

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.client import EngineClient
from jaxengine.engine.inputs import PromptType
from jaxengine.engine.outputs import RequestOutput
from jaxengine.loading.generation_config import diff_sampling_params
from jaxengine.metrics import (
    Metric,
    PrometheusStatLogger,
    aggregate_engines,
    attach_stat_loggers,
    cache_config_info,
    get_metrics_snapshot,
)
from jaxengine.replicas.data_parallel import build_engines
from jaxengine.runner.distributed import initialize_from_args
from jaxengine.runner.weights import check_weights
from scheduler import LoRARequest, RequestOutputKind, SamplingParams

Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """An offline engine: `LLM(model=None, **engine_args).generate(prompts, params)`."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """Load `model` (None: the embedded SmolLM2-135M-Instruct), build the engine and
        compile it, showing progress.

        Loading draws a bar over the checkpoint's tensors (when stderr is a terminal), and
        compiling one over the buckets (`precompile`, on by default here, as vLLM captures its
        graphs at startup): `generate` then compiles nothing and its bar moves from the first
        step. With JAX's persistent compilation cache (`compilation_cache_dir`) a later process
        loads those programs instead of compiling them. `precompile=False` compiles each bucket
        when a step first needs it instead, inside `generate`.

        Args:
          model: an HF model directory or a .gguf file; never downloaded.
          **engine_args: `EngineArgs` fields by vLLM's names (unknown names raise ValueError).
            Multi-host: run the same script on every host with `coordinator_address`,
            `num_processes` and `process_id` (or none where JAX detects them); this joins
            `jax.distributed` first, so no JAX call may come before it.
        """
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        if args.precompile is None:  # EngineArgs leaves it to the caller: LLM() warms up
            args = dataclasses.replace(args, precompile=True)
        initialize_from_args(args)  # before anything starts a JAX backend
        self._attach(build_engines(args))

    @classmethod
    def from_engine(cls, engine: EngineClient) -> LLM:
        """Wrap an existing engine (e.g. one over a fake model in tests); its stat loggers
        gain the one `get_metrics` reads."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: EngineClient) -> None:
        self.llm_engine: EngineClient = engine
        self._ids = itertools.count()
        args = engine.args
        self._default_params = SamplingParams(
            **diff_sampling_params(args.model, args.generation_config))
        self._replicas = tuple(engine.replicas)
        model_name = "default" if args.model is None else str(args.model)
        self._metrics = PrometheusStatLogger(model_name, engine.max_model_len,
                                             engine_indexes=range(len(self._replicas)))
        self._metrics.log_cache_config({i: cache_config_info(r)
                                        for i, r in enumerate(self._replicas)})
        attach_stat_loggers(self._replicas, self._metrics)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, in vLLM's shape (`vllm.v1.metrics.reader`).

        Returns:
          `Counter`, `Gauge` and `Histogram` values (`jaxengine.metrics`) under the names
          `/metrics` serves (`jaxengine:...`), summed over data-parallel replicas (KV cache
          usage averaged), with the `model_name` label (and `finished_reason` where it has one);
          `cache_config_info` has the KV cache configuration as its labels instead.
        """
        for i, replica in enumerate(self._replicas):  # the gauges as of now, not the last step
            self._metrics.record_scheduler(replica.snapshot().stats, i)
        return aggregate_engines(get_metrics_snapshot(self._metrics.registry))

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no `sampling_params` (vLLM's name).

        `SamplingParams()` with the model's recommendations from its generation_config.json
        (`temperature`, `top_p`, `top_k`, `min_p`, `max_new_tokens` as `max_tokens`) unless
        the engine was built with `generation_config="vllm"`; see
        `jaxengine.loading.generation_config`.
        """
        return self._default_params

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.llm_engine.tokenizer

    def update_weights(self, params: Any) -> None:
        """Serve new model weights without reloading or compiling (vLLM's name, of its weight
        transfer API): e.g. params trained with `jax.grad` of `jaxengine.score`.

        Every data-parallel replica gets them (copied to its devices). The prefix cache is
        emptied (its KV is the old weights'); afterwards `model_fns_of(llm)` holds `params`
        and `generate` and `chat` use them. A draft model for speculative decoding keeps its
        own weights.

        Args:
          params: a pytree exactly like `model_fns_of(llm)[0].params` (an nnx.State): the
            same leaves, shapes, dtypes and shardings, e.g. `jax.tree.map` of it.
        Raises:
          ValueError: requests are unfinished (let `generate` return, or abort them); a leaf
            differs (the first named); a multi-host engine; KV offloading is on. Nothing
            changes.
        """
        if jax.process_count() > 1:
            raise ValueError("update_weights runs in one process; a multi-host engine cannot "
                             "take new weights yet")
        check_weights(params, self._replicas[0].runner.model.params)
        if self.llm_engine.has_unfinished_requests():
            raise ValueError(f"update_weights: {self.llm_engine.get_num_unfinished_requests()} "
                             f"requests are unfinished; let them finish (or abort them) first")
        for replica in self._replicas:
            replica.update_weights(params)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read a LoRA adapter into host memory ahead of the requests that use it (vLLM's).

        Raises:
          ValueError: the engine was built without `enable_lora`, or the adapter cannot be
            served (its rank, modules or base model; named).
        """
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it was not held."""
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The `lora_int_id`s of the adapters held in host memory."""
        return self.llm_engine.list_loras()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate completions for all prompts with continuous batching.

        Args:
          prompts: one prompt or a list; each a string or a `{"prompt_token_ids": [...]}` dict.
          sampling_params: one for all prompts or one per prompt (default:
            `get_default_sampling_params()`).
          use_tqdm: show a progress bar.
          lora_request: the LoRA adapter for all prompts, or one (or None: the base model)
            per prompt; needs `enable_lora`.
        Returns:
          Finished `RequestOutput`s in the order of `prompts`, one per prompt; with
          `SamplingParams(n=...)`, its n `CompletionOutput`s (index 0..n-1).
        Raises:
          ValueError: a bad prompt or parameter; nothing was added to the engine.
        """
        # Only the finished outputs are read: the engine builds no per-step output (vLLM's
        # LLM does the same)
        ids = self._add(prompts, sampling_params, RequestOutputKind.FINAL_ONLY, lora_request)
        try:
            return self._run(ids, use_tqdm)
        except BaseException:
            self.llm_engine.abort_request(ids)  # leave the engine empty and its KV blocks free
            raise

    def add_requests(self, prompts: PromptType | Sequence[PromptType],
                     sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                     *, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                     ) -> list[str]:
        """Queue prompts on the engine without stepping it (`generate` and
        `jaxengine.streaming` step it); the arguments are `generate`'s.

        Returns:
          The new requests' ids, in the order of `prompts`.
        Raises:
          ValueError: a bad prompt or parameter; nothing was added to the engine.
        """
        return self._add(prompts, sampling_params, None, lora_request)

    def _add(self, prompts: PromptType | Sequence[PromptType],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             output_kind: RequestOutputKind | None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[str]:
        """`add_requests`, each request's `output_kind` set when given."""
        prompts = _as_list(prompts)
        params = _per_prompt(self._default_params if sampling_params is None else sampling_params,
                             len(prompts), SamplingParams, "sampling params")
        loras = _per_prompt(lora_request, len(prompts), LoRARequest, "lora_request values")
        if output_kind is not None:
            params = [dataclasses.replace(sp, output_kind=output_kind) for sp in params]
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for rid, prompt, sp, lora in zip(ids, prompts, params, loras, strict=True):
                self.llm_engine.add_request(rid, prompt, sp, lora_request=lora)
        except BaseException:
            self.llm_engine.abort_request(ids)  # the ones added before the bad one
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while wanted - done.keys():
                for out in self.llm_engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[r] for r in ids]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them via the chat template.

        Args:
          messages: `[{"role": ..., "content": ...}, ...]`, or a list of such lists.
          sampling_params, use_tqdm, lora_request: as in `generate`.
          add_generation_prompt: end the prompt with the assistant turn's header.
          chat_template_kwargs: extra variables for the template.
        """
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [chat_prompt(self.get_tokenizer(), conv,
                               add_generation_prompt=add_generation_prompt,
                               chat_template_kwargs=chat_template_kwargs)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)


def chat_prompt(tokenizer: Any, conversation: Conversation, *, add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The prompt of one conversation as `LLM.chat` makes it: its chat template's text and ids.

    Raises:
      ValueError: no tokenizer (the engine was built with `skip_tokenizer_init=True`).
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (skip_tokenizer_init=False)")
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                         **dict(chat_template_kwargs or {}))
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        raise ValueError("pass token ids as {'prompt_token_ids': [...]}, not a bare list")
    return prompts


def _per_prompt[T](value: T | Sequence[T], n: int, one: type, what: str) -> list[T]:
    """`value` for each of `n` prompts: one (an instance of `one`, or None) for all of them, or
    a sequence of exactly one per prompt."""
    if value is None or isinstance(value, one):
        return [value] * n  # type: ignore[list-item]
    values = list(value)  # type: ignore[arg-type]
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} prompts; pass one or one per "
                         f"prompt")
    return values
