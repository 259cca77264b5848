"""Host-memory budget: stream a 2 GiB checkpoint, and place it on 8 devices, in 256 MiB.

    python benchmarks/bench_budget.py [--root DIR] [--budget-mib N]

The checkpoint: 8 float32 arrays of 256 MiB (2 GiB), random normal values, saved by
orbax-checkpoint on 8 CPU devices (rows sharded 8 ways; 32 MiB chunks). Each
measurement runs in a fresh process.

- stream: per-array min, max, mean and std computed block by block with
  `lazyckpt.iter_blocks(memory_budget=budget)`; the consumer keeps nothing.
  Goal: peak RSS below baseline + budget + 15%.
- device_put: `lazyckpt.device_put(tree, sharding, memory_budget=budget)` onto 8 CPU
  devices. Goal: peak RSS above baseline minus the device arrays' bytes <= budget.
- Orbax, for contrast: the same statistics need a full restore first.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common import (
    MiB,
    fmt_bytes,
    fresh_dir,
    in_fresh_process,
    machine,
    measure,
    orbax_save,
    versions,
)

ARRAYS, ROWS, COLUMNS = 8, 8192, 8192  # 8 x 256 MiB float32


def make_checkpoint(path: Path, **handler_options: Any) -> int:
    """8 float32 arrays of 256 MiB, saved by orbax from 8 devices; returns the bytes."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",))
    rng = np.random.default_rng(1)
    tree = {}
    for i in range(ARRAYS):
        host = rng.standard_normal((ROWS, COLUMNS), dtype=np.float32)
        tree[f"layer_{i}"] = jax.device_put(host, NamedSharding(mesh, P("d")))
        del host
    orbax_save(fresh_dir(path), tree, **handler_options)
    return ARRAYS * ROWS * COLUMNS * 4


def _statistics(blocks: Any) -> dict[str, list[float]]:
    import numpy as np

    stats: dict[str, list[float]] = {}
    for key, _, values in blocks:
        s = stats.setdefault(key, [np.inf, -np.inf, 0.0, 0.0, 0])
        s[0] = min(s[0], float(values.min()))
        s[1] = max(s[1], float(values.max()))
        # Buffered reductions: no temporary the size of the block.
        s[2] += float(values.sum(dtype=np.float64))
        s[3] += float(np.einsum("ij,ij->", values, values, dtype=np.float64))
        s[4] += values.size
    return stats


def lazy_stream(path: str, budget: int) -> dict[str, Any]:
    import lazyckpt

    return measure(
        lambda: _statistics(lazyckpt.iter_blocks(lazyckpt.open(path), memory_budget=budget)),
        keep=True,
    )


def lazy_device_put(path: str, budget: int) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lazyckpt

    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))

    def run() -> Any:
        out = lazyckpt.device_put(lazyckpt.open(path), sharding, memory_budget=budget)
        return jax.block_until_ready(out)

    return measure(run)


def first_read(path: str) -> dict[str, Any]:
    """Peak RSS of reading one row with `.get()`: lazyckpt decodes the first rows of
    its 32 MiB chunk only, through a few MiB of windows."""
    import lazyckpt

    tree = lazyckpt.open(path)
    return measure(lambda: tree["layer_0"][:1].get())


def orbax_stream(path: str) -> dict[str, Any]:
    import numpy as np
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    args = {f"layer_{i}": ocp.RestoreArgs(restore_type=np.ndarray) for i in range(ARRAYS)}

    def run() -> Any:
        tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
        return _statistics((k, None, v) for k, v in tree.items())

    return measure(run, keep=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    parser.add_argument("--budget-mib", type=int, default=256)
    args = parser.parse_args()
    budget = args.budget_mib * MiB
    path = args.root / "budget_2g"
    print(f"machine: {machine()}\n{versions()}")
    start = time.perf_counter()
    data = in_fresh_process(make_checkpoint, path)
    print(f"checkpoint: {path} ({fmt_bytes(data)}; written in {time.perf_counter() - start:.1f} s)")
    print(f"budget: {fmt_bytes(budget)}\n")
    fixed = in_fresh_process(first_read, str(path))["peak_above_baseline"]
    stream = in_fresh_process(lazy_stream, str(path), budget)
    placed = in_fresh_process(lazy_device_put, str(path), budget)
    anchor = in_fresh_process(orbax_stream, str(path))
    for (name, lazy), orbax in zip(
        stream["result"].items(), anchor["result"].values(), strict=True
    ):
        assert lazy[4] == orbax[4] and lazy[:2] == orbax[:2], name
        assert abs(lazy[2] - orbax[2]) <= 1e-6 * abs(orbax[3]) + 1e-3, name
    print(f"{'':34} {'seconds':>8} {'peak RSS +':>12} {'goal':>24}")
    limit = budget * 1.15
    print(
        f"{'lazyckpt stream statistics':34} {stream['seconds']:8.2f} "
        f"{fmt_bytes(stream['peak_above_baseline']):>12} {'< ' + fmt_bytes(limit):>24}"
        f"  {'met' if stream['peak_above_baseline'] < limit else 'NOT met'}"
    )
    beyond = placed["peak_above_baseline"] - data
    print(
        f"{'lazyckpt device_put (8 devices)':34} {placed['seconds']:8.2f} "
        f"{fmt_bytes(placed['peak_above_baseline']):>12} "
        f"{'data + ' + fmt_bytes(budget):>24}  "
        f"{'met' if beyond <= budget else 'NOT met'} (beyond the arrays: {fmt_bytes(beyond)})"
    )
    print(
        f"{'orbax restore, then statistics':34} {anchor['seconds']:8.2f} "
        f"{fmt_bytes(anchor['peak_above_baseline']):>12}"
    )
    print("statistics agree between lazyckpt and orbax for all arrays")
    print(f"\nreading the first row of a {ROWS // 8} x {COLUMNS} chunk holds {fmt_bytes(fixed)}")


if __name__ == "__main__":
    main()
