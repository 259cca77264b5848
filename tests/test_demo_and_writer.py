"""`lazyckpt demo` runs end to end, and its checkpoint writer is Orbax-compatible."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from tests.helpers import assert_tree_equal, host_value


def test_demo_walks_through_open_select_reshard_load(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "lazyckpt._cli.main", "demo", "--keep", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    out = result.stdout
    for step in ("1. Save", "2. Open", "3. Select", "4. Slice", "5. Reshard", "6. Load"):
        assert step in out
    assert "values match: True" in out and "equal to saved: True" in out
    assert out.count(", no network requests, ") == 3  # what open, a slice and device_put read
    assert (
        "kernel  float32[256,128]          128.0 KiB  P('data', 'model')  mesh data=4 model=2"
        in out
    )
    assert "bias    float32[128]                  512 B  P()  " in out  # the replicated bias
    assert "the optimizer state was never read" in out
    tree = lazyckpt.open(tmp_path / "demo")
    assert tree["params"]["dense"]["kernel"].shape == (256, 128)
    again = subprocess.run(  # the demo replaces nothing, and has no --overwrite to offer
        [sys.executable, "-m", "lazyckpt._cli.main", "demo", "--keep", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert again.returncode == 1 and "--overwrite" not in again.stderr
    assert again.stderr.splitlines()[-1] == (
        f"lazyckpt: error: --keep {tmp_path / 'demo'}: the folder already exists, and the "
        "demo replaces nothing; remove it, or pass --keep a folder that does not exist yet"
    )


@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring:UserWarning")
def test_writer_output_restores_in_orbax(tmp_path: Path, mesh: jax.sharding.Mesh) -> None:
    import orbax.checkpoint as ocp

    tree = {
        "w": jax.device_put(
            np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("x", "y"))
        ),
        "r": jax.device_put(np.arange(6, dtype=np.int8), NamedSharding(mesh, P())),
        "lst": [np.ones((2, 3), np.float32), "text", 4, 1.5],
        "empty": {},
        "none": None,
    }
    path = lazyckpt.save(tmp_path / "ckpt", tree)
    restored = ocp.PyTreeCheckpointer().restore(path)
    expected = jax.tree.map(host_value, tree)
    assert_tree_equal(restored, expected)
    assert restored["empty"] == {} and restored["none"] is None
    assert_tree_equal(lazyckpt.load(lazyckpt.open(path)), expected)
    assert not (tmp_path / "ckpt.orbax-checkpoint-tmp").exists()
