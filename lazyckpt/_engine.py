"""The read engine shared by `load`, `device_put` and `iter_blocks`.

Each array is read into destination buffers ("targets": a region of the view and
the NumPy array that receives it) in blocks cut along stored chunk boundaries, so
that every stored chunk is read and decoded once per call, however the targets
cut through the chunks. A `Scheduler` keeps the bytes of blocks in flight within a
host-memory budget across the whole tree, and runs the reads of many arrays
concurrently.

Two ways to fill targets:
- *direct*: when each target is a union of whole stored chunks (the saved layout,
  or a coarser one), its blocks are read by tensorstore straight into the target.
- *routed*: otherwise blocks tile the union of the targets, each block is read
  once into a temporary buffer, and its pieces are copied to every target that
  overlaps it (Orbax was measured reading up to 2.9x the needed bytes this way in
  a 4-process restore).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import math
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import tensorstore as ts

from lazyckpt._progress import Progress
from lazyckpt._selection import NewAxis, Range
from lazyckpt._store import then

DEFAULT_MEMORY_BUDGET = min(1 << 30, max(64 << 20, (32 << 20) * (os.cpu_count() or 1)))
"""Host bytes that reads may hold at once unless a call asks otherwise: 32 MiB per
core, at least 64 MiB and at most 1 GiB; enough blocks in flight to keep every core
decoding, and little more."""
# What a block in flight holds, in multiples of its decoded size: its stored
# (compressed) bytes and the chunk tensorstore decodes them into, which is also
# the temporary that routed blocks are copied from. Measured, not assumed: counting
# a third copy kept one 12.5 MiB block in flight at the default budget, and a
# misaligned 1 GiB restore took 2.6 s instead of 1.4 s, with peak RSS within
# the budget either way (tests/test_engine.py checks it in a fresh process).
_HELD = 2
_BLOCKS_IN_FLIGHT = 4

Box = tuple[tuple[int, int], ...]


@attrs.define(eq=False)
class Target:
    """Read the view's elements in `region` (half-open per view dimension) into `out`.

    Without `out`, the engine allocates it, or adopts the array that a read of the
    whole region returns (no copy); `aligned` asks for a 64-byte aligned buffer.
    """

    region: Box
    dtype: Any
    aligned: bool = False
    out: np.ndarray | None = None
    on_allocate: Callable[[int], None] | None = None
    """Told the size of `out` when the engine allocates it."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(high - low for low, high in self.region)

    def out_nbytes(self) -> int:
        return math.prod(self.shape) * int(np.dtype(self.dtype).itemsize)

    def buffer(self) -> np.ndarray:
        if self.out is None:
            self.out = result_empty(self.shape, self.dtype)
            if self.on_allocate is not None:
                self.on_allocate(self.out.nbytes)
        return self.out


def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _libc()
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 16 << 20
"""Buffers at least this large are mapped on their own, and unmapped when freed."""


