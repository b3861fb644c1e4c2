"""Data parallelism: M engine replicas, each on its own device group, behind one router.

`DataParallelEngine` is an `EngineClient` (`jaxengine/engine/client.py`), as `LLMEngine` is,
so `LLM` and the server drive either alike (add, abort, step, ...). Each replica is a whole
`LLMEngine` (its own scheduler state, KV pool and model copy, on `tensor_parallel_size` devices
of its own); `router.route` picks the replica for each new request from the replicas'
scheduler states (longest prefix-cache hit, else least loaded), and the request lives there
until it finishes. Request ids are unique across replicas; an abort goes to the replica that
owns the request; a step steps every replica that has work.

Seeds: a request without a `seed` gets one here, drawn from `EngineArgs.seed` in the order
requests arrive, exactly as a single engine draws them; so the outputs are the same whatever
`data_parallel_size` (greedy or sampled), and identical prompts sent to two replicas do not
sample alike.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.build import build_engine
from jaxengine.engine.inputs import PromptType, TokenizerLike
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import RequestOutput
from jaxengine.replicas.router import Route, route
from jaxengine.structured.params import StructuredOutputsParams
from scheduler import LoRARequest, Request, SamplingParams, SchedulerConfig, SchedulerState


class DataParallelEngine:
    """Several `LLMEngine` replicas as one engine: add requests, call `step()` until done (an
    `EngineClient`, `jaxengine/engine/client.py`; `replicas` are the `LLMEngine`s)."""

    def __init__(self, replicas: Sequence[LLMEngine]) -> None:
        """Serve `replicas` (built alike: the same model and arguments, distinct devices).

        Raises:
          ValueError: no replicas.
        """
        if not replicas:
            raise ValueError("a DataParallelEngine needs at least one replica")
        self.replicas: tuple[LLMEngine, ...] = tuple(replicas)
        self._owner: dict[str, int] = {}  # request id -> replica index, while unfinished
        self._seeds = random.Random(self.args.seed)

    # ---- what LLM and the server read (every replica has the same) ---------------------

    @property
    def args(self) -> EngineArgs:
        """The engine arguments (every replica's)."""
        return self.replicas[0].args

    @property
    def tokenizer(self) -> TokenizerLike | None:
        """Replica 0's tokenizer (each replica loaded the same one)."""
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach."""
        return self.replicas[0].max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids are in [0, vocab_size))."""
        return self.replicas[0].vocab_size

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """Replica 0's scheduler configuration (replicas on like devices get like pools)."""
        return self.replicas[0].scheduler_config

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id (None without a tokenizer)."""
        return self.replicas[0].eos_token_id

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0, metadata: Mapping[str, Any] | None = None,
                    lora_request: LoRARequest | None = None) -> Route:
        """Route a request to a replica and queue it there (`LLMEngine.add_request`'s args).

        Returns:
          Where it went and why (its prefix-cache hit there, that replica's load).
        Raises:
          ValueError: an id that an unfinished request has on any replica, or whatever the
            replica's `add_request` raises; nothing changes then.
        """
        if request_id in self._owner:
            raise ValueError(f"request {request_id!r}: this id is already in use by an "
                             f"unfinished request; give each live request its own id")
        params = SamplingParams() if params is None else params
        text, ids = self.replicas[0].resolve_prompt(prompt)
        # The engine takes no cache_salt, so neither does the request the router looks up; its
        # parameters count (a prompt-logprobs request reads no prefix cache: routed by load).
        # Parameters of a wrong type are the replica's to refuse, below.
        looked_up = params if isinstance(params, SamplingParams) else SamplingParams()
        # Its adapter counts too: the prefix cache keys blocks by adapter.
        where = route(self.snapshots(), Request(request_id=request_id,
                                                prompt_token_ids=tuple(ids),
                                                sampling_params=looked_up,
                                                lora_request=lora_request))
        seeds = self._seeds.getstate()
        if isinstance(params, SamplingParams) and params.seed is None:  # else the replica refuses
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(32))
        try:
            self.replicas[where.replica].add_request(
                request_id, {"prompt": text, "prompt_token_ids": ids}, params,
                arrival_time=arrival_time, priority=priority, metadata=metadata,
                lora_request=lora_request)
        except BaseException:
            self._seeds.setstate(seeds)  # a refused request takes no seed, as in one engine
            raise
        self._owner[request_id] = where.replica
        return where

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests on the replicas that own them; unknown ids are ignored.

        Returns:
          The final output of each live request aborted (finish_reason "abort").
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for rid in dict.fromkeys(ids):
            owner = self._owner.pop(rid, None)
            if owner is not None:
                by_replica.setdefault(owner, []).append(rid)
        outputs = []
        for i, rids in sorted(by_replica.items()):
            outputs += self.replicas[i].abort_request(rids)
        return outputs

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """`LLMEngine.add_lora` on every replica (each holds its own adapters)."""
        return all([r.add_lora(lora_request) for r in self.replicas])

    def remove_lora(self, lora_int_id: int) -> bool:
        """`LLMEngine.remove_lora` on every replica; True if one held it."""
        return any([r.remove_lora(lora_int_id) for r in self.replicas])

    def list_loras(self) -> set[int]:
        """The adapters any replica holds in host memory."""
        return set().union(*(r.list_loras() for r in self.replicas))

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Nothing: the replica the router picks compiles the grammar in its `add_request`
        (a grammar that does not compile aborts the request at its replica's next step)."""

    def replica_of(self, request_id: str) -> int | None:
        """The index of the replica holding an unfinished request (None if none does)."""
        return self._owner.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any replica has a request waiting or running."""
        return any(r.has_unfinished_requests() for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running, over all replicas."""
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def snapshots(self) -> tuple[SchedulerState, ...]:
        """Each replica's scheduler state (immutable values), in replica order."""
        return tuple(r.snapshot() for r in self.replicas)

    # ---- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Step every replica that has work, one after another; return all their outputs.

        Each replica's `step()` waits for its own tokens, so the replicas' device work does
        not overlap. If a replica raises, the replicas before it have stepped and their
        outputs are lost with the exception (the server then aborts everything in flight).
        """
        outputs: list[RequestOutput] = []
        for replica in self.replicas:
            if replica.has_unfinished_requests():
                step_outputs = replica.step()
                for out in step_outputs:
                    if out.finished:
                        del self._owner[out.request_id]
                outputs += step_outputs
        return outputs

    def shutdown(self) -> None:
        """Shut every replica down (`LLMEngine.shutdown`)."""
        for replica in self.replicas:
            replica.shutdown()


def device_groups(data_parallel_size: int, tensor_parallel_size: int,
                  devices: Sequence[jax.Device] | None = None) -> list[list[jax.Device]]:
    """Replica i's devices: `devices[i*N:(i+1)*N]` with N = tensor_parallel_size.

    Args:
      data_parallel_size, tensor_parallel_size: M and N.
      devices: exactly M*N devices; default: the first M*N of `jax.devices()`.
    Raises:
      ValueError: fewer than M*N devices, or given devices not M*N of them.
    """
    m, n = data_parallel_size, tensor_parallel_size
    sizes = f"data_parallel_size={m} x tensor_parallel_size={n}"
    if devices is None:
        available = jax.devices()
        if len(available) < m * n:
            raise ValueError(
                f"{sizes} needs {m * n} devices, but jax sees {len(available)} "
                f"({jax.default_backend()}); lower data_parallel_size or tensor_parallel_size "
                f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N virtual "
                f"devices)")
        devices = available[:m * n]
    devices = list(devices)
    if len(devices) != m * n:
        raise ValueError(f"{sizes} needs {m * n} devices, but {len(devices)} were given; pass "
                         f"exactly {m * n}")
    return [devices[i * n:(i + 1) * n] for i in range(m)]


def build_engines(args: EngineArgs, *, devices: Sequence[jax.Device] | None = None
                  ) -> LLMEngine | DataParallelEngine:
    """One engine, or `data_parallel_size` replicas of it behind the router.

    Each replica is `build_engine(args, devices=group)` on its own group of
    `tensor_parallel_size` devices (`device_groups`); the model is loaded once per replica.

    Args:
      args: engine arguments.
      devices: all replicas' devices (data_parallel_size x tensor_parallel_size of them);
        default: the first ones of `jax.devices()`.
    Raises:
      ValueError: too few devices, data parallelism over several processes (not supported:
        every process would run every replica's step, also on devices it cannot address), or
        what `build_engine` raises.
    """
    if args.data_parallel_size == 1:
        return build_engine(args, devices=devices)
    if jax.process_count() > 1:
        raise ValueError(f"data_parallel_size={args.data_parallel_size} with "
                         f"{jax.process_count()} processes is not supported; use "
                         f"data_parallel_size=1 for multi-host (tensor_parallel_size spans the "
                         f"hosts)")
    groups = device_groups(args.data_parallel_size, args.tensor_parallel_size, devices)
    return DataParallelEngine([build_engine(args, devices=g) for g in groups])
