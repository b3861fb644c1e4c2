"""The scheduler's state and its two verbs (vLLM's `v1/core/sched`).

`state.py` holds the frozen `SchedulerState` and the plan of a step; `schedule.py` and
`update.py` are the pure functions from a state to the next (with `partial_prefill.py`, and
`kv_transfer.py` for a KV connector's bookkeeping); `_work.py` is the private working copy
they edit. `prefix_query.py` and `invariants.py` only read a state.
"""
