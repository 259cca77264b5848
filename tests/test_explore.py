"""Exploring checkpoints: summaries, treescope, statistics, diffs and the commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt import LazyArray
from tests.helpers import orbax_manager_save, orbax_save, refuse_data_reads

ROOT = Path(__file__).parent.parent


def test_summary_shows_every_leaf_with_metadata_and_reads_nothing(
    saved: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = saved
    tree = lazyckpt.open(path)  # reads the scalars (step, lr), as open does
    refuse_data_reads(monkeypatch)
    summary = lazyckpt.summary(tree, title="ref")
    text = str(summary)
    assert text.splitlines()[0] == "ref: 9 arrays, 64.5 KiB"
    kernel_line = next(line for line in text.splitlines() if line.strip().startswith("kernel"))
    assert kernel_line.split() == [
        "kernel", "float32[64,128]", "32.0", "KiB", "P('x',", "'y')", "mesh", "x=4", "y=2"
    ]  # fmt: skip
    assert "  name" not in text and "name" in text and "'run-1'" in text
    rows = {row["path"]: row for row in summary.describe()}
    assert rows["params"] == {"path": "params", "kind": "tree", "arrays": 5, "nbytes": 33184}
    assert rows["params/embed"]["sharding"] == {
        "kind": "NamedSharding", "mesh": {"x": 4, "y": 2}, "spec": ["x", None]
    }  # fmt: skip
    assert rows["step"] == {"path": "step", "kind": "value", "value": 7}
    html = summary._repr_html_()
    for key in ("params/dense/kernel", "opt_state/mask", "np_array"):
        assert f'data-path="{key}"' in html
    assert "float32[64,128]" in html and "P(&#x27;x&#x27;, &#x27;y&#x27;)" in html


def test_summary_orders_numbered_keys_of_any_length(tmp_path: Path) -> None:
    """Keys of digits show in numeric order, one of 5,000 digits too (int() raised its
    raw ValueError); keys of Unicode digits are no numbers and keep their order."""
    layers = {"10": np.ones(2), "2": np.ones(2), "9" * 5000: np.ones(3), "002": np.ones(1)}
    path = orbax_save(tmp_path / "ckpt", {"layers": layers, "other": {"\u0661": 1, "0": 2}})
    rows = [row["path"] for row in lazyckpt.summary(lazyckpt.open(path), fold=False).describe()]
    assert rows[1:5] == ["layers/002", "layers/2", "layers/10", "layers/" + "9" * 5000]
    assert rows[6:] == ["other/0", "other/\u0661"]  # (jax's string order, as opened)


@pytest.mark.slow
def test_summary_of_10000_arrays_reads_nothing(tmp_path: Path, no_data_reads: None) -> None:
    tree = {f"layer_{i:03d}": {f"p{j:02d}": np.zeros(2, np.float32) for j in range(100)}
            for i in range(100)}  # fmt: skip
    path = tmp_path / "many"
    lazyckpt.save(path, tree)  # NumPy leaves: saving reads nothing either
    opened = lazyckpt.open(path)
    summary = lazyckpt.summary(opened, fold=False)
    html = summary._repr_html_()
    assert html.count('class="row leaf"') == 10_000
    assert str(summary).count("float32[2]") == 10_000
    assert html.count("<details open") == 100  # the first level only, for so many rows
    # Folded, zero-padded numbers too: one row, and a pattern that selects it all.
    folded = lazyckpt.summary(opened)
    assert str(folded) == "layer_{000..099}/p{00..99}  10,000 x float32[2]  78.1 KiB"
    assert len(list(lazyckpt.leaves(lazyckpt.select(opened, folded.rows[1].name)))) == 10_000


def test_lazy_array_html_and_treescope_show_metadata_only(
    saved: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import treescope

    path, _ = saved
    tree = lazyckpt.open(path)
    refuse_data_reads(monkeypatch)
    html = tree["params"]["dense"]["kernel"]._repr_html_()
    assert "params/dense/kernel" in html and "float32[64,128]" in html
    text = treescope.render_to_text(tree)
    assert "LazyArray('params/dense/kernel', shape=(64, 128), dtype=float32, chunks=" in text
    assert treescope.render_to_html(tree)  # the notebook form renders too


def _with_specials(value: np.ndarray) -> np.ndarray:
    flat = value.reshape(-1)
    flat[[3, 500, 7000]] = [np.nan, np.inf, -np.inf]
    return value


def test_stats_equal_numpy_on_the_loaded_array(tmp_path: Path, mesh: Any) -> None:
    rng = np.random.default_rng(7)
    values = {
        "f32": _with_specials(rng.standard_normal((256, 64), dtype=np.float32) * 3 + 1),
        "bf16": rng.standard_normal((64, 64)).astype(jnp.bfloat16),
        "i8": rng.integers(-128, 127, (100, 10), dtype=np.int8),
        "flags": rng.random(77) > 0.3,
        "c64": np.ones(4, np.complex64),  # not summarized in a tree
    }
    tree = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in values.items()}
    path = orbax_save(tmp_path / "ckpt", tree, zarr3=True)
    results = lazyckpt.stats(lazyckpt.open(path), bins=7, memory_budget=4096)
    assert sorted(results) == ["bf16", "f32", "flags", "i8"]
    for key, s in results.items():
        value = values[key]
        finite = value[np.isfinite(value.astype(np.float64))].astype(np.float64)
        assert (s.size, s.nan, s.inf) == (
            value.size, int(np.isnan(value.astype(np.float64)).sum()),
            int(np.isinf(value.astype(np.float64)).sum()),
        ), key  # fmt: skip
        assert s.min == finite.min() and s.max == finite.max(), key
        assert s.mean == pytest.approx(finite.mean(), rel=1e-12, abs=1e-12), key
        assert s.std == pytest.approx(finite.std(), rel=1e-12, abs=1e-12), key
        counts, edges = np.histogram(finite, 7, (finite.min(), finite.max()))
        assert s.histogram is not None, key
        np.testing.assert_array_equal(s.histogram[0], counts)
        np.testing.assert_allclose(s.histogram[1], edges)
    with pytest.raises(lazyckpt.LazyTypeError, match="c64: statistics need real"):
        lazyckpt.stats(lazyckpt.open(path)["c64"])


def test_diff_structure_from_metadata_alone(
    tmp_path: Path, mesh: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = {"w": np.zeros((4, 4), np.float32), "b": np.ones(4, np.float32), "step": 1,
         "old": {"x": np.arange(3)}, "keep": np.arange(5)}  # fmt: skip
    b = {"w": np.zeros((4, 5), np.float32), "b": np.ones(4, np.float16), "step": 2,
         "new": {"x": np.arange(3)}, "keep": np.arange(5), "extra": "hi"}  # fmt: skip
    first = lazyckpt.open(lazyckpt.save(tmp_path / "a", a))
    second = lazyckpt.open(lazyckpt.save(tmp_path / "b", b))
    refuse_data_reads(monkeypatch)
    result = lazyckpt.diff(first, second)
    kinds = {c.path: c.kind for c in result.changes}
    assert kinds == {
        "w": "shape", "b": "dtype", "step": "value", "old/x": "moved", "keep": "equal",
        "extra": "added",
    }  # fmt: skip
    moved = next(c for c in result.changes if c.kind == "moved")
    assert moved.to == "new/x"
    assert bool(result) and result.counts()["equal"] == 1
    assert str(result).splitlines()[1:] == [
        "~ b  dtype: float32[4] -> float16[4]",
        "> old/x -> new/x  int64[3]",
        "~ step  value: 1 -> 2",
        "~ w  shape: float32[4,4] -> float32[4,5]",
        "+ extra  'hi'",
    ]


def test_diff_values_block_by_block_match_numpy(tmp_path: Path, count_bytes: Any) -> None:
    rng = np.random.default_rng(3)
    before = rng.standard_normal((512, 256)).astype(np.float32)
    after = before.copy()
    after[100, 7] += 0.5
    after[400, 9] = np.nan
    before[3, 3] = after[3, 3] = np.nan  # NaN in both places: equal
    same = rng.integers(0, 9, (64, 64), dtype=np.int32)
    a = lazyckpt.save(tmp_path / "a", {"w": before, "same": same}, chunk_bytes=64 << 10)
    b = lazyckpt.save(tmp_path / "b", {"w": after, "same": same}, chunk_bytes=64 << 10)
    with count_bytes() as read:
        result = lazyckpt.diff(a, b, values=True, memory_budget=256 << 10)
    changes = {c.path: c for c in result.changes}
    assert changes["same"].kind == "equal"
    w = changes["w"]
    assert w.kind == "value" and w.max_abs == np.inf and w.max_rel == np.inf
    after[400, 9] = before[400, 9]  # without the NaN, the largest change is the 0.5
    b2 = lazyckpt.save(tmp_path / "b2", {"w": after, "same": same})
    w2 = next(c for c in lazyckpt.diff(a, b2, values=True).changes if c.path == "w")
    delta = np.abs(after.astype(np.float64) - before)
    assert w2.max_abs == pytest.approx(np.nanmax(delta))
    scale = np.maximum(np.abs(after), np.abs(before)).astype(np.float64)
    assert w2.max_rel == pytest.approx(np.nanmax(delta / np.where(scale == 0, 1, scale)))
    stored = sum(f.stat().st_size for f in Path(a).rglob("d/*")) + sum(
        f.stat().st_size for f in Path(b).rglob("d/*")
    )
    assert read[0] <= stored * 1.05  # each side's chunks once


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lazyckpt._cli.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CheckpointManager root written by orbax: steps 10 and 20."""
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("manager") / "run"
    embed = np.arange(40 * 16, dtype=np.float32).reshape(40, 16)
    steps: dict[int, dict[str, Any]] = {
        step: {
            "state": ocp.args.StandardSave(
                {"params": {"embed": embed * step, "bias": np.full(4, step, np.float32)}}
            )
        }
        for step in (10, 20)
    }
    steps[20]["meta"] = ocp.args.JsonSave({"lr": 0.1})
    return orbax_manager_save(root, steps)


