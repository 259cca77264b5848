"""Decoding stored chunks ourselves: their stored bytes in windows, decoded as a stream.

For arrays whose chunks have a `Codec` (zarr v2 or v3, zstd or uncompressed, any
order, either byte order, zarr3 shards), a `ChunkStream` reads one chunk's stored
bytes through the array's own kvstore (OCDBT, file, s3, gcs) in byte ranges of
`READ_BYTES`, one read ahead, and decodes them with zstandard's streaming decoder,
slab by slab in the chunk's stream order, straight into the caller's memory where the
layouts match (`into`), else into a scratch slab. Nothing holds a whole chunk: a
1 GiB chunk streams through a few MiB. zstd cannot seek, so a slab deep inside a
chunk costs decoding everything before it (into scratch, discarded); nothing after
the last slab asked for is read.

A damaged or truncated stream, a frame of the wrong size or a shard index with a bad
checksum is a `CorruptCheckpointError` naming the array and the chunk.
"""

from __future__ import annotations

import collections
import math
import struct
from collections.abc import Callable, Sequence
from typing import Protocol, TypeGuard

import numpy as np
import zstandard

from lazyckpt._array.geometry import Box, chunk_box
from lazyckpt._array.view import Stored
from lazyckpt._engine.memory import populate
from lazyckpt._engine.sources import FileSource, KvSource
from lazyckpt._engine.stored import Codec, StoredArray
from lazyckpt._errors import CorruptCheckpointError, LazyckptError, StorageAccessError
from lazyckpt._storage.checksum import crc32c

READ_BYTES = 4 << 20
"""Stored bytes per kvstore read of a chunk; two are in flight per chunk stream."""
MIN_CHUNK_BYTES = 1 << 20
"""Chunks at least this large (decoded) are decoded by lazyckpt; smaller ones go
through tensorstore, whose per-chunk cost is lower and whose buffers are small."""
_MISSING = (1 << 64) - 1  # an inner chunk never written, in a shard index


def decodes(stored: Stored) -> TypeGuard[StoredArray]:
    """Whether lazyckpt decodes this array's chunks itself (never a composed view's:
    its parts are read instead)."""
    return (
        isinstance(stored, StoredArray)
        and stored.codec is not None
        and stored.inline is None
        and math.prod(stored.chunks) * stored.dtype.itemsize >= MIN_CHUNK_BYTES
    )


def stream_bytes(read_bytes: int) -> int:
    """Host bytes one open chunk stream holds besides its scratch slab: the read ahead
    (through a kvstore, tensorstore's buffer and its Python copy; from a file, one
    window), the read being decoded, and zstd's
    decoding window (512 KiB for Orbax's level 1 and 3 frames; counted generously)."""
    return 3 * read_bytes + (1 << 20)


def job_bytes(read_bytes: int, window: int) -> int:
    """Host bytes one decoding job holds: its chunk stream, and its scratch slab of
    `window` bytes."""
    return stream_bytes(read_bytes) + window


class _Decoding(Protocol):
    """What a chunk stream uses of zstandard's stream reader (whose stubs leave
    `close` untyped)."""

    def read(self, size: int = -1) -> bytes: ...

    def readinto(self, b: memoryview) -> int: ...

    def close(self) -> None: ...


