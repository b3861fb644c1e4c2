"""The paged KV block pool with automatic prefix caching (vLLM's `v1/core` block pool).

`kv_cache.py` holds the pool's data and the manager that edits it; `hashing.py` the chained
block hashes that name a block's whole prefix. Nothing here knows a `SchedulerState`.
"""
