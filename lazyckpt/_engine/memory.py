"""Host memory: result buffers, the process's growth during a read, glibc's thresholds.

Results of 1 MiB or more are mapped on their own (returned to the OS when freed, and
without transparent huge pages); a `MemoryGuard` trims what the allocator keeps once
the process has grown by more than the read should hold; `settle_allocator` fixes
glibc's mmap and trim thresholds where that was measured to matter, unless the caller
opts out with `malloc_tuning(False)`.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import ctypes
import errno
import functools
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from lazyckpt._array.geometry import box_shape
from lazyckpt._errors import TooLargeError
from lazyckpt._text import human_bytes

Box = tuple[tuple[int, int], ...]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
# glibc's mallopt parameters (malloc.h), and Linux's madvise advice.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE
MMAP_THRESHOLD = 16 << 20
"""Buffers at least this large are mapped on their own, and unmapped when freed."""
MAPPED_BYTES = 1 << 20
"""Results at least this large get memory mapped for them alone (`result_empty`)."""

_TUNING: contextvars.ContextVar[bool] = contextvars.ContextVar("lazyckpt_malloc", default=True)


@contextlib.contextmanager
def malloc_tuning(enabled: bool) -> Iterator[None]:
    """Within this block, lazyckpt leaves glibc's malloc thresholds as they are (with
    `False`), or sets them as it does by default (`True`).

    By default every read with a budget fixes glibc's mmap threshold at 16 MiB and
    its trim threshold at a quarter of the budget (at most 32 MiB), process-wide: with
    glibc's dynamic thresholds, freed chunk buffers stayed in per-thread arenas and a
    256 MiB stream of 32 MiB chunks grew the process by 334 MiB. The settings outlast
    the call (glibc cannot report the old ones). Setting `MALLOC_MMAP_THRESHOLD_`,
    `MALLOC_TRIM_THRESHOLD_` or `LAZYCKPT_KEEP_MALLOC` in the environment opts out for
    the whole process.

    >>> with lazyckpt.malloc_tuning(False):
    ...     values = lazyckpt.load(lazyckpt.open(path)["params"]["b"])
    """
    token = _TUNING.set(enabled)
    try:
        yield
    finally:
        _TUNING.reset(token)


def physical_memory() -> int:
    """This machine's memory and swap, in bytes: more than any one read can use."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(total)


@functools.cache
def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(what: str, nbytes: int) -> None:
    """Refuse, with a clear error, to allocate more than this machine has: a damaged
    header can declare any size, and allocating it would abort the process."""
    if nbytes <= _ram():
        return  # (without reading /proc: this runs for every array read)
    if nbytes > physical_memory():
        raise TooLargeError(
            f"{what} needs {human_bytes(nbytes)}, more than this machine's memory and swap "
            f"({human_bytes(physical_memory())}); read a slice of it, or stream it with "
            "lazyckpt.iter_blocks"
        )


def check_total(label: str, sizes: Sequence[tuple[str, int]]) -> None:
    """Refuse, before any is allocated, results (`(key, bytes)` each) that together
    need more than this machine's memory and swap, naming the largest: each may fit
    on its own (`check_fits`), and all of them kill the process."""
    total = sum(n for _, n in sizes)
    if total <= _ram():
        return
    capacity = physical_memory()
    if total > capacity:
        largest = sorted(sizes, key=lambda item: -item[1])[:3]
        check_fits(f"{largest[0][0]}: a result", largest[0][1])  # (one alone: read a slice)
        named = ", ".join(f"{key} ({human_bytes(n)})" for key, n in largest)
        raise TooLargeError(
            f"{label}: the {len(sizes):,} arrays to read need {human_bytes(total)} in all, "
            f"more than this machine's memory and swap ({human_bytes(capacity)}); the "
            f"largest: {named}. Read fewer at once (select=), or stream them with "
            "lazyckpt.iter_blocks"
        )


