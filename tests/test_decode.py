"""lazyckpt's own chunk decoder: every layout and codec it takes, values equal to what
tensorstore reads, damage reported by array and chunk, and memory within the budget
whatever the chunk size.

Reference checkpoints are written by orbax-checkpoint; the codec variants Orbax does
not write (F order, big-endian, transposed, shards of several chunks, other key
encodings) are written by tensorstore's own zarr drivers over an Orbax checkpoint's
array folder.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt._engine import decode as _decode
from lazyckpt._engine import small as _small
from lazyckpt._engine.decode import ChunkStream
from tests.helpers import LAYOUTS, assert_loaded, expected, orbax_save, rich_tree, rss_probe


@pytest.fixture
def decoder(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Decode every array that has a codec with lazyckpt's decoder, however small its
    chunks; the list collects the keys of the arrays it decoded."""
    decoded: list[str] = []
    real = ChunkStream.__init__

    def recording(self: ChunkStream, stored: Any, *args: Any) -> None:
        decoded.append(stored.key)
        real(self, stored, *args)

    monkeypatch.setattr(_decode, "MIN_CHUNK_BYTES", 0)
    monkeypatch.setattr(_small, "SMALL", -1)  # (no batches of small arrays either)
    monkeypatch.setattr(ChunkStream, "__init__", recording)
    yield decoded


@pytest.fixture
def batched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of the arrays read by the batched reads of small arrays
    (`_engine.small`), one per array in each batch."""
    keys: list[str] = []
    real = _small._coded_batch

    def recording(arrays: Any, batch: list[int], *args: Any) -> None:
        keys.extend(arrays[i].key for i in batch)
        real(arrays, batch, *args)

    monkeypatch.setattr(_small, "_coded_batch", recording)
    return keys


@pytest.fixture(scope="module")
def layouts(
    mesh: jax.sharding.Mesh, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, Path]]:
    tree = rich_tree(mesh)
    root = tmp_path_factory.mktemp("decode-layouts")
    arrays = lazyckpt.select(tree, lambda _, v: isinstance(v, jax.Array | np.ndarray))
    paths = {}
    for name, save in LAYOUTS.items():
        paths[name] = save(
            root / name, arrays if name in ("standard_checkpointer", "v1_api") else tree
        )
    return tree, paths


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_orbax_layout_decodes_to_the_saved_values(
    layouts: tuple[dict[str, Any], dict[str, Path]], layout: str, decoder: list[str]
) -> None:
    tree, paths = layouts
    if layout in ("standard_checkpointer", "v1_api"):
        tree = lazyckpt.select(tree, lambda _, v: isinstance(v, jax.Array | np.ndarray))
    assert_loaded(lazyckpt.load(lazyckpt.open(paths[layout])), expected(tree))
    assert "sharded" in decoder and "dtypes/bf16" in decoder  # not tensorstore's path


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_orbax_layout_reads_small_arrays_in_batches(
    layouts: tuple[dict[str, Any], dict[str, Path]], layout: str, batched: list[str]
) -> None:
    """The batched reads of small arrays (`_engine.small`) decode every layout to the
    saved values: zarr2 and zarr3, shards, subchunks, compressed or not."""
    tree, paths = layouts
    if layout in ("standard_checkpointer", "v1_api"):
        tree = lazyckpt.select(tree, lambda _, v: isinstance(v, jax.Array | np.ndarray))
    assert_loaded(lazyckpt.load(lazyckpt.open(paths[layout])), expected(tree))
    assert "sharded" in batched and "dtypes/bf16" in batched, batched


def _views(array: lazyckpt.LazyArray) -> dict[str, lazyckpt.LazyArray]:
    return {
        "whole": array,
        "rows": array[7:41],
        "strided": array[::3, ::-2],
        "reversed": array[::-1],
        "row": array[5],
        "newaxis_cast": array[None, 2:9, 1::3].astype(np.float16),
    }


@pytest.mark.parametrize("layout", ["ocdbt_zarr2", "folders_zarr3", "subchunked_zarr3"])
def test_views_shardings_and_streams_decode_alike(
    layouts: tuple[dict[str, Any], dict[str, Path]],
    layout: str,
    decoder: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree, paths = layouts
    array = lazyckpt.open(paths[layout])["sharded"]  # (64, 32), saved from a 4x2 mesh
    value = np.asarray(tree["sharded"])
    view_indices: dict[str, tuple[int | slice | None, ...]] = {
        "whole": (),
        "rows": (slice(7, 41),),
        "strided": (slice(None, None, 3), slice(None, None, -2)),
        "reversed": (slice(None, None, -1),),
        "row": (5,),
        "newaxis_cast": (None, slice(2, 9), slice(1, None, 3)),
    }
    wants = {name: np.asarray(value[index]) for name, index in view_indices.items()}
    wants["newaxis_cast"] = wants["newaxis_cast"].astype(np.float16)
    for name, view in _views(array).items():
        want = wants[name]
        np.testing.assert_array_equal(lazyckpt.load(view), want, err_msg=name)
        got = np.zeros(want.shape, want.dtype)
        hits = np.zeros(want.shape, np.int8)
        for _, index, block in lazyckpt.iter_blocks({"v": view}, memory_budget=4096):
            got[index] = block
            hits[index] += 1
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert (hits == 1).all(), name
    for spec in (P("d"), P(None, "d"), P()):
        sharding = NamedSharding(jax.make_mesh((8,), ("d",)), spec)
        placed = lazyckpt.device_put(array[:, :16], sharding, memory_budget=8192)
        for shard in placed.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[:, :16][shard.index])
    assert decoder


def _replace_array(item: Path, name: str, spec: dict[str, Any], value: np.ndarray) -> None:
    """Write `value` as the array `name` of the (folder layout) checkpoint `item`,
    with tensorstore's zarr driver and the codecs in `spec`."""
    folder = item / name
    shutil.rmtree(folder)
    store = ts.open(
        {**spec, "kvstore": {"driver": "file", "path": str(folder) + "/"}, "create": True},
    ).result()
    store.write(value).result()


