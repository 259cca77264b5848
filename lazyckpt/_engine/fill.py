"""The read engine: filling the destinations of `load` and `device_put`, chunk by chunk.

Each array is read into destinations (`Destination`: a region of the view and the
NumPy buffer that receives it) so that every stored chunk is decoded once per call,
however the destinations cut through the chunks, with the host memory of reads in flight
within a budget across the whole tree. Two ways:

- *decoded*: arrays whose chunks have a `Codec` and hold at least 1 MiB (Orbax's
  usual layouts: one chunk per device shard, or per NumPy array) are decoded by
  lazyckpt (`lazyckpt._engine.decode`): one job per chunk on the decoding threads, slab by
  slab, straight into the destination where the layouts match, else through one scratch
  slab whose pieces are copied to every destination that needs them. A job holds a few
  MiB whatever the chunk's size; reading stops after the last slab a destination needs.
- *tensorstore*: other arrays (small chunks, other codecs, values held in the legacy
  msgpack file) are read by tensorstore in blocks cut along the stored chunks:
  straight into the destination where it is a union of whole chunks, else each block
  once into a temporary, copied to every destination that overlaps it (reading per
  destination instead is what makes Orbax read a chunk several times:
  docs/benchmarks.md, section 8).

`lazyckpt._engine.stream` streams blocks through the same two paths.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import EllipsisType
from typing import TypeVar

import numpy as np

from lazyckpt._array import compose
from lazyckpt._array.geometry import (
    Box,
    BoxIndex,
    Index,
    Spans,
    as_slices,
    bounds,
    box_bytes,
    chunk_blocks,
    chunk_box,
    chunks_in,
    clip,
    covering_blocks,
    fitted,
    in_view,
    intersect,
    on_grid,
    piece,
    slabs,
    slices,
    split_dim,
    stored_map,
    to_stored,
)
from lazyckpt._array.selection import Selection
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.decode import READ_BYTES, ChunkStream, decodes, job_bytes
from lazyckpt._engine.lower import ByArray, lower
from lazyckpt._engine.memory import Destination, check_fits
from lazyckpt._engine.raw import schedule_raw
from lazyckpt._engine.scheduler import (
    HELD,
    Scheduler,
    in_pool,
    pool_size,
    stream_block,
)
from lazyckpt._engine.stored import StoredArray, check_plain, stored_array, ts_held
from lazyckpt._storage.futures import then
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.paths import is_remote
from lazyckpt._storage.per_process import PerProcess

_T = TypeVar("_T")


def stored_bytes(arrays: Iterable[ArrayView]) -> int:
    """The decoded size of LazyArrays' views in their stored dtype: what reading costs."""
    return sum(array.size * array.stored.dtype.itemsize for array in arrays)


