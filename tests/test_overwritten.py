"""A reader never sees a mix of two checkpoints while another process overwrites one."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

import lazyckpt
from tests.overwrite_worker import tree, version_of

ROOT = Path(__file__).parent.parent
WRITER_TIMEOUT = 300


def test_reads_during_overwrites_see_one_checkpoint_or_say_it_changed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    lazyckpt.save(path, tree(1), chunk_bytes=256 << 10)
    outcomes: Counter[str] = Counter()
    command = [sys.executable, "-m", "tests.overwrite_worker", str(path), "100"]
    deadline = time.monotonic() + WRITER_TIMEOUT
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL) as writer:
        while writer.poll() is None or not outcomes:
            if time.monotonic() > deadline:
                writer.kill()
                writer.wait(timeout=60)
                pytest.fail(f"the writer's 100 saves took more than {WRITER_TIMEOUT} s")
            try:
                lazy = lazyckpt.open(path)
                # Half the reads open, then read later: the pinned generation is checked.
                loaded = lazyckpt.load(lazy)
            except lazyckpt.CheckpointChangedError:
                outcomes["changed"] += 1
                continue
            version = version_of(loaded)
            outcomes["mixed" if version is None else f"version {version}"] += 1
            held = lazy["big"][:1]
            try:
                row = held.get()
            except lazyckpt.CheckpointChangedError:
                outcomes["changed later"] += 1
            else:
                assert np.all(row == version), "a held LazyArray read another checkpoint"
    assert writer.returncode == 0
    assert outcomes["mixed"] == 0, outcomes
    assert outcomes["version 1"] + outcomes["version 2"] > 0, outcomes


def test_every_read_of_a_replaced_checkpoint_says_it_changed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    lazyckpt.save(path, tree(1), chunk_bytes=256 << 10)
    lazy = lazyckpt.open(path)
    lazyckpt.save(path, tree(2), chunk_bytes=256 << 10, overwrite=True)
    reads = {
        "get": lambda: lazy["big"].get(),
        "slice": lambda: lazy["big"][3:5, 7].get(),
        "small": lambda: lazy["small"].get(),
        "load": lambda: lazyckpt.load(lazy),
        "device_put": lambda: lazyckpt.device_put(lazy, jax.devices()[0]),
        "blocks": lambda: list(lazyckpt.iter_blocks(lazy["big"])),
        "stats": lambda: lazyckpt.stats(lazy),
        "save": lambda: lazyckpt.save(tmp_path / "copy", lazy),
    }
    for name, read in reads.items():
        with pytest.raises(
            lazyckpt.CheckpointChangedError,
            match=r"overwritten or changed since it "
            r"was opened.*open it again",
        ):
            read()
        assert not (tmp_path / "copy").exists(), name
    assert version_of(lazyckpt.load(lazyckpt.open(path))) == 2
