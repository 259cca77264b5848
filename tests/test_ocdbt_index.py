"""An OCDBT database's b-tree as lazyckpt reads it itself (`_storage/ocdbt_format`,
`ocdbt_tree`, `ocdbt.Index`): the same nodes as tensorstore decodes, the same values
and listings as its driver gives, on trees of several levels, and a clear error, never
a fill value, when a data file is gone. Hostile databases (manifests and nodes written
here by hand, in tensorstore's format: a node that names itself, two that name each
other, one leaf named a hundred times, a few KiB that decode to 64 GiB, a tree of
20 KB that names 10**8 keys) are refused by name, or read, in bounded time and memory,
before tensorstore's decoder sees them."""

from __future__ import annotations

import itertools
import json
import shutil
import struct
import subprocess
import sys
import tracemalloc
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
import tensorstore as ts
import zstandard

import lazyckpt
from lazyckpt import CorruptCheckpointError, TooLargeError
from lazyckpt._storage import checksum, ocdbt_format, ocdbt_tree
from lazyckpt._storage.ocdbt import Index
from lazyckpt._storage.ocdbt_tree import Tree
from tests.helpers import expect, orbax_save, run_cases


def _database(path: Path, **spec: Any) -> dict[str, bytes]:
    """A database written by tensorstore with nodes small enough for a b-tree of three
    levels, values inline and in data files, keys sharing long prefixes."""
    values = {f"layer_{i // 10}/w/{i % 10}": bytes([i]) * (8 if i % 3 else 40) for i in range(200)}
    config = {"max_decoded_node_bytes": 256, "max_inline_value_bytes": 16}
    store = ts.KvStore.open(
        {
            "driver": "ocdbt",
            "base": f"file://{path}/",
            **spec,
            "config": {**config, **spec.get("config", {})},
        }
    ).result()
    with ts.Transaction() as txn:
        for key, value in values.items():
            store.with_transaction(txn)[key] = value
    return values


def _index(path: Path) -> Index:
    """The index of the database at `path`, its b-tree read whole, as `open` reads it."""
    index = Index(Tree(ts.KvStore.open(f"file://{path}/").result(), str(path), str(path)))
    index.check()
    return index


def _index_read(path: Path, keys: list[str], ranges: Sequence[slice | None]) -> list[bytes | None]:
    index = _index(path)
    with ts.Batch() as batch:
        found = index.read(keys, ranges, batch)
    assert found is not None, "the index did not serve a read of every key"
    out: list[bytes | None] = []
    for value in found:
        if isinstance(value, ts.Future):
            result = value.result()
            value = result.value if result.state == "value" else None
        out.append(value)
    return out


def _driver(path: Path) -> ts.KvStore:
    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()


def test_the_index_reads_what_the_driver_reads_on_a_tree_of_several_levels(
    tmp_path: Path,
) -> None:
    values = _database(tmp_path)
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{tmp_path}/").result()).result()
    assert manifest["versions"][-1]["root_height"] >= 2
    keys = [*values, "layer_9/w/missing", "absent"]
    assert _index_read(tmp_path, keys, [None] * len(keys)) == [*values.values(), None, None]
    # Byte ranges, of inline values and of values in data files, as the driver cuts them.
    cuts = [slice(2, 5), slice(-4, None), slice(0, 3)]
    driver = _driver(tmp_path)
    some = list(values)[:30]
    expected = [
        driver.read(key, byte_range=cut).result().value
        for key, cut in zip(some, cuts * 10, strict=True)
    ]
    assert _index_read(tmp_path, some, cuts * 10) == expected


@pytest.mark.parametrize(
    "spec",
    [
        {"value_data_prefix": "v a:b%c+é/"},  # (names a dump escapes)
        {"config": {"compression": None}},  # (nodes stored as they are)
        {"config": {"manifest_kind": "numbered"}},  # (versions in manifest.000...)
        {"config": {"version_tree_arity_log2": 1}},  # (a manifest of version nodes)
        # Leaves none of whose values is inline: every value here is 8 or 40 bytes.
        {"config": {"max_inline_value_bytes": 0}},
        {"config": {"max_inline_value_bytes": 4}},
    ],
    ids=["escaped", "uncompressed", "numbered", "version_nodes", "inline_0", "inline_4"],
)
def test_databases_written_otherwise_read_as_the_driver_reads_them(
    tmp_path: Path, spec: dict[str, Any]
) -> None:
    values = _database(tmp_path, **spec)
    driver = _driver(tmp_path)
    for generation in range(6):  # (more versions: older ones in version-tree nodes)
        driver.write(f"layer_0/extra{generation}", b"x" * generation).result()
        values[f"layer_0/extra{generation}"] = b"x" * generation
    assert _index_read(tmp_path, list(values), [None] * len(values)) == list(values.values())
    assert sorted(_index(tmp_path).list_keys("")) == sorted(values)


def test_a_byte_range_past_the_value_fails_as_through_the_driver(tmp_path: Path) -> None:
    values = _database(tmp_path)
    inline, indirect = "layer_0/w/1", "layer_0/w/0"  # 8 bytes in the b-tree, 40 in a file
    assert (len(values[inline]), len(values[indirect])) == (8, 40)
    index = _index(tmp_path)
    assert index.places(wanted=200) is not None  # (a first read of every key builds it)
    with ts.Batch() as batch:
        found = index.read(
            [inline, indirect, indirect],
            [slice(-9, None), slice(30, 41), slice(-40, None)],
            batch,
        )
    assert found is not None
    for failing in found[:2]:
        assert isinstance(failing, ts.Future)
        with pytest.raises(ValueError, match="too few for"):
            failing.result()
    last = found[2]
    assert isinstance(last, ts.Future) and last.result().value == values[indirect]


def test_the_index_serves_only_reads_of_enough_of_its_keys(tmp_path: Path) -> None:
    _database(tmp_path)
    index = _index(tmp_path)
    assert index.places(wanted=2) is None  # 2 of 200 keys: the driver reads those
    # Decided at the first read: later the driver has read the nodes already.
    assert index.places(wanted=100) is None
    places = _index(tmp_path).places(wanted=100)
    assert places is not None and len(places) == 200


