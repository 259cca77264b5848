"""Statistics of strided views of one large stored chunk, within a small budget:
lazyckpt.stats against Orbax's restore followed by NumPy, on the same checkpoint.

    python benchmarks/bench_strided.py [--root DIR] [--repeat N] [--mib 16]

The checkpoint: one float32 array of `--mib` MiB saved by orbax-checkpoint as NumPy
(one zstd chunk, which lazyckpt decodes itself). For `x[::-1]`, `x[::2]` and
`x[:, ::2]`, and budgets of 64 KiB and 1 MiB, each run is a fresh process: Orbax
restores the array and NumPy computes the mean of the view; lazyckpt streams the
view through `stats` within the budget. Printed: seconds, bytes read over the stored
bytes, and peak memory above the baseline.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common import MiB, fastest, fmt_bytes, fresh_dir, in_fresh_process, machine, measure

VIEWS = {"x[::-1]": (slice(None, None, -1),), "x[::2]": (slice(None, None, 2),)}
VIEWS["x[:, ::2]"] = (slice(None), slice(None, None, 2))


def _orbax(path: str, view: str) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    def run() -> float:
        x = ocp.PyTreeCheckpointer().restore(path)["x"]
        return float(x[VIEWS[view]].mean(dtype="float64"))

    return measure(run)


def _lazyckpt(path: str, view: str, budget: int) -> dict[str, Any]:
    import lazyckpt

    def run() -> float:
        x = lazyckpt.open(path)["x"]
        return float(lazyckpt.stats({"v": x[VIEWS[view]]}, memory_budget=budget)["v"].mean)

    return measure(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/lazyckpt-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mib", type=int, default=16)
    args = parser.parse_args()
    import numpy as np
    import orbax.checkpoint as ocp

    print(machine())
    rows = int(args.mib * MiB // 4 // 2048)
    path = fresh_dir(args.root / "strided")
    values = np.random.default_rng(0).standard_normal((rows, 2048)).astype(np.float32)
    ocp.PyTreeCheckpointer().save(path, {"x": values})
    stored = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"one chunk of {fmt_bytes(values.nbytes)}, {fmt_bytes(stored)} on disk")
    for view in VIEWS:
        runs: dict[str, list[dict[str, Any]]] = {"orbax": [], "64 KiB": [], "1 MiB": []}
        for _ in range(args.repeat):
            runs["orbax"].append(in_fresh_process(_orbax, str(path), view))
            runs["64 KiB"].append(in_fresh_process(_lazyckpt, str(path), view, 64 << 10))
            runs["1 MiB"].append(in_fresh_process(_lazyckpt, str(path), view, 1 << 20))
        best = {name: fastest(found) for name, found in runs.items()}
        for name, found in best.items():
            who = "orbax restore + numpy" if name == "orbax" else f"lazyckpt.stats, {name}"
            print(
                f"  {view:10s} {who:28s} {found['seconds']:.2f} s   read "
                f"{found['bytes_read'] / stored:.2f}x stored   "
                f"peak +{fmt_bytes(found['peak_above_baseline'])}"
            )


if __name__ == "__main__":
    main()
