"""Where the blocks of a stream fall: boxes of a view that whole cells of a grid make
up, and bands of one stored chunk that its decode completes one after another
(`lazyckpt._engine.stream`).

A band is whole cells of the grid, so where the cells span the chunk along its first
stream dimension (a transpose's cells across every row of a C-order chunk, rows of
a new grid over an F-order chunk) one band is the whole chunk: it is decoded once
and held, and handed over in pieces of whole cells (`geometry.pieces`), rather than decoded again for
each block or handed over whole (which the consumer, a writer, copies again)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from lazyckpt._array.geometry import (
    Box,
    bounds,
    box_bytes,
    chunk_blocks,
    chunk_count,
    chunks_in,
    in_view,
    split_dim,
    stored_map,
    view_origins,
)
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.stored import stored_array


def stored_cells(
    array: ArrayView, mapping: Sequence[tuple[int, int] | None], grid: tuple[int, ...] | None
) -> tuple[int, ...] | None:
    """`grid`'s cell size along each stored dimension (1 without a grid, and for
    dimensions the view drops), or None when its cells straddle stored chunks, so
    that slabs of a stored chunk cannot be unions of whole cells."""
    stored = stored_array(array)
    cells = [1] * len(stored.shape)
    if grid is None:
        return tuple(cells)
    for cell, entry in zip(grid, mapping, strict=True):
        if entry is None:
            continue
        dim, offset = entry
        if stored.chunks[dim] % cell or offset % cell:
            return None
        cells[dim] = cell
    return tuple(cells)


def widened(array: ArrayView, grid: tuple[int, ...], itemsize: int, block: int) -> tuple[int, ...]:
    """Blocks of whole cells of `grid`, widened to whole stored chunks too where the two
    grids line up (so that no stored chunk is read twice), as long as such a block is
    no larger than a stored chunk or a block of the budget."""
    mapping = stored_map(array)
    if mapping is None:
        return grid
    cells = []
    for cell, entry in zip(grid, mapping, strict=True):
        if entry is None:
            cells.append(cell)
            continue
        dim, offset = entry
        stored = stored_array(array).chunks[dim]
        cells.append(math.lcm(cell, stored) if offset % stored == 0 else cell)
    widest = max(block, math.prod(stored_array(array).chunks) * itemsize)
    if math.prod(cells) * itemsize > widest:
        return grid
    return tuple(cells)


def view_region(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def view_bands(array: ArrayView, elements: int, grid: tuple[int, ...] | None) -> Iterator[Box]:
    """The view cut into blocks of at most `elements` (whole cells of `grid`)."""
    cells = grid if grid is not None else (1,) * len(array.shape)
    yield from chunk_blocks(tuple((0, n) for n in array.shape), cells, 1, elements)


def slabs_in_view(array: ArrayView, bands: Callable[[], Iterable[Box]]) -> Iterator[Box]:
    """Stored boxes of an unstrided view (planned as they are needed), as boxes of the
    view."""
    mapping = stored_map(array)
    assert mapping is not None
    origins = view_origins(mapping, len(stored_array(array).shape))
    for band in bands():
        yield view_region(in_view(mapping, band, origins)[0], array.shape)


def strided_bands(
    array: ArrayView, grid: tuple[int, ...], block: int
) -> tuple[tuple[int, ...], list[Box], int] | None:
    """A strided view inside one stored chunk, cut into bands of whole cells of `grid`
    that the chunk's decode completes one after another: ranges along the view
    dimension of the first stored dimension (in decode order) it spans, whole along
    the others. `(chunk, bands, bytes of a band)`, or None where the view spans
    several chunks. A band one cell thick may be larger than a block (cells that span
    the chunk along its first stream dimension): it is handed over in pieces."""
    stored = stored_array(array)
    assert stored.codec is not None, "only arrays that lazyckpt decodes come here"
    box = bounds(array.selection)
    if not box or chunk_count(box, stored.chunks) != 1:
        return None
    lead = next((d for d in stored.codec.order if box[d][1] - box[d][0] > 1), None)
    if lead is None or lead not in array.selection.view:
        return None
    along = array.selection.view.index(lead)
    itemsize, length = array.dtype.itemsize, array.shape[along]
    row = math.prod(array.shape) // length * itemsize  # bytes per index along `along`
    cell = grid[along]
    rows = max(cell, block // row // cell * cell)
    whole = [(0, n) for n in array.shape]
    bands = [
        (*whole[:along], (low, min(low + rows, length)), *whole[along + 1 :])
        for low in range(0, length, rows)
    ]
    chunk = next(chunks_in(box, stored.chunks))
    return chunk, bands, rows * row


def band_split(
    box: Box, order: Sequence[int], units: Sequence[int], itemsize: int, block: int
) -> int:
    """The stored dimension that the bands of `box` (a chunk's part) are ranges along:
    `split_dim`'s, or an earlier one in stream order where a cell of the grid
    (`units`, per stored dimension) is more than one index thick there, which single
    indices would cut."""
    split = split_dim(box, order, itemsize, block)
    thick = next((d for d in order if units[d] > 1), split)
    return min(split, thick, key=order.index)


def band_bytes(
    box: Box, order: Sequence[int], split: int, unit: int, itemsize: int, block: int
) -> int:
    """The bytes of the largest band `slabs` cuts `box` into along `split`."""
    row = box_bytes(tuple(box[d] for d in order[order.index(split) + 1 :]), itemsize)
    step = max(unit, block // max(row, 1) // unit * unit)
    low, high = box[split]
    return min(step, high - low) * row
