"""Several JAX processes on 127.0.0.1 (jax.distributed, gloo): save and restore together.

Each worker has 4 CPU devices. Workers are killed on timeout or failure, so the
suite never hangs.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from tests.multihost_worker import values

ROOT = Path(__file__).parent.parent
TIMEOUT = 180


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _results(out: str) -> list[dict[str, Any]]:
    """The results a worker printed. Gloo's C++ logging shares the worker's stdout and
    can land on the same line as a result."""
    decoder = json.JSONDecoder()
    results = []
    start = out.find('{"do": ')
    while start != -1:
        result, end = decoder.raw_decode(out, start)
        results.append(result)
        start = out.find('{"do": ', end)
    return results


def run_processes(
    count: int, steps: list[dict[str, Any]], devices: int = 4
) -> list[list[dict[str, Any]]]:
    """Run `steps` in `count` worker processes of `devices` CPU devices each; each
    worker's printed results."""
    port = _free_port()
    workers = []
    for process in range(count):
        config = {
            "process": process,
            "processes": count,
            "port": port,
            "steps": steps,
            "devices": devices,
        }
        workers.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.multihost_worker", json.dumps(config)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        )
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=TIMEOUT)
            if worker.returncode != 0:
                raise AssertionError(f"worker failed ({worker.returncode}):\n{err[-3000:]}")
            outputs.append(_results(out))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.communicate(timeout=60)
    return outputs


@pytest.mark.parametrize("count", [2, 4])
def test_save_and_restore_together_on_matching_and_other_meshes(tmp_path: Path, count: int) -> None:
    path = str(tmp_path / "ckpt")
    steps = [
        {"do": "save", "path": path, "spec": ["d"], "seed": 1},
        {"do": "restore", "path": path, "spec": ["d"], "seed": 1},  # as saved: aligned
        {"do": "restore", "path": path, "spec": [None, "d"], "seed": 1},  # misaligned
        {"do": "restore", "path": path, "spec": [], "seed": 1},  # replicated
    ]
    results = run_processes(count, steps)
    for process, result in enumerate(results):
        assert [r["error"] for r in result] == [None] * 4, result
        aligned, misaligned, replicated = result[1:]
        for r in (aligned, misaligned, replicated):
            assert r["ok"], (process, r)
        assert aligned["read"] == aligned["needed"], (process, aligned)  # each chunk once
        assert misaligned["read"] <= 1.05 * misaligned["needed"], (process, misaligned)
        assert replicated["read"] <= 1.05 * replicated["needed"], (process, replicated)
    # Each process read only its own rows when aligned: together, the whole array once.
    assert sum(r[1]["read"] for r in results) == results[0][3]["needed"]
    # Readable in one process, as saved.
    tree = lazyckpt.open(path)
    assert (
        tree["note"] == "multi"
        and tree["w"].sharding.spec
        == lazyckpt.SavedSharding("NamedSharding", (count * 4,), ("d",), ("d",)).spec
    )
    np.testing.assert_array_equal(tree["w"].get(), values(1))


