"""Comparing two lazy trees: structure from metadata, values block by block."""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Iterator
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
from lazyckpt._explore import difference, digest, plot
from lazyckpt._explore.arguments import count
from lazyckpt._explore.sides import Side, check_work, unrepeated
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
_Array = Side


@attrs.frozen
class Change:
    """How one key path differs between the two trees.

    `kind` is one of: `added` (only in the second), `removed` (only in the first),
    `moved` (a removed leaf whose metadata, and values if compared, reappear at
    `to`), `shape`, `dtype`, `value` (values differ; for arrays `max_abs` and
    `max_rel` say by how much: exact ints for integer arrays, floats otherwise; an
    infinite one where a NaN or Inf faces a different value) or `equal`.
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
        """As JSON-ready data (what `lazyckpt diff --json` prints): one dict per change.
        An infinite `max_abs` or `max_rel` (a NaN or Inf facing a different value) is
        the string `"inf"`, which JSON can hold, where a float would print `Infinity`."""
        return [
            {key: _json_number(value) for key, value in attrs.asdict(c).items()}
            for c in self.changes
        ]

    def plot(self, *, top: int = 30) -> Figure:
        """A matplotlib Figure (`lazyckpt[notebook]`) of the `top` arrays whose values
        changed most, by their largest relative difference (`diff(..., values=True)`),
        largest first."""
        top = count("Diff.plot", "top", top, "pass top=30, say, for the 30 that changed most")
        return plot.changes(self.changes, top)


def _json_number(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "-inf" if value < 0 else "nan"
    return value


def _describe(leaf: object) -> str:
    if isinstance(leaf, _Array):
        return f"{leaf.dtype}[{','.join(str(n) for n in leaf.shape)}]"
    text = repr(leaf)
    return text if len(text) <= 60 else text[:57] + "..."


def _signature(leaf: object) -> _Signature:
    if isinstance(leaf, _Array):
        return ("array", tuple(leaf.shape), str(leaf.dtype))
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

    Arrays are LazyArrays, NumPy arrays or `jax.Array`s alike: a tree read with `load`
    compares equal to the lazy tree it was read from. Integer and bool values compare
    exactly, floats as float64. NaNs in the same places count as equal, in arrays and
    as scalar leaves; a NaN or Inf facing a different value makes the difference
    infinite. Broadcast views (a tensor saved `expand`ed, a NumPy `broadcast_to`) are
    compared where both sides are constant: their stored values, where they repeat
    alike. A leaf that disappears from one path and
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
    compare: list[tuple[str, _Array, _Array]] = []
    for path, old in a.items():
        if path not in b:
            changes[path] = Change(path, "removed", before=_describe(old))
            continue
        new = b[path]
        before, after = _describe(old), _describe(new)
        if isinstance(old, _Array) and isinstance(new, _Array):
            if tuple(old.shape) != tuple(new.shape):
                changes[path] = Change(path, "shape", before, after)
            elif old.dtype != new.dtype:
                changes[path] = Change(path, "dtype", before, after)
            else:
                changes[path] = Change(path, "equal", before, after)
                if values and _is_keys(old):
                    if not _equal_keys(old, new):
                        changes[path] = Change(path, "value", before, after)
                elif values:
                    compare.append((path, old, new))
        elif isinstance(old, _Array) or isinstance(new, _Array):
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
    """Scalar leaves (and any other leaf that is not an array): equal when of one type
    and `==`, or both NaN, as NaNs in the same places of arrays are."""
    if type(old) is not type(new):
        return False
    if _is_nan(old) and _is_nan(new):
        return True
    try:
        return bool(old == new)
    except (ValueError, TypeError):  # an `==` whose result is no truth value
        return old is new


def _is_nan(value: object) -> bool:
    return isinstance(value, float | complex | np.inexact) and value != value


def _compare_values(
    pairs: list[tuple[str, _Array, _Array]],
    changes: dict[str, Change],
    memory_budget: int | None,
    progress: bool | None,
) -> None:
    arrays = [unrepeated(path, old, new) for path, old, new in pairs]
    check_work([(path, *both) for (path, _, _), both in zip(pairs, arrays, strict=True)])
    total = sum(old.nbytes + new.nbytes for old, new in arrays)
    with shown(progress, total, "lazyckpt diff") as bar:
        worst: dict[str, tuple[float, float, bool]] = {}
        for position, left, right in _paired_blocks(arrays, memory_budget):
            path = pairs[position][0]
            found = difference.block_difference(left, right)
            worst[path] = difference.worse(worst.get(path, difference.SAME), found)
            if bar is not None:
                bar.advance(left.nbytes + right.nbytes)
    for path, (abs_diff, rel_diff, differs) in worst.items():
        if differs:
            changes[path] = attrs.evolve(
                changes[path], kind="value", max_abs=abs_diff, max_rel=rel_diff
            )


def _paired_blocks(
    pairs: list[tuple[_Array, _Array]], memory_budget: int | None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """`(position, left, right)`: the same block of both arrays of each pair, each side
    within half the budget. Arrays stored alike (two steps of one run) stream side by
    side, so each stored chunk is decoded once; otherwise the blocks of the first
    LazyArray of a pair are streamed, and the same region of the other side read (a
    LazyArray) or cut (an array in memory). Two arrays in memory are one block."""
    half = None if memory_budget is None else max(1, memory_budget // 2)
    alike = [i for i, (old, new) in enumerate(pairs) if _stored_alike(old, new)]
    # Not shared: the two sides must come in the same blocks, whatever views share.
    olds = stream.read_blocks([_lazy(pairs[i][0]) for i in alike], half, share=False)
    news = stream.read_blocks([_lazy(pairs[i][1]) for i in alike], half, share=False)
    for (a, index, left), (b, other, right) in zip(olds, news, strict=True):
        assert a == b and index == other, "arrays stored alike stream alike"
        yield alike[a], left, right
    done = set(alike)
    rest = [i for i in range(len(pairs)) if i not in done]
    streamed = [i for i in rest if any(isinstance(side, LazyArray) for side in pairs[i])]
    # The first side that is lazy drives; `flip` says it is the second.
    flip = [not isinstance(pairs[i][0], LazyArray) for i in streamed]
    drivers = [
        _lazy(pairs[i][1] if f else pairs[i][0]) for i, f in zip(streamed, flip, strict=True)
    ]
    for position, index, block in stream.read_blocks(drivers, half):
        old, new = pairs[streamed[position]]
        region = _region(old if flip[position] else new, index, half)
        yield streamed[position], *((region, block) if flip[position] else (block, region))
    done.update(streamed)
    for i in rest:
        if i not in done:
            yield i, np.asarray(pairs[i][0]), np.asarray(pairs[i][1])


def _lazy(array: _Array) -> LazyArray:
    assert isinstance(array, LazyArray), "only lazy sides are streamed"
    return array


def _region(array: _Array, index: tuple[slice, ...], memory_budget: int | None) -> np.ndarray:
    """`array[index]` as NumPy: read, for a LazyArray; cut, for an array in memory."""
    if isinstance(array, LazyArray):
        region: np.ndarray = load(array[index], memory_budget=memory_budget)
        return region
    return np.asarray(array[index])


def _stored_alike(old: _Array, new: _Array) -> bool:
    """Whether the engine cuts both views into the same blocks."""
    if not isinstance(old, LazyArray) or not isinstance(new, LazyArray):
        return False
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


def _moves(
    a: dict[str, object],
    b: dict[str, object],
    changes: dict[str, Change],
    added: list[Change],
    values: bool,
    memory_budget: int | None,
) -> set[str]:
    """Pair removed and added leaves with the same signature (and, with `values`,
    equal values), one to one: each removed leaf in turn with the first added one
    free. Returns the added paths that were matched."""
    removed = [path for path, change in changes.items() if change.kind == "removed"]
    olds, news = _move_keys(a, removed, b, [c.path for c in added], values, memory_budget)
    free: dict[Hashable, list[str]] = {}
    for change in added:
        free.setdefault(news[change.path], []).append(change.path)
    matched: set[str] = set()
    for path in removed:
        candidates = free.get(olds[path], [])
        for target in candidates:
            if values and not _equal_values(path, a[path], b[target], memory_budget):
                continue
            candidates.remove(target)
            matched.add(target)
            changes[path] = attrs.evolve(changes[path], kind="moved", to=target)
            break
    return matched


def _move_keys(
    a: dict[str, object],
    removed: list[str],
    b: dict[str, object],
    added: list[str],
    values: bool,
    memory_budget: int | None,
) -> tuple[dict[str, Hashable], dict[str, Hashable]]:
    """What a removed leaf shares with the added one it moves to: its signature, and
    with `values` the digest of its values (`digest`), which equal values share; so
    a removed leaf is compared with the added ones of its digest only, after each
    array was read once for the digests. (A signature of one removed and one added
    leaf keeps no digest: that pair is compared as it is, each side read once.)"""
    olds: dict[str, Hashable] = {path: _signature(a[path]) for path in removed}
    news: dict[str, Hashable] = {path: _signature(b[path]) for path in added}
    if not values:
        return olds, news
    groups: dict[Hashable, tuple[list[str], list[str]]] = {}
    for side, signatures in enumerate((olds, news)):
        for path, signature in signatures.items():
            groups.setdefault(signature, ([], []))[side].append(path)
    hashed = [
        (signature, first, second)
        for signature, (first, second) in groups.items()
        if first and second and len(first) + len(second) > 2 and isinstance(b[second[0]], _Array)
    ]
    if not hashed:
        return olds, news
    found = digest.digests(
        [
            [(path, _digested(a[path])) for path in first]
            + [(path, _digested(b[path])) for path in second]
            for _, first, second in hashed
        ],
        memory_budget,
    )
    for (signature, first, second), digests in zip(hashed, found, strict=True):
        keys = [(signature, found_digest) for found_digest in digests]
        olds.update(zip(first, keys[: len(first)], strict=True))
        news.update(zip(second, keys[len(first) :], strict=True))
    return olds, news


def _digested(leaf: object) -> _Array:
    """What `digest` takes of an array: its values; typed PRNG keys' data."""
    assert isinstance(leaf, _Array), "array signatures are arrays'"
    return _key_data(leaf) if _is_keys(leaf) else leaf


def _is_keys(array: _Array) -> bool:
    """Whether `array` holds typed PRNG keys (a LazyArray's dtype is theirs too)."""
    return bool(jax.numpy.issubdtype(array.dtype, jax.dtypes.prng_key))


def _equal_keys(old: _Array, new: _Array) -> bool:
    """Typed PRNG keys of one dtype (one implementation): equal when their key data
    is (they are small; read whole)."""
    return np.array_equal(_key_data(old), _key_data(new))


def _key_data(array: _Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(array.get() if isinstance(array, LazyArray) else array))


def _equal_values(path: str, old: object, new: object, memory_budget: int | None) -> bool:
    if not isinstance(old, _Array):
        return _same_value(old, new)
    assert isinstance(new, _Array), "signatures match: both are arrays"
    if _is_keys(old):
        return _equal_keys(old, new)
    return not any(
        difference.block_difference(left, right)[2]
        for _, left, right in _paired_blocks([unrepeated(path, old, new)], memory_budget)
    )
