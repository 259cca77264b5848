"""Legacy layouts current orbax no longer writes, built by hand as docs/format.md describes them.

- orbax <= 0.2 (2023): no `_METADATA`; the msgpack `checkpoint` file holds the tree,
  with `PLACEHOLDER://<name>` where the value is a zarr array folder (or a string in
  `_strings.json`), and aggregated values inline.
- `aggregate_all` / `aggregate_some`: `_METADATA` marks leaves `skip_deserialize`
  whose values live in the msgpack file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import tensorstore as ts

import lazyckpt
from lazyckpt import LazyArray
from lazyckpt._engine.stored import stored_array
from tests.helpers import assert_loaded, expected, orbax_save, structure


def _ext_array(value: np.ndarray, code: int = 1) -> msgpack.ExtType:
    """An ndarray (code 1) or numpy scalar (code 3) the way flax serializes it."""
    payload = msgpack.packb([list(value.shape), value.dtype.name, value.tobytes()])
    return msgpack.ExtType(code, payload)


def _zarr2_folder(item: Path, name: str, value: np.ndarray) -> None:
    """A non-OCDBT zarr v2 array folder as orbax 0.2 wrote it (docs/format.md, Arrays)."""
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": f"{item}/{name}/"},
        "metadata": {
            "compressor": {"id": "zstd", "level": 1},
            "shape": list(value.shape),
            "chunks": [max(1, n // 2) for n in value.shape],
        },
        "dtype": ts.dtype(value.dtype).name,
        "create": True,
    }
    ts.open(spec).result().write(value).result()


def _legacy_checkpoint(item: Path, tree: dict[str, Any], aggregated: set[str]) -> Path:
    """`tree` saved the orbax 0.2 way: arrays in folders unless `aggregated`, strings in
    `_strings.json`, Python scalars inline in the msgpack tree."""
    item.mkdir(parents=True)
    strings: dict[str, str] = {}

    def encode(node: Any, path: tuple[str, ...]) -> Any:
        name = ".".join(path)
        if isinstance(node, dict):
            return {str(k): encode(v, (*path, str(k))) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [encode(v, (*path, str(i))) for i, v in enumerate(node)]
        if isinstance(node, np.ndarray):
            if name in aggregated:
                return _ext_array(node)
            _zarr2_folder(item, name, node)
            return f"PLACEHOLDER://{name}"
        if isinstance(node, np.generic):
            return _ext_array(np.asarray(node), code=3)
        if isinstance(node, complex):
            return msgpack.ExtType(2, msgpack.packb([node.real, node.imag]))
        if isinstance(node, str) and name not in aggregated:
            strings[name] = node
            return f"PLACEHOLDER://{name}"
        return node

    (item / "checkpoint").write_bytes(msgpack.packb(encode(tree, ())))
    if strings:
        (item / "_strings.json").write_text(json.dumps(strings))
    return item


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(5)
    return {
        "params": {
            "w": rng.standard_normal((8, 6), dtype=np.float32),
            "b": np.arange(6, dtype=np.int8),
            "embed": rng.standard_normal((10, 4)).astype(np.float16),
        },
        "layers": [np.ones(3, np.float32), np.full(3, 2, np.float32)],
        "step": 12,
        "lr": 0.5,
        "name": "legacy run",
        "empty": {},
        "nothing": None,
    }


def test_msgpack_with_placeholders_and_no_metadata(tmp_path: Path) -> None:
    tree = _tree()
    item = _legacy_checkpoint(tmp_path / "ckpt", tree, aggregated={"params.embed"})
    lazy = lazyckpt.open(item)
    assert isinstance(lazy["params"]["w"], LazyArray) and lazy["params"]["w"].chunks == (4, 3)
    embed = lazy["params"]["embed"]  # aggregated: its values sit in the msgpack file
    assert isinstance(embed, LazyArray) and embed.shape == (10, 4) and embed.dtype == np.float16
    np.testing.assert_array_equal(embed[2:5, ::-1].get(), tree["params"]["embed"][2:5, ::-1])
    assert lazy["name"] == "legacy run" and lazy["step"] == 12 and lazy["nothing"] is None
    assert_loaded(lazyckpt.load(lazy), expected(tree))


def test_legacy_structure_equals_orbax_written_structure(tmp_path: Path) -> None:
    tree = _tree()
    legacy = _legacy_checkpoint(tmp_path / "legacy", tree, aggregated=set())
    current = orbax_save(tmp_path / "current", tree)
    assert structure(lazyckpt.open(legacy)) == structure(lazyckpt.open(current))


def test_inline_numpy_scalars_complex_and_empty_values(tmp_path: Path) -> None:
    tree = {"i8": np.int8(-3), "c": 1.5 - 2j, "agg": "inline string", "lst": [None, [], {}]}
    lazy = lazyckpt.open(_legacy_checkpoint(tmp_path / "ckpt", tree, aggregated={"agg"}))
    assert (
        lazy["i8"] == np.int8(-3) and type(lazy["i8"]) is np.int8
    )  # numpy type kept (docs/format.md, Legacy msgpack)
    assert lazy["c"] == 1.5 - 2j
    assert lazy["agg"] == "inline string"
    assert lazy["lst"] == [None, [], {}]


def _aggregate_checkpoint(item: Path, aggregated: set[str]) -> dict[str, Any]:
    """`_METADATA` + msgpack, as orbax's own testdata `aggregate_{all,some}`."""
    values: dict[str, Any] = {
        "a": np.arange(8, dtype=np.int32),
        "b": np.ones((2, 3), np.float32),
        "c": {"d": np.float64(2.5), "e": "text", "f": np.arange(4, dtype=np.uint8)},
    }
    types = {
        "a": "np.ndarray",
        "b": "np.ndarray",
        "c.d": "scalar",
        "c.e": "string",
        "c.f": "np.ndarray",
    }
    item.mkdir(parents=True)
    tree_metadata = {}
    packed: dict[str, Any] = {"c": {}}
    for name, value_type in types.items():
        keys = name.split(".")
        skip = name in aggregated
        tree_metadata[str(tuple(keys))] = {
            "key_metadata": [{"key": k, "key_type": 2} for k in keys],
            "value_metadata": {"value_type": value_type, "skip_deserialize": skip},
        }
        value = values[keys[0]] if len(keys) == 1 else values["c"][keys[1]]
        if skip:
            encoded = value if isinstance(value, str) else _ext_array(np.asarray(value))
        elif isinstance(value, str):
            (item / "_strings.json").write_text(json.dumps({name: value}))
            encoded = f"PLACEHOLDER://{name}"
        else:
            _zarr2_folder(item, name, np.asarray(value))
            encoded = f"PLACEHOLDER://{name}"
        (packed if len(keys) == 1 else packed["c"])[keys[-1]] = encoded
    (item / "_METADATA").write_text(json.dumps({"tree_metadata": tree_metadata}))
    (item / "checkpoint").write_bytes(msgpack.packb(packed))
    return values


