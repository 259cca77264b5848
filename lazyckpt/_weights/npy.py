"""NumPy's `.npy` and `.npz` files, read by their headers, with no pickle.

A `.npy` file is `\\x93NUMPY`, a version, a header length, and a header that is a
Python dict literal (`{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4)}`)
padded to 64 bytes; the array's raw bytes follow. A `.npz` file is a zip archive of
`.npy` members, stored (`np.savez`) or deflated (`np.savez_compressed`). big_vision
saves its checkpoints so, each member named by its parameter's `/`-separated path.
"""

from __future__ import annotations

import ast
import math
import re
import struct
import zlib
from typing import Any

import attrs
import numpy as np

from lazyckpt._array.dtypes import LONG_DOUBLES, parsed
from lazyckpt._array.selection import Selection
from lazyckpt._errors import CorruptCheckpointError, UnsafePickleError, UnsupportedCheckpointError
from lazyckpt._lazy import LazyArray
from lazyckpt._safetensors.format import MAX_BYTES, MAX_RANK
from lazyckpt._safetensors.ranges import contiguous_chunks
from lazyckpt._weights import longdouble, zips
from lazyckpt._weights.arrays import Place, c_strides
from lazyckpt._weights.deflated import DeflatedArray, Inflater
from lazyckpt._weights.files import File
from lazyckpt._weights.longdouble import lazy

MAGIC = b"\x93NUMPY"
HEADER_LIMIT = 10_000
"""The longest header read, as `numpy.load` allows by default."""
_DESCR = re.compile(r"[<>|=]?(?:f(?:[248]|12|16)|c(?:8|16|24|32)|[iu][1248]|b1|\?)")
_FIX = "the file is damaged, download or copy it again"


def _numeric_spelling(descr: str) -> str | None:
    """The usual spelling (`<f8`) of a numeric dtype spelled otherwise in a header
    (`<d`, `float32`: numpy never writes these, but `np.load` reads them); None where
    `descr` is no plain number or bool."""
    if len(descr) > 16:
        return None
    dtype = parsed(descr)
    if dtype is None:
        return None
    plain = dtype.kind in "biufc" and dtype.fields is None and not dtype.shape
    return dtype.str if plain else None


