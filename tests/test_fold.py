"""Folded summaries: numbered siblings alike in structure shown once, on a model the
size of DeepSeek-V3 (its real names, shapes and dtypes; sparse data), on Gemma's
`layer_N` names saved by orbax, and on Hugging Face `h.N` names written by transformers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lazyckpt
from lazyckpt._cli.main import main
from tests.helpers import orbax_save
from tests.model_shapes import deepseek_v3

FIXTURES = Path(__file__).parent / "fixtures" / "torch"


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_v3(tmp_path_factory.mktemp("deepseek") / "DeepSeek-V3")


def _line(text: str, name: str) -> str:
    """The one line of `text` whose name column is `name`."""
    found = [line for line in text.splitlines() if line.split()[:1] == [name]]
    assert len(found) == 1, (name, found)
    return found[0]


@pytest.mark.slow
def test_deepseek_v3_summarizes_in_under_100_lines(deepseek: Path, no_data_reads: None) -> None:
    tree = lazyckpt.open(deepseek)
    summary = lazyckpt.summary(tree, title="DeepSeek-V3")
    text = summary.text()
    lines = text.splitlines()
    assert len(lines) <= 100
    assert lines[0] == "DeepSeek-V3: 91,991 arrays, 641.3 GiB"
    # The 3 dense layers, the 58 MoE layers and the multi-token-prediction layer 61.
    assert "3 x 20 arrays" in _line(text, "{0..2}/")
    assert re.search(r"58 x 1,558 arrays +621\.8 GiB$", _line(text, "{3..60}/"))
    assert "1,564 arrays" in _line(text, "61/")
    # 256 experts of 3 FP8 weights and their scales, shown once.
    assert "256 x 6 arrays" in _line(text, "experts/{0..255}/")
    assert text.count("float8_e4m3fn[7168,2048]") == 1
    # What layer 61 shares with the layers above is named, not shown again.
    layer_61 = lines[lines.index(_line(text, "61/")) :]
    assert re.search(r"^ +mlp/ +1,544 arrays +10\.5 GiB  same structure as model/layers/\{3\.\.60\}/mlp$",
                     "\n".join(layer_61), re.M)  # fmt: skip
    # The notebook shows the same rows; a folded group opens on click.
    html = summary._repr_html_()
    assert html.count("data-path=") == len(lines) - 1
    assert '<details data-path="model/layers/{3..60}">' in html
    assert "58 x 1,558 arrays" in html
    # Every leaf, as before folding: one row per subtree and leaf.
    rows = lazyckpt.summary(tree, fold=False).rows
    assert sum(not row.group for row in rows) == 91_991


@pytest.mark.slow
def test_deepseek_v3_folded_names_select_what_they_stand_for(deepseek: Path) -> None:
    tree = lazyckpt.open(deepseek)
    experts = "model/layers/{3..60}/mlp/experts/{0..255}/down_proj/weight"
    picked = dict(lazyckpt.leaves(lazyckpt.select(tree, experts)))
    assert len(picked) == 58 * 256
    assert {a.shape for a in picked.values()} == {(7168, 2048)}
    dotted = lazyckpt.select(tree, "model.layers.{0..2}.mlp.down_proj.weight")
    assert [path for path, _ in lazyckpt.leaves(dotted)] == [
        f"model/layers/{i}/mlp/down_proj/weight" for i in range(3)
    ]
    # A selection folds as the whole tree does.
    text = lazyckpt.summary(lazyckpt.select(tree, "model/layers/{3..60}/mlp/experts/**")).text()
    head = [line.split() for line in text.splitlines()[:3]]
    assert head == [
        [
            "model/layers/{3..60}/mlp/experts/{0..255}/",
            "14,848",
            "x",
            "6",
            "arrays",
            "609.1",
            "GiB",
        ],
        ["down_proj/", "2", "arrays", "14.0", "MiB"],
        ["weight", "float8_e4m3fn[7168,2048]", "14.0", "MiB"],
    ]


@pytest.mark.slow
def test_deepseek_v3_cli_inspect_folds_and_expands(
    deepseek: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(deepseek)]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 100
    assert out.splitlines()[0].endswith(": 91,991 arrays, 641.3 GiB")
    assert "58 x 1,558 arrays" in out and "256 x 6 arrays" in out
    assert main(["inspect", str(deepseek), "--expand", "--select", "model.layers.7.**"]) == 0
    expanded = capsys.readouterr().out
    assert "experts/" in expanded and "{" not in expanded
    assert expanded.count("float8_e4m3fn[7168,2048]") == 257  # 256 experts, 1 shared
    assert main(["inspect", str(deepseek), "--json"]) == 0
    leaves = json.loads(capsys.readouterr().out)["leaves"]
    assert sum(leaf["kind"] == "array" for leaf in leaves) == 91_991


def _gemma(layers: int, *, odd: int | None = None) -> dict[str, Any]:
    """Gemma's parameter names (`transformer/layer_N/attn/q_einsum/w`, ...), small."""

    def layer(i: int) -> dict[str, Any]:
        hidden = 48 if i == odd else 32
        return {
            "attn": {
                "q_einsum": {"w": np.zeros((4, 16, 8), np.float32)},
                "kv_einsum": {"w": np.zeros((2, 1, 16, 8), np.float32)},
                "attn_vec_einsum": {"w": np.zeros((4, 8, 16), np.float32)},
            },
            "mlp": {
                "gating_einsum": np.zeros((2, 16, hidden), np.float32),
                "linear": np.zeros((hidden, 16), np.float32),
            },
            "pre_attention_norm": {"scale": np.zeros(16, np.float32)},
            "pre_ffw_norm": {"scale": np.zeros(16, np.float32)},
        }

    transformer = {f"layer_{i}": layer(i) for i in range(layers)}
    transformer["embedder"] = {"input_embedding": np.zeros((64, 16), np.float32)}
    transformer["final_norm"] = {"scale": np.zeros(16, np.float32)}
    return {"transformer": transformer}


