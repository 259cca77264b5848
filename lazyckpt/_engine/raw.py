"""Raw bytes straight into place: an array stored as plain C-order bytes (a
safetensors tensor) is read into the destination buffer itself, with no tensorstore
chunk, no intermediate `bytes` and no second copy:

- in a local file, with positioned reads (`os.preadv`) on the decoding threads, in
  pieces of about `PIECE` bytes;
- over HTTP (the Hugging Face Hub, https:// URLs), with Range requests whose bodies
  the transport reads straight into the buffer, in requests of up to
  `NetworkOptions.request_bytes`, cut smaller where that keeps every connection busy
  (`request_bytes`); in a bucket, with ranged reads of tensorstore's kvstore, each
  copied into place as it arrives.

A destination's box is cut into runs of consecutive stored bytes (a row-sharded
tensor is one run per shard, a whole tensor one run), and the runs into pieces. Boxes
whose runs are short (a column shard is one short run per row) keep tensorstore's
chunked path: below `MIN_RUN` locally, below `MIN_REQUEST` remotely, where each
request costs a round trip.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import math
import mmap
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from lazyckpt._array import compose
from lazyckpt._array.geometry import (
    Box,
    bounds,
    box_bytes,
    box_shape,
    intersect,
    product,
    stored_map,
    to_stored,
)
from lazyckpt._array.selection import Range, Selection
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.decode import decodes
from lazyckpt._engine.memory import Destination, result_empty
from lazyckpt._engine.scheduler import Scheduler, in_pool
from lazyckpt._engine.stored import StoredArray, stored_array
from lazyckpt._errors import CorruptCheckpointError
from lazyckpt._storage import network
from lazyckpt._storage.futures import all_of, then
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.local import pread_into
from lazyckpt._storage.metrics import count_direct

PIECE = 8 << 20
"""Bytes per job: enough for one positioned read to run at page-cache speed, few
enough that a large tensor keeps every thread busy."""

MIN_RUN = 64 << 10
"""The shortest run read on its own: below it, one system call per run costs more
than tensorstore's chunked read of the rows around it."""

MIN_REQUEST = 1 << 20
"""The shortest run read remotely on its own, and the smallest request a remote run is
cut into: below it, a request's round trip costs more than its bytes."""

Part = tuple[int, int, int]
"""A read: its offset in the file, its offset in the destination buffer, its length."""


