"""Hugging Face's safetensors format, read and written in one place.

A `.safetensors` file is an 8-byte little-endian header length `N`, `N` bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`),
then the data: each tensor's raw little-endian bytes in C order at
`[8 + N + begin, 8 + N + end)`. A sharded model is a folder of such files and a
`model.safetensors.index.json` whose `weight_map` names each tensor's file.

Everything a header declares is checked against the file's size before it is used,
so a damaged or hostile header is a `CorruptCheckpointError` naming the file, never
an allocation by a declared size.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import attrs
import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError, json_or_corrupt

SUFFIX = ".safetensors"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
METADATA_KEY = "__metadata__"
MAX_RANK = 32
"""The most dimensions tensorstore indexes."""
MAX_BYTES = 1 << 62
"""More bytes than any array holds (NumPy's bound is 2**63): also the bound on the
other sizes of a zero-size shape."""
HEADER_LIMIT = 100 << 20
"""The largest header read, as the safetensors library allows."""
INDEX_LIMIT = 64 << 20
"""The most bytes of a `model.safetensors.index.json` read (the largest releases' hold
under 10 MB: 100,000 tensors); a larger one is refused as it streams."""

DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # MX scales: 2 ** (s - 127)
    "C64": np.dtype("<c8"),
}
PACKED: dict[str, np.dtype[Any]] = {"F4": np.dtype(ml_dtypes.float4_e2m1fn)}
"""Dtypes of fewer than 8 bits, packed (F4: two values per byte, low nibble first):
read, unpacked one value per byte, but not written."""
_UNREAD = {"F6_E2M3": "6-bit floats", "F6_E3M2": "6-bit floats"}
"""Dtypes of the format that lazyckpt does not read, with what they hold."""
_NAMES = {dtype.newbyteorder("="): name for name, dtype in DTYPES.items()}


def dtype_name(dtype: DTypeLike) -> str | None:
    """The safetensors name of a NumPy dtype (`F32`), or None where it has none."""
    return _NAMES.get(np.dtype(dtype).newbyteorder("="))


class Tensor(NamedTuple):
    """One tensor of a file, as its header declares it (checked against the file). A
    tuple, not an attrs class: a model's headers declare 100,000 of them."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int
    """The offset of its first byte in the file."""
    nbytes: int


_tensor = functools.partial(tuple.__new__, Tensor)
"""`Tensor` from a tuple of its fields, without the Python call of its `__new__`:
a model's headers declare 100,000 of them."""


@attrs.frozen
class Header:
    tensors: tuple[Tensor, ...]
    metadata: dict[str, str]
    end: int
    """One past the last byte of data it declares."""


def header_length(file: str, first: bytes) -> int:
    """The JSON header's length, from the file's first 8 bytes."""
    if len(first) < 8:
        raise CorruptCheckpointError(
            f"{file} holds {len(first)} bytes, fewer than a safetensors header's 8-byte "
            "length; the file is truncated or not a safetensors file"
        )
    (length,) = struct.unpack("<Q", first[:8])
    if length > HEADER_LIMIT:
        raise CorruptCheckpointError(
            f"{file}: the header declares {length} bytes of JSON, more than the "
            f"{HEADER_LIMIT >> 20} MiB safetensors allows; the file is damaged or not a "
            "safetensors file"
        )
    return int(length)


def parse_header(file: str, text: bytes) -> Header:
    """The tensors and `__metadata__` of a file whose JSON header is `text`, every
    declaration checked (dtype, shape, no overlaps, byte spans that match shape and
    dtype). That the file holds the data up to `Header.end` is the caller's check."""
    data_start = 8 + len(text)
    try:
        raw = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CorruptCheckpointError(
            f"{file}: the header is not valid JSON ({str(error)[:100]}); the file is "
            "damaged or not a safetensors file"
        ) from None
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(
            f"{file}: the header is a JSON {type(raw).__name__}, expected an object of "
            "tensors; the file is damaged or not a safetensors file"
        )
    entries = len(raw) - (METADATA_KEY in raw)
    repeats = b"\\u" in text or text.count(b'"__metadata__"') > 1
    if repeats or any(text.count(field) != entries for field in _FIELDS):
        _refuse_repeats(file, text)  # (counted first, in C: most headers repeat nothing)
    metadata = raw.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptCheckpointError(
            f"{file}: {METADATA_KEY} must map strings to strings, found {str(metadata)[:80]}"
        )
    tensors = _tensors(file, raw, data_start)
    return Header(tuple(tensors), dict(metadata), _data_end(file, tensors, data_start))


_FIELDS = (b'"data_offsets"', b'"dtype"', b'"shape"')
"""Each tensor's fields, as they stand in a header once per tensor where no key is
repeated (a quote inside a JSON string is escaped: no string holds one of these; a
key spelled with `\\u` escapes is looked at the slow way)."""


class _Pairs(list[tuple[str, Any]]):
    """A JSON object's pairs as written, repeats and all."""


def _refuse_repeats(file: str, text: bytes) -> None:
    """Refuse a header that names a tensor (or `__metadata__`) twice, or a tensor's
    field twice: JSON keeps the last, so the first would vanish unread. Repeated keys
    inside `__metadata__` are left as the safetensors library leaves them."""
    top = json.loads(text.decode("utf-8"), object_pairs_hook=_Pairs)
    seen: set[str] = set()
    for name, entry in top if isinstance(top, _Pairs) else []:
        if name in seen:
            raise CorruptCheckpointError(
                f"{file}: the header names {name[:80]!r} twice; JSON keeps the last, so the "
                "first would vanish unread: the file is damaged (no writer repeats a name)"
            )
        seen.add(name)
        fields = [field for field, _ in entry] if isinstance(entry, _Pairs) else []
        repeated = {field for field in fields if fields.count(field) > 1}
        if name != METADATA_KEY and repeated:
            raise CorruptCheckpointError(
                f"{file}: tensor {name[:80]!r} has {sorted(repeated)[0]!r} twice in the "
                "header; the file is damaged"
            )


def _tensors(file: str, raw: dict[str, Any], data_start: int) -> list[Tensor]:
    """The tensors `raw` declares. A well-formed entry is checked in one pass of this
    loop (a model's headers hold 100,000 of them), anything else by `_checked` for its
    message."""
    out = []
    for name, entry in raw.items():
        try:
            kind, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            dtype = DTYPES[kind]
        except (TypeError, KeyError, ValueError):
            out.append(_checked(file, name, entry, data_start))
            continue
        if (
            type(shape) is list
            and len(shape) <= MAX_RANK
            and type(begin) is int
            and type(end) is int
            and begin >= 0
            and all(type(n) is int and n > 0 for n in shape)
        ):
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes == end - begin and nbytes <= MAX_BYTES:
                out.append(_tensor((name, dtype, tuple(shape), data_start + begin, nbytes)))
                continue
        out.append(_checked(file, name, entry, data_start))
    return out


def _data_end(file: str, tensors: list[Tensor], data_start: int) -> int:
    """One past the last byte of data `tensors` declare; tensors that overlap are a
    damaged header. (Writers lay them out in order: sorted only when they are not.)"""
    starts = [tensor.start for tensor in tensors if tensor.nbytes]
    ordered = tensors if starts == sorted(starts) else sorted(tensors, key=lambda t: t.start)
    end = data_start
    for tensor in ordered:
        if tensor.nbytes == 0:
            continue  # occupies no bytes, wherever it says it starts
        if tensor.start < end:
            raise CorruptCheckpointError(
                f"{file}: tensor {tensor.name!r} overlaps the tensor before it (its bytes "
                f"start at {tensor.start - data_start}, the previous one ends at "
                f"{end - data_start}); the header is damaged"
            )
        end = tensor.start + tensor.nbytes
    return end


def _checked(file: str, name: str, entry: object, data_start: int) -> Tensor:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{where} is a {type(entry).__name__}, expected an object")
    kind = entry.get("dtype")
    if not isinstance(kind, str):
        raise CorruptCheckpointError(f"{where} has dtype {str(kind)[:40]}, expected a name")
    if kind not in DTYPES and kind not in PACKED:
        what = f" ({_UNREAD[kind]}, packed four to three bytes)" if kind in _UNREAD else ""
        raise UnsupportedCheckpointError(
            f"{where} has dtype {kind!r}{what}, which lazyckpt does not read (it reads "
            f"{', '.join([*DTYPES, *PACKED])}); convert it with the safetensors library first"
        )
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(shape, list) or not all(_natural(n) for n in shape):
        raise CorruptCheckpointError(
            f"{where} has shape {str(shape)[:80]}, expected a list of sizes"
        )
    if len(shape) > MAX_RANK:
        raise UnsupportedCheckpointError(
            f"{where} has {len(shape)} dimensions; lazyckpt (and tensorstore) read at most "
            f"{MAX_RANK}"
        )

    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_natural(n) for n in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CorruptCheckpointError(
            f"{where} has data_offsets {offsets!r}, expected [begin, end] with begin <= end"
        )
    dtype = DTYPES[kind] if kind in DTYPES else PACKED[kind]
    if math.prod(n for n in shape if n) * dtype.itemsize > MAX_BYTES:
        raise CorruptCheckpointError(
            f"{where} has shape {str(shape)[:80]} of {kind}, more bytes than any array can "
            "hold (even counting only its non-zero dimensions); the header is damaged"
        )
    declared = math.prod(shape) * dtype.itemsize
    if kind in PACKED:
        if declared and (not shape or shape[-1] % 2):
            raise UnsupportedCheckpointError(
                f"{where}: shape {shape} of {kind} has an odd last dimension, so its "
                "values pack two per byte across rows, which lazyckpt does not read; "
                "convert it with the safetensors library first"
            )
        declared //= 2
    if declared != offsets[1] - offsets[0]:
        raise CorruptCheckpointError(
            f"{where}: shape {shape} of {kind} takes {declared} bytes, but its data_offsets "
            f"span {offsets[1] - offsets[0]}; the header is damaged"
        )
    return Tensor(name, dtype, tuple(shape), data_start + offsets[0], declared)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_index(file: str, text: str) -> tuple[dict[str, str], dict[str, str]]:
    """`(weight_map, metadata)` of a `model.safetensors.index.json`."""
    raw = json_or_corrupt(file, text, "the file is damaged")
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    # (JSON's keys are strings; the values' types are gathered in C: 100,000 of them)
    if not isinstance(weight_map, dict) or not set(map(type, weight_map.values())) <= {str}:
        raise CorruptCheckpointError(
            f"{file} has no 'weight_map' of tensor names to file names; the file is damaged"
        )
    for shard in set(weight_map.values()):
        if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise CorruptCheckpointError(
                f"{file} names the shard {shard!r}; shards are files beside the index"
            )
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(
            f"{file} has metadata {str(metadata)[:40]}, expected an object; the file is damaged"
        )
    return weight_map, {str(k): str(v) for k, v in metadata.items()}


def encode_header(
    entries: Iterable[tuple[str, np.dtype[Any], tuple[int, ...], int]], metadata: Mapping[str, str]
) -> bytes:
    """The length and JSON header of a file holding `(name, dtype, shape, nbytes)`
    tensors in that order, padded with spaces to a multiple of 8 bytes (so that data
    starts aligned, as the safetensors library writes it)."""
    header: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        kind = dtype_name(dtype)
        assert kind is not None
        header[name] = {
            "dtype": kind,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def index_json(weight_map: Mapping[str, str], total_size: int, metadata: Mapping[str, str]) -> str:
    return json.dumps(
        {"metadata": {**metadata, "total_size": total_size}, "weight_map": dict(weight_map)},
        indent=2,
    )


def shard_name(number: int, count: int) -> str:
    """`model-00001-of-00003.safetensors`, as `transformers` names shards."""
    return f"model-{number:05d}-of-{count:05d}{SUFFIX}"


_SHARD = re.compile(r".+-[0-9]{5}-of-[0-9]{5}\.safetensors")


def is_shard_name(name: str) -> bool:
    """Whether `name` is one file of a sharded model, as `transformers` and `diffusers`
    name them (`model-00001-of-00003.safetensors`): never a whole model without its
    index."""
    return _SHARD.fullmatch(name) is not None


_OWN_SHARD = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")


def is_model_file(name: str) -> bool:
    """Whether `name` is one of the files lazyckpt writes for a model folder (what a
    save over the folder replaces; anything else there stays)."""
    return name in (SINGLE, INDEX) or _OWN_SHARD.fullmatch(name) is not None
