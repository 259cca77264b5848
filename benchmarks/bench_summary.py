"""A 92,000-tensor model at a glance: open, summary and `lazyckpt inspect` on
DeepSeek-V3's metadata, against reading the same table with the safetensors library.

    python benchmarks/bench_summary.py [--root DIR] [--repeat N]

The model: DeepSeek-V3's 163 safetensors shards and index with its real names, shapes
and dtypes (91,991 tensors, 641 GiB), written with sparse data (tests/model_shapes.py),
so only headers are on disk. Each figure is the fastest of `--repeat` fresh processes,
files in the page cache; imports excluded except for the CLI, whose wall time is what a
user waits for.

- safetensors: `safe_open` on each shard, every tensor's shape and dtype
  (`get_slice(name).get_shape()`, `.get_dtype()`): the table, nothing more;
- lazyckpt open: the lazy tree (shapes, dtypes, chunks; nothing read);
- lazyckpt open + summary: the folded text a user reads, and how many lines;
- `lazyckpt inspect DIR`: the command, start to end, and whether it imported jax.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import fastest, fmt_bytes, in_fresh_process, machine, measure, ratio, versions

from tests.model_shapes import deepseek_v3


def safetensors_table(folder: str) -> dict[str, Any]:
    from safetensors import safe_open

    def run() -> int:
        table = {}
        for shard in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(shard, "np") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    piece = f.get_slice(name)
                    table[name] = (piece.get_shape(), piece.get_dtype())
        return len(table)

    return measure(run, keep=True)


def lazy_open(folder: str) -> dict[str, Any]:
    import lazyckpt

    def run() -> int:
        return sum(1 for _ in lazyckpt.leaves(lazyckpt.open(folder)))

    return measure(run, keep=True)


def lazy_summary(folder: str) -> dict[str, Any]:
    import lazyckpt

    def run() -> int:
        return len(lazyckpt.summary(lazyckpt.open(folder), title=folder).text().splitlines())

    return measure(run, keep=True)


def cli(folder: str, *flags: str) -> dict[str, Any]:
    code = (
        "import sys; from lazyckpt._cli.main import main; main(sys.argv[1:]); "
        "print('jax imported:', 'jax' in sys.modules, file=sys.stderr)"
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, "inspect", folder, *flags],
        capture_output=True,
        text=True,
        check=True,
    )
    return {
        "seconds": time.perf_counter() - start,
        "lines": len(done.stdout.splitlines()),
        "jax": done.stderr.strip().splitlines()[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench-summary")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    folder = deepseek_v3(Path(args.root) / "DeepSeek-V3")
    size = sum(f.stat().st_blocks * 512 for f in folder.iterdir())
    print(f"machine: {machine()}\nversions: {versions()}")
    print(f"model: {folder} (91,991 tensors in 163 shards; {fmt_bytes(size)} on disk)\n")
    runs = {
        name: fastest([in_fresh_process(fn, str(folder)) for _ in range(args.repeat)])
        for name, fn in [
            ("safetensors safe_open, every shape", safetensors_table),
            ("lazyckpt.open", lazy_open),
            ("lazyckpt.open + summary", lazy_summary),
        ]
    }
    anchor = runs["safetensors safe_open, every shape"]["seconds"]
    print(f"{'case':40} {'time':>8} {'vs safetensors':>15} {'peak memory':>13}  result")
    for name, run in runs.items():
        what = "lines" if "summary" in name else "tensors"
        print(
            f"{name:40} {run['seconds']:7.2f}s {ratio(anchor, run['seconds']):>15} "
            f"{fmt_bytes(run['peak_above_baseline']):>13}  {run['result']:,} {what}"
        )
    print()
    for flags in [(), ("--expand",)]:
        best = min(
            (cli(str(folder), *flags) for _ in range(args.repeat)), key=lambda r: r["seconds"]
        )
        command = " ".join(["lazyckpt inspect DIR", *flags])
        print(f"{command:40} {best['seconds']:7.2f}s  {best['lines']:,} lines, {best['jax']}")


if __name__ == "__main__":
    main()
