"""`device_put`: read each device's shard straight from storage into a `jax.Array`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import attrs
import jax
from jax.sharding import Sharding

from lazyckpt import _multihost as multihost
from lazyckpt._engine import Box, Scheduler, Target, schedule_fill, stored_bytes
from lazyckpt._errors import ShardingError, TreeMismatchError
from lazyckpt._lazy import LazyArray
from lazyckpt._progress import Progress
from lazyckpt._tree import keystr, map_leaves, walk

ShardingChoice: TypeAlias = (
    Sharding | jax.ShapeDtypeStruct | Callable[[str, LazyArray], Sharding] | Any
)


def device_put(
    tree: Any,
    shardings: ShardingChoice,
    *,
    memory_budget: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Place every LazyArray in `tree` on devices as a `jax.Array`, shard by shard.

    `shardings` is one of:
    - a `jax.sharding.Sharding`, used for every array;
    - a callable `(path, lazy_array) -> Sharding`, e.g. `lazyckpt.saved_shardings(mesh)`;
    - a pytree prefix of `tree` whose leaves are Shardings, `jax.ShapeDtypeStruct`s
      with `.sharding` (an abstract target: arrays are also cast to its dtype), or
      None (that subtree is left as it is).

    Each device's shard is read for exactly its index; devices that hold the same
    index (replicas) share one read, and a stored chunk that several shards need is
    read once and split among them. Reads of all arrays run concurrently with at most
    `memory_budget` bytes held by blocks in flight (default 32 MiB per core, at least
    64 MiB); shards are assembled in place in their host buffers, which CPU devices
    adopt without a copy.
    `progress` shows a bar on stderr (None: only for large reads on a terminal).
    Leaves that are not LazyArrays pass through.

    >>> tree = lazyckpt.open(path)
    >>> mesh = jax.make_mesh((8,), ("rows",))
    >>> w = lazyckpt.device_put(tree["params"]["w"], NamedSharding(mesh, P("rows")))
    >>> w.sharding.spec == P("rows"), w.addressable_shards[1].data
    (True, Array([[ 8.,  9., 10., 11., 12., 13., 14., 15.]], dtype=float32))
    """
    plan = _plan(tree, shardings)
    placements = [leaf for _, leaf in walk(plan) if isinstance(leaf, _Placement)]
    total = stored_bytes(p.array for p in placements)
    bar = Progress.maybe(progress, total, "lazyckpt device_put")
    multihost.agree(
        "the arrays and shardings to place",
        "\n".join(_describe(p) for p in placements),
        "every process must call device_put with the same tree and the same shardings",
    )
    scheduler = Scheduler(memory_budget, bar)
    results: dict[int, jax.Array] = {}
    for placement in placements:
        _schedule_put(placement, scheduler, results)
    scheduler.drain()
    if bar is not None:
        bar.close()
    return map_leaves(lambda x: results[id(x)] if isinstance(x, _Placement) else x, plan)


def _describe(placement: _Placement) -> str:
    array, sharding = placement.array, placement.sharding
    layout = repr(sharding)
    if isinstance(sharding, jax.sharding.NamedSharding):
        layout = f"{dict(sharding.mesh.shape)} {sharding.spec} {[d.id for d in sharding.mesh.devices.flat]}"
    return f"{array.key}|{array.shape}|{array.dtype}|{layout}"


@attrs.frozen
class _Placement:
    """A LazyArray paired with its target sharding."""

    array: LazyArray
    sharding: Sharding


def _plan(tree: Any, shardings: ShardingChoice) -> Any:
    """`tree` with each LazyArray replaced by a `_Placement`."""
    if callable(shardings) and not isinstance(shardings, Sharding | jax.ShapeDtypeStruct):
        choose = shardings
        return map_leaves(
            lambda x: _place(x, choose(x.key, x)) if isinstance(x, LazyArray) else x, tree
        )
    return _broadcast(shardings, tree, ())


