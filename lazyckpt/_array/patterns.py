"""Key path patterns, as every verb's `select` takes them: segments joined by `/`, `*`
within a segment, `**` across segments, and sets of numbers in braces (`{3..60}`) as a
folded summary names its groups; dotted Hugging Face names read as key paths; a leading
`!` leaves out what the rest of the pattern matches."""

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
leaf matching any of them is kept, but one matching an exclusion, `!opt_state/**`) or
a predicate `(path, leaf) -> bool`."""


def _matches(pattern: list[str], path: list[str]) -> bool:
    """Glob match by segment: `*` within a segment, `**` across any number of them.

    A pattern also matches every path below a matching prefix, so `params` selects
    the whole `params` subtree. The pattern runs as an automaton over the path, its
    states the places in the pattern reached so far: work grows with the pattern's
    length times the path's, whatever their `**`s (a recursive search tries every way
    of spreading the path over them), and no path is too deep to match.
    """
    places = _past_deep(pattern, {0})
    for key in path:
        if len(pattern) in places:
            return True
        # Each distinct segment matched once (`**/x/**/x` asks about `x` twice).
        segments = {pattern[i] for i in places} - {"**"}
        matched = {segment for segment in segments if _segment_matches(segment, key)}
        after = {i for i in places if pattern[i] == "**"}  # `**` takes the key
        after.update(i + 1 for i in places if pattern[i] in matched)
        places = _past_deep(pattern, after)
        if not places:
            return False
    return len(pattern) in places


def _past_deep(pattern: list[str], places: set[int]) -> set[int]:
    """`places` and the places past each `**` they reach (a `**` may match no
    segment), each reached once; the end of the pattern is a place too."""
    reached = set(places)
    for i in sorted(places):
        while i < len(pattern) and pattern[i] == "**" and i + 1 not in reached:
            i += 1
            reached.add(i)
    return reached


# A set of numbers in braces, as folded names write them (`layer_{0..2,5}`).
_NUMBER_SET = re.compile(r"\{([0-9]+(?:\.\.[0-9]+){0,2}(?:,[0-9]+(?:\.\.[0-9]+){0,2})*)\}")


def _segment_matches(pattern: str, key: str) -> bool:
    """One key against one segment: a glob (`*`, `?`, `[...]`), in which a set of
    numbers in braces (`{3..60}`, `{0..2,5}`) matches a number in it, so a name a
    folded summary shows selects what it stands for. A key spelled with braces of its
    own matches as written too, and so may what follows any of the sets.

    The sets are matched in turn, each from where the numbers matched by the one
    before may end: work grows with the sets times the square of the key's numbers
    (a recursive search tries every way of spreading the numbers over the sets)."""
    if fnmatch.fnmatchcase(key, pattern):
        return True
    sets = _number_sets(pattern)
    if not sets:
        return False
    numbers = [(found.start(), found.end(), found[0]) for found in re.finditer("[0-9]+", key)]
    starts = {0}  # where the key's rest may start, past the sets matched so far
    for before, held, after in sets:
        ends: set[int] = set()
        for start, (first, end, digits) in itertools.product(sorted(starts), numbers):
            if (
                first >= start
                and end not in ends
                and held.holds(digits)
                and fnmatch.fnmatchcase(key[start:first], before)
            ):
                ends.add(end)
        if any(fnmatch.fnmatchcase(key[end:], after) for end in ends):
            return True
        starts = ends
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
def _number_sets(pattern: str) -> tuple[tuple[str, _NumberSet, str], ...]:
    """Each set of numbers in braces in `pattern`, with the glob before it (from the
    set before) and the pattern after it, parsed once: a folded name may list
    thousands of runs, matched against as many keys."""
    sets = []
    start = 0
    for found in _NUMBER_SET.finditer(pattern):
        sets.append((pattern[start : found.start()], _parsed(found[1]), pattern[found.end() :]))
        start = found.end()
    return tuple(sets)


def _parsed(inside: str) -> _NumberSet:
    """A set of numbers from what its braces hold: `0..2,5`, `000..099`, `0..60..2`."""
    runs = []
    widths: set[int] = set()
    for part in inside.split(","):
        ends = part.split("..")  # first[..last[..step]]
        first, last = ends[0], ends[min(1, len(ends) - 1)]
        widths.update(len(end) for end in (first, last) if len(end) > 1 and end[0] == "0")
        step = max(ascii_int(ends[2]) or 1, 1) if len(ends) > 2 else 1
        runs.append((ascii_int(first) or 0, ascii_int(last) or 0, step))
    width = max(widths, default=0)
    runs.sort()
    ordered = all(b < c for (_, b, _), (c, _, _) in itertools.pairwise(runs))
    return _NumberSet(tuple(runs), width, ordered)


def matches(pattern: str, path: str) -> bool:
    """Whether the key path `path` is selected by `pattern` (see `select`).

    >>> matches("params/**/kernel", "params/dense/kernel"), matches("opt", "params/w")
    (True, False)
    """
    return _matches(_parts(pattern), path.split("/") if path else [])


def as_predicate(pattern: Select, paths: list[list[str]]) -> Predicate:
    """`pattern` as a predicate: a leaf is kept where it matches one of the patterns
    and none of the exclusions (`!opt_state/**`); only exclusions keep every other
    leaf. `paths` (each split at `/`) decide how dotted names read (`spelled`)."""
    if callable(pattern):
        return pattern
    names = [pattern] if isinstance(pattern, str) else list(pattern)
    kept = [_parts(spelled(name, paths)) for name in names if not name.startswith("!")]
    dropped = [_parts(spelled(name, paths)) for name in exclusions(names)]
    everything = not kept and bool(dropped)

    def predicate(path: str, _leaf: Any) -> bool:
        split = path.split("/") if path else []
        if not everything and not any(_matches(parts, split) for parts in kept):
            return False
        return not any(_matches(parts, split) for parts in dropped)

    return predicate


def exclusions(pattern: Select) -> list[str]:
    """The patterns `pattern` leaves out, each without its `!`."""
    names = [] if callable(pattern) else [pattern] if isinstance(pattern, str) else pattern
    return [name[1:] for name in names if name.startswith("!")]


def unmatched_exclusions(pattern: Select, paths: list[list[str]]) -> list[str]:
    """The exclusions of `pattern` that match none of `paths`: a typo there would
    keep what the caller meant to leave out, so `select` refuses them."""
    missed = []
    for name in exclusions(pattern):
        parts = _parts(spelled(name, paths))
        if not any(_matches(parts, path) for path in paths):
            missed.append(name)
    return missed


def _parts(pattern: str) -> list[str]:
    """The segments of `pattern`, a run of `**`s as one (they match the same paths)."""
    parts = [part for part in pattern.strip("/").split("/") if part]
    return [part for i, part in enumerate(parts) if part != "**" or parts[i - 1 : i] != ["**"]]


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
