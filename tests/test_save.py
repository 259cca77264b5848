"""`save` and `convert`: what they write, Orbax restores and lazyckpt reads back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt import LazyArray
from tests import strategies
from tests.helpers import (
    assert_loaded,
    expected,
    orbax_save,
    rich_tree,
    rss_probe,
    stored_chunk_bytes,
)


def orbax_restore(path: Path) -> Any:
    import orbax.checkpoint as ocp

    with pytest.warns(UserWarning, match="Sharding info not provided"):
        return ocp.PyTreeCheckpointer().restore(path)


def test_orbax_restores_everything_lazyckpt_saves(tmp_path: Path, mesh: Any) -> None:
    tree = rich_tree(mesh)
    path = lazyckpt.save(tmp_path / "ckpt", tree)
    assert_loaded(expected(orbax_restore(Path(path))), expected(tree))


def test_standard_checkpointer_restores_a_train_state(tmp_path: Path, mesh: Any) -> None:
    import orbax.checkpoint as ocp

    state: dict[str, Any] = {
        "params": {"w": jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))},
        "step": jnp.asarray(3, jnp.int32),
    }
    path = lazyckpt.save(tmp_path / "ckpt", state)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = ocp.StandardCheckpointer().restore(path, target)
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(64.0).reshape(8, 8))
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding
    assert restored["step"] == 3


def test_lazyckpt_reads_back_what_it_saved_as_orbax_would(tmp_path: Path, mesh: Any) -> None:
    """Same values, same structure and same saved shardings as an Orbax save of the tree."""
    tree = rich_tree(mesh)
    ours = lazyckpt.open(lazyckpt.save(tmp_path / "ours", tree))
    theirs = lazyckpt.open(orbax_save(tmp_path / "theirs", tree, zarr3=True))
    assert_loaded(lazyckpt.load(ours), expected(tree))

    def described(leaf: Any) -> Any:
        if isinstance(leaf, LazyArray):
            return (leaf.shape, leaf.dtype, leaf.key_impl, leaf.sharding)
        return leaf

    assert [(k, described(v)) for k, v in lazyckpt.leaves(ours)] == [
        (k, described(v)) for k, v in lazyckpt.leaves(theirs)
    ]
    assert ours["sharded"].sharding.spec == P("x", "y")


def test_orbax_save_convert_orbax_restore_is_bit_exact(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, tree = saved
    out = lazyckpt.convert(path, tmp_path / "converted")
    assert_loaded(expected(orbax_restore(Path(out))), expected(tree))


def test_convert_selects_and_casts_floats_only(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, tree = saved
    out = lazyckpt.convert(
        path, tmp_path / "params", select=["params/dense", "params/layers"], dtype=jnp.bfloat16
    )
    restored = orbax_restore(Path(out))
    assert sorted(restored) == ["params"]
    assert sorted(restored["params"]) == ["dense", "layers"]
    kernel = tree["params"]["dense"]["kernel"]
    np.testing.assert_array_equal(
        restored["params"]["dense"]["kernel"], np.asarray(kernel).astype(jnp.bfloat16)
    )
    layer = restored["params"]["layers"][1]["w"]
    assert layer.dtype == np.int8  # integers keep their dtype
    np.testing.assert_array_equal(layer, tree["params"]["layers"][1]["w"])


def test_sliced_and_cast_lazy_arrays_are_saved_as_their_views(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, tree = saved
    opened = lazyckpt.open(path)
    kernel = np.asarray(tree["params"]["dense"]["kernel"])
    views = {
        "rows": opened["params"]["dense"]["kernel"][10:50:3, ::-2].astype(np.float16),
        "column": opened["params"]["dense"]["kernel"][:, 5],
        "cell": opened["params"]["dense"]["kernel"][3, 4],
        "expanded": opened["params"]["dense"]["kernel"][None, 2:4],
    }
    back = lazyckpt.load(lazyckpt.open(lazyckpt.save(tmp_path / "views", views)))
    np.testing.assert_array_equal(back["rows"], kernel[10:50:3, ::-2].astype(np.float16))
    np.testing.assert_array_equal(back["column"], kernel[:, 5])
    np.testing.assert_array_equal(back["cell"], kernel[3, 4])
    np.testing.assert_array_equal(back["expanded"], kernel[None, 2:4])


def test_streaming_reads_each_stored_chunk_once(
    tmp_path: Path, count_bytes: Any, mesh: Any
) -> None:
    value = np.random.default_rng(0).standard_normal((512, 1024), dtype=np.float32)
    source = orbax_save(tmp_path / "src", {"w": jax.device_put(value, NamedSharding(mesh, P("x")))})
    lazy = lazyckpt.open(source)["w"]
    with count_bytes() as read:
        lazyckpt.save(tmp_path / "out", {"w": lazy}, chunk_bytes=128 << 10, memory_budget=1 << 20)
    # The new database's own b-tree reads (its commits) add a few KiB; reading any
    # stored chunk twice would add at least that chunk (~240 KiB).
    stored = stored_chunk_bytes(source, lazy)
    assert stored <= read[0] <= stored + (16 << 10)
    assert min(stored_chunk_bytes(source, lazy[i : i + 1]) for i in range(0, 512, 64)) > 200_000
    np.testing.assert_array_equal(lazyckpt.open(tmp_path / "out")["w"].get(), value)


def test_chunks_are_small_so_a_few_rows_read_little(tmp_path: Path, count_bytes: Any) -> None:
    value = np.random.default_rng(1).standard_normal((4096, 1024), dtype=np.float32)  # 16 MiB
    path = lazyckpt.save(tmp_path / "ckpt", {"w": value}, chunk_bytes=128 << 10)
    lazy = lazyckpt.open(path)["w"]
    assert lazy.chunks == (32, 1024)  # 128 chunks, as 4 MiB chunks cut 512 MiB
    total = stored_chunk_bytes(Path(path), lazy)
    with count_bytes() as read:
        rows = lazy[1000:1041].get()  # 1% of the rows
    np.testing.assert_array_equal(rows, value[1000:1041])
    assert read[0] <= 0.03 * total


def test_saved_sharding_lines_up_with_chunks_and_restores_on_a_mesh(
    tmp_path: Path, mesh: Any
) -> None:
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    sharded = jax.device_put(value, NamedSharding(mesh, P("x", "y")))
    path = lazyckpt.save(tmp_path / "ckpt", {"w": sharded}, chunk_bytes=512)
    lazy = lazyckpt.open(path)["w"]
    assert lazy.sharding.spec == P("x", "y")
    assert lazy.chunks == (8, 16)  # divides the (16, 16) shard
    placed = lazyckpt.device_put({"w": lazy}, lazyckpt.saved_shardings(mesh))["w"]
    assert placed.sharding.spec == P("x", "y")
    np.testing.assert_array_equal(placed, value)
    metadata = json.loads((Path(path) / "_METADATA").read_text())["tree_metadata"]
    assert metadata["('w',)"]["value_metadata"]["write_shape"] == [16, 16]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_convert_stays_within_the_memory_budget(wide: Path, tmp_path: Path) -> None:
    """256 MiB of float32 to bfloat16 at a 96 MiB budget, in a fresh process: it grew
    by 65-91 MiB here, also on a loaded machine, and by 252-306 MiB ignoring the budget
    (a 1 GiB one)."""
    budget = 96 << 20
    out = tmp_path / "bf16"
    probe = rss_probe(wide, "convert", budget, str(out))
    assert probe["peak"] < budget + (64 << 20), probe
    first = lazyckpt.open(out)["layer_0"]
    assert first.dtype == jnp.bfloat16
    source = lazyckpt.open(wide)["layer_0"]
    np.testing.assert_array_equal(first[:7].get(), source[:7].get().astype(jnp.bfloat16))


def test_save_refuses_to_replace_without_overwrite(tmp_path: Path) -> None:
    path = lazyckpt.save(tmp_path / "ckpt", {"a": np.zeros(3)})
    with pytest.raises(lazyckpt.CheckpointExistsError, match=r"already exists; pass overwrite"):
        lazyckpt.save(path, {"a": np.ones(3)})
    lazyckpt.save(path, {"b": np.ones(3)}, overwrite=True)
    assert list(lazyckpt.open(path)) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # nothing left beside it


def test_save_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(
        lazyckpt.CheckpointExistsError, match=r"notes exists and does not look like a checkpoint"
    ):
        lazyckpt.save(tmp_path / "notes", {"a": 1}, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(lazyckpt.CheckpointExistsError, match=r"file exists and is not a folder"):
        lazyckpt.save(tmp_path / "file", {"a": 1}, overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_a_failed_save_leaves_nothing(tmp_path: Path, mesh: Any) -> None:
    value = np.arange(4096, dtype=np.float32).reshape(64, 64)
    source = orbax_save(tmp_path / "src", {"w": jax.device_put(value, NamedSharding(mesh, P("x")))})
    lazy = lazyckpt.open(source)["w"]
    for data_file in source.glob("ocdbt.process_*/d/*"):  # where orbax put the chunks
        data_file.write_bytes(b"\0" * data_file.stat().st_size)
    with pytest.raises(
        lazyckpt.CorruptCheckpointError, match=r"src: reading array 'w' \(stored as 'w'\) failed"
    ):
        lazyckpt.save(tmp_path / "out", {"w": lazy})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_leftover_temporary_folders_never_open_and_never_block(tmp_path: Path) -> None:
    final = tmp_path / "run" / "ckpt_000005"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    import socket

    leftover = Path(f"{final}.orbax-checkpoint-tmp-lazyckpt-{socket.gethostname()}-{dead}-0a1b2c3d")
    lazyckpt.save(tmp_path / "whole", {"w": np.ones(4)})
    shutil.copytree(tmp_path / "whole", leftover)  # complete files, never committed
    with pytest.raises(lazyckpt.UnfinishedCheckpointError, match=r"is an unfinished save"):
        lazyckpt.open(leftover)
    with pytest.raises(lazyckpt.NotACheckpointError, match="no committed step folders"):
        lazyckpt.steps(tmp_path / "run")
    lazyckpt.save(final, {"w": np.zeros(4)})
    assert lazyckpt.steps(tmp_path / "run") == [5]
    assert not leftover.exists()  # its process is gone, so the next save removed it
    np.testing.assert_array_equal(lazyckpt.open(tmp_path / "run")["w"].get(), np.zeros(4))


def test_only_folders_named_with_a_pid_as_written_are_leftovers(tmp_path: Path) -> None:
    """Folders beside the target named like this host's leftovers but for their pid,
    which lazyckpt never wrote so: Unicode digits (`\u0669` * 7 was pid 9999999, gone, so
    the folder was deleted), a leading zero, and a pid past a C int (os.kill raised
    its raw OverflowError from save). Each stays, and the save succeeds."""
    import socket

    final = tmp_path / "ckpt"
    prefix = f"{final}.orbax-checkpoint-tmp-lazyckpt-{socket.gethostname()}-"
    others = [Path(f"{prefix}{pid}-0a1b2c3d") for pid in ("\u0669" * 7, "09999999", "9" * 12)]
    for other in others:
        other.mkdir()
        (other / "keep").write_text("not lazyckpt's")
    lazyckpt.save(final, {"w": np.zeros(4)})
    assert all((other / "keep").exists() for other in others)
    np.testing.assert_array_equal(lazyckpt.open(final)["w"].get(), np.zeros(4))


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"a": object()}, r"a: cannot save a builtins.object"),
        ({"x.y": {"z": 1}, "x": {"y.z": 2}}, r"would both be stored as 'x.y.z'"),
        (
            {"a/b": np.zeros(2), "a": {"b": np.ones(3)}},
            r"keys \('a', 'b'\) and \('a/b',\) would both read back as 'a/b'",
        ),
        ({"a~b": "text"}, r"'~' must be followed by '0' or '1'"),
        ({"s": np.zeros(2, [("a", "i4"), ("b", "f4")])}, r"s: a NumPy array of dtype"),
        ({"t": np.datetime64("2026-01-01")}, r"t: a scalar of dtype datetime64"),
        ({"big": 2**70}, r"big: the int 1180591620717411303424 does not fit the int64"),
        ({(1, 2): np.zeros(2)}, r"dict key \(1, 2\) is a tuple"),
        ({"s": np.array(["a", "b"])}, r"s: a NumPy array of dtype <U1 cannot be stored"),
        ({"e": "one", "e/f": "two"}, r"nests under another string leaf"),
        (
            {"q": np.zeros(4, ml_dtypes.uint4)},
            r"q: a NumPy array of dtype uint4 cannot be stored: tensorstore's zarr3 driver.*"
            r"cast it \(astype\) to a wider one",
        ),
    ],
)
def test_unsavable_trees_are_refused_before_writing(
    tmp_path: Path, tree: Any, message: str
) -> None:
    with pytest.raises(lazyckpt.UnsavableError, match=message):
        lazyckpt.save(tmp_path / "ckpt", tree)
    assert not any(tmp_path.iterdir())


def test_names_that_look_like_paths_are_saved_as_orbax_saves_them(tmp_path: Path) -> None:
    """Names with '.', '..' or empty parts are keys in the OCDBT database, not paths:
    Orbax saves and restores them, and a checkpoint holding them (which lazyckpt opens)
    saves again, for Orbax and lazyckpt alike."""
    import orbax.checkpoint as ocp

    tree = {
        "..": np.arange(3.0),
        "a/./b": np.ones(2, np.int32),
        "trail/": np.arange(5, dtype=np.int16),
        "a//b": np.zeros(3),
        "ok": np.zeros(2),
    }
    path = lazyckpt.save(tmp_path / "ckpt", tree)
    back = lazyckpt.load(lazyckpt.open(path))
    restored = ocp.PyTreeCheckpointer().restore(path)
    for key, array in tree.items():
        np.testing.assert_array_equal(back[key], array)
        np.testing.assert_array_equal(np.asarray(restored[key]), array)


def test_safetensors_names_that_read_alike_as_key_paths_are_refused_by_orbax(
    tmp_path: Path,
) -> None:
    """'a.b' and 'a/b' are two names in safetensors, but as a tree ('a' holding 'b',
    and 'a/b') both key paths read 'a/b': an Orbax copy would lose one from
    `open(flat=True)`, so it is refused naming both, as a safetensors save is."""
    from safetensors.numpy import save_file

    source = tmp_path / "two.safetensors"
    save_file({"a.b": np.ones(2, np.float32), "a/b": np.zeros(3, np.float32)}, str(source))
    assert sorted(lazyckpt.open(source, flat=True)) == ["a.b", "a/b"]
    with pytest.raises(lazyckpt.UnsavableError, match=r"would both read back as 'a/b'"):
        lazyckpt.convert(source, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.safetensors"]


def test_cli_convert(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, tree = saved
    out = tmp_path / "cli"
    command = [sys.executable, "-m", "lazyckpt._cli.main", "convert", str(path), str(out)]
    options = ["--select", "opt_state/**", "--dtype", "float16", "--memory-budget", "1MiB"]
    result = subprocess.run(
        [*command, *options, "--quiet"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out} (")
    converted = lazyckpt.load(lazyckpt.open(out))
    np.testing.assert_array_equal(
        converted["opt_state"]["mu"], np.asarray(tree["opt_state"]["mu"]).astype(np.float16)
    )
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"lazyckpt: error: {out} already exists; pass overwrite=True (--overwrite) to "
        "replace it, or choose a new path"
    ]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_save_then_open_round_trips_random_arrays_and_views(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    value, saved_value = data.draw(strategies.saved_arrays(mesh))
    chunk_bytes = data.draw(st.sampled_from([1, 7, 64, 4 << 20]))
    folder = tmp_path_factory.mktemp("round-trip")
    first = lazyckpt.save(folder / "a", {"v": saved_value}, chunk_bytes=chunk_bytes)
    lazy = lazyckpt.open(first)["v"]
    np.testing.assert_array_equal(lazy.get(), value)
    index = tuple(
        data.draw(st.slices(n)) if data.draw(st.booleans()) else slice(None) for n in value.shape
    )
    view = lazy[index]
    second = lazyckpt.save(folder / "b", {"v": view}, chunk_bytes=chunk_bytes)
    np.testing.assert_array_equal(lazyckpt.open(second)["v"].get(), value[index])


def test_empty_containers_of_every_kind_survive(tmp_path: Path) -> None:
    """optax's EmptyState, OrderedDicts: Orbax records them; so must lazyckpt."""
    import collections

    import orbax.checkpoint as ocp

    EmptyState = collections.namedtuple("EmptyState", [])
    tree = {
        "opt": (EmptyState(), {"mu": np.ones(3, np.float32)}),
        "od": collections.OrderedDict(),
        "nested": {"inner": {}},
    }
    path = lazyckpt.save(tmp_path / "ckpt", tree)
    opened = lazyckpt.open(path)
    assert opened["opt"][0] is None and opened["od"] == {} and opened["nested"] == {"inner": {}}
    target = {"opt": (None, {"mu": np.zeros(3, np.float32)}), "od": {}, "nested": {"inner": {}}}
    restored = ocp.StandardCheckpointer().restore(path, target)
    np.testing.assert_array_equal(restored["opt"][1]["mu"], np.ones(3, np.float32))


