"""Patterns that used to fail quietly, as a user meets them: a `rename` rule that
matches nothing, rules written with the Hugging Face names `select` takes (`dotted=True`),
a subtree left out with `!pattern`, and `unstack_layers` on a tree already per layer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import lazyckpt
from lazyckpt._cli.main import main
from tests.helpers import orbax_save

optax = pytest.importorskip("optax")

LAYERS = 3


def _train_state(path: Path) -> Path:
    """An Optax Adam train state, `{"params": ..., "opt_state": ...}`, saved by Orbax."""
    rng = np.random.default_rng(0)
    params = {
        "embedding": rng.standard_normal((16, 8)).astype(np.float32),
        **{
            f"layers_{i}": {
                "attn": {"q": {"kernel": rng.standard_normal((8, 8)).astype(np.float32)}},
                "mlp": {"bias": np.full(8, i, np.float32)},
            }
            for i in range(LAYERS)
        },
    }
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
    return orbax_save(path, state)


def _hugging_face_model(path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A per-layer model in one safetensors file, with Hugging Face names."""
    rng = np.random.default_rng(1)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32)}
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((32, 8)).astype(
            np.float32
        )
        tensors[f"model.layers.{i}.input_layernorm.weight"] = np.ones(8, np.float32)
    save_file(tensors, str(path))
    return path, tensors


def _paths(tree: Any) -> list[str]:
    return [path for path, _ in lazyckpt.leaves(tree)]


def test_a_rename_rule_that_matches_nothing_is_refused_by_name(tmp_path: Path) -> None:
    tree = lazyckpt.open(_train_state(tmp_path / "state"))
    rules = [
        (r"^params/layers_(\d+)/attn/q/kernel$", r"model/layers/\1/self_attn/q_proj/weight"),
        (r"^params/embeding$", "model/embed_tokens/weight"),  # (a typo)
    ]
    with pytest.raises(lazyckpt.RenameError) as caught:
        lazyckpt.rename(tree, rules)
    message = str(caught.value)
    assert "the rule ('^params/embeding$', 'model/embed_tokens/weight') matches no" in message
    assert "after the rules before it" in message
    assert "'params/embedding'" in message  # the path it meant
    assert isinstance(caught.value, ValueError)
    # Every rule matching: renamed; a rule that only sees what an earlier one gave too.
    rules[1] = (r"^params/embedding$", "model/embed_tokens/weight")
    chained = [*rules, (r"^model/layers/", "model/h/")]
    renamed = lazyckpt.rename(lazyckpt.select(tree, "params"), chained)
    assert sorted(_paths(renamed)) == sorted(
        ["model/embed_tokens/weight"]
        + [f"params/layers_{i}/mlp/bias" for i in range(LAYERS)]
        + [f"model/h/{i}/self_attn/q_proj/weight" for i in range(LAYERS)]
    )
    # A list of rules kept for several models opts out.
    kept = lazyckpt.rename(tree, [(r"^params/", "p/"), ("^no_such/", "x/")], missing_ok=True)
    assert "p/embedding" in _paths(kept)


def test_convert_refuses_a_rename_rule_that_matches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _train_state(tmp_path / "state")
    rule = (r"^params/layers_(\d+)/atn/", r"h/\1/attn/")  # (a typo)
    with pytest.raises(lazyckpt.RenameError, match=re.escape(repr(rule))):
        lazyckpt.convert(source, tmp_path / "a", to="safetensors", select="params", rename=[rule])
    assert not (tmp_path / "a").exists()
    command = ["convert", str(source), str(tmp_path / "b"), "--to", "safetensors"]
    command += ["--select", "params", "--rename", *rule, "--quiet"]
    assert main(command) != 0
    assert "matches no key path" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    rule = (r"^params/layers_(\d+)/attn/", r"h/\1/attn/")
    out = lazyckpt.convert(
        source, tmp_path / "c", to="safetensors", select="params/**/kernel", rename=[rule]
    )
    assert sorted(load_file(str(Path(out) / "model.safetensors"))) == [
        f"h.{i}.attn.q.kernel" for i in range(LAYERS)
    ]


