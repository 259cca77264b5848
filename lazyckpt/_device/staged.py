"""Placing arrays on accelerators in pieces, with the host's share bounded by the budget.

On CPU devices a filled host buffer becomes the shard itself (`route`), so the
results are memory the read is meant to leave behind. A TPU or GPU shard is only
staged on the host: filled whole, a shard of 2 GiB would need 2 GiB of host memory
whatever the budget, and many in flight more. Here an array's shards are filled
together where they fit half the budget (each stored chunk read once for all), and
otherwise in pieces: bands read raw where the bytes lie raw in a file, or blocks
streamed from the stored chunks (`_engine.stream.read_blocks`, each chunk read once
for all shards). Every piece is sent to its devices as it comes and written into the
shard's buffer there by a jitted `dynamic_update_slice` that donates the buffer, so it
is updated in place: no second copy of the shard in device memory, and on the host
only the pieces being read and those being sent. Half the budget reads, half carries
pieces whose transfers have not finished (`_Gate`): a piece is let go once its copy on
the device is ready, and its host buffer is filled again by a later piece, since
faulting in fresh pages costs more than the copy. A shard that one piece holds whole
is sent as that piece, with no buffer to write into. Large pieces whose bytes lie raw
in a local file are each sent and waited for by one of a few threads, so that what
the runtime does on the host for each transfer runs on several at once: sent from a
map of the file where a piece is one run of its bytes, else read in parts by several
threads at once (`lazyckpt._device.senders`).
A shard on its devices, the programs that make, write and finish it there, and how
its values arrive bit for bit, are in `lazyckpt._device.shard`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import numpy as np

from lazyckpt._array import compose
from lazyckpt._array.geometry import Box, as_slices, box_bytes, box_shape, slices
from lazyckpt._device.platforms import any_staged
from lazyckpt._device.senders import Senders, direct_reads
from lazyckpt._device.shard import Shard, Starts, release_sent
from lazyckpt._engine.decode import decodes
from lazyckpt._engine.fill import schedule_fill
from lazyckpt._engine.memory import BufferPool, Destination, held_bytes
from lazyckpt._engine.progress import Progress
from lazyckpt._engine.raw import lies_raw
from lazyckpt._engine.scheduler import MIN_BLOCK, Scheduler, stream_block
from lazyckpt._engine.stream import read_blocks
from lazyckpt._lazy import LazyArray

if TYPE_CHECKING:
    import jax
    from jax.sharding import Sharding

Regions: TypeAlias = "dict[Box, list[jax.Device]]"
"""The distinct regions of an array that this process's devices hold, each with the
devices that hold it (replicas share one read)."""

SentRegions: TypeAlias = "list[list[jax.Array]]"
"""One array's regions on their devices, in the order of its regions: a buffer on each
device that holds the region."""


class Fill(enum.Enum):
    """How an array's shards are filled on the host (`_plan`)."""

    TOGETHER = "every region in one read, each sent whole"
    PIECES = "each region in pieces that read only their own raw bytes"
    STREAMED = "the regions streamed together from the stored chunks"


@attrs.frozen
class ShardsPlan:
    """One array's shards and how they are filled: `pieces` holds, for each shard, the
    boxes it is filled in (empty lists where the regions are streamed)."""

    array: LazyArray
    shards: list[Shard]
    fill: Fill
    pieces: list[list[Box]]


@attrs.frozen
class Staged:
    """An array bound for accelerators, and the regions of it this process holds."""

    array: LazyArray
    sharding: Sharding
    regions: Regions


def staged(sharding: Sharding) -> bool:
    """Whether arrays placed with `sharding` are sent in pieces: some device of this
    process that it places on is an accelerator's (`platforms.PLATFORMS`)."""
    return any_staged(sharding.addressable_devices)


