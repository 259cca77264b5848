"""Every layout orbax-checkpoint writes opens as the same lazy tree with the same values."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt import LazyArray
from tests.conftest import orbax_manager_save, orbax_save


def rich_tree(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Every kind of leaf and key that Orbax can save (spec §3, §5, §9)."""
    rng = np.random.default_rng(3)
    return {
        "sharded": jax.device_put(
            rng.standard_normal((64, 32), dtype=np.float32), NamedSharding(mesh, P("x", "y"))
        ),
        "replicated": jax.device_put(np.arange(40, dtype=np.int32), NamedSharding(mesh, P())),
        "dtypes": {
            "bf16": np.linspace(-3, 3, 12).astype(jnp.bfloat16),
            "f16": np.linspace(-3, 3, 12).astype(np.float16),
            "i8": np.arange(-6, 6, dtype=np.int8),
            "u8": np.arange(12, dtype=np.uint8),
            "bool": np.arange(12) % 3 == 0,
            "c64": (np.arange(4) + 1j).astype(np.complex64),
        },
        "zero_d": {"jax": jnp.float32(2.5) * jnp.ones(()), "numpy": np.array(7, np.int16)},
        "scalars": {
            "int": 3,
            "float": 0.5,
            "bool": True,
            "np_int8": np.int8(-4),
            "np_f32": np.float32(1.5),
        },
        "text": "hello",
        "containers": {
            "list": [np.ones(3, np.float32), "in a list", 4],
            "tuple": (np.zeros(2, np.float32), 5),
            "empty_dict": {},
            "empty_list": [],
            "none": None,
        },
        "keys": {
            "one": jax.random.key(42),
            "split": jax.random.split(jax.random.key(1), 3),
            "raw": jax.random.PRNGKey(0),
        },
        "x.y": np.arange(3, dtype=np.float32),
        "a/b": np.arange(4, dtype=np.float32),
        "tilde~k": np.arange(5, dtype=np.float32),
        "e/f": "slash string",
        "int_keys": {7: {8: np.arange(2, dtype=np.int32)}, 9: "nine"},
    }


def expected(value: Any) -> Any:
    """What lazyckpt.load returns for what was saved (spec §3.1, §15.6)."""
    if isinstance(value, dict):
        return {str(k): expected(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [expected(v) for v in value]
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return value
    if isinstance(value, jax.Array | np.ndarray):
        return np.asarray(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def assert_loaded(actual: Any, want: Any, key: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(want), key
        for k in want:
            assert_loaded(actual[k], want[k], f"{key}/{k}")
    elif isinstance(want, list):
        assert isinstance(actual, list) and len(actual) == len(want), key
        for i, (a, w) in enumerate(zip(actual, want, strict=True)):
            assert_loaded(a, w, f"{key}/{i}")
    elif isinstance(want, jax.Array):
        assert actual.dtype == want.dtype, key
        np.testing.assert_array_equal(jax.random.key_data(actual), jax.random.key_data(want))
    elif isinstance(want, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == want.dtype, key
        np.testing.assert_array_equal(actual, want, err_msg=key)
    else:
        assert actual == want and type(actual) is type(want), key


def _structure(tree: Any) -> list[tuple[str, Any]]:
    out = []
    for key, leaf in lazyckpt.leaves(tree):
        if isinstance(leaf, LazyArray):
            out.append((key, (leaf.shape, str(leaf.dtype), leaf.key_impl)))
        else:
            out.append((key, leaf))
    return out


def _handler_save(**options: Any) -> Callable[[Path, Any], Path]:
    def save(path: Path, tree: Any) -> Path:
        import orbax.checkpoint as ocp

        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)) as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
        return path

    return save


def _chunked_save(zarr3: bool) -> Callable[[Path, Any], Path]:
    def save(path: Path, tree: Any) -> Path:
        import orbax.checkpoint as ocp

        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=512), tree)
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)) as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
        return path

    return save


def _standard_save(path: Path, tree: Any) -> Path:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
    return path


def _v1_save(path: Path, tree: Any) -> Path:
    import orbax.checkpoint as ocp

    ocp.v1.save(path, tree)
    return path


LAYOUTS: dict[str, Callable[[Path, Any], Path]] = {
    "ocdbt_zarr2": _handler_save(use_ocdbt=True, use_zarr3=False),
    "ocdbt_zarr3": _handler_save(use_ocdbt=True, use_zarr3=True),
    "folders_zarr2": _handler_save(use_ocdbt=False, use_zarr3=False),
    "folders_zarr3": _handler_save(use_ocdbt=False, use_zarr3=True),
    "uncompressed_folders": _handler_save(use_ocdbt=False, use_compression=False),
    "uncompressed_ocdbt_zarr3": _handler_save(use_zarr3=True, use_compression=False),
    "subchunked_zarr2": _chunked_save(zarr3=False),
    "subchunked_zarr3": _chunked_save(zarr3=True),
    "standard_checkpointer": _standard_save,
    "v1_api": _v1_save,
}


