"""Walking pytrees: key paths, leaves, selecting subtrees, mapping leaves.

There is one tree model, `jax.tree_util`'s: every registered pytree node (dicts,
lists, tuples, NamedTuples, dataclasses, flax structs, `nnx.State`, `nnx.Variable`,
equinox Modules...) is a container, and walking or rebuilding a tree keeps its node
types; everything else (LazyArrays, arrays, strings, scalars) is a leaf, and None is
an empty subtree. A key path is written one way everywhere: each key as Orbax names
it on disk (a dict key, an attribute or field name, an index), joined by `/`, as in
`blocks/0/attn/kernel/value`.

Plain dicts, lists and tuples, and None, are walked here in jax's order (dict keys
sorted) without jax, so that opening, walking and reading a checkpoint never wait for
its import. Other nodes are jax's to take apart: registering a node type takes jax, so
before it is imported only subclasses of dict and tuple that it registers itself
(OrderedDict, defaultdict, NamedTuples) may be nodes, and import it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import gc
import operator
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lazyckpt._array.patterns import Predicate as Predicate
from lazyckpt._array.patterns import Select as Select
from lazyckpt._array.patterns import as_predicate, exclusions, may_be_dotted, unmatched_exclusions
from lazyckpt._errors import LazyTypeError, NoMatchError, renamed
from lazyckpt._text import fold, printable

if TYPE_CHECKING:
    from types import ModuleType

Key = str | int
_T = TypeVar("_T")
Path = tuple[Key, ...]

MAX_DEPTH = 512
"""The deepest tree lazyckpt builds from a checkpoint: jax's tree functions and
Python's recursion fail past about 1,000 levels."""


@functools.cache
def _tree_util() -> ModuleType:
    """`jax.tree_util`, imported on first use."""
    import jax.tree_util

    return jax.tree_util


def _plain(node: Any) -> Iterable[tuple[Any, Any]] | None:
    """The children of a plain dict (in jax's order), list or tuple with their keys,
    and no children for None; None for any other object, and for a dict whose keys do
    not sort (1 and 'a'), which jax refuses with its own error."""
    kind = type(node)
    if kind is dict:
        try:
            return sorted(node.items(), key=operator.itemgetter(0))
        except TypeError:
            return None
    if kind is list or kind is tuple:
        return enumerate(node)
    return () if node is None else None


def _for_jax(node: object) -> bool:
    """Whether `node`, not a plain container, is a pytree node, for jax to take apart.
    Before jax is imported, only a subclass of dict, list or tuple may be one (jax
    registers OrderedDict, defaultdict and NamedTuples itself): jax decides then."""
    if type(node) in _LEAF_TYPES:
        return False
    if "jax" in sys.modules:
        return not _tree_util().all_leaves((node,))
    return isinstance(node, dict | list | tuple)


_LEAF_TYPES: set[type] = set()


def leaf_type(kind: type[_T]) -> type[_T]:
    """Mark `kind`, a type of lazyckpt's that no one registers as a pytree node, as a
    leaf of every tree without asking jax: a walk of 100,000 LazyArrays asks it 100,000
    times otherwise."""
    _LEAF_TYPES.add(kind)
    return kind


def _remade(node: object, kids: dict[Any, Any]) -> Any:
    """A plain container (see `_plain`) of `node`'s type with the children `kids`."""
    if type(node) is dict:
        return kids
    # (a list or a tuple: mypy knows only that it is some type)
    return None if node is None else type(node)(kids.values())  # type: ignore[call-arg]


def _dict_key(key: object) -> Key:
    return key if isinstance(key, str | int) else str(key)


_R = TypeVar("_R")


