"""Multi-host serving in lockstep: process 0 takes the requests, every process runs each step.

Every process holds the whole engine (the same scheduler, its own shards of the model and KV
cache), and a step is one SPMD program that all of them must run together. The scheduler is
a pure function of its state and inputs, so feeding every process the same inputs in the same
order keeps their states identical, and with them every plan. Only process 0 hears clients,
so before each step it broadcasts what changed since the last one (`StepInputs`: new requests
with their arrival times, aborts, and whether to shut down); the followers apply it, then
step. The alternative, broadcasting each step's plan, would send block tables and token ids
every step and make followers apply a plan their own scheduler did not make; the inputs are
small, usually empty (one 4-byte broadcast), and keep a single code path (docs/DESIGN.md,
"Multi-host").

- `exchange(inputs)`: process 0's inputs to every process (a no-op with one process).
- `LeaderEngine`: process 0's engine, wrapped: it records what it is asked and exchanges it at
  the start of each `step()`; `shutdown()` tells the followers to stop.
- `follow(engine)`: a follower's loop (`jaxengine serve --headless`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxengine.engine.args import EngineArgs
from jaxengine.engine.inputs import PromptType, TokenizerLike
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import RequestOutput
from jaxengine.runner.distributed import broadcast_one_to_all
from jaxengine.structured.params import StructuredOutputsParams
from scheduler import LoRARequest, SamplingParams, SchedulerConfig

logger = logging.getLogger("jaxengine.replicas")

MIN_BUFFER = 256  # bytes; payloads are padded to a power of two, so few shapes ever compile


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NewRequest:
    """An `LLMEngine.add_request` call that process 0's engine accepted, with its arguments."""

    request_id: str
    prompt: PromptType  # as given: text, a prompt dict or token ids (same tokenizer everywhere)
    params: SamplingParams
    arrival_time: float  # process 0's clock: it orders FCFS and priority ties
    priority: int
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # tenant, user, ...


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepInputs:
    """What changed on process 0 since the previous step, in the order it happened there."""

    new_requests: tuple[NewRequest, ...] = ()  # added, in order
    aborts: tuple[str, ...] = ()  # request ids, after the additions (see LeaderEngine)
    shutdown: bool = False  # the followers return instead of stepping

    def is_empty(self) -> bool:
        """Nothing to tell: the step runs on the state every process already has."""
        return not (self.new_requests or self.aborts or self.shutdown)


# ---- the wire ------------------------------------------------------------------------------

def encode(inputs: StepInputs) -> bytes:
    """`inputs` as JSON bytes (b"" when empty); `decode` inverts it exactly."""
    if inputs.is_empty():
        return b""
    body = {"new_requests": [{**dataclasses.asdict(r), "params": dataclasses.asdict(r.params)}
                             for r in inputs.new_requests],
            "aborts": list(inputs.aborts), "shutdown": inputs.shutdown}
    # ASCII escapes keep any string (lone surrogates too) intact; floats print exactly.
    return json.dumps(body, ensure_ascii=True).encode("ascii")


def decode(payload: bytes) -> StepInputs:
    """The `StepInputs` that `encode` wrote."""
    if not payload:
        return StepInputs()
    body = json.loads(payload)
    new = tuple(NewRequest(**{**r, "params": SamplingParams(**r["params"])})
                for r in body["new_requests"])
    return StepInputs(new_requests=new, aborts=tuple(body["aborts"]), shutdown=body["shutdown"])


def exchange(inputs: StepInputs | None) -> StepInputs:
    """Process 0's `inputs` on every process: a collective all processes call in step.

    Two `broadcast_one_to_all`s: the payload's length, then (when not 0) the payload padded
    to a power of two. With one process, `inputs` comes back as it is.

    Args:
      inputs: process 0's; ignored elsewhere (pass None).
    """
    if jax.process_count() == 1:
        assert inputs is not None, "the only process is process 0: it has the inputs"
        return inputs
    source = jax.process_index() == 0
    payload = encode(inputs) if source else b""
    length = int(broadcast_one_to_all(np.int32(len(payload)), is_source=source))
    if length == 0:
        return StepInputs()
    buffer = np.zeros(max(MIN_BUFFER, 1 << (length - 1).bit_length()), np.uint8)
    buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
    buffer = broadcast_one_to_all(buffer, is_source=source)
    return decode(buffer[:length].tobytes())


# ---- the two roles -------------------------------------------------------------------------

Exchange = Callable[[StepInputs | None], StepInputs]