@pytest.fixture(scope="module")
def written(
    mesh: jax.sharding.Mesh, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, Path]]:
    tree = rich_tree(mesh)
    root = tmp_path_factory.mktemp("layouts")
    # StandardCheckpointer and v1 refuse strings and non-array scalars in the tree.
    array_tree = lazyckpt.select(tree, lambda _, v: isinstance(v, jax.Array | np.ndarray))
    paths = {}
    for name, save in LAYOUTS.items():
        saved = array_tree if name in ("standard_checkpointer", "v1_api") else tree
        paths[name] = save(root / name, saved)
    return tree, paths


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_opens_with_saved_values(
    written: tuple[dict[str, Any], dict[str, Path]], layout: str
) -> None:
    tree, paths = written
    if layout in ("standard_checkpointer", "v1_api"):
        tree = lazyckpt.select(tree, lambda _, v: isinstance(v, jax.Array | np.ndarray))
    assert_loaded(lazyckpt.load(lazyckpt.open(paths[layout])), expected(tree))


def test_same_structure_across_layouts(written: tuple[dict[str, Any], dict[str, Path]]) -> None:
    _, paths = written
    full = {name: _structure(lazyckpt.open(p)) for name, p in paths.items()}
    reference = full["ocdbt_zarr2"]
    for name, structure in full.items():
        if name in ("standard_checkpointer", "v1_api"):
            keys = {key for key, _ in structure}
            assert structure == [(k, v) for k, v in reference if k in keys], name
        else:
            assert structure == reference, name


def test_layout_specific_metadata(written: tuple[dict[str, Any], dict[str, Path]]) -> None:
    _, paths = written
    chunked = lazyckpt.open(paths["subchunked_zarr3"])["sharded"]
    assert chunked.chunks != lazyckpt.open(paths["ocdbt_zarr3"])["sharded"].chunks
    assert np.prod(chunked.chunks) * 4 <= 512
    assert lazyckpt.open(paths["folders_zarr2"])["sharded"].stored.store.ocdbt is False
    assert (paths["folders_zarr2"] / "a" / "b" / ".zarray").exists()  # '/' nests folders


def test_typed_prng_keys(written: tuple[dict[str, Any], dict[str, Path]], mesh: Any) -> None:
    tree, paths = written
    keys = lazyckpt.open(paths["ocdbt_zarr3"])["keys"]
    split = keys["split"]
    assert split.key_impl == "threefry2x32" and split.shape == (3,)
    assert split.dtype == tree["keys"]["split"].dtype and split.nbytes == 3 * 8
    assert "key<fry>" in repr(split)
    assert keys["raw"].key_impl is None and keys["raw"].dtype == np.uint32  # legacy raw keys
    np.testing.assert_array_equal(
        jax.random.key_data(split[1:].get()), jax.random.key_data(tree["keys"]["split"][1:])
    )
    placed = lazyckpt.device_put(split, NamedSharding(mesh, P()))
    assert placed.dtype == split.dtype
    np.testing.assert_array_equal(
        jax.random.key_data(placed), jax.random.key_data(tree["keys"]["split"])
    )
    assert jax.eval_shape(lambda k: jax.random.uniform(k[0]), split).shape == ()
    with pytest.raises(lazyckpt.LazyTypeError, match=r"keys/split: typed PRNG keys cannot be cast"):
        split.astype(np.float32)


def test_keys_without_array_metadatas_are_uint32(
    written: tuple[dict[str, Any], dict[str, Path]], tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(written[1]["ocdbt_zarr2"], copy)
    shutil.rmtree(copy / "array_metadatas")
    split = lazyckpt.open(copy)["keys"]["split"]
    assert split.key_impl is None and split.shape == (3, 2) and split.dtype == np.uint32


def test_bare_array_tree(tmp_path: Path, mesh: Any) -> None:
    value = jax.device_put(np.arange(16.0, dtype=np.float32), NamedSharding(mesh, P("x")))
    for ocdbt in (True, False):
        path = _handler_save(use_ocdbt=ocdbt)(tmp_path / f"bare_{ocdbt}", value)
        lazy = lazyckpt.open(path)
        assert isinstance(lazy, LazyArray) and lazy.path == () and lazy.key == ""
        np.testing.assert_array_equal(lazy.get(), np.asarray(value))
        assert lazy.sharding is not None and lazy.sharding.spec == P("x")


def test_per_process_databases_merged_by_orbax(tmp_path: Path, mesh: Any) -> None:
    """Two processes' databases (0 and 7) merged into the root, as a multi-host save."""
    import asyncio

    import orbax.checkpoint._src.serialization.ocdbt_utils as ocdbt_utils
    import tensorstore as ts

    big = np.arange(4096, dtype=np.float32).reshape(64, 64)
    first = orbax_save(tmp_path / "first", {"p0": big})
    second = orbax_save(tmp_path / "second", {"p7": big + 1})
    (second / "ocdbt.process_0").rename(first / "ocdbt.process_7")
    (first / "manifest.ocdbt").unlink()
    shutil.rmtree(first / "d")
    metadata = json.loads((first / "_METADATA").read_text())
    metadata["tree_metadata"].update(
        json.loads((second / "_METADATA").read_text())["tree_metadata"]
    )
    (first / "_METADATA").write_text(json.dumps(metadata))
    context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}})
    asyncio.run(ocdbt_utils.merge_ocdbt_per_process_files(first, context, use_zarr3=False))
    lazy = lazyckpt.open(first)
    np.testing.assert_array_equal(lazy["p0"].get(), big)
    np.testing.assert_array_equal(lazy["p7"][3].get(), big[3] + 1)


