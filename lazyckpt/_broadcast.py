"""`device_put(..., broadcast=True)`: each stored chunk read by one process, then
carried to every device that needs it by JAX's own collectives.

An array whose target sharding replicates it across processes (a `NamedSharding`
whose spec leaves out mesh axes that span several processes) is placed so:

1. The devices holding one region of it form a group along the left-out axes (the
   replica axes). The region is cut along its stored chunks into one part per
   member, and each device's process reads only that device's part (`_plan`).
2. Every device holds its region with its own part filled in and zeros elsewhere:
   together, a global array with one leading dimension more, sharded over the
   replica axes.
3. A jitted maximum over that dimension, taken of the values' bits as unsigned
   integers so that every bit pattern survives (-0.0, NaN payloads), with the target
   as its output sharding, gives every device its whole region. XLA makes it one
   all-reduce within each group, over the devices' interconnect.

Where the devices copy out of host memory (TPUs, GPUs: `lazyckpt._staged.staged`),
no region is held whole on the host: each part is sent to the first of its
devices here in pieces within the budget (`put_staged`, as any placement there), and
written there into zeros made on the device, as the values' bits; the other devices
make their zeros themselves. Host memory stays within the budget whatever the
region's size, and nothing but the parts crosses to the devices.

Before any data moves, the processes agree that every process read its parts (a
small collective); a failure anywhere is an error on every process, never a hang in
the all-reduce. Arrays are placed in batches that fit the memory budget.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from lazyckpt._array.geometry import Box, as_slices, box_shape
from lazyckpt._engine.fill import schedule_fill
from lazyckpt._engine.memory import Destination, result_empty
from lazyckpt._engine.progress import Progress
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._errors import LazyckptError
from lazyckpt._lazy import LazyArray
from lazyckpt._staged import put_staged, staged
from lazyckpt._storage import multihost
from lazyckpt._target import Placement


@attrs.frozen(eq=False)
class _Region:
    """One region of the array that this process's devices hold, and what it reads
    of it: the parts of its local replicas (disjoint), read into one buffer that the
    first of its devices adopts; its other devices start from zeros."""

    region: Box
    devices: list[tuple[jax.Device, int]]
    """Each device holding the region here, with its replica index."""
    parts: list[Box]


@attrs.frozen(eq=False)
class _Plan:
    placement: Placement
    sharding: NamedSharding
    spread: NamedSharding
    """The sharding of the array of shares: the target's, after a leading dimension
    sharded over the replica axes."""
    replicas: int
    regions: list[_Region]

    def host_bytes(self) -> int:
        itemsize = int(self.placement.array.dtype.itemsize)
        return sum(math.prod(high - low for low, high in r.region) for r in self.regions) * itemsize


def broadcastable(placement: Placement) -> bool:
    """Whether `placement` is placed by broadcast: a NamedSharding that replicates the
    array across processes, of a dtype whose bits a jitted maximum can carry."""
    sharding = placement.sharding
    if not isinstance(sharding, NamedSharding) or placement.array.key_impl:
        return False
    return _bits(placement.array.dtype) is not None and len(_replica_processes(sharding)) > 1


def _replica_axes(sharding: NamedSharding) -> tuple[str, ...]:
    used: set[str] = set()
    for entry in sharding.spec:
        if entry is None:
            continue
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return tuple(a for a in sharding.mesh.axis_names if a not in used)


def _replica_processes(sharding: NamedSharding) -> set[int]:
    """The processes that the first replica group spans."""
    axes = _replica_axes(sharding)
    if not axes:
        return set()
    mesh = sharding.mesh
    names = list(mesh.axis_names)
    index = tuple(slice(None) if name in axes else 0 for name in names)
    return {d.process_index for d in np.asarray(mesh.devices)[index].flat}


_PACKED = ("int4", "uint4", "int2", "uint2", "float4_e2m1fn")
"""Dtypes of less than a byte per value, which jax cannot reinterpret as integers."""


def _bits(dtype: Any) -> Any:
    """The unsigned integer type of `dtype`'s width, if jax can reinterpret it so;
    None for complex numbers, packed types and (without x64) 8-byte ones."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return jnp.uint8
    if dtype.kind not in "fiuV" or dtype.name in _PACKED:
        return None
    if dtype.itemsize == 8 and jax.dtypes.canonicalize_dtype(np.int64) != np.int64:
        return None
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}.get(dtype.itemsize)


