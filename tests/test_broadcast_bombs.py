"""Broadcast views (a torch tensor saved `expand`ed, its strides 0): a file of a few
hundred bytes may declare 2**61 bytes of them. `stats` and `diff` answer from the
stored values, `save` and `convert` refuse to write the repeats unless asked
(`allow_expand=True`, `--allow-expand`), and `verify` checks only what is stored.

The files are written here byte by byte, as an attacker would: a zip holding a pickle
of `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` calls, in the
form torch writes (`tests/fixtures/torch/views.pt`, written by torch, holds expanded
tensors of this form that `test_torch_files` reads as torch.load does)."""

from __future__ import annotations

import json
import math
import pickle
import pickletools
import shutil
import zipfile
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from lazyckpt._array.broadcast_to import BroadcastTo
from lazyckpt._cli.main import main
from tests.helpers import expect, refuse_data_reads, run_cases, value_comparisons

_STORAGES = {
    np.dtype(np.float32): "FloatStorage",
    np.dtype(np.int32): "IntStorage",
    np.dtype(np.int8): "CharStorage",
}
_FALSE_AND_HOOKS = b"\x89ccollections\nOrderedDict\n)R"  # requires_grad, backward_hooks


def _body(value: Any) -> bytes:
    """`value`'s protocol 2 pickle without its header, memo and STOP."""
    return pickletools.optimize(pickle.dumps(value, protocol=2))[2:-1]


