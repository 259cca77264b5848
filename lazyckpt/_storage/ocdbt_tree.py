"""An OCDBT database's b-tree, read by lazyckpt itself (`ocdbt_format`): checked whole
when a checkpoint opens, and listed by prefix.

tensorstore's driver decodes whatever node a read of a key leads it to, and would
allocate whatever that node's lengths ask for. So before the driver reads anything,
`Tree.check` reads the manifest and every node reachable from the newest version's
root, each once (by its place and the path its data files are relative to), and
refuses by name any that would decode past `ocdbt_format.MAX_DECODED_BYTES`, that
tensorstore's decoder would refuse, or that is no node of a b-tree: a child whose
height is not its parent's less one (a node that names itself, or any cycle of nodes,
has one), or whose keys fall outside the range its parent gives it, on any path to it
(a node's range depends on its parent's keys alone, so the check of each edge covers
every path through it). Where the tree is a tree (no node reached twice, as
tensorstore's writer makes them) and small enough (`MAX_TREE_*`), the check also hands
back every key's place, for `ocdbt.Index`.

The format lets many paths reach one node (a b-tree of 20 KB can name 10**8 keys), so
a listing walks only the children whose keys meet the prefix, counts nodes and keys
each time a path reaches them, and stops by name past `MAX_LISTED_NODES` or
`MAX_LISTED_KEYS`.
"""

from __future__ import annotations

import bisect
import collections
import os
import stat
import threading
from collections.abc import Iterator

import attrs
import tensorstore as ts

from lazyckpt._errors import CorruptCheckpointError, TooLargeError
from lazyckpt._storage.ocdbt_format import (
    MAX_DECODED_BYTES,
    FormatError,
    Manifest,
    Node,
    Place,
    Ref,
    manifest,
    node,
)
from lazyckpt._text import shown

MAX_TREE_BYTES = 256 << 20
"""Places are handed back for trees that hold at most this many bytes decoded (as
`ocdbt_format` counts them), since the index keeps their keys and inline values for
as long as the checkpoint is open, as the driver's cache of nodes would (an Orbax
checkpoint of 150,000 small arrays has a tree of 768 KB that holds 57 MB decoded)."""

MAX_TREE_NODES = 1 << 12
"""Likewise, for trees of at most this many nodes: tensorstore fills nodes up to
`max_decoded_node_bytes` (8 MiB by default, 100 MB as Orbax writes)."""

MAX_TREE_KEYS = 1 << 21
"""Likewise, for trees of at most this many keys: the index costs about 200 bytes a
key besides its key and value (400 MiB at most)."""

MAX_CHECKED_NODES = 1 << 16
"""The check reads at most this many nodes (`TooLargeError` past it): tensorstore's
writer makes trees of a few nodes for checkpoints of millions of arrays."""

MAX_CHECKED_BYTES = 1 << 30
"""The check reads at most this many bytes of nodes (`TooLargeError` past it)."""

MAX_HELD_BYTES = 2 * MAX_DECODED_BYTES
"""The nodes on one path from the root, held decoded while a walk goes down it, hold at
most this much (`TooLargeError` past it)."""

MAX_LISTED_NODES = 1 << 16
"""A listing reaches at most this many nodes, counted each time a path reaches them."""

MAX_LISTED_KEYS = 1 << 21
"""A listing gives at most this many keys (about 200 MB of Python strings)."""

_CACHE_BYTES = 64 << 20
"""Decoded nodes kept for listings, as the driver's cache of nodes keeps them."""

_AHEAD = 16
"""Children whose reads a walk starts at once (a bucket answers each in tens of ms)..."""

_AHEAD_BYTES = 64 << 20
"""... while the bytes in flight stay within this."""


@attrs.frozen
class _Reach:
    """A node as a path reaches it: where it is, the height it must have, and the range
    its keys must fall in (`high` None: no end; b"": none can), each relative to the
    prefix that the path gives its keys (`prefix`)."""

    ref: Ref
    height: int
    low: bytes
    high: bytes | None
    prefix: bytes


