"""`flax.serialization.to_bytes` files (Hugging Face's `flax_model.msgpack`) walked
without reading their arrays: each array is an msgpack ext value of type 1 whose
payload is `[shape, dtype name, bytes]`, and the walk notes where the bytes start and
skips them. Arrays over 2**30 bytes flax splits into flat pieces
(`{"__msgpack_chunked_array__": True, "shape": ..., "chunks": ...}`), which come back
as one lazy array, the pieces joined and reshaped.

Every length is checked against the bytes that remain, in the window read so far or
at the file's end, so a damaged file is a `CorruptCheckpointError` naming it."""

from __future__ import annotations

import math
import struct
from typing import Any

import attrs
import numpy as np

from lazyckpt._array import compose
from lazyckpt._array.dtypes import LONG_DOUBLES
from lazyckpt._errors import CorruptCheckpointError, LazyckptError, UnsupportedCheckpointError
from lazyckpt._lazy import LazyArray, composed
from lazyckpt._weights.arrays import Place, c_strides
from lazyckpt._weights.files import File
from lazyckpt._weights.longdouble import lazy
from lazyckpt._weights.unpickle import DTYPES

WINDOW = 1 << 20
_DEPTH = 64
"""The deepest a flax state nests (a model's modules nest a few levels)."""
_NAMES = {dtype.name: dtype for dtype in (*DTYPES.values(), *LONG_DOUBLES)}
_NAMES["bool"] = np.dtype("?")
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin, str
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXED = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}
_FIXED |= {0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_FIX = "the file is damaged, download or copy it again"


def is_msgpack_map(head: bytes) -> bool:
    """Whether `head` starts with a msgpack map (flax saves a dict): a non-empty one,
    or an empty one alone, the whole file (`to_bytes({})`; a pickle's first byte is
    that of an empty map too)."""
    return head == b"\x80" or (bool(head) and (0x81 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)))


