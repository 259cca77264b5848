"""Bad paths and damaged checkpoints give errors that name the path and the fix."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, cast

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
from tests.helpers import orbax_manager_save, orbax_save


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
        match=r"has no committed step 5; committed "
        r"steps: \[1, 2\]",
    ):
        lazyckpt.open(root, step=5)
    with pytest.raises(
        lazyckpt.UnfinishedCheckpointError,
        match=r"has no committed step 3, but ckpt_000003\.orbax-checkpoint-tmp is a save of it",
    ):
        lazyckpt.open(root, step=3)
    for bad in ("2", 2.0, True):
        with pytest.raises(NotACheckpointError, match=r"run: step=.* but steps are whole"):
            lazyckpt.open(root, step=cast(Any, bad))
        with pytest.raises(NotACheckpointError, match=r"run: step=.* but steps are whole"):
            lazyckpt.items(root, step=cast(Any, bad))
    np.testing.assert_array_equal(
        lazyckpt.open(root, step=cast(Any, np.int64(1)))["w"].get(), np.ones(4)
    )
    (root / "ckpt_000004.orbax-checkpoint-tmp-7").mkdir()  # (only its unfinished save)
    with pytest.raises(
        lazyckpt.UnfinishedCheckpointError,
        match=r"ckpt_000004 does not exist, but .*ckpt_000004\.orbax-checkpoint-tmp-7 does: "
        r"a save to it that has not committed",
    ):
        lazyckpt.open(root / "ckpt_000004")
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
    from lazyckpt._cli.main import main

    assert main(["demo", "--keep", str(tmp_path)]) == 1  # the folder exists already
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lazyckpt: error: ")


def test_a_listed_item_whose_folder_is_missing(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    root = orbax_manager_save(
        tmp_path / "run", {1: {"state": ocp.args.StandardSave({"w": np.zeros(2)})}}
    )
    shutil.rmtree(root / "ckpt_000001" / "state")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"ckpt_000001/_CHECKPOINT_METADATA lists the item\(s\) \['state'\], but their "
        r"folders are missing .*copy it again",
    ):
        lazyckpt.open(root / "ckpt_000001")


def test_step_naming_follows_orbax(tmp_path: Path) -> None:
    """Separate checkpoints side by side (`a_0`, `b_0`) are no run: Orbax lists no steps
    there, and lazyckpt says so rather than picking one. One prefix is one run."""
    import orbax.checkpoint as ocp

    side_by_side = tmp_path / "exports"
    for name in ("model_0", "tokenizer_0", "ema_3"):
        orbax_save(side_by_side / name, {"w": np.zeros(2, np.float32)})
    with ocp.CheckpointManager(side_by_side) as manager:
        assert list(manager.all_steps()) == []
    with pytest.raises(
        NotACheckpointError,
        match=r"exports is not a CheckpointManager root: its step-like folders .*'model_0'.* "
        r"have 3 different prefixes .*separate checkpoints",
    ):
        lazyckpt.steps(side_by_side)
    with pytest.raises(NotACheckpointError, match=r"holds separate checkpoints .*open one of them"):
        lazyckpt.open(side_by_side)
    assert lazyckpt.open(side_by_side / "ema_3")["w"].shape == (2,)

    twice = tmp_path / "twice"
    for name in ("ckpt_1", "ckpt_01"):
        orbax_save(twice / name, {"w": np.zeros(2, np.float32)})
    with pytest.raises(
        NotACheckpointError,
        match=r"twice is not a CheckpointManager root: its step-like folders "
        r"\['ckpt_01', 'ckpt_1'\] .*repeat a step",
    ):
        lazyckpt.steps(twice)

    run = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(step_prefix="run")
    with ocp.CheckpointManager(run, options=options) as manager:
        for step in (2, 7):
            manager.save(step, args=ocp.args.StandardSave({"w": np.full(2, step)}))
        manager.wait_until_finished()
        assert list(manager.all_steps()) == lazyckpt.steps(run) == [2, 7]
    assert lazyckpt.open(run)["w"].get().tolist() == [7, 7]


def test_terminal_output_escapes_control_characters(tmp_path: Path, capsys: Any) -> None:
    from lazyckpt._cli.main import main

    key, note = "w\x1b]0;pwned\x07", "hi\x1b[2Jthere\u202e"
    path = orbax_save(tmp_path / "esc", {key: np.zeros(2, np.float32), "note": note})
    lazy = lazyckpt.open(path)
    assert lazy["note"] == note  # the values stay as saved; only printing escapes
    text = str(lazyckpt.summary(lazy))
    assert r"w\x1b]0;pwned\x07" in text and r"hi\x1b[2Jthere\u202e" in text
    for argv in (
        ["inspect", str(path)],
        ["show", str(path), "note"],
        ["show", str(path), key],
        ["show", str(path), "nope\x1b[31m"],
    ):
        main(argv)
        out, err = capsys.readouterr()
        assert out + err and not any(c in out + err for c in "\x1b\x07\u202e"), argv
    assert r"nope\x1b[31m" in err


def test_cli_warning_is_one_line_and_python_warnings_name_the_caller(
    tmp_path: Path, capsys: Any
) -> None:
    import warnings

    from lazyckpt._cli.main import main

    path = orbax_save(tmp_path / "ckpt", {"w": np.zeros(2, np.float32)})
    (path / "_METADATA").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # as outside pytest, which turns warnings into errors
        assert main(["inspect", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lazyckpt: warning: ") and ".py" not in err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lazyckpt.open(path)
    assert [w.category for w in caught] == [lazyckpt.InferredStructureWarning]
    assert caught[0].filename == __file__


def test_edge_inputs_of_the_second_red_team_rerun(tmp_path: Path) -> None:
    """A string holding a lone surrogate was saved where Orbax cannot read it back;
    safetensors metadata that is no dict, and a transpose axis that is no int, raised
    raw errors; a NumPy integer axis was refused."""
    lazy = lazyckpt.open(lazyckpt.save(tmp_path / "a", {"w": np.arange(4.0)}))["w"]
    assert lazy.transpose(np.int64(0)).shape == (4,)
    with pytest.raises(lazyckpt.LazyIndexError, match=r"transpose takes integer axes"):
        lazy.transpose("a")
    with pytest.raises(lazyckpt.UnsavableError, match=r"w: the string .* lone surrogate"):
        lazyckpt.save(tmp_path / "s", {"w": "a\ud800b"})
    with pytest.raises(lazyckpt.UnsavableError, match=r"metadata is a dict .* not str"):
        lazyckpt.save(tmp_path / "m.safetensors", {"w": np.ones(2)}, metadata="x")  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_process_folder_inside_a_checkpoint_points_to_the_checkpoint(tmp_path: Path) -> None:
    path = orbax_save(tmp_path / "ckpt", {"w": np.ones(3, np.float32)})
    (process,) = path.glob("ocdbt.process_*")
    with pytest.raises(
        NotACheckpointError, match=rf"holds one process's part of the checkpoint {path}"
    ):
        lazyckpt.open(process)


def test_steps_saved_as_pytree_folders_have_no_items(tmp_path: Path) -> None:
    """A root whose step folders are PyTree checkpoints themselves: a step has no
    items (its process folder is not one), and item= is refused there too."""
    for step in (1, 2):
        orbax_save(tmp_path / "run" / str(step), {"w": np.full(3, step, np.float32)})
    root = tmp_path / "run"
    assert lazyckpt.items(root, step=2) == {} == lazyckpt.items(root / "2")
    np.testing.assert_array_equal(lazyckpt.open(root, step=1)["w"].get(), np.ones(3))
    with pytest.raises(NotACheckpointError, match=r"is a PyTree checkpoint itself"):
        lazyckpt.open(root, step=2, item="bogus")
