"""One convention across the verbs: `select` takes a pattern, a list of patterns or a
predicate everywhere (with `which=` kept as a deprecated spelling), `stats` returns a
table whatever it is given, `summary` takes a depth, `diff` opens paths as `open` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from tests.helpers import ROOT, orbax_manager_save, orbax_save, stored_chunk_bytes

_TREE: dict[str, Any] = {
    "params": {
        "dense": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8), "bias": np.ones(8)},
        "embed": np.arange(32, dtype=np.float32).reshape(4, 8),
    },
    "opt": {"mu": np.zeros((8, 8), np.float32)},
}
_SELECTIONS: list[Any] = [
    ["params/dense/kernel", "opt/**"],
    lambda path, leaf: path in ("params/dense/kernel", "opt/mu"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return orbax_save(tmp_path_factory.mktemp("conventions") / "ckpt", _TREE)


@pytest.mark.parametrize("select", _SELECTIONS, ids=["patterns", "predicate"])
def test_every_verb_takes_the_same_select(ckpt: Path, tmp_path: Path, select: Any) -> None:
    tree = lazyckpt.open(ckpt)
    wanted = ["opt/mu", "params/dense/kernel"]
    assert sorted(path for path, _ in lazyckpt.leaves(lazyckpt.select(tree, select))) == wanted
    loaded = lazyckpt.load(tree, select)
    assert sorted(path for path, _ in lazyckpt.leaves(loaded)) == wanted
    np.testing.assert_array_equal(
        loaded["params"]["dense"]["kernel"], _TREE["params"]["dense"]["kernel"]
    )
    assert sorted(lazyckpt.stats(tree, select)) == wanted
    assert lazyckpt.verify(tree, select, progress=False).arrays == len(wanted)
    assert sorted({key for key, _, _ in lazyckpt.iter_blocks(tree, select)}) == wanted
    mesh = jax.make_mesh((8,), ("d",))
    placed = lazyckpt.device_put(tree, NamedSharding(mesh, P()), select=select)
    assert isinstance(placed["opt"]["mu"], jax.Array) and "embed" not in placed["params"]
    out = lazyckpt.convert(ckpt, tmp_path / "out", select=select, progress=False)
    assert sorted(path for path, _ in lazyckpt.leaves(lazyckpt.open(out))) == wanted
    changes = lazyckpt.diff(ckpt, out, select=select)
    assert not changes and sorted(c.path for c in changes.changes) == wanted


def test_a_list_of_patterns_reads_only_what_it_selects(tmp_path: Path, count_bytes: Any) -> None:
    rng = np.random.default_rng(0)  # random, so that chunks are stored apart, not inline
    big = {k: rng.standard_normal((128, 128), dtype=np.float32) for k in ("kernel", "mu", "x")}
    stored = {
        "params": {"dense": {"kernel": big["kernel"]}, "x": big["x"]},
        "opt": {"mu": big["mu"]},
    }
    path = orbax_save(tmp_path / "ckpt", stored)
    tree = lazyckpt.open(path)
    with count_bytes() as read:
        lazyckpt.load(tree, ["params/dense/kernel", "opt/**"])
    kernel, mu = tree["params"]["dense"]["kernel"], tree["opt"]["mu"]
    assert read[0] == stored_chunk_bytes(path, kernel) + stored_chunk_bytes(path, mu)


def test_which_is_a_deprecated_spelling_of_select(ckpt: Path) -> None:
    tree = lazyckpt.open(ckpt)
    with pytest.warns(
        DeprecationWarning, match=r"load\(which=\.\.\.\) is now load\(select=\.\.\.\)"
    ):
        old = lazyckpt.load(tree, which="opt")  # type: ignore[call-arg]
    assert list(old) == ["opt"]
    with pytest.warns(
        DeprecationWarning, match=r"stats\(which=\.\.\.\) is now stats\(select=\.\.\.\)"
    ):
        assert list(lazyckpt.stats(tree, which="opt")) == ["opt/mu"]  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"load\(\) got both which= and select=; use select="):
        lazyckpt.load(tree, which="opt", select="params")  # type: ignore[call-arg]


def test_stats_returns_a_table_whatever_it_is_given(ckpt: Path) -> None:
    tree = lazyckpt.open(ckpt)
    kernel = tree["params"]["dense"]["kernel"]
    one = lazyckpt.stats(kernel)
    view = lazyckpt.stats(kernel[2:4])
    whole = lazyckpt.stats(tree)
    assert isinstance(one, lazyckpt.StatsTable) and isinstance(whole, lazyckpt.StatsTable)
    assert list(one) == list(view) == ["params/dense/kernel"]
    assert one["params/dense/kernel"] == whole["params/dense/kernel"]
    assert view["params/dense/kernel"].min == 16.0 and view["params/dense/kernel"].max == 31.0
    lines = str(whole).splitlines()
    assert lines[0].split() == ["key", "size", "min", "max", "mean", "std", "nan", "inf"]
    assert lines[1].split()[:4] == ["opt/mu", "256", "B", "0"]
    assert json.loads(json.dumps(whole.describe()))["params/embed"]["max"] == 31.0


def test_summary_depth(ckpt: Path) -> None:
    tree = lazyckpt.open(ckpt)
    assert str(lazyckpt.summary(tree, depth=1)).splitlines() == [
        "opt/mu   float32[8,8]  256 B",  # a dict of one entry shares its row
        "params/  3 arrays      448 B",
    ]
    two = str(lazyckpt.summary(tree, depth=2)).splitlines()
    assert len(two) == 4 and two[2].split() == ["dense/", "2", "arrays", "320", "B"]
    assert len(str(lazyckpt.summary(tree)).splitlines()) == 6
    assert len(str(lazyckpt.summary(tree, fold=False)).splitlines()) == 7
    with pytest.raises(ValueError, match="depth=0, but depth is a whole number of 1 or more"):
        lazyckpt.summary(tree, depth=0)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps with two items each; the 'extra' item differs between them."""
    steps = {
        step: {
            "state": ocp.args.StandardSave({"w": np.full(4, 1.0, np.float32)}),
            "extra": ocp.args.StandardSave({"v": np.full(3, float(step), np.float32)}),
        }
        for step in (1, 2)
    }
    return orbax_manager_save(tmp_path_factory.mktemp("root") / "run", steps)