def release_free_memory() -> None:
    """Return freed memory that glibc's arenas keep to the OS (malloc_trim)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(ctypes.c_size_t(0))


def settle_allocator(budget: int) -> None:
    """Fix glibc's mmap and trim thresholds, so that freed read buffers are returned.

    By default glibc raises both thresholds each time a large mapped buffer is freed
    (up to 32 MiB and 64 MiB), after which decoded chunks come from per-thread
    arenas that each keep up to 64 MiB when freed: streaming 2 GiB of 32 MiB chunks
    through a 256 MiB budget grew the process by 334 MiB, and placing it on devices
    needed 314 MiB beyond the arrays. Here buffers of `MMAP_THRESHOLD` and more are
    mapped alone, and an arena keeps at most a quarter of the budget free at its top
    (so that the next block reuses the last one's memory rather than faulting it in
    again): the same reads measured 161 MiB and 71-112 MiB.

    Left alone when the process set `MALLOC_MMAP_THRESHOLD_` or
    `MALLOC_TRIM_THRESHOLD_` itself, when `LAZYCKPT_KEEP_MALLOC` is set, or where
    the C library is not glibc.
    """
    if any(
        os.environ.get(name)
        for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LAZYCKPT_KEEP_MALLOC")
    ):
        return
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        trim = min(max(budget // 4, 1 << 20), 2 * MMAP_THRESHOLD)
        _LIBC.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD))
        _LIBC.mallopt(ctypes.c_int(_M_TRIM_THRESHOLD), ctypes.c_int(trim))


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryGuard:
    """Trims freed memory when the process has grown by more than it should.

    A read may grow the process by its results, the blocks in flight and a little
    slack. Freed buffers that the allocator keeps beyond that are returned to the OS;
    trimming only then avoids refaulting memory that is within the budget anyway.
    """

    def __init__(self, budget: int) -> None:
        self.slack = budget // 4
        self.start = _rss()
        self.results = 0

    def keep(self, nbytes: int) -> None:
        """Count `nbytes` of results: memory the read is meant to leave behind."""
        self.results += nbytes

    def check(self, in_flight: int) -> None:
        if self.start is None:
            return
        now = _rss()
        if now is not None and now - self.start > self.results + in_flight + self.slack:
            release_free_memory()


class Scheduler:
    """Runs reads with at most `budget` bytes of blocks in flight (one block at least).

    Completion work (copies, casts, device transfers) runs on the calling thread,
    in the order reads were started.
    """

    def __init__(self, budget: int | None, progress: Progress | None = None) -> None:
        self.budget = DEFAULT_MEMORY_BUDGET if budget is None else int(budget)
        if self.budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, not {budget}")
        # Count each block at what it holds in flight, and cut blocks small enough
        # that several fit, to keep every core decoding.
        self.block_bytes = max(1, self.budget // (_HELD * _BLOCKS_IN_FLIGHT))
        self.progress = progress
        self._pending: collections.deque[tuple[ts.Future[Any], int, int, Callable[[Any], None]]]
        self._pending = collections.deque()
        self._in_flight = 0
        self.guard = MemoryGuard(self.budget)
        settle_allocator(self.budget)

    def submit(
        self,
        nbytes: int,
        start: Callable[[], ts.Future[Any]],
        done: Callable[[Any], None],
    ) -> None:
        """Start a read of a block of `nbytes` decoded bytes once the budget allows."""
        held = nbytes * _HELD
        while self._pending and self._in_flight + held > self.budget:
            self._finish_oldest()
        self._in_flight += held
        self._pending.append((start(), held, nbytes, done))

    def drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def abandon(self) -> None:
        """Wait for every read still in flight, discarding results and errors; after a
        failure, so that nothing touches the caller's buffers or files afterwards."""
        while self._pending:
            future, held, _, _ = self._pending.popleft()
            with contextlib.suppress(Exception):  # the first failure is already raised
                future.result()
            self._in_flight -= held

    def _finish_oldest(self) -> None:
        future, held, nbytes, done = self._pending.popleft()
        try:
            done(future.result())
        finally:
            self._in_flight -= held
        self.guard.check(self._in_flight)
        if self.progress is not None:
            self.progress.advance(nbytes)


def stored_map(array: Any) -> list[tuple[int, int] | None] | None:
    """For each view dim, `(stored dim, offset)`, or None for a new axis; None overall
    if some kept stored dimension is strided (those views are read whole per target)."""
    mapping: list[tuple[int, int] | None] = []
    for dim in array.selection.view:
        if isinstance(dim, NewAxis):
            mapping.append(None)
            continue
        stored = array.selection.stored[dim]
        assert isinstance(stored, Range)
        if stored.step != 1:
            return None
        mapping.append((dim, stored.start))
    return mapping


def _to_stored(array: Any, mapping: Sequence[tuple[int, int] | None], region: Box) -> Box:
    box = [(s, s + 1) if isinstance(s, int) else (0, 0) for s in array.selection.stored]
    for (low, high), entry in zip(region, mapping, strict=True):
        if entry is not None:
            dim, offset = entry
            box[dim] = (offset + low, offset + high)
    return tuple(box)


