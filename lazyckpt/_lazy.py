"""`LazyArray`: a stored array known from metadata, read only when asked."""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from numpy.typing import DTypeLike

from lazyckpt._decode import decodes
from lazyckpt._engine import read_view
from lazyckpt._errors import LazyIndexError, LazyTypeError
from lazyckpt._html import array_html
from lazyckpt._selection import Index, Selection, expand
from lazyckpt._sharding import SavedSharding
from lazyckpt._store import StoredArray, then


def _dtype(value: Any) -> Any:
    """A NumPy dtype, or a JAX extended dtype (typed PRNG keys) as it is."""
    if isinstance(value, np.dtype):
        return value  # the common case, and cheap: opening 10,000 arrays makes 10,000
    if jnp.issubdtype(value, jax.dtypes.extended):
        return value
    return np.dtype(value)


@functools.cache
def key_dtype(impl: str) -> tuple[Any, tuple[int, ...]]:
    """The dtype of typed PRNG keys of implementation `impl`, and the shape of one
    key's data, computed abstractly (no device work)."""
    key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return key.dtype, tuple(data.shape)


def _unchanged(store: Any, values: Any) -> Any:
    """`values`, once the checkpoint they were read from is known not to have changed."""
    store.check_unchanged()
    return values


@attrs.frozen(repr=False)
class LazyArray:
    """An array in a checkpoint, or a view of one, that reads nothing until asked.

    `shape`, `dtype`, `chunks` and `sharding` come from the checkpoint's metadata.
    Indexing (`x[2:4, ::2]`) and `astype` return new LazyArrays without reading;
    `get()` (or `np.asarray(x)`) reads exactly the stored chunks the view touches.
    A LazyArray duck-types `jax.ShapeDtypeStruct`, so `jax.eval_shape(fn, tree)`
    works on a lazy tree without reading data.

    >>> w = lazyckpt.open(path)["params"]["w"]
    >>> view = w[1:3, ::-2].astype("int32")             # no I/O yet
    >>> view.shape, view.dtype
    ((2, 4), dtype('int32'))
    >>> view.get()
    array([[15, 13, 11,  9],
           [23, 21, 19, 17]], dtype=int32)
    >>> jax.eval_shape(lambda x: x @ x.T, w)
    ShapeDtypeStruct(shape=(8, 8), dtype=float32)
    """

    path: tuple[str | int, ...]
    """Key path from the root of the checkpoint tree."""
    stored: StoredArray
    """The array as stored (equal only to itself); a view reads a part of it."""
    selection: Selection
    """The basic index that maps the stored array to this view."""
    dtype: Any = attrs.field(converter=_dtype)
    """The dtype `get()` returns: the stored dtype unless cast with `astype`; for
    typed PRNG keys, the key dtype (`key<fry>`)."""
    sharding: SavedSharding | None = None
    """The saved sharding of the stored array, or None if the checkpoint has none."""
    key_impl: str | None = None
    """For typed PRNG keys, the implementation (`'threefry2x32'`); the stored array
    then holds the key data, with one trailing dimension more than the keys."""

    @property
    def key(self) -> str:
        """The key path as one string, `'params/encoder/kernel'`."""
        return "/".join(str(k) for k in self.path)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.selection.shape
        return shape[:-1] if self.key_impl else shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * int(self.dtype.itemsize)

    @property
    def chunks(self) -> tuple[int, ...]:
        """The stored chunk shape: the unit of every read."""
        return self.stored.chunks

    @property
    def weak_type(self) -> bool:
        """Always False; read by `jax.eval_shape` as for `jax.ShapeDtypeStruct`."""
        return False

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"{self.key}: len() of a 0-d LazyArray")
        return self.shape[0]

    def __getitem__(self, index: Index) -> LazyArray:
        try:
            if self.key_impl:
                # Index the keys; their trailing key-data dimension stays whole.
                index = (*expand(index, self.ndim), slice(None))
            selection = self.selection[index]
        except LazyIndexError as error:
            raise LazyIndexError(f"{self.key} (shape {self.shape}): {error}") from None
        return attrs.evolve(self, selection=selection)

    def squeeze(self, axis: int | tuple[int, ...] | None = None) -> LazyArray:
        """A view without the size-1 dimensions `axis` (all of them by default), as
        `np.squeeze`; reads nothing.

        >>> w = lazyckpt.open(path)["params"]["w"]
        >>> w[2:3, None].squeeze().shape, w[:, 1:2].squeeze(1).shape
        ((8,), (8,))
        """
        ndim = self.ndim
        axes = (
            tuple(d for d, n in enumerate(self.shape) if n == 1)
            if axis is None
            else tuple(a % ndim if -ndim <= a < ndim else a for a in np.atleast_1d(axis).tolist())
        )
        for a in axes:
            if not 0 <= a < ndim or self.shape[a] != 1:
                raise LazyIndexError(
                    f"{self.key} (shape {self.shape}): cannot squeeze axis {a}, which is "
                    f"{'not a dimension' if not 0 <= a < ndim else f'of size {self.shape[a]}'}"
                )
        return self[tuple(0 if d in axes else slice(None) for d in range(ndim))]

    def astype(self, dtype: DTypeLike) -> LazyArray:
        """A view cast to `dtype` as it is read (NumPy casting rules)."""
        if self.key_impl:
            raise LazyTypeError(
                f"{self.key}: typed PRNG keys cannot be cast; read them and use "
                "jax.random.key_data to get their uint32 data"
            )
        return attrs.evolve(self, dtype=np.dtype(dtype))

    def read(self) -> ts.Future[Any]:
        """Start reading this view; the future resolves to a NumPy array (for typed
        PRNG keys, a `jax.Array` of keys)."""
        store = self.stored.store
        if decodes(self.stored) and not self.key_impl:
            # Decoded by lazyckpt, cast as it is copied.
            return then(read_view(self), lambda values: _unchanged(store, values))
        data = then(self.stored.read(self.selection), lambda values: _unchanged(store, values))
        if self.key_impl:
            impl = self.key_impl
            return then(data, lambda array: jax.random.wrap_key_data(jnp.asarray(array), impl=impl))
        if self.dtype == self.stored.dtype:
            return data
        return then(data, lambda array: array.astype(self.dtype))

    def get(self) -> Any:
        """Read this view into a NumPy array (typed PRNG keys: a `jax.Array`)."""
        return self.read().result()

    async def get_async(self) -> Any:
        """`get()` for asyncio code."""
        return await self.read()

    def __array__(self, dtype: DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        if self.key_impl:
            raise LazyTypeError(
                f"{self.key}: typed PRNG keys have no NumPy form; use .get() for a jax.Array"
            )
        if copy is False:
            raise ValueError(
                f"{self.key}: a LazyArray cannot be viewed without a read (copy=False)"
            )
        data: np.ndarray = self.get()
        return data if dtype is None else data.astype(dtype)

    def _repr_html_(self) -> str:
        """One summary row for notebooks; reads nothing."""
        return array_html(self)

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """How treescope shows a LazyArray: its repr, as one line; never its values.

        One text line rather than a rendered constructor: 10,000 arrays render in
        seconds instead of tens of seconds."""
        from treescope import rendering_parts

        return rendering_parts.build_one_line_tree_node(
            line=rendering_parts.text(repr(self)), path=path
        )

    def __repr__(self) -> str:
        parts = [repr(self.key), f"shape={self.shape}", f"dtype={self.dtype}"]
        if self.dtype != self.stored.dtype and not self.key_impl:
            parts.append(f"stored_dtype={self.stored.dtype}")
        if not self.selection.is_full(self.stored.shape):
            parts.append(f"view of {self.stored.shape}")
        parts.append(f"chunks={self.chunks}")
        if self.sharding is not None:
            parts.append(f"sharding={self.sharding!r}")
        return f"LazyArray({', '.join(parts)})"


def unstack(array: LazyArray, axis: int = 0) -> list[LazyArray]:
    """The slices of `array` along `axis`, as views: `unstack(x)[i]` is `x[i]`. Reads
    nothing; each view later reads only its own stored chunks, so a scanned stack of
    layers `(layers, ...)` becomes per-layer arrays without reading the others.

    Args:
        array: A LazyArray (a view too).
        axis: The dimension to split along.

    >>> w = lazyckpt.open(path)["params"]["w"]
    >>> rows = lazyckpt.unstack(w)
    >>> len(rows), rows[3].shape, float(rows[3].get()[0])
    (8, (8,), 24.0)
    """
    if not -array.ndim <= axis < array.ndim:
        raise LazyIndexError(f"{array.key} (shape {array.shape}): no axis {axis} to unstack")
    axis %= array.ndim
    before = (slice(None),) * axis
    return [array[(*before, i)] for i in range(array.shape[axis])]
