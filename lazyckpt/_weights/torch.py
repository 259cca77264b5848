"""`torch.save` files read as tables of tensors, without torch and without running
their pickle: the zip format (PyTorch 1.6 and later: `pytorch_model.bin`,
`consolidated.00.pth`, `*.pt`) and the legacy one before it.

A zip file holds `ARCHIVE/data.pkl`, the pickled object whose tensors name their
storages by key, and each storage's bytes as the stored member `ARCHIVE/data/KEY`
(`ARCHIVE/byteorder` says little or big endian). A legacy file is a run of pickles
(magic number, protocol version, system information, the object, the sorted storage
keys), then each storage in that order as an 8-byte little-endian element count and
its little-endian bytes: where each starts follows from the counts alone.
"""

from __future__ import annotations

import io
import string
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from lazyckpt._array.quant import PackedFP4
from lazyckpt._array.signs import SignFlipped
from lazyckpt._errors import CorruptCheckpointError, LazyckptError, UnsupportedCheckpointError
from lazyckpt._lazy import LazyArray, composed
from lazyckpt._weights import zips
from lazyckpt._weights.arrays import Place, Stacked, lazy
from lazyckpt._weights.files import File
from lazyckpt._weights.unpickle import (
    PICKLE_LIMIT,
    Storage,
    Tensor,
    Truncated,
    plain,
    unpickle,
)

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_FIRST_READ = 1 << 20
_FP4_PAIRS = "float4_e2m1fn_x2"
_NEGATED = frozenset(
    {
        *("float32", "float64", "float16", "bfloat16", "complex64", "complex128"),
        *("int8", "int16", "int32", "int64", "uint8"),
    }
)
"""The dtypes torch negates: it loads a negative view of another, but cannot read it."""


@attrs.frozen
class Saved:
    """What a torch file holds: the unpickled object (its tensors as `Tensor`s), the
    byte where each storage's elements start, and whether they are big-endian."""

    tree: Any
    starts: Mapping[str, int]
    storages: Mapping[str, Storage]
    big_endian: bool = False
    members: Mapping[str, zips.Stored] = attrs.field(factory=dict)
    """Each storage's zip member, by key (none in a legacy file)."""
    nodes: int = 1 << 62
    """The most nodes its tree can have without repeating itself: one per byte of
    its pickle (each value takes at least one)."""


def is_legacy(head: bytes) -> bool:
    """Whether `head` starts a legacy `torch.save` file: a pickle of its magic number
    (after a frame header, in protocols 4 and 5)."""
    if head[:1] != b"\x80":
        return False
    try:
        return bool(plain(io.BytesIO(head), "") == LEGACY_MAGIC)
    except (Truncated, LazyckptError):
        return False


