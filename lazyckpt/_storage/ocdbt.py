"""Where every key of an OCDBT database lies, from its b-tree, read once.

Reading thousands of small keys through tensorstore's OCDBT driver costs about 25 us
each (a b-tree lookup and a future per key); an Orbax checkpoint of 10,000 small
arrays spends most of a restore there. Its b-tree is usually one node, a few KiB to
a few MiB, which lazyckpt reads whole when the checkpoint opens anyway
(`ocdbt_tree.Tree.check`, before tensorstore's driver reads any of it). So a read of
many keys takes each key's place from there, an inline value or a byte range of a
data file, and reads the values from there: inline ones at no cost, the others by
byte range, together in one batch of the base store. Listings are answered from the
same keys; where the check handed back no places (a tree past its bounds, or one
that names a node twice), the driver reads and the tree lists itself
(`Tree.listing`).

It is an index of one version of the database, the newest when the checkpoint was
opened; the checkpoint's generation check (`Store.check_unchanged`) covers a database
replaced since.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from typing import TypeAlias

import attrs

from lazyckpt._errors import LazyckptError
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.ocdbt_format import Place
from lazyckpt._storage.ocdbt_tree import Tree

WORTH = 8
"""The index serves reads of at least 1/WORTH of the database's keys from the first
read on: a read through the driver costs about 25 us a key, and the driver would read
the nodes again."""

LOCATE_KEYS = 20_000
"""Reads of large values (`Index.locate`) are served from the index where it holds at
most this many keys (keeping more for them costs memory for the checkpoint's life; a
read of 1 MiB or more through the driver takes a millisecond or so)."""

Value: TypeAlias = "bytes | ts.Future[ts.KvStore.ReadResult] | None"  # a string: ts is deferred
"""A value read through the index: known already (None: no such key), or on its way."""


@attrs.define(eq=False)
class Index:
    """The places of an OCDBT database's keys, from its b-tree read whole (`check`)."""

    tree: Tree
    coalesce: bool = False
    """Read values of one data file in one batch, which tensorstore merges into
    requests that also take the gaps between them (up to a few hundred bytes): on a
    bucket, one request for many small values; on a local disk each value is read
    alone, so that no byte outside the values is read."""
    read_file: Callable[[str, slice], ts.Future[ts.KvStore.ReadResult]] | None = attrs.field(
        default=None, kw_only=True, repr=False
    )
    """Reads a byte range of a data file (by its path in the database) where lazyckpt
    reads them itself; else the base store reads."""
    _found: dict[bytes, Place] | None = attrs.field(default=None, init=False)
    """The places the check handed back, until the first read decides."""
    _spare: dict[bytes, Place] | None = attrs.field(default=None, init=False)
    """Places the first read did not want, kept for `locate` (at most `LOCATE_KEYS`)."""
    _places: dict[bytes, Place] | None = attrs.field(default=None, init=False)
    _sorted: list[bytes] | None = attrs.field(default=None, init=False, repr=False)
    _decided: bool = attrs.field(default=False, init=False)
    _walked: bool = attrs.field(default=False, init=False)
    """Whether `locate` took its places (once)."""
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    @property
    def base(self) -> ts.KvStore:
        """The store that holds the database's files."""
        return self.tree.base

    def check(self) -> None:
        """Read the manifest and every node of the b-tree (`Tree.check`), before
        tensorstore's driver reads any of it: `CorruptCheckpointError` or
        `TooLargeError` naming what is wrong."""
        found = self.tree.check()
        with self._lock:
            self._found = found

    def places(self, wanted: int) -> dict[bytes, Place] | None:
        """Each key's place, if the first read, of `wanted` keys, made the index worth
        it (`WORTH`) and the check handed places back; None means: read through the
        driver."""
        with self._lock:
            if self._decided or not wanted:
                return self._places
            # Decided once, at the first read (`open`'s of every array's header).
            self._decided = True
            found, self._found = self._found, None
            if found is not None and wanted * WORTH >= len(found):
                self._places = found
            elif found is not None and len(found) <= LOCATE_KEYS:
                self._spare = found
            return self._places

    @property
    def walked(self) -> bool:
        """Whether `locate` has its answer: it reads nothing more."""
        return self._places is not None or self._walked

    def locate(self, key: str) -> Place | None:
        """`key`'s place, for a read of a large value (a chunk of a MiB or more): from
        the index where it holds at most `LOCATE_KEYS` keys, even where the first read
        did not want it; None where it does not, or holds no such key."""
        with self._lock:
            if self._places is None and not self._walked:
                self._walked = self._decided = True
                found = self._found if self._found is not None else self._spare
                self._found = self._spare = None
                if found is not None and len(found) <= LOCATE_KEYS:
                    self._places = found
            places = self._places
        return None if places is None else places.get(key.encode())

    def list_keys(self, prefix: str) -> list[str]:
        """The keys under `prefix` (every key when it is empty): from the places where
        the check handed them back, else from the tree (`Tree.listing`, bounded)."""
        start = prefix.encode()
        end = _after_all(start)
        with self._lock:
            if self._sorted is None:
                places = next(
                    (p for p in (self._places, self._found, self._spare) if p is not None), None
                )
                self._sorted = None if places is None else sorted(places)
            keys = self._sorted
        if keys is None:
            found = self.tree.listing(start, end)
        else:
            stop = len(keys) if end is None else bisect.bisect_left(keys, end)
            found = keys[bisect.bisect_left(keys, start) : stop]
        return [key.decode("utf-8", errors="replace") for key in found]

    def read(
        self, keys: Sequence[str], byte_ranges: Sequence[slice | None], batch: ts.Batch
    ) -> list[Value] | None:
        """The values of `keys` (each cut to its byte range, if any), the indirect ones
        read in `batch`; None where the index does not serve (see `places`: the first
        read decides)."""
        places = self.places(len(keys))
        if places is None:
            return None
        values: list[Value] = []
        for key, byte_range in zip(keys, byte_ranges, strict=True):
            place = places.get(key.encode())
            if place is None or (isinstance(place, bytes) and byte_range is None):
                values.append(place)
                continue
            length = len(place) if isinstance(place, bytes) else place[2]
            cut = _cut(byte_range, length)
            if cut is None:
                values.append(
                    _failed(f"key {key!r} holds {length} bytes, too few for {byte_range}")
                )
            elif isinstance(place, bytes):
                values.append(place[cut[0] : cut[1]])
            else:
                file, offset, _ = place
                at = slice(offset + cut[0], offset + cut[1])
                read = (
                    self.read_file(file, at)
                    if self.read_file is not None
                    else self.base.read(
                        file.encode("utf-8", "surrogateescape"),
                        byte_range=at,
                        batch=batch if self.coalesce else None,
                    )
                )
                values.append(_checked(read, file, at.start, at.stop - at.start))
        return values


