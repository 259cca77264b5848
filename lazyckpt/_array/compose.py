"""Views made of other views: stacked, concatenated, transposed and reshaped arrays.

A composed view is a `LazyArray` whose `stored` is one of the nodes here instead of
a `StoredArray`. Nodes hold their parts (LazyArrays, plain or composed) and never
read; the readers lower them:

- `lower(box)` turns a box of a `Copied` node into pieces of its parts: which part,
  which box of it, and where in the destination buffer it lands (a NumPy view of it,
  so that a transposed or stacked target is filled in place, each part's stored
  chunks read once by the engine);
- a `Computed` node instead names the box of each part that a box of it needs
  (`inputs`), and computes its values from theirs (`compute`): dequantized weights
  (`lazyckpt._array.quant`);
- `stream_parts(grid, block)` says how blocks streamed from each part become blocks of the
  node, for `lazyckpt.iter_blocks`, `stats` and `save`.

`Reshape` lives in `lazyckpt._array.reshape`.

Indexing a stack, a concatenation or a transpose pushes the index down into its
parts (`take`), so `stack(xs)[i]` is `xs[i]` and slicing one layer of a stack reads
only that layer. A reshape keeps its index on top, as a `Selection` over the node.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from types import EllipsisType
from typing import Any, TypeAlias, TypeVar

import attrs
import numpy as np

from lazyckpt._array.geometry import Box
from lazyckpt._array.selection import Range, Stored
from lazyckpt._array.view import ArrayView

Part: TypeAlias = ArrayView
Dest: TypeAlias = Callable[[np.ndarray], np.ndarray]
Piece: TypeAlias = tuple[Part, Box, Dest]
# How a block `(index, values)` of a part becomes blocks of the node (one, or several
# where its elements are no one box of the node: a run of a reshape's part).
Place: TypeAlias = Callable[
    [tuple[slice, ...], np.ndarray], list[tuple[tuple[slice, ...], np.ndarray]]
]
_T = TypeVar("_T")


@attrs.frozen(eq=False)
class Node(abc.ABC):
    """What readers ask of a stored array, answered for a composed one."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    @abc.abstractmethod
    def parts(self) -> tuple[Part, ...]:
        """The views this one is made of."""

    @property
    @abc.abstractmethod
    def chunks(self) -> tuple[int, ...]:
        """A grid of the view whose cells are unions of the parts' stored chunks,
        where they line up (1 along a dimension where they do not)."""

    def stream_parts(
        self, grid: tuple[int, ...] | None, block: int
    ) -> list[tuple[Part, tuple[int, ...] | None, Place]] | None:
        """`(part, grid of the part, place)` for streaming each part on its own, or
        None where blocks must be filled from several parts (or cells of the part's
        grid would be larger than `block` bytes)."""
        return None

    @abc.abstractmethod
    def describe(self) -> str:
        """A few words for `repr`."""


class Copied(Node):
    """A node whose values are its parts' values, moved into place."""

    @abc.abstractmethod
    def lower(self, box: Box) -> Iterator[Piece]:
        """`(part, box of the part, destination)` for every piece that `box` needs."""


class Computed(Node):
    """A node whose values are computed from its parts' values (a dequantized weight
    from its quantized values and their scales). Indexing stays on top of it, as a
    `Selection` over the node, so that a read asks it for boxes."""

    @abc.abstractmethod
    def inputs(self, box: Box) -> tuple[Box, ...]:
        """The box of each part (in `parts` order) that `box` of the node needs."""

    @abc.abstractmethod
    def compute(self, box: Box, values: Sequence[np.ndarray], out: np.ndarray) -> None:
        """Fill `out`, the node's `box`, from `values`: each part's `inputs(box)`."""


