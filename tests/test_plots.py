"""Figures of statistics and differences (`StatsTable.plot`, `Diff.plot`), drawn by
matplotlib with the Agg backend from checkpoints written by Orbax."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from matplotlib.patches import Rectangle

import lazyckpt
from tests.helpers import orbax_save

pytest.importorskip("matplotlib")


def _layers(rng: np.random.Generator, count: int, scale: float = 1.0) -> dict[str, Any]:
    return {
        f"layer_{i}": {
            "attn": {"q": rng.standard_normal((16, 8), dtype=np.float32) * scale * (i + 1)},
            "mlp": {"w": rng.standard_normal((8, 32), dtype=np.float32) + i},
        }
        for i in range(count)
    }


@pytest.fixture
def gemma_like(tmp_path: Path) -> Path:
    """Gemma's naming: `transformer/layer_0..N/...` beside an embedder."""
    rng = np.random.default_rng(0)
    tree = {
        "transformer": {
            **_layers(rng, 12),
            "embedder": {"input_embedding": rng.standard_normal((64, 8), dtype=np.float32)},
        }
    }
    return orbax_save(tmp_path / "gemma", tree)


def _png(figure: Any, path: Path) -> bytes:
    figure.savefig(path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000
    return data


def test_layers_curve_per_family_of_numbered_siblings(gemma_like: Path, tmp_path: Path) -> None:
    table = lazyckpt.stats(lazyckpt.open(gemma_like))
    figure = table.plot()  # (no histograms: layers)
    visible = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == [
        "transformer/layer_*/attn/q",
        "transformer/layer_*/mlp/w",
    ]
    mean_line = next(line for line in visible[1].lines if line.get_label() == "mean")
    np.testing.assert_array_equal(np.asarray(mean_line.get_xdata()), np.arange(12))
    expected = np.array([table[f"transformer/layer_{i}/mlp/w"].mean for i in range(12)])
    np.testing.assert_allclose(np.asarray(mean_line.get_ydata()), expected)
    _png(figure, tmp_path / "layers.png")


def test_a_stacked_tree_plots_its_layers_once_unstacked(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    stacked = {"layers": {"w": rng.standard_normal((6, 8, 8), dtype=np.float32)}}
    path = orbax_save(tmp_path / "scanned", stacked)
    table = lazyckpt.stats(lazyckpt.unstack_layers(lazyckpt.open(path), "layers"))
    figure = table.plot("layers")
    (ax,) = [ax for ax in figure.axes if ax.get_visible()]
    line = next(line for line in ax.lines if line.get_label() == "max")
    np.testing.assert_allclose(
        np.asarray(line.get_ydata()), stacked["layers"]["w"].max(axis=(1, 2))
    )


def test_an_optimizer_states_layers_are_families_too(tmp_path: Path) -> None:
    """optax's state is a tuple (`opt/0/mu/...`): its index 0 numbers nothing; the
    layers beneath it do."""
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(1)
    params = {
        "embed": rng.standard_normal((8, 4), dtype=np.float32),
        "layers": [{"w": rng.standard_normal((4, 4), dtype=np.float32)} for _ in range(4)],
    }
    tree = {"params": params, "opt": optax.adam(1e-3).init(params)}
    table = lazyckpt.stats(lazyckpt.open(orbax_save(tmp_path / "ckpt", tree)))
    assert "opt/0/mu/layers/3/w" in table
    titles = [ax.get_title() for ax in table.plot().axes if ax.get_visible()]
    assert titles == ["opt/0/mu/layers/*/w", "opt/0/nu/layers/*/w", "params/layers/*/w"]


def test_only_ascii_numbers_of_few_digits_number_layers(tmp_path: Path) -> None:
    """`layer_\u0661` (an Arabic-Indic one) is no layer 1 (it was drawn at 1), and
    `layer_<5,000 digits>` no layer either (int() raised its raw ValueError)."""
    names = ["layer_0", "layer_2", "layer_\u0661", "layer_" + "9" * 5000]
    tree = {name: {"w": np.full(4, i, np.float32)} for i, name in enumerate(names)}
    table = lazyckpt.stats(lazyckpt.open(orbax_save(tmp_path / "ckpt", tree)))
    (ax,) = [ax for ax in table.plot("layers").axes if ax.get_visible()]
    assert ax.get_title() == "layer_*/w"
    mean = next(line for line in ax.lines if line.get_label() == "mean")
    np.testing.assert_array_equal(np.asarray(mean.get_xdata()), [0, 2])
    np.testing.assert_array_equal(np.asarray(mean.get_ydata()), [0, 1])


def test_histograms_one_panel_per_array(gemma_like: Path, tmp_path: Path) -> None:
    table = lazyckpt.stats(lazyckpt.open(gemma_like), "transformer/layer_1/**", bins=16)
    figure = table.plot()
    visible = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == list(table)
    for ax, stats in zip(visible, table.values(), strict=True):
        assert stats.histogram is not None
        (patch,) = ax.patches  # the stairs
        counts = stats.histogram[0]
        assert counts.sum() == stats.size
        top = np.asarray(patch.get_path().vertices)[:, 1].max()
        assert top == counts.max()
    _png(figure, tmp_path / "histograms.png")
    capped = lazyckpt.stats(lazyckpt.open(gemma_like), bins=4).plot(max_panels=5)
    assert sum(ax.get_visible() for ax in capped.axes) == 5
    assert "20 more arrays not shown" in capped.get_suptitle()


def test_diff_plot_ranks_the_arrays_that_changed_most(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    before = _layers(rng, 4)
    after = {layer: {k: dict(v) for k, v in parts.items()} for layer, parts in before.items()}
    for i, scale in ((0, 1e-3), (2, 1e-1), (3, 1e-5)):
        after[f"layer_{i}"]["mlp"]["w"] = before[f"layer_{i}"]["mlp"]["w"] * (1 + scale)
    first = orbax_save(tmp_path / "step_100", before)
    second = orbax_save(tmp_path / "step_200", after)
    result = lazyckpt.diff(first, second, values=True)
    figure = result.plot()
    (ax,) = figure.axes
    names = [label.get_text() for label in ax.get_yticklabels()]
    assert names == ["layer_2/mlp/w", "layer_0/mlp/w", "layer_3/mlp/w"]
    widths = [bar.get_width() for bar in ax.patches if isinstance(bar, Rectangle)]
    assert widths == sorted(widths, reverse=True)
    by_path = {c.path: c.max_rel for c in result.changed}
    assert widths[0] == pytest.approx(by_path["layer_2/mlp/w"])
    assert 0.05 < widths[0] < 0.1  # (scaled by 1.1: a difference of 0.1 over 1.1)
    _png(figure, tmp_path / "diff.png")
    with pytest.raises(lazyckpt.ArgumentError, match=r"values=True"):
        lazyckpt.diff(first, second).plot()


def test_plots_explain_what_they_need(gemma_like: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = lazyckpt.stats(lazyckpt.open(gemma_like), "transformer/embedder/**")
    with pytest.raises(lazyckpt.ArgumentError, match=r"no numbered siblings.*unstack_layers"):
        table.plot()
    with pytest.raises(lazyckpt.LazyckptError, match=r"bins=64"):
        table.plot("histograms")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(lazyckpt.MissingExtraError, match=r"lazyckpt\[notebook\]"):
        lazyckpt.stats(lazyckpt.open(gemma_like), bins=4).plot()


def test_cli_writes_the_figures(gemma_like: Path, tmp_path: Path, capsys: Any) -> None:
    from lazyckpt._cli.main import main

    layers, histograms = tmp_path / "layers.png", tmp_path / "histograms.svg"
    assert main(["stats", str(gemma_like), "--plot", str(layers)]) == 0
    data = layers.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000
    assert main(["stats", str(gemma_like), "--select", "**/layer_1/**", "--bins", "8",
                 "--plot", str(histograms)]) == 0  # fmt: skip
    assert histograms.read_text().count("<svg") == 1
    assert "transformer/layer_1/attn/q" in capsys.readouterr().out  # the table too
    missing = tmp_path / "no" / "such" / "folder" / "x.png"
    assert main(["stats", str(gemma_like), "--plot", str(missing)]) == 1
    assert f"--plot {missing}: the figure cannot be written" in capsys.readouterr().err


def test_a_diverged_array_is_drawn_apart_and_the_rest_stay_visible(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    before = _layers(rng, 3)
    after = {layer: {k: dict(v) for k, v in parts.items()} for layer, parts in before.items()}
    for i in range(3):
        after[f"layer_{i}"]["mlp"]["w"] = before[f"layer_{i}"]["mlp"]["w"] * 1.01
    after["layer_2"]["mlp"]["w"][0, 0] = np.nan  # diverged
    result = lazyckpt.diff(
        orbax_save(tmp_path / "a", before), orbax_save(tmp_path / "b", after), values=True
    )
    (ax,) = result.plot().axes
    bars = [bar for bar in ax.patches if isinstance(bar, Rectangle)]
    names = [label.get_text() for label in ax.get_yticklabels()]
    red = to_rgba("tab:red")
    assert names[0] == "layer_2/mlp/w" and bars[0].get_facecolor() == red
    assert all(bar.get_facecolor() != red for bar in bars[1:])
    low, high = ax.get_xlim()
    assert all(low < bar.get_width() < high for bar in bars)  # every bar on the axis
    assert bars[0].get_width() == pytest.approx(10 * bars[1].get_width())


# (matplotlib's own margins around a value near float64's largest; not lazyckpt's sums)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning:matplotlib")
def test_statistics_near_the_largest_float_are_drawn_and_none_is_a_gap(tmp_path: Path) -> None:
    big = np.finfo(np.float64).max  # (its sum, or its square, overflows float64)
    values = [np.zeros(4), np.full(4, big), np.full(4, np.nan)]
    tree = {f"layers_{i}": {"w": value} for i, value in enumerate(values)}
    table = lazyckpt.stats(lazyckpt.open(orbax_save(tmp_path / "c", tree)))
    assert (table["layers_1/w"].mean, table["layers_1/w"].std) == (big, 0.0)
    figure = table.plot()
    _png(figure, tmp_path / "gaps.png")  # drawn, not a crash in a tick locator
    mean = next(line for line in figure.axes[0].lines if line.get_label() == "mean")
    np.testing.assert_array_equal(np.asarray(mean.get_ydata(), float), [0.0, big, np.nan])


def test_cli_prints_the_table_before_a_figure_it_cannot_draw(
    gemma_like: Path, tmp_path: Path, capsys: Any
) -> None:
    from lazyckpt._cli.main import main

    code = main(["stats", str(gemma_like), "--select", "transformer/embedder/**", "--plot",
                 str(tmp_path / "x.png")])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1 and "transformer/embedder/input_embedding" in out
    assert "no numbered siblings" in err
    bare = tmp_path / "figure"  # (no suffix: a PNG under that very name)
    assert main(["stats", str(gemma_like), "--plot", str(bare)]) == 0
    assert bare.read_bytes().startswith(b"\x89PNG")
