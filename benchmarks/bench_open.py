"""Open / metadata of a 10,000-array checkpoint: lazyckpt.open against Orbax's metadata(),
and the full restore of the same 10,000 small arrays to NumPy against Orbax's restore.

    python benchmarks/bench_open.py [--root DIR] [--repeat N] [--restore-repeat N]

The checkpoint: {layer_000..099: {p000..p099: f32[8]}}, 10,000 jax.Arrays saved by
orbax-checkpoint (OCDBT, zarr v2). Each figure is the fastest of `--repeat` fresh processes (imports excluded), files in the page cache.
Both return every array's shape and dtype; lazyckpt also its chunks and sharding.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common import fresh_dir, in_fresh_process, machine, measure, orbax_save, ratio, versions

LAYERS, PARAMS = 100, 100


def make_checkpoint(path: Path) -> None:
    import jax.numpy as jnp

    tree = {
        f"layer_{i:03d}": {
            f"p{j:03d}": jnp.full((8,), i * PARAMS + j, jnp.float32) for j in range(PARAMS)
        }
        for i in range(LAYERS)
    }
    orbax_save(fresh_dir(path), tree)


def orbax_metadata(path: str) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()

    def run() -> int:
        tree = checkpointer.metadata(path).item_metadata.tree
        return sum(len(layer) for layer in tree.values())

    return measure(run, keep=True)


def lazy_open(path: str) -> dict[str, Any]:
    import lazyckpt

    def run() -> int:
        tree = lazyckpt.open(path)
        return sum(len(layer) for layer in tree.values())

    return measure(run, keep=True)


def orbax_restore(path: str) -> dict[str, Any]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)

    def run() -> float:
        tree = checkpointer.restore(path, restore_args=args)
        return float(sum(float(leaf.sum()) for leaf in jax.tree.leaves(tree)))

    return measure(run, keep=True)


def lazy_load(path: str) -> dict[str, Any]:
    import jax

    import lazyckpt

    def run() -> float:
        tree = lazyckpt.load(lazyckpt.open(path))
        return float(sum(float(leaf.sum()) for leaf in jax.tree.leaves(tree)))

    return measure(run, keep=True)


def lazy_display(path: str) -> dict[str, Any]:
    """Drawing the opened tree: lazyckpt's summary (text and HTML), and treescope."""
    import treescope

    import lazyckpt

    tree = lazyckpt.open(path)
    out = {}
    for name, draw in (
        ("summary, text", lambda: str(lazyckpt.summary(tree))),
        ("summary, HTML", lambda: lazyckpt.summary(tree)._repr_html_()),
        ("treescope.render_to_html", lambda: treescope.render_to_html(tree)),
    ):
        got = measure(draw, keep=True)
        out[name] = (got["seconds"], len(got["result"]), got["bytes_read"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--restore-repeat", type=int, default=2)
    args = parser.parse_args()
    path = args.root / "open_10k"
    print(f"machine: {machine()}\n{versions()}")
    if not (path / "_METADATA").exists():
        start = time.perf_counter()
        in_fresh_process(make_checkpoint, path)
        print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    runs: dict[str, list[dict[str, Any]]] = {"orbax metadata()": [], "lazyckpt.open": []}
    for _ in range(args.repeat):
        runs["orbax metadata()"].append(in_fresh_process(orbax_metadata, str(path)))
        runs["lazyckpt.open"].append(in_fresh_process(lazy_open, str(path)))
    best = {name: min(r["seconds"] for r in rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        assert all(r["result"] == LAYERS * PARAMS for r in rs), name
        reads = rs[0]["bytes_read"]
        print(
            f"{name:18} best {best[name]:6.3f} s   median "
            f"{sorted(r['seconds'] for r in rs)[len(rs) // 2]:6.3f} s   "
            f"{reads:,} bytes read through tensorstore"
        )
    print(
        f"lazyckpt.open is {ratio(best['orbax metadata()'], best['lazyckpt.open'])} faster "
        f"than orbax metadata() on {LAYERS * PARAMS:,} arrays"
    )
    restores: dict[str, list[dict[str, Any]]] = {"orbax restore": [], "lazyckpt open+load": []}
    for _ in range(args.restore_repeat):
        restores["orbax restore"].append(in_fresh_process(orbax_restore, str(path)))
        restores["lazyckpt open+load"].append(in_fresh_process(lazy_load, str(path)))
    total = {name: {r["result"] for r in rs} for name, rs in restores.items()}
    assert total["orbax restore"] == total["lazyckpt open+load"], total
    fast = {name: min(r["seconds"] for r in rs) for name, rs in restores.items()}
    print(
        f"\nfull restore of the {LAYERS * PARAMS:,} arrays to NumPy (best of {args.restore_repeat})"
    )
    for name, rs in restores.items():
        print(f"{name:18} best {fast[name]:6.3f} s   {rs[0]['bytes_read']:,} bytes read")
    print(
        "lazyckpt open+load is "
        f"{ratio(fast['orbax restore'], fast['lazyckpt open+load'])} faster than orbax restore"
    )
    print(f"\ndrawing the opened tree of {LAYERS * PARAMS:,} arrays (bytes read: array data)")
    for name, (seconds, size, reads) in in_fresh_process(lazy_display, str(path)).items():
        print(f"{name:26} {seconds:6.3f} s   {size / 1024:8,.0f} KiB   {reads:,} bytes read")


if __name__ == "__main__":
    main()
