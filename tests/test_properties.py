"""Property tests: random arrays saved by orbax, indexed and cast lazily, equal NumPy."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lazyckpt
from tests import strategies
from tests.helpers import orbax_save


def basic_indices(shape: tuple[int, ...]) -> st.SearchStrategy[Any]:
    """NumPy's basic indices into `shape`, newaxis and ellipsis included."""
    return hnp.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True)


@pytest.fixture(scope="module")
def zoo(mesh: jax.sharding.Mesh, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Arrays of many shapes, dtypes and shardings, saved once in each zarr format."""
    rng = np.random.default_rng(7)
    specs: dict[str, tuple[tuple[int, ...], npt.DTypeLike, tuple[str | None, ...]]] = {
        "f32": ((8, 12, 6), np.float32, ("x", None, "y")),
        "bf16": ((16, 4), np.dtype("bfloat16"), ("y", "x")),
        "i8": ((9, 10), np.int8, (None, "y")),
        "bool": ((4, 8), np.bool_, ("x", None)),
        "u8": ((30,), np.uint8, (None,)),
        "scalar": ((), np.float32, ()),
    }
    tree = {}
    for name, (shape, dtype, spec) in specs.items():
        value = strategies.values(shape, np.dtype(dtype), int(rng.integers(1 << 31)))
        tree[name] = jax.device_put(
            value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        )
    root = tmp_path_factory.mktemp("zoo")
    opened = {}
    for zarr3 in (False, True):
        path = orbax_save(root / f"zarr3_{zarr3}", tree, zarr3=zarr3)
        opened[zarr3] = lazyckpt.open(path)
    return {"expected": {k: np.asarray(v) for k, v in tree.items()}, "opened": opened}


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_chained_basic_indexing_matches_numpy(zoo: dict[str, Any], data: st.DataObject) -> None:
    # Every choice is drawn before lazyckpt runs: with draws between reads, a clean
    # install (ml_dtypes 0.7) made hypothesis report "inconsistent data generation"
    # every run (the same choices drew different indices); the cause was not found.
    name = data.draw(st.sampled_from(sorted(zoo["expected"])))
    zarr3 = data.draw(st.booleans())
    indices, shaped = [], zoo["expected"][name]
    for _ in range(data.draw(st.integers(1, 3))):
        indices.append(data.draw(basic_indices(shaped.shape)))
        shaped = shaped[indices[-1]]
    cast = data.draw(st.none() | st.sampled_from(strategies.DTYPES))
    lazy, want = zoo["opened"][zarr3][name], zoo["expected"][name]
    for index in indices:
        lazy, want = lazy[index], want[index]
        assert lazy.shape == want.shape
    if cast is not None and not (want.dtype.kind == "c" and cast.kind != "c"):
        lazy, want = lazy.astype(cast), want.astype(cast)
    got = lazy.get()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_random_arrays_round_trip(
    mesh: jax.sharding.Mesh, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    leaves = data.draw(st.lists(strategies.saved_arrays(mesh), min_size=1, max_size=4))
    zarr3 = data.draw(st.booleans())
    # Drawn before anything is saved or read (see the test above).
    indices = [data.draw(basic_indices(value.shape)) for value, _ in leaves]
    specs = [data.draw(strategies.partition_specs(value.shape)) for value, _ in leaves]
    tree = {f"a{i}": saved for i, (_, saved) in enumerate(leaves)}
    path = orbax_save(tmp_path_factory.mktemp("round-trip") / "ckpt", tree, zarr3=zarr3)
    lazy = lazyckpt.open(path)
    for i, (value, _) in enumerate(leaves):
        array = lazy[f"a{i}"]
        assert (array.shape, array.dtype) == (value.shape, value.dtype)
        np.testing.assert_array_equal(array[indices[i]].get(), value[indices[i]])
        placed = lazyckpt.device_put(array, jax.sharding.NamedSharding(mesh, specs[i]))
        np.testing.assert_array_equal(np.asarray(placed), value)
