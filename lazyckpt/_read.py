"""Reading lazy trees to host memory: `load`, and `iter_blocks` for streaming."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from lazyckpt._array.tree import Select, gc_paused, leaves, selected
from lazyckpt._device.route import materialize
from lazyckpt._engine import stream
from lazyckpt._engine.fill import stored_bytes
from lazyckpt._engine.progress import shown
from lazyckpt._errors import renamed
from lazyckpt._lazy import LazyArray
from lazyckpt._open import open as open_checkpoint
from lazyckpt._placement.target import Missing, host, match
from lazyckpt._sizes import optional_size


def arrays_of(tree: object) -> list[tuple[str, LazyArray]]:
    """`(key path, LazyArray)` for every LazyArray leaf of `tree`."""
    return [(path, leaf) for path, leaf in leaves(tree) if isinstance(leaf, LazyArray)]


@renamed(which="select")
@gc_paused()  # (reading allocates a few objects per array, none in cycles)
def load(
    tree: object,
    select: Select | None = None,
    *,
    like: object = None,
    partial: bool = False,
    missing: Missing = "error",
    lossy_casts: bool = False,
    memory_budget: int | str | None = None,
    progress: bool | None = None,
) -> Any:
    """Read every LazyArray in `tree` into NumPy arrays, in the tree's own node types.

    Reads of all arrays run concurrently, in blocks cut along stored chunks, written
    straight into the returned arrays where the dtype allows. Leaves that are not
    LazyArrays are returned as they are; typed PRNG keys come back as `jax.Array`s.

    Args:
        tree: A lazy tree, any pytree holding LazyArrays, one LazyArray, or a
            checkpoint's path (`str` or `os.PathLike`, opened with `open`).
        select: Only the leaves matching a path pattern (`params/**/kernel`), any of
            a list of patterns, or a predicate `(path, leaf) -> bool`; see `select`.
        like: A target pytree (an abstract model state, a `TrainState`, a dict with
            int keys...): the result has its structure and dtypes, matched as
            `device_put` matches a target, on host; what Orbax's restore onto a
            target gives, without a full-size target.
        partial: With `like`, read only what the target names.
        missing: With `like`, what to do with target leaves the checkpoint lacks:
            "error", "keep", or a function `(path, target_leaf) -> value`.
        lossy_casts: With `like`, allow casts that can change values.
        memory_budget: Bytes held by blocks in flight (default 32 MiB per core, at
            least 64 MiB and at most 1 GiB); a stored chunk larger than the budget is
            still read whole. An int, or text: `"256MiB"` (powers of 1024: KiB, MiB,
            GiB, TiB) or `"1GB"` (powers of 1000: KB, MB, GB, TB, as Hugging Face
            reads them); else `SizeError`.
        progress: A tqdm bar (a widget in Jupyter, a line on a terminal): True
            always, False never, None (the default) for reads of 256 MiB or more in a
            notebook or on a terminal, when tqdm is installed, never in CI.

    >>> params = lazyckpt.load(lazyckpt.open(path), "params/b")
    >>> params
    {'params': {'b': array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)}}
    >>> lazyckpt.load(lazyckpt.open(path), like={"step": 0, "params": {"b": np.zeros(8, "float16")}},
    ...               partial=True)
    {'params': {'b': array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float16)}, 'step': 3}
    >>> lazyckpt.load(path, "params/b")  # a path: opened first
    {'params': {'b': array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)}}
    """
    whole = _opened(tree)
    tree = selected(whole, select)
    if like is None:
        plan = host(tree)
    else:
        plan = match(
            tree,
            like,
            partial=partial,
            missing=missing,
            lossy_casts=lossy_casts,
            to_host=True,
            unselected=whole,
        )
    return materialize(plan, memory_budget, progress, "lazyckpt load")


def iter_blocks(
    tree: object,
    select: Select | None = None,
    *,
    memory_budget: int | str | None = None,
    progress: bool | None = None,
) -> Iterator[tuple[str, tuple[slice, ...], np.ndarray]]:
    """Stream every LazyArray in `tree` as `(key path, index, values)` blocks.

    `key path` is the array's path in `tree`; blocks follow the stored chunks (whole
    chunks, grouped up to the budget), and `array[index]` equals `values`. Reads run
    ahead of the consumer, but the blocks in flight plus the one being consumed stay
    within the budget, so a checkpoint larger than memory can be reduced chunk by
    chunk. Blocks hold at least 64 KiB, whatever the budget: a decoding job reads
    256 KiB at a time anyway.

    Args:
        tree: A lazy tree, any pytree holding LazyArrays, one LazyArray, or a
            checkpoint's path (opened with `open`).
        select: Only the leaves matching a path pattern (`params/**/kernel`), any of
            a list of patterns, or a predicate `(path, leaf) -> bool`; see `select`.
        memory_budget: As for `load`.
        progress: As for `load`.

    >>> tree = lazyckpt.open(path)
    >>> total = 0.0
    >>> for key, index, values in lazyckpt.iter_blocks(tree["params"], memory_budget=64):
    ...     total += float(values.sum())
    >>> total == float(np.arange(64).sum() + 8)
    True
    """
    budget = optional_size("memory_budget", memory_budget)
    found = arrays_of(selected(_opened(tree), select))
    with shown(progress, stored_bytes(a for _, a in found), "lazyckpt") as bar:
        # Typed PRNG keys are small and read whole, outside the engine; each is yielded
        # before any block of a later array, so that the order stays the tree's.
        keys = collections.deque(i for i, (_, array) in enumerate(found) if array.key_impl)
        plain = [i for i, (_, array) in enumerate(found) if not array.key_impl]

        def keys_before(end: int) -> Iterator[tuple[str, tuple[slice, ...], np.ndarray]]:
            while keys and keys[0] < end:
                path, array = found[keys.popleft()]
                yield path, tuple(slice(0, n) for n in array.shape), array.get()
                if bar is not None:
                    bar.advance(stored_bytes([array]))

        arrays = [found[i][1] for i in plain]
        for position, index, values in stream.read_blocks(arrays, budget, bar):
            yield from keys_before(plain[position])
            yield found[plain[position]][0], index, values
        yield from keys_before(len(found))


def _opened(tree: object) -> object:
    """`tree`, or the checkpoint at `tree` where it is a path: `load("hf://org/m")`
    would otherwise return the string, as a leaf that is no LazyArray."""
    return open_checkpoint(tree) if isinstance(tree, str | os.PathLike) else tree
