"""Bad paths and damaged checkpoints give errors that name the path and the fix."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from lazyckpt import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LazyckptError,
    NotACheckpointError,
    UnfinishedCheckpointError,
)
from tests.conftest import orbax_manager_save


def test_error_classes_inherit_builtins() -> None:
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)
    for cls in (NotACheckpointError, UnfinishedCheckpointError, CorruptCheckpointError):
        assert issubclass(cls, ValueError) and issubclass(cls, LazyckptError)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=rf"{tmp_path}/nope does not exist; check"):
        lazyckpt.open(tmp_path / "nope")


def test_a_file_is_not_a_checkpoint(small: Path) -> None:
    with pytest.raises(
        NotACheckpointError,
        match=r"_METADATA is a file, but a checkpoint is a "
        r"folder; pass the folder",
    ):
        lazyckpt.open(small / "_METADATA")


def test_a_folder_without_checkpoint_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        NotACheckpointError,
        match=rf"{tmp_path} is not an Orbax checkpoint: it has "
        r"no _METADATA.*found \['notes.txt'\]",
    ):
        lazyckpt.open(tmp_path)


def test_unfinished_save_is_refused(small: Path) -> None:
    unfinished = small.with_name("small.orbax-checkpoint-tmp-1795967929766420")
    small.rename(unfinished)
    with pytest.raises(
        UnfinishedCheckpointError,
        match=r"is an unfinished save .*never "
        r"committed.*open a committed step instead",
    ):
        lazyckpt.open(unfinished)


def test_manager_root_steps_and_items(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    root = orbax_manager_save(
        tmp_path / "run",
        {
            step: {
                "state": ocp.args.StandardSave({"w": np.full((4,), step, np.float32)}),
                "extra": ocp.args.JsonSave({"step": step}),
            }
            for step in (1, 2)
        },
    )
    (root / "ckpt_000003.orbax-checkpoint-tmp").mkdir()  # an unfinished save: skipped
    np.testing.assert_array_equal(lazyckpt.open(root)["w"].get(), np.full(4, 2, np.float32))
    np.testing.assert_array_equal(lazyckpt.open(root, step=1)["w"].get(), np.ones(4, np.float32))
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"has no committed step 3; committed "
        r"steps: \[1, 2\]",
    ):
        lazyckpt.open(root, step=3)
    assert lazyckpt.items(root) == {"extra": "json", "state": "pytree"}
    assert lazyckpt.open(root, item="extra") == {"step": 2}  # a JSON item: its value
    assert lazyckpt.open(root, step=1, item="extra") == {"step": 1}
    (root / "ckpt_000002" / "notes").mkdir()
    (root / "ckpt_000002" / "notes" / "readme.txt").write_text("not an item")
    with pytest.raises(
        NotACheckpointError,
        match=r"item 'notes' in .*ckpt_000002 is neither a PyTree nor a JSON item \(it holds "
        r"\['readme.txt'\]\); items: \{'extra': 'json', 'state': 'pytree'\}",
    ):
        lazyckpt.open(root, item="notes")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"ckpt_000002 has no item 'other'; items "
        r"present: \['extra', 'state'\]",
    ):
        lazyckpt.open(root, item="other")
    shutil.rmtree(root / "ckpt_000002" / "state")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"item 'state' is listed in .*ckpt_000002/"
        r"_CHECKPOINT_METADATA but its folder is missing",
    ):
        lazyckpt.open(root / "ckpt_000002", item="state")


def test_cli_error_is_one_line(tmp_path: Path, capsys: Any) -> None:
    from lazyckpt._cli import main

    assert main(["demo", "--keep", str(tmp_path)]) == 1  # the folder exists already
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lazyckpt: error: ")
