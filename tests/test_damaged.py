"""Damaged or hostile checkpoints give specific errors, never crashes or wrong values."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lazyckpt
from lazyckpt import CorruptCheckpointError, LazyckptError
from tests.helpers import orbax_save


def _save(path: Path, *, ocdbt: bool = True) -> Path:
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(1)
    tree = {
        "w": rng.standard_normal((64, 64), dtype=np.float32),
        "nested": {"b": np.arange(5, dtype=np.int32), "s": "text", "n": 3},
        "key": jax.random.split(jax.random.key(0), 2),
    }
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("pristine")
    return {ocdbt: _save(root / f"ocdbt_{ocdbt}", ocdbt=ocdbt) for ocdbt in (True, False)}


@pytest.fixture
def ocdbt_copy(pristine: dict[bool, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine[True], tmp_path / "ckpt"))


@pytest.fixture
def folders_copy(pristine: dict[bool, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine[False], tmp_path / "ckpt"))


def _edit_metadata(path: Path, edit: Any) -> None:
    metadata = json.loads((path / "_METADATA").read_text())
    edit(metadata)
    (path / "_METADATA").write_text(json.dumps(metadata))


def _entry(metadata: dict[str, Any], key: str) -> dict[str, Any]:
    for entry in metadata["tree_metadata"].values():
        if "/".join(k["key"] for k in entry["key_metadata"]) == key:
            return entry
    raise KeyError(key)


def test_missing_root_data_folder(ocdbt_copy: Path) -> None:
    shutil.rmtree(ocdbt_copy / "d")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"OCDBT root data folder .*/ckpt/d is missing;"
        r" per-process databases \['ocdbt.process_0'\] exist",
    ):
        lazyckpt.open(ocdbt_copy)


def test_array_missing_from_the_store(folders_copy: Path) -> None:
    shutil.rmtree(folders_copy / "nested.b")
    with pytest.raises(
        CorruptCheckpointError,
        match=r"array 'nested/b' is listed in _METADATA but "
        r"its zarr metadata 'nested.b/.zarray' is missing from the store",
    ):
        lazyckpt.open(folders_copy)


def test_deleted_chunk_file_without_fill(folders_copy: Path) -> None:
    lazy = lazyckpt.open(folders_copy)
    (folders_copy / "w" / "0.0").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"reading array 'w' \(stored as 'w'\) failed"):
        lazy["w"].get()


def test_truncated_chunk_file(folders_copy: Path) -> None:
    chunk = folders_copy / "nested.b" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-3])
    with pytest.raises(
        CorruptCheckpointError, match=r"reading array 'nested/b' \(stored as 'nested\.b'\) failed"
    ):
        lazyckpt.open(folders_copy)["nested"]["b"].get()


def test_write_shape_that_does_not_fit_the_zarr_shape(ocdbt_copy: Path) -> None:
    _edit_metadata(
        ocdbt_copy, lambda m: _entry(m, "key")["value_metadata"].update(write_shape=[2, 2, 2])
    )
    with pytest.raises(
        CorruptCheckpointError,
        match=r"'key' is declared with write_shape "
        r"\(2, 2, 2\) in _METADATA but its zarr metadata has shape \(2, 2\) "
        r"\(uint32\); the metadata files disagree",
    ):
        lazyckpt.open(ocdbt_copy)


def test_scalar_declared_over_an_array(ocdbt_copy: Path) -> None:
    _edit_metadata(
        ocdbt_copy, lambda m: _entry(m, "nested/b")["value_metadata"].update(value_type="scalar")
    )
    with pytest.raises(
        CorruptCheckpointError,
        match=r"'nested/b' is declared a scalar in "
        r"_METADATA but its zarr metadata has shape \(5,\)",
    ):
        lazyckpt.open(ocdbt_copy)


def test_zarr_dtype_that_does_not_match_the_chunks(folders_copy: Path) -> None:
    zarray = folders_copy / "nested.b" / ".zarray"
    meta = json.loads(zarray.read_text())
    meta["dtype"] = "<f8"  # the chunk holds 5 int32s: 20 bytes, not 40
    zarray.write_text(json.dumps(meta))
    lazy = lazyckpt.open(folders_copy)
    assert lazy["nested"]["b"].dtype == np.float64
    with pytest.raises(
        CorruptCheckpointError, match=r"reading array 'nested/b' \(stored as 'nested\.b'\) failed"
    ):
        lazy["nested"]["b"].get()


@pytest.mark.parametrize("name", ["../../etc", "/etc/passwd", "a/./b", "..\\x"])
def test_names_that_leave_the_folder_are_refused(folders_copy: Path, name: str) -> None:
    def point_outside(metadata: dict[str, Any]) -> None:
        _entry(metadata, "w")["key_metadata"] = [{"key": name, "key_type": 2}]

    _edit_metadata(folders_copy, point_outside)
    with pytest.raises(
        CorruptCheckpointError,
        match=r"whose folder would be outside the checkpoint folder or another array's; "
        r"refusing to read it",
    ):
        lazyckpt.open(folders_copy)


def test_names_with_dot_segments_are_keys_in_an_ocdbt_database(tmp_path: Path) -> None:
    """In OCDBT a name is a database key, not a path: Orbax saves `..` and `a/./b`
    there and restores them, and so does lazyckpt; and `trail/`, whose keys tensorstore
    joins without a second `/` (`trail/.zarray`)."""
    values = {
        "..": np.arange(3.0),
        "a/./b": np.ones(2, np.int32),
        "trail/": np.arange(5, dtype=np.int16),
        "ok": np.zeros(4),
    }
    path = orbax_save(tmp_path / "ckpt", values)
    lazy = lazyckpt.load(lazyckpt.open(path))
    assert set(lazy) == set(values)
    for key, array in values.items():
        np.testing.assert_array_equal(lazy[key], array)


def test_huge_declared_shape_allocates_nothing_at_open(folders_copy: Path) -> None:
    zarray = folders_copy / "w" / ".zarray"
    meta = json.loads(zarray.read_text())
    meta["shape"] = [10**12, 64]
    zarray.write_text(json.dumps(meta))
    tracemalloc.start()
    try:
        lazy = lazyckpt.open(folders_copy)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lazy["w"].shape == (10**12, 64) and lazy["w"].nbytes == 256 * 10**12
    assert peak < 50 << 20
    np.testing.assert_array_equal(lazy["w"][:2, :3].get().shape, (2, 3))


def test_malformed_sharding_and_array_metadatas(ocdbt_copy: Path) -> None:
    (ocdbt_copy / "_sharding").write_text('{"dw==": ')
    with pytest.raises(
        CorruptCheckpointError, match=r"_sharding is not valid JSON.*delete the file"
    ):
        lazyckpt.open(ocdbt_copy)
    (ocdbt_copy / "_sharding").unlink()  # not critical: shardings become None
    assert lazyckpt.open(ocdbt_copy)["w"].sharding is None
    (ocdbt_copy / "array_metadatas" / "process_0").write_text('[{"random_key_impl": 1}]')
    with pytest.raises(CorruptCheckpointError, match=r"array_metadatas/process_0 is malformed"):
        lazyckpt.open(ocdbt_copy)


def test_strings_file_missing(ocdbt_copy: Path) -> None:
    (ocdbt_copy / "_strings.json").unlink()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"_strings.json is missing but _METADATA "
        r"lists string leaves \['nested/s'\]",
    ):
        lazyckpt.open(ocdbt_copy)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**13) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_mutated_metadata_never_crashes(
    pristine: dict[bool, Path], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Replace any part of _METADATA with random JSON: open succeeds or raises LazyckptError."""
    ocdbt = data.draw(st.booleans())
    path = tmp_path_factory.mktemp("mutated") / "ckpt"
    shutil.copytree(pristine[ocdbt], path)
    metadata = json.loads((path / "_METADATA").read_text())
    node: Any = metadata
    while isinstance(node, dict | list) and node and data.draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = data.draw(st.sampled_from(keys))
        if not isinstance(node[key], dict | list) or data.draw(st.booleans()):
            node[key] = data.draw(_JSON)
            break
        node = node[key]
    (path / "_METADATA").write_text(json.dumps(metadata))
    try:
        tree = lazyckpt.open(path)
        small = lazyckpt.select(tree, lambda _, leaf: getattr(leaf, "size", 0) < 10**6)
        lazyckpt.load(small)
    except LazyckptError:
        pass
    finally:
        shutil.rmtree(path)


