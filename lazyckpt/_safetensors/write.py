"""Writing safetensors: one file, or Hugging Face's sharded layout, streamed.

LazyArrays stream block by block through the read engine within the budget, each
stored chunk read once; `jax.Array`s are written from their addressable shards (each
distinct shard once), NumPy arrays whole. Every block goes straight to its place in
the file (`pwrite`), so nothing holds a whole tensor. A local save is written into a
temporary name and renamed into place; in a bucket, each file is uploaded in one
request from memory, and the index goes last, so a model whose upload stopped part
way never opens.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from lazyckpt._array.tree import leaves
from lazyckpt._engine.progress import Progress, shown
from lazyckpt._engine.stored import stores
from lazyckpt._engine.stream import read_blocks
from lazyckpt._errors import CheckpointExistsError, LazyckptError, UnsavableError
from lazyckpt._lazy import LazyArray
from lazyckpt._safetensors.format import (
    DTYPES,
    INDEX,
    METADATA_KEY,
    PACKED,
    SINGLE,
    SUFFIX,
    dtype_name,
    encode_header,
    index_json,
    is_model_file,
    parse_index,
    shard_name,
)
from lazyckpt._storage import multihost, paths
from lazyckpt._storage.kvstore import check_unchanged
from lazyckpt._storage.local import pwrite_all
from lazyckpt._storage.publish import publishing
from lazyckpt._text import fold, is_utf8, printable
from lazyckpt._text import shown as value_text

DEFAULT_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default `max_shard_size` ("5GB")."""
DEFAULT_METADATA = {"format": "pt"}
"""What `transformers` expects in `__metadata__` to load a file."""
_ARRAYS = (LazyArray, jax.Array, np.ndarray, np.generic)
_LISTED = 8  # (folded) leaves that are no arrays a refusal names, and flags it writes


@attrs.frozen
class _Entry:
    name: str
    path: str
    """The key path in the tree being saved."""
    value: object
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@attrs.frozen
class File:
    """One file as `plan_files` cut it: its name, tensors and header."""

    name: str
    entries: tuple[_Entry, ...]
    """In the order of their bytes: larger items first, so each starts aligned."""
    header: bytes

    @property
    def offsets(self) -> dict[str, int]:
        out, offset = {}, len(self.header)
        for entry in self.entries:
            out[entry.name] = offset
            offset += entry.nbytes
        return out

    @property
    def size(self) -> int:
        return len(self.header) + sum(entry.nbytes for entry in self.entries)


def save_safetensors(
    path: str,
    tree: object,
    *,
    max_shard_size: int | None,
    metadata: Mapping[str, str] | None,
    memory_budget: int | None,
    overwrite: bool,
    replaceable: Callable[[str], bool],
    progress: bool | None,
    label: str = "lazyckpt save",
    extra_files: Mapping[str, bytes] | None = None,
) -> str:
    """Write `tree` at `path` (see `lazyckpt.save`); `extra_files` ({name: contents})
    go into a model folder with the tensors, before its index (the files `convert`
    carries)."""
    if multihost.count() > 1:
        raise UnsavableError(
            f"{path}: saving safetensors in a run of {multihost.count()} processes is not "
            "supported (one process writes a file); save an Orbax checkpoint, or convert "
            "one afterwards from a single process"
        )
    files, index = plan_files(path, tree, max_shard_size=max_shard_size, metadata=metadata)
    single = path.endswith(SUFFIX)
    entries = [entry for file in files for entry in file.entries]
    total = sum(entry.nbytes for entry in entries)
    with (
        shown(progress, total, label) as bar,
        _destination(path, single, overwrite, replaceable) as write,
    ):
        for file in files:
            write(file.name, lambda out, file=file: write_file(out, file, memory_budget, bar))
        for name, data in {} if single else (extra_files or {}).items():
            write(name, lambda out, data=data: out.write(data))
        if index is not None:
            write(INDEX, lambda out: out.write(index.encode()))
    return path


