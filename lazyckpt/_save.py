"""`save`: a tree written as a checkpoint of either format (`lazyckpt._orbax.save`,
`lazyckpt._safetensors.write`), streamed, and published only once complete."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from lazyckpt._array import repeats
from lazyckpt._array.tree import leaves
from lazyckpt._engine import workload
from lazyckpt._errors import ArgumentError, LazyTypeError
from lazyckpt._lazy import LazyArray
from lazyckpt._orbax.plan import DEFAULT_CHUNK_BYTES
from lazyckpt._orbax.save import is_orbax_checkpoint, save_orbax
from lazyckpt._safetensors.read import is_safetensors_model
from lazyckpt._safetensors.write import save_safetensors
from lazyckpt._safetensors.write_together import save_safetensors_together
from lazyckpt._sizes import optional_size, size_argument
from lazyckpt._storage import multihost, paths
from lazyckpt._text import human_bytes

__all__ = ["DEFAULT_CHUNK_BYTES", "save", "save_format", "save_tree"]

Format = Literal["orbax", "safetensors"]


def save(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    format: Format | None = None,  # noqa: A002 - the name the API uses for it
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write `tree` as an Orbax PyTree checkpoint (OCDBT, zarr3, zstd chunks with their
    checksums) that Orbax restores and `lazyckpt.open` reads back as saved; or as
    safetensors, one file or Hugging Face's sharded layout.

    LazyArrays are streamed, read and written block by block, never loaded whole;
    `jax.Array`s are written from their shards (each distinct shard once; typed PRNG
    keys as their key data). The checkpoint appears at `path` only once complete: on
    a local disk by a rename; in a bucket, with no rename to commit with,
    `commit_success.txt` is written last and marks it complete, and an overwrite
    is written whole beside the old checkpoint before it replaces it. In a
    `jax.distributed` run every process calls `save` with the same tree, and each
    writes the shards it holds.

    Args:
        path: The folder to create, local or `s3://` / `gs://`.
        tree: Any pytree of LazyArrays (sliced and cast views too), `jax.Array`s,
            NumPy arrays, Python and NumPy scalars, strings and None.
        format: "orbax" or "safetensors"; by default safetensors for a path ending
            in `.safetensors`, else orbax. As safetensors, key paths are joined with
            `.` (`model/layers/0/q` becomes `model.layers.0.q`); a path ending in
            `.safetensors` is one file, any other a model folder: `model.safetensors`,
            or shards `model-00001-of-0000N.safetensors` with
            `model.safetensors.index.json` when the tensors pass `max_shard_size`.
            In a bucket each file is uploaded in one request from memory.
        chunk_bytes: Orbax: about how many bytes each stored chunk holds (default
            4 MiB); chunks tile each device's shard. Sizes are ints or text, as
            `memory_budget` for `load` takes them: `"4MiB"`, `"1MB"`.
        max_shard_size: Safetensors: the most bytes of tensors per file of a model
            folder (default `"5GB"`, 5 x 10^9 bytes, as `transformers`; `"1GB"` is
            10^9 bytes here as there, `"1GiB"` 2^30). A path ending in
            `.safetensors` is one file, which it cannot split: an `ArgumentError`.
        metadata: Safetensors: text for the files' `__metadata__`, always with
            `"format": "pt"` (what `transformers` loads) unless it sets `format`.
        memory_budget: As for `load`.
        progress: As for `load`.
        overwrite: Replace an existing checkpoint of the same format at `path`,
            proven by content (anything else is never replaced); a safetensors model
            folder keeps its other files (`config.json`, the tokenizer). Otherwise
            `CheckpointExistsError`.
        allow_expand: Write a broadcast view (a tensor saved `expand`ed, its strides
            0) whole, however far its values repeat. Without it, one that would write
            more than 1 GiB and more than 1024 times the bytes it stores is an
            `ArgumentError` naming it, before anything is written; so are arrays
            that would together, against the bytes they store, each counted once
            (10,000 views of a gigabyte over one storage of 16 bytes).
        storage_options: As for `open`.

    Returns:
        The checkpoint's absolute path (or URL).

    >>> tree = lazyckpt.open(path)
    >>> small = {"w": tree["params"]["w"][:2].astype("float16"), "note": "first rows"}
    >>> out = lazyckpt.save(tmp / "small", small)
    >>> lazyckpt.open(out)
    {'note': 'first rows', 'w': LazyArray('w', shape=(2, 8), dtype=float16, chunks=(2, 8))}
    """
    return save_tree(
        path,
        tree,
        format=format,
        chunk_bytes=chunk_bytes,
        max_shard_size=max_shard_size,
        metadata=metadata,
        memory_budget=memory_budget,
        overwrite=overwrite,
        allow_expand=allow_expand,
        progress=progress,
        storage_options=storage_options,
        label="lazyckpt save",
    )


