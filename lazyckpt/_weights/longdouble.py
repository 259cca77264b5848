"""NumPy's long double arrays (`float128` and `complex256`: `np.longdouble` and
`np.clongdouble` where they take 16 and 32 bytes), as `np.save` and flax write them.

tensorstore has no such type, so such an array is read as its bytes, one more
dimension of the item size, and each box read is viewed as the type when it arrives:
a computed view over a view of bytes, held on the host as NumPy holds it. jax, Orbax
and safetensors have no such type either: casting (`astype`) is the way to them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from lazyckpt._array.compose import Computed, Part, view_chunks
from lazyckpt._array.dtypes import LONG_DOUBLES
from lazyckpt._array.geometry import Box
from lazyckpt._array.selection import Selection
from lazyckpt._lazy import LazyArray
from lazyckpt._weights import arrays
from lazyckpt._weights.arrays import Place


def lazy(name: str, path: tuple[str, ...], dtype: np.dtype[Any], place: Place) -> LazyArray:
    """`arrays.lazy` for any dtype NumPy reads here, long doubles too."""
    if dtype.newbyteorder("=") not in LONG_DOUBLES:
        return arrays.lazy(name, path, dtype, place)
    n = dtype.itemsize
    in_bytes = Place(
        place.file,
        place.start,
        place.capacity * n,
        place.offset * n,
        (*place.shape, n),
        (*(s * n for s in place.stride), 1),
        place.member,
    )
    return viewed(arrays.lazy(name, path, np.dtype(np.uint8), in_bytes), dtype)


def viewed(raw: LazyArray, dtype: np.dtype[Any]) -> LazyArray:
    """`raw`, bytes `[..., itemsize]`, as an array of `dtype` (its byte order as stored)."""
    node = LongDouble(raw.shape[:-1], dtype.newbyteorder("="), raw, dtype)
    return LazyArray(raw.path, node, Selection.full(node.shape), node.dtype)


@attrs.frozen(eq=False)
class LongDouble(Computed):
    """Elements of `stored` (a long double, in its byte order) from their bytes."""

    raw: Part
    stored: np.dtype[Any]

    @property
    def parts(self) -> tuple[Part, ...]:
        return (self.raw,)

    @property
    def chunks(self) -> tuple[int, ...]:
        return view_chunks(self.raw)[:-1]

    def inputs(self, box: Box) -> tuple[Box, ...]:
        return ((*box, (0, self.stored.itemsize)),)

    def compute(self, box: Box, values: Sequence[np.ndarray], out: np.ndarray) -> None:
        out[...] = np.ascontiguousarray(values[0]).view(self.stored)[..., 0]

    def describe(self) -> str:
        return f"{self.stored.name} from its bytes"
