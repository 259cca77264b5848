"""Reading lazy trees to host memory: `load`, and `iter_blocks` for streaming."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from lazyckpt._engine import Scheduler, Target, schedule_fill, stored_bytes
from lazyckpt._engine import iter_blocks as _iter_blocks
from lazyckpt._lazy import LazyArray
from lazyckpt._progress import Progress
from lazyckpt._tree import Predicate, leaves, map_leaves, select


def arrays_of(tree: Any) -> list[LazyArray]:
    return [leaf for _, leaf in leaves(tree) if isinstance(leaf, LazyArray)]


def load(
    tree: Any,
    which: str | Predicate | None = None,
    *,
    memory_budget: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Read every LazyArray in `tree` (or in `select(tree, which)`) into NumPy arrays.

    Reads of all arrays run concurrently, in blocks cut along stored chunks, with at
    most `memory_budget` bytes held by blocks in flight (default 32 MiB per core, at
    least 64 MiB) besides the returned arrays; blocks are written straight into the returned arrays where the
    dtype allows. `progress` shows a bar on stderr (None: only for large reads on a
    terminal). Leaves that are not LazyArrays are returned as they are.

    >>> params = lazyckpt.load(lazyckpt.open(path), "params/b")
    >>> params
    {'params': {'b': array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)}}
    """
    if which is not None:
        tree = select(tree, which)
    bar = Progress.maybe(progress, stored_bytes(arrays_of(tree)), "lazyckpt load")
    scheduler = Scheduler(memory_budget, bar)

    def start(leaf: Any) -> Any:
        if not isinstance(leaf, LazyArray):
            return leaf
        if leaf.key_impl:
            return leaf.get()  # typed keys are small; they come back as jax.Arrays
        target = Target(tuple((0, n) for n in leaf.shape), leaf.dtype)
        schedule_fill(leaf, [target], scheduler, lambda: None)
        return target

    pending = map_leaves(start, tree)
    scheduler.drain()
    if bar is not None:
        bar.close()
    return map_leaves(lambda x: x.buffer() if isinstance(x, Target) else x, pending)


def iter_blocks(
    tree: Any, *, memory_budget: int | None = None, progress: bool | None = None
) -> Iterator[tuple[str, tuple[slice, ...], np.ndarray]]:
    """Stream every LazyArray in `tree` as `(key, index, values)` blocks.

    Blocks follow the stored chunks (whole chunks, grouped up to the budget), and
    `array[index]` equals `values`. Reads run ahead of the consumer, but the blocks
    in flight plus the one being consumed stay within `memory_budget` bytes
    (default 32 MiB per core, at least 64 MiB; a single chunk larger than the budget
    is still read whole), so a
    checkpoint larger than memory can be reduced chunk by chunk.

    >>> tree = lazyckpt.open(path)
    >>> total = 0.0
    >>> for key, index, values in lazyckpt.iter_blocks(tree["params"], memory_budget=64):
    ...     total += float(values.sum())
    >>> total == float(np.arange(64).sum() + 8)
    True
    """
    arrays = arrays_of(tree)
    bar = Progress.maybe(progress, stored_bytes(arrays), "lazyckpt")
    for array, index, values in _iter_blocks(arrays, memory_budget, bar):
        yield array.key, index, values
    if bar is not None:
        bar.close()
