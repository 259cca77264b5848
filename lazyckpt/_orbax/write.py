"""Writing planned leaves: arrays into an OCDBT database block by block, then the
metadata files, within the memory budget.

Arrays are zarr3 arrays in one OCDBT database, as Orbax 0.12 writes them (format notes, What lazyckpt writes).
LazyArray leaves are read and written block by block: every block of values in
flight counts against the budget, and none is read twice when the stored chunks
line up with the new ones. A jax.Array is written from its shards, each distinct
shard once, each block from the device that holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from numpy.typing import DTypeLike

from lazyckpt._array.geometry import Box, box_bytes, box_shape, chunk_blocks, on_grid
from lazyckpt._engine.scheduler import HELD, Scheduler
from lazyckpt._engine.stream import read_blocks
from lazyckpt._lazy import LazyArray
from lazyckpt._orbax.metadata import (
    ArrayRecord,
    array_metadatas_json,
    checkpoint_metadata_json,
    commit_text,
    metadata_json,
    sharding_file,
    strings_json,
)
from lazyckpt._orbax.plan import Planned, block_cost, cost
from lazyckpt._orbax.zarr import zarr3_spec
from lazyckpt._storage import paths
from lazyckpt._storage.futures import then
from lazyckpt._storage.publish import write_failure

OCDBT_CONFIG = {"max_inline_value_bytes": 1024}
"""As Orbax configures its databases: values up to 1 KiB live in the b-tree."""


def write_context() -> ts.Context:
    """The tensorstore context writes run in: copies on every core."""
    return ts.Context({"data_copy_concurrency": {"limit": max(8, 2 * (os.cpu_count() or 1))}})


def write_arrays(
    base: dict[str, Any], leaves: Sequence[Planned], scheduler: Scheduler, final: str
) -> None:
    """Write the stored leaves into the OCDBT database at `base`, block by block."""
    context = write_context()
    kvstore = {"driver": "ocdbt", "base": base, "config": OCDBT_CONFIG}
    created: list[ts.Future[None]] = []
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


def _streamed(leaf: Planned) -> bool:
    """LazyArray leaves of at least one dimension: read by the engine's stream."""
    return isinstance(leaf.value, LazyArray) and bool(leaf.shape)


def _stream(
    leaves: Sequence[Planned],
    kvstore: dict[str, Any],
    context: ts.Context,
    writes: Scheduler,
    final: str,
    created: list[ts.Future[None]],
) -> None:
    """Write LazyArray leaves from one stream of blocks, each a union of whole new
    chunks, read ahead within half the budget while earlier blocks are written; the
    creation of each array goes into `created` first, to be awaited on failure too."""
    opened = [
        ts.open(
            zarr3_spec(kvstore, leaf.name, leaf.shape, leaf.dtype, leaf.chunks), context=context
        )
        for leaf in leaves
    ]
    failures = [_failure(final, leaf) for leaf in leaves]
    created.extend(
        then(store, _ignore, failed) for store, failed in zip(opened, failures, strict=True)
    )
    # (a leaf's `rows`, each a view of whole chunk rows, written at its place)
    pieces = [
        (position, low, leaf.value if leaf.rows is None else leaf.value[low:high])
        for position, leaf in enumerate(leaves)
        for low, high in leaf.rows or [(0, leaf.shape[0])]
    ]
    views = [view for _, _, view in pieces]
    grids = [leaves[position].chunks for position, _, _ in pieces]
    for piece, within, values in read_blocks(views, writes.budget, grids=grids):
        position, low, view = pieces[piece]
        leaf = leaves[position]
        index = _shifted(within, low, view.shape[0])
        cost = block_cost(leaf, values.size)

        def start(
            store: ts.Future[ts.TensorStore] = opened[position],
            index: tuple[slice, ...] = index,
            values: np.ndarray = values,
            failed: Callable[[Exception], Exception] = failures[position],
        ) -> ts.Future[None]:
            written = then(store, lambda array: array[index].write(values).commit)
            return then(written, _ignore, failed)

        writes.submit(start, _ignore, held=values.nbytes * HELD, work=cost)