@pytest.mark.slow
def test_cli_inspect_lists_steps_and_the_tree(run_root: Path) -> None:
    result = _cli("inspect", str(run_root))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    title = f"{run_root} (steps: 10, 20; showing 20; item state; also: meta): 2 arrays, 2.5 KiB"
    assert lines[0] == title
    assert "  embed  float32[40,16]  2.5 KiB" in lines
    older = _cli("inspect", str(run_root), "--step", "10", "--depth", "1").stdout.splitlines()
    assert older == [
        f"{run_root} (steps: 10, 20; showing 10; item state): 2 arrays, 2.5 KiB",
        "params/  2 arrays  2.5 KiB",
    ]
    meta = _cli("inspect", str(run_root), "--item", "meta").stdout.splitlines()
    assert meta[0].startswith(f"{run_root} (steps: 10, 20; showing 20; item meta; also: state)")
    as_json = json.loads(_cli("inspect", str(run_root), "--step", "10", "--json").stdout)
    assert as_json["steps"] == [10, 20]
    paths = [leaf["path"] for leaf in as_json["leaves"]]
    assert paths == ["params", "params/bias", "params/embed"]
    only = json.loads(_cli("inspect", str(run_root), "--select", "**/bias", "--json").stdout)
    assert [leaf["path"] for leaf in only["leaves"]] == ["params", "params/bias"]