@contextlib.contextmanager
def allocating(what: str, nbytes: int) -> Iterator[None]:
    """Within this block, a failure to allocate `nbytes` for `what` (NumPy's
    `MemoryError`; mmap's ENOMEM, under an address-space limit) is `TooLargeError`."""
    try:
        yield
    except TooLargeError:
        raise
    except (MemoryError, OSError) as error:
        if isinstance(error, OSError) and error.errno != errno.ENOMEM:
            raise
        raise TooLargeError(
            f"{what} needs {human_bytes(nbytes)}, which could not be allocated "
            f"({type(error).__name__}: {error}): the process is out of memory, or of what "
            "a limit (ulimit -v, a container's) lets it have. Read fewer arrays at once "
            "(select=), a slice, or stream them with lazyckpt.iter_blocks"
        ) from None


def release_free_memory() -> None:
    """Return freed memory that glibc's arenas keep to the OS (malloc_trim)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(ctypes.c_size_t(0))


def settle_allocator(budget: int) -> None:
    """Fix glibc's mmap and trim thresholds, so that freed read buffers are returned.

    By default glibc raises both thresholds each time a large mapped buffer is freed
    (up to 32 MiB and 64 MiB), after which decoded chunks come from per-thread
    arenas that each keep up to 64 MiB when freed. Here buffers of `MMAP_THRESHOLD`
    and more are mapped alone, and an arena keeps at most a quarter of the budget free
    at its top (so that the next block reuses the last one's memory rather than
    faulting it in again). See `malloc_tuning` for the measurements and opting out.
    """
    if not _TUNING.get() or any(
        os.environ.get(name)
        for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LAZYCKPT_KEEP_MALLOC")
    ):
        return
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        trim = min(max(budget // 4, 1 << 20), 2 * MMAP_THRESHOLD)
        _LIBC.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD))
        _LIBC.mallopt(ctypes.c_int(_M_TRIM_THRESHOLD), ctypes.c_int(trim))


def _rss() -> int | None:
    """The process's resident bytes, read again from a `/proc/self/statm` kept open:
    a placement looks often, and opening it for each look cost several times reading it
    again (docs/benchmarks.md, section 29). A descriptor that fails, or
    reads what is not statm (closed behind lazyckpt's back, its number taken by
    another file), is let go of unclosed and the file opened again, once."""
    for _ in range(2):
        statm = _STATM
        try:
            with statm.lock:
                if statm.fd is None or statm.pid != os.getpid():  # (a fork that ran no hooks)
                    statm.open()
                assert statm.fd is not None
                fields = os.pread(statm.fd, 128, 0).split()
            if len(fields) == 7 and all(field.isdigit() for field in fields):
                return int(fields[1]) * _PAGE
        except OSError:
            pass
        statm.fd = None  # (not closed: its number may be another file's by now)
    return None


class _Statm:
    """This process's `/proc/self/statm`, opened at the first look: its descriptor, and
    which process and file it was opened by and for."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.pid = 0
        self.identity = (0, 0)
        self.lock = threading.Lock()

    def open(self) -> None:
        self.fd = None
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        found = os.fstat(fd)
        self.fd, self.pid, self.identity = fd, os.getpid(), (found.st_dev, found.st_ino)

    def close_if_ours(self) -> None:
        """Close the descriptor where it is still the file it was opened on."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            found = os.fstat(fd)
            if (found.st_dev, found.st_ino) == self.identity:
                os.close(fd)


_STATM = _Statm()


def _forget_statm() -> None:
    """In a forked child, whose inherited descriptor reads the parent's numbers."""
    global _STATM
    _STATM.close_if_ours()
    _STATM = _Statm()


os.register_at_fork(after_in_child=_forget_statm)


CHECK_SECONDS = 0.005
"""The least time between two looks at the process's size (`MemoryGuard.check`)."""


