"""Streaming views that share a stored array, each stored chunk read once for all.

`unstack(x)` gives one view per layer; saving them (per-layer safetensors, say)
streams each view on its own, and where a stored chunk holds several layers (Orbax
stores a scanned array in one chunk per device shard, every layer in each) each
view would decode that chunk again, up to its own layer. Here such views are
grouped: the box of the stored array they cover together is streamed once, as one
view, and each block is cut into the members' blocks. Views are grouped only where
that reads nothing more than they need (they cover their box without gaps) and,
when blocks must be whole cells of new chunk grids (`save`), where the grids line
up with the stored array.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from lazyckpt._array.compose import Node
from lazyckpt._array.geometry import (
    Box,
    as_slices,
    in_view,
    intersect,
    slices,
    stored_map,
    to_stored,
    view_origins,
)
from lazyckpt._array.selection import Selection
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.stored import stored_array


@attrs.frozen
class _Member:
    position: int
    array: ArrayView
    box: Box
    mapping: list[tuple[int, int] | None]
    origins: tuple[int, ...]


@attrs.frozen
class Sharing:
    """Views of one stored array, streamed as `base`: blocks of `grid` (or of the
    stored chunks) cut by `route` into blocks of each member."""

    base: ArrayView
    grid: tuple[int, ...] | None
    members: tuple[_Member, ...]
    origin: tuple[int, ...]

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(m.position for m in self.members)

    def route(
        self, index: tuple[slice, ...], values: np.ndarray
    ) -> Iterator[tuple[int, tuple[slice, ...], np.ndarray]]:
        """`(position, index, values)` for each member's piece of a block of `base`."""
        block = tuple((o + s.start, o + s.stop) for o, s in zip(self.origin, index, strict=True))
        for member in self.members:
            part = intersect(block, member.box)
            if part is None:
                continue
            view_index, shape = in_view(member.mapping, part, member.origins)
            piece = values[slices(part, block)].reshape(shape)
            yield member.position, view_index, piece.astype(member.array.dtype, copy=False)


def sharings(
    arrays: Sequence[ArrayView], grids: Sequence[tuple[int, ...] | None], block: int
) -> list[Sharing]:
    """The sharings among `arrays` worth streaming together."""
    by_stored: dict[int, list[_Member]] = {}
    for position, array in enumerate(arrays):
        member = _member(position, array)
        if member is not None:
            by_stored.setdefault(id(array.stored), []).append(member)
    found = []
    for members in by_stored.values():
        if len(members) < 2:
            continue
        sharing = _sharing(members, [grids[m.position] for m in members], block)
        if sharing is not None:
            found.append(sharing)
    return found


def _member(position: int, array: ArrayView) -> _Member | None:
    if isinstance(array.stored, Node) or stored_array(array).inline is not None:
        return None
    mapping = stored_map(array)
    if mapping is None or array.size == 0:
        return None
    box = to_stored(array, mapping, tuple((0, n) for n in array.shape))
    return _Member(position, array, box, mapping, view_origins(mapping, len(array.stored.shape)))


def _sharing(
    members: list[_Member], grids: list[tuple[int, ...] | None], block: int
) -> Sharing | None:
    first = members[0].array
    stored = first.stored
    ndim = len(stored.shape)
    union = tuple(
        (min(m.box[d][0] for m in members), max(m.box[d][1] for m in members)) for d in range(ndim)
    )
    if math.prod(h - lo for lo, h in union) > sum(
        math.prod(h - lo for lo, h in m.box) for m in members
    ):
        return None  # streaming the box would read what no member needs
    grid = None
    if any(g is not None for g in grids):
        cells = [1] * ndim
        for member, cell in zip(members, grids, strict=True):
            if cell is None:
                return None
            for entry, size in zip(member.mapping, cell, strict=True):
                if entry is None:
                    continue
                dim, start = entry
                if (start - union[dim][0]) % size:
                    return None  # the member's cells would straddle the blocks
                cells[dim] = math.lcm(cells[dim], size)
        grid = tuple(min(c, h - lo) for c, (lo, h) in zip(cells, union, strict=True))
        widest = max(block, math.prod(stored.chunks) * stored.dtype.itemsize)
        if math.prod(grid) * stored.dtype.itemsize > widest:
            return None
    whole = first._rebased(Selection.full(stored.shape), stored.dtype)
    base = whole[as_slices(union)]
    return Sharing(base, grid, tuple(members), tuple(lo for lo, _ in union))


def by_position(found: Sequence[Sharing]) -> dict[int, Sharing]:
    """Each position in a sharing, mapped to its sharing (the first member streams it)."""
    return {p: g for g in found for p in g.positions}
