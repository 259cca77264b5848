"""Reading the placements of a matched tree: each onto its sharding, or into a NumPy
array; shared by `load` and `device_put`. jax is imported only where an array goes to
devices, whose sharding has imported it: `load` never does."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from lazyckpt import _text
from lazyckpt._array.dtypes import LONG_DOUBLES, issubdtype
from lazyckpt._array.geometry import Box
from lazyckpt._array.tree import leaf_values, map_leaves
from lazyckpt._engine.coalesced import schedule_coalesced
from lazyckpt._engine.fill import schedule_fill, stored_bytes
from lazyckpt._engine.memory import Destination, check_total
from lazyckpt._engine.progress import shown
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._engine.small import is_small, read_small
from lazyckpt._engine.stored import stores
from lazyckpt._errors import LazyTypeError, ShardingError
from lazyckpt._lazy import LazyArray
from lazyckpt._sizes import Size, optional_size
from lazyckpt._staged import put_staged, staged
from lazyckpt._storage import multihost
from lazyckpt._storage.kvstore import check_unchanged
from lazyckpt._target import Placement

if TYPE_CHECKING:
    import jax
    from jax.sharding import Sharding

ReadResult: TypeAlias = "Destination | np.ndarray | jax.Array"
"""What a placement's read leaves: a filled host buffer, or an array (typed PRNG keys,
shards placed on devices)."""


def materialize(
    plan: object,
    memory_budget: Size | None,
    progress: bool | None,
    label: str,
    *,
    broadcast: bool = False,
) -> Any:
    """`plan` with every `Placement` read: onto its sharding, or into a NumPy array;
    with `broadcast`, arrays replicated across processes are each read once by the
    job and spread by JAX (`_broadcast`). Its callers, `load` and `device_put`, pause
    the garbage collector around it (`gc_paused`)."""
    placements = [leaf for leaf in leaf_values(plan) if isinstance(leaf, Placement)]
    total = stored_bytes(p.array for p in placements)
    with shown(progress, total, label) as bar:
        on_devices = [p for p in placements if p.sharding is not None]
        for placement in on_devices:  # (before any read)
            _check_jax_dtype(placement)
        if on_devices:
            multihost.agree(
                "the arrays and shardings to place",
                "\n".join([f"broadcast={broadcast}", *(_describe(p) for p in on_devices)]),
                "every process must call device_put with the same tree, the same shardings "
                "and the same broadcast=",
            )
        spread = _spread(on_devices) if broadcast else []
        for placement in spread:  # (a sharding that cannot lay it out fails on every process)
            assert placement.sharding is not None
            _regions(placement.array, placement.sharding)
        results: dict[int, ReadResult] = {}
        failure: Exception | None = None
        budget = None
        try:
            budget = optional_size("memory_budget", memory_budget)  # (agreed on below if bad)
            check_total(label, [(p.array.key, p.array.nbytes) for p in placements if _in_host(p)])
            scheduler = Scheduler(budget, bar)
            _read_here(placements, {id(p) for p in spread}, scheduler, results)
        except Exception as error:
            if not spread:
                raise
            failure = error  # (raised once every process knows, before any collective)
        if spread:
            from lazyckpt._broadcast import agree_read, put

            agree_read(failure, [p.array.key for p in spread])
            results.update(put(spread, budget, bar))
    # Everything was read from the checkpoints as they were opened, or it is refused.
    check_unchanged(stores(p.array for p in placements))
    return map_leaves(lambda x: _result(results, x) if isinstance(x, Placement) else x, plan)


def _check_jax_dtype(placement: Placement) -> None:
    """Refuse, before any read, an array that jax has no type for, or cannot place on
    the devices it is bound for: jax's own error names no key, and comes once the
    array was read."""
    array, sharding = placement.array, placement.sharding
    if array.dtype in LONG_DOUBLES:  # (a NumPy or flax file's)
        raise LazyTypeError(
            f"{array.key}: dtype {array.dtype}, NumPy's long double, which jax has no type "
            "for; load it to NumPy (lazyckpt.load), or cast it first (.astype('float64'))"
        )
    if array.key_impl:
        return
    devices = {str(d.platform): d for d in getattr(sharding, "addressable_devices", ())}
    for platform, device in devices.items():
        refused = _refused(np.dtype(array.dtype), device)
        if refused is not None:
            raise LazyTypeError(
                f"{array.key}: dtype {array.dtype}, which jax cannot place on {platform} "
                f"devices ({refused}); load it to NumPy (lazyckpt.load), or cast it to a "
                "type jax places there (.astype('float32'))"
            )


@functools.cache
def _refused(dtype: np.dtype[Any], device: Any) -> str | None:
    """Why jax refuses to place an array of `dtype` on `device` (tried on one of two
    items, once per process), or None: jax holds numbers and booleans, and not every
    narrow float of ml_dtypes on every platform."""
    import jax

    if not any(issubdtype(dtype, t) for t in (np.number, np.bool_)):
        return "jax arrays hold numbers and booleans"
    try:
        jax.device_put(np.zeros(2, dtype), device).block_until_ready()
    except Exception as error:  # noqa: BLE001 - said in the error raised
        said = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"{type(error).__name__}: {_text.printable(said[:120])}"
    return None


def _in_host(placement: Placement) -> bool:
    """Whether `placement`'s result is held in this process's memory: a NumPy array,
    or one whose devices are all this process's CPUs."""
    sharding = placement.sharding
    return sharding is None or (sharding.is_fully_addressable and not staged(sharding))


