"""Text for terminals and notebooks: sizes in binary units, and names made safe to print."""

from __future__ import annotations

import re

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


# Control characters (ESC starts terminal escape sequences), and the bidirectional
# overrides that make text read differently from what it is.
# Lone surrogates too (valid JSON escapes, `\ud800`), which no terminal encoding takes.
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNSAFE_TEXT = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def printable(text: str, *, lines: bool = False) -> str:
    r"""`text` with control characters shown as escapes, as `repr` shows them: a key or
    string from a checkpoint cannot move the cursor or retitle the terminal. With
    `lines`, newlines stay.

    >>> printable("w\x1b]0;pwned\x07"), printable("a\nb", lines=True)
    ('w\\x1b]0;pwned\\x07', 'a\nb')
    """
    unsafe = _UNSAFE_TEXT if lines else _UNSAFE_LINE
    return unsafe.sub(lambda m: repr(m[0])[1:-1], text)


def is_utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8: not when it holds a lone surrogate (`\\ud800`,
    a valid JSON escape), which no file name, JSON or tensorstore key can hold.

    >>> is_utf8("w"), is_utf8("w\\ud800")
    (True, False)
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