@attrs.frozen
class _Array:
    """An ndarray's place: its bytes start at `start`."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    start: int


class _Walk:
    def __init__(self, file: File) -> None:
        self.file = file
        self.window, self.base, self.pos = b"", 0, 0

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.file.path}: msgpack {what} at byte {self.pos}; {_FIX}"
        )

    def take(self, n: int) -> bytes:
        """The next `n` bytes, from the window, read further where it ends."""
        at = self.pos - self.base
        if at < 0 or at + n > len(self.window):
            self.base = self.pos
            self.window = self.file.read_short(self.pos, max(n, WINDOW))
            at = 0
            if len(self.window) < n:
                raise self.fail(f"data ends early (needed {n} bytes)")
        self.pos += n
        return self.window[at : at + n]

    def number(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def value(self, depth: int) -> Any:
        if depth > _DEPTH:
            raise self.fail(f"nests deeper than {_DEPTH} levels")
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if b <= 0x8F or b in (0xDE, 0xDF):
            n = b & 0x0F if b <= 0x8F else self.number(2 if b == 0xDE else 4)
            out: dict[Any, Any] = {}
            for _ in range(n):
                key = self.value(depth + 1)
                if not isinstance(key, str | int):
                    raise UnsupportedCheckpointError(
                        f"{self.file.path}: a msgpack map key of type {type(key).__name__} "
                        f"at byte {self.pos}; lazyckpt names leaves by str and int keys (as "
                        "flax's to_bytes writes them): restore it with flax and save it "
                        "with str keys"
                    )
                out[key] = self.value(depth + 1)
            return out
        if b <= 0x9F or b in (0xDC, 0xDD):
            n = b & 0x0F if b <= 0x9F else self.number(2 if b == 0xDC else 4)
            return [self.value(depth + 1) for _ in range(n)]
        if b <= 0xBF:
            return self.text(b & 0x1F)
        if b in (0xC0, 0xC2, 0xC3):
            return {0xC0: None, 0xC2: False, 0xC3: True}[b]
        if b in _FIXED:
            fmt = struct.Struct(_FIXED[b])
            return fmt.unpack(self.take(fmt.size))[0]
        if b in _SIZED:
            n = self.number(_SIZED[b])
            return self.text(n) if b >= 0xD9 else self.take(n)
        if b in _EXT or 0xD4 <= b <= 0xD8:
            n = self.number(_EXT[b]) if b in _EXT else 1 << (b - 0xD4)
            code = struct.unpack(">b", self.take(1))[0]
            return self.ext(code, n, depth + 1)
        raise self.fail(f"type byte {b:#x}")

    def text(self, n: int) -> str:
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("string that is not UTF-8") from None

    def ext(self, code: int, n: int, depth: int) -> Any:
        end = self.pos + n
        if code not in (1, 2, 3):
            raise UnsupportedCheckpointError(
                f"{self.file.path}: msgpack ext type {code} at byte {self.pos}, which "
                "flax.serialization does not write (1 ndarray, 2 complex, 3 numpy scalar)"
            )
        if code == 2:
            found = self.value(depth)
            if not (
                isinstance(found, list)
                and len(found) == 2
                and all(isinstance(x, int | float) and not isinstance(x, bool) for x in found)
            ):
                raise self.fail("complex that is not [real, imag] of two numbers")
            value: Any = complex(*found)
        else:
            value = self.ndarray(code == 3, depth)
        if self.pos != end:
            raise self.fail(f"ext payload of {n} bytes that holds {self.pos - end + n}")
        return value

    def ndarray(self, scalar: bool, depth: int) -> Any:
        if self.take(1) != b"\x93":
            raise self.fail("ndarray that is not [shape, dtype, bytes]")
        shape = self.value(depth)
        name = self.value(depth)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise self.fail(f"ndarray shape {str(shape)[:60]}")
        if isinstance(name, bytes):  # (a name written as msgpack bin: flax reads it too)
            name = name.decode("ascii", "replace")
        dtype = _NAMES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise UnsupportedCheckpointError(
                f"{self.file.path}: an array of dtype {str(name)[:40]!r} at byte {self.pos}, "
                f"which lazyckpt does not read; it reads {', '.join(sorted(_NAMES))}"
            )
        b = self.take(1)[0]
        if b not in (0xC4, 0xC5, 0xC6):
            raise self.fail("ndarray whose data is not bytes")
        n = self.number(_SIZED[b])
        if n != math.prod(shape) * dtype.itemsize:
            raise self.fail(f"ndarray of shape {tuple(shape)} {dtype} in {n} bytes")
        if scalar:
            return np.frombuffer(self.take(n), dtype).reshape(shape)[()]
        found = _Array(tuple(shape), dtype, self.pos)
        self.pos += n
        return found


def read_flax(file: File) -> tuple[dict[str, Any], int]:
    """The tree of a flax msgpack file (its arrays as `_Array` places), and where its
    data ends: the caller checks the file reaches that far."""
    walk = _Walk(file)
    tree = walk.value(0)
    if not isinstance(tree, dict):
        raise walk.fail("top value that is not a map")
    return tree, walk.pos


def lazy_tree(file: File, tree: Any, path: tuple[str, ...] = ()) -> Any:
    """`tree` with each `_Array` a LazyArray and each chunked array joined; map keys
    kept as flax restores them (`1` and `"1"` are two keys, which the caller refuses)."""
    if isinstance(tree, _Array):
        name = "/".join(path)
        size = max(math.prod(tree.shape), 1)
        place = Place(file, tree.start, size, 0, tree.shape, c_strides(tree.shape))
        return lazy(name, path, tree.dtype, place)
    if isinstance(tree, dict) and tree.get("__msgpack_chunked_array__") is True:
        return _joined(file, tree, path)
    if isinstance(tree, dict):
        return {k: lazy_tree(file, v, (*path, str(k))) for k, v in tree.items()}
    if isinstance(tree, list):
        return [lazy_tree(file, v, (*path, str(i))) for i, v in enumerate(tree)]
    return tree


def _joined(file: File, tree: dict[str, Any], path: tuple[str, ...]) -> LazyArray:
    shape, chunks = tree.get("shape"), tree.get("chunks")
    name = "/".join(path)
    if not (isinstance(shape, dict) and isinstance(chunks, dict) and chunks):
        raise CorruptCheckpointError(f"{file.path}: chunked array {name!r} has no shape or chunks")
    dims: list[Any] = [shape.get(str(i)) for i in range(len(shape))]
    pieces: list[Any] = [chunks.get(str(i)) for i in range(len(chunks))]
    if not all(type(d) is int for d in dims) or not all(
        isinstance(p, _Array) and len(p.shape) == 1 and p.dtype == pieces[0].dtype for p in pieces
    ):
        raise CorruptCheckpointError(
            f"{file.path}: chunked array {name!r} is not flat pieces of one dtype; {_FIX}"
        )
    parts = [lazy_tree(file, p, path) for p in pieces]
    total = sum(p.shape[0] for p in parts)
    if total != math.prod(dims):
        raise CorruptCheckpointError(
            f"{file.path}: chunked array {name!r} of shape {tuple(dims)} has {total} elements; "
            f"{_FIX}"
        )
    dtype = parts[0].dtype
    flat = composed(path, compose.Concat((total,), dtype, tuple(parts), 0), dtype)
    try:
        joined = flat.reshape(tuple(dims))
    except LazyckptError as error:
        raise CorruptCheckpointError(f"{file.path}: chunked array {name!r}: {error}") from None
    return attrs.evolve(joined, path=path)