def read_zip(file: File, found: dict[str, zips.Member], head: bytes = b"") -> Saved:
    """The table of a `torch.save` zip whose members are `found`; `head` is the file's
    first bytes, read already (where torch writes `data.pkl`)."""
    found = _folded(file, found)
    pickles = [name for name in found if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1 or any(name.endswith("/constants.pkl") for name in found):
        kind = "a TorchScript archive" if pickles else "no torch.save archive"
        raise UnsupportedCheckpointError(
            f"{file.path} is a zip file but {kind} (expected one ARCHIVE/data.pkl; found "
            f"{sorted(found)[:5]}); lazyckpt reads files written by torch.save"
        )
    prefix = pickles[0][: -len("data.pkl")]
    data = _member(file, found[pickles[0]], PICKLE_LIMIT, head)
    tree, storages = _unpickled(data, file.path)
    order = found.get(prefix + "byteorder")
    big = order is not None and _byte_order(file, _member(file, order, 16, head))
    wanted = {}
    for key, storage in storages.items():
        member = found.get(fold(f"{prefix}data/{key}"))
        if member is None:
            raise CorruptCheckpointError(
                f"{file.path}: its pickle names storage {key!r} but the archive has no "
                f"{prefix}data/{key}; the file is damaged, download or copy it again"
            )
        if member.method != zips.STORED:
            raise UnsupportedCheckpointError(
                f"{file.path}: storage member {member.name!r} is compressed, which "
                "torch.save never writes (the archive was repacked); unzip it and zip it "
                "again without compression (zip -0), or load and save it with torch"
            )
        nbytes = storage.numel * storage.dtype.numpy.itemsize
        if member.size != nbytes:
            raise CorruptCheckpointError(
                f"{file.path}: storage {key!r} holds {member.size} bytes but its pickle "
                f"declares {storage.numel} elements of {storage.dtype.name} ({nbytes} "
                "bytes); the file is damaged, download or copy it again"
            )
        wanted[key] = member
    starts = zips.data_starts(file, wanted.values(), head=head)
    starts_at = {key: starts[m.name][0] for key, m in wanted.items()}
    members = {key: zips.Stored(file, starts_at[key], m) for key, m in wanted.items()}
    return Saved(tree, starts_at, storages, big, members, nodes=len(data) + 16)


_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def fold(name: str) -> str:
    """`name` as torch's zip reader (miniz) compares names: ASCII letters lowered."""
    return name.translate(_LOWER)


def _folded(file: File, found: dict[str, zips.Member]) -> dict[str, zips.Member]:
    """The members `found` by their names folded as torch looks them up, refusing two
    names that fold alike: which of them torch reads is a guess (its sorted index
    finds one or the other)."""
    out: dict[str, zips.Member] = {}
    for name, member in found.items():
        other = out.setdefault(fold(name), member)
        if other is not member:
            raise CorruptCheckpointError(
                f"{file.path}: its zip archive holds {other.name!r} and {name!r}, names "
                "that torch.load does not tell apart (it looks members up ignoring case) "
                "and reads one or the other; the archive is damaged or hostile, "
                "download or copy it again"
            )
    return out


def _byte_order(file: File, text: bytes) -> bool:
    """Whether the `byteorder` member `text` says big-endian; torch refuses any other
    text than `little` and `big`."""
    if text not in (b"little", b"big"):
        raise CorruptCheckpointError(
            f"{file.path}: its byteorder member says {text[:16]!r}, where torch.save "
            "writes b'little' or b'big' (torch.load refuses it too); the file is damaged, "
            "download or copy it again"
        )
    return text == b"big"


def _member(file: File, member: zips.Member, limit: int, head: bytes = b"") -> bytes:
    """A small member's bytes, inflated where it is compressed."""
    if member.size > limit or member.packed > limit:
        raise CorruptCheckpointError(
            f"{file.path}: member {member.name!r} declares {member.size} bytes, over the "
            f"{limit} lazyckpt reads of it; the file is damaged or hostile"
        )
    start, _ = zips.data_starts(file, [member], head=head)[member.name]
    end = start + member.packed
    data = head[start:end] if end <= len(head) else b""
    if len(data) != member.packed:
        data = file.read(start, end, f"member {member.name!r}")
    if member.method == zips.DEFLATED:
        inflater = zlib.decompressobj(-15)
        try:
            data = inflater.decompress(data, limit + 1)
        except zlib.error as error:
            raise CorruptCheckpointError(
                f"{file.path}: member {member.name!r} does not inflate ({error}); the file "
                "is damaged, download or copy it again"
            ) from None
    elif member.method != zips.STORED:
        raise UnsupportedCheckpointError(
            f"{file.path}: member {member.name!r} uses zip compression method "
            f"{member.method}; lazyckpt reads stored and deflated members"
        )
    if len(data) != member.size:
        raise CorruptCheckpointError(
            f"{file.path}: member {member.name!r} holds {len(data)} bytes, not the "
            f"{member.size} its directory declares; download or copy it again"
        )
    if zlib.crc32(data) != member.crc:
        raise CorruptCheckpointError(
            f"{file.path}: member {member.name!r}: "
            f"{zips.crc_mismatch(member, zlib.crc32(data))}; download or copy it again"
        )
    return data


def _unpickled(data: bytes, path: str) -> tuple[Any, dict[str, Storage]]:
    try:
        return unpickle(io.BytesIO(data), path)
    except Truncated:
        raise CorruptCheckpointError(
            f"{path}: its pickle ends early; the file is damaged, download or copy it again"
        ) from None


def read_legacy(file: File, head: bytes) -> Saved:
    """The table of a legacy (pre-zip) `torch.save` file that starts with `head`."""
    data = head
    while True:
        stream = io.BytesIO(data)
        try:
            magic, protocol, info = (plain(stream, file.path) for _ in range(3))
            if magic != LEGACY_MAGIC or protocol != _LEGACY_PROTOCOL:
                raise CorruptCheckpointError(
                    f"{file.path}: expected torch's magic number and protocol {_LEGACY_PROTOCOL}"
                    f", found {magic!r} and {protocol!r}; not a torch.save file"
                )
            tree, storages = unpickle(stream, file.path)
            keys = plain(stream, file.path)
            break
        except (Truncated, CorruptCheckpointError) as error:
            # Bytes cut inside a field fail in many ways (a short struct, a cut
            # string): while the file holds more, read more and parse again.
            more = b"" if len(data) >= PICKLE_LIMIT else _more(file, len(data), 2 * len(data))
            if not more and isinstance(error, CorruptCheckpointError):
                raise
            if not more:  # (the file ended, or the pickles are past any real size)
                raise CorruptCheckpointError(
                    f"{file.path}: its pickles end early, within the first {len(data)} "
                    "bytes; the file is damaged, download or copy it again"
                ) from None
            data += more
    if (
        not isinstance(info, dict)
        or not isinstance(keys, list)
        or not all(isinstance(key, str) for key in keys)
        or set(keys) != set(storages)
    ):
        raise CorruptCheckpointError(
            f"{file.path}: its storage list (a {type(keys).__name__}) does not match the storages "
            "its pickle names; the file is damaged, download or copy it again"
        )
    at = stream.tell()
    starts: dict[str, int] = {}
    for key in keys:
        storage = storages[key]
        starts[key] = at + 8
        at += 8 + storage.numel * storage.dtype.numpy.itemsize
    _check_counts(file, storages, starts, at)
    return Saved(tree, starts, storages, big_endian=False, nodes=at + 16)


def _more(file: File, start: int, stop: int) -> bytes:
    """Bytes `[start, stop)`, fewer where the file ends first."""
    return file.read_short(start, stop - start)


def _check_counts(
    file: File, storages: dict[str, Storage], starts: dict[str, int], end: int
) -> None:
    """Each storage's 8-byte element count is the pickle's, and the file reaches `end`:
    a place computed from a damaged count would read other bytes as values."""
    keys = list(starts)
    spans = [(starts[key] - 8, starts[key]) for key in keys]
    if end > 0:
        spans.append((end - 1, end))
    counts = file.reads(spans, "a storage's element count")
    for key, count in zip(keys, counts, strict=False):
        found = struct.unpack("<q", count)[0]
        if found != storages[key].numel:
            raise CorruptCheckpointError(
                f"{file.path}: storage {key!r} declares {found} elements where its pickle "
                f"says {storages[key].numel}; the file is damaged, download or copy it again"
            )


def element_dtype(
    dtype: np.dtype[Any], storage: np.dtype[Any], big_endian: bool, where: str
) -> np.dtype[Any]:
    """`dtype`, a tensor's over a storage of `storage` elements, in the byte order the
    file keeps it in (`where` names the tensor). torch.load swaps a big-endian file's
    bytes by the storage's elements (a complex one's by its parts), not the tensor's:
    over bytes (`UntypedStorage`) it swaps none."""
    if not big_endian or _swapped(storage) == 1:
        return dtype
    if _swapped(dtype) != _swapped(storage):
        raise UnsupportedCheckpointError(
            f"{where} holds {dtype.name} over a storage of {storage.name} in a big-endian "
            f"torch file: torch.load swaps its bytes in groups of {_swapped(storage)}, as "
            f"the storage's elements, then reads them as {dtype.name}, which lazyckpt does "
            "not read; save it again on a little-endian machine"
        )
    if dtype.kind not in "biufc":
        raise UnsupportedCheckpointError(
            f"{where} is big-endian {dtype.name}, which lazyckpt reads in little-endian "
            "torch files only; save it again on a little-endian machine"
        )
    return dtype.newbyteorder(">")


def _swapped(dtype: np.dtype[Any]) -> int:
    """How many bytes torch swaps at a time in elements of `dtype`."""
    return dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize


def tensor(
    file: File, saved: Saved, leaf: Tensor, name: str, path: tuple[str, ...], stacked: Stacked
) -> LazyArray:
    """The tensor `leaf` of `saved` (named `name`, at key path `path`) as a LazyArray:
    its elements where the file keeps them (their stacked views counted in `stacked`),
    float4 pairs as their two codes, and its conjugate and negative bits applied as it
    is read, as torch.load gives it."""
    storage = saved.storages[leaf.storage.key]
    where = f"{file.path}: tensor {name!r}"
    dtype = element_dtype(leaf.dtype.numpy, storage.dtype.numpy, saved.big_endian, where)
    capacity = storage.numel * storage.dtype.numpy.itemsize // dtype.itemsize
    start, member = saved.starts[storage.key], saved.members.get(storage.key)
    place = Place(file, start, capacity, leaf.offset, leaf.shape, leaf.stride, member)
    array = lazy(name, path, dtype, place, stacked)
    if leaf.dtype.name == _FP4_PAIRS:
        array = _fp4_codes(file.path, name, array)
    if leaf.conj or leaf.neg:
        array = _flipped(file.path, name, leaf, array)
    return array


def _fp4_codes(where: str, name: str, pairs: LazyArray) -> LazyArray:
    """`float4_e2m1fn_x2` bytes as their two E2M1 codes, low nibble first, along the
    last dimension, twice as long: as the tensor's safetensors form (`F4`) reads."""
    if not pairs.shape:
        raise UnsupportedCheckpointError(
            f"{where}: tensor {name!r} is a 0-d float4_e2m1fn_x2 (a pair of FP4 codes, with "
            "no dimension to unpack them along), which lazyckpt does not read; save it "
            "with .reshape(1)"
        )
    shape = (*pairs.shape[:-1], 2 * pairs.shape[-1])
    dtype = np.dtype(ml_dtypes.float4_e2m1fn)
    return composed(pairs.path, PackedFP4(shape, dtype, pairs), dtype)


def _flipped(where: str, name: str, leaf: Tensor, array: LazyArray) -> LazyArray:
    """`array` conjugated and negated as `leaf`'s bits say (both: its real parts
    negated)."""
    complex_ = array.dtype.kind == "c"
    if leaf.conj and not complex_:
        raise CorruptCheckpointError(
            f"{where}: tensor {name!r} has its conjugate bit set but holds {leaf.dtype.name}, "
            "which torch.load refuses too (only complex tensors have one); the file is "
            "damaged or not written by torch.save"
        )
    if leaf.neg and leaf.dtype.name not in _NEGATED:
        raise UnsupportedCheckpointError(
            f"{where}: tensor {name!r} is a negative view of {leaf.dtype.name}, which "
            f"torch.load returns but cannot read (torch has no negation of "
            f"{leaf.dtype.name}); lazyckpt refuses it. Save the tensor's values without "
            "the negative bit"
        )
    node = SignFlipped(
        array.shape, array.dtype, array, leaf.neg, complex_ and leaf.conj != leaf.neg
    )
    return composed(array.path, node, array.dtype)
