"""Pieces whose bytes lie raw in a local file, sent to their devices by threads of
their own (`Senders`), for `lazyckpt._device.staged`.

What the runtime does on the host for one transfer, before and after the copy, runs on
the thread that sends: several sending threads let several transfers run at once. A
piece that is one run of the file's bytes (a whole tensor, a band of its rows) is sent
from a map of the file's pages, so that the runtime copies it straight out of the
page cache: no read into a buffer, and no fresh memory to fault in, which on a TPU
host cost more than the copy. Its map is let go once its transfer is done. A piece of
many runs (a column shard), or a file that cannot be mapped, is read into a buffer of
the placement's pool in parts, by several reading threads at once, since one
positioned read of a large piece runs on one core at a fraction of the page cache's
speed. The pieces between their read (or map) and the end of their transfer are held
within a bound of their own (`Senders.hold`).

A file cut short while one of its maps is being sent ends the process with SIGBUS, as
it does for any reader that maps files (`safetensors.safe_open`, `np.load(mmap_mode=)`):
a file cut short before its piece is mapped is a `CheckpointChangedError`, as a read's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import mmap
import threading
from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from lazyckpt._array.geometry import Box, box_bytes, box_shape, slices
from lazyckpt._device.shard import Shard, release_sent
from lazyckpt._engine.memory import BufferPool, held_bytes
from lazyckpt._engine.progress import Progress
from lazyckpt._engine.raw import Part, grouped, local_runs, mapped, read_parts
from lazyckpt._engine.stored import StoredArray, stored_array
from lazyckpt._lazy import LazyArray


def direct_reads(array: LazyArray, fill: Sequence[tuple[Shard, Box]]) -> list[Read]:
    """`fill`'s pieces as reads of raw bytes in a local file, for `Senders`; none
    where some piece is smaller than `SENT_ALONE`, its bytes do not lie raw there or
    its devices adopt host memory."""
    reads = []
    for shard, piece in fill:
        large = box_bytes(piece, shard.dtype.itemsize) >= SENT_ALONE
        found = local_runs(array, piece) if shard.copies and large else None
        if found is None:
            return []
        reads.append(Read(shard, piece, *found, stored_array(array)))
    return reads


SENT_ALONE = 8 << 20
"""The smallest piece `Senders` reads and sends; smaller ones go to the engine, which
keeps up to half the budget in flight where each sending thread waits for one
(provisional: only 64 MiB pieces were measured on the chip). Measured:
docs/benchmarks.md, section 29."""


@attrs.frozen
class Read:
    """A piece of a shard whose bytes lie raw in `file`, in `runs` (made as read)."""

    shard: Shard
    piece: Box
    file: str
    runs: Iterator[Part]
    stored: StoredArray


class Senders:
    """Pieces whose bytes lie raw in a local file, each read into a buffer from `pool`
    (in parts, by `_READERS` threads at once) and sent by one of `_SENDERS` threads,
    which waits for its transfer before it takes the next. The pieces between their
    read and the end of their transfer hold at most `limit` bytes (one piece at least),
    and where a buffer used again is larger than its piece (at most twice), its extra
    besides: within twice `limit`. A placement gives them half its budget, and its
    other half reads nothing meanwhile (the engine's fills come after).

    Sent from one thread (the scheduler's completions), what the runtime does on the
    host for each transfer ran one at a time; here each thread sends and waits for its
    own, and a piece's parts are read at once (docs/benchmarks.md, section 29).
    """

    def __init__(self, limit: int, pool: BufferPool, progress: Progress | None) -> None:
        self.limit, self.pool, self.progress = limit, pool, progress
        self.held = 0
        self._room = threading.Condition()
        self._failed: list[BaseException] = []
        self._readers: concurrent.futures.Executor
        self.maps = Maps()

    def run(self, reads: Sequence[Read]) -> None:
        """Send every one of `reads`; the first failure stops the threads (each
        finishes the piece it has) and is raised once they have."""
        pending = iter(reads)
        lock = threading.Lock()

        def work() -> None:
            while not self._failed:
                with lock:
                    read = next(pending, None)
                if read is None:
                    return
                self._send(read)

        count = min(_SENDERS, len(reads))
        with (
            concurrent.futures.ThreadPoolExecutor(_READERS, "lazyckpt-read") as self._readers,
            concurrent.futures.ThreadPoolExecutor(count, "lazyckpt-send") as threads,
        ):
            running = [threads.submit(work) for _ in range(count)]
            try:
                concurrent.futures.wait(running)
            except BaseException as error:  # (interrupted: the threads stop too)
                self._fail(error)
                raise
        self.maps.settle()
        if self._failed:
            raise self._failed[0]
        for thread in running:  # (a failure outside a piece's own, which `_send` keeps)
            thread.result()

    def hold(self, nbytes: int) -> bool:
        """Hold `nbytes` more once they fit `limit` (at once where nothing is held);
        False (and nothing held) where a thread failed meanwhile."""
        with self._room:
            self._room.wait_for(
                lambda: not self.held or self.held + nbytes <= self.limit or self._failed
            )
            if self._failed:
                return False
            self.held += nbytes
            return True

    def grow(self, nbytes: int) -> None:
        """Hold `nbytes` more at once."""
        with self._room:
            self.held += nbytes

    def release(self, nbytes: int) -> None:
        with self._room:
            self.held -= nbytes
            self._room.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._room:
            self._failed.append(error)
            self._room.notify_all()

    def _send(self, read: Read) -> None:
        shard, piece = read.shard, read.piece
        nbytes = box_bytes(piece, shard.dtype.itemsize)
        if not self.hold(nbytes):
            return
        held = [nbytes]
        try:
            self._fill_and_send(read, held)
        except BaseException as error:  # noqa: BLE001 - raised by `run`
            self._fail(error)  # (before its bytes are let go: no thread takes another)
            return
        finally:
            self.release(held[0])
        if self.progress is not None:
            self.progress.advance(nbytes)

    def _fill_and_send(self, read: Read, held: list[int]) -> None:
        """Send `read`'s piece, from a map of its file where it is one run of the
        file's bytes (`SENT_FROM_MAPS`), else read into a buffer of the pool; `held`,
        the bytes it holds, grows where that buffer is larger than the piece."""
        import jax

        shard, piece = read.shard, read.piece
        at, runs = _one_run(read.runs, held[0])
        found = None
        one_run = SENT_FROM_MAPS and at is not None and at % shard.dtype.itemsize == 0
        if one_run and self.maps.reserve():
            assert at is not None
            found = mapped(read.file, read.stored, at, box_shape(piece), shard.dtype)
            if found is None:
                self.maps.cancel()
        if found is not None:
            pages, values = found
            del found
            try:
                jax.block_until_ready(shard.write(slices(piece, shard.region), values))
                del values
            finally:
                self.maps.let_go(pages)
            return
        values = self.pool.empty(box_shape(piece), shard.dtype)
        # A buffer used again may be larger, at most twice the piece: memory the pool
        # holds already, held at once (waiting for it while holding the piece could
        # wait forever).
        extra = held_bytes(values) - held[0]
        self.grow(extra)
        held[0] += extra
        self._read(read, runs, values.reshape(-1).view(np.uint8).data)
        jax.block_until_ready(shard.write(slices(piece, shard.region), values))
        # (the buffer goes back to the pool with `values`)

    def _read(self, read: Read, runs: Iterator[Part], buffer: memoryview) -> None:
        """`runs` of `read` into `buffer`, in parts of about `READ_PART` bytes read at
        once by the reading threads; the first error is raised once every part is done
        with `buffer`."""
        parts: list[concurrent.futures.Future[None]] = []
        try:
            for job in grouped(runs, READ_PART):
                parts.append(self._readers.submit(read_parts, read.file, read.stored, job, buffer))
        finally:  # (the runs may fail as they are made: the parts sent off finish first)
            concurrent.futures.wait(parts)
        for part in parts:
            part.result()


def _one_run(runs: Iterator[Part], nbytes: int) -> tuple[int | None, Iterator[Part]]:
    """Where `runs` (of a piece of `nbytes`) are one run of consecutive bytes, where in
    the file it starts; and the runs, for reading them."""
    first = next(runs, None)
    if first is None:
        return None, runs
    if first[1:] == (0, nbytes):
        return first[0], iter((first,))
    return None, itertools.chain((first,), runs)


class Maps:
    """The maps of pieces sent, until each is unmapped. JAX keeps a host array it sent
    until its garbage-collector callback runs (`release_sent`), so a map whose
    transfer is done may still be referred to: its pages are dropped from the process
    at once (a file's pages, read again if touched), and it is unmapped at a later
    turn, or when JAX lets go. Before Python 3.13 each map holds a file descriptor
    (Python's `mmap` keeps one): with `KEPT_MAPS` of them out, further pieces are read
    instead."""

    def __init__(self) -> None:
        self._kept: list[mmap.mmap] = []
        self._out = 0  # maps being made or sent
        self._lock = threading.Lock()

    def reserve(self) -> bool:
        """Whether another piece may be sent from a map: if so, counted out until
        `let_go` or `cancel`."""
        with self._lock:
            if self._out + len(self._kept) >= KEPT_MAPS:
                return False
            self._out += 1
            return True

    def cancel(self) -> None:
        """A reserved map that was not made."""
        with self._lock:
            self._out -= 1

    def let_go(self, pages: mmap.mmap) -> None:
        """Let go of `pages`, whose transfer is done (or failed): unmapped where nothing
        refers to it, else its pages dropped and the map kept, to be unmapped later."""
        try:
            release_sent()
        finally:
            kept = not _closed(pages)
            if kept:
                with contextlib.suppress(OSError, AttributeError, ValueError):  # (a hint)
                    pages.madvise(mmap.MADV_DONTNEED)
            with self._lock:
                self._out -= 1
                self._kept = [p for p in self._kept if not _closed(p)] + [pages] * kept

    def settle(self) -> None:
        """Unmap the maps kept that nothing refers to any more."""
        release_sent()
        with self._lock:
            self._kept = [pages for pages in self._kept if not _closed(pages)]


def _closed(pages: mmap.mmap) -> bool:
    """Close `pages`, where nothing refers to it any more."""
    try:
        pages.close()
    except BufferError:
        return False
    return True


KEPT_MAPS = 64
"""The most maps of pieces out at once, being sent or still referred to once sent
(each holds a file descriptor); further pieces are read instead."""


SENT_FROM_MAPS = True
"""Whether a piece that is one run of the file's bytes (a whole tensor, a band of its
rows) is sent from a map of the file's pages, with no read into a buffer of the pool:
the runtime copies it straight out of the page cache, where fresh buffers are slow to
fault in. Measured: docs/benchmarks.md, section 29."""

_SENDERS = 3
"""Threads of `Senders`, each sending one piece at a time."""

_READERS = 6
"""Threads reading the senders' pieces, in parts of `READ_PART` bytes."""

READ_PART = 16 << 20
"""Bytes of a piece that one reading thread reads: several threads reading parts of a
piece move more than one positioned read of it whole. Measured: docs/benchmarks.md,
section 29."""
