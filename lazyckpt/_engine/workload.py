"""What a verb goes through, weighed against what its arrays store: a file of a few
kilobytes can declare terabytes of views that read the same stored bytes again and
again (tensors saved `expand`ed, 10,000 of them over one storage; overlapping
windows). `stats`, `diff`, `save` and `convert` add up the bytes they would compute or
write, after `repeats.core`, and `check` refuses a call past `repeats.excessive` of the
bytes stored (`distinct_nbytes`), by name, before any read."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence

from lazyckpt._array import repeats
from lazyckpt._array.compose import sources
from lazyckpt._array.geometry import bounds
from lazyckpt._array.view import ArrayView
from lazyckpt._engine.stored import StoredArray
from lazyckpt._errors import ArgumentError
from lazyckpt._text import human_bytes

NAMED = 3
"""How many of the largest arrays a refusal names."""


def distinct_nbytes(views: Iterable[ArrayView]) -> int:
    """The stored bytes that `views` read, each counted once however many views read
    it: per place (a file; `StoredArray.extent`), the union of the byte spans their
    sources cover, or the bytes those read where that is less (a strided view)."""
    spans: dict[object, list[tuple[int, int]]] = collections.defaultdict(list)
    read: dict[object, int] = collections.defaultdict(int)
    for view in views:
        for source in sources(view):
            stored = source.stored
            count = math.prod(source.selection.shape)
            if not isinstance(stored, StoredArray) or not count:
                continue
            place, origin = stored.extent()
            itemsize = stored.dtype.itemsize
            first, last = _flat_span(stored.shape, bounds(source.selection))
            spans[place].append((origin + first * itemsize, origin + last * itemsize))
            read[place] += count * itemsize
    return sum(min(_union(spans[place]), read[place]) for place in spans)


def _flat_span(shape: Sequence[int], box: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The first element of `box` in C order, and one past its last."""
    first = last = 0
    for n, (low, high) in zip(shape, box, strict=True):
        first, last = first * n + low, last * n + high - 1
    return first, last + 1


def _union(spans: list[tuple[int, int]]) -> int:
    """How many bytes the half-open `spans` cover together."""
    total, reach = 0, None
    for low, high in sorted(spans):
        if reach is None or low > reach:
            total += high - low
            reach = high
        elif high > reach:
            total += high - reach
            reach = high
    return total


def check(
    doing: str, works: Sequence[tuple[str, int]], stored_nbytes: Callable[[], int], fix: str
) -> None:
    """Refuse a call whose arrays, `(key, bytes it goes through)` each, add up past
    `repeats.excessive` of the bytes they store (`stored_nbytes()`, asked only where
    they pass `repeats.FLOOR`), naming the largest: `doing` says what it would do
    with them ("stats would go through"), `fix` what to do instead."""
    total = sum(n for _, n in works)
    if total <= repeats.FLOOR:
        return
    stored = stored_nbytes()
    if not repeats.excessive(total, stored):
        return
    largest = sorted(works, key=lambda item: -item[1])[:NAMED]
    named = ", ".join(f"{key} ({human_bytes(n)})" for key, n in largest)
    more = len(works) - len(largest)
    raise ArgumentError(
        f"{doing} {human_bytes(total)} in all, {len(works):,} arrays made of "
        f"{human_bytes(stored)} stored: views that read the same stored bytes again and "
        "again (tensors saved expanded, strides 0; many tensors over one storage; "
        f"overlapping windows). The largest: {named}"
        f"{f' and {more:,} more' if more else ''}. {fix}"
    )
