"""Orbax's PyTree format, read and written in one place (docs/format.md).

What the files are called and hold: `_METADATA` (the tree: one entry per leaf, with
its key path, key types and value type), `_sharding`, `array_metadatas/process_<i>`,
`_strings.json` (strings, found by a JSON pointer), `_CHECKPOINT_METADATA`,
`commit_success.txt`, the per-process databases `ocdbt.process_<i>`, and the marker
of an unfinished save. Readers parse with `parse` and nest leaves with `build`;
`save` builds each file's contents with the `*_json` functions.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from lazyckpt._array.tree import MAX_DEPTH, Key, Path
from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError, json_or_corrupt

ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
STRING = "string"
# A leaf known only by its storage name (no _METADATA): an array if the store has
# zarr metadata for it, else a string from _strings.json.
STORED = "stored"
# A value held in the legacy msgpack `checkpoint` file itself.
INLINE = "inline"
EMPTY_VALUES: dict[str, Callable[[], object]] = {
    "None": lambda: None,
    "Dict": dict,
    "List": list,
    "Tuple": list,  # Orbax rebuilds tuples as lists too
    "NamedTuple": lambda: None,
}
SEQUENCE_KEY, DICT_KEY = 1, 2  # key_type codes in _METADATA (format notes, The tree)
_KNOWN_TYPES = frozenset([*EMPTY_VALUES, *ARRAY_TYPES, STRING])
EMPTY_WRITTEN = ("None", "Dict", "List", "Tuple")
"""The value types `save` writes for None and empty containers."""

PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
_PROCESS_PREFIX = "ocdbt.process_"


def process_folder(process: int) -> str:
    """The folder of process `process`'s OCDBT database in a multi-process save."""
    return f"{_PROCESS_PREFIX}{process}"


def is_process_folder(name: str) -> bool:
    return name.startswith(_PROCESS_PREFIX)


@attrs.frozen
class Leaf:
    """One leaf of the saved tree: where it sits, what it is, where its value lives."""

    path: Path
    name: str
    """The storage name: the path's keys joined by '.' (format notes, Storage names)."""
    value_type: str
    write_shape: tuple[int, ...] | None = None
    value: object = attrs.field(default=None, eq=False)
    """For INLINE leaves, the value itself."""
    declared_type: str = ""
    """For INLINE leaves, the value_type `_METADATA` declares, if any."""

    @property
    def key(self) -> str:
        return "/".join([str(k) for k in self.path])


def parse_metadata(location: str, text: str) -> tuple[dict[str, Any], list[Leaf]]:
    """The `_METADATA` object and its leaves, in saved order."""
    metadata = json_or_corrupt(
        f"{location}/_METADATA",
        text,
        "the save was interrupted or the file was damaged: open another step or copy the "
        "checkpoint again",
    )
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
        # (19 digits or more are no list's index, and int() refuses 4,300 with a ValueError.)
        if key_type == SEQUENCE_KEY and key.isascii() and key.isdigit() and len(key) < 19:
            path.append(int(key))
        elif key_type == DICT_KEY:
            path.append(key)
        else:
            raise CorruptCheckpointError(
                f"{location}/_METADATA: entry {outer} has key {key[:60]!r} of key_type "
                f"{key_type}; expected 1 (sequence index) or 2 (dict key)"
            )
    leaf = Leaf(tuple(path), ".".join([k for k, _ in keys]), value_type, write_shape)
    if value_type not in _KNOWN_TYPES:
        raise UnsupportedCheckpointError(
            f"{location}: leaf {leaf.key!r} has value_type {value_type!r}, which lazyckpt "
            "does not read (it is written by a custom orbax TypeHandler)"
        )
    if skipped and value_type not in EMPTY_VALUES:
        # Its value is aggregated into the legacy msgpack file (format notes, Legacy msgpack).
        return attrs.evolve(leaf, value_type=INLINE, declared_type=value_type)
    return leaf


def drop_stale_prefixes(leaves: list[Leaf]) -> list[Leaf]:
    """Drop entries whose path is a strict prefix of another's.

    A partial save can leave a stale empty-container entry above real entries;
    Orbax drops those too (format notes, The tree). The paths go into a trie, so the work is linear
    in their total length, however deep they are.
    """
    root: dict[Key, Any] = {}
    ends = []
    for leaf in leaves:
        node = root
        for key in leaf.path:
            node = node.setdefault(key, {})
        ends.append(node)
    return [leaf for leaf, end in zip(leaves, ends, strict=True) if not end]


def build_tree(location: str, entries: list[tuple[Path, object]]) -> object:
    """Nest `(path, value)` pairs into dicts (str keys) and lists (int keys)."""
    if len(entries) == 1 and entries[0][0] == ():
        return entries[0][1]
    root: dict[Key, Any] = {}
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


