"""`open`: build the lazy tree of an Orbax PyTree checkpoint from its metadata."""

from __future__ import annotations

import builtins
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import tensorstore as ts

from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError
from lazyckpt._layout import locate
from lazyckpt._lazy import LazyArray
from lazyckpt._selection import Selection
from lazyckpt._sharding import read_shardings
from lazyckpt._store import Store, StoredArray

_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
_EMPTY_VALUES: dict[str, Callable[[], Any]] = {
    "None": lambda: None,
    "Dict": dict,
    "List": list,
    "Tuple": list,  # Orbax rebuilds tuples as lists too
    "NamedTuple": lambda: None,
}
_SEQUENCE_KEY, _DICT_KEY = 1, 2


@attrs.frozen
class _Leaf:
    path: tuple[str | int, ...]
    name: str
    value_type: str


def open(  # noqa: A001 - the library's main verb, used as lazyckpt.open
    path: str | os.PathLike[str], *, step: int | None = None, item: str | None = None
) -> Any:
    """Open an Orbax checkpoint as a pytree of `LazyArray`s, reading only metadata.

    `path` is a PyTree checkpoint folder, a step folder with items, or a
    CheckpointManager root (the latest committed step unless `step` is given).
    Strings and Python scalars come back as their values; empty containers and
    None as saved; every array as a `LazyArray`.

    >>> tree = lazyckpt.open(path)
    >>> tree["step"], tree["params"]["b"]
    (3, LazyArray('params/b', shape=(8,), dtype=float32, chunks=(8,), sharding=NamedSharding(mesh={'x': 4, 'y': 2}, spec=P())))
    """
    location = locate(os.fspath(path), step=step, item=item)
    metadata = _read_metadata(location)
    leaves = _leaves(location, metadata)
    store = _open_store(location, metadata)
    arrays = [leaf for leaf in leaves if leaf.value_type in _ARRAY_TYPES]
    stored = _stored_arrays(store, metadata, arrays)
    shardings = read_shardings(
        location, _read_text(location, "_sharding"), [leaf.name for leaf in arrays]
    )
    values: dict[tuple[str | int, ...], Any] = {}
    scalar_reads = []
    for leaf, array in zip(arrays, stored, strict=True):
        if leaf.value_type == "scalar":
            scalar_reads.append((leaf.path, array.read(Selection.full(array.shape))))
            continue
        values[leaf.path] = LazyArray(
            path=leaf.path,
            stored=array,
            selection=Selection.full(array.shape),
            dtype=array.dtype,
            sharding=shardings.get(leaf.name) if leaf.value_type == "jax.Array" else None,
        )
    values.update(_strings(location, [leaf for leaf in leaves if leaf.value_type == "string"]))
    for leaf in leaves:
        if leaf.value_type in _EMPTY_VALUES:
            values[leaf.path] = _EMPTY_VALUES[leaf.value_type]()
    for leaf_path, future in scalar_reads:
        values[leaf_path] = future.result().item()
    return _build(location, [(leaf.path, values[leaf.path]) for leaf in leaves])


