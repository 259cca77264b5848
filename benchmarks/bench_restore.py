"""Full and partial restores: lazyckpt against Orbax on the same checkpoints, same run.

    python benchmarks/bench_restore.py [--root DIR] [--repeat N] [--layouts numpy,devices,zarr3]

Three checkpoints of the same 8 float32 arrays of 128 MiB (1 GiB), random normal
values, written by orbax-checkpoint with its defaults:
- `numpy`: NumPy arrays (PyTreeCheckpointHandler: zarr v2, zstd, OCDBT), one 128 MiB
  chunk each;
- `devices`: the arrays on 8 CPU devices, rows sharded 8 ways: 16 MiB chunks;
- `zarr3`: the same jax.Arrays saved by the v1 API (`ocp.v1.save`), whose default
  is zarr3: one 16 MiB chunk per shard.
Each measurement runs in a fresh process; figures are the best of `--repeat` runs,
interleaved, files in the page cache (both tools alike).

Printed per layout: seconds and throughput, ratio to Orbax, bytes read (tensorstore's
counters, which count Orbax's reads too), and peak RSS above the process's baseline
as a multiple of the data. Also the machine's own limit on the same bytes: zstd
decoding of every stored chunk on all cores (stored bytes fetched beforehand, output
buffers allocated by the decoder), and lazyckpt's time as a share of it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from common import (
    GiB,
    MiB,
    fastest,
    fmt_bytes,
    fresh_dir,
    in_fresh_process,
    machine,
    measure,
    orbax_save,
    ratio,
    versions,
)

ARRAYS, ROWS, COLUMNS = 8, 4096, 8192  # 8 x 128 MiB float32
LAYOUTS = ("numpy", "devices", "zarr3")


def make_checkpoint(path: Path, layout: str) -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    tree: dict[str, Any] = {
        f"layer_{i}": rng.standard_normal((ROWS, COLUMNS), dtype=np.float32) for i in range(ARRAYS)
    }
    if layout != "numpy":
        sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
        tree = {name: jax.device_put(value, sharding) for name, value in tree.items()}
    fresh_dir(path)
    if layout == "zarr3":
        import orbax.checkpoint as ocp

        ocp.v1.save(path, tree)
    else:
        orbax_save(path, tree)
    stored = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"data_bytes": ARRAYS * ROWS * COLUMNS * 4, "stored_bytes": stored}


def _item(path: str) -> str:
    """The PyTree folder: the v1 API saves it as the `state` item."""
    return os.path.join(path, "state") if os.path.isdir(os.path.join(path, "state")) else path


def _mesh_sharding(spec: tuple[Any, ...]) -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(jax.make_mesh((8,), ("d",)), P(*spec))


def orbax_restore(path: str, target: str) -> dict[str, Any]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    path = _item(path)
    names = [f"layer_{i}" for i in range(ARRAYS)]
    if target == "host":
        args = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
    else:
        sharding = _mesh_sharding(("d",) if target == "devices" else (None, "d"))
        args = {n: ocp.ArrayRestoreArgs(sharding=sharding) for n in names}
    jax.devices()  # start the backend before the baseline is taken

    def restore() -> Any:
        tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
        jax.block_until_ready(tree)
        return tree

    return measure(restore)


def lazy_restore(path: str, target: str) -> dict[str, Any]:
    import jax

    import lazyckpt

    jax.devices()

    def restore() -> Any:
        tree = lazyckpt.open(path)
        if target == "host":
            return lazyckpt.load(tree)
        if target == "selection":
            return lazyckpt.load(tree, "layer_3")  # one array of eight
        spec = ("d",) if target == "devices" else (None, "d")
        out = lazyckpt.device_put(tree, _mesh_sharding(spec))
        jax.block_until_ready(out)
        return out

    return measure(restore)


def orbax_selection(path: str) -> dict[str, Any]:
    import numpy as np
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    path = _item(path)

    def restore() -> Any:
        # Orbax's partial restore: a target tree holding only the wanted item.
        item = {"layer_3": np.empty((ROWS, COLUMNS), np.float32)}
        args = {"layer_3": ocp.RestoreArgs(restore_type=np.ndarray)}
        return checkpointer.restore(
            path, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)
        )

    return measure(restore)


def plain_read(path: str) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    files = [p for p in Path(path).rglob("*") if p.is_file()]

    def read(file: Path) -> int:
        total = 0
        with open(file, "rb", buffering=0) as f:
            while chunk := f.read(16 * MiB):
                total += len(chunk)
        return total

    def run() -> int:
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            return sum(pool.map(read, files))

    return measure(run, keep=True)


def zstd_decode(path: str) -> dict[str, Any]:
    """Decode every stored chunk with zstd on all cores (bytes fetched beforehand)."""
    from concurrent.futures import ThreadPoolExecutor

    import tensorstore as ts
    import zstandard

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{_item(path)}/"}).result()
    keys = [k for k in kv.list().result() if not k.endswith((b".zarray", b"zarr.json"))]
    # zarr3 shards: the zstd frame precedes the 20-byte index of its one inner chunk.
    zarr3 = any(k.endswith(b"zarr.json") for k in kv.list().result())
    blobs = [kv.read(k).result().value[: -20 if zarr3 else None] for k in keys]
    local = __import__("threading").local()

    def decode(blob: bytes) -> int:
        if not hasattr(local, "d"):
            local.d = zstandard.ZstdDecompressor()
        return len(local.d.decompress(blob))

    def run() -> int:
        with ThreadPoolExecutor(os.cpu_count()) as pool:
            return sum(pool.map(decode, blobs))

    return measure(run, keep=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    print(f"machine: {machine()}\n{versions()}")
    every: dict[str, Any] = {}
    for layout in args.layouts.split(","):
        every[layout] = _layout(args.root / f"restore_{layout}", layout, args.repeat)
    print("\nsummary: lazyckpt's throughput as a multiple of Orbax's; share of the zstd limit")
    for layout, results in every.items():
        limit = results["zstd decode of the chunks"]["seconds"]
        for target in ("host", "8 devices"):
            ours, theirs = results[f"lazyckpt -> {target}"], results[f"orbax -> {target}"]
            print(
                f"  {layout:8} -> {target:9}  {ratio(theirs['seconds'], ours['seconds']):>6} "
                f"Orbax   {limit / ours['seconds']:5.0%} of the limit   peak "
                f"{ours['peak_above_baseline'] / results['data_bytes']:.2f}x data "
                f"(Orbax {theirs['peak_above_baseline'] / results['data_bytes']:.2f}x)"
            )
    if args.json:
        args.json.write_text(json.dumps(every, indent=1))


def _layout(path: Path, layout: str, repeat: int) -> dict[str, Any]:
    start = time.perf_counter()
    sizes = in_fresh_process(make_checkpoint, path, layout)
    data, stored = sizes["data_bytes"], sizes["stored_bytes"]
    print(
        f"\n{layout}: {path} ({fmt_bytes(data)} of float32 in {ARRAYS} arrays, "
        f"{fmt_bytes(stored)} stored; written in {time.perf_counter() - start:.1f} s)"
    )
    p = str(path)
    results: dict[str, Any] = {"data_bytes": data, "stored_bytes": stored}
    scenarios = [
        ("zstd decode of the chunks", zstd_decode, (p,)),
        ("orbax -> host", orbax_restore, (p, "host")),
        ("lazyckpt -> host", lazy_restore, (p, "host")),
        ("orbax -> 8 devices", orbax_restore, (p, "devices")),
        ("lazyckpt -> 8 devices", lazy_restore, (p, "devices")),
    ]
    if layout == "devices":
        scenarios += [
            ("plain read of the files", plain_read, (p,)),
            ("orbax -> 8 devices, misaligned", orbax_restore, (p, "misaligned")),
            ("lazyckpt -> 8 devices, misaligned", lazy_restore, (p, "misaligned")),
            ("orbax 1/8 selection -> host", orbax_selection, (p,)),
            ("lazyckpt 1/8 selection -> host", lazy_restore, (p, "selection")),
        ]
    # Rounds interleave the tools, so that load from other tenants of a shared machine
    # hits both alike; each figure is the fastest of its runs.
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in scenarios}
    for _ in range(repeat):
        for name, fn, fn_args in scenarios:
            runs[name].append(in_fresh_process(fn, *fn_args))
    for name, measured in runs.items():
        results[name] = fastest(measured)
        results[name]["all_seconds"] = sorted(r["seconds"] for r in measured)
    print(f"{'':36} {'seconds':>8} {'GiB/s':>6} {'vs orbax':>9} {'read':>12} {'peak RSS +':>12}")
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        amount = data / ARRAYS if "selection" in name else data
        anchor = results.get(name.replace("lazyckpt", "orbax")) if "lazyckpt" in name else None
        print(
            f"{name:36} {r['seconds']:8.2f} {amount / GiB / r['seconds']:6.2f} "
            f"{ratio(anchor['seconds'], r['seconds']) if anchor else '':>9} "
            f"{fmt_bytes(r['bytes_read']):>12} {fmt_bytes(r['peak_above_baseline']):>12}"
        )
    if layout == "devices":
        for n in ("orbax -> 8 devices, misaligned", "lazyckpt -> 8 devices, misaligned"):
            print(f"{n}: bytes read / stored bytes = {results[n]['bytes_read'] / stored:.3f}")
    return results


if __name__ == "__main__":
    main()
