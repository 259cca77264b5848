"""Find the PyTree item folder under a path: a manager root, a step, or the item itself."""

from __future__ import annotations

import json
import os
import re

from lazyckpt._errors import (
    CheckpointNotFoundError,
    NotACheckpointError,
    UnfinishedCheckpointError,
)

_TMP_MARKER = ".orbax-checkpoint-tmp"
_STEP_NAME = re.compile(r"^(?:(?P<prefix>.+)_)?(?P<step>\d+)$")
_DEFAULT_ITEMS = ("state", "default", "pytree")
_ZARR_METADATA = (".zarray", "zarr.json")


def is_unfinished(name: str) -> bool:
    return _TMP_MARKER in name


def is_pytree_dir(path: str) -> bool:
    """Whether `path` holds PyTree files directly (spec §0)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if {"_METADATA", "checkpoint", "manifest.ocdbt"} & set(names):
        return True
    if any(n.startswith("ocdbt.process_") for n in names):
        return True
    return any(
        os.path.exists(os.path.join(path, n, m))
        for n in names
        if os.path.isdir(os.path.join(path, n))
        for m in _ZARR_METADATA
    )


def steps(root: str) -> dict[int, str]:
    """Committed step folders of a CheckpointManager root, by step number."""
    found: dict[int, str] = {}
    for name in sorted(os.listdir(root)):
        match = _STEP_NAME.match(name)
        if match and not is_unfinished(name) and os.path.isdir(os.path.join(root, name)):
            found[int(match["step"])] = os.path.join(root, name)
    return found


def items(step_dir: str) -> list[str]:
    """Names of the PyTree items inside a step folder."""
    return sorted(
        name
        for name in os.listdir(step_dir)
        if not is_unfinished(name) and is_pytree_dir(os.path.join(step_dir, name))
    )


def _listed_items(step_dir: str) -> list[str]:
    try:
        with open(os.path.join(step_dir, "_CHECKPOINT_METADATA")) as f:
            handlers = json.load(f).get("item_handlers")
    except (OSError, ValueError, AttributeError):
        return []
    return sorted(handlers) if isinstance(handlers, dict) else []


def locate(path: str, *, step: int | None = None, item: str | None = None) -> str:
    """The PyTree item folder that `path` (with `step` and `item`) points to."""
    path = os.path.abspath(os.fspath(path))
    if is_unfinished(os.path.basename(path)):
        raise UnfinishedCheckpointError(
            f"{path} is an unfinished save (its name contains {_TMP_MARKER!r}): the save "
            "never committed and its contents may be partial; open a committed step instead"
        )
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist; check the checkpoint path")
    if not os.path.isdir(path):
        raise NotACheckpointError(
            f"{path} is a file, but a checkpoint is a folder; pass the folder that holds "
            "_METADATA (or a CheckpointManager root or step folder)"
        )
    if is_pytree_dir(path):
        return path
    found_steps = steps(path)
    if found_steps and not items(path):
        if step is None:
            step = max(found_steps)
        elif step not in found_steps:
            raise CheckpointNotFoundError(
                f"{path} has no committed step {step}; committed steps: {sorted(found_steps)}"
            )
        return locate(found_steps[step], item=item)
    if step is not None:
        raise CheckpointNotFoundError(
            f"{path} is not a CheckpointManager root (no step folders), so step={step} "
            "cannot be chosen; pass the root folder, or drop step="
        )
    return _item(path, item)


def _item(step_dir: str, item: str | None) -> str:
    present = items(step_dir)
    if item is not None:
        if item in present:
            return os.path.join(step_dir, item)
        if os.path.isdir(os.path.join(step_dir, item)):
            raise NotACheckpointError(
                f"item {item!r} in {step_dir} is not a PyTree item (it holds "
                f"{sorted(os.listdir(os.path.join(step_dir, item)))[:5]}); PyTree items: {present}"
            )
        if item in _listed_items(step_dir):
            raise CheckpointNotFoundError(
                f"item {item!r} is listed in {step_dir}/_CHECKPOINT_METADATA but its folder "
                f"is missing; items present: {present}"
            )
        raise CheckpointNotFoundError(f"{step_dir} has no item {item!r}; items present: {present}")
    for name in _DEFAULT_ITEMS:
        if name in present:
            return os.path.join(step_dir, name)
    if len(present) == 1:
        return os.path.join(step_dir, present[0])
    if present:
        raise NotACheckpointError(
            f"{step_dir} holds several items {present}; choose one with item=NAME"
        )
    unfinished = sorted(n for n in os.listdir(step_dir) if is_unfinished(n))
    if unfinished:
        raise UnfinishedCheckpointError(
            f"{step_dir} holds only unfinished saves {unfinished}; wait for the save to "
            "finish or open an earlier checkpoint"
        )
    raise NotACheckpointError(
        f"{step_dir} is not an Orbax checkpoint: it has no _METADATA, manifest.ocdbt, "
        f"step folders or item folders (found {sorted(os.listdir(step_dir))[:10]}); "
        "pass the folder that a checkpointer saved to"
    )