@attrs.define(eq=False)
class Tree:
    """An OCDBT database's newest b-tree, read through `base`, the store of its files."""

    base: ts.KvStore = attrs.field(repr=False)
    location: str
    """The database, as errors name it."""
    folder: str | None = None
    """Its folder on this machine, where it is local: a manifest's size is known before
    it is read."""
    _root: _Reach | None = attrs.field(default=None, init=False)
    _cache: collections.OrderedDict[Ref, Node] = attrs.field(
        factory=collections.OrderedDict, init=False, repr=False
    )
    _cached: int = attrs.field(default=0, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def check(self) -> dict[bytes, Place] | None:
        """Read the manifest and every node of the newest version, each once; every
        key's place where the tree is a tree within `MAX_TREE_*`, else None.
        `CorruptCheckpointError` naming the file or node where one is malformed or
        would decode too large, `TooLargeError` past `MAX_CHECKED_*`; a failed read is
        tensorstore's `ValueError`."""
        found = self._manifest()
        if found is None or found.root is None:
            return {}
        self._root = _Reach(found.root, found.height, b"", None, b"")
        seen: dict[Ref, tuple[int, bytes, bytes]] = {}
        places: dict[bytes, Place] | None = {}
        stored = kept = decoded = 0
        for reach, at in self._walk(self._root, seen=seen):
            if at is None:
                places = None  # (a node reached again: no tree as tensorstore writes them)
                continue
            stored += reach.ref.length
            kept += len(at.keys[0]) + len(at.keys[-1])
            if len(seen) > MAX_CHECKED_NODES or max(stored, kept) > MAX_CHECKED_BYTES:
                raise TooLargeError(
                    f"{self.location}: the b-tree of the OCDBT database holds more than "
                    f"{MAX_CHECKED_NODES:,} nodes or {MAX_CHECKED_BYTES:,} bytes, which "
                    "lazyckpt reads before tensorstore's driver does; it stops there"
                )
            decoded += at.decoded
            if places is None or not at.values:
                continue
            if reach.prefix:
                places.update(
                    (reach.prefix + key, v) for key, v in zip(at.keys, at.values, strict=True)
                )
            else:
                places.update(zip(at.keys, at.values, strict=True))
            if (
                len(places) > MAX_TREE_KEYS
                or decoded > MAX_TREE_BYTES
                or len(seen) > MAX_TREE_NODES
            ):
                places = None
        return places

    def listing(self, start: bytes, end: bytes | None) -> list[bytes]:
        """The keys from `start` to before `end` (None: no end), walking only the
        children whose keys meet that range; `TooLargeError` past `MAX_LISTED_NODES` or
        `MAX_LISTED_KEYS`, each node and key counted every time a path reaches it."""
        if self._root is None:
            return []
        found: list[bytes] = []
        for nodes, (reach, at) in enumerate(self._walk(self._root, wanted=(start, end)), 1):
            assert at is not None
            if not at.height:
                first, stop = _span(at.keys, reach.prefix, start, end, leaf=True)
                found.extend(reach.prefix + key for key in at.keys[first:stop])
            if nodes > MAX_LISTED_NODES or len(found) > MAX_LISTED_KEYS:
                raise TooLargeError(
                    f"{self.location}: listing {_shown(start)} in the OCDBT database reaches "
                    f"more than {MAX_LISTED_NODES:,} nodes or {MAX_LISTED_KEYS:,} keys (its "
                    "b-tree may name some nodes many times); lazyckpt lists no more"
                )
        return found

    def _walk(
        self,
        root: _Reach,
        *,
        seen: dict[Ref, tuple[int, bytes, bytes]] | None = None,
        wanted: tuple[bytes, bytes | None] | None = None,
    ) -> Iterator[tuple[_Reach, Node | None]]:
        """Each reach of the tree under `root`, depth first, and its node, checked
        against the reach: with `seen`, each node once (a later reach is checked against
        what `seen` keeps of it, and comes with None), else each time a path reaches it;
        with `wanted` (a range of keys), only the children whose keys meet it. The reads
        of the next few children are started together (`_AHEAD`)."""
        frames: list[tuple[list[_Reach], list[int]]] = [([root], [0, 0])]
        started: dict[Ref, ts.Future[ts.KvStore.ReadResult] | Node] = {}
        held = 0
        while frames:
            reaches, state = frames[-1]
            at_index = state[0]
            if at_index == len(reaches):
                frames.pop()
                held -= state[1]
                continue
            state[0] += 1
            self._start_ahead(reaches[at_index : at_index + _AHEAD], started, seen)
            reach = reaches[at_index]
            if seen is not None and reach.ref in seen:
                self._check_reach(reach, *seen[reach.ref])
                yield reach, None
                continue
            at = self._finish(reach.ref, started.pop(reach.ref, None))
            self._check_reach(reach, at.height, at.keys[0], at.keys[-1])
            if seen is not None:
                seen[reach.ref] = (at.height, at.keys[0], at.keys[-1])
            yield reach, at
            if at.height:
                held += at.decoded
                if held > MAX_HELD_BYTES:
                    raise TooLargeError(
                        f"{self.location}: the nodes on one path of the OCDBT database's "
                        f"b-tree hold more than {MAX_HELD_BYTES:,} bytes decoded; lazyckpt "
                        "stops there"
                    )
                frames.append((_children(reach, at, wanted), [0, at.decoded]))

    def _start_ahead(
        self,
        reaches: list[_Reach],
        started: dict[Ref, ts.Future[ts.KvStore.ReadResult] | Node],
        seen: dict[Ref, tuple[int, bytes, bytes]] | None,
    ) -> None:
        """Start the reads of `reaches`' nodes not read yet, the first always, the
        others while what is in flight stays within `_AHEAD_BYTES`."""
        flight = sum(ref.length for ref, read in started.items() if not isinstance(read, Node))
        for i, reach in enumerate(reaches):
            ref = reach.ref
            if ref in started or (seen is not None and ref in seen):
                continue
            if i and flight + ref.length > _AHEAD_BYTES:
                return
            started[ref] = self._start(ref)
            flight += ref.length

    def _check_reach(self, reach: _Reach, height: int, first: bytes, last: bytes) -> None:
        """Refuse the node at `reach`, of `height` and keys from `first` to `last`,
        where it cannot be there in a b-tree, as tensorstore's reader checks it."""
        named_by = "the manifest" if reach is self._root else "its parent"
        if height != reach.height:
            cycle = " (as a node that names itself, or any cycle of nodes, must)"
            problem = (
                f"has height {height} where {named_by} names a node of height {reach.height}"
                + (cycle if height > reach.height else "")
            )
        elif first < reach.low or (reach.high is not None and last >= reach.high):
            end = "" if reach.high is None else f" to before {_shown(reach.high)}"
            problem = (
                f"holds keys {_shown(first)} to {_shown(last)}, outside the range its parent "
                f"gives it, from {_shown(reach.low)}{end} (after the prefix "
                f"{_shown(reach.prefix)} that its parents give its keys)"
            )
        else:
            return
        raise CorruptCheckpointError(self._malformed(reach.ref, problem))

    def _malformed(self, ref: Ref, problem: str) -> str:
        return (
            f"{self.location}: the b-tree of the OCDBT database (manifest.ocdbt) is "
            f"malformed: the b-tree node at bytes {ref.offset} to {ref.offset + ref.length} of data "
            f"file {shown(_text(ref.file))} {problem}; the checkpoint is damaged, or was made "
            "to harm its readers: copy it again from a source you trust"
        )

    def _start(self, ref: Ref) -> ts.Future[ts.KvStore.ReadResult] | Node:
        with self._lock:
            cached = self._cache.get(ref)
            if cached is not None:
                self._cache.move_to_end(ref)
                return cached
        if ref.length > MAX_DECODED_BYTES:
            raise CorruptCheckpointError(
                self._malformed(ref, f"is {ref.length:,} bytes long, more than lazyckpt reads")
            )
        return self.base.read(ref.file, byte_range=slice(ref.offset, ref.offset + ref.length))

    def _finish(self, ref: Ref, started: ts.Future[ts.KvStore.ReadResult] | Node | None) -> Node:
        """The node at `ref`, from its read (`started`), decoded and kept in the cache."""
        if started is None:
            started = self._start(ref)
        if isinstance(started, Node):
            return started
        try:
            result = started.result()
        except ValueError as error:  # (tensorstore's words, which name no file)
            where = f"data file {shown(_text(ref.file))}, bytes {ref.offset} to {ref.offset + ref.length}"
            raise ValueError(f"{where}: {error}") from None
        if result.state != "value":
            raise CorruptCheckpointError(
                self._malformed(ref, "is missing: its data file is not there")
            )
        try:
            found = node(result.value, ref.base)
        except FormatError as error:
            raise CorruptCheckpointError(self._malformed(ref, str(error))) from None
        with self._lock:
            if found.decoded <= _CACHE_BYTES:
                self._cache[ref] = found
                self._cached += found.decoded
                while self._cached > _CACHE_BYTES:
                    _, old = self._cache.popitem(last=False)
                    self._cached -= old.decoded
        return found

    def _manifest(self) -> Manifest | None:
        """The manifest of the newest version; None where there is none (an empty
        database, as the driver reads it)."""
        found = self._decoded("manifest.ocdbt")
        if found is None or not found.numbered:
            return found
        # The versions are in numbered manifests: the driver reads the newest.
        listed = self.base.list(ts.KvStore.KeyRange(b"manifest.0", b"manifest.:")).result()
        numbers = [_generation(key[len(b"manifest.") :]) for key in listed]
        newest = max((n for n in numbers if n), default=0)
        if not newest:
            return None
        name = f"manifest.{newest:016x}"
        found = self._decoded(name)
        if found is not None and found.numbered:
            raise CorruptCheckpointError(self._bad_manifest(name, "holds no versions"))
        return found

    def _decoded(self, name: str) -> Manifest | None:
        data = self._manifest_bytes(name)
        if data is None:
            return None
        try:
            return manifest(data)
        except FormatError as error:
            raise CorruptCheckpointError(self._bad_manifest(name, str(error))) from None

    def _manifest_bytes(self, name: str) -> bytes | None:
        """The manifest `name`, read whole where it claims (or, locally, holds) at
        most `MAX_DECODED_BYTES`; None where it is missing."""
        if self.folder is not None:
            try:
                info = os.stat(os.path.join(self.folder, name))
            except FileNotFoundError:
                return None
            if not stat.S_ISREG(info.st_mode):  # (a FIFO would block the read forever)
                raise CorruptCheckpointError(self._bad_manifest(name, "is no regular file"))
            size = info.st_size
        else:
            # (the length its header claims: a file longer than that is read whole by
            # the driver too, which refuses it)
            try:
                head = self.base.read(name, byte_range=slice(0, 12)).result()
            except ValueError:  # (shorter than a header: read whole, which says so)
                size = 0
            else:
                if head.state != "value":
                    return None
                size = int.from_bytes(head.value[4:12], "little")
        if size > MAX_DECODED_BYTES:
            says = "holds" if self.folder is not None else "says it holds"
            raise CorruptCheckpointError(
                self._bad_manifest(name, f"{says} {size:,} bytes, more than lazyckpt reads")
            )
        read = self.base.read(name).result()
        return read.value if read.state == "value" else None

    def _bad_manifest(self, name: str, problem: str) -> str:
        return (
            f"{self.location}: the OCDBT database's manifest {shown(name)} {problem}; the "
            "checkpoint is damaged, or was made to harm its readers: copy it again from a "
            "source you trust"
        )


def _children(reach: _Reach, at: Node, wanted: tuple[bytes, bytes | None] | None) -> list[_Reach]:
    """The reaches of `at`'s children (only those whose keys meet the range `wanted`):
    child i holds the keys from its key to before the next one's (the last, to before
    its parent's end), each relative to its key's prefix that all its keys share."""
    count = len(at.keys)
    first, stop = 0, count
    if wanted is not None:
        first, stop = _span(at.keys, reach.prefix, *wanted, leaf=False)
    out = []
    for i in range(first, stop):
        ref, shared = at.children[i]
        key = at.keys[i]
        common = key[:shared]
        high = at.keys[i + 1] if i + 1 < count else reach.high
        out.append(
            _Reach(ref, at.height - 1, key[shared:], _after(high, common), reach.prefix + common)
        )
    return out


def _after(high: bytes | None, common: bytes) -> bytes | None:
    """The end `high` of a range, for keys that follow `common`: None where every such
    key falls before it, b"" where none can."""
    if high is None:
        return None
    if high.startswith(common):
        return high[len(common) :]
    return None if high > common else b""


def _span(
    keys: list[bytes], prefix: bytes, start: bytes, end: bytes | None, *, leaf: bool
) -> tuple[int, int]:
    """Which of a node's `keys` (each after `prefix`, as every key below the node is)
    meet the range from `start` to before `end`: a leaf's keys in it, or the children
    whose keys (each child's from its key to the next one's) may."""
    count = len(keys)
    if start.startswith(prefix):
        relative = start[len(prefix) :]
        # (a child whose key is before `start` holds keys up to the next child's)
        low = (
            bisect.bisect_left(keys, relative) if leaf else bisect.bisect_right(keys, relative) - 1
        )
    else:
        low = 0 if start < prefix else count
    if end is None or (end > prefix and not end.startswith(prefix)):
        high = count
    elif end.startswith(prefix):
        high = bisect.bisect_left(keys, end[len(prefix) :])
    else:
        high = 0
    low = max(low, 0)
    return low, max(low, high)


def _generation(name: bytes) -> int:
    """The generation a numbered manifest's name gives (16 hex digits), else 0."""
    text = name.decode("ascii", "replace")
    digits = "0123456789abcdefABCDEF"
    return int(text, 16) if len(text) == 16 and all(c in digits for c in text) else 0


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _shown(key: bytes) -> str:
    return shown(_text(key))
