"""Files known by their content where their names say nothing: flax's
`save_checkpoint` (`checkpoint_0`, msgpack with no suffix), and each format lazyckpt
reads renamed without its suffix; a name that says one format over bytes of another is
refused by name. Every file is written by its own library (torch's by torch, committed
under tests/fixtures/torch)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flax
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from flax.training import checkpoints
from safetensors.numpy import save_file

import lazyckpt

TORCH = Path(__file__).parent / "fixtures" / "torch"
RNG = np.random.default_rng(3)


def _state(scale: float) -> dict[str, Any]:
    return {
        "params": {
            "dense": {"kernel": RNG.standard_normal((4, 3)).astype(np.float32) * scale},
            "bias": np.arange(3, dtype=np.int32),
        },
        "step": 7,
    }


@pytest.fixture
def flax_files() -> Iterator[None]:
    """flax's `save_checkpoint` as it wrote before Orbax: one msgpack file a step."""
    before = flax.config.flax_use_orbax_checkpointing
    flax.config.update("flax_use_orbax_checkpointing", False)
    yield
    flax.config.update("flax_use_orbax_checkpointing", before)


def _same(tree: Any, expected: Any) -> None:
    got = jax.tree_util.tree_leaves_with_path(lazyckpt.load(tree))
    want = jax.tree_util.tree_leaves_with_path(expected)
    assert [path for path, _ in got] == [path for path, _ in want]
    for (_, value), (_, wanted) in zip(got, want, strict=True):
        np.testing.assert_array_equal(value, wanted)
        assert np.asarray(value).dtype == np.asarray(wanted).dtype


