"""The route of each placement of a matched tree: onto its sharding, or into a NumPy
array; shared by `load` and `device_put`. jax is imported only where an array goes to
devices, whose sharding has imported it: `load` never does."""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import numpy as np

from lazyckpt import _text
from lazyckpt._array.dtypes import LONG_DOUBLES, issubdtype
from lazyckpt._array.tree import map_leaves
from lazyckpt._device.staged import Regions, Staged, put_staged, staged
from lazyckpt._engine.coalesced import schedule_coalesced
from lazyckpt._engine.fill import schedule_fill, stored_bytes
from lazyckpt._engine.memory import Destination, check_total
from lazyckpt._engine.progress import shown
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._engine.small import is_small, read_small
from lazyckpt._engine.stored import stores
from lazyckpt._errors import LazyTypeError, ShardingError
from lazyckpt._lazy import LazyArray
from lazyckpt._placement.target import Placement
from lazyckpt._sizes import Size, optional_size
from lazyckpt._storage import multihost
from lazyckpt._storage.kvstore import check_unchanged

if TYPE_CHECKING:
    import jax
    from jax.sharding import Sharding

ReadResult: TypeAlias = "Destination | np.ndarray | jax.Array"
"""What a placement's read leaves: a filled host buffer, or an array (typed PRNG keys,
shards placed on devices)."""


class Route(enum.Enum):
    """How one placement is read, decided before any read of the job (`_route`); the one
    later change: `_read_here` turns TO_HOST into COALESCED for arrays it reads over HTTP."""

    BROADCAST = "replicated across processes: read by the job together (`collective`)"
    SMALL_TO_DEVICES = "a small whole array for devices: read in batches, put in one call"
    COALESCED = "a whole array to host over HTTP: read in large ranges of its data files"
    SMALL_TO_HOST = "a small whole array to host: read in batches"
    TO_HOST = "read whole into a NumPy array (typed PRNG keys: a jax.Array of keys)"
    STAGED = "bound for accelerators: sent in pieces within the budget (`staged`)"
    PUT = "a host buffer per distinct region, handed to the devices (CPUs adopt it)"


@attrs.define(eq=False)
class Routed:
    """One placement of a job, with what was resolved about it before any read: its route and,
    bound for devices, the distinct regions this process holds."""

    at: int
    """Its position in the job: the key of its result."""
    placement: Placement
    route: Route
    to_accelerator: bool
    """Whether some device of this process it is bound for is sent pieces (`staged`)."""
    regions: Regions = attrs.field(factory=dict)
    """The distinct regions this process's devices hold, with their devices (resolved
    in `_read_here`; none for the host and the broadcasts)."""

    @property
    def array(self) -> LazyArray:
        return self.placement.array

    @property
    def sharding(self) -> Sharding:
        assert self.placement.sharding is not None, "bound for the host"
        return self.placement.sharding


@attrs.frozen
class _Slot:
    """A placement's place in the plan while the job reads it (`at`: its position)."""

    at: int


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
    job and spread by JAX (`collective`). Its callers, `load` and `device_put`, pause
    the garbage collector around it (`gc_paused`)."""
    placements: list[Placement] = []

    def slot(leaf: object) -> object:
        if not isinstance(leaf, Placement):
            return leaf
        placements.append(leaf)
        return _Slot(len(placements) - 1)

    slotted = map_leaves(slot, plan)
    arrays = [p.array for p in placements]
    with shown(progress, stored_bytes(arrays), label) as bar:
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
        spread = _spread(placements) if broadcast else set()
        jobs = [_route(at, p, at in spread) for at, p in enumerate(placements)]
        broadcasts = [job for job in jobs if job.route is Route.BROADCAST]
        for job in broadcasts:  # (a sharding that cannot lay it out fails on every process)
            _regions(job.array, job.sharding)
        results: dict[int, ReadResult] = {}
        failure: Exception | None = None
        budget = None
        try:
            budget = optional_size("memory_budget", memory_budget)  # (agreed on below if bad)
            check_total(label, [(job.array.key, job.array.nbytes) for job in jobs if _in_host(job)])
            scheduler = Scheduler(budget, bar)
            _read_here(jobs, scheduler, results)
        except Exception as error:
            if not broadcasts:
                raise
            failure = error  # (raised once every process knows, before any collective)
        if broadcasts:
            from lazyckpt._device.collective import agree_read, put

            agree_read(failure, [job.array.key for job in broadcasts])
            placed = put([job.placement for job in broadcasts], budget, bar)
            results.update((job.at, array) for job, array in zip(broadcasts, placed, strict=True))
    # Everything was read from the checkpoints as they were opened, or it is refused.
    check_unchanged(stores(arrays))
    return map_leaves(lambda x: _result(results, x.at) if isinstance(x, _Slot) else x, slotted)


def _route(at: int, placement: Placement, spread: bool) -> Routed:
    """`placement`'s route, its stored array and sharding asked about once; whole
    arrays to host that `_read_here` reads coalesced are routed there later."""
    array, sharding = placement.array, placement.sharding
    if sharding is None:
        small = not array.key_impl and is_small(array)
        return Routed(at, placement, Route.SMALL_TO_HOST if small else Route.TO_HOST, False)
    if spread:  # (its regions are the collective's, `collective._plan`)
        return Routed(at, placement, Route.BROADCAST, False)
    sent = staged(sharding)
    if sharding.is_fully_addressable and not array.key_impl and is_small(array):
        return Routed(at, placement, Route.SMALL_TO_DEVICES, sent)
    return Routed(at, placement, Route.STAGED if sent and not array.key_impl else Route.PUT, sent)


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


def _in_host(job: Routed) -> bool:
    """Whether `job`'s result is held in this process's memory: a NumPy array, or one
    whose devices are all this process's CPUs."""
    sharding = job.placement.sharding
    return sharding is None or (sharding.is_fully_addressable and not job.to_accelerator)