@attrs.frozen
class Header:
    """A `.npy` header: the array's dtype (as stored), shape and order, and the length
    of the header (where the data starts)."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran: bool
    length: int


def header(data: bytes, where: str) -> Header | None:
    """The header at the start of `data`; None where `data` is too short to hold it."""
    if data[:6] != MAGIC:
        raise CorruptCheckpointError(f"{where}: no .npy magic (\\x93NUMPY) at its start; {_FIX}")
    if len(data) < 10:
        return None
    major = data[6]
    if major not in (1, 2, 3):
        raise UnsupportedCheckpointError(
            f"{where}: .npy format version {major}.{data[7]}, which lazyckpt does not read "
            "(1, 2 and 3 it does)"
        )
    size, skip = (struct.unpack_from("<H", data, 8)[0], 10) if major == 1 else (0, 12)
    if major != 1:
        if len(data) < 12:
            return None
        size = struct.unpack_from("<I", data, 8)[0]
    if size > HEADER_LIMIT:
        # (a header of numbers is under 2 KB at any shape: 64 dimensions of 19 digits)
        raise UnsupportedCheckpointError(
            f"{where}: its .npy header is {size:,} bytes, over the {HEADER_LIMIT:,} that "
            "lazyckpt reads, as np.load does by default (max_header_size). numpy writes "
            "headers this long for structured dtypes of many fields, which lazyckpt does "
            f"not read: np.load(path, max_header_size={size}) reads it where you trust the "
            "file, and each field saved as an array of its own opens here"
        )
    if len(data) < skip + size:
        return None
    text = data[skip : skip + size].decode("utf-8" if major == 3 else "latin1", "replace")
    try:
        fields = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        fields = None
    if not (isinstance(fields, dict) and set(fields) == {"descr", "fortran_order", "shape"}):
        raise CorruptCheckpointError(
            f"{where}: its .npy header {text.strip()[:120]!r} is not a dict of descr, "
            f"fortran_order and shape; {_FIX}"
        )
    descr, shape = fields["descr"], fields["shape"]
    if descr in ("|O", "O", "<O", ">O"):
        raise UnsafePickleError(
            f"{where} holds Python objects (dtype object), which numpy stores as a "
            "pickle (allow_pickle=True); lazyckpt runs no pickle. Save numeric arrays"
        )
    if isinstance(descr, str) and not _DESCR.fullmatch(descr):
        descr = _numeric_spelling(descr) or descr
    if not isinstance(descr, str) or not _DESCR.fullmatch(descr):
        void = isinstance(descr, str) and descr.lstrip("<>|=").startswith("V")
        raise UnsupportedCheckpointError(
            f"{where}: dtype {str(descr)[:80]!r}, which lazyckpt does not read from .npy "
            "(it reads numbers and bools: strings, dates and records it does not; "
            + (
                "a bfloat16 array numpy saves as raw void bytes: save it as float32, or as "
                "safetensors)"
                if void
                else "read it with np.load)"
            )
        )
    try:
        dtype = np.dtype(descr)
    except TypeError:  # (a long double of a size this machine's is not)
        raise UnsupportedCheckpointError(
            f"{where}: dtype {descr!r}, a long double that NumPy has no type for on this "
            f"machine (its own is {np.dtype(np.longdouble).itemsize} bytes), so np.load "
            "cannot read it here either; read it where it was written and save it as float64"
        ) from None
    if not (
        isinstance(shape, tuple)
        and len(shape) <= MAX_RANK
        and all(type(n) is int and n >= 0 for n in shape)
        and math.prod(max(n, 1) for n in shape) * dtype.itemsize <= MAX_BYTES
    ):
        raise CorruptCheckpointError(
            f"{where}: its .npy shape {str(shape)[:80]} is not the sizes of an array; {_FIX}"
        )
    if not isinstance(fields["fortran_order"], bool):
        raise CorruptCheckpointError(f"{where}: its .npy fortran_order is not a bool; {_FIX}")
    return Header(dtype, shape, fields["fortran_order"], skip + size)


def place(
    file: File,
    start: int,
    head: Header,
    available: int,
    where: str,
    member: zips.Stored | None = None,
) -> Place:
    """Where an array whose `.npy` header `head` starts at `start` of `file` lies;
    `available` is how many bytes its file or stored zip `member` holds."""
    nbytes = math.prod(head.shape) * head.dtype.itemsize
    if head.length + nbytes > available:
        raise CorruptCheckpointError(
            f"{where}: its header declares {head.shape} of {head.dtype} ({nbytes} bytes) "
            f"but {available - head.length} follow; {_FIX}"
        )
    stride = c_strides(head.shape[::-1])[::-1] if head.fortran else c_strides(head.shape)
    count = max(math.prod(head.shape), 1)
    return Place(file, start + head.length, count, 0, head.shape, stride, member)


def open_npy(file: File, name: str, path: tuple[str, ...]) -> LazyArray:
    """A `.npy` file as one array."""
    data = file.head(4096)
    head = header(data, file.path)
    if head is None:
        head = header(file.head(HEADER_LIMIT + 12), file.path)
    if head is None:
        raise CorruptCheckpointError(f"{file.path}: its .npy header is cut short; {_FIX}")
    nbytes = math.prod(head.shape) * head.dtype.itemsize
    if nbytes:  # (that the file holds them: its last byte)
        file.read(head.length + nbytes - 1, head.length + nbytes, "the end of its data")
    return lazy(name, path, head.dtype, place(file, 0, head, head.length + nbytes, file.path))


def open_npz(file: File, found: dict[str, zips.Member], head: bytes = b"") -> dict[str, LazyArray]:
    """The arrays of a `.npz` archive by member name without `.npy`; `head` is the
    file's first bytes, read already."""
    members = {name: m for name, m in found.items() if name.endswith(".npy")}
    others = sorted(set(found) - set(members))
    if others:
        raise CorruptCheckpointError(
            f"{file.path}: a .npz archive holds .npy members only; it also holds "
            f"{others[:5]}; not an np.savez file"
        )
    starts = zips.data_starts(file, members.values(), extra=512, head=head)
    out: dict[str, LazyArray] = {}
    for name, member in members.items():
        key = name[: -len(".npy")]
        where = f"{file.path}: member {name!r}"
        start, first = starts[name]
        if member.method == zips.DEFLATED:
            out[key] = _deflated(file, member, start, key, where)
            continue
        if member.method != zips.STORED:
            raise UnsupportedCheckpointError(
                f"{where} uses zip compression method {member.method}; lazyckpt reads "
                "stored and deflated members"
            )
        npy = header(first, where) or header(
            file.read(start, start + min(member.size, HEADER_LIMIT + 12), where), where
        )
        if npy is None:
            raise CorruptCheckpointError(f"{where}: its .npy header is cut short; {_FIX}")
        stored = zips.Stored(file, start, member)
        at = place(file, start, npy, member.size, where, stored)
        out[key] = lazy(key, tuple(key.split("/")), npy.dtype, at)
    return out


def _deflated(file: File, member: zips.Member, start: int, key: str, where: str) -> LazyArray:
    inflater = Inflater(file, start, member)
    try:
        first = zlib.decompressobj(-15).decompress(
            file.read(start, start + min(member.packed, 1 << 16), where), HEADER_LIMIT + 12
        )
    except zlib.error as error:
        raise CorruptCheckpointError(f"{where} does not inflate ({error}); {_FIX}") from None
    head = header(first, where)
    if head is None:
        raise CorruptCheckpointError(f"{where}: its .npy header is cut short; {_FIX}")
    nbytes = math.prod(head.shape) * head.dtype.itemsize
    if head.length + nbytes != member.size:
        raise CorruptCheckpointError(
            f"{where}: its header declares {head.shape} of {head.dtype} ({nbytes} bytes) "
            f"but the member inflates to {member.size - head.length}; {_FIX}"
        )
    shape = head.shape[::-1] if head.fortran else head.shape
    dtype = head.dtype
    long = dtype.newbyteorder("=") in LONG_DOUBLES
    if long:  # (read as its bytes, viewed as it arrives)
        shape, dtype = (*shape, dtype.itemsize), np.dtype(np.uint8)
    stored = DeflatedArray(
        file.store,
        key,
        file.key,
        "deflated",
        shape,
        dtype,
        contiguous_chunks(shape, dtype.itemsize),
        False,
        checksummed=True,  # (its CRC-32, checked when it is inflated to its end)
        inflater=inflater,
        offset=head.length,
    )
    array = LazyArray(tuple(key.split("/")), stored, Selection.full(shape), dtype.newbyteorder("="))
    if long:
        array = longdouble.viewed(array, head.dtype)
    return attrs.evolve(array.T, path=array.path) if head.fortran and array.ndim > 1 else array
