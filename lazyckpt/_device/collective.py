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

Where the devices copy out of host memory (TPUs, GPUs: `lazyckpt._device.staged`), no
region is held whole on the host: this process's parts of an array are sent in pieces
within the budget (`send_shards`, each stored chunk read once for all of them), each
to the first of its region's devices here, as they are written there (unsigned
integers for floats narrower than 32 bits, which every device copies exactly), and
written into zeros made on the device; the other devices make their zeros
themselves. After the maximum, such floats are made themselves as any shard placed
in pieces is (`lazyckpt._device.shard.finish`).

Before any data moves between devices, the processes agree that every process read
its parts, made its shards of the arrays of shares and compiled the all-reduces (a
small collective): a failure there on any process is an error on every process, not
a hang in an all-reduce. A failure after them (making narrow floats on a device) is
raised on its process once every batch has been all-reduced, so that the others do
not wait for it. A device that fails inside an all-reduce (out of memory there) can
still leave the others waiting in it (gloo, between CPU devices, gives up after 30 s;
accelerators' collectives were not tried). Arrays are placed in batches that fit the
memory budget.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from collections.abc import Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lazyckpt._array.geometry import Box, box_shape
from lazyckpt._device import shard, staged
from lazyckpt._device.platforms import any_staged
from lazyckpt._engine.fill import schedule_fill
from lazyckpt._engine.memory import Destination, result_empty
from lazyckpt._engine.progress import Progress
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._errors import LazyckptError
from lazyckpt._lazy import LazyArray
from lazyckpt._placement.target import Placement
from lazyckpt._storage import multihost


@attrs.frozen(eq=False)
class _Region:
    """One region of the array that this process's devices hold, and what it reads
    of it: the parts of its local replicas (disjoint), which the first of its devices
    holds (in a host buffer it adopts, or written into zeros on it); its other
    devices start from zeros."""

    region: Box
    devices: list[tuple[jax.Device, int]]
    """Each device holding the region here, with its replica index."""
    parts: list[Box]


@attrs.frozen(eq=False)
class _Plan:
    at: int
    """The placement's position among those `put` places."""
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
    if placement.array.size == 0:  # (nothing to read; jit lays out empty outputs whole)
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


_PACKED = (
    *("int4", "uint4", "int2", "uint2"),
    *("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"),
)
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
) -> list[jax.Array]:
    """Each of `placements` (all `broadcastable`) placed by broadcast, in their order."""
    plans = [_plan(at, p) for at, p in enumerate(placements)]
    # Each batch ends in collectives, so every process must cut the same batches: by
    # the largest host bytes any process needs, within the smallest budget (in KiB).
    budget = Scheduler(memory_budget).budget
    rows = multihost.gather([_kib(budget), *(_kib(plan.host_bytes()) for plan in plans)])
    limit = min(row[0] for row in rows)
    needs = [max(row[i + 1] for row in rows) for i in range(len(plans))]
    batches: list[list[_Plan]] = []
    held = 0
    for plan, need in zip(plans, needs, strict=True):
        if not batches or held + need > limit:
            batches.append([])
            held = 0
        batches[-1].append(plan)
        held += need
    results: dict[int, jax.Array] = {}
    failures: list[BaseException] = []  # (raised once every batch is all-reduced)
    for batch in batches:
        results.update(_place(batch, memory_budget, bar, failures))
    if failures:
        raise failures[0]
    return [results[at] for at in range(len(plans))]


