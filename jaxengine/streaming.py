"""Streaming an `LLM`'s text as it is produced: each request's new text after every step.

vLLM's offline `LLM` has no streaming call (its server streams); a terminal or a notebook
wants one, so `stream(llm, prompts)` adds the requests to `llm.llm_engine` and steps it, and
`stream_chat` does the same for a conversation. A running request's text is what its
detokenizer shows: it holds back a tail that might begin a stop string, and it only grows, so
one request's `TextDelta.text`s concatenate to exactly its final `CompletionOutput.text` (the
stop string, EOS and stop tokens never appear in a piece).

    with stream(llm, ["Once upon a time"]) as pieces:
        for piece in pieces:
            print(piece.text, end="", flush=True)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxengine.engine.client import EngineClient
from jaxengine.engine.inputs import PromptType
from jaxengine.engine.outputs import RequestOutput
from jaxengine.llm import LLM, Conversation, chat_prompt
from scheduler import SamplingParams, SamplingParamsError


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one step added to one request."""

    index: int  # the request's prompt's position in the list given to `stream`
    text: str  # text new since this request's previous delta ("" only on the finishing one)
    output: RequestOutput  # the engine's snapshot after the step (cumulative text, token ids)

    @property
    def finished(self) -> bool:
        """True on the request's last delta (its `output` then has the finish reason)."""
        return self.output.finished


class TextStream:
    """Iterator of `TextDelta`s over live requests of an engine; `close()` (or leaving a `with`
    block, or an exception in a step) aborts those not finished, freeing their KV blocks.

    Nothing else may step the engine while a stream is open: the outputs of that step are not
    seen here.
    """

    def __init__(self, engine: EngineClient, request_ids: Sequence[str]) -> None:
        """Args:
          engine: the engine holding the requests (an `LLMEngine` or `DataParallelEngine`).
          request_ids: the requests to follow, in prompt order (they are already added).
        """
        self.engine = engine
        self.request_ids = list(request_ids)
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._sent = dict.fromkeys(self.request_ids, "")  # request id -> text yielded so far
        self._pending: deque[TextDelta] = deque()

    @property
    def live(self) -> bool:
        """True while some request of this stream has not finished."""
        return bool(self._sent)

    def step(self) -> list[TextDelta]:
        """Run one engine step; the deltas of this stream's requests whose text grew or that
        finished (possibly none, e.g. during a long prompt's prefill chunks)."""
        if not self._sent:
            return []
        if not self.engine.has_unfinished_requests():
            raise RuntimeError(f"requests {sorted(self._sent)} left the engine unseen: something "
                               f"else stepped or aborted it while this stream was open")
        try:
            outputs = self.engine.step()
        except BaseException:
            self.close()
            raise
        return [d for d in map(self._delta, outputs) if d is not None]

    def _delta(self, out: RequestOutput) -> TextDelta | None:
        sent = self._sent.get(out.request_id)
        if sent is None:  # another caller's request
            return None
        text = out.outputs[0].text
        if not text.startswith(sent):  # the detokenizer's contract; never print wrong text
            raise RuntimeError(f"request {out.request_id!r}: its text {text!r} no longer starts "
                               f"with the text already streamed {sent!r}")
        if out.finished:
            del self._sent[out.request_id]
        elif len(text) == len(sent):
            return None
        else:
            self._sent[out.request_id] = text
        return TextDelta(index=self._index[out.request_id], text=text[len(sent):], output=out)

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> TextDelta:
        while not self._pending:
            if not self._sent:
                raise StopIteration
            self._pending.extend(self.step())
        return self._pending.popleft()

    def close(self) -> list[RequestOutput]:
        """Abort the requests not finished yet; their final outputs (finish reason "abort")."""
        live, self._sent = list(self._sent), {}
        self._pending.clear()
        return self.engine.abort_request(live) if live else []

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stream(llm: LLM, prompts: PromptType | Sequence[PromptType],
           sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
           ) -> TextStream:
    """Add `prompts` to `llm`'s engine now and stream their text.

    Args:
      llm: the `LLM` whose engine runs the requests.
      prompts: one prompt or a list, as `LLM.generate` takes them.
      sampling_params: one for all, or one per prompt (default:
        `llm.get_default_sampling_params()`).
    Returns:
      A `TextStream`: iterate it for `TextDelta`s, in the order the engine produces them.
    Raises:
      ValueError: a bad prompt or parameter, or `n` > 1 (a delta is one text per prompt);
        nothing is left in the engine.
    """
    given = [sampling_params] if isinstance(sampling_params, SamplingParams) else (
        sampling_params or [])
    for sp in given:
        if sp.n != 1:
            raise SamplingParamsError(
                f"stream follows one text per prompt, got n={sp.n}: use LLM.generate for n "
                f"samples, or stream the prompt n times with seeds", param="n", value=sp.n)
    return TextStream(llm.llm_engine, llm.add_requests(prompts, sampling_params))


def stream_chat(llm: LLM, conversation: Conversation,
                sampling_params: SamplingParams | None = None, *,
                add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> TextStream:
    """`stream` of the reply to one conversation (`[{"role": ..., "content": ...}, ...]`),
    rendered by the chat template as `LLM.chat` renders it."""
    prompt = chat_prompt(llm.get_tokenizer(), conversation,
                         add_generation_prompt=add_generation_prompt,
                         chat_template_kwargs=chat_template_kwargs)
    return stream(llm, [prompt], sampling_params)


def in_prompt_order(deltas: Iterable[TextDelta]) -> Iterator[TextDelta]:
    """Reorder a stream so that each prompt's text comes whole and in prompt order: prompt 0's
    deltas pass through live; a later prompt's text made meanwhile is held and comes as one
    delta once the prompts before it finished, and its deltas pass live from then on.

    Concatenated, the texts of the result are the prompts' final texts one after another.
    """
    held: dict[int, TextDelta] = {}  # index -> its text so far, merged, with the last output
    current = 0
    for d in deltas:
        if d.index != current:
            before = held.get(d.index)
            held[d.index] = d if before is None else TextDelta(
                index=d.index, text=before.text + d.text, output=d.output)
            continue
        yield d
        while d.finished:  # the next prompt's held text comes now, whole
            current += 1
            d = held.pop(current, None)  # type: ignore[assignment]
            if d is None:
                break
            yield d
    yield from (held[i] for i in sorted(held))  # the stream stopped early: what there is
