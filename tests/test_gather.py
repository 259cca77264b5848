"""Integer-array and boolean-mask indexing (NumPy's advanced indexing): the same values
and shapes as NumPy on arrays written by Orbax and by the safetensors library, and
reads of only the chunks (or byte ranges) that the picked rows touch."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import lazyckpt
from lazyckpt._array import gather
from tests import strategies
from tests.helpers import orbax_save

SHAPES = {"f32": (8, 12, 6), "i8": (9, 10), "u8": (30,), "bool": (4, 8)}


@pytest.fixture(scope="module")
def zoo(mesh: jax.sharding.Mesh, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same arrays as Orbax saves them (sharded, in chunks; zarr2 and zarr3) and as
    the safetensors library does."""
    rng = np.random.default_rng(11)
    dtypes = {"f32": np.float32, "i8": np.int8, "u8": np.uint8, "bool": np.bool_}
    arrays = {
        name: strategies.values(shape, np.dtype(dtypes[name]), int(rng.integers(1 << 31)))
        for name, shape in SHAPES.items()
    }
    specs = {"f32": ("x", None, "y"), "i8": (None, "y"), "u8": (None,), "bool": ("x", None)}
    tree = {
        name: jax.device_put(
            value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*specs[name]))
        )
        for name, value in arrays.items()
    }
    root = tmp_path_factory.mktemp("gather")
    opened = {
        f"zarr3={zarr3}": lazyckpt.open(orbax_save(root / f"zarr3_{zarr3}", tree, zarr3=zarr3))
        for zarr3 in (False, True)
    }
    save_file(arrays, str(root / "model.safetensors"))
    opened["safetensors"] = lazyckpt.open(root / "model.safetensors")
    return {"expected": arrays, "opened": opened}


@st.composite
def advanced_indices(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """Indices mixing int arrays (negative, repeated, any order, 0-2 dims), masks,
    ints, slices, None and `...`, on any axis."""
    out: list[Any] = []
    dim = 0
    while dim < len(shape):
        size = shape[dim]
        kind = draw(st.sampled_from(["array", "array", "mask", "int", "slice", "none", "rest"]))
        if kind == "none":
            out.append(None)
            continue
        if kind == "rest":
            out.append(Ellipsis)
            break
        if kind == "array":
            dims = draw(st.sampled_from([(), (1,), (2,), (3,), (2, 2), (0,)]))
            count = int(np.prod(dims)) if dims else 1
            values = draw(st.lists(st.integers(-size, size - 1), min_size=count, max_size=count))
            out.append(np.array(values, np.int64).reshape(dims) if dims else values)
        elif kind == "mask":
            bits = draw(st.lists(st.booleans(), min_size=size, max_size=size))
            out.append(np.array(bits))
        elif kind == "int":
            out.append(draw(st.integers(-size, size - 1)))
        else:
            start = draw(st.integers(-size, size) | st.none())
            stop = draw(st.integers(-size, size) | st.none())
            step = draw(st.sampled_from([None, 1, 2, -1, -3]))
            out.append(slice(start, stop, step))
        dim += 1
    return tuple(out)


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_advanced_indexing_matches_numpy(zoo: dict[str, Any], data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(SHAPES)))
    where = data.draw(st.sampled_from(sorted(zoo["opened"])))
    index = data.draw(advanced_indices(SHAPES[name]))
    first = data.draw(st.sampled_from([None, (slice(None, None, -1),), (slice(1, None),)]))
    want, lazy = zoo["expected"][name], zoo["opened"][where][name]
    if first is not None:
        want, lazy = want[first], lazy[first]
    try:
        expected = want[index]
    except IndexError:  # arrays that do not broadcast: NumPy refuses, and so does lazyckpt
        with pytest.raises(lazyckpt.LazyIndexError):
            lazy[index]
        return
    view = lazy[index]
    assert view.shape == expected.shape
    np.testing.assert_array_equal(view.get(), expected)
    if view.ndim >= 2:  # views compose: a transpose and a cast of the picked rows
        np.testing.assert_array_equal(
            view.T.astype(np.float32).get(), expected.T.astype(np.float32)
        )


def test_take_is_numpy_s(zoo: dict[str, Any]) -> None:
    f32 = zoo["opened"]["safetensors"]["f32"]
    want = zoo["expected"]["f32"]
    for indices, axis in (
        ([5, 0, 5, -1], 0),
        ([[1, 2], [3, 4]], 1),
        (np.array([2]), 2),
        ([7, 0], None),
    ):
        np.testing.assert_array_equal(
            lazyckpt.take(f32, indices, axis=axis).get(), np.take(want, indices, axis=axis)
        )
    with pytest.raises(lazyckpt.LazyIndexError, match=r"f32 \(shape \(8, 12, 6\)\): no axis 3"):
        lazyckpt.take(f32, [0], axis=3)


