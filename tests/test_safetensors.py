"""Safetensors both ways: files written by the `safetensors` library open lazily (one
file, a sharded Hugging Face folder, a bucket), every verb reads exactly the bytes it
needs, bad headers are clear errors, and lazyckpt's exports load in `safetensors`."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import lazyckpt
from lazyckpt._safetensors.ranges import contiguous_chunks
from tests.helpers import ROOT, orbax_save, rss_probe, stored_chunk_bytes

_RNG = np.random.default_rng(0)
TENSORS: dict[str, np.ndarray] = {
    "model.embed_tokens.weight": _RNG.standard_normal((1000, 96), dtype=np.float32),
    "model.layers.0.self_attn.q_proj.weight": _RNG.standard_normal((96, 96)).astype(
        ml_dtypes.bfloat16
    ),
    "model.layers.1.self_attn.q_proj.weight": _RNG.standard_normal((96, 96)).astype(np.float16),
    "model.layers.1.mlp.f8": _RNG.standard_normal((8, 4)).astype(ml_dtypes.float8_e4m3fn),
    "model.layers.1.mlp.f8b": _RNG.standard_normal((8, 4)).astype(ml_dtypes.float8_e5m2),
    "model.norm.weight": np.linspace(0, 1, 96).astype(np.float64),
    "ints.i8": _RNG.integers(-100, 100, (5, 3)).astype(np.int8),
    "ints.i16": _RNG.integers(-100, 100, (5,)).astype(np.int16),
    "ints.i32": _RNG.integers(-100, 100, (5,)).astype(np.int32),
    "ints.i64": np.array(7, np.int64),
    "ints.u8": np.arange(6, dtype=np.uint8),
    "ints.u16": np.arange(6, dtype=np.uint16),
    "ints.u32": np.arange(6, dtype=np.uint32),
    "ints.u64": np.arange(6, dtype=np.uint64),
    "mask": np.array([True, False, True]),
    "empty": np.zeros((0, 4), np.float32),
}


def _bits(array: Any) -> np.ndarray:
    """The bytes of an array, to compare float8 and bfloat16 values (NaNs too) exactly."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _load(file: str) -> dict[str, np.ndarray]:
    """Every tensor's bytes as the `safetensors` library reads them (its NumPy API has
    no float8: those as the bytes its header places)."""
    out = {}
    with safe_open(file, "np") as opened:
        for name in opened.keys():  # noqa: SIM118 - safe_open is no mapping
            if "f8" not in name:
                out[name] = _bits(opened.get_tensor(name))
    data = Path(file).read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    for name, entry in header.items():
        if "f8" in name:
            begin, end = entry["data_offsets"]
            out[name] = np.frombuffer(data[8 + length + begin : 8 + length + end], np.uint8)
    return out


def _at(tree: Any, name: str) -> Any:
    for part in name.split("."):
        tree = tree[part]
    return tree


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt", "note": "test"})
    return path


def _sharded(folder: Path, tensors: dict[str, np.ndarray], shards: int) -> Path:
    """A folder as `transformers` writes it: shards and an index with a weight map."""
    folder.mkdir(parents=True)
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_open_reads_headers_only_and_every_dtype_round_trips(
    single: Path, count_bytes: Callable[[], Any]
) -> None:
    header = 8 + struct.unpack("<Q", single.read_bytes()[:8])[0]
    with count_bytes() as read:
        tree = lazyckpt.open(single)
    assert read[0] == header + 1  # the length, the JSON, one byte at the end of the data
    embed = tree["model"]["embed_tokens"]["weight"]
    assert (embed.shape, embed.dtype, embed.chunks) == ((1000, 96), np.float32, (1000, 96))
    assert embed.key == "model/embed_tokens/weight"  # key paths as everywhere; the name:
    assert embed.stored.key == "model.embed_tokens.weight"
    loaded = lazyckpt.load(tree)
    for name, want in TENSORS.items():
        got = _at(loaded, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=name)
    assert lazyckpt.safetensors_metadata(single) == {"format": "pt", "note": "test"}
    flat = lazyckpt.open(single, flat=True)
    assert sorted(flat) == sorted(TENSORS)


