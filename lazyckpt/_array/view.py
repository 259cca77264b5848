"""What the read engine needs of a lazy array: a protocol, so that the engine, which
`LazyArray` reads through, does not import `LazyArray` back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._array.selection import Index, Selection

if TYPE_CHECKING:  # in annotations only: a local open needs no tensorstore
    import tensorstore as ts


class Stored(Protocol):
    """An array as stored, or a node of a composed view: known from metadata."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def chunks(self) -> tuple[int, ...]: ...


class ArrayView(Protocol):
    """A view of a stored array (or of a composed one) that reads nothing until asked:
    what `lazyckpt.LazyArray` is, as the engine sees it. Typed PRNG keys never reach
    the engine: their reads go through `LazyArray._key_data`, plain uint32 data."""

    @property
    def path(self) -> tuple[str | int, ...]: ...

    @property
    def key(self) -> str: ...

    @property
    def stored(self) -> Stored: ...

    @property
    def selection(self) -> Selection: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def ndim(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def chunks(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: Index) -> ArrayView: ...

    def astype(self, dtype: DTypeLike) -> ArrayView: ...

    def transpose(self, *axes: int | Sequence[int]) -> ArrayView: ...

    def read(self) -> ts.Future[np.ndarray]: ...

    def _rebased(self, selection: Selection, dtype: np.dtype[Any] | None = None) -> ArrayView:
        """The same stored array (or node) through `selection`, in `dtype` if given."""
        ...
