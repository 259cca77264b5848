"""Reads of many keys through an OCDBT database's b-tree, walked once
(`_storage/ocdbt.Index`): the same values as tensorstore's driver, on trees of several
levels, and a clear error, never a fill value, when a data file is gone."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import lazyckpt
from lazyckpt import CorruptCheckpointError
from lazyckpt._storage import ocdbt
from lazyckpt._storage.ocdbt import Index
from tests.helpers import orbax_save


def _database(path: Path, **spec: Any) -> dict[str, bytes]:
    """A database written by tensorstore with nodes small enough for a b-tree of three
    levels, values inline and in data files, keys sharing long prefixes."""
    values = {f"layer_{i // 10}/w/{i % 10}": bytes([i]) * (8 if i % 3 else 40) for i in range(200)}
    store = ts.KvStore.open(
        {
            "driver": "ocdbt",
            "base": f"file://{path}/",
            "config": {"max_decoded_node_bytes": 256, "max_inline_value_bytes": 16},
            **spec,
        }
    ).result()
    with ts.Transaction() as txn:
        for key, value in values.items():
            store.with_transaction(txn)[key] = value
    return values


def _index_read(path: Path, keys: list[str], ranges: Sequence[slice | None]) -> list[bytes | None]:
    index = Index(ts.KvStore.open(f"file://{path}/").result())
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
    driver = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/"}).result()
    some = list(values)[:30]
    expected = [
        driver.read(key, byte_range=cut).result().value
        for key, cut in zip(some, cuts * 10, strict=True)
    ]
    assert _index_read(tmp_path, some, cuts * 10) == expected


def test_data_files_named_with_characters_a_dump_escapes(tmp_path: Path) -> None:
    values = _database(tmp_path, value_data_prefix="v a:b%c+é/")
    assert _index_read(tmp_path, list(values), [None] * len(values)) == list(values.values())


def test_a_byte_range_past_the_value_fails_as_through_the_driver(tmp_path: Path) -> None:
    values = _database(tmp_path)
    inline, indirect = "layer_0/w/1", "layer_0/w/0"  # 8 bytes in the b-tree, 40 in a file
    assert (len(values[inline]), len(values[indirect])) == (8, 40)
    index = Index(ts.KvStore.open(f"file://{tmp_path}/").result())
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


def test_the_index_walks_the_tree_only_for_reads_of_enough_of_its_keys(tmp_path: Path) -> None:
    _database(tmp_path)
    base = ts.KvStore.open(f"file://{tmp_path}/").result()
    index = Index(base)
    assert index.places(wanted=2) is None  # 2 of 200 keys: the driver reads those
    # Decided at the first read: later the driver has read the nodes already.
    assert index.places(wanted=100) is None
    places = Index(base).places(wanted=100)
    assert places is not None and len(places) == 200


def test_a_large_tree_is_left_to_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _database(tmp_path)
    monkeypatch.setattr(ocdbt, "MAX_TREE_BYTES", 1000)  # (this tree: 3 KiB)
    assert Index(ts.KvStore.open(f"file://{tmp_path}/").result()).places(wanted=200) is None


def test_a_damaged_node_leaves_reads_to_the_driver(tmp_path: Path) -> None:
    _database(tmp_path)
    for node_file in (tmp_path / "d").iterdir():
        data = bytearray(node_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        node_file.write_bytes(bytes(data))
    index = Index(ts.KvStore.open(f"file://{tmp_path}/").result())
    assert index.places(wanted=200) is None


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