def test_a_large_tree_is_left_to_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = _database(tmp_path)
    monkeypatch.setattr(ocdbt_tree, "MAX_TREE_BYTES", 1000)  # (this tree: 20 KB decoded)
    index = _index(tmp_path)
    assert index.places(wanted=200) is None
    assert sorted(index.list_keys("layer_1")) == sorted(k for k in values if k[:7] == "layer_1")


def test_a_damaged_node_is_refused_by_name(tmp_path: Path) -> None:
    """Before, a damaged node left reads to the driver; now the check at `open` reads
    every node first, and names the one whose checksum fails."""
    _database(tmp_path)
    for node_file in (tmp_path / "d").iterdir():
        data = bytearray(node_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        node_file.write_bytes(bytes(data))
    # (the flip lands in a node's body, its checksum, or its header's length)
    damaged = r"of data file 'd/\w+' (does not match its CRC|says it holds \d+ bytes)"
    with pytest.raises(CorruptCheckpointError, match=damaged):
        _index(tmp_path)


def test_listings_are_the_drivers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listings by prefix, from the index's keys and, for a tree the index does not
    hold, from lazyckpt's walk of the tree, are the driver's."""
    _database(tmp_path)
    driver = _driver(tmp_path)
    prefixes = ["", "l", "layer_1", "layer_1/", "layer_19/w/", "layer_3/w/7", "layer_\xff", "zz"]
    expected = {}
    for prefix in prefixes:
        start = prefix.encode()
        end = _after_all(start)
        listed = driver.list(ts.KvStore.KeyRange(start, end or b"")).result()
        expected[prefix] = sorted(key.decode("utf-8", "replace") for key in listed)
    assert expected["layer_1"] and expected["layer_3/w/7"] == ["layer_3/w/7"]
    for bounded in (False, True):
        with monkeypatch.context() as patched:
            if bounded:
                patched.setattr(ocdbt_tree, "MAX_TREE_KEYS", 10)  # (the tree walks itself)
            index = _index(tmp_path)
            for prefix in prefixes:
                assert sorted(index.list_keys(prefix)) == expected[prefix], (bounded, prefix)


def _after_all(start: bytes) -> bytes | None:
    """The first key after every key that starts with `start` (None: no such key)."""
    stripped = start.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None


def test_the_format_reader_decodes_what_tensorstore_decodes(tmp_path: Path) -> None:
    """Every node of trees tensorstore wrote (compressed and not, data files named with
    characters a dump escapes): the same height, keys, values and children as
    tensorstore's own decoder gives (`ts.ocdbt.dump`); and the CRC-32C of the format,
    computed in lanes, is the byte-by-byte one."""
    specs: dict[str, dict[str, Any]] = {
        "zstd": {"value_data_prefix": "v a:b%c+é/"},
        "raw": {"config": {"compression": None}},
    }
    for name, spec in specs.items():
        _database(tmp_path / name, **spec)
        base = ts.KvStore.open(f"file://{tmp_path / name}/").result()
        found = ocdbt_format.manifest((tmp_path / name / "manifest.ocdbt").read_bytes())
        assert found.root is not None and not found.numbered
        pending = [found.root]
        leaves = 0
        while pending:
            ref = pending.pop()
            raw = (tmp_path / name / ref.file.decode()).read_bytes()
            node = ocdbt_format.node(raw[ref.offset : ref.offset + ref.length], ref.base)
            names = (urllib.parse.quote(part.decode()) for part in (ref.base, ref.relative))
            location = ":".join(["btreenode", *names, str(ref.offset), str(ref.length)])
            dumped = ts.ocdbt.dump(base, location).result()
            assert node.height == dumped["height"]
            assert node.keys == [bytes(entry["key"]) for entry in dumped["entries"]]
            children = list(node.children(0, len(node.keys))) if node.height else []
            for entry, (child, shared) in zip(dumped["entries"], children, strict=False):
                assert bytes(entry["subtree_common_prefix"]) == bytes(entry["key"])[:shared]
                assert entry["location"].endswith(f":{child.offset}:{child.length}")
                pending.append(child)
            values = [] if node.height else node.values()
            for entry, value in zip(dumped["entries"], values, strict=False):
                if "inline_value" in entry:
                    assert value == bytes(entry["inline_value"])
                else:
                    assert isinstance(value, tuple)
                    *_, base_path, relative, offset, length = entry["indirect_value"].split(":")
                    file = urllib.parse.unquote(base_path) + urllib.parse.unquote(relative)
                    assert value == (file, int(offset), int(length))
            leaves += not node.height
        assert leaves > 3
    rng = np.random.default_rng(3)
    for size in (4, 16, 255, 1024, 1025, 70_001):
        data = rng.integers(0, 256, size, np.uint8).tobytes()
        assert checksum.crc32c(data) == _crc32c(data), size


@pytest.fixture
def many_small(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """An Orbax checkpoint of small arrays: chunks of 8 bytes (inline in the b-tree) and
    of 2 KiB (in the data files of ocdbt.process_0/d/)."""
    rng = np.random.default_rng(0)
    tree = {
        "tiny": {f"t{i}": np.full(2, i, np.float32) for i in range(20)},
        "wide": {f"w{i}": rng.standard_normal(512, dtype=np.float32) for i in range(20)},
    }
    return orbax_save(tmp_path / "ckpt", tree), tree


def test_small_orbax_arrays_are_read_through_the_index(
    many_small: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, tree = many_small
    served: list[int] = []
    real = Index.read

    def read(self: Index, keys: Any, *args: Any) -> Any:
        found = real(self, keys, *args)
        served.append(0 if found is None else len(keys))
        return found

    monkeypatch.setattr(Index, "read", read)
    loaded = lazyckpt.load(lazyckpt.open(path))
    assert sum(served) >= 80  # the 40 arrays' headers at open, their chunks at load
    for group in tree:
        for name, value in tree[group].items():
            np.testing.assert_array_equal(loaded[group][name], value)


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_data_file_gone_is_an_error_never_a_fill_value(
    many_small: tuple[Path, dict[str, Any]], damage: str
) -> None:
    path, _ = many_small
    lazy = lazyckpt.open(path)
    for data_file in path.glob("ocdbt.process_0/d/*"):
        if damage == "deleted":
            data_file.unlink()
        else:
            data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(
        CorruptCheckpointError, match=r"reading array 'wide/w\d+' .*copy it again"
    ) as raised:
        lazyckpt.load(lazy["wide"])
    assert "data file" in str(raised.value)
    # What is inline in the b-tree is still there.
    np.testing.assert_array_equal(lazyckpt.load(lazy["tiny"])["t3"], [3, 3])


def test_a_copied_checkpoint_reads_through_its_own_files(
    many_small: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, tree = many_small
    copy = shutil.copytree(path, tmp_path / "copy")
    shutil.rmtree(path)
    loaded = lazyckpt.load(lazyckpt.open(copy))
    np.testing.assert_array_equal(loaded["wide"]["w7"], tree["wide"]["w7"])


# Manifests and b-tree nodes written by hand, as tensorstore's format describes them
# (tensorstore/kvstore/ocdbt/index.rst): a header (magic, length, version 0,
# compression 0 or 1 for zstd), the body, and the CRC-32C of all that comes before it.

LEAF = -1
"""The checkpoint's own b-tree, one leaf as Orbax writes it, as a child in `_rewrite`."""

NODE, MANIFEST = 0x0CDB20DE, 0x0CDB3A2A


def _crc32c(data: bytes) -> int:
    """CRC-32C by Google's own implementation: the oracle of lazyckpt's."""
    return int(google_crc32c.value(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


def _framed(magic: int, body: bytes, *, zstd: bool = False, level: int = 19) -> bytes:
    if zstd:
        body = zstandard.ZstdCompressor(level=level).compress(body)
    length = struct.pack("<Q", 12 + 2 + len(body) + 4)
    head = struct.pack(">I", magic) + length + b"\0" + (b"\1" if zstd else b"\0")
    return head + body + struct.pack("<I", _crc32c(head + body))


def _table(paths: list[tuple[int, bytes]], bases: list[int] | None = None) -> bytes:
    """A table of data files, each path given as (the length of what it shares with
    the path before it, the rest of it), and the length of its base path (none)."""
    return b"".join(
        [
            _varint(len(paths)),
            *(_varint(shared) for shared, _ in paths[1:]),
            *(_varint(len(rest)) for _, rest in paths),
            *(_varint(base) for base in bases or [0] * len(paths)),
            *(rest for _, rest in paths),
        ]
    )


def _one_file(path: str) -> bytes:
    return _table([(0, path.encode())])


def _interior(height: int, file: str, children: list[tuple[bytes, int, int, int]]) -> bytes:
    """A node of `height` whose children are each (its first key, the length of the
    prefix that all its keys share, its offset and length in `file`)."""
    return _node(
        height,
        _one_file(file),
        [(key, shared, 0, offset, length) for key, shared, offset, length in children],
    )


def _node(
    height: int,
    table: bytes,
    children: list[tuple[bytes, int, int, int, int]],
    *,
    zstd: bool = False,
) -> bytes:
    """A node of `height` whose children are each (its first key, the length of the
    prefix that all its keys share, its data file in `table`, offset and length)."""
    count = len(children)
    return _framed(
        NODE,
        b"".join(
            [
                bytes([height]),
                table,
                _varint(count),
                _varint(0) * (count - 1),  # (no key written as a prefix of the one before)
                *(_varint(len(key)) for key, *_ in children),
                *(_varint(shared) for _, shared, *_ in children),
                *(key for key, *_ in children),
                *(_varint(file) for _, _, file, _, _ in children),
                *(_varint(offset) for *_, offset, _ in children),
                *(_varint(length) for *_, length in children),
                _varint(0) * 3 * count,  # (statistics: none)
            ]
        ),
        zstd=zstd,
    )


def _leaf(keys: list[tuple[int, bytes]], *, zstd: bool) -> bytes:
    """A leaf whose keys are each (what it shares with the key before, its suffix), and
    whose values are empty, inline."""
    count = len(keys)
    return _framed(
        NODE,
        b"".join(
            [
                b"\0",  # (height 0)
                _varint(0),  # (no data files)
                _varint(count),
                *(_varint(shared) for shared, _ in keys[1:]),
                *(_varint(len(suffix)) for _, suffix in keys),
                *(suffix for _, suffix in keys),
                _varint(0) * count,  # (value lengths)
                b"\0" * count,  # (value kinds: inline)
            ]
        ),
        zstd=zstd,
    )


def _manifest(
    config: dict[str, Any],
    file: str,
    offset: int,
    length: int,
    height: int,
    *,
    table: bytes | None = None,
    zstd: bool = False,
) -> bytes:
    """A manifest of one version, whose root is in `file` (the first of `table`), and
    which claims no keys."""
    root = [_varint(0), _varint(offset), _varint(length), _varint(0) * 3]
    return _framed(
        MANIFEST,
        b"".join(
            [
                bytes.fromhex(config["uuid"]),
                _varint(0),  # (manifest kind: single)
                _varint(config["max_inline_value_bytes"]),
                _varint(config["max_decoded_node_bytes"]),
                bytes([config["version_tree_arity_log2"]]),
                _varint(0),  # (uncompressed)
                _one_file(file) if table is None else table,
                _varint(1),  # (one version: generation 1)
                _varint(1),
                bytes([height]),
                *root,
                struct.pack("<Q", 1),  # (its commit time)
                _varint(0),  # (no older versions)
            ]
        ),
        zstd=zstd,
    )


def _root_of(item: Path) -> tuple[dict[str, Any], str, int, int]:
    """The config of the database of the Orbax checkpoint `item`, and where its root, one
    leaf, is: its data file, offset and length."""
    manifest = ts.ocdbt.dump(ts.KvStore.open(f"file://{item}/").result()).result()
    version = manifest["versions"][-1]
    assert version["root_height"] == 0
    kind, base_path, file, offset, length = version["root"]["location"].split(":")
    assert (kind, base_path) == ("btreenode", "")
    return manifest["config"], file, int(offset), int(length)


def _rewrite(item: Path, nodes: list[tuple[int, list[tuple[bytes, int, int]]]]) -> Path:
    """The OCDBT database of the Orbax checkpoint `item`, whose b-tree is one leaf, given
    `nodes` above it, the first its root: each (height, children), each child (its first
    key, the length of the prefix its keys share, the node it is: an index in `nodes` or
    `LEAF`). The nodes go at the end of the leaf's data file, in a manifest of their own."""
    config, file, leaf_offset, leaf_length = _root_of(item)
    data = (item / file).read_bytes()
    # A node's place is in its parent, or in itself: lay them out until their lengths hold.
    lengths = [0] * len(nodes)
    while True:
        starts = list(itertools.accumulate(lengths, initial=len(data)))
        places = [*zip(starts, lengths, strict=False), (leaf_offset, leaf_length)]  # (`LEAF`)
        encoded = [
            _interior(height, file, [(key, shared, *places[at]) for key, shared, at in children])
            for height, children in nodes
        ]
        if [len(node) for node in encoded] == lengths:
            break
        lengths = [len(node) for node in encoded]
    (item / file).write_bytes(data + b"".join(encoded))
    (item / "manifest.ocdbt").write_bytes(
        _manifest(config, file, len(data), lengths[0], nodes[0][0])
    )
    return item


def _small_checkpoint(path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    tree = {"a": np.arange(8, dtype=np.float32), "b": np.arange(4096, dtype=np.float32)}
    return orbax_save(path, tree), tree


_VERBS = ("open", "summary", "get", "load", "verify")

_SHAPES: dict[str, list[tuple[int, list[tuple[bytes, int, int]]]]] = {
    "names_itself": [(1, [(b"", 0, 0)])],
    "names_itself_twice": [(1, [(b"", 0, 0), (b"z", 0, 0)])],
    "two_name_each_other": [(2, [(b"", 0, 1)]), (1, [(b"", 0, 0)])],
    # A child of height 0 where its parent, of height 2, needs one of height 1.
    "wrong_height": [(2, [(b"", 0, LEAF)])],
    # Keys before the leaf's own, so that each but the last names it outside its range.
    "one_leaf_named_100_times": [(1, [(b"\0" * i, 0, LEAF) for i in range(100)])],
    # The leaf named again from 'a/' on: the first child's keys pass its end, which
    # tensorstore's reads of keys do not check (its listings do).
    "past_its_end": [(1, [(b"", 0, LEAF), (b"a/", 0, LEAF)])],
}


def test_b_trees_that_loop_or_misplace_a_node_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a node naming itself made `open` walk forever (and grow without bound);
    a child of the wrong height, or a leaf named where its keys cannot be, read as if
    nothing were wrong. Now each is a `CorruptCheckpointError` naming the checkpoint and
    the node, at `open`; and so without `_METADATA`, where the tree is inferred from a
    listing."""
    source, _ = _small_checkpoint(tmp_path / "source")
    cases = []
    for shape, nodes in _SHAPES.items():
        item = _rewrite(shutil.copytree(source, tmp_path / shape), nodes)
        cases += [{"name": f"{shape}:{do}", "path": str(item), "do": do} for do in _VERBS]
        if shape in ("names_itself", "two_name_each_other", "past_its_end"):
            listed = shutil.copytree(item, tmp_path / f"{shape}_listed")
            (listed / "_METADATA").unlink()
            cases.append({"name": f"{shape}_listed:open", "path": str(listed), "do": "open"})
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))
    outcomes = run_cases(cases, tmp_path)
    expect(outcomes, {case["name"]: "lazyckpt:CorruptCheckpointError" for case in cases})
    for case in cases:
        message = outcomes[case["name"]]
        assert f"{tmp_path / case['name'].split(':')[0]}: " in message
        assert (
            "b-tree of the OCDBT database (manifest.ocdbt) is malformed: the b-tree node" in message
        )
        assert "data file 'd/" in message and "copy it again from a source you trust" in message
    itself = outcomes["names_itself:open"]
    assert "has height 1 where its parent names a node of height 0 (as a node that" in itself
    assert "has height 0 where its parent names a node of height 1;" in outcomes["wrong_height:get"]
    assert "outside the range its parent gives it" in outcomes["one_leaf_named_100_times:load"]
    assert "to before 'a/'" in outcomes["past_its_end:verify"]
    # tensorstore's driver refuses to list each of these trees as well.
    for shape in _SHAPES:
        with pytest.raises(ValueError, match="DATA_LOSS"):
            _driver(tmp_path / shape).list().result()


def _hundred_names(item: Path) -> Path:
    """`item` with a root that names its leaf a hundred times, each under a prefix of its
    own (`zz001/`...): keys that differ, so a b-tree as the format allows (a node may be
    reached by many paths), in a manifest that claims no keys."""
    children = [(b"", 0, LEAF)] + [(f"zz{i:03d}/".encode(), 6, LEAF) for i in range(1, 100)]
    return _rewrite(item, [(1, children)])


def test_a_node_reached_twice_is_read_by_the_driver_and_listed_per_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leaf named a hundred times under prefixes of their own: the index does not
    serve it (tensorstore's writer never names a node twice) and the driver reads; a
    listing gives what the driver lists, each key counted on each path, and stops by
    name past its bound."""
    item, _ = _small_checkpoint(tmp_path / "item")
    index = _index(_hundred_names(item))
    assert index.places(wanted=4) is None
    listed = sorted(_driver(item).list().result())
    assert len(listed) == 400
    assert sorted(key.encode() for key in index.list_keys("")) == listed
    expected = ["zz042/a/.zarray", "zz042/a/0", "zz042/b/.zarray", "zz042/b/0"]
    assert sorted(index.list_keys("zz042/")) == expected
    monkeypatch.setattr(ocdbt_tree, "MAX_LISTED_KEYS", 399)
    with pytest.raises(
        TooLargeError, match=rf"{item}: listing '' .* more than 65,536 nodes or 399"
    ):
        index.list_keys("")


_PEAK = """
import json, resource, sys
import lazyckpt

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))

resource.setrlimit(resource.RLIMIT_AS, (status("VmSize:") + (3 << 30),) * 2)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # (the peak of resident memory starts again from here)
before = status("VmRSS:")
loaded = lazyckpt.load(lazyckpt.open(sys.argv[1]))
grown = status("VmHWM:") - before
print(json.dumps({"grown": grown, "a": loaded["a"].tolist(), "b": loaded["b"].tolist()}))
"""
"""`open` and `load` of a checkpoint, in a process of its own: how much its resident
memory grew at its peak (not `ru_maxrss`, which a process keeps from its parent), and
what it read."""


def test_one_leaf_named_a_hundred_times_costs_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root that names a leaf of 6.4 MB (20,000 values of 300 bytes, inline) a hundred
    times, from about 90 KB of files: before, `open` walked all 640 MB of it (+1.8 GB of
    memory, 10 s); now the check reads the leaf once and the driver reads what is asked."""
    item, tree = _small_checkpoint(tmp_path / "item")
    driver = _driver(item)
    with ts.Transaction() as txn:
        for i in range(20_000):
            driver.with_transaction(txn)[f"junk/{i:05d}"] = bytes([i % 251]) * 300
    _hundred_names(item)
    assert sum(f.stat().st_size for f in item.rglob("*") if f.is_file()) < 150_000
    cases = [{"name": do, "path": str(item), "do": do} for do in _VERBS]
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))
    expect(run_cases(cases, tmp_path), dict.fromkeys(_VERBS, "ok"))
    found = subprocess.run(
        [sys.executable, "-c", _PEAK, str(item)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    peak = json.loads(found.stdout)
    assert peak["a"] == tree["a"].tolist() and peak["b"] == tree["b"].tolist()
    assert peak["grown"] < 512 << 20


def _key_bomb(item: Path, *, zstd: bool) -> Path:
    """`item` whose root is a leaf of 65,536 keys of 64 KiB each (4 GiB), written as
    tensorstore's format allows: each the one before with its last 3 bytes changed, and
    no prefix shared by all of them, so that decoding holds every key whole."""
    config, file, _, _ = _root_of(item)
    keys = [(0, b"a"), (0, b"b" * 65532 + bytes(3))]
    keys += [(65532, i.to_bytes(3, "big")) for i in range(1, 65535)]
    data = (item / file).read_bytes()
    node = _leaf(keys, zstd=zstd)
    (item / file).write_bytes(data + node)
    (item / "manifest.ocdbt").write_bytes(_manifest(config, file, len(data), len(node), 0))
    return item


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _table_bomb(item: Path) -> Path:
    """`item` whose manifest, of a few KiB, names a million data files of 65,000 bytes
    each (65 GB decoded), every path written as the one before with its last byte
    changed."""
    config, file, offset, length = _root_of(item)
    count = 1_000_000
    table = b"".join(
        [
            _varint(count),
            _varint(0) + _varint(64_999) * (count - 2),
            _varint(len(file)) + _varint(65_000) + _varint(1) * (count - 2),
            _varint(0) * count,
            file.encode(),
            b"z" * 65_000,
            b"y" * (count - 2),
        ]
    )
    manifest = _manifest(config, file, offset, length, 0, table=table, zstd=True)
    (item / "manifest.ocdbt").write_bytes(manifest)
    return item


def test_manifests_and_nodes_that_decode_too_large_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a manifest of a few KiB whose table of data files decodes to 65 GB grew
    `open` past 20 GB (or aborted it, `std::bad_alloc`), and a leaf whose keys add up
    to 4 GiB aborted it at once, whatever lazyckpt did, inside tensorstore's decoder.
    Now lazyckpt reads each first and refuses it by name, in bounded memory, before
    tensorstore decodes it: each verb, under a 1 GiB limit."""
    source, _ = _small_checkpoint(tmp_path / "source")
    bombs = {
        "table": _table_bomb(shutil.copytree(source, tmp_path / "table")),
        "keys": _key_bomb(shutil.copytree(source, tmp_path / "keys"), zstd=False),
        "keys_zstd": _key_bomb(shutil.copytree(source, tmp_path / "keys_zstd"), zstd=True),
    }
    assert (bombs["table"] / "manifest.ocdbt").stat().st_size < 4096
    assert _size(bombs["keys_zstd"]) - _size(source) < 200_000  # (the leaf and manifest)
    cases = [
        {"name": f"{name}:{do}", "path": str(path), "do": do}
        for name, path in bombs.items()
        for do in _VERBS
    ]
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))
    outcomes = run_cases(cases, tmp_path, timeout=600)
    expect(outcomes, {case["name"]: "lazyckpt:CorruptCheckpointError" for case in cases})
    for case in cases:
        message = outcomes[case["name"]]
        assert f"{case['path']}: the " in message and "made to harm its readers" in message
        if case["name"].startswith("table"):
            assert "manifest 'manifest.ocdbt' would hold at least 65,0" in message
        else:
            assert "of data file 'd/" in message and "would hold at least 4,3" in message


def _nested(item: Path, levels: int) -> Path:
    """`item` under `levels` nodes, each naming the one below it (the last, its leaf) a
    hundred times under prefixes of its own: a tree of 20 KB that names 100**levels
    copies of the leaf's keys, as the format allows."""
    nodes: list[tuple[int, list[tuple[bytes, int, int]]]] = []
    for level in range(levels, 0, -1):
        below = LEAF if level == 1 else len(nodes) + 1
        names = [f"b/{'z' * level}{i:03d}/".encode() for i in range(1, 100)]
        nodes.append((level, [(b"", 0, below), *((name, len(name), below) for name in names)]))
    return _rewrite(item, nodes)


def test_a_small_tree_that_names_a_vast_one_is_read_or_refused_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four levels, each naming the level below a hundred times, under `b/`: 4 * 10**8
    keys from 20 KB of files. Before, `verify` (which lists the keys under `b/` to find
    the chunks of array `b`), and an `open` without `_METADATA` (which lists every key to
    infer the tree), aborted (`std::bad_alloc`) or grew without bound in tensorstore's
    listing. Now a listing walks only the paths that meet its prefix, and stops by name
    at its bound; reads of keys walk one path each."""
    item, tree = _small_checkpoint(tmp_path / "item")
    before = _size(item)
    _nested(item, 4)
    assert _size(item) - before < 30_000
    unlisted = shutil.copytree(item, tmp_path / "unlisted")
    (unlisted / "_METADATA").unlink()
    cases = [{"name": do, "path": str(item), "do": do} for do in ("open", "load", "verify")]
    cases.append({"name": "unlisted:open", "path": str(unlisted), "do": "open"})
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))
    outcomes = run_cases(cases, tmp_path, timeout=600)
    too_large = "lazyckpt:TooLargeError"
    expect(outcomes, {"open": "ok", "load": "ok", "verify": too_large, "unlisted:open": too_large})
    bound = "in the OCDBT database reaches more than 65,536 nodes or 2,097,152 keys"
    assert f"{item}: listing 'b/' {bound}" in outcomes["verify"]
    assert f"{unlisted}: listing '' {bound}" in outcomes["unlisted:open"]
    loaded = lazyckpt.load(lazyckpt.open(item))
    assert all(np.array_equal(loaded[key], tree[key]) for key in tree)


def test_crc32c_of_any_length_is_googles() -> None:
    """Before, fewer than 4 bytes gave a wrong CRC-32C (the lanes invert the first 4);
    now short data is checked a byte at a time, and every length agrees with
    google_crc32c."""
    rng = np.random.default_rng(5)
    for size in (*range(21), 63, 64, 65, 1000):
        data = rng.integers(0, 256, size, np.uint8).tobytes()
        assert checksum.crc32c(data) == _crc32c(data), size
        assert checksum.crc32c(memoryview(data)) == _crc32c(data), size


def _leaves(path: Path) -> list[tuple[int, int]]:
    """Each leaf of the newest b-tree of the database at `path`, as tensorstore dumps
    it: how many values it holds, and how many of them inline."""
    base = ts.KvStore.open(f"file://{path}/").result()
    pending = [ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]]
    found = []
    while pending:
        dumped = ts.ocdbt.dump(base, pending.pop()).result()
        if dumped["height"]:
            pending += [entry["location"] for entry in dumped["entries"]]
        else:
            entries = dumped["entries"]
            found.append((len(entries), sum("inline_value" in entry for entry in entries)))
    return found


def test_an_orbax_checkpoint_as_orbax_0_5_wrote_it_opens(tmp_path: Path) -> None:
    """Orbax 0.4 and 0.5 left tensorstore's defaults: values over 100 bytes in data
    files. A checkpoint of no smaller value (each `.zarray` is over 100 bytes) has a
    leaf of no inline value, which `open` had refused as damaged (`zip() argument 2 is
    shorter than argument 1`)."""
    rng = np.random.default_rng(0)
    tree = {"kernel": rng.standard_normal((64, 32), np.float32), "bias": np.arange(32.0)}
    item = orbax_save(tmp_path / "ckpt", tree)
    database = _driver(item)
    values = {key: database.read(key).result().value for key in database.list().result()}
    assert min(len(value) for value in values.values()) > 100
    # The same keys and values, written again as Orbax 0.5 configured the database.
    shutil.rmtree(item / "d")
    (item / "manifest.ocdbt").unlink()
    for folder in item.glob("ocdbt.process_*"):
        shutil.rmtree(folder)
    config = {"max_inline_value_bytes": 100, "max_decoded_node_bytes": 8 << 20}
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/", "config": config})
    with ts.Transaction() as txn:
        for key, value in values.items():
            store.result().with_transaction(txn)[key] = value
    assert _leaves(item) == [(len(values), 0)]
    loaded = lazyckpt.load(lazyckpt.open(item))
    for name, array in tree.items():
        np.testing.assert_array_equal(loaded[name], array)


def test_a_lazyckpt_save_of_many_chunks_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lazyckpt's own writer keeps values over 1 KiB in data files: an array of many
    chunks fills leaves that hold none inline, which `open` had refused as damaged.
    (Nodes of 8 MiB, tensorstore's default, need some 150 MB of such chunks for a leaf
    of them alone; the writer here fills nodes of 64 KiB.)"""
    from lazyckpt._orbax import write

    monkeypatch.setitem(write.OCDBT_CONFIG, "max_decoded_node_bytes", 64 << 10)
    rng = np.random.default_rng(1)
    # (random bits: no chunk compresses to 1 KiB, to be inline)
    tree = {"w": rng.integers(0, 1 << 32, 1 << 20, np.uint32), "b": np.arange(3.0)}
    path = lazyckpt.save(tmp_path / "saved", tree, chunk_bytes=1100, progress=False)
    leaves = _leaves(Path(path))
    assert len(leaves) > 3 and any(inline == 0 for _, inline in leaves), leaves
    loaded = lazyckpt.load(lazyckpt.open(path))
    for name, value in tree.items():
        np.testing.assert_array_equal(loaded[name], value)


_KEY_ALPHABET = [b"a", b"b", b"\0", b"\xff", b"/"]


def _random_key(rng: np.random.Generator) -> bytes:
    return b"".join(rng.choice(_KEY_ALPHABET, rng.integers(0, 8)).tolist())


@pytest.mark.parametrize("seed", range(12))
def test_random_databases_read_and_list_as_the_driver_does(tmp_path: Path, seed: int) -> None:
    """Databases that tensorstore wrote with configurations drawn at random (nodes of 1
    to 400 bytes, values inline up to 0, 4 or 100 bytes, numbered manifests, version
    trees of arity 2 to 16), in several commits with ranges deleted: every key's place
    holds the driver's value, and every listing is the driver's."""
    rng = np.random.default_rng(seed)
    config: dict[str, Any] = {
        "max_decoded_node_bytes": int(rng.choice([1, 50, 120, 400])),
        "max_inline_value_bytes": int(rng.choice([0, 4, 100])),
        "version_tree_arity_log2": int(rng.choice([1, 2, 4])),
    }
    if rng.random() < 0.3:
        config["manifest_kind"] = "numbered"
    spec = {"driver": "ocdbt", "base": f"file://{tmp_path}/", "config": config}
    store = ts.KvStore.open(spec).result()
    for _ in range(int(rng.integers(1, 6))):
        with ts.Transaction() as txn:
            for _ in range(int(rng.integers(1, 60))):
                key = _random_key(rng)
                store.with_transaction(txn)[key] = bytes(int(rng.integers(0, 10)))
        if rng.random() < 0.5:
            low, high = sorted([_random_key(rng), _random_key(rng)])
            store.delete_range(ts.KvStore.KeyRange(low, high)).result()
    driver = _driver(tmp_path)
    listed = sorted(driver.list().result())
    tree = Tree(ts.KvStore.open(f"file://{tmp_path}/").result(), str(tmp_path), str(tmp_path))
    places = tree.check()
    assert places is not None and sorted(places) == listed, config
    for key in listed:
        place = places[key]
        if isinstance(place, tuple):
            file, offset, length = place
            place = (tmp_path / file).read_bytes()[offset : offset + length]
        assert place == driver.read(key).result().value, (config, key)
    ranges = [sorted([_random_key(rng), _random_key(rng)]) for _ in range(40)]
    ranges += [[key[:n], _after_all(key[:n]) or b""] for key in listed[:20] for n in range(3)]
    for low, high in ranges:
        expected = sorted(driver.list(ts.KvStore.KeyRange(low, high)).result())
        assert sorted(tree.listing(low, high or None)) == expected, (config, low, high)


def _counter_leaf(count: int) -> bytes:
    """A leaf of `count` keys (`k` and a 4-byte counter) and empty values, each key
    written as its last bytes that differ from the key before: a few KiB, which
    decode to `count` keys (about 0.4 s for a million)."""
    keys = np.zeros((count, 5), np.uint8)
    keys[:, 0] = ord("k")
    keys[:, 1:] = np.arange(count, dtype=">u4").view(np.uint8).reshape(count, 4)
    shared = np.zeros(count, np.int64)
    at = np.arange(1, count)
    shared[1:] = 4 - (at % 256 == 0) - (at % 65536 == 0) - (at % (1 << 24) == 0)
    suffixes = keys[np.arange(5) >= shared[:, None]].tobytes()
    body = [b"\0", _varint(0), _varint(count), shared[1:].astype(np.uint8).tobytes()]
    body += [(5 - shared).astype(np.uint8).tobytes(), suffixes, b"\0" * count, b"\0" * count]
    return _framed(NODE, b"".join(body), zstd=True, level=3)


def _named_from(item: Path, leaf: bytes, paths: list[str], bases: list[int]) -> Path:
    """`item` under a root that names its own leaf, and `leaf` through each of `paths`
    (split into base and relative at `bases`) under a prefix of its own (`zz00000/`...):
    keys that differ, so a b-tree as the format allows."""
    config, file, offset, length = _root_of(item)
    table = _table([(0, path.encode()) for path in [file, *paths]], [0, *bases])
    children = [(b"", 0, 0, offset, length)]
    children += [(f"zz{i:05d}/".encode(), 8, i + 1, 0, len(leaf)) for i in range(len(paths))]
    root = _node(1, table, children, zstd=True)
    (item / "d" / "root").write_bytes(root)
    (item / "manifest.ocdbt").write_bytes(_manifest(config, "d/root", 0, len(root), 1))
    return item


def test_one_leaf_in_many_files_or_places_is_decoded_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leaf of 1.3 KB that decodes to a million keys (0.4 s), named by the root 3,000
    times: through hard links of its file, through one path split 3,000 ways between
    a base path and a path relative to it, and in 3,000 files of its own. Before, the
    check at `open` decoded it at every name (20 minutes; 65,535 names: 7 hours); now
    it knows a local file by its device and inode, and a leaf of inline values
    wherever its base path begins, so `open` decodes it once; in files of their own,
    it stops by name at `MAX_WALK_ENTRIES`."""
    source, tree = _small_checkpoint(tmp_path / "source")
    leaf = _counter_leaf(1 << 20)
    assert len(leaf) < 4096
    names = 3000
    links = shutil.copytree(source, tmp_path / "links")
    (links / "d" / "leaf").write_bytes(leaf)
    for i in range(names):
        (links / "d" / f"link{i}").hardlink_to(links / "d" / "leaf")
    _named_from(links, leaf, [f"d/link{i}" for i in range(names)], [0] * names)
    split = shutil.copytree(source, tmp_path / "split")
    folder = split / "d" / "/".join(["x" * 200] * 15)  # (a path of 3,000 bytes)
    folder.mkdir(parents=True)
    (folder / "leaf").write_bytes(leaf)
    path = str((folder / "leaf").relative_to(split))
    assert len(path) > names
    _named_from(split, leaf, [path] * names, list(range(names)))
    copies = shutil.copytree(source, tmp_path / "copies")
    for i in range(names):
        (copies / "d" / f"copy{i}").write_bytes(leaf)
    _named_from(copies, leaf, [f"d/copy{i}" for i in range(names)], [0] * names)
    cases = [
        {"name": "links:open", "path": str(links), "do": "open"},
        {"name": "links:load", "path": str(links), "do": "load"},
        {"name": "split:open", "path": str(split), "do": "open"},
        {"name": "copies:open", "path": str(copies), "do": "open"},
    ]
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))
    outcomes = run_cases(cases, tmp_path, timeout=600)
    expect(
        outcomes,
        {
            "links:open": "ok",
            "links:load": "ok",
            "split:open": "ok",
            "copies:open": "lazyckpt:TooLargeError",
        },
    )
    bound = "decodes b-tree nodes that hold more than 4,294,967,296 bytes or 16,777,216 entries"
    assert f"{copies}: checking the b-tree of the OCDBT database {bound}" in outcomes["copies:open"]
    loaded = lazyckpt.load(lazyckpt.open(links))
    assert all(np.array_equal(loaded[key], tree[key]) for key in tree)


def _table_leaf(files: int) -> bytes:
    """A leaf of one key (`k`, its value empty, inline) whose table names `files` data
    files (3-byte names, each written as the one before with its last 2 bytes
    changed): a few hundred KB, which take a second to decode."""
    names = np.arange(files, dtype=">u4").view(np.uint8).reshape(files, 4)[:, 1:]
    table = b"".join(
        [
            _varint(files),
            b"\1" * (files - 1),  # (each shares its first byte with the name before)
            b"\3" + b"\2" * (files - 1),
            b"\0" * files,  # (no base paths)
            names[0].tobytes(),
            names[1:, 1:].tobytes(),
        ]
    )
    body = b"".join([b"\0", table, _varint(1), b"\1", b"k", b"\0", b"\0"])
    return _framed(NODE, body, zstd=True, level=3)


def test_a_listing_decodes_a_bounded_amount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root that names one leaf 2,000 times, each under a prefix of its own; the leaf
    holds one key and a table of a million data files, which take a second to decode,
    and is too large for the cache of nodes. The check at `open` decodes it once; a
    listing reaches it on every path. Before, an `open` without `_METADATA` (which
    lists every key) decoded it 2,000 times (an hour); now the listing stops by name
    at `MAX_WALK_ENTRIES`."""
    item, _ = _small_checkpoint(tmp_path / "item")
    (item / "_METADATA").unlink()
    leaf = _table_leaf(1 << 20)
    (item / "d" / "leaf").write_bytes(leaf)
    _named_from(item, leaf, ["d/leaf"] * 2000, [0] * 2000)
    assert _size(item) < 1 << 20
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))
    outcomes = run_cases([{"name": "open", "path": str(item), "do": "open"}], tmp_path, 600)
    expect(outcomes, {"open": "lazyckpt:TooLargeError"})
    bound = "decodes b-tree nodes that hold more than 4,294,967,296 bytes or 16,777,216 entries"
    assert f"{item}: listing '' in the OCDBT database {bound}" in outcomes["open"]


