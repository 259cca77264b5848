"""Opening a model of many tensors: what `open` builds per tensor and what it shares,
and what walking the tree asks of jax, counted (the times are
benchmarks/bench_summary.py's)."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import lazyckpt
from lazyckpt._array.nesting import PathClash, nested

SHAPES = [(4, 8), (8,), (2, 3, 4)]


def sharded_model(folder: Path, layers: int = 20, shards: int = 3) -> dict[str, np.ndarray]:
    """A Hugging Face model folder written by the safetensors library: `layers` layers
    of tensors of a few shapes in `shards` files, and an index whose order is not the
    files' (names sorted as text: `layers.10` before `layers.2`)."""
    rng = np.random.default_rng(0)
    tensors = {
        f"model.layers.{i}.mlp.{part}.weight": rng.standard_normal(shape).astype(np.float32)
        for i in range(layers)
        for part, shape in zip(["up", "down", "gate"], SHAPES, strict=True)
    }
    folder.mkdir()
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        mine = names[k::shards]
        save_file({name: tensors[name] for name in mine}, folder / file)
        weight_map.update(dict.fromkeys(mine, file))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_tensors_of_one_shape_share_what_they_store_alike(tmp_path: Path) -> None:
    tensors = sharded_model(tmp_path / "m")
    tree = lazyckpt.open(tmp_path / "m")
    arrays = [leaf for _, leaf in lazyckpt.leaves(tree)]
    assert len(arrays) == len(tensors)
    # One selection and one chunk shape per shape, and each key part once.
    assert len({id(a.selection) for a in arrays}) == len(SHAPES)
    assert len({id(a.stored.chunks) for a in arrays}) == len(SHAPES)
    assert len({id(part) for a in arrays for part in a.path}) == len(
        {part for a in arrays for part in a.path}
    )
    # Each stored array is its own, at its tensor's place.
    assert len({id(a.stored) for a in arrays}) == len(tensors)
    for name, array in lazyckpt.open(tmp_path / "m", flat=True).items():
        np.testing.assert_array_equal(array.get(), tensors[name])
        with safe_open(tmp_path / "m" / array.stored.name, "np") as f:
            assert list(f.get_slice(name).get_shape()) == list(array.shape)


def test_a_model_opens_in_its_index_order_and_nests_by_name(tmp_path: Path) -> None:
    tensors = sharded_model(tmp_path / "m")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    flat = lazyckpt.open(tmp_path / "m", flat=True)
    assert list(flat) == list(index["weight_map"])
    tree = lazyckpt.open(tmp_path / "m")
    assert list(tree["model"]["layers"]) == sorted(str(i) for i in range(20))
    for name in tensors:
        node: Any = tree
        for key in name.split("."):
            node = node[key]
        assert node.path == tuple(name.split(".")) and node.stored.key == name


def test_walking_lazy_arrays_asks_jax_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`leaves` knows LazyArrays are leaves; other objects are still jax's to tell
    (a NamedTuple is a node), and the paths are jax's."""

    class Pair(NamedTuple):
        a: Any
        b: Any

    sharded_model(tmp_path / "m", layers=3)
    tree = {"m": lazyckpt.open(tmp_path / "m"), "p": Pair(1, [2, None]), "n": None, "e": {}}
    asked: list[object] = []
    all_leaves = jax.tree_util.all_leaves

    def counted(xs: Any, *rest: Any) -> bool:
        asked.append(xs)
        return all_leaves(xs, *rest)

    monkeypatch.setattr(jax.tree_util, "all_leaves", counted)
    found = list(lazyckpt.leaves(tree))
    assert asked == [(tree["p"],)]  # the NamedTuple only: jax takes it apart whole
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    assert [(jax.tree_util.keystr(p, simple=True, separator="/"), x) for p, x in flat] == [
        (path, x) for path, x in found
    ]


def test_an_opened_tree_is_left_in_the_oldest_generation(tmp_path: Path) -> None:
    """Built while the collector is paused, a tree goes where collections that it
    skipped would have put it: no later young collection walks it all again."""
    sharded_model(tmp_path / "m")
    assert gc.isenabled()
    tree = lazyckpt.open(tmp_path / "m")
    arrays = {id(leaf) for _, leaf in lazyckpt.leaves(tree)}
    young = {id(o) for generation in (0, 1) for o in gc.get_objects(generation)}
    assert not arrays & young
    assert arrays <= {id(o) for o in gc.get_objects(2)}
    assert gc.isenabled()


def test_what_the_program_froze_stays_frozen(tmp_path: Path) -> None:
    """A program that froze objects (before forking workers, say) keeps them frozen:
    `open` leaves its tree to the collector then."""
    sharded_model(tmp_path / "m", layers=3)
    kept: list[object] = []
    gc.freeze()
    try:
        tree = lazyckpt.open(tmp_path / "m")
        # (the collector's generations list every tracked object but the frozen ones)
        assert all(o is not kept for o in gc.get_objects())
        assert len(list(lazyckpt.leaves(tree))) == 9
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    ("items", "first", "second", "at"),
    [
        ([(("a", "b"), 1, "p"), (("a", "b", "c"), 2, "q")], "p", "q", ("a", "b")),
        ([(("a", "b", "c"), 1, "p"), (("a", "b"), 2, "q")], "p", "q", ("a", "b", "c")),
        ([(("a", "b"), 1, "p"), (("a", "b"), 2, "q")], "p", "q", ("a", "b")),
        ([(("a",), {"x": 1}, "p"), (("a", "x"), 2, "q")], "p", "q", ("a",)),
        (
            [(("a", "b"), 1, "p"), (("a", "c"), 2, "r"), (("a", "b", "d", "e"), 3, "q")],
            "p",
            "q",
            ("a", "b"),
        ),
    ],
)
def test_nested_names_both_leaves_of_a_clash(
    items: list[tuple[tuple[str, ...], object, str]], first: str, second: str, at: tuple[str, ...]
) -> None:
    """A leaf where a later one needs a subtree, or the other way round (a leaf that
    is a dict is a leaf, not a subtree to fill)."""
    with pytest.raises(PathClash) as clash:
        nested(items)
    assert (clash.value.first, clash.value.second, clash.value.at) == (first, second, at)


def test_nested_builds_siblings_under_one_subtree() -> None:
    items = [(("a", "b", "c"), 1, "x"), (("a", "d"), 2, "y"), (("a", "b", "e"), 3, "z")]
    tree = nested(items)
    assert tree == {"a": {"b": {"c": 1, "e": 3}, "d": 2}}
    assert list(tree["a"]) == ["b", "d"]