def test_rename_takes_the_hugging_face_names_select_takes_with_dotted(tmp_path: Path) -> None:
    path, tensors = _hugging_face_model(tmp_path / "model.safetensors")
    tree = lazyckpt.open(path)
    assert lazyckpt.select(tree, "model.layers.1.mlp.up_proj.weight")  # as select reads it
    rules = [
        (r"model\.layers\.(\d+)\.mlp\.up_proj", r"model.layers.\1.mlp.fc_in"),
        ("model.embed_tokens.weight", "model.wte.weight"),  # unescaped dots too
    ]
    renamed = lazyckpt.rename(tree, rules, dotted=True)
    layer = renamed["model"]["layers"]["1"]
    assert sorted(layer) == ["input_layernorm", "mlp"]
    np.testing.assert_array_equal(
        layer["mlp"]["fc_in"]["weight"].get(), tensors["model.layers.1.mlp.up_proj.weight"]
    )
    assert renamed["model"]["wte"]["weight"].shape == (16, 8)
    # Without dotted=True the rules see `/` paths, so the first matches nothing.
    with pytest.raises(lazyckpt.RenameError, match="matches no key path"):
        lazyckpt.rename(tree, rules)
    # The whole tree is read one way: every rule sees every path with its dots.
    whole = lazyckpt.rename(tree, [(r"\.", "_"), (r"^model_", "m.")], dotted=True)
    assert sorted(_paths(whole)) == sorted(
        "m/" + name.removeprefix("model.").replace(".", "_") for name in tensors
    )
    # A typo is named with the dotted paths it may have meant.
    with pytest.raises(lazyckpt.RenameError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'"):
        lazyckpt.rename(tree, [(r"model\.layers\.0\.mlp\.up_prj\.weight", "w")], dotted=True)
    # A key with dots of its own cannot be spelled so: refused by name, not guessed.
    flat = {"ema.decay": np.float32(0.9), "params": {"w": np.ones(2)}}
    with pytest.raises(lazyckpt.RenameError) as caught:
        lazyckpt.rename(flat, [(r"params\.w", "params.v")], dotted=True)
    assert "the key 'ema.decay'" in str(caught.value)
    assert "use dotted=False" in str(caught.value)
    assert sorted(lazyckpt.rename(flat, [(r"ema\.decay", "ema.rate")])) == ["ema.rate", "params"]


def test_rename_rules_keep_their_regular_expression_meaning() -> None:
    # `.` is regex's any-character and a key's own character: without dotted=True no
    # path is respelled and only `/` nests, whatever the rules hold.
    mixed = {"model.embed": 1, "layers": {"0": 2}}
    assert lazyckpt.rename(mixed, [(r"\.", "_")]) == {"layers": {"0": 2}, "model_embed": 1}
    suffixed = lazyckpt.rename({"dense": {"kernel": 1}}, [(r"^(.*)$", r"\1.orig")])
    assert suffixed == {"dense": {"kernel.orig": 1}}
    exported = lazyckpt.rename({"h": {"0": {"attn": 1}}}, [(r"^h.(\d+)", r"transformer.h.\1")])
    assert exported == {"transformer.h.0": {"attn": 1}}


def test_select_leaves_out_a_subtree_with_an_exclusion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _train_state(tmp_path / "state")
    tree = lazyckpt.open(source)
    params = lazyckpt.select(tree, "!opt_state/**")
    assert list(params) == ["params"]
    assert _paths(params) == _paths(lazyckpt.select(tree, "params"))
    no_bias = lazyckpt.select(tree, ["params/**", "!params/**/bias"])
    assert _paths(no_bias) == ["params/embedding"] + [
        f"params/layers_{i}/attn/q/kernel" for i in range(LAYERS)
    ]
    loaded = lazyckpt.load(tree, select="!opt_state")
    assert list(loaded) == ["params"]
    with pytest.raises(lazyckpt.NoMatchError, match=r"the exclusion '!opt_sate/\*\*' matched no"):
        lazyckpt.select(tree, "!opt_sate/**")  # a typo would keep what it meant to drop
    with pytest.raises(lazyckpt.NoMatchError, match="matched no leaf"):
        lazyckpt.select(tree, ["params/**", "!params"])
    # The command line takes the same.
    out = tmp_path / "params_only"
    command = ["convert", str(source), str(out), "--select", "!opt_state/**", "--quiet"]
    assert main(command) == 0, capsys.readouterr().err
    assert _paths(lazyckpt.open(out)) == _paths(params)
    # Hugging Face names, as select reads them.
    path, _ = _hugging_face_model(tmp_path / "model.safetensors")
    kept = lazyckpt.select(lazyckpt.open(path), "!model.layers.*.input_layernorm.weight")
    assert not any("input_layernorm" in p for p in _paths(kept))
    assert len(_paths(kept)) == 1 + LAYERS


def test_unstack_layers_refuses_a_tree_already_per_layer(tmp_path: Path) -> None:
    path, _ = _hugging_face_model(tmp_path / "model.safetensors")
    tree = lazyckpt.open(path)
    with pytest.raises(lazyckpt.LazyIndexError) as caught:
        lazyckpt.unstack_layers(tree, "model/layers")
    message = str(caught.value)
    assert "'model/layers' is already per layer" in message
    assert "model/layers/0/" in message and "stack_layers(tree, 'model/layers')" in message
    assert "at='model/layers/0'" in message
    # Scanned, it unstacks as before, back to the same per-layer names.
    scanned = lazyckpt.stack_layers(tree, "model/layers")
    again = lazyckpt.unstack_layers(scanned, "model/layers")
    assert sorted(_paths(again)) == sorted(_paths(tree))