def _wide(item: Path, levels: int, count: int) -> Path:
    """`item` under `levels` nodes of `count` children each, every child the node
    below (the last, its leaf) under a prefix of its own: 360 KB a level."""
    config, file, offset, length = _root_of(item)
    data = (item / file).read_bytes()
    for level in range(1, levels + 1):
        keys = [b"", *(f"{'pqrstuvw'[level]}{i:07d}/".encode() for i in range(1, count))]
        body = b"".join(
            [
                bytes([level]),
                _one_file(file),
                _varint(count),
                b"\0" * (count - 1),
                *(_varint(len(key)) for key in keys),
                *(_varint(len(key)) for key in keys),  # (each key a prefix of its own)
                *keys,
                b"\0" * count,
                _varint(offset) * count,
                _varint(length) * count,
                b"\0" * 3 * count,
            ]
        )
        node = _framed(NODE, body, zstd=True, level=3)
        offset, length = len(data), len(node)
        data += node
    (item / file).write_bytes(data)
    (item / "manifest.ocdbt").write_bytes(_manifest(config, file, offset, length, levels))
    return item


def test_nodes_of_a_million_children_are_walked_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three levels of nodes of a million children each, every child the node below
    under a prefix of its own: 1 MB. Before, the check at `open` made every child's
    reference and reach before it visited any (280 MB a level, where it counted 97):
    the process grew by 1.2 GB, and under a limit of 1 GiB more it died of a bare
    `MemoryError`. Now children are numbers in columns, made into references as the
    walk reaches them, and what a node holds is counted as Python holds it."""
    item, _ = _small_checkpoint(tmp_path / "item")
    before = _size(item)
    _wide(item, 3, 1_000_000)
    assert _size(item) - before < 1_200_000
    cases = [{"name": do, "path": str(item), "do": do} for do in ("open", "load")]
    monkeypatch.setenv("HOSTILE_MEMORY", str(1 << 30))
    expect(run_cases(cases, tmp_path, timeout=600), {"open": "ok", "load": "ok"})


def test_what_a_node_holds_is_counted_as_python_holds_it(tmp_path: Path) -> None:
    """`Node.held`, which the walk's bounds on memory count, is at least what a node of
    a quarter million entries holds (traced), and its decoding takes at most twice that."""
    item, _ = _small_checkpoint(tmp_path / "item")
    _wide(item, 1, 1 << 18)
    found = ocdbt_format.manifest((item / "manifest.ocdbt").read_bytes())
    assert found.root is not None
    data = (item / found.root.file.decode()).read_bytes()
    encoded = data[found.root.offset : found.root.offset + found.root.length]
    for encoded_node in (encoded, _counter_leaf(1 << 18), _table_leaf(1 << 18)):
        tracemalloc.start()
        try:
            node = ocdbt_format.node(encoded_node, b"")
            holds, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert holds <= node.held and peak <= 2 * node.held, (holds, peak, node.held)
        assert node.held < 4 * holds  # (and not far more)


def _file_bytes_read() -> int:
    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(int(v.get("value", 0)) for metric in found for v in metric["values"])


def test_a_manifest_in_a_bucket_is_read_no_further_than_its_header_says(
    tmp_path: Path,
) -> None:
    """In a bucket, where a manifest's size is known only from its header: before, the
    check read the whole object, however long; now it reads what the header claims and
    one byte more, and refuses by name one that holds more (here a local file stands
    for the bucket: the tree is not told its folder)."""
    item, _ = _small_checkpoint(tmp_path / "item")
    manifest = item / "manifest.ocdbt"
    size = manifest.stat().st_size
    with manifest.open("ab") as f:
        f.write(bytes(8 << 20))
    tree = Tree(ts.KvStore.open(f"file://{item}/").result(), str(item))
    before = _file_bytes_read()
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"manifest 'manifest.ocdbt' holds more than the {size:,} bytes its header says",
    ):
        tree.check()
    assert _file_bytes_read() - before < 2 * size
    manifest.write_bytes(manifest.read_bytes()[: size - 1])
    with pytest.raises(
        CorruptCheckpointError, match=rf"holds fewer than the {size:,} bytes its header"
    ):
        tree.check()
    manifest.write_bytes(b"\0" * 11)
    with pytest.raises(CorruptCheckpointError, match="fewer than the 12 bytes of its header"):
        tree.check()
