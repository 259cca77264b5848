"""`open`: a checkpoint of either format as a lazy tree (`lazyckpt._orbax.read`,
`lazyckpt._safetensors.read`)."""

from __future__ import annotations

import functools
import os
from typing import Any

from lazyckpt._array.tree import gc_paused, leaves
from lazyckpt._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnfinishedCheckpointError,
    UnsupportedCheckpointError,
)
from lazyckpt._orbax.layout import flax_files
from lazyckpt._orbax.read import listed_arrays, open_orbax
from lazyckpt._safetensors.read import is_safetensors, open_safetensors
from lazyckpt._storage import paths
from lazyckpt._storage.publish import SWAP_SUFFIX, interrupted_overwrite
from lazyckpt._weights import kinds
from lazyckpt._weights.read import is_weights, open_weights


def open(  # noqa: A001 - the library's main verb, used as lazyckpt.open
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    item: str | None = None,
    storage_options: dict[str, Any] | None = None,
    allow_outside_links: bool = False,
    flat: bool = False,
    keep_tied: bool = False,
) -> Any:
    """Open an Orbax checkpoint, safetensors files, or PyTorch, NumPy or flax weight
    files, as a pytree of `LazyArray`s.

    Reads metadata, and the small stored arrays of strings and Python scalars,
    which come back as their values; every other array is a `LazyArray`, read only
    when asked. Empty containers and None come back as saved. The tree is read from
    one generation of the checkpoint: a later read of a checkpoint replaced since
    raises `CheckpointChangedError`.

    Args:
        path: A PyTree checkpoint folder, a step folder with items, or a
            CheckpointManager root; or a `.safetensors` file, or a Hugging Face model
            folder (sharded with `model.safetensors.index.json`, or one file). Local,
            `s3://bucket/prefix` or `gs://bucket/prefix`; a safetensors model on the
            Hugging Face Hub, `hf://ORG/NAME[@REVISION][/PATH]`, pinned to the commit
            its revision names now (`pip install 'lazyckpt[hf]'`), or at any
            `https://` URL whose server answers Range requests (a user name and
            password in it are sent as HTTP Basic auth; a pre-signed file's URL,
            `.../x.safetensors?X-Amz-Signature=...`, opens that file, its query sent
            with each request; neither is ever shown). Safetensors names
            (`model.layers.0.mlp.up_proj.weight`) nest by their `.`-separated parts;
            each tensor's header is read, none of its data; symlinks are followed
            (the Hugging Face cache links files to its blobs). Or a `torch.save`
            file (`.bin`, `.pt`, `.pth`), a `pytorch_model.bin` folder (sharded with
            its index), a flax msgpack file (or a folder of flax's
            `save_checkpoint` files, `checkpoint_7`), or an `.npz` / `.npy` file, read
            without torch and without running a pickle: a pickle that names any
            global but a tensor's, a storage's or a plain container's is an
            `UnsafePickleError`, raised before anything runs. A local file whose name
            has no suffix lazyckpt knows is read as its first bytes say; one whose
            suffix says another format than its bytes is a `NotACheckpointError`.
        step: The step of a CheckpointManager root, or of a folder of flax's
            `save_checkpoint` files (default: the latest committed).
        item: The item of a step folder (see `lazyckpt.items`); a JSON item
            (`ocp.args.JsonSave`) opens as its value. Default: `state`, `default` or
            the only PyTree item.
        storage_options: For a bucket, added to what the environment says
            (`AWS_ENDPOINT_URL`, ...): `endpoint`, `region`, tensorstore kvstore
            options, and `retries` (how often a failed request is tried, an int from
            1 to 100; 6 by default, about 16 s in all). For an `https://` URL,
            `headers` (a dict of header names to values) and `token` (sent as
            `Authorization: Bearer TOKEN`), sent to the URL's own origin only, also
            by the tree's later reads.
        allow_outside_links: Read through symlinks that lead out of the checkpoint
            folder (refused by default: a copied checkpoint could otherwise read any
            file as array data).
        flat: A flat dict by key path (`params/dense/kernel`; safetensors tensors by
            their own names) instead of the nested tree.
        keep_tied: For a Hugging Face `pytorch_model.bin` model, every name its files
            hold, as `torch.load` shows them. transformers saves a tied weight
            (`lm_head.weight`, the embedding's storage) under both its names there,
            and once in the model's safetensors form, which the tree matches by
            default; with `keep_tied=True` the second name is kept too, a view of
            the same bytes. Other files and formats keep every name anyway.

    Returns:
        The checkpoint's tree, in the node types it was saved with.

    >>> tree = lazyckpt.open(path)
    >>> tree["step"], tree["params"]["b"]
    (3, LazyArray('params/b', shape=(8,), dtype=float32, chunks=(8,), sharding=NamedSharding(mesh={'x': 4, 'y': 2}, spec=P())))
    """
    with gc_paused(), paths.session(storage_options):
        where = paths.normalize(path)
        try:
            for holds, kind, read in (
                (is_safetensors, "safetensors", open_safetensors),
                (is_weights, "weight files", functools.partial(open_weights, keep_tied=keep_tied)),
            ):
                if not holds(where):
                    continue
                if step is not None or item is not None:
                    raise NotACheckpointError(
                        f"{where} holds {kind}, which have no steps or items; open it "
                        "without step= and item="
                    )
                try:
                    return read(where, flat=flat)
                except CorruptCheckpointError:
                    kinds.check_file(where)  # (bytes of another format: say so instead)
                    raise
            unnamed = _unnamed(where, step)
            if unnamed is not None:
                if item is not None:
                    raise NotACheckpointError(
                        f"{unnamed} is a weight file, which has no items; open it without item="
                    )
                if kinds.sniffed(unnamed) == kinds.SAFETENSORS:
                    return open_safetensors(unnamed, flat=flat)
                return open_weights(unnamed, flat=flat, keep_tied=keep_tied)
            tree = open_orbax(where, step=step, item=item, allow_outside_links=allow_outside_links)
        except (CheckpointNotFoundError, NotACheckpointError, UnfinishedCheckpointError):
            staged = interrupted_overwrite(where)
            if staged is None:
                raise
            raise UnfinishedCheckpointError(
                f"{where}: an overwrite was interrupted while it copied the new checkpoint "
                f"in; the complete new checkpoint is at {staged}. Save to {where} again "
                f"(overwrite=True), or copy the objects under {staged}/ into {where}/ "
                f"(commit_success.txt or the index last) and delete {where}{SWAP_SUFFIX}"
            ) from None
    return _flat(where, tree) if flat else tree