def plan_files(
    path: str,
    tree: object,
    *,
    max_shard_size: int | None,
    metadata: Mapping[str, str] | None,
) -> tuple[list[File], str | None]:
    """The files `save_safetensors` writes at `path` and their index (None for one
    file), from the tree's metadata alone: names, shapes, dtypes, headers."""
    entries = _entries(tree)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise UnsavableError(
            f"{path}: safetensors metadata is a dict of strings to strings, not "
            f"{type(metadata).__name__}; pass metadata={{'format': 'pt', ...}}"
        )
    # (format=pt unless the caller says otherwise: transformers refuses a file without
    # it, and a caller's own keys, a step, say, should not cost that)
    meta = {**DEFAULT_METADATA, **(metadata or {})}
    odd = {
        k: v
        for k, v in meta.items()
        if not isinstance(k, str) or not isinstance(v, str) or not is_utf8(k + v)
    }
    if odd:
        raise UnsavableError(
            f"{path}: safetensors metadata maps strings to strings, but it holds "
            f"{str(odd)[:80]}; pass strings (str(value)), as readers expect"
        )
    single = path.endswith(SUFFIX)
    limit = DEFAULT_SHARD_BYTES if max_shard_size is None else max_shard_size
    per_file = [list(entries)] if single else _shards(entries, limit)
    if single:
        names = [paths.basename(path)]
    elif len(per_file) == 1:
        names = [SINGLE]
    else:
        names = [shard_name(i + 1, len(per_file)) for i in range(len(per_file))]
    files = [
        _file(name, entries_of, meta) for name, entries_of in zip(names, per_file, strict=True)
    ]
    index = (
        index_json(
            {entry.name: file.name for file in files for entry in file.entries},
            sum(entry.nbytes for entry in entries),
            meta,
        )
        if len(files) > 1
        else None
    )
    return files, index


def _entries(tree: object) -> list[_Entry]:
    out: list[_Entry] = []
    by_name: dict[str, str] = {}
    found = list(leaves(tree))
    _check_arrays(found)
    for key, leaf in found:
        name = key.replace("/", ".")
        where = printable(key) or "(the root)"
        if not is_utf8(name):
            raise UnsavableError(
                f"{where}: the name is no valid text (a lone surrogate); safetensors names "
                "are UTF-8, rename the key"
            )
        if (isinstance(leaf, LazyArray) and leaf.key_impl) or (
            isinstance(leaf, jax.Array) and (jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key))
        ):
            raise UnsavableError(
                f"{where} holds typed PRNG keys, which safetensors cannot represent; save "
                "jax.random.key_data(...) instead, or leave it out with select"
            )
        dtype = np.dtype(leaf.dtype)
        if dtype in PACKED.values():
            raise UnsavableError(
                f"{where} has dtype {dtype}, which safetensors packs two values per byte "
                "(F4): lazyckpt reads it but does not write it; dequantize it "
                "(lazyckpt.dequantize) or cast it (astype) first"
            )
        if dtype_name(dtype) is None:
            raise UnsavableError(
                f"{where} has dtype {dtype}, which safetensors has no name for; cast it "
                f"(astype) to one of {', '.join(str(d) for d in DTYPES.values())}"
            )
        if name == METADATA_KEY:
            raise UnsavableError(
                f"{where} would be saved as {name!r}, the header entry safetensors keeps "
                "for the file's metadata, and no reader could open the file; rename the key"
            )
        if name in by_name:
            raise UnsavableError(
                f"{by_name[name]!r} and {key!r} would both be saved as {name!r}; rename one"
            )
        by_name[name] = key
        out.append(_Entry(name, key, leaf, dtype.newbyteorder("="), tuple(leaf.shape)))
    return out