def put_staged(
    placements: Sequence[Staged], budget: int, progress: Progress | None
) -> list[jax.Array]:
    """Each array placed on its devices within `budget` host bytes (`send_shards`)."""
    import jax

    sent = send_shards([(p.array, p.regions) for p in placements], budget, progress)
    placed: list[jax.Array] = [
        jax.make_array_from_single_device_arrays(
            p.array.shape, p.sharding, [buffer for buffers in done for buffer in buffers]
        )
        for p, done in zip(placements, sent, strict=True)
    ]
    jax.block_until_ready(placed)
    return placed


def send_shards(
    placements: Sequence[tuple[LazyArray, Regions]],
    budget: int,
    progress: Progress | None,
    *,
    raw: bool = False,
) -> list[SentRegions]:
    """For each `(array, regions)`, each region of `array` on its devices (a buffer per
    device, in the order of `regions`), within `budget` host bytes; as written on the
    devices (unsigned integers for narrow floats) where `raw` (`Shard.raw`).

    Half the budget is for reads in flight, half for filled pieces until their
    transfers are done. An array whose regions hold at most half the budget together
    is one fill of them all, by the engine as any read is (raw bytes straight into
    place, chunks decoded on every core, each once for all regions), each region sent
    whole. Otherwise, where its bytes lie raw in a file, each region is filled in
    pieces that read only their own bytes; elsewhere its regions are streamed
    together (`read_blocks`: each stored chunk decoded once, in slabs where it is
    larger than a block). Large pieces whose bytes lie raw in a local file go first, each
    sent and waited for by one of a few threads of their own, its parts read by several
    at once (`lazyckpt._device.senders`); the engine's fills, then the streams, follow.
    """
    half = max(1, budget // 2)
    scheduler = Scheduler(half, progress)
    starts = Starts()
    planned = [_plan(array, regions, half, raw, starts) for array, regions in placements]
    gate = _Gate(half, scheduler, BufferPool(half, release=release_sent))
    streamed = [
        (plan.array[as_slices(shard.region)], shard)
        for plan in planned
        if plan.fill is Fill.STREAMED
        for shard in plan.shards
    ]
    with concurrent.futures.ThreadPoolExecutor(COMPILERS) as compilers:
        try:
            for plan in planned:  # (assembling compiled while the reads run)
                for shard, cut in zip(plan.shards, plan.pieces, strict=True):
                    if plan.fill is Fill.STREAMED or len(cut) > 1:
                        shard.prepare(compilers, {box_shape(piece) for piece in cut})
            fills = [
                (plan.array, fill)
                for plan in planned
                if plan.fill is not Fill.STREAMED
                for fill in _fills(plan)
            ]
            direct, rest = [], []
            for array, fill in fills:
                reads = direct_reads(array, fill)
                direct += reads
                if not reads:
                    rest.append((array, fill))
            if direct:
                Senders(half, gate.pool, progress).run(direct)
            for array, fill in rest:
                _fill(array, fill, gate, scheduler)
            scheduler.drain()
            if streamed:
                # Its jobs' blocks (the other half) come from the pool too.
                gate.pool.limit = budget
                blocks = read_blocks(
                    [v for v, _ in streamed],
                    half,
                    progress,
                    pool=gate.pool,
                    in_order=False,
                    block=max(MIN_BLOCK, half // _STREAM_BLOCKS),
                )
                for position, index, values in blocks:
                    held = held_bytes(values)
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
        return [[shard.finished() for shard in plan.shards] for plan in planned]


_STREAM_BLOCKS = 16
"""Blocks of a stream that the reads' half of the budget holds: twice the engine's
(`stream_block`), so that more chunks decode at once (each job holds its stream and
a block). Measured: docs/benchmarks.md, section 29."""

COMPILERS = 4
"""Threads making shards' buffers and compiling their assembly while the reads run
(compiling for a TPU takes about half a second a program)."""


def _plan(
    array: LazyArray,
    regions: Regions,
    half: int,
    raw: bool,
    starts: Starts,
) -> ShardsPlan:
    """`array`'s shards and how they are filled: together, each region whole, where
    all fit `half`; in pieces where the bytes lie raw in a file; else streamed. Every
    shard of a placement takes its pieces' starts on the devices from `starts`."""
    shards = [
        Shard(array.key, region, devices, array.dtype, raw=raw, starts=starts)
        for region, devices in regions.items()
    ]
    itemsize = array.dtype.itemsize
    large = _large_chunks(array, half)  # (chunks lazyckpt decodes: their bytes never lie raw)
    if not large and sum(box_bytes(shard.region, itemsize) for shard in shards) <= half:
        return ShardsPlan(array, shards, Fill.TOGETHER, [[shard.region] for shard in shards])
    if not large and lies_raw(array):
        pieces = [_pieces(shard.region, itemsize, half) for shard in shards]
        return ShardsPlan(array, shards, Fill.PIECES, pieces)
    return ShardsPlan(array, shards, Fill.STREAMED, [[] for _ in shards])


def _large_chunks(array: LazyArray, half: int) -> bool:
    """Whether lazyckpt decodes `array`'s stored chunks and each is larger than the
    engine's block within `half` (an eighth of it; streamed here in blocks of half
    that): filled whole, such a chunk would be decoded by one thread while holding
    all of its memory, so that few decode at once; streamed, each holds a block or
    two, and many decode together."""
    if isinstance(array.stored, compose.Node) or not decodes(array.stored):
        return False
    stored = array.stored
    return math.prod(stored.chunks) * stored.dtype.itemsize > stream_block(half)


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


def _fills(plan: ShardsPlan) -> list[list[tuple[Shard, Box]]]:
    """The fills of an array's shards: each one read, of one piece or of every region."""
    if plan.fill is Fill.TOGETHER:
        return [[(shard, shard.region) for shard in plan.shards]]
    return [
        [(shard, piece)]
        for shard, cut in zip(plan.shards, plan.pieces, strict=True)
        for piece in cut
    ]


def _fill(
    array: LazyArray,
    pieces: Sequence[tuple[Shard, Box]],
    gate: _Gate,
    scheduler: Scheduler,
) -> None:
    """Fill each `(shard, piece)` of `array` in one read once the gate lets their bytes
    in (each stored chunk read once for all), then send each to its shard's devices."""
    dtype = array.dtype
    destinations, held = [], []
    for shard, piece in pieces:
        if shard.copies:
            out, nbytes = gate.take(box_shape(piece), dtype)
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
    let go of them: fresh pages cost far more than the copy into them
    (docs/benchmarks.md, section 29).
    """

    def __init__(self, limit: int, scheduler: Scheduler, pool: BufferPool) -> None:
        self.limit, self.scheduler, self.pool = limit, scheduler, pool
        self.held = 0
        self.sending: collections.deque[tuple[int, list[jax.Array], np.ndarray]]
        self.sending = collections.deque()

    def reserve(self, nbytes: int) -> None:
        """Wait until `nbytes` more may be held, then hold them."""
        self._let_go_done()
        while self.held and self.held + nbytes > self.limit and self._wait_one():
            pass
        self.held += nbytes

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[np.ndarray, int]:
        """An array from the pool, and the bytes held for it (its buffer's, which may
        be a little larger) until its piece is `sent` and transferred."""
        nbytes = math.prod(shape) * dtype.itemsize
        self.reserve(nbytes)
        values = self.pool.empty(shape, dtype)
        held = held_bytes(values)
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

    def _let_go_done(self) -> None:
        """Let go of the oldest pieces while their transfers are done, without waiting:
        their memory may then be filled again by the next piece, not only once the
        gate is full (kept until then, the pool made as many buffers again as the gate
        may hold)."""
        while self.sending and all(_done(array) for array in self.sending[0][1]):
            self.held -= self.sending.popleft()[0]


def _done(array: jax.Array) -> bool:
    """Whether `array`'s transfer is done, asked without waiting (`is_ready`, which
    jax's arrays have but its `Array` type does not declare; False where absent)."""
    is_ready = getattr(array, "is_ready", None)
    return bool(is_ready()) if is_ready is not None else False
