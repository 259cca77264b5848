"""`save`: write a tree as an Orbax PyTree checkpoint (OCDBT + zarr3), streaming.

What goes where follows Orbax 0.12 (docs/format notes, spec §2-§9): one OCDBT
database holding a zarr3 array per array leaf, `_METADATA` for the tree,
`_sharding` and `array_metadatas/process_0` for jax.Array leaves,
`_strings.json` for strings, `_CHECKPOINT_METADATA` and `commit_success.txt`.

Arrays are stored in chunks of about `chunk_bytes`, cut from the shard each device
held (so a saved sharding still lines up with whole chunks) along leading
dimensions first, so that a later read of a few rows reads about those rows.
LazyArray leaves are read and written block by block: every block of values in
flight counts against `memory_budget`, and none is read twice when the stored
chunks line up with the new ones.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from lazyckpt import _fs as fs
from lazyckpt import _multihost as multihost
from lazyckpt._commit import publishing, write_failure
from lazyckpt._errors import CheckpointExistsError, LazyckptError, UnsavableError
from lazyckpt._geometry import Box, box_bytes, chunk_blocks, on_grid
from lazyckpt._lazy import LazyArray
from lazyckpt._progress import Progress
from lazyckpt._scheduler import HELD, Scheduler
from lazyckpt._sharding import sharding_json
from lazyckpt._store import then
from lazyckpt._stream import iter_blocks
from lazyckpt._tree import key_of

DEFAULT_CHUNK_BYTES = 4 << 20
"""Stored chunk size that `save` aims for: small enough that reading a few rows
reads little more, large enough that a full read is not dominated by per-chunk
overhead."""

_PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
_SEQUENCE_KEY, _DICT_KEY = 1, 2  # key_type codes in _METADATA (spec §3.1)
_EMPTY_VALUE_TYPES = ("None", "Dict", "List", "Tuple")


@attrs.frozen
class _Leaf:
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

    @property
    def name(self) -> str:
        """The parameter name: keys joined by '.', unescaped, as Orbax names arrays."""
        return ".".join(key for key, _ in self.keys)

    @property
    def stored(self) -> bool:
        return self.value_type in ("jax.Array", "np.ndarray", "scalar")


def save(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    memory_budget: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write `tree` as an Orbax PyTree checkpoint at `path`; return its absolute path.

    Leaves may be LazyArrays (sliced or cast ones too), `jax.Array`s, NumPy arrays,
    Python and NumPy scalars, strings and None; containers are dicts, lists, tuples
    and any registered pytree node. LazyArrays are streamed: read and written block
    by block with at most `memory_budget` bytes of blocks in flight (default 32 MiB
    per core, at least 64 MiB), never loaded whole. Arrays are stored in chunks of
    about `chunk_bytes`. The checkpoint appears at `path` only once complete; an
    existing one is replaced only with `overwrite=True`. `path` may be an `s3://` or
    `gs://` URL (see `open` for `storage_options`): there, with no rename to commit
    with, `commit_success.txt` is written last and marks the save complete, and an
    overwrite deletes the old checkpoint first. In a `jax.distributed` run every
    process calls `save` with the same tree; each writes the shards it holds.

    Orbax restores the result (`PyTreeCheckpointer`, `StandardCheckpointer`), and
    `lazyckpt.open` reads it back as saved.

    >>> tree = lazyckpt.open(path)
    >>> small = {"w": tree["params"]["w"][:2].astype("float16"), "note": "first rows"}
    >>> out = lazyckpt.save(tmp / "small", small)
    >>> lazyckpt.open(out)
    {'note': 'first rows', 'w': LazyArray('w', shape=(2, 8), dtype=float16, chunks=(2, 8))}
    """
    final = fs.normalize(path)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, not {chunk_bytes}")
    leaves = [_plan(keys, value, chunk_bytes) for keys, value in _flatten(tree)]
    _check_names(leaves)
    if overwrite and fs.is_remote(final):
        _refuse_reading_from(final, leaves)
    multihost.agree(
        "the tree to save",
        _description(leaves),
        "every process must pass the same tree: the same keys, shapes, dtypes and shardings",
    )
    total = sum(_cost(leaf) for leaf in leaves if leaf.stored)
    bar = Progress.maybe(progress, total, "lazyckpt save")
    scheduler = Scheduler(memory_budget, bar)
    with fs.session(storage_options):
        if multihost.count() > 1:
            _save_together(final, leaves, scheduler, overwrite)
        else:
            with publishing(final, overwrite=overwrite) as tmp:
                _write_arrays(fs.kvstore_spec(tmp), leaves, scheduler, final)
                _write_metadata(tmp, final, leaves)
    if bar is not None:
        bar.close()
    return final