def windows(budget: int) -> tuple[int, int]:
    """Bytes per kvstore read and per scratch slab of a decoding job, for `budget`."""
    read = min(READ_BYTES, max(256 << 10, budget // 64))
    return read, min(READ_BYTES, max(256 << 10, budget // 16))


def schedule_fill(
    array: ArrayView,
    destinations: Sequence[Destination],
    scheduler: Scheduler,
    on_done: Callable[[], None],
) -> None:
    """Read `array` (a ArrayView) into every destination's `out`; call `on_done` after."""
    check_plain(array)
    remaining = [0]
    called = [False]  # a composed view's parts may all finish before this returns

    def finished(_: object = None) -> None:
        remaining[0] -= 1
        if remaining[0] == 0 and not called[0]:
            called[0] = True
            on_done()

    for destination in destinations:
        destination.on_allocate = scheduler.guard.keep
        check_fits(f"reading {array.key!r} {destination.shape}", destination.out_nbytes())
    stored = array.stored
    mapping = stored_map(array)
    if isinstance(stored, compose.Node):
        _schedule_composed(array, destinations, scheduler, finished, remaining)
    elif decodes(stored):
        _schedule_decoded(array, destinations, scheduler, finished, remaining)
    elif mapping is None or stored_array(array).inline is not None:
        _schedule_whole(array, destinations, scheduler, finished, remaining)
    elif schedule_raw(array, mapping, destinations, scheduler, finished, remaining):
        pass  # raw bytes read straight into place
    else:
        _schedule_blocks(array, mapping, destinations, scheduler, finished, remaining)
    if remaining[0] == 0 and not called[0]:
        called[0] = True
        on_done()


def _schedule_composed(
    array: ArrayView,
    destinations: Sequence[Destination],
    scheduler: Scheduler,
    finished: Callable[[object], None],
    remaining: list[int],
) -> None:
    """Lower each destination into destinations of the stored arrays' views it is made of
    (`lazyckpt._engine.lower`), and read those, one call per stored array."""
    block = stream_block(scheduler.budget)
    if compose.computes(array) and any(d.out_nbytes() > block for d in destinations):
        for destination in destinations:
            _fill_in_blocks(array, destination, scheduler.budget)
        return
    _schedule_lowered(array, destinations, scheduler, finished, remaining)


def _schedule_lowered(
    array: ArrayView,
    destinations: Sequence[Destination],
    scheduler: Scheduler,
    finished: Callable[[object], None],
    remaining: list[int],
) -> None:
    by_array: ByArray = {}
    after: list[Callable[[], None]] = []
    for destination in destinations:
        lower(array, destination.region, destination.buffer(), by_array, after)
    left = [len(by_array)]
    remaining[0] += 1

    def part_done() -> None:
        left[0] -= 1
        if left[0] <= 0:
            for copy in after:
                copy()
            finished(None)

    if not by_array:
        part_done()
        return
    for part, part_destinations in list(by_array.values()):
        schedule_fill(part, part_destinations, scheduler, part_done)


def _fill_in_blocks(array: ArrayView, destination: Destination, budget: int) -> None:
    """Fill a destination of a computed view block by block, one block a core at a
    time, each read and computed before that core's next: else its parts'
    temporaries would span all of it."""
    block = stream_block(budget)
    itemsize = array.dtype.itemsize
    cells = fitted(compose.view_chunks(array), itemsize, block)
    out = destination.buffer()
    regions = iter(chunk_blocks(destination.region, cells, itemsize, block))
    lock = threading.Lock()

    def fill() -> None:
        while True:
            with lock:
                region = next(regions, None)
            if region is None:
                return
            view = out[slices(region, destination.region)]
            scheduler = Scheduler(budget)
            _schedule_lowered(
                array, [Destination(region, array.dtype, out=view)], scheduler, lambda _: None, [0]
            )
            scheduler.drain()

    for done in [_block_workers().submit(fill) for _ in range(pool_size())]:
        done.result()


_WORKERS = PerProcess(
    lambda: concurrent.futures.ThreadPoolExecutor(pool_size(), thread_name_prefix="lazyckpt-blocks")
)
"""The threads that fill a computed view's blocks (the same ones each time, so that
their allocator arenas are reused): not the decoding threads, whose jobs they wait
for. Made again in a forked child, which has none of their threads."""


def _block_workers() -> concurrent.futures.ThreadPoolExecutor:
    return _WORKERS.get()


# The decoded path.


Consumer = tuple[Destination, Selection]


def _schedule_decoded(
    array: ArrayView,
    destinations: Sequence[Destination],
    scheduler: Scheduler,
    finished: Callable[[object], None],
    remaining: list[int],
) -> None:
    """One decoding job per stored chunk that some destination needs."""
    stored = stored_array(array)
    consumers = [
        (t, array.selection[as_slices(t.region)]) for t in destinations if 0 not in t.shape
    ]
    if not consumers:
        return
    read_bytes, window = windows(scheduler.budget)
    held = job_bytes(read_bytes, window)
    remote = is_remote(stored.store.location)  # (jobs as many as the budget holds)
    # The chunks each consumer's box touches: a chunk's users are found among those
    # that touch it, not among all (thousands of picked rows: `x[rows]`).
    touching: dict[tuple[int, ...], list[int]] = {}
    for k, (_, selection) in enumerate(consumers):
        for index in chunks_in(bounds(selection), stored.chunks):
            touching.setdefault(index, []).append(k)
    for index in sorted(touching):
        inside = clip(chunk_box(index, stored.chunks), stored.shape)
        users = [
            consumers[k] for k in touching[index] if piece(consumers[k][1], inside) is not None
        ]
        if not users:
            continue
        remaining[0] += 1
        work = box_bytes(inside, stored.dtype.itemsize)

        def start(index: tuple[int, ...] = index, users: list[Consumer] = users) -> ts.Future[None]:
            job = functools.partial(decode_into, array, index, users, read_bytes, window)
            return in_pool(job, waits=remote)

        scheduler.submit(start, finished, held=held, work=work)


def decode_into(
    array: ArrayView,
    index: tuple[int, ...],
    users: Sequence[Consumer],
    read_bytes: int,
    window: int,
) -> None:
    """Decode stored chunk `index` of `array` slab by slab into every user's buffer,
    stopping after the last slab one needs."""
    for _ in decode_slabs(array, index, users, read_bytes, window):
        pass


def decode_slabs(
    array: ArrayView,
    index: tuple[int, ...],
    users: Sequence[Consumer],
    read_bytes: int,
    window: int,
    stream: ChunkStream | None = None,
) -> Iterator[list[Destination]]:
    """`decode_into`, one slab at a time: after each slab, the destinations it completed.
    `stream`, where given, is the chunk's stream opened already (`ChunkStream.check`),
    decoded from its start and closed here.

    Slabs are planned as the stream goes, and each is matched only against the users
    whose extent along the split dimension it meets, so the work is linear in the
    slabs decoded and the users, whatever a (damaged) header declares."""
    stored = stored_array(array)
    codec = stored.codec
    assert codec is not None, "only arrays that lazyckpt decodes come here"
    itemsize = stored.dtype.itemsize
    box = chunk_box(index, stored.chunks)
    order = codec.order
    extents = [bounds(selection) for _, selection in users]
    split = split_dim(box, order, itemsize, window) if stored.shape else 0
    cuts: set[int] = {stored.shape[split]} if stored.shape else set()
    for extent in extents:  # slabs are also cut where destinations and the array end
        cuts.update(extent[split] if extent else ())
    # The last element any user needs, in stream order: decoding stops after it.
    last = max(tuple(extent[d][1] - 1 for d in order) for extent in extents)
    find = Spans([extent[split] if extent else (0, 1) for extent in extents])
    direct_ok = (
        order == tuple(range(len(stored.shape)))
        and codec.byteorder in ("|", "<" if np.little_endian else ">")
        and array.dtype == stored.dtype
    )
    left = {id(t): math.prod(s.shape) for t, s in users}
    if stream is None:
        stream = ChunkStream(stored, index, read_bytes)
    whole = True  # whether every slab of the chunk was decoded
    try:
        for slab in slabs(box, order, itemsize, window, sorted(cuts)):
            if tuple(slab[d][0] for d in order) > last:
                whole = False
                break
            inside = intersect(slab, clip(slab, stored.shape)) if slab else ()
            parts = []
            if inside is not None:
                span = slab[split] if slab else (0, 1)
                for i in find(span):
                    found = piece(users[i][1], inside)
                    if found is not None:
                        parts.append((users[i][0], found))
            into = _direct(slab, inside, parts) if direct_ok else None
            values = stream.next(slab, into)
            completed = []
            for destination, (in_slab, in_view_index) in parts:
                out = destination.buffer()[(*in_view_index, Ellipsis)]  # a view, even for 0-d
                if into is None:
                    assert values is not None and inside is not None
                    piece_values = values[slices(inside, slab)][in_slab]
                    np.copyto(out, piece_values.reshape(out.shape), casting="unsafe")
                left[id(destination)] -= out.size
                if not left[id(destination)]:
                    completed.append(destination)
            yield completed
        if whole:
            stream.finish()
    finally:
        stream.close()


def _direct(
    slab: Box, inside: Box | None, parts: list[tuple[Destination, tuple[Index, Index]]]
) -> memoryview | None:
    """The memory to decode `slab` straight into: one destination's buffer region that holds
    exactly the slab's elements, contiguous and in the same order; else None."""
    if len(parts) != 1 or inside != slab:
        return None
    destination, (in_slab, in_view_index) = parts[0]
    if any(isinstance(s, slice) and s.step not in (None, 1) for s in in_slab):
        return None
    region = destination.buffer()[(*in_view_index, Ellipsis)]
    if region.size != math.prod(high - low for low, high in slab) or not region.flags.c_contiguous:
        return None
    return region.reshape(-1).view(np.uint8).data


# The tensorstore path.


def _schedule_whole(
    array: ArrayView,
    destinations: Sequence[Destination],
    scheduler: Scheduler,
    finished: Callable[[object], None],
    remaining: list[int],
) -> None:
    """Strided or in-memory views: one read per destination, cast into it."""
    for destination in destinations:
        view = array[tuple(slice(low, high) for low, high in destination.region)]
        remaining[0] += 1

        def copy(data: np.ndarray, destination: Destination = destination) -> None:
            np.copyto(destination.buffer(), np.asarray(data), casting="unsafe")
            finished(None)

        scheduler.submit(view.read, copy, held=view.nbytes * HELD, work=view.nbytes)


def _schedule_blocks(
    array: ArrayView,
    mapping: Sequence[tuple[int, int] | None],
    destinations: Sequence[Destination],
    scheduler: Scheduler,
    finished: Callable[[object], None],
    remaining: list[int],
) -> None:
    stored = stored_array(array)
    itemsize = stored.dtype.itemsize
    array_box = tuple((0, n) for n in stored.shape)
    boxes = [to_stored(array, mapping, t.region) for t in destinations]
    plain = all(entry is not None for entry in mapping) and len(mapping) == len(stored.shape)
    direct = (
        plain
        and array.dtype == stored.dtype
        and all(on_grid(box, array_box, stored.chunks) for box in boxes)
    )
    opened = stored.open()
    if direct:
        for destination, box in zip(destinations, boxes, strict=True):
            blocks = list(chunk_blocks(box, stored.chunks, itemsize, scheduler.block_bytes))
            if len(blocks) == 1 and not destination.aligned and destination.out is None:
                # One read covers the destination: keep the array tensorstore returns.
                remaining[0] += 1

                def adopt(data: np.ndarray, destination: Destination = destination) -> None:
                    destination.out = data.reshape(destination.shape)
                    scheduler.guard.keep(data.nbytes)
                    finished(None)

                nbytes = destination.out_nbytes()
                start = read_box(stored, opened, blocks[0])
                scheduler.submit(start, adopt, held=ts_held(stored, blocks[0]), work=nbytes)
                continue
            for block in blocks:
                remaining[0] += 1
                nbytes = box_bytes(block, itemsize)
                write = _direct_read(stored, opened, destination, block, box)
                scheduler.submit(write, finished, held=ts_held(stored, block), work=nbytes)
        return
    near = BoxIndex(boxes)
    cover = covering_blocks(boxes, stored.chunks, stored.shape, itemsize, scheduler.block_bytes)
    for block in cover:
        consumers = [
            (destinations[i], boxes[i], part)
            for i in near.touching(block)
            if (part := intersect(block, boxes[i])) is not None
        ]

        if not consumers:
            continue
        remaining[0] += 1
        nbytes = box_bytes(block, itemsize)

        def route(
            data: np.ndarray,
            block: Box = block,
            consumers: list[tuple[Destination, Box, Box]] = consumers,
        ) -> None:
            for destination, box, part in consumers:
                values = data[slices(part, block)]
                out_index, view_shape = in_view(mapping, part, [b[0] for b in box])
                # Ellipsis: a view, even for 0-d.
                at: tuple[slice | EllipsisType, ...] = (*out_index, Ellipsis)
                out = destination.buffer()[at]
                np.copyto(out, values.reshape(view_shape), casting="unsafe")
            finished(None)

        start = read_box(stored, opened, block)
        scheduler.submit(start, route, held=ts_held(stored, block), work=nbytes)


def _direct_read(
    stored: StoredArray,
    opened: ts.Future[ts.TensorStore],
    destination: Destination,
    block: Box,
    box: Box,
) -> Callable[[], ts.Future[None]]:
    def start() -> ts.Future[None]:
        out = destination.buffer()

        def write(source: ts.TensorStore) -> ts.Future[None]:
            dest = ts.array(out, copy=False, write=True)[slices(block, box)].translate_to[0]
            return dest.write(source[tuple(slice(*r) for r in block)].translate_to[0]).commit

        written: ts.Future[None] = then(opened, write)
        return then(written, _same, stored.read_error)

    return start


def read_box(
    stored: StoredArray, opened: ts.Future[ts.TensorStore], block: Box
) -> Callable[[], ts.Future[np.ndarray]]:
    def start() -> ts.Future[np.ndarray]:
        region = tuple(slice(*r) for r in block)
        read = then(opened, lambda source: stored.read_region(source, region))
        return then(read, _same, stored.read_error)

    return start


def _same(value: _T) -> _T:
    return value
