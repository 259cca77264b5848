"""Shared fixtures: reference checkpoints written by orbax, byte counters, a reader double.

The root conftest.py fakes the 8 CPU devices before jax starts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt import LazyArray
from lazyckpt._metrics import bytes_read
from lazyckpt._store import StoredArray

ZARR_FORMATS = ["zarr2", "zarr3"]


def orbax_save(path: Path, tree: Any, *, zarr3: bool = False, **options: Any) -> Path:
    """Save `tree` with the real orbax-checkpoint, as PyTreeCheckpointHandler does
    (`options` for the handler: `use_ocdbt=False`...)."""
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler(use_zarr3=zarr3, **options)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
    return path


def orbax_manager_save(root: Path, items_by_step: dict[int, dict[str, Any]]) -> Path:
    """Save steps with orbax's CheckpointManager ('ckpt_' prefix, 6-digit steps); each
    step's items are orbax `args` (StandardSave, JsonSave, ...) by item name."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=6)
    with ocp.CheckpointManager(root, options=options) as manager:
        for step, items in items_by_step.items():
            manager.save(step, args=ocp.args.Composite(**items))
    return root


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """A small OCDBT checkpoint whose chunk data lives in ocdbt.process_0/d/."""
    rng = np.random.default_rng(0)
    tree = {"a": rng.standard_normal((64, 64), dtype=np.float32), "b": {"c": np.arange(3)}}
    return orbax_save(tmp_path / "small", tree)


@pytest.fixture(scope="session")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("x", "y"))


def reference_tree(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """A train-state-like tree: sharded, replicated, nested dicts and lists, many dtypes."""
    rng = np.random.default_rng(42)

    def put(value: np.ndarray, spec: P) -> jax.Array:
        return jax.device_put(value, NamedSharding(mesh, spec))

    return {
        "params": {
            "dense": {
                "kernel": put(rng.standard_normal((64, 128), dtype=np.float32), P("x", "y")),
                "bias": put(np.arange(8, dtype=np.float32), P()),
            },
            "embed": put(rng.standard_normal((32, 4)).astype(jnp.bfloat16), P("x", None)),
            "layers": [
                {"w": put(rng.integers(-128, 127, (8, 8), dtype=np.int8), P("x", None))},
                {"w": put(rng.integers(-128, 127, (8, 8), dtype=np.int8), P(None, "y"))},
            ],
        },
        "opt_state": {
            "mu": put(rng.standard_normal((64, 128), dtype=np.float32), P()),
            "mask": put(rng.random((4, 8)) > 0.5, P(None, ("x", "y"))),
        },
        "scalar_array": put(np.array(3.5, dtype=np.float32), P()),
        "np_array": np.arange(12, dtype=np.int32).reshape(3, 4),
        "step": 7,
        "lr": 0.25,
        "name": "run-1",
        "empty": {},
        "nothing": None,
    }


@pytest.fixture(scope="session", params=ZARR_FORMATS)
def saved(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    mesh: jax.sharding.Mesh,
) -> tuple[Path, dict[str, Any]]:
    """The reference tree saved by orbax (zarr v2 and zarr3, OCDBT), and the tree."""
    tree = reference_tree(mesh)
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    orbax_save(path, tree, zarr3=request.param == "zarr3")
    return path, tree


@pytest.fixture
def count_bytes() -> Callable[[], contextlib.AbstractContextManager[list[int]]]:
    """A context manager whose list holds, after the block, the bytes it read."""

    @contextlib.contextmanager
    def counting() -> Iterator[list[int]]:
        result: list[int] = []
        before = bytes_read()
        yield result
        result.append(bytes_read() - before)

    return counting


def refuse_data_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader double: opening any stored array for reading fails the test.

    Every read of array data, by any path, first opens the array.
    """

    def refuse(self: StoredArray, *args: Any) -> Any:
        raise AssertionError(f"array data of {self.key!r} was read")

    monkeypatch.setattr(StoredArray, "open", refuse)


@pytest.fixture
def no_data_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read of array data in the test fails it."""
    refuse_data_reads(monkeypatch)


def host_value(value: Any) -> Any:
    """What `lazyckpt.load` should return for a saved leaf."""
    if isinstance(value, jax.Array):
        return np.asarray(value)
    return value


def assert_tree_equal(actual: Any, expected: Any) -> None:
    """Structure, dtypes and values equal, leaf by leaf."""
    actual_leaves = dict(lazyckpt.leaves(actual))
    expected_leaves = dict(lazyckpt.leaves(expected))
    assert sorted(actual_leaves) == sorted(expected_leaves)
    for key, want in expected_leaves.items():
        got = actual_leaves[key]
        if isinstance(want, np.ndarray | jax.Array):
            got_np, want_np = np.asarray(got), np.asarray(want)
            assert got_np.dtype == want_np.dtype, key
            assert got_np.shape == want_np.shape, key
            np.testing.assert_array_equal(got_np, want_np, err_msg=key)
        else:
            assert got == want and type(got) is type(want), key


def _chunk_key(name: str, chunk: tuple[int, ...], zarr3: bool) -> str:
    if zarr3:
        return f"{name}/c/" + "/".join(map(str, chunk)) if chunk else f"{name}/c"
    return f"{name}/" + (".".join(map(str, chunk)) if chunk else "0")


def stored_chunk_bytes(path: Path, view: LazyArray) -> int:
    """Stored bytes of the chunks holding the elements that `view` selects."""
    zarr3 = view.stored.driver == "zarr3"
    kvstore = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    per_dim = []
    for stored, chunk in zip(view.selection.stored, view.chunks, strict=True):
        indices = (
            [stored]
            if isinstance(stored, int)
            else [stored.start + stored.step * i for i in range(stored.count)]
        )
        per_dim.append(sorted({i // chunk for i in indices}))
    total = 0
    for chunk in itertools.product(*per_dim):
        value = kvstore.read(_chunk_key(view.stored.name, chunk, zarr3)).result()
        assert value.state == "value"
        total += len(value.value)
    return total


@pytest.fixture(scope="session")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """256 MiB in 4 float32 arrays, saved by orbax from 2 devices: 8 chunks of 32 MiB."""
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("d",))
    rng = np.random.default_rng(3)
    tree = {
        f"layer_{i}": jax.device_put(
            rng.standard_normal((4096, 4096), dtype=np.float32), NamedSharding(mesh, P("d"))
        )
        for i in range(4)
    }
    return orbax_save(tmp_path_factory.mktemp("wide") / "ckpt", tree)


def rss_probe(path: Path, mode: str, budget: int, *extra: str) -> dict[str, Any]:
    """Run `tests/rss_probe.py` in a fresh process, with the allocator left to lazyckpt."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "LAZYCKPT_"))}
    result = subprocess.run(
        [sys.executable, "-m", "tests.rss_probe", str(path), mode, str(budget), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    out: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return out
