"""What `save` will write: each leaf of the tree planned as Orbax stores it.

A leaf's plan is its key path and key types, its Orbax value type, and for arrays
the shape, dtype, write shape (one device's shard) and chunks of about `chunk_bytes`
that tile the shard, cut along leading dimensions first, so that a later read of a
few rows reads about those rows. Names are checked here too: leaves Orbax would
store under one name, or could not read back, are refused before anything is
written.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from lazyckpt._array import compose
from lazyckpt._array.geometry import stored_map
from lazyckpt._array.tree import check_depth, key_of
from lazyckpt._engine.raw import in_file_order, lies_raw
from lazyckpt._errors import UnsavableError
from lazyckpt._lazy import LazyArray
from lazyckpt._orbax.metadata import (
    ARRAY_TYPES,
    DICT_KEY,
    EMPTY_WRITTEN,
    SEQUENCE_KEY,
    Entry,
    strings_json,
    valid_pointer,
)
from lazyckpt._orbax.sharding import sharding_entry
from lazyckpt._text import is_utf8, printable

DEFAULT_CHUNK_BYTES = 4 << 20
"""Stored chunk size that `save` aims for: small enough that reading a few rows
reads little more, large enough that a full read is not dominated by per-chunk
overhead."""


def plan(tree: object, chunk_bytes: int) -> list[Planned]:
    """Every leaf of `tree` as it will be saved, in tree order; raises
    `UnsavableError` for leaves and names a checkpoint cannot hold."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, not {chunk_bytes}")
    leaves = [_plan(keys, value, chunk_bytes) for keys, value in _flatten(tree)]
    _check_names(leaves)
    return leaves


@attrs.frozen
class Planned:
    """One leaf as it will be saved."""

    path: str  # for messages: params/dense/kernel
    keys: tuple[tuple[str, int], ...]  # (key, key_type) per level
    value_type: str
    value: Any = None
    shape: tuple[int, ...] = ()
    dtype: Any = None
    chunks: tuple[int, ...] = ()
    write_shape: tuple[int, ...] | None = None
    sharding: str | None = None  # the _sharding entry, for jax.Array leaves
    key_impl: str | None = None
    rows: tuple[tuple[int, int], ...] | None = None
    """In a save divided among processes, the ranges of rows (of whole chunks) this
    process writes; None: all of them."""

    @property
    def name(self) -> str:
        """The parameter name: keys joined by '.', unescaped, as Orbax names arrays."""
        return ".".join(key for key, _ in self.keys)

    @property
    def stored(self) -> bool:
        return self.value_type in ARRAY_TYPES

    def entry(self) -> Entry:
        return Entry(self.keys, self.value_type, self.write_shape)


def description(leaves: Sequence[Planned]) -> str:
    """What every process must agree on before a save: the tree's metadata."""
    return "\n".join(
        f"{leaf.name}|{leaf.value_type}|{leaf.shape}|{leaf.dtype}|{leaf.chunks}|{leaf.sharding}"
        for leaf in leaves
    )


def block_cost(leaf: Planned, size: int) -> int:
    """What a block of `size` elements counts for on the progress bar: the bytes it
    writes (see `written`)."""
    return size * int(np.dtype(leaf.dtype).itemsize)


def written(leaf: Planned) -> int:
    """The bytes of values a leaf writes, what the progress bar totals: reads are not
    added in, so a bar of 1 GiB is a gigabyte saved, whatever was read for it."""
    return math.prod(leaf.shape) * int(np.dtype(leaf.dtype).itemsize)