def fold_tree(
    tree: object,
    split: Callable[[Any], Iterable[tuple[Any, Any]] | None],
    leaf: Callable[[Path, Any], _R],
    node: Callable[[Any, Path, list[tuple[Any, _R]]], _R],
) -> _R:
    """What `node(node, path, [(key, what its child gave), ...])` makes of `tree`,
    children first, with `leaf(path, leaf)` for each leaf; `split(node)` gives a
    node's children with their keys, or None for a leaf.

    A loop over a stack, not a recursion, so no tree is too deep for Python; one
    deeper than `MAX_DEPTH` is refused by name, as no checkpoint holds it and jax's
    tree functions fail on it.
    """
    kids = split(tree)
    if kids is None:
        return leaf((), tree)
    # For each node being walked: its key, itself, its path, its children to come and
    # what those walked gave.
    stack: list[tuple[Any, Any, Path, Iterator[tuple[Any, Any]], list[tuple[Any, _R]]]]
    stack = [(None, tree, (), iter(kids), [])]
    while True:
        key, parent, path, todo, done = stack[-1]
        for child_key, child in todo:
            child_path = (*path, _dict_key(child_key))
            if len(child_path) > MAX_DEPTH:
                raise too_deep(child_path)
            kids = split(child)
            if kids is None:
                done.append((child_key, leaf(child_path, child)))
            else:  # its children first; this node's rest after them
                stack.append((child_key, child, child_path, iter(kids), []))
                break
        else:
            stack.pop()
            made = node(parent, path, done)
            if not stack:
                return made
            stack[-1][4].append((key, made))


def too_deep(path: Path) -> LazyTypeError:
    """The error for a tree that nests past `MAX_DEPTH` at `path`."""
    shown = keystr(path) if len(path) <= 8 else f"{keystr(path[:4])}/.../{keystr(path[-2:])}"
    return LazyTypeError(
        f"{printable(shown)} ({len(path)} keys): the tree nests deeper there than the "
        f"{MAX_DEPTH} levels lazyckpt walks (no checkpoint nests deeper, and jax's tree "
        "functions fail past about 1,000); join some of its keys into one (a dict keyed "
        "'a/b/c' in place of three levels) or keep that part out of the tree"
    )


@contextlib.contextmanager
def walked_by_jax(tree: object) -> Iterator[None]:
    """Around a walk of `tree` by jax's tree functions, which fail past about 1,000
    levels (a SystemError raised from a RecursionError): a tree deeper than
    `MAX_DEPTH` refused by name instead (see `too_deep`). A walk that calls back into
    Python (`is_leaf=`) must `check_depth` first."""
    try:
        yield
    except SystemError as error:
        if not isinstance(error.__cause__, RecursionError):
            raise
        check_depth(tree)
        raise


def check_depth(tree: object) -> None:
    """Refuse `tree` by name if it nests deeper than `MAX_DEPTH` (see `too_deep`).

    Before jax walks a tree calling back into Python (`is_leaf=`): past about 1,000
    levels the callback raises a RecursionError, and jax (0.10) leaves the
    interpreter's recursion depth spent, so that every later call fails too.
    """
    fold_tree(tree, _any_order, lambda path, leaf: None, lambda node, path, done: None)


def _any_order(node: object) -> Iterable[tuple[Any, Any]] | None:
    """The children of `node` in any order (a dict's keys need not sort), as far as
    depth goes: a node that jax cannot take apart counts as a leaf here, and the walk
    that follows says why."""
    if type(node) is dict:
        return node.items()
    try:
        return children(node)
    except (ValueError, TypeError):
        return None


def key_of(entry: object) -> Key:
    """One entry of a jax key path as Orbax names it: `DictKey('a')` -> `'a'`,
    `GetAttrKey('mu')` -> `'mu'`, `SequenceKey(0)` -> `0`."""
    tu = _tree_util()
    if isinstance(entry, tu.DictKey):
        return _dict_key(entry.key)
    if isinstance(entry, tu.GetAttrKey):
        return str(entry.name)
    if isinstance(entry, tu.SequenceKey):
        return int(entry.idx)
    if isinstance(entry, tu.FlattenedIndexKey):
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
    out: list[tuple[Path, Any]] = []

    def leaf(path: Path, node: object) -> None:
        if not _for_jax(node):
            out.append((path, node))
            return
        with walked_by_jax(node):
            flat, _ = _tree_util().tree_flatten_with_path(node)
        out.extend(((*path, *path_of(key_path)), leaf) for key_path, leaf in flat)

    fold_tree(tree, _plain, leaf, lambda node, path, done: None)
    return out


