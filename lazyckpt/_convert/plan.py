"""What `convert` would write (`ConversionPlan`, for `dry_run=True`), planned from
metadata alone, and what it returns (`Converted`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs
import numpy as np

from lazyckpt._array.tree import leaves, map_leaves
from lazyckpt._display import as_given
from lazyckpt._lazy import LazyArray
from lazyckpt._orbax.plan import plan
from lazyckpt._safetensors.write import plan_files
from lazyckpt._save import Format
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

    def __new__(cls, path: str, carried: tuple[str, ...] = ()) -> Converted:
        out = super().__new__(cls, path)
        out.carried = tuple(carried)
        return out

    def __reduce__(self) -> tuple[type[Converted], tuple[str, tuple[str, ...]]]:
        # (pickle and copy would rebuild a str subclass from its text alone: `carried`
        # goes with it, so a result comes back whole from a process pool)
        return (Converted, (str(self), self.carried))


def plan_safetensors(
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
    in_order = [by_path[e.path] for e in sorted(by_path.values(), key=tree_order(tree))]
    return ConversionPlan(
        final, "safetensors", tuple(in_order), tuple((f.name, f.size) for f in files)
    )


def tree_order(tree: object) -> Callable[[PlannedArray], int]:
    order = {path: i for i, (path, _) in enumerate(leaves(tree))}
    return lambda array: order[array.path]


def plan_orbax(final: str, tree: object, chunk_bytes: int) -> ConversionPlan:
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
