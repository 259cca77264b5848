"""`convert`: open a checkpoint, keep some of it, cast it, save it again, streaming."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import attrs
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._array.dtypes import parsed
from lazyckpt._array.tree import Select, leaves, map_leaves, selected
from lazyckpt._dequantize import dequantize as dequantized
from lazyckpt._display import as_given
from lazyckpt._errors import CheckpointExistsError, LazyTypeError
from lazyckpt._lazy import LazyArray
from lazyckpt._open import open as open_checkpoint
from lazyckpt._orbax.plan import plan
from lazyckpt._rename import rename as rename_keys
from lazyckpt._safetensors.write import plan_files
from lazyckpt._save import (
    DEFAULT_CHUNK_BYTES,
    Format,
    check_allow_expand,
    check_expansion,
    check_overwrite,
    save,
    save_format,
)
from lazyckpt._sizes import optional_size, size_argument
from lazyckpt._storage import paths
from lazyckpt._text import human_bytes


@attrs.frozen
class PlannedArray:
    """One array as `convert` would write it."""

    path: str
    """Its key path in the converted tree."""
    name: str
    """Its name in the files: the safetensors name, or the Orbax parameter name."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    """Bytes of values (before the Orbax checkpoint's compression)."""
    file: str | None = None
    """Safetensors: the file it goes to."""
    chunks: tuple[int, ...] | None = None
    """Orbax: the shape of each stored chunk."""


@attrs.frozen
class ConversionPlan:
    """What `convert(..., dry_run=True)` found it would write; nothing was read or
    written. `str()` is a table; `arrays` lists each array, `files` each safetensors
    file with its size in bytes (none for Orbax, whose files hold chunks)."""

    destination: str
    format: Format
    arrays: tuple[PlannedArray, ...]
    files: tuple[tuple[str, int], ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of values in every array."""
        return sum(array.nbytes for array in self.arrays)

    def __str__(self) -> str:
        where = "file" if self.format == "safetensors" else "chunks"
        rows = [("name", "dtype", "shape", "size", where)]
        for a in self.arrays:
            shape = f"[{','.join(map(str, a.shape))}]"
            place = a.file if a.file is not None else "x".join(map(str, a.chunks or ()))
            rows.append((a.name, a.dtype, shape, human_bytes(a.nbytes), place or "scalar"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            f"would write {as_given(self.destination)} ({self.format}): {len(self.arrays)} "
            f"array{'' if len(self.arrays) == 1 else 's'}, "
            f"{human_bytes(self.nbytes)}"
        ]
        lines += [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
        lines += [f"file {name}: {human_bytes(size)}" for name, size in self.files]
        return "\n".join(lines)


@overload
def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: Format | None = None,
    select: Select | None = None,
    dequantize: bool = False,
    transform: Callable[[Any], object] | None = None,
    dtype: DTypeLike | None = None,
    rename: Sequence[tuple[str, str]] = (),
    step: int | None = None,
    item: str | None = None,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    max_shard_size: int | str | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dry_run: Literal[False] = False,
) -> str: ...


@overload
def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: Format | None = None,
    select: Select | None = None,
    dequantize: bool = False,
    transform: Callable[[Any], object] | None = None,
    dtype: DTypeLike | None = None,
    rename: Sequence[tuple[str, str]] = (),
    step: int | None = None,
    item: str | None = None,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    max_shard_size: int | str | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dry_run: Literal[True],
) -> ConversionPlan: ...


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: Format | None = None,
    select: Select | None = None,
    dequantize: bool = False,
    transform: Callable[[Any], object] | None = None,
    dtype: DTypeLike | None = None,
    rename: Sequence[tuple[str, str]] = (),
    step: int | None = None,
    item: str | None = None,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    max_shard_size: int | str | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dry_run: bool = False,
) -> str | ConversionPlan:
    """Rewrite the checkpoint at `source` at `destination`, as Orbax or safetensors.

    Arrays stream from `source` to `destination` block by block within the budget,
    each stored chunk read once, never loaded whole; `save` writes the result.

    Args:
        source: What `open` takes: an Orbax checkpoint, step folder or root, a
            `.safetensors` file or a Hugging Face model folder.
        destination: The folder (or `.safetensors` file) to create.
        to: "orbax" or "safetensors"; by default as `save` decides from
            `destination`.
        select: Only the leaves matching a path pattern (`params/**/kernel`), any of
            a list of patterns, or a predicate `(path, leaf) -> bool`; see `select`.
        dequantize: Replace FP8 block-scaled and MXFP4 weights by their dense values
            in `dtype` (bfloat16 by default), before `select`: see
            `lazyckpt.dequantize`.
        transform: A function from the lazy tree (after `select`) to the tree to
            save, reading nothing: re-arranging with `stack`, `unstack`,
            `transpose`, `reshape`, `unstack_layers` or plain dict surgery.
        dtype: Cast floating-point arrays to this dtype (integers, booleans and PRNG
            keys keep theirs).
        rename: `(pattern, replacement)` rules for the key paths, applied after
            `select` (see `lazyckpt.rename`): `[(r"^params/", "model/")]`.
        step: As for `open`.
        item: As for `open`.
        chunk_bytes: As for `save`.
        max_shard_size: As for `save`.
        memory_budget: As for `load`.
        progress: As for `load`.
        overwrite: As for `save`.
        allow_expand: As for `save`: write broadcast views (tensors saved `expand`ed)
            whole, however far their values repeat; without it, `dry_run` too refuses
            one (or all of them together) that would write more than 1 GiB and 1024
            times what it stores.
        storage_options: As for `open`, for both sides.
        dry_run: Write nothing and read no array data: return the `ConversionPlan`,
            what would be written after every `select`, `transform`, `rename` and
            `dtype` (names, shapes, dtypes, bytes, and the safetensors files or
            Orbax chunk shapes). Typed PRNG keys are planned as their key data. A
            destination that exists without `overwrite` is a `CheckpointExistsError`
            here too; whether an overwrite may replace it is checked by `save` alone.

    Returns:
        The destination's absolute path (or URL); with `dry_run`, the plan.

    >>> out = lazyckpt.convert(path, tmp / "params16", select="params",
    ...                        dtype="float16")
    >>> lazyckpt.open(out)["params"]["b"]
    LazyArray('params/b', shape=(8,), dtype=float16, chunks=(8,), sharding=NamedSharding(mesh={'x': 4, 'y': 2}, spec=P()))
    >>> plan = lazyckpt.convert(path, tmp / "hf", to="safetensors", select="params/b",
    ...                         dry_run=True)
    >>> print(plan)  # doctest: +ELLIPSIS
    would write .../hf (safetensors): 1 array, 32 B
    name      dtype    shape  size  file
    params.b  float32  [8]    32 B  model.safetensors
    file model.safetensors: 136 B
    """
    # Bad arguments fail before the source is opened.
    chunk_bytes = size_argument("chunk_bytes", chunk_bytes)
    max_shard_size = optional_size("max_shard_size", max_shard_size)
    memory_budget = optional_size("memory_budget", memory_budget)
    check_overwrite(overwrite)
    check_allow_expand(allow_expand)
    final = paths.normalize(destination)
    kind = save_format(final, format=to, argument="to")
    target = None if dtype is None else _cast_dtype(dtype)
    tree = open_checkpoint(source, step=step, item=item, storage_options=storage_options)
    if dequantize:
        tree = dequantized(tree, dtype=jnp.bfloat16 if dtype is None else dtype)
    tree = selected(tree, select)
    if transform is not None:
        tree = transform(tree)
    if rename:
        tree = rename_keys(tree, rename)
    if target is not None:
        cast_to = target
        tree = map_leaves(lambda leaf: _cast(leaf, cast_to), tree)
    if dry_run:
        if not allow_expand:  # (as save would refuse, before it writes anything)
            check_expansion(tree)
        with paths.session(storage_options):
            taken = paths.isfile(final) or (paths.isdir(final) and bool(paths.listdir(final)))
        if taken and not overwrite:  # as save would refuse, before it writes anything
            raise CheckpointExistsError(
                f"{final} already exists; pass overwrite=True (--overwrite) to replace it, "
                "or choose a new path"
            )
        if kind == "safetensors":
            return _plan_safetensors(final, tree, max_shard_size)
        return _plan_orbax(final, tree, chunk_bytes)
    return save(
        destination,
        tree,
        format=to,
        chunk_bytes=chunk_bytes,
        max_shard_size=max_shard_size,
        memory_budget=memory_budget,
        overwrite=overwrite,
        allow_expand=allow_expand,
        progress=progress,
        storage_options=storage_options,
    )


def _cast_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    """`dtype=` as the floating-point dtype `convert` casts to."""
    target = parsed(dtype)
    if target is None or not _floating(target):
        raise LazyTypeError(
            f"dtype={dtype!r} is not a floating-point dtype; convert casts "
            "floating-point arrays only, to one such as bfloat16, float16 or float32"
        )
    return target


def _plan_safetensors(final: str, tree: object, max_shard_size: int | None) -> ConversionPlan:
    files, _ = plan_files(final, tree, max_shard_size=max_shard_size, metadata=None)
    by_path = {
        entry.path: PlannedArray(
            entry.path, entry.name, entry.shape, str(entry.dtype), entry.nbytes, file=file.name
        )
        for file in files
        for entry in file.entries
    }
    in_order = [by_path[e.path] for e in sorted(by_path.values(), key=_tree_order(tree))]
    return ConversionPlan(
        final, "safetensors", tuple(in_order), tuple((f.name, f.size) for f in files)
    )


def _tree_order(tree: object) -> Callable[[PlannedArray], int]:
    order = {path: i for i, (path, _) in enumerate(leaves(tree))}
    return lambda array: order[array.path]


def _plan_orbax(final: str, tree: object, chunk_bytes: int) -> ConversionPlan:
    # Typed PRNG keys are read when saved (they are small); planned as their key data.
    def key_data(leaf: object) -> object:
        return leaf._key_data() if isinstance(leaf, LazyArray) and leaf.key_impl else leaf

    arrays = tuple(
        PlannedArray(
            leaf.path,
            leaf.name,
            leaf.shape,
            str(leaf.dtype),
            math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize,
            chunks=leaf.chunks or None,
        )
        for leaf in plan(map_leaves(key_data, tree), chunk_bytes)
        if leaf.stored
    )
    return ConversionPlan(final, "orbax", arrays)


def _cast(leaf: object, dtype: np.dtype[Any]) -> object:
    if isinstance(leaf, LazyArray) and not leaf.key_impl and _floating(leaf.dtype):
        return leaf.astype(dtype)
    return leaf


def _floating(dtype: np.dtype[Any]) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))
