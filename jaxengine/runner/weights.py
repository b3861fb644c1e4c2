"""New weights for a model the runner already compiled for: `check_weights` refuses a pytree
whose leaves differ from the model's in path, shape, dtype (or sharding), naming the first
that differs; `place_weights` puts the new leaves on the old ones' shardings in the old
pytree's structure, so the compiled programs take them as they are (their cache is keyed on
exactly these). Leaves are matched by path, not by the whole tree structure: an nnx.State's
structure holds its variables' metadata (the mesh), which differs between data-parallel
replicas."""

from __future__ import annotations

from typing import Any

import jax


def check_weights(new: Any, old: Any, *, sharding: bool = True) -> None:
    """Raise unless `new` has `old`'s leaves, by path, each of its shape and dtype (and, with
    `sharding`, an equivalent sharding: the same devices and layout).

    Raises:
      ValueError: naming the first leaf (its path) that differs, and how.
    """
    new_leaves = jax.tree_util.tree_flatten_with_path(new)[0]
    old_leaves = jax.tree_util.tree_flatten_with_path(old)[0]
    new_paths = [jax.tree_util.keystr(p) for p, _ in new_leaves]
    for i, (path, want) in enumerate(old_leaves):
        name = jax.tree_util.keystr(path)
        if i >= len(new_paths) or new_paths[i] != name:
            got = new_paths[i] if i < len(new_paths) else "nothing"
            raise ValueError(f"weights: leaf {name} expected, got {got}; pass a pytree of the "
                             f"structure of model_fns_of(llm)[0].params (e.g. jax.tree.map "
                             f"over it)")
        x = new_leaves[i][1]
        for field, a, b in (("shape", getattr(x, "shape", None), want.shape),
                            ("dtype", getattr(x, "dtype", None), want.dtype)):
            if a != b:
                raise ValueError(f"weights: leaf {name} has {field} {a}, the model's is {b}")
        if sharding and not isinstance(x, jax.Array):
            raise ValueError(f"weights: leaf {name} is a {type(x).__name__}, not a jax.Array")
        if sharding and not x.sharding.is_equivalent_to(want.sharding, want.ndim):
            raise ValueError(f"weights: leaf {name} is sharded as {x.sharding}, the model's as "
                             f"{want.sharding}; jax.device_put it there")
    if len(new_paths) > len(old_leaves):
        raise ValueError(f"weights: leaf {new_paths[len(old_leaves)]} is not in "
                         f"model_fns_of(llm)[0].params")


def place_weights(new: Any, old: Any) -> Any:
    """`new`'s leaves (checked by `check_weights` without sharding) in `old`'s structure, each
    on its old leaf's sharding: a no-op for leaves already there, a copy to another replica's
    devices otherwise."""
    check_weights(new, old, sharding=False)
    old_leaves, structure = jax.tree.flatten(old)
    return jax.tree.unflatten(structure, [jax.device_put(x, o.sharding) for x, o in zip(
        jax.tree.leaves(new), old_leaves, strict=True)])
