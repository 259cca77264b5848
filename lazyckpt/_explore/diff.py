"""Comparing two lazy trees: structure from metadata, values block by block."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import jax
import numpy as np

from lazyckpt._array.tree import Select, leaves, selected
from lazyckpt._engine import stream
from lazyckpt._engine.decode import decodes
from lazyckpt._engine.progress import shown
from lazyckpt._engine.stored import StoredArray
from lazyckpt._errors import NoMatchError
from lazyckpt._explore import plot
from lazyckpt._lazy import LazyArray
from lazyckpt._open import open as open_checkpoint
from lazyckpt._read import load
from lazyckpt._sizes import optional_size
from lazyckpt._text import Folded
from lazyckpt._text import fold as fold_keys

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_KINDS = ("added", "removed", "moved", "shape", "dtype", "value", "equal")
_Signature = tuple[str, tuple[int, ...], str] | tuple[str, str]
"""What a moved leaf keeps: `('array', shape, dtype)`, or `('value', repr)`."""


@attrs.frozen
class Change:
    """How one key path differs between the two trees.

    `kind` is one of: `added` (only in the second), `removed` (only in the first),
    `moved` (a removed leaf whose metadata, and values if compared, reappear at
    `to`), `shape`, `dtype`, `value` (values differ; for arrays `max_abs` and
    `max_rel` say by how much) or `equal`.
    """

    path: str
    kind: str
    before: str = ""
    after: str = ""
    to: str = ""
    max_abs: float | None = None
    max_rel: float | None = None

    def __str__(self) -> str:
        return f"{self._head()}  {self._detail()}"

    def _head(self) -> str:
        sign = {"added": "+", "removed": "-", "moved": ">", "equal": "="}.get(self.kind, "~")
        return f"{sign} {self.path}"

    def _tail(self) -> str:
        return f" -> {self.to}" if self.kind == "moved" else ""

    def _detail(self) -> str:
        if self.kind in ("added",):
            return self.after
        if self.kind in ("removed", "equal", "moved"):
            return self.before
        text = f"{self.kind}: {self.before} -> {self.after}"
        if self.max_abs is not None:
            text += f"  max abs {self.max_abs:.6g}, max rel {self.max_rel:.6g}"
        return text


@attrs.frozen
class Diff:
    """What `lazyckpt.diff` returns: the changes in the first tree's order, then the
    additions. `changed` lists all but `equal` entries; prints as one line each, changes
    alike but for a layer number (`layers/{0..3}/w`) folded into one."""

    changes: tuple[Change, ...]
    values_compared: bool

    @property
    def changed(self) -> list[Change]:
        return [c for c in self.changes if c.kind != "equal"]

    def __bool__(self) -> bool:
        """True when the trees differ."""
        return bool(self.changed)

    def counts(self) -> dict[str, int]:
        return {kind: sum(c.kind == kind for c in self.changes) for kind in _KINDS}

    def __str__(self) -> str:
        return self.text()

    __repr__ = __str__

    def text(self, *, fold: bool = True) -> str:
        """The report; with `fold`, changes alike but for a layer number take one line:
        `- layers/{0..3}/w  f32[8]`."""
        counts = ", ".join(f"{n} {kind}" for kind, n in self.counts().items() if n)
        what = "metadata and values" if self.values_compared else "metadata only"
        lines = [f"{counts or 'both empty'} ({what})"]
        changes = [(c._head(), c._detail(), 1, c._tail()) for c in self.changed]
        if fold:
            lines.extend(str(line) for line in fold_keys(changes, vary=False))
        else:
            lines.extend(str(Folded(head + tail, detail, 1)) for head, detail, _, tail in changes)
        return "\n".join(lines)

    def describe(self) -> list[dict[str, Any]]:
        return [attrs.asdict(c) for c in self.changes]

    def plot(self, *, top: int = 30) -> Figure:
        """A matplotlib Figure (`lazyckpt[notebook]`) of the `top` arrays whose values
        changed most, by their largest relative difference (`diff(..., values=True)`),
        largest first."""
        return plot.changes(self.changes, top)


def _describe(leaf: object) -> str:
    if isinstance(leaf, LazyArray):
        return f"{leaf.dtype}[{','.join(str(n) for n in leaf.shape)}]"
    text = repr(leaf)
    return text if len(text) <= 60 else text[:57] + "..."


def _signature(leaf: object) -> _Signature:
    if isinstance(leaf, LazyArray):
        return ("array", leaf.shape, str(leaf.dtype))
    return ("value", repr(leaf))


def _selected_or_empty(tree: object, select: Select | None) -> object:
    """The selected part of one side; nothing where the pattern matches none of it,
    so that what the other side has shows as added or removed."""
    try:
        return selected(tree, select)
    except NoMatchError:
        return {}


def diff(
    first: object,
    second: object,
    *,
    select: Select | None = None,
    values: bool = False,
    step: int | tuple[int | None, int | None] | None = None,
    item: str | None = None,
    storage_options: dict[str, Any] | None = None,
    memory_budget: int | str | None = None,
    progress: bool | None = None,
) -> Diff:
    """Compare two trees or checkpoints: structure, shapes and dtypes from metadata,
    and with `values=True` array values, block by block.

    NaNs in the same places count as equal; a NaN or Inf facing a different value
    makes the difference infinite. A leaf that disappears from one path and
    appears at another with the same shape and dtype (and, if compared, values) is
    reported as moved.

    Args:
        first: A lazy tree (any pytree) or a path that `open` takes.
        second: The same, compared against `first`.
        select: Only the leaves matching a path pattern (`params/**/kernel`), any of
            a list of patterns, or a predicate `(path, leaf) -> bool`; see `select`. A side with no match compares as empty.
        values: Also compare array values, reporting the largest absolute and
            relative difference.
        step: For paths: one step for both, or `(step_of_first, step_of_second)`.
        item: For paths: the item of the step folders, as for `open`.
        storage_options: As for `open`.
        memory_budget: As for `load`.
        progress: As for `load`.

    Returns:
        A `Diff`: one `Change` per key path; true when the trees differ.

    >>> tree = lazyckpt.open(path)
    >>> changed = {**tree, "step": 4, "params": {"w": tree["params"]["w"]}}
    >>> print(lazyckpt.diff(tree, changed))
    1 removed, 1 value, 2 equal (metadata only)
    - params/b  float32[8]
    ~ step  value: 3 -> 4
    """
    budget = optional_size("memory_budget", memory_budget)
    steps = step if isinstance(step, tuple) else (step, step)
    sides = []
    for side, side_step in zip((first, second), steps, strict=True):
        if isinstance(side, str | os.PathLike):
            side = open_checkpoint(side, step=side_step, item=item, storage_options=storage_options)
        sides.append(_selected_or_empty(side, select))
    a, b = dict(leaves(sides[0])), dict(leaves(sides[1]))
    changes: dict[str, Change] = {}
    compare: list[tuple[str, LazyArray, LazyArray]] = []
    for path, old in a.items():
        if path not in b:
            changes[path] = Change(path, "removed", before=_describe(old))
            continue
        new = b[path]
        before, after = _describe(old), _describe(new)
        if isinstance(old, LazyArray) and isinstance(new, LazyArray):
            if old.shape != new.shape:
                changes[path] = Change(path, "shape", before, after)
            elif old.dtype != new.dtype:
                changes[path] = Change(path, "dtype", before, after)
            else:
                changes[path] = Change(path, "equal", before, after)
                if values and old.key_impl:
                    if not _equal_keys(old, new):
                        changes[path] = Change(path, "value", before, after)
                elif values:
                    compare.append((path, old, new))
        elif isinstance(old, LazyArray) or isinstance(new, LazyArray):
            changes[path] = Change(path, "value", before, after)
        else:
            kind = "equal" if _same_value(old, new) else "value"
            changes[path] = Change(path, kind, before, after)
    added = [
        Change(path, "added", after=_describe(leaf)) for path, leaf in b.items() if path not in a
    ]
    if compare:
        _compare_values(compare, changes, budget, progress)
    moved = _moves(a, b, changes, added, values, budget)
    ordered = [changes[path] for path in a]
    return Diff((*ordered, *(c for c in added if c.path not in moved)), values)


def _same_value(old: object, new: object) -> bool:
    return type(old) is type(new) and old == new


def _compare_values(
    pairs: list[tuple[str, LazyArray, LazyArray]],
    changes: dict[str, Change],
    memory_budget: int | None,
    progress: bool | None,
) -> None:
    total = sum(old.nbytes + new.nbytes for _, old, new in pairs)
    with shown(progress, total, "lazyckpt diff") as bar:
        worst: dict[str, tuple[float, float, bool]] = {}
        arrays = [(old, new) for _, old, new in pairs]
        for position, left, right in _paired_blocks(arrays, memory_budget):
            path = pairs[position][0]
            abs_diff, rel_diff, differs = _block_difference(left, right)
            prev = worst.get(path, (0.0, 0.0, False))
            worst[path] = (max(prev[0], abs_diff), max(prev[1], rel_diff), prev[2] or differs)
            if bar is not None:
                bar.advance(left.nbytes + right.nbytes)
    for path, (abs_diff, rel_diff, differs) in worst.items():
        if differs:
            changes[path] = attrs.evolve(
                changes[path], kind="value", max_abs=abs_diff, max_rel=rel_diff
            )


def _paired_blocks(
    pairs: list[tuple[LazyArray, LazyArray]], memory_budget: int | None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """`(position, left, right)`: the same block of both arrays of each pair, each side
    within half the budget. Arrays stored alike (two steps of one run) stream side by
    side, so each stored chunk is decoded once; otherwise the second array is read
    region by region for the first one's blocks."""
    half = None if memory_budget is None else max(1, memory_budget // 2)
    alike = [i for i, (old, new) in enumerate(pairs) if _stored_alike(old, new)]
    # Not shared: the two sides must come in the same blocks, whatever views share.
    olds = stream.iter_blocks([pairs[i][0] for i in alike], half, share=False)
    news = stream.iter_blocks([pairs[i][1] for i in alike], half, share=False)
    for (a, index, left), (b, other, right) in zip(olds, news, strict=True):
        assert a == b and index == other, "arrays stored alike stream alike"
        yield alike[a], left, right
    rest = [i for i in range(len(pairs)) if i not in set(alike)]
    for position, index, left in stream.iter_blocks([pairs[i][0] for i in rest], half):
        yield rest[position], left, load(pairs[rest[position]][1][index], memory_budget=half)


def _stored_alike(old: LazyArray, new: LazyArray) -> bool:
    """Whether the engine cuts both views into the same blocks."""
    a, b = old.stored, new.stored
    if not isinstance(a, StoredArray) or not isinstance(b, StoredArray):
        return False  # composed views: compared region by region
    return (
        old.selection == new.selection
        and (a.shape, a.chunks, a.dtype.itemsize) == (b.shape, b.chunks, b.dtype.itemsize)
        and decodes(a) == decodes(b)
        and (a.codec is None or b.codec is None or a.codec.order == b.codec.order)
        and (a.inline is None) == (b.inline is None)
    )


_PIECE = 1 << 18  # elements compared at once: a few MiB of float64 temporaries


def _block_difference(left: np.ndarray, right: np.ndarray) -> tuple[float, float, bool]:
    """Largest absolute and relative difference of two blocks, and whether any
    element differs (NaN matching NaN does not); `_PIECE` elements at a time, so the
    float64 temporaries stay small whatever the block's size."""
    a, b = left.reshape(-1), right.reshape(-1)
    worst = (0.0, 0.0, False)
    for start in range(0, a.size, _PIECE):
        found = _piece_difference(a[start : start + _PIECE], b[start : start + _PIECE])
        worst = (max(worst[0], found[0]), max(worst[1], found[1]), worst[2] or found[2])
    return worst


def _piece_difference(left: np.ndarray, right: np.ndarray) -> tuple[float, float, bool]:
    if left.dtype.kind == "b":
        differs = bool(np.any(left != right))
        return float(differs), float(differs), differs
    x = left.astype(np.float64) if left.dtype.kind != "c" else left.astype(np.complex128)
    y = right.astype(x.dtype)
    both_nan = np.isnan(x) & np.isnan(y)
    same = (x == y) | both_nan
    if bool(np.all(same)):
        return 0.0, 0.0, False
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.abs(x - y)
        delta = np.where(same, 0.0, np.where(np.isnan(delta), np.inf, delta))
        scale = np.maximum(np.abs(x), np.abs(y))
        rel = np.where(delta == 0, 0.0, delta / np.where(scale == 0, 1.0, scale))
    return float(delta.max()), float(np.nan_to_num(rel, nan=np.inf).max()), True


def _moves(
    a: dict[str, object],
    b: dict[str, object],
    changes: dict[str, Change],
    added: list[Change],
    values: bool,
    memory_budget: int | None,
) -> set[str]:
    """Pair removed and added leaves with the same signature, one to one; returns the
    added paths that were matched."""
    free: dict[_Signature, list[str]] = {}
    for change in added:
        free.setdefault(_signature(b[change.path]), []).append(change.path)
    matched: set[str] = set()
    for path, change in list(changes.items()):
        if change.kind != "removed":
            continue
        candidates = free.get(_signature(a[path]), [])
        for target in candidates:
            if values and not _equal_values(a[path], b[target], memory_budget):
                continue
            candidates.remove(target)
            matched.add(target)
            changes[path] = attrs.evolve(change, kind="moved", to=target)
            break
    return matched


def _equal_keys(old: LazyArray, new: LazyArray) -> bool:
    """Typed PRNG keys: equal when their key data is (they are small; read whole)."""
    left, right = (np.asarray(jax.random.key_data(array.get())) for array in (old, new))
    return old.key_impl == new.key_impl and np.array_equal(left, right)


def _equal_values(old: object, new: object, memory_budget: int | None) -> bool:
    if not isinstance(old, LazyArray):
        return _same_value(old, new)
    assert isinstance(new, LazyArray), "signatures match: both are arrays"
    if old.key_impl:
        return _equal_keys(old, new)
    return not any(
        _block_difference(left, right)[2]
        for _, left, right in _paired_blocks([(old, new)], memory_budget)
    )
