"""`save`: write a tree as an Orbax PyTree checkpoint (OCDBT + zarr3), streaming.

What goes where follows Orbax 0.12 (spec §2-§9, `lazyckpt._orbax`): one OCDBT
database holding a zarr3 array per array leaf, `_METADATA` for the tree,
`_sharding` and `array_metadatas/process_0` for jax.Array leaves, `_strings.json`
for strings, `_CHECKPOINT_METADATA` and `commit_success.txt`. The leaves are planned
first (`lazyckpt._save_plan`), written within the budget (`lazyckpt._write`, or
`lazyckpt._save_together` in a multi-process run) into a temporary folder, and
published atomically (`lazyckpt._commit`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lazyckpt import _fs as fs
from lazyckpt import _multihost as multihost
from lazyckpt._commit import publishing
from lazyckpt._errors import CheckpointExistsError
from lazyckpt._lazy import LazyArray
from lazyckpt._progress import Progress
from lazyckpt._save_plan import DEFAULT_CHUNK_BYTES, Planned, cost, description, plan
from lazyckpt._save_together import save_together
from lazyckpt._scheduler import Scheduler
from lazyckpt._write import write_arrays, write_metadata

__all__ = ["DEFAULT_CHUNK_BYTES", "save"]


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
    leaves = plan(tree, chunk_bytes)
    if overwrite and not fs.atomic_rename(final):
        _refuse_reading_from(final, leaves)
    multihost.agree(
        "the tree to save",
        description(leaves),
        "every process must pass the same tree: the same keys, shapes, dtypes and shardings",
    )
    total = sum(cost(leaf) for leaf in leaves if leaf.stored)
    bar = Progress.maybe(progress, total, "lazyckpt save")
    scheduler = Scheduler(memory_budget, bar)
    with fs.session(storage_options):
        if multihost.count() > 1:
            save_together(final, leaves, scheduler, overwrite)
        else:
            with publishing(final, overwrite=overwrite) as tmp:
                write_arrays(fs.kvstore_spec(tmp), leaves, scheduler, final)
                write_metadata(tmp, final, leaves)
    if bar is not None:
        bar.close()
    return final


def _refuse_reading_from(final: str, leaves: Sequence[Planned]) -> None:
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