def test_a_tree_without_arrays_opens(tmp_path: Path) -> None:
    path = lazyckpt.save(tmp_path / "ckpt", {"note": "hi", "n": None, "rate": 0.5})
    assert lazyckpt.open(path) == {"n": None, "note": "hi", "rate": 0.5}


def test_cleanup_spares_saves_of_hosts_whose_names_extend_ours(tmp_path: Path) -> None:
    import socket

    final = tmp_path / "ckpt"
    other = Path(f"{final}.orbax-checkpoint-tmp-lazyckpt-{socket.gethostname()}-7-123-0a1b2c3d")
    other.mkdir()  # host "<ours>-7", pid 123: not ours to judge
    lazyckpt.save(final, {"a": np.zeros(2)})
    assert other.exists()


def test_jax_shards_that_cut_through_chunks_are_assembled_per_block(
    tmp_path: Path, mesh: Any
) -> None:
    value = np.arange(56 * 3, dtype=np.float32).reshape(56, 3)
    sharded = jax.device_put(value, NamedSharding(mesh, P("x")))  # 14-row shards
    path = lazyckpt.save(tmp_path / "ckpt", {"w": sharded}, chunk_bytes=5 * 3 * 4)
    lazy = lazyckpt.open(path)["w"]
    assert 14 % lazy.chunks[0] != 0  # an even split of 14 rows, not a divisor
    np.testing.assert_array_equal(lazy.get(), value)


