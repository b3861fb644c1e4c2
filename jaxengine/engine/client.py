"""`EngineClient`: what the server, `LLM` and the CLI may ask of an engine (vLLM's name).

Three classes implement it: `LLMEngine` (one model), `DataParallelEngine` (replicas behind a
router, `jaxengine/replicas/data_parallel.py`) and `LeaderEngine` (process 0 of a multi-host
run, `jaxengine/replicas/lockstep.py`). Callers read only these members, so they need not know
which engine they drive; what differs per replica (the scheduler state, the runner, the stat
loggers) they reach through `replicas`. `tests/jaxengine/engine/test_client.py` checks that
each class has every member.

This file imports nothing at run time beyond `typing`: the engines import it, not it them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jaxengine.engine.args import EngineArgs
    from jaxengine.engine.inputs import PromptType, TokenizerLike
    from jaxengine.engine.llm_engine import LLMEngine
    from jaxengine.engine.outputs import RequestOutput
    from jaxengine.structured.params import StructuredOutputsParams
    from scheduler import LoRARequest, SamplingParams, SchedulerConfig


@runtime_checkable
class EngineClient(Protocol):
    """An engine as its callers drive it: add requests, `step()` until done, abort.

    Only one caller may drive an engine at a time (the server's loop, or `LLM`); none of
    these members is thread-safe unless the implementation says so.
    """

    @property
    def args(self) -> EngineArgs:
        """The engine arguments it was built with (every replica's)."""
        ...

    @property
    def tokenizer(self) -> TokenizerLike | None:
        """Encodes string prompts and decodes outputs; None: token ids only."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach."""
        ...

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids are in [0, vocab_size))."""
        ...

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler configuration (replica 0's; replicas on like devices get like
        pools): the KV pool's size, the batch limits."""
        ...

    @property
    def replicas(self) -> Sequence[LLMEngine]:
        """The `LLMEngine`s doing the work, in replica order: each has its own scheduler state
        (`snapshot()`), runner (warm-up) and `stat_loggers` (replica i records under index i).
        A plain engine is its own only replica."""
        ...

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0, metadata: Mapping[str, Any] | None = None,
                    lora_request: LoRARequest | None = None) -> object:
        """Queue a request (`LLMEngine.add_request`'s arguments and errors); callers ignore
        what it returns (a data-parallel engine says where the request went).

        Raises:
          ValueError: a bad prompt or parameter (`SamplingParamsError` names it); nothing
            changes.
        """
        ...

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Hold a LoRA adapter for requests to use (vLLM's; `LLMEngine.add_lora`).

        Raises:
          ValueError: LoRA off, or an adapter that cannot be served (named).
        """
        ...

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if none was held under that id."""
        ...

    def list_loras(self) -> set[int]:
        """The ids of the adapters held."""
        ...

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finish requests now and free their KV blocks; unknown ids are ignored.

        Returns:
          The final output of each live request aborted (finish_reason "abort").
        """
        ...

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting or running (a step would make progress)."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one iteration; the outputs of the requests that progressed or finished."""
        ...

    def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a structured-output grammar before its request is added, so a grammar that
        cannot compile is refused up front (the server answers 400) and `add_request` finds it
        compiled. An engine that compiles grammars only where `add_request` sends the request
        (a data-parallel or multi-host one) does nothing here.

        Raises:
          SamplingParamsError: the grammar does not compile, or the engine has no tokenizer.
        """
        ...

    def shutdown(self) -> None:
        """Stop what the engine runs in the background (its runners' program making, its
        grammar compilers' threads) and wait for it; the engine must not step afterwards.
        Idempotent."""
        ...
