"""Saving a tree as an Orbax PyTree checkpoint (OCDBT + zarr3), streamed.

What goes where follows Orbax 0.12 (format notes: What lazyckpt writes): one OCDBT
database holding a zarr3 array per array leaf, `_METADATA` for the tree, `_sharding`
and `array_metadatas/process_0` for jax.Array leaves, `_strings.json` for strings,
`_CHECKPOINT_METADATA` and `commit_success.txt`. The leaves are planned first
(`lazyckpt._orbax.plan`), written within the budget (`lazyckpt._orbax.write`, or
`lazyckpt._orbax.write_together` in a multi-process run) into a temporary folder, and
published atomically (`lazyckpt._storage.publish`).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping

from lazyckpt._engine.progress import shown
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._errors import LazyckptError
from lazyckpt._lazy import LazyArray
from lazyckpt._orbax.legacy import read_msgpack
from lazyckpt._orbax.metadata import parse_metadata
from lazyckpt._orbax.plan import Planned, description, plan, written
from lazyckpt._orbax.write import write_arrays, write_metadata
from lazyckpt._orbax.write_together import save_together
from lazyckpt._storage import multihost, paths
from lazyckpt._storage.extra_files import write_files
from lazyckpt._storage.per_process import tensorstore_io
from lazyckpt._storage.publish import publishing


def save_orbax(
    final: str,
    tree: object,
    *,
    chunk_bytes: int,
    memory_budget: int | None,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    progress: bool | None,
    label: str = "lazyckpt save",
    extra_files: Mapping[str, bytes] | None = None,
    divide: multihost.Divide | None = None,
) -> None:
    """Write `tree` at `final` (see `lazyckpt.save`); `replaceable` says what an
    overwrite may replace; `extra_files` ({relative path: contents}) are written into
    the checkpoint before it is committed (the files `convert` carries). In a
    multi-process run, `divide` gives each array that is no jax.Array to one process
    (a conversion divided among the processes)."""
    tensorstore_io(final)  # (which writes every array)
    leaves = plan(tree, chunk_bytes)
    multihost.agree(
        "the tree to save",
        description(leaves),
        "every process must pass the same tree: the same keys, shapes, dtypes and shardings",
    )
    # The bar counts bytes written, as the safetensors writer's does.
    total = sum(written(leaf) for leaf in leaves if leaf.stored)
    owners = _divided(leaves, divide)
    if owners is not None:
        me, by_name = multihost.index(), {leaf.name: leaf for leaf in leaves}
        mine = sum(
            part_bytes(by_name[name], rows)
            for name, parts in owners.items()
            for rows, owner in parts
            if owner == me
        )
        total, label = mine, multihost.job_label(label, mine, total)
    with shown(progress, total, label) as bar:
        scheduler = Scheduler(memory_budget, bar)
        if multihost.count() > 1:
            save_together(
                final, leaves, scheduler, overwrite, replaceable, extra_files or {}, owners
            )
        else:
            with publishing(final, overwrite=overwrite, replaceable=replaceable) as tmp:
                write_arrays(paths.kvstore_spec(tmp), leaves, scheduler, final)
                write_files(tmp, extra_files or {})  # (before the commit marker)
                write_metadata(tmp, final, leaves)


Owners = dict[str, list[tuple[tuple[int, int] | None, int]]]
"""{array name: [(rows, or None for all of them; the process that writes them)]}."""


def _divided(leaves: list[Planned], divide: multihost.Divide | None) -> Owners | None:
    """Who writes what of the stored leaves that are no jax.Array (each process
    writes its own shards of those), or None: not divided. An array larger than a
    share (the bytes of all over the processes) goes in parts of whole chunk rows."""
    if divide is None or multihost.count() == 1:
        return None
    stored = [leaf for leaf in leaves if leaf.stored and isinstance(leaf.value, LazyArray)]
    share = sum(written(leaf) for leaf in stored) / multihost.count()
    units = [(leaf, rows) for leaf in stored for rows in _row_parts(leaf, share)]
    owners = divide(
        [
            (
                [leaf.value if rows is None else leaf.value[rows[0] : rows[1]]],
                part_bytes(leaf, rows),
            )
            for leaf, rows in units
        ]
    )
    out: Owners = {}
    for (leaf, rows), owner in zip(units, owners, strict=True):
        out.setdefault(leaf.name, []).append((rows, owner))
    multihost.agree("the division of the work", repr(out), DIVISION_FIX)
    return out


DIVISION_FIX = (
    "every process must convert the same source with the same arguments and the same "
    "lazyckpt version (the division is computed from the source's metadata alone)"
)


def _row_parts(leaf: Planned, share: float) -> list[tuple[int, int] | None]:
    """`leaf` in parts of whole chunk rows of about a share each, if it is larger
    than a share and has rows of chunks to part; else [None], the whole of it."""
    if not leaf.shape or not leaf.chunks or written(leaf) <= share:
        return [None]
    rows = math.ceil(leaf.shape[0] / leaf.chunks[0])
    parts = min(rows, math.ceil(written(leaf) / share))
    if parts < 2:
        return [None]
    bounds = [
        min(leaf.shape[0], round(i * rows / parts) * leaf.chunks[0]) for i in range(parts + 1)
    ]
    return [(low, high) for low, high in itertools.pairwise(bounds)]


def part_bytes(leaf: Planned, rows: tuple[int, int] | None) -> int:
    """The bytes of values of `rows` of `leaf` (None: all)."""
    if rows is None:
        return written(leaf)
    return (rows[1] - rows[0]) * written(leaf) // max(1, leaf.shape[0])


def is_orbax_checkpoint(path: str) -> bool:
    """What `save(..., overwrite=True)` may replace with an Orbax checkpoint, proven by
    content, not names: a folder whose `_METADATA` parses as a tree, whose
    `_CHECKPOINT_METADATA` parses as a JSON object (a step of items), or whose legacy
    msgpack `checkpoint` decodes to a tree (a TensorFlow `checkpoint` text file does
    not)."""
    if not paths.isdir(path):
        return False
    try:
        text = paths.read_text(paths.join(path, "_METADATA"))
        if text is not None:
            return bool(parse_metadata(path, text))
        text = paths.read_text(paths.join(path, "_CHECKPOINT_METADATA"))
        if text is not None:
            return isinstance(json.loads(text), dict)
        return isinstance(read_msgpack(path), dict)
    except (LazyckptError, ValueError, RecursionError):
        return False
