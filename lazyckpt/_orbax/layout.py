"""Find the PyTree item folder under a path: a manager root, a step, or the item itself."""

from __future__ import annotations

import json
import operator
import os
import re
from typing import Any

from lazyckpt._errors import (
    CheckpointNotFoundError,
    NotACheckpointError,
    UnfinishedCheckpointError,
)
from lazyckpt._orbax import over_http
from lazyckpt._orbax.metadata import is_process_folder
from lazyckpt._orbax.over_http import JSON_ITEM_FILES
from lazyckpt._orbax.zarr import ZARR2_KEY, ZARR3_KEY
from lazyckpt._storage import paths
from lazyckpt._storage.folders import listing
from lazyckpt._storage.publish import TMP_MARKER, is_unfinished
from lazyckpt._text import ascii_int
from lazyckpt._weights import kinds

_STEP_NAME = re.compile(r"(?:(?P<prefix>.+)_)?(?P<step>[0-9]+)")
_STEP_DIGITS = 100  # (past any step a run reaches: longer names are no steps)
_DEFAULT_ITEMS = ("state", "default", "pytree")
_ZARR_METADATA = (ZARR2_KEY, ZARR3_KEY)


def is_pytree_dir(path: str) -> bool:
    """Whether `path` holds PyTree files directly (format notes, A PyTree folder)."""
    if not paths.isdir(path):
        return False
    names = paths.listdir(path)
    if {"_METADATA", "checkpoint", "manifest.ocdbt"} & set(names):
        return True
    if any(is_process_folder(n) for n in names):
        return True
    return any(
        paths.isfile(paths.join(paths.join(path, n), m))
        for n in names
        if paths.isdir(paths.join(path, n))
        for m in _ZARR_METADATA
    )


def _step_dirs(root: str) -> dict[int, str]:
    """Committed step folders of a CheckpointManager root, by step number.

    As Orbax's `all_steps()`: step folders are named `<step>` or `<prefix>_<step>` with
    one prefix for the whole run. Folders with several prefixes (`a_0`, `b_0`: separate
    checkpoints side by side) or one step twice (`ckpt_1`, `ckpt_01`) are no run."""
    return _steps_by_prefix(root)[0]


def _step_name(name: str) -> tuple[str | None, int] | None:
    """The prefix and step of a step folder's name, `<step>` or `<prefix>_<step>`; None
    for other names. Orbax writes steps in ASCII digits: a folder `\u0661\u0662` is
    no step 12, nor is `12\\n`."""
    match = _STEP_NAME.fullmatch(name)
    step = ascii_int(match["step"], _STEP_DIGITS) if match else None
    return (match["prefix"], step) if match and step is not None else None


def _steps_by_prefix(root: str) -> tuple[dict[int, str], dict[str | None, list[str]]]:
    """The steps, and the step-like folder names by prefix (when they make no run)."""
    by_prefix: dict[str | None, dict[int, str]] = {}
    names: dict[str | None, list[str]] = {}
    twice = False
    for name in paths.listdir(root):
        found = _step_name(name)
        if (
            found
            and not is_unfinished(name)
            and not is_process_folder(name)  # a PyTree's per-process database
            and paths.isdir(paths.join(root, name))
            and _committed(paths.join(root, name))
        ):
            prefix, step = found
            steps = by_prefix.setdefault(prefix, {})
            twice = twice or step in steps
            steps[step] = paths.join(root, name)
            names.setdefault(prefix, []).append(name)
    if len(by_prefix) == 1 and not twice:
        return next(iter(by_prefix.values())), {}
    return {}, names


def _pytree_items(step_dir: str) -> list[str]:
    """Names of the PyTree items inside a step folder."""
    return sorted(
        name
        for name in paths.listdir(step_dir)
        if not is_unfinished(name) and is_pytree_dir(paths.join(step_dir, name))
    )


def json_item_file(folder: str) -> str | None:
    """The JSON file of a JSON item folder, or None if `folder` is not one."""
    if not paths.isdir(folder) or is_pytree_dir(folder):
        return None
    names = paths.listdir(folder)
    for name in JSON_ITEM_FILES:
        if name in names and paths.isfile(paths.join(folder, name)):
            return paths.join(folder, name)
    return None


def _kinds(step_dir: str) -> dict[str, str]:
    """The items of a step folder by name: `pytree` or `json`."""
    found = {}
    for name in paths.listdir(step_dir):
        folder = paths.join(step_dir, name)
        if is_unfinished(name):
            continue
        if is_pytree_dir(folder):
            found[name] = "pytree"
        elif json_item_file(folder) is not None:
            found[name] = "json"
    return dict(sorted(found.items()))


