"""`open` builds the saved tree from metadata alone; `get` returns the saved values."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import lazyckpt
from lazyckpt import LazyArray
from lazyckpt._engine.stored import stored_array
from tests.helpers import assert_tree_equal, host_value


def test_tree_structure_and_leaf_kinds(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    assert sorted(lazy) == sorted(tree)
    assert isinstance(lazy["params"]["dense"]["kernel"], LazyArray)
    assert isinstance(lazy["params"]["layers"], list) and len(lazy["params"]["layers"]) == 2
    assert isinstance(lazy["np_array"], LazyArray)
    assert isinstance(lazy["scalar_array"], LazyArray) and lazy["scalar_array"].shape == ()
    # Python scalars and strings come back as their values.
    assert lazy["step"] == 7 and type(lazy["step"]) is int
    assert lazy["lr"] == 0.25 and type(lazy["lr"]) is float
    assert lazy["name"] == "run-1"
    assert lazy["empty"] == {} and lazy["nothing"] is None


def test_metadata_matches_saved_arrays(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    for key, want in lazyckpt.leaves(tree):
        if not isinstance(want, np.ndarray | jax.Array):
            continue
        got = dict(lazyckpt.leaves(lazy))[key]
        assert got.key == key
        assert got.shape == want.shape and got.ndim == want.ndim and got.size == want.size
        assert got.dtype == want.dtype
        assert got.nbytes == np.asarray(want).nbytes


def test_chunks_match_tensorstore_and_shards(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    driver = "zarr3" if "zarr3" in str(path) else "zarr"
    for key, leaf in lazyckpt.leaves(lazy):
        if not isinstance(leaf, LazyArray):
            continue
        spec = {
            "driver": driver,
            "kvstore": {
                "driver": "ocdbt",
                "base": f"file://{path}/",
                "path": f"{stored_array(leaf).name}/",
            },
        }
        opened = ts.open(spec, open=True).result()
        assert leaf.chunks == tuple(opened.chunk_layout.read_chunk_template.shape), key
    # A sharded array's chunks tile its saved shards (orbax may split them further
    # among replicas).
    kernel = lazy["params"]["dense"]["kernel"]
    shard = tree["params"]["dense"]["kernel"].sharding.shard_shape(kernel.shape)
    assert all(s % c == 0 for s, c in zip(shard, kernel.chunks, strict=True))


def test_saved_sharding_describes_mesh_and_spec(saved: tuple[Path, dict[str, Any]]) -> None:
    lazy = lazyckpt.open(saved[0])
    kernel = lazy["params"]["dense"]["kernel"].sharding
    assert kernel.kind == "NamedSharding"
    assert kernel.mesh_axes == {"x": 4, "y": 2}
    assert kernel.spec == jax.sharding.PartitionSpec("x", "y")
    assert kernel.device_ids == tuple(range(8))
    assert not kernel.is_replicated
    assert lazy["opt_state"]["mu"].sharding.is_replicated
    assert lazy["opt_state"]["mask"].sharding.partition_spec == (None, ("x", "y"))
    assert lazy["np_array"].sharding is None  # numpy arrays have no saved sharding
    assert repr(kernel) == "NamedSharding(mesh={'x': 4, 'y': 2}, spec=P('x', 'y'))"


def test_get_returns_saved_values(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    for key, want in lazyckpt.leaves(tree):
        got = dict(lazyckpt.leaves(lazy))[key]
        if isinstance(got, LazyArray):
            value = got.get()
            assert isinstance(value, np.ndarray)
            assert value.dtype == np.asarray(want).dtype
            np.testing.assert_array_equal(value, np.asarray(want), err_msg=key)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=key)


def test_load_returns_the_whole_tree(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    loaded = lazyckpt.load(lazyckpt.open(path))
    expected = jax.tree.map(host_value, tree)
    assert_tree_equal(loaded, expected)
    assert loaded["empty"] == {} and loaded["nothing"] is None


def test_get_async_shares_the_read_path(saved: tuple[Path, dict[str, Any]]) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)

    async def both() -> list[np.ndarray]:
        return await asyncio.gather(
            lazy["params"]["dense"]["kernel"][2:5].get_async(),
            lazy["params"]["embed"].astype(np.float32).get_async(),
        )

    kernel, embed = asyncio.run(both())
    np.testing.assert_array_equal(kernel, np.asarray(tree["params"]["dense"]["kernel"])[2:5])
    np.testing.assert_array_equal(embed, np.asarray(tree["params"]["embed"]).astype(np.float32))


def test_open_and_inspection_read_no_array_data(
    saved: tuple[Path, dict[str, Any]], no_data_reads: None
) -> None:
    tree = saved[1]
    without_scalars = {k: v for k, v in tree.items() if k not in ("step", "lr")}
    path = saved[0].parent / "no_scalars"
    if not path.exists():
        from tests.helpers import orbax_save

        orbax_save(path, without_scalars, zarr3="zarr3" in str(saved[0]))
    lazy = lazyckpt.open(path)
    kernel = lazy["params"]["dense"]["kernel"]
    _ = (kernel.shape, kernel.dtype, kernel.chunks, kernel.sharding, kernel.nbytes, repr(lazy))
    view = kernel[1:, ::2][None, ..., 0].astype(jnp.bfloat16)
    assert view.shape == (1, 63)
    assert jax.eval_shape(lambda k: (k @ k.T).sum(), kernel).shape == ()
    # Lowering needs shardings on this process's devices: said so, not jax's AttributeError.
    assert kernel.sharding is not None
    with pytest.raises(lazyckpt.LazyTypeError, match=r"jax\.jit\(f\)\.lower cannot take a"):
        jax.jit(lambda k: k.sum()).lower(kernel)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(lazyckpt.LazyTypeError, match=r"jax\.jit\(f\)\.lower cannot take a"):
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        jax.jit(lambda k: k.sum(), in_shardings=replicated).lower(kernel)
    assert not hasattr(kernel.sharding, "_device_assignment")  # (as tools probe it)


def test_open_reads_no_chunk_bytes(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, count_bytes: Any
) -> None:
    tree = {k: v for k, v in saved[1].items() if k not in ("step", "lr")}
    from tests.helpers import orbax_save

    path = orbax_save(tmp_path / "ckpt", tree, zarr3="zarr3" in str(saved[0]))
    chunk_data = _process_data_bytes(path)
    with count_bytes() as opened:
        lazy = lazyckpt.open(path)
    with count_bytes() as inspected:
        for _, leaf in lazyckpt.leaves(lazy):
            if isinstance(leaf, LazyArray):
                _ = (leaf.shape, leaf.dtype, leaf.chunks, leaf.sharding, repr(leaf))
                _ = leaf[None, ..., ::-1].astype(np.float32) if leaf.ndim else leaf[None]
        jax.eval_shape(lambda p: p["dense"]["kernel"] * 2, lazy["params"])
    # Metadata lives in the root b-tree; chunk data in ocdbt.process_0/d/ files.
    root_btree = sum(f.stat().st_size for f in (path / "d").iterdir())
    assert 0 < opened[0] <= root_btree + (path / "manifest.ocdbt").stat().st_size
    assert inspected[0] == 0
    assert chunk_data > opened[0]


def _process_data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("ocdbt.process_*/d/*"))


def test_arrays_are_opened_with_one_batched_metadata_read(saved: tuple[Path, Any]) -> None:
    """Opening does not open a TensorStore per array; arrays open on first read."""
    lazy = lazyckpt.open(saved[0])
    arrays = [leaf for _, leaf in lazyckpt.leaves(lazy) if isinstance(leaf, LazyArray)]
    assert all(stored_array(a)._opened is None for a in arrays)
    arrays[0].get()
    assert stored_array(arrays[0])._opened is not None
    assert stored_array(arrays[1])._opened is None


def test_an_array_opened_by_threads_at_once_is_opened_once(saved: tuple[Path, Any]) -> None:
    """Arrays share 64 locks for their first open: each still opens once, whichever
    thread comes first, and every caller gets that one future."""
    lazy = lazyckpt.open(saved[0])
    stored = [
        stored_array(leaf) for _, leaf in lazyckpt.leaves(lazy) if isinstance(leaf, LazyArray)
    ]
    start = threading.Barrier(8)

    def open_all(_: int) -> list[object]:
        start.wait()
        return [array.open() for array in stored]

    with ThreadPoolExecutor(8) as pool:
        opened = list(pool.map(open_all, range(8)))
    assert stored
    for i, array in enumerate(stored):
        assert array._opened is not None
        assert all(futures[i] is array._opened for futures in opened)
    assert_tree_equal(lazyckpt.load(lazy), jax.tree.map(host_value, saved[1]))


def test_lazy_array_is_a_jax_leaf_and_frozen(saved: tuple[Path, Any]) -> None:
    lazy = lazyckpt.open(saved[0])
    kernel = lazy["params"]["dense"]["kernel"]
    assert isinstance(kernel, LazyArray)
    assert jax.tree.leaves({"k": kernel}) == [kernel]
    with pytest.raises(AttributeError):
        kernel.dtype = np.dtype(np.int8)  # type: ignore[misc]
    assert kernel[:2] == kernel[:2] and kernel[:2] != kernel[:3]
    # The same path in another opening of the checkpoint is another array.
    assert lazyckpt.open(saved[0])["params"]["dense"]["kernel"] != kernel
    assert len({kernel, kernel[:], kernel[:2]}) == 2


def test_zarr_driver_matches_saved_format(saved: tuple[Path, Any]) -> None:
    lazy = lazyckpt.open(saved[0])
    expected = "zarr3" if "zarr3" in str(saved[0]) else "zarr"
    assert lazy["params"]["dense"]["kernel"].stored.driver == expected
    assert isinstance(lazy["params"]["dense"]["kernel"].read(), ts.Future)
