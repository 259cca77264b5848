"""Statistics of strided views of one large stored chunk, within a small budget:
lazyckpt.stats against Orbax's restore followed by NumPy, on the same checkpoint.

    python benchmarks/bench_strided.py [--root DIR] [--repeat N] [--mib 16] [--save]

The checkpoint: one float32 array of `--mib` MiB saved by orbax-checkpoint as NumPy
(one zstd chunk, which lazyckpt decodes itself). For `x[::-1]`, `x[::2]` and
`x[:, ::2]`, and budgets of 64 KiB and 1 MiB, each run is a fresh process: Orbax
restores the array and NumPy computes the mean of the view; lazyckpt streams the
view through `stats` within the budget. Printed: seconds, bytes read over the stored
bytes, and peak memory above the baseline.

With `--save`: the views (and a reshape and a transpose) saved as a new Orbax
checkpoint with 1 MiB chunks: Orbax restores, NumPy takes the view and Orbax saves it;
lazyckpt streams it into the new chunk grid within the budget.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import MiB, fastest, fmt_bytes, fresh_dir, in_fresh_process, machine, measure

VIEWS = {"x[::-1]": (slice(None, None, -1),), "x[::2]": (slice(None, None, 2),)}
VIEWS["x[:, ::2]"] = (slice(None), slice(None, None, 2))
SAVED: dict[str, Callable[[Any], Any]] = {
    "x[::-1]": lambda x: x[::-1],
    "x[:, ::2]": lambda x: x[:, ::2],
    "x.reshape(-1, 1024)": lambda x: x.reshape(-1, 1024),
    "x.T": lambda x: x.T,
}
CHUNK = 1 << 20  # of the saved checkpoint


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


def _orbax_save(path: str, view: str, out: str) -> dict[str, Any]:
    import numpy as np
    import orbax.checkpoint as ocp

    def run() -> None:
        x = ocp.PyTreeCheckpointer().restore(path)["x"]
        value = np.ascontiguousarray(SAVED[view](x))
        saver = ocp.PyTreeCheckpointer()
        saver.save(fresh_dir(Path(out)), {"v": value}, force=True)

    return measure(run)


def _lazyckpt_save(path: str, view: str, budget: int, out: str) -> dict[str, Any]:
    import lazyckpt

    def run() -> None:
        x = lazyckpt.open(path)["x"]
        lazyckpt.save(
            out, {"v": SAVED[view](x)}, memory_budget=budget, chunk_bytes=CHUNK, overwrite=True
        )

    return measure(run)


def _saves(path: Path, stored: int, root: Path, repeat: int) -> None:
    print(f"saved as a new Orbax checkpoint ({fmt_bytes(CHUNK)} chunks for lazyckpt)")
    for view in SAVED:
        runs: dict[str, list[dict[str, Any]]] = {"orbax": [], "64 KiB": [], "1 MiB": []}
        for _ in range(repeat):
            out = str(root / "saved")
            runs["orbax"].append(in_fresh_process(_orbax_save, str(path), view, out))
            for name, budget in (("64 KiB", 64 << 10), ("1 MiB", 1 << 20)):
                runs[name].append(in_fresh_process(_lazyckpt_save, str(path), view, budget, out))
        for name, found in {name: fastest(found) for name, found in runs.items()}.items():
            who = "orbax restore+numpy+save" if name == "orbax" else f"lazyckpt.save, {name}"
            print(
                f"  {view:20s} {who:28s} {found['seconds']:.2f} s   read "
                f"{found['bytes_read'] / stored:.2f}x stored   "
                f"peak +{fmt_bytes(found['peak_above_baseline'])}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/lazyckpt-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--save", action="store_true", help="measure saves of the views")
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
    if args.save:
        _saves(path, stored, args.root, args.repeat)
        return
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
