"""`TransferConnector`: the scheduler side of prefill/decode disaggregation
(docs/SCHEDULING.md §11), vLLM's NIXL connector's rules.

- A consumer's request with a producer's handle loads every prompt token past the local
  prefix-cache hit, asynchronously: it waits in WAITING_FOR_REMOTE_KVS while the worker
  fetches the pages, and, once they are in, the scheduler recomputes only the last prompt token
  (for its logits; vLLM's `_update_waiting_for_remote_kv`).
- A producer's request asked to be decoded elsewhere keeps its blocks when it finishes with
  all its `max_tokens` (the proxy's 1), as vLLM's `request_finished` holds a request capped by
  its length: one aborted before has nothing to hand on, and is freed. (vLLM checks the length
  before EOS, so a last token that is also EOS still counts as capped there; counting the
  outputs here gives the same answer without the finish reason, which the view does not
  carry.)

The worker fills and empties the two tables between steps only (`KVTransferWorker`), so the
methods are pure, as §11 asks.
"""

from __future__ import annotations

from jaxengine.kv_transfer.params import RemoteHandle
from scheduler import KVConnector, RequestView


class TransferConnector(KVConnector):
    """Which requests load their prompt's KV from a producer, and which hold theirs for one."""

    def __init__(self) -> None:
        self.remote_prefill: dict[str, RemoteHandle] = {}  # consumer: not yet loading
        self.remote_decode: set[str] = set()  # producer: hold the blocks when finished

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt past the local hit, asynchronously, for a request with a handle."""
        if request.request_id not in self.remote_prefill:
            return 0, False
        count = len(request.prompt_token_ids) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def request_finished(self, request: RequestView, block_ids: tuple[int, ...]) -> bool:
        """Hold a do_remote_decode request's blocks if it got all its max_tokens."""
        max_tokens = request.sampling_params.max_tokens
        return (request.request_id in self.remote_decode and max_tokens is not None
                and request.num_output_tokens >= max_tokens)
