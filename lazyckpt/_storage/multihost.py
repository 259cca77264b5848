"""Agreeing across the processes of a `jax.distributed` run.

Calls that every process makes together (`save`, `device_put` of global arrays) first
check that all processes asked for the same thing: a process with a different tree or
sharding would otherwise hang a collective or build an inconsistent array. The
checks are small collectives over JAX's own runtime (gloo on CPU), made only when
there is more than one process.

A run that has not imported jax has not initialized `jax.distributed` either: it is one
process, and asks jax nothing (reading a checkpoint to host never imports jax).
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from lazyckpt._errors import TreeMismatchError

_TEXT_BYTES = 4096


def count() -> int:
    jax = sys.modules.get("jax")
    return 1 if jax is None else int(jax.process_count())


def index() -> int:
    jax = sys.modules.get("jax")
    return 0 if jax is None else int(jax.process_index())


def _allgather(values: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils  # (more than one process: jax is imported)

    return np.asarray(multihost_utils.process_allgather(values))


def agree(what: str, description: str, fix: str) -> None:
    """Raise the same error on every process unless all gave the same `description`."""
    if count() == 1:
        return
    digest = hashlib.sha256(description.encode()).digest()[:8]
    mine = np.frombuffer(digest, np.int64).copy()
    gathered = _allgather(mine).reshape(count(), -1)[:, 0]
    differing = [i for i, value in enumerate(gathered) if value != gathered[0]]
    if differing:
        raise TreeMismatchError(
            f"the {count()} processes disagree on {what}: process(es) {differing} differ from "
            f"process 0; {fix}"
        )


def gather(flags: list[int]) -> list[list[int]]:
    """Every process's `flags` (a collective: every process must call it)."""
    if count() == 1:
        return [list(flags)]
    gathered = _allgather(np.array(flags, np.int32)).reshape(count(), len(flags))
    return [[int(v) for v in row] for row in gathered]


def any_failed(failed: bool) -> list[int]:
    """Which processes report a failure (a collective: every process must call it)."""
    return [i for i, (flag,) in enumerate(gather([int(failed)])) if flag]


def broadcast_text(text: str) -> str:
    """Process 0's `text` on every process."""
    if count() == 1:
        return text
    data = text.encode()[:_TEXT_BYTES]
    buffer = np.zeros(_TEXT_BYTES + 4, np.uint8)
    buffer[:4] = np.frombuffer(np.array([len(data)], np.int32).tobytes(), np.uint8)
    buffer[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
    from jax.experimental import multihost_utils

    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    size = int(np.frombuffer(received[:4].tobytes(), np.int32)[0])
    return bytes(received[4 : 4 + size]).decode()