def test_gemma_layer_names_fold_and_an_odd_layer_stands_apart(tmp_path: Path) -> None:
    path = orbax_save(tmp_path / "gemma", _gemma(26, odd=7))
    text = lazyckpt.summary(lazyckpt.open(path)).text()
    assert "25 x 7 arrays" in _line(text, "layer_{0..6,8..25}/")
    assert "7 arrays" in _line(text, "layer_7/")
    assert text.count("gating_einsum") == 2  # one per group
    assert "float32[2,16,48]" in text and "float32[2,16,32]" in text
    assert len(text.splitlines()) < 30
    full = lazyckpt.summary(lazyckpt.open(path), fold=False).text()
    assert full.count("gating_einsum") == 26


def test_saved_shardings_and_dtypes_split_groups(tmp_path: Path) -> None:
    """Siblings alike in names and shapes but saved with other shardings or dtypes are
    not folded together: the fold never hides what a row shows."""
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = [P("x", "y"), P("x", "y"), P(None, "y"), P("x", "y")]
    layers = [
        {"w": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, s))} for s in spec
    ]
    layers.append({"w": jax.device_put(np.ones((8, 8), np.float16), NamedSharding(mesh, spec[0]))})
    path = orbax_save(tmp_path / "ckpt", {"layers": layers})
    text = lazyckpt.summary(lazyckpt.open(path)).text()
    assert "3 x float32[8,8]" in _line(text, "{0,1,3}/w")
    assert "P(None, 'y')" in _line(text, "2/w")
    assert "float16[8,8]" in _line(text, "4/w")


def test_transformers_h_n_names_fold_alike_in_safetensors_and_bin() -> None:
    texts = [
        lazyckpt.summary(lazyckpt.open(FIXTURES / name)).text()
        for name in ("gpt2_safetensors", "gpt2_bin")
    ]
    assert texts[0] == texts[1]
    assert "2 x 12 arrays" in _line(texts[0], "h/{0,1}/")
    assert "2 x 2 arrays" in _line(texts[0], "ln_{1,2}/")  # ln_1 and ln_2 are alike


