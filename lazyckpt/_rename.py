"""`rename`: the same leaves under new key paths, by regular-expression rules."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from lazyckpt._array.nesting import PathClash, nested
from lazyckpt._array.tree import leaves, near_paths
from lazyckpt._errors import RenameError

# What a pattern's regular-expression syntax adds to the names it stands for: dropped
# to guess, for a message, which paths a rule that matched nothing meant.
_SYNTAX = re.compile(r"\\[dDwWsSbB][+*?]?|\.[*+?]|\[[^\]]*\][+*?]?|[\^$()?+*|{}]")


def rename(
    tree: object,
    rules: Sequence[tuple[str, str]],
    *,
    dotted: bool = False,
    missing_ok: bool = False,
) -> dict[str, Any]:
    """The leaves of `tree` under new key paths, reading nothing.

    Each leaf's key path, as `lazyckpt.leaves` writes it (`layers/0/attn/q`), goes
    through every rule in turn, as `re.sub(pattern, replacement, path)`; a `/` in the
    result nests, and a `.` is just a character (of a key, or regex's any-character).
    With `dotted=True` every rule sees every path in the Hugging Face spelling, with
    `.` between its keys (`model.layers.0.mlp.up_proj.weight`), and the dots (and any
    `/`) of what the rules give nest, as `select` reads such names; a key with a dot
    of its own (Orbax allows them) cannot be spelled so, and is refused. The result is
    a tree of plain dicts; the leaves themselves (and a LazyArray's record of where it
    is stored) are unchanged.

    Args:
        tree: Any pytree, such as a lazy tree from `lazyckpt.open`.
        rules: `(pattern, replacement)` pairs, applied in order to every path (each
            sees what the rules before it gave); replacements may use groups (`\\1`,
            `\\g<name>`).
        dotted: Spell every path, for every rule, with `.` between its keys, and nest
            the result at its dots.
        missing_ok: Let a rule that matches no leaf pass (a list of rules kept for
            several models, say); by default it is refused, as a typo would be.

    Raises:
        RenameError: A pattern does not compile, a rule matches no leaf (the message
            names it and the paths it may have meant), a path becomes empty, two
            leaves would get the same key path (or one would sit inside the other;
            the message names both sources), or, with `dotted=True`, a key holds a `.`.

    >>> tree = {"layers": {"0": {"q": 1, "k": 2}}, "embed": 3}
    >>> rename(tree, [(r"^layers/(\\d+)/", r"model.layers.\\1.self_attn."), ("embed", "wte")])
    {'wte': 3, 'model.layers.0.self_attn.k': 2, 'model.layers.0.self_attn.q': 1}
    >>> hf = {"model": {"layers": {"0": {"mlp": 1}}}}
    >>> rename(hf, [(r"layers\\.(\\d+)\\.mlp", r"h.\\1.ffn")], dotted=True)
    {'model': {'h': {'0': {'ffn': 1}}}}
    """
    compiled = []
    for pattern, replacement in rules:
        try:
            compiled.append((re.compile(pattern), replacement))
        except re.error as error:
            raise RenameError(
                f"rename: {pattern!r} is not a regular expression ({error})"
            ) from None
    found = list(leaves(tree))
    paths = [_spelled(path) if dotted else path for path, _ in found]
    for number, (regex, replacement) in enumerate(compiled):
        seen = paths
        paths, matched = [], 0
        for (source, _), path in zip(found, seen, strict=True):
            try:
                new, count = regex.subn(replacement, path)
            except (re.error, IndexError) as error:
                raise RenameError(
                    f"rename: {replacement!r} cannot replace {regex.pattern!r} in "
                    f"{source!r} ({error})"
                ) from None
            paths.append(new)
            matched += count > 0
        if not matched and not missing_ok:
            raise RenameError(
                f"rename: the rule ({regex.pattern!r}, {replacement!r}) matches no key path"
                f"{' after the rules before it' if number else ''}; "
                f"{_near(seen, regex.pattern)}; fix the pattern, or pass missing_ok=True "
                "to let rules that match nothing pass"
            )
    moved = []
    for (path, leaf), new in zip(found, paths, strict=True):
        keys = tuple((new.replace(".", "/") if dotted else new).split("/"))
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


def _spelled(path: str) -> str:
    """`path` with `.` between its keys, for `dotted=True`; a key with a dot of its own
    would read as two keys there, and its new path could not say which it was."""
    for key in path.split("/"):
        if "." in key:
            raise RenameError(
                f"rename: the key {key!r} (in {path!r}) holds a '.', so dotted=True cannot "
                "spell its path with '.' between keys; use dotted=False and write the "
                "rules for '/' paths"
            )
    return path.replace("/", ".")


def _near(paths: list[str], pattern: str) -> str:
    """The paths nearest what `pattern` names, its regular-expression syntax aside."""
    name = _SYNTAX.sub("", pattern).replace("\\", "")
    return near_paths(dict.fromkeys(paths, 0), [name])
