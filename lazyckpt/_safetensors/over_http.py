"""Safetensors over HTTP: a folder's files probed (a server lists nothing), and headers
read in one request a file."""

from __future__ import annotations

from collections.abc import Sequence

from lazyckpt._errors import CheckpointNotFoundError, CorruptCheckpointError
from lazyckpt._safetensors.format import (
    INDEX,
    INDEX_LIMIT,
    SINGLE,
    Header,
    header_length,
    is_shard_name,
    parse_header,
    parse_index,
)
from lazyckpt._storage import paths, probes
from lazyckpt._storage.folders import (
    Site,
    cached_copy,
    cached_fix,
    hub_listed,
    local_copy,
    register,
)
from lazyckpt._storage.folders import describe as web_describe
from lazyckpt._storage.kvstore import Store


def listed_over_http(folder: str) -> bool:
    """Whether a folder over HTTP, which has no listing, serves a model: its index (and
    the shards it names) or its `model.safetensors`, then registered as its files."""
    text = paths.read_text(paths.join(folder, INDEX), INDEX_LIMIT)
    if text is not None:
        weight_map, _ = parse_index(paths.join(folder, INDEX), text)
        names: tuple[str, ...] = (INDEX, *sorted(set(weight_map.values())))
    elif paths.isfile(paths.join(folder, SINGLE)):
        names = (SINGLE,)
    else:
        return False
    register(folder, Site(names, asked=(*names, INDEX, SINGLE)))
    return True


_PREFIX = 1 << 16
"""The bytes of a file over HTTP read first: its header, in one request, for most."""


def read_early(folder: str, names: Sequence[str]) -> None:
    """Start reading the first bytes of the shards of a folder on the Hub (its files
    listed at a pinned commit) while its index is read: their headers then cost no
    round trip after the index's (`short_headers` takes them). A file the index does
    not name costs one small read, never waited for."""
    if not paths.is_web(folder) or not hub_listed(folder):
        return
    probes.read_ahead(folder, [name for name in names if is_shard_name(name)], _PREFIX)


def forget_early(folder: str) -> None:
    """Drop what `read_early` read of `folder` and no open took (an open that failed)."""
    probes.forget_ahead(folder)


def short_headers(store: Store, folder: str, shards: Sequence[str]) -> list[Header]:
    """The headers of files of a `store.short_reads` backend (over HTTP), read
    concurrently in one request each where they are under `_PREFIX` bytes (the size that answers give says
    whether the data is all there); those `read_early` began, taken."""
    answers = []
    for shard, first in zip(shards, store.read_heads(shards, _PREFIX), strict=True):
        answer = first.result()
        if answer.state != "value":
            raise CheckpointNotFoundError(
                f"{web_describe(paths.join(folder, shard))} does not exist"
            )
        answers.append(answer)
    lengths = [
        _length(paths.join(folder, shard), bytes(answer.value[:8]), answer.size)
        for shard, answer in zip(shards, answers, strict=True)
    ]
    # The rest of the headers longer than the first read, all at once.
    rest = [
        store.read(shard, slice(len(answer.value), 8 + length))
        if 8 + length > len(answer.value)
        else None
        for shard, answer, length in zip(shards, answers, lengths, strict=True)
    ]
    headers = []
    for shard, answer, length, more in zip(shards, answers, lengths, rest, strict=True):
        file = paths.join(folder, shard)
        data = bytes(answer.value) + (b"" if more is None else bytes(more.result().value))
        if len(data) < 8 + length:
            raise _truncated(file, f"is too short for its {length}-byte header")
        try:
            header = parse_header(file, bytes(data[8 : 8 + length]))
        except CorruptCheckpointError as error:
            raise in_cache(file, error) from None
        if answer.size is not None and header.end > answer.size:
            raise _truncated(
                file,
                f"holds {answer.size} bytes; its header declares data up to byte {header.end}",
            )
        headers.append(header)
    return headers


def _length(file: str, first: bytes, size: int | None) -> int:
    """The header's length, which must fit in the file (its size as the server said)."""
    try:
        length = header_length(file, first)
    except CorruptCheckpointError as error:
        raise in_cache(file, error) from None
    if size is not None and 8 + length > size:
        raise _truncated(
            file,
            f"holds {size} bytes, but its header declares {length} bytes of header (or it "
            "is not safetensors)",
        )
    return length


def in_cache(file: str, error: CorruptCheckpointError) -> CorruptCheckpointError:
    """`error`, about a damaged header of `file`; where its bytes are the Hugging Face
    cache's copy (over `hf://`, or in a snapshot folder opened as a folder), said so,
    with the fix that works (downloading again would find the damaged copy and keep it)."""
    local = cached_copy(file)
    if local is None:
        return error
    return CorruptCheckpointError(
        f"{error} (read from its copy in the Hugging Face cache: {cached_fix(local)})"
    )


def _truncated(file: str, found: str) -> CorruptCheckpointError:
    """`file` is shorter than its header says: over HTTP, or its copy in the Hugging
    Face cache, whose blob the fix names."""
    local = local_copy(file)
    if local is None:
        return CorruptCheckpointError(f"{web_describe(file)} {found}; the file is truncated")
    return CorruptCheckpointError(
        f"{web_describe(file)}: its copy in the Hugging Face cache {found}; the cached "
        f"file is truncated: {cached_fix(local)}"
    )