def _torch_file(
    path: Path,
    storages: Mapping[str, np.ndarray],
    tensors: Mapping[str, tuple[str, tuple[int, ...], tuple[int, ...]]],
    negated: Collection[str] = (),
) -> Path:
    """A `torch.save` zip of `{name: tensor}`: each tensor `(storage key, size,
    stride)` over `storages[key]`, its elements at offset 0; those in `negated` with
    their negative bit set (torch's metadata `{"neg": True}`: `torch._neg_view(x)`)."""
    items = b""
    for name, (key, size, stride) in tensors.items():
        values = storages[key]
        kind = _STORAGES[values.dtype].encode()
        storage = b"(X\x07\x00\x00\x00storagectorch\n%s\n" % kind
        storage += _body(key) + _body("cpu") + _body(values.size) + b"tQ"
        arguments = storage + _body(0) + _body(size) + _body(stride) + _FALSE_AND_HOOKS
        if name in negated:
            arguments += _body({"neg": True})
        items += _body(name) + b"ctorch._utils\n_rebuild_tensor_v2\n(%stR" % arguments
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}(" + items + b"u.")
        archive.writestr("archive/byteorder", "little")
        for key, values in storages.items():
            archive.writestr(f"archive/data/{key}", values.tobytes())
        archive.writestr("archive/version", "3\n")
    return path


_HUGE = (1 << 27, 1 << 30, 4)  # float32: 2**61 bytes
_WIDE = 1 << 20  # int8 (2**20, 2**20): 1 TiB, from one storage of 1 MiB


def _bomb(path: Path) -> Path:
    """`x`, `y`: 2**61 bytes repeating 4 floats (`y` differs from `x` in one);
    `s`: one float; `a`, `b`: 1 TiB each from one storage of 1 MiB, `a` varying down
    its rows, `b` along them; `p`: 4 floats, stored plainly."""
    storages: dict[str, np.ndarray] = {
        "0": np.array([0.0, 1.0, 2.0, 3.0], np.float32),
        "1": np.array([0.0, 1.0, 2.5, 3.0], np.float32),
        "2": np.array([7.0], np.float32),
        "3": (np.arange(_WIDE) % 7).astype(np.int8),
    }
    tensors = {
        "x": ("0", _HUGE, (0, 0, 1)),
        "y": ("1", _HUGE, (0, 0, 1)),
        "s": ("2", _HUGE, (0, 0, 0)),
        "a": ("3", (_WIDE, _WIDE), (1, 0)),
        "b": ("3", (_WIDE, _WIDE), (0, 1)),
        "p": ("0", (4,), (1,)),
    }
    return _torch_file(path, storages, tensors)


def _outcomes(tmp_path: Path, cases: list[dict[str, Any]]) -> dict[str, str]:
    path = _bomb(tmp_path / "bomb.pt")
    tree = lazyckpt.open(path)
    assert path.stat().st_size < (1 << 20) + 2000 and tree["x"].nbytes == 1 << 61
    assert tree["a"].nbytes == 1 << 40
    return run_cases([{**case, "path": str(path)} for case in cases], tmp_path)


def _json(outcome: str) -> Any:
    assert outcome.startswith("ok: "), outcome
    return json.loads(outcome.removeprefix("ok: "))


def test_stats_diff_and_verify_of_a_bomb_answer_from_what_it_stores(tmp_path: Path) -> None:
    # Each of these went through every repeat: stats of `x` for 2**61 bytes, of the
    # tree for more; diff of two of them as long.
    cases: list[dict[str, Any]] = [
        {"name": "stats", "do": "stats_json", "kwargs": {"bins": 4}},
        {"name": "stats_view", "do": "stats_json", "key": "x", "step": 2, "astype": "float64"},
        {"name": "itself", "do": "diff", "key": "x", "versus": "x"},
        {"name": "alike", "do": "diff", "key": "x", "versus": "y"},
        {"name": "scalar", "do": "diff", "key": "x", "versus": "s"},
        {"name": "numpy", "do": "diff", "key": "x", "numpy": [0.0, 1.0, 2.0, 3.0]},
        {"name": "crossed", "do": "diff", "key": "a", "versus": "b"},
        {"name": "plain", "do": "diff", "key": "x", "versus": "p"},
        {"name": "verify", "do": "verify"},
    ]
    outcomes = _outcomes(tmp_path, cases)
    expect(outcomes, {"crossed": "lazyckpt:ArgumentError", "verify": "ok: "})
    table = _json(outcomes["stats"])
    repeated = math.prod(_HUGE) // 4
    assert table["x"] == {
        "elements": math.prod(_HUGE),
        "nbytes": 1 << 61,
        "nan": 0,
        "inf": 0,
        "min": 0.0,
        "max": 3.0,
        "mean": 1.5,
        "std": math.sqrt(1.25),
        "histogram": {"counts": [repeated] * 4, "edges": [0.0, 0.75, 1.5, 2.25, 3.0]},
    }
    assert table["s"]["histogram"]["counts"] == [0, 0, math.prod(_HUGE), 0]
    rows = np.arange(_WIDE) % 7
    assert table["a"]["elements"] == _WIDE * _WIDE and table["a"]["max"] == 6
    assert table["a"]["histogram"]["counts"] == (np.histogram(rows, 4)[0] * _WIDE).tolist()
    assert table["a"]["mean"] == pytest.approx(rows.mean(), rel=1e-12)
    view = _json(outcomes["stats_view"])["x"]
    assert (view["elements"], view["min"], view["max"]) == (math.prod(_HUGE) // 2, 0.0, 3.0)
    changes = {name: _json(outcomes[name])[0] for name in ("itself", "alike", "scalar", "numpy")}
    assert changes["itself"]["kind"] == changes["numpy"]["kind"] == "equal"
    assert (changes["alike"]["max_abs"], changes["alike"]["max_rel"]) == (0.5, 0.2)
    assert (changes["scalar"]["max_abs"], changes["scalar"]["max_rel"]) == (7.0, 1.0)
    assert _json(outcomes["plain"])[0]["kind"] == "shape"
    crossed = outcomes["crossed"]
    # (both sides read one storage of 1 MiB: it counts once)
    assert "v: values repeated" in crossed and "2.0 TiB for 1.0 MiB stored" in crossed, crossed
    assert (
        "the first varies along dimensions [0] only, the second varies along dimensions [1] only"
        in crossed
    )
    assert "no damage found" in outcomes["verify"]


def test_save_and_convert_of_a_bomb_refuse_by_name_and_write_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cases: list[dict[str, Any]] = [
        {"name": "orbax", "do": "save", "out": str(out / "o"), "key": "x"},
        {"name": "safetensors", "do": "save", "out": str(out / "s.safetensors"), "key": "x"},
        {"name": "convert", "do": "convert", "out": str(out / "c"), "kwargs": {"select": "x"}},
        {
            "name": "convert_st",
            "do": "convert",
            "out": str(out / "c2"),
            "kwargs": {"to": "safetensors", "select": "x"},
        },
        {
            "name": "dry_run",
            "do": "convert",
            "out": str(out / "d"),
            "kwargs": {"dry_run": True, "select": "x"},
        },
        {
            "name": "cli",
            "do": "convert_cli",
            "args": [str(out / "cli"), "--to", "safetensors", "--select", "x"],
        },
        {"name": "whole", "do": "save", "out": str(out / "w")},
    ]
    outcomes = _outcomes(tmp_path, cases)
    expect(outcomes, {case["name"]: "lazyckpt:ArgumentError" for case in cases})
    head = "lazyckpt:ArgumentError: {} made of {} stored, repeated (a tensor saved expanded: strides 0)"
    for name, outcome in outcomes.items():
        if name == "whole":  # (its first array past the bounds)
            what = head.format("a: a view of shape (1048576, 1048576) (int8, 1.0 TiB)", "1.0 MiB")
            index = "[:, :1]"
        else:
            what = head.format(
                "x: a view of shape (134217728, 1073741824, 4) (float32, 2048.0 PiB)", "16 B"
            )
            index = "[:1, :1]"
        assert outcome.startswith(what), (name, outcome)
        assert "allow_expand=True (lazyckpt convert --allow-expand)" in outcome, outcome
        assert f"the view {index} of it" in outcome, outcome
    assert not list(out.iterdir())


def _expanded(tmp_path: Path) -> Path:
    """`e`: 5 floats (a NaN and an infinity among them) expanded to (300, 5); `i`: 5
    ints expanded to (4, 300, 5) along its first two dimensions; `f`, `g`: two rows
    that differ in one value, each expanded to (300, 5); `k`: one float; `n`, `-f`,
    `-g`: `e`, `f` and `g` with their negative bit set."""
    storages = {
        "0": np.array([1.5, -2.0, np.nan, np.inf, 0.25], np.float32),
        "1": np.array([-(2**31), 7, 0, 2**31 - 1, 3], np.int32),
        "2": np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32),
        "3": np.array([1.0, 2.0, 3.5, 4.0, 5.0], np.float32),
        "4": np.array([2.0], np.float32),
    }
    tensors = {
        "e": ("0", (300, 5), (0, 1)),
        "i": ("1", (4, 300, 5), (0, 0, 1)),
        "f": ("2", (300, 5), (0, 1)),
        "g": ("3", (300, 5), (0, 1)),
        "k": ("4", (300, 5), (0, 0)),
        "n": ("0", (300, 5), (0, 1)),
        "-f": ("2", (300, 5), (0, 1)),
        "-g": ("3", (300, 5), (0, 1)),
    }
    return _torch_file(tmp_path / "expanded.pt", storages, tensors, negated={"n", "-f", "-g"})


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The elements each broadcast computes, as it computes them: the repeats that a
    verb went through."""
    counts: list[int] = []
    original = BroadcastTo.compute

    def compute(self: BroadcastTo, box: Any, values: Any, out: np.ndarray) -> None:
        counts.append(out.size)
        original(self, box, values, out)

    monkeypatch.setattr(BroadcastTo, "compute", compute)
    yield counts


_VIEWS = [
    ("e", lambda x: x),
    ("e", lambda x: x[::2]),
    ("e", lambda x: x[::2].astype("float64")),
    ("e", lambda x: x[7:200:3, 1:].astype("float16")),
    ("e", lambda x: x.T[::-1, None]),
    ("i", lambda x: x[1:, ::4]),
    ("i", lambda x: x.astype("float32")),
    ("e", lambda x: x.astype("float16").astype("float32")),
    # Negated as read (a computed view over the broadcast): from the stored values too.
    ("n", lambda x: x),
    ("n", lambda x: x[7:200:3, 1:].astype("float64")),
    ("n", lambda x: x.T[::-1, None]),
]


@pytest.mark.parametrize(("key", "view"), _VIEWS, ids=[str(n) for n in range(len(_VIEWS))])
def test_stats_of_a_broadcast_view_are_numpys_from_its_stored_values(
    tmp_path: Path, computed: list[int], key: str, view: Any
) -> None:
    tree = lazyckpt.open(_expanded(tmp_path))
    stored = {"e": np.array([1.5, -2.0, np.nan, np.inf, 0.25], np.float32),
              "i": np.array([-(2**31), 7, 0, 2**31 - 1, 3], np.int32),
              "n": -np.array([1.5, -2.0, np.nan, np.inf, 0.25], np.float32)}[key]  # fmt: skip
    array = view(tree[key])
    want = np.asarray(view(np.broadcast_to(stored, tree[key].shape)))
    found = lazyckpt.stats(array, bins=7)[array.key]
    # (a negated view reads its broadcast's box of stored values, once for the
    # statistics and once for the histogram)
    assert sum(computed) <= (2 * stored.size if key == "n" else 0), "stats went through the repeats"
    finite = want[np.isfinite(want)].astype(np.float64)
    assert (found.size, found.nan, found.inf) == (
        want.size,
        int(np.isnan(want).sum()),
        int(np.isinf(want).sum()),
    )
    assert (found.min, found.max) == (finite.min(), finite.max())
    assert found.mean == pytest.approx(finite.mean(), rel=1e-12)
    assert found.std == pytest.approx(finite.std(), rel=1e-12)
    assert found.histogram is not None
    counts, edges = found.histogram
    assert edges == pytest.approx(np.linspace(finite.min(), finite.max(), 8), rel=1e-12)
    assert counts.tolist() == np.histogram(finite, edges)[0].tolist()


def test_diff_of_broadcast_views_compares_what_they_store(
    tmp_path: Path, computed: list[int]
) -> None:
    tree = lazyckpt.open(_expanded(tmp_path))
    plain = np.broadcast_to(np.arange(1.0, 6.0, dtype=np.float32), (300, 5)).copy()
    cases = {
        "same": (tree["f"], tree["f"]),
        "alike": (tree["f"], tree["g"]),
        "sliced": (tree["f"][::2].astype("float64"), tree["g"][::2].astype("float64")),
        "scalar": (tree["f"], tree["k"]),
        "numpy": (tree["g"], np.broadcast_to(np.arange(1.0, 6.0, dtype=np.float32), (300, 5))),
        "plain": (tree["g"], plain),
    }
    found = lazyckpt.diff(
        {k: a for k, (a, _) in cases.items()}, {k: b for k, (_, b) in cases.items()}, values=True
    )
    changes = {c.path: c for c in found.changes}
    assert changes["same"].kind == "equal"
    for key in ("alike", "sliced", "numpy", "plain"):
        assert (changes[key].kind, changes[key].max_abs, changes[key].max_rel) == (
            "value",
            0.5,
            0.5 / 3.5,
        ), key
    assert (changes["scalar"].kind, changes["scalar"].max_abs, changes["scalar"].max_rel) == (
        "value",
        3.0,
        0.6,
    )
    # The scalar is spread along the row it faces (5 values); only the plain side of
    # 300 rows is compared row by row.
    assert sum(computed) <= 5 + 300 * 5, computed


def test_moved_broadcast_views_are_found_by_what_they_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, computed: list[int]
) -> None:
    """A broadcast view (negated too, NaN among its values) moved to the same values
    stored whole, or the other way round, is found comparing it with its target only:
    each side's digest is taken from what it stores. Every removed view had been
    compared with every added array of its shape until one matched."""
    tree = lazyckpt.open(_expanded(tmp_path))
    rows = {k: np.broadcast_to(np.asarray(tree[k][:1]), (300, 5)).copy() for k in "efg"}
    views = {"a": tree["f"], "b": tree["g"], "c": tree["-f"], "d": tree["e"]}
    whole = {
        "v": np.random.default_rng(0).standard_normal((300, 5)).astype(np.float32),
        "w": rows["g"],
        "x": -rows["f"],
        "y": rows["e"],
        "z": rows["f"],
    }
    compared = value_comparisons(monkeypatch)
    moves = {"a": "z", "b": "w", "c": "x", "d": "y"}
    for first, second, expected in ((views, whole, moves), (whole, views, {
        to: path for path, to in moves.items()
    })):  # fmt: skip
        compared.clear()
        found = lazyckpt.diff(first, second, values=True)
        assert {c.path: c.to for c in found.changes if c.kind == "moved"} == expected
        assert sorted(compared) == sorted(expected)  # its target only
    # The digests read the views' stored rows (5 values); only the comparisons with
    # whole arrays, 4 each way, spread them (to 1,500).
    assert computed.count(1500) == 8 and max(n for n in computed if n != 1500) == 5, computed


def test_diff_of_negated_broadcasts_compares_what_they_store(
    tmp_path: Path, computed: list[int]
) -> None:
    # Each side went through its 1,500 values: negation hid the broadcast below it.
    tree = lazyckpt.open(_expanded(tmp_path))
    found = lazyckpt.diff(
        {"alike": tree["-f"], "flipped": tree["-f"], "same": tree["-g"]},
        {"alike": tree["-g"], "flipped": tree["f"], "same": tree["-g"]},
        values=True,
    )
    changes = {c.path: c for c in found.changes}
    assert (changes["alike"].kind, changes["alike"].max_abs, changes["alike"].max_rel) == (
        "value",
        0.5,
        0.5 / 3.5,
    )
    assert (changes["flipped"].kind, changes["flipped"].max_abs) == ("value", 10.0)
    assert changes["same"].kind == "equal"
    assert sum(computed) <= 3 * 2 * 5, computed


def _round_trip(out: str | Path) -> None:
    """`out` holds `_expandable`'s tensors, every repeat written."""
    got = lazyckpt.load(lazyckpt.open(out))
    np.testing.assert_array_equal(got["big"], np.broadcast_to(np.arange(256.0), (8192, 256)))
    np.testing.assert_array_equal(got["bias"], np.ones((64, 16384), np.float32))


def _expandable(tmp_path: Path) -> Path:
    """`bias`: 64 KiB expanded to 4 MiB (64 times), which saves as it is; `big`: 1 KiB
    expanded to 8 MiB (8192 times), past the bounds as the tests below lower them."""
    storages = {"0": np.ones(16384, np.float32), "1": np.arange(256, dtype=np.float32)}
    tensors = {"bias": ("0", (64, 16384), (0, 1)), "big": ("1", (8192, 256), (0, 1))}
    return _torch_file(tmp_path / "model.pt", storages, tensors)


_FLOOR = "lazyckpt._array.repeats.FLOOR"
"""Lowered from 1 GiB to 4 MiB, so that a test writes a few MiB: the bomb above meets
the real bounds."""


@pytest.mark.parametrize("form", ["orbax", "safetensors"])
def test_save_refuses_a_large_expansion_by_name_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: Any
) -> None:
    monkeypatch.setattr(_FLOOR, 4 << 20)
    tree = lazyckpt.open(_expandable(tmp_path))
    lazyckpt.save(tmp_path / "bias", {"bias": tree["bias"]}, format=form)  # 64 times
    out = tmp_path / "out"
    with pytest.raises(
        lazyckpt.ArgumentError,
        match=r"^big: a view of shape \(8192, 256\) \(float32, 8\.0 MiB\) made of 1\.0 KiB "
        r"stored, repeated .*saving it would write all 8\.0 MiB\. Pass allow_expand=True "
        r"\(lazyckpt convert --allow-expand\) to write every repeat, or save its stored "
        r"values, the view \[:1\] of it",
    ):
        lazyckpt.save(out, tree, format=form)
    assert not out.exists()
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.open(out)
    with pytest.raises(lazyckpt.LazyTypeError, match="allow_expand='yes' is not a bool"):
        lazyckpt.save(out, tree, format=form, allow_expand="yes")  # type: ignore[arg-type]
    lazyckpt.save(out, tree, format=form, allow_expand=True)
    _round_trip(out)