def leaf_values(tree: object) -> list[Any]:
    """The leaves of `tree` without their key paths, in `jax.tree_util` order."""
    if "jax" in sys.modules:  # (its walk is in C, and faster)
        with walked_by_jax(tree):
            return list(_tree_util().tree_leaves(tree))
    return [leaf for _, leaf in flatten(tree)]


def children(node: object) -> list[tuple[Key, Any]] | None:
    """The children of a pytree node with their keys; None if `node` is a leaf.

    None and empty containers are nodes without children.
    """
    kids = _plain(node)
    if kids is not None:
        return list(kids)
    if not _for_jax(node):
        return None
    flat, _ = _tree_util().tree_flatten_with_path(node, is_leaf=lambda child: child is not node)
    if len(flat) == 1 and not flat[0][0]:
        return None
    return [(key_of(key_path[0]), child) for key_path, child in flat]


def rebuild(node: object, new_children: Sequence[object]) -> Any:
    """A node of the same type and metadata as `node`, with `new_children`."""
    kids = _plain(node)
    if kids is not None and len(keys := [key for key, _ in kids]) == len(new_children):
        return _remade(node, dict(zip(keys, new_children, strict=True)))
    tu = _tree_util()  # (which also refuses a wrong number of children)
    treedef = tu.tree_structure(node, is_leaf=lambda child: child is not node)
    return tu.tree_unflatten(treedef, new_children)


def leaves(tree: object) -> Iterator[tuple[str, Any]]:
    """`(key path string, leaf)` for every leaf of `tree`, in `jax.tree_util` order.

    Any registered pytree node is a container; LazyArrays, arrays, strings and
    scalars are leaves. As in `jax.tree_util`, None and empty containers are empty
    subtrees and yield nothing.

    >>> list(leaves({"a": [1, "x"], "b": None, "c": {}}))
    [('a/0', 1), ('a/1', 'x')]
    """
    out: list[tuple[str, Any]] = []
    with gc_paused():
        _leaves_into(tree, None, out)
    return iter(out)


def _leaves_into(
    node: object, path: str | None, out: list[tuple[str, Any]], depth: int = 0
) -> None:
    """`_flatten_into` with each key path as its string as it goes (None at the root),
    joined once per node rather than once per leaf; a recursion (faster than a loop
    over a stack), refused past `MAX_DEPTH` as `fold_tree` refuses. A child of a
    type marked `leaf_type` (a LazyArray) is taken where it is, without a call: a
    model's tree holds 100,000 of them."""
    kids = _plain(node)
    if kids is not None:
        prefix = "" if path is None else f"{path}/"
        for key, child in kids:
            name = key if type(key) is str else str(_dict_key(key))
            if depth == MAX_DEPTH:
                raise too_deep((*(path or "").split("/"), name))
            if type(child) in _LEAF_TYPES:
                out.append((prefix + name, child))
            else:
                _leaves_into(child, prefix + name, out, depth + 1)
    elif not _for_jax(node):
        out.append((path or "", node))
    else:
        above = () if path is None else (path,)
        flat, _ = _tree_util().tree_flatten_with_path(node)
        out.extend((keystr((*above, *path_of(key_path))), leaf) for key_path, leaf in flat)


def map_leaves(fn: Callable[[Any], Any], tree: object) -> Any:
    """`tree` with `fn` applied to each leaf; every node rebuilt as its own type (a
    dict with its keys sorted, as `jax.tree_util.tree_map` rebuilds it)."""
    if "jax" in sys.modules:  # (its walk is in C, and faster)
        with walked_by_jax(tree):
            return _tree_util().tree_map(fn, tree)
    return map_with_path(lambda _, leaf: fn(leaf), tree)


