"""The two sides of a value comparison in `diff`, reduced to what they store: where
either repeats (a broadcast view: a tensor saved `expand`ed, a NumPy `broadcast_to`),
the stored values of both, spread only where the other side varies; and the whole
comparison's bytes weighed against those that its sides store (`_engine.workload`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from lazyckpt._array import repeats
from lazyckpt._array.broadcast_to import BroadcastTo
from lazyckpt._engine import workload
from lazyckpt._errors import ArgumentError
from lazyckpt._lazy import LazyArray, composed
from lazyckpt._text import human_bytes

Side = LazyArray | np.ndarray | jax.Array
"""The leaves compared as arrays: by shape and dtype, and with `values=True` by value,
whether they are lazy or already read (`diff(lazy_tree, lazyckpt.load(lazy_tree))`)."""


def unrepeated(path: str, old: Side, new: Side) -> tuple[Side, Side]:
    """The two sides where both are constant: a broadcast view's stored values
    (`repeats.core`), spread along the dimensions where the other side varies. They
    differ as the sides do, and cost what they store; sides that repeat along
    different dimensions, which no smaller view compares, are refused where that
    would go through far more than they store."""
    if not (_repeats(old) or _repeats(new)):
        return old, new
    a, b = _core(old), _core(new)
    common = tuple(max(m, n) for m, n in zip(a.shape, b.shape, strict=True))
    work = math.prod(common) * (a.dtype.itemsize + b.dtype.itemsize)
    stored = stored_nbytes([a, b])
    if repeats.excessive(work, stored):
        raise ArgumentError(
            f"{path}: values repeated from what is stored (a tensor saved expanded: strides "
            f"0); the first {_varying(a)}, the second {_varying(b)}: comparing them would go "
            f"through {human_bytes(work)} for {human_bytes(stored)} stored. Compare slices of "
            "both (index them alike), or leave values=False"
        )
    return _spread(a, common), _spread(b, common)


def repeated(array: Side) -> tuple[Side, frozenset[int]]:
    """`array`'s stored values (of its rank, size 1 where it repeats) and the
    dimensions along which it repeats them; `array` itself where it does not."""
    core = _core(array) if _repeats(array) else array
    dims = frozenset(
        d for d, (c, n) in enumerate(zip(core.shape, array.shape, strict=True)) if c == 1 < n
    )
    return core, dims


def check_work(pairs: Sequence[tuple[str, Side, Side]]) -> None:
    """Refuse, by name, comparing `pairs` (each `unrepeated`) where they would go
    through far more than their sides store, all told (`workload.check`)."""
    _check([(path, (old, new)) for path, old, new in pairs])


def check_reads(arrays: Sequence[tuple[str, Side]]) -> None:
    """`check_work` for arrays each read once (`repeated`'s stored values)."""
    _check([(path, (array,)) for path, array in arrays])


def _check(items: Sequence[tuple[str, tuple[Side, ...]]]) -> None:
    workload.check(
        "comparing them would go through",
        [(path, sum(side.nbytes for side in sides)) for path, sides in items],
        lambda: stored_nbytes([side for _, sides in items for side in sides]),
        "Compare fewer arrays (select=), or slices of them, or leave values=False",
    )


def stored_nbytes(sides: Sequence[Side]) -> int:
    """The bytes that `sides` store: a lazy side's each counted once
    (`workload.distinct_nbytes`), an array's in memory where it does not repeat."""
    lazy = [side for side in sides if isinstance(side, LazyArray)]
    held = sum(int(_core(side).nbytes) for side in sides if not isinstance(side, LazyArray))
    return workload.distinct_nbytes(lazy) + held


def _repeats(array: Side) -> bool:
    if isinstance(array, LazyArray):
        return repeats.repeats(array)
    return isinstance(array, np.ndarray) and any(
        n > 1 and s == 0 for n, s in zip(array.shape, array.strides, strict=True)
    )


def _core(array: Side) -> Side:
    """A broadcast view's stored values, of its rank (a NumPy array's where its strides
    are 0)."""
    if isinstance(array, LazyArray):
        found = repeats.core(array)
        assert isinstance(found, LazyArray), "the views of a LazyArray are LazyArrays"
        return found
    if isinstance(array, np.ndarray):
        return array[tuple(slice(0, 1) if s == 0 else slice(None) for s in array.strides)]
    return array


def _varying(array: Side) -> str:
    """How the values of `array` (a side's core) repeat: along which dimensions it
    varies, or the node it repeats under where the core could not see through it."""
    node = repeats.opaque(array) if isinstance(array, LazyArray) else None
    if node is not None:
        return f"repeats under a {node.describe()} that lazyckpt does not see through"
    dims = [d for d, n in enumerate(array.shape) if n > 1]
    return f"varies along dimensions {dims} only" if dims else "is one value"


def _spread(array: Side, shape: tuple[int, ...]) -> Side:
    """`array` broadcast to `shape`, lazily."""
    if tuple(array.shape) == shape:
        return array
    if isinstance(array, LazyArray):
        return composed(array.path, BroadcastTo(shape, array.dtype, array), array.dtype)
    return np.broadcast_to(np.asarray(array), shape)