def _check_arrays(found: list[tuple[str, Any]]) -> None:
    """Refuse the leaves that are no arrays (a train state's step, a name), all of them
    at once: one attempt shows every `--select '!PATH'` a conversion needs."""
    others = [(printable(key), leaf) for key, leaf in found if not isinstance(leaf, _ARRAYS)]
    if not others:
        return
    value = dict(others)
    lines = fold(((key, type(leaf).__name__) for key, leaf in others), vary=False)
    shown = [
        f"{line.path or '(the root)'} (the {line.detail} {value_text(value[line.path])})"
        if line.count == 1 and line.path in value
        else f"{line.path} ({line.count} {line.detail}s)"
        for line in lines[:_LISTED]
    ]
    if len(lines) > _LISTED:
        shown.append(f"and {sum(line.count for line in lines[_LISTED:])} more")
    # (exact patterns only: a folded path is one, `select` reads its braces; one whose
    # numbers were elided is not)
    patterns = [f"!{line.path}" for line in lines if line.path and "..." not in line.path]
    key = next((line.path for line in lines if line.count == 1), others[0][0])
    leaf = value[key]
    example = {key or "key": leaf[:40] if isinstance(leaf, str) else value_text(leaf)}
    many = len(others) > 1
    leave = (
        f"leave {'them' if many else 'it'} out with select (convert "
        f"{' '.join(f'--select {shlex.quote(p)}' for p in patterns[:_LISTED])}; "
        f"select={patterns[:_LISTED]!r}, beside any other patterns)"
        if patterns
        else "save a tree of arrays"
    )
    raise UnsavableError(
        f"{len(others)} {'leaves hold' if many else 'leaf holds'} no array, and safetensors "
        f"holds arrays only: {', '.join(shown)}\n{leave}, and keep a value, if wanted, as "
        f"text in the files' metadata: metadata={example!r} (--metadata KEY=VALUE)"
    )


def _shards(entries: Sequence[_Entry], limit: int) -> list[list[_Entry]]:
    """Tensors in tree order, a new shard whenever the next would pass `limit`; a
    tensor larger than that gets a shard of its own, placed before the shard being
    filled, which goes on. So `huggingface_hub` (and `transformers`' `save_pretrained`)
    shard the same tensors."""
    per_file: list[list[_Entry]] = []
    filling: list[_Entry] = []
    size = 0
    for entry in entries:
        if entry.nbytes > limit:
            per_file.append([entry])
            continue
        if size + entry.nbytes > limit:
            per_file.append(filling)
            filling, size = [], 0
        filling.append(entry)
        size += entry.nbytes
    if filling or not per_file:
        per_file.append(filling)
    return per_file


def _file(name: str, entries: Sequence[_Entry], metadata: Mapping[str, str]) -> File:
    ordered = tuple(sorted(entries, key=lambda e: -e.dtype.itemsize))
    header = encode_header(((e.name, e.dtype, e.shape, e.nbytes) for e in ordered), metadata)
    return File(name, ordered, header)


def write_file(out: IO[bytes], file: File, memory_budget: int | None, bar: Progress | None) -> None:
    """Write `file` to the open binary file `out`: the header, then every tensor's
    bytes at its offset, block by block."""
    fd = out.fileno()
    os.ftruncate(fd, file.size)
    pwrite_all(fd, file.header, 0)
    offsets = file.offsets
    lazy = [e for e in file.entries if isinstance(e.value, LazyArray)]
    for entry in file.entries:
        if isinstance(entry.value, jax.Array):
            for shard in entry.value.addressable_shards:
                if shard.replica_id == 0:
                    _put(fd, offsets[entry.name], entry, shard.index, np.asarray(shard.data))
                    if bar is not None:
                        bar.advance(shard.data.nbytes)
        elif not isinstance(entry.value, LazyArray):
            _put(fd, offsets[entry.name], entry, (), np.asarray(entry.value))
            if bar is not None:
                bar.advance(entry.nbytes)
    arrays = [e.value for e in lazy if isinstance(e.value, LazyArray)]  # all are; for mypy
    for position, index, values in read_blocks(arrays, memory_budget, bar):
        entry = lazy[position]
        _put(fd, offsets[entry.name], entry, index, values)
    check_unchanged(stores(arrays))