def _spread(on_devices: list[Placement]) -> list[Placement]:
    """The placements to place by broadcast, in a run of several processes."""
    if not on_devices or multihost.count() == 1:
        return []
    from lazyckpt._broadcast import broadcastable  # (jax's: the shardings imported it)

    return [p for p in on_devices if broadcastable(p)]


def _read_here(
    placements: list[Placement],
    skip: set[int],
    scheduler: Scheduler,
    results: dict[int, ReadResult],
) -> None:
    """Read every placement but those in `skip` (by `id`) by this process alone:
    whole arrays of a checkpoint over HTTP in coalesced ranges, small whole arrays
    in batches, the others each on its own."""
    small_on_devices = [
        p
        for p in placements
        if p.sharding is not None
        and p.sharding.is_fully_addressable
        and not p.array.key_impl
        and is_small(p.array)
    ]
    for placement in small_on_devices:  # (a sharding that cannot lay it out, before any read)
        assert placement.sharding is not None
        _regions(placement.array, placement.sharding)
    to_host = [p for p in placements if p.sharding is None and not p.array.key_impl]
    coalesced: set[int] = set()
    for at, destination in schedule_coalesced([p.array for p in to_host], scheduler).items():
        coalesced.add(id(to_host[at]))
        results[id(to_host[at])] = destination
    small_on_host = [p for p in to_host if id(p) not in coalesced and is_small(p.array)]
    host_values = read_small([p.array for p in small_on_host], scheduler)
    read_whole = {id(p) for p in small_on_host + small_on_devices} | coalesced
    # Bound for accelerators: sent in pieces once the others are read.
    sent: list[Placement] = []
    work: list[tuple[LazyArray, Sharding, dict[Box, list[jax.Device]]]] = []
    for placement in placements:
        if id(placement) in read_whole or id(placement) in skip:
            continue
        if placement.sharding is None:
            _schedule_load(placement, scheduler, results)
        elif not placement.array.key_impl and staged(placement.sharding):
            # (a sharding that cannot lay it out is refused here, before any read)
            regions = _regions(placement.array, placement.sharding)
            sent.append(placement)
            work.append((placement.array, placement.sharding, regions))
        else:
            _schedule_put(placement, placement.sharding, scheduler, results)
    scheduler.drain()
    for placement, values in zip(small_on_host, host_values, strict=True):
        results[id(placement)] = values  # (filled as their reads finished)
    _put_small(small_on_devices, scheduler, results)
    if sent:
        placed = put_staged(work, scheduler.budget, scheduler.progress)
        results.update((id(p), array) for p, array in zip(sent, placed, strict=True))


