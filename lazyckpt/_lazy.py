"""`LazyArray`: a stored array known from metadata, read only when asked.

Making, slicing and reading one needs no jax; typed PRNG keys, which only jax has,
import it (jax's extended dtypes cannot exist before it is imported).
"""

from __future__ import annotations

import functools
import math
import operator
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._array import compose, gather
from lazyckpt._array.dtypes import finfo, issubdtype, parsed
from lazyckpt._array.gather import is_advanced
from lazyckpt._array.reshape import Reshape, matched_dims
from lazyckpt._array.selection import Index, NewAxis, Selection, expand
from lazyckpt._array.sharding import SavedSharding
from lazyckpt._array.tree import leaf_type
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.decode import decodes
from lazyckpt._engine.stored import StoredArray
from lazyckpt._engine.whole import read_composed, read_view
from lazyckpt._errors import LazyIndexError, LazyTypeError
from lazyckpt._html import array_html
from lazyckpt._storage.futures import ready, then
from lazyckpt._storage.kvstore import Store
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none

_T = TypeVar("_T")


def is_jax_array(value: object) -> bool:
    """Whether `value` is a `jax.Array` or an abstract one (`jax.ShapeDtypeStruct`),
    told without importing jax: neither can exist before it is imported."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(value, jax.Array | jax.ShapeDtypeStruct)


def _dtype(value: Any) -> Any:
    """A NumPy dtype, or a JAX extended dtype (typed PRNG keys) as it is."""
    if isinstance(value, np.dtype):
        return value  # the common case, and cheap: opening 10,000 arrays makes 10,000
    jax = sys.modules.get("jax")
    if jax is not None and jax.dtypes.issubdtype(value, jax.dtypes.extended):
        return value
    return np.dtype(value)


@functools.cache
def key_dtype(impl: str) -> tuple[Any, tuple[int, ...]]:
    """The dtype of typed PRNG keys of implementation `impl`, and the shape of one
    key's data, computed abstractly (no device work)."""
    import jax

    key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return key.dtype, tuple(data.shape)


def _unchanged(store: Store, values: _T) -> _T:
    """`values`, once the checkpoint they were read from is known not to have changed."""
    store.check_unchanged()
    return values


