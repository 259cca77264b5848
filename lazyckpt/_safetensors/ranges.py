"""A safetensors tensor as stored: raw C-order little-endian bytes at a place in its
file (`RangeArray`), read by byte ranges: from a local file by lazyckpt's positioned
reads (`Store.read`), from a bucket through tensorstore's kvstore (s3, gcs), over HTTP
by lazyckpt's client; no mmap, so network filesystems and buckets behave. Its
chunk grid cuts the tensor along its leading dimensions into runs of about
`CHUNK_BYTES` that are contiguous in the file, so a read of a few embedding rows reads
those rows' chunks and the engine's budget holds. Other weight files' raw tensors
(`lazyckpt._weights.arrays`) are RangeArrays too.
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np

from lazyckpt._array.geometry import bounds
from lazyckpt._array.selection import Selection
from lazyckpt._display import given_repr
from lazyckpt._engine.raw import read_raw
from lazyckpt._engine.scheduler import in_pool
from lazyckpt._engine.stored import StoredArray
from lazyckpt._errors import CorruptCheckpointError
from lazyckpt._storage import paths
from lazyckpt._storage.folders import local_copy
from lazyckpt._storage.futures import then
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none

CHUNK_BYTES = 1 << 20
"""About how many bytes of a tensor one chunk of its grid covers."""


@functools.lru_cache(maxsize=4096)  # a model has a few dozen shapes in 100,000 tensors
def contiguous_chunks(
    shape: tuple[int, ...], itemsize: int, target: int = CHUNK_BYTES
) -> tuple[int, ...]:
    """A chunk shape `(1, ..., 1, k, full, ..., full)` of about `target` bytes: every
    chunk is one contiguous run of the C-order bytes.

    >>> contiguous_chunks((50257, 768), 4), contiguous_chunks((4, 8, 1 << 20), 2)
    ((341, 768), (1, 1, 524288))
    """
    if math.prod(max(n, 1) for n in shape) * itemsize <= target:  # (most of a MoE file)
        return tuple(max(n, 1) for n in shape)
    chunks = list(shape)
    inner = itemsize
    for dim in range(len(shape) - 1, -1, -1):
        if inner * shape[dim] <= target:
            inner *= max(shape[dim], 1)
            continue
        chunks[dim] = max(1, target // inner)
        for before in range(dim):
            chunks[before] = 1
        break
    return tuple(max(n, 1) for n in chunks)


@attrs.frozen(eq=False, slots=False)  # (made by the 100,000: see StoredArray)
class RangeArray(StoredArray):
    """A tensor stored as raw C-order little-endian bytes at `start` in its file."""

    start: int = 0
    file: str = attrs.field(default="", repr=given_repr)

    def extent(self) -> tuple[object, int]:
        return (self.store.location, self.name), self.start

    def raw_file(self) -> tuple[str, int] | None:
        if not self.dtype.isnative:
            return None
        if paths.is_remote(self.file):
            local = local_copy(self.file)  # a Hub file in the Hugging Face cache
            return None if local is None else (local, self.start)
        return self.file, self.start

    def remote_raw(self) -> tuple[str, int] | None:
        if not paths.is_remote(self.file) or not self.dtype.isnative or local_copy(self.file):
            return None
        return self.name, self.start

    def open_tensorstore(self) -> ts.Future[ts.TensorStore]:
        return self.open_virtual(self._read_chunk)

    def _read_chunk(
        self, domain: ts.IndexDomain, array: np.ndarray, _: ts.VirtualChunkedReadParameters
    ) -> ts.Future[None]:
        """Fill one chunk of the grid from its byte range. Returns a future instead of
        waiting: a storage client whose threads all waited here would never answer."""
        start, stop = self.chunk_bytes(domain, self.start)

        # (in native byte order, the bytes land in the chunk: a local file's read there)
        into = (
            array.reshape(-1).view(np.uint8).data
            if self.dtype.isnative and array.flags.c_contiguous and array.nbytes == stop - start
            else None
        )

        def fill(result: ts.KvStore.ReadResult) -> None:
            if result.state != "value" or len(result.value) != stop - start:
                raise CorruptCheckpointError(
                    f"{self.file}: tensor {self.key!r} needs bytes {start} to {stop}, but "
                    "the file ends before; it was truncated since it was opened"
                )
            if into is None:
                array[...] = np.frombuffer(result.value, self.dtype).reshape(array.shape)

        # (a local file read by lazyckpt itself, through one descriptor of the file
        # first seen there: no chunk of another file in a result)
        return then(self.store.read(self.name, slice(start, stop), into), fill)

    def read(self, selection: Selection) -> ts.Future[np.ndarray]:
        """The view's elements. Where the whole leading-dimension rows it touches are
        little more than the view (a few embedding rows), they are read as one byte
        range; otherwise by chunks."""
        raw = read_raw(self, selection)
        if raw is not None:  # straight into the result
            return raw
        shape = selection.shape
        box = bounds(selection)
        if not self.shape or 0 in shape or any(high <= low for low, high in box):
            return super().read(selection)
        rows = box[0][1] - box[0][0]
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        wanted = math.prod(shape) * self.dtype.itemsize
        if rows * row_bytes > max(2 * wanted, CHUNK_BYTES):
            return super().read(selection)
        first = box[0][0]
        start = self.start + first * row_bytes

        def pick(result: ts.KvStore.ReadResult) -> np.ndarray:
            if result.state != "value" or len(result.value) != rows * row_bytes:
                raise self.read_error(
                    CorruptCheckpointError(
                        f"{self.file}: tensor {self.key!r} needs bytes {start} to "
                        f"{start + rows * row_bytes}, but the file ends before; it was "
                        "truncated or removed since it was opened"
                    )
                )
            block = np.frombuffer(result.value, self.dtype).reshape((rows, *self.shape[1:]))
            index = _indices(selection)
            index[0] = index[0] - first
            picked = block[np.ix_(*index)].astype(self.dtype.newbyteorder("="))
            return np.ascontiguousarray(picked).reshape(shape)

        def run() -> np.ndarray:
            # On lazyckpt's threads, never the storage client's: what callers chain on
            # this future (a check that the file is unchanged) may ask storage again.
            span = slice(start, start + rows * row_bytes)
            try:
                result = self.store.read(self.name, span).result()
            except Exception as error:  # noqa: BLE001 - tensorstore's, turned into ours
                raise self.read_error(error) from None
            return pick(result)

        return in_pool(run)


def _indices(selection: Selection) -> list[np.ndarray]:
    """Per stored dimension, the stored indices the view reads, in view order."""
    out = []
    for entry in selection.stored:
        if isinstance(entry, int):
            out.append(np.array([entry]))
        else:
            out.append(entry.start + entry.step * np.arange(entry.count))
    return out
