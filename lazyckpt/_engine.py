"""The read engine shared by `load`, `device_put`, `iter_blocks`, `stats`, `diff`, `save`.

Each array is read into destination buffers ("targets": a region of the view and the
NumPy array that receives it) so that every stored chunk is decoded once per call,
however the targets cut through the chunks, with the host memory of reads in flight
within a budget across the whole tree. Two ways:

- *decoded*: arrays whose chunks have a `Codec` and hold at least 1 MiB (Orbax's
  usual layouts: one chunk per device shard, or per NumPy array) are decoded by
  lazyckpt (`lazyckpt._decode`): one job per chunk on the decoding threads, slab by
  slab, straight into the target where the layouts match, else through one scratch
  slab whose pieces are copied to every target that needs them. A job holds a few
  MiB whatever the chunk's size; reading stops after the last slab a target needs.
- *tensorstore*: other arrays (small chunks, other codecs, values held in the legacy
  msgpack file, typed PRNG keys) are read by tensorstore in blocks cut along the
  stored chunks: straight into the target where it is a union of whole chunks, else
  each block once into a temporary, copied to every target that overlaps it (Orbax
  was measured reading up to 2.9x the needed bytes this way in a 4-process restore).

`iter_blocks` streams blocks instead: whole chunks grouped up to a block's share of
the budget, or, for chunks larger than that, slabs of the chunk cut along its leading
stored dimension, decoded in order by one job that hands each slab over as soon as
it is complete.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from lazyckpt._decode import READ_BYTES, ChunkStream, decodes, stream_bytes
from lazyckpt._geometry import (
    Box,
    as_slices,
    bounds,
    box_bytes,
    chunk_blocks,
    chunk_box,
    chunks_in,
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
from lazyckpt._memory import Target
from lazyckpt._progress import Progress
from lazyckpt._scheduler import HELD, Scheduler, in_pool
from lazyckpt._selection import Selection
from lazyckpt._store import ready, then

_END = object()


def stored_bytes(arrays: Iterable[Any]) -> int:
    """The decoded size of LazyArrays' views in their stored dtype: what reading costs."""
    return sum(array.size * array.stored.dtype.itemsize for array in arrays)


