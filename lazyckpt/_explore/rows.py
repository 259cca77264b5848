"""The rows a summary shows: the tree walked once, then laid out folded or in full.

Folding is what makes a 100,000-array model readable. DeepSeek-V3's 61 layers of 256
experts are 92,000 arrays but a few dozen distinct subtrees. Each subtree gets a
signature: an int standing for its structure (keys, container types, and each leaf's
type, saved sharding and chunks, or its value), interned bottom-up, so that comparing
two layers compares two ints. Laid out folded:

- numbered siblings (`0`, `1`, ... or `layer_0`, `layer_1`, ...) of one signature are
  one row, `{3..60}/  58 x 1,558 arrays`, under which one of them is shown; siblings
  of another signature are another group, and one alone is shown as itself;
- a subtree of three or more leaves equal in structure to another is one row that
  names the copy shown in full (`same structure as model/layers/{0..2}/self_attn`):
  the copy a person reads first, the shallowest, and among those the first in tree
  order, so that a train state shows its `params` and names them from Adam's moments;
- a plain container holding one entry shares that entry's row (`input_layernorm/weight`).

A folded name is a `select` pattern for what it stands for (`model/layers/{3..60}`).
Laid out in full (`fold=False`), there is a row for every subtree and leaf.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

import attrs
import numpy as np

from lazyckpt._array.sharding import SavedSharding
from lazyckpt._array.tree import Key, Path, children, keystr
from lazyckpt._html import array_nbytes, spec_of
from lazyckpt._lazy import LazyArray, is_jax_array
from lazyckpt._text import numbered, numbers_text

if TYPE_CHECKING:
    import jax

    ShownArray: TypeAlias = LazyArray | np.ndarray | jax.Array | jax.ShapeDtypeStruct
    """A leaf that shows as an array (see `is_array`)."""


def is_array(value: object) -> TypeGuard[ShownArray]:
    """Whether a leaf shows as an array: a LazyArray, a NumPy or jax array, or an
    abstract one (`jax.ShapeDtypeStruct`). A jax object cannot exist before jax is
    imported, so a tree is told apart without importing it."""
    return isinstance(value, LazyArray | np.ndarray) or is_jax_array(value)


@attrs.frozen(eq=False)
class Node:
    """A subtree or leaf of the tree shown, with the totals below it and its signature."""

    key: Key
    kind: str
    """The container's type, where it is not a dict, list or tuple (`State`, `Param`)."""
    kids: tuple[Node, ...] | None  # None: a leaf
    leaf: object = None
    inner: Key | None = None
    """The key of the leaf inside a box around one leaf (an `nnx.Variable`'s `value`)."""
    arrays: int = 0
    nbytes: int = 0
    leaves: int = 0
    signature: int = 0


class _Signatures:
    """Structures interned as ints: equal structures, equal ints."""

    def __init__(self) -> None:
        self._ids: dict[object, int] = {}

    def __call__(self, structure: object) -> int:
        return self._ids.setdefault(structure, len(self._ids))


_PLAIN = (dict, list, tuple)


def walk(tree: object) -> Node:
    """The tree as nodes with totals and signatures, walked with a stack of its own
    (a checkpoint's tree may be 512 levels deep, past Python's recursion)."""
    signature = _Signatures()
    open_nodes: list[tuple[Key, str, list[tuple[Key, object]], list[Node]]] = []
    # Each: key, kind, children still to walk (last first), nodes made of the others.

    def visit(key: Key, value: object) -> Node | None:
        """A leaf's node; None for a container, whose children are walked next."""
        if isinstance(value, _SCALARS) or is_array(value):  # leaves without a tree walk
            return _leaf(key, value, "", None, signature)
        kids = children(value)
        if not kids:  # a leaf, None or an empty container
            return _leaf(key, value, "", None, signature)
        kind = "" if type(value) in _PLAIN else type(value).__name__
        if len(kids) == 1 and (kind or kids[0][0] == "value") and children(kids[0][1]) is None:
            # A box around one leaf (nnx.Variable, nn.Partitioned, or such a box as
            # saved): one row, `kernel/value`.
            return _leaf(key, kids[0][1], kind, kids[0][0], signature)
        open_nodes.append((key, kind, _display_order(kids)[::-1], []))
        return None

    node = visit("", tree)
    while open_nodes:
        key, kind, pending, made = open_nodes[-1]
        if pending:
            child = visit(*pending.pop())
            if child is not None:
                made.append(child)
            continue
        open_nodes.pop()
        node = Node(
            key,
            kind,
            tuple(made),
            arrays=sum(n.arrays for n in made),
            nbytes=sum(n.nbytes for n in made),
            leaves=sum(n.leaves for n in made),
            # (keys by type too: `1` and `True` are equal dict keys, shown apart)
            signature=signature((kind, *((type(n.key), n.key, n.signature) for n in made))),
        )
        if open_nodes:
            open_nodes[-1][3].append(node)
    assert node is not None
    return node


