"""Helpers the tests share: writing reference checkpoints with the real
orbax-checkpoint, comparing trees, counting stored bytes, and running cases in a
fresh or limited child process. Fixtures live in conftest.py."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
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
from lazyckpt._engine import raw, small
from lazyckpt._engine.decode import ChunkStream
from lazyckpt._engine.stored import StoredArray, stored_array

ROOT = Path(__file__).parent.parent

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "lazyckpt-test",
    "AWS_SECRET_ACCESS_KEY": "lazyckpt-test",
    "AWS_REGION": "us-east-1",
}
"""What the S3 test server accepts."""


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


def data_reads(monkeypatch: pytest.MonkeyPatch, *, refuse: bool = False) -> list[str]:
    """The keys of the stored arrays whose data is read from now on, by any path
    (repeated where a path reads an array in parts); with `refuse`, any such read
    fails the test instead.

    Every read of array data goes through one of these: tensorstore's (which opens the
    array first), lazyckpt's chunk decoder, positioned reads of raw bytes, or the
    batched reads of small arrays.
    """
    reads: list[str] = []

    def record(stored: StoredArray) -> None:
        if refuse:
            raise AssertionError(f"array data of {stored.key!r} was read")
        reads.append(stored.key)

    real_open, real_parts = StoredArray.open, raw.read_parts
    real_stream, real_coded, real_raw = ChunkStream.__init__, small._coded_batch, small._raw_batch

    def opening(self: StoredArray) -> Any:
        record(self)
        return real_open(self)

    def parts(file: str, stored: StoredArray, *args: Any) -> None:
        record(stored)
        real_parts(file, stored, *args)

    def stream(self: ChunkStream, stored: StoredArray, *args: Any) -> None:
        record(stored)
        real_stream(self, stored, *args)

    def coded(arrays: Any, batch: list[int], *args: Any) -> None:
        for i in batch:
            record(stored_array(arrays[i]))
        real_coded(arrays, batch, *args)

    def raw_batch(file: str, arrays: Any, batch: list[tuple[int, int, int]], *args: Any) -> None:
        for _, _, i in batch:
            record(stored_array(arrays[i]))
        real_raw(file, arrays, batch, *args)

    monkeypatch.setattr(StoredArray, "open", opening)
    monkeypatch.setattr(raw, "read_parts", parts)
    monkeypatch.setattr(ChunkStream, "__init__", stream)
    monkeypatch.setattr(small, "_coded_batch", coded)
    monkeypatch.setattr(small, "_raw_batch", raw_batch)
    return reads


def refuse_data_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader double: any read of array data fails the test (`data_reads`)."""
    data_reads(monkeypatch, refuse=True)


