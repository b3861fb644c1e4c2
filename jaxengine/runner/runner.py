"""The model runner: a `SchedulerOutput` in, one sampled token per sampling request out.

It owns the device side of a step: the plan packed into a padded `ModelBatch`
(`jaxengine/runner/step_batch.py`), the jitted model step (KV cache donated, so it is updated
in place), and the jitted sampler (compiled per request bucket).
With `precompile()` every bucket is compiled up front (or loaded whole from an earlier run:
`jaxengine/runner/executables.py`; the larger ones may follow on a background thread, which a
step needing one waits for); after that a workload compiles nothing, and with
`debug_recompiles` a compilation raises `RecompileError`.

A step is `dispatch` (pack, then enqueue the step and the sampler: JAX dispatches them
asynchronously and returns at once) and `collect` (wait for the tokens, copy them to the host).
Async scheduling puts host work between the two; `execute` is both at once. A placeholder input
(`scheduler.PLACEHOLDER_TOKEN_ID`) is filled inside the step from the previous step's sampled
tokens, which never leave the device for it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxengine.model.fns import ModelFns
from jaxengine.model.fns import signature as model_signature
from jaxengine.runner.bucket_programs import (
    Bucket,
    BucketPrograms,
    abstract,
    describe,
    devices_of,
    make_program,
    spec,
)
from jaxengine.runner.buckets import pick_bucket
from jaxengine.runner.compiles import (
    Compiles,
    RecompileError,
    compile_count,
    compiles_by_name,
    ensure_listener,
)
from jaxengine.runner.config import RunnerConfig, RunnerStats
from jaxengine.runner.distributed import to_host
from jaxengine.runner.in_flight import Forward, InFlight, SampledToken, sampled_tokens
from jaxengine.runner.lora_inputs import WRITE_LORA_NAME, lora_inputs_for
from jaxengine.runner.penalty_inputs import WRITE_SLOT_NAME, PenaltyInputs
from jaxengine.runner.programs import SAMPLE_NAME, STEP_NAME, programs_for
from jaxengine.runner.prompt_logprob_inputs import PromptLogprobChunk, PromptLogprobInputs
from jaxengine.runner.step_batch import batch_spec, first_rows, pack_step
from jaxengine.runner.verify import sampler_rows
from jaxengine.runner.weights import place_weights
from jaxengine.sampling.logits_processors import build_adjustments
from jaxengine.sampling.rows import MAX_BANNED, SamplingRow, build_sampling_metadata
from jaxengine.sampling.sampler import SamplerOutput
from jaxengine.structured.bitmask import allocate_bitmask, bitmask_width, fill_bitmasks
from scheduler import SchedulerOutput

logger = logging.getLogger("jaxengine.runner")

# The programs a runner makes, by the names its compilations are counted under.
_PROGRAM_NAMES = (STEP_NAME, SAMPLE_NAME, WRITE_SLOT_NAME, WRITE_LORA_NAME)


class Runner:
    """Runs scheduler plans on a model; holds the KV cache as a donated value."""

    def __init__(self, model: ModelFns, config: RunnerConfig) -> None:
        """Allocate the KV pool and build the two jitted functions (nothing compiles yet)."""
        ensure_listener()
        self.model = model
        self.config = config
        self.token_buckets, self.request_buckets = config.buckets()
        init = model.init_kv
        if config.num_kv_cache_groups > 1:  # the pool in the groups' layout (kv_groups.py)
            init = model.init_group_kv or model.init_kv
        self.kv = init(config.num_blocks, config.block_size)
        self.stats = RunnerStats()
        self.warm = False
        # The sampled tokens a step reads its placeholders from live where the sampler puts
        # them: replicated over the model's mesh (or uncommitted, for an unsharded model), so
        # the step has one signature whether it reads a real step's tokens or none.
        sharding = getattr(self.kv, "sharding", None)
        self._token_sharding = (NamedSharding(sharding.mesh, PartitionSpec())
                                if isinstance(sharding, NamedSharding) else None)
        self._no_tokens = self._put(np.zeros(config.max_num_rows, np.int32))
        # Penalty/bias rows of the requests that use them (runner/penalty_inputs.py).
        self.penalties = PenaltyInputs(config.max_num_seqs, model.vocab_size, put=self._put,
                                       sharding=self._token_sharding)
        # Token bitmasks of structured outputs (jaxengine/structured): an i32[Rb, ceil(V/32)]
        # sampler input per step; batches without a grammar reuse one all-ones array per bucket.
        self._all_allowed: dict[int, jax.Array] = {}
        self.grammar_executor: Any = None  # llguidance.LLExecutor: fills rows in parallel
        # Programs of others to compile with these (a draft model's: jaxengine/spec).
        self.precompile_hooks: list[Callable[[], None]] = []
        # Requests that asked for prompt logprobs, each step's targets (sampling/prompt_logprob*)
        self.prompt_logprobs = PromptLogprobInputs()
        # LoRA adapter slots (runner/lora_inputs.py); None: LoRA off
        self.lora = lora_inputs_for(model.lora_layout, config)

        # Runners over the same model object share its programs (runner/programs.py); the
        # executables `precompile` made are this runner's, by bucket.
        self._programs = programs_for(model)
        self._executables = BucketPrograms()
        self._devices = devices_of(self.kv)  # where the programs run, in assignment order
        self._stats_lock = threading.Lock()  # a background thread counts what it makes
        self._abstract_params: Any = None  # the weights and the pool as programs take them
        self._abstract_kv: Any = None
        self._abstract_lora: Any = None  # the adapter slots (None: LoRA off)
        self._hidden_spec: jax.ShapeDtypeStruct | None = None  # the sampler's hidden rows
        self._step_statics = dict(max_logprobs=config.max_logprobs)
        self._sample_statics = dict(max_logprobs=config.max_logprobs,
                                    num_rows=config.max_num_rows,
                                    token_sharding=self._token_sharding)

    # ---- compilation -------------------------------------------------------------------

    def _put(self, x: np.ndarray) -> jax.Array:
        """On the device, replicated over the model's mesh if it has one."""
        return (jnp.asarray(x) if self._token_sharding is None
                else jax.device_put(x, self._token_sharding))

    def compilations(self) -> int:
        """Process-wide compilations of the step, the sampler and the slot writers (penalties,
        LoRA) of all runners."""
        return compile_count(*_PROGRAM_NAMES)

    @property
    def num_programs(self) -> int:
        """What `precompile` compiles: a step per token bucket, a sampler per request bucket
        and the penalty-slot writer (which depends on no model: runners of the same shapes in
        one process share it), and with LoRA the adapter-slot writer."""
        return len(self.token_buckets) + len(self.request_buckets) + 1 + (self.lora is not None)

    def precompile(self, *, progress: bool = True, background: bool = False) -> None:
        """Make ready the step of every token bucket and the sampler of every request bucket:
        each loaded whole when it was saved before (jaxengine/runner/executables.py: no
        tracing), else traced and compiled (or loaded from JAX's persistent cache) and then
        saved. The runner is warm afterwards: later steps call these executables and compile
        nothing (docs/JAX_NOTES.md, "Counting compilations").

        Args:
          progress: a bar over the programs made here.
          background: make only what a first short request needs here (the smallest token
            bucket's step: one decode token, and the smallest request bucket's sampler) and
            the rest afterwards on a background thread, smallest first; a step that needs
            one of those waits for it (`BucketPrograms`).
        """
        before, t0 = self._compiles_here(), time.perf_counter()
        first: list[Bucket] = [("step", self.token_buckets[0]),
                               ("sample", self.request_buckets[0])]
        rest = sorted(({("step", t) for t in self.token_buckets}
                       | {("sample", r) for r in self.request_buckets}) - set(first),
                      key=lambda bucket: (bucket[1], bucket[0]))
        now, later = (first, rest) if background else (first + rest, [])
        # Abstract, so that the background thread never reads the pool a step donates.
        self._abstract_params = abstract(self.model.params)
        self._abstract_kv = abstract(self.kv)
        self._abstract_lora = None if self.lora is None else abstract(self.lora.slots)
        for bucket in tqdm(now, desc="precompile", disable=not progress):
            self._executables.put(bucket, self._make_program(bucket))
        signature = model_signature(self.model)
        self.penalties.precompile_write_slot(self._prev_spec(), signature=signature,
                                             devices=self._devices)
        if self.lora is not None:
            self.lora.precompile(signature=signature, devices=self._devices)
        with self._stats_lock:
            self.stats.compilations += (self._compiles_here() - before).total
            self.stats.compile_seconds += time.perf_counter() - t0
        logger.info("compiled %d programs (%d token buckets, %d request buckets) in %.2f s%s",
                    len(now) + 1 + (self.lora is not None), len(self.token_buckets),
                    len(self.request_buckets),
                    time.perf_counter() - t0,
                    f"; {len(later)} more follow in the background" if later else "")
        for hook in self.precompile_hooks:
            hook()
        if later:
            self._executables.make_later(later, self._make_program_counted)
        self.warm = True

    def wait_for_programs(self) -> None:
        """Wait until the programs `precompile(background=True)` left to the background are
        made (at once if none are)."""
        self._executables.wait()

    def shutdown(self) -> None:
        """Stop making programs in the background (`precompile(background=True)`): the one in
        progress is finished, the rest are never made (nor saved for a later start); returns
        once the background thread has ended. A step needing one never made raises
        afterwards. Idempotent."""
        self._executables.stop()

    def _make_program_counted(self, bucket: Bucket) -> jax.stages.Compiled:
        """`_make_program`, its compilations (and loads) added to the stats (a background
        thread's)."""
        before = self._compiles_here()
        compiled = self._make_program(bucket)
        with self._stats_lock:
            self.stats.compilations += (self._compiles_here() - before).total
        return compiled

    def _make_program(self, bucket: Bucket) -> jax.stages.Compiled:
        """`bucket`'s program (`make_program`); the first step's tells the samplers' input."""
        name, jitted, args, statics = self._program_inputs(*bucket)
        compiled = make_program(describe(bucket), name, jitted, args, statics,
                                signature=model_signature(self.model), devices=self._devices)
        if bucket[0] == "step" and self._hidden_spec is None:
            self._hidden_spec = self._hidden_of(compiled)
        return compiled

    def _program_inputs(self, kind: str, size: int
                        ) -> tuple[str, Callable, tuple[Any, ...], dict[str, Any]]:
        """(name, jitted function, abstract arguments, static arguments) of `kind`'s program
        for `size` tokens ("step") or requests ("sample")."""
        prev = self._prev_spec()
        params = self._abstract_params
        if kind == "step":
            fill = self._fill_spec(size)
            batch = batch_spec(self.config, size, lora=self.lora is not None)
            return (STEP_NAME, self._programs.step,
                    (params, self._abstract_kv, batch, prev, fill, fill, self._abstract_lora),
                    self._step_statics)
        md = jax.tree.map(spec, build_sampling_metadata([], size))
        adj = jax.tree.map(spec, build_adjustments([], [], [], [], size))
        t = self.penalties.spec()
        mask = jax.ShapeDtypeStruct((size, bitmask_width(self.model.vocab_size)), np.int32,
                                    sharding=self._token_sharding)
        return (SAMPLE_NAME, self._programs.sample,
                (params, self._hidden_spec, jax.ShapeDtypeStruct((size,), np.int32), md, adj,
                 t.bias, t.prompt_mask, t.output_counts, prev, mask), self._sample_statics)

    def _hidden_of(self, step: jax.stages.Compiled) -> jax.ShapeDtypeStruct:
        """The hidden rows as `step` hands them to the sampler. jit's outputs are committed
        (to their sharding) when an input is: the sampler is compiled for them on the mesh
        then, or a first real call would not match it."""
        out = step.out_info[1]
        committed = any(getattr(x, "sharding", None) is not None
                        for x in jax.tree.leaves((self._abstract_params, self._abstract_kv)))
        return jax.ShapeDtypeStruct(out.shape, out.dtype,
                                    sharding=step.output_shardings[1] if committed else None)

    def _prev_spec(self) -> jax.ShapeDtypeStruct:
        """The sampled tokens' array (i32[R]) as programs take it."""
        return jax.ShapeDtypeStruct(self._no_tokens.shape, np.int32,
                                    sharding=self._token_sharding)

    def _compiles_here(self) -> Compiles:
        """Compilations (loads included) of this runner's kinds of program on this thread."""
        return compiles_by_name(*_PROGRAM_NAMES, this_thread=True)

    def mark_warm(self) -> None:
        """Declare warm-up over: from now on a compilation is counted (and raises in debug)."""
        self.warm = True

    def update_weights(self, params: Any) -> None:
        """Run the model with `params` from the next step on, compiling nothing: they must
        have the structure, shapes and dtypes of `self.model.params`, and are put on its
        shardings (`jaxengine.runner.weights.place_weights`). `self.model` becomes a copy with
        them; the programs stay this runner's (they close over the model's functions, which
        are the same, and take the weights as an argument).

        Raises:
          ValueError: a leaf missing, extra, or of another shape or dtype (named).
        """
        self.model = replace(self.model, params=place_weights(params, self.model.params))

    @staticmethod
    def _fill_spec(num_tokens: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((num_tokens,), np.int32)

    # ---- one step ----------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, rows: Mapping[str, SamplingRow]
                ) -> dict[str, SampledToken]:
        """Run one scheduler plan; return the token of each request in `out.sampling_req_ids`.

        Args:
          out: the plan of one step (no placeholders: see `dispatch`).
          rows: sampling parameters, seed and output position of each sampling request.
        Returns:
          {request id: SampledToken} for the requests that sample this step.
        """
        step = self.dispatch(out, rows)
        return {} if step is None else self.collect(step)

    def dispatch(self, out: SchedulerOutput, rows: Mapping[str, SamplingRow],
                 prev: InFlight | None = None, *, lora_slots: Mapping[str, int] | None = None
                 ) -> InFlight | None:
        """Enqueue one plan's step and sampler on the device; return without waiting.

        Args:
          out: the plan of one step.
          rows: sampling parameters, seed and output position of each sampling request.
          prev: the step before, if its tokens are not on the host yet: each placeholder in
            `out.input_token_ids` is the token that step sampled for the same request.
          lora_slots: with LoRA, the slot of each scheduled request's adapter in `self.lora`
            (the engine loads them first); a request not in it runs the base model.
        Returns:
          The step in flight (pass it to `collect`), or None if the plan schedules nothing.
        Raises:
          ValueError: a placeholder for a request that `prev` does not sample.
        """
        forward = self.dispatch_forward(out, prev, lora_slots=lora_slots)
        return None if forward is None else self.dispatch_sample(forward, rows)

    def dispatch_forward(self, out: SchedulerOutput, prev: InFlight | None = None, *,
                         lora_slots: Mapping[str, int] | None = None) -> Forward | None:
        """`dispatch`'s first half: enqueue the model step only (None if the plan schedules
        nothing). The host may then collect `prev` and build the rows (a grammar's bitmask
        needs `prev`'s tokens) while the device runs it; `dispatch_sample` finishes the step."""
        order = list(out.num_scheduled_tokens)
        if not order:
            return None
        before, t0 = self._compiles_here(), time.perf_counter()
        self.penalties.slots.release(out.finished_req_ids)  # before a reused id asks for one
        self.prompt_logprobs.update(out)
        batch, fill = pack_step(out, order, prev, lora_slots or {}, config=self.config,
                                token_buckets=self.token_buckets,
                                lora=self.lora is not None)
        targets, spans = self.prompt_logprobs.targets(out, order, batch.query_start_loc,
                                                      len(batch.input_ids))
        prev_tokens = self._prev_tokens(prev)
        step = self._executables.get(("step", len(batch.input_ids)))
        if step is None:  # not precompiled: jit compiles it on first use
            step = functools.partial(self._programs.step, **self._step_statics)
        self.kv, hidden, plp = step(self.model.params, self.kv, batch, prev_tokens, fill,
                                    targets, None if self.lora is None else self.lora.slots)
        return Forward(plan=out, order=order, hidden=hidden, prev=prev, started=t0,
                       compiles_before=before, num_tokens=len(batch.input_ids),
                       total=int(batch.query_start_loc[-1]),
                       prompt_logprobs=(plp, targets, spans) if spans else None)

    def dispatch_sample(self, forward: Forward, rows: Mapping[str, SamplingRow]) -> InFlight:
        """`dispatch`'s second half: enqueue the sampler of a dispatched model step."""
        f = forward
        row_ids, result, tokens = self._draw(f.hidden, f.order, f.plan, rows, f.prev)
        step = InFlight(plan=f.plan, rows=rows, result=result, tokens=tokens, row_ids=row_ids,
                        started=f.started, num_tokens=f.num_tokens, total=f.total,
                        prompt_logprobs=f.prompt_logprobs)
        self._account_compiles(f.compiles_before, time.perf_counter() - f.started,
                               step.num_tokens)
        return step

    def collect(self, step: InFlight) -> dict[str, SampledToken]:
        """Wait for a dispatched step's tokens; {request id: SampledToken} of its samplers
        (each one's first row: the step's token when it verifies no drafts)."""
        return {r: tokens[0] for r, tokens in self.collect_rows(step).items()}

    def collect_rows(self, step: InFlight) -> dict[str, list[SampledToken]]:
        """Wait for a dispatched step's tokens; per sampling request the tokens of its rows:
        one, then one per draft it verifies (`jaxengine.spec.Speculator.verify` keeps the
        accepted)."""
        # multi-host: the results are replicated over several processes' devices
        out = ({} if step.result is None
               else sampled_tokens(to_host(step.result), step.row_ids, step.rows))
        s = self.stats
        s.steps += 1
        s.computed_tokens += step.total
        s.padded_tokens += step.num_tokens - step.total
        s.step_seconds += time.perf_counter() - step.started
        return out

    @staticmethod
    def collect_prompt_logprobs(step: InFlight) -> dict[str, PromptLogprobChunk]:
        """The prompt logprobs a collected step computed, by request (read from the device only
        when some position of the step asked for them)."""
        if step.prompt_logprobs is None:
            return {}
        result, targets, spans = step.prompt_logprobs
        return PromptLogprobInputs.read(to_host(result), targets, spans)

    def _prev_tokens(self, prev: InFlight | None) -> jax.Array:
        """i32[R]: the tokens the step in flight samples (zeros of the same sharding without
        one), which the step's placeholders and the sampler's penalty counts read."""
        return self._no_tokens if prev is None else prev.tokens

    def _draw(self, hidden: jax.Array, order: Sequence[str], plan: SchedulerOutput,
              rows: Mapping[str, SamplingRow], prev: InFlight | None
              ) -> tuple[tuple[str, ...], SamplerOutput | None, jax.Array]:
        """Enqueue the sampler on the hidden rows of the plan's samplers and their drafts:
        (the request of each row, its device results, the tokens padded to
        i32[R * (1 + K)]); ((), None, no tokens) when nobody samples."""
        if not plan.sampling_req_ids:
            return (), None, self._no_tokens
        sampling_ids, batch_rows, index = sampler_rows(
            order, plan.sampling_req_ids, rows, plan.scheduled_spec_decode_tokens,
            width=1 + self.config.num_speculative_tokens)
        size = pick_bucket(self.request_buckets, len(sampling_ids))
        row_index = np.zeros(size, np.int32)
        row_index[: len(sampling_ids)] = index
        md = build_sampling_metadata(batch_rows, size, max_banned=MAX_BANNED)
        prev_tokens = self._prev_tokens(prev)
        adj = self.penalties.adjustments(sampling_ids, rows, size, first_rows(prev),
                                         prev_tokens)
        t = self.penalties.tables
        sample = self._executables.get(("sample", size))
        if sample is None:  # not precompiled: jit compiles it on first use
            sample = functools.partial(self._programs.sample, **self._sample_statics)
        out, tokens, counts = sample(
            self.model.params, hidden, row_index, md, adj, t.bias, t.prompt_mask,
            t.output_counts, prev_tokens, self._bitmask(batch_rows, size))
        self.penalties.tables = replace(t, output_counts=counts)
        return tuple(sampling_ids), out, tokens

    def _bitmask(self, batch_rows: Sequence[SamplingRow], size: int) -> jax.Array:
        """i32[size, ceil(V/32)] on the device: each row's allowed next tokens from its
        grammar matcher (all ones without one, and in padding rows)."""
        matchers = [row.grammar for row in batch_rows]
        if all(m is None for m in matchers):
            if size not in self._all_allowed:
                self._all_allowed[size] = self._put(allocate_bitmask(size,
                                                                     self.model.vocab_size))
            return self._all_allowed[size]
        mask = fill_bitmasks(matchers, allocate_bitmask(size, self.model.vocab_size),
                             self.grammar_executor)
        return self._put(mask)

    def _account_compiles(self, compiles_before: Compiles, seconds: float,
                          num_tokens: int) -> None:
        s = self.stats
        new = self._compiles_here() - compiles_before
        with self._stats_lock:
            s.compilations += new.total
        if new.total:
            s.compile_seconds += seconds
        if self.warm and new.total:
            s.compilations_after_warmup += new.total
            message = (f"{new.total} compilation(s) after warm-up in a step of {num_tokens} "
                       f"tokens: {new}; buckets: tokens {self.token_buckets}, requests "
                       f"{self.request_buckets}")
            if self.config.debug_recompiles:
                raise RecompileError(message)
            logger.warning("%s", message)

