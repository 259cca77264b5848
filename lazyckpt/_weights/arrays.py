"""A tensor's elements at a place in a file, as a `LazyArray`: in C order (a
`RangeArray`), in Fortran order or any permuted order (a transposed view of one),
strided within a larger storage (a view of the storage's elements, indexed), with
dimensions that overlap or interleave (`unfold`'s windows, `as_strided`: views along
one of them, stacked), or repeated (stride 0, `expand`: a broadcast view), so that a read of a few rows reads a few rows whichever way the
writer laid them out."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from lazyckpt._array.broadcast_to import BroadcastTo
from lazyckpt._array.compose import Stack
from lazyckpt._array.selection import Selection
from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError
from lazyckpt._lazy import LazyArray, composed
from lazyckpt._safetensors.format import MAX_BYTES, MAX_RANK
from lazyckpt._safetensors.ranges import RangeArray, contiguous_chunks
from lazyckpt._weights import zips
from lazyckpt._weights.files import File

_FIX = "the file is damaged, download or copy it again"
MAX_STACKED = 1 << 14
"""The most views the stacked tensors of one file are made of, all told (each costs
about 600 bytes and a share of every read's planning)."""


@attrs.frozen
class Place:
    """Where a tensor's elements are: element `offset`, `shape` and `stride` (in
    elements) within a storage of `capacity` elements whose first byte is at `start`
    of `file`; `member`, the stored zip member that holds them, if one does."""

    file: File
    start: int
    capacity: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    member: zips.Stored | None = None


@attrs.frozen(eq=False)
class MemberArray(RangeArray):
    """A `RangeArray` in a stored zip member, whose CRC-32 `verify` checks."""

    member: zips.Stored | None = attrs.field(default=None, repr=False)


@attrs.define
class Stacked:
    """How many more views the stacked tensors of one file may be made of."""

    left: int = MAX_STACKED


def lazy(
    name: str,
    path: tuple[str, ...],
    dtype: np.dtype[Any],
    place: Place,
    stacked: Stacked | None = None,
) -> LazyArray:
    """The tensor `name` (key path `path`) of `dtype` (its byte order as stored) at
    `place`, reading nothing; its stacked views, where it needs them, counted in
    `stacked` (one per file)."""
    shape, stride = place.shape, place.stride
    size = math.prod(shape)
    where = f"{place.file.path}: tensor {name!r} (shape {shape}, strides {stride}"
    if math.prod(max(n, 1) for n in shape) * dtype.itemsize > MAX_BYTES or len(shape) > MAX_RANK:
        raise CorruptCheckpointError(f"{where}) is larger than any array; {_FIX}")
    if size and (
        min(stride, default=0) < 0
        or place.offset < 0
        or place.offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        >= place.capacity
    ):
        raise CorruptCheckpointError(
            f"{where}, offset {place.offset}) reaches past its storage of {place.capacity} "
            f"elements; {_FIX}"
        )
    if not size:
        start = place.start + place.offset * dtype.itemsize
        return attrs.evolve(_raw(name, path, dtype, place, start, shape), path=path)
    # Dimensions of size 1 come back as new axes; those of stride 0 (an expanded
    # tensor) as size 1 too, then repeated by a broadcast.
    kept = [d for d in range(len(shape)) if shape[d] != 1 and stride[d] != 0]
    view = _View(where, name, path, dtype, place, stacked or Stacked())
    array = view.of([shape[d] for d in kept], [stride[d] for d in kept], place.offset)
    single = tuple(n if d in kept else 1 for d, n in enumerate(shape))
    if array.shape != single:
        array = array[tuple(slice(None) if d in kept else None for d in range(len(shape)))]
    if single != shape:
        array = composed(path, BroadcastTo(shape, array.dtype, array), array.dtype)
    return attrs.evolve(array, path=path)


@attrs.frozen
class _View:
    """Views of one tensor's storage."""

    where: str
    name: str
    path: tuple[str, ...]
    dtype: np.dtype[Any]
    place: Place
    stacked: Stacked

    def of(self, shape: list[int], stride: list[int], offset: int) -> LazyArray:
        """The elements at `offset + sum(i * stride)` for `i` within `shape` (sizes
        over 1, strides over 0), in C order, transposed, strided or stacked."""
        order = sorted(range(len(shape)), key=lambda d: -stride[d])
        inner = [shape[d] for d in order]
        steps = [stride[d] for d in order]
        itemsize = self.dtype.itemsize
        if _c_order(inner, steps):
            start = self.place.start + offset * itemsize
            array = _raw(self.name, self.path, self.dtype, self.place, start, tuple(inner))
        elif (found := _strided(self.place.capacity, offset, inner, steps)) is not None:
            first, base, index = found  # a slice of a larger tensor: a view of its storage
            start = self.place.start + first * itemsize
            array = _raw(self.name, self.path, self.dtype, self.place, start, base)[index]
        else:
            array = self._stacked(inner, steps, offset)
        if order != sorted(order):  # stored transposed: a view of the stored order
            array = array.transpose([order.index(d) for d in range(len(shape))])
        return array

    def _stacked(self, shape: list[int], stride: list[int], offset: int) -> LazyArray:
        """Dimensions (strides in decreasing order) that overlap (a window's elements
        are its neighbour's too) or interleave: views along one of them, stacked."""
        axis = _stack_axis(self.place.capacity, offset, shape, stride)
        self.stacked.left -= shape[axis]
        if self.stacked.left < 0:
            raise UnsupportedCheckpointError(
                f"{self.where}, offset {self.place.offset}) overlaps or interleaves its "
                f"dimensions, which lazyckpt reads as views stacked, at most {MAX_STACKED} "
                "in a file, and its tensors need more; save it with .contiguous() (or "
                ".clone())"
            )
        rest, steps = _without(shape, axis), _without(stride, axis)
        pieces = tuple(self.of(rest, steps, offset + i * stride[axis]) for i in range(shape[axis]))
        dtype = self.dtype.newbyteorder("=")
        return composed(self.path, Stack(tuple(shape), dtype, pieces, axis), dtype)


def _stack_axis(capacity: int, offset: int, shape: list[int], stride: list[int]) -> int:
    """The dimension to stack views along: the shortest whose views are each one view
    of the storage (`unfold`'s `(n, w)` windows: `w` slices of `n` elements), else the
    shortest."""
    by_size = sorted(range(len(shape)), key=lambda d: shape[d])
    for axis in by_size:
        rest, steps = _without(shape, axis), _without(stride, axis)
        if _c_order(rest, steps) or _strided(capacity, offset, rest, steps) is not None:
            return axis
    return by_size[0]


def _without(values: list[int], axis: int) -> list[int]:
    return values[:axis] + values[axis + 1 :]


def _c_order(shape: list[int], stride: list[int]) -> bool:
    step = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if s != step:
            return False
        step *= n
    return True


def _raw(
    name: str,
    path: tuple[str, ...],
    dtype: np.dtype[Any],
    place: Place,
    start: int,
    shape: tuple[int, ...],
) -> LazyArray:
    where = (place.file.store, name, place.file.key, "raw", shape, dtype)
    chunks = contiguous_chunks(shape, dtype.itemsize)
    stored = (
        RangeArray(*where, chunks, False, start=start, file=place.file.path)
        if place.member is None
        else MemberArray(
            *where,
            chunks,
            False,
            checksummed=True,
            start=start,
            file=place.file.path,
            member=place.member,
        )
    )
    return LazyArray(path, stored, Selection.full(shape), dtype.newbyteorder("="))


def _strided(
    capacity: int, offset: int, shape: list[int], stride: list[int]
) -> tuple[int, tuple[int, ...], tuple[int | slice, ...]] | None:
    """The storage of `capacity` elements as a C-order array from some element, that
    element, and the index that picks the tensor from the array, for strides in
    decreasing order (a slice of a larger tensor: `qkv[:, :d]`, `w[::2, 1::3]`,
    `x[::2]`); None where no such view describes it (its dimensions overlap or
    interleave). Element `i` of the tensor is at `offset + sum(i * stride)`. The
    storage's rows are taken from its start where the tensor fits them, else from
    the tensor's first element."""
    for first in (0, offset):
        found = _grid(capacity - first, offset - first, shape, stride)
        if found is not None:
            return first, *found
    return None


def _grid(
    capacity: int, offset: int, shape: list[int], stride: list[int]
) -> tuple[tuple[int, ...], tuple[int | slice, ...]] | None:
    """`capacity` elements as rows of `stride[0]`, each stride that divides the one
    before splitting them further and the last stepping within its row, with the
    index of the tensor at `offset`; None where the tensor does not fit them."""
    if len(shape) == 1 and offset == 0:  # one dimension: a step through the storage
        return (capacity,), (slice(0, (shape[0] - 1) * stride[0] + 1, stride[0]),)
    base = [capacity // stride[0]]
    index: list[int | slice] = [slice(offset // stride[0], offset // stride[0] + shape[0])]
    fits = offset // stride[0] + shape[0] <= base[0]
    unit, rest = stride[0], offset % stride[0]
    for d in range(1, len(shape)):
        n, step = shape[d], stride[d]
        if unit % step == 0:
            base.append(unit // step)
            index.append(slice(rest // step, rest // step + n))
            fits = fits and rest // step + n <= unit // step
            unit, rest = step, rest % step
        elif d == len(shape) - 1:  # a step within the row
            base.append(unit)
            index.append(slice(rest, rest + (n - 1) * step + 1, step))
            fits = fits and rest + (n - 1) * step < unit
            unit, rest = 1, 0
        else:
            return None
    if unit > 1:
        base.append(unit)
        index.append(rest)
    return (tuple(base), tuple(index)) if fits else None


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of `shape` in C order."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))
