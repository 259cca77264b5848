"""Converting and re-chunking: lazyckpt.convert against Orbax restore-then-save.

    python benchmarks/bench_convert.py [--root DIR] [--budget-mib N]

1. Convert a 2 GiB float32 checkpoint (8 arrays of 256 MiB, saved by orbax on 8 CPU
   devices, 32 MiB chunks) to bfloat16 with a 256 MiB budget. Goal: peak RSS below
   baseline + budget + 15%. Orbax, for contrast: restore the whole tree, cast it,
   save it (`PyTreeCheckpointer`, the same OCDBT + zarr3 layout).
2. Read 1% of the rows of a 512 MiB float32 array, saved three ways: by lazyckpt
   (default 4 MiB chunks), by orbax as a replicated array (its default layout: one
   chunk per shard, here the whole array) and by orbax sharded 8 ways. Goal: the
   lazyckpt-saved one reads at most 3% of its stored bytes.

Each measurement runs in a fresh process.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench_budget import ARRAYS, make_checkpoint
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

TALL = (65536, 2048)  # 512 MiB float32


def make_source(path: Path) -> int:
    return make_checkpoint(path, use_zarr3=True)


def lazy_convert(source: str, destination: str, budget: int) -> dict[str, Any]:
    import lazyckpt

    fresh_dir(Path(destination))
    return measure(
        lambda: lazyckpt.convert(source, destination, dtype="bfloat16", memory_budget=budget)
    )


def orbax_convert(source: str, destination: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    fresh_dir(Path(destination))

    def run() -> None:
        # Without restore args Orbax restores onto the saved shardings (_sharding).
        tree = ocp.PyTreeCheckpointer().restore(source)
        tree = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)
        orbax_save(Path(destination), tree, use_zarr3=True)

    return measure(run)


def make_tall(root: Path) -> dict[str, str]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lazyckpt

    value = np.random.default_rng(2).standard_normal(TALL, dtype=np.float32)
    mesh = jax.make_mesh((8,), ("d",))
    paths = {
        "lazyckpt.save (4 MiB chunks)": root / "tall_lazyckpt",
        "orbax, replicated (default layout)": root / "tall_orbax",
        "orbax, sharded 8 ways": root / "tall_orbax_sharded",
    }
    lazyckpt.save(fresh_dir(paths["lazyckpt.save (4 MiB chunks)"]), {"w": value})
    replicated = jax.device_put(value, NamedSharding(mesh, P()))
    orbax_save(fresh_dir(paths["orbax, replicated (default layout)"]), {"w": replicated})
    sharded = jax.device_put(value, NamedSharding(mesh, P("d")))
    orbax_save(fresh_dir(paths["orbax, sharded 8 ways"]), {"w": sharded})
    return {name: str(path) for name, path in paths.items()}


def read_rows(path: str) -> dict[str, Any]:
    import lazyckpt

    rows = TALL[0] // 100
    start = TALL[0] // 3
    lazy = lazyckpt.open(path)["w"]
    out = measure(lambda: lazy[start : start + rows].get())
    out["stored"] = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    out["chunks"] = lazy.chunks
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    parser.add_argument("--budget-mib", type=int, default=256)
    args = parser.parse_args()
    budget = args.budget_mib * MiB
    print(f"machine: {machine()}\n{versions()}")
    source = args.root / "convert_2g"
    start = time.perf_counter()
    data = in_fresh_process(make_source, source)
    print(
        f"source: {source} ({fmt_bytes(data)} float32; written in {time.perf_counter() - start:.1f} s)"
    )
    print(f"budget: {fmt_bytes(budget)}\n")
    ours = in_fresh_process(lazy_convert, str(source), str(args.root / "convert_lazy"), budget)
    theirs = in_fresh_process(orbax_convert, str(source), str(args.root / "convert_orbax"))
    check = in_fresh_process(
        _compare, str(args.root / "convert_lazy"), str(args.root / "convert_orbax")
    )
    limit = budget * 1.15
    print(f"{'float32 -> bfloat16, 2 GiB':38} {'seconds':>8} {'read':>12} {'peak RSS +':>12}")
    print(
        f"{'lazyckpt.convert':38} {ours['seconds']:8.2f} {fmt_bytes(ours['bytes_read']):>12} "
        f"{fmt_bytes(ours['peak_above_baseline']):>12}  goal < {fmt_bytes(limit)}: "
        f"{'met' if ours['peak_above_baseline'] < limit else 'NOT met'}"
    )
    print(
        f"{'orbax restore, cast, save':38} {theirs['seconds']:8.2f} "
        f"{fmt_bytes(theirs['bytes_read']):>12} {fmt_bytes(theirs['peak_above_baseline']):>12}"
    )
    print(f"outputs equal (all {ARRAYS} arrays, bfloat16 bit for bit): {check['equal']}\n")

    paths = in_fresh_process(_tall, args.root)["result"]
    print(f"reading 1% of the rows ({TALL[0] // 100} of {TALL[0]}) of a 512 MiB float32 array")
    print(f"{'saved by':38} {'chunks':>14} {'stored':>12} {'read':>12} {'share':>7} {'seconds':>8}")
    for name, path in paths.items():
        got = in_fresh_process(read_rows, path)
        share = got["bytes_read"] / got["stored"]
        print(
            f"{name:38} {got['chunks']!s:>14} {fmt_bytes(got['stored']):>12} "
            f"{fmt_bytes(got['bytes_read']):>12} {share:7.1%} {got['seconds']:8.3f}"
        )


def _tall(root: Path) -> dict[str, Any]:
    return {"result": make_tall(root)}


def _compare(ours: str, theirs: str) -> dict[str, Any]:
    import numpy as np

    import lazyckpt

    a, b = lazyckpt.open(ours), lazyckpt.open(theirs)
    equal = all(
        np.array_equal(x.get().view(np.uint16), b[key].get().view(np.uint16))
        for key, x in a.items()
    )
    return {"equal": equal}


if __name__ == "__main__":
    main()