def _windows(budget: int) -> tuple[int, int]:
    """Bytes per kvstore read and per scratch slab of a decoding job, for `budget`."""
    read = min(READ_BYTES, max(256 << 10, budget // 64))
    return read, min(READ_BYTES, max(256 << 10, budget // 16))


def schedule_fill(
    array: Any, targets: Sequence[Target], scheduler: Scheduler, on_done: Callable[[], None]
) -> None:
    """Read `array` (a LazyArray) into every target's `out`; call `on_done` after."""
    remaining = [0]

    def finished(_: Any = None) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            on_done()

    for target in targets:
        target.on_allocate = scheduler.guard.keep
    stored = array.stored
    mapping = stored_map(array)
    if decodes(stored) and not array.key_impl:
        _schedule_decoded(array, targets, scheduler, finished, remaining)
    elif mapping is None or stored.inline is not None or array.key_impl:
        _schedule_whole(array, targets, scheduler, finished, remaining)
    else:
        _schedule_blocks(array, mapping, targets, scheduler, finished, remaining)
    if remaining[0] == 0:
        on_done()


# The decoded path.


Consumer = tuple[Target, Selection]


def _schedule_decoded(
    array: Any,
    targets: Sequence[Target],
    scheduler: Scheduler,
    finished: Callable[[Any], None],
    remaining: list[int],
) -> None:
    """One decoding job per stored chunk that some target needs."""
    stored = array.stored
    consumers = [(t, array.selection[as_slices(t.region)]) for t in targets if 0 not in t.shape]
    if not consumers:
        return
    read_bytes, window = _windows(scheduler.budget)
    held = stream_bytes(read_bytes) + window
    every = [bounds(selection) for _, selection in consumers]
    union = tuple(
        (min(b[d][0] for b in every), max(b[d][1] for b in every)) for d in range(len(stored.shape))
    )
    for index in chunks_in(union, stored.chunks):
        inside = _clip(chunk_box(index, stored.chunks), stored.shape)
        users = [(t, s) for t, s in consumers if piece(s, inside) is not None]
        if not users:
            continue
        remaining[0] += 1
        work = box_bytes(inside, stored.dtype.itemsize)

        def start(index: tuple[int, ...] = index, users: list[Consumer] = users) -> Any:
            return in_pool(lambda: decode_into(array, index, users, read_bytes, window))

        scheduler.submit(start, finished, held=held, work=work)


def _clip(box: Box, shape: Sequence[int]) -> Box:
    return tuple((low, min(high, n)) for (low, high), n in zip(box, shape, strict=True))


def decode_into(
    array: Any, index: tuple[int, ...], users: Sequence[Consumer], read_bytes: int, window: int
) -> None:
    """Decode stored chunk `index` of `array` slab by slab into every user's buffer,
    stopping after the last slab one needs."""
    for _ in decode_slabs(array, index, users, read_bytes, window):
        pass


def decode_slabs(
    array: Any, index: tuple[int, ...], users: Sequence[Consumer], read_bytes: int, window: int
) -> Iterator[list[Target]]:
    """`decode_into`, one slab at a time: after each slab, the targets it completed."""
    stored = array.stored
    codec = stored.codec
    itemsize = stored.dtype.itemsize
    box = chunk_box(index, stored.chunks)
    cuts: set[int] = set()
    if stored.shape:  # slabs are also cut where targets and the array end
        split = split_dim(box, codec.order, itemsize, window)
        cuts.add(stored.shape[split])
        for _, selection in users:
            cuts.update(bounds(selection)[split])
    plan = []
    for slab in slabs(box, codec.order, itemsize, window, sorted(cuts)):
        inside = intersect(slab, _clip(slab, stored.shape)) if slab else ()
        parts = (
            []
            if inside is None
            else [(t, found) for t, s in users if (found := piece(s, inside)) is not None]
        )
        plan.append((slab, inside, parts))
    needed = [i for i, (_, _, parts) in enumerate(plan) if parts]
    if not needed:
        return
    direct_ok = (
        codec.order == tuple(range(len(stored.shape)))
        and codec.byteorder in ("|", "<" if np.little_endian else ">")
        and array.dtype == stored.dtype
    )
    left = {id(t): math.prod(s.shape) for t, s in users}
    stream = ChunkStream(stored, index, read_bytes)
    try:
        for slab, inside, parts in plan[: needed[-1] + 1]:
            into = _direct(slab, inside, parts) if direct_ok else None
            values = stream.next(slab, into)
            completed = []
            for target, (in_slab, in_view_index) in parts:
                out = target.buffer()[(*in_view_index, Ellipsis)]  # a view, even for 0-d
                if into is None:
                    assert values is not None and inside is not None
                    piece_values = values[slices(inside, slab)][in_slab]
                    np.copyto(out, piece_values.reshape(out.shape), casting="unsafe")
                left[id(target)] -= out.size
                if not left[id(target)]:
                    completed.append(target)
            yield completed
        if needed[-1] == len(plan) - 1:
            stream.finish()
    finally:
        stream.close()


def _direct(slab: Box, inside: Box | None, parts: list[Any]) -> memoryview | None:
    """The memory to decode `slab` straight into: one target's buffer region that holds
    exactly the slab's elements, contiguous and in the same order; else None."""
    if len(parts) != 1 or inside != slab:
        return None
    target, (in_slab, in_view_index) = parts[0]
    if any(isinstance(s, slice) and s.step not in (None, 1) for s in in_slab):
        return None
    region = target.buffer()[(*in_view_index, Ellipsis)]
    if region.size != math.prod(high - low for low, high in slab) or not region.flags.c_contiguous:
        return None
    return memoryview(region.reshape(-1).view(np.uint8))


# The tensorstore path.


def _schedule_whole(
    array: Any,
    targets: Sequence[Target],
    scheduler: Scheduler,
    finished: Callable[[Any], None],
    remaining: list[int],
) -> None:
    """Strided or in-memory views: one read per target, cast into it."""
    for target in targets:
        view = array[tuple(slice(low, high) for low, high in target.region)]
        remaining[0] += 1

        def copy(data: Any, target: Target = target) -> None:
            np.copyto(target.buffer(), np.asarray(data), casting="unsafe")
            finished(None)

        scheduler.submit(view.read, copy, held=view.nbytes * HELD, work=view.nbytes)


def _schedule_blocks(
    array: Any,
    mapping: Sequence[tuple[int, int] | None],
    targets: Sequence[Target],
    scheduler: Scheduler,
    finished: Callable[[Any], None],
    remaining: list[int],
) -> None:
    stored = array.stored
    itemsize = stored.dtype.itemsize
    array_box = tuple((0, n) for n in stored.shape)
    boxes = [to_stored(array, mapping, t.region) for t in targets]
    plain = all(entry is not None for entry in mapping) and len(mapping) == len(stored.shape)
    direct = (
        plain
        and array.dtype == stored.dtype
        and all(on_grid(box, array_box, stored.chunks) for box in boxes)
    )
    opened = stored.open()
    if direct:
        for target, box in zip(targets, boxes, strict=True):
            blocks = list(chunk_blocks(box, stored.chunks, itemsize, scheduler.block_bytes))
            if len(blocks) == 1 and not target.aligned and target.out is None:
                # One read covers the target: keep the array tensorstore returns.
                remaining[0] += 1

                def adopt(data: np.ndarray, target: Target = target) -> None:
                    target.out = data.reshape(target.shape)
                    scheduler.guard.keep(data.nbytes)
                    finished(None)

                nbytes = target.out_nbytes()
                start = _read_box(stored, opened, blocks[0])
                scheduler.submit(start, adopt, held=nbytes * HELD, work=nbytes)
                continue
            for block in blocks:
                remaining[0] += 1
                nbytes = box_bytes(block, itemsize)
                start = _direct_read(stored, opened, target, block, box)
                scheduler.submit(start, finished, held=nbytes * HELD, work=nbytes)
        return
    union = tuple(
        (min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(array_box))
    )
    for block in chunk_blocks(union, stored.chunks, itemsize, scheduler.block_bytes):
        consumers = [
            (t, b, part)
            for t, b in zip(targets, boxes, strict=True)
            if (part := intersect(block, b)) is not None
        ]
        if not consumers:
            continue
        remaining[0] += 1
        nbytes = box_bytes(block, itemsize)

        def route(
            data: np.ndarray,
            block: Box = block,
            consumers: list[tuple[Target, Box, Box]] = consumers,
        ) -> None:
            for target, box, part in consumers:
                values = data[slices(part, block)]
                out_index, view_shape = in_view(mapping, part, [b[0] for b in box])
                np.copyto(target.buffer()[out_index], values.reshape(view_shape), casting="unsafe")
            finished(None)

        scheduler.submit(_read_box(stored, opened, block), route, held=nbytes * HELD, work=nbytes)


def _direct_read(
    stored: Any, opened: ts.Future[ts.TensorStore], target: Target, block: Box, box: Box
) -> Callable[[], ts.Future[Any]]:
    def start() -> ts.Future[Any]:
        out = target.buffer()

        def write(source: ts.TensorStore) -> ts.Future[Any]:
            dest = ts.array(out, copy=False, write=True)[slices(block, box)].translate_to[0]
            return dest.write(source[tuple(slice(*r) for r in block)].translate_to[0]).commit

        return then(then(opened, write), _same, stored.read_error)

    return start


def _read_box(
    stored: Any, opened: ts.Future[ts.TensorStore], block: Box
) -> Callable[[], ts.Future[Any]]:
    def start() -> ts.Future[Any]:
        read = then(opened, lambda source: source[tuple(slice(*r) for r in block)].read())
        return then(read, _same, stored.read_error)

    return start


def _same(value: Any) -> Any:
    return value


# Streaming blocks.


class _Job:
    """Consecutive blocks of one array; `step()` starts producing the next, a future
    of `(index, values, work)` or `_END`. Steps of one job run one after another."""

    def __init__(self, position: int, held: int, steps: Iterator[Callable[[], Any]]) -> None:
        self.position, self.held, self._steps = position, held, steps

    def step(self) -> ts.Future[Any]:
        start = next(self._steps, None)
        if start is None:
            return ready(_END)
        result: ts.Future[Any] = start()
        return result


def iter_blocks(
    arrays: Sequence[Any],
    budget: int | None,
    progress: Progress | None = None,
    grids: Sequence[tuple[int, ...] | None] | None = None,
) -> Iterator[tuple[int, tuple[slice, ...], np.ndarray]]:
    """`(position, index, values)` for consecutive blocks of each LazyArray in `arrays`,
    where `arrays[position][index]` equals `values`.

    `grids[position]`, where given, is a chunk grid of the view (a new checkpoint's
    chunks) that every block must be a union of whole cells of. Reads run ahead of the
    consumer: every job in flight holds at most its stream and one block, and the one
    the consumer holds counts too, within `budget` bytes (one job at least).
    """
    limits = Scheduler(budget)
    block = max(1, limits.budget // 8)
    cells = list(grids) if grids is not None else [None] * len(arrays)
    jobs = (
        job
        for position, (array, grid) in enumerate(zip(arrays, cells, strict=True))
        for job in _jobs(position, array, limits, grid)
    )
    active: collections.deque[tuple[_Job, ts.Future[Any]]] = collections.deque()
    reserved = block  # the block the consumer holds
    upcoming = next(jobs, None)

    def start_more() -> None:
        nonlocal reserved, upcoming
        while upcoming is not None and (not active or reserved + upcoming.held <= limits.budget):
            reserved += upcoming.held
            active.append((upcoming, upcoming.step()))
            upcoming = next(jobs, None)

    start_more()
    while active:
        job, pending = active[0]
        result = pending.result()
        if result is _END:
            active.popleft()
            reserved -= job.held
            start_more()
            continue
        index, values, work = result
        active[0] = (job, job.step())  # decode the next block while this one is used
        yield job.position, index, values
        del values, result
        limits.guard.check(reserved)
        if progress is not None:
            progress.advance(work)


def _jobs(
    position: int, array: Any, limits: Scheduler, grid: tuple[int, ...] | None
) -> Iterator[_Job]:
    """The jobs that stream one view, in order."""
    stored = array.stored
    mapping = stored_map(array)
    budget = limits.budget
    block = max(1, budget // 8)
    itemsize = stored.dtype.itemsize
    whole = tuple((0, n) for n in array.shape)
    if array.key_impl or 0 in array.shape or (mapping is None and not decodes(stored)):
        index = as_slices(whole)
        yield _Job(position, array.nbytes * HELD, iter([_ts_step(array, index, array.nbytes)]))
        return
    if not decodes(stored):
        assert mapping is not None
        if grid is None:
            yield from _ts_jobs(position, array, mapping, limits)
            return
        cells = widened(array, grid, itemsize, block)
        for part in chunk_blocks(whole, cells, itemsize, block):
            index = as_slices(part)
            held = box_bytes(part, itemsize) * HELD
            yield _Job(position, held, iter([_ts_step(array, index, box_bytes(part, itemsize))]))
        return
    read_bytes, window = _windows(budget)
    window = min(window, block)
    held = stream_bytes(read_bytes) + window + block
    if mapping is None:  # strided: bands of the view, each decoded from its chunks
        for region in _view_bands(array, block // itemsize, grid):
            yield _Job(position, held, iter([_decoded_block(array, region, read_bytes, window)]))
        return
    origins = [0] * len(stored.shape)
    for entry in mapping:
        if entry is not None:
            origins[entry[0]] = entry[1]
    box = to_stored(array, mapping, whole)
    stored_cells = _stored_cells(array, mapping, grid)
    if math.prod(stored.chunks) * itemsize <= block or stored_cells is None:
        regions: Iterable[Box] = (
            (
                _region(in_view(mapping, part, origins)[0], array.shape)
                for part in chunk_blocks(box, stored.chunks, itemsize, block)
            )
            if grid is None
            else chunk_blocks(whole, widened(array, grid, itemsize, block), itemsize, block)
        )
        for region in regions:
            yield _Job(position, held, iter([_decoded_block(array, region, read_bytes, window)]))
        return
    order = stored.codec.order
    for chunk in chunks_in(box, stored.chunks):
        overlap = intersect(chunk_box(chunk, stored.chunks), box)
        assert overlap is not None
        split = split_dim(overlap, order, itemsize, block)
        if any(stored_cells[d] > 1 for d in order[: order.index(split)]):
            # Bands would cut cells of the grid: whole cells instead, decoded per block.
            view_part = _region(in_view(mapping, overlap, origins)[0], array.shape)
            for region in chunk_blocks(view_part, grid or (), itemsize, block):
                job = _decoded_block(array, region, read_bytes, window)
                yield _Job(position, held, iter([job]))
            continue
        bands = list(slabs(overlap, order, itemsize, block, unit=stored_cells[split]))
        steps = _chunk_bands(array, chunk, bands, mapping, origins, read_bytes, window)
        yield _Job(position, held, steps)


def _stored_cells(
    array: Any, mapping: Sequence[tuple[int, int] | None], grid: tuple[int, ...] | None
) -> tuple[int, ...] | None:
    """`grid`'s cell size along each stored dimension (1 without a grid, and for
    dimensions the view drops), or None when its cells straddle stored chunks, so
    that slabs of a stored chunk cannot be unions of whole cells."""
    stored = array.stored
    cells = [1] * len(stored.shape)
    if grid is None:
        return tuple(cells)
    for cell, entry in zip(grid, mapping, strict=True):
        if entry is None:
            continue
        dim, offset = entry
        if stored.chunks[dim] % cell or offset % cell:
            return None
        cells[dim] = cell
    return tuple(cells)


def widened(array: Any, grid: tuple[int, ...], itemsize: int, block: int) -> tuple[int, ...]:
    """Blocks of whole cells of `grid`, widened to whole stored chunks too where the two
    grids line up (so that no stored chunk is read twice), as long as such a block is
    no larger than a stored chunk or a block of the budget."""
    mapping = stored_map(array)
    if mapping is None:
        return grid
    cells = []
    for cell, entry in zip(grid, mapping, strict=True):
        if entry is None:
            cells.append(cell)
            continue
        dim, offset = entry
        stored = array.stored.chunks[dim]
        cells.append(math.lcm(cell, stored) if offset % stored == 0 else cell)
    widest = max(block, math.prod(array.stored.chunks) * itemsize)
    if math.prod(cells) * itemsize > widest:
        return grid
    return tuple(cells)


def _region(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _view_bands(array: Any, elements: int, grid: tuple[int, ...] | None) -> Iterator[Box]:
    """The view cut into blocks of at most `elements` (whole cells of `grid`)."""
    cells = grid if grid is not None else (1,) * len(array.shape)
    yield from chunk_blocks(tuple((0, n) for n in array.shape), cells, 1, elements)


def _decoded_block(
    array: Any, region: Box, read_bytes: int, window: int
) -> Callable[[], ts.Future[Any]]:
    """A step that fills one block, `array[region]`, from every chunk it touches."""

    def fill() -> tuple[tuple[slice, ...], np.ndarray, int]:
        target = Target(region, array.dtype)
        selection = array.selection[as_slices(region)]
        box = bounds(selection)
        for index in chunks_in(box, array.stored.chunks) if box else [()]:
            decode_into(array, index, [(target, selection)], read_bytes, window)
        nbytes = target.out_nbytes()
        return as_slices(region), target.buffer(), nbytes

    return lambda: in_pool(fill)


def _chunk_bands(
    array: Any,
    index: tuple[int, ...],
    bands: list[Box],
    mapping: Sequence[tuple[int, int] | None],
    origins: Sequence[int],
    read_bytes: int,
    window: int,
) -> Iterator[Callable[[], ts.Future[Any]]]:
    """Steps that decode one chunk larger than a block, each up to the end of its next
    band (a slab of the chunk along its leading stored dimension), handing it over."""
    regions = [_region(in_view(mapping, band, origins)[0], array.shape) for band in bands]
    targets = [Target(region, array.dtype) for region in regions]
    users = [(t, array.selection[as_slices(t.region)]) for t in targets]

    def produce() -> Iterator[tuple[tuple[slice, ...], np.ndarray, int]]:
        for completed in decode_slabs(array, index, users, read_bytes, window):
            for target in completed:
                yield as_slices(target.region), target.buffer(), target.out_nbytes()
                target.out = None  # handed over: the job keeps no reference

    bands_out = produce()
    for _ in targets:
        yield lambda: in_pool(lambda: next(bands_out))


def _ts_step(array: Any, index: tuple[slice, ...], nbytes: int) -> Callable[[], ts.Future[Any]]:
    return lambda: then(array[index].read(), lambda values: (index, values, nbytes))


def _ts_jobs(
    position: int, array: Any, mapping: Sequence[tuple[int, int] | None], limits: Scheduler
) -> Iterator[_Job]:
    """Blocks read by tensorstore: whole chunks, grouped up to a block's share."""
    stored = array.stored
    box = to_stored(array, mapping, tuple((0, n) for n in array.shape))
    opened = stored.open() if stored.inline is None else None
    origins = [0] * len(stored.shape)
    for entry in mapping:
        if entry is not None:
            origins[entry[0]] = entry[1]
    itemsize = stored.dtype.itemsize
    for part in chunk_blocks(box, stored.chunks, itemsize, limits.block_bytes):
        index, shape = in_view(mapping, part, origins)
        nbytes = box_bytes(part, itemsize)
        if opened is None:
            yield _Job(position, nbytes * HELD, iter([_ts_step(array, index, array[index].nbytes)]))
            continue

        def start(part: Box = part, index: Any = index, shape: Any = shape, n: int = nbytes) -> Any:
            future = _read_box(stored, opened, part)()
            return then(
                future,
                lambda data: (index, data.reshape(shape).astype(array.dtype, copy=False), n),
            )

        yield _Job(position, nbytes * HELD, iter([start]))
