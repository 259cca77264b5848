"""Figures of statistics and differences, drawn with matplotlib.

matplotlib is what notebooks show inline and what every JAX user has at hand; it is
an optional extra (`lazyckpt[notebook]`). Figures are made without pyplot, so none
lingers in pyplot's registry and a notebook shows the returned one once (as a PNG,
where nothing else shows figures yet); `savefig` writes it anywhere.

- `layers`: one panel per family of numbered siblings (`layers/0..25/mlp/kernel`,
  `layer_0..25`), each statistic against the layer's number.
- `histograms`: one panel per array whose `stats` was asked for `bins`.
- `changes`: the relative change of each array between two trees, largest first.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lazyckpt._engine.progress import in_notebook
from lazyckpt._errors import ArgumentError, MissingExtraError
from lazyckpt._text import ascii_int

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# (`Stats` and `Change` are spelled `Any` here: stats.py and diff.py import this module.)

_NUMBERED = re.compile(r"(.*?)([0-9]+)")
"""A path component that numbers a sibling: `3`, `layer_3`, `layers_3`, `h3` (ASCII
digits: `layer_\u0663` is a name, not layer 3)."""


def layer_families(keys: Sequence[str]) -> dict[str, list[tuple[int, str]]]:
    """Keys that differ only by the number in one numbered component, as
    `{pattern: [(number, key), ...]}` in order of number; families of one are left out.
    A key joins the family of its first numbered component that has siblings: an
    optimizer state's `opt/0/mu/layers/3/w` (optax's tuple index 0, alone) joins
    `opt/0/mu/layers/*/w`.

    >>> layer_families(["l/0/w", "l/1/w", "l/10/w", "l/0/b", "head"])
    {'l/*/w': [(0, 'l/0/w'), (1, 'l/1/w'), (10, 'l/10/w')]}
    >>> list(layer_families(["opt/0/mu/l/0/w", "opt/0/mu/l/1/w", "opt/0/nu/l/0/w"]))
    ['opt/0/mu/l/*/w']
    """
    candidates: dict[str, list[tuple[int, str]]] = {}  # every numbered component's
    numbered: list[tuple[str, list[tuple[str, int]]]] = []
    for key in keys:
        parts = key.split("/")
        places = []
        for i, part in enumerate(parts):
            match = _NUMBERED.fullmatch(part)
            number = ascii_int(match[2]) if match else None
            if match and number is not None:
                pattern = "/".join([*parts[:i], match[1] + "*", *parts[i + 1 :]])
                candidates.setdefault(pattern, []).append((number, key))
                places.append((pattern, number))
        numbered.append((key, places))
    families: dict[str, list[tuple[int, str]]] = {}
    for key, places in numbered:
        for pattern, number in places:
            if len(candidates[pattern]) > 1:
                families.setdefault(pattern, []).append((number, key))
                break
    return {p: sorted(members) for p, members in families.items() if len(members) > 1}


def layers(results: Mapping[str, Any], max_panels: int) -> Figure:
    """Mean, the band of one standard deviation, min and max of each family of
    numbered siblings, against the number."""
    families = layer_families(list(results))
    if not families:
        raise ArgumentError(
            "stats(...).plot('layers'): no numbered siblings among the keys "
            f"({_some(list(results))}); plot a tree with layers (`layers/0`, `layer_0`), "
            "unstack a stacked one first (lazyckpt.unstack_layers), or plot 'histograms'"
        )
    chosen = list(families.items())[:max_panels]
    figure, axes = _grid(len(chosen))
    for ax, (pattern, members) in zip(axes, chosen, strict=False):
        number = [n for n, _ in members]
        found = [results[key] for _, key in members]
        mean = [_nan(s.mean) for s in found]
        std = [_nan(s.std) for s in found]
        ax.fill_between(
            number, [m - d for m, d in zip(mean, std, strict=True)],
            [m + d for m, d in zip(mean, std, strict=True)], alpha=0.25, label="mean ± std",
        )  # fmt: skip
        ax.plot(number, mean, marker=".", label="mean")
        ax.plot(number, [_nan(s.min) for s in found], ls="--", lw=0.8, label="min")
        ax.plot(number, [_nan(s.max) for s in found], ls="--", lw=0.8, label="max")
        ax.set_title(pattern, fontsize=9)
        ax.set_xlabel("layer")
    axes[0].legend(fontsize=7)
    _left_out(figure, len(families) - len(chosen), "families")
    return figure


def histograms(results: Mapping[str, Any], max_panels: int) -> Figure:
    """Each array's histogram of finite values (`stats(..., bins=N)`)."""
    found = [(key, s.histogram) for key, s in results.items() if s.histogram is not None]
    if not found:
        raise ArgumentError(
            "stats(...).plot('histograms'): no histograms were computed; call "
            "lazyckpt.stats(tree, bins=64) (or the CLI's --bins 64) first"
        )
    chosen = found[:max_panels]
    figure, axes = _grid(len(chosen))
    for ax, (key, (counts, edges)) in zip(axes, chosen, strict=False):
        ax.stairs(counts, edges, fill=True, alpha=0.7)
        ax.set_title(key, fontsize=9)
        ax.set_ylabel("count")
    _left_out(figure, len(found) - len(chosen), "arrays")
    return figure


