"""Opening safetensors files lazily: a file, or a Hugging Face model folder (sharded
with `model.safetensors.index.json`), locally or in a bucket.

Each tensor becomes a `LazyArray` over a `RangeArray` (`lazyckpt._safetensors.ranges`),
which reads byte ranges of its file. A model of 100,000 tensors opens in one pass over
its headers, sharing what tensors of one shape and dtype share.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import attrs
import numpy as np

from lazyckpt._array.nesting import PathClash, nested
from lazyckpt._array.quant import PackedFP4
from lazyckpt._array.selection import Selection
from lazyckpt._array.tree import MAX_DEPTH
from lazyckpt._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LazyckptError,
    UnfinishedCheckpointError,
    UnsupportedCheckpointError,
)
from lazyckpt._lazy import LazyArray
from lazyckpt._safetensors.format import (
    INDEX,
    INDEX_LIMIT,
    PACKED,
    SINGLE,
    SUFFIX,
    Header,
    Tensor,
    header_length,
    is_model_file,
    is_shard_name,
    parse_header,
    parse_index,
)
from lazyckpt._safetensors.over_http import (
    forget_early,
    in_cache,
    listed_over_http,
    read_early,
    short_headers,
)
from lazyckpt._safetensors.ranges import RangeArray, contiguous_chunks
from lazyckpt._storage import paths
from lazyckpt._storage.deferred import Answered, answer
from lazyckpt._storage.folders import hub_listed, redownload
from lazyckpt._storage.futures import then
from lazyckpt._storage.kvstore import Store, from_one_generation
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none
from lazyckpt._text import printable

T = TypeVar("T")


def is_safetensors(path: str) -> bool:
    """Whether `path` is a safetensors file, or a folder of them without `_METADATA`."""
    if path.endswith(SUFFIX):
        return not paths.isdir(path)
    if paths.is_web(path) and not hub_listed(path):
        return listed_over_http(path)  # probed at each open: its files may have changed
    if not paths.isdir(path):
        return False
    names = paths.listdir(path)
    return "_METADATA" not in names and (
        INDEX in names or any(name.endswith(SUFFIX) for name in names)
    )


def is_safetensors_model(path: str) -> bool:
    """Whether `path` provably holds a safetensors model, by content: a file whose
    header parses, or a folder with an index that parses, a `model.safetensors` whose
    header does, or lazyckpt's shards (`model-0000i-of-0000N.safetensors`) that all
    parse without their index. What `save(..., overwrite=True)` may replace."""
    try:
        if not paths.isdir(path):
            return paths.isfile(path) and bool(
                _headers(paths.dirname(path), [paths.basename(path)])
            )
        names = paths.listdir(path)
        if INDEX in names:
            return bool(_index(path))
        if SINGLE in names:
            return paths.isfile(paths.join(path, SINGLE)) and bool(_headers(path, [SINGLE]))
        # Shards with no index: a save that never finished (say, killed while copying
        # a staged model into a bucket), replaceable when every shard parses.
        shards = [name for name in names if is_model_file(name)]
        return bool(shards) and len(_headers(path, shards)) == len(shards)
    except LazyckptError:
        return False


def open_safetensors(path: str, *, flat: bool = False) -> Mapping[str, object]:
    """The tensors at `path` as a tree of LazyArrays: nested by the `.`-separated parts
    of their names (`model.layers.0.q_proj.weight`), or flat by name."""
    try:
        folder, files, index = _files(path)
        weight_map = index[0] if index is not None else None
        tensors = from_one_generation(
            folder,
            lambda generation: _tensors(folder, files, weight_map, generation, split=not flat),
            files,
        )
    finally:
        forget_early(path)  # (what an open that failed read early)
    return tensors if flat else nest(tensors, path)


def metadata(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, or of all the files of a Hugging Face
    model folder together with its index's `metadata`. Reads the headers only.

    Args:
        path: A `.safetensors` file or a model folder, local, `s3://` / `gs://`,
            `hf://` or `https://`.
        storage_options: As for `open`.

    >>> out = lazyckpt.save(tmp / "w.safetensors", {"w": np.ones(2)}, metadata={"step": "3"})
    >>> lazyckpt.safetensors_metadata(out)
    {'format': 'pt', 'step': '3'}
    """
    with paths.session(storage_options):
        normalized = paths.normalize(path)
        try:
            return _metadata(normalized)
        finally:
            forget_early(normalized)


def _metadata(path: str) -> dict[str, str]:
    folder, files, index = _files(path)
    out: dict[str, str] = dict(index[1]) if index is not None else {}
    for header in _headers(folder, [name for name in files if name != INDEX]):
        out.update(header.metadata)
    return out


