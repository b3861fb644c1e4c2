"""`SamplingParams(n=...)`: one request fanned out into n samples, vLLM V1's `ParentRequest`.

The scheduler never sees `n`: each sample is a request of its own (its child) with `n=1` and
the same prompt, so the prefix cache computes the shared prompt once (the children are admitted
together, and a block is cached when it is allocated). `child_params` is the one rule for the
children's parameters, which both the engine (`LLMEngine.add_request`) and the HTTP server
(`jaxengine/server/serving.py`, whose choices span a list of prompts too) follow: with a seed,
sample i draws with `seed + i` (vLLM V1's), so a seeded request is reproducible and its samples
differ; without one, each child gets the engine's own random seed. `ParentRequest` merges the
children's outputs back into the parent's, as vLLM's output processor does; `ParentRequests`
holds an engine's live ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxengine.engine.outputs import CompletionOutput, RequestOutput
from scheduler import RequestOutputKind, SamplingParams
from scheduler.sampling_params import SEED_MIN


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The `params.n` samples' parameters, each `n=1`: sample i with seed `seed + i` when
    seeded (kept within int64, as vLLM's), else `params`' own (the engine draws a seed per
    request)."""
    one = dataclasses.replace(params, n=1)
    if params.seed is None:
        return [one] * params.n
    return [dataclasses.replace(one, seed=(params.seed + i - SEED_MIN) % 2**64 + SEED_MIN)
            for i in range(params.n)]


def child_request_id(request_id: str, index: int) -> str:
    """The engine's id of sample `index` of request `request_id` (vLLM's `f"{index}_{id}"`)."""
    return f"{index}_{request_id}"


class ParentRequest:
    """The n children of one request, and their outputs merged into the request's.

    Streamed (`CUMULATIVE`): each child's output comes out under the parent's id with that
    child's `CompletionOutput` alone (its `index` the sample's), as vLLM streams them; the
    parent is finished with its last child. `FINAL_ONLY`: one output, once every child has
    finished, with the n completions in index order.
    """

    __slots__ = ("_done", "_final", "_index", "_live", "request_id")

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        """Children of request `request_id` with `params` (`params.n` of them)."""
        self.request_id = request_id
        self._index = {child_request_id(request_id, i): i for i in range(params.n)}
        self._live = set(self._index)  # children whose final output has not come yet
        self._final = params.output_kind is RequestOutputKind.FINAL_ONLY
        self._done: dict[int, CompletionOutput] = {}

    @property
    def child_ids(self) -> list[str]:
        """The children's request ids, by sample index."""
        return list(self._index)

    def merge(self, out: RequestOutput) -> RequestOutput | None:
        """The parent's output for a child's `out` (None: nothing to emit yet, FINAL_ONLY)."""
        i = self._index[out.request_id]
        completion = dataclasses.replace(out.outputs[0], index=i)
        if out.finished:
            self._live.discard(out.request_id)
            self._done[i] = completion
        if self._final:
            if self._live:
                return None
            outputs = [self._done[j] for j in sorted(self._done)]
        else:
            outputs = [completion]
        return dataclasses.replace(out, request_id=self.request_id, outputs=outputs,
                                   finished=not self._live)


class ParentRequests:
    """An engine's live requests of n > 1 samples: by their id, and by each unfinished
    child's id."""

    __slots__ = ("_by_child", "_by_id")

    def __init__(self) -> None:
        self._by_id: dict[str, ParentRequest] = {}
        self._by_child: dict[str, ParentRequest] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def add(self, parent: ParentRequest) -> None:
        """Hold `parent` until its last child's final output is merged (all its children
        queued)."""
        self._by_id[parent.request_id] = parent
        self._by_child.update(dict.fromkeys(parent.child_ids, parent))

    def expand(self, request_ids: Iterable[str]) -> list[str]:
        """The ids with each live parent's replaced by its children's."""
        return [c for r in request_ids
                for c in (self._by_id[r].child_ids if r in self._by_id else (r,))]

    def merged(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs with those of children merged into their parents'
        (`ParentRequest.merge`; a FINAL_ONLY parent's only once all its children finished)."""
        if not self._by_child:
            return outputs
        merged = []
        for out in outputs:
            parent = self._by_child.get(out.request_id)
            if parent is None:
                merged.append(out)
                continue
            if out.finished:
                del self._by_child[out.request_id]
            out = parent.merge(out)
            if out is not None:
                merged.append(out)
                if out.finished:
                    del self._by_id[parent.request_id]
        return merged
