"""`convert`: open a checkpoint, keep some of it, cast it, save it again, streaming."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._array.tree import Select, map_leaves, selected
from lazyckpt._errors import LazyTypeError
from lazyckpt._lazy import LazyArray
from lazyckpt._open import open as open_checkpoint
from lazyckpt._rename import rename as rename_keys
from lazyckpt._save import DEFAULT_CHUNK_BYTES, Format, save
from lazyckpt._sizes import optional_size, size_argument


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: Format | None = None,
    select: Select | None = None,
    transform: Callable[[Any], object] | None = None,
    dtype: DTypeLike | None = None,
    rename: Sequence[tuple[str, str]] = (),
    step: int | None = None,
    item: str | None = None,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    max_shard_size: int | str | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
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
        storage_options: As for `open`, for both sides.

    Returns:
        The destination's absolute path (or URL).

    >>> out = lazyckpt.convert(path, tmp / "params16", select="params",
    ...                        dtype="float16")
    >>> lazyckpt.open(out)["params"]["b"]
    LazyArray('params/b', shape=(8,), dtype=float16, chunks=(8,), sharding=NamedSharding(mesh={'x': 4, 'y': 2}, spec=P()))
    """
    # Bad sizes fail before the source is opened.
    chunk_bytes = size_argument("chunk_bytes", chunk_bytes)
    max_shard_size = optional_size("max_shard_size", max_shard_size)
    memory_budget = optional_size("memory_budget", memory_budget)
    tree = open_checkpoint(source, step=step, item=item, storage_options=storage_options)
    tree = selected(tree, select)
    if transform is not None:
        tree = transform(tree)
    if rename:
        tree = rename_keys(tree, rename)
    if dtype is not None:
        target = np.dtype(dtype)
        if not _floating(target):
            raise LazyTypeError(
                f"dtype={target} is not a floating-point dtype; convert casts floating-point "
                "arrays only (to bfloat16, float16, float32...)"
            )
        tree = map_leaves(lambda leaf: _cast(leaf, target), tree)
    return save(
        destination,
        tree,
        format=to,
        chunk_bytes=chunk_bytes,
        max_shard_size=max_shard_size,
        memory_budget=memory_budget,
        overwrite=overwrite,
        progress=progress,
        storage_options=storage_options,
    )


def _cast(leaf: object, dtype: np.dtype[Any]) -> object:
    if isinstance(leaf, LazyArray) and not leaf.key_impl and _floating(leaf.dtype):
        return leaf.astype(dtype)
    return leaf


def _floating(dtype: np.dtype[Any]) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))
