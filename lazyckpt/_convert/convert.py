"""`convert`: open a checkpoint, keep some of it, cast it, save it again, streaming."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._array.dtypes import parsed
from lazyckpt._array.tree import Select, leaves, map_leaves, selected
from lazyckpt._convert import fleet, launch
from lazyckpt._convert.plan import ConversionPlan, Converted, plan_orbax, plan_safetensors
from lazyckpt._dequantize import dequantize as dequantized
from lazyckpt._display import as_given
from lazyckpt._errors import (
    CarriedFilesWarning,
    LazyTypeError,
    RenameError,
    ShardingError,
    warn,
)
from lazyckpt._lazy import LazyArray
from lazyckpt._open import open as open_checkpoint
from lazyckpt._rename import rename as rename_keys
from lazyckpt._safetensors.carried import (
    carriable,
    carried_to,
    config_mismatch,
    edited_config,
    read_carried,
    remote_model_folder,
)
from lazyckpt._save import (
    DEFAULT_CHUNK_BYTES,
    Format,
    check_allow_expand,
    check_expansion,
    check_overwrite,
    check_shard_size,
    save_format,
    save_tree,
)
from lazyckpt._sizes import optional_size, size_argument
from lazyckpt._storage import multihost, paths


def _carried_files(
    source: str | os.PathLike[str],
    final: str,
    kind: Format,
    *,
    dequantize: bool,
    dtype: str | None,
    changed: list[str],
    read: bool,
) -> tuple[list[str], dict[str, bytes]]:
    """The names of the files carried from a Hugging Face folder `source` (see
    `lazyckpt._safetensors.carried`), and {path in the checkpoint: contents} to write
    with the weights, read now; `config.json` fitted to a dequantization or a cast,
    with a warning where `changed` options (select=, ...) renamed or dropped tensors."""
    into = carried_to(final, orbax=kind == "orbax")
    if into is None:
        return [], {}
    folder, names = carriable(source)
    if not names:
        if remote_model_folder(source):
            warn(
                f"{as_given(os.fspath(source))} is a remote model folder: its config.json and tokenizer files "
                "are not carried (only a local folder's are); download them beside the "
                "converted weights yourself",
                CarriedFilesWarning,
            )
        return [], {}
    if changed and "config.json" in names:
        config_mismatch(changed)
    if not read:
        return names, {}  # (a dry run reads nothing)
    found = read_carried(folder, names)
    if "config.json" in found:
        found["config.json"] = edited_config(
            found["config.json"], dequantized=dequantize, dtype=dtype
        )
    return names, {(f"{into}/{name}" if into else name): data for name, data in found.items()}


@overload
def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: Format | None = None,
    select: Select | None = None,
    dequantize: bool = False,
    transform: Callable[[Any], object] | None = None,
    dtype: DTypeLike | None = None,
    rename: Sequence[tuple[str, str]] = (),
    rename_dotted: bool = False,
    rename_missing_ok: bool = False,
    step: int | None = None,
    item: str | None = None,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dry_run: Literal[False] = False,
    processes: int = 1,
) -> Converted: ...


@overload
def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: Format | None = None,
    select: Select | None = None,
    dequantize: bool = False,
    transform: Callable[[Any], object] | None = None,
    dtype: DTypeLike | None = None,
    rename: Sequence[tuple[str, str]] = (),
    rename_dotted: bool = False,
    rename_missing_ok: bool = False,
    step: int | None = None,
    item: str | None = None,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dry_run: Literal[True],
    processes: int = 1,
) -> ConversionPlan: ...


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: Format | None = None,
    select: Select | None = None,
    dequantize: bool = False,
    transform: Callable[[Any], object] | None = None,
    dtype: DTypeLike | None = None,
    rename: Sequence[tuple[str, str]] = (),
    rename_dotted: bool = False,
    rename_missing_ok: bool = False,
    step: int | None = None,
    item: str | None = None,
    chunk_bytes: int | str = DEFAULT_CHUNK_BYTES,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
    memory_budget: int | str | None = None,
    overwrite: bool = False,
    allow_expand: bool = False,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dry_run: bool = False,
    processes: int = 1,
) -> Converted | ConversionPlan:
    """Rewrite the checkpoint at `source` at `destination`, as Orbax or safetensors.

    Arrays stream from `source` to `destination` block by block within the budget,
    each stored chunk read once, never loaded whole; `save` writes the result.

    Args:
        source: What `open` takes: an Orbax checkpoint, step folder or root, a
            `.safetensors` file or a Hugging Face model folder.
        destination: The folder (or `.safetensors` file) to create.
        to: "orbax" or "safetensors"; by default as `save` decides from
            `destination`.
        select: Only the leaves matching a path pattern (`params/**/kernel`), any of
            a list of patterns, or a predicate `(path, leaf) -> bool`; see `select`.
        dequantize: Replace FP8 block-scaled and MXFP4 weights by their dense values
            in `dtype` (bfloat16 by default), before `select`: see
            `lazyckpt.dequantize`.
        transform: A function from the lazy tree (after `select`) to the tree to
            save, reading nothing: re-arranging with `stack`, `unstack`,
            `transpose`, `reshape`, `unstack_layers` or plain dict surgery.
        dtype: Cast floating-point arrays to this dtype (integers, booleans and PRNG
            keys keep theirs).
        rename: `(pattern, replacement)` rules for the key paths, applied after
            `select` (see `lazyckpt.rename`): `[(r"^params/", "model/")]`.
        rename_dotted: `rename`'s `dotted`: the rules see every path in the Hugging
            Face spelling (`model.layers.0.mlp`).
        rename_missing_ok: `rename`'s `missing_ok`: let a rule that matches no leaf
            pass (by default it is refused, as a typo would be).
        step: As for `open`.
        item: As for `open`.
        chunk_bytes: As for `save`.
        max_shard_size: As for `save` (a model folder's shards; a destination that is
            one `.safetensors` file, or an Orbax checkpoint, refuses it).
        metadata: As for `save`: text for the safetensors files' `__metadata__`
            (`{"step": "1000"}`), beside `"format": "pt"` unless it sets `format`;
            where a train state's scalars go.
        memory_budget: As for `load`.
        progress: As for `load`.
        overwrite: As for `save`.
        allow_expand: As for `save`: write broadcast views (tensors saved `expand`ed)
            whole, however far their values repeat; without it, `dry_run` too refuses
            one (or all of them together) that would write more than 1 GiB and 1024
            times what it stores.
        storage_options: As for `open`, for both sides.
        dry_run: Write nothing and read no array data: return the `ConversionPlan`,
            what would be written after every `select`, `transform`, `rename` and
            `dtype` (names, shapes, dtypes, bytes, and the safetensors files or
            Orbax chunk shapes, the files it would carry). Typed PRNG keys are
            planned as their key data. A destination that exists is reported
            (`exists`), not refused: the conversion itself refuses it without
            `overwrite`; whether an overwrite may replace it is checked by `save`.
        processes: Start N local processes (a `jax.distributed` job on the loopback)
            that divide the work, each within its own `memory_budget`, on the CPU
            (`JAX_PLATFORMS=cpu`) unless the environment sets `JAX_PLATFORMS`.

    Called with the same arguments in every process of a `jax.distributed` job,
    `convert` divides the work: each process reads and writes a share of the arrays,
    balanced by bytes (views that read the same stored bytes go to one process, so
    each stored byte is read once across the job; an array larger than a share, its
    bytes lying whole in a file, is divided by rows of chunks), within its own
    `memory_budget`. An Orbax destination is written as `save` writes one across
    processes (a database per process, merged by process 0); a safetensors model
    folder's files, cut as one process would cut them, are each written by one
    process and the index by process 0. A failure in any process fails the job in
    every process, naming it, and publishes nothing.

    A local Hugging Face model folder's files that are not weights (`config.json`,
    `generation_config.json`, the tokenizer's files and chat template, ...) go with
    it, so that `from_pretrained` loads the result: beside the weights of a
    safetensors model folder, in the subfolder `huggingface/` of an Orbax checkpoint
    (which Orbax's restore never reads), and back out of there when that checkpoint
    is converted to a folder again. Only the folder's own top-level files that
    `from_pretrained` reads go (`*.json` but a model's index, `tokenizer*`, `*.model`,
    `*.tiktoken`, `*.jinja`, `merges.txt`, `vocab.*`, the model's `*.py`, `README.md`,
    `LICENSE*`: `lazyckpt._safetensors.carried.CARRIED_PATTERNS`), each of at most
    64 MiB (a larger one is left behind with a `CarriedFilesWarning`); not other
    formats' weights, nor links that lead out of the folder, except a Hub cache
    snapshot's links into its repository's `blobs/`. They are read before anything
    is written and published with the weights, all or nothing (a conversion in
    place too). `config.json` is fitted to the result: `dequantize` drops its
    `quantization_config`, and it and `dtype` set its `torch_dtype` (or `dtype`);
    where `select`, `transform` or `rename` changed the tensors' names, a
    `CarriedFilesWarning` says it may not describe them. A remote folder's files
    are not carried (a `CarriedFilesWarning` says so).

    Returns:
        The destination's absolute path (or URL), a `str` whose `carried` lists the
        files carried; with `dry_run`, the plan.

    >>> out = lazyckpt.convert(path, tmp / "params16", select="params",
    ...                        dtype="float16")
    >>> lazyckpt.open(out)["params"]["b"]
    LazyArray('params/b', shape=(8,), dtype=float16, chunks=(8,), sharding=NamedSharding(mesh={'x': 4, 'y': 2}, spec=P()))
    >>> plan = lazyckpt.convert(path, tmp / "hf", to="safetensors", select="params/b",
    ...                         dry_run=True)
    >>> print(plan)  # doctest: +ELLIPSIS
    would write .../hf (safetensors): 1 array, 32 B
    name      dtype    shape  size  file
    params.b  float32  [8]    32 B  model.safetensors
    file model.safetensors: 136 B
    """
    # Bad arguments fail before the source is opened.
    chunk_bytes = size_argument("chunk_bytes", chunk_bytes)
    max_shard_size = optional_size("max_shard_size", max_shard_size)
    memory_budget = optional_size("memory_budget", memory_budget)
    check_overwrite(overwrite)
    check_allow_expand(allow_expand)
    final = paths.normalize(destination)
    kind = save_format(final, format=to, argument="to")
    check_shard_size(final, kind, max_shard_size)
    target = None if dtype is None else _cast_dtype(dtype)
    if launch.processes_argument(processes) > 1 and not dry_run:
        return launch.run_processes(processes, convert, locals())  # type: ignore[no-any-return]

    def prepared() -> tuple[Any, list[str], dict[str, bytes]]:
        tree = open_checkpoint(source, step=step, item=item, storage_options=storage_options)
        if dequantize:
            tree = dequantized(tree, dtype=jnp.bfloat16 if dtype is None else dtype)
        reshaping = [
            option
            for option, given in (
                ("select=", select is not None),
                ("transform=", transform is not None),
                ("rename=", bool(rename)),
            )
            if given
        ]
        names = _names(tree) if reshaping else None
        tree = selected(tree, select)
        if transform is not None:
            tree = transform(tree)
        if rename:
            tree = _renamed(tree, rename, dotted=rename_dotted, missing_ok=rename_missing_ok)
        if target is not None:
            cast_to = target
            tree = map_leaves(lambda leaf: _cast(leaf, cast_to), tree)
        with paths.session(storage_options):
            carried, files = _carried_files(
                source,
                final,
                kind,
                dequantize=dequantize,
                dtype=_dtype_name(jnp.bfloat16 if target is None and dequantize else target),
                changed=reshaping if names is not None and _names(tree) != names else [],
                read=not dry_run,
            )
        return tree, carried, files

    if multihost.count() > 1 and not dry_run:
        # Every process of a job opens and reshapes the tree; one that fails there (its
        # copy of the source missing, say) fails them all, before any waits on it.
        failed: BaseException | None = None
        try:
            tree, carried, files = prepared()
            tree = _host_arrays(tree, final)
        except Exception as error:  # noqa: BLE001 - raised on every process just below
            failed = error
        multihost.agree_on_failure(f"{as_given(final)}: opening {source} failed", failed)
    else:
        tree, carried, files = prepared()
    if dry_run:
        if not allow_expand:  # (as save would refuse, before it writes anything)
            check_expansion(tree)
        with paths.session(storage_options):
            taken = paths.isfile(final) or (paths.isdir(final) and bool(paths.listdir(final)))
        planned = (
            plan_safetensors(final, tree, max_shard_size, metadata)
            if kind == "safetensors"
            else plan_orbax(final, tree, chunk_bytes)
        )
        return attrs.evolve(planned, carried=tuple(carried), exists=taken, overwrite=overwrite)
    out = save_tree(
        destination,
        tree,
        format=to,
        chunk_bytes=chunk_bytes,
        max_shard_size=max_shard_size,
        metadata=metadata,
        memory_budget=memory_budget,
        overwrite=overwrite,
        allow_expand=allow_expand,
        progress=progress,
        storage_options=storage_options,
        label="lazyckpt convert",
        extra_files=files,
        divide=fleet.divide,  # (in a jax.distributed job: each process writes its share)
    )
    return Converted(out, tuple(carried))


def _host_arrays(tree: object, final: str) -> object:
    """`tree` with each jax.Array leaf (one a `transform` made) as a NumPy array, so
    that process 0 alone writes it, as any other leaf that is no LazyArray: divided
    among processes, each holds its own copy, on its own devices."""
    for path, leaf in leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ShardingError(
                f"{as_given(final)}: {path} is a jax.Array sharded across the processes; "
                "a conversion divided among processes writes what it reads from the "
                "source, and leaves that are NumPy arrays or arrays each process holds "
                "whole: make it one (or save such a tree with lazyckpt.save)"
            )
    return map_leaves(lambda leaf: np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf, tree)


def _names(tree: object) -> set[str] | None:
    """The key paths of `tree`'s leaves; None for a tree jax cannot walk (`save` says why)."""
    try:
        return {path for path, _ in leaves(tree)}
    except (TypeError, ValueError):
        return None


def _dtype_name(dtype: DTypeLike | None) -> str | None:
    """A dtype as `config.json`'s `torch_dtype` names it (`bfloat16`, `float16`)."""
    return None if dtype is None else np.dtype(dtype).name


def _renamed(
    tree: object, rules: Sequence[tuple[str, str]], *, dotted: bool, missing_ok: bool
) -> object:
    """`rename`, its refusals naming convert's keywords (`rename_missing_ok=True`), not
    `rename`'s own, which convert does not take."""
    try:
        return rename_keys(tree, rules, dotted=dotted, missing_ok=missing_ok)
    except RenameError as error:
        raise RenameError(re.sub(r"\b(missing_ok|dotted)=", r"rename_\1=", str(error))) from None


def _cast_dtype(dtype: DTypeLike) -> np.dtype[Any]:
    """`dtype=` as the floating-point dtype `convert` casts to."""
    target = parsed(dtype)
    if target is None or not _floating(target):
        raise LazyTypeError(
            f"dtype={dtype!r} is not a floating-point dtype; convert casts "
            "floating-point arrays only, to one such as bfloat16, float16 or float32"
        )
    return target


def _cast(leaf: object, dtype: np.dtype[Any]) -> object:
    if isinstance(leaf, LazyArray) and not leaf.key_impl and _floating(leaf.dtype):
        return leaf.astype(dtype)
    return leaf


def _floating(dtype: np.dtype[Any]) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))