def changes(found: Sequence[Any], top: int) -> Figure:
    """The largest relative difference of each array whose values changed, largest
    first, on a log scale where they span two decades or more (a linear one otherwise:
    a log axis over less holds one power of ten or none, and matplotlib then labels
    its minor ticks, which run into each other); an infinite one (a NaN or Inf facing
    a number) is drawn in red past the largest finite one, and labelled."""
    ranked = sorted(
        (c for c in found if c.kind == "value" and c.max_rel is not None),
        key=lambda c: -_rank(c.max_rel),
    )
    if not ranked:
        raise ArgumentError(
            "diff(...).plot(): no arrays with values that differ; compare values with "
            "lazyckpt.diff(a, b, values=True) (the CLI's --values), or the trees are equal"
        )
    chosen = ranked[:top]
    finite = [c.max_rel for c in chosen if math.isfinite(c.max_rel) and c.max_rel > 0]
    beyond = 10 * max(finite, default=1.0)
    widths = [c.max_rel if math.isfinite(c.max_rel) else beyond for c in chosen]
    figure = _figure()
    figure.set_size_inches(8, 1.2 + 0.28 * len(chosen))
    ax = figure.subplots()
    bars = ax.barh(range(len(chosen)), widths)
    for bar, change in zip(bars, chosen, strict=True):
        if not math.isfinite(change.max_rel):
            bar.set_color("tab:red")
            ax.annotate(
                " NaN or Inf against a number", (bar.get_width(), bar.get_y() + 0.4),
                fontsize=7, va="center", ha="right", color="white",
            )  # fmt: skip
    ax.set_yticks(range(len(chosen)), [c.path for c in chosen], fontsize=8)
    ax.invert_yaxis()
    if finite and max(finite) >= _LOG_FROM * min(finite):
        _log_axis(ax)
    ax.set_xlabel("largest relative difference")
    ax.set_title(f"the {len(chosen)} arrays that changed most, of {len(ranked)}")
    figure.tight_layout()
    return figure


_LOG_FROM = 100.0
"""The ratio of largest to smallest drawn on a log axis: two decades hold two powers
of ten, which alone are labelled."""


def _log_axis(ax: Any) -> None:
    """A log x axis labelled at powers of ten only, at most 8 of them: matplotlib also
    labels minor ticks on an axis of a decade or two (`2x10^-3`, `3x10^-3`), crowded."""
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10.0, numticks=8))
    ax.xaxis.set_major_formatter(LogFormatterSciNotation(base=10.0))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _figure() -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError(
            "plots are drawn with matplotlib, which is not installed; "
            "pip install 'lazyckpt[notebook]'"
        ) from None
    shell = in_notebook()
    if shell is not None:  # (shown as a PNG, as the inline backend shows pyplot's)
        formatter = shell.display_formatter.formatters["image/png"]
        if Figure not in formatter.type_printers:
            formatter.for_type(Figure, _png)
    return Figure()


def _png(figure: Figure) -> bytes:
    out = io.BytesIO()
    figure.savefig(out, format="png", bbox_inches="tight")
    return out.getvalue()


def _grid(count: int) -> tuple[Figure, list[Any]]:
    columns = min(count, 3)
    rows = math.ceil(count / columns)
    figure = _figure()
    figure.set_size_inches(4 * columns, 3 * rows)
    axes = figure.subplots(rows, columns, squeeze=False).reshape(-1)
    for ax in axes[count:]:
        ax.set_visible(False)
    figure.set_layout_engine("constrained")
    return figure, list(axes[:count])


def _left_out(figure: Figure, count: int, what: str) -> None:
    if count > 0:
        figure.suptitle(f"{count} more {what} not shown (max_panels=)", fontsize=8)


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "") if keys else "none"


def _nan(value: float | None) -> float:
    """A statistic as drawn: none (an array without finite values), or one that is
    not finite, is a gap in the curve."""
    return math.nan if value is None or not math.isfinite(value) else value


def _rank(value: float) -> float:
    """Largest first, infinite ones (a NaN facing a number) before all."""
    return math.inf if math.isnan(value) else value
