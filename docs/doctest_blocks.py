"""A griffe extension for the docs site: show docstrings' doctest examples as code.

The docstrings hold plain `>>>` examples (the test suite runs them); Markdown would
read those lines as nested quotes and `x["w"]` as a link. This wraps each run of
example lines, and the output under them, in a fenced `pycon` block.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_examples(text: str) -> str:
    out: list[str] = []
    in_example = False
    for line in text.splitlines():
        starts = line.lstrip().startswith((">>>", "..."))
        if starts and not in_example:
            out.append("```pycon")
            in_example = True
        elif in_example and not line.strip():
            out.append("```")
            in_example = False
        out.append(line)
    if in_example:
        out.append("```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_examples(obj.docstring.value)