def _refuse_reading_from(final: str, leaves: Sequence[_Leaf]) -> None:
    """On object storage an overwrite deletes the old checkpoint before writing: refuse
    when the tree still reads from it."""
    for leaf in leaves:
        if isinstance(leaf.value, LazyArray):
            source = leaf.value.stored.store.location
            if source == final or source.startswith(final + "/"):
                raise CheckpointExistsError(
                    f"{leaf.path} is read from {source}, which overwriting {final} would "
                    "delete before it is read (object storage has no atomic replace); save "
                    "to a new path, then delete the old one"
                )


def _description(leaves: Sequence[_Leaf]) -> str:
    """What every process must agree on before a save: the tree's metadata."""
    return "\n".join(
        f"{leaf.name}|{leaf.value_type}|{leaf.shape}|{leaf.dtype}|{leaf.chunks}|{leaf.sharding}"
        for leaf in leaves
    )


def _context() -> ts.Context:
    return ts.Context({"data_copy_concurrency": {"limit": max(8, 2 * (os.cpu_count() or 1))}})


def _write_arrays(
    base: dict[str, Any], leaves: Sequence[_Leaf], scheduler: Scheduler, final: str
) -> None:
    """Write the stored leaves into the OCDBT database at `base`, block by block."""
    context = _context()
    kvstore = {"driver": "ocdbt", "base": base, "config": {"max_inline_value_bytes": 1024}}
    created: list[ts.Future[Any]] = []
    streamed = [leaf for leaf in leaves if leaf.stored and _streamed(leaf)]
    # Lazy leaves are read by one stream with half the budget; their writes get the rest.
    writes = Scheduler(max(1, scheduler.budget // 2), scheduler.progress) if streamed else None
    try:
        for leaf in leaves:
            if leaf.stored and not _streamed(leaf):
                created.append(_schedule(leaf, kvstore, context, scheduler, final))
        if writes is not None:
            _stream(streamed, kvstore, context, writes, final, created)
            writes.drain()
        scheduler.drain()
        for future in created:  # arrays without blocks (size 0) too
            future.result()
    except BaseException:
        # Let writes in flight end before the folder is removed.
        scheduler.abandon()
        if writes is not None:
            writes.abandon()
        for future in created:
            with contextlib.suppress(Exception):
                future.result()
        raise


def _streamed(leaf: _Leaf) -> bool:
    """LazyArray leaves of at least one dimension: read by the engine's stream."""
    return isinstance(leaf.value, LazyArray) and bool(leaf.shape)


def _stream(
    leaves: Sequence[_Leaf],
    kvstore: dict[str, Any],
    context: ts.Context,
    writes: Scheduler,
    final: str,
    created: list[ts.Future[Any]],
) -> None:
    """Write LazyArray leaves from one stream of blocks, each a union of whole new
    chunks, read ahead within half the budget while earlier blocks are written; the
    creation of each array goes into `created` first, to be awaited on failure too."""
    opened = [ts.open(_zarr3_spec(kvstore, leaf), context=context) for leaf in leaves]
    failures = [_failure(final, leaf) for leaf in leaves]
    created.extend(
        then(store, _ignore, failed) for store, failed in zip(opened, failures, strict=True)
    )
    views = [leaf.value for leaf in leaves]
    grids = [leaf.chunks for leaf in leaves]
    for position, index, values in iter_blocks(views, writes.budget, grids=grids):
        leaf = leaves[position]
        cost = _block_cost(leaf, values.size)

        def start(
            store: ts.Future[Any] = opened[position],
            index: tuple[slice, ...] = index,
            values: np.ndarray = values,
            failed: Callable[[Exception], Exception] = failures[position],
        ) -> ts.Future[Any]:
            written = then(store, lambda array: array[index].write(values).commit)
            return then(written, _ignore, failed)

        writes.submit(start, _ignore, held=values.nbytes * HELD, work=cost)


def _failure(final: str, leaf: _Leaf) -> Callable[[Exception], Exception]:
    return lambda error: write_failure(final, repr(leaf.path), error)


def _block_cost(leaf: _Leaf, size: int) -> int:
    """What a block of `size` elements counts for on the progress bar (see `_cost`)."""
    stored = int(leaf.value.stored.dtype.itemsize) if isinstance(leaf.value, LazyArray) else 0
    return size * (int(np.dtype(leaf.dtype).itemsize) + stored)


def _save_together(
    final: str, leaves: Sequence[_Leaf], scheduler: Scheduler, overwrite: bool
) -> None:
    """A save by every process of a `jax.distributed` run, as Orbax does one.

    Process 0 checks the destination and makes the temporary folder; each process
    writes the shards it holds (replica 0 of each, so replicated data is written
    once in total) into its own OCDBT database `ocdbt.process_<i>`, and process 0
    also every non-jax.Array leaf. Once all have written, process 0 checks that every
    writer's database is there (the processes must share the destination's file
    system), merges them into the root one, writes the metadata and publishes the
    checkpoint. A failure anywhere fails the save on every process, and nothing is
    published.
    """
    me = multihost.index()
    stack = contextlib.ExitStack()
    tmp = ""
    if me == 0:
        try:
            tmp = stack.enter_context(publishing(final, overwrite=overwrite))
        except Exception as error:
            multihost.broadcast_text(f"error:{type(error).__name__}:{error}")
            raise
    told = multihost.broadcast_text(f"ok:{tmp}")
    if told.startswith("error:"):
        kind, _, message = told[6:].partition(":")
        raise _error_class(kind)(f"process 0 could not start the save: {message}")
    tmp = told[3:]
    with stack:
        mine = [leaf for leaf in leaves if me == 0 or _holds_shards(leaf)]
        failed: BaseException | None = None
        try:
            base = fs.kvstore_spec(fs.join(tmp, f"ocdbt.process_{me}"))
            _write_arrays(base, mine, scheduler, final)
        except Exception as error:  # noqa: BLE001 - reported to every process below
            failed = error
        wrote = any(leaf.stored for leaf in mine)
        flags = multihost.gather([int(failed is not None), int(wrote)])
        if failed is not None:
            raise failed
        failing = [i for i, (bad, _) in enumerate(flags) if bad]
        if failing:
            raise LazyckptError(f"{final}: process(es) {failing} failed to write their shards")
        if me != 0:
            if multihost.any_failed(False):
                raise LazyckptError(f"{final}: process 0 failed to merge and publish the save")
            return
        published = False
        try:
            writers = [i for i, (_, did) in enumerate(flags) if did]
            _merge(tmp, writers, final)
            _write_metadata(tmp, final, leaves)
            stack.close()  # publish: fsync and rename, or the bucket's commit marker
            published = True
        finally:
            multihost.any_failed(not published)


def _error_class(name: str) -> type[LazyckptError]:
    import lazyckpt._errors as errors

    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, LazyckptError) else LazyckptError


def _holds_shards(leaf: _Leaf) -> bool:
    value = leaf.value
    return isinstance(value, jax.Array) and any(
        shard.replica_id == 0 for shard in value.addressable_shards
    )


def _merge(tmp: str, writers: list[int], final: str) -> None:
    """Copy every writer's database into the root one (spec §4.1); large chunks stay
    in the files where they were written."""
    missing = [
        i for i in writers if not fs.isfile(fs.join(tmp, f"ocdbt.process_{i}/manifest.ocdbt"))
    ]
    if missing:
        raise LazyckptError(
            f"{final}: process 0 cannot see what process(es) {missing} wrote under {tmp}; "
            "every process must save to the same shared file system or bucket"
        )
    context = _context()
    root_spec = {"driver": "ocdbt", "base": fs.kvstore_spec(tmp)}
    root = ts.KvStore.open(
        {**root_spec, "config": {"max_inline_value_bytes": 1024}}, context=context
    ).result()
    for process in writers:
        spec = {
            "driver": "ocdbt",
            "base": fs.kvstore_spec(fs.join(tmp, f"ocdbt.process_{process}")),
        }
        source = ts.KvStore.open(spec, context=context).result()
        source.experimental_copy_range_to(root).result()


def _flatten(tree: Any) -> Iterator[tuple[tuple[tuple[str, int], ...], Any]]:
    """`(keys, leaf)` in tree order, None and empty containers included as leaves."""

    def is_leaf(node: Any) -> bool:
        return node is None or _empty_node(node)

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
                keys.append((str(key_of(entry)), _DICT_KEY))
            elif isinstance(entry, jax.tree_util.SequenceKey | jax.tree_util.FlattenedIndexKey):
                keys.append((str(key_of(entry)), _SEQUENCE_KEY))
            else:
                raise UnsavableError(f"{_path_str(keys)}: unknown pytree key {entry!r}")
        yield tuple(keys), leaf


def _mixed_keys(tree: Any) -> tuple[str, list[Any]] | None:
    """The first dict (its path, its keys) whose keys are not all of one type."""
    todo: list[tuple[Any, str]] = [(tree, "")]
    while todo:
        node, where = todo.pop()
        if isinstance(node, dict):
            if len({type(k) for k in node}) > 1:
                return where, list(node)
            todo.extend((v, f"{where}/{k}".lstrip("/")) for k, v in node.items())
        elif isinstance(node, list | tuple):
            todo.extend((v, f"{where}/{i}".lstrip("/")) for i, v in enumerate(node))
    return None


def _empty_node(node: Any) -> bool:
    """Whether `node` is a pytree container with no children (`{}`, `()`, an empty
    NamedTuple such as optax's EmptyState, an empty OrderedDict...)."""
    if node is None or isinstance(node, LazyArray | np.ndarray | jax.Array | str | bytes):
        return False
    children: Any = jax.tree_util.tree_structure(node, is_leaf=lambda child: child is not node)
    return bool(children.num_leaves == 0 and children.num_nodes == 1)


def _empty_type(node: Any) -> str:
    """The value_type Orbax records for an empty container (spec §3.1)."""
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


def _plan(keys: tuple[tuple[str, int], ...], value: Any, chunk_bytes: int) -> _Leaf:
    path = _path_str(keys)
    if value is None or _empty_node(value):
        return _Leaf(path, keys, _empty_type(value))
    if isinstance(value, str):
        return _Leaf(path, keys, "string", value=value)
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
        return _Leaf(
            path, keys, value_type, value, value.shape, dtype,
            choose_chunks(write_shape, dtype.itemsize, chunk_bytes),
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
        return _Leaf(
            path, keys, "jax.Array", value, tuple(value.shape), dtype, chunks,
            write_shape, sharding_json(value.sharding), impl,
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
            raise UnsavableError(
                f"{path}: a scalar of dtype {array.dtype} cannot be stored in a checkpoint; "
                "save numbers, or strings as str leaves"
            )
        return _Leaf(path, keys, "scalar", array, (), array.dtype)
    if isinstance(value, np.ndarray):
        if not _storable(value.dtype):
            raise UnsavableError(
                f"{path}: NumPy arrays of dtype {value.dtype} cannot be stored in a "
                "checkpoint; convert them to numbers, or save strings as str leaves"
            )
        return _Leaf(
            path, keys, "np.ndarray", value, value.shape, value.dtype,
            choose_chunks(value.shape, value.dtype.itemsize, chunk_bytes),
        )  # fmt: skip
    raise UnsavableError(
        f"{path}: cannot save a {type(value).__module__}.{type(value).__qualname__}; "
        "leaves must be LazyArrays, jax or NumPy arrays, scalars, strings or None"
    )


def _storable(dtype: np.dtype[Any]) -> bool:
    """Whether tensorstore's zarr3 driver stores this dtype (bfloat16 and other
    ml_dtypes included; strings and objects not)."""
    if dtype.hasobject or dtype.kind in "USMm" or dtype.names is not None:
        return False
    try:
        ts.dtype(dtype)
    except (TypeError, ValueError):
        return False
    return True


def choose_chunks(write_shape: Sequence[int], itemsize: int, target: int) -> tuple[int, ...]:
    """A chunk shape of about `target` bytes that tiles `write_shape` (one device's
    shard), cut along leading dimensions first.

    Along each cut dimension it takes the largest divisor of the shard's extent that
    fits, so that shard boundaries fall on chunk boundaries; where the only such
    divisors are far too small (a prime extent), an even split instead.

    >>> choose_chunks((4096, 1024), 4, 4 << 20)     # 16 MiB shard -> 1024-row chunks
    (1024, 1024)
    >>> choose_chunks((50257, 1024), 4, 4 << 20)    # 50257 = 29 x 1733: even split
    (1006, 1024)
    >>> choose_chunks((8, 8), 4, 4 << 20)
    (8, 8)
    """
    chunk = [max(int(n), 1) for n in write_shape]
    for dim in range(len(chunk)):
        if math.prod(chunk) * itemsize <= target:
            break
        per_unit = math.prod(chunk[dim + 1 :]) * itemsize
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


def _check_names(leaves: Sequence[_Leaf]) -> None:
    """Refuse trees whose leaves Orbax would store under one name, or could not read."""
    seen: dict[str, _Leaf] = {}
    for leaf in leaves:
        if leaf.value_type in _EMPTY_VALUE_TYPES:
            continue
        name = leaf.name
        parts = name.split("/")
        if name and (name.startswith("/") or any(part in ("", ".", "..") for part in parts)):
            raise UnsavableError(
                f"{leaf.path}: its parameter name {name!r} has an empty, '.' or '..' part "
                "between '/'s, which readers take as a path; rename the key"
            )
        if leaf.value_type == "string" and any(_bad_tilde(part) for part in parts):
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
    _nest_strings([leaf for leaf in leaves if leaf.value_type == "string"])


def _bad_tilde(part: str) -> bool:
    return any(c == "~" and part[i + 1 : i + 2] not in ("0", "1") for i, c in enumerate(part))


def _cost(leaf: _Leaf) -> int:
    """Bytes a leaf's blocks count for progress and the budget."""
    nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    if isinstance(leaf.value, LazyArray):
        nbytes += leaf.value.size * leaf.value.stored.dtype.itemsize
    return int(nbytes)


def _zarr3_spec(kvstore: dict[str, Any], leaf: _Leaf) -> dict[str, Any]:
    codecs = [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "zstd", "configuration": {"level": 1, "checksum": True}},
    ]
    return {
        "driver": "zarr3",
        "kvstore": {**kvstore, "path": f"{leaf.name}/" if leaf.name else ""},
        "metadata": {
            "shape": list(leaf.shape),
            "data_type": ts.dtype(leaf.dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(leaf.chunks)}},
            "chunk_key_encoding": {"name": "default"},
            # As Orbax writes it: a shard holding exactly one chunk, with a checksummed index.
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(leaf.chunks),
                        "codecs": codecs,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                        "index_location": "end",
                    },
                }
            ],
        },
        "create": True,
        # Write every chunk, even all-zero ones: readers then treat a missing chunk
        # as damage (store_array_data_equal_to_fill_value in _METADATA).
        "store_data_equal_to_fill_value": True,
    }