def leaves_of(root: Node) -> Iterator[object]:
    """Every leaf below `root` (each once, folded or not)."""
    stack = [root]
    while stack:
        node = stack.pop()
        if node.kids is None:
            yield node.leaf
        else:
            stack.extend(reversed(node.kids))


_SCALARS = (str, int, float, bool, bytes, type(None))


def _leaf(key: Key, leaf: object, kind: str, inner: Key | None, signature: _Signatures) -> Node:
    if is_array(leaf):
        # What a row shows of the array (the saved spec and mesh as text: a mesh's
        # axes are a dict, which does not hash), and the stored dtype describe shows.
        chunks = getattr(leaf, "chunks", None)
        stored = getattr(getattr(leaf, "stored", None), "dtype", None)
        shape = (leaf.dtype, stored, tuple(leaf.shape), spec_of(leaf), chunks)
        structure: object = ("array", kind, inner, *shape)
        return Node(key, kind, None, leaf, inner, 1, array_nbytes(leaf), 1, signature(structure))
    structure = ("value", kind, inner, type(leaf).__name__, _value(leaf))
    return Node(key, kind, None, leaf, inner, leaves=1, signature=signature(structure))


def _value(leaf: object) -> object:
    """A value as signatures compare it: as it prints (`-0.0` is not `0.0`, nor
    `Decimal('1.00')` `Decimal('1.0')`), ints and strings as themselves (an int of
    thousands of digits does not print)."""
    if type(leaf) in (int, str, bytes):
        return leaf
    try:
        return repr(leaf)
    except ValueError:  # a container of huge ints
        return id(leaf)


def _display_order(kids: list[tuple[Key, object]]) -> list[tuple[Key, object]]:
    """Layers keyed '0', '1', ..., '10' (as checkpoints store int keys) in numeric
    order, not jax's string order. (Compared as digits, shortest first: int() would
    refuse a key of thousands of digits.)"""
    if all(isinstance(key, str) and key.isascii() and key.isdigit() for key, _ in kids):
        return sorted(kids, key=lambda kid: _by_number(str(kid[0]).lstrip("0")))
    return kids


def _by_number(digits: str) -> tuple[int, str]:
    return len(digits), digits


@attrs.frozen
class Row:
    """One line of a summary: a subtree (`group`) or a leaf."""

    path: Path
    depth: int
    group: bool
    arrays: int = 0  # arrays at or below this row, in every sibling it stands for
    nbytes: int = 0  # their size as views, in their dtypes
    leaf: object = None
    kind: str = ""
    """The container's type, where it is not a dict, list or tuple (`State`, `Param`)."""
    keys_shown: int = 1
    """Trailing keys of `path` the row's name shows: a leaf alone in a box such as an
    `nnx.Variable` shows as `kernel/value`, a dict of one entry as `norm/scale`."""
    count: int = 1
    """The numbered siblings the row stands for (`{3..60}/`: 58); the rows below it
    show one of them."""
    same_as: str = ""
    """The key path of a subtree of the same structure shown in full, which this row
    stands for instead of its own rows."""

    @property
    def name(self) -> str:
        return keystr(self.path[-self.keys_shown :]) if self.path else "(root)"

    def describe(self) -> dict[str, Any]:
        """The row as JSON-ready data (what `lazyckpt inspect --json` prints)."""
        out: dict[str, Any] = {"path": keystr(self.path)}
        if self.kind:
            out["type"] = self.kind
        if self.count > 1:
            out["count"] = self.count
        if self.same_as:
            out["same_structure_as"] = self.same_as
        if self.group:
            out.update(kind="tree", arrays=self.arrays, nbytes=self.nbytes)
            return out
        leaf = self.leaf
        if isinstance(leaf, LazyArray):
            sharding = leaf.sharding
            out.update(
                kind="array",
                shape=list(leaf.shape),
                dtype=str(leaf.dtype),
                nbytes=self.nbytes,  # of every sibling the row stands for
                chunks=list(leaf.chunks),
                sharding=None if sharding is None else _sharding_dict(sharding),
            )
            if leaf.dtype != leaf.stored.dtype and not leaf.key_impl:
                out["stored_dtype"] = str(leaf.stored.dtype)
            return out
        if is_array(leaf):
            out.update(
                kind="array",
                shape=list(leaf.shape),
                dtype=str(leaf.dtype),
                nbytes=self.nbytes,
            )
            return out
        out.update(kind="value", value=_json_value(leaf))
        return out


