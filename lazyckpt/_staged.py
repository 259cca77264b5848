"""Placing arrays on accelerators in pieces, with the host's share bounded by the budget.

On CPU devices a filled host buffer becomes the shard itself (`_materialize`), so the
results are memory the read is meant to leave behind. A TPU or GPU shard is only
staged on the host: filled whole, a shard of 2 GiB would need 2 GiB of host memory
whatever the budget, and many in flight more. Here an array's shards are filled
together where they fit half the budget (each stored chunk read once for all), and
otherwise in pieces: bands read raw where the bytes lie raw in a file, or blocks
streamed from the stored chunks (`_engine.stream.iter_blocks`, each chunk read once
for all shards). Every piece is sent to its devices as it comes and written into the
shard's buffer there by a jitted `dynamic_update_slice` that donates the buffer, so it
is updated in place: no second copy of the shard in device memory, and on the host
only the pieces being read and those being sent. Half the budget reads, half carries
pieces whose transfers have not finished (`_Gate`): a piece is let go once its copy on
the device is ready, and its host buffer is filled again by a later piece, since
faulting in fresh pages costs more than the copy. A shard that one piece holds whole
is sent as that piece, with no buffer to write into. The programs that make, write
and finish a shard on its devices, and how its values arrive bit for bit, are in
`lazyckpt._on_device`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lazyckpt import _on_device as on_device
from lazyckpt._array import compose
from lazyckpt._array.geometry import Box, as_slices, box_bytes, slices
from lazyckpt._engine.decode import decodes
from lazyckpt._engine.fill import schedule_fill
from lazyckpt._engine.memory import BufferPool, Destination
from lazyckpt._engine.progress import Progress
from lazyckpt._engine.raw import source
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._engine.stream import iter_blocks
from lazyckpt._errors import OverBudgetWarning, warn
from lazyckpt._lazy import LazyArray
from lazyckpt._text import human_bytes

if TYPE_CHECKING:
    import jax
    from jax.sharding import Sharding

STAGED_PLATFORMS = frozenset({"tpu", "gpu"})
"""Device platforms whose shards are staged on the host and sent in pieces (jax names
CUDA and ROCm devices' platform "gpu"); every other platform's devices (CPU) adopt the
filled host buffer as the shard."""

ADOPTING_PLATFORMS = frozenset({"cpu"})
"""Device platforms whose arrays may be host buffers handed to them, not copies."""


def staged(sharding: Sharding) -> bool:
    """Whether arrays placed with `sharding` are sent in pieces: some device of this
    process that it places on is an accelerator's."""
    platforms = {str(getattr(d, "platform", "")) for d in sharding.addressable_devices}
    return not platforms.isdisjoint(STAGED_PLATFORMS)


def put_staged(
    placements: Sequence[tuple[LazyArray, Sharding, dict[Box, list[jax.Device]]]],
    budget: int,
    progress: Progress | None,
) -> list[jax.Array]:
    """Each `(array, sharding, regions)` placed on its devices within `budget` host
    bytes; `regions` maps each distinct region this process holds to the devices
    that hold it.

    Half the budget is for reads in flight, half for filled pieces until their
    transfers are done. An array whose regions hold at most half the budget together
    is one fill of them all, by the engine as any read is (raw bytes straight into
    place, chunks decoded on every core, each once for all regions), each region sent
    whole. Otherwise, where its bytes lie raw in a file, each region is filled in
    pieces that read only their own bytes; elsewhere its regions are streamed
    together (`iter_blocks`: each stored chunk decoded once, in slabs where it is
    larger than a block).
    """
    import jax

    half = max(1, budget // 2)
    scheduler = Scheduler(half, progress)
    planned = [_plan(array, regions, half) for array, _, regions in placements]
    gate = _Gate(half, scheduler, BufferPool(half))
    streamed = [
        (array[as_slices(shard.region)], shard)
        for (array, _, _), (shards, pieces, _) in zip(placements, planned, strict=True)
        if pieces is None
        for shard in shards
    ]
    with concurrent.futures.ThreadPoolExecutor(_COMPILERS) as compilers:
        try:
            for shards, pieces, _ in planned:  # (assembling compiled while the reads run)
                for k, shard in enumerate(shards):
                    if pieces is None or len(pieces[k]) > 1:
                        cut = pieces[k] if pieces is not None else []
                        shard.prepare(compilers, {_shape(piece) for piece in cut})
            for (array, _, _), (shards, pieces, together) in zip(placements, planned, strict=True):
                if pieces is None:
                    continue
                if together:
                    _fill(array, [(shard, shard.region) for shard in shards], gate, scheduler)
                    continue
                for shard, cut in zip(shards, pieces, strict=True):
                    for piece in cut:
                        _fill(array, [(shard, piece)], gate, scheduler)
            scheduler.drain()
            if streamed:
                # Its jobs' blocks (the other half) come from the pool too.
                gate.pool.limit = budget
                blocks = iter_blocks([v for v, _ in streamed], half, progress, pool=gate.pool)
                for position, index, values in blocks:
                    held = _held_bytes(values)
                    if not values.flags.c_contiguous:  # a piece of a block shared by regions
                        values = np.ascontiguousarray(values)
                        held += values.nbytes
                    gate.reserve(held)
                    gate.sent(held, streamed[position][1].write(index, values), values)
                    del values
            gate.drain()
        except BaseException:
            compilers.shutdown(cancel_futures=True)  # (not compiled for nothing first)
            scheduler.abandon()
            raise
        finished = [[shard.finished() for shard in shards] for shards, _, _ in planned]
    placed: list[jax.Array] = [
        jax.make_array_from_single_device_arrays(
            array.shape, sharding, [buffer for buffers in done for buffer in buffers]
        )
        for (array, sharding, _), done in zip(placements, finished, strict=True)
    ]
    jax.block_until_ready(placed)
    return placed


_COMPILERS = 4
"""Threads making shards' buffers and compiling their assembly while the reads run
(compiling for a TPU takes about half a second a program)."""


def _plan(
    array: LazyArray, regions: dict[Box, list[jax.Device]], half: int
) -> tuple[list[_Shard], list[list[Box]] | None, bool]:
    """`array`'s shards, the pieces each is filled in (None where they are streamed),
    and whether they are filled together, in one read: each region whole where all fit
    `half` together, cut where the bytes lie raw in a file."""
    shards = [
        _Shard(array.key, region, devices, array.dtype) for region, devices in regions.items()
    ]
    itemsize = array.dtype.itemsize
    if sum(box_bytes(shard.region, itemsize) for shard in shards) <= half:
        return shards, [[shard.region] for shard in shards], True
    if _raw(array):
        return shards, [_pieces(shard.region, itemsize, half) for shard in shards], False
    return shards, None, False


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(high - low for low, high in box)


def _raw(array: LazyArray) -> bool:
    """Whether `array`'s bytes lie raw in a file, so that any box of it is read alone."""
    stored = array.stored
    return not (isinstance(stored, compose.Node) or decodes(stored) or source(stored) is None)


def _pieces(region: Box, itemsize: int, half: int) -> list[Box]:
    """`region` itself where it holds at most `half` bytes; else cut into boxes of at
    most a quarter of that: bands of its leading dimension, and where one index of
    that dimension is larger still, each index cut the same way along the next."""
    if box_bytes(region, itemsize) <= half:
        return [region]
    return _cut(region, itemsize, max(itemsize, half // 4))


def _cut(box: Box, itemsize: int, limit: int) -> list[Box]:
    if box_bytes(box, itemsize) <= limit or not box:
        return [box]
    (low, high), rest = box[0], box[1:]
    row = box_bytes(((0, 1), *rest), itemsize)
    if row <= limit:
        # Bands of one shape (the last overlaps the one before, its rows written twice
        # alike): one program assembles them all.
        rows = min(limit // row, high - low)
        return [((at, at + rows), *rest) for at in (*range(low, high - rows, rows), high - rows)]
    return [
        ((at, at + 1), *inner) for at in range(low, high) for inner in _cut(rest, itemsize, limit)
    ]


def _fill(
    array: LazyArray,
    pieces: Sequence[tuple[_Shard, Box]],
    gate: _Gate,
    scheduler: Scheduler,
) -> None:
    """Fill each `(shard, piece)` of `array` in one read once the gate lets their bytes
    in (each stored chunk read once for all), then send each to its shard's devices."""
    dtype = array.dtype
    destinations, held = [], []
    for shard, piece in pieces:
        if shard.copies:
            out, nbytes = gate.take(_shape(piece), dtype)
        else:  # the devices adopt host memory: a buffer of its own
            out, nbytes = None, box_bytes(piece, dtype.itemsize)
            gate.reserve(nbytes)
        destinations.append(Destination(piece, dtype, aligned=True, out=out))
        held.append(nbytes)

    def send() -> None:
        for (shard, piece), destination, nbytes in zip(pieces, destinations, held, strict=True):
            index = slices(piece, shard.region)
            values = destination.buffer()
            destination.out = None  # (held by the transfer until it is done, not here)
            gate.sent(nbytes, shard.write(index, values), values)
        destinations.clear()

    schedule_fill(array, destinations, scheduler, send)


class _Gate:
    """Host bytes of pieces between their fill and the end of their transfer, at most
    `limit` (one piece at least): a piece waits for reads to finish, whose pieces go
    out, or for the oldest transfer.

    Pieces bound for devices that copy them out of host memory are filled into buffers
    of `pool`, whose memory is filled again by later pieces once their transfers have
    let go of them: fresh pages cost more than the copy into them (a gVisor host
    measured 0.75 GB/s through fresh buffers, over 10 GB/s through reused ones).
    """

    def __init__(self, limit: int, scheduler: Scheduler, pool: BufferPool) -> None:
        self.limit, self.scheduler, self.pool = limit, scheduler, pool
        self.held = 0
        self.sending: collections.deque[tuple[int, list[jax.Array], np.ndarray]]
        self.sending = collections.deque()

    def reserve(self, nbytes: int) -> None:
        """Wait until `nbytes` more may be held, then hold them."""
        while self.held and self.held + nbytes > self.limit and self._wait_one():
            pass
        self.held += nbytes

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[np.ndarray, int]:
        """An array from the pool, and the bytes held for it (its buffer's, which may
        be a little larger) until its piece is `sent` and transferred."""
        nbytes = math.prod(shape) * dtype.itemsize
        self.reserve(nbytes)
        values = self.pool.empty(shape, dtype)
        held = _held_bytes(values)
        self.reserve(held - nbytes)
        return values, held

    def sent(self, nbytes: int, arrays: list[jax.Array], values: np.ndarray) -> None:
        """`nbytes` are held, and `values` (sent as `arrays`) kept from the pool, until
        `arrays` are on their devices."""
        self.sending.append((nbytes, arrays, values))

    def drain(self) -> None:
        while self.sending:
            self._wait_oldest()

    def _wait_one(self) -> bool:
        """Let some held bytes go: the oldest transfer's, or a read's (whose piece is then
        sent); False where nothing is in flight."""
        if self.sending:
            self._wait_oldest()
            return True
        return self.scheduler.finish_one()

    def _wait_oldest(self) -> None:
        import jax

        nbytes, arrays, _ = self.sending.popleft()
        jax.block_until_ready(arrays)
        self.held -= nbytes


class _Shard:
    """One region of a placed array on its devices: a buffer on each, written block by
    block (as unsigned integers for floats narrower than 32 bits), or the one block
    that covers it."""

    def __init__(
        self, key: str, region: Box, devices: Sequence[jax.Device], dtype: np.dtype[Any]
    ) -> None:
        self.key, self.region = key, region
        self.devices, self.dtype = list(devices), np.dtype(dtype)
        self.shape = _shape(region)
        self.written = on_device.written_dtype(self.dtype)
        self.copies = all(str(d.platform) not in ADOPTING_PLATFORMS for d in self.devices)
        """Whether the devices copy what is sent out of host memory, which can then be
        used again once the transfer is done."""
        self.buffers: list[jax.Array] | None = None
        self.whole = False
        self.preparing: list[concurrent.futures.Future[None]] = []

    def prepare(
        self, compilers: concurrent.futures.Executor, pieces: Collection[tuple[int, ...]]
    ) -> None:
        """Start compiling (or loading, `_programs`) the programs that make this shard's
        buffers and assemble it from pieces of the shapes `pieces` (others when they
        come). The buffers themselves are made by the first piece that is not the
        whole shard: a streamed shard may come whole, as one block."""
        self.preparing = [
            compilers.submit(on_device.empty_program, self.shape, self.device_dtype, device)
            for device in self.devices
        ]
        self.preparing += [
            compilers.submit(on_device.write_program, self.shape, piece, self.device_dtype, device)
            for piece in pieces
            for device in self.devices
        ]
        if self.written != self.dtype:
            self.preparing.append(compilers.submit(self._compile_finish))

    @property
    def device_dtype(self) -> np.dtype[Any]:
        """The dtype of the buffers on the devices (without jax's 64-bit types, 32 bits)."""
        import jax

        return np.dtype(jax.dtypes.canonicalize_dtype(self.written))

    def _compile_finish(self) -> None:
        changed = on_device.changed_patterns(self.devices[0], self.dtype)
        if changed:
            holds = on_device.holds_fn(changed)
            on_device.program_for(holds, self.shape, self.device_dtype, self.devices[0])
        bitcast = on_device.bitcast_fn(self.dtype)
        for device in self.devices:
            on_device.program_for(bitcast, self.shape, self.device_dtype, device)

    def write(self, index: tuple[slice, ...], values: np.ndarray) -> list[jax.Array]:
        """Send `values` (`index` of this region) to every device and write them in;
        the arrays sent, for the caller to wait on."""
        import jax

        if values.shape == self.shape:  # the whole region in one block
            self.buffers = [
                jax.device_put(values, device, may_alias=not self.copies) for device in self.devices
            ]
            self.whole = True
            return self.buffers
        sent = [
            jax.device_put(values.view(self.written), device, may_alias=not self.copies)
            for device in self.devices
        ]
        if self.buffers is None:
            self.buffers = [
                on_device.empty(self.shape, self.device_dtype, device) for device in self.devices
            ]
        starts = tuple(s.indices(n)[0] for s, n in zip(index, self.shape, strict=True))
        self.buffers = [
            on_device.write(buffer, piece, starts)
            for buffer, piece in zip(self.buffers, sent, strict=True)
        ]
        return sent

    def finished(self) -> list[jax.Array]:
        """The shard on each device, in its own dtype."""
        import jax

        for preparing in self.preparing:
            preparing.result()
        assert self.buffers is not None
        if self.whole or self.written == self.dtype:
            return self.buffers
        changed = on_device.changed_patterns(self.devices[0], self.dtype)
        if changed and on_device.holds_any(self.buffers[0], changed):
            size = human_bytes(math.prod(self.shape) * self.dtype.itemsize)
            kind = self.devices[0].device_kind
            warn(
                f"{self.key}: a shard of {size} went to {kind} whole from host memory, over "
                f"memory_budget: it holds {self.dtype} values that {kind} changes when it "
                "assembles a shard from pieces (NaN payloads or subnormals), and they must "
                "arrive bit for bit",
                OverBudgetWarning,
            )
            host = np.asarray(jax.device_get(self.buffers[0])).view(self.dtype)
            return [jax.device_put(host, device) for device in self.devices]
        return [on_device.bitcast(buffer, self.dtype) for buffer in self.buffers]


def _held_bytes(values: np.ndarray) -> int:
    """The host memory that keeping `values` keeps: all of the array it is a view of."""
    base: Any = values
    while isinstance(base.base, np.ndarray):
        base = base.base
    return int(base.nbytes)
