"""`diff` and `stats` at the edges of their values and leaves: integers past float64's
2**53, float64's largest, constant arrays of large magnitude, NaN scalars, trees of
arrays already read (NumPy, jax) beside lazy ones, moves among hundreds of arrays of
one shape, and arguments out of range."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lazyckpt
from lazyckpt._cli.main import main
from lazyckpt._explore import difference
from tests.helpers import data_reads, orbax_save, value_comparisons

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


def test_moves_among_300_arrays_of_one_shape_read_each_once_not_once_per_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 arrays renamed and retrained, 51 of them only renamed: each removed one is
    compared with its target alone, each array read once for its digest and once more
    where it moved. Every removed one had been compared with every added one of its
    shape until one matched (400 pairs took 29 s; 10,000 would take hours)."""
    n = 300
    rng = np.random.default_rng(0)
    before = {f"old{i:03}": rng.standard_normal(64).astype(np.float32) for i in range(n)}
    after = {f"new{i:03}": rng.standard_normal(64).astype(np.float32) for i in range(n)}
    expected = {}
    for j in range(0, n, 6):  # 50 moved, to targets 3 apart from all others modulo 6
        target = f"new{(7 * j + 3) % n:03}"
        after[target] = before[f"old{j:03}"].copy()
        expected[f"old{j:03}"] = target
    # Equal values twice on each side: paired in order, the first removed to the first.
    before["old001"] = before["old000"].copy()
    after["new010"] = before["old000"].copy()
    expected["old001"] = "new010"
    a, b = lazyckpt.save(tmp_path / "a", before), lazyckpt.save(tmp_path / "b", after)
    compared = []
    block_difference = difference.block_difference

    def counted(left: np.ndarray, right: np.ndarray) -> difference.Found:
        compared.append(left.size)
        assert len(compared) <= len(expected), "compared with more than its target"
        return block_difference(left, right)

    monkeypatch.setattr(difference, "block_difference", counted)
    reads = data_reads(monkeypatch)
    result = lazyckpt.diff(a, b, values=True, memory_budget=1 << 20)
    assert {c.path: c.to for c in result.changes if c.kind == "moved"} == expected
    assert result.counts() == {**dict.fromkeys(result.counts(), 0),
                               "moved": 51, "removed": n - 51, "added": n - 51}  # fmt: skip
    assert compared == [64] * 51
    times = collections.Counter(reads)
    assert set(times) == {*before, *after}
    moved = {*expected, *expected.values()}
    assert {key: times[key] for key in times if times[key] != 1} == dict.fromkeys(moved, 2)


