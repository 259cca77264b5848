"""Reading composed views (`lazyckpt._array.compose`) through the engine.

A destination of a composed view is lowered, node by node, into destinations of the views of
stored arrays it is made of, each with a NumPy view of the destination's buffer as its
destination: a transposed part lands in a transposed view, a stacked one in a
slice. Parts that are views of one stored array become regions of that whole
array (a strided one, `x[::-1]`, through the box around it), so that the engine
reads each of its chunks once however many parts share it. Temporaries are used
only where a destination cannot be a view: a part of another dtype (cast on its
own first, as NumPy would), a reshape into a strided buffer, the parts of a
computed view (a dequantized weight's values and scales), and the box around a
strided view (only where that box is at most about twice the view and 64 MiB;
else a strided part is read on its own, and a strided reshape one index at a time
along the strided dimension).
"""

from __future__ import annotations

from collections.abc import Callable
from types import EllipsisType
from typing import Any

import numpy as np

from lazyckpt._array import compose
from lazyckpt._array.geometry import (
    Box,
    as_slices,
    bounds,
    box_bytes,
    box_shape,
    stored_map,
    to_stored,
)
from lazyckpt._array.reshape import Reshape
from lazyckpt._array.selection import NewAxis, Range, Selection
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.memory import Destination
from lazyckpt._engine.stored import stored_array

# Keyed by the id of a view read on its own, or by a stored array's id and the dtype
# that its shared regions are read in.
ByArray = dict[int | tuple[int, np.dtype[Any]], tuple[ArrayView, list[Destination]]]


def lower(
    array: ArrayView,
    region: Box,
    out: np.ndarray,
    by_array: ByArray,
    after: list[Callable[[], None]],
) -> None:
    """Add to `by_array` the destinations, per array to read, that fill `out` with
    `array[region]`; copies out of temporaries go to `after`, innermost first."""
    if 0 in out.shape:
        return
    if array.dtype != out.dtype:
        _through_temporary(array, region, out, by_array, after, lambda t: t)
        return
    mapping = stored_map(array)
    node = array.stored
    if not isinstance(node, compose.Node):
        _add_plain(array, region, out, mapping, by_array, after)
        return
    if mapping is None:  # a reshaped view sliced with a step
        if _through_box(array, region, out, by_array, after):
            return
        # Else one index at a time along a strided dimension: no temporary, and
        # nothing read that the view does not need.
        selection = array.selection[as_slices(region)]
        dim = next(
            v
            for v, d in enumerate(selection.view)
            if isinstance(d, int) and _strided(selection.stored[d])
        )
        low = region[dim][0]
        for i in range(out.shape[dim]):
            at = (*region[:dim], (low + i, low + i + 1), *region[dim + 1 :])
            one: tuple[slice | EllipsisType, ...]
            one = (*(slice(None),) * dim, slice(i, i + 1), Ellipsis)
            into = out[one]
            lower(array, at, into, by_array, after)
        return
    node_box = to_stored(array, mapping, region)
    node_out = stored_view(array.selection, out)
    if isinstance(node, Reshape) and not node_out.flags.c_contiguous:
        whole = array._rebased(Selection.full(node.shape))
        _through_temporary(whole, node_box, node_out, by_array, after, lambda t: t)
        return
    if isinstance(node, compose.Computed):
        _computed(node, node_box, node_out, by_array, after)
        return
    assert isinstance(node, compose.Copied), node
    for part, box, dest in node.lower(node_box):
        lower(part, box, dest(node_out), by_array, after)


def _computed(
    node: compose.Computed,
    box: Box,
    out: np.ndarray,
    by_array: ByArray,
    after: list[Callable[[], None]],
) -> None:
    """Read the boxes of the parts that `box` of a computed node needs into
    temporaries, then compute `out` from them (after the parts' own copies)."""
    values = []
    for part, part_box in zip(node.parts, node.inputs(box), strict=True):
        temporary = np.empty(box_shape(part_box), part.dtype)
        lower(part, part_box, temporary, by_array, after)
        values.append(temporary)
    after.append(lambda: node.compute(box, values, out))