def _sharding_dict(sharding: SavedSharding) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": sharding.kind}
    if sharding.kind == "NamedSharding":
        out["mesh"] = sharding.mesh_axes
        out["spec"] = [list(e) if isinstance(e, tuple) else e for e in sharding.partition_spec]
    elif sharding.device is not None:
        out["device"] = sharding.device
    return out


def _json_value(value: object) -> object:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict | list | tuple) and not value:
        return type(value)()
    return repr(value)


def layout(root: Node, *, fold: bool = True) -> list[Row]:
    """The rows of the tree at `root`, in tree order, the first for the root itself:
    folded (see the module's docstring) or one per subtree and leaf."""
    rows = _Layout(fold)
    if root.kids is None:
        # A tree that is one leaf (`summary(tree["params"]["w"])`): its row, by the
        # array's own key path, with its size; nothing would show it otherwise.
        own = root.leaf.key if isinstance(root.leaf, LazyArray) else ""
        path: Path = (own or "(root)", *(() if root.inner is None else (root.inner,)))
        rows.out.append(
            Row(path, 1, False, root.arrays, root.nbytes, root.leaf, root.kind, len(path))
        )
        return rows.out
    if fold:
        rows.choose_shown(root)
    rows.out.append(Row((), 0, True, root.arrays, root.nbytes, kind=root.kind))
    rows.below(root, (), 0)
    return rows.out


_SAME_AS_LEAVES = 3


def _by_width(members: list[tuple[str, Node]]) -> list[tuple[int, list[tuple[str, Node]]]]:
    """Numbered siblings as they fold, with the width their numbers are written in:
    `9`, `10` as written (width 0); `00` to `99` zero-padded (width 2). Where some
    are padded and their widths differ (`9` and `009`), each width folds apart."""
    padded = any(len(digits) > 1 and digits.startswith("0") for digits, _ in members)
    if not padded:
        return [(0, members)]
    widths: dict[int, list[tuple[str, Node]]] = {}
    for member in members:
        widths.setdefault(len(member[0]), []).append(member)
    if len(widths) == 1:
        return [(len(members[0][0]), members)]
    out: dict[int, list[tuple[str, Node]]] = {}
    for width, alike in widths.items():
        padded = any(len(d) > 1 and d.startswith("0") for d, _ in alike)
        out.setdefault(width if padded else 0, []).extend(alike)
    return list(out.items())