def test_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(
        lazyckpt.NotACheckpointError, match=r"is not an Orbax checkpoint: .*\(found \['data'\]\)"
    ):
        lazyckpt.open(tmp_path)


def test_deeply_nested_metadata_is_a_clear_error(ocdbt_copy: Path) -> None:
    (ocdbt_copy / "_METADATA").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptCheckpointError, match=r"_METADATA is not valid JSON"):
        lazyckpt.open(ocdbt_copy)


def test_metadata_that_is_not_json(small: Path) -> None:
    (small / "_METADATA").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=r"small/_METADATA is not valid JSON"):
        lazyckpt.open(small)


def test_metadata_without_tree(small: Path) -> None:
    (small / "_METADATA").write_text(json.dumps({"use_zarr3": False}))
    with pytest.raises(CorruptCheckpointError, match=r"_METADATA has no 'tree_metadata' object"):
        lazyckpt.open(small)


def test_missing_root_manifest_names_the_per_process_databases(small: Path) -> None:
    (small / "manifest.ocdbt").unlink()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"OCDBT root manifest .*manifest.ocdbt is "
        r"missing; per-process databases \['ocdbt.process_0'\] exist",
    ):
        lazyckpt.open(small)


def test_deleted_chunk_data_fails_at_read_time_naming_the_array(small: Path) -> None:
    lazy = lazyckpt.open(small)  # metadata is intact: open succeeds
    for data_file in small.glob("ocdbt.process_0/d/*"):
        data_file.unlink()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"reading array 'a' \(stored as 'a'\) failed"
        r".*missing or damaged, copy it again",
    ):
        lazy["a"][:2].get()


