"""Walking pytrees: key paths, leaves, selecting subtrees, mapping leaves.

There is one tree model, `jax.tree_util`'s: every registered pytree node (dicts,
lists, tuples, NamedTuples, dataclasses, flax structs, `nnx.State`, `nnx.Variable`,
equinox Modules...) is a container, and walking or rebuilding a tree keeps its node
types; everything else (LazyArrays, arrays, strings, scalars) is a leaf, and None is
an empty subtree. A key path is written one way everywhere: each key as Orbax names
it on disk (a dict key, an attribute or field name, an index), joined by `/`, as in
`blocks/0/attn/kernel/value`.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import gc
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from lazyckpt._errors import NoMatchError, renamed
from lazyckpt._text import fold

Key = str | int
Path = tuple[Key, ...]

MAX_DEPTH = 512
"""The deepest tree lazyckpt builds from a checkpoint: jax's tree functions and
Python's recursion fail past about 1,000 levels."""
Predicate = Callable[[str, Any], bool]
Select = str | Sequence[str] | Predicate
"""What every verb's `select` argument takes: a path pattern, a list of patterns (a
leaf matching any of them is kept) or a predicate `(path, leaf) -> bool`."""

_tu = jax.tree_util


def key_of(entry: object) -> Key:
    """One entry of a jax key path as Orbax names it: `DictKey('a')` -> `'a'`,
    `GetAttrKey('mu')` -> `'mu'`, `SequenceKey(0)` -> `0`."""
    if isinstance(entry, _tu.DictKey):
        key = entry.key
        return key if isinstance(key, str | int) else str(key)
    if isinstance(entry, _tu.GetAttrKey):
        return str(entry.name)
    if isinstance(entry, _tu.SequenceKey):
        return int(entry.idx)
    if isinstance(entry, _tu.FlattenedIndexKey):
        return int(entry.key)
    return str(entry)


def path_of(key_path: Sequence[object]) -> Path:
    """A jax key path as a tuple of keys (see `key_of`)."""
    return tuple(key_of(entry) for entry in key_path)


def keystr(path: Path) -> str:
    """A key path as one string: `('params', 'layers', 0)` -> `'params/layers/0'`."""
    return "/".join(str(k) for k in path)


def flatten(tree: object) -> list[tuple[Path, Any]]:
    """`(key path, leaf)` for every leaf of `tree`, in `jax.tree_util` order."""
    flat, _ = _tu.tree_flatten_with_path(tree)
    return [(path_of(key_path), leaf) for key_path, leaf in flat]


def children(node: object) -> list[tuple[Key, Any]] | None:
    """The children of a pytree node with their keys; None if `node` is a leaf.

    None and empty containers are nodes without children.
    """
    if node is None:
        return []
    # Plain containers as jax.tree_util takes them apart (dict keys sorted), without a
    # call into jax: opened checkpoints are all dicts and lists.
    if type(node) is dict:
        return sorted(node.items(), key=lambda item: item[0])
    if type(node) is list or type(node) is tuple:
        return list(enumerate(node))
    flat, _ = _tu.tree_flatten_with_path(node, is_leaf=lambda child: child is not node)
    if len(flat) == 1 and not flat[0][0]:
        return None
    return [(key_of(key_path[0]), child) for key_path, child in flat]


def rebuild(node: object, new_children: Sequence[object]) -> Any:
    """A node of the same type and metadata as `node`, with `new_children`."""
    treedef = _tu.tree_structure(node, is_leaf=lambda child: child is not node)
    return _tu.tree_unflatten(treedef, new_children)


def leaves(tree: object) -> Iterator[tuple[str, Any]]:
    """`(key path string, leaf)` for every leaf of `tree`, in `jax.tree_util` order.

    Any registered pytree node is a container; LazyArrays, arrays, strings and
    scalars are leaves. As in `jax.tree_util`, None and empty containers are empty
    subtrees and yield nothing.

    >>> list(leaves({"a": [1, "x"], "b": None, "c": {}}))
    [('a/0', 1), ('a/1', 'x')]
    """
    return ((keystr(path), leaf) for path, leaf in flatten(tree))


def map_leaves(fn: Callable[[Any], Any], tree: object) -> Any:
    """`tree` with `fn` applied to each leaf; every node rebuilt as its own type."""
    return _tu.tree_map(fn, tree)


def subtree(tree: object, keys: Sequence[str]) -> Any:
    """The node of `tree` at the key path `keys` (each key as a string, so `'0'`
    finds list index 0 and int dict key 0); KeyError if there is none."""
    node = tree
    for depth, key in enumerate(keys):
        found = [child for child_key, child in children(node) or [] if str(child_key) == key]
        if not found:
            raise KeyError("/".join(keys[: depth + 1]))
        node = found[0]
    return node


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


def _as_predicate(pattern: Select, paths: list[list[str]]) -> Predicate:
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
    return pattern.replace(".", "/")


def _may_be_dotted(pattern: Select) -> bool:
    names = [pattern] if isinstance(pattern, str) else [] if callable(pattern) else pattern
    return any("." in name and "/" not in name for name in names)


_DROPPED = object()
_GLOB = re.compile(r"[*?[]")