def test_convert_and_its_command_take_allow_expand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_FLOOR, 4 << 20)
    source = str(_expandable(tmp_path))
    with pytest.raises(lazyckpt.ArgumentError, match=r"^big: .*allow_expand=True"):
        lazyckpt.convert(source, tmp_path / "dry", dry_run=True)
    plan = lazyckpt.convert(source, tmp_path / "dry", dry_run=True, allow_expand=True)
    assert plan.nbytes == (4 << 20) + (8 << 20)
    out = tmp_path / "python"
    with pytest.raises(lazyckpt.ArgumentError, match=r"^big: .*--allow-expand"):
        lazyckpt.convert(source, out, to="safetensors")
    assert not out.exists()
    _round_trip(lazyckpt.convert(source, out, to="safetensors", allow_expand=True))
    cli = tmp_path / "cli"
    assert main(["convert", source, str(cli), "--quiet"]) == 1
    assert "lazyckpt: error: big: a view of shape (8192, 256)" in capsys.readouterr().err
    assert not cli.exists()
    assert main(["convert", source, str(cli), "--quiet", "--allow-expand"]) == 0
    _round_trip(cli)


def _modest_and_shared(tmp_path: Path) -> Path:
    """`bias0` to `bias2`: one storage of 64 KiB expanded to 4 MiB each (64 times,
    12 MiB in all); `rep0` to `rep7`: one storage of 1 KiB expanded to 1 MiB each
    (1,024 times, 8 MiB in all); `neg0` to `neg7`, the same negated."""
    storages = {"0": np.ones(16384, np.float32), "1": np.arange(256, dtype=np.float32)}
    tensors = {f"bias{i}": ("0", (64, 16384), (0, 1)) for i in range(3)}
    for kind in ("rep", "neg"):
        tensors.update({f"{kind}{i}": ("1", (1024, 256), (0, 1)) for i in range(8)})
    negated = {f"neg{i}" for i in range(8)}
    return _torch_file(tmp_path / "shared.pt", storages, tensors, negated)