class Pushed(Copied):
    """A node that indexing pushes into its parts."""

    @abc.abstractmethod
    def take(self, items: Sequence[Stored]) -> Part | Node:
        """The node indexed by one entry per dimension (an int or a `Range`): a part's
        view, or a new node over the parts' views."""

    @abc.abstractmethod
    def expand(self, at: int) -> Node:
        """The node with a new size-1 dimension at `at`."""


def view_chunks(part: Part) -> tuple[int, ...]:
    """The chunk grid of a part in its own view's dimensions."""
    stored, ndim = part.stored, int(part.ndim)
    if isinstance(stored, Node):
        if part.selection.is_full(stored.shape):
            cells: tuple[int, ...] = stored.chunks
            return cells
        return (1,) * ndim
    grid = []
    for dim in part.selection.view:
        entry = part.selection.stored[dim] if isinstance(dim, int) else None
        chunk = stored.chunks[dim] if isinstance(dim, int) else 1
        aligned = isinstance(entry, Range) and entry.step == 1 and entry.start % chunk == 0
        grid.append(chunk if aligned else 1)
    return tuple(grid[:ndim])


def _common(cells: Sequence[tuple[int, ...]], shape: Sequence[int]) -> tuple[int, ...]:
    if not cells:
        return tuple(max(1, n) for n in shape)
    return tuple(max(1, min(n, math.lcm(*(c[d] for c in cells)))) for d, n in enumerate(shape))


def as_index(item: Stored) -> int | slice:
    """A stored entry of a `Selection` as a NumPy index."""
    if isinstance(item, int):
        return item
    if item.count == 0:  # its start may be -1, which a slice reads as the end
        return slice(0, 0)
    stop = item.start + item.step * item.count
    return slice(item.start, stop if stop >= 0 else None, item.step)


def _drop(items: Sequence[Stored], axis: int) -> int:
    """Where `axis` lands once the dimensions indexed by an int are dropped."""
    return axis - sum(isinstance(item, int) for item in items[:axis])


def _kept(items: Sequence[Stored]) -> tuple[int, ...]:
    return tuple(item.count for item in items if isinstance(item, Range))


@attrs.frozen(eq=False)
class _Joined(Pushed):
    """Several arrays joined along `axis`."""

    arrays: tuple[Part, ...]
    axis: int

    @property
    def parts(self) -> tuple[Part, ...]:
        return self.arrays


@attrs.frozen(eq=False)
class Stack(_Joined):
    """`np.stack(arrays, axis)`."""

    @property
    def chunks(self) -> tuple[int, ...]:
        inner = _common([view_chunks(a) for a in self.arrays], _without(self.shape, self.axis))
        return (*inner[: self.axis], 1, *inner[self.axis :])

    def take(self, items: Sequence[Stored]) -> Part | Node:
        rest = tuple(as_index(item) for d, item in enumerate(items) if d != self.axis)
        chosen = items[self.axis]
        if isinstance(chosen, int):
            return self.arrays[chosen][rest]
        arrays = tuple(
            self.arrays[chosen.start + chosen.step * j][rest] for j in range(chosen.count)
        )
        return Stack(_kept(items), self.dtype, arrays, _drop(items, self.axis))

    def expand(self, at: int) -> Node:
        inner = at if at <= self.axis else at - 1
        arrays = tuple(_new_axis(a, inner) for a in self.arrays)
        return Stack(_inserted(self.shape, at), self.dtype, arrays, self.axis + (at <= self.axis))

    def lower(self, box: Box) -> Iterator[Piece]:
        low, high = box[self.axis]
        inner = _without(box, self.axis)
        for i in range(low, high):
            yield self.arrays[i], inner, taking((*(slice(None),) * self.axis, i - low))

    def stream_parts(
        self, grid: tuple[int, ...] | None, block: int
    ) -> list[tuple[Part, tuple[int, ...] | None, Place]] | None:
        k = self.axis
        if grid is not None and grid[k] != 1:
            return None
        inner = _without(grid, k) if grid is not None else None

        def place(i: int) -> Place:
            return lambda index, values: [
                ((*index[:k], slice(i, i + 1), *index[k:]), np.expand_dims(values, k))
            ]

        return [(a, inner, place(i)) for i, a in enumerate(self.arrays)]

    def describe(self) -> str:
        return f"stack of {len(self.arrays)} along axis {self.axis}"


