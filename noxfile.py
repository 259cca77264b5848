"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s typecheck`, `nox -s docs`."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".", "mypy")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site into site/, warnings as errors."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")