def test_arrays_each_within_the_bounds_are_refused_together_past_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The bounds lowered to 4 MiB (as above): each `rep` (1 MiB) is within them, the
    # eight together (8 MiB over 1 KiB stored) are not. Each array was weighed alone.
    monkeypatch.setattr(_FLOOR, 4 << 20)
    source = _modest_and_shared(tmp_path)
    tree = lazyckpt.open(source)
    biases = {k: v for k, v in tree.items() if k.startswith("bias")}
    reps = {k: v for k, v in tree.items() if k.startswith("rep")}
    # Modest expansions (12 MiB in all, 64 times their one storage) save as they are.
    lazyckpt.save(tmp_path / "biases", biases)
    got = lazyckpt.load(lazyckpt.open(tmp_path / "biases"))
    assert set(got) == set(biases) and all((v == 1).all() for v in got.values())
    assert lazyckpt.stats(biases)["bias2"].mean == 1.0
    refusal = (
        r"saving them would write 8\.0 MiB in all, 8 arrays made of 1\.0 KiB stored: views "
        r"that read the same stored bytes again and again .* The largest: rep0 \(1\.0 MiB\), "
        r"rep1 \(1\.0 MiB\), rep2 \(1\.0 MiB\) and 5 more\. Pass allow_expand=True"
    )
    for form in ("orbax", "safetensors"):
        out = tmp_path / f"reps_{form}"
        with pytest.raises(lazyckpt.ArgumentError, match=refusal):
            lazyckpt.save(out, reps, format=form)
        assert not out.exists()
    with pytest.raises(lazyckpt.ArgumentError, match=refusal.replace("rep", "neg")):
        lazyckpt.save(tmp_path / "negs", {k: tree[k] for k in tree if k.startswith("neg")})
    with pytest.raises(lazyckpt.ArgumentError, match=refusal):
        lazyckpt.convert(source, tmp_path / "dry", dry_run=True, select="rep*")
    assert main(["convert", str(source), str(tmp_path / "cli"), "--select", "rep*", "--quiet"]) == 1
    assert "saving them would write 8.0 MiB in all" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()
    # Fewer of them, or every repeat asked for, are written.
    plan = lazyckpt.convert(source, tmp_path / "dry", dry_run=True, select=["rep0", "rep1"])
    assert plan.nbytes == 2 << 20
    lazyckpt.save(tmp_path / "all", reps, allow_expand=True)
    np.testing.assert_array_equal(
        lazyckpt.load(lazyckpt.open(tmp_path / "all"))["rep7"],
        np.broadcast_to(np.arange(256, dtype=np.float32), (1024, 256)),
    )
    # stats and diff answer from each one's stored values (negated ones too).
    table = lazyckpt.stats(tree, ["rep*", "neg*"])
    assert [(table[f"rep{i}"].mean, table[f"neg{i}"].mean) for i in range(8)] == [
        (127.5, -127.5)
    ] * 8
    found = lazyckpt.diff(tree, lazyckpt.open(source), values=True)
    assert {c.kind for c in found.changes} == {"equal"}


