"""A save killed with SIGKILL at any moment leaves no checkpoint or a complete one."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from tests.save_worker import tree

pytestmark = pytest.mark.slow

RUNS = 8  # kill points per mode, spread over the whole save and past its end
ROOT = Path(__file__).parent.parent


def _start(path: Path, seed: int, overwrite: bool) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "tests.save_worker", str(path), str(seed)]
    return subprocess.Popen(
        [*command, *(["overwrite"] if overwrite else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _wait_for(worker: subprocess.Popen[str], word: str, timeout: float = 300) -> str:
    """The worker's next line, which must start with `word`; a worker silent for
    `timeout` seconds fails the test instead of hanging it."""
    assert worker.stdout is not None
    stdout, said = worker.stdout, []
    reader = threading.Thread(target=lambda: said.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)  # on a timeout the worker is killed below, which ends the read
    line = said[0] if said else f"nothing in {timeout} s"
    if not line.startswith(word):
        worker.kill()
        _, stderr = worker.communicate(timeout=60)
        raise AssertionError(f"worker said {line!r}; stderr: {stderr}")
    return line


def _kill_after(path: Path, seed: int, overwrite: bool, delay: float) -> bool:
    """Run a save and SIGKILL it `delay` seconds after it starts; True if it finished."""
    with _start(path, seed, overwrite) as worker:
        try:
            _wait_for(worker, "ready")
            time.sleep(delay)
            finished = worker.poll() is not None
            worker.send_signal(signal.SIGKILL)  # no-op if it already exited
            worker.wait(timeout=60)
            return finished
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=60)


def _equals(path: Path, seed: int) -> bool:
    loaded = lazyckpt.load(lazyckpt.open(path))
    want = tree(seed)
    return (
        loaded["note"] == want["note"]
        and loaded["seed"] == want["seed"]
        and all(
            np.array_equal(got["w"], layer["w"])
            for got, layer in zip(loaded["layers"], want["layers"], strict=True)
        )
    )


def _assert_leftovers_never_open(folder: Path) -> int:
    leftovers = [p for p in folder.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    for leftover in leftovers:
        with pytest.raises(lazyckpt.UnfinishedCheckpointError, match=r"is an unfinished save"):
            lazyckpt.open(leftover)
    return len(leftovers)


@pytest.fixture(scope="module")
def save_seconds(tmp_path_factory: pytest.TempPathFactory) -> float:
    """How long an uninterrupted save of the worker's tree takes here."""
    with _start(tmp_path_factory.mktemp("timing") / "ckpt", 1, False) as worker:
        try:
            _wait_for(worker, "ready")
            return float(_wait_for(worker, "saved").split()[1])
        finally:
            if worker.poll() is None:
                worker.wait(timeout=60)


def test_killed_saves_leave_no_checkpoint_or_a_complete_one(
    tmp_path: Path, save_seconds: float
) -> None:
    final = tmp_path / "ckpt"
    outcomes: list[str] = []
    for run in range(RUNS):
        delay = save_seconds * 2 * (run + 0.5) / RUNS
        finished = _kill_after(final, 1, False, delay)
        if final.exists():
            assert _equals(final, 1), f"run {run}: a published checkpoint has wrong data"
            outcomes.append("complete")
            shutil.rmtree(final)
        else:
            assert not finished, f"run {run}: the save finished but published nothing"
            outcomes.append("none")
        _assert_leftovers_never_open(tmp_path)
    assert "none" in outcomes, (outcomes, save_seconds)  # some kills did land mid-save
    # Leftovers of killed saves never block the next one, which also clears them.
    lazyckpt.save(final, tree(2))
    assert _equals(final, 2)
    assert _assert_leftovers_never_open(tmp_path) == 0


def test_killed_overwrites_leave_the_old_checkpoint_or_the_new_one(
    tmp_path: Path, save_seconds: float
) -> None:
    final = tmp_path / "ckpt"
    outcomes: list[Any] = []
    for run in range(RUNS):
        lazyckpt.save(final, tree(1), overwrite=True)
        delay = save_seconds * 2 * (run + 0.5) / RUNS
        _kill_after(final, 2, True, delay)
        assert final.exists(), f"run {run}: the old checkpoint is gone"
        old, new = _equals(final, 1), _equals(final, 2)
        assert old or new, f"run {run}: the checkpoint has neither the old nor the new data"
        outcomes.append("new" if new else "old")
        _assert_leftovers_never_open(tmp_path)
    assert "old" in outcomes, (outcomes, save_seconds)
