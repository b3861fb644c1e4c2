"""vLLM V1's scheduler as a host-side immutable state machine (docs/SCHEDULING.md is its contract).

Pure functions from a state (and requests or model output) to a new state and a plan; no
function mutates its arguments, so an old state stays valid and can be scheduled again.
No jax here: this package is plain Python.
"""

from scheduler.config import SchedulerConfig
from scheduler.core.invariants import check_invariants
from scheduler.core.prefix_query import prefix_cache_hit
from scheduler.core.schedule import schedule
from scheduler.core.state import (
    PLACEHOLDER_TOKEN_ID,
    NewRequestData,
    RequestDelta,
    SchedulerCounters,
    SchedulerOutput,
    SchedulerState,
    SchedulerStats,
    init_state,
)
from scheduler.core.update import (
    abort_requests,
    add_request,
    check_stop,
    grammars_ready,
    reset_prefix_cache,
    update_from_output,
)
from scheduler.kv.groups import KVCacheGroup, kv_block_layers, max_concurrency
from scheduler.kv_connector import (
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoad,
    KVSave,
)
from scheduler.metadata import RequestMetadata
from scheduler.policies.policies import (
    POLICIES,
    Policy,
    SortedPolicy,
    register,
    resolve_policy,
    unregister,
)
from scheduler.policies.request_view import RequestView
from scheduler.request import LoRARequest, Request, RequestStatus
from scheduler.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError

__all__ = [
    "PLACEHOLDER_TOKEN_ID", "POLICIES", "KVConnector", "KVConnectorMetadata", "KVConnectorOutput",
    "KVCacheGroup", "KVLoad", "KVSave", "LoRARequest", "NewRequestData", "Policy", "Request",
    "RequestDelta",
    "RequestMetadata", "RequestOutputKind", "RequestStatus", "RequestView", "SamplingParams",
    "SamplingParamsError",
    "SchedulerConfig", "SchedulerCounters", "SchedulerOutput", "SchedulerState", "SchedulerStats",
    "SortedPolicy",
    "abort_requests", "add_request", "check_invariants", "check_stop", "grammars_ready",
    "init_state", "kv_block_layers", "max_concurrency",
    "prefix_cache_hit",
    "register", "reset_prefix_cache", "resolve_policy", "schedule", "unregister",
    "update_from_output",
]
