"""The command line: what it imports before it has work, dotted names, convert --dry-run."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lazyckpt

ROOT = Path(__file__).resolve().parent.parent

# Runs the entry point the console script runs, then says which heavy modules it imported.
_PROBE = """
import sys
from lazyckpt._cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted(m for m in ("jax", "tensorstore", "numpy") if m in sys.modules))
"""


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        *((command, "--help") for command in ("inspect", "show", "stats", "verify", "diff")),
        ("convert", "--help"),
        ("demo", "--help"),
        ("inspect",),  # a missing argument
        ("stats", "ckpt", "--memory-budget", "lots"),  # a bad size
        ("frobnicate",),
    ],
)
def test_help_and_argument_errors_import_no_jax(args: tuple[str, ...]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]", result.stdout + result.stderr
    assert "usage: lazyckpt" in result.stdout + result.stderr


def test_import_lazyckpt_imports_no_jax_until_a_verb_is_used() -> None:
    script = (
        "import sys, lazyckpt\n"
        "print('jax' in sys.modules, lazyckpt.LazyckptError.__name__)\n"
        "lazyckpt.open\n"
        "print('jax' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.stdout.split() == ["False", "LazyckptError", "True"], result.stderr


def test_every_public_name_resolves_and_the_lazy_table_matches_the_imports() -> None:
    for name in lazyckpt.__all__:
        assert getattr(lazyckpt, name) is not None
    assert set(dir(lazyckpt)) >= set(lazyckpt.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lazyckpt.nope  # type: ignore[attr-defined]  # noqa: B018
    init = ast.parse((ROOT / "lazyckpt" / "__init__.py").read_text())
    checked = next(n for n in init.body if isinstance(n, ast.If))  # if TYPE_CHECKING:
    imported = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in checked.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == lazyckpt._LAZY
