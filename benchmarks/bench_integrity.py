"""Single-bit flips in stored data: what Orbax's restore and lazyckpt's reads detect.

    python benchmarks/bench_integrity.py [--root DIR] [--flips N]

The same tree (a 2 MiB array in one chunk, a 256 KiB one) written twice: by
orbax-checkpoint with its defaults (zstd without checksums) and by `lazyckpt.save`
(zstd with its content checksum). For each of `--flips` seeded trials, one bit of one
data file (the OCDBT data files, weighted by size) is flipped in a copy, and the copy
is read by Orbax's restore, `lazyckpt.load` and `lazyckpt.verify`. A read either
raises (detected), returns the saved values (the bit did not matter), or returns
other values with no error (silent damage).
"""

from __future__ import annotations

import argparse
import random
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from common import fresh_dir, machine, orbax_save, versions


def _tree() -> dict[str, object]:
    import numpy as np

    rng = np.random.default_rng(5)
    return {
        "big": rng.standard_normal((512, 1024)).astype(np.float32),
        "small": rng.standard_normal((256, 256)).astype(np.float32),
    }


def _orbax_read(path: Path) -> dict[str, object]:
    import numpy as np
    import orbax.checkpoint as ocp

    restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in ("big", "small")}
    args = ocp.args.PyTreeRestore(restore_args=restore_args)
    return dict(ocp.PyTreeCheckpointer().restore(path, args=args))


def _lazy_read(path: Path) -> dict[str, object]:
    import lazyckpt

    return dict(lazyckpt.load(lazyckpt.open(path)))


def _outcome(read: Callable[[Path], dict[str, object]], path: Path, tree: dict[str, object]) -> str:
    import numpy as np

    try:
        values = read(path)
    except Exception:  # noqa: BLE001 - any error is a detection
        return "detected"
    same = all(np.array_equal(np.asarray(values[k]), tree[k]) for k in tree)
    return "harmless" if same else "silent"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/lazyckpt-bench", type=Path)
    parser.add_argument("--flips", type=int, default=200)
    args = parser.parse_args()
    import lazyckpt

    print(f"machine: {machine()}\n{versions()}\n")
    tree = _tree()
    print(f"{'written by':10} {'reader':16} {'detected':>9} {'harmless':>9} {'silent':>7}")
    for writer in ("orbax", "lazyckpt"):
        base = fresh_dir(args.root / f"integrity-{writer}")
        if writer == "orbax":
            orbax_save(base, tree)
        else:
            lazyckpt.save(base, tree, chunk_bytes=2 << 20)
        files = sorted(p for p in base.rglob("*") if p.is_file() and p.parent.name == "d")
        sizes = [f.stat().st_size for f in files]
        pick = random.Random(3)
        counts: dict[str, Counter[str]] = {r: Counter() for r in ("orbax restore", "lazyckpt load")}
        verified: Counter[str] = Counter()
        work = args.root / "integrity-work"
        for _ in range(args.flips):
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(base, work)
            (i,) = pick.choices(range(len(files)), weights=sizes)
            target = work / files[i].relative_to(base)
            data = bytearray(target.read_bytes())
            data[pick.randrange(len(data))] ^= 1 << pick.randrange(8)
            target.write_bytes(bytes(data))
            counts["orbax restore"][_outcome(_orbax_read, work, tree)] += 1
            counts["lazyckpt load"][_outcome(_lazy_read, work, tree)] += 1
            try:
                found = lazyckpt.verify(lazyckpt.open(work), progress=False).ok
                verified["harmless or silent" if found else "detected"] += 1
            except lazyckpt.LazyckptError:
                verified["detected"] += 1
        for reader, c in counts.items():
            print(f"{writer:10} {reader:16} {c['detected']:>9} {c['harmless']:>9} {c['silent']:>7}")
        print(f"{writer:10} {'lazyckpt verify':16} {verified['detected']:>9}  (reported damage)")
    print(f"\n{args.flips} single-bit flips per writer, in the data files of an OCDBT checkpoint")


if __name__ == "__main__":
    main()
