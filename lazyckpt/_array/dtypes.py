"""Dtype categories and limits that know ml_dtypes' types (bfloat16, the float8, float6
and float4 types, int4...) as `jax.numpy.issubdtype` and `jnp.finfo` do, without
importing jax: NumPy files them all under `np.void`, so `np.issubdtype(bfloat16,
np.floating)` is False."""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike


@functools.cache
def _category(dtype: np.dtype[Any]) -> type[Any]:
    """The NumPy scalar type that stands for `dtype` in NumPy's type hierarchy: its own,
    or, for ml_dtypes' types, `np.floating`, `np.signedinteger` or `np.unsignedinteger`
    (ml_dtypes knows the limits of each of its numbers, and only of those)."""
    if not dtype.type.__module__.startswith("ml_dtypes"):
        return dtype.type  # NumPy's own (ml_dtypes' float8_e5m2 claims kind 'f' too)
    try:
        ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]  # (ml_dtypes is untyped)
    except ValueError:
        pass
    else:
        return np.floating
    try:
        signed = ml_dtypes.iinfo(dtype).min < 0  # type: ignore[no-untyped-call]
    except ValueError:
        return dtype.type
    return np.signedinteger if signed else np.unsignedinteger


def issubdtype(dtype: DTypeLike, category: type[Any]) -> bool:
    """`np.issubdtype`, with ml_dtypes' floats under `np.floating` and its ints under
    `np.signedinteger` or `np.unsignedinteger`, as in `jnp.issubdtype`.

    >>> issubdtype(ml_dtypes.bfloat16, np.floating), issubdtype("int32", np.floating)
    (True, False)
    >>> issubdtype(ml_dtypes.uint4, np.unsignedinteger)
    True
    >>> issubdtype(ml_dtypes.float8_e5m2, np.floating), issubdtype(np.void, np.floating)
    (True, False)
    """
    return bool(np.issubdtype(_category(np.dtype(dtype)), category))


def parsed(given: object) -> np.dtype[Any] | None:
    """The dtype NumPy reads `given` as (`"bfloat16"` too, once ml_dtypes is imported);
    None where it reads none. NumPy raises TypeError, ValueError or, for some strings
    it parses as code (`"f4,,"`), SyntaxError.

    >>> parsed("float32"), parsed("floaty"), parsed("f4,,")
    (dtype('float32'), None, None)
    """
    try:
        found: np.dtype[Any] = np.dtype(given)  # type: ignore[call-overload]  # (checked here)
    except (TypeError, ValueError, SyntaxError):
        return None
    return found


def finfo(dtype: DTypeLike) -> Any:
    """`np.finfo`, which also knows bfloat16 and the float8, float6 and float4 types
    (`ml_dtypes.finfo`, untyped)."""
    return ml_dtypes.finfo(np.dtype(dtype))  # type: ignore[no-untyped-call]


LONG_DOUBLES = frozenset(
    dtype
    for dtype in (np.dtype(np.longdouble), np.dtype(np.clongdouble))
    if dtype.name not in ("float64", "complex128")  # (where a long double is a double)
)
"""NumPy's long doubles where they are wider than a double, in native byte order:
`float128` and `complex256` on x86-64 Linux (x87's 80 bits, padded to 16 bytes) and
arm64 Linux (IEEE quad precision). NumPy holds them; tensorstore and jax have no such
type."""
