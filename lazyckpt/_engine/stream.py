"""Streaming blocks of lazy arrays within a budget: `read_blocks` for `stats`, `diff`,
`save` and `lazyckpt.iter_blocks`.

Blocks are whole stored chunks grouped up to a block's share of the budget (an
eighth), or, for chunks larger than that, slabs of the chunk cut along its leading
stored dimension, which one job decodes in order and hands over as each is complete
(`lazyckpt._engine.fill.decode_slabs`); arrays lazyckpt does not decode itself are read by
tensorstore block by block. Given a grid (a new checkpoint's chunks), every block is a
union of whole cells of it; where such a slab is larger than a block (cells that span
the chunk along its stream), it is held and handed over in blocks of whole cells.
Jobs run ahead of the consumer, each holding its stream and one block (or slab),
within the budget.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import queue
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import tensorstore as ts

from lazyckpt._array import compose
from lazyckpt._array.geometry import (
    Box,
    as_slices,
    bounds,
    box_bytes,
    chunk_blocks,
    chunk_box,
    chunks_in,
    fitted,
    in_view,
    intersect,
    pieces,
    slabs,
    slices,
    stored_map,
    to_stored,
    view_origins,
)
from lazyckpt._array.selection import Selection
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.bands import (
    band_bytes,
    band_split,
    slabs_in_view,
    stored_cells,
    strided_bands,
    view_bands,
    view_region,
    widened,
)
from lazyckpt._engine.decode import ChunkStream, decodes, job_bytes
from lazyckpt._engine.fill import decode_into, decode_slabs, schedule_fill, windows
from lazyckpt._engine.jobs import END, SKIP, Block, Job, picked, ts_jobs, ts_step
from lazyckpt._engine.memory import BufferPool, Destination
from lazyckpt._engine.progress import Progress
from lazyckpt._engine.scheduler import HELD, Scheduler, in_pool
from lazyckpt._engine.share import by_position, sharings
from lazyckpt._engine.stored import check_plain, stored_array, stores, ts_held
from lazyckpt._storage.futures import ready
from lazyckpt._storage.kvstore import check_unchanged
from lazyckpt._storage.paths import is_remote


def read_blocks(
    arrays: Sequence[ArrayView],
    budget: int | None,
    progress: Progress | None = None,
    grids: Sequence[tuple[int, ...] | None] | None = None,
    *,
    share: bool = True,
    pool: BufferPool | None = None,
    in_order: bool = True,
    block: int | None = None,
) -> Iterator[tuple[int, tuple[slice, ...], np.ndarray]]:
    """`(position, index, values)` for consecutive blocks of each ArrayView in `arrays`,
    where `arrays[position][index]` equals `values`.

    `grids[position]`, where given, is a chunk grid of the view (a new checkpoint's
    chunks) that every block must be a union of whole cells of. Reads run ahead of the
    consumer: every job in flight holds at most its stream and one block, and the one
    the consumer holds counts too, within `budget` bytes (one job at least).

    With `share`, views of one stored array that cover it together (`unstack`) are
    streamed as one (`lazyckpt._engine.share`), so that each stored chunk is read once;
    their blocks then come in the stored array's order.

    Blocks are filled into buffers of `pool` (by default one that keeps at most a
    block free), reused once the consumer and everything else have let go of them.

    `block` is the most bytes of a block (by default an eighth of the budget).

    Without `in_order`, blocks come as they are ready, each job going on as soon as
    its block is handed over: every job in flight decodes at once (in order, those
    behind the first wait with one block ready), as placing arrays on accelerators
    wants, where any order will do.
    """
    limits = Scheduler(budget)
    # Streams promise their peak within the budget and a little: trim freed buffers
    # sooner than a load does (whose results are most of what it holds anyway).
    limits.guard.slack = limits.budget // 16
    if block is not None:
        limits.stream_block = max(1, min(block, limits.budget))
    block = limits.stream_block
    # (free: at most the block the consumer is counted for, which it has let go)
    buffers = pool if pool is not None else BufferPool(limits.budget, keep=block)
    limits.pool = buffers
    cells = list(grids) if grids is not None else [None] * len(arrays)
    for array in arrays:
        check_plain(array)
    # Composed views streamed as their parts, so that parts can share with others.
    leaves = [
        leaf
        for position, (array, grid) in enumerate(zip(arrays, cells, strict=True))
        for leaf in _leaves(position, array, grid, None, block)
    ]
    found = [leaf.array for leaf in leaves], [leaf.grid for leaf in leaves]
    owner = by_position(sharings(*found, block)) if share else {}

    def every_job() -> Iterator[Job]:
        for i, leaf in enumerate(leaves):
            sharing = owner.get(i)
            if sharing is None:
                for job in _jobs(leaf.position, leaf.array, limits, leaf.grid):
                    yield job if leaf.place is None else job.placed(leaf.place)
            elif sharing.positions[0] == i:
                for job in _jobs(i, sharing.base, limits, sharing.grid):
                    yield Job(i, job.held, job.steps(), sharing)

    jobs = every_job()
    steps: _Steps = _InOrder() if in_order else _AsReady()
    reserved = block  # the block the consumer holds
    upcoming = next(jobs, None)

    def start_more() -> None:
        nonlocal reserved, upcoming
        while upcoming is not None and (not steps or reserved + upcoming.held <= limits.budget):
            reserved += upcoming.held
            steps.start(upcoming)
            upcoming = next(jobs, None)

    start_more()
    while steps:
        job, result = steps.next()
        if result is END:
            steps.end(job)
            reserved -= job.held
            start_more()
            continue
        if result is SKIP:
            steps.go_on(job)
            continue
        assert isinstance(result, (tuple, list))  # a block, or a placed block's pieces
        blocks = result if isinstance(result, list) else [result]
        steps.go_on(job)  # decode the next block while this one is used
        yield from _handed(job, blocks, leaves, progress)
        del blocks, result
        buffers.settle()
        limits.guard.check(max(reserved, buffers.held))
    check_unchanged(stores(arrays))


class _InOrder:
    """The jobs in flight, their blocks taken in the order the jobs started: the first
    job's, to its end, then the next one's."""

    def __init__(self) -> None:
        self.active: collections.deque[tuple[Job, ts.Future[object]]] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self.active)

    def start(self, job: Job) -> None:
        self.active.append((job, job.step()))

    def next(self) -> tuple[Job, object]:
        job, pending = self.active[0]
        return job, pending.result()

    def go_on(self, job: Job) -> None:
        self.active[0] = (job, job.step())

    def end(self, job: Job) -> None:
        self.active.popleft()


class _AsReady:
    """The jobs in flight, their blocks taken as they are ready, whichever job's."""

    def __init__(self) -> None:
        self.ready: queue.SimpleQueue[tuple[Job, ts.Future[object]]] = queue.SimpleQueue()
        self.running = 0

    def __bool__(self) -> bool:
        return self.running > 0

    def start(self, job: Job) -> None:
        self.running += 1
        self.go_on(job)

    def next(self) -> tuple[Job, object]:
        job, done = self.ready.get()
        return job, done.result()

    def go_on(self, job: Job) -> None:
        job.step().add_done_callback(lambda done: self.ready.put((job, done)))

    def end(self, job: Job) -> None:
        self.running -= 1