def test_truncated_chunk_file_fails_at_read_time(small: Path) -> None:
    lazy = lazyckpt.open(small)
    for data_file in small.glob("ocdbt.process_0/d/*"):
        data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match=r"reading array 'a' \(stored as 'a'\) failed"):
        lazy["a"].get()


def test_unsupported_value_type(small: Path) -> None:
    metadata = json.loads((small / "_METADATA").read_text())
    entry = next(iter(metadata["tree_metadata"].values()))
    entry["value_metadata"]["value_type"] = "my.CustomThing"
    (small / "_METADATA").write_text(json.dumps(metadata))
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError,
        match=r"leaf 'a' has value_type "
        r"'my.CustomThing', which lazyckpt does not read",
    ):
        lazyckpt.open(small)


def test_a_zstd_frame_declaring_another_size_is_refused_before_decoding(
    folders_copy: Path,
) -> None:
    """A small array's chunk replaced by a zstd frame that declares 64 MiB: refused by
    its header, before anything is decoded (the batched path decoded it all first)."""
    import zstandard

    lazy = lazyckpt.open(folders_copy)
    chunk = folders_copy / "w" / "0.0"
    chunk.write_bytes(zstandard.ZstdCompressor().compress(bytes(64 << 20)))
    with pytest.raises(
        CorruptCheckpointError, match=r"array 'w' chunk \[0, 0\].*zstd frame of 67108864 bytes"
    ):
        lazyckpt.load(lazy["w"])


def test_damaged_chunks_fail_load_device_put_and_streaming_alike(folders_copy: Path) -> None:
    lazy = lazyckpt.open(folders_copy)
    chunk = folders_copy / "w" / "0.0"
    chunk.write_bytes(chunk.read_bytes()[:-7])
    # Each names the array and its stored name (lazyckpt's own decoder, reading small
    # arrays in batches, names the chunk too), and says what to do.
    message = r"array 'w'.*\(stored as 'w[^)]*\).*copy it again"
    with pytest.raises(CorruptCheckpointError, match=message):
        lazyckpt.load(lazy["w"])
    with pytest.raises(CorruptCheckpointError, match=message):
        lazyckpt.load(lazy["w"][1:5, ::2])  # a strided view: another read path
    sharding = jax.sharding.NamedSharding(
        jax.make_mesh((8,), ("d",)), jax.sharding.PartitionSpec(None, "d")
    )
    with pytest.raises(CorruptCheckpointError, match=message):
        lazyckpt.device_put(lazy["w"], sharding)  # misaligned: routed blocks
    with pytest.raises(CorruptCheckpointError, match=message):
        list(lazyckpt.iter_blocks(lazy))