def test_cli_show_stats_diff(run_root: Path) -> None:
    shown = _cli("show", str(run_root), "params/embed[1:3, :4]", "--step", "10")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[1:] == ["[[160. 170. 180. 190.]", " [320. 330. 340. 350.]]"]
    stats = json.loads(_cli("stats", str(run_root), "--json", "--bins", "2").stdout)
    assert stats["params/bias"]["mean"] == 20.0
    assert stats["params/embed"]["histogram"]["counts"] == [320, 320]
    diff = _cli("diff", str(run_root), str(run_root), "--step", "10", "20", "--values",
                "--exit-code")  # fmt: skip
    assert diff.returncode == 1
    assert diff.stdout.splitlines()[0] == "2 value (metadata and values)"
    assert "~ params/embed  value: float32[40,16] -> float32[40,16]  max abs 6390" in diff.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("inspect", "/nonexistent/ckpt"), "lazyckpt: error: /nonexistent/ckpt does not exist"),
        (("show", "{root}", "params/nope"), "lazyckpt: error: no key 'params/nope'"),
        (("show", "{root}", "params/embed[1, q]"), "'q' is not an integer"),
        (("show", "{root}", "params/embed[\u0661]"), "'\u0661' is not an integer"),
        (("show", "{root}", f"params/embed[{'9' * 5000}]"), "999... (5002 characters) is not an"),
        (("show", "{root}", "params/embed[99]"), "index 99 is out of range"),
        (("inspect", "{root}", "--step", "7"), "step 7"),
    ],
)
def test_cli_errors_are_one_line(run_root: Path, args: tuple[str, ...], message: str) -> None:
    result = _cli(*(a.format(root=run_root) for a in args))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_cli_traceback_on_request(run_root: Path) -> None:
    result = _cli("--traceback", "show", str(run_root), "params/nope")
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr


def test_stats_reads_within_budget_and_reports_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    value = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
    path = lazyckpt.save(tmp_path / "ckpt", {"w": value}, chunk_bytes=16 << 10)
    s = lazyckpt.stats(lazyckpt.open(path), memory_budget=64 << 10, progress=True)["w"]
    assert s.max == 65535.0 and s.mean == pytest.approx(value.mean(dtype=np.float64))
    assert "lazyckpt stats: 100%|" in capsys.readouterr().err
    assert isinstance(lazyckpt.open(path)["w"], LazyArray)


def test_cli_inspect_reads_only_what_open_reads(
    saved: tuple[Path, dict[str, Any]], count_bytes: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from lazyckpt._cli.main import main

    path, _ = saved
    with count_bytes() as opening:
        lazyckpt.open(path)
    with count_bytes() as inspecting:
        assert main(["inspect", str(path)]) == 0
    assert "kernel" in capsys.readouterr().out
    assert inspecting[0] == opening[0]  # metadata (and the inline scalars); no chunk
