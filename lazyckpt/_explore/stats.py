"""Statistics of lazy arrays, computed block by block within the memory budget."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from lazyckpt._array import repeats
from lazyckpt._array.dtypes import issubdtype
from lazyckpt._array.tree import Select, selected
from lazyckpt._engine import stream, workload
from lazyckpt._engine.progress import Progress, shown
from lazyckpt._errors import ArgumentError, LazyTypeError, renamed
from lazyckpt._explore import plot
from lazyckpt._explore.arguments import choice, count
from lazyckpt._lazy import LazyArray
from lazyckpt._read import arrays_of
from lazyckpt._sizes import optional_size
from lazyckpt._text import fold as fold_keys
from lazyckpt._text import human_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@attrs.frozen
class Stats:
    """Statistics of one array. `min`, `max`, `mean` and `std` are over its finite
    values (None when it has none); `nan` and `inf` count the others. `min` and `max`
    of an integer array are exact ints (float64 rounds 2**53 + 1); the rest are floats.
    `histogram` is `(counts, edges)` over `[min, max]` when asked for. `size` counts
    elements, as NumPy's does; `describe()` names it `elements`."""

    size: int
    nan: int
    inf: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    histogram: tuple[np.ndarray, np.ndarray] | None = attrs.field(default=None, eq=False)

    def describe(self) -> dict[str, Any]:
        """As JSON-ready data, the element count as `elements` (a `size` would read as
        bytes beside the table's sizes)."""
        out = attrs.asdict(self, filter=lambda a, _: a.name not in ("size", "histogram"))
        out = {"elements": self.size, **out}
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
_LARGEST = float(np.finfo(np.float64).max)
_LARGE = 2.0**400
"""Values beyond which sums of squares could overflow float64: the mean and squared
deviations are then kept in units of a power of two (`_Running.unit`)."""


