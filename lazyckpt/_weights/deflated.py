"""An array stored in a deflated zip member (`np.savez_compressed`): read by inflating
the member's stream from its start, in pieces, never whole.

A deflate stream has no index: a read of bytes far into it inflates everything
before them. Each array keeps its inflater where the last read left it, and a copy of
it every `MARK_BYTES` of output, so that reading the array's chunks in order inflates
the member once, and a read behind it starts from the nearest copy before it.
Reads in flight at once, which arrive in any order, are served by one pass forward
from the lowest, and a read a little behind it from the last 4 MiB it inflated.
What a member holds is those 4 MiB, one piece of input and the copies (each about
the 32 KiB window of deflate); each read holds its own bytes."""

from __future__ import annotations

import bisect
import collections
import threading
import zlib
from typing import Any

import attrs
import numpy as np

from lazyckpt._engine.scheduler import in_pool
from lazyckpt._engine.stored import StoredArray
from lazyckpt._errors import CorruptCheckpointError
from lazyckpt._storage.futures import then
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._weights.files import File
from lazyckpt._weights.zips import Member, crc_mismatch

PIECE = 1 << 20
"""How many compressed bytes one read takes."""
MARK_BYTES = 4 << 20
"""How often (in inflated bytes) an inflater's state is kept to restart from."""
KEEP_BYTES = 4 << 20
"""How much of what it inflated last an inflater keeps, for reads a little behind."""


