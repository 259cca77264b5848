"""Bytes each process reads in a 4-process restore: lazyckpt against Orbax.

    python benchmarks/bench_multihost.py [--root DIR] [--processes N] [--case columns|replicated]

One process saves a (4096, 2048) float32 array (32 MiB) with orbax, sharded by rows
over 8 devices (one 4 MiB chunk per shard). Then N processes with 4 CPU devices each
(jax.distributed on 127.0.0.1, gloo) restore it onto a mesh of all their devices,
sharded by columns, so every shard needs every stored chunk: each process needs the
rows of every chunk. Each restore is timed and its tensorstore byte counters read
per process. Each tool restores twice, interleaved, and the second run is reported.

`--case replicated` restores onto a ("data", "model") mesh of N x 4 devices, sharded
by columns over "model" and so replicated across the processes ("data"), as data
parallel training replicates parameters: Orbax, lazyckpt, and lazyckpt with
`broadcast=True` (each chunk read by one process, carried to the others by an XLA
all-reduce over gloo).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPE = (4096, 2048)


def _save(path: str) -> None:
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, str(Path(__file__).parent))
    from common import fresh_dir, orbax_save

    value = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    mesh = jax.make_mesh((8,), ("d",))
    orbax_save(fresh_dir(Path(path)), {"w": jax.device_put(value, NamedSharding(mesh, P("d")))})


def _worker(config: dict[str, Any]) -> None:
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = f"127.0.0.1:{config['port']}"
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=config["processes"],
        process_id=config["process"],
        coordinator_bind_address=address,
    )
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import lazyckpt
    from lazyckpt._storage.metrics import bytes_read

    tools = ["orbax", "lazyckpt"]
    if config["case"] == "replicated":
        grid = (config["processes"], len(jax.devices()) // config["processes"])
        mesh = jax.make_mesh(grid, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        sharding = NamedSharding(mesh, P(None, "model"))
        tools.append("lazyckpt broadcast")
    else:
        sharding = NamedSharding(jax.make_mesh((len(jax.devices()),), ("d",)), P(None, "d"))
    out: dict[str, Any] = {"process": config["process"]}
    # Each tool twice, interleaved; the second (warm) run of each is reported.
    for tool in tools + tools:
        before, start = bytes_read(), time.perf_counter()
        if tool == "orbax":
            import orbax.checkpoint as ocp

            args = {"w": ocp.ArrayRestoreArgs(sharding=sharding)}
            result = ocp.PyTreeCheckpointer().restore(
                config["path"], args=ocp.args.PyTreeRestore(restore_args=args)
            )["w"]
        else:
            result = lazyckpt.device_put(
                lazyckpt.open(config["path"])["w"], sharding, broadcast=tool.endswith("broadcast")
            )
        jax.block_until_ready(result)
        out[tool] = {"read": bytes_read() - before, "seconds": time.perf_counter() - start}
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--case", choices=["columns", "replicated"], default="columns")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import fmt_bytes, in_fresh_process, machine, versions

    path = str(args.root / "multihost_32m")
    print(f"machine: {machine()}\n{versions()}")
    in_fresh_process(_saved, path)
    stored = sum(p.stat().st_size for p in Path(path).rglob("d/*"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                json.dumps(
                    {
                        "process": i,
                        "processes": args.processes,
                        "port": port,
                        "path": path,
                        "case": args.case,
                    }
                ),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(args.processes)
    ]
    results = []
    try:
        for worker in workers:
            out, _ = worker.communicate(timeout=600)
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    tools = [t for t in results[0] if t != "process"]
    print(f"checkpoint: {path}, {fmt_bytes(stored)} stored in 8 row chunks")
    layout = "replicated across processes" if args.case == "replicated" else "sharded by columns"
    print(f"{args.processes} processes x 4 devices, restored {layout}")
    print(f"{'process':>8}" + "".join(f" {t + ' read':>24} {'x stored':>9}" for t in tools))
    for r in sorted(results, key=lambda r: r["process"]):
        print(
            f"{r['process']:>8}"
            + "".join(f" {fmt_bytes(r[t]['read']):>24} {r[t]['read'] / stored:9.2f}" for t in tools)
        )
    for tool in tools:
        total = sum(r[tool]["read"] for r in results)
        slowest = max(r[tool]["seconds"] for r in results)
        print(
            f"{tool}: all processes read {total / stored:.2f}x the stored bytes; slowest "
            f"process {slowest:.2f} s"
        )


def _saved(path: str) -> dict[str, Any]:
    _save(path)
    return {}


if __name__ == "__main__":
    main()