def test_equal_subtrees_elsewhere_are_named_once() -> None:
    """Adam's moments mirror the parameters: the parameters shown (the shallowest
    copy), the moments named after them."""
    params = {"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}, "out": np.zeros(3)}
    tree = {"opt_state": {"mu": params, "nu": params}, "params": params}
    lines = str(lazyckpt.summary(tree)).splitlines()
    assert lines[1].startswith("  mu/") and lines[1].endswith("same structure as params")
    assert lines[2].startswith("  nu/") and lines[2].endswith("same structure as params")
    assert lines[3].startswith("params/") and lines[3].endswith("344 B")
    assert len(lines) == 8


def test_stats_and_diff_fold_equal_rows_by_layer_number(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tree = {f"layer_{i}": {"scale": np.ones(16, np.float32),
                           "w": rng.normal(size=(4, 4)).astype(np.float32)}
            for i in range(8)}  # fmt: skip
    path = lazyckpt.save(tmp_path / "a", tree)
    table = lazyckpt.stats(lazyckpt.open(path))
    lines = table.text().splitlines()
    assert lines[1].split()[:2] == ["layer_{0..7}/scale", "64"]
    assert sum(line.startswith("layer_") for line in lines) == 9  # the 8 w differ
    assert len(table.text(fold=False).splitlines()) == 17
    changed = {key: {**value, "scale": value["scale"] * 2} for key, value in tree.items()}
    other = lazyckpt.save(tmp_path / "b", changed)
    diff = lazyckpt.diff(path, other, values=True)
    assert diff.text().splitlines()[1:] == [
        "~ layer_{0..7}/scale  value: float32[16] -> float32[16]  max abs 1, max rel 0.5"
    ]
    assert len(diff.text(fold=False).splitlines()) == 9


def test_interleaved_layers_fold_as_steps_and_select_back() -> None:
    """Llama 4's MoE layers alternate with dense ones: two groups, every other layer."""
    dense = {"mlp": {"up": np.zeros((8, 32), np.float32), "down": np.zeros((32, 8), np.float32)}}
    moe = {"experts": {"up": np.zeros((4, 8, 16), np.float32),
                       "down": np.zeros((4, 16, 8), np.float32)},
           "router": np.zeros((8, 4), np.float32)}  # fmt: skip
    tree = {"layers": {str(i): moe if i % 2 else dense for i in range(48)}}
    text = lazyckpt.summary(tree).text()
    assert "24 x 2 arrays" in _line(text, "{0..46..2}/mlp/")
    assert "24 x 3 arrays" in _line(text, "{1..47..2}/")
    picked = lazyckpt.select(tree, "layers/{1..47..2}/router")
    assert sorted(picked["layers"], key=int) == [str(i) for i in range(1, 48, 2)]


def test_folded_names_select_exactly_what_they_stand_for() -> None:
    """Zero-padded steps, scattered numbers by the thousand, and keys with braces of
    their own (found by review): each row's name selects its leaves, no more."""
    rng = np.random.default_rng(0)
    scattered = sorted(rng.choice(100_000, 3_000, replace=False).tolist())
    tree = {
        "padded": {f"p{i:03d}": np.zeros(1) for i in range(0, 8, 2)},
        "scattered": {str(i): np.zeros(2) for i in scattered},
        "braces": {"x{1}10": np.zeros(3), "x{1}46": np.zeros(3)},
    }
    rows = lazyckpt.summary(tree).rows[1:]
    for row in rows:
        if row.group:
            continue
        picked = list(lazyckpt.leaves(lazyckpt.select(tree, "/".join(map(str, row.path)))))
        assert len(picked) == row.count, row.path
    names = [row.name for row in rows]
    assert "padded/p{000..006..2}" in names and "x{1}10" in names


def test_what_a_row_shows_tells_siblings_apart() -> None:
    """Values fold as they print (-0.0 is not 0.0), keys by type, and folded rows'
    data gives the size of every sibling they stand for."""
    text = str(lazyckpt.summary({"layer_0": 0.0, "layer_1": -0.0, "layer_2": 0.0}))
    assert text.splitlines() == ["layer_{0,2}  2 x 0.0", "layer_1      -0.0"]
    keyed = {"layer_0": {1: np.zeros(2)}, "layer_1": {True: np.zeros(2)}}
    assert len(str(lazyckpt.summary(keyed)).splitlines()) == 2
    described = lazyckpt.summary({"g": {str(i): np.zeros(4, np.float32) for i in range(3)}})
    assert described.describe() == [
        {"path": "g/{0..2}", "count": 3, "kind": "array", "shape": [4], "dtype": "float32",
         "nbytes": 48}
    ]  # fmt: skip


def test_arrays_cast_from_other_stored_dtypes_fold_apart(tmp_path: Path) -> None:
    path = lazyckpt.save(tmp_path / "c", {f"w{i}": np.ones(4, np.float16 if i else np.float32)
                                          for i in range(3)})  # fmt: skip
    opened = lazyckpt.open(path)
    cast = {key: array.astype(np.float32) for key, array in opened.items()}
    described = lazyckpt.summary(cast).describe()
    assert [row["path"] for row in described] == ["w0", "w{1,2}"]
    assert described[1]["stored_dtype"] == "float16"


def test_cli_prints_stored_strings_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Messages hide URLs' query strings; a checkpoint's own values are data, shown
    whole."""
    url = "https://wandb.ai/team/run?runId=42#chart"
    path = orbax_save(tmp_path / "ckpt", {"url": url, "w": np.zeros(2, np.float32)})
    assert main(["show", str(path), "url"]) == 0
    assert capsys.readouterr().out.strip() == url
    assert main(["inspect", str(path)]) == 0
    assert repr(url) in capsys.readouterr().out