@attrs.define
class _Running:
    """Chan et al.'s pairwise combination of counts, means and squared deviations.

    `mean` and `m2` are in units of `unit`, a power of two, 1 unless values beyond
    `_LARGE` came (float64's largest, 1.8e308, squared or summed twice, overflows):
    dividing by a power of two is exact, so ordinary arrays get the same results."""

    size: int = 0
    nan: int = 0
    inf: int = 0
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    unit: float = 1.0
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
        low, high = float(block.min()), float(block.max())  # (exact for every float)
        self._rescale(max(abs(low), abs(high)))
        if finite.dtype.kind in "iu":  # as Python ints: float64 rounds past 2**53
            self.low = min(self.low, int(finite.min()))
            self.high = max(self.high, int(finite.max()))
        else:
            self.low, self.high = min(self.low, low), max(self.high, high)
        if self.unit != 1.0:
            block = block / self.unit
        n = block.size
        mean = float(block.mean())
        m2 = float(np.square(block - mean).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def repeat(self, times: int) -> None:
        """Count every value folded in `times` times (a broadcast view's stored values
        stand for its repeats): the minimum, maximum, mean and std stay as they are."""
        self.size, self.nan, self.inf = self.size * times, self.nan * times, self.inf * times
        self.count *= times
        self.m2 *= times

    def _rescale(self, largest: float) -> None:
        """Make `unit` at least `largest`, once values pass `_LARGE`."""
        if largest <= _LARGE * self.unit:
            return
        unit = math.ldexp(1.0, math.frexp(largest)[1] - 1)  # largest / unit < 2
        self.mean *= self.unit / unit
        self.m2 *= (self.unit / unit) ** 2
        self.unit = unit

    def result(self, histogram: tuple[np.ndarray, np.ndarray] | None = None) -> Stats:
        if not self.count:
            return Stats(self.size, self.nan, self.inf, None, None, None, None, histogram)
        std = math.sqrt(self.m2 / self.count) * self.unit
        mean = self.mean * self.unit
        return Stats(self.size, self.nan, self.inf, self.low, self.high, mean, std, histogram)


class StatsTable(dict[str, Stats]):
    """What `stats` returns: `Stats` by key path, printed as an aligned table.

    `skipped` lists the arrays left out (complex numbers, PRNG keys); `nbytes` the
    size of each summarized array.
    """

    def __init__(self, results: dict[str, Stats], nbytes: dict[str, int], skipped: list[str]):
        super().__init__(results)
        self.nbytes = nbytes
        self.skipped = skipped

    def describe(self) -> dict[str, dict[str, Any]]:
        """As JSON-ready data (what `lazyckpt stats --json` prints): by key path, the
        array's `elements` and `nbytes` (the table's size), then its statistics."""
        return {
            key: {"elements": s.size, "nbytes": self.nbytes[key], **s.describe()}
            for key, s in self.items()
        }

    def __str__(self) -> str:
        return self.text()

    def text(self, *, fold: bool = True) -> str:
        """The table; with `fold`, arrays alike but for a layer number whose size and
        statistics are all equal (norm scales as initialized, say) share one line,
        `layers/{0..25}/norm/scale`."""
        lines = [format_stats(self, self.nbytes, fold=fold)]
        for key, s in self.items():
            if s.histogram is not None:
                counts, edges = s.histogram
                lines.append(f"\n{key}: histogram over [{edges[0]:.6g}, {edges[-1]:.6g}]")
                lines.append("  " + " ".join(str(int(c)) for c in counts))
        if self.skipped:
            lines.append(f"\nnot summarized (not real numbers): {', '.join(self.skipped)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def plot(self, kind: str | None = None, *, max_panels: int = 12) -> Figure:
        """A matplotlib Figure (`lazyckpt[notebook]`), which a notebook shows and
        `savefig` writes.

        Args:
            kind: `'layers'`: per family of numbered siblings (`layers/0..25/...`,
                `layer_0..25`), each statistic against the layer's number (a stacked
                tree: `unstack_layers` it first); `'histograms'`: each array's
                histogram (`stats(..., bins=N)`). Default: histograms if they were
                computed, else layers.
            max_panels: The most panels; the rest are counted in the title.
        """
        max_panels = count("stats(...).plot", "max_panels", max_panels, "pass max_panels=12, say")
        if kind is None:
            kind = "histograms" if any(s.histogram is not None for s in self.values()) else "layers"
        kind = choice("stats(...).plot", "kind", kind, ("layers", "histograms"))
        if kind == "layers":
            return plot.layers(self, max_panels)
        return plot.histograms(self, max_panels)


@renamed(which="select")
def stats(
    tree: object,
    select: Select | None = None,
    *,
    bins: int | None = None,
    memory_budget: int | str | None = None,
    progress: bool | None = None,
) -> StatsTable:
    """Statistics of every LazyArray in `tree`, read block by block within the budget.

    Arrays of other kinds (complex numbers, PRNG keys) are left out and listed in
    the result's `skipped`. A broadcast view (a tensor saved `expand`ed, sliced or cast
    too) is summarized from its stored values, each counted as often as it repeats.

    Args:
        tree: A lazy tree, a subtree of one, or a single LazyArray (a view too).
        select: Only the leaves matching a pattern, any of several patterns, or a
            predicate `(path, leaf) -> bool` (see `select`).
        bins: Also a histogram of the finite values in this many equal bins over
            `[min, max]` (1 or more), which takes a second read.
        memory_budget: As for `load`.
        progress: As for `load`.

    Returns:
        A `StatsTable`: a dict of `Stats` by key path, whatever `tree` is.

    >>> w = lazyckpt.open(path)["params"]["w"]
    >>> s = lazyckpt.stats(w, bins=4)["params/w"]
    >>> s.min, s.max, s.mean, s.nan
    (0.0, 63.0, 31.5, 0)
    >>> s.histogram[0]
    array([16, 16, 16, 16])
    >>> print(lazyckpt.stats(lazyckpt.open(path), "params"))
    key        size  min  max  mean     std  nan  inf
    params/b   32 B    1    1     1       0    0    0
    params/w  256 B    0   63  31.5  18.473    0    0
    """
    budget = optional_size("memory_budget", memory_budget)
    if bins is not None:
        bins = count("stats", "bins", bins, "pass bins=64, say, or bins=None for no histogram")
    if isinstance(tree, LazyArray):
        if not summarizable(tree):
            raise LazyTypeError(
                f"{tree.key}: statistics need real or integer values, not {tree.dtype}; "
                "read this array and reduce it yourself"
            )
        everything = [(tree.key or "(array)", tree)]
    else:
        everything = arrays_of(selected(tree, select))
    found = [(path, array) for path, array in everything if summarizable(array)]
    skipped = [path for path, array in everything if not summarizable(array)]
    arrays = [_stored_values(path, array) for path, array in found]
    workload.check(
        "stats would go through",
        [(path, array.nbytes) for (path, _), array in zip(found, arrays, strict=True)],
        lambda: workload.distinct_nbytes(arrays),
        "Take the statistics of fewer arrays (select=), or of slices of them",
    )
    total = sum(array.nbytes for array in arrays) * (2 if bins else 1)
    with shown(progress, total, "lazyckpt stats") as bar:
        running = [_Running() for _ in arrays]
        for position, _, values in stream.read_blocks(arrays, budget, bar):
            running[position].add(values)
        histograms: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(arrays)
        if bins:
            histograms = list(_histograms(arrays, running, bins, budget, bar))
    for (_, array), read, r, h in zip(found, arrays, running, histograms, strict=True):
        times = array.size // read.size if read.size else 1
        r.repeat(times)
        if h is not None:
            h[0][...] *= times
    results = [r.result(h) for r, h in zip(running, histograms, strict=True)]
    return StatsTable(
        {path: s for (path, _), s in zip(found, results, strict=True)},
        {path: array.nbytes for path, array in found},
        skipped,
    )


def _stored_values(path: str, array: LazyArray) -> LazyArray:
    """What `stats` reads of `array`: its stored values once, where it is a broadcast
    view (`repeats.core`); a view whose repeats cannot be told apart from the rest and
    that would go through far more than it stores is refused by name."""
    found = repeats.core(array)
    node = repeats.opaque(found)
    stored = workload.distinct_nbytes([found])
    if node is not None and repeats.excessive(found.nbytes, stored):
        raise ArgumentError(
            f"{repeats.described(path, array, stored)} under a {node.describe()} that "
            f"lazyckpt does not see through: stats would go through all "
            f"{human_bytes(found.nbytes)}. Take the statistics of the views it is made of, "
            "or of a slice of it"
        )
    assert isinstance(found, LazyArray), "the views of a LazyArray are LazyArrays"
    return found


def _histograms(
    arrays: list[LazyArray],
    running: list[_Running],
    bins: int,
    memory_budget: int | None,
    bar: Progress | None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    edges = [
        _edges(r.low, r.high, bins) if r.count else np.linspace(0.0, 1.0, bins + 1) for r in running
    ]
    counts = [np.zeros(bins, np.int64) for _ in arrays]
    for position, _, values in stream.read_blocks(arrays, memory_budget, bar):
        flat = values.reshape(-1)
        if flat.dtype.kind == "b":
            flat = flat.view(np.uint8)
        for start in range(0, flat.size, _PIECE):
            part = flat[start : start + _PIECE]
            floating = issubdtype(part.dtype, np.floating)
            finite = part[np.isfinite(part)] if floating else part
            counts[position] += np.histogram(finite, edges[position])[0]
    return list(zip(counts, edges, strict=True))


def _edges(low: float, high: float, bins: int) -> np.ndarray:
    """`bins + 1` increasing float64 edges from `low` to `high`, equally spaced where
    float64 can space them; NumPy's own refuses a range it cannot cut into `bins`
    (a constant 1e17, whose neighbours are 16 apart) and overflows on one wider than
    float64's largest (-1.7e308 to 1.7e308)."""
    lo, hi = float(low), float(high)  # (exact ints rounded as NumPy compares them)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5  # NumPy's range for a single value
    share = np.linspace(0.0, 1.0, bins + 1)
    edges = lo * (1 - share) + hi * share  # (never hi - lo, which can overflow)
    edges[0], edges[-1] = lo, hi
    if np.all(edges[:-1] < edges[1:]):
        return edges
    return _neighbours(float(low), float(high), bins)


def _neighbours(low: float, high: float, bins: int) -> np.ndarray:
    """`bins + 1` consecutive float64 values from `low`, the last one at least `high`;
    those that would pass float64's largest go below `low` instead."""
    edges = [low]
    while len(edges) <= bins and edges[-1] < _LARGEST:
        edges.append(float(np.nextafter(edges[-1], math.inf)))
    edges[-1] = max(edges[-1], high)
    below = [low]
    while len(below) + len(edges) <= bins + 1:
        below.append(float(np.nextafter(below[-1], -math.inf)))
    return np.array(below[:0:-1] + edges)


def summarizable(array: LazyArray) -> bool:
    """Whether `stats` covers the array: real floating, integer or bool values."""
    if array.key_impl:
        return False
    dtype = array.dtype
    return (
        issubdtype(dtype, np.floating)
        or issubdtype(dtype, np.integer)
        or (np.dtype(dtype) == np.bool_)
    )


def format_stats(results: dict[str, Stats], nbytes: dict[str, int], *, fold: bool = False) -> str:
    """An aligned table of statistics by key path (what `lazyckpt stats` prints); with
    `fold`, rows equal but for a layer number in their keys share one line."""
    header = ("key", "size", "min", "max", "mean", "std", "nan", "inf")
    cells = {
        key: (
            human_bytes(nbytes[key]),
            *("-" if v is None else f"{v:.6g}" for v in (s.min, s.max, s.mean, s.std)),
            str(s.nan),
            str(s.inf),
        )
        for key, s in results.items()
    }
    rows: list[tuple[str, ...]] = [header]
    if fold:
        lines = ((key, "\t".join(row)) for key, row in cells.items())
        rows += [(line.path, *line.detail.split("\t")) for line in fold_keys(lines, vary=False)]
    else:
        rows += [(key, *row) for key, row in cells.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    )
