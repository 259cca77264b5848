"""Every layout orbax-checkpoint writes opens as the same lazy tree with the same values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt import LazyArray
from tests.helpers import (
    LAYOUTS,
    assert_loaded,
    expected,
    handler_save,
    orbax_manager_save,
    orbax_save,
    rich_tree,
    structure,
    v1_save,
)


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
    full = {name: structure(lazyckpt.open(p)) for name, p in paths.items()}
    reference = full["ocdbt_zarr2"]
    for name, found in full.items():
        if name in ("standard_checkpointer", "v1_api"):
            keys = {key for key, _ in found}
            assert found == [(k, v) for k, v in reference if k in keys], name
        else:
            assert found == reference, name


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


def test_iter_blocks_keeps_tree_order_around_typed_keys(tmp_path: Path) -> None:
    split = jax.random.split(jax.random.key(3), 2)
    saved = {
        "a": np.arange(6.0),
        "k": split,
        "m": np.ones((2, 3)),
        "z": jax.random.key(4),
    }
    lazy = lazyckpt.open(lazyckpt.save(tmp_path / "c", saved))
    blocks = list(lazyckpt.iter_blocks(lazy))
    assert [key for key, _, _ in blocks] == ["a", "k", "m", "z"]
    _, index, keys = blocks[1]
    assert index == (slice(0, 2),)
    np.testing.assert_array_equal(jax.random.key_data(keys), jax.random.key_data(split))


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
        path = handler_save(use_ocdbt=ocdbt)(tmp_path / f"bare_{ocdbt}", value)
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
    v1 = v1_save(tmp_path / "v1", {"x": np.arange(3)})
    assert (v1 / "orbax.checkpoint").exists() and lazyckpt.items(v1) == {"state": "pytree"}
    assert lazyckpt.open(v1)["x"].get().tolist() == [0, 1, 2]
    # v1's JsonHandler writes <item>/data.json (docs/format.md, Folders and levels), as in Orbax's own corpus.
    (v1 / "metadata").mkdir()
    (v1 / "metadata" / "data.json").write_text('{"metadata": "json_data"}')
    assert lazyckpt.items(v1) == {"metadata": "json", "state": "pytree"}
    assert lazyckpt.open(v1, item="metadata") == {"metadata": "json_data"}
    assert lazyckpt.open(v1)["x"].get().tolist() == [0, 1, 2]  # the PyTree stays the default
    with pytest.raises(
        lazyckpt.NotACheckpointError,
        match=r"v1 is not a CheckpointManager root: it has no committed step folders",
    ):
        lazyckpt.steps(v1)
    with pytest.raises(
        lazyckpt.NotACheckpointError,
        match=r"state is a PyTree checkpoint itself, not a step folder of items, so "
        r"item='params' cannot be chosen; open it without item=",
    ):
        lazyckpt.open(v1 / "state", item="params")


def test_steps_are_named_in_ascii_digits(tmp_path: Path) -> None:
    """Orbax names steps in ASCII digits: a copy of a step renamed `ckpt_\u0669` (an
    Arabic-Indic 9) or `ckpt_000009\\n` is no step 9 (each was the latest step)."""
    import orbax.checkpoint as ocp

    root = orbax_manager_save(
        tmp_path / "run",
        {step: {"state": ocp.args.StandardSave({"w": np.full(3, step)})} for step in (1, 2)},
    )
    for name in ("ckpt_\u0669", "ckpt_000009\n", "\u0669"):
        shutil.copytree(root / "ckpt_000002", root / name)
        assert lazyckpt.steps(root) == [1, 2], name
        assert lazyckpt.open(root)["w"].get().tolist() == [2, 2, 2]
        with pytest.raises(lazyckpt.CheckpointNotFoundError):
            lazyckpt.open(root, step=9)
        shutil.rmtree(root / name)


@pytest.mark.parametrize("ocdbt", [True, False])
def test_structure_inferred_from_the_store_without_metadata(tmp_path: Path, ocdbt: bool) -> None:
    tree: dict[str, Any] = {
        "params": {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int8)},
        "layers": [np.zeros(2, np.float32), np.ones(2, np.float32)],
        "step": np.array(4, np.int64),
    }
    path = handler_save(use_ocdbt=ocdbt)(tmp_path / "ckpt", tree)
    (path / "_METADATA").unlink()
    with pytest.warns(
        lazyckpt.InferredStructureWarning,
        match=r"tree was inferred from array "
        r"names: lists come back as dicts",
    ):
        lazy = lazyckpt.open(path)
    # Lossy, as docs/format.md says (Without metadata): the list becomes a dict keyed by index strings.
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
