"""Save a deterministic tree, for the kill test: `python -m tests.save_worker PATH SEED [overwrite]`.

Prints `ready` once the tree is built and the save starts, then `saved SECONDS`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np


def tree(seed: int) -> dict[str, Any]:
    """96 MiB in 12 arrays, plus a string and a scalar; values depend on `seed`."""
    rng = np.random.default_rng(seed)
    return {
        "layers": [{"w": rng.standard_normal((1024, 2048), dtype=np.float32)} for _ in range(12)],
        "note": f"seed {seed}",
        "seed": seed,
    }


def main(path: str, seed: int, overwrite: bool) -> None:
    import lazyckpt

    values = tree(seed)
    print("ready", flush=True)
    start = time.perf_counter()
    lazyckpt.save(path, values, chunk_bytes=256 << 10, overwrite=overwrite)
    print(f"saved {time.perf_counter() - start:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["overwrite"])
