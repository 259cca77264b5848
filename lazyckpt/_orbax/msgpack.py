"""A safe, pure-Python reader for the legacy msgpack `checkpoint` file (flax's format).

Orbax 0.2-0.5 wrote aggregated leaves and placeholders as one msgpack value with
flax's extension types (format notes, Legacy msgpack). This decoder never uses pickle or eval,
keeps its own stack instead of recursing per nesting level, and checks every declared
length against the bytes that remain before allocating, so a damaged file raises
`CorruptCheckpointError` rather than crashing or exhausting memory.

Chunked arrays (`{"__msgpack_chunked_array__": True, ...}`) are reassembled inside
`decode`; callers never see the chunked form.
"""

from __future__ import annotations

import math
import reprlib
import struct
import sys
from typing import Any, TypeGuard

import numpy as np

from lazyckpt._array.tree import MAX_DEPTH
from lazyckpt._errors import CorruptCheckpointError, UnsupportedCheckpointError
from lazyckpt._orbax.zarr import readable
from lazyckpt._storage.lazy_tensorstore import ts  # deferred: a local open needs none

__all__ = ["MAX_DEPTH", "decode"]

_MAX_RANK = 64  # numpy's own limit on dimensions
_MAX_ELEMENTS = sys.maxsize // 32  # numpy needs elements * itemsize (up to 32) to fit an intp
_DAMAGED = "the file is damaged, copy the checkpoint again"
_UNKNOWN = "the file is damaged or was written by a newer writer"
_LIST, _MAP, _TUPLE = 0, 1, 2
# flax writes `dtype.name`. Names are looked up, never given to np.dtype(), which parses
# any string (field lists, sub-arrays) and raises SyntaxError or warns on some.
_NUMPY_DTYPES = {d.name: d for d in map(np.dtype, set(np.sctypeDict.values()))}
# numpy dtype names that flax can write and lazyckpt does not read (dates, text, bytes).
_UNREADABLE = ("datetime64", "timedelta64", "str", "bytes", "object", "void")
_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}
_INT8 = struct.Struct(">b")
# Type bytes 0xca-0xd3: a fixed-size number follows.
_NUMBERS = (
    "a float32|a float64|a uint8|a uint16|a uint32|a uint64|an int8|an int16|an int32|an int64"
)
_FIXED = {
    0xCA + i: (struct.Struct(">" + fmt), what)
    for i, (fmt, what) in enumerate(zip("fdBHIQbhiq", _NUMBERS.split("|"), strict=True))
}
# Type byte -> (struct of the length that follows, what it counts); 0xc4 is bin8.
_SIZED = {
    first + i: (struct.Struct(">" + fmt), kind)
    for kind, first, fmts in (
        ("bin", 0xC4, "BHI"),
        ("ext", 0xC7, "BHI"),
        ("str", 0xD9, "BHI"),
        ("array", 0xDC, "HI"),
        ("map", 0xDE, "HI"),
    )
    for i, fmt in enumerate(fmts)
}


def decode(data: bytes, *, where: str) -> Any:
    """Decode one msgpack value filling `data`, with flax's ndarray/complex/tuple types.

    `where` (normally the file's path) starts every error message.

    >>> from lazyckpt._orbax.msgpack import decode
    >>> # {"w": ext 1 holding [[2], "int8", b"\\x01\\x02"]}: flax's encoding of an array.
    >>> payload = bytes([0x93, 0x91, 0x02, 0xA4]) + b"int8" + bytes([0xC4, 2, 1, 2])
    >>> decode(bytes([0x81, 0xA1]) + b"w" + bytes([0xC7, len(payload), 1]) + payload, where="ckpt")
    {'w': array([1, 2], dtype=int8)}
    """
    return _Decoder(memoryview(data).toreadonly(), where, base=0, raw=False).whole()


class _Frame:
    """A container being filled: `remaining` values (for a map: pairs) still to come."""

    __slots__ = ("end", "items", "key", "kind", "remaining", "start")

    def __init__(self, kind: int, items: Any, remaining: int, start: int, end: int = -1) -> None:
        self.kind, self.items, self.remaining = kind, items, remaining
        self.start, self.end, self.key = start, end, _Frame  # `_Frame`: no key read yet


