"""Developer sessions: `nox -s lint`, `nox -s typecheck`, `nox -s docs`, `nox -s tests`,
`nox -s package`; and, run by hand, `nox -s tests-latest` and `nox -s lock`.

Each session installs what it needs into its own virtualenv, at the versions of
`constraints.txt`: the lock the checks were last green with. In an environment that
already has `.[dev]` installed with that lock (what `.ci/run` and the README's test
command set up), run them all there without installing: `python -m nox --no-venv
--no-install`.

`nox -s tests-latest` runs the suite against the newest releases instead, and names the
packages that moved past the lock, so drift is seen before it breaks the default.
`nox -s lock` writes the lock again from the newest releases; commit it once the checks
pass with it.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import nox
from packaging.markers import Marker

nox.options.sessions = ["lint", "typecheck", "docs", "package", "tests"]
nox.options.reuse_existing_virtualenvs = True

LOCK = Path(__file__).parent / "constraints.txt"


def _python(session: nox.Session) -> str:
    """The session's interpreter; with `--no-venv`, the one running nox."""
    return sys.executable if session.venv_backend == "none" else "python"


def _install(session: nox.Session, *args: str) -> None:
    """`pip install ARGS` held to the lock."""
    session.install("-c", str(LOCK), *args)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: the lint rules and the formatting, over the whole repository."""
    _install(session, "ruff")
    session.run(_python(session), "-m", "ruff", "check", ".")
    session.run(_python(session), "-m", "ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy, strict, over the package and the tests (pyproject.toml's [tool.mypy])."""
    _install(session, "-e", ".[test]", "mypy")
    session.run(_python(session), "-m", "mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site into site/, warnings as errors."""
    _install(session, "-e", ".[docs]")
    session.run(_python(session), "-m", "mkdocs", "build", "--strict")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite; arguments after `--` go to pytest."""
    _install(session, "-e", ".[test]")
    session.run(_python(session), "-m", "pytest", *session.posargs)


@nox.session
def package(session: nox.Session) -> None:
    """Build the sdist and the wheel, check them (`twine check`), install the wheel,
    not editable, into a fresh virtualenv, and run `lazyckpt --version`, `lazyckpt
    demo` and `tests/wheel_smoke.py` (every verb once) with it, from outside the
    repository: what a user installs, tried as they would."""
    _install(session, "build", "twine")
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
    pip = str(venv / "bin" / "pip")
    session.run(pip, "install", "-q", "-c", str(LOCK), str(wheel), external=True)
    smoke = Path("tests", "wheel_smoke.py").resolve()
    with session.chdir(tmp):
        session.run(str(venv / "bin" / "lazyckpt"), "--version", external=True)
        session.run(str(venv / "bin" / "lazyckpt"), "demo", external=True, silent=True)
        session.run(str(venv / "bin" / "python"), str(smoke), external=True)


@nox.session(name="tests-latest", venv_backend="venv")
def tests_latest(session: nox.Session) -> None:
    """The test suite against the newest release of every dependency, unlocked: first the
    packages whose installed version differs from the lock, then pytest's report of
    what broke (`-rfE`). Not in the default sessions; arguments go to pytest."""
    session.install("--upgrade", "--upgrade-strategy", "eager", "-e", ".[test]")
    frozen = session.run("python", "-m", "pip", "freeze", "--exclude-editable", silent=True)
    installed = _pins(str(frozen))
    locked = _pins(LOCK.read_text())
    moved = sorted(
        name for name in installed.keys() & locked.keys() if installed[name] != locked[name]
    )
    session.log(
        f"{len(moved)} of {len(installed)} installed packages moved past the lock"
        + "".join(f"\n  {name} {locked[name]} -> {installed[name]}" for name in moved)
    )
    session.run("python", "-m", "pytest", "-rfE", *session.posargs)


@nox.session(venv_backend="venv")
def lock(session: nox.Session) -> None:
    """Write constraints.txt again: every package `.[dev]` brings, at its newest release
    for Python 3.11 and later on every platform, resolved by uv."""
    session.install("uv")
    session.run(
        "uv", "pip", "compile", "pyproject.toml", "--extra", "dev", "--universal",
        "--python-version", "3.11", "--no-header", "--quiet", "--output-file", str(LOCK),
    )  # fmt: skip


def _pins(text: str) -> dict[str, str]:
    """`name==version` lines that apply to this interpreter, as {normalised name:
    version}; a lock has one line a package for each range of its markers."""
    pins = {}
    for line in text.splitlines():
        requirement, _, marker = line.partition(";")
        name, equals, version = requirement.strip().partition("==")
        applies = not marker.strip() or Marker(marker.strip()).evaluate()
        if equals and applies and not name.startswith(("#", "-")):
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins
