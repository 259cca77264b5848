"""Safetensors read straight into place (issue 24): lazyckpt against the `safetensors`
library and Orbax v1's SAFETENSORS layout, on the same files, in the same run.

    python benchmarks/bench_raw.py [--root DIR] [--repeat N] [--cases big,put,small,tiny]

- `big`: a 1 GiB model in 2 files with a Hugging Face index (8 float32 tensors of
  128 MiB) read to host: `safetensors.numpy.load_file` per file against
  `lazyckpt.load(lazyckpt.open(folder))`.
- `put`: the same onto 8 CPU devices, rows sharded: Orbax v1 `ocp.load` with the
  SAFETENSORS layout and a sharded abstract tree, `load_file` + `jax.device_put`, and
  `lazyckpt.device_put`.
- `small`: one file of 20,000 float32 tensors of 4 KiB (releases that store each MoE
  expert apart have tens of thousands): `load_file` against open + load.
- `tiny`: one file of 10,000 tensors of 1 KiB, the same.

Each measurement runs in a fresh process (`common.in_fresh_process`), with the files
in the page cache for every reader. Printed: best seconds of `--repeat`, bytes read
(lazyckpt's counter; the safetensors library maps the file, which no counter sees),
peak memory above the baseline, and lazyckpt's speed over each peer.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import fmt_bytes, in_fresh_process, machine, measure, ratio, versions

TENSORS, ROWS, COLS = 8, 8192, 4096  # 128 MiB each


def _make(root: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    big = root / "big"
    if not (big / "model.safetensors.index.json").exists():
        big.mkdir(parents=True, exist_ok=True)
        weights = {}
        for f in range(2):
            name = f"model-{f + 1:05d}-of-00002.safetensors"
            tensors = {
                f"layers.{f * 4 + i}.w": rng.standard_normal((ROWS, COLS), dtype=np.float32)
                for i in range(TENSORS // 2)
            }
            save_file(tensors, str(big / name))
            weights.update(dict.fromkeys(tensors, name))
        index = {"metadata": {}, "weight_map": weights}
        (big / "model.safetensors.index.json").write_text(json.dumps(index))
    for name, count, size in (("small", 20_000, 1024), ("tiny", 10_000, 256)):
        path = root / f"{name}.safetensors"
        if not path.exists():
            values = {f"e{i}": rng.standard_normal(size, dtype=np.float32) for i in range(count)}
            save_file(values, str(path))


def _files(root: Path, case: str) -> list[str]:
    if case in ("big", "put"):
        return sorted(str(p) for p in (root / "big").glob("*.safetensors"))
    return [str(root / f"{case}.safetensors")]


def _peer(root: str, case: str) -> dict[str, Any]:
    from safetensors.numpy import load_file

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for file in _files(Path(root), case):
            out.update(load_file(file))
        return out

    return measure(run)


def _lazyckpt(root: str, case: str) -> dict[str, Any]:
    import lazyckpt

    where = Path(root) / ("big" if case == "big" else f"{case}.safetensors")
    return measure(lambda: lazyckpt.load(lazyckpt.open(where)))


def _sharding() -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))


def _ready(tree: Any) -> Any:
    import jax

    return jax.block_until_ready(tree)


def _orbax_v1_put(root: str, case: str) -> dict[str, Any]:
    import jax
    from orbax.checkpoint import v1 as ocp

    sharding = _sharding()
    folder = Path(root) / "big"
    names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    abstract = {
        name: jax.ShapeDtypeStruct((ROWS, COLS), "float32", sharding=sharding) for name in names
    }

    def run() -> Any:
        context = ocp.Context()
        context.checkpoint_layout = "safetensors"  # type: ignore[attr-defined]
        with context:
            return _ready(ocp.load(folder, abstract))

    return measure(run)


def _load_file_put(root: str, case: str) -> dict[str, Any]:
    import jax
    from safetensors.numpy import load_file

    sharding = _sharding()

    def run() -> Any:
        out = {}
        for file in _files(Path(root), case):
            out.update({k: jax.device_put(v, sharding) for k, v in load_file(file).items()})
        return _ready(out)

    return measure(run)


def _lazyckpt_put(root: str, case: str) -> dict[str, Any]:
    import lazyckpt

    sharding = _sharding()
    return measure(lambda: _ready(lazyckpt.device_put(lazyckpt.open(Path(root) / "big"), sharding)))


RUNNERS: dict[str, list[tuple[str, Callable[[str, str], dict[str, Any]]]]] = {
    "big": [("safetensors load_file", _peer), ("lazyckpt load", _lazyckpt)],
    "put": [
        ("Orbax v1 load (SAFETENSORS)", _orbax_v1_put),
        ("load_file + jax.device_put", _load_file_put),
        ("lazyckpt device_put", _lazyckpt_put),
    ],
    "small": [("safetensors load_file", _peer), ("lazyckpt open + load", _lazyckpt)],
    "tiny": [("safetensors load_file", _peer), ("lazyckpt open + load", _lazyckpt)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/lazyckpt-bench-raw"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default="big,put,small,tiny")
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    print(machine())
    print(versions())
    _make(args.root)
    for case in args.cases.split(","):
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.repeat):  # alternating, so that drift hits every reader alike
            for name, runner in RUNNERS[case]:
                found = in_fresh_process(runner, str(args.root), case)
                if name not in best or found["seconds"] < best[name]["seconds"]:
                    best[name] = found
        ours = next(found for name, found in best.items() if name.startswith("lazyckpt"))
        print(f"{case}:")
        for name, found in best.items():
            speed = (
                "" if found is ours else f"   lazyckpt {ratio(found['seconds'], ours['seconds'])}"
            )
            print(
                f"  {name:30s} {found['seconds']:.3f} s   read {fmt_bytes(found['bytes_read'])}   "
                f"peak +{fmt_bytes(found['peak_above_baseline'])}{speed}"
            )


if __name__ == "__main__":
    main()
