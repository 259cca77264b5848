"""The docs site builds with warnings as errors (what `nox -s docs` runs)."""

from __future__ import annotations

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
    for page in ("index.html", "getting-started/index.html", "reference/index.html",
                 "use-cases/small-hosts/index.html", "tutorial.ipynb"):  # fmt: skip
        assert (tmp_path / page).exists(), page
    reference = (tmp_path / "reference" / "index.html").read_text()
    assert "lazyckpt.save" in reference and "chunk_bytes" in reference
