"""Where every key of an OCDBT database lies, from its b-tree, read once.

Reading thousands of small keys through tensorstore's OCDBT driver costs about 25 us
each (a b-tree lookup and a future per key); an Orbax checkpoint of 10,000 small
arrays spends most of a restore there. Its b-tree is usually one node, a few KiB to
a few MiB that tensorstore decodes in milliseconds (`ts.ocdbt.dump`, which checks the
manifest's and each node's checksums). So a read of many keys walks the b-tree once,
keeps each key's place, an inline value or a byte range of a data file, and reads the
values from there: inline ones at no cost, the others by byte range, together in one
batch of the base store.

It is an index of one version of the database, the newest when it is walked; the
checkpoint's generation check (`Store.check_unchanged`) covers a database replaced
since. Anything unexpected in the dump (a damaged node, a format this does not know)
leaves the index unbuilt, and the caller reads through the driver, whose errors say
what is wrong.
"""

from __future__ import annotations

import re
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import tensorstore as ts

WORTH = 8
"""The index is built for reads of at least 1/WORTH of the database's keys: walking
the b-tree costs a few microseconds per key, a key read through the driver about
25."""

MAX_TREE_BYTES = 16 << 20
"""The index is built for b-trees up to this size as stored: it holds their keys and
inline values for as long as the checkpoint is open, as the driver's cache of nodes
would. (An Orbax checkpoint of 10,000 small arrays has a tree of 18 KiB; one of
200,000 values of 1 KiB inline, 200 MB, is read faster through the driver.)"""

LOCATE_KEYS = 20_000
"""The b-tree is walked for reads of large values (`Index.locate`) where it holds at
most this many keys: a walk costs about 3.6 us a key (100,000 keys took 0.36 s), a
read of 1 MiB or more through the driver a millisecond or so."""

_LOCATION = re.compile(r"value:([^:]*):([^:]*):(\d+):(\d+)")
"""An indirect value's place in a dump: base path and path relative to it (each
percent-encoded), offset, length."""

Place = bytes | tuple[str, int, int]
"""A key's value: inline bytes, or (data file, offset, length) in the base store."""

Value = bytes | None | ts.Future[ts.KvStore.ReadResult]
"""A value read through the index: known already (None: no such key), or on its way."""


@attrs.define(eq=False)
class Index:
    """The places of an OCDBT database's keys, built on first use (`places`)."""

    base: ts.KvStore = attrs.field(repr=False)
    """The store that holds the database's files."""
    coalesce: bool = False
    """Read values of one data file in one batch, which tensorstore merges into
    requests that also take the gaps between them (up to a few hundred bytes): on a
    bucket, one request for many small values; on a local disk each value is read
    alone, so that no byte outside the values is read."""
    _places: dict[bytes, Place] | None = attrs.field(default=None, init=False)
    _decided: bool = attrs.field(default=False, init=False)
    _walked: bool = attrs.field(default=False, init=False)
    """Whether `locate` tried the walk (once)."""
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def places(self, wanted: int) -> dict[bytes, Place] | None:
        """Each key's place, if the first read, of `wanted` keys, made the walk worth
        it (`WORTH`) and the b-tree could be walked; None means: read through the
        driver."""
        with self._lock:
            if self._decided or not wanted:
                return self._places
            # Decided once, at the first read (`open`'s of every array's header): built
            # later, the walk would read again the nodes that the driver has read.
            self._decided = True
            self._places = _walked(self.base, lambda keys: wanted * WORTH >= keys)
            return self._places

    @property
    def walked(self) -> bool:
        """Whether the b-tree was walked, or tried: `locate` reads nothing more."""
        return self._places is not None or self._walked

    def locate(self, key: str) -> Place | None:
        """`key`'s place, for a read of a large value (a chunk of a MiB or more, whose
        read costs far more than a walk): the b-tree is walked now if the first read
        did not find it worth it, where it is small enough (`LOCATE_KEYS`,
        `MAX_TREE_BYTES`); None where it is not walked or holds no such key."""
        with self._lock:
            if self._places is None and not self._walked:
                self._places = _walked(self.base, lambda keys: keys <= LOCATE_KEYS)
                # (set once walked: a child forked meanwhile is told, by `Store`'s check
                # before any walk, not left waiting on this lock)
                self._walked = self._decided = True
            places = self._places
        return None if places is None else places.get(key.encode())

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
                read = self.base.read(file, byte_range=at, batch=batch if self.coalesce else None)
                values.append(_checked(read, file, at.start, at.stop - at.start))
        return values


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


def _dump(base: ts.KvStore, node: str | None) -> Any:
    try:
        return ts.ocdbt.dump(base, node).result()
    except Exception:  # noqa: BLE001 - any failure: the driver reads instead
        return None


def _newest_root(manifest: Any) -> tuple[str, int, int] | None:
    """The newest version's root node, number of keys and bytes of tree; None for an
    empty database or a manifest this does not read."""
    try:
        version = max(manifest["versions"], key=lambda v: v["generation_number"])
        root = version["root"]
        statistics = root["statistics"]
        return root["location"], int(statistics["num_keys"]), int(statistics["num_tree_bytes"])
    except (TypeError, KeyError, ValueError):
        return None


def _walked(base: ts.KvStore, worth: Callable[[int], bool]) -> dict[bytes, Place] | None:
    """Every key's place, from the newest version's b-tree, where `worth` says its number
    of keys is worth the walk and it is at most `MAX_TREE_BYTES`; else None."""
    root = _newest_root(_dump(base, None))
    if root is None or not worth(root[1]) or root[2] > MAX_TREE_BYTES:
        return None
    return _walk(base, root[0])


def _walk(base: ts.KvStore, root: str) -> dict[bytes, Place] | None:
    """Every key's place under the node at `root`; None if a node will not dump or
    holds what this does not know."""
    places: dict[bytes, Place] = {}
    pending: list[tuple[str, bytes]] = [(root, b"")]
    try:
        while pending:
            location, prefix = pending.pop()
            node = _dump(base, location)
            if node is None:
                return None
            entries = node["entries"]
            if node["height"] > 0:
                for entry in entries:
                    pending.append(
                        (entry["location"], prefix + bytes(entry["subtree_common_prefix"]))
                    )
                continue
            for entry in entries:
                key = prefix + bytes(entry["key"])
                if "inline_value" in entry:
                    places[key] = bytes(entry["inline_value"])
                else:
                    places[key] = _indirect(entry["indirect_value"])
    except (TypeError, KeyError, ValueError):
        return None
    return places


def _indirect(location: str) -> tuple[str, int, int]:
    """An indirect value's (data file, offset, length), from its place in a dump."""
    match = _LOCATION.fullmatch(location)
    if match is None:
        raise ValueError(location)
    base_path, relative = (
        urllib.parse.unquote(part, errors="strict") for part in match.group(1, 2)
    )
    return base_path + relative, int(match[3]), int(match[4])
