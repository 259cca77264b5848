"""One 1 GiB array in one stored chunk, read within a 128 MiB budget.

    python benchmarks/bench_single_chunk.py [--root DIR] [--budget-mib N] [--repeat N]

The checkpoint: a (32768, 8192) float32 NumPy array saved by orbax-checkpoint with its
defaults (PyTreeCheckpointHandler: zarr v2, zstd, OCDBT), which stores a NumPy array
as one chunk: here 1 GiB. Each measurement runs in a fresh process (best of
`--repeat`); peak RSS is above the process's baseline.

Goals (issue 13): `load` and `device_put` need at most budget + 15% beyond their
results; `iter_blocks`, `stats` and `verify` peak at most budget + 15%; 100 rows near the start
peak within the budget and read at most the stored prefix up to those rows plus one
read window; `stats` takes at most 1.3x a plain `load`. Orbax, for contrast, restores
the whole array for any of these.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common import (
    MiB,
    fastest,
    fmt_bytes,
    fresh_dir,
    in_fresh_process,
    machine,
    measure,
    orbax_save,
    versions,
)

ROWS, COLUMNS = 32768, 8192  # 1 GiB of float32


def make_checkpoint(path: Path) -> dict[str, int]:
    import numpy as np

    value = np.random.default_rng(7).standard_normal((ROWS, COLUMNS), dtype=np.float32)
    orbax_save(fresh_dir(path), {"w": value})
    stored = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"data_bytes": value.nbytes, "stored_bytes": stored}


def lazy(path: str, mode: str, budget: int) -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lazyckpt

    tree = lazyckpt.open(path)
    w = tree["w"]
    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))

    def stream() -> float:
        total = 0.0
        for _, _, values in lazyckpt.iter_blocks(tree, memory_budget=budget):
            total += float(values.sum(dtype=np.float64))
        return total

    operations = {
        "load": lambda: lazyckpt.load(w, memory_budget=budget).nbytes,
        "device_put": lambda: (
            jax.block_until_ready(lazyckpt.device_put(w, sharding, memory_budget=budget)).nbytes
        ),
        "iter_blocks": stream,
        "stats": lambda: lazyckpt.stats(w, memory_budget=budget)[w.key].mean,
        "verify": lambda: lazyckpt.verify(w, memory_budget=budget, progress=False).ok,
        "100 rows at 1000": lambda: lazyckpt.load(w[1000:1100], memory_budget=budget).nbytes,
    }
    return measure(operations[mode], keep=True)


def orbax_restore(path: str) -> dict[str, Any]:
    import numpy as np
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    args = {"w": ocp.RestoreArgs(restore_type=np.ndarray)}
    return measure(
        lambda: (
            checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))["w"].nbytes
        ),
        keep=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    parser.add_argument("--budget-mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    budget = args.budget_mib * MiB
    path = args.root / "single_chunk_1g"
    print(f"machine: {machine()}\n{versions()}")
    start = time.perf_counter()
    sizes = in_fresh_process(make_checkpoint, path)
    data, stored = sizes["data_bytes"], sizes["stored_bytes"]
    print(
        f"checkpoint: {path} ({fmt_bytes(data)} in one chunk, {fmt_bytes(stored)} stored; "
        f"written in {time.perf_counter() - start:.1f} s); budget {fmt_bytes(budget)}\n"
    )
    modes = ["load", "device_put", "iter_blocks", "stats", "verify", "100 rows at 1000"]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in [*modes, "orbax restore"]}
    for _ in range(args.repeat):
        for mode in modes:
            runs[mode].append(in_fresh_process(lazy, str(path), mode, budget))
        runs["orbax restore"].append(in_fresh_process(orbax_restore, str(path)))
    best = {mode: fastest(rs) for mode, rs in runs.items()}
    limit = budget * 1.15
    print(f"{'':22} {'seconds':>8} {'read':>12} {'peak RSS +':>12} {'beyond result':>14}  goal")
    for mode, r in best.items():
        kept = r["result"] if mode in ("load", "device_put", "orbax restore") else 0
        kept = kept if isinstance(kept, int) else 0
        beyond = r["peak_above_baseline"] - kept
        goal = budget if mode == "100 rows at 1000" else limit
        verdict = (
            ""
            if mode == "orbax restore"
            else (f"< {fmt_bytes(goal)}: {'met' if beyond < goal else 'NOT met'}")
        )
        print(
            f"{mode:22} {r['seconds']:8.2f} {fmt_bytes(r['bytes_read']):>12} "
            f"{fmt_bytes(r['peak_above_baseline']):>12} {fmt_bytes(beyond):>14}  {verdict}"
        )
    rows = best["100 rows at 1000"]
    prefix = stored * 1100 / ROWS
    print(
        f"\n100 rows at row 1000 read {fmt_bytes(rows['bytes_read'])}: the stored prefix up to "
        f"row 1100 is about {fmt_bytes(prefix)} (zstd cannot seek), plus reads ahead"
    )
    ratio = best["stats"]["seconds"] / best["load"]["seconds"]
    print(f"stats took {ratio:.2f}x the time of a plain load (goal: at most 1.3x)")


if __name__ == "__main__":
    main()