def _unnamed(where: str, step: int | None) -> str | None:
    """The weight file to read at `where` by its content, where its name says no format:
    `where` itself, or in a folder the file of flax's `save_checkpoint` of `step` (by
    default the latest, as flax's `restore_checkpoint` picks). None where neither is."""
    if kinds.sniffed(where) is not None:
        if step is not None:
            raise NotACheckpointError(
                f"{where} is a weight file, which has no steps; open it without step="
            )
        return where
    saved = flax_files(where)  # (none in a folder Orbax reads; both refused)
    if not saved:
        return None
    if step is None:
        return saved[max(saved)]
    if step not in saved:
        raise CheckpointNotFoundError(
            f"{where} has no flax checkpoint of step {step}: its steps are {sorted(saved)}; "
            "pass one of them as step=, or none for the latest"
        )
    return saved[step]


def _flat(where: str, tree: Any) -> dict[str, Any]:
    """`tree` as a dict by key path; two leaves whose paths read alike (an Orbax tree
    of keys `a/b` and `a` > `b`) are refused, not one kept."""
    flat: dict[str, Any] = {}
    for path, leaf in leaves(tree):
        if path in flat:
            raise UnsupportedCheckpointError(
                f"{where}: two leaves have the key path {path!r} (a key holding '/' beside "
                "a nested one), and a flat dict can hold one; open it without flat=True, "
                "where both are kept in their subtrees"
            )
        flat[path] = leaf
    return flat


def arrays_listed(
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    item: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """The key paths of the arrays an Orbax checkpoint's `_METADATA` lists, read
    without opening its store (for reports on a checkpoint that does not open); none
    for safetensors, whose list of names is the header that failed."""
    with paths.session(storage_options):
        where = paths.normalize(path)
        if is_safetensors(where):
            return []
        return listed_arrays(where, step=step, item=item)