def _schedule(
    leaf: _Leaf,
    kvstore: dict[str, Any],
    context: ts.Context,
    scheduler: Scheduler,
    final: str,
) -> ts.Future[Any]:
    """Submit the writes of one array leaf, block by block, to `scheduler`; return
    the creation of its zarr array."""
    opened = ts.open(_zarr3_spec(kvstore, leaf), context=context)
    failed = _failure(final, leaf)
    for index, nbytes, values in _blocks_of(leaf, scheduler.block_bytes):

        def start(
            index: tuple[slice, ...] = index, values: Callable[[], Any] = values
        ) -> ts.Future[Any]:
            def write(data: Any) -> ts.Future[Any]:
                return then(opened, lambda store: store[index].write(data).commit)

            data = values()
            written = then(data, write) if isinstance(data, ts.Future) else write(data)
            return then(written, lambda _: None, failed)

        # A failed block raises from the scheduler, and `publishing` discards the save.
        scheduler.submit(start, _ignore, held=nbytes * HELD, work=nbytes)
    return then(opened, _ignore, failed)


def _ignore(_: Any) -> None:
    pass


def _blocks_of(
    leaf: _Leaf, block_bytes: int
) -> Iterator[tuple[tuple[slice, ...], int, Callable[[], Any]]]:
    """`(index, budget bytes, values)` for each block to write; `values()` returns the
    block's values or a future of them."""
    value = leaf.value
    full: Box = tuple((0, n) for n in leaf.shape)
    if not leaf.shape:  # (LazyArrays of one dimension or more are streamed: `_stream`)
        if isinstance(value, LazyArray):
            yield (), max(1, _cost(leaf)), value.read
        else:
            data = np.asarray(value)
            yield (), max(1, data.nbytes), _const(data)
        return
    itemsize = np.dtype(leaf.dtype).itemsize
    if isinstance(value, jax.Array):
        yield from _shard_blocks(value, leaf, block_bytes)
        return
    for block in chunk_blocks(full, leaf.chunks, itemsize, block_bytes):
        index = _index(block)
        yield index, box_bytes(block, itemsize), _const(value[index])