def test_views_read_only_their_rows(tmp_path: Path, count_bytes: Callable[[], Any]) -> None:
    embed = _RNG.standard_normal((50257, 64), dtype=np.float32)  # rows of 256 B, 12 MiB
    path = tmp_path / "embed.safetensors"
    save_file({"wte": embed}, str(path))
    lazy = lazyckpt.open(path)["wte"]
    assert lazy.chunks == contiguous_chunks((50257, 64), 4) == (4096, 64)
    with count_bytes() as read:
        rows = lazy[1000:1010].get()
    np.testing.assert_array_equal(rows, embed[1000:1010])
    assert read[0] == 10 * 256
    for index in [(slice(None, None, -997), 3), (5,), (slice(7, 40, 3), slice(None, None, -2))]:
        np.testing.assert_array_equal(lazy[index].get(), embed[index])
    with count_bytes() as read:
        np.testing.assert_array_equal(lazyckpt.load(lazy[20000:20010]), embed[20000:20010])
    assert read[0] <= 4096 * 256  # the engine reads whole chunks: one here
    np.testing.assert_array_equal(lazy.astype("bfloat16").get(), embed.astype(ml_dtypes.bfloat16))


def test_device_put_reads_each_byte_once(tmp_path: Path, count_bytes: Callable[[], Any]) -> None:
    weight = _RNG.standard_normal((5000, 128), dtype=np.float32)
    path = tmp_path / "w.safetensors"
    save_file({"w": weight}, str(path))
    lazy = lazyckpt.open(path)["w"]
    mesh = jax.make_mesh((8,), ("d",))
    with count_bytes() as read:
        placed = lazyckpt.device_put(lazy, NamedSharding(mesh, P("d")))
    np.testing.assert_array_equal(np.asarray(placed), weight)
    assert read[0] == weight.nbytes  # chunks straddling two devices' rows are read once
    replicated = lazyckpt.device_put({"w": lazy}, NamedSharding(mesh, P()))
    np.testing.assert_array_equal(np.asarray(replicated["w"]), weight)


def test_a_sharded_model_folder_is_one_tree(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "hf", TENSORS, 3)
    tree = lazyckpt.open(folder)
    assert sorted(path for path, _ in lazyckpt.leaves(tree)) == sorted(
        n.replace(".", "/") for n in TENSORS
    )
    np.testing.assert_array_equal(
        lazyckpt.load(tree, "model/embed_tokens/**")["model"]["embed_tokens"]["weight"],
        TENSORS["model.embed_tokens.weight"],
    )
    stats = lazyckpt.stats(tree, "model/norm/**")
    assert stats["model/norm/weight"].max == 1.0
    assert [key for key, _, _ in lazyckpt.iter_blocks(tree, "ints/i8")] == ["ints/i8"]
    assert lazyckpt.verify(tree, progress=False).ok
    # And into an Orbax checkpoint that Orbax restores (it saves no float8 arrays).
    kept = lazyckpt.select(tree, lambda path, leaf: "f8" not in path and leaf.size)
    orbax = lazyckpt.convert(
        folder, tmp_path / "orbax", select=lambda p, x: "f8" not in p and x.size
    )
    restored = ocp.PyTreeCheckpointer().restore(orbax)
    for path, leaf in lazyckpt.leaves(kept):
        np.testing.assert_array_equal(
            _bits(_at(restored, path.replace("/", "."))), _bits(leaf.get())
        )
    assert lazyckpt.safetensors_metadata(folder) == {
        "format": "pt",
        "total_size": str(sum(t.nbytes for t in TENSORS.values())),
    }


def test_diff_against_orbax_of_the_same_model(single: Path, tmp_path: Path) -> None:
    # Orbax saves neither float8 nor empty arrays: compare the rest.
    kept = [name for name in TENSORS if "f8" not in name and name != "empty"]
    nested: dict[str, Any] = {}
    for name in kept:
        node = nested
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = TENSORS[name]
    orbax = orbax_save(tmp_path / "orbax", nested)
    tree = lazyckpt.select(lazyckpt.open(single), [name.replace(".", "/") for name in kept])
    result = lazyckpt.diff(tree, orbax, values=True)
    assert not result, str(result)
    assert {c.kind for c in result.changes} == {"equal"}


