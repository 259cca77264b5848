"""Safetensors: lazyckpt against the `safetensors` library on the same files.

    python benchmarks/bench_safetensors.py [--root DIR] [--repeat N] [--budget-mib N]

1. Full read of a 1 GiB model (8 tensors of 128 MiB, float32): `safetensors.numpy.
   load_file` (mmap, then copies) against `lazyckpt.load(lazyckpt.open(...))`
   (byte ranges through tensorstore, no mmap), and the same as bfloat16 casts.
2. Ten rows of a 50257 x 768 embedding: `safe_open(...).get_slice(...)[a:b]` against
   `lazy[a:b].get()`; bytes read (lazyckpt's counter; safetensors' mmap faults in
   what it touches, at page granularity).
3. Export of a 1 GiB Orbax checkpoint (8 arrays of 128 MiB on 8 devices) to sharded
   safetensors: what users write today (Orbax restore, then `save_file` per shard)
   against `lazyckpt.convert(..., to="safetensors")` within the budget; time and peak
   memory above the baseline.

Each measurement runs in a fresh process; files are in the page cache for both.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from common import (
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

ARRAYS = 8
SHAPE = (8192, 4096)  # 128 MiB float32
EMBED = (50257, 768)


def make_model(path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {
        f"model.layers.{i}.mlp.weight": rng.standard_normal(SHAPE, dtype=np.float32)
        for i in range(ARRAYS)
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


def make_embedding(path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    embed = np.random.default_rng(1).standard_normal(EMBED, dtype=np.float32)
    save_file({"wte": embed}, str(path))


def make_orbax(path: Path) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",))
    rng = np.random.default_rng(2)
    tree = {
        "params": {
            f"layer_{i}": jax.device_put(
                rng.standard_normal(SHAPE, dtype=np.float32), NamedSharding(mesh, P("d"))
            )
            for i in range(ARRAYS)
        }
    }
    orbax_save(fresh_dir(path), tree)


def st_load(path: str, cast: bool) -> dict[str, Any]:
    import ml_dtypes
    from safetensors.numpy import load_file

    def run() -> Any:
        tensors = load_file(path)
        if cast:
            return {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
        return tensors

    return measure(run)


def lazy_load(path: str, cast: bool, budget: int) -> dict[str, Any]:
    import lazyckpt

    def run() -> Any:
        tree = lazyckpt.open(path, flat=True)
        if cast:
            tree = {k: v.astype("bfloat16") for k, v in tree.items()}
        return lazyckpt.load(tree, memory_budget=budget)

    return measure(run)


def st_rows(path: str) -> dict[str, Any]:
    from safetensors import safe_open

    def run() -> Any:
        with safe_open(path, "np") as f:
            return f.get_slice("wte")[20000:20010]

    out = measure(run)
    out["bytes_read"] = None  # mmap: no counter; pages of the rows are faulted in
    return out


def lazy_rows(path: str) -> dict[str, Any]:
    import lazyckpt

    return measure(lambda: lazyckpt.open(path)["wte"][20000:20010].get())


def st_export(source: str, destination: str) -> dict[str, Any]:
    import numpy as np
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file

    fresh_dir(Path(destination)).mkdir()

    def run() -> None:
        # What conversion scripts do: restore everything, then write each shard.
        tree = ocp.PyTreeCheckpointer().restore(source)
        tensors = {f"params.{k}": np.asarray(v) for k, v in tree["params"].items()}
        names = sorted(tensors)
        for i in range(0, len(names), 2):
            part = {name: tensors[name] for name in names[i : i + 2]}
            save_file(part, os.path.join(destination, f"model-{i // 2 + 1:05d}.safetensors"))

    return measure(run)


def lazy_export(source: str, destination: str, budget: int) -> dict[str, Any]:
    import lazyckpt

    fresh_dir(Path(destination))
    return measure(
        lambda: lazyckpt.convert(
            source,
            destination,
            to="safetensors",
            max_shard_size=256 * MiB,
            memory_budget=budget,
            progress=False,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/tmp/lazyckpt-bench-safetensors")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=256)
    args = parser.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    budget = args.budget_mib * MiB
    model, embed, orbax = root / "model.safetensors", root / "embed.safetensors", root / "orbax"
    if not model.exists():
        in_fresh_process(make_model, model)
    if not embed.exists():
        in_fresh_process(make_embedding, embed)
    if not orbax.exists():
        in_fresh_process(make_orbax, orbax)
    print(f"machine: {machine()}\nversions: {versions()}\nbudget: {args.budget_mib} MiB\n")

    print("1. full read of a 1 GiB safetensors file (best of", args.repeat, "fresh processes)")
    for cast in (False, True):
        ours, theirs = [], []
        for _ in range(args.repeat):  # interleaved, so machine load falls on both alike
            theirs.append(in_fresh_process(st_load, str(model), cast))
            ours.append(in_fresh_process(lazy_load, str(model), cast, budget))
        a, b = fastest(theirs), fastest(ours)
        label = "as bfloat16" if cast else "as stored"
        print(
            f"   {label}: safetensors {a['seconds']:.3f} s, peak +{fmt_bytes(a['peak_above_baseline'])}"
            f" | lazyckpt {b['seconds']:.3f} s, peak +{fmt_bytes(b['peak_above_baseline'])},"
            f" read {fmt_bytes(b['bytes_read'])} | time ratio {ratio(a['seconds'], b['seconds'])}"
        )

    print("\n2. ten rows of a 50257 x 768 float32 embedding")
    a = fastest([in_fresh_process(st_rows, str(embed)) for _ in range(args.repeat)])
    b = fastest([in_fresh_process(lazy_rows, str(embed)) for _ in range(args.repeat)])
    print(
        f"   safetensors get_slice {a['seconds'] * 1e3:.2f} ms (mmap)"
        f" | lazyckpt {b['seconds'] * 1e3:.2f} ms, read {b['bytes_read']:,} bytes"
        f" (10 rows = {10 * EMBED[1] * 4:,})"
    )

    print("\n3. export a 1 GiB Orbax checkpoint to sharded safetensors")
    ours, theirs = [], []
    for _ in range(args.repeat):
        theirs.append(in_fresh_process(st_export, str(orbax), str(root / "out_anchor")))
        ours.append(in_fresh_process(lazy_export, str(orbax), str(root / "out_lazy"), budget))
    a, b = fastest(theirs), fastest(ours)
    print(
        f"   orbax restore + save_file {a['seconds']:.3f} s, peak +{fmt_bytes(a['peak_above_baseline'])}"
        f" | lazyckpt.convert {b['seconds']:.3f} s, peak +{fmt_bytes(b['peak_above_baseline'])},"
        f" read {fmt_bytes(b['bytes_read'])} | time ratio {ratio(a['seconds'], b['seconds'])},"
        f" memory ratio {ratio(a['peak_above_baseline'], b['peak_above_baseline'])}"
    )


if __name__ == "__main__":
    main()
