"""Sizes as the API and the command line take them: bytes, or text such as `"5GB"`.

`KB`, `MB`, `GB` and `TB` are powers of 1000, as `huggingface_hub` and `transformers`
read them (`max_shard_size="5GB"` is 5 x 10^9 bytes there and here); `KiB`, `MiB`,
`GiB` and `TiB` are powers of 1024. Units are read whatever their case: a lowercase
`b` is bytes, as `huggingface_hub` reads it (`transformers` alone reads `"5Gb"` as
bits). A unit of one letter (`"5G"`) is refused: tools disagree on what it means.
A size is at most 2**64 bytes (16 EiB), more than any machine or file holds.
"""

from __future__ import annotations

import numbers
import re

from lazyckpt._errors import SizeError
from lazyckpt._text import shown

Size = int | str
"""A number of bytes, or text: `"256MiB"`, `"5 GB"`, `"1.5GiB"`, `"4096"`."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# ASCII alone: `str.lower` would turn the Kelvin sign into a `k`.
_SIZE = re.compile(r"([0-9]+(?:_[0-9]+)*)(?:\.([0-9]+))?\s*([a-z]*)", re.ASCII | re.IGNORECASE)
LARGEST = 2**64
# Far more digits than a size needs (21 before the point pass LARGEST): Python's int()
# refuses 4,300 or more with a bare ValueError, and big ones cost quadratic time.
_DIGITS = 60
_TOO_LARGE = "more than 2**64 bytes (16 EiB), which no machine or file holds"


def _accepted(example: int = 268435456) -> str:
    """What every bad size's message ends with: the forms a size takes."""
    return (
        f"write bytes ({example}) or a number with a unit: KB, MB, GB, TB (powers of 1000, "
        "as huggingface_hub and transformers) or KiB, MiB, GiB, TiB (powers of 1024)"
    )


def parse_size(value: object) -> int:
    """The bytes `value` stands for, at least 1; else `SizeError` saying what to write.
    A fraction of a unit is rounded down to whole bytes.

    >>> parse_size("5GB"), parse_size("5GiB"), parse_size("1.5 kib"), parse_size(4096)
    (5000000000, 5368709120, 1536, 4096)
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        found = int(value)
    elif isinstance(value, str):
        found = _parse_text(value)
    elif isinstance(value, float) and value.is_integer() and abs(value) <= LARGEST:
        raise SizeError(f"{value!r} is not a size: a float; {_accepted(int(value))}")
    else:
        raise SizeError(f"{shown(value)} is not a size: {_accepted()}")
    if found < 1:
        raise SizeError(f"{shown(value)} is not a size: a size is at least 1 byte; {_accepted()}")
    if found > LARGEST:
        raise SizeError(f"{shown(value)} is not a size: {_TOO_LARGE}; {_accepted()}")
    return found


def size_argument(name: str, value: object) -> int:
    """`parse_size(value)` for the argument `name`, which the error names."""
    try:
        return parse_size(value)
    except SizeError as error:
        raise SizeError(f"{name}={error}") from None


def optional_size(name: str, value: object) -> int | None:
    """`size_argument`, where None stands for the default."""
    return None if value is None else size_argument(name, value)


def _parse_text(text: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    unit = match[3].lower() if match else ""
    if match is None or unit not in _UNITS:
        prefix = unit.upper() if unit in ("k", "m", "g", "t") else ""
        hint = f"{prefix} alone is ambiguous; " if prefix else ""
        raise SizeError(f"{shown(text)} is not a size: {hint}{_accepted()}")
    whole, fraction = match[1].replace("_", "").lstrip("0"), match[2] or ""
    if fraction and _UNITS[unit] == 1:
        raise SizeError(f"{shown(text)} is not a size: bytes are whole; {_accepted()}")
    if len(whole) > 20:  # 10**20 bytes is past LARGEST whatever the unit
        raise SizeError(f"{shown(text)} is not a size: {_TOO_LARGE}; {_accepted()}")
    if len(whole) + len(fraction) > _DIGITS:
        raise SizeError(
            f"{shown(text)} is not a size: {len(whole) + len(fraction)} digits, more than "
            f"the {_DIGITS} a size can need; {_accepted()}"
        )
    # Exact integer arithmetic: "4.35MB" is 4350000 bytes, where floats give 4349999.
    scale: int = 10 ** len(fraction)
    return int(whole + fraction or "0") * _UNITS[unit] // scale