def chunk_blocks(box: Box, chunks: Sequence[int], itemsize: int, budget: int) -> Iterator[Box]:
    """`box` cut along the chunk grid into blocks of at most `budget` bytes (or one
    chunk, if a chunk is larger), growing blocks along trailing dimensions first so
    that they stay contiguous."""
    if any(low >= high for low, high in box):
        return
    spans = [((low // c), (high - 1) // c) for (low, high), c in zip(box, chunks, strict=True)]
    per_block = [1] * len(box)  # chunks per block, per dimension
    limit = max(1, budget // itemsize)
    for dim in reversed(range(len(box))):
        others = math.prod(c * k for c, k in zip(chunks, per_block, strict=True)) // chunks[dim]
        fit = max(1, limit // (others * chunks[dim]))
        first, last = spans[dim]
        per_block[dim] = min(last - first + 1, fit)
        if per_block[dim] <= last - first:
            break
    edges = []
    for (low, high), c, (first, last), k in zip(box, chunks, spans, per_block, strict=True):
        edges.append([(max(low, g * c), min(high, (g + k) * c)) for g in range(first, last + 1, k)])
    yield from itertools.product(*edges)


def on_grid(box: Box, array_box: Box, chunks: Sequence[int]) -> bool:
    """Whether `box` starts and ends on chunk boundaries (or the array's edges)."""
    return all(
        low % chunk == 0 and (high % chunk == 0 or high == edge)
        for (low, high), (_, edge), chunk in zip(box, array_box, chunks, strict=True)
    )


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(low < high for low, high in out) else None


def box_bytes(box: Box, itemsize: int) -> int:
    return math.prod(high - low for low, high in box) * itemsize


def _in_view(
    mapping: Sequence[tuple[int, int] | None], part: Box, origins: Sequence[int]
) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """The index and shape, in view dimensions, of the stored box `part`, where
    `origins[d]` is the stored index that index 0 of stored dimension d maps to."""
    index = tuple(
        slice(part[e[0]][0] - origins[e[0]], part[e[0]][1] - origins[e[0]])
        if e is not None
        else slice(None)
        for e in mapping
    )
    shape = tuple(part[e[0]][1] - part[e[0]][0] if e is not None else 1 for e in mapping)
    return index, shape


def stored_bytes(arrays: Iterable[Any]) -> int:
    """The decoded size of LazyArrays' views in their stored dtype: what reading costs."""
    return sum(array.size * array.stored.dtype.itemsize for array in arrays)


def _slices(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(low - o, high - o) for (low, high), (o, _) in zip(box, origin, strict=True))


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
    mapping = stored_map(array)
    stored = array.stored
    if mapping is None or stored.inline is not None or array.key_impl:
        _schedule_whole(array, targets, scheduler, finished, remaining)
    else:
        _schedule_blocks(array, mapping, targets, scheduler, finished, remaining)
    if remaining[0] == 0:
        on_done()


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

        scheduler.submit(view.nbytes, view.read, copy)


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
    boxes = [_to_stored(array, mapping, t.region) for t in targets]
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

                scheduler.submit(target.out_nbytes(), _read_box(stored, opened, blocks[0]), adopt)
                continue
            for block in blocks:
                remaining[0] += 1
                nbytes = box_bytes(block, itemsize)
                scheduler.submit(nbytes, _direct(stored, opened, target, block, box), finished)
        return
    union = tuple(
        (min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(array_box))
    )
    for block in chunk_blocks(union, stored.chunks, itemsize, scheduler.block_bytes):
        consumers = [
            (t, b, part)
            for t, b in zip(targets, boxes, strict=True)
            if (part := _intersect(block, b)) is not None
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
                piece = data[_slices(part, block)]
                out_index, view_shape = _in_view(mapping, part, [b[0] for b in box])
                np.copyto(target.buffer()[out_index], piece.reshape(view_shape), casting="unsafe")
            finished(None)

        scheduler.submit(nbytes, _read_box(stored, opened, block), route)


def _direct(
    stored: Any, opened: ts.Future[ts.TensorStore], target: Target, block: Box, box: Box
) -> Callable[[], ts.Future[Any]]:
    def start() -> ts.Future[Any]:
        out = target.buffer()

        def write(source: ts.TensorStore) -> ts.Future[Any]:
            dest = ts.array(out, copy=False, write=True)[_slices(block, box)].translate_to[0]
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


def iter_blocks(
    arrays: Sequence[Any], budget: int | None, progress: Progress | None = None
) -> Iterator[tuple[int, tuple[slice, ...], np.ndarray]]:
    """`(position, index, values)` for consecutive chunk-aligned blocks of each
    LazyArray in `arrays`, where `arrays[position][index]` equals `values`.

    Reads run ahead of the consumer, but the blocks in flight plus the one the
    consumer holds stay within `budget` bytes (one block at least).
    """
    limits = Scheduler(budget)
    pending: collections.deque[tuple[int, tuple[slice, ...], ts.Future[Any], int]]
    pending = collections.deque()
    in_flight = 0
    for position, array in enumerate(arrays):
        for index, nbytes, start in _view_blocks(array, limits.block_bytes):
            held = nbytes * _HELD
            while pending and in_flight + held > limits.budget:
                owner, done_index, future, done_held = pending.popleft()
                values = future.result()
                yield owner, done_index, values
                del values
                in_flight -= done_held  # the consumer has let go of it
                limits.guard.check(in_flight)
                if progress is not None:
                    progress.advance(done_held // _HELD)
            in_flight += held
            pending.append((position, index, start(), held))
    while pending:
        owner, done_index, future, done_held = pending.popleft()
        yield owner, done_index, future.result()
        if progress is not None:
            progress.advance(done_held // _HELD)


def _view_blocks(
    array: Any, budget: int
) -> Iterator[tuple[tuple[slice, ...], int, Callable[[], ts.Future[Any]]]]:
    """The view's blocks: its index, bytes, and how to start reading it."""
    mapping = stored_map(array)
    stored = array.stored
    if mapping is None or array.key_impl or 0 in array.shape:
        index = tuple(slice(0, n) for n in array.shape)
        yield index, array.nbytes, array.read
        return
    box = _to_stored(array, mapping, tuple((0, n) for n in array.shape))
    opened = stored.open() if stored.inline is None else None
    # A view's index i in a kept dimension is stored index `offset + i`.
    origins = [0] * len(stored.shape)
    for entry in mapping:
        if entry is not None:
            origins[entry[0]] = entry[1]
    for block in chunk_blocks(box, stored.chunks, stored.dtype.itemsize, budget):
        index, shape = _in_view(mapping, block, origins)
        if opened is None:
            yield index, array[index].nbytes, array[index].read
            continue
        nbytes = box_bytes(block, stored.dtype.itemsize)

        def start(block: Box = block, shape: tuple[int, ...] = shape) -> ts.Future[Any]:
            future = _read_box(stored, opened, block)()
            return then(future, lambda data: data.reshape(shape).astype(array.dtype, copy=False))

        yield index, nbytes, start


MAPPED_BYTES = 1 << 20
"""Results at least this large get memory mapped for them alone (`result_empty`)."""


def result_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialized array to read results into, starting on a 64-byte boundary
    so that `jax.device_put` on CPU adopts it without a copy.

    Large ones are mapped on their own: page-aligned, returned to the OS as soon as
    they are freed, and without the transparent huge pages NumPy asks for. Faulting
    those in stalls on the kernel's synchronous compaction: a 1 GiB restore here took
    0.6-1.9 s with them (up to 2.8 s of system time) and 0.72-0.80 s without.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MAPPED_BYTES:
        return aligned_empty(shape, dtype)
    out: np.ndarray = np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)
    return out


def aligned_empty(shape: Sequence[int], dtype: Any, alignment: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on an `alignment`-byte boundary, which
    lets `jax.device_put` on CPU adopt it without a copy."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    out: np.ndarray = raw[offset : offset + nbytes].view(dtype).reshape(shape)
    return out