def _after_all(prefix: bytes) -> bytes | None:
    """The first key after every key that starts with `prefix` (None: no such key)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _cut(byte_range: slice | None, length: int) -> tuple[int, int] | None:
    """The bytes `byte_range` takes of a value of `length` bytes (a negative start
    counts from the end, as tensorstore's ranges do); None where the value is too
    short, which tensorstore's driver calls out of range."""
    if byte_range is None:
        return 0, length
    start = byte_range.start or 0
    if start < 0:
        start += length
    stop = length if byte_range.stop is None else byte_range.stop
    if not 0 <= start <= stop <= length:
        return None
    return start, stop


def _failed(message: str) -> ts.Future[ts.KvStore.ReadResult]:
    promise: ts.Promise[ts.KvStore.ReadResult]
    future: ts.Future[ts.KvStore.ReadResult]
    promise, future = ts.Promise.new()
    promise.set_exception(ValueError(message))
    return future


def _checked(
    read: ts.Future[ts.KvStore.ReadResult], file: str, offset: int, length: int
) -> ts.Future[ts.KvStore.ReadResult]:
    """`read`, failing where the data file is gone or ends before the value does: the
    b-tree says the value is there, so neither is a value that was never written."""
    promise: ts.Promise[ts.KvStore.ReadResult]
    future: ts.Future[ts.KvStore.ReadResult]
    promise, future = ts.Promise.new()

    def settle(done: ts.Future[ts.KvStore.ReadResult]) -> None:
        where = f"the b-tree places a value at bytes {offset} to {offset + length} of data file {file!r}"
        try:
            result = done.result()
        except LazyckptError as error:  # (a data file replaced: said so, by name)
            promise.set_exception(error)
            return
        except Exception as error:  # noqa: BLE001 - handed to whoever awaits
            promise.set_exception(ValueError(f"{where}, which could not be read ({error})"))
            return
        found = len(result.value) if result.state == "value" else None
        if found == length:
            promise.set_result(result)
        else:
            promise.set_exception(
                ValueError(
                    f"{where}, which "
                    + ("is missing" if found is None else f"holds only {found} of them")
                )
            )

    read.add_done_callback(settle)
    return future