def _put(fd: int, start: int, entry: _Entry, index: tuple[slice, ...], values: np.ndarray) -> None:
    """Write the block `values` of `entry` at `index` into the file, as runs of its
    C-order bytes."""
    shape = entry.shape
    box = [
        (s.start or 0, shape[d] if s.stop is None else s.stop)
        for d, s in enumerate(index + (slice(None),) * (len(shape) - len(index)))
    ]
    data = np.ascontiguousarray(values, dtype=entry.dtype)
    if data.size == 0:
        return
    if sys.byteorder == "big":  # safetensors is little-endian
        data = data.byteswap()
    itemsize = entry.dtype.itemsize
    # The trailing dimensions the block covers whole, and the one before them: each run
    # of the file's bytes is a row of those.
    split = len(shape)
    while split > 0 and box[split - 1] == (0, shape[split - 1]):
        split -= 1
    run_dims = max(split - 1, 0)
    rows = data.reshape((*data.shape[:run_dims], -1))
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    for position in np.ndindex(*data.shape[:run_dims]):
        first = sum((box[d][0] + position[d]) * strides[d] for d in range(run_dims))
        first += sum(box[d][0] * strides[d] for d in range(run_dims, len(shape)))
        run = rows[position]
        pwrite_all(fd, run.view(np.uint8).data, start + first * itemsize)


@contextlib.contextmanager
def _destination(
    path: str, single: bool, overwrite: bool, replaceable: Callable[[str], bool]
) -> Iterator[Callable[[str, Callable[..., object]], None]]:
    """`write(name, fill)`, which creates the file `name` of the model with
    `fill(binary_file)`; on a clean exit the files are published at `path` (see
    `publishing`)."""
    with publishing_model(path, single, overwrite, replaceable) as tmp:
        yield file_writer(tmp, single, paths.is_remote(path))


def publishing_model(
    path: str, single: bool, overwrite: bool, replaceable: Callable[[str], bool]
) -> contextlib.AbstractContextManager[str]:
    """`publishing` for a safetensors file or model folder at `path`: an overwrite of
    a folder replaces the model's files and keeps the others (`config.json`)."""
    if paths.is_remote(path) and single and paths.isfile(path):
        if not overwrite:
            raise CheckpointExistsError(
                f"{path} already exists; pass overwrite=True (--overwrite) to replace it, "
                "or choose a new path"
            )
        if not replaceable(path):
            raise CheckpointExistsError(
                f"{path} exists and is not a safetensors file; lazyckpt replaces only "
                "checkpoints, delete it yourself if it should go"
            )
    old_shards = set() if single else _indexed_shards(path)
    keep = None if single else (lambda name: not is_model_file(name) and name not in old_shards)
    return publishing(path, overwrite=overwrite, replaceable=replaceable, file=single, keep=keep)


def file_writer(
    tmp: str, single: bool, remote: bool
) -> Callable[[str, Callable[..., object]], None]:
    """`write(name, fill)` into the temporary folder (or file) `tmp`: creates the file
    `name` with `fill(binary_file)`. In a bucket each file is built in a local scratch
    file, then uploaded in one request."""

    def write(name: str, fill: Callable[..., object]) -> None:
        target = tmp if single else paths.join(tmp, name)
        if not remote:
            with open(target, "wb") as out:
                fill(out)
            return
        with tempfile.TemporaryFile() as scratch:
            fill(scratch)
            scratch.seek(0)
            paths.write_bytes(target, scratch.read())

    return write


def _indexed_shards(folder: str) -> set[str]:
    """The shards the index of an existing model folder names (owned by the model, so
    replaced with it, whatever their names); none without a readable index."""
    text = paths.read_text(paths.join(folder, INDEX)) if paths.isdir(folder) else None
    if text is None:
        return set()
    try:
        weight_map, _ = parse_index(paths.join(folder, INDEX), text)
    except LazyckptError:
        return set()
    return set(weight_map.values())
