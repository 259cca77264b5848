"""When a save fails in the file system, the error names the path and what happened,
derives from `LazyckptError` and the matching `OSError`, and nothing is published."""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import lazyckpt
from lazyckpt._storage import publish

ROOT = Path(__file__).parent.parent


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_file_size_limit_mid_save_is_a_write_error(tmp_path: Path) -> None:
    """In a child process limited to 64 KiB files (the kernel refuses more with EFBIG,
    as a full disk refuses with ENOSPC): one clear error, nothing left behind."""
    code = textwrap.dedent(
        f"""
        import resource, signal, numpy as np, lazyckpt
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        tree = {{"w": np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32),
                "note": "x" * 100_000}}
        try:
            lazyckpt.save({str(tmp_path / "out")!r}, tree)
        except lazyckpt.LazyckptError as error:
            print(type(error).__name__, isinstance(error, OSError), error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    kind, is_os_error, message = result.stdout.strip().split(" ", 2)
    assert (kind, is_os_error) == ("CheckpointWriteError", "True"), result.stdout
    assert str(tmp_path / "out") in message and "nothing was saved" in message
    assert _entries(tmp_path) == []  # no checkpoint, no temporary folder


@pytest.mark.slow
def test_writes_in_flight_after_a_full_disk_leave_nothing(tmp_path: Path) -> None:
    """Tensorstore reports a save's first failed write while other writes it started
    run on; those once re-created the temporary folder just deleted (1 failed save in
    6 to 10). Sixteen failing saves, each checked a while after it failed."""
    code = textwrap.dedent(
        f"""
        import os, resource, signal, time, numpy as np, lazyckpt
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
        for run in range(16):
            rng = np.random.default_rng(run)
            tree = {{f"w{{i}}": rng.standard_normal((256, 512)).astype(np.float32)
                    for i in range(24)}}
            folder = {str(tmp_path)!r} + f"/{{run}}"
            os.mkdir(folder)
            try:
                lazyckpt.save(folder + "/out", tree, chunk_bytes=64 << 10)
            except lazyckpt.CheckpointWriteError:
                pass
            time.sleep(0.3)
            print(run, sorted(os.listdir(folder)))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 16 and all(line.endswith(" []") for line in lines), lines


def test_a_leftover_of_this_process_goes_with_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed save's folder that writes still in flight re-created after it was
    deleted goes with the next save to the same destination; a folder named for this
    process whose save has not ended (another thread's, in progress) stays."""
    left: list[str] = []
    monkeypatch.setattr(publish, "_delete_settled", left.append)  # as if re-created later
    source = lazyckpt.save(tmp_path / "src.safetensors", {"w": np.ones(4096, np.float32)})
    lazy = lazyckpt.open(source)["w"]
    os.truncate(source, 1024)  # its data is gone once the save reads it
    with pytest.raises((lazyckpt.CorruptCheckpointError, lazyckpt.CheckpointChangedError)):
        lazyckpt.save(tmp_path / "out", {"w": lazy})
    monkeypatch.undo()
    os.unlink(source)
    assert len(left) == 1 and os.path.isdir(left[0])
    host = socket.gethostname()
    running = tmp_path / f"out.orbax-checkpoint-tmp-lazyckpt-{host}-{os.getpid()}-0a1b2c3d"
    running.mkdir()
    lazyckpt.save(tmp_path / "out", {"w": np.zeros(3)})
    assert _entries(tmp_path) == ["out", running.name]


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_a_folder_that_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """(Tests run as root here, for whom every folder is writable: the kernel's answer
    for a read-only mount or a folder of another user is given by hand.)"""
    real = os.mkdir

    def refuse(path: str, mode: int = 0o777) -> None:
        if ".orbax-checkpoint-tmp" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        real(path, mode)

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(
        lazyckpt.StorageAccessError, match=r"out: cannot write .*orbax-checkpoint-tmp"
    ) as caught:
        lazyckpt.save(tmp_path / "out", {"w": np.zeros(3)})
    assert isinstance(caught.value, PermissionError)
    assert os.strerror(code) in str(caught.value)
    assert _entries(tmp_path) == []


def test_replacing_a_read_only_checkpoint_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = lazyckpt.save(tmp_path / "ckpt", {"w": np.zeros(3)})
    locked = Path(old) / "d"
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and Path(p) != locked)
    with pytest.raises(lazyckpt.StorageAccessError, match=r"its folder .*/ckpt/d is read-only"):
        lazyckpt.save(old, {"w": np.ones(3)}, overwrite=True)
    assert _entries(tmp_path) == ["ckpt"]
    assert lazyckpt.open(old)["w"].get().tolist() == [0.0, 0.0, 0.0]


def test_a_replaced_checkpoint_that_cannot_be_deleted_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = lazyckpt.save(tmp_path / "ckpt", {"w": np.zeros(3)})
    real = shutil.rmtree

    def stuck(path: str, ignore_errors: bool = False) -> None:
        if ignore_errors:
            return real(path, ignore_errors=True)
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)

    monkeypatch.setattr(shutil, "rmtree", stuck)
    with pytest.warns(
        lazyckpt.LeftoverWarning,
        match=r"saved .*ckpt; the checkpoint it replaced, now at .*orbax-checkpoint-tmp.*, could not be deleted",
    ):
        lazyckpt.save(old, {"w": np.ones(3)}, overwrite=True)
    assert lazyckpt.open(old)["w"].get().tolist() == [1.0, 1.0, 1.0]