@leaf_type
@attrs.frozen(repr=False)
class LazyArray:
    """An array in a checkpoint, or a view of one, that reads nothing until asked.

    `shape`, `dtype`, `chunks` and `sharding` come from the checkpoint's metadata.
    Indexing (`x[2:4, ::2]`, and integer arrays or masks, which read only the rows
    they pick) and `astype` return new LazyArrays without reading; `get()` (or
    `np.asarray(x)`) reads exactly the stored chunks the view touches.
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
    """Key path from the root of the checkpoint tree; for a stacked, concatenated,
    transposed or reshaped view, one key naming the operation and its sources."""
    stored: StoredArray | compose.Node
    """The array as stored (equal only to itself), which a view reads a part of; or,
    for a view made of other views (`stack`, `concat`, `transpose`, `reshape`), the
    node that holds them."""
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
        """The stored chunk shape: the unit of every read (for a composed view, a grid
        of the view whose cells are unions of its sources' chunks)."""
        return self.stored.chunks

    @property
    def sources(self) -> tuple[LazyArray, ...]:
        """The views of stored arrays that this one reads: itself, or the parts of a
        stacked, concatenated, transposed or reshaped view (`sources[i].key` is each
        part's key path in its checkpoint)."""
        return tuple(_own(part) for part in compose.sources(self))

    @property
    def weak_type(self) -> bool:
        """Always False; read by `jax.eval_shape` as for `jax.ShapeDtypeStruct`."""
        return False

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"{self.key}: len() of a 0-d LazyArray")
        return self.shape[0]

    def __getitem__(self, index: Index) -> LazyArray:
        if is_advanced(index):
            try:
                return self._gathered(gather.plan(index, self.shape))
            except LazyIndexError as error:
                raise LazyIndexError(f"{self.key} (shape {self.shape}): {error}") from None
        try:
            if self.key_impl:
                # Index the keys; their trailing key-data dimension stays whole.
                index = (*expand(index, self.ndim), slice(None))
            selection = self.selection[index]
        except LazyIndexError as error:
            raise LazyIndexError(f"{self.key} (shape {self.shape}): {error}") from None
        if not isinstance(self.stored, compose.Pushed):
            return attrs.evolve(self, selection=selection)
        # Into the parts: `stack(xs)[i]` is `xs[i]`, and reads only what it needs.
        result = self._composed(self.stored.take(selection.stored))
        for at, dim in enumerate(selection.view):
            if isinstance(dim, NewAxis):
                result = result._new_axis(at, dim.count)
        return result

    def _gathered(self, plan: gather.Gather) -> LazyArray:
        """The view of an advanced index, made of basic views of this array: the runs
        of consecutive picks along one axis joined (`x[[3, 4, 9]]` is `x[3:5]` and
        `x[9:10]`), or the picked elements of several axes stacked."""
        self._composable("indexing with arrays")
        base = self[plan.basic]
        rest = [n for d, n in enumerate(base.shape) if d not in plan.axes]
        shape = (*rest[: plan.at], *plan.shape, *rest[plan.at :])
        if len(plan.axes) == 1:
            axis = plan.axes[0]
            before = (slice(None),) * axis
            found = gather.runs(plan.picks[:, 0])
            pieces = [base[(*before, piece)] for piece in found]
            if len(pieces) == 1:
                joined = pieces[0]
            elif not pieces:
                joined = base[(*before, slice(0, 0))]
            else:
                size = (*base.shape[:axis], len(plan.picks), *base.shape[axis + 1 :])
                node = gather.Picked(size, self.dtype, tuple(pieces), axis)
                joined = composed(self.path, node, self.dtype)
            return attrs.evolve(joined.reshape(shape), path=self.path)
        parts = tuple(
            base[
                tuple(
                    int(pick[plan.axes.index(d)]) if d in plan.axes else slice(None)
                    for d in range(base.ndim)
                )
            ]
            for pick in plan.picks
        )
        stacked_shape = (*rest[: plan.at], len(parts), *rest[plan.at :])
        if not parts:
            return attrs.evolve(base[(slice(0, 0),) * base.ndim].reshape(shape), path=self.path)
        stack = gather.PickedStack(stacked_shape, self.dtype, parts, plan.at)
        return attrs.evolve(composed(self.path, stack, self.dtype).reshape(shape), path=self.path)

    def _composed(self, found: ArrayView | compose.Node) -> LazyArray:
        if isinstance(found, compose.Node):
            return composed(self.path, found, self.dtype)
        part = _own(found)
        return part if part.dtype == self.dtype else part.astype(self.dtype)

    def _new_axis(self, at: int, count: int) -> LazyArray:
        if isinstance(self.stored, compose.Pushed):
            result = self._composed(self.stored.expand(at))
        else:
            result = self[(slice(None),) * at + (None,)]
        return result if count else result[(slice(None),) * at + (slice(0, 0),)]

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

    def transpose(self, *axes: int | Sequence[int]) -> LazyArray:
        """A view with its dimensions permuted, as `np.transpose` (reversed by
        default); reads nothing, and a read fills its result in place from the
        stored chunks, each read once.

        >>> w = lazyckpt.open(path)["params"]["w"]
        >>> bool((w.T.get() == w.get().T).all()), w[:2].transpose(1, 0).shape
        (True, (8, 2))
        """
        ndim = self.ndim
        one = len(axes) == 1 and not isinstance(axes[0], int | np.integer)
        given: Sequence[Any] = tuple(axes[0]) if one else axes  # type: ignore[arg-type]
        try:
            perm = tuple(operator.index(a) for a in given) if given else tuple(range(ndim))[::-1]
        except TypeError:
            raise LazyIndexError(
                f"{self.key} (shape {self.shape}): transpose takes integer axes, not {axes}"
            ) from None
        if sorted(a % ndim if -ndim <= a < ndim else a for a in perm) != list(range(ndim)):
            raise LazyIndexError(
                f"{self.key} (shape {self.shape}): axes {perm} are not a permutation of "
                f"its {ndim} dimensions"
            )
        perm = tuple(a % ndim for a in perm)
        if perm == tuple(range(ndim)):
            return self
        shape = tuple(self.shape[a] for a in perm)
        stored = self.stored
        if isinstance(stored, compose.Transpose):  # compose the two permutations
            inner = tuple(stored.perm[a] for a in perm)
            # A cast between the two transposes applies to the part, before the rest.
            part = _own(stored.array)
            part = part if part.dtype == self.dtype else part.astype(self.dtype)
            if inner == tuple(range(ndim)):
                return part
            return composed(
                self.path, compose.Transpose(shape, self.dtype, part, inner), self.dtype
            )
        self._composable("transpose")
        return composed(
            (f"transpose({self.key})",),
            compose.Transpose(shape, self.dtype, self, perm),
            self.dtype,
        )

    @property
    def T(self) -> LazyArray:
        """`transpose()`: the dimensions reversed."""
        return self.transpose()

    def reshape(self, *shape: int | Sequence[int]) -> LazyArray:
        """A view of the same elements in C order with another shape, as
        `np.reshape` (one dimension may be -1); reads nothing.

        Merging or splitting dimensions reads the stored chunks of what a read needs,
        once, into the result in place. A reshaped view sliced with a step reads the
        smallest box around what it needs.

        >>> w = lazyckpt.open(path)["params"]["w"]
        >>> w.reshape(4, 16).shape, bool((w.reshape(-1)[8:16].get() == w.get()[1]).all())
        ((4, 16), True)
        """
        given = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        new = _infer_shape(self.key, self.shape, tuple(int(n) for n in given))  # type: ignore[arg-type]
        if new == self.shape:
            return self
        self._composable("reshape")
        stored = self.stored
        if isinstance(stored, Reshape) and self.selection.is_full(stored.shape):
            source = _own(stored.array)
            return source.astype(self.dtype).reshape(new)
        groups = (
            matched_dims(self.shape, new)
            if self.size
            else ((tuple(range(self.ndim)), tuple(range(len(new)))),)
        )
        node = Reshape(new, self.dtype, self, groups)
        return composed((f"reshape({self.key})",), node, self.dtype)

    def _rebased(self, selection: Selection, dtype: np.dtype[Any] | None = None) -> LazyArray:
        """The same stored array (or node) through `selection`, in `dtype` if given: how
        the engine widens a view to the whole of what it is a view of."""
        if dtype is None:
            return attrs.evolve(self, selection=selection)
        return attrs.evolve(self, selection=selection, dtype=dtype)

    def _key_data(self) -> LazyArray:
        """For typed PRNG keys, the view of their stored uint32 data (one trailing
        dimension more); what every read of keys goes through, so that the read
        engine only ever sees plain arrays. Any other array is its own data."""
        if not self.key_impl:
            return self
        return attrs.evolve(self, dtype=self.stored.dtype, key_impl=None)

    def _composable(self, operation: str) -> None:
        if self.key_impl:
            raise LazyTypeError(
                f"{self.key}: typed PRNG keys cannot be used in {operation}; read them with "
                ".get() and use jax.random.key_data"
            )

    def astype(self, dtype: DTypeLike) -> LazyArray:
        """A view cast to `dtype` as it is read (NumPy casting rules)."""
        if self.key_impl:
            raise LazyTypeError(
                f"{self.key}: typed PRNG keys cannot be cast; read them and use "
                "jax.random.key_data to get their uint32 data"
            )
        new = parsed(dtype)
        if new is None:
            raise LazyTypeError(
                f"{self.key}: astype({dtype!r}): not a dtype NumPy knows; pass one such as "
                "'float32', 'bfloat16' or np.int8"
            )
        if new.hasobject:  # (reads fill arrays of values, which cannot hold references)
            raise LazyTypeError(
                f"{self.key}: astype(object): a LazyArray reads values, not Python objects; "
                "read it first, then convert: np.asarray(x).astype(object)"
            )
        natural = self.stored.dtype
        if self.dtype not in (natural, new) and not exact(natural, self.dtype):
            # The earlier cast rounds or wraps: keep it, so values equal NumPy's.
            return composed(self.path, compose.Cast(self.shape, self.dtype, self), new)
        return attrs.evolve(self, dtype=new)

    def read(self) -> ts.Future[Any]:
        """Start reading this view; the future resolves to a NumPy array (for typed
        PRNG keys, a `jax.Array` of keys)."""
        stored = self.stored
        if isinstance(stored, compose.Node):
            return ready(read_composed(self))
        if self.key_impl:
            import jax

            impl = self.key_impl
            keys = self._key_data().read()
            return then(
                keys, lambda data: jax.random.wrap_key_data(jax.numpy.asarray(data), impl=impl)
            )
        store = stored.store
        if decodes(stored):
            # Decoded by lazyckpt, cast as it is copied.
            return then(read_view(self), lambda values: _unchanged(store, values))
        data = then(stored.read(self.selection), lambda values: _unchanged(store, values))
        if self.dtype == stored.dtype:
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

    def __treescope_repr__(self, path: str | None, subtree_renderer: object) -> Any:
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
        if isinstance(self.stored, compose.Node):
            parts.append(self.stored.describe())
        if not self.selection.is_full(self.stored.shape):
            parts.append(f"view of {self.stored.shape}")
        parts.append(f"chunks={self.chunks}")
        if self.sharding is not None:
            parts.append(f"sharding={self.sharding!r}")
        return f"LazyArray({', '.join(parts)})"