def put(
    placements: Sequence[Placement], memory_budget: int | None, bar: Progress | None
) -> dict[int, jax.Array]:
    """Place each of `placements` (all `broadcastable`) by broadcast; by `id`."""
    plans = [_plan(p) for p in placements]
    # Each batch ends in collectives, so every process must cut the same batches: by
    # the largest host bytes any process needs, within the smallest budget (in KiB).
    budget = Scheduler(memory_budget).budget
    rows = multihost.gather([_kib(budget), *(_kib(plan.host_bytes()) for plan in plans)])
    limit = min(row[0] for row in rows)
    needs = [max(row[i + 1] for row in rows) for i in range(len(plans))]
    results: dict[int, jax.Array] = {}
    batch: list[_Plan] = []
    held = 0
    for plan, need in zip(plans, needs, strict=True):
        if batch and held + need > limit:
            results.update(_place(batch, memory_budget, bar))
            batch, held = [], 0
        batch.append(plan)
        held += need
    if batch:
        results.update(_place(batch, memory_budget, bar))
    return results


def _kib(nbytes: int) -> int:
    return min(-(-nbytes // 1024), (1 << 31) - 1)  # (an int32 for the collective)


def _plan(placement: Placement) -> _Plan:
    array, sharding = placement.array, placement.sharding
    assert isinstance(sharding, NamedSharding)
    axes = _replica_axes(sharding)
    replicas = math.prod(sharding.mesh.shape[a] for a in axes)
    spec = (*sharding.spec, *(None,) * (array.ndim - len(sharding.spec)))
    spread = NamedSharding(sharding.mesh, P(axes, *spec))
    positions = spread.addressable_devices_indices_map((replicas, *array.shape))
    regions: dict[Box, _Region] = {}
    for device, index in sharding.addressable_devices_indices_map(array.shape).items():
        index = index if index is not None else (slice(None),) * array.ndim
        region = tuple(s.indices(n)[:2] for s, n in zip(index, array.shape, strict=True))
        position = positions[device]
        replica = position[0].indices(replicas)[0] if position is not None else 0
        if region not in regions:
            regions[region] = _Region(region, [], [])
        found = regions[region]
        found.devices.append((device, replica))
        part = _parts(array, region, replicas)[replica]
        if part is not None and part not in found.parts:
            found.parts.append(part)
    return _Plan(placement, sharding, spread, replicas, list(regions.values()))


def _parts(array: LazyArray, region: Box, count: int) -> list[Box | None]:
    """`region` cut into `count` parts (None: empty) along the dimension in which it
    spans most stored chunks, on chunk boundaries where the view is a whole stored
    array, so that no two parts share a chunk; elsewhere evenly. A 0-d array is one
    part, read by the first replica."""
    if any(low >= high for low, high in region):
        return [None] * count
    if not region:
        return [(), *[None] * (count - 1)]
    whole = array.sources == (array,) and array.selection.is_full(array.stored.shape)
    chunks = array.chunks if whole else (1,) * array.ndim
    cells = [_cells(low, high, c) for (low, high), c in zip(region, chunks, strict=True)]
    dim = max(range(len(region)), key=lambda d: (cells[d], -d))
    (low, high), size, total = region[dim], chunks[dim], cells[dim]

    def edge(k: int) -> int:  # the k-th edge between the dimension's cells
        return low if k == 0 else high if k == total else (low // size + k) * size

    parts: list[Box | None] = []
    for i in range(count):
        first, last = i * total // count, (i + 1) * total // count
        parts.append(
            None
            if first == last
            else (*region[:dim], (edge(first), edge(last)), *region[dim + 1 :])
        )
    return parts


def _cells(low: int, high: int, chunk: int) -> int:
    """How many cells of a grid of `chunk` the range `[low, high)` touches."""
    return (high - 1) // chunk - low // chunk + 1


def _place(
    plans: list[_Plan], memory_budget: int | None, bar: Progress | None
) -> dict[int, jax.Array]:
    """Read this process's parts of `plans`, agree with every process that all
    reads succeeded, then all-reduce each array into place."""
    sent = [staged(plan.sharding) for plan in plans]
    found: list[list[_Read]] = []
    failure: BaseException | None = None
    try:
        scheduler = Scheduler(memory_budget, bar)
        found = [[] if s else _schedule(p, scheduler) for p, s in zip(plans, sent, strict=True)]
        scheduler.drain()
        parts = iter(
            _send_parts([p for p, s in zip(plans, sent, strict=True) if s], scheduler.budget, bar)
        )
        found = [next(parts) if s else read for read, s in zip(found, sent, strict=True)]
    except Exception as error:  # noqa: BLE001 - agreed on below, then raised
        failure = error
    agree_read(failure, [p.placement.array.key for p in plans])
    return {
        id(plan.placement): _combine(plan, read, of_bits)
        for plan, read, of_bits in zip(plans, found, sent, strict=True)
    }


_Read = np.ndarray | list[tuple[Box, jax.Array]]
"""What this process read of one region: a host buffer of the whole region (its parts
filled in, zeros elsewhere), or each part on the region's first device here."""


def agree_read(failure: BaseException | None, keys: Sequence[str]) -> None:
    """Raise on every process if the reads of `keys` failed on any (a collective):
    the failing process's own error there, a `LazyckptError` naming it elsewhere."""
    failed = multihost.any_failed(failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise LazyckptError(
            f"device_put(broadcast=True): process(es) {failed} failed to read their share "
            "of the checkpoint; every process stops here, before placing "
            f"{', '.join(repr(k) for k in keys[:3])}{' and others' if len(keys) > 3 else ''}. "
            "The failing process's own error says why"
        )


def _schedule(plan: _Plan, scheduler: Scheduler) -> list[_Read]:
    """A zeroed buffer per region of `plan`, with reads of its parts into it
    scheduled."""
    array = plan.placement.array
    buffers: list[_Read] = []
    destinations = []
    for found in plan.regions:
        region = found.region
        buffer = result_empty(box_shape(region), array.dtype)
        buffer[...] = 0
        buffers.append(buffer)
        scheduler.guard.keep(buffer.nbytes)
        for part in found.parts:
            inside = tuple(
                slice(p0 - r0, p1 - r0) for (p0, p1), (r0, _) in zip(part, region, strict=True)
            )
            view: tuple[Any, ...] = (*inside, ...)  # (a view, 0-d too: `buffer[()]` is a scalar)
            destinations.append(Destination(part, array.dtype, out=buffer[view]))
    if destinations:
        schedule_fill(array, destinations, scheduler, lambda: None)
    return buffers


def _send_parts(plans: list[_Plan], budget: int, bar: Progress | None) -> list[list[_Read]]:
    """For each region of `plans` (bound for devices that copy out of host memory),
    its parts read and sent to the first of its devices here, in pieces within
    `budget` (`put_staged`)."""
    work: list[tuple[LazyArray, jax.sharding.Sharding, dict[Box, list[jax.Device]]]] = []
    for plan in plans:
        for region in plan.regions:
            device = region.devices[0][0]
            for part in region.parts:
                view = plan.placement.array[as_slices(part)]
                whole = tuple((0, n) for n in view.shape)
                work.append((view, SingleDeviceSharding(device), {whole: [device]}))
    placed = iter(put_staged(work, budget, bar) if work else [])
    return [
        [[(part, next(placed)) for part in region.parts] for region in plan.regions]
        for plan in plans
    ]


def _combine(plan: _Plan, read: list[_Read], of_bits: bool) -> jax.Array:
    """The all-reduce: each region's values on its first device, zeros on its other
    devices here; from a host buffer (adopted on CPU) or, where the parts were sent
    to that device (`of_bits`), written there into zeros as their bits."""
    array = plan.placement.array
    bits = _bits(array.dtype)
    shards = []
    for region, values in zip(plan.regions, read, strict=True):
        shape = (1, *box_shape(region.region))
        if isinstance(values, np.ndarray):
            zeros = np.zeros(shape, values.dtype)  # (pages untouched until copied)
            for i, (device, _) in enumerate(region.devices):
                held = values[None] if i == 0 else zeros
                shards.append(jax.device_put(held, device, may_alias=True))
        else:
            for i, (device, _) in enumerate(region.devices):
                shard = jnp.zeros(shape, bits, device=device)
                for part, sent in values if i == 0 else []:
                    shard = _write_bits(shard, sent, _offsets(part, region.region))
                shards.append(shard)
    spread = jax.make_array_from_single_device_arrays(
        (plan.replicas, *array.shape), plan.spread, shards
    )
    placed: jax.Array = _maximum(np.dtype(array.dtype).name, plan.sharding, of_bits)(spread)
    return placed


def _offsets(part: Box, region: Box) -> tuple[int, ...]:
    """Where `part` starts in its region's shard (after its leading dimension of 1)."""
    return (0, *(low - start for (low, _), (start, _) in zip(part, region, strict=True)))


@functools.partial(jax.jit, donate_argnums=0)
def _write_bits(shard: jax.Array, part: jax.Array, at: tuple[int, ...]) -> jax.Array:
    """`shard` (the bits of a region, with a leading dimension of 1) with `part`'s bits
    written at `at`, in place: the offsets are traced, so one program serves every part
    of a shape."""
    if part.dtype == jnp.bool_:
        values = part.astype(shard.dtype)
    else:
        values = jax.lax.bitcast_convert_type(part, shard.dtype)
    return jax.lax.dynamic_update_slice(shard, values[None], at)


@functools.cache
def _maximum(dtype_name: str, sharding: NamedSharding, of_bits: bool = False) -> Any:
    """A jitted maximum over the leading dimension, of the bits, onto `sharding`; its
    input is the values or (`of_bits`) their bits already."""
    dtype = jnp.dtype(dtype_name)
    bits = _bits(dtype)

    def combine(spread: jax.Array) -> jax.Array:
        if dtype == jnp.bool_:
            return jnp.max(spread.astype(bits), axis=0).astype(jnp.bool_)
        unsigned = spread if of_bits else jax.lax.bitcast_convert_type(spread, bits)
        return jax.lax.bitcast_convert_type(jnp.max(unsigned, axis=0), dtype)

    return jax.jit(combine, out_shardings=sharding)