def test_export_loads_in_safetensors(single: Path, tmp_path: Path) -> None:
    tree = lazyckpt.open(single)
    one = lazyckpt.save(tmp_path / "copy.safetensors", tree, metadata={"format": "pt"})
    back = _load(one)
    assert sorted(back) == sorted(TENSORS)
    for name, want in TENSORS.items():
        np.testing.assert_array_equal(back[name], _bits(want), name)
    header = json.loads(
        Path(one).read_bytes()[8 : 8 + struct.unpack("<Q", Path(one).read_bytes()[:8])[0]]
    )
    assert header["__metadata__"] == {"format": "pt"}
    sharded = lazyckpt.save(tmp_path / "hf", tree, format="safetensors", max_shard_size=100_000)
    names = sorted(os.listdir(sharded))
    count = len(names) - 1  # the embedding alone passes the limit, the rest fill one
    assert count == 2 and names == [
        *(f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)),
        "model.safetensors.index.json",
    ]
    index = json.loads((Path(sharded) / names[-1]).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in TENSORS.values())
    assert sorted(index["weight_map"]) == sorted(TENSORS)
    for file in set(index["weight_map"].values()):
        part = _load(str(Path(sharded) / file))
        for name, value in part.items():
            assert index["weight_map"][name] == file
            np.testing.assert_array_equal(value, _bits(TENSORS[name]))
    assert not lazyckpt.diff(tree, sharded, values=True)


