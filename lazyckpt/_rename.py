"""`rename`: the same leaves under new key paths, by regular-expression rules."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from lazyckpt._array.nesting import PathClash, nested
from lazyckpt._array.tree import leaves
from lazyckpt._errors import RenameError


def rename(tree: object, rules: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The leaves of `tree` under new key paths, reading nothing.

    Each leaf's key path, as `lazyckpt.leaves` writes it (`layers/0/attn/q`), goes
    through every rule in turn, as `re.sub(pattern, replacement, path)`; a `/` in the
    result nests. The result is a tree of plain dicts; the leaves themselves (and a
    LazyArray's record of where it is stored) are unchanged.

    Args:
        tree: Any pytree, such as a lazy tree from `lazyckpt.open`.
        rules: `(pattern, replacement)` pairs, applied in order to every path;
            replacements may use groups (`\\1`, `\\g<name>`).

    Raises:
        RenameError: A pattern does not compile, a path becomes empty, or two leaves
            would get the same key path (or one would sit inside the other); the
            message names both sources.

    >>> tree = {"layers": {"0": {"q": 1, "k": 2}}, "embed": 3}
    >>> rename(tree, [(r"^layers/(\\d+)/", r"model.layers.\\1.self_attn."), ("embed", "wte")])
    {'wte': 3, 'model.layers.0.self_attn.k': 2, 'model.layers.0.self_attn.q': 1}
    """
    compiled = []
    for pattern, replacement in rules:
        try:
            compiled.append((re.compile(pattern), replacement))
        except re.error as error:
            raise RenameError(
                f"rename: {pattern!r} is not a regular expression ({error})"
            ) from None
    moved = []
    for path, leaf in leaves(tree):
        new = path
        for regex, replacement in compiled:
            try:
                new = regex.sub(replacement, new)
            except (re.error, IndexError) as error:
                raise RenameError(
                    f"rename: {replacement!r} cannot replace {regex.pattern!r} in {path!r} ({error})"
                ) from None
        keys = tuple(new.split("/"))
        if not new or "" in keys:
            raise RenameError(
                f"rename: {path!r} becomes {new!r}, which is not a key path (empty keys); "
                "fix the rules"
            )
        moved.append((keys, leaf, path))
    try:
        return nested(moved)
    except PathClash as clash:
        first = "/".join(clash.at)
        second = "/".join(next(keys for keys, _, path in moved if path == clash.second))
        where = (
            f"both to {first!r}"
            if first == second
            else f"to {first!r} and {second!r}, one inside the other"
        )
        raise RenameError(
            f"rename: {clash.first!r} and {clash.second!r} would go {where}; change the rules"
        ) from None
