"""Root conftest: fake 8 CPU devices, and a checkpoint for the docstring examples."""

from __future__ import annotations

import os

# Must be set before jax starts its backend: 8 CPU devices to shard across.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# Programs compiled for devices are cached per machine (`lazyckpt._device.programs`): the
# tests' go to a folder of their own, gone at exit, never the user's cache.
if "LAZYCKPT_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["LAZYCKPT_CACHE_DIR"] = _CACHE = tempfile.mkdtemp(prefix="lazyckpt-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@pytest.fixture(autouse=True)
def _doctest_checkpoint(
    doctest_namespace: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`path`: a small train state saved by `lazyckpt.save`, for docstring examples;
    `tmp`: an empty folder to save into."""
    import lazyckpt

    write_checkpoint = lazyckpt.save

    if "path" not in doctest_namespace:
        mesh = jax.make_mesh((4, 2), ("x", "y"))
        state = {
            "params": {
                "w": jax.device_put(
                    np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("x", "y"))
                ),
                "b": jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P())),
            },
            "opt_state": {"mu": np.zeros((8, 8), np.float32)},
            "step": 3,
        }
        folder = tmp_path_factory.mktemp("doctest")
        path = write_checkpoint(folder / "ckpt", state)
        # A CheckpointManager-style root: step 1 holds `state`, step 2 `state` and `extra`.
        run = folder / "run"
        write_checkpoint(run / "ckpt_1" / "state", {"step": 1})
        write_checkpoint(run / "ckpt_2" / "state", {"step": 2})
        write_checkpoint(run / "ckpt_2" / "extra", {"note": "eval"})
        # Quantized safetensors files, written by the safetensors library: `fp8` holds
        # `w` (float8_e4m3fn) with one scale per 2x4 block, `mx` MXFP4 `w_blocks` with
        # `w_scales`.
        from ml_dtypes import float8_e4m3fn
        from safetensors.numpy import save_file

        fp8 = str(folder / "fp8.safetensors")
        values = (np.arange(30) % 8).reshape(5, 6).astype(float8_e4m3fn)
        scales = np.arange(1, 7, dtype=np.float32).reshape(3, 2)
        save_file({"w": values, "w_scale_inv": scales, "b": np.ones(5, np.float32)}, fp8)
        mx = str(folder / "mx.safetensors")
        codes = np.arange(64, dtype=np.uint8).reshape(2, 2, 16) * 7
        save_file({"w_blocks": codes, "w_scales": np.array([[127, 128], [126, 127]], np.uint8)}, mx)
        doctest_namespace.update(
            fp8=fp8,
            mx=mx,
            lazyckpt=lazyckpt,
            jax=jax,
            np=np,
            P=P,
            NamedSharding=NamedSharding,
            path=path,
            run=run,
        )
    doctest_namespace["tmp"] = tmp_path_factory.mktemp("doctest-out")