_Steps = _InOrder | _AsReady


def _handed(
    job: Job, blocks: list[Block], leaves: Sequence[_Leaf], progress: Progress | None
) -> Iterator[tuple[int, tuple[slice, ...], np.ndarray]]:
    """`read_blocks`' answers for one step's blocks (in a frame of their own, which
    keeps no reference to them once they are handed over: a piece of a band would
    keep all of the band)."""
    for index, values, work in blocks:
        if job.sharing is None:
            yield job.position, index, values
        else:
            for i, piece_index, piece in job.sharing.route(index, values):
                leaf = leaves[i]
                moved = (
                    [(piece_index, piece)] if leaf.place is None else leaf.place(piece_index, piece)
                )
                for moved_index, moved_values in moved:
                    yield leaf.position, moved_index, moved_values
        if progress is not None:
            progress.advance(work)


def _jobs(
    position: int, array: ArrayView, limits: Scheduler, grid: tuple[int, ...] | None
) -> Iterator[Job]:
    """The jobs that stream one view, in order."""
    stored = array.stored
    if isinstance(stored, compose.Node):
        yield from _composed_jobs(position, array, limits, grid)
        return
    stored = stored_array(array)
    mapping = stored_map(array)
    budget = limits.budget
    block = limits.stream_block
    itemsize = stored.dtype.itemsize
    whole = tuple((0, n) for n in array.shape)
    if 0 in array.shape:
        index = as_slices(whole)
        yield Job(position, array.nbytes * HELD, iter([ts_step(array, index, array.nbytes)]))
        return
    if mapping is None and not decodes(stored):
        # Strided, read by tensorstore: bands of the view (whole cells of `grid`), each
        # holding the stored box around it while it is read, so cut as much smaller
        # than a block as that box is larger than the view (`w[:, ::64]`: 64 times).
        around = box_bytes(bounds(array.selection), itemsize)
        elements = block // itemsize * max(1, array.nbytes) // max(1, around)
        for region in view_bands(array, max(1, elements), grid):
            index = as_slices(region)
            band = array[index]
            held = ts_held(stored, bounds(band.selection))
            yield Job(position, held, iter([ts_step(array, index, band.nbytes)]))
        return
    if not decodes(stored):
        assert mapping is not None
        if grid is None:
            yield from ts_jobs(position, array, mapping, limits)
            return
        cells = widened(array, grid, itemsize, block)
        for part in chunk_blocks(whole, cells, itemsize, block):
            index = as_slices(part)
            held = box_bytes(part, itemsize) * HELD
            yield Job(position, held, iter([ts_step(array, index, box_bytes(part, itemsize))]))
        return
    read_bytes, window = windows(budget)
    window = min(window, block)
    pool = limits.pool
    held = job_bytes(read_bytes, window) + block
    if mapping is None and grid is None:
        # Strided: the box around the view, streamed as a unit-stride view (each stored
        # chunk decoded once), each of its blocks cut down to the view's elements.
        box = bounds(array.selection)
        base = array._rebased(Selection.full(stored.shape)[as_slices(box)])
        for inner in _jobs(position, base, limits, None):
            yield picked(inner, array.selection, box)
        return
    if mapping is None:  # strided, in whole cells of `grid`
        assert grid is not None
        found = strided_bands(array, grid, block)
        if found is not None:  # inside one stored chunk: decoded once, band by band
            chunk, cut_bands, nbytes = found
            steps = _chunk_bands(
                array, chunk, lambda: cut_bands, read_bytes, window, grid, block, pool
            )
            yield Job(position, held - block + max(block, nbytes), steps)
            return
        for region in view_bands(array, block // itemsize, grid):  # each decoded on its own
            yield Job(
                position, held, iter([_decoded_block(array, region, read_bytes, window, pool)])
            )
        return
    origins = view_origins(mapping, len(stored.shape))
    box = to_stored(array, mapping, whole)
    units = stored_cells(array, mapping, grid)
    if math.prod(stored.chunks) * itemsize <= block or units is None:
        blocks: Iterable[Box] = (
            (
                view_region(in_view(mapping, part, origins)[0], array.shape)
                for part in chunk_blocks(box, stored.chunks, itemsize, block)
            )
            if grid is None
            else chunk_blocks(whole, widened(array, grid, itemsize, block), itemsize, block)
        )
        for region in blocks:
            # A cell of `grid` may be larger than a block: counted as it is.
            nbytes = box_bytes(region, itemsize)
            steps = iter([_decoded_block(array, region, read_bytes, window, pool)])
            yield Job(position, held - block + max(block, nbytes), steps)
        return
    assert stored.codec is not None, "only arrays that lazyckpt decodes come here"
    order = stored.codec.order
    for chunk in chunks_in(box, stored.chunks):
        overlap = intersect(chunk_box(chunk, stored.chunks), box)
        assert overlap is not None
        split = band_split(overlap, order, units, itemsize, block)
        unit = units[split]
        cut = functools.partial(slabs, overlap, order, itemsize, block, unit=unit, split_at=split)
        bands = functools.partial(slabs_in_view, array, cut)
        nbytes = band_bytes(overlap, order, split, unit, itemsize, block)
        steps = _chunk_bands(array, chunk, bands, read_bytes, window, grid, block, pool)
        yield Job(position, held - block + max(block, nbytes), steps)


@attrs.frozen
class _Leaf:
    """A view to stream, and how its blocks become blocks of the array asked for."""

    position: int
    array: ArrayView
    grid: tuple[int, ...] | None
    place: compose.Place | None


def _leaves(
    position: int,
    array: ArrayView,
    grid: tuple[int, ...] | None,
    place: compose.Place | None,
    block: int,
) -> Iterator[_Leaf]:
    """`array`, or the parts of a composed view that can be streamed apart (in blocks
    of `block` bytes)."""
    node = array.stored
    parts = (
        node.stream_parts(grid, block)
        if isinstance(node, compose.Node) and array.selection.is_full(node.shape)
        else None
    )
    if parts is None:
        yield _Leaf(position, array, grid, place)
        return
    for part, part_grid, part_place in parts:
        moved = _then(part_place, part.shape, array.dtype, place)
        yield from _leaves(position, part, part_grid, moved, block)


def _then(
    inner: compose.Place,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    outer: compose.Place | None,
) -> compose.Place:
    """Blocks of a part (of `shape`) moved by `inner`, cast, then moved by `outer`."""

    def place(
        index: tuple[slice, ...], values: np.ndarray
    ) -> list[tuple[tuple[slice, ...], np.ndarray]]:
        # Explicit bounds: a new axis comes as slice(None), which moving cannot shift.
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
        moved = inner(index, values.astype(dtype, copy=False))
        if outer is None:
            return moved
        return [piece for at, part in moved for piece in outer(at, part)]

    return place


def _composed_jobs(
    position: int, array: ArrayView, limits: Scheduler, grid: tuple[int, ...] | None
) -> Iterator[Job]:
    """Blocks of a composed view that cannot be streamed as its parts (a reshape, a
    grid that cuts across parts), each filled from its parts through the engine."""
    block = limits.stream_block
    itemsize = array.dtype.itemsize
    cells = grid if grid is not None else fitted(compose.view_chunks(array), itemsize, block)
    for region in chunk_blocks(tuple((0, n) for n in array.shape), cells, itemsize, block):
        yield Job(position, block * 3, iter([_filled(array, region, block, limits.pool)]))


def _filled(
    array: ArrayView, region: Box, budget: int, pool: BufferPool | None
) -> Callable[[], ts.Future[Block]]:
    """A step that fills `array[region]` through the engine, within `budget`, on the
    consumer's thread (the engine's own jobs run on the decoding threads)."""

    def fill() -> ts.Future[Block]:
        scheduler = Scheduler(budget)
        destination = Destination(region, array.dtype, pool=pool)
        schedule_fill(array, [destination], scheduler, lambda: None)
        scheduler.drain()
        return ready((as_slices(region), destination.buffer(), destination.out_nbytes()))

    return fill


def _decoded_block(
    array: ArrayView, region: Box, read_bytes: int, window: int, pool: BufferPool | None
) -> Callable[[], ts.Future[Block]]:
    """A step that fills one block, `array[region]`, from every chunk it touches."""

    def fill() -> Block:
        destination = Destination(region, array.dtype, pool=pool)
        selection = array.selection[as_slices(region)]
        box = bounds(selection)
        for index in chunks_in(box, stored_array(array).chunks) if box else [()]:
            decode_into(array, index, [(destination, selection)], read_bytes, window)
        nbytes = destination.out_nbytes()
        return as_slices(region), destination.buffer(), nbytes

    return lambda: in_pool(fill, waits=is_remote(stored_array(array).store.location))


def _chunk_bands(
    array: ArrayView,
    index: tuple[int, ...],
    bands: Callable[[], Iterable[Box]],
    read_bytes: int,
    window: int,
    grid: tuple[int, ...] | None,
    block: int,
    pool: BufferPool | None,
) -> Iterator[Callable[[], ts.Future[object]]]:
    """Steps that decode one chunk larger than a block, each up to the end of its next
    band (a box of the view, whole cells of `grid`, that the chunk's decode completes,
    in decode order; for an unstrided view a slab along its leading stored dimension),
    handing it over in blocks (`pieces`: views of the band, which is freed with the
    last); the last step's result is `END`. The chunk's stored bytes are checked
    against its declared size before its bands are planned: a damaged header may
    declare petabytes."""

    def produce() -> Iterator[Block]:
        chunk = ChunkStream(stored_array(array), index, read_bytes)
        try:
            chunk.check()  # (then decoded on: located and its first window read once)
            regions = list(bands())
            destinations = [Destination(region, array.dtype, pool=pool) for region in regions]
            users = [(t, array.selection[as_slices(t.region)]) for t in destinations]
            itemsize = array.dtype.itemsize
            for completed in decode_slabs(array, index, users, read_bytes, window, chunk):
                for destination in completed:
                    band, region = destination.buffer(), destination.region
                    destination.out = None  # handed over: the job keeps no reference
                    for part in pieces(region, grid, itemsize, block):
                        yield as_slices(part), band[slices(part, region)], box_bytes(part, itemsize)
                    del band  # (and no piece of it is left in this frame)
        finally:
            chunk.close()  # (where planning failed, or the stream was let go early)

    bands_out = produce()
    return itertools.repeat(lambda: in_pool(lambda: next(bands_out, END)))