class _Layout:
    def __init__(self, fold: bool) -> None:
        self.fold = fold
        self.out: list[Row] = []
        # signature -> the subtree shown in full, and its key path
        self.shown: dict[int, tuple[Node, str]] = {}
        self._entries: dict[int, list[tuple[Key, list[Node]]]] = {}  # by id(node)

    def choose_shown(self, root: Node) -> None:
        """Which copy of each repeated subtree is shown in full: the one a person reads
        first, the shallowest (fewest keys to its row's end), and among those the first
        in tree order (a train state's `params/`, not `opt_state/0/mu/`, which sorts
        first). Rows are laid out shallowest first, to be thrown away; `below` then
        meets each copy in tree order and names the chosen one."""
        # (keys, place in tree order, entry): a place is unique, so entries never compare
        pending: list[tuple[int, tuple[int, ...], Key, list[Node], Path]] = [
            (1, (i,), key, members, ()) for i, (key, members) in enumerate(self.entries(root))
        ]
        while pending:
            keys, place, key, members, at = heapq.heappop(pending)
            reach = len(at) + self._chain_keys(members[0])
            if reach > keys:  # a row of several keys (`norm/scale`) is as deep as its end
                heapq.heappush(pending, (reach, place, key, members, at))
                continue
            opened = self.entry(key, members, at, len(place))
            if opened is not None:
                entries, row_path = opened
                for i, (k, m) in enumerate(entries):
                    heapq.heappush(pending, (len(row_path) + 1, (*place, i), k, m, row_path))
        self.out.clear()

    def _chain_keys(self, node: Node) -> int:
        """How many keys the row of `node` names, as `entry` lays it out now."""
        keys = 1
        entries = self.entries(node)
        while not self._same_as(node) and self.fold and not node.kind and len(entries) == 1:
            keys += 1
            node = entries[0][1][0]
            entries = self.entries(node)
        return keys

    def entries(self, node: Node) -> list[tuple[Key, list[Node]]]:
        """The children of `node` as shown: numbered siblings of one signature
        together, under their folded name, where the first of them stood."""
        made = self._entries.get(id(node))
        if made is None:
            made = self._entries[id(node)] = self._grouped(node)
        return made

    def _grouped(self, node: Node) -> list[tuple[Key, list[Node]]]:
        kids = node.kids or ()
        if not self.fold:
            return [(kid.key, [kid]) for kid in kids]
        # (before, after, signature) of numbered siblings; a position for the others
        groups: dict[tuple[str, str, int] | int, list[tuple[str, Node]]] = {}
        for i, kid in enumerate(kids):
            split = numbered(str(kid.key))
            if split and ("{" in split[0] + split[2] or "}" in split[0] + split[2]):
                split = None  # braces of its own: a folded name would not select it
            group = (split[0], split[2], kid.signature) if split else i
            groups.setdefault(group, []).append((split[1] if split else "", kid))
        out: list[tuple[Key, list[Node]]] = []
        for group, members in groups.items():
            if isinstance(group, int):
                out.append((members[0][1].key, [members[0][1]]))
                continue
            for width, alike in _by_width(members):
                nodes = [node for _, node in alike]
                if len(nodes) == 1:
                    out.append((nodes[0].key, nodes))
                    continue
                numbers = [int(digits) for digits, _ in alike]
                text = numbers_text(numbers, runs=len(numbers), width=width)
                out.append((f"{group[0]}{{{text}}}{group[1]}", nodes))
        return out

    def below(self, node: Node, path: Path, depth: int) -> None:
        """The rows under `node`, in tree order (a stack of its own, as for `walk`)."""
        pending = [(key, members, path, depth + 1) for key, members in self.entries(node)]
        pending.reverse()
        while pending:
            key, members, at, level = pending.pop()
            opened = self.entry(key, members, at, level)
            if opened is not None:
                entries, row_path = opened
                pending.extend((k, m, row_path, level + 1) for k, m in reversed(entries))

    def entry(
        self, key: Key, members: list[Node], path: Path, depth: int
    ) -> tuple[list[tuple[Key, list[Node]]], Path] | None:
        """The row of one entry, `members` (one node, or numbered siblings alike), and
        the entries shown under it with its path; None when nothing is."""
        node = members[0]
        count = len(members)
        arrays, nbytes = node.arrays * count, node.nbytes * count
        keys = [key]
        chain = [(node, 1)]  # the nodes the row's keys name, and how many keys name each
        same_as = self._same_as(node)
        entries = self.entries(node)
        # A plain container whose one entry shares its row (`input_layernorm/weight`).
        while not same_as and self.fold and not node.kind and len(entries) == 1:
            keys.append(entries[0][0])
            count *= len(entries[0][1])
            node = entries[0][1][0]
            chain.append((node, len(keys)))
            same_as = self._same_as(node)
            entries = self.entries(node)
        if node.kids is None:  # a leaf
            if node.inner is not None:
                keys.append(node.inner)
            shown = len(keys)
            row = Row(
                (*path, *keys), depth, False, arrays, nbytes, node.leaf, node.kind, shown, count
            )
            self.out.append(row)
            return None
        row_path = (*path, *keys)
        self.out.append(
            Row(
                row_path,
                depth,
                True,
                arrays,
                nbytes,
                kind=node.kind,
                keys_shown=len(keys),
                count=count,
                same_as=same_as,
            )
        )
        if same_as:
            return None
        for named, names in chain:  # (`opt/mu/` in full: either may be named later)
            if self.fold and named.leaves >= _SAME_AS_LEAVES:
                copy = (named, keystr((*path, *keys[:names])))
                self.shown.setdefault(named.signature, copy)
        return entries, row_path

    def _same_as(self, node: Node) -> str:
        """The key path of another subtree of the same structure shown in full, for a
        subtree of a few leaves or more (a weight and its scale read better than a
        reference)."""
        if not self.fold or node.kids is None or node.leaves < _SAME_AS_LEAVES:
            return ""
        shown, path = self.shown.get(node.signature, (node, ""))
        return "" if shown is node else path
