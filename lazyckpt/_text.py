"""Text for terminals and notebooks: sizes in binary units, names made safe to print,
long lists of key paths folded by their layer numbers; and numbers read from names."""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable

import attrs

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


def ascii_int(text: str, max_digits: int = 18) -> int | None:
    """`text` as a number when it is 1 to `max_digits` ASCII digits; None otherwise.

    Names from files, folders and keys are numbers only as ASCII writes them: `int()`
    also takes Unicode digits (`"١٢"` is 12), signs, spaces and underscores, and raises
    its own ValueError past 4,300 digits. 18 digits fit any index or count.

    >>> ascii_int("12"), ascii_int("007"), ascii_int("١٢"), ascii_int("²"), ascii_int("9" * 19)
    (12, 7, None, None, None)
    """
    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None


def shown(value: object) -> str:
    """`value` for a message, cut short: `repr` of an int of 4,300 digits or more
    raises, and a string of thousands of characters would bury the message.

    >>> shown(3), shown("9" * 5000)[-20:], shown(10**5000)
    ('3', '... (5002 characters)', '(an int of 16610 bits)')
    """
    if isinstance(value, numbers.Integral) and abs(int(value)) > 10**40:
        return f"(an int of {int(value).bit_length()} bits)"
    try:
        text = repr(value)
    except ValueError:  # a container of huge ints
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


Detail = tuple[tuple[str, str], ...]
"""What a report says about one key path, as `(label, value)` fields: a field whose
values differ along a folded run says so on its own (`checkpoint varies: ...`)."""

_NUMBER = re.compile(r"([0-9]{1,18})")  # (ASCII digits, fewer than int() refuses)
_DIGITS = re.compile("[0-9]+")
_SHOWN_RUNS = 6  # runs of numbers written out before the rest are elided
_SHOWN_VALUES = 3  # distinct values of a field listed before it just "varies"
_STEPPED_RUN = 4  # numbers a step apart written `first..last..step`, from this many


@attrs.frozen
class Folded:
    """One line of a folded report: `path` (ranges in braces), its detail, and how many
    of the original lines it stands for."""

    path: str
    detail: str
    count: int

    def __str__(self) -> str:
        return f"{self.path}  {self.detail}" if self.detail else self.path


@attrs.frozen
class _Entry:
    tokens: tuple[str | frozenset[int], ...]  # text, digits, or a folded set of numbers
    detail: Detail
    count: int
    tail: str
    varied: bool = False


def fold(
    lines: Iterable[tuple[str, str | Detail] | tuple[str, str | Detail, int, str]],
    *,
    vary: bool = True,
) -> list[Folded]:
    """Report lines `(path, detail)` (or `(path, detail, count, tail)`, a `tail` that
    is printed after the path and never folded), lines whose paths differ only in one
    number collapsed into one: `layer_{0..25}/mlp/gate`, `layers/{0..3,5..9}/w`.
    Runs fold innermost first, so experts of layers fold twice. A detail identical
    along a run is kept; with `vary`, runs whose details differ fold too, and each
    differing field lists its values by number, or says how many differ.

    >>> [str(f) for f in fold([(f"layer_{i}/w", "f32[8]") for i in (0, 1, 2, 5)])]
    ['layer_{0..2,5}/w  f32[8]']
    >>> lines = [(f"b.{i}", (("target", "(8,)"), ("checkpoint", f"({i},)"))) for i in (1, 2)]
    >>> [str(f) for f in fold(lines)]
    ['b.{1,2}  target (8,), checkpoint varies: (1,) at 1; (2,) at 2']
    """
    entries = []
    for line in lines:
        path, detail = line[0], line[1]
        count, tail = (line[2], line[3]) if len(line) == 4 else (1, "")
        fields = ((("", detail),) if detail else ()) if isinstance(detail, str) else detail
        entries.append(_Entry(_tokens(path), fields, count, tail))
    for varied in (False, True) if vary else (False,):
        width = max((len(e.tokens) for e in entries), default=0)
        for at in reversed(range(1, width, 2)):  # digits sit at odd positions
            entries = _fold_at(entries, at, varied)
    return [
        Folded(
            "".join(_token_text(t) for t in e.tokens) + e.tail,
            ", ".join(f"{label} {value}" if label else value for label, value in e.detail),
            e.count,
        )
        for e in entries
    ]


def _tokens(path: str) -> tuple[str | frozenset[int], ...]:
    """`path` split around its numbers; numbers with a leading zero stay text, as
    `layer_01` cannot be written back from 1."""
    parts = _NUMBER.split(path)
    return tuple(
        frozenset({int(p)}) if i % 2 and (p == "0" or not p.startswith("0")) else p
        for i, p in enumerate(parts)
    )


