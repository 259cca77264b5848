"""Whole arrays of an Orbax checkpoint over HTTP read in large ranges of its OCDBT data
files, straight into their results, and decoded there.

Through tensorstore's drivers (and the relay) each chunk that lazyckpt decodes is
read in windows of its own, a round trip each. Where whole arrays of an OCDBT
database over HTTP are wanted and its b-tree was walked (`_storage.ocdbt.Index`),
every chunk's byte range in the data files is known at once: neighbours (at most
`REMOTE_GAP` apart) are read together, in requests as large as keep every connection
busy (`NetworkOptions.connections`), and each request's body lands in the arrays'
own results (`Store.read_scattered`). A chunk's stored bytes land at the end of the
memory its values fill, and zstd decodes them from there towards its start
(`decode.decode_in_place`); uncompressed ones land where they belong. Nothing is held
besides the results but the decoders' windows: a whole tree comes in at the link's
speed in about its own size of memory (docs/benchmarks.md, section 25).

A chunk qualifies where its values fill a run of its array's C-order memory (one
chunk per array, or chunks cut along one dimension, with no partial edge chunk), in
the stored byte order and dimension order, and its bytes lie in a data file, no more
of them than its values (zstd's frame of incompressible values is a few bytes more).
An array with a chunk that does not (inline in the b-tree, never written,
incompressible) keeps the engine's other paths (`fill`, `small`), whose errors say
what is wrong.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence

import attrs
import numpy as np

from lazyckpt._array.geometry import product
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.decode import chunk_error, decode_in_place
from lazyckpt._engine.memory import Destination
from lazyckpt._engine.raw import MIN_REQUEST
from lazyckpt._engine.scheduler import Scheduler, in_pool
from lazyckpt._engine.small import REMOTE_GAP
from lazyckpt._engine.stored import StoredArray
from lazyckpt._errors import LazyckptError
from lazyckpt._storage import network
from lazyckpt._storage.futures import all_of, ready, then
from lazyckpt._storage.kvstore import Store
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none


@attrs.define(eq=False)
class _Chunk:
    """One stored chunk to read: where its bytes lie, and the memory its values fill."""

    stored: StoredArray
    index: tuple[int, ...]
    key: str
    file: str
    offset: int
    length: int
    out: memoryview
    """Its values' bytes in the result; its stored bytes land at the end."""
    parts: int = 0
    """Requests that carry some of its bytes and have not arrived."""

    @property
    def landing(self) -> int:
        """Where in `out` its stored bytes start."""
        return len(self.out) - self.length

    def fail(self, what: str) -> LazyckptError:
        return chunk_error(self.stored, self.index, self.key, what)


@attrs.frozen
class _Request:
    """One ranged read of a data file, and the chunks whose bytes it carries."""

    store: Store
    file: str
    start: int
    stop: int
    chunks: tuple[_Chunk, ...]


def schedule_coalesced(arrays: Sequence[ArrayView], scheduler: Scheduler) -> dict[int, Destination]:
    """Read the arrays of `arrays` that qualify, each whole, in coalesced requests:
    their destinations by position in `arrays` (the others are the caller's to read)."""
    planned: dict[int, Destination] = {}
    chunks: list[_Chunk] = []
    for at, array in enumerate(arrays):
        places = _places(array)
        if places:
            destination = Destination(
                tuple((0, n) for n in array.shape), array.dtype, key=array.key
            )
            destination.on_allocate = scheduler.guard.keep
            planned[at] = destination
            chunks.extend(_chunks(array, places, destination))
    if not chunks:
        return planned
    size = _request_bytes(sum(chunk.length for chunk in chunks))
    lock = threading.Lock()
    for request in _requests(chunks, size):
        work = sum(len(chunk.out) for chunk in request.chunks if _last_part(request, chunk))
        gaps = (request.stop - request.start) - sum(_carried(request, c) for c in request.chunks)

        def start(request: _Request = request) -> ts.Future[None]:
            return _read(request, lock)

        scheduler.submit(start, lambda _: None, held=gaps, work=work)
    return planned


