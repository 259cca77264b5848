"""Bad paths and damaged checkpoints give errors that name the path and the fix."""

from __future__ import annotations

import json
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
from tests.conftest import orbax_save


@pytest.fixture
def small(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    tree = {"a": rng.standard_normal((64, 64), dtype=np.float32), "b": {"c": np.arange(3)}}
    return orbax_save(tmp_path / "small", tree)


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

    root = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=6)
    with ocp.CheckpointManager(root, options=options) as manager:
        for step in (1, 2):
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"w": np.full((4,), step, np.float32)}),
                    extra=ocp.args.JsonSave({"step": step}),
                ),
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
    with pytest.raises(
        NotACheckpointError,
        match=r"item 'extra' in .*ckpt_000002 is not a PyTree "
        r"item \(it holds \['commit_success.txt', 'metadata'\]\); PyTree items: \['state'\]",
    ):
        lazyckpt.open(root, item="extra")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"ckpt_000002 has no item 'other'; items "
        r"present: \['state'\]",
    ):
        lazyckpt.open(root, item="other")
    shutil.rmtree(root / "ckpt_000002" / "state")
    with pytest.raises(
        CheckpointNotFoundError,
        match=r"item 'state' is listed in .*ckpt_000002/"
        r"_CHECKPOINT_METADATA but its folder is missing",
    ):
        lazyckpt.open(root / "ckpt_000002", item="state")


def test_metadata_that_is_not_json(small: Path) -> None:
    (small / "_METADATA").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=r"small/_METADATA is not valid JSON"):
        lazyckpt.open(small)


def test_metadata_without_tree(small: Path) -> None:
    (small / "_METADATA").write_text(json.dumps({"use_zarr3": False}))
    with pytest.raises(CorruptCheckpointError, match=r"_METADATA has no 'tree_metadata' object"):
        lazyckpt.open(small)


def test_missing_root_manifest_names_the_per_process_databases(small: Path) -> None:
    (small / "manifest.ocdbt").unlink()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"OCDBT root manifest .*manifest.ocdbt is "
        r"missing; per-process databases \['ocdbt.process_0'\] exist",
    ):
        lazyckpt.open(small)


def test_deleted_chunk_data_fails_at_read_time_naming_the_array(small: Path) -> None:
    lazy = lazyckpt.open(small)  # metadata is intact: open succeeds
    for data_file in small.glob("ocdbt.process_0/d/*"):
        data_file.unlink()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"reading array 'a' \(stored as 'a'\) failed"
        r".*missing or damaged, copy it again",
    ):
        lazy["a"][:2].get()


def test_truncated_chunk_file_fails_at_read_time(small: Path) -> None:
    lazy = lazyckpt.open(small)
    for data_file in small.glob("ocdbt.process_0/d/*"):
        data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match=r"reading array 'a'"):
        lazy["a"].get()


def test_unsupported_value_type(small: Path) -> None:
    metadata = json.loads((small / "_METADATA").read_text())
    entry = next(iter(metadata["tree_metadata"].values()))
    entry["value_metadata"]["value_type"] = "my.CustomThing"
    (small / "_METADATA").write_text(json.dumps(metadata))
    with pytest.raises(
        lazyckpt.UnsupportedCheckpointError,
        match=r"leaf 'a' has value_type "
        r"'my.CustomThing', which lazyckpt does not read",
    ):
        lazyckpt.open(small)


def test_cli_error_is_one_line(tmp_path: Path, capsys: Any) -> None:
    from lazyckpt._cli import main

    assert main(["demo", "--keep", str(tmp_path)]) == 1  # the folder exists already
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lazyckpt: error: ")
