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
from lazyckpt._safetensors.read import RangeArray, contiguous_chunks
from lazyckpt._weights.files import File


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
    if size and (
        min(stride, default=0) < 0
        or place.offset < 0
        or place.offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        >= place.capacity
    ):
        raise CorruptCheckpointError(
            f"{place.file.path}: tensor {name!r} (shape {shape}, strides {stride}, offset "
            f"{place.offset}) reaches past its storage of {place.capacity} elements; the "
            "file is damaged, download or copy it again"
        )
    kept = [d for d in range(len(shape)) if shape[d] != 1]
    order = sorted(kept, key=lambda d: -stride[d])
    if not size or _c_order([shape[d] for d in order], [stride[d] for d in order]):
        inner = tuple(shape[d] for d in order) if size else shape
        array = _raw(name, path, dtype, place, place.start + place.offset * dtype.itemsize, inner)
        if size and order != kept:  # stored transposed: a view of the stored order
            array = array.transpose([order.index(d) for d in kept])
        return _restored(array, path, shape, kept if size else list(range(len(shape))))
    base = _strided(name, place, [shape[d] for d in order], [stride[d] for d in order])
    storage = _raw(name, path, dtype, place, place.start, base[0])
    array = storage[base[1]]
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
    name: str, place: Place, shape: list[int], stride: list[int]
) -> tuple[tuple[int, ...], tuple[int | slice, ...]]:
    """The storage as a C-order array, and the index that picks the tensor from it,
    for strides in decreasing order (a slice of a larger tensor: `qkv[:, :d]`,
    `w[::2, 1::3]`): element `i` is at `offset + sum(i * stride)`. Each stride that
    divides the one before splits the storage's rows further; the last may step."""
    base = [place.capacity // stride[0]]
    index: list[int | slice] = [
        slice(place.offset // stride[0], place.offset // stride[0] + shape[0])
    ]
    unit, rest = stride[0], place.offset % stride[0]
    fits = index[0].stop <= base[0]  # type: ignore[union-attr]
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
            fits = False
            break
    if fits and unit > 1:
        base.append(unit)
        index.append(rest)
    if not fits:
        raise UnsupportedCheckpointError(
            f"{place.file.path}: tensor {name!r} (shape {tuple(shape)}) is stored with strides "
            f"{tuple(stride)} at offset {place.offset}, whose elements overlap, repeat or "
            "interleave (an expanded tensor); lazyckpt reads tensors laid out as slices "
            "of a storage. Save it with .contiguous() (or .clone())"
        )
    return tuple(base), tuple(index)


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of `shape` in C order."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))