def test_shards_are_cut_as_huggingface_hub_cuts_them(tmp_path: Path) -> None:
    """The same tensors in the same files as `huggingface_hub`'s splitter (which
    `transformers`' `save_pretrained` uses): a tensor over the limit gets a file of its
    own, and the file being filled goes on after it."""
    from huggingface_hub import split_state_dict_into_shards_factory

    sizes = [300, 900, 4000, 100, 2500, 700, 5000, 5000, 10, 2000]
    tree = {f"t{i:02d}": np.ones(n, np.uint8) for i, n in enumerate(sizes)}
    for limit in (1000, 2500, 5000, 100_000):
        out = lazyckpt.save(tmp_path / str(limit), tree, format="safetensors", max_shard_size=limit)
        split = split_state_dict_into_shards_factory(
            tree,
            get_storage_size=lambda t: t.nbytes,
            filename_pattern="model{suffix}.safetensors",
            max_shard_size=limit,
        )
        if not split.is_sharded:
            assert sorted(os.listdir(out)) == ["model.safetensors"]
            continue
        index = json.loads((Path(out) / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == split.tensor_to_filename, limit


def test_export_of_orbax_and_jax_arrays(tmp_path: Path, count_bytes: Callable[[], Any]) -> None:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    kernel = _RNG.standard_normal((512, 256), dtype=np.float32)
    state = {
        "params": {
            "kernel": jax.device_put(kernel, NamedSharding(mesh, P("x", "y"))),
            "bias": jax.device_put(np.arange(256, dtype=np.float32), NamedSharding(mesh, P())),
        },
    }
    direct = load_file(lazyckpt.save(tmp_path / "jax.safetensors", state))
    np.testing.assert_array_equal(direct["params.kernel"], kernel)
    orbax = orbax_save(tmp_path / "orbax", state)  # chunks of the (128, 128) shards
    lazy = lazyckpt.open(orbax)
    stored = sum(stored_chunk_bytes(orbax, a) for _, a in lazyckpt.leaves(lazy))
    with count_bytes() as read:
        out = lazyckpt.convert(
            orbax, tmp_path / "out.safetensors", dtype="bfloat16", progress=False
        )
    assert read[0] <= stored + (64 << 10)  # each stored chunk once (and OCDBT's nodes)
    back = load_file(out)
    np.testing.assert_array_equal(back["params.kernel"], kernel.astype(ml_dtypes.bfloat16))


def test_convert_renames_to_hugging_face_names(tmp_path: Path) -> None:
    params = {
        "params": {
            "layers_0": {"attn": {"q": {"kernel": np.ones((4, 4), np.float32)}}},
            "layers_1": {"attn": {"q": {"kernel": np.full((4, 4), 2, np.float32)}}},
        },
        "opt": {"mu": np.zeros(3)},
    }
    orbax = orbax_save(tmp_path / "orbax", params)
    rules = [
        (r"^params/layers_(\d+)/attn/(\w)/kernel$", r"model/layers/\1/self_attn/\2_proj/weight")
    ]
    out = lazyckpt.convert(orbax, tmp_path / "hf", to="safetensors", select="params", rename=rules)
    back = load_file(str(Path(out) / "model.safetensors"))
    assert sorted(back) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert back["model.layers.1.self_attn.q_proj.weight"][0, 0] == 2
    cli = subprocess.run(
        [sys.executable, "-m", "lazyckpt._cli.main", "convert", str(orbax), str(tmp_path / "cli"),
         "--to", "safetensors", "--select", "params", "--rename", r"^params/layers_(\d+)/",
         r"h/\1/", "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert sorted(load_file(str(tmp_path / "cli" / "model.safetensors"))) == [
        "h.0.attn.q.kernel",
        "h.1.attn.q.kernel",
    ]
    with pytest.raises(
        lazyckpt.RenameError,
        match="'params/layers_0/attn/q/kernel' and 'params/layers_1/attn/q/kernel' would go both to 'w'",
    ):
        lazyckpt.rename(lazyckpt.open(orbax), [(".*kernel", "w")])
    inside = "'params/layers_1/attn/q/kernel' would go to 'w' and 'w/q', one inside the other"
    with pytest.raises(lazyckpt.RenameError, match=re.escape(inside)):
        lazyckpt.rename(
            lazyckpt.open(orbax), [(r"^params/layers_0/.*", "w"), (r"^params/layers_1/.*", "w/q")]
        )


def test_a_failed_export_leaves_nothing(tmp_path: Path) -> None:
    data = _RNG.standard_normal((256, 256), dtype=np.float32)
    orbax = orbax_save(tmp_path / "orbax", {"a": data, "b": data}, use_ocdbt=False)
    tree = lazyckpt.open(orbax)
    chunks = [f for f in (orbax / "b").rglob("*") if f.is_file() and not f.name.startswith(".")]
    assert chunks  # zarr v2 chunk files beside .zarray
    for chunk in chunks:
        chunk.write_bytes(b"damaged")
    for target in (tmp_path / "one.safetensors", tmp_path / "folder"):
        with pytest.raises(lazyckpt.CorruptCheckpointError, match="reading array 'b'"):
            lazyckpt.save(target, tree, format="safetensors")
        assert sorted(os.listdir(tmp_path)) == ["orbax"]


def test_unsavable_leaves_and_destinations(tmp_path: Path) -> None:
    with pytest.raises(
        lazyckpt.UnsavableError,
        match=re.escape("no array, and safetensors holds arrays only: step"),
    ):
        lazyckpt.save(tmp_path / "a.safetensors", {"w": np.ones(2), "step": 3})
    with pytest.raises(lazyckpt.UnsavableError, match="key holds typed PRNG keys"):
        lazyckpt.save(tmp_path / "a.safetensors", {"key": jax.random.key(0)})
    with pytest.raises(
        lazyckpt.UnsavableError, match=re.escape("'a/b' and 'a.b' would both be saved as 'a.b'")
    ):
        lazyckpt.save(tmp_path / "a.safetensors", {"a.b": np.ones(1), "a": {"b": np.ones(1)}})
    for reserved in ({"__metadata__": np.ones(2)}, {"__metadata__": np.ones(2), "w": np.ones(2)}):
        with pytest.raises(lazyckpt.UnsavableError, match="the header entry safetensors keeps"):
            lazyckpt.save(tmp_path / "m", reserved, format="safetensors", max_shard_size=8)
    assert not (tmp_path / "m").exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "readme.txt").write_text("keep me")
    with pytest.raises(lazyckpt.CheckpointExistsError, match="does not look like a checkpoint"):
        lazyckpt.save(other, {"w": np.ones(2)}, format="safetensors", overwrite=True)
    assert (other / "readme.txt").read_text() == "keep me"
    out = lazyckpt.save(tmp_path / "w.safetensors", {"w": np.ones(2)})
    with pytest.raises(lazyckpt.CheckpointExistsError, match=f"{out} already exists"):
        lazyckpt.save(out, {"w": np.zeros(2)})
    lazyckpt.save(out, {"w": np.zeros(2)}, overwrite=True)
    np.testing.assert_array_equal(load_file(out)["w"], np.zeros(2))


def test_only_shards_numbered_in_ascii_are_the_models_files(tmp_path: Path) -> None:
    """A file named like a shard but numbered in Arabic-Indic digits is no file of
    the model: an overwrite keeps it (it was deleted with the old shards), and a
    lone one is no shard left without its index (it refused to open)."""
    folder = tmp_path / "model"
    lazyckpt.save(folder, {"a": np.ones(64), "b": np.ones(64)}, format="safetensors",
                  max_shard_size=600)  # fmt: skip
    arabic = str.maketrans("0123456789", "".join(map(chr, range(0x0660, 0x066A))))
    other = folder / "model-00001-of-00002.safetensors".translate(arabic)
    other.write_bytes(_file(_GOOD, bytes(16)))
    lazyckpt.save(folder, {"a": np.zeros(64)}, format="safetensors", overwrite=True)
    assert other.exists() and sorted(lazyckpt.load(lazyckpt.open(folder))) == ["a"]
    (tmp_path / "lone").mkdir()
    lone = other.rename(tmp_path / "lone" / other.name)
    np.testing.assert_array_equal(lazyckpt.open(lone.parent)["w"].get(), np.zeros((2, 2)))


def _file(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


_GOOD = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
BAD_FILES = {
    "too short": (b"\x01\x02", "too short for its header length (bytes 0 to 8)"),
    "length beyond the file": (_file(_GOOD, bytes(16), length=1000), "too short for its header"),
    "huge length": (_file(_GOOD, bytes(16), length=1 << 60), "more than the 100 MiB"),
    "not json": (_file(b"{nope", bytes(16)), "the header is not valid JSON"),
    "not an object": (_file([1, 2]), "the header is a JSON list"),
    "truncated data": (_file(_GOOD, bytes(15)), "too short for the end of its data"),
    "overlap": (
        _file({**_GOOD, "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16)),
        "overlaps the tensor before it",
    ),
    "span and shape disagree": (
        _file({"w": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}}, bytes(16)),
        "shape [3, 2] of F32 takes 24 bytes, but its data_offsets span 16",
    ),
    "bad shape": (
        _file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 16]}}, bytes(16)),
        "has shape [-1], expected a list of sizes",
    ),
    "bad offsets": (
        _file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, bytes(16)),
        "expected [begin, end] with begin <= end",
    ),
    "declared petabytes": (
        _file({"w": {"dtype": "F32", "shape": [1 << 48], "data_offsets": [0, 1 << 50]}}),
        "too short for the end of its data",
    ),
    "metadata not strings": (_file({"__metadata__": {"a": 1}}), "__metadata__ must map strings"),
    "a tensor named twice": (
        _file(
            b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
            b'"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}',
            bytes(16),
        ),
        "the header names 'w' twice",
    ),
    "a field named twice": (
        _file(b'{"w": {"dtype": "F32", "dtype": "F16", "shape": [4], "data_offsets": [0, 16]}}'),
        "tensor 'w' has 'dtype' twice in the header",
    ),
    "a tensor named twice, once in escapes": (
        _file(
            b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
            b'"\\u0077": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}',
            bytes(16),
        ),
        "the header names 'w' twice",
    ),
    "metadata twice": (
        _file(b'{"__metadata__": {"a": "1"}, "__metadata__": {"b": "2"}}'),
        "the header names '__metadata__' twice",
    ),
}


