"""Statistics of lazy arrays, computed block by block within the memory budget."""

from __future__ import annotations

import math
from typing import Any

import attrs
import jax.numpy as jnp
import numpy as np

from lazyckpt._errors import LazyTypeError
from lazyckpt._lazy import LazyArray
from lazyckpt._progress import Progress
from lazyckpt._read import arrays_of
from lazyckpt._stream import iter_blocks as engine_blocks
from lazyckpt._text import human_bytes
from lazyckpt._tree import Predicate, select


@attrs.frozen
class Stats:
    """Statistics of one array. `min`, `max`, `mean` and `std` are over its finite
    values (None when it has none); `nan` and `inf` count the others. `histogram`
    is `(counts, edges)` over `[min, max]` when asked for."""

    size: int
    nan: int
    inf: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    histogram: tuple[np.ndarray, np.ndarray] | None = attrs.field(default=None, eq=False)

    @property
    def finite(self) -> int:
        return self.size - self.nan - self.inf

    def describe(self) -> dict[str, Any]:
        """As JSON-ready data."""
        out = attrs.asdict(self, filter=lambda a, _: a.name != "histogram")
        if self.histogram is not None:
            counts, edges = self.histogram
            out["histogram"] = {"counts": counts.tolist(), "edges": edges.tolist()}
        return out

    def __str__(self) -> str:
        if self.min is None:
            values = "no finite values"
        else:
            values = (
                f"min {self.min:.6g}  max {self.max:.6g}  mean {self.mean:.6g}  std {self.std:.6g}"
            )
        return f"{values}  nan {self.nan}  inf {self.inf}  (of {self.size})"


_PIECE = 1 << 18  # elements folded in at once: 2 MiB of float64


@attrs.define
class _Running:
    """Chan et al.'s pairwise combination of counts, means and squared deviations."""

    size: int = 0
    nan: int = 0
    inf: int = 0
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, values: np.ndarray) -> None:
        """Fold in a block, a slice of `_PIECE` elements at a time: the float64 copy and
        the masks of a slice are all the temporaries, whatever the block's size."""
        flat = np.asarray(values).reshape(-1)
        for start in range(0, flat.size, _PIECE):
            self._add(flat[start : start + _PIECE])

    def _add(self, values: np.ndarray) -> None:
        self.size += values.size
        if values.dtype.kind in "biu":
            finite = values.reshape(-1)
        else:
            nan = int(np.isnan(values).sum())
            inf = int(np.isinf(values).sum())
            self.nan += nan
            self.inf += inf
            finite = values[np.isfinite(values)] if nan or inf else values.reshape(-1)
        if not finite.size:
            return
        block = finite.astype(np.float64, copy=False)
        n = block.size
        mean = float(block.mean())
        m2 = float(np.square(block - mean).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total
        self.low = min(self.low, float(block.min()))
        self.high = max(self.high, float(block.max()))

    def result(self, histogram: tuple[np.ndarray, np.ndarray] | None = None) -> Stats:
        if not self.count:
            return Stats(self.size, self.nan, self.inf, None, None, None, None, histogram)
        std = math.sqrt(self.m2 / self.count)
        return Stats(self.size, self.nan, self.inf, self.low, self.high, self.mean, std, histogram)


def stats(
    tree: Any,
    which: str | Predicate | None = None,
    *,
    bins: int | None = None,
    memory_budget: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Statistics of every LazyArray in `tree` (or in `select(tree, which)`), read
    block by block within `memory_budget`: a dict of `Stats` by key path, or one
    `Stats` when `tree` is a LazyArray.

    Arrays of other kinds in a tree (complex numbers, PRNG keys) are left out. With `bins`, also a histogram of the finite values
    in `bins` equal bins over `[min, max]`, which takes a second read.

    >>> s = lazyckpt.stats(lazyckpt.open(path)["params"]["w"], bins=4)
    >>> s.min, s.max, s.mean, s.nan
    (0.0, 63.0, 31.5, 0)
    >>> s.histogram[0]
    array([16, 16, 16, 16])
    """
    single = isinstance(tree, LazyArray)
    if single and not summarizable(tree):
        raise LazyTypeError(
            f"{tree.key}: statistics need real or integer values, not {tree.dtype}; "
            "read this array and reduce it yourself"
        )
    if which is not None:
        tree = select(tree, which)
    found = [(path, array) for path, array in arrays_of(tree) if summarizable(array)]
    arrays = [array for _, array in found]
    total = sum(array.nbytes for array in arrays) * (2 if bins else 1)
    bar = Progress.maybe(progress, total, "lazyckpt stats")
    running = [_Running() for _ in arrays]
    for position, _, values in engine_blocks(arrays, memory_budget, bar):
        running[position].add(values)
    histograms: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(arrays)
    if bins:
        histograms = list(_histograms(arrays, running, bins, memory_budget, bar))
    if bar is not None:
        bar.close()
    results = [r.result(h) for r, h in zip(running, histograms, strict=True)]
    return results[0] if single else {path: s for (path, _), s in zip(found, results, strict=True)}


def _histograms(
    arrays: list[LazyArray],
    running: list[_Running],
    bins: int,
    memory_budget: int | None,
    bar: Progress | None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    edges = [
        np.histogram_bin_edges([], bins, (r.low, r.high) if r.count else (0.0, 1.0))
        for r in running
    ]
    counts = [np.zeros(bins, np.int64) for _ in arrays]
    for position, _, values in engine_blocks(arrays, memory_budget, bar):
        flat = values.reshape(-1)
        if flat.dtype.kind == "b":
            flat = flat.view(np.uint8)
        for start in range(0, flat.size, _PIECE):
            part = flat[start : start + _PIECE]
            floating = jnp.issubdtype(part.dtype, jnp.floating)
            finite = part[np.isfinite(part)] if floating else part
            counts[position] += np.histogram(finite, edges[position])[0]
    return list(zip(counts, edges, strict=True))


def summarizable(array: LazyArray) -> bool:
    """Whether `stats` covers the array: real floating, integer or bool values."""
    if array.key_impl:
        return False
    dtype = array.dtype
    return bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)) or (
        np.dtype(dtype) == np.bool_
    )


def format_stats(results: dict[str, Stats], nbytes: dict[str, int]) -> str:
    """An aligned table of statistics by key path (what `lazyckpt stats` prints)."""
    header = ("key", "size", "min", "max", "mean", "std", "nan", "inf")
    rows: list[tuple[str, ...]] = [header]
    for key, s in results.items():
        numbers = [s.min, s.max, s.mean, s.std]
        rows.append(
            (
                key,
                human_bytes(nbytes[key]),
                *("-" if v is None else f"{v:.6g}" for v in numbers),
                str(s.nan),
                str(s.inf),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    )
