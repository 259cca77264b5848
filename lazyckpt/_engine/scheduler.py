"""Running reads within a host-memory budget, and the threads that decode chunks.

A `Scheduler` starts jobs (tensorstore reads, chunk decodes, writes) while the bytes
they hold stay within the budget, and finishes them in the order they started on the
calling thread. Chunk decoding runs on a small pool of threads (`in_pool`): zstandard
releases the GIL while it decodes, so the pool keeps every core busy.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

from lazyckpt._engine.memory import BufferPool, MemoryGuard, settle_allocator
from lazyckpt._engine.progress import Progress
from lazyckpt._storage import network
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.per_process import PerProcess

T = TypeVar("T")

DEFAULT_MEMORY_BUDGET = min(1 << 30, max(64 << 20, (32 << 20) * (os.cpu_count() or 1)))
"""Host bytes that reads may hold at once unless a call asks otherwise: 32 MiB per
core, at least 64 MiB and at most 1 GiB; enough blocks in flight to keep every core
decoding, and little more."""
# What a block read by tensorstore holds in flight, in multiples of its decoded size:
# its stored bytes and the chunk decoded from them (a third copy counted left too few
# blocks in flight; docs/benchmarks.md, section 14).
HELD = 2
_BLOCKS_IN_FLIGHT = 4

MIN_BLOCK = 64 << 10
"""The smallest block a stream cuts: a decoding job holds a read window of 256 KiB
whatever the budget, and a block of a few bytes would cost a job, a destination and
a plan each (an 8 MiB chunk at `memory_budget=64` once planned a million bands, 1.3 GiB,
before its first block)."""


def stream_block(budget: int) -> int:
    """The bytes of one block of a stream within `budget`: an eighth of it, at least
    `MIN_BLOCK`."""
    return max(MIN_BLOCK, budget // 8)


def pool_size() -> int:
    """Decoding threads: one per core, at least two (reading overlaps decoding)."""
    return max(2, os.cpu_count() or 1)


def waiting_pool_size() -> int:
    """Threads for jobs that mostly wait on the network: one per connection a server
    may have (`NetworkOptions.connections`, when the pool starts), at least as many as
    decode."""
    return max(pool_size(), network.options().connections)


# Made at first use, and again in a forked child, which has none of their threads.
_POOL = PerProcess(lambda: concurrent.futures.ThreadPoolExecutor(pool_size(), "lazyckpt-decode"))
_WAITING_POOL = PerProcess(
    lambda: concurrent.futures.ThreadPoolExecutor(waiting_pool_size(), "lazyckpt-wait")
)


def in_pool(fn: Callable[[], T], *, waits: bool = False) -> ts.Future[T]:
    """Run `fn` on the decoding threads; a tensorstore future of its result. A job that
    `waits` on the network for most of its time (decoding a chunk read over HTTP, or
    from a bucket: a round trip per window) runs on threads of its own, as many as
    `waiting_pool_size`, so that reads in flight are not held to the cores; callers
    bound how many such jobs run by the memory each holds."""
    pool = (_WAITING_POOL if waits else _POOL).get()
    promise: ts.Promise[T]
    future: ts.Future[T]
    promise, future = ts.Promise.new()

    def run() -> None:
        try:
            promise.set_result(fn())
        except BaseException as error:  # noqa: BLE001 - handed to whoever awaits
            promise.set_exception(error)

    pool.submit(run)
    return future


class Scheduler:
    """Runs jobs with at most `budget` bytes held by those in flight (one job at least).

    Completion work (copies, casts, device transfers) runs on the calling thread,
    in the order jobs were started.
    """

    def __init__(self, budget: int | None, progress: Progress | None = None) -> None:
        self.budget = DEFAULT_MEMORY_BUDGET if budget is None else int(budget)
        if self.budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, not {budget}")
        # Blocks small enough that several fit, to keep every core decoding.
        self.block_bytes = max(1, self.budget // (HELD * _BLOCKS_IN_FLIGHT))
        self.stream_block = stream_block(self.budget)
        """The bytes of one block of a stream within this budget (`stream.read_blocks`)."""
        self.progress = progress
        self._pending: collections.deque[tuple[ts.Future[Any], int, int, Callable[[Any], None]]]
        self._pending = collections.deque()
        self._in_flight = 0
        self.guard = MemoryGuard(self.budget)
        self.pool: BufferPool | None = None
        """Where blocks streamed within this budget are filled (`stream.read_blocks`)."""
        settle_allocator(self.budget)

    def submit(
        self,
        start: Callable[[], ts.Future[T]],
        done: Callable[[T], None],
        *,
        held: int,
        work: int,
    ) -> None:
        """Start a job that holds `held` bytes while in flight once the budget allows;
        `work` is what it counts for on the progress bar."""
        while self._pending and self._in_flight + held > self.budget:
            self._finish_oldest()
        self._in_flight += held
        self._pending.append((start(), held, work, done))

    def drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def finish_one(self) -> bool:
        """Finish the oldest job in flight, if any; whether there was one."""
        if not self._pending:
            return False
        self._finish_oldest()
        return True

    def abandon(self) -> None:
        """Wait for every job still in flight, discarding results and errors; after a
        failure, so that nothing touches the caller's buffers or files afterwards."""
        while self._pending:
            future, held, _, _ = self._pending.popleft()
            with contextlib.suppress(Exception):  # the first failure is already raised
                future.result()
            self._in_flight -= held

    def _finish_oldest(self) -> None:
        future, held, work, done = self._pending.popleft()
        try:
            done(future.result())
        except BaseException:
            self.abandon()
            raise
        finally:
            self._in_flight -= held
        self.guard.check(self._in_flight)
        if self.progress is not None:
            self.progress.advance(work)
