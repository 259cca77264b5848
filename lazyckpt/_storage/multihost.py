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

import contextlib
import hashlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lazyckpt._errors import (
    LazyckptError,
    LostProcessWarning,
    TreeMismatchError,
    error_class,
    warn,
)
from lazyckpt._text import human_bytes

Divide = Callable[[Sequence[tuple[Sequence[Any], int]]], list[int]]
"""Which process writes each unit of a save divided among the processes, from
`(the values it reads, the bytes it writes)` of each (`lazyckpt._convert.fleet`)."""

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
    from jax.experimental import multihost_utils

    return _decoded(np.asarray(multihost_utils.broadcast_one_to_all(_encoded(text))))


def _encoded(text: str) -> np.ndarray:
    """`text` as a fixed-size buffer: its length, then up to `_TEXT_BYTES` of UTF-8
    (a longer text is cut, at a character)."""
    data = text.encode()[:_TEXT_BYTES].decode(errors="ignore").encode()
    buffer = np.zeros(_TEXT_BYTES + 4, np.uint8)
    buffer[:4] = np.frombuffer(np.array([len(data)], np.int32).tobytes(), np.uint8)
    buffer[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
    return buffer


def _decoded(buffer: np.ndarray) -> str:
    size = int(np.frombuffer(buffer[:4].tobytes(), np.int32)[0])
    return bytes(buffer[4 : 4 + size]).decode()


def gather_text(text: str) -> list[str]:
    """Every process's `text`, in process order (a collective: every process must call
    it); each cut to 4 KiB."""
    if count() == 1:
        return [text]
    gathered = _allgather(_encoded(text)).reshape(count(), -1)
    return [_decoded(row) for row in gathered]


def agree_on_failure(what: str, failed: BaseException | None) -> None:
    """Raise on every process if `failed` is set on any (a collective: every process
    must call it, failed or not): the error names each failing process and its error,
    as the first failing process's error class where it is a lazyckpt one; `what`
    says what failed and what that left."""
    texts = gather_text("" if failed is None else f"{type(failed).__name__}:{failed}")
    failing = [(i, text) for i, text in enumerate(texts) if text]
    if not failing:
        return
    cls = error_class(failing[0][1].partition(":")[0])
    told = "; ".join(f"process {i} failed: {text.replace(':', ': ', 1)}" for i, text in failing)
    raise cls(f"{what}: {told}; every process of the {count()} stopped there") from failed


def job_label(base: str, mine: int, total: int) -> str:
    """A progress bar's description in a job of several processes: this process's
    part of the job's bytes."""
    if count() == 1:
        return base
    return (
        f"{base} (process {index()} of {count()}: "
        f"{human_bytes(mine)} of the job's {human_bytes(total)})"
    )


def agree_on_publishing(what: str, failed: BaseException | None, published: bool) -> None:
    """The last agreement of a job whose process 0 publishes (`published`: it did):
    `agree_on_failure`, but an interrupt (not an `Exception`) is re-raised once the
    others are told, and a process 0 that published whole does not fail because
    another process was lost after the job agreed (a `LostProcessWarning` says so)."""
    if failed is not None and not isinstance(failed, Exception):
        with contextlib.suppress(LazyckptError):  # (the others raise; this one goes on)
            agree_on_failure(what, failed)
        raise failed
    try:
        agree_on_failure(what, failed)
    except LazyckptError:
        raise
    except Exception as error:
        if not published:
            raise
        warn(
            f"{what.rpartition(':')[0]}: published whole, but a process was lost after "
            f"the job agreed ({type(error).__name__}: {str(error)[:200]}); check its log",
            LostProcessWarning,
        )