_MANY = 10_000
_GIB = (1 << 14, 1 << 12, 4)  # float32: 1 GiB


def _many(path: Path) -> Path:
    """`b0` to `b9999`: 1 GiB each, repeating one storage of 4 floats; `m0` to
    `m9999`: the same with their negative bit set. 19.5 TiB in a file of 3 MB."""
    tensors = {f"{kind}{i}": ("0", _GIB, (0, 0, 1)) for kind in "bm" for i in range(_MANY)}
    storages = {"0": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}
    return _torch_file(path, storages, tensors, negated={f"m{i}" for i in range(_MANY)})


@pytest.mark.slow
def test_ten_thousand_broadcasts_are_bounded_over_the_whole_call(tmp_path: Path) -> None:
    # Each array is within the bounds (1 GiB). stats went through the negated ones
    # (14 h), diff too (8 h), save and convert wrote 19.5 TiB (their dry run planned
    # it), and load raised a raw OSError (without a memory limit: the OOM killer).
    path = _many(tmp_path / "many.pt")
    other = shutil.copy(path, tmp_path / "copy.pt")
    assert path.stat().st_size < 4 << 20
    out = tmp_path / "out"
    out.mkdir()
    refused = ["orbax", "safetensors", "convert", "convert_st", "dry_run", "cli"]
    cases: list[dict[str, Any]] = [
        {"name": "stats", "do": "stats_json"},
        {"name": "diff", "do": "diff", "other": str(other)},
        {"name": "orbax", "do": "save", "out": str(out / "o")},
        {"name": "safetensors", "do": "save", "out": str(out / "s.safetensors")},
        {"name": "convert", "do": "convert", "out": str(out / "c")},
        {
            "name": "convert_st",
            "do": "convert",
            "out": str(out / "c2"),
            "kwargs": {"to": "safetensors"},
        },
        {"name": "dry_run", "do": "convert", "out": str(out / "d"), "kwargs": {"dry_run": True}},
        {"name": "cli", "do": "convert_cli", "args": [str(out / "cli"), "--to", "safetensors"]},
        {
            "name": "dry_run_one",
            "do": "convert",
            "out": str(out / "d"),
            "kwargs": {"dry_run": True, "select": "m0"},
        },
        {"name": "load", "do": "load"},
    ]
    # (each case opens the file's 20,000 tensors; stats and diff go through each)
    outcomes = run_cases([{**case, "path": str(path)} for case in cases], tmp_path, timeout=900)
    expect(
        outcomes,
        {
            "stats": "ok: ",
            "diff": "ok: ",
            "dry_run_one": "ok: ",
            "load": "lazyckpt:TooLargeError",
            **dict.fromkeys(refused, "lazyckpt:ArgumentError"),
        },
    )
    table = _json(outcomes["stats"])
    assert len(table) == 2 * _MANY
    size = math.prod(_GIB)
    for key, sign in (("b0", 1), ("b9999", 1), ("m0", -1), ("m9999", -1)):
        found = {k: table[key][k] for k in ("elements", "min", "max", "mean", "std")}
        low, high = sorted((sign * 1.0, sign * 4.0))
        assert found == {"elements": size, "min": low, "max": high, "mean": sign * 2.5,
                         "std": math.sqrt(1.25)}, key  # fmt: skip
    changes = _json(outcomes["diff"])
    assert len(changes) == 2 * _MANY and {c["kind"] for c in changes} == {"equal"}
    for name in refused:
        assert outcomes[name].startswith(
            "lazyckpt:ArgumentError: saving them would write 19.5 TiB in all, 20,000 arrays "
            "made of 16 B stored"
        ), (name, outcomes[name])
        assert (
            "The largest: b0 (1.0 GiB), b1 (1.0 GiB), b10 (1.0 GiB) and 19,997 more. Pass "
            "allow_expand=True (lazyckpt convert --allow-expand)"
        ) in outcomes[name], outcomes[name]
    assert "1 array, 1.0 GiB" in outcomes["dry_run_one"], outcomes["dry_run_one"]
    assert outcomes["load"].startswith(
        "lazyckpt:TooLargeError: lazyckpt load: the 20,000 arrays to read need 19.5 TiB in "
        "all, more than this machine's memory and swap"
    ), outcomes["load"]
    assert not list(out.iterdir())


