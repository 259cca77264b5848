"""How two blocks of values differ: exactly for integers and bools, in float64 (or
wider) for floats, with NaNs in the same places equal; a piece at a time, so the
temporaries stay small whatever the block's size."""

from __future__ import annotations

from typing import Any

import numpy as np

PIECE = 1 << 18  # elements compared at once: a few MiB of float64 temporaries
Found = tuple[float, float, bool]
"""Largest absolute and relative difference, and whether any element differs."""
SAME: Found = (0, 0.0, False)


def worse(a: Found, b: Found) -> Found:
    return max(a[0], b[0]), max(a[1], b[1]), a[2] or b[2]


def block_difference(left: np.ndarray, right: np.ndarray) -> Found:
    """Largest absolute and relative difference of two blocks, and whether any
    element differs (NaN matching NaN does not); `PIECE` elements at a time, so the
    temporaries stay small whatever the block's size."""
    a, b = left.reshape(-1), right.reshape(-1)
    worst = SAME
    for start in range(0, a.size, PIECE):
        found = _piece_difference(a[start : start + PIECE], b[start : start + PIECE])
        worst = worse(worst, found)
    return worst


def _piece_difference(left: np.ndarray, right: np.ndarray) -> Found:
    if left.dtype.kind == "b":
        differs = bool(np.any(left != right))
        return int(differs), float(differs), differs
    if not _numeric(left.dtype):  # text, dates, objects
        differs = not np.array_equal(left, right)
        return int(differs), float(differs), differs
    if left.dtype.kind in "iu":
        return _integer_difference(left, right)
    # float64 holds every value of the narrower floats exactly (float16, bfloat16, the
    # float8s), so that equal means equal; long doubles keep their own precision.
    wide = np.result_type(left.dtype, np.float64) if left.dtype.kind in "fc" else np.float64
    x, y = left.astype(wide), right.astype(wide)
    same = _same(x.real, y.real)
    if x.dtype.kind == "c":  # (NaN in the same parts: `nan+1j` is not `1+nanj`)
        same &= _same(x.imag, y.imag)
    if bool(np.all(same)):
        return SAME
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.abs(x - y)
        delta = np.where(same, 0.0, np.where(np.isnan(delta), np.inf, delta))
        scale = np.maximum(np.abs(x), np.abs(y))
        rel = np.where(delta == 0, 0.0, delta / np.where(scale == 0, 1.0, scale))
    return float(delta.max()), float(np.nan_to_num(rel, nan=np.inf).max()), True


def _integer_difference(left: np.ndarray, right: np.ndarray) -> Found:
    """Integers compared exactly, as float64 cannot (2**53 + 1 is 2**53 there), and
    their largest difference as an exact int. |x - y| of two int64 or two uint64 is
    below 2**64: the difference of their unsigned forms, which wraps modulo 2**64, is
    that exactly, where int64's own would overflow."""
    differs = left != right
    if not bool(np.any(differs)):
        return SAME
    wide = np.int64 if left.dtype.kind == "i" else np.uint64
    x, y = left[differs].astype(wide), right[differs].astype(wide)
    high, low = np.maximum(x, y).view(np.uint64), np.minimum(x, y).view(np.uint64)
    delta = high - low
    size = np.maximum(_magnitude(x), _magnitude(y)).astype(np.float64)
    return int(delta.max()), float((delta.astype(np.float64) / size).max()), True


def _magnitude(values: np.ndarray) -> np.ndarray:
    """|values| as uint64, exact for int64's most negative value too."""
    unsigned = values.view(np.uint64)
    return (
        np.where(values < 0, np.negative(unsigned), unsigned)
        if values.dtype.kind == "i"
        else unsigned
    )


def _same(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Where two float arrays are equal, NaN counting as equal to NaN."""
    same: np.ndarray = (x == y) | (np.isnan(x) & np.isnan(y))
    return same


def canonical(values: np.ndarray) -> list[np.ndarray] | None:
    """The flat `values` as uint64 words (a list of arrays, one word of each value in
    each): two values have the same words wherever `block_difference` finds them
    equal. Integers exactly; floats by their bits once every NaN is one NaN and -0.0
    is 0.0, in float64 where their own dtype is not NumPy's (a long double as two
    float64s, a complex number part by part); text, dates and raw bytes by their
    bytes. None for objects and records, whose equality no bytes show."""
    flat = values.reshape(-1)
    if flat.dtype.kind in "biu":  # (a bool's byte other than 1 is True, as `!=` has it)
        return [flat.astype(np.int64 if flat.dtype.kind == "i" else np.uint64).view(np.uint64)]
    if flat.dtype.kind == "f" and flat.dtype.itemsize <= 8:  # (float64 holds them exactly)
        with np.errstate(invalid="ignore"):
            same = np.where(np.isnan(flat), np.nan, flat + flat.dtype.type(0))
        return [same.view(f"u{flat.dtype.itemsize}").astype(np.uint64)]
    if _numeric(flat.dtype):
        wide = np.result_type(flat.dtype, np.float64) if flat.dtype.kind in "fc" else np.float64
        x = flat.astype(wide)
        parts = (x.real, x.imag) if x.dtype.kind == "c" else (x,)
        return [word for part in parts for word in _float_words(part)]
    if flat.dtype.names is not None or flat.dtype.kind == "O":
        return None
    # Text, dates and raw bytes: equal where their bytes are (NaT equals nothing).
    size = flat.dtype.itemsize
    rows = np.zeros((flat.size, -(-size // 8) * 8), np.uint8)
    rows[:, :size] = np.ascontiguousarray(flat).view(np.uint8).reshape(flat.size, size)
    words = rows.view(np.uint64)
    return [words[:, i] for i in range(words.shape[1])]


def _float_words(part: np.ndarray) -> list[np.ndarray]:
    """A real part's words: float64, with one NaN and one zero; a long double as its
    float64 and what that leaves over, whose bytes hold padding that its value does not."""
    with np.errstate(invalid="ignore", over="ignore"):
        if part.dtype.itemsize > 8:
            high = part.astype(np.float64)
            pieces = [high, (part - high).astype(np.float64)]
        else:
            pieces = [part]
        return [np.where(np.isnan(p), np.nan, p + 0.0).view(np.uint64) for p in pieces]


def _numeric(dtype: np.dtype[Any]) -> bool:
    """Whether `dtype` holds numbers: bfloat16 and the other ml_dtypes (whose kind is
    'V') too; not text, dates, objects, records or raw bytes."""
    if dtype.kind in "fc":  # (long doubles too, which float64 cannot hold)
        return True
    return dtype.names is None and dtype.kind not in "OSUMm" and np.can_cast(dtype, np.float64)
