"""`device_put`: read each device's shard straight from storage into a `jax.Array`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import attrs
import jax
import numpy as np
from jax.sharding import Sharding

from lazyckpt._errors import ShardingError, TreeMismatchError
from lazyckpt._lazy import LazyArray
from lazyckpt._tree import keystr, map_leaves

ShardingChoice: TypeAlias = (
    Sharding | jax.ShapeDtypeStruct | Callable[[str, LazyArray], Sharding] | Any
)


def device_put(tree: Any, shardings: ShardingChoice) -> Any:
    """Place every LazyArray in `tree` on devices as a `jax.Array`, shard by shard.

    `shardings` is one of:
    - a `jax.sharding.Sharding`, used for every array;
    - a callable `(path, lazy_array) -> Sharding`, e.g. `lazyckpt.saved_shardings(mesh)`;
    - a pytree prefix of `tree` whose leaves are Shardings, `jax.ShapeDtypeStruct`s
      with `.sharding` (an abstract target: arrays are also cast to its dtype), or
      None (that subtree is left as it is).

    Each device's shard is read for exactly its index; devices that hold the same
    index (replicas) share one read. Leaves that are not LazyArrays pass through.

    >>> tree = lazyckpt.open(path)
    >>> mesh = jax.make_mesh((8,), ("rows",))
    >>> w = lazyckpt.device_put(tree["params"]["w"], NamedSharding(mesh, P("rows")))
    >>> w.sharding.spec == P("rows"), w.addressable_shards[1].data
    (True, Array([[ 8.,  9., 10., 11., 12., 13., 14., 15.]], dtype=float32))
    """
    plan = _plan(tree, shardings)
    return map_leaves(lambda x: _put(x.array, x.sharding) if isinstance(x, _Placement) else x, plan)


@attrs.frozen
class _Placement:
    """A LazyArray paired with its target sharding."""

    array: LazyArray
    sharding: Sharding


def _plan(tree: Any, shardings: ShardingChoice) -> Any:
    """`tree` with each LazyArray replaced by a `_Placement`."""
    if isinstance(shardings, Sharding):
        return map_leaves(lambda x: _place(x, shardings), tree)
    if callable(shardings) and not isinstance(shardings, jax.ShapeDtypeStruct):
        return map_leaves(lambda x: _place(x, shardings(x.key, x)) if isinstance(x, LazyArray) else x, tree)

    def broadcast(target: Any, subtree: Any) -> Any:
        if target is None:
            return subtree
        return map_leaves(lambda x: _place(x, target), subtree)

    try:
        return jax.tree.map(
            broadcast,
            shardings,
            tree,
            is_leaf=lambda x: x is None or isinstance(x, Sharding | jax.ShapeDtypeStruct),
        )
    except ValueError as error:
        if isinstance(error, TreeMismatchError | ShardingError):
            raise
        raise TreeMismatchError(
            f"the shardings tree does not match the checkpoint tree: {error}\n"
            "Pass one Sharding, a callable (path, array) -> Sharding, or a tree whose "
            "structure is a prefix of the checkpoint tree (use None to leave a subtree as is)"
        ) from None


def _place(leaf: Any, target: Any) -> Any:
    if not isinstance(leaf, LazyArray):
        return leaf
    if isinstance(target, jax.ShapeDtypeStruct):
        if tuple(target.shape) != leaf.shape:
            raise TreeMismatchError(
                f"{leaf.key}: the target has shape {tuple(target.shape)} but the checkpoint "
                f"array has shape {leaf.shape}; slice the LazyArray or fix the target"
            )
        if target.sharding is None:
            raise TreeMismatchError(
                f"{leaf.key}: the target ShapeDtypeStruct has no sharding; give it one with "
                "jax.ShapeDtypeStruct(shape, dtype, sharding=...)"
            )
        leaf, target = leaf.astype(target.dtype), target.sharding
    if not isinstance(target, Sharding):
        raise TreeMismatchError(
            f"{leaf.key}: expected a jax.sharding.Sharding, found {type(target).__name__} "
            f"{target!r}"
        )
    return _Placement(leaf, target)


def _put(array: LazyArray, sharding: Sharding) -> jax.Array:
    try:
        indices = sharding.addressable_devices_indices_map(array.shape)
    except Exception as error:  # jax raises ValueError, IndexError or TypeError here
        raise ShardingError(
            f"{array.key}: sharding {sharding} cannot lay out an array of shape "
            f"{array.shape} ({error}); choose a sharding whose mesh axes divide the "
            "sharded dimensions, or slice the array first"
        ) from None
    # Replicas hold the same index: read each distinct index once.
    groups: dict[tuple[tuple[int, int, int], ...], list[jax.Device]] = {}
    for device, index in indices.items():
        key = tuple(s.indices(n) for s, n in zip(index, array.shape, strict=True))
        groups.setdefault(key, []).append(device)
    reads = [
        (devices, array[tuple(slice(*k) for k in key)].read()) for key, devices in groups.items()
    ]
    shards = []
    for devices, future in reads:
        host: np.ndarray = future.result()
        shards.extend(jax.device_put(host, device) for device in devices)
        del host
    return jax.make_array_from_single_device_arrays(array.shape, sharding, shards)