_VALUE = np.random.default_rng(5).standard_normal((37, 24)).astype(np.float32)
_ZARR2: dict[str, Any] = {
    "driver": "zarr",
    "metadata": {
        "shape": [37, 24],
        "chunks": [10, 7],
        "dtype": "<f4",
        "compressor": {"id": "zstd", "level": 1},
    },
}
_ZARR3: dict[str, Any] = {
    "driver": "zarr3",
    "metadata": {
        "shape": [37, 24],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [10, 7]}},
        "data_type": "float32",
    },
}


def _sharded(inner: list[int], location: str) -> dict[str, Any]:
    return {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": inner,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
            "index_codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
            "index_location": location,
        },
    }


CODECS: dict[str, tuple[bool, dict[str, Any]]] = {
    "zarr2_f_order": (False, {**_ZARR2, "metadata": {**_ZARR2["metadata"], "order": "F"}}),
    "zarr2_big_endian": (
        False,
        {**_ZARR2, "metadata": {**_ZARR2["metadata"], "dtype": ">f4"}},
    ),
    "zarr2_slash_keys": (
        False,
        {**_ZARR2, "metadata": {**_ZARR2["metadata"], "dimension_separator": "/"}},
    ),
    "zarr2_raw": (False, {**_ZARR2, "metadata": {**_ZARR2["metadata"], "compressor": None}}),
    "zarr3_plain": (True, _ZARR3),
    "zarr3_transposed_big_endian": (
        True,
        {
            **_ZARR3,
            "metadata": {
                **_ZARR3["metadata"],
                "codecs": [
                    {"name": "transpose", "configuration": {"order": [1, 0]}},
                    {"name": "bytes", "configuration": {"endian": "big"}},
                    {"name": "zstd", "configuration": {"level": 5, "checksum": True}},
                ],
            },
        },
    ),
    "zarr3_v2_keys": (
        True,
        {**_ZARR3, "metadata": {**_ZARR3["metadata"], "chunk_key_encoding": {"name": "v2"}}},
    ),
    "zarr3_shards_of_six_index_first": (
        True,
        {
            **_ZARR3,
            "metadata": {
                **_ZARR3["metadata"],
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [20, 21]}},
                "codecs": [_sharded([10, 7], "start")],
            },
        },
    ),
    "zarr3_shards_of_six_index_last": (
        True,
        {
            **_ZARR3,
            "metadata": {
                **_ZARR3["metadata"],
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [20, 21]}},
                "codecs": [_sharded([10, 7], "end")],
            },
        },
    ),
}


@pytest.mark.parametrize("variant", list(CODECS))
def test_codec_variants_decode(tmp_path: Path, variant: str, decoder: list[str]) -> None:
    zarr3, spec = CODECS[variant]
    item = orbax_save(tmp_path / "ckpt", {"w": _VALUE}, zarr3=zarr3, use_ocdbt=False)
    _replace_array(item, "w", spec, _VALUE)
    lazy = lazyckpt.open(item)["w"]
    assert lazy.stored.codec is not None, variant
    np.testing.assert_array_equal(lazyckpt.load(lazy), _VALUE)
    np.testing.assert_array_equal(lazy[3:30:4, ::-3].get(), _VALUE[3:30:4, ::-3])
    np.testing.assert_array_equal(lazyckpt.load(lazy[12:19, 5:16]), _VALUE[12:19, 5:16])
    assert decoder.count("w") >= 1