@attrs.frozen
class Source:
    """Where an array's raw bytes lie: a local `file`, or the key `key` of its store
    (a bucket, or a folder over HTTP); the array starts at byte `start`."""

    stored: StoredArray
    start: int
    file: str | None = None
    key: str = ""

    @property
    def min_run(self) -> int:
        return MIN_RUN if self.file is not None else MIN_REQUEST

    def piece(self, scheduler: Scheduler) -> int:
        """Bytes per job within `scheduler`'s budget: a local one's share of a block, a
        remote one's of the connections."""
        if self.file is not None:
            return piece_bytes(scheduler)
        return request_bytes(scheduler.budget)

    def jobs(self, runs: Iterator[Part], piece: int) -> Iterator[list[Part]]:
        """`runs` as jobs of about `piece` bytes: locally, runs grouped and cut into
        pieces; remotely, one request a job, each run cut on its own into equal
        requests of at most `piece` bytes, but no fewer than `MIN_REQUEST` (never a
        sliver of a run left over, nor a request that spans two runs)."""
        if self.file is not None:
            yield from grouped(runs, piece)
            return
        for file_at, buffer_at, length in runs:
            if length == 0:
                continue  # (no request: `count` would be 0)
            count = min(-(-length // piece), max(1, length // MIN_REQUEST))
            cuts = [length * i // count for i in range(count + 1)]
            for low, high in itertools.pairwise(cuts):
                yield [(file_at + low, buffer_at + low, high - low)]

    def read(self, parts: list[Part], buffer: memoryview) -> ts.Future[None]:
        """Read each part of `parts` into `buffer`."""
        if self.file is not None:
            file = self.file
            return in_pool(lambda: read_parts(file, self.stored, parts, buffer))
        return read_remote(self.stored, self.key, parts, buffer)


def source(stored: StoredArray) -> Source | None:
    """Where `stored`'s raw bytes lie; None where it is not stored as raw bytes."""
    local = stored.raw_file()
    if local is not None:
        return Source(stored, local[1], file=local[0])
    remote = stored.remote_raw()
    if remote is not None:
        return Source(stored, remote[1], key=remote[0])
    return None


def lies_raw(array: ArrayView) -> bool:
    """Whether `array`'s bytes lie raw in a file (not a composed view, not encoded
    chunks), so that any box of it is read alone."""
    if isinstance(array.stored, compose.Node):
        return False
    stored = stored_array(array)
    return not (decodes(stored) or source(stored) is None)


def in_file_order(mapping: Sequence[tuple[int, int] | None] | None) -> bool:
    """Whether a view with this `stored_map` is unstrided and keeps the order of its
    stored array's dimensions (new axes aside): its boxes are then runs of the stored
    bytes."""
    if mapping is None:
        return False
    dims = [entry[0] for entry in mapping if entry is not None]
    return dims == sorted(set(dims))


def _in_order(array: ArrayView, mapping: Sequence[tuple[int, int] | None]) -> Source | None:
    """Where `array`'s stored bytes lie raw, where the view keeps their dtype and the
    order of their dimensions (a box of it is then runs of them); None otherwise."""
    stored = stored_array(array)
    found = source(stored)
    if found is None or array.dtype != stored.dtype or not in_file_order(mapping):
        return None
    return found


def local_runs(array: ArrayView, region: Box) -> tuple[str, Iterator[Part]] | None:
    """Where the box `region` of `array` lies raw in a local file, in `array`'s order
    and dtype, in runs of `MIN_RUN` bytes or more: the file and the runs (made as they
    are read), as `read_parts` reads them into a C-ordered buffer of the region; None
    otherwise (`schedule_fill` then chooses how to read it)."""
    if not lies_raw(array) or stored_array(array).inline is not None:
        return None
    mapping = stored_map(array)
    if mapping is None:
        return None
    found = _in_order(array, mapping)
    if found is None or found.file is None:
        return None
    stored = found.stored
    box = to_stored(array, mapping, region)
    itemsize = stored.dtype.itemsize
    if not _long_runs(stored.shape, box, itemsize, MIN_RUN):
        return None
    if box_bytes(region, itemsize) == 0:  # (empty along a new axis: its stored box is not)
        return found.file, iter(())
    return found.file, _runs(stored.shape, box, itemsize, found.start)


def request_bytes(held: int) -> int:
    """Bytes per remote request where requests may hold `held` bytes in flight
    together: that shared among the connections, between `MIN_REQUEST` and
    `NetworkOptions.request_bytes`."""
    options = network.options()
    return max(MIN_REQUEST, min(options.request_bytes, held // options.connections))


def schedule_raw(
    array: ArrayView,
    mapping: Sequence[tuple[int, int] | None],
    destinations: Sequence[Destination],
    scheduler: Scheduler,
    finished: Callable[[object], None],
    remaining: list[int],
) -> bool:
    """Read `array` into `destinations` straight from its file, if it lies there as
    raw bytes in the view's order and dtype with long enough runs; False (and nothing
    scheduled) otherwise."""
    stored = stored_array(array)
    found = _in_order(array, mapping)
    if found is None:
        return False
    itemsize = stored.dtype.itemsize
    boxes = [to_stored(array, mapping, d.region) for d in destinations]
    if any(not _long_runs(stored.shape, box, itemsize, found.min_run) for box in boxes):
        return False
    shared = _shared(boxes) * itemsize
    if shared > max(1 << 20, sum(box_bytes(box, itemsize) for box in boxes) // 8):
        return False  # boxes that share much: the chunked path reads what they share once
    # Bytes land in the buffer in C order: it must be C-contiguous (a composed view's
    # part may be given a transposed view of its parent's buffer) and of this dtype.
    if any(
        np.dtype(d.dtype) != stored.dtype or (d.out is not None and not d.out.flags.c_contiguous)
        for d in destinations
    ):
        return False
    piece = found.piece(scheduler)
    for destination, box in zip(destinations, boxes, strict=True):
        if destination.out_nbytes() == 0:
            continue
        buffer = destination.buffer().reshape(-1).view(np.uint8).data
        for parts in found.jobs(_runs(stored.shape, box, itemsize, found.start), piece):
            remaining[0] += 1
            work = sum(length for _, _, length in parts)

            def start_job(
                parts: list[Part] = parts, buffer: memoryview = buffer
            ) -> ts.Future[None]:
                return found.read(parts, buffer)

            # Held while in flight: where the buffer is a temporary (a cast, a shard on
            # its way to a device), reads must not run ahead of what frees it.
            scheduler.submit(start_job, finished, held=work, work=work)
    return True


def _shared(boxes: Sequence[Box]) -> int:
    """How many elements `boxes` share, pair by pair (a repeated row counts once per
    repeat): swept along their first dimension, so that thousands of picked rows
    (`x[rows]`) cost a comparison each, not one a pair."""
    if not boxes or not boxes[0]:
        return len(boxes) - 1 if boxes else 0
    counts = collections.Counter(boxes)  # (a row picked again and again: once here)
    shared = sum((n - 1) * math.prod(high - low for low, high in box) for box, n in counts.items())
    order = sorted(counts, key=lambda box: box[0][0])
    for k, box in enumerate(order):
        for j in range(k + 1, len(order)):
            other = order[j]
            if other[0][0] >= box[0][1]:
                break
            both = intersect(box, other)
            if both is not None:
                shared += math.prod(high - low for low, high in both)
    return shared


def read_raw(stored: StoredArray, selection: Selection) -> ts.Future[np.ndarray] | None:
    """The view `selection` of an array stored as raw bytes, read straight into a new
    array (all its pieces at once); None where that does not apply (strided, empty,
    out of the stored order, or short runs)."""
    found = source(stored)
    if found is None or 0 in selection.shape:
        return None
    if any(isinstance(e, Range) and e.step != 1 and e.count > 1 for e in selection.stored):
        return None
    dims = [d for d in selection.view if isinstance(d, int)]
    box = bounds(selection)
    itemsize = stored.dtype.itemsize
    if dims != sorted(dims) or not _long_runs(stored.shape, box, itemsize, found.min_run):
        return None
    out = result_empty(box_shape(box), stored.dtype)
    buffer = out.reshape(-1).view(np.uint8).data
    # All at once: the read holds no more than its result.
    piece = PIECE if found.file is not None else request_bytes(out.nbytes)
    jobs = list(found.jobs(_runs(stored.shape, box, itemsize, found.start), piece))
    reads = [found.read(parts, buffer) for parts in jobs]
    return then(all_of(reads, lambda error: error), lambda _: out.reshape(selection.shape))


def _long_runs(shape: Sequence[int], box: Box, itemsize: int, least: int) -> bool:
    """Whether `box` is one run of consecutive bytes, or runs of `least` bytes or more."""
    last = _last_cut(shape, box)
    extents = [high - low for low, high in box]
    return math.prod(extents[:last]) <= 1 or math.prod(extents[last:]) * itemsize >= least


def _last_cut(shape: Sequence[int], box: Box) -> int:
    """The last dimension that `box` does not span whole: a run of consecutive bytes
    is its extent there times the whole dimensions after it (C order)."""
    return max((d for d, (low, high) in enumerate(box) if (low, high) != (0, shape[d])), default=0)


def _runs(shape: Sequence[int], box: Box, itemsize: int, start: int) -> Iterator[Part]:
    """The runs of `box`, in the destination's order (which is C order: the view keeps
    the stored dimensions' order)."""
    if not shape:
        yield start, 0, itemsize
        return
    last = _last_cut(shape, box)
    length = math.prod(high - low for low, high in box[last:]) * itemsize
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    lead = [range(low, high) for low, high in box[:last]]
    at = 0
    for index in product(lead) if lead else [()]:
        first = sum(i * s for i, s in zip(index, strides, strict=False))
        first += box[last][0] * strides[last]
        yield start + first * itemsize, at, length
        at += length


def piece_bytes(scheduler: Scheduler) -> int:
    """Bytes per local job within `scheduler`'s budget: `PIECE`, or a block of a small
    one."""
    return min(PIECE, max(MIN_RUN, scheduler.block_bytes))


def grouped(runs: Iterator[Part], piece: int) -> Iterator[list[Part]]:
    """Runs grouped, and long ones cut, into jobs of about `piece` bytes."""
    job: list[Part] = []
    size = 0
    for file_at, buffer_at, length in runs:
        done = 0
        while done < length:
            take = min(length - done, piece - size)
            job.append((file_at + done, buffer_at + done, take))
            size += take
            done += take
            if size >= piece:
                yield job
                job, size = [], 0
    if job:
        yield job


def read_parts(
    file: str, stored: StoredArray, parts: Iterable[Part], buffer: memoryview, what: str = ""
) -> None:
    """Read each `(file offset, buffer offset, length)` of `parts` from `file` into
    `buffer`; a file that ends too soon is an error naming `what` (default: the
    array)."""
    fd = _open(file, stored)
    try:
        for file_at, buffer_at, length in parts:
            done = pread_into(fd, buffer[buffer_at : buffer_at + length], file_at)
            if done < length:
                raise _ends_early(file, stored, what, file_at, length, file_at + done)
            count_direct(length)
    except OSError as error:
        raise stored.read_error(error) from None
    finally:
        os.close(fd)


def mapped(
    file: str, stored: StoredArray, at: int, shape: tuple[int, ...], dtype: np.dtype[Any]
) -> tuple[mmap.mmap, np.ndarray] | None:
    """The bytes of `file` from `at` as a read-only array of `shape` and `dtype`, over
    a map of the file's pages (no copy), and the map; None where the file cannot be
    mapped (some FUSE and network file systems) or its pages cannot be had, to be read
    instead (which says why). The pages are mapped in at once (`_populated`), not one
    fault at a time as the array is copied."""
    length = math.prod(shape) * dtype.itemsize
    start = at - at % mmap.ALLOCATIONGRANULARITY
    fd = _open(file, stored)
    try:
        size = os.fstat(fd).st_size
        pages = None
        if size >= at + length:
            with contextlib.suppress(OSError, ValueError):
                pages = mmap.mmap(
                    fd, at + length - start, access=mmap.ACCESS_READ, offset=start, **_UNTRACKED
                )
    finally:
        os.close(fd)
    if size < at + length:
        raise _ends_early(file, stored, "", at, length, size)
    if pages is None or not _populated(pages):
        return None
    count_direct(length)
    return pages, np.frombuffer(pages, dtype, math.prod(shape), at - start).reshape(shape)


def _populated(pages: mmap.mmap) -> bool:
    """Map in all of `pages` at once, read from the disk where they are not in the page
    cache (`MADV_POPULATE_READ`, Linux 5.14), as fast to send as a reused buffer where
    a map faulted in page by page is slower (docs/benchmarks.md, section 29). Where that
    is refused (older kernels, gVisor), the disk is only asked for them ahead
    (`MADV_WILLNEED`). False (the map closed) where the
    pages cannot be had: a file cut short or a failing disk, which a read names."""
    if _POPULATE_READ is not None:
        try:
            pages.madvise(_POPULATE_READ)
            return True
        except (OSError, ValueError) as error:
            if getattr(error, "errno", errno.EINVAL) != errno.EINVAL:
                pages.close()
                return False
    with contextlib.suppress(OSError, ValueError, AttributeError):
        pages.madvise(mmap.MADV_WILLNEED)
    return True


_POPULATE_READ: int | None = getattr(
    mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None
)
"""`MADV_POPULATE_READ`, which Python names from 3.12 (22 on Linux); None elsewhere."""

_UNTRACKED: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
"""Where Python can, a map keeps no descriptor of its own (it needs none to be read)."""


def _open(file: str, stored: StoredArray) -> int:
    """A descriptor of `file`, a regular file and the one its store first saw there
    (`Store.open_file`: no other file's bytes in a piece); else `stored`'s read error."""
    try:
        found = stored.store.open_file(file)
    except CorruptCheckpointError as error:  # a FIFO or a device in the file's place
        raise stored.read_error(error) from None
    if found is None:
        gone = errno.ENOENT
        raise stored.read_error(FileNotFoundError(gone, os.strerror(gone), file))
    return found[0]


def _ends_early(
    file: str, stored: StoredArray, what: str, at: int, length: int, end: int
) -> Exception:
    """The error for `file` ending at byte `end`, before `at + length` (said to be a
    changed file by `read_error`)."""
    return stored.read_error(
        CorruptCheckpointError(
            f"{file}: {what or repr(stored.key)} needs bytes {at} to {at + length}, but "
            f"the file ends at byte {end}; it was truncated since it was opened, open it "
            "again"
        )
    )


def read_remote(
    stored: StoredArray, key: str, parts: list[Part], buffer: memoryview
) -> ts.Future[None]:
    """Read each `(file offset, buffer offset, length)` of `parts` of `key` in
    `stored`'s store (a bucket, or a folder over HTTP) into `buffer`: one ranged read
    each, all at once. Over HTTP the bodies land in `buffer` itself; a bucket's reads
    are copied into it as they arrive."""
    reads: list[ts.Future[None]] = []
    for file_at, buffer_at, length in parts:
        view = buffer[buffer_at : buffer_at + length]

        def check(result: Any, view: memoryview = view, file_at: int = file_at) -> None:
            # (a "missing" answer: a file deleted since the open, on a server that
            # cannot say it was there)
            if result.state != "value" or len(result.value) != len(view):
                raise CorruptCheckpointError(
                    f"{stored.store.location}/{key}: {stored.key!r} needs bytes {file_at} to "
                    f"{file_at + len(view)}, but the file ends before or is gone; it was "
                    "truncated or removed since it was opened, open it again"
                )

        reads.append(then(stored.store.read_into(key, file_at, view), check))
    # Settled, and its error made the array's, on lazyckpt's threads, never the storage
    # client's: that (`read_error` asks whether the checkpoint changed) and what callers
    # chain on it (a check that the file is unchanged) may ask the storage again, and
    # would wait forever on a thread the storage needs.
    promise: ts.Promise[None]
    future: ts.Future[None]
    promise, future = ts.Promise.new()

    def settle(done: ts.Future[None]) -> None:
        try:
            done.result()
        except Exception as error:  # noqa: BLE001 - handed to whoever awaits
            promise.set_exception(stored.read_error(error))
        else:
            promise.set_result(None)

    def hop(done: ts.Future[None]) -> None:
        in_pool(lambda: settle(done))

    all_of(reads, lambda error: error).add_done_callback(hop)
    return future
