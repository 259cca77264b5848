"""OCDBT's manifests and b-tree nodes, read by lazyckpt before tensorstore decodes them.

tensorstore's decoder sizes what it allocates from the lengths that a manifest or node
gives: a table of a million data-file paths of 64 KiB each, or keys that add up to
64 GiB, fit in a few KiB once compressed, and decoding them exhausts memory or aborts
the process. So lazyckpt reads each one first, as tensorstore's format describes it
(tensorstore/kvstore/ocdbt/index.rst): its header and CRC-32C, its body (decompressed
to at most `MAX_DECODED_BYTES`), its columns of lengths (with NumPy, a column at a
time), what decoding it would hold (`decoded`, refused past `MAX_DECODED_BYTES`), and
then its keys, values and children. Whatever this does not read whole is
`FormatError`, saying what is wrong. tensorstore's driver reads no version-tree node
to read the newest version (a database whose version-tree nodes are garbage reads as
before), so a manifest's references to them are read, and never followed.

A node's children and values stay columns of numbers until they are asked for
(`Node.children`, `Node.values`), and `Node.held` says what the node holds in this
process's memory, which the walks of `ocdbt_tree` bound.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Iterator

import attrs
import numpy as np
import zstandard

from lazyckpt._storage.checksum import crc32c

MANIFEST_MAGIC = 0x0CDB3A2A
NODE_MAGIC = 0x0CDB20DE

MAX_DECODED_BYTES = 256 << 20
"""The most that a manifest or node may hold decoded, stored bytes included, as
`decoded` counts it: Orbax lets tensorstore fill nodes up to 100 MB as tensorstore's
writer estimates them, which this count (every entry's place in memory besides its key
and value) puts at up to twice that."""

MAX_KEY = 65535
"""The longest key, and the longest data-file path, that the format allows."""

MAX_ENTRIES = 1 << 20
"""The most entries a node may hold (tensorstore's `kMaxNodeArity`)."""

MAX_INLINE = 1 << 20
"""The longest value a leaf may hold inline (tensorstore's `kMaxInlineValueLength`)."""

MISSING = (1 << 64) - 1
"""Offset and length of a reference to nothing: the root of an empty database."""

_LEAF_ENTRY = 72
"""Bytes tensorstore holds for a leaf's entry besides its key and value: the entry, a
value length and two key lengths."""
_INTERIOR_ENTRY = 88
"""Likewise for a child's entry: its reference, statistics and key lengths."""
_TABLE_ENTRY = 64
"""Likewise for a data file of a table, besides its path."""

_HELD_ENTRY = 96
"""Bytes a `Node` holds for an entry besides its key's and inline value's bytes: the
key as a Python `bytes` in a list (about 50) and four columns of 8-byte numbers
(tests/test_ocdbt_index.py measures it)."""
_HELD_FILE = 192
"""Likewise for a data file of its table besides its path: a tuple of two `bytes`."""

_BATCH = 4096
"""Keys decoded, and children made into references, at a time: few Python numbers at
once."""


class FormatError(ValueError):
    """A manifest or node that tensorstore's decoder would refuse, or that would hold
    more than `MAX_DECODED_BYTES` decoded."""


@attrs.frozen
class Ref:
    """Where a node lies: its data file (`base` + `relative`), offset and length. Its
    own table's paths are relative to `base`, the path its parent's table gave."""

    base: bytes
    relative: bytes
    offset: int
    length: int

    @property
    def file(self) -> bytes:
        return self.base + self.relative


@attrs.frozen
class Manifest:
    """What a manifest says of the newest version: where its root is (None in an empty
    database), and its height; `numbered` where the manifest holds only the
    configuration and the versions are in the newest `manifest.{generation:016x}`."""

    numbered: bool
    root: Ref | None = None
    height: int = 0


Place = bytes | tuple[str, int, int]
"""A key's value: inline bytes, or (data file, offset, length) in the base store."""


@attrs.frozen
class Node:
    """A b-tree node: its keys (relative to the prefix its parents give it, increasing)
    and its table of data files (each its base path and the path relative to that);
    a leaf's values (`values`) or an interior node's children (`children`), kept as
    columns of numbers until they are asked for. `decoded` is what tensorstore holds
    to decode it (as `MAX_DECODED_BYTES` bounds it), `held` what this object holds."""

    height: int
    keys: list[bytes]
    files: list[tuple[bytes, bytes]]
    columns: np.ndarray = attrs.field(repr=False)
    """Four rows of a number per entry: a child's data file, offset, length and the
    length of its key's prefix that all keys below it share; or a value's kind
    (0 inline, 1 in a data file), length, data file and offset."""
    inline: bytes = attrs.field(repr=False)
    """A leaf's inline values, one after the other."""
    decoded: int
    held: int

    @property
    def entries(self) -> int:
        """Its keys and data files: what decoding it did a step of Python for each."""
        return len(self.keys) + len(self.files)

    def children(self, first: int, stop: int) -> Iterator[tuple[Ref, int]]:
        """Children `first` to before `stop`, each the node and the length of its key's
        prefix that all keys below it share: made a batch at a time, as asked for."""
        for at in range(first, stop, _BATCH):
            files, offsets, lengths, shared = self.columns[:, at : min(at + _BATCH, stop)].tolist()
            for file, offset, length, common in zip(files, offsets, lengths, shared, strict=True):
                base, relative = self.files[file]
                yield Ref(base, relative, offset, length), common

    def values(self) -> list[Place]:
        """A leaf's values, each inline bytes or a place in a data file."""
        kinds, lengths, files, offsets = self.columns
        sizes = np.where(kinds == 0, lengths, 0)
        ends = np.cumsum(sizes)
        names = [
            (base + relative).decode("utf-8", "surrogateescape") for base, relative in self.files
        ]
        raw = self.inline
        return [
            (names[file], offset, length) if kind else raw[end - length : end]
            for kind, length, end, file, offset in zip(
                kinds.tolist(),
                lengths.tolist(),
                ends.tolist(),
                files.tolist(),
                offsets.tolist(),
                strict=True,
            )
        ]


def manifest(data: bytes) -> Manifest:
    """The manifest encoded in `data` (`FormatError` where tensorstore would refuse it,
    or past `MAX_DECODED_BYTES`)."""
    body, reader = _opened(data, MANIFEST_MAGIC)
    reader.take(16)  # (the database's uuid)
    kind = reader.byte()
    if kind > 1:
        raise FormatError(f"has manifest kind {kind}, where 0 and 1 are known")
    reader.varint(32), reader.varint(32)  # (the largest inline value and node)
    arity = reader.byte()
    if not 1 <= arity <= 16:
        raise FormatError(f"has a version tree of arity 2**{arity}, outside 2**1 to 2**16")
    compression = reader.varint(32)
    if compression > 1:
        raise FormatError(f"has compression method {compression}, where 0 and 1 are known")
    if compression:
        reader.take(4)  # (the zstd level its writer uses)
    if kind == 1:
        reader.end()
        return Manifest(numbered=True)
    table, decoded = _table(reader, b"", len(data) + len(body))
    count = reader.varint(64)
    if not 1 <= count <= 1 << arity:
        raise FormatError(f"lists {count} versions inline, where 1 to {1 << arity} fit")
    reader.varints(count, 64)  # (generation numbers)
    heights = reader.take(count)
    roots = _refs(reader, table, count, missing=True)
    reader.varints(3 * count, 64)  # (each root's statistics)
    reader.take(8 * count)  # (commit times)
    older = reader.varint(64)
    if older > max(63 // arity - 1, 0):
        raise FormatError(f"refers to {older} version-tree nodes, more than its arity allows")
    reader.varints(older, 64)  # (their generation numbers)
    _refs(reader, table, older, missing=False)
    reader.varints(older, 64)  # (their numbers of generations)
    reader.take(9 * older)  # (commit times and heights)
    reader.end()
    _bounded(decoded + (count + older) * _INTERIOR_ENTRY)
    root = roots[-1]
    return Manifest(False, None if root.offset == MISSING else root, heights[-1])


def node(data: bytes, base: bytes) -> Node:
    """The b-tree node encoded in `data`, its table's paths relative to `base`
    (`FormatError` where tensorstore would refuse it, or past `MAX_DECODED_BYTES`)."""
    body, reader = _opened(data, NODE_MAGIC)
    height = reader.byte()
    stored = len(data) + len(body)
    table, decoded = _table(reader, base, stored)
    table_decoded = decoded - stored
    count = reader.varint(32)
    if not 1 <= count <= MAX_ENTRIES:
        raise FormatError(f"holds {count} entries, where 1 to {MAX_ENTRIES} fit")
    prefixes = np.concatenate([np.zeros(1, np.uint64), reader.varints(count - 1, 16)])
    suffixes = reader.varints(count, 16)
    lengths = prefixes + suffixes
    if np.any(lengths > MAX_KEY):
        raise FormatError(f"holds a key of more than {MAX_KEY} bytes")
    if np.any(prefixes[1:] > lengths[:-1]):
        raise FormatError("holds a key that shares more with the key before it than that key holds")
    shared = reader.varints(count, 16) if height else None
    if shared is not None and np.any(shared > lengths):
        raise FormatError("gives a child a common prefix longer than its key")
    # tensorstore keeps the node's keys in one buffer, less the prefix all of them share.
    common = int(min(prefixes[1:].min(initial=MAX_KEY), suffixes[0]))
    if shared is not None:
        common = min(common, int(shared.min()))
    entry = _INTERIOR_ENTRY if height else _LEAF_ENTRY
    decoded += common + int(lengths.sum()) - count * common + count * entry
    _bounded(decoded)
    keys = _keys(reader, prefixes, suffixes)
    if height:
        assert shared is not None
        columns = np.stack([*_places(reader, table, count), shared])
        for _ in range(3):  # (each child's statistics, a column at a time)
            reader.varints(count, 64)
        inline = b""
    else:
        columns, inline = _values(reader, table, count)
    reader.end()
    # (the table as `_table` counted it, with Python's objects in place of tensorstore's)
    files = table_decoded + len(table) * (_HELD_FILE - _TABLE_ENTRY)
    held = int(lengths.sum()) + count * _HELD_ENTRY + files + len(inline)
    return Node(height, keys, table, columns, inline, decoded, held)


def _bounded(decoded: int) -> None:
    if decoded > MAX_DECODED_BYTES:
        raise FormatError(
            f"would hold at least {decoded:,} bytes decoded, more than the "
            f"{MAX_DECODED_BYTES:,} that lazyckpt lets tensorstore decode"
        )


def _opened(data: bytes, magic: int) -> tuple[bytes, _Reader]:
    """The body of an encoded manifest or node, decompressed, and a reader of it."""
    if len(data) < 16:
        raise FormatError(f"holds {len(data)} bytes, fewer than its header and checksum")
    found, length = struct.unpack_from(">I", data)[0], struct.unpack_from("<Q", data, 4)[0]
    if found != magic:
        raise FormatError(f"starts with {found:#010x}, not {magic:#010x}")
    if length != len(data):
        raise FormatError(f"says it holds {length} bytes, where it holds {len(data)}")
    (checksum,) = struct.unpack_from("<I", data, len(data) - 4)
    if crc32c(memoryview(data)[:-4]) != checksum:
        raise FormatError("does not match its CRC-32C checksum")
    header = _Reader(data[12:-4])
    if header.varint(32) != 0:
        raise FormatError("has a format version other than 0")
    compression = header.varint(32)
    rest = data[12 + header.at : -4]
    if compression == 0:
        return rest, _Reader(rest)
    if compression != 1:
        raise FormatError(f"has compression format {compression}, where 0 and 1 are known")
    body = _decompressed(rest, MAX_DECODED_BYTES + 1 - len(data))
    _bounded(len(data) + len(body))
    return body, _Reader(body)


def _decompressed(data: bytes, most: int) -> bytes:
    """`data` decompressed, or its first `most` bytes: read in pieces that double, from
    a few times its length (tensorstore's writer does not say how long it is), so that
    no buffer of `most` bytes is taken for a node of a few."""
    pieces = []
    size = min(max(8 * len(data), 1 << 16), most)
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True) as stream:
            while most > 0 and (piece := stream.read(size)):
                pieces.append(piece)
                most -= len(piece)
                size = min(2 * size, most)
    except zstandard.ZstdError as error:
        raise FormatError(f"is not valid zstd data ({error})") from None
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _table(reader: _Reader, base: bytes, decoded: int) -> tuple[list[tuple[bytes, bytes]], int]:
    """A table of data files, each (its base path, the path relative to that), the
    base paths after `base`; and `decoded` with what decoding the table holds."""
    count = reader.varint(64)
    if count > MAX_ENTRIES:
        # (a node names at most one data file an entry; a manifest, one a version)
        raise FormatError(f"names {count:,} data files, more than the {MAX_ENTRIES:,} it can use")
    prefixes = np.concatenate([np.zeros(min(count, 1), np.uint64), reader.varints(count - 1, 16)])
    suffixes = reader.varints(count, 16)
    bases = reader.varints(count, 16)
    lengths = prefixes + suffixes
    if np.any(lengths > MAX_KEY - len(base)) or np.any(bases > lengths):
        raise FormatError("names a data file whose path is too long, or shorter than its base")
    before = np.concatenate([np.zeros(min(count, 1), np.uint64), bases[:-1]])
    if np.any((prefixes > np.minimum(before, bases)) & (bases != before)):
        raise FormatError("names data files whose base paths share more than they hold")
    # (each path a string of its own, after `base`: the most that decoding may hold)
    decoded += count * (_TABLE_ENTRY + len(base)) + int(lengths.sum())
    _bounded(decoded)
    files = []
    path = b""
    for shared, suffix, length in zip(
        prefixes.tolist(), suffixes.tolist(), bases.tolist(), strict=True
    ):
        path = path[:shared] + reader.take(suffix)
        files.append((base + path[:length], path[length:]))
    return files, decoded


def _refs(
    reader: _Reader, table: list[tuple[bytes, bytes]], count: int, *, missing: bool
) -> list[Ref]:
    """`count` references: data files, offsets and lengths, each a column."""
    ids = reader.varints(count, 64)
    offsets = reader.varints(count, 64)
    lengths = reader.varints(count, 64)
    if np.any(ids >= len(table)):
        raise FormatError(f"refers to a data file outside its table of {len(table)}")
    out = []
    for at, offset, length in zip(ids.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
        if not (missing and offset == length == MISSING) and offset + length >= 1 << 63:
            raise FormatError(f"refers to bytes {offset} to {offset + length} of a data file")
        base, relative = table[at]
        out.append(Ref(base, relative, offset, length))
    return out


def _past_end(offsets: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether a range of a data file ends past 2**63 - 1, as tensorstore refuses."""
    limit = np.uint64(1 << 63)
    return bool(np.any((offsets >= limit) | (lengths >= limit) | (offsets + lengths >= limit)))


def _keys(reader: _Reader, prefixes: np.ndarray, suffixes: np.ndarray) -> list[bytes]:
    """The keys whose lengths the columns give, each made of what it shares with the
    one before it and its own suffix (a batch of columns at a time, as Python numbers);
    strictly increasing, as tensorstore checks."""
    start = reader.at
    raw = reader.take(int(suffixes.sum()))
    ends = np.cumsum(suffixes)
    keys: list[bytes] = []
    key = b""
    for at in range(0, ends.size, _BATCH):
        batch = slice(at, at + _BATCH)
        for shared, begin, end in zip(
            prefixes[batch].tolist(),
            (ends[batch] - suffixes[batch]).tolist(),
            ends[batch].tolist(),
            strict=True,
        ):
            key = key[:shared] + raw[begin:end]
            keys.append(key)
    if not all(map(operator.lt, keys, itertools.islice(keys, 1, None))):
        raise FormatError(f"holds keys out of order (at byte {start} of its body)")
    return keys


def _places(
    reader: _Reader, table: list[tuple[bytes, bytes]], count: int, lengths: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`count` places in data files, each a column: data files, offsets and lengths
    (`lengths`, where they were read before)."""
    ids = reader.varints(count, 64)
    offsets = reader.varints(count, 64)
    if lengths is None:
        lengths = reader.varints(count, 64)
    if np.any(ids >= len(table)):
        raise FormatError(f"refers to a data file outside its table of {len(table)}")
    if _past_end(offsets, lengths):
        raise FormatError("refers to bytes past the end that any data file can have")
    return ids, offsets, lengths


def _values(
    reader: _Reader, table: list[tuple[bytes, bytes]], count: int
) -> tuple[np.ndarray, bytes]:
    """A leaf's values as `Node.columns` holds them, and its inline values' bytes."""
    lengths = reader.varints(count, 64)
    kinds = np.frombuffer(reader.take(count), np.uint8).astype(np.uint64)
    if np.any(kinds > 1):
        raise FormatError("gives a value a kind other than inline (0) or in a data file (1)")
    inline = kinds == 0
    if np.any(lengths[inline] > MAX_INLINE):
        raise FormatError(f"holds an inline value of more than {MAX_INLINE} bytes")
    indirect = ~inline
    ids, offsets, _ = _places(reader, table, int(indirect.sum()), lengths[indirect])
    raw = reader.take(int(lengths[inline].sum()))
    files = np.zeros(count, np.uint64)
    places = np.zeros(count, np.uint64)
    files[indirect], places[indirect] = ids, offsets
    return np.stack([kinds, lengths, files, places]), raw


class _Reader:
    """A body read field by field, and column by column."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.array = np.frombuffer(body, np.uint8)
        self.at = 0

    def take(self, count: int) -> bytes:
        if count > len(self.body) - self.at:
            raise FormatError(
                f"ends within a field of {count} bytes, at byte {self.at} of its body"
            )
        self.at += count
        return self.body[self.at - count : self.at]

    def byte(self) -> int:
        return self.take(1)[0]

    def varint(self, bits: int) -> int:
        return int(self.varints(1, bits)[0])

    def varints(self, count: int, bits: int) -> np.ndarray:
        """A column of `count` varints (7 bits a byte, low ones first, a set high bit
        saying more follow), each of at most `bits` bits, as riegeli reads them; with
        arrays of `count` numbers, never one a byte."""
        if count <= 0:
            return np.zeros(0, np.uint64)
        most = 5 if bits <= 32 else 10
        window = self.array[self.at : self.at + count * most]
        ends = _ends(window, count)
        if ends.size < count:
            raise FormatError(f"ends within a column of {count} numbers, at byte {self.at}")
        starts = np.concatenate([np.zeros(1, np.intp), ends[:-1] + 1])
        sizes = ends - starts + 1
        longest = int(sizes.max())
        if longest > most:
            raise FormatError(f"holds a number of more than {most} bytes, at byte {self.at}")
        if bits == 64 and np.any((sizes == 10) & (window[ends] > 1)):
            raise FormatError(f"holds a number of more than 64 bits, at byte {self.at}")
        values: np.ndarray = (window[starts] & 0x7F).astype(np.uint64)
        for k in range(1, longest):
            byte = (window[np.minimum(starts + k, ends)] & 0x7F).astype(np.uint64)
            byte[sizes <= k] = 0
            values |= byte << np.uint64(7 * k)
        if bits < 64 and np.any(values >> np.uint64(bits)):
            raise FormatError(f"holds a number of more than {bits} bits, at byte {self.at}")
        self.at += int(ends[-1]) + 1
        return values

    def end(self) -> None:
        if self.at != len(self.body):
            raise FormatError(f"holds {len(self.body) - self.at} bytes past its last field")


def _ends(window: np.ndarray, count: int) -> np.ndarray:
    """Where the first `count` varints in `window` end (at most `count` positions): a
    piece of `count` bytes at a time, which holds them all where each takes a byte."""
    found = []
    have = 0
    for at in range(0, window.size, count):
        piece = np.flatnonzero(window[at : at + count] < 0x80)[: count - have]
        found.append(piece + at)
        have += piece.size
        if have == count:
            break
    return np.concatenate(found) if found else np.zeros(0, np.intp)
