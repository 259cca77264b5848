"""Block geometry: boxes, chunk grids, and where a view's elements lie in stored chunks.

A `Box` is a half-open interval per dimension. Views (`Selection`s) map view
indices to stored indices; the functions here turn that into boxes on the stored
chunk grid, cut chunks into slabs that are contiguous in their byte stream, and find
the piece of a slab that a view needs, as index tuples on both sides.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from lazyckpt._array.selection import NewAxis, Range, Selection
from lazyckpt._array.view import ArrayView

Box = tuple[tuple[int, int], ...]
Index = tuple[int | slice, ...]
_T = TypeVar("_T")


def box_bytes(box: Box, itemsize: int) -> int:
    return math.prod(high - low for low, high in box) * itemsize


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(high - low for low, high in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(low < high for low, high in out) else None


def clip(box: Box, shape: Sequence[int]) -> Box:
    """`box` cut at the end of an array of `shape`: an edge chunk's elements."""
    return tuple((low, min(high, n)) for (low, high), n in zip(box, shape, strict=True))


def slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """`box` as slices relative to the start of `origin`."""
    return tuple(slice(low - o, high - o) for (low, high), (o, _) in zip(box, origin, strict=True))


def as_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(low, high) for low, high in box)


def product(axes: Sequence[Sequence[_T]]) -> Iterator[tuple[_T, ...]]:
    """`itertools.product` in C order for sequences too long to list (ranges over a
    huge grid: `itertools.product` would copy each into a tuple first)."""
    if any(len(axis) == 0 for axis in axes):
        return
    position = [0] * len(axes)
    while True:
        yield tuple(axis[i] for axis, i in zip(axes, position, strict=True))
        for dim in reversed(range(len(axes))):
            position[dim] += 1
            if position[dim] < len(axes[dim]):
                break
            position[dim] = 0
        else:
            return


