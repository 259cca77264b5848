"""`convert`: open a checkpoint, keep some of it, cast it, save it again, streaming."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._errors import LazyTypeError
from lazyckpt._lazy import LazyArray
from lazyckpt._open import open as open_checkpoint
from lazyckpt._save import DEFAULT_CHUNK_BYTES, save
from lazyckpt._tree import Predicate, any_of, map_leaves
from lazyckpt._tree import select as select_tree


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    select: str | Sequence[str] | Predicate | None = None,
    dtype: DTypeLike | None = None,
    step: int | None = None,
    item: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    memory_budget: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Rewrite the checkpoint at `source` as a lazyckpt-saved one at `destination`.

    `select` keeps only the leaves matching a pattern (or any of several, or
    a predicate; see `select`); `dtype` casts floating-point arrays (integers,
    booleans and PRNG keys keep theirs). Arrays stream from `source` to
    `destination` block by block within `memory_budget`, never loaded whole; the
    result is an Orbax PyTree checkpoint in chunks of about `chunk_bytes`.

    >>> out = lazyckpt.convert(path, tmp / "params16", select="params",
    ...                        dtype="float16")
    >>> lazyckpt.open(out)["params"]["b"]
    LazyArray('params/b', shape=(8,), dtype=float16, chunks=(8,), sharding=NamedSharding(mesh={'x': 4, 'y': 2}, spec=P()))
    """
    tree = open_checkpoint(source, step=step, item=item, storage_options=storage_options)
    if select is not None:
        tree = select_tree(tree, _predicate(select))
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
        chunk_bytes=chunk_bytes,
        memory_budget=memory_budget,
        overwrite=overwrite,
        progress=progress,
        storage_options=storage_options,
    )


def _predicate(which: str | Sequence[str] | Predicate) -> str | Predicate:
    if isinstance(which, str) or callable(which):
        return which
    return any_of(which)


def _cast(leaf: Any, dtype: np.dtype[Any]) -> Any:
    if isinstance(leaf, LazyArray) and not leaf.key_impl and _floating(leaf.dtype):
        return leaf.astype(dtype)
    return leaf


def _floating(dtype: Any) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.floating))