def _listed_items(step_dir: str) -> list[str]:
    try:
        text = paths.read_text(paths.join(step_dir, "_CHECKPOINT_METADATA"))
        handlers = json.loads(text).get("item_handlers") if text is not None else None
    except (OSError, ValueError, AttributeError, RecursionError):
        return []
    return sorted(handlers) if isinstance(handlers, dict) else []


def flax_files(folder: str) -> dict[int, str]:
    """The files of flax's `save_checkpoint` in `folder` (`checkpoint_7`), by step, where
    Orbax's reader finds no checkpoint there: a checkpoint or step folder is Orbax's,
    whatever else it holds. A folder of Orbax steps and flax files is refused by name."""
    found = kinds.flax_steps(folder)
    if not found or is_pytree_dir(folder):
        return {}
    if paths.isfile(paths.join(folder, "_CHECKPOINT_METADATA")):
        return {}
    run, separate = _steps_by_prefix(folder)
    if run or separate:
        # Refused, not one side chosen: Orbax lists only the folders and flax only the
        # files, so each tool's latest step is another, and either choice could hand
        # back a step the user did not mean, with no sign of it.
        some = [name for names in separate.values() for name in names][:6]
        orbax = f"steps {sorted(run)}" if run else f"separate checkpoints {some}"
        latest = run[max(run)] if run else paths.join(folder, some[0])
        raise NotACheckpointError(
            f"{folder} holds both Orbax checkpoint folders ({orbax}) and flax "
            f"save_checkpoint files (steps {sorted(found)}), so its latest step or step= "
            f"could mean either; open one directly: a step's folder ({latest}) or a flax "
            f"file ({found[max(found)]}), or move the other out"
        )
    return {} if _pytree_items(folder) else found