@pytest.mark.slow
def test_saved_by_two_restored_by_four(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_processes(2, [{"do": "save", "path": path, "spec": [None, "d"], "seed": 5}])
    results = run_processes(4, [{"do": "restore", "path": path, "spec": ["d"], "seed": 5}])
    assert all(r[0]["error"] is None and r[0]["ok"] for r in results), results
    import orbax.checkpoint as ocp

    restored = ocp.PyTreeCheckpointer().restore(
        path,
        args=ocp.args.PyTreeRestore(
            restore_args={"w": ocp.RestoreArgs(restore_type=np.ndarray), "note": None}
        ),
    )
    np.testing.assert_array_equal(restored["w"], values(5))


def test_processes_that_disagree_get_a_clear_error(tmp_path: Path) -> None:
    """Also: when process 0 cannot start the save, every process fails (none hangs)."""
    path = str(tmp_path / "ckpt")
    (tmp_path / "a_file").write_text("not a folder")
    run_processes(2, [{"do": "save", "path": path, "spec": ["d"], "seed": 2}])
    results = run_processes(
        2,
        [
            {"do": "put_disagree", "path": path},
            {"do": "save_disagree", "path": str(tmp_path / "other")},
            {"do": "save", "path": str(tmp_path / "a_file" / "ckpt"), "spec": ["d"], "seed": 3},
        ],
    )
    for result in results:
        put, save, unwritable = result
        assert "cannot create the folder it goes in" in unwritable["error"], unwritable
        assert put["error"].startswith("TreeMismatchError: the 2 processes disagree on the")
        assert "process(es) [1] differ from process 0" in put["error"]
        assert "device_put with the same tree, the same shardings" in put["error"]
        assert "disagree on the tree to save" in save["error"]
    assert not (tmp_path / "other").exists()


REPLICATED = {"w": [None, "model"], "h": [], "m": ["model", None], "n": [], "s": []}
"""Specs of `_replicated_checkpoint`'s arrays on a ("data", "model") mesh that leave the
processes' "data" axis out: each array replicated across processes (a scalar too)."""


def test_broadcast_onto_accelerators_sends_only_each_process_parts(tmp_path: Path) -> None:
    """Onto devices that copy out of host memory (CPU devices sent down the
    accelerators' path here), broadcast=True holds no region whole on the host: each
    process sends only its parts, in pieces within its budget, and the devices fill
    the rest with zeros themselves. Together the processes read the stored bytes once
    and send each value once; every shard holds its values bit for bit (NaN, -0.0,
    subnormals, every bfloat16 and float8 pattern, bool), and a chunk that one
    process's two regions share is read once; a process failing its reads, or on its
    devices before the all-reduce, is an error on all, not a hang; one failing after
    it (making floats), an error there alone, the others placing every batch."""
    path = tmp_path / "ckpt"
    stored = _replicated_checkpoint(path)
    specs = {**REPLICATED, "p": [], "e": [None, "model"]}
    step = {
        "do": "broadcast",
        "path": str(path),
        "mesh": [4, 2],
        "specs": specs,
        "fail": None,
        "broadcast": True,
        "staged": True,
    }
    results = run_processes(
        4,
        [
            {**step, "budget": "64KiB"},
            {**step, "budget": None},
            {**step, "specs": {"x": [None, "model"]}},  # (its chunks cross both regions)
            {**step, "budget": "64KiB", "fail_finish": 3},  # (from here on)
            {**step, "fail_write": 2},  # (process 2's writes fail from here on)
            {**step, "fail": 1},  # (and process 1's reads)
        ],
        devices=2,
    )
    small, default, crossing, late, failed_write, failed = (
        [r[i] for r in results] for i in range(6)
    )
    lazy = lazyckpt.open(path)
    values = sum(lazy[key].nbytes for key in specs)
    for run in (small, default):
        assert all(r["error"] is None and r["ok"] for r in run), run
        assert all(r["regions"] == [] for r in run), run  # (nothing held whole)
        assert sum(r["sent"] for r in run) == values, ([r["sent"] for r in run], values)
        assert all(r["sent"] < 0.5 * values for r in run), run  # (spread over the four)
        together = sum(r["read"] for r in run)
        assert together <= 1.05 * sum(stored[key] for key in specs), together
    assert all(r["error"] is None and r["ok"] for r in crossing), crossing
    assert sum(r["read"] for r in crossing) <= 1.05 * stored["x"], (crossing, stored["x"])
    # (after the all-reduces, in several batches: raised there alone, the others done)
    assert "injected failure making floats" in (late[3]["error"] or ""), late[3]
    assert all(r["error"] is None and r["ok"] for r in late[:3]), late
    assert "injected failure writing" in (failed_write[2]["error"] or ""), failed_write[2]
    for process in (0, 1, 3):
        assert "process(es) [2] failed" in (failed_write[process]["error"] or ""), failed_write
    assert "injected failure reading" in (failed[1]["error"] or ""), failed[1]
    for process in (0, 3):
        assert "process(es) [1, 2] failed" in (failed[process]["error"] or ""), failed


def _replicated_checkpoint(path: Path) -> dict[str, int]:
    """Arrays that a restore replicates across processes (and one it shards over
    every device, and one no mesh axis here divides), saved by Orbax in chunks of at
    most 32 KiB, special floats included to check every bit; the stored bytes of each
    array's chunks."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import tensorstore as ts

    rng = np.random.default_rng(7)
    w = rng.standard_normal((1024, 256), dtype=np.float32)
    w[0, :5] = np.array([-0.0, np.nan, np.inf, -np.inf, 1e-45], np.float32)
    tree = {
        "w": w,
        "h": rng.standard_normal((512, 512)).astype(jnp.bfloat16),
        "m": rng.random((256, 256)) > 0.5,
        "n": np.arange(8192, dtype=np.int32),
        "s": np.array(-3.5, np.float32),
        "c": rng.standard_normal((4096, 8), dtype=np.float32),
        "u": np.arange(15, dtype=np.float32).reshape(5, 3),
        "x": rng.standard_normal((1024, 64), dtype=np.float32),  # (chunks of whole rows)
        # every bit pattern: NaN payloads and subnormals, which some devices change
        "p": np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).reshape(256, 256),
        "e": np.tile(np.arange(256, dtype=np.uint8), 64).view(jnp.float8_e4m3fn).reshape(128, 128),
    }
    save_args = {key: ocp.SaveArgs(chunk_byte_size=32 << 10) for key in tree}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    stored = dict.fromkeys(tree, 0)
    for key in (k.decode() for k in kv.list().result()):
        name, leaf = key.split("/", 1)
        if leaf not in (".zarray", "zarr.json"):
            stored[name] += len(kv.read(key).result().value)
    return stored


def test_broadcast_reads_each_chunk_once_across_processes(tmp_path: Path) -> None:
    """4 processes x 2 devices on a ("data", "model") mesh, arrays replicated across
    the processes' "data" axis (a scalar too): with broadcast=True the processes
    together read the stored bytes once (each chunk by one process) and every device
    holds its shard bit for bit, even when the processes' budgets differ; without it
    every process reads everything it needs (4x). A process failing its reads (on
    the path without broadcast, or on its part), a process asking for another
    broadcast=, a sharding no mesh axis divides, and a bad memory_budget on one
    process each give every process an error, not a hang."""
    path = tmp_path / "ckpt"
    stored = _replicated_checkpoint(path)
    specs = {**REPLICATED, "c": ["data", "model"]}  # (c has no replicas: as without broadcast)
    step = {"do": "broadcast", "path": str(path), "mesh": [4, 2], "specs": specs, "fail": None}
    results = run_processes(
        4,
        [
            {**step, "broadcast": True, "budget": 256 << 10, "budget_of": {"0": "64KiB"}},
            {**step, "broadcast": False},
            {**step, "broadcast": True, "budget_of": {"3": "64 KiBs"}},
            {**step, "broadcast": True, "fail": 2},  # (process 2's reads fail from here on)
            {**step, "broadcast": True, "broadcast_of": {"1": False}},
            {**step, "broadcast": True, "specs": {"u": ["model"]}},
        ],
        devices=2,
    )
    spread, each, bad, failed, differ, uneven = ([r[i] for r in results] for i in range(6))
    assert all(r["error"] is None and r["ok"] for r in spread + each), spread + each
    total = sum(stored[key] for key in specs)
    together = sum(r["read"] for r in spread)
    assert together <= 1.05 * total, (together, total, [r["read"] for r in spread])
    assert all(r["read"] > 0.1 * total for r in spread), spread  # spread over all four
    assert sum(r["read"] for r in each) >= 3.5 * (total - stored["c"]), (each, stored)
    assert "injected failure" in failed[2]["error"], failed[2]
    for process in (0, 1, 3):
        assert "process(es) [2] failed to read their share" in (failed[process]["error"] or "")
    assert all("TreeMismatchError" in (r["error"] or "") for r in differ), differ
    assert all("ShardingError" in (r["error"] or "") for r in uneven), uneven
    assert "memory_budget='64 KiBs' is not a size" in (bad[3]["error"] or ""), bad[3]
    for process in (0, 1, 2):
        assert "process(es) [3] failed to read their share" in (bad[process]["error"] or "")