@pytest.mark.usefixtures("flax_files")
@pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")
def test_flax_save_checkpoint_opens_as_a_file_and_as_its_folder(tmp_path: Path) -> None:
    first, latest = _state(1.0), _state(2.0)
    checkpoints.save_checkpoint(tmp_path, first, step=0)
    checkpoints.save_checkpoint(tmp_path, latest, step=5, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_0", "checkpoint_5"]

    file = tmp_path / "checkpoint_0"
    _same(lazyckpt.open(file), serialization.msgpack_restore(file.read_bytes()))
    # The folder opens as flax restores it: the latest step, or the one asked for.
    _same(lazyckpt.open(tmp_path), checkpoints.restore_checkpoint(tmp_path, target=None))
    _same(lazyckpt.open(tmp_path, step=0), checkpoints.restore_checkpoint(tmp_path, None, step=0))
    with pytest.raises(
        lazyckpt.CheckpointNotFoundError, match=r"no flax checkpoint of step 3.*\[0, 5\]"
    ):
        lazyckpt.open(tmp_path, step=3)
    with pytest.raises(
        lazyckpt.NotACheckpointError, match="checkpoint_0 is a weight file, which has no steps"
    ):
        lazyckpt.open(file, step=0)

    headline = lazyckpt.summary(lazyckpt.open(tmp_path), title=str(tmp_path)).text()
    assert headline.splitlines()[0] == f"{tmp_path} (read checkpoint_5): 2 arrays, 60 B"


@pytest.mark.usefixtures("flax_files")
@pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")
def test_a_flax_folder_lists_the_steps_open_picks_from(tmp_path: Path) -> None:
    checkpoints.save_checkpoint(tmp_path, _state(1.0), step=0)
    checkpoints.save_checkpoint(tmp_path, _state(2.0), step=5, keep=2)
    assert lazyckpt.steps(tmp_path) == [0, 5]
    # (what `lazyckpt inspect --step 0` asks: flax's files have no items)
    assert lazyckpt.items(tmp_path, step=0) == {}


@pytest.mark.usefixtures("flax_files")
@pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated:DeprecationWarning")
def test_a_run_folder_with_flax_files_beside_its_steps_is_refused(tmp_path: Path) -> None:
    run = {step: _state(float(step)) for step in (100, 200, 300)}
    with ocp.CheckpointManager(tmp_path) as manager:
        for step in (200, 300):
            manager.save(step, args=ocp.args.StandardSave(run[step]))
    # A leftover of flax's save_checkpoint: flax would restore step 100, Orbax step 300.
    checkpoints.save_checkpoint(tmp_path, run[100], step=100)
    assert (tmp_path / "checkpoint_100").is_file()

    both = r"holds both Orbax checkpoint folders \(steps \[200, 300\]\) and flax .*\[100\]"
    for asked in (None, 100, 300):
        with pytest.raises(lazyckpt.NotACheckpointError, match=both):
            lazyckpt.open(tmp_path, step=asked)
    with pytest.raises(lazyckpt.NotACheckpointError, match=both):
        lazyckpt.steps(tmp_path)
    # What the message says to open, opens.
    _same(lazyckpt.open(tmp_path / "300"), run[300])
    _same(lazyckpt.open(tmp_path / "checkpoint_100"), run[100])


def _renamed(tmp_path: Path, source: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copyfile(source, target)
    return target


def test_each_format_opens_by_its_content_without_a_suffix(tmp_path: Path) -> None:
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.int64)
    arrays: dict[str, np.ndarray] = {"a": a, "b": b}
    save_file(arrays, tmp_path / "w.safetensors")
    np.savez(tmp_path / "w.npz", a=a, b=b)
    np.save(tmp_path / "w.npy", a)
    (tmp_path / "w.msgpack").write_bytes(serialization.to_bytes(arrays))
    named = [
        tmp_path / "w.safetensors",
        tmp_path / "w.npz",
        tmp_path / "w.msgpack",
        TORCH / "state.pt",  # torch's zip format
        TORCH / "state_legacy.pt",  # torch's legacy pickle
    ]
    for i, source in enumerate(named):
        unnamed = _renamed(tmp_path, source, f"weights{i}")
        _same(lazyckpt.open(unnamed), lazyckpt.load(lazyckpt.open(source)))
    # A .npy is named by its file; without a suffix, by the whole name.
    tree = lazyckpt.open(_renamed(tmp_path, tmp_path / "w.npy", "array"))
    np.testing.assert_array_equal(lazyckpt.load(tree["array"]), a)


@pytest.mark.parametrize(
    ("source", "name", "found"),
    [
        ("w.npz", "x.safetensors", "a zip archive"),
        ("w.safetensors", "x.npy", "a safetensors file"),
        ("state.pt", "x.npy", "a zip archive"),
        ("state_legacy.pt", "x.npz", "a legacy torch.save file"),
        ("w.msgpack", "x.pt", "flax msgpack"),
        ("w.safetensors", "x.bin", "a safetensors file"),
    ],
)
def test_a_name_that_says_another_format_is_refused(
    tmp_path: Path, source: str, name: str, found: str
) -> None:
    arrays = {"a": np.arange(6, dtype=np.float32)}
    save_file(arrays, tmp_path / "w.safetensors")
    np.savez(tmp_path / "w.npz", a=arrays["a"])
    (tmp_path / "w.msgpack").write_bytes(serialization.to_bytes(arrays))
    origin = TORCH / source if source.endswith(".pt") else tmp_path / source
    target = _renamed(tmp_path, origin, name)
    suffix = name.rsplit(".", 1)[1]
    with pytest.raises(
        lazyckpt.NotACheckpointError,
        match=rf"x\.{suffix} is named \.{suffix}, .* its first bytes are those of {found}.*Rename it",
    ):
        lazyckpt.open(target)


def test_a_folder_summary_names_the_file_it_read(tmp_path: Path) -> None:
    shutil.copyfile(TORCH / "state.pt", tmp_path / "model.pt")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("trained on a Tuesday")
    tree = lazyckpt.open(tmp_path)
    _same(tree, lazyckpt.load(lazyckpt.open(TORCH / "state.pt")))
    headline = lazyckpt.summary(tree, title=str(tmp_path)).text().splitlines()[0]
    assert headline.startswith(f"{tmp_path} (read model.pt): ")
    # Opened as the file itself, the title already names it.
    itself = lazyckpt.summary(
        lazyckpt.open(tmp_path / "model.pt"), title=str(tmp_path / "model.pt")
    )
    assert "(read" not in itself.text().splitlines()[0]
