"""PyTorch weight files (issue 38): lazyckpt against `torch.load(mmap=True,
weights_only=True)` on the same 1 GiB `pytorch_model.bin`, in the same run.

    python benchmarks/bench_torch.py [--root DIR] [--repeat N]

Needs torch (it writes the file and is the peer): run it in an environment with
torch and lazyckpt installed. The file is a Hugging Face-style state dict of 32
float32 tensors of 32 MiB (`model.layers.N.mlp.up_proj.weight`).

- `full`: every tensor in host memory. torch: `torch.load(mmap=True,
  weights_only=True)`, then each tensor copied out of the map (`.clone()`, what a
  caller that keeps the values needs once the file may change); also `torch.load`
  without mmap, which reads the file whole. lazyckpt: `load(open(path))`.
- `one`: open, then one tensor in memory (torch: `torch.load` with and without mmap,
  then the tensor cloned).

Each measurement runs in a fresh process, cold (the file's pages dropped from the
page cache with `posix_fadvise(DONTNEED)` first) and warm (the file read once
before). Printed: best seconds of `--repeat`, bytes read (lazyckpt's counter),
peak memory above the baseline, and lazyckpt's speed over torch's.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from common import fmt_bytes, in_fresh_process, machine, measure, ratio

TENSORS, ROWS, COLS = 32, 2048, 4096  # 32 MiB each
ONE = "model.layers.17.mlp.up_proj.weight"


def _make(path: Path) -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    state = {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(ROWS, COLS, generator=generator)
        for i in range(TENSORS)
    }
    torch.save(state, path)


def _cold(path: str, cold: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if cold:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while os.read(fd, 1 << 24):
                pass
    finally:
        os.close(fd)


def _torch(path: str, case: str, cold: bool, mmap: bool) -> dict[str, Any]:
    import torch

    _cold(path, cold)

    def run() -> Any:
        state = torch.load(path, mmap=mmap, weights_only=True)
        if case == "one":
            return state[ONE].clone()
        return {name: tensor.clone() for name, tensor in state.items()}

    return measure(run)


def _lazyckpt(path: str, case: str, cold: bool) -> dict[str, Any]:
    import lazyckpt

    _cold(path, cold)

    def run() -> Any:
        tree = lazyckpt.open(path, flat=True)
        return lazyckpt.load(tree[ONE] if case == "one" else tree)

    return measure(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/lazyckpt-bench-torch"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    path = args.root / "pytorch_model.bin"
    if not path.exists():
        in_fresh_process(_make, path)
    size = path.stat().st_size
    print(f"machine: {machine()}")
    print(f"file: {path} ({fmt_bytes(size)}, {TENSORS} float32 tensors)")
    for cold in (True, False):
        for case in ("full", "one"):
            runs: dict[str, list[dict[str, Any]]] = {"mmap": [], "read": [], "lazyckpt": []}
            for _ in range(args.repeat):
                runs["mmap"].append(in_fresh_process(_torch, str(path), case, cold, True))
                runs["read"].append(in_fresh_process(_torch, str(path), case, cold, False))
                runs["lazyckpt"].append(in_fresh_process(_lazyckpt, str(path), case, cold))
            best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items() if v}
            title = f"{'cold' if cold else 'warm'} {case}"
            for name, run in best.items():
                print(
                    f"{title:10} {name:9} {run['seconds']:7.3f} s  read "
                    f"{fmt_bytes(run['bytes_read']):>10}  peak +{fmt_bytes(run['peak_above_baseline'])}"
                )
            ours = best["lazyckpt"]["seconds"]
            print(
                f"{title:10} lazyckpt vs torch.load(mmap=True): {ratio(best['mmap']['seconds'], ours)}"
            )
            if "read" in best:
                print(
                    f"{title:10} lazyckpt vs torch.load():          {ratio(best['read']['seconds'], ours)}"
                )


if __name__ == "__main__":
    main()