@pytest.fixture(scope="module")
def embedding(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, np.ndarray]:
    """A (4096, 256) float32 table (4 MiB): Orbax with chunks of 256 KiB (256 rows),
    and safetensors."""
    root = tmp_path_factory.mktemp("embedding")
    table = np.random.default_rng(3).standard_normal((4096, 256), dtype=np.float32)
    save_args = {"embed": ocp.SaveArgs(chunk_byte_size=256 << 10)}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        checkpointer.save(
            root / "orbax", args=ocp.args.PyTreeSave({"embed": table}, save_args=save_args)
        )
    save_file({"embed": table}, str(root / "model.safetensors"))
    return root / "orbax", root / "model.safetensors", table


def test_three_rows_read_their_chunks_or_their_bytes(
    embedding: tuple[Path, Path, np.ndarray],
) -> None:
    orbax_path, safetensors_path, table = embedding
    lazy = lazyckpt.open(orbax_path)["embed"]
    assert lazy.chunks == (256, 256)
    rows = [3900, 3, 5]  # two chunks: rows 3 and 5 share one, and its decode
    with lazyckpt.measure() as cost:
        got = lazyckpt.load(lazy[rows])
    np.testing.assert_array_equal(got, table[rows])
    chunk = 256 * 256 * 4
    assert cost.bytes_read <= 2 * chunk * 1.05  # (zstd leaves random floats near their size)
    lazy = lazyckpt.open(safetensors_path)["embed"]
    with lazyckpt.measure() as cost:
        got = lazyckpt.load(lazy[rows])
    np.testing.assert_array_equal(got, table[rows])
    assert cost.bytes_read == 3 * 256 * 4


def test_a_trimmed_table_saved_in_a_budget_reads_each_chunk_once(
    embedding: tuple[Path, Path, np.ndarray], tmp_path: Path
) -> None:
    orbax_path, _, table = embedding
    keep = np.sort(np.random.default_rng(5).choice(4096, 600, replace=False))
    lazy = lazyckpt.open(orbax_path)["embed"]
    with lazyckpt.measure() as cost:
        out = lazyckpt.save(tmp_path / "trimmed", {"embed": lazy[keep]}, memory_budget="16MiB")
    stored = sum(p.stat().st_size for p in orbax_path.rglob("*") if p.is_file())
    assert cost.bytes_read <= stored * 1.05  # every chunk holds kept rows: each read once
    np.testing.assert_array_equal(lazyckpt.open(out)["embed"].get(), table[keep])


def test_picked_experts_compose_with_every_verb(tmp_path: Path) -> None:
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    bank = np.random.default_rng(9).standard_normal((16, 8, 12), dtype=np.float32)
    save_file({"experts": bank}, str(tmp_path / "moe.safetensors"))
    experts = lazyckpt.open(tmp_path / "moe.safetensors")["experts"][[3, 9, 14, 15]]
    want = bank[[3, 9, 14, 15]]
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None, "y"))
    placed = lazyckpt.device_put(experts, sharding)
    np.testing.assert_array_equal(np.asarray(placed), want)
    blocks = list(lazyckpt.iter_blocks({"e": experts}, memory_budget=1024))
    assert sum(block.size for _, _, block in blocks) == want.size
    stats = lazyckpt.stats({"e": experts})
    assert stats["e"].max == pytest.approx(float(want.max()))
    stacked = lazyckpt.stack([experts[0], experts[-1]])
    np.testing.assert_array_equal(stacked.get(), want[[0, -1]])
    out = lazyckpt.save(tmp_path / "picked.safetensors", {"experts": experts.astype(np.float16)})
    np.testing.assert_array_equal(lazyckpt.open(out)["experts"].get(), want.astype(np.float16))
    assert not lazyckpt.diff(
        {"e": experts}, {"e": lazyckpt.open(out)["experts"].astype(np.float32)}, values=False
    )


