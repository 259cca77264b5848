"""An Orbax checkpoint at a plain https:// URL, whose folder has no listing: its files
found by the names the format gives them.

A PyTree folder is known by `_METADATA`, `manifest.ocdbt` or the legacy `checkpoint`
file, a step folder by `_CHECKPOINT_METADATA`, whose `item_handlers` name its items;
the arrays' files are named by the OCDBT manifest and b-tree, or by `_METADATA` and
the zarr headers, which tensorstore's drivers read by name. What needs a listing
cannot be done: the steps of a CheckpointManager root (a step is found only where its
folder is named by its number, as Orbax names it by default), or the tree of a folder
without `_METADATA`. A Hub folder is listed at its commit and needs none of this.
"""

from __future__ import annotations

import json

from lazyckpt._storage import paths
from lazyckpt._storage.folders import Site, listing, register
from lazyckpt._storage.probes import present

JSON_ITEM_FILES = ("metadata", "data.json")
"""The file of a JSON item (`ocp.args.JsonSave`): Orbax's v0 JsonCheckpointHandler
writes `metadata`, v1's JsonHandler `data.json` (format notes, Folders and levels)."""
_TREE_FILES = ("_METADATA", "manifest.ocdbt", "checkpoint")
"""Files that make a folder a PyTree checkpoint."""
_FILES = (
    *_TREE_FILES,
    "_CHECKPOINT_METADATA",
    "commit_success.txt",
    "_sharding",
    "_strings.json",
    "array_metadatas/process_0",
    *JSON_ITEM_FILES,
)
"""Every file of a checkpoint folder that lazyckpt reads by its own name."""
_ITEMS = 64
"""The most items of a step folder probed (Orbax's steps have a few)."""


def probe(folder: str) -> None:
    """Register the checkpoint files at `folder` (an http(s):// URL without a listing),
    and those of its items where it is a step folder; nothing where it holds none,
    or is listed already (on the Hub)."""
    known = listing(folder)
    if not paths.is_web(folder) or (known is not None and known.asked is None):
        return
    asked = list(_FILES)
    names = present(folder, asked)
    if "_CHECKPOINT_METADATA" in names and not names & set(_TREE_FILES):
        items = [f"{item}/{name}" for item in _items(folder) for name in _FILES]
        names |= present(folder, items)
        asked += items
    if names:
        register(folder, Site(tuple(sorted(names)), asked=tuple(asked)))


def step_folder(root: str, step: int) -> str | None:
    """The folder of `step` under a CheckpointManager root over plain HTTP, probed where
    Orbax names it by default (its number); None where it is not there."""
    folder = paths.join(root, str(step))
    probe(folder)
    return folder if listing(folder) is not None else None


def _items(folder: str) -> list[str]:
    """The item names that the step folder's `_CHECKPOINT_METADATA` lists (none where
    it is damaged: the step then has no items, which opening it says)."""
    try:
        text = paths.read_text(paths.join(folder, "_CHECKPOINT_METADATA"))
        handlers = json.loads(text or "{}").get("item_handlers")
    except (ValueError, AttributeError, RecursionError):
        return []
    if not isinstance(handlers, dict):
        return []
    return [
        name
        for name in list(handlers)[:_ITEMS]
        if isinstance(name, str) and name and "/" not in name and name not in (".", "..")
    ]