_WINDOW, _WINDOWS = 1 << 17, 1 << 10


def _windows(path: Path) -> Path:
    """`w0` to `w15`: 1,024 overlapping windows of 131,072 floats each (`unfold`,
    strides (1, 1): no stride 0), 512 MiB each, all over one storage of 516 KiB;
    their 16,384 views, stacked, are the most a file may have."""
    storages = {"0": np.arange(_WINDOW + _WINDOWS - 1, dtype=np.float32)}
    tensors = {f"w{i}": ("0", (_WINDOWS, _WINDOW), (1, 1)) for i in range(16)}
    return _torch_file(path, storages, tensors)


def test_overlapping_windows_count_what_they_store_once(tmp_path: Path) -> None:
    # Stored bytes were the sum of the views' (512 MiB each): 8 GiB "stored", so the
    # 8 GiB that stats, diff and save went through was within the bounds.
    path = _windows(tmp_path / "windows.pt")
    other = shutil.copy(path, tmp_path / "copy.pt")
    out = tmp_path / "out"
    out.mkdir()
    cases: list[dict[str, Any]] = [
        {"name": "stats", "do": "stats_json"},
        {"name": "stats_one", "do": "stats_json", "kwargs": {"select": "w3"}},
        {"name": "diff", "do": "diff", "other": str(other)},
        {"name": "save", "do": "save", "out": str(out / "o")},
        {"name": "dry_run", "do": "convert", "out": str(out / "d"), "kwargs": {"dry_run": True}},
    ]
    outcomes = run_cases([{**case, "path": str(path)} for case in cases], tmp_path)
    expect(
        outcomes,
        {
            "stats": "lazyckpt:ArgumentError",
            "stats_one": "ok: ",
            "diff": "lazyckpt:ArgumentError",
            "save": "lazyckpt:ArgumentError",
            "dry_run": "lazyckpt:ArgumentError",
        },
    )
    made = "16 arrays made of 516.0 KiB stored"
    assert outcomes["stats"].startswith(
        f"lazyckpt:ArgumentError: stats would go through 8.0 GiB in all, {made}"
    ), outcomes["stats"]
    assert "Take the statistics of fewer arrays (select=)" in outcomes["stats"]
    assert outcomes["diff"].startswith(
        "lazyckpt:ArgumentError: comparing them would go through 16.0 GiB in all, 16 arrays "
        "made of 1.0 MiB stored"
    ), outcomes["diff"]
    assert "leave values=False" in outcomes["diff"]
    for name in ("save", "dry_run"):
        assert outcomes[name].startswith(
            f"lazyckpt:ArgumentError: saving them would write 8.0 GiB in all, {made}"
        ), outcomes[name]
    one = _json(outcomes["stats_one"])["w3"]
    assert (one["elements"], one["min"], one["max"]) == (
        _WINDOW * _WINDOWS,
        0.0,
        _WINDOW + _WINDOWS - 2.0,
    )
    assert not list(out.iterdir())


