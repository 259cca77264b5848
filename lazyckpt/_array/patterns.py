"""Key path patterns, as every verb's `select` takes them: segments joined by `/`, `*`
within a segment, `**` across segments, and sets of numbers in braces (`{3..60}`) as a
folded summary names its groups; dotted Hugging Face names read as key paths."""

from __future__ import annotations

import bisect
import fnmatch
import functools
import itertools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from lazyckpt._text import ascii_int

Predicate = Callable[[str, Any], bool]
Select = str | Sequence[str] | Predicate
"""What every verb's `select` argument takes: a path pattern, a list of patterns (a
leaf matching any of them is kept) or a predicate `(path, leaf) -> bool`."""


def _matches(pattern: list[str], path: list[str]) -> bool:
    """Glob match by segment: `*` within a segment, `**` across any number of them.

    A pattern also matches every path below a matching prefix, so `params` selects
    the whole `params` subtree.
    """
    if not pattern:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_matches(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and _segment_matches(head, path[0]) and _matches(rest, path[1:])


# A set of numbers in braces, as folded names write them (`layer_{0..2,5}`).
_NUMBER_SET = re.compile(r"\{([0-9]+(?:\.\.[0-9]+){0,2}(?:,[0-9]+(?:\.\.[0-9]+){0,2})*)\}")


def _segment_matches(pattern: str, key: str) -> bool:
    """One key against one segment: a glob (`*`, `?`, `[...]`), in which a set of
    numbers in braces (`{3..60}`, `{0..2,5}`) matches a number in it, so a name a
    folded summary shows selects what it stands for. A key spelled with braces of its
    own matches as written too."""
    if fnmatch.fnmatchcase(key, pattern):
        return True
    found = _number_set(pattern)
    if found is None:
        return False
    before, numbers, after = found
    for digits in re.finditer("[0-9]+", key):
        if (
            numbers.holds(digits[0])
            and fnmatch.fnmatchcase(key[: digits.start()], before)
            and _segment_matches(after, key[digits.end() :])
        ):
            return True
    return False


@attrs.frozen
class _NumberSet:
    """A set of numbers as written in braces: runs `first..last..step`, in order."""

    runs: tuple[tuple[int, int, int], ...]
    width: int
    """The digits each number is written with, zero-padded (`{000..099}`); 0: as is."""
    ordered: bool
    """Whether each run ends before the next starts (as folded names write them)."""

    def holds(self, digits: str) -> bool:
        """Whether the number `digits` is in the set, written as the set writes numbers:
        with leading zeros to its width, or without any."""
        number = ascii_int(digits)
        padded = len(digits) > 1 and digits.startswith("0")
        if number is None or (len(digits) != self.width if self.width else padded):
            return False
        runs = self.runs
        if self.ordered:  # the one run that can hold it
            at = bisect.bisect_right(runs, (number, math.inf, math.inf)) - 1
            runs = runs[at : at + 1] if at >= 0 else ()
        return any(a <= number <= b and (number - a) % step == 0 for a, b, step in runs)


@functools.lru_cache(maxsize=256)
def _number_set(pattern: str) -> tuple[str, _NumberSet, str] | None:
    """`pattern` around its first set of numbers in braces, parsed once: a folded name
    may list thousands of runs, matched against as many keys."""
    found = _NUMBER_SET.search(pattern)
    if found is None:
        return None
    runs = []
    widths: set[int] = set()
    for part in found[1].split(","):
        ends = part.split("..")  # first[..last[..step]]
        first, last = ends[0], ends[min(1, len(ends) - 1)]
        widths.update(len(end) for end in (first, last) if len(end) > 1 and end[0] == "0")
        step = max(ascii_int(ends[2]) or 1, 1) if len(ends) > 2 else 1
        runs.append((ascii_int(first) or 0, ascii_int(last) or 0, step))
    width = max(widths, default=0)
    runs.sort()
    ordered = all(b < c for (_, b, _), (c, _, _) in itertools.pairwise(runs))
    numbers = _NumberSet(tuple(runs), width, ordered)
    return pattern[: found.start()], numbers, pattern[found.end() :]


def matches(pattern: str, path: str) -> bool:
    """Whether the key path `path` is selected by `pattern` (see `select`).

    >>> matches("params/**/kernel", "params/dense/kernel"), matches("opt", "params/w")
    (True, False)
    """
    parts = [part for part in pattern.strip("/").split("/") if part]
    return _matches(parts, path.split("/") if path else [])


def any_of(patterns: Sequence[str]) -> Predicate:
    """A predicate for `select` that keeps leaves matching any of `patterns`.

    >>> keep = any_of(["a", "c/**"])
    >>> keep("a", 1), keep("b", 2), keep("c/d", 3)
    (True, False, True)
    """
    parts = list(patterns)
    return lambda path, _leaf: any(matches(pattern, path) for pattern in parts)


def as_predicate(pattern: Select, paths: list[list[str]]) -> Predicate:
    if callable(pattern):
        return pattern
    if not isinstance(pattern, str):
        return any_of([spelled(p, paths) for p in pattern])
    parts = _parts(spelled(pattern, paths))
    return lambda path, _leaf: _matches(parts, path.split("/") if path else [])


def _parts(pattern: str) -> list[str]:
    return [part for part in pattern.strip("/").split("/") if part]


def spelled(pattern: str, paths: list[list[str]]) -> str:
    """`pattern`, or, when it has dots, no `/` and matches none of `paths` (each split
    at `/`) as written, the pattern with its dots read as `/`: a Hugging Face name
    (`model.layers.*.mlp.up_proj.weight`) for the key path safetensors trees use
    (`model/layers/*/mlp/up_proj/weight`). A key with dots of its own (Orbax allows
    them) is matched as written first, so it keeps its meaning.

    >>> spelled("model.norm.weight", [["model", "norm", "weight"]])
    'model/norm/weight'
    >>> spelled("step.count", [["step.count"]])
    'step.count'
    """
    if "/" in pattern or "." not in pattern:
        return pattern
    parts = _parts(pattern)
    if any(_matches(parts, path) for path in paths):
        return pattern
    # Dots between names, not the `..` of a set of numbers (`layers.{0..2}.mlp`).
    return re.sub(r"(?<!\.)\.(?!\.)", "/", pattern)


def may_be_dotted(pattern: Select) -> bool:
    names = [pattern] if isinstance(pattern, str) else [] if callable(pattern) else pattern
    return any("." in name and "/" not in name for name in names)
