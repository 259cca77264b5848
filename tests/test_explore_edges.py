"""`diff` and `stats` at the edges of their values and leaves: integers past float64's
2**53, float64's largest, constant arrays of large magnitude, NaN scalars, trees of
arrays already read (NumPy, jax) beside lazy ones, and arguments out of range."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazyckpt
from lazyckpt._cli.main import main
from tests.helpers import orbax_save

BIG = 2**53  # the first integer after which float64 skips some
I64, U64 = np.iinfo(np.int64), np.iinfo(np.uint64)


def _npz(path: Path, **arrays: Any) -> Path:
    np.savez(path, **arrays)
    return path


def test_diff_compares_integers_exactly(tmp_path: Path) -> None:
    before: dict[str, Any] = {
        "ids": np.array([BIG, 7], np.int64),
        "u": np.array([U64.max, 3], np.uint64),
        "span": np.array([I64.min, 0], np.int64),  # |difference| past int64's largest
        "small": np.array([-128, 5], np.int8),
        "same": np.array([BIG + 1, I64.min], np.int64),
    }
    after = {
        "ids": np.array([BIG + 1, 7], np.int64),
        "u": np.array([U64.max - 1, 3], np.uint64),
        "span": np.array([I64.max, 0], np.int64),
        "small": np.array([127, 5], np.int8),
        "same": before["same"].copy(),
    }
    result = lazyckpt.diff(
        _npz(tmp_path / "a.npz", **before), _npz(tmp_path / "b.npz", **after), values=True
    )
    changes = {c.path: c for c in result.changes}
    assert {path: c.kind for path, c in changes.items()} == {
        "ids": "value", "u": "value", "span": "value", "small": "value", "same": "equal",
    }  # fmt: skip
    found = {path: changes[path].max_abs for path in ("ids", "u", "span", "small")}
    assert found == {"ids": 1, "u": 1, "span": 2**64 - 1, "small": 255}
    assert all(type(value) is int for value in found.values())  # exact, not rounded
    assert changes["span"].max_rel == pytest.approx((2**64 - 1) / 2**63)
    assert changes["ids"].max_rel == pytest.approx(1 / (BIG + 1))
    # A moved integer array is matched only by equal values, compared exactly.
    moved = lazyckpt.diff(
        _npz(tmp_path / "c.npz", old=before["ids"]),
        _npz(tmp_path / "d.npz", new=after["ids"], other=before["ids"]),
        values=True,
    )
    assert [(c.path, c.kind, c.to) for c in moved.changes] == [
        ("old", "moved", "other"), ("new", "added", ""),
    ]  # fmt: skip


def test_stats_keeps_integer_extremes_exact(tmp_path: Path) -> None:
    values = {
        "ids": np.array([BIG + 1, BIG + 3], np.int64),
        "u": np.array([U64.max - 1, U64.max], np.uint64),
        "i": np.array([I64.min, I64.max], np.int64),
    }
    table = lazyckpt.stats(lazyckpt.open(_npz(tmp_path / "a.npz", **values)))
    for key, value in values.items():
        s = table[key]
        assert (s.min, s.max) == (int(value.min()), int(value.max())), key
        assert type(s.min) is int and type(s.max) is int, key
        assert s.mean == pytest.approx(value.astype(np.float64).mean()), key
    assert json.loads(json.dumps(table.describe()))["u"]["max"] == U64.max


def test_diff_compares_arrays_already_read_as_it_compares_lazy_ones(tmp_path: Path) -> None:
    tree: dict[str, Any] = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "ids": np.array([BIG, 7], np.int64),
        "step": 3,
        "lr": float("nan"),
    }
    lazy = lazyckpt.open(orbax_save(tmp_path / "ckpt", tree))
    host = lazyckpt.load(lazy)
    on_device = {**host, "w": jnp.asarray(host["w"])}  # (a jax.Array of int64 needs x64)
    for read in (host, on_device):
        for first, second in ((lazy, read), (read, lazy), (read, read)):
            result = lazyckpt.diff(first, second, values=True)
            assert not result, result
            assert {c.path: c.kind for c in result.changes} == dict.fromkeys(tree, "equal")
            assert not lazyckpt.diff(first, second)  # metadata alone
    changed = {**host, "w": host["w"] + np.eye(3, 4, dtype=np.float32), "ids": tree["ids"] + 1}
    both = [lazyckpt.diff(lazy, changed, values=True), lazyckpt.diff(host, changed, values=True)]
    for result in both:
        found = {c.path: (c.kind, c.max_abs) for c in result.changed}
        assert found == {"w": ("value", 1.0), "ids": ("value", 1)}
    assert str(both[0]) == str(both[1])  # lazy or read, the same report
    # Metadata of arrays in memory: shape and dtype, as for LazyArrays.
    reshaped = {**host, "w": host["w"].reshape(4, 3), "ids": tree["ids"].astype(np.int32)}
    kinds = {c.path: c.kind for c in lazyckpt.diff(lazy, reshaped).changed}
    assert kinds == {"w": "shape", "ids": "dtype"}
    moved = lazyckpt.diff(host, {"v": host["w"], "ids": host["ids"]}, values=True)
    assert [(c.path, c.kind, c.to) for c in moved.changed] == [
        ("lr", "removed", ""), ("step", "removed", ""), ("w", "moved", "v"),
    ]  # fmt: skip


def test_diff_of_typed_keys_in_memory_and_nan_scalars() -> None:
    keys = {"rng": jax.random.key(0), "s": float("nan"), "n": np.float32("nan")}
    assert not lazyckpt.diff(keys, {**keys, "rng": jax.random.key(0)}, values=True)
    changed = lazyckpt.diff(keys, {**keys, "rng": jax.random.key(1), "s": 1.0}, values=True)
    assert [(c.path, c.kind) for c in changed.changed] == [("rng", "value"), ("s", "value")]


def test_diff_json_holds_infinite_differences_as_strings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _npz(tmp_path / "a.npz", a=np.array([1.0, 2.0]))
    b = _npz(tmp_path / "b.npz", a=np.array([1.0, np.nan]))
    assert main(["diff", str(a), str(b), "--values", "--json"]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    (change,) = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert (change["kind"], change["max_abs"], change["max_rel"]) == ("value", "inf", "inf")


@pytest.mark.parametrize(
    "value",
    [
        np.full(4, 1e17, np.float32),  # constant, its neighbours 16 apart in float64 too
        np.full(3, BIG + 1, np.int64),
        np.full(3, np.finfo(np.float64).max),
        np.array([-np.finfo(np.float64).max, 0.0, np.finfo(np.float64).max]),
        np.array([1.0, np.nextafter(1.0, 2.0)]),  # two neighbours, more bins than between
        np.array([U64.max - 2, U64.max], np.uint64),
    ],
)
def test_histograms_of_any_range(tmp_path: Path, value: np.ndarray) -> None:
    path = _npz(tmp_path / "a.npz", a=value)
    s = lazyckpt.stats(lazyckpt.open(path), bins=8)["a"]
    assert s.histogram is not None
    counts, edges = s.histogram
    assert counts.sum() == value.size and len(edges) == 9
    assert np.all(np.isfinite(edges)) and np.all(edges[:-1] < edges[1:])
    assert s.min is not None and s.max is not None and s.mean is not None and s.std is not None
    assert edges[0] <= float(s.min) and float(s.max) <= edges[-1]
    assert np.isfinite(s.mean) and np.isfinite(s.std)  # (and no overflow warning)
    mean = value.astype(np.float64)
    assert s.mean == pytest.approx(np.mean(mean / 4) * 4)


def test_arguments_out_of_range_are_errors_that_name_them(tmp_path: Path) -> None:
    path = orbax_save(tmp_path / "ckpt", {f"layer_{i}": {"w": np.ones(4) * i} for i in range(3)})
    tree = lazyckpt.open(path)
    for bins in (0, -2, 2.5, True):
        with pytest.raises(lazyckpt.ArgumentError, match=rf"stats: bins={bins!r}, but bins"):
            lazyckpt.stats(tree, bins=bins)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"summary: depth=0, but depth is a whole number"):
        lazyckpt.summary(tree, depth=0)
    table = lazyckpt.stats(tree)
    with pytest.raises(lazyckpt.ArgumentError, match=r"kind='bogus'; pass 'layers' or"):
        table.plot("bogus")
    with pytest.raises(lazyckpt.ArgumentError, match=r"max_panels=0, but max_panels"):
        table.plot(max_panels=0)
    changed = lazyckpt.diff(
        tree, {**lazyckpt.load(tree), "layer_1": {"w": np.zeros(4)}}, values=True
    )
    for top in (0, -1):
        with pytest.raises(lazyckpt.ArgumentError, match=rf"Diff.plot: top={top}, but top"):
            changed.plot(top=top)
    with pytest.raises(lazyckpt.LazyTypeError, match=r"layer_0/w: astype\('notadtype'\): not a"):
        tree["layer_0"]["w"].astype("notadtype")


@pytest.mark.parametrize(
    ("args", "flag"),
    [(("stats", "--bins", "-3"), "--bins"), (("stats", "--bins", "0"), "--bins"),
     (("inspect", "--depth", "0"), "--depth"), (("inspect", "--depth", "x"), "--depth")],
)  # fmt: skip
def test_cli_counts_out_of_range_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], flag: str
) -> None:
    path = _npz(tmp_path / "a.npz", a=np.ones(3))
    with pytest.raises(SystemExit) as exited:
        main([args[0], str(path), *args[1:]])
    assert exited.value.code == 2
    assert f"argument {flag}: {args[2]!r}: pass a whole number of 1 or more" in (
        capsys.readouterr().err
    )


def test_diff_compares_text_dates_and_objects_by_equality() -> None:
    """Arrays that hold no numbers (NumPy strings, dates, objects) are compared equal
    or not; their values had been taken as floats (a raw ValueError for strings)."""
    cases = [
        (np.array(["a", "b"]), np.array(["a", "c"])),
        (np.array(["2020-01-01"], "M8[D]"), np.array(["2021-01-01"], "M8[D]")),
        (np.array([1, None], object), np.array([1, 2], object)),
    ]
    for before, after in cases:
        assert not lazyckpt.diff({"x": before}, {"x": before.copy()}, values=True)
        (change,) = lazyckpt.diff({"x": before}, {"x": after}, values=True).changes
        assert change.kind == "value", (before, change)


def test_diff_of_complex_values_holds_nan_to_its_part() -> None:
    """A NaN equals a NaN in the same part only: `nan+1j` against `1+nanj` differs
    (both had counted as NaN, so equal)."""
    first = np.array([complex(np.nan, 1), 2 + 3j])
    assert not lazyckpt.diff({"x": first}, {"x": first.copy()}, values=True)
    other = np.array([complex(1, np.nan), 2 + 3j])
    (change,) = lazyckpt.diff({"x": first}, {"x": other}, values=True).changes
    assert change.kind == "value" and change.max_abs == np.inf, change
