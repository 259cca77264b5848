"""Overwrite one checkpoint again and again, for the concurrent-reader test:
`python -m tests.overwrite_worker PATH SAVES`. Save k holds version k % 2 + 1 everywhere.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def tree(version: int) -> dict[str, Any]:
    """Every leaf says `version`: a scalar and a small array (inline in the OCDBT
    b-tree), a string (`_strings.json`) and 4 MiB in 16 chunks (data files)."""
    return {
        "step": version,
        "note": f"version {version}",
        "small": np.full(4, version, np.int32),
        "big": np.full((1024, 1024), version, np.float32),
    }


def version_of(loaded: dict[str, Any]) -> int | None:
    """The one version every leaf of `loaded` holds, or None for a mixed tree."""
    version = int(loaded["step"])
    same = (
        loaded["note"] == f"version {version}"
        and (loaded["small"] == version).all()
        and (loaded["big"] == version).all()
    )
    return version if same else None


def main(path: str, saves: int) -> None:
    import lazyckpt

    for k in range(saves):
        lazyckpt.save(path, tree(k % 2 + 1), chunk_bytes=256 << 10, overwrite=True)
        print(f"saved {k}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