def test_diff_opens_paths_with_step_and_item(root: Path) -> None:
    same = lazyckpt.diff(root, root, step=(1, 2), values=True)
    assert not same  # the default item, 'state', is equal
    changed = lazyckpt.diff(root, root, step=(1, 2), item="extra", values=True)
    assert [(c.path, c.kind) for c in changed.changes] == [("v", "value")]
    assert not lazyckpt.diff(root, root, step=2, item="extra", values=True)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lazyckpt._cli.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_cli_flags_are_spelled_like_the_arguments(root: Path, ckpt: Path, tmp_path: Path) -> None:
    changed = _cli("diff", str(root), str(root), "--step", "1", "2", "--item", "extra",
                   "--values", "--exit-code")  # fmt: skip
    assert changed.returncode == 1 and "~ v" in changed.stdout, changed.stderr
    same = _cli("diff", str(root), str(root), "--step", "1", "2", "--values", "--exit-code")
    assert same.returncode == 0, same.stdout + same.stderr
    out = tmp_path / "rechunked"
    converted = _cli("convert", str(ckpt), str(out), "--chunk-bytes", "64B", "--quiet")
    assert converted.returncode == 0, converted.stderr
    assert lazyckpt.open(out)["params"]["dense"]["kernel"].chunks == (2, 8)
    old = _cli("convert", str(ckpt), str(tmp_path / "x"), "--chunk-size", "64B")
    assert old.returncode == 2 and "--chunk-size" in old.stderr
