"""The docs site builds with warnings as errors (what `nox -s docs` runs), and the
recipes in it run and print what they show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for page in ("index.html", "getting-started/index.html", "api/index.html",
                 "use-cases/small-hosts/index.html", "tutorial.ipynb"):  # fmt: skip
        assert (tmp_path / page).exists(), page
    reference = (tmp_path / "api" / "index.html").read_text()
    assert "lazyckpt.save" in reference and "chunk_bytes" in reference


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_END = "----- end of block -----"


@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    [
        "use-cases/flax.md",
        "use-cases/surgery.md",
        "use-cases/dequantize.md",
        "use-cases/gather.md",
    ],
)
def test_recipe_runs_and_prints_what_it_shows(page: str, tmp_path: Path) -> None:
    """Every python block of the page runs, in order, in one fresh process; a text
    block right after a python block is what that block prints."""
    pytest.importorskip("flax")
    text = (ROOT / "docs" / page).read_text()
    blocks = [(m[1], m[2], m.start(), m.end()) for m in _FENCE.finditer(text)]
    code = [body for lang, body, _, _ in blocks if lang == "python"]
    script = "".join(f"{body}\nprint({_END!r}, flush=True)\n" for body in code)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.split(_END + "\n")
    shown = 0
    python_index = -1
    for (lang, body, start, _), previous in zip(blocks, [None, *blocks[:-1]], strict=True):
        if lang == "python":
            python_index += 1
        elif lang == "text" and previous is not None and previous[0] == "python":
            between = text[previous[3] : start]
            assert not between.strip(), f"prose between a block and its output in {page}"
            want = [line.rstrip() for line in body.rstrip("\n").splitlines()]
            got = [line.rstrip() for line in printed[python_index].rstrip("\n").splitlines()]
            assert got == want, f"{page}: block {python_index} prints\n" + "\n".join(got)
            shown += 1
    assert shown >= 2
