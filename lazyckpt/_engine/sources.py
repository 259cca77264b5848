"""Where a decoded chunk's stored bytes come from, a window at a time (`ChunkStream`):
through the store's kvstore (`KvSource`: OCDBT, a bucket, HTTP), or, where they lie
in a local file, by positioned reads into reused memory (`FileSource`).

The file's way is the faster one where the host is slow to hand out fresh memory, as
on a TPU host under gVisor (docs/benchmarks.md, section 29).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

from lazyckpt._errors import CorruptCheckpointError
from lazyckpt._storage.kvstore import Store
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.local import open_file, pread_into
from lazyckpt._storage.metrics import count_direct
from lazyckpt._storage.per_process import PerProcess


class _Windowed:
    """What both sources hand out: whole windows (zstd's reader takes any length), the
    bytes `held` over from one first (the first window, read to check the header, or
    what a `readinto` left of one), then the next window (`_window`)."""

    held: memoryview | bytes

    def _window(self) -> memoryview | bytes:
        raise NotImplementedError

    def read(self, size: int = -1) -> memoryview | bytes:
        if self.held:
            data, self.held = self.held, b""
            return data
        return self._window()

    def readinto(self, memory: memoryview) -> int:
        """Copy the next bytes into `memory`; how many (0 at the end)."""
        data = self.read(len(memory))
        if len(data) > len(memory):  # (bytes arrive in whole windows: keep the rest)
            self.held = data[len(memory) :]
            data = data[: len(memory)]
        memory[: len(data)] = data
        return len(data)


class KvSource(_Windowed):
    """The stored bytes `[start, stop)` of one key (to the value's end when `stop` is
    None), read through `kvstore` in windows of `window` bytes, one window ahead."""

    def __init__(
        self, kvstore: ts.KvStore, key: str, start: int, stop: int | None, window: int
    ) -> None:
        self.kvstore, self.key, self.window, self.stop = kvstore, key, window, stop
        self.next_start = self._origin = start
        self.ahead = self._request()
        self.held = b""

    def _request(self) -> tuple[ts.Future[ts.KvStore.ReadResult], int] | None:
        start = self.next_start
        if self.stop is not None and start >= self.stop:
            return None
        end = start + self.window if self.stop is None else min(start + self.window, self.stop)
        self.next_start = end
        return self.kvstore.read(self.key, byte_range=slice(start, end)), start

    def _take(self) -> tuple[str, bytes]:
        if self.ahead is None:
            return "value", b""
        future, start = self.ahead
        try:
            result = future.result()
        except ValueError as error:
            if self.stop is not None or "OUT_OF_RANGE" not in str(error):
                raise
            # A window past the end of a value of unknown size: read what is left. The
            # window before it was whole, so a value that ends right there is no error
            # (a file read over HTTP says OUT_OF_RANGE, as a server answers 416).
            self.ahead = None
            try:
                result = self.kvstore.read(self.key, byte_range=slice(start, None)).result()
            except ValueError as again:
                if "OUT_OF_RANGE" not in str(again):
                    raise
                return "value", b""
            return result.state, result.value
        if result.state != "value":
            self.ahead = None
            return result.state, b""
        self.ahead = self._request()
        return "value", result.value

    def check_length(self, length: int) -> bool:
        """Whether the bytes hold at least `length` from where they start."""
        if self.stop is not None:
            return self.stop - self._origin >= length
        last = self._origin + length - 1
        try:
            result = self.kvstore.read(self.key, byte_range=slice(last, last + 1)).result()
        except ValueError as error:
            if "OUT_OF_RANGE" not in str(error):
                raise
            return False
        return bool(result.state == "value")

    def first(self) -> str:
        """Read the first window; the key's state (`value` or `missing`)."""
        state, self.held = self._take()
        return state

    def _window(self) -> bytes:
        return self._take()[1]

    def close(self) -> None:
        self.ahead = None
        self.held = b""


class FileSource(_Windowed):
    """The bytes `[start, stop)` of the local file `path` (to its end when `stop` is
    None), read with positioned reads into two buffers of `window` bytes, the next
    one filled ahead on a reading thread while the caller works through the one it
    was handed. zstandard's stream reader asks for more input only once it has used
    all it was given, so the buffer handed over before is free to fill again.

    A file that is missing reads as a missing value where its length is not known (a
    chunk never written, in a folder); where it is (a database's data file, whose
    index places a value there), a missing or short file is a `CorruptCheckpointError`
    naming it, as in `lazyckpt._storage.ocdbt`. Where a `store` is given, one that is
    not the file it first saw there is a `CheckpointChangedError`
    (`Store.open_file`): each chunk opens its data file again."""

    def __init__(
        self, path: str, start: int, stop: int | None, window: int, store: Store | None = None
    ) -> None:
        self.path, self.window = path, window
        self._process = os.getpid()
        self._origin = self._next = start
        self._known = stop is not None
        self.fd: int | None = None
        self.stop = stop
        found = open_file(path) if store is None else store.open_file(path)
        if found is not None:
            self.fd = found[0]
            if stop is None:
                self.stop = found[1].st_size
        self._buffers = [_windows.take(window), _windows.take(window)]
        self._turn = 0
        self._ahead: concurrent.futures.Future[memoryview] | None = None
        self.held: memoryview | bytes = b""

    def _request(self) -> None:
        assert self.fd is not None and self.stop is not None
        start, end = self._next, min(self._next + self.window, self.stop)
        self._next = end
        if start >= end:
            self._ahead = None
            return
        buffer = memoryview(self._buffers[self._turn])[: end - start]
        self._turn ^= 1
        self._ahead = _READS.get().submit(self._fill, self.fd, buffer, start)

    def _fill(self, fd: int, buffer: memoryview, start: int) -> memoryview:
        done = pread_into(fd, buffer, start)
        count_direct(done)
        if done < len(buffer):
            raise CorruptCheckpointError(
                f"{self.path}: holds {start + done} bytes, but the checkpoint places "
                f"bytes up to {start + len(buffer)} in it; it was truncated or replaced, "
                "copy the checkpoint again"
            )
        return buffer

    def _window(self) -> memoryview | bytes:
        if self._ahead is None:
            return b""
        data = self._ahead.result()
        self._request()
        return data

    def check_length(self, length: int) -> bool:
        """Whether the bytes hold at least `length` from where they start."""
        return self.stop is not None and self.stop - self._origin >= length

    def first(self) -> str:
        """Read the first window; `missing` where the file is (and may be)."""
        if self.fd is None:
            if self._known:
                raise CorruptCheckpointError(
                    f"{self.path} is missing, and the checkpoint places bytes "
                    f"{self._origin} to {self.stop} in it; copy the checkpoint again"
                )
            return "missing"
        self._request()
        self.held = self._window()
        return "value"

    def close(self) -> None:
        """Close the file once (a close that fails is not tried again: its number may
        be another file's by then), and hand the windows on."""
        if os.getpid() != self._process:  # (in a fork: no reading thread, no windows here)
            self._ahead, self._buffers, self.held = None, [], b""
            self._close_file()
            return
        if self._ahead is not None:  # (its buffer is written until it is done)
            concurrent.futures.wait([self._ahead])
            self._ahead = None
        buffers, self._buffers, self.held = self._buffers, [], b""
        for buffer in buffers:
            _windows.give(buffer)
        self._close_file()

    def _close_file(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class _Windows:
    """Buffers of open file sources, handed on to the next ones as sources close: the
    pages of a buffer made anew are faulted in again (slow under gVisor), those of
    one handed on are not. No more are kept free than are in use (what the sources
    open now will hand back anyway), and none once none is in use."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)  # (a lock held at the fork)

    def reset(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}
        self._kept = 0
        self._taken = 0

    def take(self, size: int) -> bytearray:
        with self._lock:
            self._taken += 1
            free = self._free.get(size)
            if free:
                self._kept -= 1
                return free.pop()
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            self._taken -= 1
            if self._kept < self._taken:
                self._free.setdefault(len(buffer), []).append(buffer)
                self._kept += 1
            while self._kept > max(0, self._taken):  # (fewer in use: let go of the rest)
                size = next((size for size, free in self._free.items() if free), None)
                if size is None:
                    break
                self._free[size].pop()
                self._kept -= 1


_windows = _Windows()
_READS = PerProcess(
    lambda: concurrent.futures.ThreadPoolExecutor(
        max(4, os.cpu_count() or 1), thread_name_prefix="lazyckpt-read"
    )
)
"""The threads that read file sources' windows ahead (a forked child makes its own)."""
