"""NumPy basic indexing composed without touching data.

A `Selection` maps the dimensions of a stored array to the dimensions of a view of
it. Each stored dimension is either fixed at one index (the view drops it) or an
arithmetic range `start + step * i` for `i < count` (the view keeps it). New axes
(`None` in an index) are view dimensions of size 0 or 1 backed by no stored
dimension. Indexing a view composes into a new `Selection`, so any chain of
indexing costs no I/O and reads only the elements that the final view needs.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, TypeAlias

import attrs

from lazyckpt._errors import LazyIndexError


@attrs.frozen
class Range:
    """Stored indices `start + step * i` for `i` in `range(count)`; step is never 0."""

    start: int
    step: int
    count: int

    @property
    def bounds(self) -> tuple[int, int]:
        """The smallest and one past the largest stored index, for `count > 0`."""
        last = self.start + self.step * (self.count - 1)
        return min(self.start, last), max(self.start, last) + 1


@attrs.frozen
class NewAxis:
    """A view dimension of size 0 or 1 that has no stored dimension behind it."""

    count: int = 1


# One entry per stored dimension: a fixed index or a kept range.
Stored: TypeAlias = int | Range
# One entry per view dimension: the stored dimension it reads, or a new axis.
ViewDim: TypeAlias = int | NewAxis

# What `x[index]` takes: an int, slice, None or Ellipsis, or a tuple of them. Anything
# else is refused at run time (`expand`), with a message that says what to do.
Index: TypeAlias = object


@attrs.frozen
class Selection:
    """A composed basic index of a stored array of shape `stored_shape`."""

    stored: tuple[Stored, ...]
    view: tuple[ViewDim, ...]
    shape: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    """The view's shape, computed once: every verb asks it of every array, often."""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self._dim_size(v) for v in self.view))

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def full(shape: tuple[int, ...]) -> Selection:
        """The identity selection: the whole stored array (cached; it is immutable)."""
        return Selection(
            stored=tuple(Range(0, 1, int(n)) for n in shape),
            view=tuple(range(len(shape))),
        )

    def is_full(self, stored_shape: tuple[int, ...]) -> bool:
        """Whether this selects every element of a stored array of `stored_shape`, in
        stored order and shape."""
        return self == Selection.full(stored_shape)

    def _dim_size(self, dim: ViewDim) -> int:
        if isinstance(dim, NewAxis):
            return dim.count
        stored = self.stored[dim]
        assert isinstance(stored, Range)
        return stored.count

    def __getitem__(self, index: Index) -> Selection:
        items = expand(index, len(self.view))
        stored = list(self.stored)
        view: list[ViewDim] = []
        dims = iter(self.view)
        for item in items:
            if item is None:
                view.append(NewAxis())
                continue
            dim = next(dims)
            size = self._dim_size(dim)
            if isinstance(item, slice):
                start, stop, step = item.indices(size)
                count = len(range(start, stop, step))
                if isinstance(dim, NewAxis):
                    view.append(NewAxis(count))
                else:
                    old = stored[dim]
                    assert isinstance(old, Range)
                    stored[dim] = Range(old.start + old.step * start, old.step * step, count)
                    view.append(dim)
                continue
            position = _normalize_int(item, size)
            if not isinstance(dim, NewAxis):
                old = stored[dim]
                assert isinstance(old, Range)
                stored[dim] = old.start + old.step * position
        view.extend(dims)
        return Selection(stored=tuple(stored), view=tuple(view))


def _normalize_int(item: int, size: int) -> int:
    position = item + size if item < 0 else item
    if not 0 <= position < size:
        raise LazyIndexError(
            f"index {item} is out of range for a dimension of size {size}; "
            f"use an index in [{-size}, {size})"
        )
    return position


def expand(index: Index, ndim: int) -> list[int | slice | None]:
    """Validate `index` for `ndim` dimensions and replace its Ellipsis with full slices."""
    items = list(index) if isinstance(index, tuple) else [index]
    out: list[Any] = []
    for item in items:
        if item is None or item is Ellipsis:
            out.append(item)
        elif isinstance(item, slice):
            out.append(slice(*(_bound(b) for b in (item.start, item.stop, item.step))))
            if out[-1].step == 0:
                raise LazyIndexError("a slice's step is 0; use a step other than 0")
        else:
            out.append(_integer(item))
    ellipses = sum(item is Ellipsis for item in out)
    if ellipses > 1:
        raise LazyIndexError("an index can only have a single ellipsis ('...')")
    consumed = sum(item is not None and item is not Ellipsis for item in out)
    if consumed > ndim:
        raise LazyIndexError(
            f"too many indices: the array is {ndim}-dimensional but {consumed} were given"
        )
    fill = [slice(None)] * (ndim - consumed)
    if ellipses:
        at = out.index(Ellipsis)
        out[at : at + 1] = fill
    else:
        out.extend(fill)
    return out


_BASIC = (
    "a LazyArray takes ints, slices, Ellipsis, None, and integer arrays, lists or "
    "boolean masks (NumPy's indexing)"
)


def _integer(item: object) -> int:
    """`item` as an int index: an int, a NumPy or jax integer scalar or 0-d array."""
    # `operator.index` also refuses arrays of more than one element, and bool arrays,
    # but with a TypeError that names neither the array nor what to do.
    if not isinstance(item, bool):
        try:
            return operator.index(item)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise LazyIndexError(f"unsupported index {_describe(item)}; {_BASIC}")


def _bound(bound: object) -> int | None:
    """A slice's start, stop or step as an int (or None), for `slice.indices`."""
    if bound is None:
        return None
    try:
        return _integer(bound)
    except LazyIndexError:
        raise LazyIndexError(
            f"unsupported slice bound {_describe(bound)}; a slice's start, stop and step "
            "are ints, 0-d integer arrays or None"
        ) from None


def _describe(item: object) -> str:
    """`item` for a message: an array by its shape and dtype, not its values (a jax
    array's repr would copy it to the host; a large one's fills the screen)."""
    shape, dtype = getattr(item, "shape", None), getattr(item, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return f"an array of shape {shape} and dtype {dtype} ({type(item).__name__})"
    return f"{item!r} of type {type(item).__name__}"[:200]