def test_moves_keep_what_diff_calls_equal_and_compare_only_their_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Moves found by digest, each confirmed by one comparison: NaNs in the same
    places and -0.0 against 0.0 equal, NaN to its part of a complex number, a
    broadcast view equal to its values stored whole (along either dimension), typed
    PRNG keys by their data, long doubles past float64's precision, bools and text."""
    rng = np.random.default_rng(1)
    noise = rng.standard_normal((2, 3)).astype(np.float32)
    zeros = np.array([[np.nan, -0.0, 1.0], [2.0, np.float32(1e-45), 3.0]], np.float32)
    row, column = np.arange(4.0), np.arange(3.0)[:, None]
    tiny = np.finfo(np.longdouble).eps  # (past float64's precision, where it is wider)
    before = {
        "f_noise": noise,
        "f_zeros": zeros,
        "f_nan_elsewhere": np.where(np.eye(2, 3, dtype=bool), np.nan, zeros),
        "c_first": np.array([complex(np.nan, 1), 2j]),
        "c_second": np.array([complex(1, np.nan), 2j]),
        "r_row": np.broadcast_to(row, (3, 4)),
        "r_column": np.broadcast_to(column, (3, 4)),
        "k_zero": jax.random.key(0),
        "k_one": jax.random.key(1),
        "l_one": np.array([1 + tiny, 1], np.longdouble),
        "l_two": np.array([1, 1], np.longdouble),
        "b_one": np.array([True, False]),
        "b_two": np.array([False, True]),
        "t_one": np.array(["a", "bc"]),
        "t_two": np.array(["bc", "a"]),
    }
    after = {  # (other names: an added leaf is one whose path the first tree lacks)
        "to_f_one": rng.standard_normal((2, 3)).astype(np.float32),
        "to_f_two": np.where(np.isnan(zeros), np.nan, np.abs(zeros)),  # +0.0 where -0.0 was
        "to_f_three": np.where(np.eye(2, 3, k=1, dtype=bool), np.nan, zeros),
        "to_c_one": np.array([complex(1, np.nan), 2j]),
        "to_c_two": np.array([complex(np.nan, 1), 2j]),
        "to_r_one": rng.standard_normal((3, 4)),
        "to_r_two": np.broadcast_to(column, (3, 4)).copy(),
        "to_r_three": np.broadcast_to(row, (3, 4)).copy(),
        "to_k_one": jax.random.key(2),
        "to_k_two": jax.random.key(1),
        "to_k_three": jax.random.key(0),
        "to_l_one": np.array([1, 1], np.longdouble),
        "to_l_two": np.array([1 + tiny, 1], np.longdouble),
        "to_b_one": np.array([False, True]),
        "to_b_two": np.array([True, False]),
        "to_t_one": np.array(["bc", "a"]),
        "to_t_two": np.array(["a", "bc"]),
    }
    compared = value_comparisons(monkeypatch)
    result = lazyckpt.diff(before, after, values=True)
    moved = {c.path: c.to for c in result.changes if c.kind == "moved"}
    assert moved == {
        "f_zeros": "to_f_two", "c_first": "to_c_two", "c_second": "to_c_one",
        "r_row": "to_r_three", "r_column": "to_r_two", "k_zero": "to_k_three",
        "k_one": "to_k_two", "l_one": "to_l_two", "l_two": "to_l_one", "b_one": "to_b_two",
        "b_two": "to_b_one", "t_one": "to_t_two", "t_two": "to_t_one",
    }  # fmt: skip
    assert {(c.path, c.kind) for c in result.changes if c.kind != "moved"} == {
        ("f_noise", "removed"), ("f_nan_elsewhere", "removed"), ("to_f_one", "added"),
        ("to_f_three", "added"), ("to_r_one", "added"), ("to_k_one", "added"),
    }  # fmt: skip
    assert sorted(compared) == sorted(moved)  # one comparison for each move, none besides


_FEW: dict[np.dtype[Any], list[Any]] = {
    np.dtype(np.float32): [0.0, -0.0, np.nan, 1.0],
    np.dtype(np.complex128): [0j, complex(-0.0, 0), complex(np.nan, 1), complex(1, np.nan)],
}


def _equal(x: np.ndarray, y: np.ndarray) -> bool:
    """Equal, -0.0 as 0.0 and NaN as NaN in the same part (NumPy's `equal_nan` takes a
    complex number with a NaN in either part for any other)."""
    return all(np.array_equal(part(x), part(y), equal_nan=True) for part in (np.real, np.imag))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_moves_are_those_comparing_every_pair_finds(data: st.DataObject) -> None:
    """Arrays of a few values (NaN, 0.0 and -0.0 among them), each whole or a broadcast
    of its values along some dimensions: the moves are those that comparing each
    removed array in turn with every added one still free finds, and each costs one
    comparison (not one per pair tried)."""
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, max_side=3))
    dtype = data.draw(st.sampled_from(list(_FEW)))

    def drawn() -> np.ndarray:
        repeats = data.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
        stored = tuple(1 if r else n for r, n in zip(repeats, shape, strict=True))
        values = data.draw(hnp.arrays(dtype, stored, elements=st.sampled_from(_FEW[dtype])))
        view = np.broadcast_to(values, shape)
        return view if data.draw(st.booleans()) else view.copy()

    before = {f"a{i}": drawn() for i in range(data.draw(st.integers(2, 5)))}
    after = {f"b{i}": drawn() for i in range(data.draw(st.integers(2, 5)))}
    expected, free = {}, list(after)
    for path, old in before.items():
        target = next((t for t in free if _equal(old, after[t])), None)
        if target is not None:
            expected[path] = target
            free.remove(target)
    with pytest.MonkeyPatch.context() as patch:
        compared = value_comparisons(patch)
        found = lazyckpt.diff(before, after, values=True)
    assert {c.path: c.to for c in found.changes if c.kind == "moved"} == expected
    assert sorted(compared) == sorted(expected)


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
