"""Two revisions of lazyckpt on the same checkpoints: did a change move the figures?

    python benchmarks/bench_versions.py OLD [NEW] [--root DIR] [--repeat N]

OLD and NEW are git revisions of this repository (NEW defaults to HEAD); each is
checked out in a temporary worktree and imported from there. The cases are the
checkpoints that `bench_open.py` and `bench_restore.py` write under `--root` (run
them first; missing ones are skipped), and a 512 MiB safetensors file written here:
`open` of 10,000 arrays, `load` of each 1 GiB Orbax layout and of the safetensors
file, and `stats` of one. Every run is a fresh process; the revisions alternate, and
the best of `--repeat` is printed with the ratio NEW / OLD (below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine

REPOSITORY = Path(__file__).resolve().parent.parent

CHILD = """
import os, sys, time, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import lazyckpt
verb, path = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if verb == "open":
    lazyckpt.open(path)
elif verb == "load":
    lazyckpt.load(lazyckpt.open(path))
else:
    lazyckpt.stats(lazyckpt.open(path))
print(json.dumps(time.perf_counter() - start))
"""


def _seconds(source: Path, verb: str, path: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(source))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, verb, str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def _safetensors_file(folder: Path) -> Path:
    import numpy as np

    import lazyckpt

    path = folder / "model.safetensors"
    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.standard_normal((4096, 4096), dtype=np.float32) for i in range(8)}
    lazyckpt.save(path, arrays)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--root", type=Path, default=Path("/tmp/lazyckpt-bench"))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as scratch:
        trees = {}
        for name, revision in (("old", args.old), ("new", args.new)):
            trees[name] = Path(scratch) / name
            subprocess.run(
                [
                    "git",
                    "-C",
                    str(REPOSITORY),
                    "worktree",
                    "add",
                    "-q",
                    "--detach",
                    str(trees[name]),
                    revision,
                ],
                check=True,
            )
        try:
            cases = [
                ("open", args.root / "open_10k"),
                ("load", args.root / "restore_numpy"),
                ("load", args.root / "restore_devices"),
                ("load", args.root / "restore_zarr3"),
                ("stats", args.root / "restore_devices"),
            ]
            cases = [(verb, path) for verb, path in cases if path.exists()]
            written = _safetensors_file(Path(scratch))
            cases += [("load", written), ("stats", written)]
            print(f"{args.old} (old) against {args.new} (new), best of {args.repeat}")
            for verb, path in cases:
                best = {"old": float("inf"), "new": float("inf")}
                for _ in range(args.repeat):
                    for name in ("old", "new"):
                        best[name] = min(best[name], _seconds(trees[name], verb, path))
                print(
                    f"  {verb:5s} {path.name:18s} old {best['old']:.3f} s  new {best['new']:.3f} s"
                    f"  new/old {best['new'] / best['old']:.2f}",
                    flush=True,
                )
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )


if __name__ == "__main__":
    main()
