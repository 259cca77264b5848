"""Walking lazy trees: key paths, selecting subtrees, and loading them to host."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lazyckpt._errors import NoMatchError

Path = tuple[str | int, ...]
Predicate = Callable[[str, Any], bool]


def keystr(path: Path) -> str:
    """A key path as one string: `('params', 'layers', 0)` -> `'params/layers/0'`."""
    return "/".join(str(k) for k in path)


def children_of(node: Any) -> Iterator[tuple[str | int, Any]] | None:
    if isinstance(node, dict):
        return iter(node.items())
    if isinstance(node, list | tuple):
        return iter(enumerate(node))
    return None


def leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """`(key path string, leaf)` for every leaf of `tree`, in tree order.

    Dicts, lists and tuples are containers; everything else (LazyArrays, arrays,
    strings, scalars) is a leaf. As in `jax.tree_util`, None and empty containers
    are empty subtrees and yield nothing.

    >>> list(leaves({"a": [1, "x"], "b": None, "c": {}}))
    [('a/0', 1), ('a/1', 'x')]
    """
    return ((keystr(path), leaf) for path, leaf in walk(tree))


def walk(tree: Any, *, empty_containers: bool = False) -> Iterator[tuple[Path, Any]]:
    """`(key path, leaf)` for every leaf; empty containers too if asked."""
    yield from _walk(tree, (), empty_containers)


def _walk(node: Any, path: Path, empty: bool) -> Iterator[tuple[Path, Any]]:
    if node is None:  # an empty subtree, as in jax.tree_util
        if empty and path:
            yield path, node
        return
    children = children_of(node)
    if children is None or (empty and not node):
        if children is None or path:
            yield path, node
        return
    for key, child in children:
        yield from _walk(child, (*path, key), empty)


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
    return bool(path) and fnmatch.fnmatchcase(path[0], head) and _matches(rest, path[1:])


def matches(pattern: str, path: str) -> bool:
    """Whether the key path `path` is selected by `pattern` (see `select`).

    >>> matches("params/**/kernel", "params/dense/kernel"), matches("opt", "params/w")
    (True, False)
    """
    parts = [part for part in pattern.strip("/").split("/") if part]
    return _matches(parts, path.split("/") if path else [])


def any_of(patterns: Sequence[str]) -> Predicate:
    """A predicate for `select` that keeps leaves matching any of `patterns`.

    >>> select({"a": 1, "b": 2, "c": 3}, any_of(["a", "c"]))
    {'a': 1, 'c': 3}
    """
    parts = list(patterns)
    return lambda path, _leaf: any(matches(pattern, path) for pattern in parts)


def _as_predicate(which: str | Predicate) -> Predicate:
    if callable(which):
        return which
    pattern = [part for part in which.strip("/").split("/") if part]
    return lambda path, _leaf: _matches(pattern, path.split("/") if path else [])


_DROPPED = object()


def select(tree: Any, which: str | Predicate) -> Any:
    """The part of `tree` whose leaves match `which`, without reading anything.

    `which` is a path pattern (segments joined by `/`; `*` matches within a
    segment, `**` any number of segments; a pattern selects whole subtrees below
    what it matches) or a predicate `(path, leaf) -> bool`. Dicts keep only
    selected keys; lists keep their length and put None (an empty subtree) where
    nothing is selected, so indices keep their meaning.

    >>> tree = {"params": {"dense": {"kernel": 1, "bias": 2}}, "opt": {"mu": 3}}
    >>> select(tree, "params/**/kernel")
    {'params': {'dense': {'kernel': 1}}}
    >>> select(tree, lambda path, leaf: leaf > 1)
    {'params': {'dense': {'bias': 2}}, 'opt': {'mu': 3}}
    """
    predicate = _as_predicate(which)
    picked = _select(tree, (), predicate)
    if picked is _DROPPED:
        some = [path for path, _ in leaves(tree)][:5]
        raise NoMatchError(f"{which!r} matched no leaf of the tree; its paths look like {some}")
    return picked


def _select(node: Any, path: Path, predicate: Predicate) -> Any:
    children = children_of(node)
    if children is None:
        return node if predicate(keystr(path), node) else _DROPPED
    picked = [(key, _select(child, (*path, key), predicate)) for key, child in children]
    if all(value is _DROPPED for _, value in picked):
        return _DROPPED
    if isinstance(node, dict):
        return {key: value for key, value in picked if value is not _DROPPED}
    kept = [None if value is _DROPPED else value for _, value in picked]
    return kept if isinstance(node, list) else tuple(kept)


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` with `fn` applied to each leaf; dicts, lists and tuples rebuilt."""
    children = children_of(tree)
    if children is None:
        return fn(tree)
    mapped = [(key, map_leaves(fn, child)) for key, child in children]
    if isinstance(tree, dict):
        return dict(mapped)
    values = [value for _, value in mapped]
    return values if isinstance(tree, list) else tuple(values)