@attrs.frozen(eq=False)
class Concat(_Joined):
    """`np.concatenate(arrays, axis)`."""

    @property
    def offsets(self) -> list[int]:
        starts = [0]
        for a in self.arrays:
            starts.append(starts[-1] + a.shape[self.axis])
        return starts

    @property
    def chunks(self) -> tuple[int, ...]:
        cells = list(_common([view_chunks(a) for a in self.arrays], self.shape))
        starts = self.offsets
        cells[self.axis] = max(1, math.gcd(*starts[1:-1], cells[self.axis]))
        return tuple(cells)

    def take(self, items: Sequence[Stored]) -> Part | Node:
        k, starts = self.axis, self.offsets
        chosen = items[k]

        def index(local: int | slice) -> tuple[int | slice, ...]:
            return tuple(local if d == k else as_index(item) for d, item in enumerate(items))

        if isinstance(chosen, int):
            c = bisect.bisect_right(starts, chosen) - 1
            return self.arrays[c][index(chosen - starts[c])]
        pieces, j = [], 0
        while j < chosen.count:
            i = chosen.start + chosen.step * j
            c = bisect.bisect_right(starts, i) - 1
            low, size = starts[c], self.arrays[c].shape[k]
            room = (
                (low + size - 1 - i) // chosen.step
                if chosen.step > 0
                else (i - low) // -chosen.step
            )
            count = min(chosen.count - j, room + 1)
            local = Range(i - low, chosen.step, count)
            pieces.append(self.arrays[c][index(as_index(local))])
            j += count
        if len(pieces) == 1:
            return pieces[0]
        return Concat(_kept(items), self.dtype, tuple(pieces), _drop(items, k))

    def expand(self, at: int) -> Node:
        arrays = tuple(_new_axis(a, at) for a in self.arrays)
        return Concat(_inserted(self.shape, at), self.dtype, arrays, self.axis + (at <= self.axis))

    def lower(self, box: Box) -> Iterator[Piece]:
        k = self.axis
        low, high = box[k]
        for c, start in enumerate(self.offsets[:-1]):
            end = start + self.arrays[c].shape[k]
            a, b = max(low, start), min(high, end)
            if a >= b:
                continue
            part = (*box[:k], (a - start, b - start), *box[k + 1 :])
            yield self.arrays[c], part, taking((*(slice(None),) * k, slice(a - low, b - low)))

    def stream_parts(
        self, grid: tuple[int, ...] | None, block: int
    ) -> list[tuple[Part, tuple[int, ...] | None, Place]] | None:
        k, starts = self.axis, self.offsets
        if grid is not None and any(s % grid[k] for s in starts[1:-1]):
            return None

        def place(start: int) -> Place:
            return lambda index, values: [
                (
                    (
                        *index[:k],
                        slice(index[k].start + start, index[k].stop + start),
                        *index[k + 1 :],
                    ),
                    values,
                )
            ]

        return [(a, grid, place(s)) for a, s in zip(self.arrays, starts, strict=False)]

    def describe(self) -> str:
        return f"concatenation of {len(self.arrays)} along axis {self.axis}"