def steps(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> list[int]:
    """The committed steps of a CheckpointManager root, or of a folder of flax's
    `save_checkpoint` files (`checkpoint_7`), in increasing order.

    Unfinished saves (`*.orbax-checkpoint-tmp*`) are not listed.

    Args:
        path: The root folder, local or `s3://` / `gs://`.
        storage_options: As for `open`.

    >>> lazyckpt.steps(run)
    [1, 2]
    """
    with paths.session(storage_options):
        root, _ = _existing_folder(path)
        flax = flax_files(root)
        if flax:
            return sorted(flax)
        found, mixed = _steps_by_prefix(root)
        listed = paths.listdir(root)[:10]
    if mixed:
        some = [name for names in mixed.values() for name in names][:6]
        raise NotACheckpointError(
            f"{root} is not a CheckpointManager root: its step-like folders {some} have "
            f"{len(mixed)} different prefixes or repeat a step, so they are separate "
            "checkpoints, not the steps of one run (Orbax lists none of them); open one of "
            "them"
        )
    if not found:
        raise NotACheckpointError(
            f"{root} is not a CheckpointManager root: it has no committed step folders "
            f"(names like '12' or 'ckpt_000012'; found {listed})"
        )
    return sorted(found)


def items(
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, str]:
    """The items of a step folder (of the latest or given step of a root), by name,
    with their kind: `'pytree'` (a PyTree checkpoint, opened as a lazy tree) or
    `'json'` (an `ocp.args.JsonSave` item, opened as its value).

    Pass one of them to `lazyckpt.open(..., item=NAME)`.

    Args:
        path: A step folder, or a CheckpointManager root.
        step: The step of a root (default: the latest committed).
        storage_options: As for `open`.

    >>> lazyckpt.items(run), lazyckpt.items(run, step=1)
    ({'extra': 'pytree', 'state': 'pytree'}, {'state': 'pytree'})
    """
    with paths.session(storage_options):
        folder, step = _existing_folder(path, step)
        if is_pytree_dir(folder) or flax_files(folder):  # (flax's files have no items)
            return {}
        chosen = _step_folder(folder, step)
        return {} if is_pytree_dir(chosen) else _kinds(chosen)  # (a step saved as one PyTree)


def _step_folder(folder: str, step: int | None) -> str:
    """`folder` itself, or for a CheckpointManager root the folder of `step` (or the
    latest committed step)."""
    found = _step_dirs(folder)
    items = _pytree_items(folder)
    # Step folders that are PyTree folders themselves (saved directly, one per step)
    # make a root too; a step folder with items has _CHECKPOINT_METADATA, or items
    # not named like steps.
    step_like = paths.isfile(paths.join(folder, "_CHECKPOINT_METADATA")) or any(
        _step_name(name) is None for name in items
    )
    if not found or (items and step_like) or is_pytree_dir(folder):
        if step is not None:
            raise CheckpointNotFoundError(
                f"{folder} is not a CheckpointManager root (no step folders), so "
                f"step={step} cannot be chosen; pass the root folder, or drop step="
            )
        return folder
    if step is None:
        return found[max(found)]
    if step not in found:
        for name in paths.listdir(folder):
            named = _step_name(name.split(TMP_MARKER)[0]) if is_unfinished(name) else None
            if named is not None and named[1] == step:
                raise UnfinishedCheckpointError(
                    f"{folder} has no committed step {step}, but {name} is a save of it "
                    "that has not committed (still running, or interrupted); wait for it "
                    f"to finish, or open a committed step: {sorted(found)}"
                )
        raise CheckpointNotFoundError(
            f"{folder} has no committed step {step}; committed steps: {sorted(found)}"
        )
    return found[step]


def _probed(path: str, step: int | None) -> tuple[str, int | None]:
    """`path` and `step`, where `path` over plain HTTP was probed for a checkpoint's
    files (`over_http`); for a CheckpointManager root there, which lists nothing, the
    folder of `step` by its default name, and no step."""
    over_http.probe(path)
    if step is None or not paths.is_web(path) or listing(path) is not None:
        return path, step
    found = over_http.step_folder(path, step)
    if found is None:
        raise CheckpointNotFoundError(
            f"{path}: over plain HTTP a folder has no listing, and there is no step "
            f"folder {path}/{step} (as Orbax names steps by default); open the step's "
            "folder by its URL"
        )
    return found, None


def _step_number(path: str | os.PathLike[str], step: object) -> int | None:
    """`step` as an int (NumPy's integers too); refused by name where it is not one."""
    if step is None:
        return None
    try:
        if isinstance(step, bool):
            raise TypeError
        return operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise NotACheckpointError(
            f"{path}: step={step!r} is a {type(step).__name__}, but steps are whole "
            "numbers; pass an int"
        ) from None


def _existing_folder(
    path: str | os.PathLike[str], step: int | None = None
) -> tuple[str, int | None]:
    """The folder at `path` (and `step` of it, see `_probed`), which must exist."""
    step = _step_number(path, step)
    folder, step = _probed(paths.normalize(path), step)
    if paths.is_web(folder) and listing(folder) is None:
        raise CheckpointNotFoundError(
            f"{folder}: a folder over plain HTTP has no listing, and no checkpoint files "
            "were found there by name, so its steps and items cannot be found; open a "
            "step by its URL (ROOT/STEP), or pass step= to lazyckpt.open"
        )
    if not paths.isdir(folder):
        raise CheckpointNotFoundError(f"{folder} is not an existing folder; check the path")
    return folder, step


def locate(path: str, *, step: int | None = None, item: str | None = None) -> str:
    """The item folder that `path` (with `step` and `item`) points to: a PyTree item,
    or a JSON item when one is asked for by name (or `path` is one)."""
    path = paths.normalize(path)
    if is_unfinished(paths.basename(path)):
        raise UnfinishedCheckpointError(
            f"{path} is an unfinished save (its name contains {TMP_MARKER!r}): the save "
            "never committed and its contents may be partial; open a committed step instead"
        )
    step = _step_number(path, step)
    path, step = _probed(path, step)
    if not paths.exists(path):
        unfinished = _unfinished_save_of(path)
        if unfinished is not None:
            raise UnfinishedCheckpointError(
                f"{path} does not exist, but {unfinished} does: a save to it that has not "
                "committed (still running, or interrupted); wait for it to finish, or open "
                "an earlier step"
            )
        raise CheckpointNotFoundError(f"{path} does not exist; check the checkpoint path")
    if not paths.isdir(path):
        raise NotACheckpointError(
            f"{path} is a file, but a checkpoint is a folder; pass the folder that holds "
            "_METADATA (or a CheckpointManager root or step folder)"
        )
    parent = paths.dirname(path)
    if is_process_folder(paths.basename(path)) and paths.isfile(paths.join(parent, "_METADATA")):
        raise NotACheckpointError(
            f"{path} holds one process's part of the checkpoint {parent} (its arrays "
            f"without their tree); open {parent}"
        )
    if step is None and item is None and (is_pytree_dir(path) or json_item_file(path)):
        found = path
    else:
        folder = _step_folder(path, step)
        pytree = folder != path and is_pytree_dir(folder) and item is None
        found = folder if pytree else _item(folder, item)
    if not _finished(found):
        raise UnfinishedCheckpointError(
            f"{found} has no commit_success.txt, which on object storage marks a finished "
            "save (there is no rename to commit with); the save is unfinished or was "
            "interrupted: open an earlier step, or save again"
        )
    return found


def _unfinished_save_of(path: str) -> str | None:
    """The folder beside `path` that a save to `path` writes before it commits (Orbax
    names it `path` + `.orbax-checkpoint-tmp-N`), where one is there; local only."""
    if paths.is_remote(path):
        return None
    name = paths.basename(path)
    try:
        beside = paths.listdir(paths.dirname(path))
    except OSError:
        return None
    found = sorted(other for other in beside if other.startswith(name + TMP_MARKER))
    return paths.join(paths.dirname(path), found[-1]) if found else None


def _finished(item: str) -> bool:
    """Whether the save of the PyTree folder `item` finished: its step folder's commit
    marker when it is an item of a step, else its own."""
    if paths.atomic_rename(item):
        return True
    step = paths.dirname(item)
    in_step = not paths.isfile(paths.join(item, "_CHECKPOINT_METADATA")) and paths.isfile(
        paths.join(step, "_CHECKPOINT_METADATA")
    )
    return _committed(step) if in_step else _committed(item) or _committed(step)


def _committed(folder: str) -> bool:
    """Whether a save to `folder` finished. On object storage only the presence of
    commit_success.txt says so (format notes, Folders and levels); on a local disk the rename did."""
    return paths.atomic_rename(folder) or paths.isfile(paths.join(folder, "commit_success.txt"))


def _item(step_dir: str, item: str | None) -> str:
    present = _pytree_items(step_dir)
    if item is not None and is_pytree_dir(step_dir):
        raise NotACheckpointError(
            f"{step_dir} is a PyTree checkpoint itself, not a step folder of items, so "
            f"item={item!r} cannot be chosen; open it without item="
        )
    if item is not None:
        if not item or item in (".", "..") or any(c in item for c in "/\\\0"):
            raise NotACheckpointError(
                f"item={item!r} is not an item name: items are folders directly inside a "
                f"step folder ({step_dir}), named like 'state' or 'params'"
            )
        kinds = _kinds(step_dir)
        if item in kinds:
            return paths.join(step_dir, item)
        if paths.isdir(paths.join(step_dir, item)):
            raise NotACheckpointError(
                f"item {item!r} in {step_dir} is neither a PyTree nor a JSON item (it holds "
                f"{paths.listdir(paths.join(step_dir, item))[:5]}); items: {kinds}"
            )
        if item in _listed_items(step_dir):
            raise CheckpointNotFoundError(
                f"item {item!r} is listed in {step_dir}/_CHECKPOINT_METADATA but its folder "
                f"is missing; items present: {list(kinds)}"
            )
        raise CheckpointNotFoundError(
            f"{step_dir} has no item {item!r}; items present: {list(kinds)}"
        )
    for name in _DEFAULT_ITEMS:
        if name in present:
            return paths.join(step_dir, name)
    if len(present) == 1:
        return paths.join(step_dir, present[0])
    _, mixed = _steps_by_prefix(step_dir)
    if mixed:
        some = [name for names in mixed.values() for name in names][:6]
        raise NotACheckpointError(
            f"{step_dir} holds separate checkpoints {some}, not the steps of one run (their "
            "names have different prefixes or repeat a step); open one of them"
        )
    if present:
        raise NotACheckpointError(
            f"{step_dir} holds several items {present}; choose one with item=NAME"
        )
    unfinished = [n for n in paths.listdir(step_dir) if is_unfinished(n)]
    if unfinished:
        raise UnfinishedCheckpointError(
            f"{step_dir} holds only unfinished saves {unfinished}; wait for the save to "
            "finish or open an earlier checkpoint"
        )
    listed = [
        name for name in _listed_items(step_dir) if not paths.isdir(paths.join(step_dir, name))
    ]
    if listed:
        raise CheckpointNotFoundError(
            f"{step_dir}/_CHECKPOINT_METADATA lists the item(s) {listed}, but their folders "
            f"are missing (found {paths.listdir(step_dir)[:10]}); the step was copied "
            "incompletely: copy it again, or open another step"
        )
    raise NotACheckpointError(
        f"{step_dir} is not an Orbax checkpoint: it has no _METADATA, manifest.ocdbt, "
        f"step folders or item folders (found {paths.listdir(step_dir)[:10]}); "
        "pass the folder that a checkpointer saved to"
    )
