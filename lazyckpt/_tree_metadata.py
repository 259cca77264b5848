"""The saved tree's structure: `_METADATA` entries, and nesting leaves into a tree."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs

from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError
from lazyckpt._msgpack import MAX_DEPTH

Path = tuple[str | int, ...]

ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
STRING = "string"
# A leaf known only by its storage name (no _METADATA): an array if the store has
# zarr metadata for it, else a string from _strings.json.
STORED = "stored"
# A value held in the legacy msgpack `checkpoint` file itself.
INLINE = "inline"
EMPTY_VALUES: dict[str, Callable[[], Any]] = {
    "None": lambda: None,
    "Dict": dict,
    "List": list,
    "Tuple": list,  # Orbax rebuilds tuples as lists too
    "NamedTuple": lambda: None,
}
_SEQUENCE_KEY, _DICT_KEY = 1, 2
_KNOWN_TYPES = frozenset([*EMPTY_VALUES, *ARRAY_TYPES, STRING])


@attrs.frozen
class Leaf:
    """One leaf of the saved tree: where it sits, what it is, where its value lives."""

    path: Path
    name: str
    """The storage name: the path's keys joined by '.' (spec §3.4)."""
    value_type: str
    write_shape: tuple[int, ...] | None = None
    value: Any = attrs.field(default=None, eq=False)
    """For INLINE leaves, the value itself."""
    declared_type: str = ""
    """For INLINE leaves, the value_type `_METADATA` declares, if any."""

    @property
    def key(self) -> str:
        return "/".join([str(k) for k in self.path])


def parse(location: str, text: str) -> tuple[dict[str, Any], list[Leaf]]:
    """The `_METADATA` object and its leaves, in saved order."""
    try:
        metadata = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"{location}/_METADATA is not valid JSON ({error}); the save was interrupted "
            "or the file was damaged: open another step or copy the checkpoint again"
        ) from error
    if not isinstance(metadata, dict) or not isinstance(metadata.get("tree_metadata"), dict):
        found = sorted(metadata)[:5] if isinstance(metadata, dict) else type(metadata).__name__
        raise CorruptCheckpointError(
            f"{location}/_METADATA has no 'tree_metadata' object (found {found}); "
            "it is not an Orbax PyTree checkpoint's metadata"
        )
    leaves = [_leaf(location, outer, entry) for outer, entry in metadata["tree_metadata"].items()]
    return metadata, drop_stale_prefixes(leaves)


def _leaf(location: str, outer: str, entry: Any) -> Leaf:
    try:
        keys = [(str(k["key"]), int(k["key_type"])) for k in entry["key_metadata"]]
        value = entry["value_metadata"]
        value_type = str(value["value_type"])
        skipped = bool(value.get("skip_deserialize", False))
        write_shape = value.get("write_shape")
        write_shape = tuple([int(n) for n in write_shape]) if write_shape is not None else None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CorruptCheckpointError(
            f"{location}/_METADATA: entry {outer} is malformed ({error!r}); expected "
            "key_metadata and value_metadata.value_type"
        ) from None
    if len(keys) > MAX_DEPTH:
        raise CorruptCheckpointError(
            f"{location}/_METADATA: an entry's key path is {len(keys)} keys long, deeper than "
            f"the {MAX_DEPTH} levels any checkpoint tree has; the file is damaged or hostile"
        )
    path: list[str | int] = []
    for key, key_type in keys:
        if key_type == _SEQUENCE_KEY and key.isascii() and key.isdigit():
            path.append(int(key))
        elif key_type == _DICT_KEY:
            path.append(key)
        else:
            raise CorruptCheckpointError(
                f"{location}/_METADATA: entry {outer} has key {key!r} of key_type "
                f"{key_type}; expected 1 (sequence index) or 2 (dict key)"
            )
    leaf = Leaf(tuple(path), ".".join([k for k, _ in keys]), value_type, write_shape)
    if value_type not in _KNOWN_TYPES:
        raise UnsupportedCheckpointError(
            f"{location}: leaf {leaf.key!r} has value_type {value_type!r}, which lazyckpt "
            "does not read (it is written by a custom orbax TypeHandler)"
        )
    if skipped and value_type not in EMPTY_VALUES:
        # Its value is aggregated into the legacy msgpack file (spec §5, §6).
        return attrs.evolve(leaf, value_type=INLINE, declared_type=value_type)
    return leaf


def drop_stale_prefixes(leaves: list[Leaf]) -> list[Leaf]:
    """Drop entries whose path is a strict prefix of another's.

    A partial save can leave a stale empty-container entry above real entries;
    Orbax drops those too (spec §3.2). The paths go into a trie, so the work is linear
    in their total length, however deep they are.
    """
    root: dict[Any, Any] = {}
    ends = []
    for leaf in leaves:
        node = root
        for key in leaf.path:
            node = node.setdefault(key, {})
        ends.append(node)
    return [leaf for leaf, end in zip(leaves, ends, strict=True) if not end]


def build(location: str, entries: list[tuple[Path, Any]]) -> Any:
    """Nest `(path, value)` pairs into dicts (str keys) and lists (int keys)."""
    if len(entries) == 1 and entries[0][0] == ():
        return entries[0][1]
    root: dict[Any, Any] = {}
    for path, value in entries:
        where = "/".join(map(str, path))
        if not path:
            raise CorruptCheckpointError(
                f"{location}: the checkpoint has a whole-tree entry beside other entries"
            )
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CorruptCheckpointError(f"{location}: {where!r} nests under a leaf")
        if path[-1] in node:
            raise CorruptCheckpointError(f"{location}: {where!r} appears twice")
        node[path[-1]] = value
    return _to_lists(location, root, ())


def _to_lists(location: str, root: Any, path: Path) -> Any:
    """Dicts keyed 0..n-1 (list indices) become lists, bottom up, without recursing:
    the tree is as deep as the checkpoint says."""
    result: list[Any] = [None]
    # (node, its path, where the converted node goes)
    todo: list[tuple[Any, Path, Any, Any]] = [(root, path, result, 0)]
    while todo:
        node, where_path, parent, slot = todo.pop()
        if not isinstance(node, dict) or not node:
            parent[slot] = node
            continue
        where = "/".join(map(str, where_path)) or "<root>"
        kinds = {isinstance(k, int) for k in node}
        if kinds == {True}:
            indices = sorted(node)
            if indices != list(range(len(indices))):
                raise CorruptCheckpointError(
                    f"{location}: list {where!r} has indices {indices[:10]}; "
                    f"expected 0..{len(indices) - 1}"
                )
            converted: Any = [None] * len(indices)
            for i in indices:
                todo.append((node[i], (*where_path, i), converted, i))
        elif kinds == {False}:
            converted = dict.fromkeys(node)
            for key, child in node.items():
                todo.append((child, (*where_path, key), converted, key))
        else:
            raise CorruptCheckpointError(f"{location}: {where!r} mixes list indices and dict keys")
        parent[slot] = converted
    return result[0]