@pytest.mark.parametrize("variant", list(CODECS))
def test_codec_variants_read_in_batches(tmp_path: Path, variant: str, batched: list[str]) -> None:
    """The batched reads of small arrays take every codec variant: values equal, each
    result C-ordered and its own (an F-order chunk too), read by that path."""
    zarr3, spec = CODECS[variant]
    item = orbax_save(tmp_path / "ckpt", {"w": _VALUE}, zarr3=zarr3, use_ocdbt=False)
    _replace_array(item, "w", spec, _VALUE)
    lazy = lazyckpt.open(item)["w"]
    loaded = lazyckpt.load({"a": lazy, "b": lazy})
    assert batched == ["w", "w"], batched
    for values in loaded.values():
        np.testing.assert_array_equal(values, _VALUE)
        assert values.flags.c_contiguous and values.flags.writeable, variant
    assert not np.shares_memory(loaded["a"], loaded["b"])


def test_codecs_lazyckpt_leaves_to_tensorstore(tmp_path: Path, decoder: list[str]) -> None:
    """A crc32c over chunk data, or blosc: read by tensorstore, which verifies them."""
    for name, codecs in {
        "crc": [{"name": "bytes"}, {"name": "zstd"}, {"name": "crc32c"}],
        "blosc": [{"name": "bytes"}, {"name": "blosc"}],
    }.items():
        item = orbax_save(tmp_path / name, {"w": _VALUE}, zarr3=True, use_ocdbt=False)
        spec = {**_ZARR3, "metadata": {**_ZARR3["metadata"], "codecs": codecs}}
        _replace_array(item, "w", spec, _VALUE)
        lazy = lazyckpt.open(item)["w"]
        assert lazy.stored.codec is None, name
        np.testing.assert_array_equal(lazyckpt.load(lazy), _VALUE)
    assert not decoder


def test_missing_chunks_are_the_fill_value_or_an_error(tmp_path: Path, decoder: list[str]) -> None:
    value = np.arange(40 * 24, dtype=np.float32).reshape(40, 24)
    item = orbax_save(tmp_path / "ckpt", {"w": value}, zarr3=True, use_ocdbt=False)
    spec = {**_ZARR3, "metadata": {**_ZARR3["metadata"], "shape": [40, 24], "fill_value": -1.0}}
    _replace_array(item, "w", spec, value)
    (item / "w" / "c" / "1" / "2").unlink()  # rows 10:20, columns 14:21
    metadata = json.loads((item / "_METADATA").read_text())
    want = value.copy()
    want[10:20, 14:21] = -1.0
    for equal_to_fill in (False, True):
        metadata["store_array_data_equal_to_fill_value"] = equal_to_fill
        (item / "_METADATA").write_text(json.dumps(metadata))
        lazy = lazyckpt.open(item)["w"]
        if not equal_to_fill:  # chunks may be left out: missing ones are the fill value
            np.testing.assert_array_equal(lazyckpt.load(lazy), want)
            continue
        with pytest.raises(
            lazyckpt.CorruptCheckpointError,
            match=r"array 'w' chunk \[1, 2\] \(stored as 'w/c/1/2'\) is missing from the store",
        ):
            lazyckpt.load(lazy)