def test_the_command_line_shows_picked_rows(
    embedding: tuple[Path, Path, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    from lazyckpt._cli.main import main

    _, safetensors_path, table = embedding
    assert main(["show", str(safetensors_path), "embed[[3, 17, -1], :2]"]) == 0
    shown = capsys.readouterr().out
    assert "shape=(3, 2)" in shown
    assert str(np.float32(table[17, 1]))[:6] in shown
    assert main(["show", str(safetensors_path), "embed[[3, 9000]]"]) == 1
    assert "index 9000 is out of bounds for axis 0 of size 4096" in capsys.readouterr().err


def test_streaming_verbs_read_each_chunk_of_picked_rows_once(
    embedding: tuple[Path, Path, np.ndarray], tmp_path: Path
) -> None:
    # Rows picked in runs are streamed in blocks of the view, not run by run: a chunk
    # that holds many runs is read once a block (here the view is one block).
    orbax_path, _, table = embedding
    keep = np.sort(np.random.default_rng(2).choice(2048, 600, replace=False))  # 8 chunks
    assert len(list(gather.runs(keep))) > 300  # hundreds of pieces
    lazy = lazyckpt.open(orbax_path)["embed"][keep]
    stored = sum(p.stat().st_size for p in orbax_path.rglob("*") if p.is_file())
    for name, verb in {
        "stats": lambda: lazyckpt.stats({"e": lazy}),
        "iter_blocks": lambda: list(lazyckpt.iter_blocks({"e": lazy})),
        "save safetensors": lambda: lazyckpt.save(
            tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors", {"e": lazy}
        ),
    }.items():
        with lazyckpt.measure() as cost:
            verb()
        assert cost.bytes_read <= stored * 0.55, name
    many = lazyckpt.open(orbax_path)["embed"][np.arange(1, 4096, 2)]  # every other row
    np.testing.assert_array_equal(many.get(), table[1::2])


def test_a_view_of_too_many_pieces_is_refused_before_it_is_made(
    zoo: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gather, "MAX_PIECES", 4)
    u8 = zoo["opened"]["safetensors"]["u8"]
    assert u8[[0, 1, 2, 9, 20, 21]].shape == (6,)  # 3 runs
    with pytest.raises(lazyckpt.LazyIndexError, match=r"u8 \(shape \(30,\)\): .* makes 5 runs"):
        u8[[0, 2, 9, 20, 27]]
    with pytest.raises(lazyckpt.LazyIndexError, match="take\\(\\) takes an int axis"):
        lazyckpt.take(u8, [1], axis=0.0)  # type: ignore[arg-type]


@st.composite
def _picks(draw: st.DrawFn) -> list[int]:
    """Indices into 64 rows: runs up or down, progressions of small steps, repeats and
    scattered rows, one after another."""
    picks: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        start = draw(st.integers(0, 63))
        step = draw(st.sampled_from([1, -1, 2, -3, 4, 0, 5]))
        length = draw(st.integers(1, 12))
        picks += [start + step * k for k in range(length)]
        picks += draw(st.lists(st.integers(0, 63), max_size=3))
    return [value for value in picks if 0 <= value < 64]


@settings(max_examples=300, deadline=None)
@given(_picks())
def test_runs_pick_the_picks_in_order(picks: list[int]) -> None:
    found = gather.runs(np.array(picks, np.int64))
    rows = np.arange(64)
    assert [int(row) for piece in found for row in rows[piece]] == picks
    assert all(len(rows[piece]) for piece in found)


def test_runs_join_runs_and_progressions() -> None:
    three = [slice(3, 6, 1), slice(9, 10, 1), slice(9, 10, 1)]
    assert gather.runs(np.array([3, 4, 5, 9, 9])) == three
    every_other = np.arange(1, 40, 2)
    assert gather.runs(every_other) == [slice(1, 41, 2)]
    assert gather.runs(np.array([5, 4, 3, 2, 1, 0])) == [slice(5, None, -1)]
    assert len(gather.runs(np.array([0, 2, 4, 6]))) == 4  # a step of 2 joins 8 picks or more


@pytest.mark.parametrize("axes", [1, 2])
def test_millions_of_scattered_picks_are_refused_before_any_piece_is_made(
    zoo: dict[str, Any], axes: int
) -> None:
    """2 million random indices make about as many pieces, far more than one view may
    hold: counted from the indices by NumPy and refused holding a few copies of them.
    (Each piece was made first: 10 million took 10 s and 1.5 GB before the refusal.)"""
    rng = np.random.default_rng(5)
    array = zoo["opened"]["safetensors"]["u8" if axes == 1 else "i8"]
    index = tuple(rng.integers(0, size, 2_000_000) for size in array.shape[:axes])
    tracemalloc.start()
    try:
        with pytest.raises(lazyckpt.LazyIndexError, match="over the 131072 views one picked"):
            array[index]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 24 * 2_000_000, f"{peak / 2e6:.0f} bytes per index"
