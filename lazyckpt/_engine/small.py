"""Many small whole arrays read as batches: a `load` of thousands of small arrays
costs a few reads and a copy or a decode per array, not a tensorstore open, a future
chain and a plan per array.

- Raw arrays (safetensors tensors): neighbouring arrays' bytes are one read of up to
  a piece, straight into a buffer whose parts become the results, with no copy and
  no allocation per array: a positioned read in a local file (`_raw_batch`), one
  ranged read in a bucket or over HTTP (`_remote_batch`), where a gap of up to
  `REMOTE_GAP` between neighbours is read rather than cost a request of its own.
- Arrays whose chunks lazyckpt decodes (Orbax's zarr arrays, zstd or raw bytes, in
  zarr3 shards or not): a batch's chunk keys are read in one tensorstore batch (OCDBT
  serves the keys of one data file together; a shard's index first, then its chunks,
  in a second batch), then decoded on the decoding threads into the results
  (`_coded_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import zstandard

from lazyckpt._array.geometry import chunk_box, product
from lazyckpt._array.view import ArrayView
from lazyckpt._engine import raw
from lazyckpt._engine.decode import chunk_error, in_shard, shard_index_range
from lazyckpt._engine.scheduler import Scheduler, in_pool
from lazyckpt._engine.stored import StoredArray, stored_array
from lazyckpt._storage.futures import then
from lazyckpt._storage.kvstore import Store
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none

SMALL = 1 << 20
"""Arrays (and their chunks) up to this size that `load` reads whole are read in
batches."""

GAP = 4 << 10
"""Bytes between two small raw arrays in one file that one read spans rather than
split."""

REMOTE_GAP = 64 << 10
"""As `GAP`, remotely: a request costs a round trip, which carries hundreds of KiB."""

_ALIGN = 64
"""A raw batch's buffer lies at the same offset modulo this as its bytes in the file,
so that every array in it is as aligned in memory as it is in the file."""

_EMPTY = np.empty(0)

BATCH = 1024
"""The most arrays in one batch: later batches' reads are issued while earlier ones
decode."""


def is_small(array: ArrayView) -> bool:
    """Whether `read_small` reads `array`: the whole of a small stored array, in its
    stored dtype, whose bytes lie raw in a local file or in chunks lazyckpt decodes."""
    stored = array.stored
    if (
        not isinstance(stored, StoredArray)
        or array.nbytes > SMALL
        or array.dtype != stored.dtype
        or not array.selection.is_full(stored.shape)
    ):
        return False
    if stored.raw_file() is not None or stored.remote_raw() is not None:
        return True
    codec = stored.codec
    return (
        codec is not None
        and stored.inline is None
        and math.prod(stored.chunks) * stored.dtype.itemsize <= SMALL
    )


def read_small(arrays: Sequence[ArrayView], scheduler: Scheduler) -> list[np.ndarray]:
    """The values of many small arrays (`is_small`), read in batches of up to a piece
    each. A raw result is a view of its batch's buffer, so one result kept alive keeps
    its batch's few MiB; one whose offset in the file does not suit its dtype's
    alignment is copied into its own memory. The list is filled as the reads finish:
    read it after `scheduler.drain()`."""
    out: list[np.ndarray] = [_EMPTY] * len(arrays)
    by_file: dict[str, list[tuple[int, int, int]]] = {}
    by_key: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
    coded: list[int] = []
    for i, array in enumerate(arrays):
        stored = stored_array(array)
        if not array.nbytes:  # (an empty array's offset or chunk means nothing)
            out[i] = np.empty(array.shape, array.dtype)
            continue
        source = stored.raw_file()
        if source is not None:
            file, start = source
            by_file.setdefault(file, []).append((start, start + array.nbytes, i))
            continue
        remote = stored.remote_raw()  # (asked only where the bytes are not local)
        if remote is not None:
            key, start = remote
            by_key.setdefault((id(stored.store), key), []).append((start, start + array.nbytes, i))
        else:
            coded.append(i)
    piece = raw.piece_bytes(scheduler)
    for file, found in by_file.items():
        for batch in _neighbours(found, piece):
            _raw_batch(file, arrays, batch, out, scheduler)
    for (_, key), found in by_key.items():
        for batch in _neighbours(found, raw.request_bytes(scheduler.budget), REMOTE_GAP):
            _remote_batch(key, arrays, batch, out, scheduler)
    decoded: dict[int, int] = {}  # (bytes of each array's chunks, decoded)
    for i in coded:
        stored = stored_array(arrays[i])
        decoded[i] = _chunk_count(stored) * math.prod(stored.chunks) * stored.dtype.itemsize
    chosen: list[int] = []
    size = 0
    for i in coded:
        if chosen and (size + decoded[i] > piece or len(chosen) == BATCH):
            _coded_batch(arrays, chosen, size, out, scheduler)
            chosen, size = [], 0
        chosen.append(i)
        size += decoded[i]
    if chosen:
        _coded_batch(arrays, chosen, size, out, scheduler)
    return out


def _raw_batch(
    file: str,
    arrays: Sequence[ArrayView],
    batch: list[tuple[int, int, int]],
    out: list[np.ndarray],
    scheduler: Scheduler,
) -> None:
    first = batch[0][0]
    size = max(stop for _, stop, _ in batch) - first
    names = (
        f"tensors {arrays[batch[0][2]].key!r} to {arrays[batch[-1][2]].key!r}"
        if len(batch) > 1
        else ""
    )
    stored = stored_array(arrays[batch[0][2]])
    scheduler.guard.keep(size)

    def job() -> None:
        memory = np.empty(size + _ALIGN, np.uint8)
        pad = (first - memory.ctypes.data) % _ALIGN
        buffer = memory[pad : pad + size]
        raw.read_parts(file, stored, [(first, 0, size)], buffer.data, names)
        _place(buffer, first, arrays, batch, out)

    scheduler.submit(lambda: in_pool(job), lambda _: None, held=size, work=size)


def _place(
    buffer: np.ndarray,
    first: int,
    arrays: Sequence[ArrayView],
    batch: list[tuple[int, int, int]],
    out: list[np.ndarray],
) -> None:
    """Each array of `batch` as its part of `buffer` (the bytes from offset `first`);
    copied where the part is not aligned for its dtype, or is asked for twice (tied
    weights: the second its own copy)."""
    seen: set[tuple[int, int]] = set()
    for start, stop, i in batch:
        array = arrays[i]
        values = buffer[start - first : stop - first].view(array.dtype).reshape(array.shape)
        alone = values.flags.aligned and (start, stop) not in seen
        out[i] = values if alone else values.copy()
        seen.add((start, stop))


def _neighbours(
    found: list[tuple[int, int, int]], piece: int, gap: int = GAP
) -> list[list[tuple[int, int, int]]]:
    """`(start, stop, i)` of arrays in one file, in batches of neighbours: no gap over
    `gap`, and up to `piece` bytes."""
    found.sort()
    batches: list[list[tuple[int, int, int]]] = [[]]
    for entry in found:
        batch = batches[-1]
        if batch and (entry[0] - batch[-1][1] > gap or entry[1] - batch[0][0] > piece):
            batches.append(batch := [])
        batch.append(entry)
    return [batch for batch in batches if batch]


def _remote_batch(
    key: str,
    arrays: Sequence[ArrayView],
    batch: list[tuple[int, int, int]],
    out: list[np.ndarray],
    scheduler: Scheduler,
) -> None:
    """One ranged read of neighbouring arrays in a bucket or over HTTP, into one
    buffer whose parts become the results."""
    first = batch[0][0]
    size = max(stop for _, stop, _ in batch) - first
    stored = stored_array(arrays[batch[0][2]])
    scheduler.guard.keep(size)

    def start() -> ts.Future[None]:
        memory = np.empty(size + _ALIGN, np.uint8)
        pad = (first - memory.ctypes.data) % _ALIGN
        buffer = memory[pad : pad + size]
        read = raw.read_remote(stored, key, [(first, 0, size)], buffer.data)
        return then(read, lambda _: _place(buffer, first, arrays, batch, out))

    scheduler.submit(start, lambda _: None, held=size, work=size)


def _chunk_count(stored: StoredArray) -> int:
    return math.prod(-(-n // c) for n, c in zip(stored.shape, stored.chunks, strict=True))


_Value: TypeAlias = "bytes | ts.Future[ts.KvStore.ReadResult] | None"  # a string: ts is deferred
"""Stored bytes read or on their way (None: never written)."""

_Read = tuple[int, tuple[int, ...], str, _Value]
"""A chunk's read: its array's position in the batch, its grid index, its store key,
and its stored bytes (for a chunk in a zarr3 shard, the shard's index)."""

_Request = tuple[Store, str, slice | None]
"""A key to read from a store, whole or a byte range of it."""


def _coded_batch(
    arrays: Sequence[ArrayView],
    batch: list[int],
    decoded: int,
    out: list[np.ndarray],
    scheduler: Scheduler,
) -> None:
    results = sum(arrays[i].nbytes for i in batch)
    scheduler.guard.keep(results)

    def start() -> ts.Future[None]:
        chunks: list[tuple[int, tuple[int, ...], str, int]] = []
        requests: dict[tuple[int, str], int] = {}
        asked: list[_Request] = []
        for i in batch:
            stored = stored_array(arrays[i])
            codec = stored.codec
            assert codec is not None
            for index, key in _chunk_keys(stored):
                # (the chunks of one shard share one read of its index)
                at = requests.setdefault((id(stored.store), key), len(asked))
                if at == len(asked):
                    where = (
                        None
                        if codec.shard is None
                        else shard_index_range(codec, index, stored.chunks)
                    )
                    asked.append((stored.store, key, where))
                chunks.append((i, index, key, at))
        values = _read(asked)
        reads = [(i, index, key, values[at]) for i, index, key, at in chunks]
        return in_pool(lambda: _decode_batch(arrays, reads, out))

    # Held while in flight: the stored bytes and the `decoded` ones (edge chunks
    # whole), beside the results (counted above).
    scheduler.submit(start, lambda _: None, held=2 * decoded, work=results)


def _read(asked: Sequence[_Request]) -> list[_Value]:
    """The values of `asked`, read together in one batch, store by store (through an
    OCDBT database's b-tree index where it was built at open)."""
    values: list[_Value] = [None] * len(asked)
    by_store: dict[int, list[int]] = {}
    for at, (store, _, _) in enumerate(asked):
        by_store.setdefault(id(store), []).append(at)
    with ts.Batch() as together:
        for positions in by_store.values():
            store = asked[positions[0]][0]
            found = store.read_many(
                [asked[at][1] for at in positions],
                [asked[at][2] for at in positions],
                together,
            )
            for at, value in zip(positions, found, strict=True):
                values[at] = value
    return values


def _chunk_keys(stored: StoredArray) -> list[tuple[tuple[int, ...], str]]:
    """Each chunk's grid index and store key (most small arrays are one chunk)."""
    codec = stored.codec
    assert codec is not None
    grid = [range(-(-n // c)) for n, c in zip(stored.shape, stored.chunks, strict=True)]
    if all(len(axis) == 1 for axis in grid):
        index = (0,) * len(grid)
        return [(index, codec.chunk_key(stored.name, index, stored.chunks))]
    return [(index, codec.chunk_key(stored.name, index, stored.chunks)) for index in product(grid)]


def _decode_batch(arrays: Sequence[ArrayView], reads: list[_Read], out: list[np.ndarray]) -> None:
    values = _values(arrays, reads)
    decompressor = zstandard.ZstdDecompressor()
    for (i, index, key, _), data in zip(reads, values, strict=True):
        array = arrays[i]
        stored = stored_array(array)
        chunk = _chunk(stored, index, key, data, decompressor)
        if stored.chunks == stored.shape:  # the chunk is the array: a C-order copy
            out[i] = np.array(chunk, array.dtype, order="C")
            continue
        if out[i] is _EMPTY:
            out[i] = np.empty(array.shape, array.dtype)
        box = chunk_box(index, stored.chunks)
        region = tuple(
            slice(low, min(high, n)) for (low, high), n in zip(box, stored.shape, strict=True)
        )
        out[i][region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]


def _values(arrays: Sequence[ArrayView], reads: list[_Read]) -> list[bytes | None]:
    """Each chunk's stored bytes (None where it was never written): for chunks in
    shards, read now from where their shards' indexes place them, in one batch."""
    found: list[bytes | int | None] = []
    asked: list[_Request] = []
    for i, index, key, read in reads:
        stored = stored_array(arrays[i])
        value = _wait(stored, read)
        codec = stored.codec
        assert codec is not None
        if codec.shard is None or value is None:
            found.append(value)
            continue
        located = in_shard(codec, index, stored.chunks, value)
        if isinstance(located, str):
            raise chunk_error(stored, index, key, located)
        if located is None:
            found.append(None)
        else:
            found.append(len(asked))
            asked.append((stored.store, key, slice(*located)))
    if not asked:
        return found  # type: ignore[return-value]  # (no ints: nothing was asked)
    chunks = _read(asked)
    return [
        _wait(stored_array(arrays[i]), chunks[value]) if isinstance(value, int) else value
        for (i, _, _, _), value in zip(reads, found, strict=True)
    ]


def _wait(stored: StoredArray, read: _Value) -> bytes | None:
    if not isinstance(read, ts.Future):
        return read
    try:
        result = read.result()
    except Exception as error:  # noqa: BLE001 - tensorstore's, turned into ours
        raise stored.read_error(error) from None
    return bytes(result.value) if result.state == "value" else None


def _chunk(
    stored: StoredArray,
    index: tuple[int, ...],
    key: str,
    data: bytes | None,
    decompressor: zstandard.ZstdDecompressor,
) -> np.ndarray:
    """One whole chunk's values, in stored dimension order, from its stored bytes
    (None: never written)."""
    codec = stored.codec
    assert codec is not None
    if data is None:
        if not stored.fill_missing:
            raise chunk_error(
                stored,
                index,
                key,
                "is missing from the store, and this checkpoint writes every chunk",
            )
        return np.full(stored.chunks, codec.fill, stored.dtype)
    total = math.prod(stored.chunks) * stored.dtype.itemsize
    if codec.zstd:
        try:
            declared = zstandard.frame_content_size(data)
            if declared not in (-1, total):  # (checked before decoding: a damaged header)
                raise chunk_error(
                    stored, index, key, f"holds a zstd frame of {declared} bytes, expected {total}"
                )
            data = decompressor.decompress(data, max_output_size=total, allow_extra_data=False)
        except zstandard.ZstdError as error:
            raise chunk_error(stored, index, key, f"does not decode ({error})") from None
    if len(data) != total:
        raise chunk_error(stored, index, key, f"holds {len(data)} decoded bytes, expected {total}")
    values = np.frombuffer(data, stored.dtype.newbyteorder(codec.byteorder))  # type: ignore[arg-type]
    values = values.reshape([stored.chunks[d] for d in codec.order])
    return values.transpose(np.argsort(codec.order))