def value_comparisons(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the removed leaves `diff(values=True)` compares with an added one,
    from now on, one entry per comparison (`diff._equal_values`)."""
    from lazyckpt._explore import diff

    compared: list[str] = []
    real = diff._equal_values

    def counted(path: str, old: object, new: object, memory_budget: int | None) -> bool:
        compared.append(path)
        return real(path, old, new, memory_budget)

    monkeypatch.setattr(diff, "_equal_values", counted)
    return compared


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
    zarr3 = stored_array(view).driver == "zarr3"
    kvstore = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    per_dim: list[list[int]] = []
    for stored, chunk_size in zip(view.selection.stored, view.chunks, strict=True):
        indices = (
            [stored]
            if isinstance(stored, int)
            else [stored.start + stored.step * i for i in range(stored.count)]
        )
        per_dim.append(sorted({i // chunk_size for i in indices}))
    total = 0
    for chunk in itertools.product(*per_dim):
        value = kvstore.read(_chunk_key(stored_array(view).name, chunk, zarr3)).result()
        assert value.state == "value"
        total += len(value.value)
    return total


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


def rich_tree(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Every kind of leaf and key that Orbax can save (docs/format.md: The tree, Other leaves, PRNG keys)."""
    rng = np.random.default_rng(3)
    return {
        "sharded": jax.device_put(
            rng.standard_normal((64, 32), dtype=np.float32), NamedSharding(mesh, P("x", "y"))
        ),
        "replicated": jax.device_put(np.arange(40, dtype=np.int32), NamedSharding(mesh, P())),
        "dtypes": {
            "bf16": np.linspace(-3, 3, 12).astype(jnp.bfloat16),
            "f16": np.linspace(-3, 3, 12).astype(np.float16),
            "i8": np.arange(-6, 6, dtype=np.int8),
            "u8": np.arange(12, dtype=np.uint8),
            "bool": np.arange(12) % 3 == 0,
            "c64": (np.arange(4) + 1j).astype(np.complex64),
        },
        "zero_d": {"jax": jnp.float32(2.5) * jnp.ones(()), "numpy": np.array(7, np.int16)},
        "scalars": {
            "int": 3,
            "float": 0.5,
            "bool": True,
            "np_int8": np.int8(-4),
            "np_f32": np.float32(1.5),
        },
        "text": "hello",
        "containers": {
            "list": [np.ones(3, np.float32), "in a list", 4],
            "tuple": (np.zeros(2, np.float32), 5),
            "empty_dict": {},
            "empty_list": [],
            "none": None,
        },
        "keys": {
            "one": jax.random.key(42),
            "split": jax.random.split(jax.random.key(1), 3),
            "raw": jax.random.PRNGKey(0),
        },
        "x.y": np.arange(3, dtype=np.float32),
        "a/b": np.arange(4, dtype=np.float32),
        "tilde~k": np.arange(5, dtype=np.float32),
        "e/f": "slash string",
        "int_keys": {7: {8: np.arange(2, dtype=np.int32)}, 9: "nine"},
    }


def expected(value: Any) -> Any:
    """What lazyckpt.load returns for what was saved (docs/format.md, The tree)."""
    if isinstance(value, dict):
        return {str(k): expected(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [expected(v) for v in value]
    if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        return value
    if isinstance(value, jax.Array | np.ndarray):
        return np.asarray(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def assert_loaded(actual: Any, want: Any, key: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(want), key
        for k in want:
            assert_loaded(actual[k], want[k], f"{key}/{k}")
    elif isinstance(want, list):
        assert isinstance(actual, list) and len(actual) == len(want), key
        for i, (a, w) in enumerate(zip(actual, want, strict=True)):
            assert_loaded(a, w, f"{key}/{i}")
    elif isinstance(want, jax.Array):
        assert actual.dtype == want.dtype, key
        np.testing.assert_array_equal(jax.random.key_data(actual), jax.random.key_data(want))
    elif isinstance(want, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == want.dtype, key
        np.testing.assert_array_equal(actual, want, err_msg=key)
    else:
        assert actual == want and type(actual) is type(want), key


def structure(tree: Any) -> list[tuple[str, Any]]:
    out = []
    for key, leaf in lazyckpt.leaves(tree):
        if isinstance(leaf, LazyArray):
            out.append((key, (leaf.shape, str(leaf.dtype), leaf.key_impl)))
        else:
            out.append((key, leaf))
    return out


def handler_save(**options: Any) -> Callable[[Path, Any], Path]:
    def save(path: Path, tree: Any) -> Path:
        import orbax.checkpoint as ocp

        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)) as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
        return path

    return save


def chunked_save(zarr3: bool) -> Callable[[Path, Any], Path]:
    def save(path: Path, tree: Any) -> Path:
        import orbax.checkpoint as ocp

        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=512), tree)
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)) as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
        return path

    return save


def standard_save(path: Path, tree: Any) -> Path:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
    return path


def v1_save(path: Path, tree: Any) -> Path:
    import orbax.checkpoint as ocp

    ocp.v1.save(path, tree)
    return path


LAYOUTS: dict[str, Callable[[Path, Any], Path]] = {
    "ocdbt_zarr2": handler_save(use_ocdbt=True, use_zarr3=False),
    "ocdbt_zarr3": handler_save(use_ocdbt=True, use_zarr3=True),
    "folders_zarr2": handler_save(use_ocdbt=False, use_zarr3=False),
    "folders_zarr3": handler_save(use_ocdbt=False, use_zarr3=True),
    "uncompressed_folders": handler_save(use_ocdbt=False, use_compression=False),
    "uncompressed_ocdbt_zarr3": handler_save(use_zarr3=True, use_compression=False),
    "subchunked_zarr2": chunked_save(zarr3=False),
    "subchunked_zarr3": chunked_save(zarr3=True),
    "standard_checkpointer": standard_save,
    "v1_api": v1_save,
}


def run_cases(cases: list[dict[str, Any]], tmp_path: Path, timeout: int = 240) -> dict[str, str]:
    """Outcome by case name; fails the test if the child crashed or timed out."""
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tests.hostile_child", str(spec)],
            # The limit is on address space: without this, each thread that first
            # allocates reserves a 64 MiB malloc arena, and how many do varies by run.
            env={**os.environ, "MALLOC_ARENA_MAX": "2"},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as expired:
        lines = (
            (expired.stdout or b"").decode().splitlines()
            if isinstance(expired.stdout, bytes)
            else (expired.stdout or "").splitlines()
        )
        last = json.loads(lines[-1])["name"] if lines else "(none)"
        pytest.fail(f"the cases hung; the last one started was {last!r}")
    outcomes: dict[str, str] = {}
    last = None
    for line in result.stdout.splitlines():
        record = json.loads(line)
        if "outcome" in record:
            outcomes[record["name"]] = record["outcome"]
        last = record["name"]
    if result.returncode != 0:
        pytest.fail(
            f"the child exited with {result.returncode} during case {last!r}: "
            f"{result.stderr[-2000:]}"
        )
    return outcomes


def expect(outcomes: dict[str, str], wanted: dict[str, str]) -> None:
    """Each case's outcome starts with what is expected: `ok`, or `lazyckpt:<Error>`."""
    wrong = {
        name: outcomes.get(name, "(no outcome)")
        for name, want in wanted.items()
        if not outcomes.get(name, "").startswith(want)
    }
    assert not wrong, json.dumps(wrong, indent=1)
