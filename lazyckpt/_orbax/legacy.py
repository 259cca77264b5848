"""Structure without `_METADATA`: the legacy msgpack file, or failing that the store.

Orbax before 2023-11 wrote no `_METADATA`; its tree is in the msgpack `checkpoint`
file, with `PLACEHOLDER://<name>` strings where a value lives in tensorstore
(format notes, Legacy msgpack). Without either file, the arrays in the store are the only record, and
the tree is inferred from their names (format notes, Without metadata): lossy, so it warns.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lazyckpt._array.tree import Path
from lazyckpt._engine.memory import physical_memory
from lazyckpt._errors import CorruptCheckpointError, InferredStructureWarning, warn
from lazyckpt._orbax.metadata import INLINE, STORED, Leaf
from lazyckpt._orbax.msgpack import decode
from lazyckpt._orbax.zarr import ZARR2_KEY, ZARR3_KEY
from lazyckpt._storage import paths
from lazyckpt._storage.kvstore import Store

MSGPACK_FILE = "checkpoint"
_PLACEHOLDER = "PLACEHOLDER://"


def read_msgpack(location: str) -> object | None:
    """The decoded legacy msgpack tree, or None if the file does not exist."""
    path = paths.join(location, MSGPACK_FILE)
    data = paths.read_bytes(path, limit=physical_memory())
    return None if data is None else decode(data, where=path)


def msgpack_value(location: str, tree: Any, path: Path) -> object:
    """The value at `path` in the msgpack tree, for a leaf aggregated into it."""
    node = tree
    for key in path:
        try:
            node = node[key if isinstance(node, list) else str(key)]
        except (KeyError, IndexError, TypeError):
            raise CorruptCheckpointError(
                f"{location}/{MSGPACK_FILE}: _METADATA says {'/'.join(map(str, path))!r} is "
                "stored in this file, but it is not there; the checkpoint is damaged"
            ) from None
    return node


def msgpack_leaves(tree: object, location: str) -> list[Leaf]:
    """The leaves of a msgpack tree: placeholders point into the store, the rest is inline."""
    leaves = []
    for path, value in _walk(tree, (), location):
        if isinstance(value, str) and value.startswith(_PLACEHOLDER):
            leaves.append(Leaf(path, value[len(_PLACEHOLDER) :], STORED))
        else:
            leaves.append(Leaf(path, ".".join(map(str, path)), INLINE, value=value))
    return leaves


KEY_WORK = 20_000_000
"""The most keys, summed over the key paths of a msgpack tree's nodes, that opening
builds (160 MB of key paths): a small file of deep maps over many leaves would
otherwise cost leaves times depth (300,000 leaves under 490 maps: 78 s, 2.9 GB)."""


def _walk(tree: object, root: Path, location: str) -> Iterator[tuple[Path, object]]:
    """`(path, leaf)` in jax's order, with a stack of its own rather than recursion (the
    msgpack tree may be 512 levels deep)."""
    todo: list[tuple[object, Path]] = [(tree, root)]
    work = len(root)
    while todo:
        node, path = todo.pop()
        if isinstance(node, dict | list | tuple) and node:
            # Counted before the children's key paths are built: they are the cost.
            work += len(node) * (len(path) + 1)
            if work > KEY_WORK:
                raise CorruptCheckpointError(
                    f"{location}/{MSGPACK_FILE}: its tree's key paths add up to more than "
                    f"{KEY_WORK:,} keys (nodes times depth; {len(path) + 1} deep here), more "
                    "than any checkpoint's tree needs; the file is damaged or hostile"
                )
        if isinstance(node, dict) and node:
            # Sorted as jax flattens dicts, so every layout gives the same key order.
            items = sorted(node.items(), key=lambda item: str(item[0]))
            todo.extend((child, (*path, str(key))) for key, child in reversed(items))
        elif isinstance(node, list | tuple) and node:
            todo.extend((child, (*path, i)) for i, child in reversed(list(enumerate(node))))
        else:
            # Empty containers, None and ndarrays are leaves; a 0-d ndarray too.
            yield path, node if not isinstance(node, tuple) else list(node)


def listed_leaves(store: Store) -> list[Leaf]:
    """Leaves inferred from the arrays in the store: names split on '.' into dicts."""
    names = sorted(_ocdbt_names(store) if store.ocdbt else _folder_names(store.location))
    warn(
        f"{store.location} has neither _METADATA nor a msgpack 'checkpoint' file, so its "
        "tree was inferred from array names: lists come back as dicts, keys containing '.' "
        "are split, and strings and scalar types are lost",
        InferredStructureWarning,
    )
    return [Leaf(tuple(name.split(".")) if name else (), name, STORED) for name in names]


def _ocdbt_names(store: Store) -> Iterator[str]:
    # (through `list_keys`: a damaged or malformed b-tree is an error naming the folder)
    for key in store.list_keys(""):
        for suffix in (ZARR2_KEY, ZARR3_KEY):
            if key == suffix:
                yield ""
            elif key.endswith("/" + suffix):
                yield key[: -len(suffix) - 1]


def _folder_names(location: str) -> Iterator[str]:
    files = set(paths.walk_files(location))
    if files & {ZARR2_KEY, ZARR3_KEY}:
        yield ""
        return
    found: list[str] = []
    for name in sorted(files):
        folder, _, leaf = name.rpartition("/")
        # A zarr array's folder holds chunks, not more arrays.
        if leaf in (ZARR2_KEY, ZARR3_KEY) and not any(folder.startswith(f + "/") for f in found):
            found.append(folder)
            yield folder