def test_steps_items_and_the_v1_layout(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    root = orbax_manager_save(
        tmp_path / "run",
        {
            step: {
                "state": ocp.args.StandardSave({"w": np.full(3, step, np.int32)}),
                "params": ocp.args.StandardSave({"p": np.zeros(2, np.float32)}),
            }
            for step in (5, 10)
        },
    )
    (root / "ckpt_000011.orbax-checkpoint-tmp").mkdir()
    assert lazyckpt.steps(root) == [5, 10]
    assert lazyckpt.items(root) == {"params": "pytree", "state": "pytree"}
    assert lazyckpt.items(root, step=5) == {"params": "pytree", "state": "pytree"}
    assert lazyckpt.open(root, step=5)["w"].get().tolist() == [5, 5, 5]  # `state` by default
    assert list(lazyckpt.open(root, item="params")) == ["p"]
    v1 = _v1_save(tmp_path / "v1", {"x": np.arange(3)})
    assert (v1 / "orbax.checkpoint").exists() and lazyckpt.items(v1) == {"state": "pytree"}
    assert lazyckpt.open(v1)["x"].get().tolist() == [0, 1, 2]
    # v1's JsonHandler writes <item>/data.json (spec §1.3), as in Orbax's own corpus.
    (v1 / "metadata").mkdir()
    (v1 / "metadata" / "data.json").write_text('{"metadata": "json_data"}')
    assert lazyckpt.items(v1) == {"metadata": "json", "state": "pytree"}
    assert lazyckpt.open(v1, item="metadata") == {"metadata": "json_data"}
    assert lazyckpt.open(v1)["x"].get().tolist() == [0, 1, 2]  # the PyTree stays the default
    with pytest.raises(lazyckpt.NotACheckpointError, match=r"is not a CheckpointManager root"):
        lazyckpt.steps(v1)
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match=r"has no item 'params'"):
        lazyckpt.open(v1 / "state", item="params")


@pytest.mark.parametrize("ocdbt", [True, False])
def test_structure_inferred_from_the_store_without_metadata(tmp_path: Path, ocdbt: bool) -> None:
    tree = {
        "params": {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int8)},
        "layers": [np.zeros(2, np.float32), np.ones(2, np.float32)],
        "step": np.array(4, np.int64),
    }
    path = _handler_save(use_ocdbt=ocdbt)(tmp_path / "ckpt", tree)
    (path / "_METADATA").unlink()
    with pytest.warns(
        lazyckpt.InferredStructureWarning,
        match=r"tree was inferred from array "
        r"names: lists come back as dicts",
    ):
        lazy = lazyckpt.open(path)
    # Lossy, as the spec says: the list becomes a dict keyed by index strings.
    want = {
        "layers": {"0": tree["layers"][0], "1": tree["layers"][1]},
        "params": tree["params"],
        "step": tree["step"],
    }
    assert_loaded(lazyckpt.load(lazy), want)


def test_saved_sharding_kinds(tmp_path: Path, mesh: Any) -> None:
    device = jax.devices()[2]
    tree = {
        "named": jax.device_put(np.arange(8.0), NamedSharding(mesh, P(("x", "y")))),
        "single": jax.device_put(np.arange(4.0), jax.sharding.SingleDeviceSharding(device)),
    }
    path = orbax_save(tmp_path / "ckpt", tree)
    lazy = lazyckpt.open(path)
    assert lazy["named"].sharding.partition_spec == (("x", "y"),)
    single = lazy["single"].sharding
    assert single.kind == "SingleDeviceSharding" and single.is_replicated
    assert single.device is not None and single.device.endswith(str(device.id))
    # Files from 2023-09 keyed entries by the raw name; PositionalSharding (2024) is
    # reported, not applied.
    table = json.loads((path / "_sharding").read_text())
    positional = json.dumps(
        {"sharding_type": "PositionalSharding", "shape": [8], "memory_kind": "device"}
    )
    (path / "_sharding").write_text(json.dumps({"named": positional, "single": ""}))
    lazy = lazyckpt.open(path)
    assert repr(lazy["named"].sharding) == "PositionalSharding(shape=(8,))"
    assert lazy["single"].sharding is None  # an empty entry means unknown
    assert len(table) == 2
