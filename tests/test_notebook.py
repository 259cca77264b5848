"""The tutorial notebook runs from top to bottom in a real Jupyter kernel."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent


def _text(output: dict[str, Any]) -> str:
    if output.get("output_type") == "stream":
        return str(output["text"])
    data = output.get("data", {})
    return str(data.get("text/html", "")) + str(data.get("text/plain", ""))


def test_tutorial_notebook_runs(tutorial: Any) -> None:
    notebook = tutorial
    outputs = [
        _text(o) for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs
    ]
    joined = "\n".join(outputs)
    assert not any(o.get("output_type") == "error" for c in notebook.cells
                   if c.cell_type == "code" for o in c.outputs)  # fmt: skip
    assert "[100, 200]" in joined  # the steps
    assert 'data-path="params/layers/{0..2}/kernel"' in joined  # the summary's folded HTML
    assert "float32[4096,256]" in joined
    assert re.search(r"KiB, no network requests, .*\n\d\.\d% of the checkpoint's arrays", joined)
    assert "~ params/layers/0/kernel  value: float32[256,512] -> float32[256,512]" in joined
    assert "P(None, 'model')" in joined  # the placed kernel's sharding
    assert "bfloat16[4096,256]" in joined  # the converted copy
    assert "LazyArray('params/layers/0/kernel', shape=(256, 512)" in joined  # treescope
    figures = [
        o for c in notebook.cells if c.cell_type == "code" for o in c.outputs
        if "image/png" in o.get("data", {})
    ]  # fmt: skip
    assert len(figures) == 3  # the layers, a histogram, the changes (each shown once)


def test_progress_is_a_tqdm_widget_in_a_notebook(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    code = f"""
import os
os.environ.pop("CI", None)  # (a CI run's environment: this kernel stands for a person's)
import numpy as np
import lazyckpt
from lazyckpt._engine import progress
progress.AUTO_MIN_BYTES = 0  # (a small read, drawn as a large one would be)
path = lazyckpt.save({str(tmp_path / "ckpt")!r}, {{"w": np.ones((64, 64), np.float32)}})
loaded = lazyckpt.load(lazyckpt.open(path))
float(loaded["w"].sum())
"""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    outputs = notebook.cells[0].outputs
    widgets = [
        str(o["data"].get("text/plain", ""))
        for o in outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert any(w.startswith("lazyckpt save") for w in widgets), outputs
    assert any(w.startswith("lazyckpt load") for w in widgets), outputs
    assert "4096.0" in _text(outputs[-1])