class MemoryGuard:
    """Trims freed memory when the process has grown by more than it should.

    A read may grow the process by its results, the blocks in flight and a little
    slack. Freed buffers that the allocator keeps beyond that are returned to the OS;
    trimming only then avoids refaulting memory that is within the budget anyway.
    """

    def __init__(self, budget: int) -> None:
        self.slack = budget // 4
        self.start = self.baseline = _rss()
        self.left: float = math.inf
        """The process's size after the last trim that returned little."""
        self.results = 0
        self._lock = threading.Lock()
        self._checked = -math.inf

    def keep(self, nbytes: int) -> None:
        """Count `nbytes` of results: memory the read is meant to leave behind."""
        with self._lock:
            self.results += nbytes

    def check(self, in_flight: int) -> None:
        if self.start is None:
            return
        moment = time.monotonic()
        if moment - self._checked < CHECK_SECONDS:
            return  # (reading the RSS costs a file read: not for each of many small jobs)
        self._checked = moment
        now = _rss()
        if now is None or self.baseline is None:
            return
        bound = self.results + in_flight + self.slack
        within = now - self.baseline <= bound
        if within or now < self.left - self.slack:
            self.start = self.baseline  # (what a trim could not return is gone, or going)
            self.left = math.inf
        if within:
            return
        if now - self.start <= bound:
            return  # (over only by what a trim could not return before)
        release_free_memory()
        after = _rss()
        if after is not None and now - after < self.slack // 2:
            # Little came back: the rest is not the allocator's to return (a device
            # runtime's staging buffers, say). Trimmed for again only once the process
            # grows past this (a trim is costly, and one placement tried it again and
            # again: docs/benchmarks.md, section 29), or from the start again once the
            # process is back within bounds or has shrunk by the slack since.
            self.start, self.left = max(self.start, after - bound), after


@attrs.define(eq=False)
class Destination:
    """Where the engine puts the view's elements in `region` (half-open per view
    dimension): the buffer `out`.

    Without `out`, the engine allocates it, once, from whichever thread writes first,
    or adopts the array that a read of the whole region returns (no copy); `aligned`
    asks for a 64-byte aligned buffer.
    """

    region: Box
    dtype: np.dtype[Any]
    aligned: bool = False
    out: np.ndarray | None = None
    on_allocate: Callable[[int], None] | None = None
    """Told the size of `out` when the engine allocates it."""
    pool: BufferPool | None = None
    """Where `out` comes from when the engine allocates it (else fresh memory)."""
    key: str | None = None
    """The key of the array it is a result of, for errors."""
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.region)

    def out_nbytes(self) -> int:
        return math.prod(self.shape) * int(np.dtype(self.dtype).itemsize)

    def buffer(self) -> np.ndarray:
        if self.out is None:
            with self._lock:
                if self.out is None:
                    what = f"a result of shape {self.shape} ({np.dtype(self.dtype)})"
                    what = what if self.key is None else f"{self.key}: {what}"
                    check_fits(what, self.out_nbytes())
                    with allocating(what, self.out_nbytes()):
                        if self.pool is not None:
                            out = self.pool.empty(self.shape, self.dtype)
                        else:
                            out = result_empty(self.shape, self.dtype, what)
                    if self.on_allocate is not None:
                        self.on_allocate(out.nbytes)
                    self.out = out
        return self.out


