"""The counts the explore verbs take (`stats(bins=)`, `summary(depth=)`, `plot(max_panels=)`,
`Diff.plot(top=)`), checked before any work: a bad one is an error that names the verb,
the argument and what it takes, not NumPy's or matplotlib's complaint from deep inside."""

from __future__ import annotations

import numbers

from lazyckpt._errors import ArgumentError


def count(where: str, name: str, value: object, fix: str) -> int:
    """`value` as an int of 1 or more; else an `ArgumentError` naming `where` (the
    verb), `name` and `value`, and `fix` (what to pass instead).

    >>> count("stats", "bins", 8, "")
    8
    >>> count("stats", "bins", 2.5, "pass bins=64")
    Traceback (most recent call last):
    ...
    lazyckpt.ArgumentError: stats: bins=2.5, but bins is a whole number of 1 or more; pass bins=64
    """
    # (bool is an int to Python, but True bins is a slip, not a count)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1:
        return int(value)
    raise ArgumentError(
        f"{where}: {name}={value!r}, but {name} is a whole number of 1 or more; {fix}"
    )


def choice(where: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`; else an `ArgumentError` that lists them."""
    if not isinstance(value, str) or value not in choices:
        listed = " or ".join(repr(c) for c in choices)
        raise ArgumentError(f"{where}: {name}={value!r}; pass {listed}")
    return value