def _flatten(tree: object) -> Iterator[tuple[tuple[tuple[str, int], ...], object]]:
    """`(keys, leaf)` in tree order, None and empty containers included as leaves."""

    def is_leaf(node: object) -> bool:
        return node is None or _empty_node(node)

    check_depth(tree)  # (before jax calls `is_leaf` at every level)
    try:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    except (ValueError, TypeError) as error:
        mixed = _mixed_keys(tree)
        if mixed is None:
            raise
        where, mixed_keys = mixed
        kinds = sorted({type(k).__name__ for k in mixed_keys})
        raise UnsavableError(
            f"{where or '(the root)'}: a dict mixes keys of types {kinds} "
            f"({', '.join(map(repr, mixed_keys[:4]))}); "
            "jax cannot order them and a checkpoint names keys as strings, so 1 and '1' "
            "would collide: use keys of one type"
        ) from error
    for key_path, leaf in flat:
        keys: list[tuple[str, int]] = []
        for entry in key_path:
            if isinstance(entry, jax.tree_util.DictKey) and not isinstance(entry.key, str | int):
                raise UnsavableError(
                    f"{_path_str(keys)}: dict key {entry.key!r} is a "
                    f"{type(entry.key).__name__}; checkpoints keep str and int keys only"
                )
            if isinstance(entry, jax.tree_util.DictKey | jax.tree_util.GetAttrKey):
                keys.append((str(key_of(entry)), DICT_KEY))
            elif isinstance(entry, jax.tree_util.SequenceKey | jax.tree_util.FlattenedIndexKey):
                keys.append((str(key_of(entry)), SEQUENCE_KEY))
            else:
                raise UnsavableError(f"{_path_str(keys)}: unknown pytree key {entry!r}")
            if not keys[-1][0].isascii() and not is_utf8(keys[-1][0]):
                raise UnsavableError(
                    f"{printable(_path_str(keys))}: the key is no valid text (a lone "
                    "surrogate); checkpoint names are UTF-8, rename the key"
                )
        yield tuple(keys), leaf


def _mixed_keys(tree: object) -> tuple[str, list[object]] | None:
    """The first dict (its path, its keys) whose keys are not all of one type."""
    todo: list[tuple[object, str]] = [(tree, "")]
    while todo:
        node, where = todo.pop()
        if isinstance(node, dict):
            if len({type(k) for k in node}) > 1:
                return where, list(node)
            todo.extend((v, f"{where}/{k}".lstrip("/")) for k, v in node.items())
        elif isinstance(node, list | tuple):
            todo.extend((v, f"{where}/{i}".lstrip("/")) for i, v in enumerate(node))
    return None


def _empty_node(node: object) -> bool:
    """Whether `node` is a pytree container with no children (`{}`, `()`, an empty
    NamedTuple such as optax's EmptyState, an empty OrderedDict...)."""
    if node is None or isinstance(node, LazyArray | np.ndarray | jax.Array | str | bytes):
        return False
    children: Any = jax.tree_util.tree_structure(node, is_leaf=lambda child: child is not node)
    return bool(children.num_leaves == 0 and children.num_nodes == 1)


def _empty_type(node: object) -> str:
    """The value_type Orbax records for an empty container (format notes, The tree)."""
    if node is None:
        return "None"
    if isinstance(node, dict):
        return "Dict"
    if type(node) is list:
        return "List"
    if type(node) is tuple:
        return "Tuple"
    return "None"  # NamedTuples and other registered nodes: restored as None


def _path_str(keys: Sequence[tuple[str, int]]) -> str:
    return "/".join(key for key, _ in keys) or "(the root)"


