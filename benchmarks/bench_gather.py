"""Rows picked by index (issue 39): lazyckpt's advanced indexing against reading the
array and indexing it in NumPy, on the same files, in the same run.

    python benchmarks/bench_gather.py [--root DIR] [--repeat N]

- `vocab`: 4,096 rows (sorted, random) of a 1 GiB embedding (262,144 x 1,024
  float32).
- `experts`: experts 3, 17, 40 and 41 of a 1 GiB bank of 64 experts (64 x 2,048 x
  2,048 float32).

Each is stored as safetensors (the `safetensors` library's file) and as Orbax
(`PyTreeCheckpointer`, zstd chunks of about 4 MiB). The peers read the whole array,
then index it: `safe_open(...).get_tensor(name)[index]`, and Orbax's restore of the
array then `[index]`. lazyckpt: `lazyckpt.load(lazyckpt.open(path)[name][index])`.
Each measurement runs in a fresh process with the files in the page cache; printed:
best seconds of `--repeat`, bytes read (lazyckpt's counter; the peers read the whole
array), peak memory above the baseline, and lazyckpt's speed over the peer.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common import fmt_bytes, in_fresh_process, machine, measure, ratio, versions

CASES = {"vocab": ((262144, 1024), "embed"), "experts": ((64, 2048, 2048), "experts")}


def _index(case: str) -> Any:
    import numpy as np

    if case == "vocab":
        return np.sort(np.random.default_rng(1).choice(262144, 4096, replace=False))
    return np.array([3, 17, 40, 41])


def _make(root: Path) -> None:
    import numpy as np
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    for case, (shape, name) in CASES.items():
        value = rng.standard_normal(shape, dtype=np.float32)
        save_file({name: value}, str(root / f"{case}.safetensors"))
        save_args = {name: ocp.SaveArgs(chunk_byte_size=4 << 20)}
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            checkpointer.save(
                root / f"{case}_orbax", args=ocp.args.PyTreeSave({name: value}, save_args=save_args)
            )


def _peer(root: str, case: str, layout: str) -> dict[str, Any]:
    import numpy as np

    _, name = CASES[case]
    index = _index(case)
    if layout == "safetensors":
        from safetensors import safe_open

        def run() -> Any:
            with safe_open(f"{root}/{case}.safetensors", framework="numpy") as f:
                return np.ascontiguousarray(f.get_tensor(name)[index])

    else:
        import orbax.checkpoint as ocp

        def run() -> Any:
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
                tree = checkpointer.restore(f"{root}/{case}_orbax")
            return np.ascontiguousarray(np.asarray(tree[name])[index])

    return measure(run)


def _ours(root: str, case: str, layout: str) -> dict[str, Any]:
    import lazyckpt

    _, name = CASES[case]
    index = _index(case)
    path = f"{root}/{case}.safetensors" if layout == "safetensors" else f"{root}/{case}_orbax"
    return measure(lambda: lazyckpt.load(lazyckpt.open(path)[name][index]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/lazyckpt-bench-gather"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    if not (args.root / "experts_orbax").exists():
        in_fresh_process(_make, args.root)
    print(f"machine: {machine()}")
    print(f"versions: {versions()}")
    for case in CASES:
        for layout in ("safetensors", "orbax"):
            peer = min(
                (in_fresh_process(_peer, str(args.root), case, layout) for _ in range(args.repeat)),
                key=lambda r: r["seconds"],
            )
            ours = min(
                (in_fresh_process(_ours, str(args.root), case, layout) for _ in range(args.repeat)),
                key=lambda r: r["seconds"],
            )
            title = f"{case:8} {layout:11}"
            print(
                f"{title} read whole + index: {peer['seconds']:7.3f} s  peak "
                f"+{fmt_bytes(peer['peak_above_baseline'])}"
            )
            print(
                f"{title} lazyckpt:           {ours['seconds']:7.3f} s  peak "
                f"+{fmt_bytes(ours['peak_above_baseline'])}  read {fmt_bytes(ours['bytes_read'])}"
                f"  ({ratio(peer['seconds'], ours['seconds'])})"
            )


if __name__ == "__main__":
    main()