class LeaderEngine:
    """Process 0's `LLMEngine` in multi-host serving; the HTTP server drives it as an engine.

    `add_request` and `abort_request` go to the engine and are recorded; `step()` first hands
    the record to the followers (`exchange`), then steps. Additions are recorded in order,
    aborts after them: the server queues aborts and applies them just before a step, so that
    is also the order they reach the engine here. An `EngineClient`
    (`jaxengine/engine/client.py`): what else the server reads is the engine's.
    Thread-safe: a lock keeps `shutdown()` from overtaking a step still running in a thread.
    """

    def __init__(self, engine: LLMEngine, *, exchange_fn: Exchange = exchange) -> None:
        """Wrap `engine` (nothing else may call it any more)."""
        self._engine = engine
        self._exchange = exchange_fn
        self._lock = threading.Lock()
        self._new: list[NewRequest] = []
        self._aborts: list[str] = []
        self._closed = False

    # ---- what the server reads (the engine's own; `EngineClient`) ---------------------

    @property
    def args(self) -> EngineArgs:
        """The engine's arguments."""
        return self._engine.args

    @property
    def tokenizer(self) -> TokenizerLike | None:
        """The engine's tokenizer (every process loaded the same one)."""
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach."""
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids are in [0, vocab_size))."""
        return self._engine.vocab_size

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The engine's scheduler configuration."""
        return self._engine.scheduler_config

    @property
    def replicas(self) -> tuple[LLMEngine]:
        """The wrapped engine: its scheduler state, runner and `stat_loggers` (the server
        appends its loggers there; only its steps run through this wrapper)."""
        return (self._engine,)

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Nothing: the grammar compiles in `add_request`, on every process (a grammar that
        does not compile aborts the request at the next step)."""

    def has_unfinished_requests(self) -> bool:
        """True while the engine has a request waiting or running."""
        return self._engine.has_unfinished_requests()

    # ---- what is recorded for the followers --------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0, metadata: Mapping[str, Any] | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """`LLMEngine.add_request`; a request it accepts is recorded for the followers.

        Raises:
          ValueError: a `lora_request` (the followers are not sent adapters yet).
        """
        if lora_request is not None:
            self.add_lora(lora_request)  # raises
        params = SamplingParams() if params is None else params
        arrival = time.time() if arrival_time is None else arrival_time
        with self._lock:
            self._check_open()
            self._engine.add_request(request_id, prompt, params, arrival_time=arrival,
                                     priority=priority, metadata=metadata)
            self._new.append(NewRequest(request_id=request_id, prompt=_plain(prompt),
                                        params=params, arrival_time=arrival, priority=priority,
                                        metadata=dict(metadata or {})))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Refused: the followers are not sent adapters yet.

        Raises:
          ValueError: always, naming enable_lora.
        """
        raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: a multi-host engine "
                         f"serves no adapters yet; run it without enable_lora")

    def remove_lora(self, lora_int_id: int) -> bool:
        """No adapter is ever held: False."""
        del lora_int_id
        return False

    def list_loras(self) -> set[int]:
        """No adapter is ever held."""
        return set()

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """`LLMEngine.abort_request`, recorded for the followers."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            if not self._closed:  # after shutdown the followers are gone: only tidy up here
                self._aborts.extend(ids)
            return self._engine.abort_request(ids)

    def step(self) -> list[RequestOutput]:
        """Send the followers what changed, then run the step with them."""
        with self._lock:
            self._check_open()
            self._exchange(self._take(shutdown=False))
            return self._engine.step()

    def shutdown(self) -> None:
        """Tell the followers to return (after any step in flight), and shut the engine down
        (`LLMEngine.shutdown`); later calls do nothing."""
        with self._lock:
            if not self._closed:
                self._exchange(self._take(shutdown=True))
                self._closed = True
                self._engine.shutdown()

    def _take(self, *, shutdown: bool) -> StepInputs:
        inputs = StepInputs(new_requests=tuple(self._new), aborts=tuple(self._aborts),
                            shutdown=shutdown)
        self._new, self._aborts = [], []
        return inputs

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the multi-host engine was shut down; its followers are gone")


def _plain(prompt: PromptType) -> PromptType:
    """The prompt as JSON types (a mapping as a dict, token ids as a list)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        return {k: (list(v) if k == "prompt_token_ids" else v) for k, v in prompt.items()}
    return list(prompt)


def apply_inputs(engine: LLMEngine, inputs: StepInputs) -> None:
    """Do to a follower's engine what process 0 did to its own (additions, then aborts)."""
    for r in inputs.new_requests:
        engine.add_request(r.request_id, r.prompt, r.params, arrival_time=r.arrival_time,
                           priority=r.priority, metadata=r.metadata)
    if inputs.aborts:
        engine.abort_request(list(inputs.aborts))


def follow(engine: LLMEngine, *, exchange_fn: Exchange = exchange) -> int:
    """A follower's loop: take process 0's inputs, apply them, step; until told to stop.

    Every process runs exactly the steps process 0 runs, on the same state, so each step's
    collectives line up. A step that raises is logged and the loop goes on, as the server does
    on process 0: a failing SPMD step fails everywhere, the engine keeps its old state, and
    process 0's aborts of the failed batch arrive with the next inputs. A request process 0
    accepted but this engine refuses means the processes were not started alike: that raises.

    Returns:
      The number of steps run.
    """
    steps = 0
    while not (inputs := exchange_fn(None)).shutdown:
        apply_inputs(engine, inputs)
        try:
            engine.step()
        except Exception:
            logger.exception("engine step failed on this follower; going on with process 0")
        steps += 1
    apply_inputs(engine, inputs)  # aborts of the requests still running at shutdown
    return steps
