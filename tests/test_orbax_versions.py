"""Checkpoints written by past orbax-checkpoint releases, read as users have them on disk.

`tests/fixtures/orbax_versions/<orbax version>/` holds what each release wrote with its
usual APIs (`make_fixtures.py`, run in a virtual environment per release; README.md
names the versions): PyTree saves with and without OCDBT, zarr3, `StandardCheckpointer`
and a `CheckpointManager` root, and `expected.json`/`expected.npz`, what that release's
own restore gave back. lazyckpt must give the same tree, the same bits and the saved
shardings, without orbax.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from lazyckpt import LazyArray

FIXTURES = Path(__file__).parent / "fixtures" / "orbax_versions"
VERSIONS = sorted(
    (p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file()),
    key=lambda v: tuple(int(n) for n in v.split(".")),
)
EXPECTED = {v: json.loads((FIXTURES / v / "expected.json").read_text()) for v in VERSIONS}
CASES = [
    pytest.param(version, name, id=f"{version}-{name}")
    for version in VERSIONS
    for name in EXPECTED[version]["fixtures"]
]


def _bits(version: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / version / "expected.npz") as npz:
        return {name: npz[name] for name in npz.files}


def _as_bits(value: Any) -> np.ndarray:
    value = np.asarray(value)
    return value.view(f"u{value.dtype.itemsize}") if value.dtype.kind != "b" else value


def _check_tree(found: Any, record: Any, bits: dict[str, np.ndarray], path: str) -> None:
    """`found` (lazy, or loaded with `load`) against what orbax restored (`record`)."""
    (kind, value), *_ = record.items()
    where = path or "the root"
    if kind == "dict":
        assert isinstance(found, dict) and sorted(found) == sorted(value), where
        for key, child in value.items():
            _check_tree(found[key], child, bits, f"{path}/{key}")
    elif kind in ("list", "tuple"):
        assert type(found).__name__ == kind and len(found) == len(value), where
        for i, child in enumerate(value):
            _check_tree(found[i], child, bits, f"{path}/{i}")
    elif kind == "none":
        assert found is None, where
    elif kind == "python":
        assert type(found).__name__ == value and found == record["value"], where
        if value == "float":  # the same double, bit for bit
            assert struct.pack("<d", found) == struct.pack("<d", record["value"]), where
    else:
        if record["type"] not in ("ndarray", "jax.Array"):  # a NumPy scalar, kept as one
            assert type(found).__name__ == record["type"], where
        array = found.get() if isinstance(found, LazyArray) else found
        assert np.asarray(array).dtype.name == record["dtype"], where
        assert list(np.shape(array)) == record["shape"], where
        np.testing.assert_array_equal(_as_bits(array), bits[record["array"]], err_msg=where)


def _check_sharding(lazy: LazyArray, record: dict[str, Any], path: str) -> None:
    saved = record.get("sharding")
    if saved is None:  # a NumPy array: orbax records no sharding
        assert lazy.sharding is None, path
    elif "kind" in saved:
        assert lazy.sharding is not None and lazy.sharding.kind == saved["kind"], path
    else:
        assert lazy.sharding is not None and lazy.sharding.kind == "NamedSharding", path
        assert list(lazy.sharding.mesh_shape) == saved["mesh_shape"], path
        assert list(lazy.sharding.axis_names) == saved["axis_names"], path
        spec = [list(e) if isinstance(e, tuple) else e for e in lazy.sharding.partition_spec]
        assert spec == saved["spec"], path


def _arrays(record: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Each array leaf of `record` (a LazyArray in lazyckpt's tree) with its key path,
    `a/0/b`."""
    (kind, value), *_ = record.items()
    if kind == "dict":
        return [a for k, v in value.items() for a in _arrays(v, f"{path}/{k}")]
    if kind in ("list", "tuple"):
        return [a for i, v in enumerate(value) for a in _arrays(v, f"{path}/{i}")]
    lazy = record.get("type") in ("ndarray", "jax.Array")
    return [(path.lstrip("/"), record)] if lazy else []


def _leaf(tree: Any, path: str) -> Any:
    for key in path.split("/"):
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
    return tree


def test_fixtures_cover_the_releases() -> None:
    """Each folder names the release that wrote it; the spread is 2023 to 2025."""
    for version in VERSIONS:
        assert EXPECTED[version]["versions"]["orbax-checkpoint"] == version
    assert {"0.4.8", "0.5.20", "0.6.4", "0.9.1", "0.10.3", "0.11.13"} <= set(VERSIONS)
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 2_500_000


@pytest.mark.parametrize(("version", "name"), CASES)
def test_lazy_tree_and_get_match_orbax_restore(version: str, name: str) -> None:
    record = EXPECTED[version]["fixtures"][name]["restored"]
    lazy = lazyckpt.open(FIXTURES / version / name)
    _check_tree(lazy, record, _bits(version), "")
    for path, leaf in _arrays(record):
        assert isinstance(_leaf(lazy, path), LazyArray), path
        _check_sharding(_leaf(lazy, path), leaf, path)


