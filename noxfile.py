"""Developer sessions: `nox -s lint`, `nox -s typecheck`, `nox -s docs`, `nox -s tests`,
`nox -s package`.

Each session installs what it needs into its own virtualenv. In an environment that
already has `.[dev]` (what `.ci/run` and the README's test command set up), run them
all there without installing: `python -m nox --no-venv --no-install`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "docs", "package", "tests"]
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


@nox.session
def package(session: nox.Session) -> None:
    """Build the sdist and the wheel, check them (`twine check`), install the wheel,
    not editable, into a fresh virtualenv, and run `lazyckpt --version`, `lazyckpt
    demo` and `tests/wheel_smoke.py` (every verb once) with it, from outside the
    repository: what a user installs, tried as they would."""
    session.install("build", "twine")
    python = _python(session)
    tmp = Path(session.create_tmp()).resolve()
    dist = tmp / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run(python, "-m", "build", "--outdir", str(dist), silent=True)
    session.run(python, "-m", "twine", "check", "--strict", *map(str, sorted(dist.iterdir())))
    venv = tmp / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    session.run(python, "-m", "venv", str(venv))
    wheel = next(dist.glob("*.whl"))
    session.run(str(venv / "bin" / "pip"), "install", "-q", str(wheel), external=True)
    smoke = Path("tests", "wheel_smoke.py").resolve()
    with session.chdir(tmp):
        session.run(str(venv / "bin" / "lazyckpt"), "--version", external=True)
        session.run(str(venv / "bin" / "lazyckpt"), "demo", external=True, silent=True)
        session.run(str(venv / "bin" / "python"), str(smoke), external=True)
