"""The files beside `_METADATA` that complete a tree: `_strings.json`, which holds the
values of string leaves, and `array_metadatas/`, which names the implementation of
typed PRNG keys."""

from __future__ import annotations

import json
from collections.abc import Sequence

from lazyckpt._array.tree import Path
from lazyckpt._errors import CorruptCheckpointError, json_or_corrupt
from lazyckpt._orbax.metadata import STORED, Leaf, find_string
from lazyckpt._storage import paths


def key_impls_of(location: str) -> dict[str, str]:
    """PRNG key implementations by name, from `array_metadatas/process_*` (format notes, PRNG keys)."""
    folder = paths.join(location, "array_metadatas")
    if not paths.isdir(folder):
        return {}
    impls = {}
    for name in paths.listdir(folder):
        path = paths.join(folder, name)
        try:
            text = paths.read_text(path) or ""
            if "random_key_impl" not in text:
                continue  # the file's only use here is PRNG key identity; skip parsing
            entries = json.loads(text)["array_metadatas"]
            for entry in entries:
                array = entry["array_metadata"]
                impl = (array.get("ext_metadata") or {}).get("random_key_impl")
                if impl is not None:
                    impls[str(array["param_name"])] = str(impl)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
            raise CorruptCheckpointError(
                f"{path} is malformed ({error!r}); expected JSON with an 'array_metadatas' "
                "list; delete the folder to read PRNG keys as their uint32 data"
            ) from None
    return impls


def strings_of(location: str, leaves: Sequence[Leaf]) -> dict[Path, str]:
    """The values of string leaves, from `_strings.json` (format notes, Other leaves)."""
    if not leaves:
        return {}
    text = paths.read_text(paths.join(location, "_strings.json"))
    if text is None:
        stored = [leaf for leaf in leaves if leaf.value_type == STORED]
        if stored:
            raise CorruptCheckpointError(
                f"{location}: {stored[0].key!r} (stored as {stored[0].name!r}) has neither "
                "zarr metadata nor an entry in _strings.json; the checkpoint is incomplete"
            )
        raise CorruptCheckpointError(
            f"{location}/_strings.json is missing but _METADATA lists string leaves "
            f"{[leaf.key for leaf in leaves[:3]]}; copy the checkpoint again"
        )
    table = json_or_corrupt(
        f"{location}/_strings.json", text, "the file is damaged, copy the checkpoint again"
    )
    values = {}
    for leaf in leaves:
        node = find_string(table, leaf.name)
        if not isinstance(node, str):
            found = "nothing" if node is None else f"a {type(node).__name__}"
            raise CorruptCheckpointError(
                f"{location}/_strings.json: expected the string of {leaf.key!r} at "
                f"{'/' + leaf.name!r}, found {found}; the file is damaged, copy the "
                "checkpoint again"
            )
        values[leaf.path] = node
    return values