def _const(values: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: values


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(low, high) for low, high in box)


def _shard_blocks(
    value: jax.Array, leaf: _Leaf, block_bytes: int
) -> Iterator[tuple[tuple[slice, ...], int, Callable[[], Any]]]:
    """Blocks of a jax.Array, taken from its shards: each distinct shard once (replica
    0), each block from the device that holds it."""
    full: Box = tuple((0, n) for n in leaf.shape)
    itemsize = np.dtype(leaf.dtype).itemsize
    shards = [shard for shard in value.addressable_shards if shard.replica_id == 0]
    boxes = [
        tuple(s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape, strict=True))
        for shard in shards
    ]
    if not all(on_grid(box, full, leaf.chunks) for box in boxes):
        # Chunks that straddle shards: assemble each block from the shards it overlaps.
        for block in chunk_blocks(full, leaf.chunks, itemsize, block_bytes):
            parts = []
            for shard, box in zip(shards, boxes, strict=True):
                part = tuple(
                    (max(a, c), min(b, d)) for (a, b), (c, d) in zip(block, box, strict=True)
                )
                if all(low < high for low, high in part):
                    parts.append((shard.data, part, box))
            yield _index(block), box_bytes(block, itemsize), _assemble(block, parts, leaf.dtype)
        return
    for shard, box in zip(shards, boxes, strict=True):
        for block in chunk_blocks(box, leaf.chunks, itemsize, block_bytes):
            local = tuple(
                slice(low - o, high - o) for (low, high), (o, _) in zip(block, box, strict=True)
            )
            yield _index(block), box_bytes(block, itemsize), _shard_piece(shard.data, local)


