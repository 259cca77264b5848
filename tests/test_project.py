"""The README, CI script and docs stay in step with the code."""

from __future__ import annotations

import re
from pathlib import Path

import lazyckpt

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block is not None and readme.index(block.group(0)) < readme.index("\n\n", 12)
    return block.group(1).strip().splitlines()


def test_readme_opens_with_two_setup_commands_and_ci_runs_the_second() -> None:
    demo, tests = _setup_commands()
    assert demo.endswith("lazyckpt demo")
    assert tests.endswith("python -m nox --no-venv --no-install")
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
    noxfile = (ROOT / "noxfile.py").read_text()
    sessions = '["lint", "typecheck", "docs", "package", "tests"]'
    assert f"nox.options.sessions = {sessions}" in noxfile


def test_every_public_name_is_documented() -> None:
    """docs/api.md renders each name of `lazyckpt.__all__` through mkdocstrings
    (`::: lazyckpt.NAME`), and nothing else; `__version__` has its own section."""
    api = (ROOT / "docs" / "api.md").read_text()
    assert lazyckpt.__all__ == sorted(lazyckpt.__all__)
    documented = re.findall(r"^::: lazyckpt\.(\w+)$", api, flags=re.MULTILINE)
    assert len(documented) == len(set(documented))
    assert sorted(documented) == sorted(n for n in lazyckpt.__all__ if n != "__version__")
    assert "`lazyckpt.__version__`" in api


def test_the_changelog_has_the_version_being_released() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    heading = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    assert heading is not None and heading.group(1) == lazyckpt.__version__