def _files(
    path: str,
) -> tuple[str, tuple[str, ...], tuple[dict[str, str], dict[str, str]] | None]:
    """The folder, the files that make up the model (the index first where there is
    one), and the index's weight map and metadata (None without an index)."""
    named = path.endswith(SUFFIX) and not paths.isdir(path)
    unnamed = not named and not paths.is_remote(path) and paths.isfile(path)  # (told by content)
    if named or unnamed:
        check_plain(path)
        return paths.dirname(path), (paths.basename(path),), None
    names = paths.listdir(path)
    if INDEX in names:
        read_early(path, names)  # (on the Hub: the shards' headers, while the index is read)
        index = _index(path)
        shards = sorted(set(index[0].values()))
        missing = [shard for shard in shards if shard not in names]
        if missing:
            raise CorruptCheckpointError(
                f"{path}/{INDEX} names shards that are not in the folder: {missing[:5]}; "
                "download or copy the model again"
            )
        for shard in shards:
            check_plain(paths.join(path, shard))
        return path, (INDEX, *shards), index
    found = sorted(name for name in names if name.endswith(SUFFIX))
    shards = [name for name in found if is_shard_name(name)]
    if shards and SINGLE not in found:
        raise UnfinishedCheckpointError(
            f"{path} holds shards of a sharded model ({shards[:3]}) but no {INDEX}: its "
            "save or download did not finish; save or download it again"
        )
    if SINGLE in found or len(found) == 1:
        name = SINGLE if SINGLE in found else found[0]
        check_plain(paths.join(path, name))
        return path, (name,), None
    raise CorruptCheckpointError(
        f"{path} holds several safetensors files {found[:5]} but no {INDEX} saying which "
        "tensor is in which; open one file, or add the index"
    )


def check_plain(file: str) -> None:
    """A model's file must be a plain file (or a link to one, as the Hugging Face cache
    makes): a FIFO would block the read forever, a device never end."""
    if paths.isfile(file):
        return
    if not paths.exists(file):
        raise CheckpointNotFoundError(f"{file} does not exist; check the path")
    raise CorruptCheckpointError(
        f"{file} is not a regular file; a model's files are plain files: the folder is "
        "damaged or hostile, refusing to read it"
    )


def _index(folder: str) -> tuple[dict[str, str], dict[str, str]]:
    file = paths.join(folder, INDEX)
    text = paths.read_text(file, INDEX_LIMIT)
    if text is None:
        raise CheckpointNotFoundError(f"{file} does not exist")
    return parse_index(file, text)


def _tensors(
    folder: str,
    files: tuple[str, ...],
    weight_map: dict[str, str] | None,
    generation: tuple[object, ...],
    *,
    split: bool,
) -> dict[str, LazyArray]:
    """The tensors by name, each a LazyArray whose key path is its name split on `.`
    (`split`) or the name whole."""
    store = Store.open(folder, ocdbt=False, generation=generation, files=files)
    shards = [name for name in files if name != INDEX]
    headers = _headers(folder, shards, store)
    if weight_map is None:  # one file: its tensors in the header's order
        (shard,), (header,) = shards, headers
        file = paths.join(folder, shard)
        return _arrays(store, [(shard, file, tensor) for tensor in header.tensors], split)
    # In the index's order; a tensor that the index places elsewhere (or nowhere) is
    # skipped, as Hugging Face skips it.
    tables = {
        shard: (paths.join(folder, shard), {tensor.name: tensor for tensor in header.tensors})
        for shard, header in zip(shards, headers, strict=True)
    }
    placed = []
    missing = []
    for name, shard in weight_map.items():
        file, table = tables[shard]
        tensor = table.get(name)
        if tensor is None:
            missing.append(name)
        else:
            placed.append((shard, file, tensor))
    if missing:
        raise CorruptCheckpointError(
            f"{folder}/{INDEX} places {missing[:3]} ({len(missing)} in all) in shards "
            "whose headers do not hold them; download or copy the model again"
        )
    return _arrays(store, placed, split)


def _arrays(
    store: Store, placed: list[tuple[str, str, Tensor]], split: bool
) -> dict[str, LazyArray]:
    """Each `(shard, file, tensor)`'s LazyArray over a `RangeArray`, by name. One loop
    that shares what tensors of one shape and dtype share: a model of 100,000 tensors
    has a few dozen shapes."""
    layouts: dict[tuple[tuple[int, ...], np.dtype[Any]], _Layout] = {}
    out = {}
    for shard, file, tensor in placed:
        name, dtype, shape, start, _ = tensor  # (one unpacking, not a look-up each)
        layout = layouts.get((shape, dtype))
        if layout is None:
            layout = layouts[shape, dtype] = _Layout.of(tensor)
        stored = RangeArray(
            store,
            name,
            shard,
            "safetensors",
            layout.shape,
            layout.dtype,
            layout.chunks,
            False,
            start=start,
            file=file,
        )
        # (each part kept once: a model repeats `model`, `layers`, `weight` 100,000 times)
        path = tuple(map(sys.intern, name.split("."))) if split else (name,)
        array = LazyArray(path, stored, layout.selection, layout.native)
        if layout.packed:  # unpacked as it is read, one code per element
            node = PackedFP4(shape, dtype, array)
            array = LazyArray(path, node, Selection.full(shape), dtype)
        out[name] = array
    return out