def test_moves_among_overlapping_windows_are_refused_before_any_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Windows renamed: the digests of all 16 would go through 8 GiB for 516 KiB stored,
    # which is refused by name as comparisons at one path are. Each pair had been
    # compared instead, 512 MiB a side.
    tree = lazyckpt.open(_windows(tmp_path / "windows.pt"))
    first = {f"old{i}": tree[f"w{i}"] for i in range(8)}
    second = {f"new{i}": tree[f"w{i + 8}"] for i in range(8)}
    refuse_data_reads(monkeypatch)
    refusal = r"comparing them would go through 8\.0 GiB in all, 16 arrays made of 516\.0 KiB"
    with pytest.raises(lazyckpt.ArgumentError, match=refusal):
        lazyckpt.diff(first, second, values=True)
    assert lazyckpt.diff(first, second).counts()["moved"] == 8  # (metadata alone: no read)


def test_a_broadcast_of_overlapping_windows_is_refused_by_save(tmp_path: Path) -> None:
    # 8,192 overlapping windows of 8,192 floats, broadcast 1,024 times: 256 GiB over
    # 64 KiB; counted as 256 MiB stored, it was exactly 1,024 times that, and written.
    storages = {"0": np.arange(16383, dtype=np.float32)}
    path = _torch_file(tmp_path / "w.pt", storages, {"w": ("0", (1024, 8192, 8192), (0, 1, 1))})
    assert path.stat().st_size < 100_000
    out = tmp_path / "out"
    out.mkdir()
    cases: list[dict[str, Any]] = [
        {"name": "orbax", "do": "save", "out": str(out / "o")},
        {"name": "safetensors", "do": "save", "out": str(out / "s.safetensors")},
        {"name": "convert", "do": "convert", "out": str(out / "c")},
        {"name": "dry_run", "do": "convert", "out": str(out / "d"), "kwargs": {"dry_run": True}},
        {"name": "cli", "do": "convert_cli", "args": [str(out / "cli"), "--to", "safetensors"]},
    ]
    outcomes = run_cases([{**case, "path": str(path)} for case in cases], tmp_path)
    expect(outcomes, {case["name"]: "lazyckpt:ArgumentError" for case in cases})
    for name, outcome in outcomes.items():
        assert outcome.startswith(
            "lazyckpt:ArgumentError: w: a view of shape (1024, 8192, 8192) (float32, 256.0 GiB) "
            "made of 64.0 KiB stored"
        ), (name, outcome)
        assert "Pass allow_expand=True" in outcome, outcome
    assert not list(out.iterdir())
