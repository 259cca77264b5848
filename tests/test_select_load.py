"""Selecting subtrees reads nothing; loading a selection reads only its arrays."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lazyckpt
from lazyckpt import LazyArray, NoMatchError
from lazyckpt._array.patterns import matches
from tests.helpers import data_reads, refuse_data_reads, stored_chunk_bytes


def _keys(tree: Any) -> list[str]:
    return [key for key, _ in lazyckpt.leaves(tree)]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("params/**/w", ["params/layers/0/w", "params/layers/1/w"]),
        ("params/*/kernel", ["params/dense/kernel"]),
        ("**/kernel", ["params/dense/kernel"]),
        ("params/dense", ["params/dense/bias", "params/dense/kernel"]),
        ("opt_state/m*", ["opt_state/mask", "opt_state/mu"]),
        ("params/layers/1", ["params/layers/1/w"]),
        ("/step/", ["step"]),
    ],
)
def test_select_by_pattern(saved: tuple[Path, Any], pattern: str, expected: list[str]) -> None:
    lazy = lazyckpt.open(saved[0])
    assert sorted(_keys(lazyckpt.select(lazy, pattern))) == expected


def test_select_keeps_list_positions(saved: tuple[Path, Any]) -> None:
    lazy = lazyckpt.open(saved[0])
    picked = lazyckpt.select(lazy, "params/layers/1/**")
    assert picked == {"params": {"layers": [None, {"w": lazy["params"]["layers"][1]["w"]}]}}


def test_select_by_predicate(saved: tuple[Path, Any]) -> None:
    lazy = lazyckpt.open(saved[0])
    big = lazyckpt.select(lazy, lambda _, leaf: isinstance(leaf, LazyArray) and leaf.nbytes > 4096)
    assert sorted(_keys(big)) == ["opt_state/mu", "params/dense/kernel"]


def test_select_nothing_is_an_error(saved: tuple[Path, Any]) -> None:
    lazy = lazyckpt.open(saved[0])
    with pytest.raises(
        NoMatchError,
        match=r"^'parms/\*\*' matched no leaf of the tree; its paths look like "
        r"\['lr', 'name', 'np_array', 'opt_state/mask', 'opt_state/mu'\]",
    ):
        lazyckpt.select(lazy, "parms/**")
    assert issubclass(NoMatchError, KeyError)


def test_select_reads_nothing(saved: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    lazy = lazyckpt.open(saved[0])

    refuse_data_reads(monkeypatch)
    picked = lazyckpt.select(lazy, "params/**")
    picked = lazyckpt.select(picked, lambda _, leaf: leaf.ndim == 2)
    assert sorted(_keys(picked)) == [
        "params/dense/kernel",
        "params/embed",
        "params/layers/0/w",
        "params/layers/1/w",
    ]
    with pytest.raises(AssertionError, match="array data of 'params/dense/kernel' was read"):
        lazyckpt.load(picked)


def test_load_of_a_selection_reads_only_the_selection(
    saved: tuple[Path, dict[str, Any]], count_bytes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, tree = saved
    lazy = lazyckpt.open(path)
    reads = data_reads(monkeypatch)
    with count_bytes() as read:
        loaded = lazyckpt.load(lazy, "params/dense/kernel")
    assert set(reads) == {"params/dense/kernel"}
    assert read[0] == stored_chunk_bytes(path, lazy["params"]["dense"]["kernel"])
    np.testing.assert_array_equal(
        loaded["params"]["dense"]["kernel"], np.asarray(tree["params"]["dense"]["kernel"])
    )
    assert list(loaded) == ["params"] and list(loaded["params"]) == ["dense"]


# Sets of numbers in braces, and the keys' numbers each holds.
_SETS = {
    "{1}": {"1"},
    "{2}": {"2"},
    "{1,3}": {"1", "3"},
    "{0..3}": {"0", "1", "2", "3"},
    "{01..03}": {"01", "02", "03"},
    "{1..9..4}": {"1", "5", "9"},
}


def _matches_by_search(pattern: str, path: str) -> bool:
    """`select`'s patterns by their definition: a search over every way of spreading
    the path's keys over the pattern's `**`s, and a key's numbers over a segment's sets
    in braces (`_SETS`; exponential in both: for small cases only)."""

    def keys(parts: list[str], at: list[str]) -> bool:
        if not parts:
            return True
        if parts[0] == "**":
            return any(keys(parts[1:], at[i:]) for i in range(len(at) + 1))
        return bool(at) and segment(parts[0], at[0]) and keys(parts[1:], at[1:])

    def segment(part: str, key: str) -> bool:
        if fnmatch.fnmatchcase(key, part):
            return True
        found = re.search("|".join(map(re.escape, _SETS)), part)
        if found is None:
            return False
        before, after = part[: found.start()], part[found.end() :]
        return any(
            digits[0] in _SETS[found[0]]
            and fnmatch.fnmatchcase(key[: digits.start()], before)
            and segment(after, key[digits.end() :])
            for digits in re.finditer("[0-9]+", key)
        )

    return keys([p for p in pattern.strip("/").split("/") if p], path.split("/") if path else [])


_PARTS = ["*", "?", "a", "a*", "[ab]", "{x}", *_SETS]
_SEGMENTS = st.lists(st.sampled_from(_PARTS), min_size=1, max_size=3).map("".join)
_KEY_PARTS = ["a", "b", "x", "1", "2", "3", "5", "01", "02", "11", "{x}", "{1}"]
_KEYS = st.lists(st.sampled_from(_KEY_PARTS), min_size=1, max_size=4).map("".join)


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(st.one_of(st.just("**"), _SEGMENTS), max_size=4).map("/".join),
    st.lists(_KEYS, max_size=5).map("/".join),
)
def test_patterns_select_what_their_definition_does(pattern: str, path: str) -> None:
    """Matched in polynomial time, a pattern selects what the search over every way
    of matching it selects."""
    assert matches(pattern, path) == _matches_by_search(pattern, path)


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("**/" * 8 + "x", "/".join(["a"] * 40), False),
        ("**/" * 8 + "x", "/".join(["a"] * 40 + ["x"]), True),
        ("/".join(["**/a"] * 8) + "/x", "/".join(["a"] * 40), False),
        ("/".join(["**/a"] * 8) + "/x", "/".join(["a"] * 40 + ["x"]), True),
        ("*{1}" * 8, "1a" * 30 + "b", False),
        ("*{1}" * 8, "1a" * 30 + "1", True),
        ("**/" + "*{1}" * 8 + "/**/x", "/".join(["1a" * 30] * 30), False),
    ],
    ids=["deep", "deep-found", "deep-named", "deep-named-found", "sets", "sets-found", "both"],
)
def test_adversarial_patterns_match_in_polynomial_work(
    pattern: str, path: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patterns on which a search over every way of matching them never ends: 8 `**`s
    over 40 keys are C(48, 8) = 377 million ways, 8 sets over 30 numbers C(30, 8) =
    5.8 million. Matched as an automaton, a few thousand glob matches decide them."""
    glob_match = fnmatch.fnmatchcase
    count = 0

    def counted(name: str, pattern: str) -> bool:
        nonlocal count
        count += 1
        assert count <= 20_000, "the pattern took more than 20,000 glob matches"
        return glob_match(name, pattern)

    monkeypatch.setattr(fnmatch, "fnmatchcase", counted)
    assert matches(pattern, path) is expected


def test_select_walks_trees_as_deep_as_checkpoints_nest() -> None:
    """A tree nesting 512 levels, as deep as a checkpoint's tree may (Orbax restores
    511), selects like any other; one deeper is refused by name, as every verb
    refuses it, not with a RecursionError."""
    deep: Any = np.zeros(2, np.float32)
    for _ in range(511):
        deep = {"n": deep}
    path = "/".join(["n"] * 511)
    assert _keys(lazyckpt.select(deep, "n/**")) == [path]
    assert _keys(lazyckpt.select(deep, "**/n")) == [path]
    with pytest.raises(
        lazyckpt.LazyTypeError,
        match=r"^n/n/n/n/\.\.\./n/n \(513 keys\): the tree nests deeper there than the 512 "
        r"levels lazyckpt walks .*; join some of its keys into one",
    ):
        lazyckpt.select({"n": {"n": deep}}, "n/**")
