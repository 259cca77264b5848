"""Leaves whose names collide once their keys are turned to text, in every format that
names leaves by nested keys: refused naming both, or (where one name nests inside the
other) read whole with `flat=True`, equal to the writer's own reader; never one left
out. The torch files were written by torch (`tests/fixtures/torch/make.py`,
`colliding`); the others are written here by numpy, flax and safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.serialization
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import lazyckpt
from tests.helpers import orbax_save

TORCH = Path(__file__).parent / "fixtures" / "torch"
RNG = np.random.default_rng(0)


def _flax_file(path: Path, tree: dict[Any, Any]) -> Path:
    # (in place: flax's copy of the tree first sorts its keys, which 1 and "1" refuse)
    path.write_bytes(flax.serialization.msgpack_serialize(tree, in_place=True))
    return path


def _same_bytes(got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        value = got[name].get()
        assert (value.shape, value.dtype, value.tobytes()) == (
            array.shape,
            array.dtype,
            array.tobytes(),
        ), name


@pytest.mark.parametrize("flat", [False, True], ids=["tree", "flat"])
def test_flax_keys_1_and_the_text_1_are_refused_naming_both(tmp_path: Path, flat: bool) -> None:
    tree: dict[Any, Any] = {"params": {1: RNG.standard_normal(3), "1": RNG.standard_normal(2)}}
    path = _flax_file(tmp_path / "keys.msgpack", tree)
    assert sorted(map(str, flax.serialization.msgpack_restore(path.read_bytes())["params"])) == [
        "1",
        "1",
    ]  # flax restores both
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError,
        match=r"keys\.msgpack: keys 1 \(int\) and '1' \(str\) of 'params' are both '1' as text",
    ):
        lazyckpt.open(path, flat=flat)


@pytest.mark.parametrize("flat", [False, True], ids=["tree", "flat"])
def test_torch_keys_1_and_the_text_1_are_refused_naming_both(flat: bool) -> None:
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError,
        match=r"keys_1\.pt: keys 1 \(int\) and '1' \(str\) at its top level are both '1'",
    ):
        lazyckpt.open(TORCH / "keys_1.pt", flat=flat)


@pytest.mark.parametrize("flat", [False, True], ids=["tree", "flat"])
def test_a_key_with_a_slash_and_nested_keys_of_one_name_are_refused(
    tmp_path: Path, flat: bool
) -> None:
    # Equal values too: two leaves, not one (they were one leaf, flat, by identity).
    path = _flax_file(tmp_path / "spelled.msgpack", {"x/y": 1, "x": {"y": 1}})
    with pytest.raises(lazyckpt.UnsupportedCheckpointError, match=r"two leaves are named 'x/y'"):
        lazyckpt.open(path, flat=flat)


def test_flax_keys_that_only_look_nested_read_as_flax_restores_them(tmp_path: Path) -> None:
    # "a" and "a/b" are two keys of one map: no clash, in the tree or flat.
    tree = {"a": RNG.standard_normal(3), "a/b": RNG.standard_normal((2, 2)).astype("f4")}
    path = _flax_file(tmp_path / "flax_model.msgpack", tree)
    restored = flax.serialization.msgpack_restore(path.read_bytes())
    _same_bytes(lazyckpt.open(path), restored)
    _same_bytes(lazyckpt.open(path, flat=True), restored)


def _nested_names(tmp_path: Path, form: str) -> tuple[Path, dict[str, np.ndarray], str]:
    """A file holding `a` and a name nested under it, its writer's own reading, and
    that name."""
    if form == "torch":
        path = TORCH / "keys_nested.pt"
        return path, dict(np.load(TORCH / "keys_nested_expected.npz")), "a.b"
    values = {"a": RNG.standard_normal(3), "b": RNG.standard_normal((2, 2)).astype("f2")}
    if form == "safetensors":
        path = tmp_path / "model.safetensors"
        save_file({"a": values["a"], "a.b": values["b"]}, str(path))
        return path, load_file(path), "a.b"
    path = tmp_path / "params.npz"
    members: dict[str, Any] = {"a": values["a"], "a/b": values["b"]}
    np.savez(path, **members)
    return path, dict(np.load(path)), "a/b"


@pytest.mark.parametrize("form", ["torch", "safetensors", "npz"])
def test_a_name_nested_under_another_is_refused_as_a_tree_and_reads_flat(
    tmp_path: Path, form: str
) -> None:
    path, want, inner = _nested_names(tmp_path, form)
    assert sorted(want) == ["a", inner]
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError,
        match=rf"names '{inner[0]}' and '{inner}' cannot both be nested .*flat=True",
    ):
        lazyckpt.open(path)
    _same_bytes(lazyckpt.open(path, flat=True), want)


def test_an_orbax_tree_of_a_slashed_key_beside_a_nested_one(tmp_path: Path) -> None:
    """Orbax keeps a key holding '/' beside the same path nested: open keeps both in
    their subtrees, and a flat dict, which could hold one, is refused naming the path."""
    x, y = np.arange(3, dtype=np.float32), np.arange(4, dtype=np.int32)
    path = orbax_save(tmp_path / "ckpt", {"a/b": x, "a": {"b": y}})
    tree = lazyckpt.open(path)
    assert np.array_equal(tree["a/b"].get(), x)
    assert np.array_equal(tree["a"]["b"].get(), y)
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError, match=r"two leaves have the key path 'a/b'"
    ):
        lazyckpt.open(path, flat=True)