def test_a_metadata_key_written_twice_is_read_as_the_library_reads_it(tmp_path: Path) -> None:
    """Inside `__metadata__` a repeated key is no tensor lost: the last value, as the
    safetensors library gives it (a tensor named `shape` takes the slow look)."""
    header = (
        b'{"__metadata__": {"format": "pt", "format": "np"}, '
        b'"shape": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    )
    path = tmp_path / "twice.safetensors"
    path.write_bytes(_file(header, np.arange(2, dtype=np.float32).tobytes()))
    assert lazyckpt.safetensors_metadata(path) == {"format": "np"}
    np.testing.assert_array_equal(lazyckpt.open(path)["shape"].get(), [0.0, 1.0])


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_headers_are_clear_errors(tmp_path: Path, case: str) -> None:
    content, message = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=f"{path}.*" + re.escape(message)):
        lazyckpt.open(path)


def test_unsupported_dtypes_and_broken_indexes(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    path.write_bytes(
        _file({"z": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [0, 3]}}, bytes(3))
    )
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match="tensor 'z' has dtype 'F6_E3M2'"):
        lazyckpt.open(path)
    complex_values = np.array([1 + 2j, -3.5j], np.complex64)  # C64, as the library writes it
    save_file({"z": complex_values}, str(tmp_path / "complex.safetensors"))
    np.testing.assert_array_equal(
        lazyckpt.open(tmp_path / "complex.safetensors")["z"].get(), complex_values
    )
    folder = _sharded(tmp_path / "hf", {"a.w": np.ones(2), "b.w": np.ones(3)}, 2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        lazyckpt.CorruptCheckpointError, match="names shards that are not in the folder"
    ):
        lazyckpt.open(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["c.w"] = "model-00001-of-00002.safetensors"
    index["weight_map"].pop("b.w")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"places \['c.w'\]"):
        lazyckpt.open(folder)
    clash = tmp_path / "clash.safetensors"
    save_file({"a.b": np.ones(1), "a.b.c": np.ones(1)}, str(clash))
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError,
        match=r"names 'a\.b' and 'a\.b\.c' .* open it with flat=True",
    ):
        lazyckpt.open(clash)
    assert sorted(lazyckpt.open(clash, flat=True)) == ["a.b", "a.b.c"]
    with pytest.raises(
        lazyckpt.NotACheckpointError, match="holds safetensors, which have no steps"
    ):
        lazyckpt.open(clash, step=3)