def _plan(keys: tuple[tuple[str, int], ...], value: object, chunk_bytes: int) -> Planned:
    path = _path_str(keys)
    if value is None or _empty_node(value):
        return Planned(path, keys, _empty_type(value))
    if isinstance(value, str):
        if not is_utf8(value):
            raise UnsavableError(
                f"{path}: the string {printable(value[:40])} is not valid Unicode text (a "
                "lone surrogate), which Orbax cannot read back from _strings.json; "
                "save valid text, or its bytes as an array"
            )
        return Planned(path, keys, "string", value=value)
    if isinstance(value, LazyArray) and value.key_impl:
        value = value.get()  # typed PRNG keys: small; saved as jax.Array keys below
    if isinstance(value, LazyArray):
        sharding = value.sharding if value.selection.is_full(value.stored.shape) else None
        if sharding is not None and sharding.to_json():
            write_shape = sharding.shard_shape(value.shape)
            value_type, entry = "jax.Array", sharding.to_json()
        else:
            write_shape, value_type, entry = value.shape, "np.ndarray", None
        dtype = np.dtype(value.dtype)
        if not _storable(dtype):  # (a long double of a NumPy or flax file)
            raise UnsavableError(
                f"{path}: an array of dtype {dtype}, which tensorstore, and so a "
                "checkpoint, has no type for; cast it first (.astype('float64'))"
            )
        order = _stored_order(value) if entry is None else None
        return Planned(
            path, keys, value_type, value, value.shape, dtype,
            choose_chunks(write_shape, dtype.itemsize, chunk_bytes, order),
            write_shape if value_type == "jax.Array" else None, entry,
        )  # fmt: skip
    if isinstance(value, jax.Array):
        impl = None
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(value))
            value = jax.random.key_data(value)
        write_shape = tuple(value.sharding.shard_shape(value.shape))
        dtype = np.dtype(value.dtype)
        chunks = choose_chunks(write_shape, dtype.itemsize, chunk_bytes)
        if not value.is_fully_addressable and any(
            n % c for n, c in zip(write_shape, chunks, strict=True)
        ):
            # Chunks must not straddle shards held by different processes.
            chunks = tuple(max(n, 1) for n in write_shape)
        return Planned(
            path, keys, "jax.Array", value, tuple(value.shape), dtype, chunks,
            write_shape, sharding_entry(value.sharding), impl,
        )  # fmt: skip
    if isinstance(value, bool | int | float | np.generic):
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:
                raise UnsavableError(
                    f"{path}: the int {value} does not fit the int64 that checkpoints store "
                    "Python ints as; save it as a string or a float"
                )
            array = np.asarray(value, np.int64)
        else:
            array = np.asarray(value)
        if not _storable(array.dtype):
            raise UnsavableError(_unstorable(path, "a scalar", array.dtype))
        return Planned(path, keys, "scalar", array, (), array.dtype)
    if isinstance(value, np.ndarray):
        if not _storable(value.dtype):
            raise UnsavableError(_unstorable(path, "a NumPy array", value.dtype))
        return Planned(
            path, keys, "np.ndarray", value, value.shape, value.dtype,
            choose_chunks(value.shape, value.dtype.itemsize, chunk_bytes),
        )  # fmt: skip
    raise UnsavableError(
        f"{path}: cannot save a {type(value).__module__}.{type(value).__qualname__}; "
        "leaves must be LazyArrays, jax or NumPy arrays, scalars, strings or None"
    )


def _unstorable(path: str, what: str, dtype: np.dtype[Any]) -> str:
    """Why `what` of `dtype` at `path` cannot be saved, and what to do."""
    if not _not_numbers(dtype):  # numbers tensorstore lacks, as uint4 and float4
        return (
            f"{path}: {what} of dtype {dtype} cannot be stored: tensorstore's zarr3 driver, "
            "which Orbax checkpoints are written with, has no such dtype; cast it "
            "(astype) to a wider one, such as int8 or uint8 for 4-bit integers"
        )
    return (
        f"{path}: {what} of dtype {dtype} cannot be stored in a checkpoint; convert it "
        "to numbers, or save strings as str leaves"
    )


def _not_numbers(dtype: np.dtype[Any]) -> bool:
    """Objects, strings, dates, times and records."""
    return dtype.hasobject or dtype.kind in "USMm" or dtype.names is not None


def _storable(dtype: np.dtype[Any]) -> bool:
    """Whether tensorstore's zarr3 driver stores this dtype (bfloat16 and other
    ml_dtypes included; strings and objects not)."""
    if _not_numbers(dtype):
        return False
    try:
        ts.dtype(dtype)
    except (TypeError, ValueError):
        return False
    return True


def _stored_order(array: LazyArray) -> list[int] | None:
    """For a transposed view of raw bytes in a file (a safetensors or NumPy tensor, as
    `(out, in)` weights become Flax's `(in, out)` kernels), its dimensions in the
    file's order, outermost first; None for any other view. Chunks cut in that order
    are runs of the file, each read once, where chunks cut along the view's leading
    dimensions would each need every row of the file."""
    node = array.stored
    if not isinstance(node, compose.Transpose) or not array.selection.is_full(node.shape):
        return None
    inner = node.array
    if not lies_raw(inner) or not in_file_order(stored_map(inner)):
        return None
    return sorted(range(len(node.perm)), key=lambda dim: node.perm[dim])


