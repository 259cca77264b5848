"""An OCDBT database's b-tree, read by lazyckpt itself (`ocdbt_format`): checked whole
when a checkpoint opens, and listed by prefix.

tensorstore's driver decodes whatever node a read of a key leads it to, and would
allocate whatever that node's lengths ask for. So before the driver reads anything,
`Tree.check` reads the manifest (`ocdbt_manifest`) and every node reachable from the
newest version's root, each once (by its data file, a local one by device and inode
whatever path names it, its place there and, where it has a table, the path that
table is relative to), and refuses by name any that would decode past
`ocdbt_format.MAX_DECODED_BYTES`, that tensorstore's decoder would refuse, or that is
no node of a b-tree: a child whose height is not its parent's less one (a node that
names itself, or any cycle of nodes, has one), or whose keys fall outside the range
its parent gives it, on any path to it (a node's range depends on its parent's keys
alone, so the check of each edge covers every path through it). Where the tree is a
tree (no node reached twice, as tensorstore's writer makes them) and small enough
(`MAX_TREE_*`), the check also hands back every key's place, for `ocdbt.Index`.

The format lets many paths reach one node (a b-tree of 20 KB can name 10**8 keys), so
a listing walks only the children whose keys meet the prefix, counts nodes and keys
each time a path reaches them, and stops by name past `MAX_LISTED_NODES` or
`MAX_LISTED_KEYS`. A node of 1 KB can take a second to decode, and many files can hold
it: a check and a listing each decode at most `MAX_WALK_*` in all, and hold at most
`MAX_HELD_BYTES` at once; the memory this process may take running out is a
`TooLargeError` too.

The driver reads each node again later: a local data file is checked to be the file
the check saw (by device and inode, `identities`) before each read through the driver
starts, and a file over HTTP is read at the version the relay pinned; on `gs://` and
`s3://` the driver reads whatever object is there then, so a node that the bucket's
owner replaces after `open` reaches tensorstore's decoder unchecked (as does a local
data file rewritten in place).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
from collections.abc import Iterator
from typing import TypeVar

import attrs

from lazyckpt._errors import CorruptCheckpointError, LazyckptError, TooLargeError
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._storage.ocdbt_format import MAX_DECODED_BYTES, FormatError, Node, Place, Ref, node
from lazyckpt._storage.ocdbt_manifest import Sizes, newest
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
"""The nodes on one path from the root, held while a walk goes down it, and the node
it reads, hold at most this much (`Node.held`; `TooLargeError` past it)."""

MAX_WALK_BYTES = 4 << 30
"""A check, or a listing, decodes nodes that hold at most this many bytes decoded in
all, each counted every time it is decoded (`TooLargeError` past it): a node of 1 KB
can hold 80 MB decoded (0.4 s), and many paths, or files, can name it."""

MAX_WALK_ENTRIES = 8 * MAX_TREE_KEYS
"""Likewise for the entries of those nodes (keys and data files: a step of Python
each)."""

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

_Key = tuple[object, int, int, bytes | None]
"""A node's place, as a walk tells nodes apart: its data file (by device and inode on
this machine, else by its path), offset and length, and the base path that its table's
paths are relative to (None where it has no table: a leaf of inline values, the same
node whatever path reaches it)."""

_Value = TypeVar("_Value")


@attrs.frozen
class _Reach:
    """A node as a path reaches it: where it is (`ref`, and `key`), the height it must
    have, and the range its keys must fall in (`high` None: no end; b"": none can), each
    relative to the prefix that the path gives its keys (`prefix`)."""

    ref: Ref
    height: int
    low: bytes
    high: bytes | None
    prefix: bytes
    key: _Key


@attrs.define
class _Frame:
    """A node whose children a walk goes through: the reaches made of them already
    (`ahead`, whose first `asked` have had their reads started, or need none), the
    others (`coming`, made as they are needed), and what the node holds (`held`)."""

    ahead: collections.deque[_Reach]
    coming: Iterator[_Reach]
    held: int
    asked: int = 0


@attrs.define(eq=False)
class Tree:
    """An OCDBT database's newest b-tree, read through `base`, the store of its files."""

    base: ts.KvStore = attrs.field(repr=False)
    location: str
    """The database, as errors name it."""
    folder: str | None = None
    """Its folder on this machine, where it is local: a manifest's size is known before
    it is read, and a data file is known by its device and inode."""
    sizes: Sizes | None = attrs.field(default=None, repr=False)
    """The sizes of its files, where the store that reads them knows them (over HTTP)."""
    _root: _Reach | None = attrs.field(default=None, init=False)
    _cache: collections.OrderedDict[_Key, Node] = attrs.field(
        factory=collections.OrderedDict, init=False, repr=False
    )
    _cached: int = attrs.field(default=0, init=False)
    _files: dict[bytes, object] = attrs.field(factory=dict, init=False, repr=False)
    """Each data file's identity (`_Key`), by its path, for the first `MAX_CHECKED_NODES`."""
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def check(self) -> dict[bytes, Place] | None:
        """Read the manifest and every node of the newest version, each once; every
        key's place where the tree is a tree within `MAX_TREE_*`, else None.
        `CorruptCheckpointError` naming the file or node where one is malformed or
        would decode too large, `TooLargeError` past `MAX_CHECKED_*`, `MAX_WALK_*` or
        the memory this process may take; a failed read is tensorstore's `ValueError`."""
        try:
            return self._check()
        except LazyckptError:
            raise
        except MemoryError:
            raise TooLargeError(self._no_memory("checking the b-tree of")) from None

    def _check(self) -> dict[bytes, Place] | None:
        found = newest(self.base, self.location, self.folder, self.sizes)
        if found is None or found.root is None:
            return {}
        self._root = self._reach(found.root, found.height, b"", None, b"")
        seen: dict[_Key, tuple[int, bytes, bytes]] = {}
        places: dict[bytes, Place] | None = {}
        stored = kept = decoded = 0
        for reach, at in self._walk(self._root, "checking the b-tree of", seen=seen):
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
            if places is None or at.height:
                continue
            if (
                len(places) + len(at.keys) > MAX_TREE_KEYS
                or decoded > MAX_TREE_BYTES
                or len(seen) > MAX_TREE_NODES
            ):
                places = None
                continue
            keys = [reach.prefix + key for key in at.keys] if reach.prefix else at.keys
            places.update(zip(keys, at.values(), strict=True))
        return places

    def listing(self, start: bytes, end: bytes | None) -> list[bytes]:
        """The keys from `start` to before `end` (None: no end), walking only the
        children whose keys meet that range; `TooLargeError` past `MAX_LISTED_NODES`,
        `MAX_LISTED_KEYS` or `MAX_WALK_*`, each node and key counted every time a path
        reaches it."""
        if self._root is None:
            return []
        doing = f"listing {_shown(start)} in"
        try:
            return self._listing(self._root, start, end, doing)
        except LazyckptError:
            raise
        except MemoryError:
            raise TooLargeError(self._no_memory(doing)) from None

    def _listing(self, root: _Reach, start: bytes, end: bytes | None, doing: str) -> list[bytes]:
        found: list[bytes] = []
        walk = self._walk(root, doing, wanted=(start, end))
        for nodes, (reach, at) in enumerate(walk, 1):
            assert at is not None
            if not at.height:
                first, stop = _span(at.keys, reach.prefix, start, end, leaf=True)
                found.extend(reach.prefix + key for key in at.keys[first:stop])
            if nodes > MAX_LISTED_NODES or len(found) > MAX_LISTED_KEYS:
                raise TooLargeError(
                    f"{self.location}: {doing} the OCDBT database reaches more than "
                    f"{MAX_LISTED_NODES:,} nodes or {MAX_LISTED_KEYS:,} keys (its b-tree "
                    "may name some nodes many times); lazyckpt lists no more"
                )
        return found

    def _walk(
        self,
        root: _Reach,
        doing: str,
        *,
        seen: dict[_Key, tuple[int, bytes, bytes]] | None = None,
        wanted: tuple[bytes, bytes | None] | None = None,
    ) -> Iterator[tuple[_Reach, Node | None]]:
        """Each reach of the tree under `root`, depth first, and its node, checked
        against the reach: with `seen`, each node once (a later reach is checked against
        what `seen` keeps of it, and comes with None), else each time a path reaches it;
        with `wanted` (a range of keys), only the children whose keys meet it. The reads
        of the next few children are started together (`_AHEAD`). Every node it decodes
        counts towards `MAX_WALK_*`, and those it holds at once towards
        `MAX_HELD_BYTES` (`doing`: what the walk is for, as errors say)."""
        frames = [_Frame(collections.deque([root]), iter(()), 0)]
        started: dict[_Key, ts.Future[ts.KvStore.ReadResult] | Node] = {}
        held = decoded = entries = 0
        while frames:
            frame = frames[-1]
            frame.ahead.extend(itertools.islice(frame.coming, _AHEAD - len(frame.ahead)))
            if not frame.ahead:
                frames.pop()
                held -= frame.held
                continue
            self._start_ahead(frame, started, seen)
            reach = frame.ahead.popleft()
            frame.asked -= 1
            known = None if seen is None else _known(seen, reach.key)
            if known is not None:
                started.pop(reach.key, None)  # (read ahead before another path reached it)
                self._check_reach(reach, *known)
                yield reach, None
                continue
            at = self._finish(reach, started.pop(reach.key, None))
            self._check_reach(reach, at.height, at.keys[0], at.keys[-1])
            decoded += at.decoded
            entries += at.entries
            if decoded > MAX_WALK_BYTES or entries > MAX_WALK_ENTRIES:
                raise TooLargeError(
                    f"{self.location}: {doing} the OCDBT database decodes b-tree nodes that "
                    f"hold more than {MAX_WALK_BYTES:,} bytes or {MAX_WALK_ENTRIES:,} entries "
                    "in all (its b-tree may name a node many times, or from many files); "
                    "lazyckpt stops there"
                )
            if held + at.held > MAX_HELD_BYTES:
                raise TooLargeError(
                    f"{self.location}: the nodes on one path of the OCDBT database's "
                    f"b-tree hold more than {MAX_HELD_BYTES:,} bytes in memory; lazyckpt "
                    "stops there"
                )
            if seen is not None:
                seen[_kept_as(reach.key, at)] = (at.height, at.keys[0], at.keys[-1])
            yield reach, at
            if at.height:
                held += at.held
                frames.append(
                    _Frame(collections.deque(), self._children(reach, at, wanted), at.held)
                )

    def _start_ahead(
        self,
        frame: _Frame,
        started: dict[_Key, ts.Future[ts.KvStore.ReadResult] | Node],
        seen: dict[_Key, tuple[int, bytes, bytes]] | None,
    ) -> None:
        """Start the reads of the nodes of `frame`'s reaches made already and not read
        yet, the first always, the others while what is in flight stays within
        `_AHEAD_BYTES`."""
        flight = sum(key[2] for key, read in started.items() if not isinstance(read, Node))
        for reach in itertools.islice(frame.ahead, frame.asked, None):
            if reach.key not in started and (seen is None or _known(seen, reach.key) is None):
                if frame.asked and flight + reach.ref.length > _AHEAD_BYTES:
                    return
                started[reach.key] = self._start(reach)
                flight += reach.ref.length
            frame.asked += 1

    def _reach(
        self, ref: Ref, height: int, low: bytes, high: bytes | None, prefix: bytes
    ) -> _Reach:
        file = self._files.get(ref.file)
        if file is None:
            file = self._identity(ref.file)
        return _Reach(ref, height, low, high, prefix, (file, ref.offset, ref.length, ref.base))

    def _identity(self, path: bytes) -> object:
        """The data file at `path`: its device and inode where it is a local file (many
        paths can name one file: hard links, links to folders), else its path."""
        found: object = path
        # (only a path as tensorstore's file kvstore reads it: no part empty, `.` or `..`)
        if self.folder is not None and not {b"", b".", b".."} & set(path.split(b"/")):
            try:
                info = os.stat(os.fsencode(self.folder) + b"/" + path)
            except (OSError, ValueError):
                pass  # (its read fails, and says so)
            else:
                found = (info.st_dev, info.st_ino)
        if len(self._files) < MAX_CHECKED_NODES:
            self._files[path] = found
        return found

    def _children(
        self, reach: _Reach, at: Node, wanted: tuple[bytes, bytes | None] | None
    ) -> Iterator[_Reach]:
        """The reaches of `at`'s children (only those whose keys meet the range
        `wanted`), made as they are asked for: child i holds the keys from its key to
        before the next one's (the last, to before its parent's end), each relative to
        its key's prefix that all its keys share."""
        count = len(at.keys)
        first, stop = 0, count
        if wanted is not None:
            first, stop = _span(at.keys, reach.prefix, *wanted, leaf=False)
        for i, (ref, shared) in enumerate(at.children(first, stop), first):
            key = at.keys[i]
            common = key[:shared]
            high = at.keys[i + 1] if i + 1 < count else reach.high
            yield self._reach(
                ref, at.height - 1, key[shared:], _after(high, common), reach.prefix + common
            )

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

    def _no_memory(self, doing: str) -> str:
        return (
            f"{self.location}: {doing} the OCDBT database, lazyckpt ran out of the memory "
            "this process may take (its b-tree may name a node many times); give it more "
            "memory, or copy the checkpoint again from a source you trust"
        )

    def _start(self, reach: _Reach) -> ts.Future[ts.KvStore.ReadResult] | Node:
        ref = reach.ref
        with self._lock:
            cached = _known(self._cache, reach.key)
            if cached is not None:
                self._cache.move_to_end(_kept_as(reach.key, cached))
                return cached
        if ref.length > MAX_DECODED_BYTES:
            raise CorruptCheckpointError(
                self._malformed(ref, f"is {ref.length:,} bytes long, more than lazyckpt reads")
            )
        return self.base.read(ref.file, byte_range=slice(ref.offset, ref.offset + ref.length))

    def _finish(
        self, reach: _Reach, started: ts.Future[ts.KvStore.ReadResult] | Node | None
    ) -> Node:
        """The node at `reach`, from its read (`started`), decoded and kept in the cache."""
        ref = reach.ref
        if started is None:
            started = self._start(reach)
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
            if found.held <= _CACHE_BYTES:
                self._cache[_kept_as(reach.key, found)] = found
                self._cached += found.held
                while self._cached > _CACHE_BYTES:
                    _, old = self._cache.popitem(last=False)
                    self._cached -= old.held
        return found


def _known(kept: dict[_Key, _Value], key: _Key) -> _Value | None:
    """What `kept` holds of the node at `key`: kept with no base path where it has no
    table, else with its own."""
    found = kept.get((*key[:3], None))
    return kept.get(key) if found is None else found


def _kept_as(key: _Key, at: Node) -> _Key:
    """The key under which the node `at`, reached at `key`, is kept (`_known`)."""
    return key if at.files else (*key[:3], None)


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


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _shown(key: bytes) -> str:
    return shown(_text(key))
