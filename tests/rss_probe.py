"""Run one lazyckpt read in this fresh process and print its peak memory growth.

    python -m tests.rss_probe PATH load|device_put|staged|stream|stats|verify|slice|get BUDGET_BYTES
    python -m tests.rss_probe PATH convert|export BUDGET_BYTES DESTINATION
    python -m tests.rss_probe PATH save|save_T BUDGET_BYTES DESTINATION

Prints JSON: `peak` (bytes of peak RSS above the RSS just before the read; the
kernel's high-water mark is reset first), `kept` (bytes of arrays the read
returned) and, for `stream`, `largest` (bytes of the largest block). `slice` loads
rows 100:110 of the first array, `get` reads them with `.get()` (no budget given).
`staged` places the tree on one CPU device as lazyckpt places it on an accelerator
(in pieces sent as they are filled, `lazyckpt._device.staged`), once before the baseline
too: the small programs that make and update a shard on the device are compiled
once per shape (some 40 MiB of compiler memory), and `peak` holds a placement alone.
`save` saves the first array as a new Orbax checkpoint of 1 MiB chunks, `save_T` its
transpose.
Linux only (`/proc/self/clear_refs`).

Before the baseline is taken, one row of the first array is streamed and placed on
the devices: what any first read starts once (thread pools, decoder contexts, malloc
arenas, lazy imports) is then in the baseline, and `peak` holds the read itself.
"""

from __future__ import annotations

import gc
import json
import os
import sys


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(path: str, mode: str, budget: int, *extra: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lazyckpt

    if mode == "staged":
        from lazyckpt._device.platforms import PLATFORMS, Platform

        PLATFORMS["cpu"] = Platform(staged=True, adopts=True)
    tree = lazyckpt.open(path)
    sharding: jax.sharding.Sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P(None, "d"))
    total = 0.0
    row = {"row": next(leaf for _, leaf in lazyckpt.leaves(tree))[:1]}  # a few KiB
    for _ in lazyckpt.iter_blocks(row, memory_budget=1 << 20):
        pass
    jax.block_until_ready(lazyckpt.device_put(row, sharding, memory_budget=1 << 20))
    del row
    if mode == "staged":
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        jax.block_until_ready(lazyckpt.device_put(tree, one, memory_budget=budget))
    gc.collect()
    baseline = _rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    kept = largest = 0
    if mode == "convert":
        lazyckpt.convert(path, extra[0], dtype="bfloat16", memory_budget=budget)
    elif mode == "export":
        lazyckpt.convert(path, extra[0], to="safetensors", memory_budget=budget)
    elif mode in ("save", "save_T"):
        first = next(leaf for _, leaf in lazyckpt.leaves(tree))
        view = first.T if mode == "save_T" else first
        lazyckpt.save(extra[0], {"v": view}, memory_budget=budget, chunk_bytes=1 << 20)
    elif mode == "stream_reshape":  # the first array reshaped to the shape in `extra`
        first = next(leaf for _, leaf in lazyckpt.leaves(tree))
        view = first.reshape(*(int(n) for n in extra))
        for _, _, values in lazyckpt.iter_blocks(view, memory_budget=budget):
            total += float(values.sum(dtype=np.float64))
            largest = max(largest, values.nbytes)
    elif mode == "stream":
        for _, _, values in lazyckpt.iter_blocks(tree, memory_budget=budget):
            total += float(values.sum(dtype=np.float64))
            largest = max(largest, values.nbytes)
    elif mode == "stats":
        found = lazyckpt.stats(tree, memory_budget=budget)
        total = sum(s.mean or 0.0 for s in found.values())
    elif mode == "verify":
        result = lazyckpt.verify(tree, memory_budget=budget)
        arrays = [leaf for _, leaf in lazyckpt.leaves(tree) if isinstance(leaf, lazyckpt.LazyArray)]
        assert result.ok and result.nbytes == sum(a.nbytes for a in arrays), result
    elif mode == "load":
        loaded = lazyckpt.load(tree, memory_budget=budget)
        kept = sum(leaf.nbytes for _, leaf in lazyckpt.leaves(loaded))
    elif mode in ("slice", "get"):
        first = next(leaf for _, leaf in lazyckpt.leaves(tree))
        view = first[100:110]
        rows = lazyckpt.load(view, memory_budget=budget) if mode == "slice" else view.get()
        kept = rows.nbytes
    else:
        if mode == "staged":
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placed = jax.block_until_ready(lazyckpt.device_put(tree, sharding, memory_budget=budget))
        kept = sum(leaf.nbytes for leaf in jax.tree.leaves(placed))
    out = {"peak": _peak() - baseline, "kept": kept, "total": total, "largest": largest}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