def choose_chunks(
    write_shape: Sequence[int], itemsize: int, target: int, order: Sequence[int] | None = None
) -> tuple[int, ...]:
    """A chunk shape of about `target` bytes that tiles `write_shape` (one device's
    shard), cut along leading dimensions first (or the dimensions in `order`).

    Along each cut dimension it takes the largest divisor of the shard's extent that
    fits, so that shard boundaries fall on chunk boundaries; where the only such
    divisors are far too small (a prime extent), an even split instead.

    >>> choose_chunks((4096, 1024), 4, 4 << 20)     # 16 MiB shard -> 1024-row chunks
    (1024, 1024)
    >>> choose_chunks((50257, 1024), 4, 4 << 20)    # 50257 = 29 x 1733: even split
    (1006, 1024)
    >>> choose_chunks((8, 8), 4, 4 << 20)
    (8, 8)
    >>> choose_chunks((4096, 8192), 4, 4 << 20, order=(1, 0))  # a transposed tensor
    (4096, 256)
    """
    chunk = [max(int(n), 1) for n in write_shape]
    dims = list(range(len(chunk)) if order is None else order)
    for at, dim in enumerate(dims):
        if math.prod(chunk) * itemsize <= target:
            break
        per_unit = math.prod(chunk[d] for d in dims[at + 1 :]) * itemsize
        fit = max(1, target // per_unit)
        if fit >= chunk[dim]:
            continue
        extent = chunk[dim]
        pieces = -(-extent // fit)
        divisor = next(
            (extent // k for k in range(pieces, min(extent, 2 * pieces) + 1) if extent % k == 0),
            None,
        )
        chunk[dim] = divisor if divisor is not None else -(-extent // pieces)
    return tuple(chunk)


def _check_names(leaves: Sequence[Planned]) -> None:
    """Refuse trees whose leaves Orbax would store under one name, or could not read,
    or that lazyckpt would show by one key path (`{"a/b": x, "a": {"b": y}}`: Orbax
    keeps both, but `open(flat=True)`, `select` and messages name both 'a/b')."""
    seen: dict[str, Planned] = {}
    shown: dict[str, Planned] = {}
    for leaf in leaves:
        if leaf.value_type in EMPTY_WRITTEN:
            continue
        name = leaf.name
        # (A name with '.', '..' or empty parts between '/'s is a key in the OCDBT
        # database lazyckpt writes, not a path: Orbax saves and restores such names.)
        if leaf.value_type == "string" and not valid_pointer(name):
            raise UnsavableError(
                f"{leaf.path}: Orbax reads strings by the JSON pointer '/{name}', where '~' "
                "must be followed by '0' or '1'; rename the key"
            )
        other = seen.get(name)
        if other is not None:
            raise UnsavableError(
                f"{leaf.path} and {other.path} would both be stored as {name!r} (Orbax joins "
                "keys with '.'); rename one of them"
            )
        seen[name] = leaf
        other = shown.get(leaf.path)
        if other is not None:
            keys = [tuple(key for key, _ in each.keys) for each in (other, leaf)]
            raise UnsavableError(
                f"the leaves at keys {keys[0]!r} and {keys[1]!r} would both read back as "
                f"{printable(leaf.path)!r} (a key holding '/' reads as a nested path in "
                "open(flat=True), select and messages); rename one"
            )
        shown[leaf.path] = leaf
    strings = [leaf for leaf in leaves if leaf.value_type == "string"]
    try:
        strings_json(
            {leaf.name: leaf.value for leaf in strings}, {leaf.name: leaf.path for leaf in strings}
        )
    except ValueError as error:
        raise UnsavableError(str(error)) from None


def cost(leaf: Planned) -> int:
    """Bytes a leaf's blocks count for progress and the budget."""
    nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    if isinstance(leaf.value, LazyArray):
        nbytes += leaf.value.size * leaf.value.stored.dtype.itemsize
    return int(nbytes)
