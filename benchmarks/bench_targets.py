"""Restoring a Flax NNX model onto its abstract state: lazyckpt against Orbax, same run.

    python benchmarks/bench_targets.py [--root DIR] [--repeat N]

The checkpoint: one item holding an NNX model's state (8 blocks with a 4096 x 4096
float32 kernel sharded P(None, 'model') on a 2x4 mesh, and a bias: 512 MiB) and its
adamw optimizer state (mu and nu: 1 GiB more), saved by Orbax's CheckpointManager.
Each measurement runs in a fresh process; figures are the best of `--repeat` runs,
files in the page cache.

- *model*: the model's part of the item onto the abstract state from
  `nnx.get_abstract_model` (Orbax: `PyTreeRestore(partial_restore=True)`, which reads
  only what the target names; lazyckpt: `device_put(tree, target, partial=True)`).
- *everything*: model and optimizer state onto their abstract states.

Printed: seconds, ratio to Orbax, bytes read (tensorstore's counters, which count
Orbax's reads too), peak RSS above the process's baseline, and whether the values
are bit-equal.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common import (
    fastest,
    fmt_bytes,
    fresh_dir,
    in_fresh_process,
    machine,
    measure,
    ratio,
    versions,
)

BLOCKS, WIDTH = 8, 4096


def _model_class() -> Any:
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            kernel = nnx.with_partitioning(nnx.initializers.normal(0.02), (None, "model"))
            self.linear = nnx.Linear(WIDTH, WIDTH, kernel_init=kernel, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])

    return Model


def _mesh() -> Any:
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _abstract() -> dict[str, Any]:
    """The abstract target: model and optimizer state, with concrete shardings."""
    import optax
    from flax import nnx

    model_class = _model_class()

    def build() -> Any:
        model = model_class(nnx.Rngs(0))
        return nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    _, optimizer = nnx.get_abstract_model(build, _mesh())
    _, model = nnx.get_abstract_model(lambda: model_class(nnx.Rngs(0)), _mesh())
    return {"model": model, "optimizer": optimizer}


def make_checkpoint(root: Path) -> dict[str, Any]:
    import jax
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    with jax.set_mesh(_mesh()):
        model = _model_class()(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        # One update, so that mu and nu hold values rather than zeros.
        grads = jax.tree.map(lambda x: x * 0.5, nnx.state(model, nnx.Param))
        optimizer.update(model, grads)
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    with ocp.CheckpointManager(fresh_dir(root)) as manager:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    stored = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return {"stored_bytes": stored}


def _digest(tree: Any) -> list[float]:
    import jax
    import numpy as np

    return [float(np.asarray(leaf, np.float64).sum()) for leaf in jax.tree_util.tree_leaves(tree)]


def orbax_restore(root: str, case: str) -> dict[str, Any]:
    import jax
    import orbax.checkpoint as ocp

    target = _abstract()
    if case == "model":
        target = {"model": target["model"]}
    jax.devices()

    def run() -> Any:
        with ocp.CheckpointManager(root) as manager:
            restore = ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=case == "model",
            )
            return manager.restore(1, args=ocp.args.Composite(state=restore))["state"]

    out = measure(run, keep=True)
    out["digest"] = _digest(out.pop("result"))
    return out


def lazy_restore(root: str, case: str) -> dict[str, Any]:
    import jax

    import lazyckpt

    target = _abstract()
    if case == "model":
        target = {"model": target["model"]}
    jax.devices()

    def run() -> Any:
        return lazyckpt.device_put(lazyckpt.open(root), target, partial=case == "model")

    out = measure(run, keep=True)
    out["digest"] = _digest(out.pop("result"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    root = args.root / "nnx_targets"
    print(f"machine: {machine()}\n{versions()}")
    if not (root / "1").exists():
        start = time.perf_counter()
        made = in_fresh_process(make_checkpoint, root)
        print(
            f"wrote {root} ({fmt_bytes(made['stored_bytes'])}) in {time.perf_counter() - start:.1f} s"
        )
    for case in ("model", "everything"):
        runs: dict[str, list[dict[str, Any]]] = {"orbax": [], "lazyckpt": []}
        for _ in range(args.repeat):  # alternate, so both see the same machine state
            runs["orbax"].append(in_fresh_process(orbax_restore, str(root), case))
            runs["lazyckpt"].append(in_fresh_process(lazy_restore, str(root), case))
        best = {name: fastest(rs) for name, rs in runs.items()}
        equal = best["orbax"]["digest"] == best["lazyckpt"]["digest"]
        print(f"\n{case}: values equal: {equal}")
        for name, r in best.items():
            peaks = sorted(run["peak_above_baseline"] for run in runs[name])
            print(
                f"  {name:9} {r['seconds']:6.2f} s   read {fmt_bytes(r['bytes_read'])}   "
                f"peak above baseline {fmt_bytes(peaks[0])}-{fmt_bytes(peaks[-1])}"
            )
        print(
            f"  lazyckpt is {ratio(best['orbax']['seconds'], best['lazyckpt']['seconds'])} "
            "Orbax's speed"
        )


if __name__ == "__main__":
    main()
