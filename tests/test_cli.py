"""The command line: what it imports before it has work, dotted names, convert --dry-run."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lazyckpt
from tests.helpers import orbax_save, refuse_data_reads

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


def test_version_answers_without_jax() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"lazyckpt {lazyckpt.__version__}" and lines[-1] == "[]"


def test_import_lazyckpt_imports_no_jax_until_a_verb_that_needs_it() -> None:
    script = (
        "import sys, lazyckpt\n"
        "print('jax' in sys.modules, lazyckpt.LazyckptError.__name__)\n"
        "lazyckpt.open, lazyckpt.load, lazyckpt.select\n"
        "print('jax' in sys.modules)\n"
        "lazyckpt.device_put\n"
        "print('jax' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.stdout.split() == ["False", "LazyckptError", "False", "True"], result.stderr


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


LAYERS = 3


@pytest.fixture
def scanned(tmp_path: Path) -> Path:
    """A scanned model written by Orbax: its blocks stacked along a leading layer axis."""
    rng = np.random.default_rng(0)
    params = {
        "blocks": {
            "up": {"kernel": rng.standard_normal((LAYERS, 8, 16), dtype=np.float32)},
            "norm": {"scale": rng.standard_normal((LAYERS, 16), dtype=np.float32)},
        },
        "embed": rng.standard_normal((32, 8), dtype=np.float32),
    }
    return orbax_save(tmp_path / "scanned", {"params": params})


def _hugging_face(tree: Any) -> Any:
    """A transform as a conversion script writes one: transposes, per-layer names."""
    layers = tree["blocks"].items()
    return {
        "layers": {i: {"up": b["up"]["kernel"].T, "norm": b["norm"]["scale"]} for i, b in layers},
        "embed": tree["embed"],
    }


_RULES = [(r"^layers/(\d+)/up$", r"model/layers/\1/mlp/up_proj/weight"), (r"^embed$", "lm_head")]


def _dry_run_then_convert(
    source: Path,
    destination: Path,
    monkeypatch: pytest.MonkeyPatch,
    count_bytes: Any,
    **options: Any,
) -> tuple[lazyckpt.ConversionPlan, str]:
    options = {"select": "params", "rename": _RULES, "progress": False, **options}
    with count_bytes() as opening:
        lazyckpt.open(source)
    with monkeypatch.context() as patched, count_bytes() as planning:
        refuse_data_reads(patched)
        plan = lazyckpt.convert(source, destination, dry_run=True, **options)
    assert planning[0] == opening[0]  # the metadata open reads, and no chunk
    assert not destination.exists()
    return plan, lazyckpt.convert(source, destination, **options)


def test_dry_run_to_safetensors_plans_the_files_convert_writes(
    scanned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count_bytes: Any
) -> None:
    def transform(tree: Any) -> Any:
        return _hugging_face(lazyckpt.unstack_layers(tree["params"], at="blocks"))

    plan, out = _dry_run_then_convert(
        scanned, tmp_path / "hf", monkeypatch, count_bytes,
        to="safetensors", transform=transform, dtype="bfloat16", max_shard_size=700,
    )  # fmt: skip
    index = json.loads((Path(out) / "model.safetensors.index.json").read_text())
    assert {a.name: a.file for a in plan.arrays} == index["weight_map"]
    assert [(f, (Path(out) / f).stat().st_size) for f, _ in plan.files] == list(plan.files)
    written = lazyckpt.open(out, flat=True)
    assert {a.name: (a.shape, a.dtype) for a in plan.arrays} == {
        name: (array.shape, str(array.dtype)) for name, array in written.items()
    }
    assert "model.layers.2.mlp.up_proj.weight" in str(plan)
    assert (plan.arrays[0].name, plan.arrays[0].shape) == ("layers.0.norm", (16,))  # tree order
    assert plan.nbytes == sum(a.nbytes for a in plan.arrays) == 3 * (16 + 128) * 2 + 512


def test_dry_run_to_orbax_plans_the_chunks_convert_writes(
    scanned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count_bytes: Any
) -> None:
    plan, out = _dry_run_then_convert(
        scanned, tmp_path / "orbax", monkeypatch, count_bytes,
        transform=lambda tree: _hugging_face(lazyckpt.unstack_layers(tree["params"], "blocks")),
        chunk_bytes=256,
    )  # fmt: skip
    written = dict(lazyckpt.leaves(lazyckpt.open(out)))
    assert {a.path: (a.shape, a.dtype, a.chunks) for a in plan.arrays} == {
        path: (array.shape, str(array.dtype), array.chunks) for path, array in written.items()
    }
    assert plan.format == "orbax" and plan.files == ()
    again = lazyckpt.convert(scanned, out, dry_run=True)  # reported, not refused
    assert again.exists and "already exists: convert would refuse it" in str(again)
    assert lazyckpt.convert(scanned, out, dry_run=True, overwrite=True).arrays


def test_cli_convert_dry_run_prints_the_plan_and_writes_nothing(
    scanned: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lazyckpt._cli.main import main

    script = tmp_path / "to_hf.py"
    script.write_text(
        "def convert(tree):\n"
        "    layers = tree['params']['blocks'].items()\n"
        "    return {'layers': {i: {'up': b['up']['kernel'].T} for i, b in layers}}\n"
    )
    out = tmp_path / "model.safetensors"
    command = ["convert", str(scanned), str(out), "--select", "params/blocks/up", "--dry-run"]
    command += ["--unstack", "params/blocks", "--script", str(script)]
    command += ["--rename", *_RULES[0]]
    refuse_data_reads(monkeypatch)
    assert main(command) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"would write {out} (safetensors): 3 arrays, 1.5 KiB"
    assert lines[1].split() == ["name", "dtype", "shape", "size", "file"]
    assert lines[2].split() == [
        "model.layers.0.mlp.up_proj.weight", "float32", "[16,8]", "512", "B", "model.safetensors",
    ]  # fmt: skip
    assert not out.exists()
