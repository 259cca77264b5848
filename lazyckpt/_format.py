"""Human-readable figures for terminals and notebooks."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int) -> str:
    """`n` bytes in binary units.

    >>> human_bytes(512), human_bytes(1536), human_bytes(3 << 30)
    ('512 B', '1.5 KiB', '3.0 GiB')
    """
    size = float(n)
    for unit in _UNITS:
        if size < 1024 or unit == _UNITS[-1]:
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
