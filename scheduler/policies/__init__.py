"""Scheduling policies and what they see (docs/SCHEDULING.md §8).

`policies.py` holds the `Policy` interface, the registry and the built-in policies;
`request_view.py` the read-only `RequestView` a policy (and a KV connector) is shown of a request.
"""