def test_streaming_blocks_stay_whole_new_chunks_when_the_grids_disagree(
    tmp_path: Path,
) -> None:
    from lazyckpt._engine.bands import widened

    value = np.zeros((400, 4096), np.float32)
    path = lazyckpt.save(tmp_path / "src", {"w": value}, chunk_bytes=4 * 4096 * 4)
    lazy = lazyckpt.open(path)["w"]
    assert lazy.chunks == (4, 4096)
    # New 5-row chunks: the common grid (20 rows) is 5 stored chunks, more than the
    # budget's block, so blocks stay single new chunks.
    assert widened(lazy, (5, 4096), 8, 50 << 10) == (5, 4096)
    # New 2-row chunks divide the stored ones: blocks are whole stored chunks.
    assert widened(lazy, (2, 4096), 8, 50 << 10) == (4, 4096)


def test_a_folder_of_step_checkpoints_opens_as_a_run(tmp_path: Path) -> None:
    """Checkpoints saved straight into `run/<step>` make a CheckpointManager-like root."""
    for step in (100, 200):
        lazyckpt.save(tmp_path / "run" / str(step), {"step": step, "w": np.full(2, step)})
    assert lazyckpt.steps(tmp_path / "run") == [100, 200]
    assert lazyckpt.open(tmp_path / "run")["step"] == 200
    assert lazyckpt.open(tmp_path / "run", step=100)["step"] == 100