@renamed(which="pattern")
def select(tree: object, pattern: Select) -> Any:
    """The part of `tree` whose leaves match `pattern`, without reading anything.

    Dicts keep only the selected keys; every other container (lists, tuples,
    NamedTuples, dataclasses, `nnx.State`...) keeps its type and shape, with None
    (an empty subtree) where nothing is selected, so that indices and fields keep
    their meaning. Flax NNX state paths end in `/value`: `blocks/*/attn/**` or
    `**/kernel/value` match them. Every verb's `select` argument takes the same.

    Args:
        tree: Any pytree.
        pattern: A path pattern: segments joined by `/`, `*` matching within a
            segment and `**` any number of segments; a pattern selects the whole
            subtree below what it matches. A pattern with dots and no `/` that
            matches nothing as written is read with its dots as `/`, so Hugging Face
            names select from safetensors trees (`model.layers.*.mlp.up_proj.weight`
            is `model/layers/*/mlp/up_proj/weight`). Or a list of patterns (a leaf
            matching any is kept), or a predicate `(path, leaf) -> bool`.

    Raises:
        NoMatchError: Nothing matched; the message shows the tree's paths nearest
            the pattern, or some of them.

    >>> tree = {"params": {"dense": {"kernel": 1, "bias": 2}}, "opt": {"mu": 3}}
    >>> select(tree, "params/**/kernel")
    {'params': {'dense': {'kernel': 1}}}
    >>> select(tree, lambda path, leaf: leaf > 1)
    {'params': {'dense': {'bias': 2}}, 'opt': {'mu': 3}}
    """
    paths = [path.split("/") for path, _ in leaves(tree)] if _may_be_dotted(pattern) else []
    picked = _select(tree, (), _as_predicate(pattern, paths))
    if picked is _DROPPED:
        shown = pattern if isinstance(pattern, str) or callable(pattern) else list(pattern)
        wanted = [] if callable(pattern) else [pattern] if isinstance(pattern, str) else pattern
        raise NoMatchError(f"{shown!r} matched no leaf of the tree; {near_paths(tree, wanted)}")
    return picked


def near_paths(tree: object, wanted: Sequence[str]) -> str:
    """The tree's paths nearest to the names in `wanted` (dots read as `/` too; globs
    are not names), or its first few paths: for an error message."""
    every = [path for path, _ in leaves(tree)]
    nodes = list(dict.fromkeys(p.rsplit("/", i)[0] for p in every for i in range(p.count("/") + 1)))
    near: list[str] = []
    for name in (n.strip("/") for n in wanted if not _GLOB.search(n)):
        for spelling in dict.fromkeys([name, name.replace(".", "/")]):
            near += difflib.get_close_matches(spelling, nodes, n=5, cutoff=0.6)
    if near:
        return f"the nearest paths are {list(dict.fromkeys(near))[:5]}"
    some = [line.path for line in fold((path, "") for path in every)][:5]
    return f"its paths look like {some}"


def selected(tree: object, pattern: Select | None) -> Any:
    """`select(tree, pattern)`, or the whole tree when `pattern` is None."""
    return tree if pattern is None else select(tree, pattern)


def _select(node: object, path: Path, predicate: Predicate) -> object:
    # Plain dicts keep their own key order; other nodes go in jax's order.
    kids = list(node.items()) if type(node) is dict else children(node)
    if kids is None:
        return node if predicate(keystr(path), node) else _DROPPED
    picked = [(key, _select(child, (*path, key), predicate)) for key, child in kids]
    if all(value is _DROPPED for _, value in picked):
        return _DROPPED
    if type(node) is dict:
        return {key: value for key, value in picked if value is not _DROPPED}
    return rebuild(node, [None if value is _DROPPED else value for _, value in picked])


class PathClash(Exception):
    """Two leaves that `nested` would put at one key path, or one inside the other:
    `first` and `second` are their sources, `at` the key path of the first."""

    def __init__(self, first: str, second: str, at: tuple[str, ...]) -> None:
        super().__init__(first, second, at)
        self.first, self.second, self.at = first, second, at


def nested(items: Iterable[tuple[tuple[str, ...], object, str]]) -> dict[str, Any]:
    """Plain nested dicts holding each `(keys, leaf, source)` leaf at its key path.

    >>> nested([(("a", "b"), 1, "x"), (("a", "c"), 2, "y")])
    {'a': {'b': 1, 'c': 2}}
    """
    root: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    subtrees = {id(root)}  # the dicts this builds, told apart from leaves that are dicts
    for keys, leaf, source in items:
        node = root
        for depth, key in enumerate(keys[:-1]):
            if key not in node:
                child = node[key] = {}
                subtrees.add(id(child))
                node = child
                continue
            child = node[key]
            if id(child) not in subtrees:  # a leaf where this path needs a subtree
                prefix = keys[: depth + 1]
                raise PathClash(sources[prefix], source, prefix)
            node = child
        if keys[-1] in node:  # a leaf, or a subtree where this leaf goes
            if keys in sources:
                raise PathClash(sources[keys], source, keys)
            inside = next(k for k in sources if k[: len(keys)] == keys)
            raise PathClash(sources[inside], source, inside)
        node[keys[-1]] = leaf
        sources[keys] = source
    return root


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building or reading a large tree.

    Opening and reading allocate a few objects per array, none in cycles, over which
    the collector's repeated passes cost a third of the time at 10,000 arrays
    (docs/benchmarks.md, Design measurements).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
