"""`device_put`: read each device's shard straight from storage into a `jax.Array`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, Sharding

from lazyckpt._array.compose import stores
from lazyckpt._array.geometry import Box
from lazyckpt._array.tree import Select, children, map_leaves, selected
from lazyckpt._engine.fill import schedule_fill, stored_bytes
from lazyckpt._engine.memory import Target
from lazyckpt._engine.progress import Progress
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._errors import ShardingError
from lazyckpt._lazy import LazyArray
from lazyckpt._orbax.sharding import resolve
from lazyckpt._storage import multihost
from lazyckpt._storage.kvstore import check_unchanged
from lazyckpt._target import Missing, Placement, match


def device_put(
    tree: Any,
    target: Any,
    *,
    select: Select | None = None,
    partial: bool = False,
    missing: Missing = "error",
    lossy_casts: bool = False,
    mesh: Mesh | None = None,
    memory_budget: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Place the LazyArrays of `tree` on devices as `jax.Array`s, shard by shard.

    Each device's shard is read for exactly its index; devices that hold the same
    index (replicas) share one read, and a stored chunk that several shards need is
    read once and split among them. Reads of all arrays run concurrently; shards are
    assembled in place in their host buffers, which CPU devices adopt without a
    copy. Leaves that are not LazyArrays pass through.

    Args:
        tree: A lazy tree, any pytree holding LazyArrays, or one LazyArray.
        target: Where to place the arrays, in one of three forms:

            - one `Sharding`, `jax.Device` or `PartitionSpec`, for every array;
            - a callable `(key, lazy_array) -> Sharding` (or Device, or
              PartitionSpec), given each array's key in its checkpoint, such as
              `lazyckpt.saved_shardings(mesh)`;
            - a target pytree: the abstract state of a model (`nnx.eval_shape`,
              `nnx.get_abstract_model`, `jax.eval_shape`), a Linen `TrainState`, an
              optax state, a dict of Shardings. Its leaves are
              `jax.ShapeDtypeStruct`s or `jax.Array`s (restored with their shape,
              dtype and sharding), NumPy arrays (read to host), Shardings, Devices
              or PartitionSpecs (the checkpoint's leaf or whole subtree there, placed
              so), None (left as it is), or Python scalars. Leaves pair with the
              checkpoint's by key path as Orbax names them on disk (int and str keys
              alike, fields by name, an `nnx.Variable`'s `value` level optional),
              and the result has the target's structure.

            Matching is strict: a target leaf the checkpoint lacks, a checkpoint
            leaf the target does not name, a different shape, or a cast that can
            change values (float to int, int64 to int32) raises one
            `TreeMismatchError` that lists them all.
        select: Only the leaves matching a path pattern, any of a list of patterns,
            or a predicate `(path, leaf) -> bool`; see `select`.
        partial: Restore only what a target pytree names; the rest is never read.
        missing: What to do with target leaves the checkpoint lacks: "error",
            "keep" (keep the target's leaf), or a function
            `(path, target_leaf) -> value`.
        lossy_casts: Allow any cast (floating-point precision changes never need it).
        mesh: The mesh for NamedShardings on an `AbstractMesh` and for
            PartitionSpecs; default: the mesh of `jax.set_mesh`.
        memory_budget: As for `load`.
        progress: As for `load`.

    Returns:
        `jax.Array`s in the structure of `tree`, or of a target pytree.

    >>> tree = lazyckpt.open(path)
    >>> mesh = jax.make_mesh((8,), ("rows",))
    >>> w = lazyckpt.device_put(tree["params"]["w"], NamedSharding(mesh, P("rows")))
    >>> w.sharding.spec == P("rows"), w.addressable_shards[1].data
    (True, Array([[ 8.,  9., 10., 11., 12., 13., 14., 15.]], dtype=float32))
    >>> abstract = {"params": {"w": jax.ShapeDtypeStruct((8, 8), np.float32,
    ...                                                  sharding=NamedSharding(mesh, P()))}}
    >>> lazyckpt.device_put(tree, abstract)
    Traceback (most recent call last):
    ...
    lazyckpt.TreeMismatchError: the target does not match the checkpoint: 3 checkpoint leaves not in the target
      not in the target: opt_state/mu  float32[8,8]
      not in the target: params/b  float32[8]
      not in the target: step  3
    to restore anyway: partial=True restores only what the target names
    >>> placed = lazyckpt.device_put(tree, abstract, partial=True)
    >>> placed["params"]["w"].sharding.spec
    P()
    """
    tree = selected(tree, select)
    if callable(target) and children(target) is None:  # a function, not a pytree (a Module)
        choose: Callable[[str, LazyArray], Any] = target
        plan = map_leaves(
            lambda x: (
                Placement(x, resolve(x.key, choose(x.key, x), mesh))
                if isinstance(x, LazyArray)
                else x
            ),
            tree,
        )
    else:
        plan = match(
            tree, target, partial=partial, missing=missing, lossy_casts=lossy_casts, mesh=mesh
        )
    return materialize(plan, memory_budget, progress, "lazyckpt device_put")


def materialize(plan: Any, memory_budget: int | None, progress: bool | None, label: str) -> Any:
    """`plan` with every `Placement` read: onto its sharding, or into a NumPy array."""
    placements = [leaf for leaf in jax.tree_util.tree_leaves(plan) if isinstance(leaf, Placement)]
    total = stored_bytes(p.array for p in placements)
    bar = Progress.maybe(progress, total, label)
    on_devices = [p for p in placements if p.sharding is not None]
    if on_devices:
        multihost.agree(
            "the arrays and shardings to place",
            "\n".join(_describe(p) for p in on_devices),
            "every process must call device_put with the same tree and the same shardings",
        )
    scheduler = Scheduler(memory_budget, bar)
    results: dict[int, Any] = {}
    for placement in placements:
        if placement.sharding is None:
            _schedule_load(placement, scheduler, results)
        else:
            _schedule_put(placement, placement.sharding, scheduler, results)
    scheduler.drain()
    if bar is not None:
        bar.close()
    # Everything was read from the checkpoints as they were opened, or it is refused.
    check_unchanged(stores(p.array for p in placements))
    return map_leaves(lambda x: _result(results, x) if isinstance(x, Placement) else x, plan)


def _result(results: dict[int, Any], placement: Placement) -> Any:
    found = results[id(placement)]
    return found.buffer() if isinstance(found, Target) else found


def _describe(placement: Placement) -> str:
    array, sharding = placement.array, placement.sharding
    layout = repr(sharding)
    if isinstance(sharding, jax.sharding.NamedSharding):
        layout = f"{dict(sharding.mesh.shape)} {sharding.spec} {[d.id for d in sharding.mesh.devices.flat]}"
    return f"{array.key}|{array.shape}|{array.dtype}|{layout}"


def _schedule_load(placement: Placement, scheduler: Scheduler, results: dict[int, Any]) -> None:
    """Read the whole view into a NumPy array (typed PRNG keys: a jax.Array of keys)."""
    array = placement.array
    if array.key_impl:
        results[id(placement)] = array.get()  # typed keys are small
        return
    target = Target(tuple((0, n) for n in array.shape), array.dtype)
    schedule_fill(array, [target], scheduler, lambda: None)
    results[id(placement)] = target


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
    placement: Placement, sharding: Sharding, scheduler: Scheduler, results: dict[int, Any]
) -> None:
    """Fill one host buffer per distinct region, then hand them to the devices."""
    array = placement.array
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