def _own(part: ArrayView) -> LazyArray:
    """A part of a composed view, which `LazyArray` builds from LazyArrays only."""
    assert isinstance(part, LazyArray), part
    return part


def exact(source: DTypeLike, dest: DTypeLike) -> bool:
    """Whether casting `source` values to `dest` keeps every one exactly (so that a
    cast after it is the same as casting directly): NumPy's "safe" is not enough,
    int64 to float64 rounds."""
    source, dest = np.dtype(source), np.dtype(dest)
    if source == dest or source == np.bool_:
        return True
    if issubdtype(dest, np.complexfloating):  # parts are cast alike
        dest = np.dtype(f"f{dest.itemsize // 2}")
        if issubdtype(source, np.complexfloating):
            source = np.dtype(f"f{source.itemsize // 2}")
    integer, floating = issubdtype(source, np.integer), issubdtype(source, np.floating)
    if integer and issubdtype(dest, np.integer):
        return bool(np.can_cast(source, dest, "safe"))
    if integer and issubdtype(dest, np.floating):
        bits = 8 * source.itemsize - int(issubdtype(source, np.signedinteger))
        return bool(int(finfo(dest).nmant) + 1 >= bits)
    if floating and issubdtype(dest, np.floating):
        a, b = finfo(source), finfo(dest)
        return bool(b.nmant >= a.nmant and b.maxexp >= a.maxexp and b.minexp <= a.minexp)
    return False


def composed(path: tuple[str | int, ...], node: compose.Node, dtype: np.dtype[Any]) -> LazyArray:
    """The LazyArray of a view made of other views."""
    return LazyArray(path=path, stored=node, selection=Selection.full(node.shape), dtype=dtype)


def _infer_shape(key: str, shape: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, ...]:
    size = math.prod(shape)
    unknown = [i for i, n in enumerate(new) if n == -1]
    known = math.prod(n for n in new if n != -1)
    found = new
    if len(unknown) == 1 and known and size % known == 0:
        found = (*new[: unknown[0]], size // known, *new[unknown[0] + 1 :])
    if math.prod(found) != size or any(n < 0 for n in found):
        raise LazyIndexError(
            f"{key}: cannot reshape an array of shape {shape} ({size} elements) into "
            f"{new}; the sizes must match (one dimension may be -1)"
        )
    return found
