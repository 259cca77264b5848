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
    tree: object, rules: Sequence[tuple[str, str]], *, missing_ok: bool = False
) -> dict[str, Any]:
    """The leaves of `tree` under new key paths, reading nothing.

    Each leaf's key path, as `lazyckpt.leaves` writes it (`layers/0/attn/q`), goes
    through every rule in turn, as `re.sub(pattern, replacement, path)`; a `/` in the
    result nests. A rule spelled the Hugging Face way, with a `.` in its pattern and
    no `/` in it or its replacement (`(r"model\\.layers\\.(\\d+)\\.mlp", r"h.\\1.ffn")`),
    sees the path with `.` between its keys (`model.layers.0.mlp.up_proj.weight`), and
    the dots of what it gives nest again, as `select` reads such names; a leaf with a
    dot in a key of its own (Orbax allows them) keeps its `/` spelling, so its keys keep
    their names. The result is a tree of plain dicts; the leaves themselves (and a
    LazyArray's record of where it is stored) are unchanged.

    Args:
        tree: Any pytree, such as a lazy tree from `lazyckpt.open`.
        rules: `(pattern, replacement)` pairs, applied in order to every path (each
            sees what the rules before it gave); replacements may use groups (`\\1`,
            `\\g<name>`).
        missing_ok: Let a rule that matches no leaf pass (a list of rules kept for
            several models, say); by default it is refused, as a typo would be.

    Raises:
        RenameError: A pattern does not compile, a rule matches no leaf (the message
            names it and the paths it may have meant), a path becomes empty, or two
            leaves would get the same key path (or one would sit inside the other);
            the message names both sources.

    >>> tree = {"layers": {"0": {"q": 1, "k": 2}}, "embed": 3}
    >>> rename(tree, [(r"^layers/(\\d+)/", r"model.layers.\\1.self_attn."), ("embed", "wte")])
    {'wte': 3, 'model.layers.0.self_attn.k': 2, 'model.layers.0.self_attn.q': 1}
    >>> rename({"model": {"layers": {"0": {"mlp": 1}}}}, [(r"layers\\.(\\d+)\\.mlp", r"h.\\1.ffn")])
    {'model': {'h': {'0': {'ffn': 1}}}}
    """
    compiled = []
    for pattern, replacement in rules:
        try:
            regex = re.compile(pattern)
        except re.error as error:
            raise RenameError(
                f"rename: {pattern!r} is not a regular expression ({error})"
            ) from None
        dotted = "." in pattern and "/" not in pattern and "/" not in replacement
        compiled.append((regex, replacement, dotted))
    found = list(leaves(tree))
    paths = [path for path, _ in found]
    for number, (regex, replacement, dotted) in enumerate(compiled):
        seen = paths
        paths, matched = [], 0
        for source, path in zip(found, seen, strict=True):
            new, count = _renamed(regex, replacement, path, dotted, source[0])
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


def _renamed(
    regex: re.Pattern[str], replacement: str, path: str, dotted: bool, source: str
) -> tuple[str, int]:
    """`path` through one rule, and how many times it matched; a Hugging Face spelled
    rule (`dotted`) sees the path with dots between its keys, where no key has one."""
    spelled = path.replace("/", ".") if dotted and "." not in path else path
    try:
        new, count = regex.subn(replacement, spelled)
    except (re.error, IndexError) as error:
        raise RenameError(
            f"rename: {replacement!r} cannot replace {regex.pattern!r} in {source!r} ({error})"
        ) from None
    if not count:
        return path, 0
    return (new.replace(".", "/") if spelled is not path else new), count


def _near(paths: list[str], pattern: str) -> str:
    """The paths nearest what `pattern` names, its regular-expression syntax aside."""
    name = _SYNTAX.sub("", pattern).replace("\\", "")
    return near_paths(dict.fromkeys(paths, 0), [name])