class ChunkStream:
    """One stored chunk's values, decoded slab by slab in its stream order.

    Ask for consecutive slabs (as `lazyckpt._array.geometry.slabs` cuts them) from the
    first; `next(slab, into)` decodes one into the writable bytes `into` (exactly the
    slab's bytes, native byte order, C order), or returns its values (a scratch view
    in stored dimension order, reused by the next call) when `into` is None.
    """

    def __init__(self, stored: StoredArray, index: tuple[int, ...], read_bytes: int) -> None:
        assert stored.codec is not None
        self.stored, self.index, self.codec = stored, index, stored.codec
        self.box = chunk_box(index, stored.chunks)
        self.read_bytes = read_bytes
        self.dtype = stored.dtype.newbyteorder(self.codec.byteorder)  # type: ignore[arg-type]
        self.total = math.prod(stored.chunks) * stored.dtype.itemsize
        self.done = 0  # decoded bytes so far
        self.key = self.codec.chunk_key(stored.name, index, stored.chunks)
        self._reader: _Decoding | None = None
        self._source: KvSource | FileSource | None = None
        self._missing = False
        self._opened = False
        self._scratch: bytearray | None = None

    def _fail(self, what: str) -> LazyckptError:
        return chunk_error(self.stored, self.index, self.key, what)

    def _open(self) -> None:
        self._opened = True
        try:
            self.stored.store.check_files([self.key])
            located = self._locate()
            if located is None:
                self._missing = True
                return
            source = self._source_of(*located)
            try:
                state = source.first()
            except BaseException:
                source.close()
                raise
        except StorageAccessError:
            raise  # (not read in this process: not the checkpoint's doing)
        except Exception as error:  # noqa: BLE001 - tensorstore's, turned into ours
            # (ours too: a checkpoint replaced since `open` is said so, not damaged)
            raise self.stored.read_error(error) from None
        if state != "value":
            source.close()
            self._missing = True
            return
        self._source = source
        if not self.codec.zstd:
            return
        head = bytes(source.held[:18])
        try:
            declared = zstandard.frame_content_size(head)
        except zstandard.ZstdError as error:
            raise self._fail(f"does not start with a zstd frame ({error})") from None
        if declared not in (-1, self.total):
            raise self._fail(f"holds a zstd frame of {declared} bytes, expected {self.total}")
        self._reader = zstandard.ZstdDecompressor().stream_reader(
            source,  # type: ignore[arg-type]  # any object with read() will do
            read_size=self.read_bytes,
            read_across_frames=False,
        )

    def _source_of(self, start: int, stop: int | None) -> KvSource | FileSource:
        """The stored bytes `[start, stop)` of the chunk's key: read from the local file
        that holds them where the store can tell which (`Store.local_file`), else
        through its kvstore."""
        store = self.stored.store
        local = store.local_file(self.key)
        if local is None:
            store.check_tensorstore()
            return KvSource(store.kvstore, self.key, start, stop, self.read_bytes)
        path, offset, length = local
        if length is not None:
            stop = length if stop is None else min(stop, length)
        return FileSource(
            path, offset + start, None if stop is None else offset + stop, self.read_bytes, store
        )

    def check(self) -> None:
        """Open the stream and check, before anything is planned, that its stored bytes
        can hold the chunk its header declares (the zstd frame's size, or the raw
        bytes' length): a damaged header may declare petabytes. The stream stays open,
        and its decoding goes on from what this read: the chunk is located and its
        first window read once (close it where it is not decoded)."""
        if not self._opened:
            self._open()
        source = self._source
        if source is not None and not self.codec.zstd and not source.check_length(self.total):
            raise self._fail(f"holds fewer than the {self.total} bytes it declares")

    def _locate(self) -> tuple[int, int | None] | None:
        """The byte range of the chunk's stored bytes in its key's value; None when it
        was never written."""
        if self.codec.shard is None:
            return 0, None
        where = shard_index_range(self.codec, self.index, self.stored.chunks)
        result = self.stored.store.read(self.key, where).result()  # (a local file: by lazyckpt)
        if result.state != "value":
            return None
        located = in_shard(self.codec, self.index, self.stored.chunks, bytes(result.value))
        if isinstance(located, str):
            raise self._fail(located)
        return located

    def next(self, slab: Box, into: memoryview | None = None) -> np.ndarray | None:
        if not self._opened:
            self._open()
        shape = [high - low for low, high in (slab[d] for d in self.codec.order)]
        nbytes = math.prod(shape) * self.dtype.itemsize
        if self._missing:
            return self._fill(shape, into)
        if into is not None:
            populate(into)
            self._read_into(into)
            return None
        if self._scratch is None or len(self._scratch) < nbytes:
            self._scratch = bytearray(max(nbytes, len(self._scratch or b"")))
        view = memoryview(self._scratch)[:nbytes]
        self._read_into(view)
        values = np.frombuffer(view, self.dtype).reshape(shape)
        return values.transpose(np.argsort(self.codec.order))

    def _fill(self, shape: Sequence[int], into: memoryview | None) -> np.ndarray | None:
        if not self.stored.fill_missing:
            raise self._fail("is missing from the store, and this checkpoint writes every chunk")
        fill = self.codec.fill
        if into is not None:
            np.frombuffer(into, self.stored.dtype).fill(fill)
            return None
        values = np.full(shape, fill, self.stored.dtype)
        return values.transpose(np.argsort(self.codec.order))

    def _read_into(self, memory: memoryview) -> None:
        got = 0
        try:
            while got < len(memory):
                n = self._readinto(memory[got:])
                if not n:
                    break
                got += n
        except zstandard.ZstdError as error:
            raise self._fail(f"does not decode ({error})") from None
        except StorageAccessError:
            raise  # (not read in this process: not the checkpoint's doing)
        except Exception as error:  # noqa: BLE001 - tensorstore's, turned into ours
            # (ours too: a checkpoint replaced since `open` is said so, not damaged)
            raise self.stored.read_error(error) from None
        if got < len(memory):
            raise self._fail(f"ends after {self.done + got} of its {self.total} decoded bytes")
        self.done += got

    def _readinto(self, memory: memoryview) -> int:
        if self._reader is not None:
            return int(self._reader.readinto(memory))
        assert self._source is not None
        return self._source.readinto(memory)

    def finish(self) -> None:
        """After the last slab: check that the stored bytes end with the chunk."""
        if self._missing or not self._opened or self.done < self.total:
            return
        try:
            extra: bytes | memoryview | None = None
            if self._reader is not None:
                extra = self._reader.read(1)
            elif self._source is not None:
                extra = self._source.read(1)
        except zstandard.ZstdError:
            extra = b"?"  # bytes after the frame that are no zstd frame either
        except StorageAccessError:
            raise  # (not read in this process: not the checkpoint's doing)
        except Exception as error:  # noqa: BLE001 - tensorstore's, turned into ours
            # (ours too: a checkpoint replaced since `open` is said so, not damaged)
            raise self.stored.read_error(error) from None
        if extra:
            raise self._fail(f"holds more than its {self.total} decoded bytes")

    def close(self) -> None:
        """Let go of the reader and the source, each closed once (a stream may be
        closed by more than one owner: `decode_slabs`, and the job that opened it)."""
        reader, self._reader = self._reader, None
        source, self._source = self._source, None
        self._scratch = None
        try:
            if reader is not None:
                reader.close()
        finally:
            if source is not None:
                source.close()