@pytest.mark.parametrize(("version", "name"), CASES)
def test_load_matches_orbax_restore(version: str, name: str) -> None:
    record = EXPECTED[version]["fixtures"][name]["restored"]
    loaded = lazyckpt.load(lazyckpt.open(FIXTURES / version / name))
    _check_tree(loaded, record, _bits(version), "")


@pytest.mark.parametrize(("version", "name"), CASES)
def test_partial_reads(version: str, name: str) -> None:
    """One row, a strided block and one element of each array, bit for bit."""
    record = EXPECTED[version]["fixtures"][name]["restored"]
    bits = _bits(version)
    lazy = lazyckpt.open(FIXTURES / version / name)
    for path, leaf in _arrays(record):
        array, want = _leaf(lazy, path), bits[leaf["array"]]
        if array.ndim == 0:
            np.testing.assert_array_equal(_as_bits(array[()].get()), want, err_msg=path)
            continue
        row = array.shape[0] // 2
        np.testing.assert_array_equal(_as_bits(array[row].get()), want[row], err_msg=path)
        np.testing.assert_array_equal(_as_bits(array[1::3].get()), want[1::3], err_msg=path)
        last = tuple(n - 1 for n in array.shape)
        np.testing.assert_array_equal(_as_bits(array[last].get()), want[last], err_msg=path)


@pytest.mark.parametrize(("version", "name"), CASES)
def test_summary_lists_every_leaf(version: str, name: str) -> None:
    record = EXPECTED[version]["fixtures"][name]["restored"]
    shown = str(lazyckpt.summary(lazyckpt.open(FIXTURES / version / name), fold=False))
    for path, leaf in _arrays(record):
        dims = ",".join(map(str, leaf["shape"]))
        assert path.rpartition("/")[2] in shown and f"{leaf['dtype']}[{dims}]" in shown, path
    assert "P('x', 'y')" in shown and "mesh x=4 y=2" in shown


@pytest.mark.parametrize("version", VERSIONS)
def test_manager_root_and_steps(version: str) -> None:
    """A `CheckpointManager` root opens its latest step; a step folder, its item."""
    root = FIXTURES / version / "manager"
    record = EXPECTED[version]["fixtures"]["manager"]["restored"]
    bits = _bits(version)
    for folder in (root, root / "1", root / "2", root / "2" / "state"):
        _check_tree(lazyckpt.load(lazyckpt.open(folder)), record, bits, str(folder))


def _copy(version: str, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / version / name, tmp_path / name))


@pytest.mark.parametrize("version", VERSIONS)
def test_damaged_metadata_names_the_file(version: str, tmp_path: Path) -> None:
    folder = _copy(version, "pytree_ocdbt", tmp_path)
    (folder / "_METADATA").write_text((folder / "_METADATA").read_text()[:200])
    with pytest.raises(lazyckpt.LazyckptError, match=r"_METADATA"):
        lazyckpt.open(folder)


@pytest.mark.parametrize("version", VERSIONS)
def test_damaged_zarr_chunk_names_the_array(version: str, tmp_path: Path) -> None:
    folder = _copy(version, "pytree_zarr2", tmp_path)
    chunk = folder / "params.dense.kernel" / "0.0"
    chunk.write_bytes(chunk.read_bytes()[:20])
    lazy = lazyckpt.open(folder)
    with pytest.raises(lazyckpt.LazyckptError, match=r"params/dense/kernel"):
        lazy["params"]["dense"]["kernel"][0].get()
    with pytest.raises(lazyckpt.LazyckptError, match=r"params/dense/kernel"):
        lazyckpt.load(lazy)


@pytest.mark.parametrize("version", VERSIONS)
def test_damaged_zarray_names_the_array(version: str, tmp_path: Path) -> None:
    folder = _copy(version, "pytree_zarr2", tmp_path)
    (folder / "params.dense.kernel" / ".zarray").write_text("{not json")
    with pytest.raises(lazyckpt.LazyckptError, match=r"params.dense.kernel"):
        lazyckpt.load(lazyckpt.open(folder))


@pytest.mark.parametrize("version", VERSIONS)
def test_missing_ocdbt_data_file_names_the_array(version: str, tmp_path: Path) -> None:
    folder = _copy(version, "pytree_ocdbt", tmp_path)
    for data in [*folder.glob("d/*"), *folder.glob("ocdbt.process_*/d/*")]:
        data.unlink()
    with pytest.raises(lazyckpt.LazyckptError):
        lazyckpt.load(lazyckpt.open(folder))


@pytest.mark.parametrize("version", ["0.4.8", "0.5.20"])
def test_aggregated_numpy_scalars_keep_their_dtype(version: str) -> None:
    """Releases that honour `aggregate=True` keep NumPy scalars in the msgpack file;
    Orbax restores them as NumPy scalars, float32 stays float32 (it once became a
    Python float, another value)."""
    lazy = lazyckpt.open(FIXTURES / version / "aggregated")
    betas = lazy["opt_state"]["betas"]
    assert [type(b) for b in betas] == [np.float32, np.float32]
    assert betas == [np.float32(0.9), np.float32(0.999)]
    assert isinstance(lazy["ema"], LazyArray) and lazy["ema"].sharding is None