def test_dict_keys_of_mixed_types_are_unsavable(tmp_path: Path) -> None:
    with pytest.raises(
        lazyckpt.UnsavableError,
        match=r"^params: a dict mixes keys of types \['int', 'str'\] \(1, '1'\); jax cannot order",
    ):
        lazyckpt.save(tmp_path / "out", {"params": {1: np.zeros(2), "1": np.ones(2)}})
    assert _entries(tmp_path) == []


def test_save_and_convert_refuse_arguments_they_cannot_honour(tmp_path: Path) -> None:
    """Each an error naming the argument, before the source is opened or anything is
    written; `overwrite="no"` had replaced the checkpoint."""
    tree = {"w": np.arange(4.0)}
    source = lazyckpt.save(tmp_path / "source", tree)
    existing = lazyckpt.save(tmp_path / "existing", tree)
    refused: list[tuple[str, Callable[[], object]]] = [
        ("format='npz' is not a format", lambda: lazyckpt.save(tmp_path / "a", tree, format="npz")),  # type: ignore[arg-type]
        ("to='npz' is not a format", lambda: lazyckpt.convert(source, tmp_path / "b", to="npz")),  # type: ignore[call-overload]
        (
            "max_shard_size= applies to safetensors files",
            lambda: lazyckpt.save(tmp_path / "c", tree, max_shard_size="1GB"),
        ),
        (
            "dtype='floaty' is not a floating-point dtype",
            lambda: lazyckpt.convert(source, tmp_path / "d", dtype="floaty"),
        ),
        (
            "dtype='int8' is not a floating-point dtype",
            lambda: lazyckpt.convert(source, tmp_path / "e", dtype="int8"),
        ),
        (
            "overwrite='no' is not a bool",
            lambda: lazyckpt.save(existing, {"v": np.zeros(2)}, overwrite="no"),  # type: ignore[arg-type]
        ),
        (
            "overwrite='no' is not a bool",
            lambda: lazyckpt.convert(source, existing, overwrite="no"),  # type: ignore[call-overload]
        ),
    ]
    for message, call in refused:
        # (a value out of range is an ArgumentError, a ValueError; one of a wrong kind
        # a LazyTypeError, a TypeError)
        kind = lazyckpt.LazyTypeError if "dtype" in message or "bool" in message else None
        with pytest.raises(kind or lazyckpt.ArgumentError, match=re.escape(message)):
            call()
    assert _entries(tmp_path) == ["existing", "source"]
    assert list(lazyckpt.open(existing)) == ["w"]