def _shifted(index: tuple[slice, ...], low: int, rows: int) -> tuple[slice, ...]:
    """`index` into a view of the rows from `low` on, as an index into the array."""
    if not low:
        return index
    first = index[0] if index else slice(None)
    start, stop, _ = first.indices(rows)
    return (slice(start + low, stop + low), *index[1:])


def _failure(final: str, leaf: Planned) -> Callable[[Exception], Exception]:
    return lambda error: write_failure(final, repr(leaf.path), error)


def _schedule(
    leaf: Planned,
    kvstore: dict[str, Any],
    context: ts.Context,
    scheduler: Scheduler,
    final: str,
) -> ts.Future[None]:
    """Submit the writes of one array leaf, block by block, to `scheduler`; return
    the creation of its zarr array."""
    opened = ts.open(
        zarr3_spec(kvstore, leaf.name, leaf.shape, leaf.dtype, leaf.chunks), context=context
    )
    failed = _failure(final, leaf)
    for index, nbytes, values in _blocks_of(leaf, scheduler.block_bytes):

        def start(
            index: tuple[slice, ...] = index, values: Callable[[], object] = values
        ) -> ts.Future[None]:
            def write(data: Any) -> ts.Future[None]:
                return then(opened, lambda store: store[index].write(data).commit)

            data = values()
            written: ts.Future[None] = (
                then(data, write) if isinstance(data, ts.Future) else write(data)
            )
            return then(written, lambda _: None, failed)

        # A failed block raises from the scheduler, and `publishing` discards the save.
        scheduler.submit(start, _ignore, held=nbytes * HELD, work=nbytes)
    return then(opened, _ignore, failed)


def _ignore(_: object) -> None:
    pass


def _blocks_of(
    leaf: Planned, block_bytes: int
) -> Iterator[tuple[tuple[slice, ...], int, Callable[[], object]]]:
    """`(index, budget bytes, values)` for each block to write; `values()` returns the
    block's values or a future of them."""
    value = leaf.value
    full: Box = tuple((0, n) for n in leaf.shape)
    if not leaf.shape:  # (LazyArrays of one dimension or more are streamed: `_stream`)
        if isinstance(value, LazyArray):
            yield (), max(1, cost(leaf)), value.read
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
    value: jax.Array, leaf: Planned, block_bytes: int
) -> Iterator[tuple[tuple[slice, ...], int, Callable[[], np.ndarray]]]:
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
    block: Box, parts: list[tuple[jax.Array, Box, Box]], dtype: DTypeLike
) -> Callable[[], np.ndarray]:
    """The values of `block`, copied together from the shards that overlap it."""

    def values() -> np.ndarray:
        out = np.empty(box_shape(block), dtype)
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


def write_metadata(tmp: str, final: str, leaves: Sequence[Planned]) -> None:
    """The metadata files, `commit_success.txt` last (on object storage, the commit)."""
    started = time.time_ns()
    _write_json(tmp, "_METADATA", metadata_json(leaf.entry() for leaf in leaves))
    arrays = [leaf for leaf in leaves if leaf.value_type == "jax.Array"]
    _write_json(tmp, "_sharding", sharding_file({a.name: a.sharding or "" for a in arrays}))
    if arrays:
        paths.make_folder(paths.join(tmp, "array_metadatas"))
        records = [
            ArrayRecord(a.name, a.write_shape or a.shape, a.chunks, a.key_impl) for a in arrays
        ]
        _write_json(tmp, "array_metadatas/process_0", array_metadatas_json(records))
    strings = {leaf.name: leaf.value for leaf in leaves if leaf.value_type == "string"}
    if strings:
        where = {name: name for name in strings}  # names were checked when planned
        _write_json(tmp, "_strings.json", strings_json(strings, where))
    _write_json(tmp, "_CHECKPOINT_METADATA", checkpoint_metadata_json(started))
    paths.write_bytes(paths.join(tmp, "commit_success.txt"), commit_text(final))


def _write_json(directory: str, name: str, data: object) -> None:
    paths.write_bytes(paths.join(directory, name), json.dumps(data).encode())