def save_tree(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    format: Format | None,  # noqa: A002 - as save's
    chunk_bytes: int | str,
    max_shard_size: int | str | None,
    metadata: Mapping[str, str] | None,
    memory_budget: int | str | None,
    overwrite: bool,
    allow_expand: bool,
    progress: bool | None,
    storage_options: dict[str, Any] | None,
    label: str,
    extra_files: Mapping[str, bytes] | None = None,
    divide: multihost.Divide | None = None,
) -> str:
    """`save`, its progress bar labelled `label` (`convert` saves through this too);
    `extra_files` ({path relative to the checkpoint: contents}) are published with it,
    or not at all (the files `convert` carries). In a multi-process run, `divide`
    shares the writing out among the processes, each of which calls this with the
    same tree (`lazyckpt._convert.fleet`); without it, safetensors are refused there."""
    chunk_bytes = size_argument("chunk_bytes", chunk_bytes)
    max_shard_size = optional_size("max_shard_size", max_shard_size)
    memory_budget = optional_size("memory_budget", memory_budget)
    check_overwrite(overwrite)
    check_allow_expand(allow_expand)
    if not allow_expand:
        check_expansion(tree)
    final = paths.normalize(path)
    kind = save_format(final, format=format)
    check_shard_size(final, kind, max_shard_size)
    if kind == "safetensors":
        # (in a job of several processes, `convert`'s: each writes its share of the files)
        write: Callable[..., str] = save_safetensors
        if divide is not None and multihost.count() > 1:
            write = functools.partial(save_safetensors_together, divide=divide)
        with paths.session(storage_options):
            return write(
                final,
                tree,
                max_shard_size=max_shard_size,
                metadata=metadata,
                memory_budget=memory_budget,
                overwrite=overwrite,
                replaceable=is_safetensors_model,
                progress=progress,
                label=label,
                extra_files=extra_files,
            )
    if metadata is not None:
        raise ArgumentError(
            f"save: metadata= applies to safetensors files, and {final} is saved as an Orbax "
            "checkpoint; pass format='safetensors' (or a path ending in .safetensors), or "
            "leave out metadata="
        )
    with paths.session(storage_options):
        save_orbax(
            final,
            tree,
            chunk_bytes=chunk_bytes,
            memory_budget=memory_budget,
            overwrite=overwrite,
            replaceable=is_orbax_checkpoint,
            progress=progress,
            label=label,
            extra_files=extra_files,
            divide=divide,
        )
    return final


def check_shard_size(final: str, kind: Format, max_shard_size: int | None) -> None:
    """Refuse a `max_shard_size=` the destination cannot honour, rather than ignore it:
    an Orbax checkpoint has no shards of that kind, and one `.safetensors` file is one
    file however large."""
    if max_shard_size is None:
        return
    if kind == "orbax":
        raise ArgumentError(
            f"save: max_shard_size= applies to safetensors files, and {final} is saved as an "
            "Orbax checkpoint; pass format='safetensors' (or a path ending in .safetensors), "
            "or leave out max_shard_size="
        )
    if final.endswith(".safetensors"):
        raise ArgumentError(
            f"max_shard_size= (--max-shard-size) splits a safetensors model folder into "
            f"shards, but {final} is one .safetensors file, which it cannot split; name a "
            "folder instead (a path not ending in .safetensors, with format='safetensors' "
            "or --to safetensors), or leave out max_shard_size"
        )


def save_format(
    final: str,
    *,
    format: Format | None,  # noqa: A002 - as save's
    argument: str = "format",
) -> Format:
    """The format `save` writes at `final`: `format` (given as `argument=`), or
    safetensors for a path ending in `.safetensors`, else orbax."""
    kind = format or ("safetensors" if final.endswith(".safetensors") else "orbax")
    if kind not in ("orbax", "safetensors"):
        raise ArgumentError(
            f"{argument}={format!r} is not a format lazyckpt writes; pass 'orbax' (an "
            "Orbax PyTree checkpoint) or 'safetensors'"
        )
    return kind


def check_overwrite(overwrite: object) -> None:
    """Refuse an `overwrite=` that is not a bool: any true value would replace what is
    there (`overwrite="no"` too)."""
    if not isinstance(overwrite, bool):
        raise LazyTypeError(
            f"overwrite={overwrite!r} is not a bool; pass overwrite=True to replace an "
            "existing checkpoint, or leave it out"
        )


def check_allow_expand(allow_expand: object) -> None:
    """Refuse an `allow_expand=` that is not a bool, as `check_overwrite` does."""
    if not isinstance(allow_expand, bool):
        raise LazyTypeError(
            f"allow_expand={allow_expand!r} is not a bool; pass allow_expand=True to write "
            "broadcast views whole, or leave it out"
        )


def check_expansion(tree: object) -> None:
    """Refuse, by name, a broadcast view in `tree` that would write far more than it
    stores (`repeats.excessive`), and arrays that would together (`workload.check`):
    a tiny file can declare exabytes, or 10,000 views of a gigabyte over 16 bytes."""
    try:
        found = [(path, leaf) for path, leaf in leaves(tree) if isinstance(leaf, LazyArray)]
    except (TypeError, ValueError):  # (a tree jax cannot walk: the writer names why)
        return
    for path, leaf in found:
        if leaf.key_impl or not repeats.repeats(leaf):
            continue
        stored = workload.distinct_nbytes([repeats.core(leaf)])
        if repeats.excessive(leaf.nbytes, stored):
            index = repeats.unrepeated_index(leaf)
            once = (
                f", or save its stored values, the view {index} of it, and broadcast them when loading"
                if index
                else ""
            )
            raise ArgumentError(
                f"{repeats.described(path or leaf.key, leaf, stored)}: saving it would write "
                f"all {human_bytes(leaf.nbytes)}. Pass allow_expand=True (lazyckpt convert "
                f"--allow-expand) to write every repeat{once}"
            )
    workload.check(
        "saving them would write",
        [(path or leaf.key, leaf.nbytes) for path, leaf in found],
        lambda: workload.distinct_nbytes(leaf for _, leaf in found),
        "Pass allow_expand=True (lazyckpt convert --allow-expand) to write every repeat, "
        "or save fewer of them (a subtree; convert's select=, --select)",
    )
