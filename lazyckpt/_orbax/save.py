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

import json
from collections.abc import Callable, Mapping

from lazyckpt._engine.progress import shown
from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._errors import LazyckptError
from lazyckpt._orbax.legacy import read_msgpack
from lazyckpt._orbax.metadata import parse_metadata
from lazyckpt._orbax.plan import description, plan, written
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
) -> None:
    """Write `tree` at `final` (see `lazyckpt.save`); `replaceable` says what an
    overwrite may replace; `extra_files` ({relative path: contents}) are written into
    the checkpoint before it is committed (the files `convert` carries)."""
    tensorstore_io(final)  # (which writes every array)
    leaves = plan(tree, chunk_bytes)
    multihost.agree(
        "the tree to save",
        description(leaves),
        "every process must pass the same tree: the same keys, shapes, dtypes and shardings",
    )
    # The bar counts bytes written, as the safetensors writer's does.
    total = sum(written(leaf) for leaf in leaves if leaf.stored)
    with shown(progress, total, label) as bar:
        scheduler = Scheduler(memory_budget, bar)
        if multihost.count() > 1:
            save_together(final, leaves, scheduler, overwrite, replaceable, extra_files or {})
        else:
            with publishing(final, overwrite=overwrite, replaceable=replaceable) as tmp:
                write_arrays(paths.kvstore_spec(tmp), leaves, scheduler, final)
                write_files(tmp, extra_files or {})  # (before the commit marker)
                write_metadata(tmp, final, leaves)


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