def _read_text(location: str, name: str) -> str | None:
    try:
        with builtins.open(os.path.join(location, name), encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _read_metadata(location: str) -> dict[str, Any]:
    text = _read_text(location, "_METADATA")
    if text is None:
        raise UnsupportedCheckpointError(
            f"{location} has no _METADATA file (checkpoints written by orbax before "
            "2023-11 lack it); lazyckpt cannot read such checkpoints yet"
        )
    try:
        metadata = json.loads(text)
    except json.JSONDecodeError as error:
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
    return metadata


def _leaves(location: str, metadata: dict[str, Any]) -> list[_Leaf]:
    leaves = []
    for outer, entry in metadata["tree_metadata"].items():
        try:
            keys = [(str(k["key"]), int(k["key_type"])) for k in entry["key_metadata"]]
            value_type = str(entry["value_metadata"]["value_type"])
            skipped = bool(entry["value_metadata"].get("skip_deserialize", False))
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptCheckpointError(
                f"{location}/_METADATA: entry {outer} is malformed (missing {error}); "
                "expected key_metadata and value_metadata.value_type"
            ) from None
        path: list[str | int] = []
        for key, key_type in keys:
            if key_type == _SEQUENCE_KEY and key.isdigit():
                path.append(int(key))
            elif key_type == _DICT_KEY:
                path.append(key)
            else:
                raise CorruptCheckpointError(
                    f"{location}/_METADATA: entry {outer} has key {key!r} of key_type "
                    f"{key_type}; expected 1 (sequence index) or 2 (dict key)"
                )
        if value_type not in _EMPTY_VALUES and value_type not in (*_ARRAY_TYPES, "string"):
            raise UnsupportedCheckpointError(
                f"{location}: leaf {'/'.join(map(str, path))!r} has value_type "
                f"{value_type!r}, which lazyckpt does not read (it is written by a custom "
                "orbax TypeHandler)"
            )
        if skipped and value_type not in _EMPTY_VALUES:
            raise UnsupportedCheckpointError(
                f"{location}: leaf {'/'.join(map(str, path))!r} is stored inside the legacy "
                "msgpack 'checkpoint' file (aggregate=True), which lazyckpt cannot read yet"
            )
        leaves.append(_Leaf(tuple(path), ".".join(k for k, _ in keys), value_type))
    # A partial save can leave a stale empty-container entry that is a prefix of
    # real entries; Orbax drops those too (spec §3.2).
    paths = {leaf.path for leaf in leaves}
    prefixes = {p[:i] for p in paths for i in range(len(p))}
    return [leaf for leaf in leaves if leaf.path not in prefixes]


def _open_store(location: str, metadata: dict[str, Any]) -> Store:
    has_manifest = os.path.exists(os.path.join(location, "manifest.ocdbt"))
    per_process = sorted(n for n in os.listdir(location) if n.startswith("ocdbt.process_"))
    use_ocdbt = metadata.get("use_ocdbt")
    ocdbt = bool(use_ocdbt) if use_ocdbt is not None else bool(has_manifest or per_process)
    if ocdbt and not has_manifest:
        raise CorruptCheckpointError(
            f"OCDBT root manifest {location}/manifest.ocdbt is missing"
            + (
                f"; per-process databases {per_process} exist, so the merge step never ran "
                "or the manifest was lost"
                if per_process
                else ""
            )
            + "; the checkpoint cannot be read as saved, copy it again"
        )
    return Store.open(location, ocdbt=ocdbt)


def _stored_arrays(
    store: Store, metadata: dict[str, Any], leaves: Sequence[_Leaf]
) -> list[StoredArray]:
    zarr3 = bool(metadata.get("use_zarr3", False))
    fill_missing = not metadata.get("store_array_data_equal_to_fill_value", False)
    suffix = "zarr.json" if zarr3 else ".zarray"
    keys = [f"{leaf.name}/{suffix}" if leaf.name else suffix for leaf in leaves]
    found = store.read_keys(keys)
    arrays = []
    for leaf, key, raw in zip(leaves, keys, found, strict=True):
        where = f"{store.location}: array {'/'.join(map(str, leaf.path))!r}"
        if raw is None:
            raise CorruptCheckpointError(
                f"{where} is listed in _METADATA but its zarr metadata {key!r} is missing "
                "from the store; the checkpoint is incomplete, copy it again (cp -a keeps dotfiles)"
            )
        shape, dtype, chunks = _parse_zarr(where, key, raw, zarr3)
        arrays.append(
            StoredArray(
                store=store,
                key="/".join(map(str, leaf.path)),
                name=leaf.name,
                driver="zarr3" if zarr3 else "zarr",
                shape=shape,
                dtype=dtype,
                chunks=chunks,
                fill_missing=fill_missing,
            )
        )
    return arrays


def _parse_zarr(
    where: str, key: str, raw: bytes, zarr3: bool
) -> tuple[tuple[int, ...], np.dtype[Any], tuple[int, ...]]:
    """Shape, dtype and read-chunk shape from zarr v2 or v3 metadata (spec §4.3)."""
    try:
        meta = json.loads(raw)
        shape = tuple(int(n) for n in meta["shape"])
        if zarr3:
            dtype = ts.dtype(meta["data_type"]).numpy_dtype
            chunks = meta["chunk_grid"]["configuration"]["chunk_shape"]
            codecs = meta.get("codecs") or []
            if codecs and codecs[0].get("name") == "sharding_indexed":
                chunks = codecs[0]["configuration"]["chunk_shape"]
        else:
            name = meta["dtype"]
            dtype = np.dtype(name) if name[:1] in "<>|=" else ts.dtype(name).numpy_dtype
            dtype = dtype.newbyteorder("=") if dtype.byteorder in "<>" else dtype
            chunks = meta["chunks"]
        chunks = tuple(int(n) for n in chunks)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise CorruptCheckpointError(
            f"{where}: zarr metadata {key!r} is malformed ({error!r}); expected zarr "
            f"{'v3' if zarr3 else 'v2'} array metadata with shape, dtype and chunks"
        ) from None
    if any(n < 0 for n in shape) or len(chunks) != len(shape) or any(n <= 0 for n in chunks):
        raise CorruptCheckpointError(
            f"{where}: zarr metadata {key!r} declares shape {shape} with chunks {chunks}; "
            "expected non-negative sizes and one positive chunk size per dimension"
        )
    return shape, dtype, chunks


def _strings(location: str, leaves: Sequence[_Leaf]) -> dict[tuple[str | int, ...], str]:
    if not leaves:
        return {}
    text = _read_text(location, "_strings.json")
    if text is None:
        raise CorruptCheckpointError(
            f"{location}/_strings.json is missing but _METADATA lists string leaves "
            f"{['/'.join(map(str, leaf.path)) for leaf in leaves[:3]]}; copy the checkpoint again"
        )
    try:
        table = json.loads(text)
        values = {}
        for leaf in leaves:
            # Orbax looks strings up with the JSON pointer "/" + name (spec §5).
            node = table
            for part in leaf.name.split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
            if not isinstance(node, str):
                raise TypeError(f"expected a string, found {type(node).__name__}")
            values[leaf.path] = node
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpointError(
            f"{location}/_strings.json: cannot read the string for "
            f"{leaf.name!r} ({error!r}); the file is damaged, copy the checkpoint again"
        ) from None
    return values


def _build(location: str, entries: list[tuple[tuple[str | int, ...], Any]]) -> Any:
    """Nest `(path, value)` pairs into dicts (str keys) and lists (int keys)."""
    if len(entries) == 1 and entries[0][0] == ():
        return entries[0][1]
    root: dict[Any, Any] = {}
    for path, value in entries:
        if not path:
            raise CorruptCheckpointError(
                f"{location}/_METADATA has a whole-tree entry beside other entries"
            )
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CorruptCheckpointError(
                    f"{location}/_METADATA: {'/'.join(map(str, path))!r} nests under a leaf"
                )
        node[path[-1]] = value
    return _to_lists(location, root, ())


def _to_lists(location: str, node: Any, path: tuple[str | int, ...]) -> Any:
    if not isinstance(node, dict) or not node:
        return node
    kinds = {isinstance(k, int) for k in node}
    if kinds == {True}:
        indices = sorted(node)
        if indices != list(range(len(indices))):
            raise CorruptCheckpointError(
                f"{location}/_METADATA: list {'/'.join(map(str, path)) or '<root>'!r} has "
                f"indices {indices[:10]}; expected 0..{len(indices) - 1}"
            )
        return [_to_lists(location, node[i], (*path, i)) for i in indices]
    if kinds == {False}:
        return {k: _to_lists(location, v, (*path, k)) for k, v in node.items()}
    raise CorruptCheckpointError(
        f"{location}/_METADATA: {'/'.join(map(str, path)) or '<root>'!r} mixes list indices "
        "and dict keys"
    )