@attrs.frozen(eq=False)
class Transpose(Pushed):
    """`np.transpose(array, perm)`: view dimension d is the part's dimension perm[d]."""

    array: Part
    perm: tuple[int, ...]

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.array,)

    @property
    def chunks(self) -> tuple[int, ...]:
        inner = view_chunks(self.array)
        return tuple(inner[p] for p in self.perm)

    def take(self, items: Sequence[Stored]) -> Part | Node:
        inner: list[Stored] = [0] * len(self.perm)
        for d, p in enumerate(self.perm):
            inner[p] = items[d]
        view = self.array[tuple(as_index(item) for item in inner)]
        # The part's kept dimensions, in its order, and where each view dimension is.
        kept = [p for p, item in enumerate(inner) if isinstance(item, Range)]
        perm = tuple(kept.index(p) for d, p in enumerate(self.perm) if isinstance(items[d], Range))
        if perm == tuple(range(len(perm))):
            return view
        return Transpose(_kept(items), self.dtype, view, perm)

    def expand(self, at: int) -> Node:
        end = len(self.perm)
        perm = (*self.perm[:at], end, *self.perm[at:])
        return Transpose(_inserted(self.shape, at), self.dtype, _new_axis(self.array, end), perm)

    def lower(self, box: Box) -> Iterator[Piece]:
        inner: list[tuple[int, int]] = [(0, 0)] * len(self.perm)
        for d, p in enumerate(self.perm):
            inner[p] = box[d]
        back = tuple(int(d) for d in np.argsort(self.perm))
        yield self.array, tuple(inner), lambda out: out.transpose(back)

    def stream_parts(
        self, grid: tuple[int, ...] | None, block: int
    ) -> list[tuple[Part, tuple[int, ...] | None, Place]] | None:
        inner = None
        if grid is not None:
            cells = [1] * len(self.perm)
            for d, p in enumerate(self.perm):
                cells[p] = grid[d]
            inner = tuple(cells)

        def place(
            index: tuple[slice, ...], values: np.ndarray
        ) -> list[tuple[tuple[slice, ...], np.ndarray]]:
            return [(tuple(index[p] for p in self.perm), values.transpose(self.perm))]

        return [(self.array, inner, place)]

    def describe(self) -> str:
        return f"transpose {self.perm}"


@attrs.frozen(eq=False)
class Cast(Pushed):
    """A view read in its own dtype first, then cast again: `x.astype(a).astype(b)`
    rounds through `a`, as NumPy does."""

    array: Part

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.array,)

    @property
    def chunks(self) -> tuple[int, ...]:
        return view_chunks(self.array)

    def take(self, items: Sequence[Stored]) -> Part | Node:
        return self.array[tuple(as_index(item) for item in items)]

    def expand(self, at: int) -> Node:
        return Cast(_inserted(self.shape, at), self.dtype, _new_axis(self.array, at))

    def lower(self, box: Box) -> Iterator[Piece]:
        yield self.array, box, lambda out: out

    def stream_parts(
        self, grid: tuple[int, ...] | None, block: int
    ) -> list[tuple[Part, tuple[int, ...] | None, Place]] | None:
        return [(self.array, grid, lambda index, values: [(index, values)])]

    def describe(self) -> str:
        return f"read as {self.array.dtype}"


def taking(index: tuple[int | slice | None, ...]) -> Dest:
    """The view of a buffer at `index` (Ellipsis keeps it a view where every
    dimension is indexed by an int)."""
    full: tuple[int | slice | EllipsisType | None, ...] = (*index, Ellipsis)
    return lambda out: out[full]


def _new_axis(array: Part, at: int) -> Part:
    return array[(slice(None),) * at + (None,)]


def _inserted(shape: tuple[int, ...], at: int) -> tuple[int, ...]:
    return (*shape[:at], 1, *shape[at:])


def _without(values: Sequence[_T], axis: int) -> tuple[_T, ...]:
    return (*values[:axis], *values[axis + 1 :])


def computes(array: Part) -> bool:
    """Whether a read of `array` computes values (there is a `Computed` node in it)."""
    node = array.stored
    return isinstance(node, Node) and (
        isinstance(node, Computed) or any(computes(part) for part in node.parts)
    )


def sources(array: Part) -> Iterator[Part]:
    """The plain LazyArrays a view reads from (itself, if it is one)."""
    if not isinstance(array.stored, Node):
        yield array
        return
    for part in array.stored.parts:
        yield from sources(part)
