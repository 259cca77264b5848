"""`reshape` as a view: C-order reshapes lowered into boxes of the part.

The dimensions of the part and of the view pair into groups holding the same
elements (`groups`). A box of the view reads, per group, runs of consecutive
elements; each run is a few boxes of the part, and lands in the destination buffer
through a reshaped NumPy view of it (the buffer is C-contiguous: the engine gives
a reshape a contiguous temporary otherwise), so a reshape costs no copy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence

import attrs
import numpy as np

from lazyckpt._array.compose import Copied, Part, Piece, Place, taking, view_chunks
from lazyckpt._array.geometry import Box, as_slices, pieces, product, slices


class NotAView(ValueError):
    """A destination that NumPy cannot express as a view of the destination buffer."""


@attrs.frozen(eq=False)
class Reshape(Copied):
    """`np.reshape(array, shape)` in C order."""

    array: Part
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    """Dimensions of the part and of the view that hold the same elements: pairs
    `(part dims, view dims)` with equal sizes, in order."""

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.array,)

    @property
    def chunks(self) -> tuple[int, ...]:
        inner = view_chunks(self.array)
        cells = [1] * len(self.shape)
        for mine, theirs in self.groups:
            if len(mine) == 1 and len(theirs) == 1:
                cells[theirs[0]] = inner[mine[0]]
        return tuple(cells)

    def lower(self, box: Box) -> Iterator[Piece]:
        if any(low >= high for low, high in box):
            return
        per_group = [list(self._group_pieces(g, box)) for g in range(len(self.groups))]
        for combo in product(per_group):
            part_box: list[tuple[int, int]] = []
            for inner, _ in combo:
                part_box.extend(inner)
            moves = [move for _, move in combo]
            yield self.array, tuple(part_box), functools.partial(_apply, moves=moves)

    def _group_pieces(
        self, g: int, box: Box
    ) -> Iterator[tuple[list[tuple[int, int]], Callable[[np.ndarray], np.ndarray]]]:
        """For group `g`, each box of the part's dimensions that some of `box` reads,
        with how to turn the destination buffer's dimensions of the group into that box."""
        mine, theirs = self.groups[g]
        at = theirs[0] if theirs else sum(len(t) for _, t in self.groups[:g])
        part_sizes = [self.array.shape[d] for d in mine]
        if not theirs:  # size-1 dimensions of the part only
            yield (
                [(0, 1)] * len(mine),
                taking((*(slice(None),) * at, *(None,) * len(mine))),
            )
            return
        sizes = [self.shape[d] for d in theirs]
        ranges = [box[d] for d in theirs]
        if not mine:  # size-1 dimensions of the view only
            yield [], taking((*(slice(None),) * at, *(0,) * len(theirs)))
            return
        # Runs: the last dimension that is not whole, a range along it, and every
        # combination of single indices before it.
        last = max(
            (i for i, (r, n) in enumerate(zip(ranges, sizes, strict=True)) if r != (0, n)),
            default=0,
        )
        strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
        lead = [range(low, high) for low, high in ranges[:last]]
        for fixed in product(lead) if lead else [()]:
            base = sum(i * s for i, s in zip(fixed, strides, strict=False))
            start = base + ranges[last][0] * strides[last]
            stop = base + ranges[last][1] * strides[last]
            chosen = tuple(i - low for i, (low, _) in zip(fixed, ranges, strict=False))
            offset = 0
            for inner in _flat_boxes(part_sizes, start, stop):
                n = math.prod(high - low for low, high in inner)
                yield list(inner), _run_move(at, chosen, len(theirs), offset, n, inner)
                offset += n

    def stream_parts(
        self, grid: tuple[int, ...] | None, block: int
    ) -> list[tuple[Part, tuple[int, ...] | None, Place]] | None:
        """The part in blocks of whole rows along its first dimension longer than 1: a
        block of the part is a run of consecutive elements of the view, which `place`
        cuts into a few boxes of it (`_flat_boxes`), so that any block the part
        streams in (bands of its stored chunks, decoded once) lands in the view, where
        the view's rows and the part's do not line up too. Given `grid`, runs start on
        a row of the part and where the view's cells allow (`_aligned`), and each box
        is handed over in blocks of whole cells. None where the shortest such run is
        larger than `block` bytes, a cell of `grid` and a stored chunk of the part that
        such runs tile (which a band may hold: each chunk is decoded once)."""
        source, shape, itemsize = self.array.shape, self.shape, self.dtype.itemsize
        if 0 in source or not any(n > 1 for n in source) or not any(n > 1 for n in shape):
            return None
        at = next(d for d, n in enumerate(source) if n > 1)  # leading 1s are fixed at 0
        row = math.prod(source[at + 1 :])
        step = math.lcm(row, _aligned(shape, grid))
        cell = math.prod(grid) if grid is not None else 0
        # A run as long as a stored chunk only where runs tile the chunks (whole rows
        # after `at`): then a band holds the chunk, decoded once and counted; a run
        # that straddles chunks would be read whole for each block of the view.
        chunks = view_chunks(self.array)
        tiles = chunks[at] % (step // row) == 0 and all(
            c % n == 0 for c, n in zip(chunks[at + 1 :], source[at + 1 :], strict=True)
        )
        if step > max(block // itemsize, cell, math.prod(chunks) if tiles else 0):
            return None

        def place(
            index: tuple[slice, ...], values: np.ndarray
        ) -> list[tuple[tuple[slice, ...], np.ndarray]]:
            low, high, _ = index[at].indices(source[at])
            rest = zip(index[at + 1 :], source[at + 1 :], strict=True)
            assert all(s.indices(n)[:2] == (0, n) for s, n in rest), "whole rows only"
            flat, start, out = values.reshape(-1), 0, []
            for run in _flat_boxes(shape, low * row, high * row):
                extents = tuple(b - a for a, b in run)
                stop = start + math.prod(extents)
                in_run = flat[start:stop].reshape(extents)
                # (the values' own item size: a cast after the reshape came first)
                for box in pieces(run, grid, values.dtype.itemsize, block):
                    out.append((as_slices(box), in_run[slices(box, run)]))
                start = stop
            return out

        return [(self.array, (*source[:at], step // row, *source[at + 1 :]), place)]

    def describe(self) -> str:
        return f"reshape of {self.array.shape}"


def _aligned(shape: Sequence[int], grid: Sequence[int] | None) -> int:
    """Where runs of the view's elements (in C order) may start and end, so that the
    boxes `_flat_boxes` cuts them into are whole cells of `grid`: multiples of this.
    Cells are one index thick before the first dimension where they are not; there a
    run starts on a cell's edge (the stride of that dimension times its cell), or, if
    its cells end unevenly inside the view, on an index of the dimension before."""
    if grid is None:
        return 1
    for d, (n, cell) in enumerate(zip(shape, grid, strict=True)):
        if n > 1 and cell > 1:
            stride = math.prod(shape[d + 1 :])
            even = n % cell == 0 or all(m == 1 for m in shape[:d])
            return stride * min(cell, n) if even else stride * n
    return 1


def _run_move(
    at: int, chosen: tuple[int, ...], ndim: int, offset: int, n: int, inner: Box
) -> Callable[[np.ndarray], np.ndarray]:
    def move(view: np.ndarray) -> np.ndarray:
        view = taking((*(slice(None),) * at, *chosen))(view)
        merged = ndim - len(chosen)
        flat = (*view.shape[:at], -1, *view.shape[at + merged :])
        view = _reshaped(view, flat)[(slice(None),) * at + (slice(offset, offset + n),)]
        shape = (*view.shape[:at], *(high - low for low, high in inner), *view.shape[at + 1 :])
        return _reshaped(view, shape)

    return move


def _apply(out: np.ndarray, moves: Sequence[Callable[[np.ndarray], np.ndarray]]) -> np.ndarray:
    # Right to left, so that the axes of the groups still to move stay where they are.
    for move in reversed(moves):
        out = move(out)
    return out


def _reshaped(view: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    try:
        return np.reshape(view, tuple(shape), copy=False)
    except ValueError:
        raise NotAView(shape) from None


def _flat_boxes(sizes: Sequence[int], start: int, stop: int) -> Iterator[Box]:
    """The elements `[start, stop)` of a C-order array of shape `sizes`, as boxes in
    flat order."""
    if start >= stop:
        return
    if len(sizes) == 1:
        yield ((start, stop),)
        return
    inner = math.prod(sizes[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    whole = tuple((0, n) for n in sizes[1:])
    if first == last:
        for box in _flat_boxes(sizes[1:], head, tail):
            yield ((first, first + 1), *box)
        return
    if head:
        for box in _flat_boxes(sizes[1:], head, inner):
            yield ((first, first + 1), *box)
        first += 1
    if first < last:
        yield ((first, last), *whole)
    if tail:
        for box in _flat_boxes(sizes[1:], 0, tail):
            yield ((last, last + 1), *box)


def matched_dims(
    source: Sequence[int], target: Sequence[int]
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Pair the dimensions of two shapes of the same (non-zero) size into groups that
    hold the same elements in C order."""
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    i = j = 0
    while i < len(source) and j < len(target):
        mine, theirs = [i], [j]
        have, want = source[i], target[j]
        i, j = i + 1, j + 1
        while have != want:
            if have < want:
                have *= source[i]
                mine.append(i)
                i += 1
            else:
                want *= target[j]
                theirs.append(j)
                j += 1
        out.append((tuple(mine), tuple(theirs)))
    out.extend(((d,), ()) for d in range(i, len(source)))
    out.extend(((), (d,)) for d in range(j, len(target)))
    return tuple(out)
