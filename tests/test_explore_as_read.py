"""The explore verbs as a person first reads them: an Optax train state saved by Orbax
shows its params, a tree of one array shows it, `stats --json` says which number is
bytes, and a diff's figure has axis labels that can be read."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import lazyckpt
from lazyckpt._cli.main import main


def _train_state() -> dict[str, Any]:
    params = {
        "dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)},
        "out": {"kernel": jnp.ones((8, 2)), "bias": jnp.zeros(2)},
    }
    return {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": 3}


def _save_standard(path: Path, state: dict[str, Any]) -> None:
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)


def _save_pytree(path: Path, state: dict[str, Any]) -> None:
    ocp.PyTreeCheckpointer().save(path, state)


def _line(text: str, name: str) -> str:
    """The one line of `text` whose name column is `name`."""
    found = [line for line in text.splitlines() if line.split()[:1] == [name]]
    assert len(found) == 1, (name, text)
    return found[0]


@pytest.mark.parametrize("save", [_save_standard, _save_pytree], ids=["standard", "pytree"])
def test_an_optax_train_state_shows_its_params(
    save: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ckpt"
    save(path, _train_state())
    summary = lazyckpt.summary(lazyckpt.open(path))
    text = summary.text()
    # The params are shown in full; Adam's moments name them, as structure alone.
    assert _line(text, "params/").split()[-2:] == ["232", "B"]
    assert _line(text, "mu/").endswith("4 arrays      232 B  same structure as params")
    assert _line(text, "nu/").endswith("same structure as params")
    assert " same as " not in text
    below = text.splitlines()[text.splitlines().index(_line(text, "params/")) + 1 :]
    assert [line.split()[0] for line in below[:3]] == ["dense/", "bias", "kernel"]
    html = summary._repr_html_()
    assert 'data-path="params/dense/kernel"' in html
    assert "same structure as params" in html and "same as opt_state" not in html
    assert main(["inspect", str(path)]) == 0
    printed = capsys.readouterr().out
    assert _line(printed, "params/").split()[-2:] == ["232", "B"]
    assert _line(printed, "mu/").endswith("same structure as params")


def test_the_shallowest_copy_is_shown_and_the_first_among_equals() -> None:
    """Copies at one depth: the first in the tree's order is shown, the later named."""
    block = {"a": np.zeros(2), "b": np.zeros(3), "c": np.zeros(4)}
    tree = {"deep": {"x": {"y": block}}, "p": block, "q": block}
    rows = {row.name: row.same_as for row in lazyckpt.summary(tree).rows if row.path}
    assert rows == {"deep/x/y": "p", "p": "", "a": "", "b": "", "c": "", "q": "p"}
    assert lazyckpt.summary(tree).describe()[-1] == {
        "path": "q", "same_structure_as": "p", "kind": "tree", "arrays": 3, "nbytes": 72,
    }  # fmt: skip


def test_a_tree_of_one_array_shows_its_row_and_size(tmp_path: Path) -> None:
    """A chain down to one array (`tree["params"]["w"]`, a bare array) is one row with
    its size, not an empty summary."""
    path = lazyckpt.save(tmp_path / "ckpt", {"params": {"w": np.zeros((8, 8), np.float32)}})
    weight = lazyckpt.open(path)["params"]["w"]
    assert lazyckpt.summary(weight).text() == "params/w  float32[8,8]  256 B"
    assert lazyckpt.summary(weight, depth=1).text() == "params/w  float32[8,8]  256 B"
    assert lazyckpt.summary(weight).describe()[0]["nbytes"] == 256
    assert lazyckpt.summary(np.zeros(3, np.float32)).text() == "(root)  float32[3]  12 B"
    assert 'data-path="params/w"' in lazyckpt.summary(weight)._repr_html_()


def test_stats_json_names_elements_and_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = {"w": np.arange(32, dtype=np.float32).reshape(4, 8), "b": np.ones(8, np.int8)}
    path = lazyckpt.save(tmp_path / "ckpt", tree)
    assert main(["stats", str(path), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["w"]["elements"] == 32 and found["w"]["nbytes"] == 128
    assert found["b"]["elements"] == 8 and found["b"]["nbytes"] == 8
    assert "size" not in found["w"]
    assert main(["stats", str(path)]) == 0
    table = capsys.readouterr().out
    assert _line(table, "w").split()[1:3] == ["128", "B"]  # the table's size: bytes too


_SPREADS = [
    (0.004, 0.00401, 0.00402, 0.00403, 0.00404),  # within a hundredth of each other
    (0.004, 0.0041, 0.0042, 0.0043, 0.0044),  # within a tenth
    (0.0015, 0.02, 0.04, 0.075),  # across a power of ten
    (0.001, 0.2),  # two decades and a bit
    (1e-6, 1e-3, 0.5),  # many decades
]


def test_diff_plot_tick_labels_do_not_overlap(tmp_path: Path) -> None:
    """Rendered by Agg: at every spread of relative changes, close or far apart, the x
    axis has two labels or more and none runs into the next."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rng = np.random.default_rng(0)
    before = {f"layer_{i}": rng.uniform(1, 2, (16, 8)).astype(np.float32) for i in range(5)}
    first = lazyckpt.save(tmp_path / "before", before)
    for n, scales in enumerate(_SPREADS):
        after = dict(before)
        for i, scale in enumerate(scales):
            after[f"layer_{i}"] = before[f"layer_{i}"] * np.float32(1 + scale)
        result = lazyckpt.diff(first, lazyckpt.save(tmp_path / f"after_{n}", after), values=True)
        assert len(result.changed) == len(scales)
        canvas = FigureCanvasAgg(result.plot())
        canvas.draw()
        renderer = canvas.get_renderer()
        (ax,) = canvas.figure.axes
        low, high = sorted(ax.get_xlim())
        shown = [
            (tick.label1.get_text(), tick.label1.get_window_extent(renderer))
            for tick in [*ax.xaxis.get_major_ticks(), *ax.xaxis.get_minor_ticks()]
            if low <= tick.get_loc() <= high
            and tick.label1.get_visible()
            and tick.label1.get_text()
        ]
        assert len(shown) >= 2, (scales, shown)  # an axis that can be read
        shown.sort(key=lambda item: item[1].x0)
        for (left, a), (right, b) in itertools.pairwise(shown):
            assert a.x1 <= b.x0, f"{scales}: {left!r} and {right!r} overlap ({a.x1} > {b.x0})"
