"""Dividing a conversion among the processes of a `jax.distributed` job.

Every process calls `convert` with the same arguments and so holds the same lazy tree;
`divide` then gives each unit of writing (an array of an Orbax checkpoint, a file of a
safetensors model folder) to one process, from metadata alone, the same on every
process. Units that read the same stored bytes (two views of one tensor, a dequantized
weight and its scales beside the scales' other readers) go to one process together,
so that each stored byte is read once across the job; the groups are weighed by the
stored bytes they read plus the bytes they write, and given out largest first to the
least loaded process (ties: the lower process, in tree order).

An array larger than a share comes as several units, parts of whole chunk rows of
the new checkpoint (Orbax: `lazyckpt._orbax.save`); they go to different processes
where they read apart: rows of a tensor lying whole in a file (safetensors, raw
`.npy`), or rows of an array stored in chunks that touch no chunk in common; not a
dequantized weight (each part of it reads all of its stored weight and scales), nor
parts that share a stored chunk (those stay together, read once). A
safetensors file is written by one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from lazyckpt._array.compose import sources
from lazyckpt._array.geometry import bounds
from lazyckpt._engine.stored import StoredArray
from lazyckpt._engine.workload import distinct_nbytes
from lazyckpt._lazy import LazyArray
from lazyckpt._storage import multihost


def divide(units: Sequence[tuple[Sequence[Any], int]]) -> list[int]:
    """The process that writes each of `units`, `(the values it reads, bytes it
    writes)`: see the module docstring."""
    count = multihost.count()
    parent = list(range(len(units)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # What each unit reads: per place (a file, a stored array; equal places are one,
    # as two tensors of one file name theirs anew), byte spans.
    spans: dict[object, list[tuple[int, int, int]]] = {}
    for i, (values, _) in enumerate(units):
        for value in values:
            for place, low, high in _reads(value):
                spans.setdefault(place, []).append((low, high, i))
    for found in spans.values():
        found.sort()
        end, reader = -1, -1
        for low, high, i in found:
            if low < end:  # (overlapping what an earlier unit reads: one group)
                a, b = root(i), root(reader)
                if a != b:
                    parent[max(a, b)] = min(a, b)
            if high > end:
                end, reader = high, i
    groups: dict[int, list[int]] = {}
    for i in range(len(units)):
        groups.setdefault(root(i), []).append(i)
    weighed = sorted(
        (
            (_weight([units[i] for i in members]), members[0], members)
            for members in groups.values()
        ),
        key=lambda item: (-item[0], item[1]),
    )
    load = [0] * count
    owner = [0] * len(units)
    for weight, _, members in weighed:
        process = min(range(count), key=lambda p: (load[p], p))
        load[process] += weight
        for i in members:
            owner[i] = process
    return owner


def _reads(value: object) -> Iterator[tuple[object, int, int]]:
    """`(place, first, one past the last)` that `value` reads of each stored array:
    of a plain one lying whole in a file, the bytes its selection spans (rows of it
    read apart, so an array can be divided among processes by its rows); of any
    other (chunked, encoded: read a chunk at a time), the span of its chunk grid, in
    flat C order, from the first chunk its selection touches to the last (views of
    different chunks, a stacked array's layers, read apart)."""
    if not isinstance(value, LazyArray):
        return
    for source in sources(value):
        stored = source.stored
        if not isinstance(stored, StoredArray) or not math.prod(source.selection.shape):
            continue
        place, origin = stored.extent()
        itemsize = stored.dtype.itemsize
        if stored.raw_file() is None and stored.remote_raw() is None:
            # (flat C-order chunk indices, first to last touched: the chunks between
            # may be untouched, so this may join units that read apart, never split
            # ones that share a chunk)
            first = last = 0
            for n, c, (low, high) in zip(
                stored.shape, stored.chunks, bounds(source.selection), strict=True
            ):
                c = max(1, c)
                first, last = first * -(-n // c) + low // c, last * -(-n // c) + (high - 1) // c
            yield place, first, last + 1
            continue
        first = last = 0
        for n, (low, high) in zip(stored.shape, bounds(source.selection), strict=True):
            first, last = first * n + low, last * n + high - 1
        yield place, origin + first * itemsize, origin + (last + 1) * itemsize


def _weight(units: Sequence[tuple[Sequence[Any], int]]) -> int:
    read = distinct_nbytes(v for values, _ in units for v in values if isinstance(v, LazyArray))
    return read + sum(written for _, written in units)