class _Edges(Sequence[tuple[int, int]]):
    """Blocks of `k` chunks of size `c` along one dimension, clipped to `[low, high)`."""

    def __init__(self, low: int, high: int, c: int, k: int) -> None:
        self.low, self.high, self.c, self.k = low, high, c, k
        self.starts = range(low // c, (high - 1) // c + 1, k)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: Any) -> Any:
        first = self.starts[i]
        return max(self.low, first * self.c), min(self.high, (first + self.k) * self.c)


MAX_CHUNKS_PER_BLOCK = 1 << 16
"""The most stored chunks one block spans: tensorstore keeps state per chunk of a read,
so a block of millions of tiny chunks (a shape of 10**7 in chunks of 1) would grow
memory with the chunk count, to an abort, whatever its bytes."""


def chunk_blocks(box: Box, chunks: Sequence[int], itemsize: int, budget: int) -> Iterator[Box]:
    """`box` cut along the chunk grid into blocks of at most `budget` bytes (or one
    chunk, if a chunk is larger) and `MAX_CHUNKS_PER_BLOCK` chunks, growing blocks
    along trailing dimensions first so that they stay contiguous. Lazily: a huge grid
    is never listed."""
    if any(low >= high for low, high in box):
        return
    spans = [((low // c), (high - 1) // c) for (low, high), c in zip(box, chunks, strict=True)]
    per_block = [1] * len(box)  # chunks per block, per dimension
    limit = max(1, budget // itemsize)
    for dim in reversed(range(len(box))):
        others = math.prod(c * k for c, k in zip(chunks, per_block, strict=True)) // chunks[dim]
        count = math.prod(per_block)  # chunks per block so far (this dimension's is 1)
        fit = max(1, min(limit // (others * chunks[dim]), MAX_CHUNKS_PER_BLOCK // count))
        first, last = spans[dim]
        per_block[dim] = min(last - first + 1, fit)
        if per_block[dim] <= last - first:
            break
    edges = [
        _Edges(low, high, c, k) for (low, high), c, k in zip(box, chunks, per_block, strict=True)
    ]
    yield from product(edges)


def fitted(cells: Sequence[int], itemsize: int, budget: int) -> tuple[int, ...]:
    """`cells` with their leading dimensions cut to 1, one after another, until a cell
    holds at most `budget` bytes: blocks of whole trailing cells, still contiguous."""
    out = list(cells)
    for dim in range(len(out)):
        if math.prod(out) * itemsize <= budget:
            break
        out[dim] = 1
    return tuple(out)


def pieces(region: Box, grid: Sequence[int] | None, itemsize: int, block: int) -> Iterator[Box]:
    """`region` (whole cells of `grid`, anchored at 0) in blocks of whole cells of at
    most `block` bytes (one cell where a cell is larger); `region` itself where it
    fits."""
    if box_bytes(region, itemsize) <= block:
        yield region
        return
    cells = grid if grid is not None else fitted([h - lo for lo, h in region], itemsize, block)
    yield from chunk_blocks(region, cells, itemsize, block)


def chunk_count(box: Box, chunks: Sequence[int]) -> int:
    """How many chunks of the grid `box` touches."""
    if any(low >= high for low, high in box):
        return 0
    return math.prod(
        (high - 1) // c - low // c + 1 for (low, high), c in zip(box, chunks, strict=True)
    )


def chunks_in(box: Box, chunks: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Grid positions of the chunks that `box` touches, in C order (lazily: a huge
    array's grid is never listed whole)."""
    if any(low >= high for low, high in box):
        return
    ranges = [
        range(low // c, (high - 1) // c + 1) for (low, high), c in zip(box, chunks, strict=True)
    ]
    yield from product(ranges)


def chunk_box(index: Sequence[int], chunks: Sequence[int]) -> Box:
    """The whole chunk at grid `index`, padding past the array's edge included."""
    return tuple((i * c, (i + 1) * c) for i, c in zip(index, chunks, strict=True))


def on_grid(box: Box, array_box: Box, chunks: Sequence[int]) -> bool:
    """Whether `box` starts and ends on chunk boundaries (or the array's edges)."""
    return all(
        low % chunk == 0 and (high % chunk == 0 or high == edge)
        for (low, high), (_, edge), chunk in zip(box, array_box, chunks, strict=True)
    )


def slabs(
    box: Box,
    order: Sequence[int],
    itemsize: int,
    max_bytes: int,
    cuts: Sequence[int] = (),
    unit: int = 1,
    split_at: int | None = None,
) -> Iterator[Box]:
    """`box` (a chunk) cut into slabs that follow each other in its byte stream, which
    runs in C order over the stored dimensions `order`: single indices in the leading
    stream dimensions, a range in one (`split_at`, or `split_dim`'s), whole extents
    in the rest. Each slab holds at most `max_bytes` (at least one element row of the
    split dimension, or `unit` rows: slab lengths are multiples of `unit` in the split
    dimension), and slabs are also cut at the stored indices `cuts` of the split
    dimension."""
    if not box:
        yield ()
        return
    stream = [box[d] for d in order]
    if split_at is None:
        split_at = split_dim(box, order, itemsize, max_bytes)
    split = order.index(split_at)
    row = math.prod(high - low for low, high in stream[split + 1 :]) * itemsize
    step = max(unit, max_bytes // max(row, 1) // unit * unit)
    low, high = stream[split]
    inner = sorted(c for c in cuts if low < c < high)
    for head in product([range(a, b) for a, b in stream[:split]]):
        for run in _runs(low, high, step, inner):
            slab = [(i, i + 1) for i in head] + [run] + list(stream[split + 1 :])
            out: list[tuple[int, int]] = [(0, 0)] * len(box)
            for position, dim in enumerate(order):
                out[dim] = slab[position]
            yield tuple(out)


def _runs(low: int, high: int, step: int, cuts: list[int]) -> Iterator[tuple[int, int]]:
    """`[low, high)` cut every `step` and at `cuts` (sorted, inside), lazily."""
    start = low
    for point in heapq.merge(range(low + step, high, step), cuts):
        if point > start:
            yield start, point
            start = point
    yield start, high


def split_dim(box: Box, order: Sequence[int], itemsize: int, max_bytes: int) -> int:
    """The stored dimension along which `slabs` cuts `box`: the first one in stream
    order after which the rest of the box fits in `max_bytes`."""
    sizes = [box[d][1] - box[d][0] for d in order]
    split = 0
    while split < len(sizes) - 1 and math.prod(sizes[split + 1 :]) * itemsize > max_bytes:
        split += 1
    return order[split] if order else 0


def _progression(low: int, high: int, start: int, step: int, count: int) -> tuple[int, int]:
    """The `i` in `[0, count)` with `low <= start + step * i < high`, as `(i0, i1)`."""
    if step > 0:
        i0 = max(0, -((start - low) // step))
        i1 = min(count, -((start - high) // step))
    else:
        i0 = max(0, (start - high) // -step + 1)
        i1 = min(count, (start - low) // -step + 1)
    return i0, max(i0, i1)


def piece(selection: Selection, slab: Box) -> tuple[Index, Index] | None:
    """Where the view `selection` meets the stored `slab`: the index into the slab's
    values (stored dimensions) and the index into the view (view dimensions) of the
    elements they share, or None if none. Reshape the slab's piece to the shape of
    the view's piece: their elements are in the same order."""
    in_slab: list[int | slice] = []
    found: dict[int, slice] = {}
    for dim, (entry, (low, high)) in enumerate(zip(selection.stored, slab, strict=True)):
        if isinstance(entry, int):
            if not low <= entry < high:
                return None
            in_slab.append(entry - low)
            continue
        i0, i1 = _progression(low, high, entry.start, entry.step, entry.count)
        if i0 >= i1:
            return None
        first = entry.start + entry.step * i0 - low
        last = entry.start + entry.step * (i1 - 1) - low
        stop = last + (1 if entry.step > 0 else -1)
        in_slab.append(slice(first, stop if stop >= 0 else None, entry.step))
        found[dim] = slice(i0, i1)
    in_view = tuple(
        slice(None) if isinstance(dim, NewAxis) else found[dim] for dim in selection.view
    )
    return tuple(in_slab), in_view


def bounds(selection: Selection) -> Box:
    """Per stored dimension, the interval of stored indices that `selection` reads."""
    out = []
    for entry in selection.stored:
        if isinstance(entry, int):
            out.append((entry, entry + 1))
        elif entry.count == 0:
            out.append((0, 0))
        else:
            out.append(entry.bounds)
    return tuple(out)


def stored_map(array: ArrayView) -> list[tuple[int, int] | None] | None:
    """For each view dim, `(stored dim, offset)`, or None for a new axis; None overall
    if some kept stored dimension is strided (those views are read whole per target)."""
    mapping: list[tuple[int, int] | None] = []
    for dim in array.selection.view:
        if isinstance(dim, NewAxis):
            mapping.append(None)
            continue
        stored = array.selection.stored[dim]
        assert isinstance(stored, Range)
        if stored.step != 1 and stored.count > 1:
            return None
        mapping.append((dim, stored.start))
    return mapping


def to_stored(array: ArrayView, mapping: Sequence[tuple[int, int] | None], region: Box) -> Box:
    """The stored box behind the view box `region` (unstrided views)."""
    box = [(s, s + 1) if isinstance(s, int) else (0, 0) for s in array.selection.stored]
    for (low, high), entry in zip(region, mapping, strict=True):
        if entry is not None:
            dim, offset = entry
            box[dim] = (offset + low, offset + high)
    return tuple(box)


def view_origins(mapping: Sequence[tuple[int, int] | None], ndim: int) -> tuple[int, ...]:
    """The stored index that index 0 of each stored dimension maps to (0 for those
    the view drops), as `in_view` takes them."""
    origins = [0] * ndim
    for entry in mapping:
        if entry is not None:
            origins[entry[0]] = entry[1]
    return tuple(origins)


def in_view(
    mapping: Sequence[tuple[int, int] | None], part: Box, origins: Sequence[int]
) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """The index and shape, in view dimensions, of the stored box `part`, where
    `origins[d]` is the stored index that index 0 of stored dimension d maps to."""
    index = tuple(
        slice(part[e[0]][0] - origins[e[0]], part[e[0]][1] - origins[e[0]])
        if e is not None
        else slice(None)
        for e in mapping
    )
    shape = tuple(part[e[0]][1] - part[e[0]][0] if e is not None else 1 for e in mapping)
    return index, shape


class Spans:
    """Which of some extents along one dimension meet a span: by bisection where the
    extents are disjoint (the bands of a chunk), else by looking at each."""

    def __init__(self, extents: list[tuple[int, int]]) -> None:
        self.order = sorted(range(len(extents)), key=lambda i: extents[i])
        self.lows = [extents[i][0] for i in self.order]
        self.highs = [extents[i][1] for i in self.order]
        self.disjoint = all(h <= lo for h, lo in zip(self.highs, self.lows[1:], strict=False))

    def __call__(self, span: tuple[int, int]) -> list[int]:
        low, high = span
        if not self.disjoint:
            return [
                i
                for i, a, b in zip(self.order, self.lows, self.highs, strict=True)
                if a < high and b > low
            ]
        first = bisect.bisect_right(self.highs, low)
        stop = bisect.bisect_left(self.lows, high)
        return self.order[first:stop]


def strided_block(
    selection: Selection, box: Box, index: tuple[slice, ...], values: np.ndarray
) -> tuple[tuple[slice, ...], np.ndarray] | None:
    """The view's elements in `values`, the block `index` of the stored `box` around
    the view `selection`: their index in the view, and them; None if there are none."""
    picks: list[int | slice] = []
    covered: dict[int, tuple[int, int]] = {}
    for dim, (entry, part, (low, _)) in enumerate(zip(selection.stored, index, box, strict=True)):
        start, stop = low + part.start, low + part.stop  # the block's stored extent
        if isinstance(entry, int):
            picks.append(entry - start)
            continue
        first, last = covered_range(entry, start, stop)
        if first >= last:
            return None
        at = entry.start + entry.step * first - start
        end = at + entry.step * (last - first)
        picks.append(slice(at, end if end >= 0 else None, entry.step))
        covered[dim] = (first, last)
    picked = values[tuple(picks)]
    out_index, shape = [], []
    for view_dim in selection.view:
        low, high = (0, view_dim.count) if isinstance(view_dim, NewAxis) else covered[view_dim]
        out_index.append(slice(low, high))
        shape.append(high - low)
    return tuple(out_index), picked.reshape(shape)


def covered_range(entry: Range, start: int, stop: int) -> tuple[int, int]:
    """The `i` whose stored index `entry.start + entry.step * i` lies in `[start, stop)`,
    as a range `[first, last)` clipped to the entry's count."""
    if entry.step > 0:
        first = -((entry.start - start) // entry.step)
        last = -((entry.start - stop) // entry.step)
    else:
        step = -entry.step
        first = (entry.start - stop) // step + 1
        last = (entry.start - start) // step + 1
    return max(0, first), min(entry.count, last)


def covering_blocks(
    boxes: Sequence[Box],
    chunks: Sequence[int],
    shape: Sequence[int],
    itemsize: int,
    budget: int,
) -> Iterator[Box]:
    """Blocks of whole chunks (`chunk_blocks`) that cover `boxes`: of the box around
    them all, or, where they are sparse in it (rows picked far apart: `x[[3, 3900]]`),
    of the chunks around each, each chunk once where boxes share it."""
    union = tuple(
        (min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(shape))
    )
    around = {
        tuple(
            (lo // c * c, min(-(-hi // c) * c, n))
            for (lo, hi), c, n in zip(box, chunks, shape, strict=True)
        )
        for box in boxes
        if all(hi > lo for lo, hi in box)
    }
    volume = sum(math.prod(hi - lo for lo, hi in box) for box in around)
    if volume >= math.prod(hi - lo for lo, hi in union):
        around = {union}
    for region in sorted(around):
        yield from chunk_blocks(region, chunks, itemsize, budget)


class BoxIndex:
    """Boxes by where they start along the first dimension, to find those that a box
    may touch without trying them all (thousands of picked rows)."""

    def __init__(self, boxes: Sequence[Box]) -> None:
        self.order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0] if boxes[i] else 0)
        self.starts = [boxes[i][0][0] if boxes[i] else 0 for i in self.order]
        self.reach = max((b[0][1] - b[0][0] for b in boxes if b), default=0)

    def touching(self, box: Box) -> list[int]:
        """The indices, in order, of the boxes that may intersect `box`."""
        if not box:
            return list(range(len(self.order)))
        low = bisect.bisect_left(self.starts, box[0][0] - self.reach + 1)
        high = bisect.bisect_left(self.starts, box[0][1])
        return sorted(self.order[low:high])
