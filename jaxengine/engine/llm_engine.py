"""`LLMEngine`: the continuous-batching loop around the pure scheduler and the runner.

One `step()` is docs/DESIGN.md's data flow, a straight line: `schedule` (host, pure) -> runner
(device: padded batch, model step with the KV cache donated, sampling) -> detokenize (stop
strings) -> `update_from_output` (host, pure; it takes the stop strings too) -> outputs, and
the step's statistics to `stat_loggers`. The scheduler state is a value held here, so
`snapshot()` is free. Errors a user can cause raise `ValueError` before anything changes.

The loop itself is one of two, picked once when the engine is built (`engine/loops.py`):
`SyncLoop` finishes each plan in the call that made it; with `async_scheduling`
(docs/DESIGN.md, "Async scheduling") `AsyncLoop` overlaps the host's work on one step with the
device's on the next, its outputs those of the synchronous loop, one call later. Both finish a
collected step with the stages of `engine/step_outputs.py`.

The engine's `KVWorker` (`jaxengine/kv_connector`: host offloading's, `kv_offload/`, prefill/
decode disaggregation's, `kv_transfer/`, or the base one that moves nothing) is called at the
same points whichever it is: its connector answers every `schedule()` call, and it carries out
the plan's transfers between `schedule` and the step's dispatch.

Structured outputs (docs/DESIGN.md, "Structured outputs"): `add_request` submits the grammar to
the engine's `GrammarCompiler` and the request waits as WAITING_FOR_FSM; each `step()` first
passes the finished compilations to `grammars_ready`. The runner fills the bitmask rows from the
requests' matchers, which accept every sampled token before the scheduler's update. A step
whose batch samples a grammar request overlaps less under async scheduling: its bitmask
needs the token of the step before, so its forward is dispatched, that step collected while
the forward runs, and its sampler dispatched last (vLLM's order).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jaxengine.config import EngineConfig
from jaxengine.engine import inputs
from jaxengine.engine.args import EngineArgs
from jaxengine.engine.grammars import Grammars
from jaxengine.engine.inputs import PromptType, TokenizerLike
from jaxengine.engine.loops import AsyncLoop, SyncLoop
from jaxengine.engine.loras import LoRAAdapters
from jaxengine.engine.outputs import RequestOutput
from jaxengine.engine.parallel_sampling import ParentRequest, ParentRequests, child_params
from jaxengine.engine.request_state import TrackedRequest
from jaxengine.engine.stats import IterationStats, StatLogger
from jaxengine.kv_connector import KVWorker
from jaxengine.kv_offload import OffloadingWorker, offloading_worker
from jaxengine.kv_transfer import KVTransferWorker, kv_transfer_params_of, kv_transfer_worker
from jaxengine.model.fns import ModelFns
from jaxengine.runner.config import RunnerConfig
from jaxengine.runner.runner import Runner
from jaxengine.sampling.bad_words import tokenize_bad_words
from jaxengine.spec.factory import make_speculator
from jaxengine.structured.compiler import GrammarCompiler
from jaxengine.structured.params import StructuredOutputsParams
from scheduler import (
    LoRARequest,
    Request,
    SamplingParams,
    SchedulerOutput,
    SchedulerState,
    abort_requests,
    add_request,
    grammars_ready,
    init_state,
    reset_prefix_cache,
    schedule,
)

# What `on_schedule` is given: (state before, state after, plan) of a step's `schedule` call.
OnSchedule = Callable[[SchedulerState, SchedulerState, SchedulerOutput], None]


class LLMEngine:
    """Continuous batching over one model: add requests, call `step()` until done (an
    `EngineClient`, `jaxengine/engine/client.py`).

    `stat_loggers` (a list; append to it) receive every step's `SchedulerStats` and
    `IterationStats`, and an `IterationStats` of the requests each `abort_request` finished.
    `kv_worker` (a `KVWorker`) moves KV blocks between the pool and a store outside it.
    """

    def __init__(self, model: ModelFns, args: EngineArgs, config: EngineConfig, *,
                 tokenizer: TokenizerLike | None, draft: ModelFns | None = None,
                 stat_loggers: Sequence[StatLogger] = (),
                 make_runner: Callable[[ModelFns, RunnerConfig], Runner] = Runner,
                 clock: Callable[[], float] = time.time,
                 on_schedule: OnSchedule | None = None) -> None:
        """Build the scheduler state and the runner (allocates the KV pool).

        Args:
          model: the model's pure functions and weights (real or fake).
          args: the engine arguments, as given (what `EngineClient.args` reports).
          config: `args` resolved for this model and these devices
            (`jaxengine.engine.engine_config.create_engine_config`); all the engine reads.
          tokenizer: encodes string prompts and decodes outputs; None = token ids only.
          draft: the draft model's functions, for speculative method "draft_model".
          stat_loggers: receivers of each step's statistics (e.g. `jaxengine.metrics`').
          make_runner: builds the runner from the model and its sizes: a `Runner`, or
            anything with the `Runner` methods the loops call (`engine/loops.py`; the
            simulator's prices each step instead: `jaxengine.lab.cost_runner`).
          clock: the time in seconds (default: since the epoch); every time the engine
            stamps (arrivals, request metrics, step statistics) is read from it (the
            simulator's is virtual).
          on_schedule: called with (state before, state after, plan) of every step's
            `schedule` call, before the plan runs (the simulator's step records).
        Raises:
          ValueError: a draft model missing for method "draft_model", or its vocabulary not
            the target's.
        """
        self.args, self.config = args, config
        self.tokenizer = tokenizer
        self.vocab_size = model.vocab_size
        self.scheduler_config = config.scheduler
        self.state: SchedulerState = init_state(self.scheduler_config)
        self.runner = make_runner(model, RunnerConfig.of(config))
        self.speculator = None if config.speculative is None else make_speculator(
            config.speculative, runner=self.runner, draft=draft,
            max_model_len=config.max_model_len,
            eos_token_id=None if tokenizer is None else tokenizer.eos_token_id,
            async_scheduling=config.scheduler.async_scheduling)
        if config.precompile:  # ready once a first short request can run; the rest follows
            self.runner.precompile(background=True)
        # Host offloading (kv_offloading_size) or P/D disaggregation (kv_transfer_config):
        # `EngineArgs` allow one of them; without either the base worker moves nothing.
        self.kv_worker: KVWorker = (
            offloading_worker(config, self.runner, model.kv_page_axis)
            or kv_transfer_worker(config, self.runner, model.kv_page_axis) or KVWorker())
        self.clock = clock
        self._on_schedule = on_schedule
        self._seeds = random.Random(config.seed)
        self._tracked: dict[str, TrackedRequest] = {}
        self._parents = ParentRequests()  # requests of n > 1 samples
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        # The step loop, chosen once: async scheduling's holds the step in flight.
        self._loop = AsyncLoop(self) if config.scheduler.async_scheduling else SyncLoop(self)
        self.grammars = Grammars(tokenizer, vocab_size=self.vocab_size,
                                 eos_token_id=self.eos_token_id,
                                 on_compiler=self._give_runner_executor)
        # LoRA adapters on the host and in the runner's slots (enable_lora); None: off
        self.loras = None if config.lora is None else LoRAAdapters.over(config.lora,
                                                                         self.runner)

    @property
    def kv_offload(self) -> OffloadingWorker | None:
        """The KV worker if it is host offloading's (its store), else None."""
        return self.kv_worker if isinstance(self.kv_worker, OffloadingWorker) else None

    @property
    def kv_transfer(self) -> KVTransferWorker | None:
        """The KV worker if it is P/D disaggregation's (its server), else None."""
        return self.kv_worker if isinstance(self.kv_worker, KVTransferWorker) else None

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach."""
        return self.scheduler_config.max_model_len

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id (None without a tokenizer)."""
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (built on first use, from the tokenizer and the
        model's vocabulary size; a finished grammar allows only the EOS the scheduler stops on).

        Raises:
          SamplingParamsError: the engine has no tokenizer.
        """
        return self.grammars.compiler

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a grammar now (into the compiler's cache, where `add_request` finds it).

        Raises:
          SamplingParamsError: the grammar does not compile, or the engine has no tokenizer.
        """
        self.grammar_compiler.compile(params)

    @property
    def replicas(self) -> tuple[LLMEngine]:
        """This engine, its own only replica (`EngineClient.replicas`)."""
        return (self,)

    def _give_runner_executor(self, compiler: GrammarCompiler) -> None:
        self.runner.grammar_executor = compiler.executor  # fills bitmask rows in parallel

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0,
                    metadata: Mapping[str, str | int | float | bool] | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; one of `params.n` > 1 samples as n requests of one
        (`jaxengine/engine/parallel_sampling.py`: ids `"{i}_{request_id}"`), whose outputs
        come out merged under `request_id`.

        Args:
          request_id: unique among live requests.
          prompt: text, `{"prompt_token_ids": [...]}` / `{"prompt": "..."}`, or token ids.
          params: sampling parameters (default `SamplingParams()`).
          arrival_time: when it arrived, on the engine's `clock` (default: now).
          priority: lower is served first under `scheduling_policy="priority"`.
          metadata: who sent it, e.g. `{"tenant": "a", "user": "u1"}` (str keys; str, int,
            float or bool values), for scheduling policies such as `fair`.
          lora_request: the LoRA adapter to serve it with (needs `enable_lora`); read now if
            the engine does not hold it (`add_lora`).
        Raises:
          SamplingParamsError: a parameter this engine cannot honour (`param` names it).
          ValueError: a bad prompt, a duplicate id, a request that can never fit the KV
            pool, or an adapter without `enable_lora` or that cannot be served (named); the
            engine is unchanged.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):  # its own checks ran when it was built
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n > 1 and kv_transfer_params_of(params.extra_args) is not None:
            raise ValueError(f"kv_transfer_params need n=1 (one sequence's KV is handed on), "
                             f"got n={params.n}")
        arrival = self.clock() if arrival_time is None else arrival_time
        if lora_request is not None:
            self.add_lora(lora_request)  # read and checked before anything is queued
        if params.n == 1:
            self._add_one(request_id, prompt, params, arrival, priority, metadata, lora_request)
            return
        if request_id in self._parents or request_id in self._tracked:
            raise ValueError(f"request {request_id!r}: this id is already in use by a live "
                             f"request")
        parent = ParentRequest(request_id, params)
        added: list[str] = []
        try:
            for rid, child in zip(parent.child_ids, child_params(params), strict=True):
                self._add_one(rid, prompt, child, arrival, priority, metadata, lora_request)
                added.append(rid)
        except BaseException:
            self.abort_request(added)  # the children before the one refused (none, as a rule)
            raise
        self._parents.add(parent)

    def _add_one(self, request_id: str, prompt: PromptType, params: SamplingParams,
                 arrival: float, priority: int,
                 metadata: Mapping[str, str | int | float | bool] | None,
                 lora_request: LoRARequest | None = None) -> None:
        """`add_request` of one sample."""
        text, ids = self.resolve_prompt(prompt)
        if self.tokenizer is not None:
            params = inputs.with_model_eos(params, self.tokenizer.eos_token_ids)
        inputs.check_params(params, max_logprobs=self.config.max_logprobs,
                            vocab_size=self.vocab_size, has_tokenizer=self.tokenizer is not None)
        if params.structured_outputs is not None:
            _ = self.grammar_compiler  # raises without a tokenizer
        bad_words = (tokenize_bad_words(self.tokenizer, params.bad_words,
                                        vocab_size=self.vocab_size)
                     if params.bad_words and self.tokenizer is not None else ())
        request = Request(request_id=request_id, prompt_token_ids=tuple(ids),
                          sampling_params=params, arrival_time=arrival, priority=priority,
                          eos_token_id=self.eos_token_id,
                          metadata={} if metadata is None else metadata,
                          use_structured_output=params.structured_outputs is not None,
                          lora_request=lora_request)
        # The scheduler refuses duplicate ids, empty prompts and prompts with no room for
        # output; its new state is a value, kept only once the engine's own check passes too.
        state = add_request(self.state, request)
        inputs.check_fits_pool(request_id, len(ids), params, self.scheduler_config)
        kv_params = kv_transfer_params_of(params.extra_args)  # refused by name if unservable
        asked = None if kv_params is None else self.kv_worker.check_request(kv_params, len(ids))
        self.state = state
        self.kv_worker.add_request(request_id, asked)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        self._tracked[request_id] = TrackedRequest.start(
            request, prompt=text, seed=seed, tokenizer=self.tokenizer,
            bad_words_token_ids=bad_words)
        if params.structured_outputs is not None:  # WAITING_FOR_FSM until it compiles
            self.grammars.submit(request_id, params.structured_outputs)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finish requests now and free their KV blocks (a request of n samples: its
        unfinished ones); unknown ids are ignored.

        Returns:
          The final output of each live request aborted (finish_reason "abort"); the stat
          loggers count them (each sample of one of n) as finished "abort", as vLLM does.
        """
        ids = self._parents.expand([request_ids] if isinstance(request_ids, str)
                                   else request_ids)
        live = [self._tracked.pop(r) for r in dict.fromkeys(ids) if r in self._tracked]
        if not live:
            return []
        for t in live:
            self.grammars.forget(t.request_id)
        self._loop.drop(t.request_id for t in live)
        self.state = abort_requests(self.state, [t.request_id for t in live],
                                    kv_connector=self.kv_worker.connector)
        stats = IterationStats(timestamp=self.clock())
        outputs = [self._with_kv_transfer_params(t, t.abort(stats.timestamp)) for t in live]
        stats.finished_requests.extend(t.finished_stats() for t in live)
        self._record(stats)
        return self._parents.merged(outputs)

    # ---- LoRA adapters (vLLM's names) ---------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into host memory so requests can use it; True.

        Raises:
          ValueError: LoRA is off (`enable_lora`), or the adapter cannot be served
            (`jaxengine.engine.loras.LoRAAdapters.add`: named).
        """
        return self._adapters("add_lora").add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (host and device); False if the engine did not hold it."""
        return self._adapters("remove_lora").remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The `lora_int_id`s of the adapters the engine holds in host memory."""
        return self._adapters("list_loras").list()

    def _adapters(self, caller: str) -> LoRAAdapters:
        if self.loras is None:
            raise ValueError(f"{caller}: LoRA is off; build the engine with enable_lora=True "
                             f"(--enable-lora)")
        return self.loras

    def lora_slots(self, plan: SchedulerOutput) -> dict[str, int] | None:
        """The device slot of each adapter `plan`'s requests use, its adapters loaded first
        (None with LoRA off): the runner's `lora_slots`."""
        if self.loras is None:
            return None
        return self.loras.slots_for(plan.num_scheduled_tokens,
                                    lambda rid: self._tracked[rid].lora_request)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running, or a KV connector still holds a
        finished one's blocks (the steps that report its transfers free them)."""
        return bool(self._tracked or self.state.held_req_ids)

    def update_weights(self, params: Any) -> None:
        """Serve new model weights from the next request on (`LLM.update_weights`): the
        runner takes them (`Runner.update_weights`: nothing compiles), then the prefix cache
        is emptied, since the KV it holds was computed by the old ones. A draft model keeps
        its weights.

        Raises:
          ValueError: a request is unfinished; the KV worker refuses (KV offloading: its
            host store holds KV of the old weights); `params` not of the model's structure,
            shapes and dtypes (the first leaf that differs named). Nothing changes.
        """
        self.kv_worker.check_update_weights()
        if self.has_unfinished_requests():
            raise ValueError(f"update_weights: {self.get_num_unfinished_requests()} requests "
                             f"are unfinished; let them finish (or abort them) first")
        self.runner.update_weights(params)
        self.state = reset_prefix_cache(self.state)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self._tracked)

    def resolve_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt's text (None if given as ids only) and checked token ids, as `add_request`
        takes it (a data-parallel router reads the ids before it picks a replica).

        Raises:
          ValueError: what `add_request` raises for a bad prompt; nothing changes.
        """
        return inputs.resolve_prompt(prompt, self.tokenizer, self.vocab_size)

    def snapshot(self) -> SchedulerState:
        """The scheduler state: an immutable value (schedule it again to replay or fork)."""
        return self.state

    # ---- the loop (what every call does; the rest is `self._loop`'s, engine/loops.py) ----

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that progressed or finished (only
        the finished ones of a request whose `output_kind` is `FINAL_ONLY`).

        With `async_scheduling` the outputs are those of the step dispatched by the call
        before (the first call returns none; a call that schedules nothing still collects).
        A request whose grammar failed to compile is aborted here (its output comes first).
        """
        failed = self._take_compiled_grammars()
        verified = self._loop.finish_verifying()
        before = self.state
        # Pure scheduler: if anything below raises, self.state is still the old, consistent one.
        state, plan = schedule(before, self.kv_worker.connector)
        if self._on_schedule is not None:
            self._on_schedule(before, state, plan)
        # Copies out and in before the step overwrites or reads the blocks
        self.kv_worker.start_step(plan, state, idle=not plan.num_scheduled_tokens
                                  and self._loop.in_flight is None)
        self._note_scheduled(plan)
        return self._parents.merged(failed + verified + self._loop.step(state, before, plan))

    def shutdown(self) -> None:
        """Stop the runner's background program making (`Runner.shutdown`; what a process
        that exits would otherwise wait for), the KV worker's server or threads and the
        grammar compiler's threads. Call it before dropping an engine in a process that goes
        on; the engine must not step afterwards. Idempotent."""
        self.runner.shutdown()
        self.kv_worker.shutdown()
        self.grammars.shutdown()

    def _take_compiled_grammars(self) -> list[RequestOutput]:
        """Hand finished compilations to the scheduler (`grammars_ready`); abort the requests
        whose grammar failed, with their outputs. With nothing else to do, wait for one."""
        if not self.grammars.num_compiling:
            return []
        idle = self.grammars.num_compiling == len(self._tracked) and self._loop.in_flight is None
        ready, failed = self.grammars.take_compiled(self._tracked, wait=idle)
        if ready:
            self.state = grammars_ready(self.state, ready)
        return self.abort_request(failed) if failed else []

    def _note_scheduled(self, plan: SchedulerOutput) -> None:
        now = self.clock()
        for rid in plan.num_scheduled_tokens:
            self._tracked[rid].on_scheduled(now, plan.num_computed_tokens[rid])

    def _with_kv_transfer_params(self, tracked: TrackedRequest, out: RequestOutput
                                 ) -> RequestOutput:
        """A finished or aborted request's final output `out`, with what the KV worker gives
        it, told whether the scheduler holds its blocks (a producer's handle, by which a
        consumer fetches its KV: vLLM's `RequestOutput.kv_transfer_params`)."""
        rid = tracked.request_id
        held = self.state.kv_transfers.held.get(rid)
        params = self.kv_worker.finish_request(
            rid, held_blocks=None if held is None else held.block_ids,
            num_prompt_tokens=len(tracked.prompt_token_ids))
        return out if params is None else dataclasses.replace(out, kv_transfer_params=params)

    def _record(self, stats: IterationStats) -> None:
        self.kv_worker.record(stats)
        if not self.stat_loggers:
            return
        scheduler_stats = self.state.stats
        for logger in self.stat_loggers:
            logger.record(scheduler_stats, stats)