@attrs.frozen
class _Layout:
    """What every tensor of one shape and dtype stores alike."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    """As stored: uint8 for packed dtypes, two values to a byte."""
    native: np.dtype[Any]
    chunks: tuple[int, ...]
    selection: Selection
    packed: bool

    @staticmethod
    def of(tensor: Tensor) -> _Layout:
        packed = any(tensor.dtype == dtype for dtype in PACKED.values())
        dtype = np.dtype(np.uint8) if packed else tensor.dtype
        shape = (*tensor.shape[:-1], tensor.shape[-1] // 2) if packed else tensor.shape
        chunks = contiguous_chunks(shape, dtype.itemsize)
        return _Layout(shape, dtype, dtype.newbyteorder("="), chunks, Selection.full(shape), packed)


def _headers(folder: str, shards: Sequence[str], store: Store | None = None) -> list[Header]:
    """The parsed headers of `shards`, read concurrently: 8 bytes, then the JSON, then
    one byte at the end of the data (that the file is not truncated)."""
    store = store or Store.open(folder, ocdbt=False)
    if store.short_reads:  # (over HTTP: a header in one request, with the file's size)
        return short_headers(store, folder, shards)
    files = [paths.join(folder, shard) for shard in shards]
    firsts = [
        _read(store, shard, file, 0, 8, what="its header length")
        for shard, file in zip(shards, files, strict=True)
    ]
    lengths = [
        _parsed(f, header_length, first.result()) for f, first in zip(files, firsts, strict=True)
    ]
    texts = [
        _read(store, shard, file, 8, 8 + length, what="its header")
        for shard, file, length in zip(shards, files, lengths, strict=True)
    ]
    headers = [
        _parsed(f, parse_header, text.result()) for f, text in zip(files, texts, strict=True)
    ]
    probes = [
        _read(store, shard, file, header.end - 1, header.end, what="the end of its data")
        for shard, file, header, length in zip(shards, files, headers, lengths, strict=True)
        if header.end > 8 + length  # some tensor holds data
    ]
    for probe in probes:
        probe.result()
    return headers


def _parsed(file: str, parse: Callable[[str, bytes], T], data: bytes) -> T:
    """`parse(file, data)`; where `file` is the Hugging Face cache's copy, its error
    names the fix that works there (`in_cache`)."""
    try:
        return parse(file, data)
    except CorruptCheckpointError as error:
        raise in_cache(file, error) from None


def _read(
    store: Store, key: str, file: str, start: int, stop: int, *, what: str
) -> ts.Future[bytes] | Answered[bytes]:
    """The bytes `[start, stop)` of `key`; a file too short for them is truncated."""
    if stop > 1 << 62:
        raise CorruptCheckpointError(
            f"{file}: the header places {what} at byte {stop}; the header is damaged"
        )

    def value(result: ts.KvStore.ReadResult) -> bytes:
        if result.state != "value":
            raise CheckpointNotFoundError(f"{file} does not exist")
        return bytes(result.value)

    def failed(error: Exception) -> Exception:
        if isinstance(error, LazyckptError):  # (a file swapped since `open`, say)
            return error
        if "OUT_OF_RANGE" in str(error):
            return CorruptCheckpointError(
                f"{file} is too short for {what} (bytes {start} to {stop}); the file is "
                f"truncated, {redownload(file)}"
            )
        if store.changed():
            return store.changed_error()
        return (
            paths.storage_error(file, error)
            if paths.is_remote(file)
            else CorruptCheckpointError(f"{file}: reading {what} failed ({error})")
        )

    if store.reads_itself(key):  # (a local file: read now, importing no tensorstore)
        return answer(lambda: store.read_at_once(key, slice(start, stop)), value, failed)
    return then(store.read(key, slice(start, stop)), value, failed)


def nest(tensors: dict[str, LazyArray], path: str) -> dict[str, object]:
    """Names split on `.` into nested dicts: `a.b.0.w` -> `{"a": {"b": {"0": {"w": ...}}}}`
    (each LazyArray's path already is its name split on `.`).
    A name that is also the start of others (`a.b` and `a.b.c`) cannot nest."""
    # (counted in C: a model names 100,000 tensors)
    if max(map(str.count, tensors, itertools.repeat(".")), default=0) >= MAX_DEPTH:
        deep = next(name for name in tensors if name.count(".") >= MAX_DEPTH)
        raise CorruptCheckpointError(
            f"{path}: tensor name {printable(deep[:60])}... has {deep.count('.') + 1} "
            f"'.'-separated parts, more than the {MAX_DEPTH} levels a tree can nest; open "
            "it with flat=True"
        )
    try:
        # (each path is its name's str parts, split once by `_tensors`; cast once, not
        # once per tensor)
        items = ((leaf.path, leaf, name) for name, leaf in tensors.items())
        return nested(cast(Iterable[tuple[tuple[str, ...], LazyArray, str]], items))
    except PathClash as clash:
        raise UnsupportedCheckpointError(
            f"{path}: tensor names {clash.first!r} and {clash.second!r} cannot both be "
            "nested by '.' (one is a prefix of the other); open it with flat=True"
        ) from None