def _spread(placements: list[Placement]) -> set[int]:
    """The positions of the placements to place by broadcast, in a run of several
    processes."""
    on_devices = [(at, p) for at, p in enumerate(placements) if p.sharding is not None]
    if not on_devices or multihost.count() == 1:
        return set()
    from lazyckpt._device.collective import broadcastable  # (jax's: the shardings imported it)

    return {at for at, p in on_devices if broadcastable(p)}


def _read_here(jobs: list[Routed], scheduler: Scheduler, results: dict[int, ReadResult]) -> None:
    """Read every job but the broadcasts by this process alone, route by route: whole
    arrays of a checkpoint over HTTP in coalesced ranges, small whole arrays in
    batches, the others each on its own; those bound for accelerators last."""
    routes: dict[Route, list[Routed]] = {route: [] for route in Route}
    for job in jobs:
        sharding = job.placement.sharding
        if sharding is not None and job.route is not Route.BROADCAST:
            # (a sharding that cannot lay it out is refused here, before any read)
            job.regions = _regions(job.array, sharding)
    to_host = [j for j in jobs if j.placement.sharding is None and not j.array.key_impl]
    for at, destination in schedule_coalesced([j.array for j in to_host], scheduler).items():
        to_host[at].route = Route.COALESCED
        results[to_host[at].at] = destination
    for job in jobs:
        routes[job.route].append(job)
    host_values = read_small([j.array for j in routes[Route.SMALL_TO_HOST]], scheduler)
    for job in jobs:
        if job.route is Route.TO_HOST:
            _schedule_load(job.array, scheduler, results, job.at)
        elif job.route is Route.PUT:
            _schedule_put(job, scheduler, results)
    scheduler.drain()
    for job, values in zip(routes[Route.SMALL_TO_HOST], host_values, strict=True):
        results[job.at] = values  # (filled as their reads finished)
    _put_small(routes[Route.SMALL_TO_DEVICES], scheduler, results)
    if routes[Route.STAGED]:
        work = [Staged(job.array, job.sharding, job.regions) for job in routes[Route.STAGED]]
        placed = put_staged(work, scheduler.budget, scheduler.progress)
        results.update((j.at, array) for j, array in zip(routes[Route.STAGED], placed, strict=True))


def _put_small(jobs: list[Routed], scheduler: Scheduler, results: dict[int, ReadResult]) -> None:
    """Read small arrays bound for devices in batches, each batch's host values
    within the budget, then put each batch on its devices in one call."""
    while jobs:
        size, count = 0, 0
        while count < len(jobs) and (
            not count or size + jobs[count].array.nbytes <= scheduler.budget
        ):
            size += jobs[count].array.nbytes
            count += 1
        batch, jobs = jobs[:count], jobs[count:]
        values = read_small([job.array for job in batch], scheduler)
        scheduler.drain()
        import jax  # (the shardings imported it)

        placed = jax.device_put(values, [job.sharding for job in batch])
        if any(job.to_accelerator for job in batch):
            jax.block_until_ready(placed)  # (the host values are held until sent)
        for job, array in zip(batch, placed, strict=True):
            results[job.at] = array
        del values, placed


def _result(results: dict[int, ReadResult], at: int) -> np.ndarray | jax.Array:
    found = results[at]
    return found.buffer() if isinstance(found, Destination) else found


def _describe(placement: Placement) -> str:
    from jax.sharding import NamedSharding  # (the shardings imported it)

    array, sharding = placement.array, placement.sharding
    layout = repr(sharding)
    if isinstance(sharding, NamedSharding):
        layout = f"{dict(sharding.mesh.shape)} {sharding.spec} {[d.id for d in sharding.mesh.devices.flat]}"
    return f"{array.key}|{array.shape}|{array.dtype}|{layout}"


def _schedule_load(
    array: LazyArray, scheduler: Scheduler, results: dict[int, ReadResult], at: int
) -> None:
    """Read the whole view into a NumPy array (typed PRNG keys: a jax.Array of keys)."""
    if array.key_impl:
        results[at] = array.get()  # typed keys are small
        return
    destination = Destination(tuple((0, n) for n in array.shape), array.dtype, key=array.key)
    schedule_fill(array, [destination], scheduler, lambda: None)
    results[at] = destination


def _regions(array: LazyArray, sharding: Sharding) -> Regions:
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
    regions: Regions = {}
    for device, index in indices.items():
        index = index if index is not None else (slice(None),) * array.ndim
        region = tuple(s.indices(n)[:2] for s, n in zip(index, array.shape, strict=True))
        regions.setdefault(region, []).append(device)
    return regions


def _schedule_put(job: Routed, scheduler: Scheduler, results: dict[int, ReadResult]) -> None:
    """Fill one host buffer per distinct region, then hand them to the devices."""
    import jax  # (the sharding imported it)

    array, sharding, regions = job.array, job.sharding, job.regions
    if array.key_impl:
        # Typed keys are small: read each region as keys, then place them.
        shards: list[jax.Array] = []
        for region, devices in regions.items():
            keys = array[tuple(slice(*r) for r in region)].get()
            shards.extend(jax.device_put(keys, device) for device in devices)
        results[job.at] = jax.make_array_from_single_device_arrays(array.shape, sharding, shards)
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
        results[job.at] = jax.make_array_from_single_device_arrays(array.shape, sharding, shards)
        destinations.clear()

    schedule_fill(array, destinations, scheduler, finish)