def _to_lists(location: str, root: object, path: Path) -> object:
    """Dicts keyed 0..n-1 (list indices) become lists, bottom up, without recursing:
    the tree is as deep as the checkpoint says."""
    result: list[object] = [None]
    # (node, its path, where the converted node goes)
    todo: list[tuple[object, Path, Any, Key]] = [(root, path, result, 0)]
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


# Strings (format notes, Other leaves): Orbax finds each with the JSON pointer "/" + its name.


def pointer_parts(name: str) -> list[str]:
    """The keys the JSON pointer `"/" + name` steps through."""
    return [part.replace("~1", "/").replace("~0", "~") for part in name.split("/")]


def valid_pointer(name: str) -> bool:
    """Whether `"/" + name` is a JSON pointer: every '~' is followed by '0' or '1'."""
    return not any(
        c == "~" and part[i + 1 : i + 2] not in ("0", "1")
        for part in name.split("/")
        for i, c in enumerate(part)
    )


def find_string(table: Any, name: str) -> object:
    """What `_strings.json`'s `table` holds at the pointer of `name` (None if nothing)."""
    node = table
    try:
        for part in pointer_parts(name):
            node = node[part]
    except (KeyError, TypeError):
        return None
    return node


def strings_json(values: Mapping[str, str], where: Mapping[str, str]) -> dict[str, Any]:
    """`_strings.json` for string leaves by name; `where[name]` names a leaf in errors.

    Raises ValueError when two names would collide in the nesting."""
    nested: dict[str, Any] = {}
    for name, value in values.items():
        *parents, last = pointer_parts(name)
        node = nested
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"{where[name]}: its name {name!r} nests under another string leaf "
                    f"({part!r}) in _strings.json; rename one of them"
                )
            node = child
        if last in node:
            raise ValueError(
                f"{where[name]}: its name {name!r} collides with other string leaves in "
                "_strings.json; rename one of them"
            )
        node[last] = value
    return nested


# Writing the other files.


@attrs.frozen
class Entry:
    """One leaf as `_METADATA` records it."""

    keys: tuple[tuple[str, int], ...]
    """(key, key_type) per level."""
    value_type: str
    write_shape: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        """The storage name: the keys joined by '.' (format notes, Storage names)."""
        return ".".join(key for key, _ in self.keys)


def metadata_json(entries: Iterable[Entry]) -> dict[str, Any]:
    """`_METADATA` for a checkpoint of one OCDBT database of zarr3 arrays, every chunk
    written."""
    tree_metadata = {}
    for entry in entries:
        value: dict[str, Any] = {
            "value_type": entry.value_type,
            "skip_deserialize": entry.value_type in EMPTY_WRITTEN,
        }
        if entry.write_shape is not None:
            value["write_shape"] = list(entry.write_shape)
        tree_metadata[str(tuple(key for key, _ in entry.keys))] = {
            "key_metadata": [{"key": key, "key_type": kind} for key, kind in entry.keys],
            "value_metadata": value,
        }
    return {
        "tree_metadata": tree_metadata,
        "use_ocdbt": True,
        "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }


def sharding_file(shardings: Mapping[str, str]) -> dict[str, str]:
    """`_sharding`: each jax.Array's sharding entry, keyed by its name in base64."""
    return {
        base64.urlsafe_b64encode(name.encode()).decode(): entry for name, entry in shardings.items()
    }


@attrs.frozen
class ArrayRecord:
    """One jax.Array as `array_metadatas/process_<i>` records it."""

    name: str
    write_shape: tuple[int, ...]
    chunks: tuple[int, ...]
    key_impl: str | None = None


def array_metadatas_json(records: Sequence[ArrayRecord]) -> dict[str, Any]:
    return {
        "array_metadatas": [
            {
                "array_metadata": {
                    "param_name": r.name,
                    "write_shape": list(r.write_shape),
                    "chunk_shape": list(r.chunks),
                    "ext_metadata": {"random_key_impl": r.key_impl} if r.key_impl else None,
                }
            }
            for r in records
        ]
    }


def checkpoint_metadata_json(started_ns: int) -> dict[str, Any]:
    """`_CHECKPOINT_METADATA` of a save that started at `started_ns` and commits now."""
    return {
        "item_handlers": PYTREE_HANDLER,
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": started_ns,
        "commit_timestamp_nsecs": time.time_ns(),
        "custom_metadata": {},
    }


def commit_text(final: str) -> bytes:
    """`commit_success.txt`: on object storage, the file whose presence commits."""
    return f"Checkpoint commit was successful to {final}".encode()
