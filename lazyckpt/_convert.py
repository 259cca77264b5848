"""`convert`: open a checkpoint, keep some of it, cast it, save it again, streaming."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import attrs
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._array.dtypes import parsed
from lazyckpt._array.tree import Select, leaves, map_leaves, selected
from lazyckpt._dequantize import dequantize as dequantized
from lazyckpt._display import as_given
from lazyckpt._errors import LazyTypeError
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
    check_shard_size,
    save_format,
    save_tree,
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
    carried: tuple[str, ...] = ()
    """The source's files that are not weights (config, tokenizer) it would carry."""
    exists: bool = False
    """Whether something is at `destination` already."""
    overwrite: bool = False

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
        if self.carried:
            lines.append(f"would carry {len(self.carried)} files: {', '.join(self.carried)}")
        if self.exists:
            lines.append(
                f"{as_given(self.destination)} exists: it would be replaced (overwrite)"
                if self.overwrite
                else f"{as_given(self.destination)} already exists: convert would refuse it; "
                "pass overwrite=True (--overwrite) to replace it, or choose a new path"
            )
        return "\n".join(lines)


class Converted(str):
    """What `convert` returns: the destination's path, and in `carried` the names of
    the files it carried from a Hugging Face folder (config, tokenizer, ...)."""

    carried: tuple[str, ...]

    def __new__(cls, path: str, carried: tuple[str, ...]) -> Converted:
        out = super().__new__(cls, path)
        out.carried = carried
        return out


CARRIED_FOLDER = "huggingface"
"""Where an Orbax checkpoint converted from a Hugging Face folder keeps the folder's
other files: a subfolder, which Orbax's restore never reads."""

_WEIGHTS = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".npz", ".npy",
    ".gguf", ".onnx", ".pkl", ".pickle", ".index.json",
)  # fmt: skip
_ORBAX_FILES = {"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "commit_success.txt"}


def _carriable(source: str | os.PathLike[str]) -> tuple[str, list[str]]:
    """The folder and names of the files to carry from `source`, a local folder: a
    Hugging Face model folder's files that are not weights (config.json,
    generation_config.json, tokenizer files, chat template, README), or those an Orbax
    checkpoint keeps in `CARRIED_FOLDER`. Top-level regular files only: no weights, no
    hidden files, and no link that leads out of the folder (a Hub cache's links to
    its blobs too)."""
    text = os.fspath(source)
    if paths.is_remote(text) or not os.path.isdir(text):
        return "", []
    folder = os.path.realpath(text)
    names = os.listdir(folder)
    if CARRIED_FOLDER in names and _ORBAX_FILES & set(names):
        folder = os.path.join(folder, CARRIED_FOLDER)
        names = os.listdir(folder)
    elif _ORBAX_FILES & set(names) or not any(name.endswith(_WEIGHTS) for name in names):
        return "", []  # (an Orbax checkpoint's own files, or no model folder)
    kept = []
    for name in sorted(names):
        if name.startswith(".") or name.endswith(_WEIGHTS):
            continue
        real = os.path.realpath(os.path.join(folder, name))
        if os.path.dirname(real) == folder and os.path.isfile(real):
            kept.append(name)
    return folder, kept


def _carry(folder: str, names: list[str], destination: str) -> None:
    """Copy the files `names` of the local `folder` into `destination`'s folder."""
    if paths.is_remote(destination):
        for name in names:  # (one small file in memory at a time, as uploads are)
            with open(os.path.join(folder, name), "rb") as file:
                paths.write_bytes(paths.join(destination, name), file.read())
        return
    os.makedirs(destination, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(folder, name), os.path.join(destination, name))


def _carried_to(final: str, kind: Format) -> str | None:
    """Where the carried files go: beside the weights of a safetensors model folder, in
    `CARRIED_FOLDER` of an Orbax checkpoint; nowhere for one `.safetensors` file."""
    if kind == "orbax":
        return paths.join(final, CARRIED_FOLDER)
    return None if final.endswith(".safetensors") else final


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
    metadata: Mapping[str, str] | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dry_run: Literal[False] = False,
) -> Converted: ...


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
    metadata: Mapping[str, str] | None = None,
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
    metadata: Mapping[str, str] | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dry_run: bool = False,
) -> Converted | ConversionPlan:
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
        max_shard_size: As for `save` (a model folder's shards; a destination that is
            one `.safetensors` file, or an Orbax checkpoint, refuses it).
        metadata: As for `save`: the safetensors files' `__metadata__`, text only
            (`{"format": "pt", "step": "1000"}`); where a train state's scalars go.
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
            Orbax chunk shapes, the files it would carry). Typed PRNG keys are
            planned as their key data. A destination that exists is reported
            (`exists`), not refused: the conversion itself refuses it without
            `overwrite`; whether an overwrite may replace it is checked by `save`.

    A local Hugging Face model folder's files that are not weights (`config.json`,
    `generation_config.json`, the tokenizer's files and chat template, ...) go with
    it, so that `from_pretrained` loads the result: beside the weights of a
    safetensors model folder, in the subfolder `huggingface/` of an Orbax checkpoint
    (which Orbax's restore never reads), and back out of there when that checkpoint
    is converted to a folder again. Only the folder's own top-level files go: not
    other weight files, hidden files, or links that lead out of the folder.

    Returns:
        The destination's absolute path (or URL), a `str` whose `carried` lists the
        files carried; with `dry_run`, the plan.

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
    check_shard_size(final, kind, max_shard_size)
    target = None if dtype is None else _cast_dtype(dtype)
    tree = open_checkpoint(source, step=step, item=item, storage_options=storage_options)
    carried_from, carried = _carriable(source)
    carried_to = _carried_to(final, kind)
    if carried_to is None:
        carried = []
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
        planned = (
            _plan_safetensors(final, tree, max_shard_size, metadata)
            if kind == "safetensors"
            else _plan_orbax(final, tree, chunk_bytes)
        )
        return attrs.evolve(planned, carried=tuple(carried), exists=taken, overwrite=overwrite)
    out = save_tree(
        destination,
        tree,
        format=to,
        chunk_bytes=chunk_bytes,
        max_shard_size=max_shard_size,
        metadata=metadata,
        memory_budget=memory_budget,
        overwrite=overwrite,
        allow_expand=allow_expand,
        progress=progress,
        storage_options=storage_options,
        label="lazyckpt convert",
    )
    if carried and carried_to is not None:
        with paths.session(storage_options):
            _carry(carried_from, carried, carried_to)
    return Converted(out, tuple(carried))


def _cast_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    """`dtype=` as the floating-point dtype `convert` casts to."""
    target = parsed(dtype)
    if target is None or not _floating(target):
        raise LazyTypeError(
            f"dtype={dtype!r} is not a floating-point dtype; convert casts "
            "floating-point arrays only, to one such as bfloat16, float16 or float32"
        )
    return target


def _plan_safetensors(
    final: str, tree: object, max_shard_size: int | None, metadata: Mapping[str, str] | None
) -> ConversionPlan:
    files, _ = plan_files(final, tree, max_shard_size=max_shard_size, metadata=metadata)
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