def read_whole(array: ArrayView) -> ts.Future[np.ndarray] | None:
    """A future of the whole of `array`, read in coalesced requests all at once into
    its result (nothing else held), where it qualifies; None otherwise."""
    places = _places(array)
    if not places:
        return None
    destination = Destination(tuple((0, n) for n in array.shape), array.dtype, key=array.key)
    chunks = _chunks(array, places, destination)
    lock = threading.Lock()
    size = _request_bytes(sum(chunk.length for chunk in chunks))
    reads = [_read(request, lock) for request in _requests(chunks, size)]
    # Settled once every request ended: none still writes into the result after a failure.
    return then(all_of(reads, lambda error: error), lambda _: destination.buffer())


def _request_bytes(total: int) -> int:
    """Bytes per request for reads of `total` bytes: shared among the connections (so
    that every one is busy), at least `MIN_REQUEST`, at most
    `NetworkOptions.request_bytes`."""
    options = network.options()
    return max(MIN_REQUEST, min(options.request_bytes, -(-total // options.connections)))


_Place = tuple[tuple[int, ...], str, str, int, int]
"""A chunk's grid index and key, and the data file, offset and length of its bytes."""


def _places(array: ArrayView) -> list[_Place] | None:
    """Where each chunk of the whole of `array` lies, in C order of its grid, where
    every one qualifies (the module's docstring says how); None otherwise."""
    stored = array.stored
    if not isinstance(stored, StoredArray) or not stored.store.scatters:
        return None  # (most arrays: not over HTTP, or a composed view)
    store, codec = stored.store, stored.codec
    native = "<" if np.little_endian else ">"
    if (
        codec is None
        or stored.inline is not None
        or 0 in array.shape
        or store.index is None
        or codec.shard is not None
        or codec.order != tuple(range(len(stored.shape)))
        or codec.byteorder not in ("|", native)
        or array.dtype != stored.dtype
        or not array.selection.is_full(stored.shape)
        or not _runs_of_memory(stored.shape, stored.chunks)
    ):
        return None
    grid = [range(n // c) for n, c in zip(stored.shape, stored.chunks, strict=True)]
    keys = [(index, codec.chunk_key(stored.name, index, stored.chunks)) for index in product(grid)]
    places = store.index.places(len(keys))
    if places is None:
        return None
    size = math.prod(stored.chunks) * stored.dtype.itemsize
    found = []
    for index, key in keys:
        place = places.get(key.encode())
        if not isinstance(place, tuple):  # inline, or never written
            return None
        file, offset, length = place
        if length > size or (not codec.zstd and length != size):
            return None  # (incompressible, or damaged: read as the engine reads it)
        found.append((index, key, file, offset, length))
    return found


def _chunks(array: ArrayView, places: list[_Place], destination: Destination) -> list[_Chunk]:
    """The chunks at `places`, each with the part of `destination` (the whole array, C
    order) its values fill: in C order of the grid, one after the other
    (`_runs_of_memory`)."""
    stored = array.stored
    assert isinstance(stored, StoredArray)
    size = math.prod(stored.chunks) * stored.dtype.itemsize
    memory = destination.buffer().reshape(-1).view(np.uint8).data
    return [
        _Chunk(stored, index, key, file, offset, length, memory[n * size : (n + 1) * size])
        for n, (index, key, file, offset, length) in enumerate(places)
    ]


def _runs_of_memory(shape: tuple[int, ...], chunks: tuple[int, ...]) -> bool:
    """Whether each chunk fills one run of the array's C-order memory, with none past
    its edge: chunks of 1 along the dimensions before one, whole along those after it,
    and a whole number of them along it."""
    cut = [d for d, (n, c) in enumerate(zip(shape, chunks, strict=True)) if n != c]
    if not cut:
        return True
    last = cut[-1]
    return shape[last] % chunks[last] == 0 and all(chunks[d] == 1 for d in cut[:-1])


def _requests(chunks: list[_Chunk], size: int) -> list[_Request]:
    """The requests that read `chunks`: each data file's chunks in order, neighbours
    together, a run cut into equal requests of about `size` bytes (at least
    `MIN_REQUEST`). A chunk whose bytes overlap another's (the same array asked
    twice) is read in a run of its own."""
    by_file: dict[tuple[int, str], list[_Chunk]] = {}
    for chunk in chunks:
        by_file.setdefault((id(chunk.stored.store), chunk.file), []).append(chunk)
    requests = []
    for found in by_file.values():
        found.sort(key=lambda chunk: chunk.offset)
        runs: list[list[_Chunk]] = []
        for chunk in found:
            end = runs[-1][-1].offset + runs[-1][-1].length if runs else 0
            if runs and end <= chunk.offset <= end + REMOTE_GAP:
                runs[-1].append(chunk)
            else:
                runs.append([chunk])
        for run in runs:
            requests.extend(_cut(run, size))
    return requests


def _cut(run: list[_Chunk], size: int) -> list[_Request]:
    """A run of neighbouring chunks as equal requests of about `size` bytes (never a
    sliver left over), each listing the chunks it carries bytes of."""
    start, stop = run[0].offset, run[-1].offset + run[-1].length
    length = stop - start
    count = min(-(-length // size), max(1, length // MIN_REQUEST))
    cuts = [start + length * i // count for i in range(count + 1)]
    requests = []
    for low, high in itertools.pairwise(cuts):
        carried = tuple(c for c in run if c.offset < high and c.offset + c.length > low)
        for chunk in carried:
            chunk.parts += 1
        requests.append(_Request(run[0].stored.store, run[0].file, low, high, carried))
    return requests


def _carried(request: _Request, chunk: _Chunk) -> int:
    """How many of `chunk`'s bytes `request` carries."""
    low = max(request.start, chunk.offset)
    return min(request.stop, chunk.offset + chunk.length) - low


def _last_part(request: _Request, chunk: _Chunk) -> bool:
    """Whether `request` carries `chunk`'s last bytes (counts its values once)."""
    return request.stop >= chunk.offset + chunk.length


def _scatter(request: _Request) -> list[memoryview]:
    """Where the request's body goes: each chunk's part at its place in the chunk's
    landing, the bytes between chunks into a scratch buffer."""
    views = []
    at = request.start
    for chunk in request.chunks:
        low = max(at, chunk.offset)
        if low > at:
            views.append(memoryview(bytearray(low - at)))
        high = min(request.stop, chunk.offset + chunk.length)
        begin = chunk.landing + low - chunk.offset
        views.append(chunk.out[begin : begin + high - low])
        at = high
    return views


def _read(request: _Request, lock: threading.Lock) -> ts.Future[None]:
    """Read `request` into place, then decode the chunks whose last bytes it brought,
    on the decoding threads."""
    first = request.chunks[0]
    read = request.store.read_scattered(request.file, request.start, _scatter(request))

    def arrived(answer: ts.KvStore.ReadResult) -> ts.Future[None]:
        if answer.state != "value":  # (as `ocdbt.Index` says it)
            where = f"bytes {first.offset} to {first.offset + first.length}"
            raise first.stored.read_error(
                ValueError(
                    f"the b-tree places a value at {where} of data file {request.file!r}, "
                    "which is missing"
                )
            )
        with lock:
            complete = []
            for chunk in request.chunks:
                chunk.parts -= 1
                if not chunk.parts:
                    complete.append(chunk)
        return in_pool(lambda: _decode(complete)) if complete else ready(None)

    return then(read, arrived, first.stored.read_error)


def _decode(chunks: list[_Chunk]) -> None:
    for chunk in chunks:
        if chunk.stored.codec is not None and chunk.stored.codec.zstd:
            decode_in_place(chunk.out, chunk.length, chunk.fail)
