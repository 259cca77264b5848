"""The stored-array contract of the engine: one array as stored, its chunk keys and
codec, and its reads through tensorstore. Orbax's zarr arrays are this class; a format
whose arrays tensorstore cannot open by a driver (safetensors' byte ranges) subclasses
it and supplies `open_tensorstore`."""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import numpy as np

from lazyckpt._array.compose import sources
from lazyckpt._array.geometry import Box, box_bytes, chunk_count
from lazyckpt._array.selection import Selection
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.memory import check_fits
from lazyckpt._engine.scheduler import HELD
from lazyckpt._errors import CorruptCheckpointError, LazyckptError
from lazyckpt._storage import paths
from lazyckpt._storage.futures import ready, then
from lazyckpt._storage.kvstore import Store
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.per_process import tensorstore_io
from lazyckpt._text import ascii_int


def in_array(name: str, key: str) -> str:
    """The store key `key` of the array stored under `name`, joined as tensorstore
    joins a path and a key: with a `/` between, unless `name` is empty or ends with
    one (Orbax's array `trail/` keeps its metadata at `trail/.zarray`)."""
    if not name or name.endswith("/"):
        return name + key
    return f"{name}/{key}"


@attrs.frozen
class ChunkKeys:
    """Where an array's chunks are stored: the key of each cell of its grid (a chunk,
    or with zarr3's `sharding_indexed` a shard of whole chunks), under its name."""

    separator: str
    """Between chunk indices in chunk keys."""
    prefix: str = ""
    """Before the chunk indices: `c/` for zarr3's default key encoding."""
    shard: tuple[int, ...] | None = None
    """zarr3 `sharding_indexed`: the shard shape, a whole number of read chunks."""

    def cells(self, chunks: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one stored cell: the shard, else the chunk."""
        return self.shard if self.shard is not None else chunks

    def key(self, name: str, cell: tuple[int, ...]) -> str:
        """The store key of the cell at grid position `cell`."""
        if cell:
            key = self.prefix + self.separator.join(str(i) for i in cell)
        else:
            key = self.prefix.rstrip("/") or "0"  # zarr3's `c`, zarr2's `0`
        return in_array(name, key)

    def parse(self, name: str, key: str, rank: int) -> tuple[int, ...] | None:
        """The grid position of a store key of this array; None for other keys
        (its metadata, stray files)."""
        head = in_array(name, self.prefix)
        if rank == 0:
            return () if key == self.key(name, ()) else None
        if not key.startswith(head):
            return None
        # Indices as tensorstore writes them: ASCII, no leading zero. Keys it never
        # reads (`00.0` beside `0.0`, thousands of digits) are stray, not chunks.
        parts = key[len(head) :].split(self.separator)
        if len(parts) != rank:
            return None
        cell = []
        for part in parts:
            index = ascii_int(part) if part[:1] != "0" or part == "0" else None
            if index is None:
                return None
            cell.append(index)
        return tuple(cell)


@attrs.frozen
class Codec:
    """How one stored chunk's bytes become its values, for chunks lazyckpt decodes."""

    zstd: bool
    """Compressed as one zstd frame; else the raw bytes."""
    byteorder: str
    """`<` or `>` as stored; `|` for one-byte types."""
    order: tuple[int, ...]
    """The stored dimension behind each dimension of the decoded byte stream, which is
    in C order: identity for C order, reversed for zarr v2's F order, or zarr3's
    `transpose`."""
    keys: ChunkKeys
    index_at_end: bool = True
    index_byteorder: str = "<"
    index_checksum: bool = True
    fill: object = 0
    """The value of elements in a chunk that was never written."""

    @property
    def shard(self) -> tuple[int, ...] | None:
        return self.keys.shard

    def chunk_key(self, name: str, index: tuple[int, ...], chunks: tuple[int, ...]) -> str:
        """The store key of the chunk (for shards, of the shard) at grid `index`."""
        if self.shard is not None:
            index = tuple(i * c // s for i, c, s in zip(index, chunks, self.shard, strict=True))
        return self.keys.key(name, index)

    def position_in_shard(self, index: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, int]:
        """The chunk's entry in its shard's index, and the number of entries."""
        assert self.shard is not None
        counts = [s // c for s, c in zip(self.shard, chunks, strict=True)]
        position = 0
        for i, count in zip(index, counts, strict=True):
            position = position * count + i % count
        return position, math.prod(counts)


_METADATA = (".zarray", "zarr.json")


_OPENING = tuple(threading.Lock() for _ in range(64))
"""Each held while the first `open` of the arrays hashed to it starts (it checks
their files, as many as an OCDBT database's, so arrays opened at once mostly take
different locks): not a lock (and a list) per array, which cost 15 MiB of the
135 MiB that opening 92,000 safetensors tensors took."""


@attrs.frozen(eq=False, slots=False)
class StoredArray:
    """One array as stored: its zarr driver, shape, dtype and chunking.

    Not slotted, nor are its subclasses for tensors by the 100,000 (`RangeArray`):
    attrs sets a frozen slotted instance's 15 fields by `object.__setattr__` one call
    each, and a frozen dict instance's in its dict: opening many tensors is faster
    for a little more memory (docs/benchmarks.md, section 28).
    """

    store: Store = attrs.field(repr=False)
    key: str
    name: str
    driver: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    chunks: tuple[int, ...]
    fill_missing: bool
    inline: np.ndarray | None = attrs.field(default=None, repr=False)
    """The values themselves, for arrays kept in the legacy msgpack file."""
    codec: Codec | None = attrs.field(default=None, repr=False)
    """How its chunks are encoded, where lazyckpt decodes them itself."""
    checksummed: bool = attrs.field(default=False, repr=False)
    """Whether its chunks carry checksums that reading verifies (`ZarrInfo`)."""
    keys: ChunkKeys | None = attrs.field(default=None, repr=False)
    """Where its chunks are stored, when lazyckpt knows the key encoding."""
    _opened: ts.Future[ts.TensorStore] | None = attrs.field(default=None, init=False, repr=False)
    """Set once, by the first `open`."""

    def open(self) -> ts.Future[ts.TensorStore]:
        """Open the array once; later calls share the same future.

        Only for tensorstore's reads, which decode a stored chunk whole: a chunk that
        cannot fit in memory is refused before tensorstore would try (and abort)."""
        if self.inline is None:
            chunk = math.prod(self.chunks) * self.dtype.itemsize
            check_fits(f"a stored chunk of {self.key!r} ({self.chunks})", chunk)
            tensorstore_io(f"{self.store.location}: {self.key}")
        opened = self._opened
        if opened is None:
            with _OPENING[hash(self) % len(_OPENING)]:
                opened = self._opened
                if opened is None:
                    opened = self._first_open()
                    object.__setattr__(self, "_opened", opened)
        return opened

    def _first_open(self) -> ts.Future[ts.TensorStore]:
        if self.inline is not None:
            return ready(ts.array(self.inline))
        opened: ts.Future[ts.TensorStore] = then(ready(None), self._open_checked)
        return then(opened, self._check, self.read_error)

    def _open_checked(self, _: None) -> ts.Future[ts.TensorStore]:
        # Opening reads the array's metadata (in an OCDBT database, the b-tree too).
        self.store.check_files(in_array(self.name, name) for name in _METADATA)
        return self.open_tensorstore()

    def open_tensorstore(self) -> ts.Future[ts.TensorStore]:
        """The array as a TensorStore, through its zarr driver: what a subclass for
        another format replaces."""
        return ts.open(self._spec(), context=self.store.context, open=True)

    def open_virtual(self, read_chunk: Callable[..., ts.Future[None]]) -> ts.Future[ts.TensorStore]:
        """The array as tensorstore's virtual chunks on its grid, each filled by
        `read_chunk(domain, array, parameters)`: for a format whose bytes lazyckpt reads
        itself (raw ranges of a file, an inflated stream)."""
        return ready(
            ts.virtual_chunked(
                read_chunk,
                dtype=ts.dtype(self.dtype.newbyteorder("=").name),
                shape=self.shape,
                chunk_layout=ts.ChunkLayout(read_chunk_shape=self.chunks),
                context=self.store.context,
            )
        )

    def chunk_bytes(self, domain: ts.IndexDomain, origin: int) -> tuple[int, int]:
        """The bytes that the elements of `domain` span, in C order, where element 0
        is at byte `origin`: from its first element to one past its last."""
        low = tuple(d.inclusive_min for d in domain)
        high = tuple(d.exclusive_max - 1 for d in domain)
        first = int(np.ravel_multi_index(low, self.shape)) if self.shape else 0
        last = int(np.ravel_multi_index(high, self.shape)) if self.shape else 0
        size = self.dtype.itemsize
        return origin + first * size, origin + (last + 1) * size

    def _spec(self) -> dict[str, object]:
        kvstore = dict(self.store.kvstore_spec)
        if self.name:
            kvstore["path"] = kvstore.get("path", "") + in_array(self.name, "")
        return {
            "driver": self.driver,
            "kvstore": kvstore,
            "recheck_cached_data": False,
            "recheck_cached_metadata": False,
            "fill_missing_data_reads": self.fill_missing,
        }

    def _check(self, opened: ts.TensorStore) -> ts.TensorStore:
        found = (tuple(opened.shape), opened.dtype.numpy_dtype)
        # (tensorstore holds values in native byte order, whatever the stored order)
        if found != (self.shape, self.dtype.newbyteorder("=")):
            raise CorruptCheckpointError(
                f"{self.store.location}: array {self.key!r} changed on disk: expected "
                f"shape {self.shape} and dtype {self.dtype}, found {found[0]} and {found[1]}; "
                "open the checkpoint again"
            )
        return opened

    def read(self, selection: Selection) -> ts.Future[np.ndarray]:
        """Read exactly the stored elements that `selection` picks, as its view."""
        shape = selection.shape
        check_fits(f"reading {self.key!r} {shape}", math.prod(shape) * self.dtype.itemsize)
        if 0 in shape:
            return ready(np.empty(shape, self.dtype))
        index: list[int | slice] = []
        flips: list[int] = []
        for stored in selection.stored:
            if isinstance(stored, int):
                index.append(stored)
                continue
            low, high = stored.bounds
            if stored.step < 0:
                flips.append(sum(isinstance(i, slice) for i in index))
            index.append(slice(low, high, abs(stored.step)))

        def finish(data: np.ndarray) -> np.ndarray:
            if flips:
                data = np.ascontiguousarray(np.flip(data, axis=tuple(flips)))
            return data.reshape(shape)

        region = tuple(index)
        read: ts.Future[np.ndarray] = then(self.open(), lambda t: self.read_region(t, region))
        return then(read, finish, self.read_error)

    def read_region(
        self, opened: ts.TensorStore, region: tuple[int | slice, ...]
    ) -> ts.Future[Any]:
        """`opened[region].read()`, once the local files it reads are known to be
        regular files (`Store.check_files`): never a wait on a FIFO."""
        self.store.check_files(self._region_keys(region))
        return opened[region].read()

    def _region_keys(self, region: tuple[int | slice, ...]) -> Iterator[str]:
        """The store keys of the chunks (or shards) that `region` touches; where the key
        encoding is unknown, every file in the array's folder."""
        if self.keys is None:
            folder = os.path.join(self.store.location, self.name)
            for parent, _, names in os.walk(folder):
                yield from (
                    os.path.relpath(os.path.join(parent, n), self.store.location) for n in names
                )
            return
        spans = []
        for item, size, cell in zip(region, self.shape, self.keys.cells(self.chunks), strict=True):
            low, high, _ = item.indices(size) if isinstance(item, slice) else (item, item + 1, 1)
            spans.append(range(low // cell, -(-high // cell)))
        for position in itertools.product(*spans):
            yield self.keys.key(self.name, position)

    def extent(self) -> tuple[object, int]:
        """`(place, byte offset)`: where its C-order bytes begin in a space of bytes
        that other arrays may share (a file: `RangeArray`s), for counting each stored
        byte once (`_engine.workload`); a space of its own by default."""
        return self, 0

    def raw_file(self) -> tuple[str, int] | None:
        """`(local file, byte offset)` where the whole array lies as plain C-order bytes
        in native byte order, for reads straight into place (`lazyckpt._engine.raw`);
        None where it is encoded, chunked or remote."""
        return None

    def remote_raw(self) -> tuple[str, int] | None:
        """`(key in its store, byte offset)` where the whole array lies as plain C-order
        bytes in native byte order in a bucket or over HTTP, for batched ranged reads
        (`lazyckpt._engine.small`); None elsewhere."""
        return None

    def read_error(self, error: Exception) -> Exception:
        """The error to show for a failed read of this array's data: that the checkpoint
        was replaced, where it was, else that its files are damaged."""
        if self.store.changed():
            return self.store.changed_error()
        if isinstance(error, LazyckptError):
            return error
        return paths.read_failure(  # (lazyckpt's own error, where its client failed a read)
            error,
            lambda text: CorruptCheckpointError(
                f"{self.store.location}: reading array {self.key!r} (stored as {self.name!r}) "
                f"failed: {text}; the checkpoint's files are missing or damaged, copy it again"
            ),
        )


def stored_array(array: ArrayView) -> StoredArray:
    """The `StoredArray` behind a view of one, for code that reads stored arrays
    (composed views are lowered into such views before they get there)."""
    stored = array.stored
    assert isinstance(stored, StoredArray), f"{array.key}: a composed view, not lowered"
    return stored


CHUNK_STATE = 2 << 10
"""What tensorstore holds per chunk of a read in flight beyond the chunk's bytes, as
counted against the budget: a read of a million tiny chunks holds gigabytes."""


def ts_held(stored: StoredArray, box: Box) -> int:
    """What a tensorstore read of `box` of `stored` holds while in flight: its values
    (`HELD` times) and its chunks' state."""
    nbytes = box_bytes(box, stored.dtype.itemsize)
    return nbytes * HELD + chunk_count(box, stored.chunks) * CHUNK_STATE


def check_plain(array: ArrayView) -> None:
    """Refuse a view whose shape is not its selection's: typed PRNG keys, whose reads go
    through their uint32 data (`LazyArray._key_data`) and never reach the engine."""
    assert array.shape == array.selection.shape, (
        f"{array.key}: shape {array.shape} over a selection of shape "
        f"{array.selection.shape} (typed PRNG keys?) reached the read engine"
    )


def stores(arrays: Iterable[ArrayView]) -> Iterator[Store]:
    """The stores of every stored array that `arrays` (composed views too) read."""
    for array in arrays:
        stored = array.stored
        if isinstance(stored, StoredArray):  # (most arrays: no composed parts to walk)
            yield stored.store
            continue
        for part in sources(array):
            yield stored_array(part).store
