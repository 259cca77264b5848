"""Plain nested dicts from flat key paths, as the weight formats and renames build
their trees: each subtree found by its key path, and two leaves at one path, or one
inside the other, refused (`PathClash`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class PathClash(Exception):
    """Two leaves that `nested` would put at one key path, or one inside the other:
    `first` and `second` are their sources, `at` the key path of the first."""

    def __init__(self, first: str, second: str, at: tuple[str, ...]) -> None:
        super().__init__(first, second, at)
        self.first, self.second, self.at = first, second, at


_ABSENT = object()


def nested(items: Iterable[tuple[tuple[str, ...], object, str]]) -> dict[str, Any]:
    """Plain nested dicts holding each `(keys, leaf, source)` leaf at its key path.

    >>> nested([(("a", "b"), 1, "x"), (("a", "c"), 2, "y")])
    {'a': {'b': 1, 'c': 2}}
    """
    root: dict[str, Any] = {}
    placed: list[tuple[tuple[str, ...], str]] = []  # (what a clash's message names)
    # Each subtree this builds by its key path, told apart from leaves that are dicts:
    # siblings (a layer's weights) find their parent in one look-up, not a walk.
    subtrees: dict[tuple[str, ...], dict[str, Any]] = {(): root}
    for keys, leaf, source in items:
        node = subtrees.get(keys[:-1])
        if node is None:
            node = _subtree(subtrees, keys[:-1], placed, source)
        if keys[-1] in node:  # a leaf, or a subtree where this leaf goes
            inside = next(k for k, _ in placed if k[: len(keys)] == keys)
            raise PathClash(_placed_at(placed, inside), source, inside)
        node[keys[-1]] = leaf
        placed.append((keys, source))
    return root


def _subtree(
    subtrees: dict[tuple[str, ...], dict[str, Any]],
    keys: tuple[str, ...],
    placed: list[tuple[tuple[str, ...], str]],
    source: str,
) -> dict[str, Any]:
    """The subtree of `nested`'s tree at `keys`, made below the deepest one there is."""
    made = len(keys)
    while keys[:made] not in subtrees:
        made -= 1
    node = subtrees[keys[:made]]
    for depth in range(made, len(keys)):
        if keys[depth] in node:  # a leaf where this path needs a subtree
            prefix = keys[: depth + 1]
            raise PathClash(_placed_at(placed, prefix), source, prefix)
        child: dict[str, Any] = {}
        node[keys[depth]] = subtrees[keys[: depth + 1]] = child
        node = child
    return node


def _placed_at(placed: list[tuple[tuple[str, ...], str]], keys: tuple[str, ...]) -> str:
    """The source of the leaf `nested` placed at `keys` (the first, where it placed
    several one inside the other)."""
    return next(source for at, source in placed if at == keys)