@pytest.fixture
def one_chunk(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A NumPy array saved by orbax's defaults: 4 MiB in one zstd chunk."""
    value = np.random.default_rng(9).standard_normal((1024, 1024)).astype(np.float32)
    return orbax_save(tmp_path / "one", {"w": value}, use_ocdbt=False), value


def _chunk_file(item: Path) -> Path:
    return item / "w" / "0.0"


def test_damaged_chunks_name_the_array_and_chunk(one_chunk: tuple[Path, np.ndarray]) -> None:
    item, _ = one_chunk
    chunk = _chunk_file(item)
    good = chunk.read_bytes()
    # (Orbax writes zstd frames without a checksum: a flipped bit in stored bytes of
    # random values decodes to a wrong value, which nothing can detect.)
    cases = {
        "truncated": good[: len(good) // 3],
        "not zstd": b"\x00" * len(good),
        "trailing": good + b"more",
    }
    messages = {
        "truncated": r"ends after \d+ of its 4194304 decoded bytes",
        "not zstd": r"does not start with a zstd frame \(error when determining content size\)",
        "trailing": r"holds more than its 4194304 decoded bytes",
    }
    for case, data in cases.items():
        chunk.write_bytes(data)
        lazy = lazyckpt.open(item)["w"]
        assert _decode.decodes(lazy.stored)
        with pytest.raises(
            lazyckpt.CorruptCheckpointError,
            match=rf"one: array 'w' chunk \[0, 0\] \(stored as 'w/0.0'\) ({messages[case]}); the "
            r"checkpoint's data is damaged, copy it again",
        ):
            lazyckpt.load(lazy)
    chunk.write_bytes(good)


def test_shard_index_checksum_is_verified(tmp_path: Path, decoder: list[str]) -> None:
    item = orbax_save(tmp_path / "ckpt", {"w": _VALUE}, zarr3=True, use_ocdbt=False)
    shard = item / "w" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[-6] ^= 0x01  # inside the index (offset, length), before its crc32c
    shard.write_bytes(bytes(data))
    with pytest.raises(
        lazyckpt.CorruptCheckpointError, match=r"has a shard index whose crc32c does not match"
    ):
        lazyckpt.load(lazyckpt.open(item)["w"])


def test_a_slice_reads_only_the_stored_prefix_up_to_its_rows(
    one_chunk: tuple[Path, np.ndarray], count_bytes: Any
) -> None:
    item, value = one_chunk
    lazy = lazyckpt.open(item)["w"]
    stored = _chunk_file(item).stat().st_size
    budget = 1 << 20
    read_window = max(256 << 10, budget // 64)
    with count_bytes() as read:
        rows = lazyckpt.load(lazy[100:110], memory_budget=budget)
    np.testing.assert_array_equal(rows, value[100:110])
    # zstd cannot seek: the prefix up to row 110 is decoded, plus what reads ahead.
    assert read[0] <= stored * 110 / 1024 * 1.05 + 2 * read_window
    with count_bytes() as read:
        lazyckpt.load(lazy[1000:], memory_budget=budget)
    assert read[0] >= stored * 0.97  # the last rows need the whole stream


def test_concurrent_reads_from_many_threads(one_chunk: tuple[Path, np.ndarray]) -> None:
    item, value = one_chunk
    lazy = lazyckpt.open(item)["w"]
    results: dict[int, Any] = {}

    def read(i: int) -> None:
        results[i] = lazyckpt.load(lazy[i * 100 : i * 100 + 300], memory_budget=2 << 20)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for i in range(6):
        np.testing.assert_array_equal(results[i], value[i * 100 : i * 100 + 300])


@pytest.fixture(scope="module")
def big_chunk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """96 MiB in one chunk, as orbax saves a NumPy array by default."""
    value = np.random.default_rng(2).standard_normal((3072, 8192)).astype(np.float32)
    return orbax_save(tmp_path_factory.mktemp("big-chunk") / "ckpt", {"w": value})


@pytest.mark.parametrize(
    "mode", ["load", "device_put", "stream", "stats", "verify", "slice", "get"]
)
def test_memory_stays_within_the_budget_whatever_the_chunk_size(big_chunk: Path, mode: str) -> None:
    """In a fresh process: one 96 MiB chunk read at a 16 MiB budget. Beyond their
    results, reads grew the process by 2-14 MiB here, also on a loaded machine; holding
    the chunk whole, decoded or compressed (89 MiB), would take 89 MiB or more, and
    ignoring the budget (a 1 GiB one) grows `stream` and `stats` by 114-133 MiB. A few
    rows near the start of the chunk need 2-10 MiB, `.get()` with the default windows
    included."""
    budget = 16 << 20
    probe = rss_probe(big_chunk, mode, budget)
    beyond = probe["peak"] - probe["kept"]
    assert beyond < budget + (16 << 20), probe
    if mode in ("load", "device_put"):
        assert probe["kept"] == 96 << 20, probe
    if mode == "stream":
        assert probe["largest"] <= budget // 8, probe  # blocks cut inside the chunk
    if mode in ("slice", "get"):
        assert beyond < budget, probe


def test_the_stored_dtype_and_order_of_jax_and_numpy_arrays_decode_alike(
    tmp_path: Path, decoder: list[str]
) -> None:
    """bfloat16 from a jax.Array and bool from NumPy: ml_dtypes and one-byte types."""
    tree = {
        "bf16": jnp.linspace(-2, 2, 4096, dtype=jnp.bfloat16).reshape(64, 64),
        "flags": np.arange(4096).reshape(64, 64) % 7 == 0,
    }
    item = orbax_save(tmp_path / "ckpt", tree, zarr3=True)
    loaded = lazyckpt.load(lazyckpt.open(item))
    np.testing.assert_array_equal(loaded["bf16"], np.asarray(tree["bf16"]))
    np.testing.assert_array_equal(loaded["flags"], tree["flags"])
    assert sorted(set(decoder)) == ["bf16", "flags"]