@pytest.mark.parametrize(
    "aggregated",
    [{"a", "b", "c.d", "c.e", "c.f"}, {"c.d", "c.e", "c.f"}],
    ids=["aggregate_all", "aggregate_some"],
)
def test_metadata_with_values_in_msgpack(tmp_path: Path, aggregated: set[str]) -> None:
    values = _aggregate_checkpoint(tmp_path / "ckpt", aggregated)
    lazy = lazyckpt.open(tmp_path / "ckpt")
    assert isinstance(lazy["a"], LazyArray) and isinstance(lazy["c"]["f"], LazyArray)
    assert (
        stored_array(lazy["a"]).inline is not None
        if "a" in aggregated
        else lazy["a"].chunks == (4,)
    )
    np.testing.assert_array_equal(lazy["a"][::3].get(), values["a"][::3])
    assert_loaded(lazyckpt.load(lazy), expected(values))


def test_metadata_pointing_into_a_missing_msgpack_file(tmp_path: Path) -> None:
    _aggregate_checkpoint(tmp_path / "ckpt", {"c.d", "c.e", "c.f"})
    (tmp_path / "ckpt" / "checkpoint").unlink()
    with pytest.raises(
        lazyckpt.CorruptCheckpointError,
        match=r"_METADATA says some leaves are "
        r"stored in the msgpack 'checkpoint' file, but that file is missing",
    ):
        lazyckpt.open(tmp_path / "ckpt")


def test_damaged_msgpack_file(tmp_path: Path) -> None:
    item = _legacy_checkpoint(tmp_path / "ckpt", _tree(), aggregated=set())
    data = (item / "checkpoint").read_bytes()
    (item / "checkpoint").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        lazyckpt.CorruptCheckpointError,
        match=r"ckpt/checkpoint: msgpack data is truncated at byte \d+",
    ):
        lazyckpt.open(item)