def test_fuzzed_headers_open_or_fail_cleanly(tmp_path: Path) -> None:
    """Mutations of a real header: each opens and reads, or raises a LazyckptError."""
    path = tmp_path / "seed.safetensors"
    save_file(
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int8)}, str(path)
    )
    seed = path.read_bytes()
    length = struct.unpack("<Q", seed[:8])[0]
    rng = np.random.default_rng(int(os.environ.get("LAZYCKPT_FUZZ_SEED", "0")))
    outcomes = {"opened": 0, "refused": 0}
    for case in range(int(os.environ.get("LAZYCKPT_FUZZ_CASES", "300"))):
        data = bytearray(seed)
        for _ in range(int(rng.integers(1, 4))):
            where = int(rng.integers(0, 8 + length))
            data[where] = (
                int(rng.integers(0, 256))
                if rng.random() < 0.7
                else ord(rng.choice(list('0123456789[]{},":')))
            )
        mutated = tmp_path / f"case{case}.safetensors"
        mutated.write_bytes(bytes(data))
        try:
            tree = lazyckpt.open(mutated, flat=True)
            lazyckpt.load(tree)
            outcomes["opened"] += 1
        except lazyckpt.LazyckptError:
            outcomes["refused"] += 1
        mutated.unlink()
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == int(
        os.environ.get("LAZYCKPT_FUZZ_CASES", "300")
    )


