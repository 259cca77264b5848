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
    ],
    ids=["escaped", "uncompressed", "numbered", "version_nodes"],
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
            for entry, (child, shared) in zip(dumped["entries"], node.children, strict=False):
                assert bytes(entry["subtree_common_prefix"]) == bytes(entry["key"])[:shared]
                assert entry["location"].endswith(f":{child.offset}:{child.length}")
                pending.append(child)
            for entry, value in zip(dumped["entries"], node.values, strict=False):
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


def _framed(magic: int, body: bytes, *, zstd: bool = False) -> bytes:
    if zstd:
        body = zstandard.ZstdCompressor(level=19).compress(body)
    length = struct.pack("<Q", 12 + 2 + len(body) + 4)
    head = struct.pack(">I", magic) + length + b"\0" + (b"\1" if zstd else b"\0")
    return head + body + struct.pack("<I", _crc32c(head + body))


def _table(paths: list[tuple[int, bytes]]) -> bytes:
    """A table of data files, each path given as (the length of what it shares with
    the path before it, the rest of it), none with a base path."""
    return b"".join(
        [
            _varint(len(paths)),
            *(_varint(shared) for shared, _ in paths[1:]),
            *(_varint(len(rest)) for _, rest in paths),
            _varint(0) * len(paths),
            *(rest for _, rest in paths),
        ]
    )


def _one_file(path: str) -> bytes:
    return _table([(0, path.encode())])


def _interior(height: int, file: str, children: list[tuple[bytes, int, int, int]]) -> bytes:
    """A node of `height` whose children are each (its first key, the length of the
    prefix that all its keys share, its offset and length in `file`)."""
    count = len(children)
    return _framed(
        NODE,
        b"".join(
            [
                bytes([height]),
                _one_file(file),
                _varint(count),
                _varint(0) * (count - 1),  # (no key written as a prefix of the one before)
                *(_varint(len(key)) for key, _, _, _ in children),
                *(_varint(shared) for _, shared, _, _ in children),
                *(key for key, _, _, _ in children),
                _varint(0) * count,  # (each in data file 0 of the table)
                *(_varint(offset) for _, _, offset, _ in children),
                *(_varint(length) for _, _, _, length in children),
                _varint(0) * 3 * count,  # (statistics: none)
            ]
        ),
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
