"""A tensor's elements at a place in a file, as a `LazyArray`: in C order (a
`RangeArray`), in Fortran order or any permuted order (a transposed view of one), or
strided within a larger storage (a view of the storage's elements, indexed), so that
a read of a few rows reads a few rows whichever way the writer laid them out."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from lazyckpt._array.selection import Selection
from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError
from lazyckpt._lazy import LazyArray
from lazyckpt._safetensors.format import MAX_BYTES, MAX_RANK
from lazyckpt._safetensors.ranges import RangeArray, contiguous_chunks
from lazyckpt._weights.files import File

_FIX = "the file is damaged, download or copy it again"


@attrs.frozen
class Place:
    """Where a tensor's elements are: element `offset`, `shape` and `stride` (in
    elements) within a storage of `capacity` elements whose first byte is at `start`
    of `file`."""

    file: File
    start: int
    capacity: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def lazy(name: str, path: tuple[str, ...], dtype: np.dtype[Any], place: Place) -> LazyArray:
    """The tensor `name` (key path `path`) of `dtype` (its byte order as stored) at
    `place`, reading nothing."""
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
    kept = [d for d in range(len(shape)) if shape[d] != 1]
    if size and any(stride[d] == 0 for d in kept):
        raise UnsupportedCheckpointError(
            f"{where}) repeats its elements (a stride of 0: an expanded tensor); lazyckpt "
            "reads each element from its own place. Save it with .contiguous() (or .clone())"
        )
    order = sorted(kept, key=lambda d: -stride[d])
    start = place.start + place.offset * dtype.itemsize
    if not size or _c_order([shape[d] for d in order], [stride[d] for d in order]):
        inner = tuple(shape[d] for d in order) if size else shape
        array = _raw(name, path, dtype, place, start, inner)
        if size and order != kept:  # stored transposed: a view of the stored order
            array = array.transpose([order.index(d) for d in kept])
        return _restored(array, path, shape, kept if size else list(range(len(shape))))
    # A slice of a larger tensor: a view of its storage.
    first, base, index = _strided(
        where, place, [shape[d] for d in order], [stride[d] for d in order]
    )
    array = _raw(name, path, dtype, place, place.start + first * dtype.itemsize, base)[index]
    if order != kept:
        array = array.transpose([order.index(d) for d in kept])
    return _restored(array, path, shape, kept)


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
    stored = RangeArray(
        place.file.store,
        name,
        place.file.key,
        "raw",
        shape,
        dtype,
        contiguous_chunks(shape, dtype.itemsize),
        False,
        start=start,
        file=place.file.path,
    )
    return LazyArray(path, stored, Selection.full(shape), dtype.newbyteorder("="))


def _restored(
    array: LazyArray, path: tuple[str, ...], shape: tuple[int, ...], kept: list[int]
) -> LazyArray:
    """`array` (the dimensions `kept`) with the size-1 dimensions put back, at `path`."""
    if array.shape != shape:
        array = array[tuple(slice(None) if d in kept else None for d in range(len(shape)))]
    return attrs.evolve(array, path=path)


def _strided(
    where: str, place: Place, shape: list[int], stride: list[int]
) -> tuple[int, tuple[int, ...], tuple[int | slice, ...]]:
    """The storage as a C-order array from some element, that element, and the index
    that picks the tensor from the array, for strides in decreasing order (a slice of
    a larger tensor: `qkv[:, :d]`, `w[::2, 1::3]`, `x[::2]`). Element `i` of the tensor
    is at `offset + sum(i * stride)`. The storage's rows are taken from its start
    where the tensor fits them, else from the tensor's first element."""
    for first in (0, place.offset):
        found = _grid(place.capacity - first, place.offset - first, shape, stride)
        if found is not None:
            return first, *found
    raise UnsupportedCheckpointError(
        f"{where}, offset {place.offset} in a storage of {place.capacity} elements) "
        "interleaves its dimensions in a way no view of a C-order array describes; save "
        "it with .contiguous() (or .clone())"
    )


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
