"""Selecting subtrees reads nothing; loading a selection reads only its arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from lazyckpt import LazyArray, NoMatchError
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