def test_models_in_buckets(
    s3: Any, gcs: str, tmp_path: Path, count_bytes: Callable[[], Any]
) -> None:
    folder = _sharded(tmp_path / "hf", TENSORS, 2)
    for name in os.listdir(folder):
        s3.upload_file(str(folder / name), "ckpts", f"models/hf/{name}")
    tree = lazyckpt.open("s3://ckpts/models/hf")
    with count_bytes() as read:
        rows = tree["model"]["embed_tokens"]["weight"][10:12].get()
    np.testing.assert_array_equal(rows, TENSORS["model.embed_tokens.weight"][10:12])
    assert read[0] == 2 * 96 * 4
    # (a max_shard_size for the one-file destination would be refused: only a folder shards)
    for destination, shard_size in (
        ("s3://ckpts/out/model", 200_000),
        (f"{gcs}/out/model.safetensors", None),
    ):
        out = lazyckpt.save(destination, tree, format="safetensors", max_shard_size=shard_size)
        assert not lazyckpt.diff(tree, out, values=True), destination
    listed = s3.list_objects_v2(Bucket="ckpts", Prefix="out/model/")["Contents"]
    assert sorted(o["Key"].rsplit("/", 1)[1] for o in listed)[-1] == "model.safetensors.index.json"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_export_stays_within_the_memory_budget(wide: Path, tmp_path: Path) -> None:
    """256 MiB of Orbax float32 (32 MiB chunks) to one safetensors file at a 96 MiB
    budget, in a fresh process: blocks go straight to their place in the file. It grew
    by 80 MiB here, and by 258 MiB ignoring the budget (a 1 GiB one)."""
    budget = 96 << 20
    out = tmp_path / "wide.safetensors"
    probe = rss_probe(wide, "export", budget, str(out))
    assert probe["peak"] < budget + (64 << 20), probe
    back = load_file(str(out))
    source = lazyckpt.open(wide)["layer_3"]
    np.testing.assert_array_equal(back["layer_3"][-5:], source[-5:].get())


def test_a_load_reads_raw_bytes_straight_into_its_results(tmp_path: Path) -> None:
    """A full load of a sharded model reads each byte once, with positioned reads into
    the results themselves: its peak is the results and little more (through
    tensorstore's chunks, every byte was copied three times)."""
    rng = np.random.default_rng(5)
    tensors = {f"layer{i}.w": rng.standard_normal((1024, 4096), np.float32) for i in range(4)}
    folder = _sharded(tmp_path / "hf", tensors, 2)
    probe = rss_probe(folder, "load", 1 << 30)
    data = sum(t.nbytes for t in tensors.values())
    assert probe["kept"] == data, probe
    assert probe["peak"] <= data + (4 << 20), probe  # no second copy of any tensor


def test_many_small_tensors_are_read_in_a_few_large_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count_bytes: Callable[[], Any]
) -> None:
    """2,000 tensors of 1 KiB in one file: one read for all of them, each byte once,
    every value right (one tensorstore read per tensor before)."""
    rng = np.random.default_rng(6)
    tensors = {f"e{i}": rng.standard_normal(256, np.float32) for i in range(2000)}
    path = tmp_path / "experts.safetensors"
    save_file(tensors, str(path))
    lazy = lazyckpt.open(path)
    reads: list[int] = []
    real = os.preadv

    def counted(fd: int, buffers: Any, offset: int) -> int:
        reads.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    with count_bytes() as read:
        loaded = lazyckpt.load(lazy)
    assert len(reads) == 1 and read[0] == 2000 * 1024
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name], value)


def test_small_tensors_are_read_into_their_results_without_a_copy(tmp_path: Path) -> None:
    """20,000 tensors of 1 KiB: the batched reads land in the results themselves, so
    the peak is the data and the results' Python objects (before, a scratch copy of
    each batch besides)."""
    rng = np.random.default_rng(8)
    path = tmp_path / "experts.safetensors"
    tensors = {f"e{i}": rng.standard_normal((2, 128), np.float32) for i in range(20_000)}
    save_file(tensors, str(path))  # (2-D: the probe warms up on a row of the first)
    probe = rss_probe(path, "load", 1 << 30)
    data = 20_000 * 1024
    assert probe["kept"] == data, probe
    # Beyond the data: the Python objects of 20,000 results and their tree, about
    # 500 bytes each (before: also a scratch copy of every batch, +24 MiB in all).
    assert probe["peak"] <= data + 20_000 * 800, probe