class _Decoder:
    # `raw` decodes an ndarray or complex payload: str and bin stay views, ext is refused.
    __slots__ = ("base", "data", "end", "pos", "raw", "where")

    def __init__(self, data: memoryview, where: str, *, base: int, raw: bool) -> None:
        self.data, self.where, self.base, self.raw = data, where, base, raw
        self.pos, self.end = 0, len(data)

    def fail(
        self, offset: int, problem: str, detail: str, fix: str = _DAMAGED
    ) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: msgpack data {problem} at byte {self.base + offset}: {detail}; {fix}"
        )

    def whole(self) -> Any:
        value = self.value()
        if self.pos != self.end:
            trailing = f"has {self.end - self.pos} trailing bytes"
            raise self.fail(self.pos, trailing, "expected the data to end after one value")
        return value

    def take(self, n: int, what: str, *, declared: bool = True) -> int:
        """Claim `n` bytes and return where they start, checking they exist first."""
        start, remain = self.pos, self.end - self.pos
        if n > remain:
            size = f"of {n} bytes was declared" if declared else f"needs {n} bytes"
            detail = f"{what} {size} but only {remain} remain"
            raise self.fail(start, "is truncated", detail)
        self.pos = start + n
        return start

    def value(self) -> Any:
        stack: list[_Frame] = []
        while True:
            start = self.pos
            value = self.item()
            if isinstance(value, _Frame):
                if len(stack) >= MAX_DEPTH:
                    deep = f"nests deeper than {MAX_DEPTH} levels"
                    raise self.fail(start, deep, "no checkpoint tree is this deep")
                stack.append(value)
                continue
            while stack:
                frame = stack[-1]
                if frame.kind == _LIST:
                    frame.items.append(value)
                elif frame.kind == _TUPLE:
                    if not isinstance(value, list) or self.pos != frame.end:
                        detail = "expected an ext payload of exactly one array"
                        raise self.fail(frame.start, "has a bad tuple", detail)
                    frame.items = tuple(value)
                elif frame.key is _Frame:
                    if isinstance(value, bytes):
                        value = self.text(value, start)
                    try:
                        hash(value)
                    except TypeError:
                        detail = f"expected a str, found a {type(value).__name__}"
                        raise self.fail(start, "has a bad map key", detail) from None
                    frame.key = value
                    break
                else:
                    frame.items[frame.key] = value
                    frame.key = _Frame
                frame.remaining -= 1
                if frame.remaining:
                    break
                stack.pop()
                value, start = frame.items, frame.start
                if frame.kind == _MAP and value.get("__msgpack_chunked_array__") is True:
                    value = self.unchunk(value, start)
            else:
                return value

    def item(self) -> Any:
        """Read one value, or the header of a non-empty container as a `_Frame` to fill."""
        start = self.pos
        if start >= self.end:
            raise self.fail(start, "is truncated", "expected another value but the data ended")
        self.pos = start + 1
        b = self.data[start]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if b <= 0x9F:
            return self.open(_MAP if b <= 0x8F else _LIST, b & 0x0F, start)
        if b <= 0xBF:
            return self.string(b & 0x1F, "str")
        if b in _CONSTANTS:
            return _CONSTANTS[b]
        if b in _FIXED:
            fmt, what = _FIXED[b]
            return fmt.unpack_from(self.data, self.take(fmt.size, what, declared=False))[0]
        if b in _SIZED:
            fmt, what = _SIZED[b]
            at = self.take(fmt.size, f"a {what} length", declared=False)
            n = fmt.unpack_from(self.data, at)[0]
            if what in ("array", "map"):
                return self.open(_LIST if what == "array" else _MAP, n, start)
            return self.ext(n, start) if what == "ext" else self.string(n, what)
        if 0xD4 <= b <= 0xD8:
            return self.ext(1 << (b - 0xD4), start)
        raise self.fail(start, "has byte 0xc1", "msgpack never uses it")

    def open(self, kind: int, n: int, start: int) -> object:
        # Every value takes at least one byte, so a count is checked before any work.
        needed, what = (n, "an array") if kind == _LIST else (2 * n, "a map")
        remain = self.end - self.pos
        if needed > remain:
            detail = f"{what} of {n} items was declared but only {remain} bytes remain"
            raise self.fail(start, "is truncated", detail)
        if n == 0:
            return [] if kind == _LIST else {}
        return _Frame(kind, [] if kind == _LIST else {}, n, start)

    def string(self, n: int, what: str) -> object:
        start = self.take(n, f"a {what}")
        view = self.data[start : start + n]
        if self.raw:
            return view
        return self.text(view, start) if what == "str" else bytes(view)

    def text(self, view: bytes | memoryview, start: int) -> str:
        try:
            return str(view, "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(start, "has a bad str", f"expected UTF-8, found {e.reason}") from None

    def ext(self, n: int, start: int) -> object:
        code = _INT8.unpack_from(self.data, self.take(1, "an ext code", declared=False))[0]
        begin = self.take(n, "an ext payload")
        if self.raw:
            detail = f"expected plain values in an ext payload, found ext code {code}"
            raise self.fail(start, "has a nested ext", detail)
        if code == 4:  # tuple: the payload is decoded in place, on this decoder's stack
            self.pos = begin
            return _Frame(_TUPLE, None, 1, start, end=begin + n)
        if code not in (1, 2, 3):
            detail = "expected 1 (ndarray), 2 (complex), 3 (numpy scalar) or 4 (tuple)"
            raise self.fail(start, f"has unknown ext code {code}", detail, _UNKNOWN)
        payload = _Decoder(
            self.data[begin : begin + n], self.where, base=self.base + begin, raw=True
        )
        found = payload.whole()
        if code == 2:
            if not (isinstance(found, list) and len(found) == 2 and _numbers(found)):
                detail = f"expected [real, imag], found {_show(found)}"
                raise self.fail(start, "has a bad complex", detail)
            return complex(*found)
        array = self.ndarray(found, start)
        if code == 3:
            if array.ndim:
                detail = f"expected shape (), found {array.shape}"
                raise self.fail(start, "has a bad numpy scalar", detail)
            return array[()]
        return array

    def ndarray(self, payload: object, start: int) -> np.ndarray:
        if not (isinstance(payload, list) and len(payload) == 3):
            detail = f"expected [shape, dtype name, bytes], found {_show(payload)}"
            raise self.fail(start, "has a bad ndarray", detail)
        shape, name, buffer = payload
        if not _is_shape(shape):
            detail = (
                f"expected a shape of at most {_MAX_RANK} non-negative ints, found {_show(shape)}"
            )
            raise self.fail(start, "has a bad ndarray", detail)
        if not (isinstance(name, memoryview) and isinstance(buffer, memoryview)):
            detail = "expected a dtype name and bytes after the shape"
            raise self.fail(start, "has a bad ndarray", detail)
        dtype_name = str(name, "utf-8", "replace")
        dtype = _dtype(dtype_name)
        if dtype is None and not dtype_name.startswith(_UNREADABLE):
            detail = f"expected a dtype name such as 'float32', found {_show(dtype_name)}"
            raise self.fail(start, "has an ndarray of unknown dtype", detail, _UNKNOWN)
        if dtype is None or not readable(dtype):
            raise UnsupportedCheckpointError(
                f"{self.where}: msgpack data has an ndarray of dtype {dtype_name!r} at byte "
                f"{self.base + start}, which lazyckpt does not read (numbers, bools, "
                "bfloat16, float8 and int4 it does)"
            )
        size = math.prod(shape) * dtype.itemsize
        if size != len(buffer):
            detail = f"shape {tuple(shape)} of {dtype} needs {size} bytes, found {len(buffer)}"
            raise self.fail(start, "has a bad ndarray", detail)
        # A copy, so the array is writable and does not pin the whole file's bytes.
        return np.frombuffer(buffer, dtype).reshape(shape).copy()

    def unchunk(self, chunked: dict[str, object], start: int) -> np.ndarray:
        """Reassemble flax's split form of an array over 2**30 bytes."""
        shape, chunks = _indexed(chunked.get("shape")), _indexed(chunked.get("chunks"))
        if not (_is_shape(shape) and chunks):
            detail = 'expected "shape" and "chunks" maps keyed "0", "1", ...'
            raise self.fail(start, "has a bad chunked array", detail)
        if not all(isinstance(c, np.ndarray) and c.dtype == chunks[0].dtype for c in chunks):
            detail = "expected chunks that are arrays of one dtype"
            raise self.fail(start, "has a bad chunked array", detail)
        size = sum(c.size for c in chunks)
        if size != math.prod(shape):
            detail = f"shape {tuple(shape)} needs {math.prod(shape)} elements, found {size}"
            raise self.fail(start, "has a bad chunked array", detail)
        return np.concatenate([c.reshape(-1) for c in chunks]).reshape(shape)


# `type(x) is int`, not isinstance: a bool is neither a size nor a complex part.
def _is_shape(shape: object) -> TypeGuard[list[int]]:
    """A list of sizes numpy can hold; the product skips zeros, as numpy's own check does."""
    return (
        isinstance(shape, list)
        and len(shape) <= _MAX_RANK
        and all(type(d) is int and d >= 0 for d in shape)
        and math.prod(d for d in shape if d) <= _MAX_ELEMENTS
    )


def _numbers(parts: list[object]) -> bool:
    return all(type(x) in (int, float) for x in parts)


class _Short(reprlib.Repr):
    """A short repr for messages; payload bytes are memoryviews, shown as bytes."""

    def repr_memoryview(self, view: memoryview, level: int) -> str:
        return self.repr_instance(bytes(view[: self.maxother]), level)


_show = _Short().repr


def _indexed(mapping: object) -> list[Any] | None:
    """`{"0": a, "1": b}` as `[a, b]`: how flax stores a tuple inside a chunked array."""
    if not isinstance(mapping, dict) or set(mapping) != {str(i) for i in range(len(mapping))}:
        return None
    return [mapping[str(i)] for i in range(len(mapping))]


def _dtype(name: str) -> np.dtype[Any] | None:
    """numpy's dtype for a name, via tensorstore for ones numpy lacks ("bfloat16", "int4")."""
    dtype = _NUMPY_DTYPES.get(name)
    if dtype is None:
        try:
            dtype = np.dtype(ts.dtype(name).numpy_dtype)
        except ValueError:
            return None
    # Object dtypes (tensorstore's "json", "string") and sizeless ones cannot come from bytes.
    return None if dtype.hasobject or not dtype.itemsize else dtype
