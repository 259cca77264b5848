"""An array stored in a deflated zip member (`np.savez_compressed`): read by inflating
the member's stream from its start, in pieces, never whole.

A deflate stream has no index: a read of bytes far into it inflates everything
before them. Each array keeps its inflater where the last read left it, and a copy of
it every `MARK_BYTES` of output, so that reading the array's chunks in order inflates
the member once, and a read out of order starts from the nearest copy before it.
What a read holds is its chunk, one piece of input and the copies (each about the
32 KiB window of deflate)."""

from __future__ import annotations

import bisect
import threading
import zlib
from typing import Any

import attrs
import numpy as np
import tensorstore as ts

from lazyckpt._engine.scheduler import in_pool
from lazyckpt._engine.stored import StoredArray
from lazyckpt._errors import CorruptCheckpointError
from lazyckpt._storage.kvstore import ready, then
from lazyckpt._weights.files import File

PIECE = 1 << 20
"""How many compressed bytes one read takes."""
MARK_BYTES = 16 << 20
"""How often (in inflated bytes) an inflater's state is kept to restart from."""


class Inflater:
    """A deflated member of `file`: `packed` bytes at `start`, `size` bytes inflated."""

    def __init__(self, file: File, start: int, packed: int, size: int, name: str) -> None:
        self.file, self.start, self.packed, self.size, self.name = file, start, packed, size, name
        self._lock = threading.Lock()
        # (inflated offset, compressed offset, inflater) to restart from, by offset.
        self._marks: list[tuple[int, int, Any]] = [(0, 0, zlib.decompressobj(-15))]
        # Where the last read left off, with the input it took but has not used yet.
        self._at: tuple[int, int, Any, bytes] = (0, 0, zlib.decompressobj(-15), b"")

    def read(self, low: int, high: int) -> bytes:
        """The inflated bytes `[low, high)`."""
        with self._lock:
            done, position, inflater, pending = self._resume(low)
            out = []
            while done < high:
                if not pending:
                    if position >= self.packed:
                        raise self._damaged(f"its data ends at {done} of {self.size} bytes")
                    stop = min(position + PIECE, self.packed)
                    pending = self.file.read(
                        self.start + position, self.start + stop, f"member {self.name!r}"
                    )
                    position = stop
                try:
                    piece = inflater.decompress(pending, min(PIECE, high - done))
                except zlib.error as error:
                    raise self._damaged(f"it does not inflate ({error})") from None
                pending = inflater.unconsumed_tail
                if not piece and inflater.eof:
                    raise self._damaged(f"its stream ends at {done} of {self.size} bytes")
                if done + len(piece) > low:
                    out.append(piece[max(0, low - done) :])
                done += len(piece)
                if done // MARK_BYTES > self._marks[-1][0] // MARK_BYTES:
                    self._marks.append((done, position - len(pending), inflater.copy()))
            self._at = (done, position, inflater, pending)
        return b"".join(out)[: high - low]

    def _resume(self, low: int) -> tuple[int, int, Any, bytes]:
        """Where to inflate from to reach `low`: where the last read left off, if not
        past `low`, else the nearest kept copy before it."""
        if self._at[0] <= low:
            return self._at
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
        return ready(
            ts.virtual_chunked(
                self._read_chunk,
                dtype=ts.dtype(self.dtype.newbyteorder("=").name),
                shape=self.shape,
                chunk_layout=ts.ChunkLayout(read_chunk_shape=self.chunks),
                context=self.store.context,
            )
        )

    def _read_chunk(
        self, domain: ts.IndexDomain, array: np.ndarray, _: ts.VirtualChunkedReadParameters
    ) -> ts.Future[None]:
        assert self.inflater is not None
        inflater = self.inflater
        low = [d.inclusive_min for d in domain]
        high = [d.exclusive_max - 1 for d in domain]
        size = self.dtype.itemsize
        first = int(np.ravel_multi_index(tuple(low), self.shape)) if self.shape else 0
        last = int(np.ravel_multi_index(tuple(high), self.shape)) if self.shape else 0
        start, stop = self.offset + first * size, self.offset + (last + 1) * size

        def fill(data: bytes) -> None:
            array[...] = np.frombuffer(data, self.dtype).reshape(array.shape)

        return then(in_pool(lambda: inflater.read(start, stop), waits=True), fill)
