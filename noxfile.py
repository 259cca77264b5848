"""Developer sessions: `nox -s lint`, `nox -s typecheck`, `nox -s docs`, `nox -s tests`.

Each session installs what it needs into its own virtualenv. In an environment that
already has `.[dev]` (what `.ci/run` and the README's test command set up), run them
all there without installing: `python -m nox --no-venv --no-install`.
"""

from __future__ import annotations

import sys

import nox

nox.options.sessions = ["lint", "typecheck", "docs", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _python(session: nox.Session) -> str:
    """The session's interpreter; with `--no-venv`, the one running nox."""
    return sys.executable if session.venv_backend == "none" else "python"


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: the lint rules and the formatting, over the whole repository."""
    session.install("ruff")
    session.run(_python(session), "-m", "ruff", "check", ".")
    session.run(_python(session), "-m", "ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy, strict, over the package and the tests (pyproject.toml's [tool.mypy])."""
    session.install("-e", ".[test]", "mypy")
    session.run(_python(session), "-m", "mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site into site/, warnings as errors."""
    session.install("-e", ".[docs]")
    session.run(_python(session), "-m", "mkdocs", "build", "--strict")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite; arguments after `--` go to pytest."""
    session.install("-e", ".[test]")
    session.run(_python(session), "-m", "pytest", *session.posargs)