def _token_text(token: str | frozenset[int]) -> str:
    if isinstance(token, str):
        return token
    return f"{{{numbers_text(token)}}}" if len(token) > 1 else str(next(iter(token)))


def _fold_at(entries: list[_Entry], at: int, varied: bool) -> list[_Entry]:
    """Entries equal but for the number at token `at` merged (their details equal, or
    with `varied`, differing in values only), in the order they came."""
    groups: dict[object, list[_Entry]] = {}
    order: list[object] = []
    for i, entry in enumerate(entries):
        number = entry.tokens[at] if at < len(entry.tokens) else None
        if not isinstance(number, frozenset) or (varied and entry.varied):
            key: object = i
        else:
            rest = (entry.tokens[:at], entry.tokens[at + 1 :], entry.tail)
            key = (rest, tuple(label for label, _ in entry.detail) if varied else entry.detail)
        if key not in groups:
            order.append(key)
        groups.setdefault(key, []).append(entry)
    out = []
    for key in order:
        members = groups[key]
        if len(members) == 1:
            out.append(members[0])
            continue
        numbers = [n for m in members if isinstance(n := m.tokens[at], frozenset)]
        union: frozenset[int] = frozenset().union(*numbers)
        detail = members[0].detail
        if varied and any(m.detail != detail for m in members):
            detail = _varying([m.detail for m in members], numbers)
        tokens = (*members[0].tokens[:at], union, *members[0].tokens[at + 1 :])
        count = sum(m.count for m in members)
        out.append(_Entry(tokens, detail, count, members[0].tail, varied or members[0].varied))
    return out


def _varying(details: list[Detail], numbers: list[frozenset[int]]) -> Detail:
    """Fields of `details` merged: equal values kept, differing ones listed by number."""
    out = []
    for i, (label, value) in enumerate(details[0]):
        where: dict[str, set[int]] = {}
        for detail, found in zip(details, numbers, strict=True):
            where.setdefault(detail[i][1], set()).update(found)
        if len(where) == 1:
            out.append((label, value))
        elif len(where) <= _SHOWN_VALUES:
            listed = "; ".join(f"{v} at {numbers_text(n)}" for v, n in where.items())
            out.append((label, f"varies: {listed}"))
        else:
            out.append((label, f"varies ({len(where)} values)"))
    return tuple(out)


def numbered(key: str) -> tuple[str, str, str] | None:
    """`key` around its last number, `(before, digits, after)`, for folding siblings
    by it; None without one (or with one of more digits than a count takes).

    >>> numbered("layer_12"), numbered("7"), numbered("layer_007"), numbered("w")
    (('layer_', '12', ''), ('', '7', ''), ('layer_', '007', ''), None)
    """
    runs = list(_DIGITS.finditer(key))
    if not runs or ascii_int(runs[-1][0]) is None:
        return None
    last = runs[-1]
    return key[: last.start()], last[0], key[last.end() :]


def numbers_text(values: Iterable[int], *, runs: int = _SHOWN_RUNS, width: int = 0) -> str:
    """Numbers as runs, the way folded names write them: `0..25`, `0..3,5..9`, `4,5`,
    and a step as bash writes one (`1..47..2`, every other one); past `runs` runs,
    `...` and how many in all; each of `width` digits at least.

    >>> numbers_text([0, 1, 2, 5]), numbers_text(range(1, 48, 2))
    ('0..2,5', '1..47..2')
    >>> numbers_text([i * i for i in range(10)], runs=2)
    '0,1,...(10 in all)'
    >>> numbers_text([0, 1, 2, 3], width=3)
    '000..003'
    """
    ordered = sorted(set(values))
    spans: list[tuple[int, int, int]] = []  # first, last, step
    i = 0
    while i < len(ordered):
        step = ordered[i + 1] - ordered[i] if i + 1 < len(ordered) else 1
        end = i + 1
        while end < len(ordered) and ordered[end] - ordered[end - 1] == step:
            end += 1
        if step == 1 or end - i >= _STEPPED_RUN:
            spans.append((ordered[i], ordered[end - 1], step))
            i = end
        else:
            spans.append((ordered[i], ordered[i], 1))
            i += 1
    shown = []
    for first, last, step in spans[:runs]:
        low, high = str(first).zfill(width), str(last).zfill(width)
        if first == last:
            shown.append(low)
        elif step > 1:
            shown.append(f"{low}..{high}..{step}")
        else:
            shown.append(f"{low},{high}" if last == first + 1 else f"{low}..{high}")
    return ",".join(shown) + (f",...({len(ordered)} in all)" if len(spans) > runs else "")