def _kib(nbytes: int) -> int:
    return min(-(-nbytes // 1024), (1 << 31) - 1)  # (an int32 for the collective)


def _plan(at: int, placement: Placement) -> _Plan:
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
    return _Plan(at, placement, sharding, spread, replicas, list(regions.values()))


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
    plans: list[_Plan],
    memory_budget: int | None,
    bar: Progress | None,
    failures: list[BaseException],
) -> dict[int, jax.Array]:
    """Read this process's parts of `plans`, make its shards of each array of shares
    and compile the all-reduces, agree with every process that all of that
    succeeded, then all-reduce each array into place. A failure after the agreement
    (making narrow floats on a device, after the all-reduces) is added to
    `failures`, for the caller to raise once no collective is left."""
    sent = [_sent(plan) for plan in plans]
    spreads: list[jax.Array | None] = []
    combines = []
    failure: BaseException | None = None
    # (the programs compiled, or loaded, while the reads run)
    with concurrent.futures.ThreadPoolExecutor(staged.COMPILERS) as compilers:
        try:
            compiling = [
                compilers.submit(_compile_maximum, plan, s)
                for plan, s in zip(plans, sent, strict=True)
            ]
            sending = [plan for plan, s in zip(plans, sent, strict=True) if s]
            preparing = [f for plan in sending for f in _prepare(plan, compilers)]
            scheduler = Scheduler(memory_budget, bar)
            read = [
                None if s else _schedule(p, scheduler) for p, s in zip(plans, sent, strict=True)
            ]
            scheduler.drain()
            for future in preparing:
                future.result()
            parts = iter(_send_parts(sending, scheduler.budget, bar))
            for plan, buffers in zip(plans, read, strict=True):
                shards = _from_host(plan, buffers) if buffers is not None else next(parts)
                shape = (plan.replicas, *plan.placement.array.shape)
                spreads.append(jax.make_array_from_single_device_arrays(shape, plan.spread, shards))
                del shards
            combines = [future.result() for future in compiling]
            jax.block_until_ready(spreads)  # (a device's failure, here, before the all-reduce)
        except Exception as error:  # noqa: BLE001 - agreed on below, then raised
            compilers.shutdown(cancel_futures=True)
            failure = error
    agree_read(failure, [p.placement.array.key for p in plans])
    reduced = []
    for i, combine in enumerate(combines):  # (every collective of the batch, first)
        reduced.append(combine(spreads[i]))
        spreads[i] = None  # (its memory on the devices let go once reduced)
    results = {}
    for plan, placed in zip(plans, reduced, strict=True):
        try:
            results[plan.at] = _finish(plan, placed)
        except Exception as error:  # noqa: BLE001 - raised by `put`, after every batch
            failures.append(error)
    return results


def _compile_maximum(plan: _Plan, sent: bool) -> Any:
    """`plan`'s all-reduce, compiled for its array of shares (of the values, or as they
    are written on the devices where its parts are `sent`)."""
    dtype = np.dtype(plan.placement.array.dtype)
    shares = shard.device_dtype(dtype) if sent else np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    shape = (plan.replicas, *plan.placement.array.shape)
    abstract = jax.ShapeDtypeStruct(shape, shares, sharding=plan.spread)
    return _maximum(dtype.name, shares.name, plan.sharding).lower(abstract).compile()


def _prepare(
    plan: _Plan, compilers: concurrent.futures.Executor
) -> list[concurrent.futures.Future[Any]]:
    """Start compiling (or loading) the programs that make `plan`'s shares on its
    devices here: zeros of each region, and each part written into them."""
    dtype = shard.device_dtype(np.dtype(plan.placement.array.dtype))
    futures = []
    for region in plan.regions:
        shape = (1, *box_shape(region.region))
        for i, (device, _) in enumerate(region.devices):
            futures.append(compilers.submit(shard.empty_program, shape, dtype, device))
            for part in region.parts if i == 0 else []:
                piece = box_shape(part)
                futures.append(compilers.submit(shard.write_program, shape, piece, dtype, device))
    return futures


def _sent(plan: _Plan) -> bool:
    """Whether `plan`'s parts are sent to its devices in pieces: its mesh's devices
    copy out of host memory. Decided from the whole mesh, so that every process runs
    the same programs."""
    return any_staged(plan.sharding.mesh.devices.flat)


def agree_read(failure: BaseException | None, keys: Sequence[str]) -> None:
    """Raise on every process if the reads of `keys` failed on any (a collective):
    the failing process's own error there, a `LazyckptError` naming it elsewhere."""
    failed = multihost.any_failed(failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise LazyckptError(
            f"device_put(broadcast=True): process(es) {failed} failed to read their share "
            "of the checkpoint or to put it on their devices; every process stops here, "
            "before placing "
            f"{', '.join(repr(k) for k in keys[:3])}{' and others' if len(keys) > 3 else ''}. "
            "The failing process's own error says why"
        )


def _schedule(plan: _Plan, scheduler: Scheduler) -> list[np.ndarray]:
    """A zeroed buffer per region of `plan`, with reads of its parts into it
    scheduled."""
    array = plan.placement.array
    buffers = []
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


def _from_host(plan: _Plan, buffers: list[np.ndarray]) -> list[jax.Array]:
    """This process's shards of the array of shares: each region's buffer on its first
    device (adopted on CPU), zeros on its other devices."""
    shards = []
    for region, buffer in zip(plan.regions, buffers, strict=True):
        zeros = np.zeros((1, *buffer.shape), buffer.dtype)  # (pages untouched until copied)
        for i, (device, _) in enumerate(region.devices):
            held = buffer[None] if i == 0 else zeros
            shards.append(jax.device_put(held, device, may_alias=True))
    return shards


def _send_parts(plans: list[_Plan], budget: int, bar: Progress | None) -> list[list[jax.Array]]:
    """This process's shards of each array of shares of `plans`, bound for devices
    that copy out of host memory: its parts of each array sent in one `send_shards`
    within `budget` (each stored chunk read once for all of them), each to the first
    of its region's devices, and written there into zeros, as they are written on the
    device; zeros on the region's other devices."""
    work = [
        (
            plan.placement.array,
            {part: [region.devices[0][0]] for region in plan.regions for part in region.parts},
        )
        for plan in plans
    ]
    reading = [(array, parts) for array, parts in work if parts]  # (some read nothing here)
    done = iter(staged.send_shards(reading, budget, bar, raw=True) if reading else [])
    sent = [next(done) if parts else [] for _, parts in work]
    out = []
    for plan, buffers in zip(plans, sent, strict=True):
        dtype = shard.device_dtype(np.dtype(plan.placement.array.dtype))
        at = iter(buffers)
        shards = []
        for region in plan.regions:
            shape = (1, *box_shape(region.region))
            for i, (device, _) in enumerate(region.devices):
                made = shard.empty(shape, dtype, device)
                for part in region.parts if i == 0 else []:
                    (piece,) = next(at)
                    made = shard.write(made, piece, _offsets(part, region.region))
                    del piece  # (let go once written)
                shards.append(made)
        out.append(shards)
    return out


def _offsets(part: Box, region: Box) -> tuple[int, ...]:
    """Where `part` starts in its region's shard (after its leading dimension of 1)."""
    return (0, *(low - start for (low, _), (start, _) in zip(part, region, strict=True)))


def _finish(plan: _Plan, placed: jax.Array) -> jax.Array:
    """An all-reduced array in its own dtype: floats narrower than 32 bits, where their
    parts were sent as unsigned integers, made floats (`lazyckpt._device.shard.finish`)."""
    array = plan.placement.array
    dtype = np.dtype(array.dtype)
    if placed.dtype == dtype:
        return placed
    regions: dict[Box, list[jax.Array]] = {}  # (the same values on each device of one)
    for held in placed.addressable_shards:
        region = tuple(s.indices(n)[:2] for s, n in zip(held.index, array.shape, strict=True))
        regions.setdefault(region, []).append(held.data)
    del placed  # (its buffers are made floats in place)
    finished = [
        buffer for buffers in regions.values() for buffer in shard.finish(array.key, buffers, dtype)
    ]
    return jax.make_array_from_single_device_arrays(array.shape, plan.sharding, finished)


@functools.cache
def _maximum(dtype_name: str, spread_name: str, sharding: NamedSharding) -> Any:
    """A jitted maximum over the leading dimension, of the bits, onto `sharding`: of
    an array of shares of `spread_name` for an array of `dtype_name`. Shares already
    unsigned integers (narrow floats sent to accelerators) stay so."""
    dtype, spread_dtype = jnp.dtype(dtype_name), jnp.dtype(spread_name)
    bits = _bits(dtype)

    def combine(spread: jax.Array) -> jax.Array:
        if dtype == jnp.bool_:
            return jnp.max(spread.astype(bits), axis=0).astype(jnp.bool_)
        if spread_dtype != dtype:
            return jnp.max(spread, axis=0)
        unsigned = jax.lax.bitcast_convert_type(spread, bits)
        return jax.lax.bitcast_convert_type(jnp.max(unsigned, axis=0), dtype)

    return jax.jit(combine, out_shardings=sharding)
