"""The README, CI script and docs stay in step with the code."""

from __future__ import annotations

import re
import tomllib
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


def test_the_checks_install_at_the_locked_versions() -> None:
    """Both set-up commands and every nox session install with `-c constraints.txt`, and
    the lock pins every package the `dev` extra names (directly or through another
    extra), so none is left to the newest release."""
    for command in _setup_commands():
        assert "pip install -q -c constraints.txt -e " in command
    noxfile = (ROOT / "noxfile.py").read_text()
    assert noxfile.count("session.install(") == noxfile.count('session.install("-c"') + 2
    locked = set()
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, equals, _ = line.partition(";")[0].partition("==")
        if equals:
            locked.add(_normalised(name))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted, seen, todo = set(), set(), ["dev"]
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for requirement in extras[extra]:
            name = _normalised(re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0])
            if name == "lazyckpt":
                todo += [e for e in re.findall(r"\w+", requirement.split("[")[1]) if e not in seen]
            else:
                wanted.add(name)
    wanted |= {
        _normalised(re.split(r"[<>=!~; ]", r, maxsplit=1)[0]) for r in project["dependencies"]
    }
    assert wanted - locked == set()


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()