def _broadcast(prefix: Any, tree: Any, path: tuple[str | int, ...]) -> Any:
    """Pair the leaves of the `prefix` tree with the subtrees of `tree` they cover."""
    if prefix is None:
        return tree
    if isinstance(prefix, Sharding | jax.ShapeDtypeStruct):
        return map_leaves(lambda x: _place(x, prefix), tree)
    where = keystr(path) or "root"
    hint = (
        "pass one Sharding, a callable (path, array) -> Sharding, or a tree whose "
        "structure is a prefix of the checkpoint tree (None leaves a subtree as is)"
    )
    if isinstance(prefix, dict):
        if not isinstance(tree, dict) or set(prefix) != set(tree):
            found = sorted(map(str, tree)) if isinstance(tree, dict) else type(tree).__name__
            missing = sorted(map(str, set(tree) - set(prefix))) if isinstance(tree, dict) else []
            extra = sorted(map(str, set(prefix) - set(tree))) if isinstance(tree, dict) else []
            raise TreeMismatchError(
                f"the shardings tree does not match the checkpoint tree at {where}: the "
                f"shardings have keys {sorted(map(str, prefix))}, the checkpoint has {found}"
                + (f" (missing {missing}, unexpected {extra})" if missing or extra else "")
                + f"; {hint}"
            )
        return {key: _broadcast(prefix[key], tree[key], (*path, key)) for key in tree}
    if isinstance(prefix, list | tuple):
        if not isinstance(tree, list | tuple) or len(prefix) != len(tree):
            found = f"{len(tree)} items" if isinstance(tree, list | tuple) else type(tree).__name__
            raise TreeMismatchError(
                f"the shardings tree does not match the checkpoint tree at {where}: the "
                f"shardings have a sequence of {len(prefix)} items, the checkpoint has {found}; "
                f"{hint}"
            )
        pairs = enumerate(zip(prefix, tree, strict=True))
        items = [_broadcast(p, t, (*path, i)) for i, (p, t) in pairs]
        return items if isinstance(tree, list) else tuple(items)
    return map_leaves(lambda x: _place(x, prefix), tree)


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


def _regions(array: LazyArray, sharding: Sharding) -> dict[Box, list[jax.Device]]:
    """Distinct regions of the array held by this process's devices, with their devices."""
    try:
        indices = sharding.addressable_devices_indices_map(array.shape)
    # jax raises ValueError, IndexError or TypeError here, depending on the mismatch.
    except Exception as error:  # noqa: BLE001
        raise ShardingError(
            f"{array.key}: the sharding cannot lay out an array of shape {array.shape}: "
            f"{error}; choose a sharding whose mesh axes divide the sharded dimensions, "
            "or slice the array first"
        ) from None
    # Replicas hold the same region: each distinct region is read once.
    groups: dict[Box, list[jax.Device]] = {}
    for device, index in indices.items():
        index = index if index is not None else (slice(None),) * array.ndim
        region = tuple(s.indices(n)[:2] for s, n in zip(index, array.shape, strict=True))
        groups.setdefault(region, []).append(device)
    return groups


def _schedule_put(
    placement: _Placement, scheduler: Scheduler, results: dict[int, jax.Array]
) -> None:
    """Fill one host buffer per distinct region, then hand them to the devices."""
    array, sharding = placement.array, placement.sharding
    groups = _regions(array, sharding)
    if array.key_impl:
        # Typed keys are small: read each region as keys, then place them.
        shards: list[jax.Array] = []
        for region, devices in groups.items():
            keys = array[tuple(slice(*r) for r in region)].get()
            shards.extend(jax.device_put(keys, device) for device in devices)
        results[id(placement)] = jax.make_array_from_single_device_arrays(
            array.shape, sharding, shards
        )
        return
    targets = [Target(region, array.dtype, aligned=True) for region in groups]

    def finish() -> None:
        shards: list[jax.Array] = []
        for target, devices in zip(targets, groups.values(), strict=True):
            scheduler.guard.keep(target.out_nbytes() * (len(devices) - 1))  # replica copies
            # On CPU the first device adopts the aligned buffer without a copy; replicas
            # get their own copies, so that donating one cannot overwrite another.
            shards.extend(
                jax.device_put(target.buffer(), device, may_alias=i == 0)
                for i, device in enumerate(devices)
            )
        results[id(placement)] = jax.make_array_from_single_device_arrays(
            array.shape, sharding, shards
        )
        targets.clear()

    schedule_fill(array, targets, scheduler, finish)
