"""A save by every process of a `jax.distributed` run, as Orbax does one (format notes, Multi-process saves).

Process 0 checks the destination and makes the temporary folder; each process
writes the shards it holds (replica 0 of each, so replicated data is written once in
total) into its own OCDBT database, and process 0 also every non-jax.Array leaf; in a
conversion divided among the processes (`lazyckpt._convert.fleet`), each process
writes the arrays it was given.
Once all have written, process 0 checks that every writer's database is there (the
processes must share the destination's file system), merges them into the root one,
writes the metadata and publishes the checkpoint. A failure anywhere fails the save
on every process, naming the failing process(es) and their errors, and nothing is
published.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

import attrs
import jax
import tensorstore as ts

from lazyckpt._engine.scheduler import Scheduler
from lazyckpt._errors import LazyckptError, error_class
from lazyckpt._orbax.metadata import process_folder
from lazyckpt._orbax.plan import Planned
from lazyckpt._orbax.write import OCDBT_CONFIG, write_arrays, write_context, write_metadata
from lazyckpt._storage import multihost, paths
from lazyckpt._storage.extra_files import write_files
from lazyckpt._storage.publish import publishing


def save_together(
    final: str,
    leaves: Sequence[Planned],
    scheduler: Scheduler,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    extra_files: Mapping[str, bytes],
    owners: Mapping[str, list[tuple[tuple[int, int] | None, int]]] | None = None,
) -> None:
    """Save `leaves` together with the other processes (see the module docstring);
    process 0 writes `extra_files` (see `save_orbax`). `owners` ({array name: [(its
    rows, or None for all; the process that writes them)]}) says which process
    writes what of each array it names (a conversion divided among the processes);
    the others go as the module docstring says."""
    me = multihost.index()
    stack = contextlib.ExitStack()
    tmp = ""
    if me == 0:
        try:
            tmp = stack.enter_context(
                publishing(final, overwrite=overwrite, replaceable=replaceable)
            )
        except Exception as error:
            multihost.broadcast_text(f"error:{type(error).__name__}:{error}")
            raise
    told = multihost.broadcast_text(f"ok:{tmp}")
    if told.startswith("error:"):
        kind, _, message = told[6:].partition(":")
        raise error_class(kind)(f"process 0 could not start the save: {message}")
    tmp = told[3:]
    with stack:
        mine = _mine(leaves, me, owners)
        failed: BaseException | None = None
        try:
            base = paths.kvstore_spec(paths.join(tmp, process_folder(me)))
            write_arrays(base, mine, scheduler, final)
        except Exception as error:  # noqa: BLE001 - reported to every process below
            failed = error
        wrote = any(leaf.stored for leaf in mine)
        flags = multihost.gather([int(wrote)])
        # (every process reaches both collectives, failed or not: none waits alone)
        multihost.agree_on_failure(
            f"{final}: writing the arrays failed, nothing was published", failed
        )
        failed, published = None, False
        if me == 0:
            try:
                writers = [i for i, (did,) in enumerate(flags) if did]
                _merge(tmp, writers, final)
                write_files(tmp, extra_files)
                write_metadata(tmp, final, leaves)
                stack.close()  # publish: fsync and rename, or the bucket's commit marker
                published = True
            except BaseException as error:  # noqa: BLE001 - reported to every process below
                # (KeyboardInterrupt and SystemExit too: the others wait on this agreement)
                failed = error
        multihost.agree_on_publishing(
            f"{final}: merging and publishing the save failed", failed, published
        )


def _mine(
    leaves: Sequence[Planned],
    me: int,
    owners: Mapping[str, list[tuple[tuple[int, int] | None, int]]] | None,
) -> list[Planned]:
    """The leaves process `me` writes, each with the rows it writes of it."""
    out = []
    for leaf in leaves:
        if owners is None or leaf.name not in owners:
            if me == 0 or _holds_shards(leaf):
                out.append(leaf)
            continue
        parts = [rows for rows, owner in owners[leaf.name] if owner == me]
        if None in parts:
            out.append(leaf)
        elif parts:
            out.append(attrs.evolve(leaf, rows=tuple(r for r in parts if r is not None)))
    return out


def _holds_shards(leaf: Planned) -> bool:
    value = leaf.value
    return isinstance(value, jax.Array) and any(
        shard.replica_id == 0 for shard in value.addressable_shards
    )


def _merge(tmp: str, writers: list[int], final: str) -> None:
    """Copy every writer's database into the root one (format notes, Multi-process saves); large chunks stay
    in the files where they were written."""
    missing = [
        i
        for i in writers
        if not paths.isfile(paths.join(paths.join(tmp, process_folder(i)), "manifest.ocdbt"))
    ]
    if missing:
        raise LazyckptError(
            f"{final}: process 0 cannot see what process(es) {missing} wrote under {tmp}; "
            "every process must save to the same shared file system or bucket"
        )
    context = write_context()
    root_spec = {"driver": "ocdbt", "base": paths.kvstore_spec(tmp)}
    root = ts.KvStore.open({**root_spec, "config": OCDBT_CONFIG}, context=context).result()
    for process in writers:
        spec = {
            "driver": "ocdbt",
            "base": paths.kvstore_spec(paths.join(tmp, process_folder(process))),
        }
        source = ts.KvStore.open(spec, context=context).result()
        source.experimental_copy_range_to(root).result()
