"""The paged KV block pool with automatic prefix caching (vLLM's `v1/core` block pool).

`kv_cache.py` holds the pool's data and the manager that edits it; `hashing.py` the chained
block hashes that name a block's whole prefix; `groups.py` the KV cache groups of a hybrid
model (sliding windows, docs/SCHEDULING.md §13). Nothing here knows a `SchedulerState`.
"""