def result_empty(shape: Sequence[int], dtype: npt.DTypeLike, what: str | None = None) -> np.ndarray:
    """An uninitialized array to read results into, starting on a 64-byte boundary
    so that `jax.device_put` on CPU adopts it without a copy.

    Large ones are mapped on their own: page-aligned, returned to the OS as soon as
    they are freed, and without the transparent huge pages NumPy asks for, whose
    faults stall on the kernel's synchronous compaction (docs/benchmarks.md, Design
    measurements). `what` names it in the `TooLargeError` of a failed allocation.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    with allocating(what or f"a result of shape {tuple(shape)} ({dtype})", nbytes):
        if nbytes < MAPPED_BYTES:
            return aligned_empty(shape, dtype)
        out: np.ndarray = np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)
    return out


class BufferPool:
    """Result buffers of `MAPPED_BYTES` or more, whose memory is used again once nothing
    refers to them.

    Faulting in fresh pages can cost more than filling them, most of all under gVisor
    (docs/benchmarks.md, section 29). The pool
    keeps each buffer's memory (an anonymous map) and only a weak reference to the
    array it handed out over it, which every view of that array keeps alive: a block
    that a caller still holds, or that a transfer still reads from, is never written
    again. A buffer comes back when that array is gone (the reference's callback).
    Free buffers are let go, largest first, where keeping them would take what the
    pool holds past `limit` bytes, or what it keeps free past `keep`.
    """

    def __init__(
        self, limit: int, keep: int | None = None, release: Callable[[], None] | None = None
    ) -> None:
        self.limit = limit
        self.keep = limit if keep is None else keep
        self.release = release
        """Called before new memory is made while some buffers are out: lets what keeps
        arrays of the pool's past their use let go (JAX, of host arrays it sent to an
        accelerator: `lazyckpt._device.shard.release_sent`)."""
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self._in_use: dict[int, weakref.ref[np.ndarray]] = {}  # by id() of the map
        self._back: collections.deque[mmap.mmap] = collections.deque()
        """Maps whose arrays are gone, put here by the references' callbacks (which may
        run on any thread, even one inside `empty`: a deque, no lock)."""
        self._held = 0

    @property
    def held(self) -> int:
        """Bytes of every buffer the pool keeps, in use or free."""
        return self._held

    def empty(self, shape: Sequence[int], dtype: npt.DTypeLike) -> np.ndarray:
        """An uninitialized array, in a free buffer of the pool where one is large enough
        and at most twice the size (the smallest such), else in new memory (as
        `result_empty`)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MAPPED_BYTES:
            return aligned_empty(shape, dtype)
        if self.release is not None and self._in_use and not self._fits(nbytes):
            self.release()  # (new memory costs more than asking)
        with self._lock:
            self._take_back()
            fits = self._fitting(nbytes)
            memory = min(fits, key=len) if fits else mmap.mmap(-1, nbytes)
            if fits:
                self._free.remove(memory)
            else:
                self._held += nbytes
            self._let_go()
            whole = np.frombuffer(memory, np.uint8)
            back = self._back

            def came_back(_: object, memory: mmap.mmap = memory) -> None:
                back.append(memory)

            self._in_use[id(memory)] = weakref.ref(whole, came_back)
        return whole[:nbytes].view(dtype).reshape(shape)

    def _fits(self, nbytes: int) -> bool:
        """Whether a free buffer (or one come back) can hold `nbytes`."""
        with self._lock:
            self._take_back()
            return bool(self._fitting(nbytes))

    def _fitting(self, nbytes: int) -> list[mmap.mmap]:
        """The free buffers that `empty` may fill with `nbytes`: large enough, and at
        most twice the size."""
        return [m for m in self._free if nbytes <= len(m) <= 2 * nbytes]

    def settle(self) -> None:
        """Let go of free buffers beyond the pool's bounds now, not at the next `empty`
        (which may never come: the next array may be read by tensorstore)."""
        with self._lock:
            self._take_back()
            self._let_go()

    def _take_back(self) -> None:
        while self._back:
            memory = self._back.popleft()
            del self._in_use[id(memory)]
            self._free.append(memory)

    def _let_go(self) -> None:
        self._free.sort(key=len)
        while self._free and (self._held > self.limit or sum(map(len, self._free)) > self.keep):
            self._held -= len(self._free.pop())


def held_bytes(values: np.ndarray) -> int:
    """The host memory that keeping `values` keeps: all of the array it is a view of."""
    base: Any = values
    while isinstance(base.base, np.ndarray):
        base = base.base
    return int(base.nbytes)


def aligned_empty(shape: Sequence[int], dtype: npt.DTypeLike, alignment: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on an `alignment`-byte boundary, which
    lets `jax.device_put` on CPU adopt it without a copy."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    out: np.ndarray = raw[offset : offset + nbytes].view(dtype).reshape(shape)
    return out


def populate(memory: memoryview) -> None:
    """Fault in the pages of `memory` in one call (Linux's MADV_POPULATE_WRITE), before
    decoding into it: one system call instead of a fault per 4 KiB page, on the
    decoding thread. Does nothing where the kernel or memory does not allow it."""
    if _LIBC is None or len(memory) < 16 * _PAGE:
        return
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    start = -(-address // _PAGE) * _PAGE
    end = (address + len(memory)) // _PAGE * _PAGE
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE)
