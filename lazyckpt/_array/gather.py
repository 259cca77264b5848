"""NumPy's advanced indexing (integer arrays and boolean masks) planned without data.

`x[[3, 17, 42]]`, `x[:, mask]`, `x[idx, :, jdx]`: an index with arrays (lists, NumPy
or jax arrays) picks elements rather than ranges. NumPy's rules decide the result's
shape: the index arrays (and any ints beside them) broadcast together to one shape
`B`; a mask counts as the integer arrays of its `nonzero()`; where the advanced
indices are next to each other, `B` takes their place in the result, and where a
slice, `...` or None separates them, `B` comes first.

`plan` turns such an index into a `Gather`: the basic index to apply first (every
advanced position kept whole), which of its result's dimensions the picks index, the
picks themselves, and where `B` goes. `LazyArray` builds the view from it, out of
basic views of the array, so a read reads only the chunks the picked elements touch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from lazyckpt._array.compose import Concat, Node, Part, Stack
from lazyckpt._array.selection import Stored
from lazyckpt._errors import LazyIndexError

MAX_PICKS = 1 << 24
"""The most elements (rows, experts...) one index may pick."""
MAX_PIECES = 1 << 17
"""The most views a picked view is made of (a run of rows is one; each costs about
1.5 KB and a share of every read's planning)."""


@attrs.frozen
class Gather:
    """An advanced index, planned: `x[index]` is `x[basic]` with `picks` taken along
    its dimensions `axes`, the picks' shape `shape` placed at result dimension `at`."""

    basic: tuple[int | slice | None, ...]
    axes: tuple[int, ...]
    picks: np.ndarray = attrs.field(eq=False)
    """One row per element picked, in C order of `shape`: its index on each axis."""
    shape: tuple[int, ...]
    at: int


def is_advanced(index: object) -> bool:
    """Whether `index` holds an array or list (an advanced index), not only basic items."""
    items = index if isinstance(index, tuple) else (index,)
    return any(_is_array(item) for item in items)


def _is_array(item: object) -> bool:
    if isinstance(item, list):
        return True
    shape = getattr(item, "shape", None)
    dtype = getattr(item, "dtype", None)
    # A 0-d integer array is an int (basic); a 0-d bool array is a mask.
    return (
        isinstance(shape, tuple)
        and dtype is not None
        and (bool(shape) or np.dtype(dtype).kind == "b")
    )


def plan(index: object, shape: tuple[int, ...]) -> Gather:
    """The `Gather` of `index` on an array of `shape`."""
    items = list(index) if isinstance(index, tuple) else [index]
    converted: list[Any] = []
    for item in items:
        if item is None or item is Ellipsis or isinstance(item, slice):
            converted.append(item)
        elif _is_array(item):
            converted.append(_array(item))
        else:
            converted.append(item)  # an int: basic indexing checks it
    consumed = sum(
        item.ndim if isinstance(item, np.ndarray) and item.dtype == bool else 1
        for item in converted
        if item is not None and item is not Ellipsis
    )
    if consumed > len(shape):
        raise LazyIndexError(
            f"too many indices: the array is {len(shape)}-dimensional but {consumed} were given"
        )
    if sum(item is Ellipsis for item in converted) > 1:
        raise LazyIndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in [i for i in converted if not isinstance(i, np.ndarray)]:
        at = next(i for i, item in enumerate(converted) if item is Ellipsis)
        converted[at : at + 1] = [slice(None)] * (len(shape) - consumed)
    else:
        converted += [slice(None)] * (len(shape) - consumed)
    return _planned(converted, shape)


def _array(item: object) -> np.ndarray:
    """An index array as NumPy's: integers (any width) or a mask; never floats."""
    try:
        array = np.asarray(item)
    except (ValueError, TypeError) as error:
        raise LazyIndexError(f"an index list that is not an array of ints ({error})") from None
    if array.dtype == bool:
        return array
    if array.size == 0 and array.dtype.kind == "f":  # `[]`: NumPy takes it as ints
        return array.astype(np.intp)
    if array.dtype.kind not in "iu":
        raise LazyIndexError(
            f"an index array of dtype {array.dtype}; index arrays hold integers (or bools, a mask)"
        )
    return array


def _planned(items: list[Any], shape: tuple[int, ...]) -> Gather:
    basic: list[int | slice | None] = []
    axes: list[int] = []
    arrays: list[np.ndarray] = []
    spots: list[int] = []  # where in `items` each advanced index stood
    dim = 0  # the next dimension of the array
    kept = 0  # the next dimension of the basic result
    for spot, item in enumerate(items):
        if item is None:
            basic.append(None)
            kept += 1
            continue
        if isinstance(item, slice):
            basic.append(item)
            dim, kept = dim + 1, kept + 1
            continue
        if isinstance(item, np.ndarray) and item.dtype == bool:
            if not item.ndim:
                raise LazyIndexError(
                    "a 0-d boolean index (NumPy reads it as a mask of no axes); use None "
                    "for a new axis, or a mask of the axes' shape"
                )
            found = shape[dim : dim + item.ndim]
            if item.shape != found:
                raise LazyIndexError(
                    f"a boolean mask of shape {item.shape} for axes {dim} to "
                    f"{dim + item.ndim - 1}, of shape {found}; a mask has the shape of "
                    "the axes it picks from"
                )
            for picks in item.nonzero():
                arrays.append(picks)
                axes.append(kept)
                spots.append(spot)
                basic.append(slice(None))
                dim, kept = dim + 1, kept + 1
            continue
        array = np.asarray(item)
        if array.dtype.kind not in "iu" or array.dtype == bool:
            raise LazyIndexError(f"unsupported index {item!r}; use ints, slices or int arrays")
        size = shape[dim]
        if array.size and (array.min() < -size or array.max() >= size):
            bad = array[(array < -size) | (array >= size)].flat[0]
            raise LazyIndexError(
                f"index {bad} is out of bounds for axis {dim} of size {size}; use indices "
                f"in [{-size}, {size})"
            )
        if array.size and array.min() < 0:
            array = np.where(array < 0, array + size, array)
        arrays.append(array.astype(np.int64, copy=False))
        axes.append(kept)
        spots.append(spot)
        basic.append(slice(None))
        dim, kept = dim + 1, kept + 1
    try:
        broadcast = np.broadcast_arrays(*arrays)
    except ValueError:
        shapes = ", ".join(str(a.shape) for a in arrays)
        raise LazyIndexError(
            f"index arrays of shapes {shapes} do not broadcast together; give arrays of one "
            "shape (or that broadcast, as NumPy's rules say)"
        ) from None
    together = broadcast[0].shape if broadcast else ()
    count = math.prod(together)
    if count > MAX_PICKS:
        raise LazyIndexError(
            f"an index that picks {count} elements, over the {MAX_PICKS} one view may pick; "
            "pick fewer (a slice reads a range), or read the array and index the result"
        )
    if len(arrays) > 1:  # (each element picked is a piece of its own)
        check_pieces(count, "elements picked by several index arrays")
    # (one index array is its own column: millions of picks are not copied)
    rows: np.ndarray = (
        broadcast[0].reshape(-1, 1)
        if len(broadcast) == 1
        else np.stack([b.reshape(-1) for b in broadcast], axis=1)
    )
    adjacent = all(b - a <= 1 for a, b in itertools.pairwise(spots))
    at = axes[0] - sum(1 for a in axes if a < axes[0]) if adjacent else 0
    return Gather(tuple(basic), tuple(axes), rows, together, at)


def check_pieces(count: int, what: str, *, at_least: bool = False) -> None:
    """Refuse a view of more than `MAX_PIECES` pieces before it is made."""
    if count > MAX_PIECES:
        raise LazyIndexError(
            f"an index that makes {'at least ' if at_least else ''}{count} {what}, over the "
            f"{MAX_PIECES} views one picked view may hold; pick in fewer pieces (sorted "
            "indices make runs), or read the array (or a slice around the picks) and index "
            "the result"
        )


def runs(picks: np.ndarray) -> list[slice]:
    """Slices that together pick `picks`, in order: runs of consecutive indices
    (either way), and longer progressions of a small step (a mask keeping every other
    row): `[3, 4, 5, 9, 9]` is `3:6, 9:10, 9:10`. Fewer pieces make a cheaper view.

    Counted before any is made, and refused past `MAX_PIECES` (`check_pieces`): first
    from two bounds NumPy finds in a few passes over the picks, so that millions of
    scattered picks cost no more than a few copies of them.
    """
    count = len(picks)
    if count < 2:
        return [slice(int(value), int(value) + 1, 1) for value in picks]
    steps = np.diff(picks)
    turns = steps[1:] != steps[:-1]  # where a stretch of equal steps ends
    # A piece takes steps of one stretch, so there are at least half as many pieces as
    # stretches; and no piece takes a step of 0 or of more than 4 either way.
    apart = int(np.count_nonzero((steps == 0) | (steps > 4) | (steps < -4)))
    what = "runs of consecutive picks"
    check_pieces(max((int(np.count_nonzero(turns)) + 2) // 2, apart + 1), what, at_least=True)
    stretches = np.flatnonzero(np.concatenate(([True], turns)))
    pieces = _pieces(
        stretches.tolist(),
        np.diff(stretches, append=len(steps)).tolist(),
        steps[stretches].tolist(),
        count,
    )
    check_pieces(sum(number for _, _, _, number in pieces), what)
    out: list[slice] = []
    for first, length, step, number in pieces:
        for value in picks[first : first + number].tolist():
            stop = value + step * length
            out.append(slice(value, stop if stop >= 0 else None, step))
    return out


def _pieces(
    starts: list[int], sizes: list[int], steps: list[int], count: int
) -> list[tuple[int, int, int, int]]:
    """The pieces of `count` picks whose stretches of equal steps start at the steps
    `starts`, of `sizes` steps of `steps`: `(first pick, length, step, number)` for
    `number` pieces from the first pick on, each of `length` picks `step` apart (a run
    is one piece; single picks are pieces of length 1). From a pick on, a run takes
    what is left of its stretch if its step is ±1, or 2 to 4 over at least 8 picks;
    else the pick is a piece of its own."""
    pieces: list[tuple[int, int, int, int]] = []
    at = 0  # the first pick not yet in a piece
    for start, size, step in zip(starts, sizes, steps, strict=True):
        end = start + size  # the stretch's last pick
        if at >= end:  # (the run before took its one step)
            continue
        length = end + 1 - at
        if abs(step) == 1 or (length >= 8 and 2 <= abs(step) <= 4):
            pieces.append((at, length, step, 1))
            at = end + 1
        else:  # (from any later pick the stretch is shorter: single picks to its end)
            pieces.append((at, 1, 1, end - at))
            at = end
    if at == count - 1:
        pieces.append((at, 1, 1, 1))
    return pieces


@attrs.frozen(eq=False)
class Picked(Concat):
    """Pieces of one array picked by index (`x[[3, 4, 9]]`), joined along `axis`.
    Streamed in blocks of the view, each filled through the engine, so that a stored
    chunk that several pieces share is read once a block, not once a piece."""

    def stream_parts(self, grid: tuple[int, ...] | None, block: int) -> None:
        return None

    def take(self, items: Sequence[Stored]) -> Part | Node:
        found = super().take(items)
        if type(found) is Concat:
            return Picked(found.shape, found.dtype, found.arrays, found.axis)
        return found

    def describe(self) -> str:
        return f"{len(self.arrays)} pieces picked along axis {self.axis}"


@attrs.frozen(eq=False)
class PickedStack(Stack):
    """Elements picked by several index arrays (`x[rows, cols]`), stacked; streamed
    as `Picked` is."""

    def stream_parts(self, grid: tuple[int, ...] | None, block: int) -> None:
        return None

    def take(self, items: Sequence[Stored]) -> Part | Node:
        found = super().take(items)
        if type(found) is Stack:
            return PickedStack(found.shape, found.dtype, found.arrays, found.axis)
        return found

    def describe(self) -> str:
        return f"{len(self.arrays)} elements picked"
