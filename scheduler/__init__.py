"""vLLM V1's scheduler as a host-side immutable state machine (docs/SCHEDULING.md is its contract).

Pure functions from a state (and requests or model output) to a new state and a plan; no
function mutates its arguments, so an old state stays valid and can be scheduled again.
No jax here: this package is plain Python.
"""

from scheduler.config import SchedulerConfig
from scheduler.invariants import check_invariants
from scheduler.kv_connector import (
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoad,
    KVSave,
)
from scheduler.metadata import RequestMetadata
from scheduler.policies import POLICIES, Policy, SortedPolicy, register
from scheduler.prefix_query import prefix_cache_hit
from scheduler.request import Request, RequestStatus
from scheduler.request_view import RequestView
from scheduler.sampling_params import SamplingParams, SamplingParamsError
from scheduler.schedule import schedule
from scheduler.state import (
    PLACEHOLDER_TOKEN_ID,
    NewRequestData,
    RequestDelta,
    SchedulerCounters,
    SchedulerOutput,
    SchedulerState,
    SchedulerStats,
    init_state,
)
from scheduler.update import (
    abort_requests,
    add_request,
    check_stop,
    grammars_ready,
    update_from_output,
)

__all__ = [
    "PLACEHOLDER_TOKEN_ID", "POLICIES", "KVConnector", "KVConnectorMetadata", "KVConnectorOutput",
    "KVLoad", "KVSave", "NewRequestData", "Policy", "Request", "RequestDelta",
    "RequestMetadata", "RequestStatus", "RequestView", "SamplingParams", "SamplingParamsError",
    "SchedulerConfig", "SchedulerCounters", "SchedulerOutput", "SchedulerState", "SchedulerStats",
    "SortedPolicy",
    "abort_requests", "add_request", "check_invariants", "check_stop", "grammars_ready",
    "init_state",
    "prefix_cache_hit",
    "register", "schedule", "update_from_output",
]