class _Wanted:
    """One read waiting for bytes `[low, high)` of the inflated stream."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self.data = bytearray()  # filled from `low` on, in order, as a pass reaches it
        self.error: Exception | None = None

    @property
    def filled(self) -> int:
        return len(self.data)


class Inflater:
    """A deflated `member` of `file` whose data starts at `start`.

    Reads in flight at once (tensorstore asks for a view's chunks together, in any
    order) wait in one list; one thread at a time inflates forward from the lowest
    byte any of them wants and fills each as the stream passes it."""

    def __init__(self, file: File, start: int, member: Member) -> None:
        self.file, self.start, self.member = file, start, member
        self.packed, self.size, self.name = member.packed, member.size, member.name
        self._lock = threading.Condition()
        self._waiting: list[_Wanted] = []
        self._busy = False
        # (inflated offset, compressed offset, inflater) to restart from, by offset.
        self._marks: list[tuple[int, int, Any]] = [(0, 0, zlib.decompressobj(-15))]
        # Where the last pass left off, with the input it took but has not used, and
        # the last `KEEP_BYTES` it inflated, for reads a little behind it.
        self._at: tuple[int, int, Any, bytes] = (0, 0, zlib.decompressobj(-15), b"")
        self._recent: collections.deque[bytes] = collections.deque()  # its last pieces
        self._recent_end = 0  # where they end (a pass adds to them before it ends)
        # The CRC-32 of its first `_crc_done` inflated bytes, checked at its end.
        self._crc, self._crc_done = 0, 0

    def read(self, low: int, high: int) -> bytes:
        """The inflated bytes `[low, high)`."""
        wanted = _Wanted(low, high)
        with self._lock:
            self._check_crc()
            if self._kept() <= low and high <= self._recent_end:
                return self._from_recent(low, high)
            self._waiting.append(wanted)
            while wanted.filled < high - low and wanted.error is None:
                if self._busy:
                    self._lock.wait()
                    continue
                self._busy = True
                try:
                    self._pass()
                except Exception as error:  # noqa: BLE001 - every read waiting fails with it
                    for other in self._waiting:
                        other.error = error
                    self._waiting.clear()
                    # (the inflater moved on without the pass's end: start again)
                    self._recent.clear()
                    self._recent_end = 0
                    self._at = (0, 0, self._marks[0][2].copy(), b"")
                finally:
                    self._busy = False
                    self._lock.notify_all()
        if wanted.error is not None:
            raise wanted.error
        return bytes(wanted.data)

    def _pass(self) -> None:
        """Inflate forward from the lowest byte wanted until no read waits (the lock is
        held, but for the reads of input and the inflating)."""
        kept = self._kept()
        for wanted in self._waiting:  # what the last pass kept
            at = wanted.low + wanted.filled
            if kept <= at < self._recent_end:
                wanted.data += self._from_recent(at, min(self._recent_end, wanted.high))
        self._waiting = [w for w in self._waiting if w.filled < w.high - w.low]
        if not self._waiting:
            return
        low = min(w.low + w.filled for w in self._waiting)
        done, position, inflater, pending = self._resume(low)
        while self._waiting:
            if not pending and position < self.packed:
                stop = min(position + PIECE, self.packed)
                self._lock.release()
                try:
                    pending = self.file.read(
                        self.start + position, self.start + stop, f"member {self.name!r}"
                    )
                finally:
                    self._lock.acquire()
                position = stop
            try:
                piece = inflater.decompress(pending, PIECE)
            except zlib.error as error:
                raise self._damaged(f"it does not inflate ({error})") from None
            pending = inflater.unconsumed_tail
            if not piece:
                if inflater.eof:
                    raise self._damaged(f"its stream ends at {done} of {self.size} bytes")
                if position >= self.packed:  # (nothing to take, nothing held back)
                    raise self._damaged(f"its data ends at {done} of {self.size} bytes")
                continue
            end = done + len(piece)
            if done <= self._crc_done < end:  # (a pass from a mark may overlap it)
                fresh = piece[self._crc_done - done :]
                self._crc, self._crc_done = zlib.crc32(fresh, self._crc), end
                self._check_crc()
            for wanted in self._waiting:
                at = wanted.low + wanted.filled
                if done <= at < end:
                    take = min(end, wanted.high) - at
                    wanted.data += piece[at - done : at - done + take]
            self._waiting = [w for w in self._waiting if w.filled < w.high - w.low]
            self._recent.append(piece)
            self._recent_end = end
            while sum(map(len, self._recent)) - len(self._recent[0]) >= KEEP_BYTES:
                self._recent.popleft()
            done = end
            if done // MARK_BYTES > self._marks[-1][0] // MARK_BYTES:
                self._marks.append((done, position - len(pending), inflater.copy()))
            self._lock.notify_all()
            if self._waiting and min(w.low + w.filled for w in self._waiting) < done:
                break  # (one behind the stream, come while it ran: a new pass)
        self._at = (done, position, inflater, pending)
        if done >= self.size:  # (read to its end: nothing is behind to keep for)
            self._recent.clear()
            self._recent_end = 0

    def _check_crc(self) -> None:
        """Refuse the member once inflated to its end where its CRC-32 is not its
        directory's, as np.load does: a read of its last bytes fails, and every read
        after. (A read of bytes before cannot wait for the end to be checked.)"""
        if self._crc_done >= self.size and self._crc != self.member.crc:
            raise self._damaged(crc_mismatch(self.member, self._crc))

    def _kept(self) -> int:
        """Where what the last pass kept starts."""
        return self._recent_end - sum(map(len, self._recent))

    def _from_recent(self, low: int, high: int) -> bytes:
        """Bytes `[low, high)` of what the last pass kept."""
        out, start = [], self._kept()
        for piece in self._recent:
            end = start + len(piece)
            if start < high and low < end:
                out.append(piece[max(low, start) - start : min(high, end) - start])
            start = end
        return b"".join(out)

    def _resume(self, low: int) -> tuple[int, int, Any, bytes]:
        """Where to inflate from to reach `low`: where the last pass left off, if not
        past `low`, else the nearest kept copy before it."""
        if self._at[0] <= low:  # (a copy: a pass that fails leaves `_at` as it was)
            done, position, inflater, pending = self._at
            return done, position, inflater.copy(), pending
        self._recent.clear()
        self._recent_end = 0
        done, position, inflater = self._marks[
            bisect.bisect_right([m[0] for m in self._marks], low) - 1
        ]
        return done, position, inflater.copy(), b""

    def _damaged(self, found: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.file.path}: compressed member {self.name!r}: {found}; the file is "
            "damaged, download or copy it again"
        )


@attrs.frozen(eq=False)
class DeflatedArray(StoredArray):
    """An array of C-order bytes at `offset` of an inflated member."""

    inflater: Inflater | None = attrs.field(default=None, repr=False)
    offset: int = 0

    def open_tensorstore(self) -> ts.Future[ts.TensorStore]:
        return self.open_virtual(self._read_chunk)

    def _read_chunk(
        self, domain: ts.IndexDomain, array: np.ndarray, _: ts.VirtualChunkedReadParameters
    ) -> ts.Future[None]:
        assert self.inflater is not None
        inflater = self.inflater
        start, stop = self.chunk_bytes(domain, self.offset)

        def fill(data: bytes) -> None:
            array[...] = np.frombuffer(data, self.dtype).reshape(array.shape)

        return then(in_pool(lambda: inflater.read(start, stop), waits=True), fill)
