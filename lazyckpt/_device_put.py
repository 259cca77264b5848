"""`device_put`: read each device's shard straight from storage into a `jax.Array`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from lazyckpt._array.tree import Select, children, gc_paused, map_leaves, selected
from lazyckpt._device.route import materialize
from lazyckpt._errors import ArgumentError
from lazyckpt._lazy import LazyArray
from lazyckpt._placement.saved import PlacementSpec, resolve
from lazyckpt._placement.target import Missing, Placement, match


@gc_paused()  # (reading allocates a few objects per array, none in cycles)
def device_put(
    tree: object,
    target: object,
    *,
    select: Select | None = None,
    partial: bool = False,
    missing: Missing = "error",
    lossy_casts: bool = False,
    mesh: Mesh | None = None,
    memory_budget: int | str | None = None,
    progress: bool | None = None,
    broadcast: bool = False,
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
            `TreeMismatchError` that lists them all. A target that places nothing
            (`None`, or every leaf None, as `eqx.partition(..., eqx.is_array)` makes
            of abstract arrays) is a `TreeMismatchError` too.
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
        broadcast: In a multi-process job (`jax.distributed`), read each stored
            chunk that arrays replicated across processes need once in the whole
            job, spread evenly over the processes, and carry it to every device that
            needs it through JAX's collectives (an all-reduce in XLA) instead of
            every process reading it. Every process must call it together. It pays
            where the devices' interconnect is faster than storage (TPU and GPU
            fleets reading from buckets); off by default, since on CPU hosts the
            collectives can cost more than a second read. Complex, packed 2-, 4- and
            6-bit and (without x64) 8-byte dtypes, empty arrays, and arrays no process
            shares, are read as without it.

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
    whole, tree = tree, selected(tree, select)
    if callable(target) and children(target) is None:  # a function, not a pytree (a Module)
        choose = _placer(target)
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
            tree,
            target,
            partial=partial,
            missing=missing,
            lossy_casts=lossy_casts,
            mesh=mesh,
            unselected=whole,
        )
    return materialize(plan, memory_budget, progress, "lazyckpt device_put", broadcast=broadcast)


def _placer(target: Callable[..., Any]) -> Callable[[str, LazyArray], PlacementSpec]:
    """`target`, a function of an array's key and the array; a callable that takes no
    such arguments (a `Mesh`, a dtype such as `jnp.bfloat16`) is an `ArgumentError`."""
    try:
        inspect.signature(target).bind("key", None)
    except TypeError:
        shown = repr(target) if len(repr(target)) <= 60 else repr(target)[:57] + "..."
        raise ArgumentError(
            f"target={shown} is callable, but not as a function (key, lazy_array) -> "
            "Sharding; pass one Sharding for every array (on a mesh: "
            "NamedSharding(mesh, PartitionSpec())), such a function "
            "(lazyckpt.saved_shardings(mesh)), or a target pytree"
        ) from None
    except ValueError:  # (no signature to read: a builtin; calling it will tell)
        pass
    return target