def _assemble(
    block: Box, parts: list[tuple[jax.Array, Box, Box]], dtype: Any
) -> Callable[[], np.ndarray]:
    """The values of `block`, copied together from the shards that overlap it."""

    def values() -> np.ndarray:
        out = np.empty(tuple(high - low for low, high in block), dtype)
        for data, part, box in parts:
            local = tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(part, box, strict=True))
            into = tuple(
                slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(part, block, strict=True)
            )
            out[into] = _shard_piece(data, local)()
        return out

    return values


def _shard_piece(data: jax.Array, local: tuple[slice, ...]) -> Callable[[], np.ndarray]:
    def piece() -> np.ndarray:
        if data.devices() and next(iter(data.devices())).platform == "cpu":
            return np.asarray(data)[local]  # a view of the device buffer: no copy
        return np.asarray(data[local])  # copy only this block to the host

    return piece


def _write_metadata(tmp: str, final: str, leaves: Sequence[_Leaf]) -> None:
    started = time.time_ns()
    tree_metadata = {}
    for leaf in leaves:
        entry: dict[str, Any] = {
            "value_type": leaf.value_type,
            "skip_deserialize": leaf.value_type in _EMPTY_VALUE_TYPES,
        }
        if leaf.write_shape is not None:
            entry["write_shape"] = list(leaf.write_shape)
        outer = str(tuple(key for key, _ in leaf.keys))
        tree_metadata[outer] = {
            "key_metadata": [{"key": key, "key_type": kind} for key, kind in leaf.keys],
            "value_metadata": entry,
        }
    _write_json(
        tmp,
        "_METADATA",
        {
            "tree_metadata": tree_metadata,
            "use_ocdbt": True,
            "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        },
    )
    arrays = [leaf for leaf in leaves if leaf.value_type == "jax.Array"]
    _write_json(
        tmp,
        "_sharding",
        {
            base64.urlsafe_b64encode(leaf.name.encode()).decode(): leaf.sharding or ""
            for leaf in arrays
        },
    )
    if arrays and not fs.is_remote(tmp):
        os.mkdir(os.path.join(tmp, "array_metadatas"))
    if arrays:
        _write_json(
            tmp,
            "array_metadatas/process_0",
            {
                "array_metadatas": [
                    {
                        "array_metadata": {
                            "param_name": leaf.name,
                            "write_shape": list(leaf.write_shape or leaf.shape),
                            "chunk_shape": list(leaf.chunks),
                            "ext_metadata": (
                                {"random_key_impl": leaf.key_impl} if leaf.key_impl else None
                            ),
                        }
                    }
                    for leaf in arrays
                ]
            },
        )
    strings = [leaf for leaf in leaves if leaf.value_type == "string"]
    if strings:
        _write_json(tmp, "_strings.json", _nest_strings(strings))
    _write_json(
        tmp,
        "_CHECKPOINT_METADATA",
        {
            "item_handlers": _PYTREE_HANDLER,
            "metrics": {},
            "performance_metrics": {},
            "init_timestamp_nsecs": started,
            "commit_timestamp_nsecs": time.time_ns(),
            "custom_metadata": {},
        },
    )
    # Last: on object storage this file is the commit.
    fs.write_bytes(
        fs.join(tmp, "commit_success.txt"), f"Checkpoint commit was successful to {final}".encode()
    )


def _nest_strings(leaves: Sequence[_Leaf]) -> dict[str, Any]:
    """Strings keyed so that the JSON pointer "/" + name finds each (spec §5)."""
    nested: dict[str, Any] = {}
    for leaf in leaves:
        *parents, last = (
            part.replace("~1", "/").replace("~0", "~") for part in leaf.name.split("/")
        )
        node = nested
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UnsavableError(
                    f"{leaf.path}: its name {leaf.name!r} nests under another string leaf "
                    f"({part!r}) in _strings.json; rename one of them"
                )
            node = child
        if last in node:
            raise UnsavableError(
                f"{leaf.path}: its name {leaf.name!r} collides with other string leaves in "
                "_strings.json; rename one of them"
            )
        node[last] = leaf.value
    return nested


def _write_json(directory: str, name: str, data: Any) -> None:
    fs.write_bytes(fs.join(directory, name), json.dumps(data).encode())