_BOX_BYTES = 64 << 20  # the largest box read around a strided view


def _through_box(
    array: ArrayView,
    region: Box,
    out: np.ndarray,
    by_array: ByArray,
    after: list[Callable[[], None]],
) -> bool:
    """Fill `out` with the strided `array[region]` through the box around it, read
    as a region of the whole array (with its other parts), where that box is at most
    about twice `out` and `_BOX_BYTES`; False, doing nothing, where it is larger."""
    selection = array.selection[as_slices(region)]
    box = bounds(selection)
    if box_bytes(box, array.dtype.itemsize) > min(2 * out.nbytes + (1 << 20), _BOX_BYTES):
        return False
    whole = array._rebased(Selection.full(array.stored.shape))
    index = relative_index(selection, box)
    _through_temporary(whole, box, out, by_array, after, lambda t: t[index])
    return True


def _strided(entry: int | Range) -> bool:
    return isinstance(entry, Range) and entry.step != 1 and entry.count > 1


def _through_temporary(
    array: ArrayView,
    region: Box,
    out: np.ndarray,
    by_array: ByArray,
    after: list[Callable[[], None]],
    pick: Callable[[np.ndarray], np.ndarray],
) -> None:
    temporary = np.empty(box_shape(region), array.dtype)
    lower(array, region, temporary, by_array, after)
    after.append(lambda: np.copyto(out, pick(temporary), casting="unsafe"))


def _add_plain(
    array: ArrayView,
    region: Box,
    out: np.ndarray,
    mapping: list[tuple[int, int] | None] | None,
    by_array: ByArray,
    after: list[Callable[[], None]],
) -> None:
    stored = stored_array(array)
    plain = stored.inline is None
    if plain and mapping is None and _through_box(array, region, out, by_array, after):
        return  # strided (`x[::-1]`): through the box, shared with the other parts
    if not plain or mapping is None:
        by_array.setdefault(id(array), (array, []))[1].append(
            Destination(region, out.dtype, out=out)
        )
        return
    # A region of the whole stored array, shared with the other parts of it.
    base = array._rebased(Selection.full(stored.shape))
    box = to_stored(array, mapping, region)
    destination = Destination(box, out.dtype, out=stored_view(array.selection, out))
    by_array.setdefault((id(stored), array.dtype), (base, []))[1].append(destination)


def stored_view(selection: Selection, out: np.ndarray) -> np.ndarray:
    """`out`, a buffer of a unit-stride view, seen along the stored dimensions: the
    view's new axes dropped, and dimensions an int index fixes back, of size 1."""
    # Ellipsis keeps a view even where every dimension is indexed by an int.
    dropped = out[(*(0 if isinstance(v, NewAxis) else slice(None) for v in selection.view), ...)]
    return dropped[(*(None if isinstance(s, int) else slice(None) for s in selection.stored), ...)]


def relative_index(selection: Selection, box: Box) -> tuple[int | slice | None, ...]:
    """The NumPy index of `selection` into a buffer holding the stored `box`."""
    pending = [i for i, v in enumerate(selection.view) if isinstance(v, NewAxis)]
    position = {v: i for i, v in enumerate(selection.view) if isinstance(v, int)}
    index: list[int | slice | None] = []
    for dim, entry in enumerate(selection.stored):
        origin = box[dim][0]
        if isinstance(entry, int):
            index.append(entry - origin)
            continue
        assert isinstance(entry, Range)
        while pending and pending[0] < position[dim]:
            index.append(None)
            pending.pop(0)
        start = entry.start - origin
        stop = start + entry.step * entry.count
        index.append(slice(start, stop if stop >= 0 else None, entry.step))
    index.extend(None for _ in pending)
    return tuple(index)
