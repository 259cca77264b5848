"""The command line: what it imports before it has work, dotted names, convert --dry-run."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
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


@pytest.fixture
def hf_model(tmp_path: Path) -> Path:
    """A transformers-style model.safetensors, written by the `safetensors` library."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray[Any, Any]] = {
        f"model.layers.{i}.mlp.up_proj.weight": np.full((4, 2), i, np.float32) for i in range(3)
    }
    tensors["model.norm.weight"] = np.arange(4, dtype=np.float32)
    tensors["lm_head.weight"] = np.ones((2, 4), np.float32)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _paths(tree: object) -> list[str]:
    return [path for path, _ in lazyckpt.leaves(tree)]


def test_select_takes_hugging_face_names_and_globs(hf_model: Path) -> None:
    tree = lazyckpt.open(hf_model)
    up = "model/layers/{}/mlp/up_proj/weight"
    assert _paths(lazyckpt.select(tree, "model.layers.1.mlp.up_proj.weight")) == [up.format(1)]
    globbed = lazyckpt.select(tree, "model.layers.*.mlp.up_proj.weight")
    assert _paths(globbed) == [up.format(i) for i in range(3)]
    assert _paths(lazyckpt.select(tree, "model.**.weight")) == _paths(
        lazyckpt.select(tree, "model/**/weight")
    )
    both = lazyckpt.select(tree, ["lm_head.weight", "model/norm"])  # each spelling its own way
    assert _paths(both) == ["lm_head/weight", "model/norm/weight"]
    assert (
        lazyckpt.load(lazyckpt.select(tree, "model.layers.2"))["model"]["layers"]["2"]["mlp"][
            "up_proj"
        ]["weight"].tolist()
        == [[2.0, 2.0]] * 4
    )


def test_a_key_with_dots_of_its_own_keeps_its_meaning() -> None:
    tree = {"step.count": 1, "step": {"count": 2}, "opt": {"mu.0": 3}}
    assert lazyckpt.select(tree, "step.count") == {"step.count": 1}  # as written first
    assert lazyckpt.select(tree, "step/count") == {"step": {"count": 2}}
    assert lazyckpt.select(tree, "opt/mu.0") == {"opt": {"mu.0": 3}}  # '/': never re-read


def test_an_unknown_dotted_name_suggests_near_names(hf_model: Path) -> None:
    tree = lazyckpt.open(hf_model)
    with pytest.raises(
        lazyckpt.NoMatchError,
        match=r"^'model.layers.1.mlp.up_prj.weight' matched no leaf of the tree; the nearest "
        r"paths are \['model/layers/1/mlp/up_proj/weight'",
    ):
        lazyckpt.select(tree, "model.layers.1.mlp.up_prj.weight")


def test_cli_show_and_stats_take_hugging_face_names(
    hf_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lazyckpt._cli.main import main

    assert main(["show", str(hf_model), "model.layers.2.mlp.up_proj.weight[0]"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("LazyArray('model/layers/2/mlp/up_proj/weight', shape=(2,)")
    assert shown[1] == "[2. 2.]"
    assert main(["stats", str(hf_model), "--select", "model.layers.*.mlp.up_proj.weight"]) == 0
    out = capsys.readouterr().out
    assert "model/layers/1/mlp/up_proj/weight" in out and "lm_head" not in out
    assert main(["show", str(hf_model), "model.norm.wieght"]) == 1
    error = capsys.readouterr().err
    assert "no key 'model.norm.wieght'" in error and "'model/norm/weight'" in error