def test_a_small_tensor_loaded_twice_is_two_arrays(tmp_path: Path) -> None:
    """Tied weights: one tensor at two places of a tree loads as two arrays that do
    not share memory, as any other read's results."""
    path = tmp_path / "tied.safetensors"
    save_file({"embed": np.arange(12, dtype=np.float32), "b": np.ones(3, np.float32)}, str(path))
    lazy = lazyckpt.open(path)
    loaded = lazyckpt.load({"embed": lazy["embed"], "head": lazy["embed"], "b": lazy["b"]})
    assert not np.shares_memory(loaded["embed"], loaded["head"])
    loaded["embed"][0] = 99
    np.testing.assert_array_equal(loaded["head"], np.arange(12, dtype=np.float32))


def test_small_tensors_at_unaligned_offsets_are_aligned_results(tmp_path: Path) -> None:
    """A file whose tensors are packed without padding (a u8 tensor of 3 bytes, then
    float32 and float64 tensors at odd offsets), as the format allows: each result is
    right and aligned for its dtype."""
    values: dict[str, np.ndarray] = {
        "a": np.arange(3, dtype=np.uint8),
        "b": np.linspace(-1, 1, 5).astype(np.float32),
        "c": np.arange(7, dtype=np.float64),
        "d": np.arange(6, dtype=np.int16).reshape(2, 3),
    }
    header: dict[str, object] = {}
    data = b""
    for name, value in values.items():
        kind = {"uint8": "U8", "float32": "F32", "float64": "F64", "int16": "I16"}
        header[name] = {
            "dtype": kind[value.dtype.name],
            "shape": list(value.shape),
            "data_offsets": [len(data), len(data) + value.nbytes],
        }
        data += value.tobytes()
    text = json.dumps(header).encode()
    path = tmp_path / "packed.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    np.testing.assert_array_equal(load_file(str(path))["c"], values["c"])  # the library reads it
    loaded = lazyckpt.load(lazyckpt.open(path))
    for name, value in values.items():
        np.testing.assert_array_equal(loaded[name], value)
        assert loaded[name].flags.aligned and loaded[name].flags.writeable, name


def test_a_file_truncated_after_open_is_an_error_on_the_raw_path(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": np.ones((512, 1024), np.float32), "b": np.ones(8, np.float32)}, str(path))
    lazy = lazyckpt.open(path)
    os.truncate(path, os.path.getsize(path) // 2)
    for read in (lambda: lazyckpt.load(lazy["w"]), lambda: lazyckpt.load(lazy)):
        with pytest.raises(
            (lazyckpt.CheckpointChangedError, lazyckpt.CorruptCheckpointError),
            match=re.escape(str(tmp_path)),
        ):
            read()


def test_a_file_changed_after_open_is_named_not_its_folder(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": np.ones((256, 256), np.float32)}, str(path))
    lazy = lazyckpt.open(path)
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(
        lazyckpt.CheckpointChangedError,
        match=re.escape(f"{path} was overwritten or changed since it was opened"),
    ):
        lazyckpt.save(tmp_path / "out", lazy)


@pytest.mark.parametrize("budget", ["1MiB", None])
def test_a_transposed_tensor_saved_to_orbax_reads_each_byte_once(
    tmp_path: Path, budget: str | None
) -> None:
    """Hugging Face's `(out, in)` weight as Flax's `(in, out)` kernel: the checkpoint is
    chunked in the file's order, so each chunk is a run of the file, read once; cut
    along the kernel's rows, every chunk needed every row of the file (32 times the
    tensor's bytes at a 4 MiB budget). Orbax restores it as saved."""
    import orbax.checkpoint as ocp

    weight = _RNG.standard_normal((1024, 512), dtype=np.float32)  # 2 MiB
    save_file({"w": weight}, str(tmp_path / "model.safetensors"))
    lazy = lazyckpt.open(tmp_path / "model.safetensors")["w"]
    with lazyckpt.measure() as cost:
        out = lazyckpt.save(
            tmp_path / "flax", {"kernel": lazy.T}, chunk_bytes="64KiB", memory_budget=budget
        )
    assert weight.nbytes <= cost.bytes_read < weight.nbytes + (64 << 10), cost  # (and a header)
    assert lazyckpt.open(out)["kernel"].chunks == (512, 32)
    restored = ocp.PyTreeCheckpointer().restore(out)
    np.testing.assert_array_equal(restored["kernel"], weight.T)