def map_with_path(
    fn: Callable[[Path, Any], Any], tree: object, *, none_is_leaf: bool = False
) -> Any:
    """`tree` with `fn(key path, leaf)` in place of each leaf, as `map_leaves`; with
    `none_is_leaf`, None is a leaf too (a target's None: a subtree left as it is)."""

    def split(node: object) -> Iterable[tuple[Any, Any]] | None:
        return None if node is None and none_is_leaf else _plain(node)

    def leaf(path: Path, node: object) -> Any:
        if node is None or not _for_jax(node):
            return fn(path, node)
        if none_is_leaf:
            check_depth(node)
        with walked_by_jax(node):
            return _tree_util().tree_map_with_path(
                lambda key_path, leaf: fn((*path, *path_of(key_path)), leaf),
                node,
                is_leaf=(lambda leaf: leaf is None) if none_is_leaf else None,
            )

    return fold_tree(tree, split, leaf, lambda node, path, done: _remade(node, dict(done)))


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
            segment, `**` any number of segments, and a set of numbers in braces
            (`layers/{3..60}`, `layer_{0..2,5}`) a number in it, as a folded
            `summary` names its groups; a pattern selects the whole subtree below
            what it matches. A pattern with dots and no `/` that
            matches nothing as written is read with its dots as `/`, so Hugging Face
            names select from safetensors trees (`model.layers.*.mlp.up_proj.weight`
            is `model/layers/*/mlp/up_proj/weight`). Within a segment `?` and
            `[...]` match as in `fnmatch` (a literal `[` is `[[]`); a key that holds
            `/` reads as segments, like the nested keys it spells. Or a list of
            patterns (a leaf matching any is kept), or a predicate
            `(path, leaf) -> bool`. A pattern that begins with `!` leaves out
            what the rest of it matches: the leaves matching any other pattern are
            kept but those matching an exclusion, and exclusions alone keep every
            other leaf (`["params/**", "!**/bias"]`; `"!opt_state/**"`). A key that
            itself begins with `!` is matched by `?` there.

    Raises:
        NoMatchError: Nothing matched, or an exclusion matched no leaf; the message
            shows the tree's paths nearest the pattern, or some of them.

    >>> tree = {"params": {"dense": {"kernel": 1, "bias": 2}}, "opt": {"mu": 3}}
    >>> select(tree, "params/**/kernel")
    {'params': {'dense': {'kernel': 1}}}
    >>> select(tree, "!opt/**")
    {'params': {'dense': {'kernel': 1, 'bias': 2}}}
    >>> select(tree, lambda path, leaf: leaf > 1)
    {'params': {'dense': {'bias': 2}}, 'opt': {'mu': 3}}
    >>> select({"layer_0": 0, "layer_1": 1, "layer_2": 2, "layer_3": 3}, "layer_{0,2..3}")
    {'layer_0': 0, 'layer_2': 2, 'layer_3': 3}
    >>> select({"[k]": 1, "k": 2}, "[[]k]")
    {'[k]': 1}
    """
    every = may_be_dotted(pattern) or exclusions(pattern)
    paths = [path.split("/") for path, _ in leaves(tree)] if every else []
    missed = unmatched_exclusions(pattern, paths)
    if missed:
        raise NoMatchError(
            f"the exclusion {'!' + missed[0]!r} matched no leaf of the tree, so it would "
            f"leave nothing out; {near_paths(tree, [name.removesuffix('/**') for name in missed])}"
        )
    picked = _select(tree, as_predicate(pattern, paths))
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


def _select(tree: object, predicate: Predicate) -> object:
    def split(node: object) -> Iterable[tuple[Any, Any]] | None:
        # Plain dicts keep their own key order; other nodes go in jax's order.
        return list(node.items()) if type(node) is dict else children(node)

    def leaf(path: Path, node: object) -> object:
        return node if predicate(keystr(path), node) else _DROPPED

    def kept(node: object, path: Path, picked: list[tuple[Any, object]]) -> object:
        if all(value is _DROPPED for _, value in picked):
            return _DROPPED
        if type(node) is dict:
            return {key: value for key, value in picked if value is not _DROPPED}
        return rebuild(node, [None if value is _DROPPED else value for _, value in picked])

    return fold_tree(tree, split, leaf, kept)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building or reading a large tree.

    Opening and reading allocate a few objects per array, none in cycles, over which
    the collector's repeated passes cost a third of the time at 10,000 arrays
    (docs/benchmarks.md, Design measurements). On the way out, what was made meanwhile
    goes to the oldest generation, where the passes it skipped would have put what
    lives on (a tree): left in the youngest, the first pass after would walk it all
    (docs/benchmarks.md, section 28). (Freezing and unfreezing at once moves it there; not when
    the program has frozen objects itself, which unfreezing would release.)
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
