"""Opening an Orbax PyTree checkpoint: its lazy tree, built from its metadata.

The folder is found first (`lazyckpt._orbax.layout`); then, within one generation of
the checkpoint, `_METADATA` (or the legacy msgpack file, or the store's names) gives
the leaves, the zarr metadata of every array is read in batches, and each array leaf
becomes a `LazyArray` over a `StoredArray`. Strings and Python scalars are read now,
as Orbax restores them (format notes: Other leaves).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from lazyckpt._array.selection import Selection
from lazyckpt._array.sharding import SavedSharding
from lazyckpt._array.tree import Path
from lazyckpt._engine.stored import StoredArray
from lazyckpt._errors import (
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedCheckpointError,
    json_or_corrupt,
)
from lazyckpt._lazy import LazyArray, key_dtype
from lazyckpt._orbax.layout import json_item_file, locate
from lazyckpt._orbax.legacy import listed_leaves, msgpack_leaves, msgpack_value, read_msgpack
from lazyckpt._orbax.metadata import (
    ARRAY_TYPES,
    EMPTY_VALUES,
    INLINE,
    STORED,
    STRING,
    Leaf,
    build_tree,
    is_process_folder,
    parse_metadata,
)
from lazyckpt._orbax.sharding import read_shardings
from lazyckpt._orbax.side_files import key_impls_of, strings_of
from lazyckpt._orbax.zarr import ZarrInfo, metadata_key, parse_zarr
from lazyckpt._storage import paths
from lazyckpt._storage.folders import probed
from lazyckpt._storage.kvstore import Store, from_one_generation


def open_orbax(
    path: str, *, step: int | None, item: str | None, allow_outside_links: bool
) -> object:
    """The lazy tree of the PyTree checkpoint at `path` (a root, a step or an item;
    see `lazyckpt.open`), or the value of a JSON item."""
    found = locate(path, step=step, item=item)
    _refuse_unsafe_entries(found, allow_outside_links)
    json_file = json_item_file(found)
    if json_file is not None:
        return _json_item(json_file)
    return from_one_generation(
        found, lambda generation: _open_once(found, generation, allow_outside_links)
    )


def listed_arrays(path: str, *, step: int | None, item: str | None) -> list[str]:
    """The key paths of the stored arrays that `_METADATA` lists, read without the
    store: what a checkpoint too damaged to open should have held (none without
    `_METADATA`)."""
    found = locate(path, step=step, item=item)
    text = _read_text(found, "_METADATA")
    if text is None:
        return []
    return [leaf.key for leaf in parse_metadata(found, text)[1] if leaf.value_type in _IN_STORE]


_IN_STORE = (*ARRAY_TYPES, STORED)


def _refuse_unsafe_entries(folder: str, allow_outside_links: bool) -> None:
    outside, special = paths.unsafe_entries(folder)
    if outside and not allow_outside_links:
        link, target = outside[0]
        raise NotACheckpointError(
            f"{folder}: {link} is a symlink to {target}, outside the checkpoint folder "
            f"({len(outside)} such link(s)); refusing to read through it. Pass "
            "allow_outside_links=True to lazyckpt.open if you trust these links"
        )
    if special:
        name, kind = special[0]
        raise CorruptCheckpointError(
            f"{folder}/{name} is not a regular file ({kind})"
            + (f", nor are {len(special) - 1} more entries" if len(special) > 1 else "")
            + "; a checkpoint's files are plain files: the checkpoint is damaged or "
            "hostile, refusing to read it"
        )


def _json_item(path: str) -> Any:
    """The value of a JSON item (`ocp.args.JsonSave`)."""
    text = paths.read_text(path)
    return json_or_corrupt(path, text or "", "the JSON item is damaged, copy the checkpoint again")


def _open_once(location: str, generation: tuple[object, ...], outside_links: bool) -> object:
    text = _read_text(location, "_METADATA")
    metadata, leaves = parse_metadata(location, text) if text is not None else ({}, [])
    # A tree without arrays (strings, scalars read from _strings.json, None) has no
    # database at all when Orbax or lazyckpt saves it.
    needs_store = text is None or any(leaf.value_type in _IN_STORE for leaf in leaves)
    store = _open_store(
        location, metadata, generation, required=needs_store, outside_links=outside_links
    )
    legacy = read_msgpack(location)
    if text is None:
        leaves = msgpack_leaves(legacy, location) if legacy is not None else listed_leaves(store)
    elif any(leaf.value_type == INLINE for leaf in leaves):
        if legacy is None:
            raise CorruptCheckpointError(
                f"{location}/_METADATA says some leaves are stored in the msgpack "
                "'checkpoint' file, but that file is missing; copy the checkpoint again"
            )
        leaves = [
            leaf if leaf.value_type != INLINE else _with_value(leaf, location, legacy)
            for leaf in leaves
        ]
    return _materialize(location, store, metadata, leaves)


def _with_value(leaf: Leaf, location: str, legacy: object) -> Leaf:
    value = msgpack_value(location, legacy, leaf.path)
    # A NumPy scalar stays one, with its dtype, as Orbax restores it from the file
    # (format notes, Legacy msgpack); a 0-d array declared a scalar becomes a number.
    if leaf.declared_type == "scalar" and isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    return attrs.evolve(leaf, value=value)


def _materialize(
    location: str, store: Store, metadata: dict[str, Any], leaves: list[Leaf]
) -> object:
    stored_leaves = [leaf for leaf in leaves if leaf.value_type in (*ARRAY_TYPES, STORED)]
    infos = _zarr_infos(store, metadata, stored_leaves)
    # Typed PRNG keys are stored as uint32 data ending in 2 or 4 (format notes, PRNG keys); only then is
    # array_metadatas/ worth reading (one request per file on object storage).
    maybe_keys = any(
        info.dtype == np.uint32 and info.shape and info.shape[-1] in (2, 4)
        for info in infos.values()
    )
    key_impls = key_impls_of(location) if maybe_keys else {}
    shardings = read_shardings(
        location, _read_text(location, "_sharding"), [leaf.name for leaf in stored_leaves]
    )
    fill_missing = not metadata.get("store_array_data_equal_to_fill_value", False)
    values: dict[Path, object] = {}
    scalars = []
    strings = []
    for leaf in leaves:
        info = infos.get(leaf.name)
        if leaf.value_type in EMPTY_VALUES:
            values[leaf.path] = EMPTY_VALUES[leaf.value_type]()
        elif leaf.value_type == STRING or (leaf.value_type == STORED and info is None):
            strings.append(leaf)
        elif leaf.value_type == INLINE:
            values[leaf.path] = _inline(store, leaf, fill_missing)
        else:
            assert info is not None
            _check_declared(location, leaf, info)
            array = StoredArray(
                store,
                leaf.key,
                leaf.name,
                info.driver,
                info.shape,
                info.dtype,
                info.chunks,
                fill_missing,
                codec=info.codec,
                checksummed=info.checksummed,
                keys=info.keys,
            )
            if leaf.value_type == "scalar":
                scalars.append((leaf.path, array.read(Selection.full(info.shape))))
                continue
            values[leaf.path] = _lazy(location, leaf, array, shardings, key_impls)
    values.update(strings_of(location, strings))
    for leaf_path, future in scalars:
        values[leaf_path] = future.result().item()
    return build_tree(location, [(leaf.path, values[leaf.path]) for leaf in leaves])


def _lazy(
    location: str,
    leaf: Leaf,
    array: StoredArray,
    shardings: dict[str, SavedSharding],
    key_impls: dict[str, str],
) -> LazyArray:
    impl = key_impls.get(leaf.name)
    dtype: object = array.dtype
    if impl is not None:
        try:
            dtype, data_shape = key_dtype(impl)
        except (ValueError, TypeError, KeyError):  # jax knows no such implementation
            raise UnsupportedCheckpointError(
                f"{location}: {leaf.key!r} is recorded as PRNG keys of implementation "
                f"{impl!r}, which this jax does not know; delete array_metadatas/ to read "
                "the keys as their uint32 data"
            ) from None
        if array.shape[len(array.shape) - len(data_shape) :] != data_shape:
            raise CorruptCheckpointError(
                f"{location}: {leaf.key!r} is recorded as {impl} PRNG keys, whose data ends "
                f"in shape {data_shape}, but the stored array has shape {array.shape}"
            )
    return LazyArray(
        path=leaf.path,
        stored=array,
        selection=Selection.full(array.shape),
        dtype=dtype,
        sharding=shardings.get(leaf.name) if leaf.value_type != "np.ndarray" else None,
        key_impl=impl,
    )


def _inline(store: Store, leaf: Leaf, fill_missing: bool) -> object:
    """A value from the msgpack file: arrays become LazyArrays like stored ones."""
    value = leaf.value
    if not isinstance(value, np.ndarray):
        return value
    array = StoredArray(
        store,
        leaf.key,
        leaf.name,
        "inline",
        value.shape,
        value.dtype,
        tuple(max(n, 1) for n in value.shape),
        fill_missing,
        inline=value,
    )
    return LazyArray(leaf.path, array, Selection.full(value.shape), value.dtype)


def _read_text(location: str, name: str) -> str | None:
    return paths.read_text(paths.join(location, name))


def _open_store(
    location: str,
    metadata: dict[str, Any],
    generation: tuple[object, ...],
    *,
    required: bool = True,
    outside_links: bool = False,
) -> Store:
    names = paths.listdir(location)
    per_process = sorted(n for n in names if is_process_folder(n))
    use_ocdbt = metadata.get("use_ocdbt")
    ocdbt = (
        bool(use_ocdbt) if use_ocdbt is not None else bool("manifest.ocdbt" in names or per_process)
    )
    if ocdbt and required:
        # A missing manifest would open as an empty database without error (format notes, Arrays).
        hint = (
            f"; per-process databases {per_process} exist, so the merge step never ran or "
            "the root files were lost"
            if per_process
            else ""
        )
        for needed, what in (("manifest.ocdbt", "root manifest"), ("d", "root data folder")):
            # (A folder over plain HTTP lists the files it was probed for, never `d/`.)
            if needed not in names and not (needed == "d" and probed(location)):
                raise CorruptCheckpointError(
                    f"OCDBT {what} {location}/{needed} is missing{hint}; the checkpoint "
                    "cannot be read as saved, copy it again"
                )
    # (its chunk files, in folders listed at their first read: none from outside the
    # checkpoint, unless `allow_outside_links`)
    return Store.open(
        location,
        ocdbt=ocdbt,
        generation=generation,
        drivers=True,
        listed=True,
        outside_links=outside_links,
    )


def _zarr_infos(
    store: Store, metadata: dict[str, Any], leaves: Sequence[Leaf]
) -> dict[str, ZarrInfo]:
    """Zarr metadata of every stored leaf, read in batches; absent names are left out.

    The declared format (`use_zarr3`) is read first; names missing in it are
    probed in the other format, as checkpoints without `_METADATA` need.
    """
    names = sorted({leaf.name for leaf in leaves})
    for name in names:
        _check_name(store, name)
    zarr3 = bool(metadata.get("use_zarr3", False))
    infos: dict[str, ZarrInfo] = {}
    for formats in (zarr3, not zarr3):
        keys = [metadata_key(name, formats) for name in names]
        missing = []
        for name, key, raw in zip(names, keys, store.read_keys(keys), strict=True):
            if raw is None:
                missing.append(name)
            else:
                infos[name] = parse_zarr(f"{store.location}: array {name!r}", key, raw)
        names = missing
    for leaf in leaves:
        if leaf.name in names and leaf.value_type != STORED:
            raise CorruptCheckpointError(
                f"{store.location}: array {leaf.key!r} is listed in _METADATA but its zarr "
                f"metadata {metadata_key(leaf.name, zarr3)!r} is missing from the store; the "
                "checkpoint is incomplete, copy it again (cp -a keeps dotfiles)"
            )
    return infos


def _check_name(store: Store, name: str) -> None:
    """Refuse names that would read outside the checkpoint folder, or another array's
    files, where each array is a folder of its own (in an OCDBT database a name is a
    key, whatever it holds: Orbax saves `..` there and restores it)."""
    if store.ocdbt:
        return
    if not name.startswith("/") and "\\" not in name and "/." not in f"/{name}":
        return  # the common case, and cheap: no segment starts with a dot
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in ("..", ".") for p in parts):
        raise CorruptCheckpointError(
            f"{store.location}: the checkpoint names an array {name!r}, whose folder would "
            "be outside the checkpoint folder or another array's; refusing to read it. The "
            "metadata is damaged or hostile"
        )


def _check_declared(location: str, leaf: Leaf, info: ZarrInfo) -> None:
    """`_METADATA`'s write_shape (the saved shard) must fit the zarr array."""
    if leaf.value_type == "scalar" and info.shape != ():
        raise CorruptCheckpointError(
            f"{location}: {leaf.key!r} is declared a scalar in _METADATA but its zarr "
            f"metadata has shape {info.shape}; the metadata files disagree"
        )
    shape = leaf.write_shape
    if shape is not None and (
        len(shape) != len(info.shape) or any(w > n for w, n in zip(shape, info.shape, strict=True))
    ):
        raise CorruptCheckpointError(
            f"{location}: {leaf.key!r} is declared with write_shape {shape} in _METADATA but "
            f"its zarr metadata has shape {info.shape} ({info.dtype}); the metadata files "
            "disagree, the checkpoint is damaged"
        )
