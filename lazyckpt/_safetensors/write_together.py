"""A safetensors model folder written by every process of a `jax.distributed` job
together (a conversion divided among them, `lazyckpt._convert.fleet`).

Every process plans the same files as one process would cut them (`plan_files`: the
same names, headers and index) and checks that all planned the same. Process 0 opens
the destination (the overwrite rules, a temporary folder beside it) and tells the
others where; each process writes the files it was given there; once all have
written, process 0 writes the carried files and the index and publishes the folder.
A failure anywhere fails the save on every process, naming the failing process(es)
and their errors, and nothing is published. A destination that is one `.safetensors`
file is written by process 0 alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Mapping

from lazyckpt._engine.progress import shown
from lazyckpt._errors import LazyckptError
from lazyckpt._safetensors.format import INDEX, SUFFIX
from lazyckpt._safetensors.write import File, file_writer, plan_files, publishing_model, write_file
from lazyckpt._storage import multihost, paths


def save_safetensors_together(
    path: str,
    tree: object,
    *,
    max_shard_size: int | None,
    metadata: Mapping[str, str] | None,
    memory_budget: int | None,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    progress: bool | None,
    label: str,
    extra_files: Mapping[str, bytes] | None,
    divide: multihost.Divide,
) -> str:
    """`save_safetensors` by every process together (see the module docstring);
    `divide` gives each file to a process."""
    files, index = plan_files(path, tree, max_shard_size=max_shard_size, metadata=metadata)
    multihost.agree(
        "the safetensors files to write",
        _description(files, index),
        "every process must convert with the same arguments (the same source, select, "
        "rename, dtype and max_shard_size)",
    )
    single = path.endswith(SUFFIX)
    owners = [0] * len(files) if single else divide([_unit(file) for file in files])
    multihost.agree(
        "the division of the work",
        repr(owners),
        "every process must convert the same source with the same arguments and the same "
        "lazyckpt version (the division is computed from the source's metadata alone)",
    )
    me = multihost.index()
    mine = [file for file, owner in zip(files, owners, strict=True) if owner == me]
    job = sum(entry.nbytes for file in files for entry in file.entries)
    my_bytes = sum(entry.nbytes for file in mine for entry in file.entries)
    stack = contextlib.ExitStack()
    tmp, failed = "", None
    failed_here: BaseException | None = None
    if me == 0:
        try:
            tmp = stack.enter_context(publishing_model(path, single, overwrite, replaceable))
        except Exception as error:  # noqa: BLE001 - reported to every process below
            failed = error
    multihost.agree_on_failure(
        f"{path}: opening the destination failed, nothing was written", failed
    )
    tmp = multihost.broadcast_text(tmp)
    write = file_writer(tmp, single, paths.is_remote(path))
    with stack:
        failed = None
        try:
            with shown(progress, my_bytes, multihost.job_label(label, my_bytes, job)) as bar:
                for file in mine:
                    write(
                        file.name, lambda out, file=file: write_file(out, file, memory_budget, bar)
                    )
        except Exception as error:  # noqa: BLE001 - reported to every process below
            failed = error
        # (every process reaches each collective, failed or not: none waits alone)
        multihost.agree_on_failure(
            f"{path}: writing the files failed, nothing was published", failed
        )
        published = False
        if me == 0:
            try:
                if not single:
                    _check_written(path, tmp, files)
                for name, data in {} if single else (extra_files or {}).items():
                    write(name, lambda out, data=data: out.write(data))
                if index is not None:
                    write(INDEX, lambda out: out.write(index.encode()))
                stack.close()  # publish: the rename, or the bucket's index last
                published = True
            except BaseException as error:  # noqa: BLE001 - reported to every process below
                # (KeyboardInterrupt and SystemExit too: the others wait on this agreement)
                failed_here = error
        multihost.agree_on_publishing(
            f"{path}: publishing the files failed", failed_here, published
        )
    return path


def _check_written(path: str, tmp: str, files: list[File]) -> None:
    """Every planned file is in `tmp` (with its planned size, where local): else the
    processes did not write to the same place."""
    remote = paths.is_remote(path)
    missing = []
    for file in files:
        target = paths.join(tmp, file.name)
        if remote:
            there = paths.isfile(target)
        else:
            there = os.path.isfile(target) and os.path.getsize(target) == file.size
        if not there:
            missing.append(file.name)
    if missing:
        raise LazyckptError(
            f"{path}: process 0 cannot see (whole) what the other processes wrote under "
            f"{tmp}: {', '.join(missing)}; every process must write to the same shared "
            "file system or bucket"
        )


def _unit(file: File) -> tuple[list[object], int]:
    return [entry.value for entry in file.entries], file.size


def _description(files: list[File], index: str | None) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.header)
    digest.update((index or "").encode())
    return digest.hexdigest()
