"""A 2 GiB FP8 release dequantized to bf16 by 1, 2 (and 4) processes of one job.

    python benchmarks/bench_fleet_convert.py [--gib G] [--budget-mib N] [--processes 1 2 4]
        [--formats orbax safetensors] [--max-shard-size-mib N] [--repeat R] [--data DIR]

The source is bench_dequantize.py's synthetic DeepSeek-style folder (float8_e4m3fn
experts with float32 `weight_scale_inv` per 128 x 128 block, one shard per layer,
written by the `safetensors` library). Each run is a fresh interpreter that calls
`lazyckpt.convert(source, destination, dequantize=True, to=FORMAT, memory_budget=B,
processes=N)`: with N > 1, `convert` starts N local processes (a jax.distributed job
on 127.0.0.1) that divide the work. The wall time is the whole call, the children's
start-up included. Each process reports, at its exit, the bytes it read from the
source and its peak RSS above its RSS once the lazy tree was built (VmHWM), against
its own budget. The safetensors destination is cut into files of at most
`--max-shard-size-mib` (1 GiB: four files, which the processes share). The outputs of
every N are compared with N = 1's, bit for bit (and file for file).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_dequantize import layers_for, make_model, stored_tensor_bytes
from common import GiB, MiB, fmt_bytes, fresh_dir, in_fresh_process, machine, ratio, versions

_REPORTS = "LAZYCKPT_BENCH_REPORTS"
"""The folder each process writes its report into (set by the run, read by `report`)."""


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def report(tree: object) -> object:
    """`convert`'s transform in every process: note the RSS now (jax imported, the lazy
    tree built), and at exit write the bytes read and the peak RSS."""
    import jax

    from lazyckpt._storage.metrics import direct_bytes_read

    baseline, started = _status("VmRSS:"), time.perf_counter()

    def write() -> None:
        out = {
            "process": jax.process_index(),
            "bytes_read": direct_bytes_read(),
            "peak_above_baseline": _status("VmHWM:") - baseline,
            "seconds_after_tree": time.perf_counter() - started,
        }
        Path(os.environ[_REPORTS], f"{out['process']}.json").write_text(json.dumps(out))

    atexit.register(write)
    return tree


def run(source: str, destination: str, fmt: str, processes: int, budget: int, shard: int) -> None:
    """One conversion (the body of the fresh interpreter `main` starts)."""
    import lazyckpt

    lazyckpt.convert(
        source,
        destination,
        dequantize=True,
        to="orbax" if fmt == "orbax" else "safetensors",
        max_shard_size=shard if fmt == "safetensors" else None,
        memory_budget=budget,
        processes=processes,
        transform=report,
        progress=False,
    )


def timed_run(
    source: Path, destination: Path, fmt: str, processes: int, budget: int, shard: int
) -> dict[str, Any]:
    fresh_dir(destination)
    reports = fresh_dir(destination.parent / f"reports-{fmt}-{processes}")
    reports.mkdir()
    here = Path(__file__).parent
    script = (
        f"import sys; sys.path.insert(0, {str(here)!r}); import bench_fleet_convert as b; "
        f"b.run({str(source)!r}, {str(destination)!r}, {fmt!r}, {processes}, {budget}, {shard})"
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, _REPORTS: str(reports)},
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{fmt}, {processes} processes failed:\n{done.stderr[-3000:]}")
    per = [json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))]
    return {"seconds": seconds, "per_process": sorted(per, key=lambda r: r["process"])}


def same_output(first: str, second: str) -> bool:
    """Every array of the two outputs equal bit for bit, the same names and dtypes."""
    import numpy as np

    import lazyckpt

    a, b = dict(lazyckpt.leaves(lazyckpt.open(first))), dict(lazyckpt.leaves(lazyckpt.open(second)))
    if sorted(a) != sorted(b):
        return False
    return all(
        a[k].dtype == b[k].dtype
        and np.array_equal(
            np.asarray(a[k].get()).view(np.uint8), np.asarray(b[k].get()).view(np.uint8)
        )
        for k in a
    )


def same_files(first: str, second: str) -> bool:
    """The same file names with the same bytes (a safetensors folder)."""
    names = sorted(p.name for p in Path(first).iterdir())
    if names != sorted(p.name for p in Path(second).iterdir()):
        return False
    return all((Path(first) / n).read_bytes() == (Path(second) / n).read_bytes() for n in names)


def _compare(fmt: str, first: str, second: str) -> dict[str, Any]:
    out = {"values": same_output(first, second)}
    if fmt == "safetensors":
        out["files"] = same_files(first, second)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="FP8 weights to write, in GiB")
    parser.add_argument("--budget-mib", type=int, default=256, help="each process's budget")
    default = [1, 2, 4] if (os.cpu_count() or 1) >= 4 else [1, 2]
    parser.add_argument("--processes", type=int, nargs="+", default=default)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the fastest shown")
    parser.add_argument("--formats", nargs="+", default=["orbax", "safetensors"])
    parser.add_argument(
        "--max-shard-size-mib",
        type=int,
        default=1024,
        help="safetensors files of at most this size (several files, for the processes to share)",
    )
    parser.add_argument("--data", default="/tmp/lazyckpt-bench-dequant", type=Path)
    args = parser.parse_args()
    budget = args.budget_mib * MiB
    layers = layers_for(args.gib)
    source = args.data / f"fp8_moe_{layers}x32"
    if not (source / "config.json").exists():  # written last: the folder is complete
        in_fresh_process(_make, fresh_dir(source), layers)
    stored = stored_tensor_bytes(source)
    print(f"machine: {machine()}\nversions: {versions()}\nbudget: {args.budget_mib} MiB each")
    print(
        f"source: {source}, {layers} shards, float8_e4m3fn with 128x128 float32 scales; "
        f"{fmt_bytes(stored)} of tensors ({stored / GiB:.2f} GiB)\n"
    )
    print(
        "| format | processes | time s | vs 1 process | bytes read per process "
        "| job / stored | peak RSS above baseline per process (MiB) | of its budget |"
    )
    print("|---|---|---|---|---|---|---|---|")
    checks = []
    for fmt in args.formats:
        base: dict[str, Any] | None = None
        for n in args.processes:
            destination = args.data / f"out-{fmt}-{n}"
            shard = args.max_shard_size_mib * MiB
            runs = [
                timed_run(source, destination, fmt, n, budget, shard) for _ in range(args.repeat)
            ]
            # The fastest run's time; each process's worst peak: the bound is on every run.
            r = min(runs, key=lambda run: run["seconds"])
            per = r["per_process"]
            total = sum(p["bytes_read"] for p in per)
            peaks = [max(run["per_process"][i]["peak_above_baseline"] for run in runs)
                     for i in range(n)]  # fmt: skip
            base = base or {**r, "destination": str(destination)}
            print(
                f"| {fmt} | {n} | {r['seconds']:.1f} | {ratio(base['seconds'], r['seconds'])} | "
                f"{', '.join(fmt_bytes(p['bytes_read']) for p in per)} | "
                f"{total / stored:.4f}x | {', '.join(f'{p / MiB:,.0f}' for p in peaks)} | "
                f"{max(peaks) / budget:.2f}x |",
                flush=True,
            )
            if n != args.processes[0]:
                checks.append(
                    (fmt, n, in_fresh_process(_compare, fmt, base["destination"], str(destination)))
                )
    for fmt, n, found in checks:
        print(f"{fmt}, {n} processes against {args.processes[0]}: {found}")


def _make(folder: Path, layers: int) -> dict[str, Any]:
    make_model(folder, layers)
    return {}


if __name__ == "__main__":
    main()