def chunk_error(stored: StoredArray, index: tuple[int, ...], key: str, what: str) -> LazyckptError:
    """What a chunk whose stored bytes are wrong (`what`) is: a replaced checkpoint, or
    damaged data."""
    if stored.store.changed():
        return stored.store.changed_error()
    return CorruptCheckpointError(
        f"{stored.store.location}: array {stored.key!r} chunk {list(index)} (stored as "
        f"{key!r}) {what}; the checkpoint's data is damaged, copy it again"
    )


_TAIL_PIECE = 128 << 10
"""Stored bytes handed to zstd at a time by `decode_in_place` (a block's worth)."""


class _Tail:
    """A chunk's stored bytes at the end of the memory its values fill, handed to zstd's
    reader a copy at a time (`handed`: the first byte not yet handed over). Values
    decoded go over bytes handed over, never over those still to come."""

    def __init__(self, buffer: memoryview, start: int) -> None:
        self.buffer, self.handed = buffer, start
        self.ahead: collections.deque[bytes] = collections.deque()

    def read(self, size: int = -1) -> bytes:
        if self.ahead:
            return self.ahead.popleft()
        piece = bytes(self.buffer[self.handed : self.handed + max(size, _TAIL_PIECE)])
        self.handed += len(piece)
        return piece

    def copy_ahead(self) -> None:
        """Copy the next bytes out before the reader asks for them: room for values
        that a chunk's first part decodes into beyond what its bytes took (it
        compresses better than the rest). The copies wait in `ahead`, a piece or two."""
        piece = bytes(self.buffer[self.handed : self.handed + _TAIL_PIECE])
        self.handed += len(piece)
        self.ahead.append(piece)


def decode_in_place(out: memoryview, stored: int, fail: Callable[[str], LazyckptError]) -> None:
    """Decode one zstd frame whose `stored` bytes lie at the end of `out` into all of
    `out`, front to back: each value is written over stored bytes already handed to
    zstd (`_Tail`), so nothing is held but zstd's window and a piece or two of copies.
    `fail(what)` is the error of a frame that is wrong."""
    total = len(out)
    tail = _Tail(out, total - stored)
    try:
        declared = zstandard.frame_content_size(bytes(out[tail.handed : tail.handed + 18]))
    except zstandard.ZstdError as error:
        raise fail(f"does not start with a zstd frame ({error})") from None
    if declared not in (-1, total):
        raise fail(f"holds a zstd frame of {declared} bytes, expected {total}")
    reader: _Decoding = zstandard.ZstdDecompressor().stream_reader(
        tail,  # type: ignore[arg-type]  # any object with read() will do
        read_size=_TAIL_PIECE,
        read_across_frames=False,
        closefd=False,
    )
    done = 0
    try:
        while done < total:
            room = min(tail.handed, total) - done
            if room <= 0:
                tail.copy_ahead()
                continue
            count = reader.readinto(out[done : done + room])
            if not count:
                raise fail(f"ends after {done} of its {total} decoded bytes")
            done += count
        try:
            extra = reader.read(1)
        except zstandard.ZstdError:
            extra = b"?"  # bytes after the frame that are no zstd frame either
        if extra:
            raise fail(f"holds more than its {total} decoded bytes")
    except zstandard.ZstdError as error:
        raise fail(f"does not decode ({error})") from None
    finally:
        reader.close()


def shard_index_range(codec: Codec, index: tuple[int, ...], chunks: tuple[int, ...]) -> slice:
    """The byte range of the index of the shard holding chunk `index`, in its key."""
    _, count = codec.position_in_shard(index, chunks)
    size = 16 * count + (4 if codec.index_checksum else 0)
    return slice(-size, None) if codec.index_at_end else slice(0, size)


def in_shard(
    codec: Codec, index: tuple[int, ...], chunks: tuple[int, ...], raw: bytes
) -> tuple[int, int] | str | None:
    """Where chunk `index` lies in its shard, from the shard's index `raw`: its byte
    range, None when it was never written, or what is wrong with the index."""
    position, count = codec.position_in_shard(index, chunks)
    size = 16 * count + (4 if codec.index_checksum else 0)
    if len(raw) != size:
        return f"has a shard index of {len(raw)} bytes, expected {size}"
    if codec.index_checksum:
        (stored_crc,) = struct.unpack("<I", raw[-4:])
        if crc32c(raw[:-4]) != stored_crc:
            return "has a shard index whose crc32c does not match"
    offset, nbytes = struct.unpack_from(f"{codec.index_byteorder}QQ", raw, 16 * position)
    if offset == _MISSING and nbytes == _MISSING:
        return None
    return offset, offset + nbytes