def _put_small(
    placements: list[Placement], scheduler: Scheduler, results: dict[int, ReadResult]
) -> None:
    """Read small arrays bound for devices in batches, each batch's host values
    within the budget, then put each batch on its devices in one call."""
    while placements:
        size, count = 0, 0
        while count < len(placements) and (
            not count or size + placements[count].array.nbytes <= scheduler.budget
        ):
            size += placements[count].array.nbytes
            count += 1
        batch, placements = placements[:count], placements[count:]
        values = read_small([p.array for p in batch], scheduler)
        scheduler.drain()
        import jax  # (the shardings imported it)

        shardings = [p.sharding for p in batch if p.sharding is not None]
        placed = jax.device_put(values, shardings)
        if any(staged(sharding) for sharding in shardings):
            jax.block_until_ready(placed)  # (the host values are held until sent)
        for placement, array in zip(batch, placed, strict=True):
            results[id(placement)] = array
        del values, placed


def _result(results: dict[int, ReadResult], placement: Placement) -> np.ndarray | jax.Array:
    found = results[id(placement)]
    return found.buffer() if isinstance(found, Destination) else found


def _describe(placement: Placement) -> str:
    from jax.sharding import NamedSharding  # (the shardings imported it)

    array, sharding = placement.array, placement.sharding
    layout = repr(sharding)
    if isinstance(sharding, NamedSharding):
        layout = f"{dict(sharding.mesh.shape)} {sharding.spec} {[d.id for d in sharding.mesh.devices.flat]}"
    return f"{array.key}|{array.shape}|{array.dtype}|{layout}"


def _schedule_load(
    placement: Placement, scheduler: Scheduler, results: dict[int, ReadResult]
) -> None:
    """Read the whole view into a NumPy array (typed PRNG keys: a jax.Array of keys)."""
    array = placement.array
    if array.key_impl:
        results[id(placement)] = array.get()  # typed keys are small
        return
    destination = Destination(tuple((0, n) for n in array.shape), array.dtype, key=array.key)
    schedule_fill(array, [destination], scheduler, lambda: None)
    results[id(placement)] = destination


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
    regions: dict[Box, list[jax.Device]] = {}
    for device, index in indices.items():
        index = index if index is not None else (slice(None),) * array.ndim
        region = tuple(s.indices(n)[:2] for s, n in zip(index, array.shape, strict=True))
        regions.setdefault(region, []).append(device)
    return regions


def _schedule_put(
    placement: Placement, sharding: Sharding, scheduler: Scheduler, results: dict[int, ReadResult]
) -> None:
    """Fill one host buffer per distinct region, then hand them to the devices."""
    import jax  # (the sharding imported it)

    array = placement.array
    regions = _regions(array, sharding)
    if array.key_impl:
        # Typed keys are small: read each region as keys, then place them.
        shards: list[jax.Array] = []
        for region, devices in regions.items():
            keys = array[tuple(slice(*r) for r in region)].get()
            shards.extend(jax.device_put(keys, device) for device in devices)
        results[id(placement)] = jax.make_array_from_single_device_arrays(
            array.shape, sharding, shards
        )
        return
    destinations = [
        Destination(region, array.dtype, aligned=True, key=array.key) for region in regions
    ]

    def finish() -> None:
        shards: list[jax.Array] = []
        for destination, devices in zip(destinations, regions.values(), strict=True):
            scheduler.guard.keep(destination.out_nbytes() * (len(devices) - 1))  # replica copies
            # On CPU the first device adopts the aligned buffer without a copy; replicas
            # ask for their own copies (jax 0.10 on CPU may still share the aligned
            # buffer; donating one replica leaves the others intact all the same).
            shards.extend(
                jax.device_put(destination.buffer(), device, may_alias=i == 0)
                for i, device in enumerate(devices)
            )
        results[id(placement)] = jax.make_array_from_single_device_arrays(
            array.shape, sharding, shards
        )
        destinations.clear()

    schedule_fill(array, destinations, scheduler, finish)
